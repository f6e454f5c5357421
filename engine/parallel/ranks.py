"""The processes of tensor parallelism: rank 0 (the engine) starts ranks 1..N-1 and tells them what to run.

Rank 0 decides everything (docs/design/tensor-parallel.md §1): it schedules, samples and owns the sessions. Every other
rank holds its part of the model and of the state pool, and runs what rank 0 sends it, in order, through shared memory
(engine/parallel/command_channel.py): a step's slots and prompt tokens, pool resets and forks, a session's state out of
or into a
slot (whose bytes go over a gloo group on the host). The tensors of a step move between GPUs through the model's own
collectives (NCCL on GPUs): one all-reduce per block half, the gathered logits, and the decode input tokens, which rank
0 samples and broadcasts (`ModelRunner`). Because every rank runs the same calls in the same order, every rank's
collectives, its CUDA-graph captures included, line up.

A worker that fails on a command rank 0 also failed on (bad input reaches every rank alike: a full KV cache) goes on
with the next; any other failure ends it, and rank 0's next command fails saying so. A worker whose rank 0 is gone
exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvfree.engine.core.model_runner import ModelRunner
from kvfree.engine.model.loader import load_model
from kvfree.engine.model.tensor_parallel import TensorParallel
from kvfree.engine.parallel.command_channel import CommandChannel
from kvfree.engine.parallel.sharded_pool import ShardedStatePool
from kvfree.engine.state.packed import PackedState
from kvfree.engine.state.pool import StatePool
from kvfree.engine.state.sizing import DEFAULT_CPU_SESSIONS, DEFAULT_MAX_SESSIONS, size_pool
from kvfree.engine.state.snapshot import model_fingerprint

log = logging.getLogger("kvfree.engine")

TIMEOUT = timedelta(minutes=10)  # a collective waits this long for a rank before it fails


@dataclass
class RankSpec:
    """What every rank needs to build its part of the engine: `LLM`'s arguments (plain values, sent to new
    processes) and the group's address."""

    size: int
    init_method: str
    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    max_sessions: int | None = None  # the pool's slots: at most this many (engine/state/sizing.py)
    max_context: int = 4096
    config_overrides: dict[str, Any] = field(default_factory=dict)
    enforce_eager: bool = False
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float | None = 0.9  # on a GPU, the share of its memory the pool is sized by (None: not)
    step_tokens: int = 8192  # the most tokens a step feeds (its activations are measured at this size)
    channel_path: str = ""  # the command channel's file (set by `Workers`)

    def device_of(self, rank: int) -> str:
        """Rank r's device: cuda:r (counting from the device asked for), or the CPU."""
        if self.device in ("auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{rank}"
        if self.device.startswith("cuda:"):
            return f"cuda:{int(self.device.split(':')[1]) + rank}"
        return self.device


def free_address() -> str:
    """A tcp:// address on the loopback interface with a port free now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Workers:
    """Rank 0's handle on ranks 1..N-1: start them, send them commands, move session bytes to and from them."""

    def __init__(self, spec: RankSpec) -> None:
        if spec.size < 2:
            raise ValueError(f"tensor_parallel_size {spec.size}: workers are for 2 or more ranks")
        if spec.device_of(0).startswith("cuda") and torch.cuda.device_count() < spec.size:
            raise ValueError(
                f"tensor_parallel_size {spec.size} needs {spec.size} GPUs; this machine has {torch.cuda.device_count()}"
            )
        self.channel = CommandChannel.create(readers=spec.size - 1)
        self.spec = spec = dataclasses.replace(spec, channel_path=self.channel.path)
        context = mp.get_context("spawn")
        self.processes = [context.Process(target=worker_main, args=(rank, spec), daemon=True,
                                          name=f"kvfree-rank-{rank}") for rank in range(1, spec.size)]  # fmt: skip
        for p in self.processes:
            p.start()
        self.tp, self.host_group = join(0, spec)
        self._pending: list[tuple] = []  # commands that may wait for the next one (pool resets)

    def defer(self, command: tuple) -> None:
        """Queue `command` to go out in front of the next `send` (what the ranks need only before their next step)."""
        self._pending.append(command)

    def send(self, command: tuple) -> None:
        """Every worker runs `command` (its name, then its arguments) next, after any deferred ones."""
        batch, self._pending = [*self._pending, command], []
        self.channel.put(batch, self._alive, TIMEOUT.total_seconds())

    def _alive(self) -> None:
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} has stopped (exit code {p.exitcode}); see its log")

    def gather(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's uint8 host buffer of `data`'s size, rank 0's (`data`) first (after an "export" command, which
        has each worker gather its part of a slot)."""
        parts = [data] + [torch.empty_like(data) for _ in range(self.tp.size - 1)]
        dist.gather(data, parts, dst=0, group=self.host_group)
        return parts

    def scatter(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Hand each worker its uint8 host buffer (equal sizes, rank order; rank 0's first, kept)."""
        mine = torch.empty_like(parts[0])
        dist.scatter(mine, parts, src=0, group=self.host_group)
        return mine

    def stop(self) -> None:
        """End the workers and leave the group (idempotent). Every rank leaves the group at once, as they joined it
        (NCCL's teardown waits for its peers)."""
        if not self.processes:
            return
        try:
            self.send(("stop",))
            dist.destroy_process_group()
        finally:
            for p in self.processes:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            self.processes = []
            self.channel.close(unlink=True)


def join(rank: int, spec: RankSpec) -> tuple[TensorParallel, dist.ProcessGroup]:
    """Join the ranks' group (NCCL on GPUs, gloo on CPUs) and a gloo group on the host, which carries session bytes
    (exports and imports); the GPU is rank r's."""
    device = spec.device_of(rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    tp = TensorParallel.start(rank, spec.size, spec.init_method, timeout=TIMEOUT)
    host_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if dist.get_backend() != "gloo" else dist.group.WORLD
    return tp, host_group


def build_rank(spec: RankSpec, tp: TensorParallel, workers: Workers | None = None) -> ModelRunner:
    """One rank's model, state pool and runner (every rank builds them in the same order: their collectives, the
    warm-ups and CUDA-graph captures included, line up). Rank 0 passes its `workers`; its pool then moves whole
    sessions (engine/parallel/sharded_pool.py). Under tensor parallelism the fingerprint is taken here, by every rank
    at once,
    and kept on the runner."""
    model = load_model(spec.model, device=spec.device_of(tp.rank), dtype=spec.dtype,
                       config_overrides=spec.config_overrides, tp=tp)  # fmt: skip
    model.set_kv_cache_dtype(spec.kv_cache_dtype)
    fingerprint = model_fingerprint(model) if tp.size > 1 else None
    capacity = spec.max_sessions or DEFAULT_CPU_SESSIONS
    if model.device.type == "cuda" and spec.gpu_memory_utilization is not None:
        size = size_pool(model, spec.max_context, spec.gpu_memory_utilization, spec.step_tokens,
                         spec.max_sessions or DEFAULT_MAX_SESSIONS)  # fmt: skip
        capacity = size.sessions
        if tp.rank == 0:
            log.info("state pool: %s", size.describe(spec.max_context))
    if workers is not None:
        pool: StatePool = ShardedStatePool(model, capacity, spec.max_context, workers)
    else:
        pool = StatePool(model, capacity, spec.max_context)
    runner = ModelRunner(model, pool, enforce_eager=spec.enforce_eager, workers=workers)
    runner.fingerprint = fingerprint
    return runner


def worker_main(rank: int, spec: RankSpec) -> None:
    """Rank `rank` (1..N-1): build the same engine parts as rank 0, in the same order, then run its commands."""
    logging.basicConfig(level=os.environ.get("KVFREE_LOG_LEVEL", "WARNING"))
    parent = os.getppid()

    def rank_zero_alive() -> None:
        if os.getppid() != parent:  # rank 0 is gone (this process was handed to another parent)
            raise SystemExit(f"rank {rank}: rank 0 has gone")

    channel = CommandChannel(spec.channel_path, spec.size - 1)
    tp, host_group = join(rank, spec)
    runner = build_rank(spec, tp)
    pool = runner.pool
    try:
        with torch.inference_mode():  # as rank 0's runner calls: the pool and graph buffers are inference tensors
            while True:
                for name, *args in channel.get(rank - 1, rank_zero_alive, timeout=float("inf")):
                    if name == "stop":
                        runner.release_graphs()
                        dist.destroy_process_group()
                        return
                    try:
                        run_command(runner, host_group, name, args)
                    except ValueError as e:  # rank 0 met the same bad input, and answers for it
                        log.debug("rank %d: %s failed: %s", rank, name, e)
    finally:
        del runner, pool
        channel.close()


def run_command(runner, host_group: dist.ProcessGroup, name: str, args: list[Any]) -> None:
    """A worker's part of one command of rank 0's (`Workers.send`)."""
    pool = runner.pool
    if name == "step":
        runner.model_step(*args)
    elif name == "reset":
        pool.reset(*args)
    elif name == "copy":
        pool.copy_many(*args)
    elif name == "capture_prefill":
        runner.capture_prefill_graphs(*args)
    elif name == "export":
        data = pool.export_packed(*args).wait().data
        dist.gather(data, None, dst=0, group=host_group)
    elif name == "import":
        slot, entries, nbytes = args
        data = torch.empty(nbytes, dtype=torch.uint8)
        dist.scatter(data, None, src=0, group=host_group)
        pool.import_part(slot, PackedState(data, entries))
    else:
        raise RuntimeError(f"unknown command {name!r} from rank 0")
