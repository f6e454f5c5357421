"""What the Hugging Face checkpoint converters share: reading an HF directory's config and weights, checking values
and tensors, mapping tensor names, and the tokenizer files to copy.

`hf_mamba2` (Mamba2ForCausalLM) and `hf_qwen3` (Qwen3ForCausalLM) are built on it. Every failure is a CheckpointError
naming the file, key or tensor.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Callable
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

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"


# -- reading the HF directory ------------------------------------------------------------------------------------
def read_json(path: Path) -> Any:
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
    index = read_json(index_path)
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


def read_config(src: Path) -> dict[str, Any]:
    """The HF directory's config.json as a dict (non-finite floats decoded); checks the directory and file exist."""
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such HF checkpoint directory")
    if not (src / CONFIG_FILE).is_file():
        raise CheckpointError(f"{src}: missing {CONFIG_FILE}")
    hf = read_json(src / CONFIG_FILE)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{src / CONFIG_FILE}: expected a JSON object")
    return decode_special_floats(hf)


# -- config values -----------------------------------------------------------------------------------------------
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


def positive_int(hf: dict[str, Any], key: str, where: Path, defaults: dict[str, Any] | None = None) -> int:
    """hf[key] (or its default), checked to be a positive integer."""
    value = hf.get(key, (defaults or {}).get(key))
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{where}: key {key!r} must be a positive integer, got {value!r}")
    return value


def positive_number(hf: dict[str, Any], key: str, where: Path, defaults: dict[str, Any] | None = None) -> float:
    """hf[key] (or its default), checked to be a finite positive number."""
    value = hf.get(key, (defaults or {}).get(key))
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise CheckpointError(f"{where}: key {key!r} must be a positive number, got {value!r}")
    return value


def flag(hf: dict[str, Any], key: str, where: Path, defaults: dict[str, Any] | None = None) -> bool:
    """hf[key] (or its default), checked to be a boolean."""
    value = hf.get(key, (defaults or {}).get(key))
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: key {key!r} must be true or false, got {value!r}")
    return value


def token_id(value: Any, vocab_size: int) -> int | None:
    """An HF special-token id if it is a single int inside the vocabulary (lists and out-of-range ids are dropped)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
        return value
    return None


# -- tensors -----------------------------------------------------------------------------------------------------
Plan = dict[str, tuple[tuple[str, ...], tuple[int, ...]]]  # our name -> (HF names tried in order, expected shape)


def apply_plan(
    plan: Plan, hf_tensors: dict[str, torch.Tensor], src: Path
) -> tuple[dict[str, torch.Tensor], set[str], list[str]]:
    """Take each planned tensor from the first HF name present, checked (`checked`). Returns (our tensors, the HF
    names used, the HF names missing)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for ours, (candidates, shape) in plan.items():
        hf_name = next((c for c in candidates if c in hf_tensors), None)
        if hf_name is None:
            missing.append(candidates[0])
            continue
        out[ours] = checked(hf_tensors[hf_name], hf_name, shape, src)
        used.add(hf_name)
    return out, used, missing


def refuse_missing(missing: list[str], src: Path) -> None:
    """Raise naming the first missing HF tensor (and a few more), if any is missing."""
    if missing:
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:6])}{', ...' if len(missing) > 6 else ''})"
        raise CheckpointError(f"{src}: missing HF tensor {missing[0]!r}" + (more if len(missing) > 1 else ""))


def refuse_unexpected(hf_tensors: dict[str, torch.Tensor], used: set[str], tied: bool, src: Path,
                      hint: str) -> None:  # fmt: skip
    """Raise naming the first HF tensor that the converted model would not use (`hint` says which keys to check).
    With tied embeddings an `lm_head.weight` is allowed: it is a copy of the embedding."""
    ignorable = {"lm_head.weight"} if tied else set()
    unexpected = sorted(k for k in hf_tensors if k not in used and k not in ignorable)
    if unexpected:
        raise CheckpointError(
            f"{src}: unexpected HF tensor {unexpected[0]!r} ({len(unexpected)} in all) that this config's model "
            f"does not use; {hint}"
        )


def checked(t: torch.Tensor, hf_name: str, shape: tuple[int, ...], src: Path) -> torch.Tensor:
    """An HF tensor checked to have `shape` and a floating dtype, made contiguous."""
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{src}: HF tensor {hf_name!r} has shape {tuple(t.shape)}, the config needs {shape}")
    if not t.is_floating_point():
        raise CheckpointError(f"{src}: HF tensor {hf_name!r} has dtype {t.dtype}, expected floating point")
    return t.contiguous()


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


def _has_tokens(tokenizer_file: Path, tokens: tuple[str, ...]) -> bool:
    """Whether every one of `tokens` is a single token of tokenizer.json (an added token or a vocabulary entry)."""
    data = read_json(tokenizer_file)
    added = {t.get("content") for t in data.get("added_tokens") or [] if isinstance(t, dict)}
    vocab = (data.get("model") or {}).get("vocab") or {}
    return all(t in added or (isinstance(vocab, dict) and t in vocab) for t in tokens)


def tokenizer_dir(
    src: Path, tokenizer_from: Path | None, config: dict[str, Any], staging: Path,
    reasoning: tuple[str, str] | None = None,
) -> Path:  # fmt: skip
    """The directory to copy tokenizer.json and tokenizer_config.json from (`staging` if one had to be written).

    `reasoning`: the (start, end) tags of the model family's thinking (Qwen3's `<think>`, `</think>`). When both are
    tokens of the tokenizer and its config declares no tags, the written config declares them (`reasoning_start`,
    `reasoning_end`: the server then returns the thinking as `reasoning_content`)."""
    tok_dir = tokenizer_from if tokenizer_from is not None else src
    if tokenizer_from is not None and not tokenizer_from.is_dir():
        raise CheckpointError(f"{tokenizer_from}: no such tokenizer directory")
    if not (tok_dir / TOKENIZER_FILE).is_file():
        raise CheckpointError(
            f"{tok_dir}: missing {TOKENIZER_FILE}; pass a tokenizer directory holding {TOKENIZER_FILE} "
            f"(and {TOKENIZER_CONFIG_FILE}) with --tokenizer / tokenizer_from"
        )
    if (tok_dir / TOKENIZER_CONFIG_FILE).is_file():
        tok_config = read_json(tok_dir / TOKENIZER_CONFIG_FILE)
    else:
        tok_config = _minimal_tokenizer_config(tok_dir / TOKENIZER_FILE, config)
    declares = isinstance(tok_config, dict) and "reasoning_start" in tok_config
    if (
        reasoning is not None
        and isinstance(tok_config, dict)
        and not declares
        and _has_tokens(tok_dir / TOKENIZER_FILE, reasoning)
    ):
        tok_config = tok_config | {"reasoning_start": reasoning[0], "reasoning_end": reasoning[1]}
    elif (tok_dir / TOKENIZER_CONFIG_FILE).is_file():
        return tok_dir
    shutil.copyfile(tok_dir / TOKENIZER_FILE, staging / TOKENIZER_FILE)
    (staging / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tok_config, indent=2) + "\n")
    return staging


# -- the conversion ----------------------------------------------------------------------------------------------
def convert(
    src: str | Path,
    dst: str | Path,
    tokenizer_from: str | Path | None,
    convert_config: Callable[[dict[str, Any], Path], dict[str, Any]],
    convert_tensors: Callable[[dict[str, torch.Tensor], dict[str, Any], Path], dict[str, torch.Tensor]],
    reasoning: tuple[str, str] | None = None,
) -> Path:
    """Convert the HF directory `src` into a native checkpoint `dst` with a model's two translations: its config
    (`convert_config(hf_config, src)` -> our config dict) and its tensors (`convert_tensors(hf_tensors, config, src)`
    -> our state dict). The tokenizer files come from `tokenizer_from` when given, else from `src`, declaring the
    family's `reasoning` tags when given (`tokenizer_dir`). Nothing is written to `dst` until every check has
    passed. Returns `dst`."""
    src, dst = Path(src), Path(dst)
    tok_src = Path(tokenizer_from) if tokenizer_from is not None else None
    hf_config = read_config(src)
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: the destination must differ from the HF source directory")
    config = convert_config(hf_config, src)
    with tempfile.TemporaryDirectory(prefix="kvfree-hf-") as staging:
        tok_dir = tokenizer_dir(src, tok_src, config, Path(staging), reasoning)
        tensors = convert_tensors(load_hf_tensors(src), config, src)
        return write_checkpoint(dst, config, tensors, tokenizer_from=tok_dir)
