"""Convert a Hugging Face `Mamba2ForCausalLM` checkpoint directory into kvfree's native checkpoint format.

The HF directory holds `config.json` (with `model_type: "mamba2"`) and the weights as `model.safetensors`, as
sharded safetensors listed in `model.safetensors.index.json`, or as `pytorch_model.bin` (optionally sharded with
`pytorch_model.bin.index.json`). Our Mamba-2 mixer is laid out like HF's `Mamba2Mixer`, so converting is a renaming
of tensors (plus dropping the conv weight's singleton channel axis) and a translation of the config into the schema
of `engine/model/config.py`, written here as a plain dict because `checkpoints` must not import `engine`.

Usage::

    from kvfree.checkpoints.hf_mamba2 import convert_hf_mamba2
    convert_hf_mamba2("path/to/hf-mamba2", "path/to/kvfree-checkpoint", tokenizer_from=None)
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch

from kvfree.checkpoints import hf_common
from kvfree.checkpoints.format import CONFIG_FILE, CheckpointError
from kvfree.checkpoints.hf_common import apply_plan, checked, refuse_missing, token_id

SOURCE_NAME = "hf-mamba2"

# Our mixer's largest useful chunk: the reference SSD materialises [H, L, L] decay masks per chunk.
MAX_CHUNK_SIZE = 256
# JSON has no infinity; an unbounded dt maximum is written as this (softplus output never gets near it).
LARGE_DT_MAX = 1e30

# HF `Mamba2Config` defaults (transformers 5.x), used for keys a config.json leaves out, as HF itself does.
HF_DEFAULTS: dict[str, Any] = {
    "num_heads": 128,
    "head_dim": 64,
    "vocab_size": 32768,
    "hidden_size": 4096,
    "state_size": 128,
    "num_hidden_layers": 64,
    "layer_norm_epsilon": 1e-5,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "expand": 2,
    "conv_kernel": 4,
    "n_groups": 8,
    "use_bias": False,
    "use_conv_bias": True,
    "hidden_act": "silu",
    "time_step_limit": [0.0, math.inf],
    "chunk_size": 256,
    "tie_word_embeddings": False,
}

# Mixer tensors that are renamed one to one (HF `backbone.layers.{i}.mixer.X` -> our `layers.{i}.mixer.X`).
_MIXER_PARAMS = ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight", "in_proj.weight")


# -- config ------------------------------------------------------------------------------------------------------
def _value(hf: dict[str, Any], key: str) -> Any:
    return hf.get(key, HF_DEFAULTS.get(key))


# The shared value checks, reading HF's Mamba2Config defaults for keys config.json leaves out.
_positive_int = functools.partial(hf_common.positive_int, defaults=HF_DEFAULTS)
_positive_number = functools.partial(hf_common.positive_number, defaults=HF_DEFAULTS)
_flag = functools.partial(hf_common.flag, defaults=HF_DEFAULTS)


def _time_step_limit(hf: dict[str, Any], where: Path) -> list[float] | None:
    limit = _value(hf, "time_step_limit")
    if limit is None:
        return None
    if not isinstance(limit, list | tuple) or len(limit) != 2:
        raise CheckpointError(f"{where}: key 'time_step_limit' must be [min, max], got {limit!r}")
    try:
        lo, hi = float(limit[0]), float(limit[1])
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: key 'time_step_limit' must hold two numbers, got {limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi or math.isinf(lo):
        raise CheckpointError(f"{where}: key 'time_step_limit' is not a valid [min, max] range: {limit!r}")
    if lo == 0.0 and math.isinf(hi):
        return None  # HF's default (0, inf): no clamp
    return [lo, LARGE_DT_MAX if math.isinf(hi) else hi]


def convert_config(hf: dict[str, Any], src: Path) -> dict[str, Any]:
    """Translate an HF `Mamba2Config` dict into our `ModelConfig` dict (engine/model/config.py's schema)."""
    where = src / CONFIG_FILE
    model_type = hf.get("model_type")
    if model_type != "mamba2":
        raise CheckpointError(f"{where}: model_type is {model_type!r}, expected 'mamba2' (a Mamba2ForCausalLM)")
    hidden_act = _value(hf, "hidden_act")
    if hidden_act != "silu":
        raise CheckpointError(f"{where}: hidden_act is {hidden_act!r}; only 'silu' is supported")

    vocab_size = _positive_int(hf, "vocab_size", where)
    hidden_size = _positive_int(hf, "hidden_size", where)
    num_layers = _positive_int(hf, "num_hidden_layers", where)
    num_heads = _positive_int(hf, "num_heads", where)
    head_dim = _positive_int(hf, "head_dim", where)
    state_size = _positive_int(hf, "state_size", where)
    n_groups = _positive_int(hf, "n_groups", where)
    conv_kernel = _positive_int(hf, "conv_kernel", where)
    chunk_size = _positive_int(hf, "chunk_size", where)
    expand = _positive_number(hf, "expand", where)
    eps = float(_positive_number(hf, "layer_norm_epsilon", where))
    use_bias = _flag(hf, "use_bias", where)
    use_conv_bias = _flag(hf, "use_conv_bias", where)
    tie = _flag(hf, "tie_word_embeddings", where)

    if expand * hidden_size != num_heads * head_dim:
        raise CheckpointError(
            f"{where}: expand * hidden_size ({expand} * {hidden_size} = {expand * hidden_size}) must equal "
            f"num_heads * head_dim ({num_heads} * {head_dim} = {num_heads * head_dim})"
        )
    if num_heads % n_groups:
        raise CheckpointError(f"{where}: n_groups ({n_groups}) must divide num_heads ({num_heads})")

    mamba2: dict[str, Any] = {
        "num_heads": num_heads,
        "head_dim": head_dim,
        "state_size": state_size,
        "n_groups": n_groups,
        "conv_kernel": conv_kernel,
        "chunk_size": min(chunk_size, MAX_CHUNK_SIZE),
        "use_bias": use_bias,
        "use_conv_bias": use_conv_bias,
    }
    limit = _time_step_limit(hf, where)
    if limit is not None:
        mamba2["time_step_limit"] = limit
    mamba2["norm_eps"] = eps

    config: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "layers": ["mamba2"] * num_layers,
        "norm_eps": eps,
        "tie_word_embeddings": tie,
        "mamba2": mamba2,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tid = token_id(_value(hf, key), vocab_size)
        if tid is not None:
            config[key] = tid
    config["notes"] = {"converted_from": SOURCE_NAME, "source": str(src)}
    return config


# -- tensors -----------------------------------------------------------------------------------------------------
def convert_tensors(hf_tensors: dict[str, torch.Tensor], config: dict[str, Any], src: Path) -> dict[str, torch.Tensor]:
    """Rename (and reshape) HF tensors to our HybridLM state-dict names, checking that each is there and fits."""
    m = config["mamba2"]
    D, V, L = config["hidden_size"], config["vocab_size"], len(config["layers"])
    H, P, N, G, K = m["num_heads"], m["head_dim"], m["state_size"], m["n_groups"], m["conv_kernel"]
    inner = H * P
    conv_dim = inner + 2 * G * N

    # our name -> (HF names tried in order, expected shape)
    plan: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
        "embed.weight": (("backbone.embeddings.weight", "backbone.embedding.weight"), (V, D)),
        "norm.weight": (("backbone.norm_f.weight",), (D,)),
    }
    if not config["tie_word_embeddings"]:
        plan["lm_head.weight"] = (("lm_head.weight",), (V, D))
    shapes = {
        "in_proj.weight": (inner + conv_dim + H, D),
        "in_proj.bias": (inner + conv_dim + H,),
        "conv.bias": (conv_dim,),
        "dt_bias": (H,),
        "A_log": (H,),
        "D": (H,),
        "norm.weight": (inner,),
        "out_proj.weight": (D, inner),
        "out_proj.bias": (D,),
    }
    for i in range(L):
        hf_prefix, prefix = f"backbone.layers.{i}.", f"layers.{i}."
        plan[prefix + "norm.weight"] = ((hf_prefix + "norm.weight",), (D,))
        names = list(_MIXER_PARAMS)
        if m["use_bias"]:
            names += ["in_proj.bias", "out_proj.bias"]
        for name in names:
            plan[f"{prefix}mixer.{name}"] = ((f"{hf_prefix}mixer.{name}",), shapes[name])
        if m["use_conv_bias"]:
            plan[prefix + "mixer.conv.bias"] = ((hf_prefix + "mixer.conv1d.bias",), shapes["conv.bias"])

    out, used, missing = apply_plan(plan, hf_tensors, src)
    # conv1d.weight is [conv_dim, 1, K] in HF (nn.Conv1d, depthwise); ours is [conv_dim, K].
    for i in range(L):
        hf_name = f"backbone.layers.{i}.mixer.conv1d.weight"
        if hf_name not in hf_tensors:
            missing.append(hf_name)
            continue
        t = hf_tensors[hf_name]
        if t.dim() == 3 and t.shape[1] == 1:
            t = t[:, 0, :]
        out[f"layers.{i}.mixer.conv.weight"] = checked(t, hf_name, (conv_dim, K), src)
        used.add(hf_name)
    refuse_missing(missing, src)
    hf_common.refuse_unexpected(hf_tensors, used, config["tie_word_embeddings"], src,
                                "check num_hidden_layers, use_bias and use_conv_bias in config.json")  # fmt: skip
    return out


# -- entry point -------------------------------------------------------------------------------------------------
def convert_hf_mamba2(src: str | Path, dst: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """Convert the HF `Mamba2ForCausalLM` directory `src` into a native checkpoint directory `dst`.

    The tokenizer files are taken from `tokenizer_from` when given, else from `src`; a tokenizer.json without a
    tokenizer_config.json gets a minimal one (special tokens from the HF config's ids, no chat template).

    Returns `dst`. Raises CheckpointError naming the file, key or tensor when `src` cannot be converted; nothing is
    written to `dst` until every check has passed.
    """
    return hf_common.convert(src, dst, tokenizer_from, convert_config, convert_tensors)
