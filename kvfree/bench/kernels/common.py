"""What the kernel check scripts share beyond kvfree.bench.harness: check rows, timing pieces, the slot-pool ops' steps.

- check rows: `check_on_pools` (an op's output and the pool rows it wrote against float64, the other rows
  untouched), `check_decode_graph` (a decode step replayed from a CUDA graph against eager calls), `record`;
- timing: `random_slots`, `lens_tag`, `first_call_s`, `failure`, `fla_ops` (fla's kernels as anchors, where it
  imports; `fla_anchors`, their step), and `sweep_text`, `table_rows` (columns, `optional`) for the tables;
- `PoolOp` and `pool_op_steps`: the check, decode, prefill and profile steps of an op whose sessions' states live
  in fp32 slot pools, which gdn.py and gka.py share.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvfree.bench.harness import (
    CheckScript,
    RunLog,
    Sizes,
    bench,
    cu_seqlens,
    decode_timings,
    graph_matches_eager,
    profile_device_us,
    rel_err,
    sync,
    untouched_equal,
)
from kvfree.kernels.common import poisoned_outputs

f64 = torch.float64


def record(res: dict[str, Any], log: RunLog, section: str, key: str, row: dict[str, Any], what: str) -> None:
    """`row` into `res[section][key]`, said on `log` as `what: <the row as JSON>`."""
    res[section][key] = row
    log.say(f"{what}: {json.dumps(row)}")


def as_f64(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The tensors in float64 for a reference call (None, an input left out, stays None)."""
    return [None if t is None else t.to(f64) for t in tensors]


def check_on_pools(run: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor],
                   inputs: Sequence[torch.Tensor | None], pools: dict[str, torch.Tensor], idx: torch.Tensor,
                   *after: Any, tol: float, out: str = "o", **kw: Any) -> dict[str, Any]:  # fmt: skip
    """A check row of an op that writes the rows `idx` of its state pools, called `(*inputs, *pools, idx, *after,
    **kw)`: `run` (Triton, every buffer it allocates poisoned with NaN first) against `reference` on float64 inputs
    and float64 copies of the pools. The relative errors of the output (`<out>_rel`) and of each pool's rows `idx`
    (`<name>_rel`), whether the other rows are unchanged bit for bit, and whether all of it is within `tol`."""
    refs = {name: p.to(f64) for name, p in pools.items()}
    before = {name: p.clone() for name, p in pools.items()}
    with poisoned_outputs():
        o = run(*inputs, *pools.values(), idx, *after, **kw)
    o_ref = reference(*as_f64(inputs), *refs.values(), idx, *after, **kw)
    i = idx.long()
    row: dict[str, Any] = {f"{out}_rel": rel_err(o, o_ref)}
    row |= {f"{name}_rel": rel_err(p[i], refs[name][i]) for name, p in pools.items()}
    row["untouched_equal"] = all(untouched_equal(p, before[name], idx) for name, p in pools.items())
    # (max passes over a NaN after its first argument, but the output's error comes first: a NaN output fails)
    row["ok"] = row["untouched_equal"] and max(v for k, v in row.items() if k.endswith("_rel")) <= tol
    return row


def check_decode_graph(res: dict[str, Any], log: RunLog, step: Callable[[list[torch.Tensor]], torch.Tensor],
                       state: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                       new_inputs: Callable[[], Sequence[torch.Tensor]], replays: int = 1) -> None:  # fmt: skip
    """The check "decode_cuda_graph": a decode step captured in a CUDA graph and replayed `replays` times on new
    inputs equals eager calls (`graph_matches_eager`)."""
    ok = graph_matches_eager(step, state, inputs, new_inputs, replays)
    res["checks"]["decode_cuda_graph"] = {"ok": ok, "equal_to_eager": ok}
    log.say(f"check decode graph replay equals eager{f' ({replays} steps)' if replays > 1 else ''}: {ok}")


def random_slots(rows: int, n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """`[n]` int32: n distinct random rows of a pool of `rows` (sessions at random slots, as the engine's)."""
    return torch.randperm(rows, generator=gen, device=device)[:n].to(torch.int32)


def lens_tag(lens: Sequence[int]) -> str:
    """A packed prefill's name: B1_T<T> for one sequence, else <N>x<first length>."""
    return f"B1_T{sum(lens)}" if len(lens) == 1 else f"{len(lens)}x{lens[0]}"


def first_call_s(fn: Callable[[], object]) -> float:
    """Seconds of one synced call of `fn`: its first, compile and autotuning included, before it is timed."""
    start = time.time()
    fn()
    sync()
    return time.time() - start


def failure(e: Exception, chars: int = 120) -> str:
    """A sweep entry that did not run (a launch configuration that does not compile), as it is reported."""
    return f"{type(e).__name__}: {str(e)[:chars]}"


def fla_ops(res: dict[str, Any], log: RunLog, *names: str) -> list[Callable[..., Any]] | None:
    """fla's kernels `names` (dotted: "fla.ops.simple_gla.chunk_simple_gla"), the anchors, with fla's version in
    res["anchors"]; None, said and noted there, when they do not import (fla-core is never a dependency)."""
    try:
        import fla

        ops = [getattr(importlib.import_module(module), op) for module, _, op in (n.rpartition(".") for n in names)]
    except Exception as e:  # not installed here
        res["anchors"]["fla"] = f"not importable: {e!r}"[:300]
        log.say(res["anchors"]["fla"])
        return None
    res["anchors"]["fla_version"] = getattr(fla, "__version__", "?")
    return ops


def fla_anchors(script: CheckScript, *names: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: `fn(device, result, *the kernels named)` is the script's step "fla" (unless --skip-fla), run when
    they import (`fla_ops`)."""

    def add(fn: Callable[..., None]) -> Callable[..., None]:
        def step(dev: torch.device, res: dict[str, Any]) -> None:
            ops = fla_ops(res, script.log, *names)
            if ops is not None:
                fn(dev, res, *ops)

        script.step("fla", unless="--skip-fla")(step)
        return fn

    return add


def sweep_text(values: dict[str, float | str], fmt: str = ".1f") -> str:
    """A sweep's entries for a table: `name value, ...`, an entry that did not run (`failure`) as `name failed`."""
    return ", ".join(f"{c} {u:{fmt}}" if isinstance(u, float) else f"{c} failed" for c, u in values.items())


# A table column: its title, the value in a row (the row's field, or `value(name, row)`), and the value's format, whose
# width is the column's.
Column = tuple[str, str | Callable[[str, dict[str, Any]], float], str]


def optional(field: str) -> Callable[[str, dict[str, Any]], float]:
    """A column's value: the row's `field`, NaN in the rows without one."""
    return lambda name, row: row.get(field, math.nan)


def table_rows(title: str, width: int, rows: dict[str, dict[str, Any]], columns: Sequence[Column],
               tail: Callable[[str, dict[str, Any]], str] | None = None, sweep: str = "sweep_us", label: str = "sweep",
               fmt: str = ".1f") -> list[str]:  # fmt: skip
    """A section of a table: a head (`title`, `width` wide, then the columns' titles over their values), then a line
    a row (its name, indented, then each column's value and `tail(name, row)`), each followed, where the row has
    one, by its launch sweep `row[sweep]` as `    <label>: name value, ...` (`sweep_text`)."""
    lines = [f"{title:{width}s}" + "".join(f" {t:>{int(re.match(r'[0-9]+', spec)[0])}s}" for t, _, spec in columns)]
    for k, v in rows.items():
        cells = "".join(f" {value(k, v) if callable(value) else v[value]:{spec}}" for _, value, spec in columns)
        lines.append(f"  {k:{width - 2}s}{cells}" + (tail(k, v) if tail else ""))
        if sweep in v:
            lines.append(f"    {label}: " + sweep_text(v[sweep], fmt))
    return lines


# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolOp:
    """An op whose sessions' states live in fp32 slot pools, one row a session (gdn, gka), as `pool_op_steps`
    checks and times it.

    Its calls take `(*inputs, *pools, idx)` for a decode step and `(*inputs, *pools, idx, cu_seqlens,
    cu_seqlens_cpu=...)` for a packed prefill, the op's own parameters bound: the Triton op, the reference, and
    `launch` with its launch keywords open (the sweeps).
    """

    sizes: Sizes  # check_B, check_lens, pool, decode_batches, decode_sweep, prefill_lens, reference_lens
    description: str  # its sizes in words: the result's shapes' "op"
    inputs: Callable[[int, torch.dtype, torch.device, torch.Generator], list[torch.Tensor]]  # n tokens' inputs
    pools: Callable[[torch.device, torch.Generator, int], tuple[list[torch.Tensor], torch.Tensor]]  # and n rows
    names: tuple[str, ...]  # the pools' names in the check rows: `<name>_rel`
    decode: Callable[..., torch.Tensor]
    decode_reference: Callable[..., torch.Tensor]
    decode_launch: Callable[..., torch.Tensor]  # keywords block_v, num_warps
    prefill: Callable[..., torch.Tensor]
    prefill_reference: Callable[..., torch.Tensor]
    prefill_launch: Callable[..., torch.Tensor]
    tol: dict[torch.dtype, float]  # the checks' tolerance, by input dtype
    decode_bytes: Callable[[int], int]  # what a decode step of B sessions must move: its floor over the copy bandwidth
    decode_GBps: str  # the decode row's name for those bytes over its time
    # (row name, launch keywords): the bf16 prefill's sweep; its first entry is timed with fp32 inputs too
    prefill_sweep: list[tuple[str, dict[str, Any]]]
    prefill_tol: dict[torch.dtype, float] | None = None  # the prefill check's, where it differs from `tol`
    prefill_reference_timed: Callable[..., torch.Tensor] | None = None  # the reference as timed, where not as checked
    decode_best_sweep: bool = False  # each decode row also has its best sweep entry over the floor
    decode_goal: int | None = None  # the batch whose over_floor is the goal value decode_B<B>_over_floor
    prefill_failures: bool = False  # a sweep entry that does not compile is reported, not a failed step
    prefill_default: bool = False  # the prefill row "default" is the Triton op itself, timed after the sweep


def pool_op_steps(script: CheckScript) -> Callable[[Callable[[], PoolOp]], Callable[[], PoolOp]]:
    """Decorator of a pool op's factory: the script's result shapes (`pool_op_shapes`) and its steps "checks",
    "decode", "prefill" and (on a GPU) "profile", in that order, each of them using the op the factory builds when
    it runs (after --smoke has chosen the sizes and switched on the interpreter, so that the kernels import then)."""

    def add(op: Callable[[], PoolOp]) -> Callable[[], PoolOp]:
        script.shapes(lambda: pool_op_shapes(op()))
        script.step("checks")(lambda dev, res: _check(dev, res, script.log, op()))
        script.step("decode")(lambda dev, res: _time_decode(dev, res, script.log, op()))
        script.step("prefill")(lambda dev, res: _time_prefill(dev, res, script.log, op()))
        script.step("profile", gpu_only=True)(lambda dev, res: _profile(dev, res, script.log, op()))
        return op

    return add


def _check(dev: torch.device, res: dict[str, Any], log: RunLog, op: PoolOp) -> None:
    """The decode step at check_B random rows and the prefill of packed check_lens, each with fp32 and bf16 inputs,
    against the reference in float64 (`check_on_pools`); on a GPU the decode step replayed from a CUDA graph."""
    sz = op.sizes
    gen = torch.Generator(device=dev).manual_seed(1)
    prefill_tol = op.prefill_tol or op.tol
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        B = sz["check_B"]
        inp = op.inputs(B, dtype, dev, gen)
        pools, idx = op.pools(dev, gen, B)
        named = dict(zip(op.names, pools, strict=True))
        row = check_on_pools(op.decode, op.decode_reference, inp, named, idx, tol=op.tol[dtype])
        record(res, log, "checks", f"decode_B{B}_{name}", row, f"check decode {name}")

        lens = sz["check_lens"]
        cu = cu_seqlens(lens, dev)
        inp = op.inputs(sum(lens), dtype, dev, gen)
        pools, idx = op.pools(dev, gen, len(lens))
        named = dict(zip(op.names, pools, strict=True))
        row = check_on_pools(op.prefill, op.prefill_reference, inp, named, idx, cu, tol=prefill_tol[dtype],
                             cu_seqlens_cpu=cu.tolist())  # fmt: skip
        record(res, log, "checks", f"prefill_{name}", row, f"check prefill {name}")
        sync()

    if dev.type == "cuda":  # the decode step inside a CUDA graph, replayed on new inputs
        B = sz["check_B"]
        inp = op.inputs(B, torch.bfloat16, dev, gen)
        pools, idx = op.pools(dev, gen, B)
        check_decode_graph(res, log, lambda st: op.decode(*inp, *st, idx), pools, inp,
                           lambda: op.inputs(B, torch.bfloat16, dev, gen))  # fmt: skip


def _time_decode(dev: torch.device, res: dict[str, Any], log: RunLog, op: PoolOp) -> None:
    """The decode step at each of decode_batches (bf16 inputs, random rows) against its floor, with a (block_v,
    num_warps) sweep (`decode_timings`; B=1 also replayed from a CUDA graph)."""
    sz = op.sizes
    gen = torch.Generator(device=dev).manual_seed(2)
    pools, _ = op.pools(dev, gen, 1)
    for B in sz["decode_batches"]:
        inp = op.inputs(B, torch.bfloat16, dev, gen)
        idx = random_slots(sz["pool"], B, gen, dev)
        args = (*inp, *pools, idx)
        moved = op.decode_bytes(B)
        sweep = {f"BV{bv}_w{nw}": lambda args=args, bv=bv, nw=nw: op.decode_launch(*args, block_v=bv, num_warps=nw)
                 for bv, nw in sz["decode_sweep"]}  # fmt: skip
        row = decode_timings(lambda args=args: op.decode(*args), lambda args=args: op.decode_reference(*args), sweep,
                             moved, res["hbm_copy_GBps"], dev, graph=B == 1)  # fmt: skip
        row[op.decode_GBps] = moved / row["triton_us"] / 1e3
        if op.decode_best_sweep:
            row["best_sweep_over_floor"] = min(row["sweep_us"].values()) / row["floor_us"]
        record(res, log, "decode", f"B{B}", row, f"decode B={B}")
    if op.decode_goal is not None:
        B = op.decode_goal
        res["goals_values"][f"decode_B{B}_over_floor"] = res["decode"].get(f"B{B}", {}).get("over_floor")


def _time_prefill(dev: torch.device, res: dict[str, Any], log: RunLog, op: PoolOp) -> None:
    """The prefill of each of prefill_lens packed, bf16 (with the launch sweep) and fp32 inputs, in tokens/s; the
    reference at reference_lens."""
    sz = op.sizes
    gen = torch.Generator(device=dev).manual_seed(3)
    pools, _ = op.pools(dev, gen, 1)
    for lens in sz["prefill_lens"]:
        T = sum(lens)
        cu = cu_seqlens(lens, dev)
        cu_cpu = cu.tolist()
        idx = random_slots(sz["pool"], len(lens), gen, dev)
        for dtype in (torch.bfloat16, torch.float32):
            inp = op.inputs(T, dtype, dev, gen)
            row: dict[str, Any] = {}
            for key, knobs in op.prefill_sweep if dtype == torch.bfloat16 else op.prefill_sweep[:1]:
                def run(knobs=knobs, inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu) -> torch.Tensor:
                    return op.prefill_launch(*inp, *pools, idx, cu, cu_seqlens_cpu=cu_cpu, **knobs)

                try:
                    first = first_call_s(run)
                    ms = bench(run, dev, rep=100)
                    row[key] = {"ms": ms, "Mtok_s": T / ms / 1e3, "first_call_s": first}
                except Exception as e:  # a config that does not compile (shared memory, registers)
                    if not op.prefill_failures:
                        raise
                    row[key] = {"error": failure(e, 200)}
            if op.prefill_default:
                ms = bench(lambda inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu: op.prefill(
                    *inp, *pools, idx, cu, cu_seqlens_cpu=cu_cpu), dev, rep=100)  # fmt: skip
                row["default"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
            name = f"{lens_tag(lens)}_{str(dtype).removeprefix('torch.')}"
            record(res, log, "prefill", name, row, f"prefill {name}")
            del inp
    reference = op.prefill_reference_timed or op.prefill_reference
    for n in sz["reference_lens"]:
        inp = op.inputs(n, torch.bfloat16, dev, gen)
        cu = cu_seqlens([n], dev)
        idx = torch.zeros(1, dtype=torch.int32, device=dev)
        ms = bench(lambda inp=inp, cu=cu, idx=idx, n=n: reference(*inp, *pools, idx, cu, cu_seqlens_cpu=[0, n]), dev,
                   rep=50)  # fmt: skip
        res["prefill"][f"reference_B1_T{n}"] = {"ms": ms, "Mtok_s": n / ms / 1e3}
        log.say(f"prefill reference T={n}: {ms:.2f} ms")
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _profile(dev: torch.device, res: dict[str, Any], log: RunLog, op: PoolOp) -> None:
    """Device time per kernel of one prefill of the first of prefill_lens (bf16) and one decode step at the largest
    batch (`profile_device_us`): which launch the time goes to."""
    sz = op.sizes
    gen = torch.Generator(device=dev).manual_seed(5)
    pools, _ = op.pools(dev, gen, 1)
    T = sz["prefill_lens"][0][0]
    B = max(sz["decode_batches"])
    pre = op.inputs(T, torch.bfloat16, dev, gen)
    cu = cu_seqlens([T], dev)
    one = torch.zeros(1, dtype=torch.int32, device=dev)
    dec = op.inputs(B, torch.bfloat16, dev, gen)
    idx = random_slots(sz["pool"], B, gen, dev)
    calls = {
        "prefill": lambda: op.prefill(*pre, *pools, one, cu, cu_seqlens_cpu=[0, T]),
        "decode": lambda: op.decode(*dec, *pools, idx),
    }
    profile_device_us(calls, res["profile"], log)


def pool_op_shapes(op: PoolOp) -> dict[str, str]:
    """A pool op's result shapes: the op's sizes in words, the decode batches, the prefills, the checks."""
    sz = op.sizes
    return {"op": op.description, "decode": f"bf16 q, k, v; B in {list(sz['decode_batches'])}",
            "prefill": "B=1 T=16384 and 8x4096 packed (cu_seqlens), bf16 and fp32 inputs",
            "checks": f"decode B={sz['check_B']}; prefill lens {sz['check_lens']}"}  # fmt: skip
