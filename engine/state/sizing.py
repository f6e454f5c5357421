"""How many session slots a GPU holds: the pool sized by a share of its memory, as vLLM sizes its KV cache.

With `gpu_memory_utilization` u, the engine may use u of the GPU's memory in all. After the weights are loaded, what
is left of that share holds the largest step's activations (measured: one prefill of the step's token budget into a
probe pool, its peak over the memory before it), a margin for CUDA graphs' pools, and then the slots: each a whole
session's state at the full context (recurrent states and KV caches alike) plus the per-slot buffers of the sampler
and the decode step (a few vocabulary-wide rows). `max_sessions` bounds the count from above; fewer than one slot is
an error that says what would fit. Under tensor parallelism each rank sizes its part and the ranks take the least.
On the CPU nothing is measured: the pool has `max_sessions` slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool

GRAPH_MARGIN_BYTES = 1 << 30  # CUDA graphs' private pools and the allocator's fragmentation
SLOT_VOCAB_ROWS = 8  # fp32 vocabulary-wide rows a slot costs beyond its state (logits, sampling, penalties)
DEFAULT_CPU_SESSIONS = 64
DEFAULT_MAX_SESSIONS = 1024  # the upper bound on a GPU when none is given


@dataclass(frozen=True)
class PoolSize:
    """The slots chosen and how: `sessions`, each `bytes_per_slot` (its state at full context and its buffers), from
    `budget_bytes` left once `activation_bytes` (the largest step's, measured) and the margin were set aside; `limit`:
    what bounded it ("memory" or "max_sessions")."""

    sessions: int
    bytes_per_slot: int
    budget_bytes: int
    activation_bytes: int
    limit: str

    def describe(self, max_context: int) -> str:
        gib = 2**30
        return (f"{self.sessions} session slots of {self.bytes_per_slot / 2**20:.1f} MiB (state at {max_context} "
                f"tokens of context, and its buffers) in {self.budget_bytes / gib:.2f} GiB, bounded by {self.limit}; "
                f"{self.activation_bytes / gib:.2f} GiB kept for a step's activations")  # fmt: skip


def slots_that_fit(budget_bytes: int, bytes_per_slot: int, max_sessions: int) -> tuple[int, str]:
    """(slots, what bounded them): as many `bytes_per_slot` slots as `budget_bytes` holds, at most `max_sessions`."""
    fit = max(0, budget_bytes) // max(1, bytes_per_slot)
    return (max_sessions, "max_sessions") if fit >= max_sessions else (int(fit), "memory")


def size_pool(
    model: HybridLM, max_context: int, gpu_memory_utilization: float, step_tokens: int, max_sessions: int
) -> PoolSize:
    """Measure and size the pool of `model` on its GPU (see the module docstring). Every tensor-parallel rank calls it
    at the same point (its probe prefill runs the layers' collectives); the ranks agree on the least."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(device)
    probe = StatePool(model, capacity=1, max_context=max_context)
    bytes_per_slot = probe.bytes_per_session(part=True) + SLOT_VOCAB_ROWS * 4 * model.config.vocab_size
    tokens = min(step_tokens, max_context) if probe.bytes_per_token() else step_tokens
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        model.prefill(ids, probe.tensors, StepBatch.prefill([probe.scratch_slot], [tokens], device))
    torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_allocated(device) - before
    del probe, ids
    torch.cuda.empty_cache()
    used = torch.cuda.memory_allocated(device)  # the weights and what else this process holds
    budget = int(gpu_memory_utilization * total) - used - activation - GRAPH_MARGIN_BYTES
    sessions, limit = slots_that_fit(budget, bytes_per_slot, max_sessions)
    if model.tp.size > 1:  # every rank holds its part of each session: the rank with the least room decides
        least = torch.tensor([sessions], dtype=torch.long, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        if int(least.item()) < sessions:
            sessions, limit = int(least.item()), "another rank's memory"
    if sessions < 1:
        raise RuntimeError(
            f"no session slot fits in gpu_memory_utilization={gpu_memory_utilization:g} of this GPU's "
            f"{total / 2**30:.1f} GiB: the model holds {used / 2**30:.2f} GiB, a step's activations "
            f"{activation / 2**30:.2f} GiB, and one slot needs {bytes_per_slot / 2**30:.2f} GiB at max_context="
            f"{max_context}; raise gpu_memory_utilization, lower max_context or the step's tokens, or add GPUs"
        )
    return PoolSize(sessions, bytes_per_slot, budget, activation, limit)

