"""What every benchmark script shares: median timings, the HBM bandwidth measured in the same run, the environment;
and what the kernel check scripts (kvfree/bench/kernels) share: their frame (`CheckScript`: the command line, the
sizes `Sizes`, the steps and the result), the CUDA-graph replay check of a decode step, a decode step's timing row
with its launch-configuration sweep, per-kernel profiles, the table's head and the goals. What else they share is
kvfree/bench/kernels/common.py.

Speed claims come from these scripts' JSON (BENCHMARKS.md), never from timed tests. On a GPU, times are medians of
`triton.testing.do_bench` (CUDA events, L2 flushed between runs) when Triton is there, else of CUDA events.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Goal:
    """A number a benchmark checks on one kind of device: `metric` `op` (">=" or "<=") `threshold`; `what` says it in
    words. Benchmarks write each goal to their JSON with its value and whether it is met."""

    device: str
    metric: str
    op: str
    threshold: float
    what: str

    def met(self, value: float) -> bool:
        return value >= self.threshold if self.op == ">=" else value <= self.threshold


def print_goals(rows: list[dict[str, Any]], device_type: str) -> None:
    """One line per goal row of a benchmark's JSON (a Goal's fields, its `value` and `met`): those of this device,
    and any other that was judged."""
    for row in rows:
        if row["met"] is None and row["device"] != device_type:
            continue
        verdict = {True: "met", False: "MISSED", None: "not run"}[row["met"]]
        value = "-" if row["value"] is None else f"{row['value']:.3g}"
        print(f"target {row['what']}: {value} ({row['op']} {row['threshold']:g}): {verdict}")


def goal_rows(goals: list[Goal], values: dict[str, float | None], device_type: str) -> list[dict[str, Any]]:
    """A benchmark's goal rows for its JSON: each goal's fields, its value (from `values`, by metric) and whether it
    is met, judged only where measured on its kind of device (else None)."""
    rows = []
    for g in goals:
        value = values.get(g.metric)
        judged = value is not None and device_type == g.device
        rows.append({**dataclasses.asdict(g), "value": value, "met": g.met(value) if judged else None})
    return rows


def median_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 200,
              repeats: int | None = None) -> float:  # fmt: skip
    """Median milliseconds of one `fn()` call on `device` (warmed up first). `repeats`: call it that many times
    (after 5 warm-up calls) rather than for `rep_ms`: processes that time one collective step together must each
    make the same number of calls."""
    if device.type == "cuda" and repeats is not None:
        return _cuda_events_ms(fn, warmup=5, repeats=repeats)
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            return _cuda_events_ms(fn, warmup=5, repeats=50)
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench(fn: Callable[[], object], device: torch.device, rep: int = 100) -> float:
    """Median milliseconds of `fn()` over about `rep` ms (`median_ms`: do_bench on a GPU, a host clock for --smoke)."""
    return median_ms(fn, device, rep_ms=rep)


def _cuda_events_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_per_call_ms(fn: Callable[[], object], calls: int = 10) -> float:
    """Milliseconds per call of `fn` replayed from one CUDA graph of `calls` calls: launch gaps as in a graphed decode
    step, not as in an eager loop. NaN without a GPU."""
    if not torch.cuda.is_available():
        return float("nan")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (compiles, allocator pools)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, torch.device("cuda")) / calls


def decode_timings(step: Callable[[], object], reference: Callable[[], object], sweep: dict[str, Callable[[], object]],
                   floor_bytes: float, hbm_GBps: float, device: torch.device,
                   graph: bool = True) -> dict[str, Any]:  # fmt: skip
    """A decode step's timing row: its median (`triton_us`) against its floor, `floor_bytes` over the copy bandwidth
    (`floor_us`, `over_floor`); the reference's (`reference_us`); per step replayed from a CUDA graph of 10
    (`triton_graph_per_step_us`, when `graph` and on a GPU); and each launch configuration of `sweep` (`sweep_us`)."""
    floor_us = floor_bytes / hbm_GBps / 1e3
    ms = bench(step, device, rep=200)
    row: dict[str, Any] = {"floor_us": floor_us, "triton_us": ms * 1e3, "over_floor": ms * 1e3 / floor_us}
    row["reference_us"] = bench(reference, device, rep=50) * 1e3
    if graph and device.type == "cuda":
        row["triton_graph_per_step_us"] = graph_per_call_ms(step) * 1e3
    row["sweep_us"] = {tag: bench(fn, device, rep=100) * 1e3 for tag, fn in sweep.items()}
    return row


def graph_matches_eager(step: Callable[[list[torch.Tensor]], torch.Tensor], state: Sequence[torch.Tensor],
                        inputs: Sequence[torch.Tensor], new_inputs: Callable[[], Sequence[torch.Tensor]],
                        replays: int = 1) -> bool:  # fmt: skip
    """Whether a decode step captured in a CUDA graph and replayed gives what eager calls give.

    `step(tensors)` runs the op on `inputs` and the state `tensors` (in place) and returns its output. It is captured
    on a copy of `state` (called once before, to compile); then `replays` times: `new_inputs()` is copied into
    `inputs`, the graph replayed and the step called eagerly on `state`; outputs and states must be equal bit for bit.
    """
    graphed = [t.clone() for t in state]
    step(graphed)  # compiled before capture
    for g, t in zip(graphed, state, strict=True):
        g.copy_(t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph = step(graphed)
    for g, t in zip(graphed, state, strict=True):
        g.copy_(t)
    ok = True
    for _ in range(replays):
        for x, new in zip(inputs, new_inputs(), strict=True):
            x.copy_(new)
        graph.replay()
        o_eager = step(list(state))
        ok = ok and bool(torch.equal(o_graph, o_eager)) and all(
            torch.equal(g, t) for g, t in zip(graphed, state, strict=True)
        )  # fmt: skip
    return ok


def profile_device_us(calls: dict[str, Callable[[], object]], out: dict[str, Any], log: RunLog,
                      top: int | None = None) -> None:  # fmt: skip
    """Device microseconds per kernel of each named call (torch profiler over 3 calls after one warm-up: which launch
    the time goes to), longest first (the `top` longest), into `out[name]`, each said on `log`."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in calls.items():
        fn()
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            sync()
        per = {e.key: e.device_time_total / 3 for e in prof.key_averages() if e.device_time_total > 0}
        out[name] = {k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]}
        log.say(f"profile {name} (device us per call): {json.dumps(out[name])}")


def cu_seqlens(lens: Sequence[int], device: torch.device) -> torch.Tensor:
    """`[N+1]` int32 boundaries of packed sequences of lengths `lens`."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (METHOD.md's measure); NaN when `out` holds a NaN (an unwritten element)."""
    if out.isnan().any():
        return float("nan")
    ref = ref.to(torch.float64)
    return ((out.to(torch.float64) - ref).norm() / ref.norm()).item()


class RunLog:
    """Timestamped progress lines of a benchmark script: printed as they come, kept for its JSON."""

    def __init__(self) -> None:
        self.start = time.time()
        self.lines: list[str] = []

    def say(self, msg: str) -> None:
        line = f"[{time.time() - self.start:6.1f}s] {msg}"
        self.lines.append(line)
        print(line, flush=True)


def untouched_equal(pool: torch.Tensor, before: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether every row of `pool` outside `idx` equals `before` bit for bit (an op wrote only where it should)."""
    keep = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    keep[idx.long()] = False
    return bool(torch.equal(pool[keep], before[keep]))


def sync() -> None:
    """Wait for the GPU (no-op without one), so that a failure or a time lands in the step that caused it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def script_device(smoke: bool, script: str) -> torch.device | None:
    """The device a kernel check script runs on: a CUDA GPU, or with `--smoke` the CPU under Triton's interpreter
    (switched on here, before any kernel module is imported). None, after saying why on stderr, otherwise."""
    if smoke:
        if torch.cuda.is_available():
            print(f"{script}: --smoke is for machines without a GPU", file=sys.stderr)
            return None
        os.environ["TRITON_INTERPRET"] = "1"
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return None
    return torch.device("cuda")


# A check script's option beyond --out and --smoke: (flag, help) is a switch; (flag, help, keywords) takes a value,
# the keywords going to argparse (type, default).
Flag = tuple[str, str | None] | tuple[str, str | None, dict[str, Any]]


def script_args(argv: list[str] | None, doc: str, name: str, *flags: Flag, script: str | None = None
                ) -> tuple[argparse.Namespace, torch.device | None]:  # fmt: skip
    """A kernel check script's command line (`--out`, the folder for NAME.json; then `flags`; `--smoke`) parsed from
    `argv`, and its device (`script_device`, as `script`, by default kvfree.bench.kernels.NAME: None when it cannot
    run)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default="docs/bench", help=f"folder for {name}.json")
    for flag, what, *value in flags:
        ap.add_argument(flag, help=what, **(value[0] if value else {"action": "store_true"}))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under the Triton interpreter")
    a = ap.parse_args(argv)
    return a, script_device(a.smoke, script or f"kvfree.bench.kernels.{name}")


def measure_hbm(res: dict[str, Any], device: torch.device, log: RunLog, key: str = "hbm_copy_GBps",
                label: str = "HBM copy", gib: float = 2.0) -> None:  # fmt: skip
    """`res[key]`: the device-to-device copy bandwidth in GB/s (`hbm_bandwidth` of `gib`; 1 without a GPU), said as
    `label`. The copy's buffers go back to the device, not kept in the allocator's cache for the steps after."""
    res[key] = (hbm_bandwidth(device, gib) or 1e9) / 1e9
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log.say(f"{res['device']}: {label} {res[key]:.0f} GB/s")


def table_head(res: dict[str, Any], has: str | None = None, line: Callable[[str, dict[str, Any]], str] | None = None,
               key: str | None = "hbm_copy_GBps", label: str = "HBM copy") -> list[str]:  # fmt: skip
    """A check script's table's first lines: the device, versions and copy bandwidth (`measure_hbm`'s `key`; None:
    not measured); the checks passed; then `line(name, check)` for each check (those with the field `has`)."""
    bad = [k for k, v in res["checks"].items() if not v.get("ok")]
    head = f"{res['device']}  torch {res['torch']}  triton {res['triton']}"
    lines = [head + (f"  {label} {res[key]:.0f} GB/s" if key else ""),
             f"checks: {len(res['checks']) - len(bad)}/{len(res['checks'])} ok" + (f"  FAILED {bad}" if bad else "")]
    if line is not None:
        lines += [line(k, v) for k, v in res["checks"].items() if has is None or has in v]
    return lines


def run_script(steps: list[tuple[str, Callable[[], object]]], res: dict[str, Any], path: Path, log: RunLog,
               table: Callable[[dict[str, Any]], str], device_type: str) -> int:  # fmt: skip
    """`run_steps`, then the script's table and its goals (if any) printed; returns the exit status."""
    status = run_steps(steps, res, path, log)
    print(table(res), flush=True)
    print_goals(res.get("goals", []), device_type)
    return status


class Sizes(dict[str, Any]):
    """A check script's sizes (its `SZ`): the real ones, until `--smoke` swaps in the tiny ones, in place, so that the
    script's functions, which read SZ when they run, see them."""

    def __init__(self, real: dict[str, Any], smoke: dict[str, Any]) -> None:
        super().__init__(real)
        self.smoke = smoke

    def use_smoke(self) -> None:
        self.clear()
        self.update(self.smoke)


@dataclass(frozen=True)
class Step:
    """A check script's step: `run(device, result)`; skipped without a GPU when `gpu_only`, and when the switch
    `unless` (a flag, "--skip-fla") is given."""

    name: str
    run: Callable[[torch.device, dict[str, Any]], object]
    gpu_only: bool = False
    unless: str | None = None

    def chosen(self, args: argparse.Namespace, device: torch.device) -> bool:
        skipped = self.unless is not None and getattr(args, _dest(self.unless))
        return not skipped and (device.type == "cuda" or not self.gpu_only)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


class CheckScript:
    """A kernel check script's frame: its command line, sizes, log and steps, run by `main`.

    It writes NAME.json; `script` is how it is named in messages (default kvfree.bench.kernels.NAME). `flags`: its
    options beyond --out and --smoke (`script_args`), of which --smoke turns on the switches `smoke_sets`.
    `sections`: the result's tables after "checks", each starting empty. `goals`: judged after the last step, from
    the result's "goals_values". `measure(result, device, log)`: what is measured before the steps (the copy
    bandwidth, `measure_hbm`), or None. The script's steps are added in order by the decorator `step`, its result's
    shapes and its table by `shapes` and `table`; `args` is the parsed command line once `main` runs.
    """

    def __init__(self, name: str, doc: str, sizes: Sizes, *, sections: Sequence[str], flags: Sequence[Flag] = (),
                 smoke_sets: Sequence[str] = (), goals: Sequence[Goal] = (),
                 measure: Callable[[dict[str, Any], torch.device, RunLog], None] | None = measure_hbm,
                 script: str | None = None) -> None:  # fmt: skip
        self.name, self.doc, self.sizes, self.script = name, doc, sizes, script
        self.sections, self.flags, self.smoke_sets, self.goals = tuple(sections), tuple(flags), smoke_sets, list(goals)
        self.measure = measure
        self.log = RunLog()
        self.steps: list[Step] = []
        self.args = argparse.Namespace()
        self._shapes: Callable[[], dict[str, Any]] = dict  # (set by the decorators below)
        self._table: Callable[[dict[str, Any]], str] = lambda res: ""

    def step(self, name: str, *, gpu_only: bool = False, unless: str | None = None
             ) -> Callable[[Callable[[torch.device, dict[str, Any]], object]], Callable[..., object]]:  # fmt: skip
        """Decorator: the function `(device, result)` is the script's next step, `name` (see `Step`)."""

        def add(run: Callable[[torch.device, dict[str, Any]], object]) -> Callable[..., object]:
            self.steps.append(Step(name, run, gpu_only, unless))
            return run

        return add

    def shapes(self, fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        """Decorator: `fn()` is the result's "shapes", its sizes in words (called once the sizes are chosen)."""
        self._shapes = fn
        return fn

    def table(self, fn: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
        """Decorator: `fn(result)` is the short table printed last."""
        self._table = fn
        return fn

    def main(self, argv: list[str] | None = None) -> int:
        """Parse `argv`, switch to the tiny sizes with --smoke, start the result (the environment, its shapes, the
        sections), measure, then `run_script` the steps chosen and the goals into NAME.json under --out, printing the
        table. Returns the exit status (2: no device to run on)."""
        a, dev = script_args(argv, self.doc, self.name, *self.flags, script=self.script)
        if dev is None:
            return 2
        self.args = a
        if a.smoke:
            self.sizes.use_smoke()
            for flag in self.smoke_sets:
                setattr(a, _dest(flag), True)
        res = environment(dev) | {"shapes": self._shapes(), "checks": {}} | {name: {} for name in self.sections}
        res |= ({"goals_values": {}} if self.goals else {}) | {"errors": []}
        if self.measure is not None:
            self.measure(res, dev, self.log)
        steps = [(s.name, functools.partial(s.run, dev, res)) for s in self.steps if s.chosen(a, dev)]
        if self.goals:
            steps.append(("goals", lambda: res.update(goals=goal_rows(self.goals, res["goals_values"], dev.type))))
        return run_script(steps, res, Path(a.out) / f"{self.name}.json", self.log, self._table, dev.type)


def run_steps(steps: list[tuple[str, Callable[[], object]]], res: dict[str, Any], path: Path, log: RunLog) -> int:
    """Run a check script's named steps in order; a failing step's traceback goes to `res["errors"]` and the next
    step still runs. `res` (with the log) is written to `path` after every step, so a run cut short keeps what it
    measured. Returns the exit status: 1 when a step failed or a check in `res["checks"]` is not ok, else 0."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for name, step in steps:
        try:
            step()
            sync()
        except Exception:
            err = traceback.format_exc()
            res["errors"].append({name: err[-3000:]})
            log.say(f"{name} FAILED:\n{err}")
        res["total_s"] = time.time() - log.start
        path.write_text(json.dumps(res | {"log": log.lines}, indent=1))
    return 1 if res["errors"] or any(not v.get("ok") for v in res["checks"].values()) else 0


def hbm_bandwidth(device: torch.device, gib: float = 2.0) -> float | None:
    """Device-memory bandwidth in bytes/s: a large device-to-device copy, counting bytes read plus bytes written.

    The physical floor of a memory-bound step is the bytes it must move over this figure. None on a CPU.
    """
    if device.type != "cuda":
        return None
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * n * 4 / (ms / 1e3)


def environment(device: torch.device) -> dict[str, Any]:
    """Device name, library versions and date, for the JSON every benchmark writes."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device=props.name, multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    else:
        env.update(device=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write a benchmark's results (creating the folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
