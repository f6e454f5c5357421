"""How kvfree's Triton kernels autotune: a short benchmark per config, and the choice cached on disk.

Triton's default benchmarks each config for ~125 ms, so a kernel meeting a new autotuning key (e.g. a prefill with
a new number of sequences) stalls that step for about half a second per config; in a server that is a request's
time to first token. A few milliseconds per config pick the same winners on these kernels (their configs differ by
far more than the noise), and `cache_results` keeps the choice in Triton's cache directory for the next process.
The engine also meets every key once at start-up (engine/core/model_runner.py, `warm_up_prefill`).
"""

from __future__ import annotations

import triton
import triton.testing


def quick_bench(fn, quantiles=None):
    """`triton.testing.do_bench` with a short warm-up and measuring window."""
    return triton.testing.do_bench(fn, warmup=3, rep=15, quantiles=quantiles)


AUTOTUNE_OPTIONS = {"do_bench": quick_bench, "cache_results": True}
