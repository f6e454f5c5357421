"""Paths the tests share: the repository root and the tiny test checkpoint.

`TINY_CHECKPOINT` is a 4-layer Mamba-2 of width 128 with random weights and kvfree's byte tokenizer (1.9 MB; it was
the embedded default before `kvfree-demo`). Tests that need *a* small model, not the shipped one, use it: it loads
in milliseconds and its byte vocabulary makes token-level assertions simple.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_CHECKPOINT = ROOT / "tests" / "tiny_checkpoint"
