"""Convert a hybrid-model-factory (hmf) `hybrid_qwen3` checkpoint directory into kvfree's native checkpoint format.

hmf (awslabs/hybrid-model-factory) primes Qwen3 models by replacing some attention layers with recurrent ones
(published as e.g. `amazon/GKA-primed-HQwen3-8B-Instruct`). Its config.json is Qwen3's plus
`hybrid_override_pattern`, one symbol per layer separated by "-" (e.g. "*-GKA-*-GKA"), and one sub-config per layer
kind (`gka_config`, `swa_config`, ...). Every block is Qwen3's (pre-norm, SwiGLU MLP, RMSNorm); the symbols map to
kvfree mixers:

| hmf | module in the checkpoint | kvfree kind |
|---|---|---|
| `*` | `self_attn` (Qwen3 attention: GQA, q/k RMSNorm, RoPE) | `attention` (its KV cache grows with context) |
| `SWA` | `swa` (the same with `swa_config.window_size`) | `swa` |
| `GKA` | `gka` (Gated KalmaNet, `gka_config`) | `gka` with q/k/v head counts and low-rank k/v expansion |
| `M2` | `mamba` (Mamba-2 primed from attention, `mamba2_config`) | `mamba2` with B/C norms, x and B expanded |
| `BMF` | `bmojo_f` (`bmojo_attn` + `gka` or `mamba`, `bmojo_config`) | `bmojo_f` (engine/model/layers/bmojo_f.py) |
| `GDN` | `gdn` (Gated DeltaNet, `gdn_config`) | `gdn` with q/k/v head counts and low-rank k/v expansion |

hmf's training-stage layers (`GKA*`, `*DA`, ...: the attention-plus-recurrent pairs of layer-wise distillation) are
refused with an error naming the layer, as is any unknown symbol or sub-config key. docs/design/hmf.md records how
hmf's GKA and GDN map onto kvfree's (and where hmf's code, the paper and kvfree's gka.md differ).

Usage::

    kvfree convert --from hmf path/to/GKA-primed-HQwen3-8B-Instruct path/to/kvfree-checkpoint
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvfree.checkpoints import hf_common
from kvfree.checkpoints.format import CONFIG_FILE, CheckpointError
from kvfree.checkpoints.hf_common import Plan, apply_plan, refuse_missing
from kvfree.checkpoints.hf_qwen3 import (
    QWEN3_REASONING,
    _positive_int,
    attention_plan,
    base_config,
    block_plan,
    model_plan,
)

SOURCE_NAME = "hmf"
# symbol -> (kvfree kind, the block's HF module name)
LAYER_KINDS: dict[str, tuple[str, str]] = {
    "*": ("attention", "self_attn"),
    "SWA": ("swa", "swa"),
    "GKA": ("gka", "gka"),
    "M2": ("mamba2", "mamba"),
    "BMF": ("bmojo_f", "bmojo_f"),
    "GDN": ("gdn", "gdn"),
}
_TRAINING_ONLY = ("*DA", "M2*", "BMF*", "GDN*", "GKA*", "SWA*", "GDN>GKA")
# hmf's `HybridGKAConfig` fields and their defaults (hmf's layers/hybrid_dataclasses.py).
GKA_DEFAULTS: dict[str, Any] = {
    "use_alpha_connection": True, "use_v_conv": True, "use_forgetting_gate": True, "gla_rescale": True,
    "solver_type": "chebyshev", "bp_lambda": True, "num_iter": 30, "ridge_strength": 0.02, "use_gate": True,
    "conv_size": 4, "norm_eps": 1e-6, "use_forgetting_gate_kk": True, "use_beta_gate": True, "chunk_size": 64,
    "kv_proj_rank": None, "kv_learnable_residual": False,
}  # fmt: skip
# hmf's `HybridGatedDeltaNetConfig` fields and their defaults.
GDN_DEFAULTS: dict[str, Any] = {
    "use_gate": True, "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4, "conv_bias": False,
    "norm_eps": 1e-5, "kv_proj_rank": None, "kv_learnable_residual": False,
}  # fmt: skip
_GKA_FLAGS = ("use_alpha_connection", "use_v_conv", "use_forgetting_gate", "gla_rescale", "bp_lambda", "use_gate",
              "use_forgetting_gate_kk", "use_beta_gate", "kv_learnable_residual")  # fmt: skip


def layer_symbols(hf: dict[str, Any], n: int, where: Path) -> list[str]:
    """The pattern's symbol for each of the n layers (`hybrid_override_pattern`, else `layer_types`)."""
    pattern = hf.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise CheckpointError(f"{where}: hybrid_override_pattern must be a string like '*-GKA-*', got {pattern!r}")
        symbols = pattern.split("-")
    else:
        symbols = hf.get("layer_types")
        if not isinstance(symbols, list):
            raise CheckpointError(f"{where}: needs hybrid_override_pattern (e.g. '*-GKA-*-GKA'), one symbol a layer")
    if len(symbols) != n:
        raise CheckpointError(f"{where}: hybrid_override_pattern has {len(symbols)} layers, num_hidden_layers is {n}")
    for i, sym in enumerate(symbols):
        if sym in LAYER_KINDS:
            continue
        if sym in _TRAINING_ONLY:
            raise CheckpointError(
                f"{where}: layer {i} is {sym!r}, a training-stage layer of hmf's layer-wise distillation; convert "
                "the final checkpoint (its pattern holds only *, SWA, GKA, ...)"
            )
        raise CheckpointError(f"{where}: layer {i} has unknown layer type {sym!r}; known: {sorted(LAYER_KINDS)}")
    return symbols


def _check_derived(raw: dict[str, Any], derived: dict[str, Any], section: str, where: Path) -> None:
    """Remove from `raw` the keys hmf derives from the base model and saves beside the user keys (its layers recompute
    them and ignore the saved values), refusing any that disagrees with what the model's config implies."""
    for key, want in derived.items():
        if key in raw:
            got = raw.pop(key)
            if want is not None and got != want:
                raise CheckpointError(f"{where}: {section}.{key} is {got!r} but the model's shape implies {want!r}")


def _grouped_heads_config(
    raw: Any, section: str, defaults: dict[str, Any], flags: tuple[str, ...], hf: dict[str, Any],
    attention: dict[str, Any], where: Path,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """What hmf's GKA and GDN sub-configs share: the section checked (an object, its derived head shape agreeing with
    the attention it was primed from, no unknown key, `flags` booleans), merged over `defaults`; and our config's
    head shape (query heads = attention heads, key and value heads = KV heads), short-conv width and low-rank k/v
    expansion. Returns (the merged hmf section, our sub-config so far)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: {section} must be an object, got {raw!r}")
    raw = dict(raw)
    # hmf saves the derived head shape beside the user keys; they must agree with the attention it was primed from.
    Hq, Hkv = attention["num_heads"], attention["num_kv_heads"]
    _check_derived(raw, {"hidden_size": hf.get("hidden_size"), "head_dim": attention["head_dim"], "num_q_heads": Hq,
                         "num_k_heads": Hkv, "num_v_heads": Hkv}, section, where)  # fmt: skip
    unknown = sorted(set(raw) - set(defaults))
    if unknown:
        raise CheckpointError(f"{where}: unknown {section} key {unknown[0]!r} (known: {sorted(defaults)})")
    c = defaults | raw
    for key in flags:
        hf_common.flag(c, key, where)
    out = {
        "num_heads": max(Hq, Hkv), "head_dim": attention["head_dim"], "num_q_heads": Hq, "num_k_heads": Hkv,
        "num_v_heads": Hkv, "conv_kernel": hf_common.positive_int(c, "conv_size", where),
        "norm_eps": float(hf_common.positive_number(c, "norm_eps", where)), "use_gate": c["use_gate"],
    }  # fmt: skip
    # hmf applies the low-rank expansion only where some head count is expanded; elsewhere its weights go unused.
    if c["kv_proj_rank"] is not None and Hkv < out["num_heads"]:
        out["kv_proj_rank"] = hf_common.positive_int(c, "kv_proj_rank", where)
        out["kv_learnable_residual"] = c["kv_learnable_residual"]
    return c, out


def gka_config(hf: dict[str, Any], attention: dict[str, Any], where: Path) -> dict[str, Any]:
    """Our `gka` sub-config from hmf's `gka_config` (plus the vLLM plugin's `gka_overrides`) and the attention
    shape the GKA layers were primed from."""
    raw = hf.get("gka_config") or {}
    raw = raw | (hf.get("gka_overrides") or {}) if isinstance(raw, dict) else raw
    c, out = _grouped_heads_config(raw, "gka_config", GKA_DEFAULTS, _GKA_FLAGS, hf, attention, where)
    if c["solver_type"] != "chebyshev":
        raise CheckpointError(f"{where}: gka_config.solver_type is {c['solver_type']!r}; only 'chebyshev' exists")
    num_iter = c["num_iter"]
    if not isinstance(num_iter, int) or isinstance(num_iter, bool) or num_iter < 0:
        raise CheckpointError(f"{where}: gka_config.num_iter must be an integer >= 0, got {num_iter!r}")
    out |= {"chunk_size": hf_common.positive_int(c, "chunk_size", where), "num_iter": max(num_iter, 1),
            "use_solver": num_iter > 0, "ridge_strength": float(hf_common.positive_number(c, "ridge_strength", where))}
    # use_forgetting_gate_kk = false: the key covariance never decays while the state does (hmf: gk = None).
    for key in ("use_v_conv", "use_beta_gate", "use_alpha_connection", "gla_rescale", "use_forgetting_gate",
                "use_forgetting_gate_kk"):  # fmt: skip
        out[key] = c[key]
    return out


def gdn_config(hf: dict[str, Any], attention: dict[str, Any], where: Path) -> dict[str, Any]:
    """Our `gdn` sub-config from hmf's `gdn_config` and the attention shape the GDN layers were primed from (hmf's
    `_construct_from_transformer`)."""
    flags = ("use_gate", "use_short_conv", "allow_neg_eigval", "conv_bias", "kv_learnable_residual")
    c, out = _grouped_heads_config(hf.get("gdn_config") or {}, "gdn_config", GDN_DEFAULTS, flags, hf, attention, where)
    if not c["use_short_conv"]:
        raise CheckpointError(f"{where}: gdn_config.use_short_conv = false (q, k, v without their short convs) is "
                              "not supported")  # fmt: skip
    if c["conv_bias"]:
        raise CheckpointError(f"{where}: gdn_config.conv_bias = true (biased short convs) is not supported")
    return out | {"allow_neg_eigval": c["allow_neg_eigval"]}


def mamba2_config(hf: dict[str, Any], attention: dict[str, Any], where: Path) -> dict[str, Any]:
    """Our `mamba2` sub-config for hmf's Mamba-2 layer (Mamba-in-the-Llama form, primed from the attention it
    replaces): one head per query head, head and state width = head_dim, B and C of each head its own group (C from
    the queries, x and B from the KV heads, repeated to the query heads), B/C RMSNorm under `use_qk_norm`.

    kvfree's mixer takes x and B already repeated: the converter repeats their in_proj rows and conv channels
    (the conv is depthwise, so repeating before it equals hmf's repeat after it)."""
    raw = hf.get("mamba2_config") or {}
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: mamba2_config must be an object, got {raw!r}")
    raw = dict(raw)
    H, D, Hkv = attention["num_heads"], attention["head_dim"], attention["num_kv_heads"]
    _check_derived(raw, {"d_model": hf.get("hidden_size"), "d_inner": H * D, "d_xb": Hkv * D,
                         "intermediate_size": hf.get("intermediate_size"), "hidden_act": hf.get("hidden_act", "silu"),
                         "n_layer": hf.get("num_hidden_layers"), "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
                         "ssm_cfg": {"expand": 1, "ngroups": H, "d_state": D}}, "mamba2_config", where)  # fmt: skip
    unknown = sorted(set(raw) - {"use_qk_norm", "use_pos_emb"})
    if unknown:
        raise CheckpointError(f"{where}: unknown mamba2_config key {unknown[0]!r} (known: use_qk_norm, use_pos_emb)")
    c = {"use_qk_norm": True, "use_pos_emb": False} | raw
    if hf_common.flag(c, "use_pos_emb", where):
        raise CheckpointError(f"{where}: mamba2_config.use_pos_emb = true (RoPE on B and C) is not supported yet")
    return {"num_heads": H, "head_dim": D, "state_size": D, "n_groups": H, "conv_kernel": 4, "use_bias": False,
            "use_conv_bias": True, "norm_eps": 1e-5, "bc_norm": hf_common.flag(c, "use_qk_norm", where),
            "bc_norm_eps": 1e-6}  # fmt: skip


def bmojo_f_config(hf: dict[str, Any], attention: dict[str, Any], where: Path) -> dict[str, Any]:
    """Our `bmojo_f` sub-config from hmf's `bmojo_config` (window_size W, tie_attn_weights, ssm_mixer) and the
    fading layer's own sub-config (`gka_config` or `mamba2_config`)."""
    raw = hf.get("bmojo_config") or {}
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: bmojo_config must be an object, got {raw!r}")
    raw = dict(raw)
    _check_derived(raw, {"hidden_size": hf.get("hidden_size"), "num_heads": attention["num_heads"],
                         "num_key_value_heads": attention["num_kv_heads"], "head_dim": attention["head_dim"],
                         "rms_norm_eps": hf.get("rms_norm_eps", 1e-6)}, "bmojo_config", where)  # fmt: skip
    known = {"window_size": 2048, "tie_attn_weights": True, "ssm_mixer": "mamba2"}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise CheckpointError(f"{where}: unknown bmojo_config key {unknown[0]!r} (known: {sorted(known)})")
    c = known | raw
    mixer = str(c["ssm_mixer"]).lower()
    fading = {"gka": "gka", "gated_kalmanet": "gka", "mamba2": "mamba2"}.get(mixer)
    if fading is None:
        raise CheckpointError(f"{where}: bmojo_config.ssm_mixer {c['ssm_mixer']!r} is not supported (gka, mamba2)")
    sub = gka_config(hf, attention, where) if fading == "gka" else mamba2_config(hf, attention, where)
    return {"num_heads": attention["num_heads"], "num_kv_heads": attention["num_kv_heads"],
            "head_dim": attention["head_dim"], "window": hf_common.positive_int(c, "window_size", where),
            "rope_theta": attention["rope_theta"], "qk_norm_eps": attention["qk_norm_eps"],
            "tie_attn_weights": hf_common.flag(c, "tie_attn_weights", where), f"fading_{fading}": sub}  # fmt: skip


def convert_config(hf: dict[str, Any], src: Path) -> dict[str, Any]:
    """Translate an hmf `HybridQwen3Config` dict into our `ModelConfig` dict (engine/model/config.py's schema)."""
    where = src / CONFIG_FILE
    if hf.get("model_type") != "hybrid_qwen3":
        raise CheckpointError(
            f"{where}: model_type is {hf.get('model_type')!r}, expected 'hybrid_qwen3' (hmf's HybridQwen3ForCausalLM)"
        )
    config, attention = base_config(hf, where)
    symbols = layer_symbols(hf, _positive_int(hf, "num_hidden_layers", where), where)
    config["layers"] = [LAYER_KINDS[s][0] for s in symbols]
    if "*" in symbols:
        config["attention"] = attention
    if "SWA" in symbols:
        swa = hf.get("swa_config")
        if not isinstance(swa, dict) or set(swa) != {"window_size"}:
            raise CheckpointError(f"{where}: SWA layers need swa_config = {{'window_size': N}}, got {swa!r}")
        config["swa"] = attention | {"window": hf_common.positive_int(swa, "window_size", where)}
    if "GKA" in symbols:
        config["gka"] = gka_config(hf, attention, where)
    if "M2" in symbols:
        config["mamba2"] = mamba2_config(hf, attention, where)
    if "BMF" in symbols:
        config["bmojo_f"] = bmojo_f_config(hf, attention, where)
    if "GDN" in symbols:
        config["gdn"] = gdn_config(hf, attention, where)
    config["notes"] = {"converted_from": SOURCE_NAME, "source": str(src), "pattern": "-".join(symbols)}
    return config


def _grouped_heads_tensors(
    hf_tensors: dict[str, torch.Tensor], config: dict[str, Any], kind: str, g: dict[str, Any], hf: str, ours: str,
    src: Path,
) -> tuple[Plan, dict[str, torch.Tensor], set[str]]:
    """Block i's GKA or GDN (`kind`): a plan for the one-to-one tensors, and the short conv, whose three hmf
    convolutions (q, k, v: `[C, 1, K]` each) become our one conv over q|k|v `[Cq + Ck + Cv, K]`. `g` is the layer's
    sub-config, `hf` and `ours` the module prefixes. Returns (plan, tensors made, HF names used)."""
    D, He, hd, K = config["hidden_size"], g["num_heads"], g["head_dim"], g["conv_kernel"]
    dims = {"q": g["num_q_heads"] * hd, "k": g["num_k_heads"] * hd, "v": g["num_v_heads"] * hd}
    shapes = {"q_proj": (dims["q"], D), "k_proj": (dims["k"], D), "v_proj": (dims["v"], D), "a_proj": (He, D),
              "o_proj": (D, He * hd)}  # fmt: skip
    if g["use_gate"]:
        shapes["g_proj"] = (He * hd, D)
    hf_name = {"a_proj": "gk_proj"} if kind == "gdn" else {}  # hmf's GDN calls the forget gate's input gk_proj
    plan: Plan = {f"{ours}{n}.weight": ((f"{hf}{hf_name.get(n, n)}.weight",), shape) for n, shape in shapes.items()}
    if kind == "gdn":
        plan[f"{ours}b_proj.weight"] = ((f"{hf}b_proj.weight",), (He, D))  # (no bias in GDN)
    else:
        for name in ("b_proj", "alpha_proj"):
            if g["use_beta_gate" if name == "b_proj" else "use_alpha_connection"]:
                plan[f"{ours}{name}.weight"] = ((f"{hf}{name}.weight",), (He, D))
                plan[f"{ours}{name}.bias"] = ((f"{hf}{name}.bias",), (He,))
    plan[ours + "A_log"] = ((hf + "A_log",), (He,))
    plan[ours + "dt_bias"] = ((hf + "dt_bias",), (He,))
    plan[ours + "norm.weight"] = ((hf + "o_norm.weight",), (hd,))
    if "kv_proj_rank" in g:
        r = g["kv_proj_rank"]
        for x in ("k", "v"):
            plan[f"{ours}proj_{x}.linearA.weight"] = ((f"{hf}proj_{x}.linearA.weight",), (r, dims[x]))
            plan[f"{ours}proj_{x}.linearB.weight"] = ((f"{hf}proj_{x}.linearB.weight",), (He * hd, r))
            if g["kv_learnable_residual"]:
                plan[f"{ours}{x}_rep"] = ((f"{hf}{x}_rep",), (He, g[f"num_{x}_heads"]))
    convs = ("q", "k", "v") if g.get("use_v_conv", True) else ("q", "k")
    parts, used, missing = [], set(), []
    for x in convs:
        name = f"{hf}{x}_conv1d.weight"
        if name not in hf_tensors:
            missing.append(name)
            continue
        parts.append(hf_common.checked(hf_tensors[name], name, (dims[x], 1, K), src)[:, 0])
        used.add(name)
    refuse_missing(missing, src)
    return plan, {ours + "conv.weight": torch.cat(parts)}, used


def _repeat_rows(t: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Rows of `heads` heads -> each head's rows repeated `groups` times in place (head e reads head e // groups)."""
    return t.unflatten(0, (heads, -1)).repeat_interleave(groups, dim=0).flatten(0, 1)


def _mamba2_tensors(
    hf_tensors: dict[str, torch.Tensor], config: dict[str, Any], m: dict[str, Any], hf: str, ours: str, src: Path
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Block i's hmf Mamba-2 as our `mamba2` mixer: x and B (KV heads) repeated to the query heads in the input
    projection and the conv. `m` is the Mamba-2 sub-config, `hf` and `ours` the module prefixes. Returns
    (tensors, HF names used)."""
    H, D, hidden = m["num_heads"], m["head_dim"], config["hidden_size"]
    d_in = H * D
    # The KV-head count is not in our config (the mixer sees x and B repeated): read it off in_proj's rows.
    rows = hf_tensors[hf + "in_proj.weight"].shape[0] if hf + "in_proj.weight" in hf_tensors else 2 * d_in + H
    d_xb = (rows - 2 * d_in - H) // 2
    if d_xb <= 0 or d_xb % D or H % (d_xb // D):
        raise CheckpointError(f"{src}: HF tensor {hf}in_proj.weight has {rows} rows, not z, x, B, C, dt for {H} heads")
    Hkv = d_xb // D
    g = H // Hkv
    shapes = {"in_proj.weight": (2 * d_in + 2 * d_xb + H, hidden), "conv1d.weight": (2 * d_xb + d_in, 1, 4),
              "conv1d.bias": (2 * d_xb + d_in,), "dt_bias": (H,), "A_log": (H,), "D": (H,), "norm.weight": (d_in,),
              "out_proj.weight": (hidden, d_in)}  # fmt: skip
    if m["bc_norm"]:
        shapes |= {"B_norm.weight": (D,), "C_norm.weight": (D,)}
    missing = [hf + n for n in shapes if hf + n not in hf_tensors]
    refuse_missing(missing, src)
    t = {n: hf_common.checked(hf_tensors[hf + n], hf + n, shape, src) for n, shape in shapes.items()}

    def expand(rows: torch.Tensor, offset: int) -> torch.Tensor:  # [z]? x B C [dt]: x and B repeated
        head, x, B, rest = rows.split([offset, d_xb, d_xb, rows.shape[0] - offset - 2 * d_xb])
        return torch.cat([head, _repeat_rows(x, Hkv, g), _repeat_rows(B, Hkv, g), rest])

    out = {
        ours + "in_proj.weight": expand(t["in_proj.weight"], d_in),
        ours + "conv.weight": expand(t["conv1d.weight"][:, 0], 0),
        ours + "conv.bias": expand(t["conv1d.bias"], 0),
        ours + "out_proj.weight": t["out_proj.weight"],
        ours + "norm.weight": t["norm.weight"],
    }
    for name in ("dt_bias", "A_log", "D") + (("B_norm.weight", "C_norm.weight") if m["bc_norm"] else ()):
        out[ours + name] = t[name]
    return out, {hf + n for n in shapes}


def _recurrent_tensors(
    hf_tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    kind: str,
    sub: dict[str, Any],
    hf: str,
    ours: str,
    src: Path,
) -> tuple[Plan, dict[str, torch.Tensor], set[str]]:
    """A GKA, GDN or Mamba-2 layer (`kind`, sub-config `sub`) at HF prefix `hf`, ours `ours`: (plan, made, used)."""
    if kind == "mamba2":
        made, used = _mamba2_tensors(hf_tensors, config, sub, hf, ours, src)
        return {}, made, used
    plan, made, used = _grouped_heads_tensors(hf_tensors, config, kind, sub, hf, ours, src)
    if "kv_proj_rank" not in sub:  # hmf builds the low-rank expansion even where no head is expanded; never runs it
        used |= {n for n in hf_tensors if n.startswith((hf + "proj_", hf + "k_rep", hf + "v_rep"))}
    return plan, made, used


def _bmojo_f_plan(plan: Plan, config: dict[str, Any], i: int) -> None:
    """Block i's B'MOJO-F attention projections and norms (the fading path's too when untied)."""
    b, D = config["bmojo_f"], config["hidden_size"]
    Hq, Hkv, hd = b["num_heads"], b["num_kv_heads"], b["head_dim"]
    shapes = {"q_proj": (Hq * hd, D), "k_proj": (Hkv * hd, D), "v_proj": (Hkv * hd, D)}
    hf, ours = f"model.layers.{i}.bmojo_f.bmojo_attn.", f"layers.{i}.mixer."
    paths = [("", "attn.")] + ([] if b["tie_attn_weights"] else [("_", "attn_fading.")])
    for suffix, path in paths:
        for name, shape in shapes.items():
            plan[f"{ours}{path}{name}.weight"] = ((f"{hf}{name}{suffix}.weight",), shape)
        for name in ("q_norm", "k_norm"):
            plan[f"{ours}{path}{name}.weight"] = ((f"{hf}{name}{suffix}.weight",), (hd,))
    plan[ours + "o_proj.weight"] = ((hf + "o_proj.weight",), (D, Hq * hd))


def convert_tensors(hf_tensors: dict[str, torch.Tensor], config: dict[str, Any], src: Path) -> dict[str, torch.Tensor]:
    """Rename and reshape hmf's tensors into our HybridLM state dict, checking that each is there and fits."""
    plan, made, used = model_plan(config), {}, set()
    for i, kind in enumerate(config["layers"]):
        block_plan(plan, config, i)
        ours = f"layers.{i}.mixer."
        if kind in ("gka", "gdn", "mamba2"):
            hf = f"model.layers.{i}.{'mamba' if kind == 'mamba2' else kind}."
            layer = _recurrent_tensors(hf_tensors, config, kind, config[kind], hf, ours, src)
        elif kind == "bmojo_f":
            b = config["bmojo_f"]
            fading = "gka" if "fading_gka" in b else "mamba2"
            hf = f"model.layers.{i}.bmojo_f.{'gka' if fading == 'gka' else 'mamba'}."
            layer = _recurrent_tensors(hf_tensors, config, fading, b[f"fading_{fading}"], hf, ours + "ssm.", src)
            _bmojo_f_plan(plan, config, i)
        else:
            attention_plan(plan, config, config[kind], i, LAYER_KINDS["*" if kind == "attention" else "SWA"][1])
            continue
        plan |= layer[0]
        made |= layer[1]
        used |= layer[2]
    out, plan_used, missing = apply_plan(plan, hf_tensors, src)
    refuse_missing(missing, src)
    hf_common.refuse_unexpected(hf_tensors, used | plan_used, config["tie_word_embeddings"], src,
                                "check hybrid_override_pattern and the layer sub-configs in config.json")  # fmt: skip
    return out | made


def convert_hmf(src: str | Path, dst: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """Convert the hmf `hybrid_qwen3` directory `src` into a native checkpoint directory `dst`.

    The tokenizer files (tokenizer.json and tokenizer_config.json with Qwen3's chat template) come from
    `tokenizer_from` when given, else from `src`. Returns `dst`. Raises CheckpointError naming the file, key, layer
    or tensor when `src` cannot be converted; nothing is written to `dst` until every check has passed.
    """
    return hf_common.convert(src, dst, tokenizer_from, convert_config, convert_tensors, QWEN3_REASONING)
