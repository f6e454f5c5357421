"""The native checkpoint: a directory holding

    config.json             the ModelConfig (engine/model/config.py)
    model.safetensors       the weights, named as HybridLM's state_dict
    tokenizer.json          a `tokenizers` tokenizer
    tokenizer_config.json   special tokens and the Jinja chat template

This module reads and writes the files and checks that they are there and parse. Whether the config and tensors
describe a valid model is checked by `engine.loader`, which knows the model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file, key or tensor at fault."""


@dataclass
class RawCheckpoint:
    """A checkpoint's files, parsed but not yet checked against a model."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def default_checkpoint_path() -> Path:
    """The small checkpoint shipped inside the package (used when no checkpoint is named)."""
    return Path(__file__).parent / "default"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def read_checkpoint(path: str | Path) -> RawCheckpoint:
    """Read a native checkpoint directory; raises CheckpointError naming whatever is missing or unreadable."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: missing {name}")
    config = _read_json(path / CONFIG_FILE)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / CONFIG_FILE}: expected a JSON object")
    try:
        tensors = load_file(path / WEIGHTS_FILE)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path / WEIGHTS_FILE}: unreadable safetensors file ({e})") from None
    return RawCheckpoint(path=path, config=config, tensors=tensors)


def write_checkpoint(
    path: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    tokenizer_from: str | Path,
) -> Path:
    """Write a native checkpoint directory, copying the tokenizer files from directory `tokenizer_from`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path / WEIGHTS_FILE)
    src = Path(tokenizer_from)
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        if not (src / name).is_file():
            raise CheckpointError(f"{src}: missing {name}")
        if (src / name).resolve() != (path / name).resolve():
            shutil.copyfile(src / name, path / name)
    return path
