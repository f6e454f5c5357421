"""`kvfree bench structured`: what grammar-constrained rows cost a decode batch, against the same batch free.

    kvfree bench structured                                    # GPU: the embedded model and mamba2-370m, bf16
    kvfree bench structured --models default --device cpu --rows 8 --constrained 2 --max-tokens 32

For each model, `LLM.generate` runs `--rows` prompts of `--prompt-tokens` random ids, every row sampled (temperature
1, seeded) for exactly `--max-tokens` tokens, in two ways: all rows free (EOS ignored), and `--constrained` of them
held to a JSON schema (a list of at least 40 records, so that no constrained row can finish early: every row
decodes the same number of tokens either way). The two alternate `--repeats` times. The decode rate is the rows
over the median time of the steps in which every row decodes (no prompt fed); the ratio constrained/free is the
figure judged. Models: `default`, the embedded kvfree-demo (20M parameters, its own 49,152-token vocabulary; a
step is short, so the host's share shows most), and any preset, random weights with the embedded model's tokenizer
(mamba2-370m: a step as a real model's).

Also timed, once: building llguidance's tokenizer for the 49K vocabulary (start-up), compiling a tool list of five
functions the first time and from the cache, and the host time per step spent filling the constrained rows' masks.

Writes docs/bench/structured-DEVICE.json (device, versions, date, settings, per model: the runs, medians, ratio,
the target and whether it is met) and prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import tempfile
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from kvfree.bench.harness import Goal, environment, print_goals, write_json
from kvfree.bench.offline import random_prompts
from kvfree.bench.serve import git_commit
from kvfree.checkpoints import default_checkpoint_path
from kvfree.engine.llm import LLM
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.loader import resolve_device, resolve_dtype, save_model
from kvfree.engine.model.presets import PRESETS, preset_config
from kvfree.engine.protocol import Grammar, SamplingParams
from kvfree.engine.text.grammar import GrammarCompiler, fill_masks
from kvfree.engine.text.tokenizer import Tokenizer

TARGET = Goal("cuda", "constrained_over_free", ">=", 0.90,
              "decode rate with 16 of 64 rows constrained >= 90% of 64 free rows")  # fmt: skip

# The constrained rows' schema: records of bounded fields, at least 40 of them, so that no row completes its JSON
# within the run (every row decodes `--max-tokens` tokens, as the free ones do with EOS ignored).
RECORDS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 16},
                    "status": {"enum": ["open", "closed", "pending"]},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                },
                "required": ["id", "name", "status"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}

# A typical agent's tool list, for the compile timing.
TOOL_LIST: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}}}
    for name, props in [
        ("search_web", {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}),
        ("read_file", {"path": {"type": "string"}, "start_line": {"type": "integer", "minimum": 1}}),
        ("write_file", {"path": {"type": "string"}, "content": {"type": "string"}, "append": {"type": "boolean"}}),
        ("run_command", {"command": {"type": "string"}, "timeout_s": {"type": "number", "minimum": 0}}),
        ("send_email", {"to": {"type": "array", "items": {"type": "string"}}, "subject": {"type": "string"},
                        "body": {"type": "string"}, "priority": {"enum": ["low", "normal", "high"]}}),
    ]
]  # fmt: skip


def build_llm(model: str, device: torch.device, dtype: torch.dtype, rows: int, tmp: Path) -> LLM:
    """`default`: the embedded checkpoint; a preset: random weights of that size with the embedded tokenizer."""
    if model == "default":
        return LLM(default_checkpoint_path(), device=str(device), dtype=dtype, max_sessions=rows)
    tokenizer = Tokenizer(default_checkpoint_path())
    net = HybridLM(preset_config(model).model_copy(update={"vocab_size": tokenizer.vocab_size}))
    net.init_weights(0)
    path = save_model(net.to(dtype), tmp / model, tokenizer_from=default_checkpoint_path())
    return LLM(path, device=str(device), dtype=dtype, max_sessions=rows)


def instrument(llm: LLM) -> dict[str, list[float]]:
    """Record the host seconds of each call to the parts of a step that grammars add to or lengthen: filling the
    masks, advancing the grammars, launching the sampling, and the rest of the previous step's host work. Returns
    the lists, by name, that the calls append to (cleared by the caller between runs)."""
    times: dict[str, list[float]] = {}
    for owner, name in ((llm.runner, "_host_masks"), (llm.runner, "sample"), (llm.runner, "forward"),
                        (llm.engine.scheduler, "advance_grammars"), (llm.engine.scheduler, "postprocess")):  # fmt: skip
        record = times.setdefault(name.strip("_"), [])
        original = getattr(owner, name)

        def timed(*a, _original=original, _record=record, **kw):
            start = time.perf_counter()
            out = _original(*a, **kw)
            _record.append(time.perf_counter() - start)
            return out

        setattr(owner, name, functools.wraps(original)(timed))
    return times


def _fill_pooled(executor, matchers: list, masks: torch.Tensor, rows: list[int] | None = None) -> None:
    """Matcher i's mask into row `rows[i]` (default i) of `masks` (`[R, W]` int32, host), on llguidance's pool."""
    rows = list(range(len(matchers))) if rows is None else rows
    executor.unsafe_compute_mask_ptr([(m._m, r) for m, r in zip(matchers, rows, strict=True)], masks.data_ptr(),
                                     masks.shape[1] * 4, masks.shape[0])  # fmt: skip


@contextlib.contextmanager
def pooled_masks() -> Iterator[None]:
    """Within: the runner fills masks on llguidance's thread pool instead of one row after another."""
    from llguidance import LLExecutor

    import kvfree.engine.core.model_runner as runner_module

    executor, one_by_one = LLExecutor(), runner_module.fill_masks

    def pooled(matchers, end_tokens, out, rows):
        _fill_pooled(executor, matchers, out, rows)
        for matcher, ends, row in zip(matchers, end_tokens, rows, strict=True):
            if ends and matcher.accepting:  # (the end tokens' bits, as fill_masks sets them)
                one_by_one([matcher], [ends], out, [row])

    runner_module.fill_masks = pooled
    try:
        yield
    finally:
        runner_module.fill_masks = one_by_one


def _medians_ms(times: dict[str, list[float]]) -> dict[str, float | None]:
    return {name: statistics.median(v) * 1e3 if v else None for name, v in times.items()}


def decode_run(llm: LLM, rows: int, constrained: int, prompt_tokens: int, max_tokens: int, seed: int) -> dict:
    """One `LLM.generate` of `rows` rows, `constrained` of them under `RECORDS_SCHEMA`; the full-batch steps' times."""
    prompts = random_prompts(rows, prompt_tokens, llm.config.vocab_size, seed)
    grammar = Grammar.json_schema(RECORDS_SCHEMA)
    held = set(range(0, rows, rows // constrained)[:constrained]) if constrained else set()  # spread over the batch
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i, ignore_eos=True,
                       grammar=grammar if i in held else None)
        for i in range(rows)
    ]  # fmt: skip
    engine = llm.engine
    engine.history.clear()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    full = [r for r in engine.history if r.decode_rows == rows and not r.prefill_tokens]
    step_ms = statistics.median(r.seconds for r in full) * 1e3
    lengths = [len(o.token_ids) for o in outputs]
    return {
        "constrained": sum(p.grammar is not None for p in params),
        "wall_s": wall,
        "full_steps": len(full),
        "decode_step_ms": step_ms,
        "decode_host_ms": statistics.median(r.seconds - r.wait for r in full) * 1e3,
        "decode_tokens_per_s": rows / step_ms * 1e3,
        "every_row_ran_max_tokens": all(n == max_tokens for n in lengths),
    }


def bench_model(model: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        llm = build_llm(model, device, dtype, args.rows, Path(tmp))
    if args.eager_sampler:
        llm.runner.sampler_graphs = None
    start = time.perf_counter()
    llm.grammars.lltokenizer  # noqa: B018 (built here, timed)
    tokenizer_s = time.perf_counter() - start
    # Warm-up: Triton compiles, graphs are captured, the grammar is compiled, both kinds of step are met once.
    llm.runner.capture_prefill_graphs(args.rows * args.prompt_tokens)
    for constrained in (0, args.constrained):
        decode_run(llm, args.rows, constrained, args.prompt_tokens, 8, seed=99)
    times = instrument(llm)
    free, mixed, host = [], [], []
    for r in range(args.repeats):
        free.append(decode_run(llm, args.rows, 0, args.prompt_tokens, args.max_tokens, seed=r))
        for v in times.values():
            v.clear()
        mixed.append(decode_run(llm, args.rows, args.constrained, args.prompt_tokens, args.max_tokens, seed=r))
        host.append(_medians_ms(times))
    # The masks filled on llguidance's thread pool instead of one row after another (what grammar.fill_masks rests on).
    for v in times.values():
        v.clear()
    with pooled_masks():
        run = decode_run(llm, args.rows, args.constrained, args.prompt_tokens, args.max_tokens, seed=7)
    modes = {"pooled": {"decode_tokens_per_s": run["decode_tokens_per_s"], "host_ms": _medians_ms(times)}}
    free_rate = statistics.median(x["decode_tokens_per_s"] for x in free)
    mixed_rate = statistics.median(x["decode_tokens_per_s"] for x in mixed)
    return {
        "model": model,
        "params": sum(p.numel() for p in llm.model.parameters()),
        "vocab_size": llm.config.vocab_size,
        "llguidance_tokenizer_s": tokenizer_s,
        "free": free,
        "constrained": mixed,
        "free_tokens_per_s": free_rate,
        "constrained_tokens_per_s": mixed_rate,
        "constrained_over_free": mixed_rate / free_rate,
        "constrained_host_ms": host,
        "mask_modes": modes,
        "mask_fill_ms_median": statistics.median(h["host_masks"] for h in host),
    }


def mask_fill_times(tokenizer: Tokenizer, rows: int, repeats: int = 40) -> dict[str, float]:
    """One step's masks of `rows` matchers along a record, filled one row after another and on llguidance's thread
    pool, median ms of each. Each fill is cold: fresh matchers advanced to a new position (llguidance caches a
    state's mask, so filling the same state twice measures the cache)."""
    from llguidance import LLExecutor

    compiler = GrammarCompiler(tokenizer)
    grammar = Grammar.json_schema(RECORDS_SCHEMA)
    text = '{"records": [{"id": 12, "name": "alpha beta", "status": "open", "tags": ["x", "yz"]}, {"id": 7, "name": '
    ids = tokenizer.encode(text)
    masks = torch.zeros(rows, (tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    executor = LLExecutor()
    out = {}
    for name in ("sequential", "pooled"):
        times = []
        for r in range(repeats):
            matchers = [compiler.compile(grammar) for _ in range(rows)]
            for i, matcher in enumerate(matchers):  # rows at different places, as a batch's are
                assert all(matcher.consume(t) for t in ids[: (r + i) % len(ids)])
            start = time.perf_counter()
            if name == "pooled":
                _fill_pooled(executor, matchers, masks)
            else:  # (what the engine does)
                fill_masks(matchers, [frozenset()] * rows, masks, list(range(rows)))
            times.append(time.perf_counter() - start)
        out[f"{rows}_rows_{name}_ms"] = statistics.median(times) * 1e3
    return out


def compile_times(tokenizer: Tokenizer) -> dict[str, float]:
    """A five-function tool list's grammar (tool_choice "auto"), compiled the first time and from the cache."""
    from kvfree.server.protocol import ChatTool
    from kvfree.server.structured_outputs import tool_call_grammar
    from kvfree.server.tools import ToolCallFormat

    compiler = GrammarCompiler(tokenizer)
    compiler.lltokenizer  # noqa: B018 (not part of the compile)
    tools = [ChatTool.model_validate(t) for t in TOOL_LIST]
    fmt = ToolCallFormat.from_tokenizer_config(tokenizer.config)
    grammar = tool_call_grammar(tools, "auto", True, fmt, tokenizer)
    start = time.perf_counter()
    compiler.compile(grammar)
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(grammar)
    return {"tool_list_first_ms": first * 1e3, "tool_list_cached_ms": (time.perf_counter() - start) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfree bench structured", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--structured", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=["default", "mamba2-370m"], choices=["default", *PRESETS],
                        help="default: the embedded model, then a preset")  # fmt: skip
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--rows", type=int, default=64, help="decode batch")
    parser.add_argument("--constrained", type=int, default=16, help="rows held to the JSON schema")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens every row decodes")
    parser.add_argument("--repeats", type=int, default=3, help="free and constrained runs, alternating")
    parser.add_argument("--eager-sampler", action="store_true",
                        help="sample op by op instead of replaying sampler graphs (to measure what they save)")
    parser.add_argument("--out", type=Path, default=None, help="default: docs/bench/structured-DEVICE.json")
    args = parser.parse_args(argv)
    if not 0 < args.constrained <= args.rows:
        parser.error("--constrained must be in [1, --rows]")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    models = [bench_model(m, args, device, dtype) for m in args.models]
    tokenizer = Tokenizer(default_checkpoint_path())
    compile = compile_times(tokenizer)
    masks = mask_fill_times(tokenizer, args.constrained)
    targets = [
        {**TARGET.__dict__, "model": m["model"], "value": m["constrained_over_free"],
         "met": TARGET.met(m["constrained_over_free"]) if device.type == TARGET.device else None}
        for m in models
    ]  # fmt: skip
    suffix = "-eager-sampler" if args.eager_sampler else ""
    out = args.out or Path("docs/bench") / f"structured-{device.type}{suffix}.json"
    env = {**environment(device), "kvfree_commit": git_commit(), "llguidance": version("llguidance")}
    payload = {
        "what": "decode rate of a batch with grammar-constrained rows (a JSON schema) against the same batch free",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "structured")} | {"dtype": str(dtype)},
        "environment": env,
        "schema": RECORDS_SCHEMA,
        "models": models,
        "compile": compile,
        "mask_fill": masks,
        "targets": targets,
    }
    write_json(out, payload)
    sampler = "sampled op by op" if args.eager_sampler else "sampler graphs"
    print(f"# {env['device']}, torch {env['torch']}, llguidance {env['llguidance']}: {args.rows} rows, "
          f"{args.constrained} constrained, {args.max_tokens} tokens each, {args.repeats} runs each, "
          f"{sampler}")  # fmt: skip
    print(f"{'model':>14} {'free tok/s':>11} {'constr tok/s':>13} {'ratio':>6} {'free ms':>8} {'constr ms':>10} "
          f"{'mask ms':>8}")  # fmt: skip
    for m in models:
        f_ms = statistics.median(x["decode_step_ms"] for x in m["free"])
        c_ms = statistics.median(x["decode_step_ms"] for x in m["constrained"])
        mask_ms = m["mask_fill_ms_median"] or 0
        print(f"{m['model']:>14} {m['free_tokens_per_s']:>11.0f} {m['constrained_tokens_per_s']:>13.0f} "
              f"{m['constrained_over_free']:>6.3f} {f_ms:>8.2f} {c_ms:>10.2f} {mask_ms:>8.3f}")  # fmt: skip
    for m in models:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in m["constrained_host_ms"][-1].items() if v is not None)
        modes = ", ".join(f"{k} {v['decode_tokens_per_s']:.0f} tok/s" for k, v in m["mask_modes"].items())
        print(f"  {m['model']}: host ms per call (median, last run): {parts}; masks {modes}")
    print(f"tool list of 5 functions: compiled in {compile['tool_list_first_ms']:.1f} ms, "
          f"{compile['tool_list_cached_ms']:.2f} ms from the cache; masks of {args.constrained} rows: "
          + ", ".join(f"{k.split('_')[2]} {v:.3f} ms" for k, v in masks.items()))  # fmt: skip
    for row in targets:
        if row["met"] is not None:
            print(f"[{row['model']}]", end=" ")
            print_goals([row], device.type)
    print(f"wrote {out}")
    return 0
