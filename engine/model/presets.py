"""Named model sizes for `kvfree init-checkpoint`: random-initialised checkpoints with the byte-level tokenizer."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from kvfree.checkpoints.byte_tokenizer import write_byte_tokenizer
from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.loader import save_model

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


_ATTN_TINY = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
_SKA_TINY = {"num_heads": 4, "rank": 24, "head_dim": 32, "chunk_size": 64}
_MAMBA2_TINY_SSM16 = {"num_heads": 8, "head_dim": 32, "state_size": 16, "n_groups": 1, "conv_kernel": 4}


def _echo_layers(n: int, ska_at: set[int]) -> list[str]:
    return ["ska" if i in ska_at else "mamba2" for i in range(n)]


PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to ship inside the package and to test on a CPU.
    "tiny": _model(128, ["mamba2"] * 4, mamba2=_mamba2(128, 8, 32, 32)),
    "tiny-attention": _model(128, ["attention"] * 4, attention=_ATTN_TINY),
    "tiny-swa": _model(128, ["swa"] * 4, swa={**_ATTN_TINY, "window": 64}),
    "tiny-hybrid": _model(
        128,
        ["mamba2", "mamba2", "mamba2", "attention"],
        mamba2=_mamba2(128, 8, 32, 32),
        attention=_ATTN_TINY,
        mlp={"intermediate_size": 256},
    ),
    # Echo at sub-million scale (docs/design/ska.md §4.3 / §7.3): [Mamba-2, Mamba-2, SKA, SKA] with SwiGLU, or with the
    # Spectral Koopman MLP (the full Echo block).
    "tiny-ska": _model(
        128,
        ["mamba2", "mamba2", "ska", "ska"],
        mamba2=_MAMBA2_TINY_SSM16,
        ska=_SKA_TINY,
        mlp={"intermediate_size": 384},
    ),
    "tiny-echo": _model(
        128,
        ["mamba2", "mamba2", "ska", "ska"],
        mamba2=_MAMBA2_TINY_SSM16,
        ska=_SKA_TINY,
        mlp={"intermediate_size": 384, "kind": "koopman"},
    ),
    "tiny-gka": _model(
        128,
        ["gka"] * 4,
        gka={"num_heads": 4, "head_dim": 32, "chunk_size": 64, "num_iter": 30},
        mlp={"intermediate_size": 256},
    ),
    # Gated DeltaNet in hmf's grouped form (4 state heads read 2 key/value heads), as its GDN hybrids hold it.
    "tiny-gdn": _model(
        128,
        ["gdn"] * 4,
        gdn={"num_heads": 4, "head_dim": 32, "num_k_heads": 2, "num_v_heads": 2, "chunk_size": 64},
        mlp={"intermediate_size": 256},
    ),
    "tiny-lattice": _model(
        128, ["lattice"] * 4, lattice={"num_heads": 4, "head_dim": 32, "num_slots": 32}, mlp={"intermediate_size": 256}
    ),
    "tiny-bmojo": _model(
        128,
        ["bmojo"] * 4,
        bmojo={
            "num_heads": 4,
            "num_kv_heads": 4,
            "head_dim": 32,
            "ssm_num_heads": 8,
            "ssm_head_dim": 32,
            "ssm_state_size": 32,
            "window": 64,
            "fading_tokens": 1,
            "eidetic_tokens": 16,
        },
    ),
    # The shapes of state-spaces/mamba2-130m and -370m (with the byte vocabulary), and an attention baseline of
    # the same width and depth for each, for memory and speed measurements.
    "mamba2-130m": _model(768, ["mamba2"] * 24, mamba2=_mamba2(768, 24, 64, 128)),
    "mamba2-370m": _model(1024, ["mamba2"] * 48, mamba2=_mamba2(1024, 32, 64, 128)),
    "attention-130m": _model(768, ["attention"] * 24, attention={"num_heads": 12, "num_kv_heads": 12, "head_dim": 64}),
    "attention-370m": _model(1024, ["attention"] * 48, attention={"num_heads": 16, "num_kv_heads": 16, "head_dim": 64}),
    # The papers' sizes, with the byte vocabulary (so a random checkpoint of them pairs with the shipped tokenizer;
    # the papers' own vocabularies are 32K-50K, which adds only embedding rows). The Mamba-2 sizes inside Echo are
    # assumptions (docs/design/ska.md §4.6).
    "echo-50m": _model(
        448,
        _echo_layers(16, {2, 6, 10, 14}),
        mamba2=_mamba2(448, 14, 64, 64),
        ska={"num_heads": 7, "rank": 56, "head_dim": 64, "chunk_size": 64},
        mlp={"intermediate_size": 1216, "kind": "koopman"},
    ),
    "echo-180m": _model(
        768,
        _echo_layers(24, {8, 16}),
        mamba2=_mamba2(768, 24, 64, 128),
        ska={"num_heads": 12, "rank": 48, "head_dim": 64, "chunk_size": 64},
        mlp={"intermediate_size": 2048, "kind": "koopman"},
    ),
    "gka-2.8b": _model(
        2560,
        ["gka"] * 32,
        gka={"num_heads": 20, "head_dim": 128, "chunk_size": 64, "num_iter": 30},
        mlp={"intermediate_size": 6912},
    ),
    "lattice-110m": _model(
        768,
        ["lattice"] * 12,
        lattice={"num_heads": 12, "head_dim": 64, "num_slots": 64},
        mlp={"intermediate_size": 2048},
    ),
    "bmojo-1.4b": _model(
        2048,
        ["bmojo"] * 32,
        bmojo={
            "num_heads": 16,
            "num_kv_heads": 16,
            "head_dim": 128,
            "ssm_num_heads": 64,
            "ssm_head_dim": 64,
            "ssm_state_size": 128,
            "window": 512,
            "fading_tokens": 1,
            "eidetic_tokens": 64,
        },
    ),
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
