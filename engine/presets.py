"""Named model sizes for `kvfree init-checkpoint`: random-initialised checkpoints with the byte-level tokenizer."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from checkpoints.byte_tokenizer import write_byte_tokenizer
from engine.config import ModelConfig
from engine.loader import save_model
from engine.model import HybridLM

BYTE_VOCAB = 261  # 256 bytes + 5 special tokens (checkpoints/byte_tokenizer.py)
EOS_ID = 256


def _mamba2(hidden: int, heads: int, head_dim: int, state: int) -> dict[str, Any]:
    return {"num_heads": heads, "head_dim": head_dim, "state_size": state, "n_groups": 1, "conv_kernel": 4}


def _model(hidden: int, layers: list[str], **sub: Any) -> dict[str, Any]:
    return {
        "vocab_size": BYTE_VOCAB,
        "hidden_size": hidden,
        "layers": layers,
        "tie_word_embeddings": True,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        **sub,
    }


PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to ship inside the package and to test on a CPU.
    "tiny": _model(128, ["mamba2"] * 4, mamba2=_mamba2(128, 8, 32, 32)),
    "tiny-attention": _model(128, ["attention"] * 4, attention={"num_heads": 4, "num_kv_heads": 2, "head_dim": 32}),
    "tiny-swa": _model(128, ["swa"] * 4, swa={"num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "window": 64}),
    "tiny-hybrid": _model(
        128,
        ["mamba2", "mamba2", "mamba2", "attention"],
        mamba2=_mamba2(128, 8, 32, 32),
        attention={"num_heads": 4, "num_kv_heads": 2, "head_dim": 32},
        mlp={"intermediate_size": 256},
    ),
    # The shapes of state-spaces/mamba2-130m and -370m (with the byte vocabulary), and an attention baseline of
    # the same width and depth, for memory and speed measurements.
    "mamba2-130m": _model(768, ["mamba2"] * 24, mamba2=_mamba2(768, 24, 64, 128)),
    "mamba2-370m": _model(1024, ["mamba2"] * 48, mamba2=_mamba2(1024, 32, 64, 128)),
    "attention-130m": _model(768, ["attention"] * 24, attention={"num_heads": 12, "num_kv_heads": 12, "head_dim": 64}),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[name])


def init_checkpoint(preset: str, path: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write a random-initialised checkpoint of `preset` (with the byte-level tokenizer) to directory `path`."""
    model = HybridLM(preset_config(preset))
    model.init_weights(seed)
    model.to(dtype)
    with tempfile.TemporaryDirectory() as tok_dir:
        write_byte_tokenizer(tok_dir)
        return save_model(model, path, tokenizer_from=tok_dir)
