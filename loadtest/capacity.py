"""How many sessions fit in a device's memory at each context length.

sessions(L) = floor(budget / bytes_per_session(L)), where budget is `--device-memory-gib` minus what the server
holds besides session states (weights, activations), and bytes_per_session(L) is:

- measured: the `state_bytes` a session of exactly L tokens reported in the context sweep, where L was measured
  (the session fitted on the server);
- extrapolated: the sweep's least-squares line (intercept + slope * L) elsewhere, e.g. past the longest context
  the server accepted. Extrapolated rows are marked as such in the report.

The non-state memory is estimated from `/metrics` on a GPU server at rest: `kvfree_gpu_memory_allocated_bytes`
minus the whole pool (`kvfree_state_bytes_per_session` at its reserved size times `kvfree_pool_slots_total`). A CPU
server reports no device memory, so nothing is subtracted and the budget is all state.

The rows count the bytes a session *holds* at each length. A kvfree pool reserves every slot at its full size
(for the attention baseline: the KV cache at `--max-context`), so the number of slots the same budget buys today
is kept beside the table (`slots_at_reserved_size`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvfree.loadtest.context_sweep import ContextSweepResult
from kvfree.loadtest.prom import ServerMemory

GIB = 2**30


@dataclass
class CapacityRow:
    context: int
    bytes_per_session: float | None
    sessions: int | None
    source: str  # "measured", "extrapolated", or "unknown" (no measurement and no fit)


@dataclass
class CapacityTable:
    device_memory_bytes: int
    non_state_bytes: int  # subtracted from the device memory (0 when the server reports no device memory)
    budget_bytes: int
    rows: list[CapacityRow] = field(default_factory=list)
    # What the server reserves per pool slot today (kvfree_state_bytes_per_session: the attention baseline's KV
    # cache at its --max-context, whatever a session's length) and how many slots of that size the budget holds.
    reserved_bytes_per_slot: float | None = None
    slots_at_reserved_size: int | None = None


def non_state_bytes(idle: ServerMemory | None) -> int:
    """Device bytes the server holds besides its state pool (weights...), from an idle scrape; 0 if unknown."""
    if idle is None or not idle.gpu_memory_allocated:
        return 0
    pool = (idle.state_bytes_per_session or 0) * (idle.pool_slots_total or 0)
    return max(0, int(idle.gpu_memory_allocated - pool))


def capacity_table(
    sweep: ContextSweepResult | None, contexts: list[int], device_memory_gib: float, idle: ServerMemory | None
) -> CapacityTable:
    """Sessions that fit at each of `contexts` (module doc)."""
    device = int(device_memory_gib * GIB)
    overhead = non_state_bytes(idle)
    table = CapacityTable(device_memory_bytes=device, non_state_bytes=overhead, budget_bytes=max(0, device - overhead))
    if idle is not None and idle.state_bytes_per_session:
        table.reserved_bytes_per_slot = idle.state_bytes_per_session
        table.slots_at_reserved_size = math.floor(table.budget_bytes / idle.state_bytes_per_session)
    measured = sweep.measured() if sweep is not None else {}
    fit = sweep.slope if sweep is not None else None
    for context in sorted(set(contexts)):
        if context in measured:
            per, source = float(measured[context]), "measured"
        elif fit is not None:
            per, source = fit.predict(context), "extrapolated"
        else:
            table.rows.append(CapacityRow(context, None, None, "unknown"))
            continue
        sessions = math.floor(table.budget_bytes / per) if per > 0 else None
        table.rows.append(CapacityRow(context, per, sessions, source))
    return table
