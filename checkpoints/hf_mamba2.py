"""Convert a Hugging Face `Mamba2ForCausalLM` checkpoint directory into kvfree's native checkpoint format.

The HF directory holds `config.json` (with `model_type: "mamba2"`) and the weights as `model.safetensors`, as
sharded safetensors listed in `model.safetensors.index.json`, or as `pytorch_model.bin` (optionally sharded with
`pytorch_model.bin.index.json`). Our Mamba-2 mixer is laid out like HF's `Mamba2Mixer`, so converting is a renaming
of tensors (plus dropping the conv weight's singleton channel axis) and a translation of the config into the schema
of `engine/config.py`, written here as a plain dict because `checkpoints` must not import `engine`.

Usage::

    from kvfree.checkpoints.hf_mamba2 import convert_hf_mamba2
    convert_hf_mamba2("path/to/hf-mamba2", "path/to/kvfree-checkpoint", tokenizer_from=None)
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvfree.checkpoints.format import (
    CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    CheckpointError,
    write_checkpoint,
)

SOURCE_NAME = "hf-mamba2"

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"

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


# -- reading the HF directory ------------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many kinds (pickle, zip, weights_only refusals)
        raise CheckpointError(f"{path}: cannot load with torch.load(weights_only=True) ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise CheckpointError(f"{path}: expected a state dict of tensor names to tensors")
    # Tensors of a pickled state dict may share storage (tied weights); safetensors refuses to save shared storage.
    return {str(k): v.clone() for k, v in data.items()}


def _load_sharded(src: Path, index_name: str, load: Any) -> dict[str, torch.Tensor]:
    index_path = src / index_name
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: missing or empty 'weight_map'")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = src / str(shard)
        if not shard_path.is_file():
            raise CheckpointError(f"{index_path}: lists shard {shard!r}, which is missing from {src}")
        tensors.update(load(shard_path))
    absent = [name for name in weight_map if name not in tensors]
    if absent:
        raise CheckpointError(f"{index_path}: tensor {absent[0]!r} is not in its shard {weight_map[absent[0]]!r}")
    return tensors


def load_hf_tensors(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory, from whichever weights format it holds."""
    if (src / SAFETENSORS_FILE).is_file():
        return _load_safetensors(src / SAFETENSORS_FILE)
    if (src / SAFETENSORS_INDEX_FILE).is_file():
        return _load_sharded(src, SAFETENSORS_INDEX_FILE, _load_safetensors)
    if (src / BIN_FILE).is_file():
        return _load_bin(src / BIN_FILE)
    if (src / BIN_INDEX_FILE).is_file():
        return _load_sharded(src, BIN_INDEX_FILE, _load_bin)
    raise CheckpointError(
        f"{src}: no weights found (looked for {SAFETENSORS_FILE}, {SAFETENSORS_INDEX_FILE}, {BIN_FILE}, "
        f"{BIN_INDEX_FILE})"
    )


# -- config ------------------------------------------------------------------------------------------------------
# transformers >= 5 writes non-finite floats in config.json as {"__float__": "Infinity"} (older versions: Infinity).
_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_special_floats(obj: Any) -> Any:
    """Undo transformers' JSON encoding of non-finite floats, recursively."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[obj["__float__"]]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


def _value(hf: dict[str, Any], key: str) -> Any:
    return hf.get(key, HF_DEFAULTS.get(key))


def _positive_int(hf: dict[str, Any], key: str, where: Path) -> int:
    value = _value(hf, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{where}: key {key!r} must be a positive integer, got {value!r}")
    return value


def _positive_number(hf: dict[str, Any], key: str, where: Path) -> float:
    value = _value(hf, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise CheckpointError(f"{where}: key {key!r} must be a positive number, got {value!r}")
    return value


def _flag(hf: dict[str, Any], key: str, where: Path) -> bool:
    value = _value(hf, key)
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: key {key!r} must be true or false, got {value!r}")
    return value


def _token_id(value: Any, vocab_size: int) -> int | None:
    """An HF special-token id if it is a single int inside the vocabulary (lists and out-of-range ids are dropped)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
        return value
    return None


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
    """Translate an HF `Mamba2Config` dict into our `ModelConfig` dict (engine/config.py's schema)."""
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
        tid = _token_id(_value(hf, key), vocab_size)
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

    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for ours, (candidates, shape) in plan.items():
        hf_name = next((c for c in candidates if c in hf_tensors), None)
        if hf_name is None:
            missing.append(candidates[0])
            continue
        out[ours] = _checked(hf_tensors[hf_name], hf_name, shape, src)
        used.add(hf_name)
    # conv1d.weight is [conv_dim, 1, K] in HF (nn.Conv1d, depthwise); ours is [conv_dim, K].
    for i in range(L):
        hf_name = f"backbone.layers.{i}.mixer.conv1d.weight"
        if hf_name not in hf_tensors:
            missing.append(hf_name)
            continue
        t = hf_tensors[hf_name]
        if t.dim() == 3 and t.shape[1] == 1:
            t = t[:, 0, :]
        out[f"layers.{i}.mixer.conv.weight"] = _checked(t, hf_name, (conv_dim, K), src)
        used.add(hf_name)
    if missing:
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:6])}{', ...' if len(missing) > 6 else ''})"
        raise CheckpointError(f"{src}: missing HF tensor {missing[0]!r}" + (more if len(missing) > 1 else ""))

    ignorable = {"lm_head.weight"} if config["tie_word_embeddings"] else set()  # tied: a copy of the embedding
    unexpected = sorted(k for k in hf_tensors if k not in used and k not in ignorable)
    if unexpected:
        raise CheckpointError(
            f"{src}: unexpected HF tensor {unexpected[0]!r} ({len(unexpected)} in all) that this config's model "
            "does not use; check num_hidden_layers, use_bias and use_conv_bias in config.json"
        )
    return out


def _checked(t: torch.Tensor, hf_name: str, shape: tuple[int, ...], src: Path) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{src}: HF tensor {hf_name!r} has shape {tuple(t.shape)}, the config needs {shape}")
    if not t.is_floating_point():
        raise CheckpointError(f"{src}: HF tensor {hf_name!r} has dtype {t.dtype}, expected floating point")
    return t.contiguous()


# -- tokenizer ---------------------------------------------------------------------------------------------------
def _token_for_id(tokenizer_file: Path, tid: int | None) -> str | None:
    if tid is None:
        return None
    from tokenizers import Tokenizer  # only needed when a tokenizer_config.json must be written

    try:
        tok = Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
        raise CheckpointError(f"{tokenizer_file}: cannot load tokenizer ({e})") from None
    return tok.id_to_token(tid)


def _minimal_tokenizer_config(tokenizer_file: Path, config: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer_config.json for a tokenizer.json that came without one: special tokens only, no chat template."""
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key in ("bos", "eos", "pad"):
        token = _token_for_id(tokenizer_file, config.get(f"{key}_token_id"))
        if token is not None:
            out[f"{key}_token"] = token
    return out


def _tokenizer_dir(src: Path, tokenizer_from: Path | None, config: dict[str, Any], staging: Path) -> Path:
    """The directory to copy tokenizer.json and tokenizer_config.json from (`staging` if one had to be written)."""
    tok_dir = tokenizer_from if tokenizer_from is not None else src
    if tokenizer_from is not None and not tokenizer_from.is_dir():
        raise CheckpointError(f"{tokenizer_from}: no such tokenizer directory")
    if not (tok_dir / TOKENIZER_FILE).is_file():
        raise CheckpointError(
            f"{tok_dir}: missing {TOKENIZER_FILE}; pass a tokenizer directory holding {TOKENIZER_FILE} "
            f"(and {TOKENIZER_CONFIG_FILE}) with --tokenizer / tokenizer_from"
        )
    if (tok_dir / TOKENIZER_CONFIG_FILE).is_file():
        return tok_dir
    shutil.copyfile(tok_dir / TOKENIZER_FILE, staging / TOKENIZER_FILE)
    tok_config = _minimal_tokenizer_config(tok_dir / TOKENIZER_FILE, config)
    (staging / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tok_config, indent=2) + "\n")
    return staging


# -- entry point -------------------------------------------------------------------------------------------------
def convert_hf_mamba2(src: str | Path, dst: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """Convert the HF `Mamba2ForCausalLM` directory `src` into a native checkpoint directory `dst`.

    The tokenizer files are taken from `tokenizer_from` when given, else from `src`; a tokenizer.json without a
    tokenizer_config.json gets a minimal one (special tokens from the HF config's ids, no chat template).

    Returns `dst`. Raises CheckpointError naming the file, key or tensor when `src` cannot be converted; nothing is
    written to `dst` until every check has passed.
    """
    src, dst = Path(src), Path(dst)
    tok_src = Path(tokenizer_from) if tokenizer_from is not None else None
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such HF checkpoint directory")
    if not (src / CONFIG_FILE).is_file():
        raise CheckpointError(f"{src}: missing {CONFIG_FILE}")
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: the destination must differ from the HF source directory")
    hf_config = _read_json(src / CONFIG_FILE)
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{src / CONFIG_FILE}: expected a JSON object")
    config = convert_config(decode_special_floats(hf_config), src)
    with tempfile.TemporaryDirectory(prefix="kvfree-hf-mamba2-") as staging:
        tok_dir = _tokenizer_dir(src, tok_src, config, Path(staging))
        tensors = convert_tensors(load_hf_tensors(src), config, src)
        return write_checkpoint(dst, config, tensors, tokenizer_from=tok_dir)
