"""Whole models through the Triton kernels (interpreted on the CPU) against the PyTorch reference path.

Greedy continuations of the tiny presets must agree token for token between `KVFREE_KERNELS=reference` and
`KVFREE_KERNELS=triton`, through a prompt prefilled in pieces split at random points (two sessions packed in each
call) and then decoded one token at a time.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.presets import preset_config
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool
from tests.conftest import rel_err

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on a GPU machine, compiled kernels


def continue_greedily(model: HybridLM, prompts: list[list[int]], cuts: list[int], steps: int):
    """Prefill both prompts in the pieces `cuts` gives (packed together), then decode `steps` tokens greedily.

    Returns the tokens of each session and every logits row computed, for comparison between kernel paths.
    """
    pool = StatePool(model, capacity=4)
    slots = [3, 1]  # not the first rows, so row addressing is exercised
    device = model.device
    rows, start = [], 0
    with torch.inference_mode():
        for end in [*cuts, len(prompts[0])]:
            pieces = [p[start:end] for p in prompts]
            ids = torch.tensor([t for p in pieces for t in p], device=device)
            logits = model.prefill(ids, pool.tensors, StepBatch.prefill(slots, [len(p) for p in pieces], device))
            rows.append(logits)
            start = end
        tokens = [[] for _ in prompts]
        ids = logits.argmax(-1)
        for _ in range(steps):
            for row, t in zip(tokens, ids.tolist(), strict=True):
                row.append(t)
            logits = model.decode(ids, pool.tensors, StepBatch.decode(slots, device))
            rows.append(logits)
            ids = logits.argmax(-1)
    return tokens, torch.cat(rows)


def test_greedy_tokens_agree_between_reference_and_triton(monkeypatch):
    """The embedded default's shape (`tiny`: 4 Mamba-2 layers); interpreted Triton is slow, so the run is short."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = HybridLM(preset_config("tiny"))
    model.init_weights(seed)
    model.to(DEVICE).eval()
    n = 21
    prompts = [[rng.randrange(256) for _ in range(n)] for _ in range(2)]
    cuts = sorted(rng.sample(range(1, n), 2))
    monkeypatch.setenv("KVFREE_KERNELS", "reference")
    ref_tokens, ref_logits = continue_greedily(model, prompts, cuts, steps=6)
    monkeypatch.setenv("KVFREE_KERNELS", "triton")
    tri_tokens, tri_logits = continue_greedily(model, prompts, cuts, steps=6)
    assert tri_tokens == ref_tokens, f"seed {seed}, cuts {cuts}"
    assert rel_err(tri_logits, ref_logits) <= 1e-4, f"seed {seed}, cuts {cuts}"  # fp32 throughout
