"""Build a HybridLM from a native checkpoint directory, checking config and tensors against the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvfree.checkpoints import CheckpointError, default_checkpoint_path, read_checkpoint, write_checkpoint
from kvfree.engine.model.config import ConfigError, ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.tensor_parallel import ONE_RANK, TensorParallel, rank_shape, shard


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bf16 on GPU and fp32 on CPU unless asked otherwise (docs/design/architecture.md §8)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
    return names[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' (or None) picks CUDA when available; anything else must name a device this machine has."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but this torch build or machine has no CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    return dev


def load_model(
    path: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    config_overrides: dict[str, Any] | None = None,
    tp: TensorParallel = ONE_RANK,
) -> HybridLM:
    """Load a checkpoint (the embedded default when `path` is None) onto `device` in `dtype`.

    `config_overrides` replaces config values that do not change the weights, by dotted key (e.g.
    `{"gka.num_iter": 10}` for fewer solver iterations at serving time). With `tp`, this rank's part of the model:
    each tensor is checked whole, then cut (`HybridLM.weight_splits`).
    Raises CheckpointError naming the config key or tensor when the checkpoint does not describe a valid model,
    ValueError naming the layer when it does not divide among `tp`'s ranks.
    """
    path = Path(path) if path is not None else default_checkpoint_path()
    raw = read_checkpoint(path)
    try:
        config = ModelConfig.from_dict(ModelConfig.apply_overrides(raw.config, config_overrides or {}))
    except ConfigError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    dev = resolve_device(device)
    model = HybridLM(config, tp)
    splits = model.weight_splits()
    expected = model.state_dict()
    missing = [k for k in expected if k not in raw.tensors]
    if missing:
        raise CheckpointError(
            f"{path}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    # Calibrated fp8 KV-cache scales (`layers.{i}.mixer.k_scale` / `v_scale`, `[Hkv]`, as vLLM's fp8 checkpoints
    # ship them) are optional: they start each session's scales (engine/model/layers/attention.py).
    buffers = dict(model.named_buffers())
    scales = {k: t for k, t in raw.tensors.items() if k.endswith(("mixer.k_scale", "mixer.v_scale")) and k in buffers}
    unexpected = [k for k in raw.tensors if k not in expected and k not in scales]
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor {unexpected[0]!r} (not part of this config's model)")
    for name, want in expected.items():
        got = raw.tensors[name]
        try:
            fits = rank_shape(got.shape, splits.get(name), tp.size, name) == tuple(want.shape)
        except ValueError:
            fits = False
        if not fits:
            need = f"the config needs {tuple(want.shape)}"
            if tp.size > 1:
                need = f"the config needs {tuple(want.shape)} on each of {tp.size} tensor-parallel ranks"
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(got.shape)}, {need}")
        if not got.is_floating_point():
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {got.dtype}, expected floating point")
        if not torch.isfinite(got).all():
            raise CheckpointError(f"{path}: tensor {name!r} holds NaN or Inf values")
    model.load_state_dict({name: shard(raw.tensors[name], splits.get(name), tp) for name in expected})
    for name, scale in scales.items():
        try:
            fits = scale.dim() == 1 and rank_shape(scale.shape, splits.get(name), tp.size, name) == buffers[name].shape
        except ValueError:
            fits = False
        if not fits:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(scale.shape)}: one scale per KV head")
        if not torch.isfinite(scale).all() or not (scale > 0).all():
            raise CheckpointError(f"{path}: tensor {name!r} holds a scale that is not a finite positive number")
        buffers[name].copy_(shard(scale.float(), splits.get(name), tp))
    for layer in model.layers:
        layer.mixer.on_load()
    model.checkpoint_path = path  # type: ignore[attr-defined]
    return model.to(device=dev, dtype=resolve_dtype(dtype, dev)).eval()


def save_model(model: HybridLM, path: str | Path, tokenizer_from: str | Path) -> Path:
    """Write `model` as a native checkpoint, with the tokenizer files of directory `tokenizer_from`."""
    return write_checkpoint(path, model.config.to_dict(), model.state_dict(), tokenizer_from)
