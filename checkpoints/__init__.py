"""Checkpoint format (a directory of config, safetensors weights and tokenizer), converters, shipped checkpoints."""

from kvfree.checkpoints.format import (
    CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    RawCheckpoint,
    default_checkpoint_path,
    read_checkpoint,
    write_checkpoint,
)

__all__ = [
    "CONFIG_FILE",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "WEIGHTS_FILE",
    "CheckpointError",
    "RawCheckpoint",
    "default_checkpoint_path",
    "read_checkpoint",
    "write_checkpoint",
]
