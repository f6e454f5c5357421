"""Convert a Hugging Face `Qwen3ForCausalLM` checkpoint directory into kvfree's native checkpoint format.

Qwen3 is a pre-norm decoder of attention blocks: grouped-query attention with an RMSNorm on every query and key head
before RoPE (kvfree's `attention` mixer with `qk_norm`), a SwiGLU MLP, RMSNorm everywhere with one epsilon. Layers
whose `layer_types` entry is "sliding_attention" become kvfree's `swa` kind with the config's `sliding_window`. The
tensor names map one to one (`model.layers.{i}.self_attn.X` -> `layers.{i}.mixer.X`, `post_attention_layernorm` ->
`mlp_norm`). This is the attention half of hybrid-model-factory's primed hybrids (`hybrid_qwen3`). The config is
written as a plain dict because `checkpoints` must not import `engine`.

RoPE variants other than the default (`rope_scaling` / `rope_parameters` of type yarn, linear, dynamic, ...) are
refused with an error naming them: the attention kernels implement plain RoPE only.

Usage::

    from kvfree.checkpoints.hf_qwen3 import convert_hf_qwen3
    convert_hf_qwen3("path/to/Qwen3-0.6B", "path/to/kvfree-checkpoint")
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from kvfree.checkpoints import hf_common
from kvfree.checkpoints.format import CONFIG_FILE, CheckpointError
from kvfree.checkpoints.hf_common import Plan, apply_plan, refuse_missing, token_id

SOURCE_NAME = "hf-qwen3"
# Qwen3's thinking tags: declared in the converted tokenizer_config when the tokenizer has them (reasoning_content).
QWEN3_REASONING = ("<think>", "</think>")
# HF `Qwen3Config` defaults (transformers 5.x) for keys a config.json leaves out, as HF itself does.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
}
_positive_int = functools.partial(hf_common.positive_int, defaults=HF_DEFAULTS)
_positive_number = functools.partial(hf_common.positive_number, defaults=HF_DEFAULTS)
_flag = functools.partial(hf_common.flag, defaults=HF_DEFAULTS)
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _rope_theta(hf: dict[str, Any], where: Path) -> float:
    """The RoPE base, from `rope_theta` or transformers 5's `rope_parameters`; other RoPE types are refused."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: rope_parameters must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"{where}: RoPE type {kind!r} is not supported (kvfree implements plain RoPE)")
    theta = params.get("rope_theta", hf.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    return float(_positive_number({"rope_theta": theta}, "rope_theta", where))


def _layer_kinds(hf: dict[str, Any], n: int, where: Path) -> list[str]:
    """kvfree kinds per layer: "attention", or "swa" where `layer_types` says "sliding_attention"."""
    types = hf.get("layer_types")
    if types is None:
        return ["attention"] * n
    if not isinstance(types, list) or len(types) != n:
        raise CheckpointError(f"{where}: layer_types must list {n} layer types, got {types!r}")
    kinds = {"full_attention": "attention", "sliding_attention": "swa"}
    unknown = sorted({t for t in types if t not in kinds}, key=str)
    if unknown:
        raise CheckpointError(f"{where}: unknown layer type {unknown[0]!r} in layer_types (known: {sorted(kinds)})")
    return [kinds[t] for t in types]


def base_config(hf: dict[str, Any], where: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parts of our config that every Qwen3-based model shares, from an HF config dict: (the model-wide config
    without `layers`, the attention sub-config). Also used by hybrid-model-factory's Qwen3 hybrids (hf_hmf)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act is {hf['hidden_act']!r}; only 'silu' is supported")
    vocab = _positive_int(hf, "vocab_size", where)
    hidden = _positive_int(hf, "hidden_size", where)
    heads = _positive_int(hf, "num_attention_heads", where)
    kv_heads = _positive_int(hf, "num_key_value_heads", where)
    head_dim = _positive_int({"head_dim": hf.get("head_dim") or hidden // heads}, "head_dim", where)
    eps = float(_positive_number(hf, "rms_norm_eps", where))
    if heads % kv_heads:
        raise CheckpointError(f"{where}: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
    attention = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
                 "rope_theta": _rope_theta(hf, where), "use_bias": _flag(hf, "attention_bias", where),
                 "qk_norm": True, "qk_norm_eps": eps}  # fmt: skip
    config: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "norm_eps": eps,
        "tie_word_embeddings": _flag(hf, "tie_word_embeddings", where),
        "mlp": {"intermediate_size": _positive_int(hf, "intermediate_size", where)},
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tid = token_id(hf.get(key), vocab)
        if tid is not None:
            config[key] = tid
    return config, attention


def convert_config(hf: dict[str, Any], src: Path) -> dict[str, Any]:
    """Translate an HF `Qwen3Config` dict into our `ModelConfig` dict (engine/model/config.py's schema)."""
    where = src / CONFIG_FILE
    if hf.get("model_type") != "qwen3":
        raise CheckpointError(f"{where}: model_type is {hf.get('model_type')!r}, expected 'qwen3' (Qwen3ForCausalLM)")
    config, attention = base_config(hf, where)
    kinds = _layer_kinds(hf, _positive_int(hf, "num_hidden_layers", where), where)
    config["layers"] = kinds
    if "attention" in kinds:
        config["attention"] = attention
    if "swa" in kinds:
        config["swa"] = attention | {"window": _positive_int(hf, "sliding_window", where)}
    config["notes"] = {"converted_from": SOURCE_NAME, "source": str(src)}
    return config


def model_plan(config: dict[str, Any]) -> Plan:
    """The tensors outside the blocks: embedding, final norm and (untied) LM head."""
    D, V = config["hidden_size"], config["vocab_size"]
    plan: Plan = {"embed.weight": (("model.embed_tokens.weight",), (V, D)),
                  "norm.weight": (("model.norm.weight",), (D,))}  # fmt: skip
    if not config["tie_word_embeddings"]:
        plan["lm_head.weight"] = (("lm_head.weight",), (V, D))
    return plan


def block_plan(plan: Plan, config: dict[str, Any], i: int) -> None:
    """Add block i's two norms and SwiGLU MLP to `plan`."""
    D, inter = config["hidden_size"], config["mlp"]["intermediate_size"]
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    plan[ours + "norm.weight"] = ((hf + "input_layernorm.weight",), (D,))
    plan[ours + "mlp_norm.weight"] = ((hf + "post_attention_layernorm.weight",), (D,))
    shapes = {"gate_proj": (inter, D), "up_proj": (inter, D), "down_proj": (D, inter)}
    for name in _MLP:
        plan[f"{ours}mlp.{name}.weight"] = ((f"{hf}mlp.{name}.weight",), shapes[name])


def attention_plan(plan: Plan, config: dict[str, Any], a: dict[str, Any], i: int, hf_module: str) -> None:
    """Add block i's attention (sub-config `a`, HF module `model.layers.{i}.{hf_module}`) to `plan`."""
    D, Hq, Hkv, hd = config["hidden_size"], a["num_heads"], a["num_kv_heads"], a["head_dim"]
    shapes = {"q_proj": (Hq * hd, D), "k_proj": (Hkv * hd, D), "v_proj": (Hkv * hd, D), "o_proj": (D, Hq * hd)}
    hf, ours = f"model.layers.{i}.{hf_module}.", f"layers.{i}.mixer."
    for name in _ATTN:
        plan[f"{ours}{name}.weight"] = ((f"{hf}{name}.weight",), shapes[name])
        if a["use_bias"]:
            plan[f"{ours}{name}.bias"] = ((f"{hf}{name}.bias",), shapes[name][:1])
    for name in ("q_norm", "k_norm"):
        plan[f"{ours}{name}.weight"] = ((f"{hf}{name}.weight",), (hd,))


def convert_tensors(hf_tensors: dict[str, torch.Tensor], config: dict[str, Any], src: Path) -> dict[str, torch.Tensor]:
    """Rename HF tensors to our HybridLM state-dict names, checking that each is there and fits."""
    plan = model_plan(config)
    for i, kind in enumerate(config["layers"]):
        block_plan(plan, config, i)
        attention_plan(plan, config, config[kind], i, "self_attn")
    out, used, missing = apply_plan(plan, hf_tensors, src)
    refuse_missing(missing, src)
    hf_common.refuse_unexpected(hf_tensors, used, config["tie_word_embeddings"], src,
                                "check num_hidden_layers and attention_bias in config.json")  # fmt: skip
    return out


def convert_hf_qwen3(src: str | Path, dst: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """Convert the HF `Qwen3ForCausalLM` directory `src` into a native checkpoint directory `dst`.

    The tokenizer files (tokenizer.json and tokenizer_config.json with Qwen3's chat template) come from
    `tokenizer_from` when given, else from `src`. Returns `dst`. Raises CheckpointError naming the file, key or tensor
    when `src` cannot be converted; nothing is written to `dst` until every check has passed.
    """
    return hf_common.convert(src, dst, tokenizer_from, convert_config, convert_tensors, QWEN3_REASONING)
