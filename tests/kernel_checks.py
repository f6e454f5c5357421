"""Helpers the Triton kernel tests share: seeded generators, the relative error, packed lengths, untouched pool rows.

The `poison` fixture (every buffer a Triton op allocates starts as NaN) is in conftest.py.
"""

from __future__ import annotations

import itertools
import json
import zlib
from pathlib import Path
from types import ModuleType

import torch

from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.loader import load_model
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool
from kvfree.kernels.dispatch import Op

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
f64 = torch.float64
TRAINED = Path(__file__).resolve().parents[1] / "checkpoints" / "trained"


def seed(*key) -> torch.Generator:
    """A generator seeded from the test's parameters (stable across processes, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero); fails on a NaN (an element a kernel never wrote
    to a poisoned buffer)."""
    assert not out.isnan().any(), "NaN (an unwritten poisoned element?)"
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    ref = ref.to(f64)
    return ((out.to(f64) - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def cu_of(lens: list[int]) -> torch.Tensor:
    """cu_seqlens `[N+1]` int32 on DEVICE for packed sequences of these lengths."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)


def untouched(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """A copy of the pool rows not named by idx (to check them bit-identical after an op)."""
    keep = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    keep[idx.long()] = False
    return pool[keep].clone()

def recorded_dispatch(monkeypatch, mode: str, *patches: tuple[ModuleType, str, str]) -> list[str]:
    """KVFREE_KERNELS set to `mode`, and each (module, function, label) of `patches` replaced by a stand-in that
    records `label` ("reference" or "triton") in the returned list when the op's dispatch calls it."""
    calls: list[str] = []
    monkeypatch.setenv("KVFREE_KERNELS", mode)
    for module, function, label in patches:
        monkeypatch.setattr(module, function, lambda *a, _label=label, **k: calls.append(_label))
    return calls


def run_layers(model: HybridLM, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """Prefill two packed prompts in two pieces each, then decode `steps` greedy tokens: every logits row."""
    pool = StatePool(model, capacity=4)
    slots = [3, 1]
    rows = []
    with torch.inference_mode():
        for lo, hi in [(0, 9), (9, None)]:
            pieces = [p[lo:hi] for p in prompts]
            ids = torch.tensor([t for p in pieces for t in p], device=DEVICE)
            rows.append(model.prefill(ids, pool.tensors, StepBatch.prefill(slots, [len(p) for p in pieces], DEVICE)))
        ids = rows[-1].argmax(-1)
        for _ in range(steps):
            rows.append(model.decode(ids, pool.tensors, StepBatch.decode(slots, DEVICE)))
            ids = rows[-1].argmax(-1)
    return torch.cat(rows)



def assert_mqar_scores_the_same(name: str, ops: ModuleType, monkeypatch, batch: int = 4) -> None:
    """The shipped checkpoint `checkpoints/trained/<name>` on held-out MQAR sequences (M=8, gap=64: prefill, then
    teacher-forced decode) scores through the Triton kernels of `ops` (a `kvfree.kernels.<layer>` package, whose
    ops are forced onto Triton) exactly what it scores through the reference, and what its report says. The other
    layers stay on the reference, to keep the interpreted run short; `batch` sequences of the held-out batch."""
    from kvfree.training.train import evaluate_batch

    report = json.loads((TRAINED / name / "mqar.json").read_text())
    model = load_model(TRAINED / name, device=str(DEVICE))
    monkeypatch.setenv("KVFREE_KERNELS", "reference")
    scores = {"reference": evaluate_batch(model, num_pairs=8, x=64, batch=batch, index=0)}
    for obj in vars(ops).values():  # the package's ops (kernels/dispatch.py; its decode_graph_safe asks them too)
        if isinstance(obj, Op):
            monkeypatch.setattr(obj, "device_check", lambda device: True)
    scores["triton"] = evaluate_batch(model, num_pairs=8, x=64, batch=batch, index=0)
    assert scores["triton"] == scores["reference"]
    correct, total = scores["triton"]
    assert total > 0 and correct / total >= report["accuracy"]["M=8,gap=64"] - 0.01
