"""Offline throughput: `LLM.generate` of many prompts end to end (prefill included), and where an engine step's
time goes (host vs device), for `kvfree bench offline`."""

from __future__ import annotations

import cProfile
import math
import pstats
import statistics
import time
from typing import Any

import torch

from kvfree.engine.core.stepper import StepRecord
from kvfree.engine.llm import LLM
from kvfree.engine.protocol import SamplingParams


def random_prompts(count: int, tokens: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `tokens` random token ids (what the model reads does not change its speed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, tokens), generator=gen).tolist()


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else math.nan


def offline_run(llm: LLM, prompts: int, prompt_tokens: int, max_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Generate `max_tokens` greedy tokens (EOS ignored) for `prompts` prompts at once; throughput and step times.

    decode phase: the steps that fed no prompt token, from the first to the last (every sequence decoding).
    host_ms: a step's time minus the time it waited for the device (overlapped steps hide host work behind it).
    """
    ids = random_prompts(prompts, prompt_tokens, llm.config.vocab_size, seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    engine.history.clear()
    start = time.perf_counter()
    outputs = llm.generate(ids, params)
    wall = time.perf_counter() - start
    steps: list[StepRecord] = list(engine.history)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    decoding = [r for r in steps if r.decode_rows and not r.prefill_tokens]
    full = [r for r in decoding if r.decode_rows == prompts]
    prefilling = [r for r in steps if r.prefill_tokens]
    span = decoding[-1].end - decoding[0].start if decoding else math.nan
    return {
        "prompts": prompts,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "wall_s": wall,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall,
        "steps": len(steps),
        "prefill_steps": len(prefilling),
        "prefill_s": sum(r.seconds for r in prefilling),
        "decode_phase_tokens_per_s": sum(r.decode_rows for r in decoding) / span if decoding else math.nan,
        "decode_step_ms": _median_ms([r.seconds for r in full]),
        "decode_host_ms": _median_ms([r.seconds - r.wait for r in full]),
        "prefill_step_ms": _median_ms([r.seconds for r in prefilling]),
        "prefill_host_ms": _median_ms([r.seconds - r.wait for r in prefilling]),
    }


def profile_steps(llm: LLM, prompts: int, prompt_tokens: int, steps: int = 2) -> dict[str, Any]:
    """Profile engine steps of `prompts` prompts at two points: while prompts are fed (steps after the first, which
    also admits) and in the decode phase (every sequence decoding). Each: the device's busy time (torch profiler,
    CUDA kernels and copies) against the steps' wall time, then the host functions of as many more steps
    (cProfile, run separately as it slows the host)."""
    ids = random_prompts(prompts, prompt_tokens, llm.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0, max_tokens=1_000_000, ignore_eos=True)
    requests = [llm._request(p, params, []) for p in ids]  # noqa: SLF001 (the bench steps the engine itself)
    engine = llm.engine
    driver = llm._drive(requests)  # noqa: SLF001
    next(driver)  # admission and the first chunks
    prefill = _profile(driver, steps)
    while engine.history[-1].prefill_tokens or engine.history[-1].decode_rows < prompts:
        next(driver)
    for _ in range(3):  # settle
        next(driver)
    decode = _profile(driver, steps)
    driver.close()  # aborts the requests and frees their slots
    return {"batch": prompts, "prompt_tokens": prompt_tokens, "prefill": prefill, "decode": decode}


def _profile(driver, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            next(driver)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    busy_us = sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        next(driver)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:15]  # by own time
    host = [
        {
            "function": f"{path.rsplit('/', 1)[-1]}:{line} {name}",
            "calls_per_step": calls / steps,
            "ms_per_step": own / steps * 1e3,
        }
        for (path, line, name), (calls, _primitive, own, _cumulative, _callers) in top
    ]
    step_ms = wall / steps * 1e3
    device_ms = busy_us / steps / 1e3
    return {
        "step_ms": step_ms,
        "device_busy_ms": device_ms,
        "device_idle_fraction": max(0.0, 1 - device_ms / step_ms),
        "host_functions": host,
    }
