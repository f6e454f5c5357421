"""The state pool sized by memory (engine/state/sizing.py): as many slots as the budget holds, at most max_sessions;
on the CPU exactly max_sessions (64 by default); on a GPU, measured, within its share of the memory."""

from __future__ import annotations

import pytest
import torch

from kvfree.engine import LLM
from kvfree.engine.state.sizing import DEFAULT_CPU_SESSIONS, slots_that_fit
from tests.paths import TINY_CHECKPOINT


def test_slots_are_what_the_budget_holds_at_most_max_sessions():
    assert slots_that_fit(10 * 100 + 99, 100, 64) == (10, "memory")
    assert slots_that_fit(10**9, 100, 64) == (64, "max_sessions")
    assert slots_that_fit(-5, 100, 64) == (0, "memory")  # the weights alone overflow the share: nothing fits


def test_on_the_cpu_the_pool_has_max_sessions_slots_or_64():
    assert LLM(TINY_CHECKPOINT, device="cpu").pool.capacity == DEFAULT_CPU_SESSIONS
    assert LLM(TINY_CHECKPOINT, device="cpu", max_sessions=3).pool.capacity == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_pool_fills_its_share_of_memory_and_no_more():
    """A share of 0.5 of the GPU: the pool, the weights and a step fit in it; a larger share holds more slots; a
    small max_sessions bounds them."""
    free, total = torch.cuda.mem_get_info()
    small = LLM(TINY_CHECKPOINT, gpu_memory_utilization=0.3, max_sessions=100_000, max_context=2048)
    assert small.pool.capacity > 64
    small.generate([[1, 2, 3]])
    assert torch.cuda.memory_reserved() <= 0.3 * total + (total - free)  # (what other processes held before)
    bounded = LLM(TINY_CHECKPOINT, gpu_memory_utilization=0.3, max_sessions=8, max_context=2048)
    assert bounded.pool.capacity == 8
