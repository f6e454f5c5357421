"""The engine on a GPU (skipped elsewhere; run by tests/gpu_run.sh on the device): CUDA-graph decode through the
scheduler gives the tokens eager decode gives, for batches that hit, pad and exceed the graph buckets."""

from __future__ import annotations

import pytest
import torch

from kvfree import LLM, SamplingParams
from tests.paths import TINY_CHECKPOINT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_graph_decode_matches_eager_through_the_scheduler():
    prompts = [f"prompt {i}: " + "abc" * (i % 7) for i in range(37)]  # 37: padded to a 40-session bucket
    params = SamplingParams(max_tokens=24, temperature=0)
    graphed = LLM(TINY_CHECKPOINT, max_sessions=48)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.sizes[-1] == 48
    eager = LLM(TINY_CHECKPOINT, max_sessions=48, enforce_eager=True)
    assert eager.runner.graphs is None
    for batch in (prompts[:1], prompts[:5], prompts):
        got = [o.token_ids for o in graphed.generate(batch, params)]
        want = [o.token_ids for o in eager.generate(batch, params)]
        assert got == want


def test_launching_a_step_never_makes_the_host_wait_for_the_device():
    """Scheduling and launching a step (admission, slot resets, uploads, prefill, forks, decode, sampling with logit
    biases, the copy of the tokens to the host) queue device work without a single implicit sync: the host only ever
    waits in `StepHandle.result()`, so its work on one step overlaps the device's on the previous one."""
    llm = LLM(TINY_CHECKPOINT, max_sessions=16)
    mixed = [
        SamplingParams(max_tokens=6, temperature=0),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=3),
        SamplingParams(max_tokens=6, temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, seed=4),
        SamplingParams(max_tokens=6, temperature=0, logprobs=3),
        SamplingParams(max_tokens=6, temperature=0.9, seed=5, logit_bias={65: 5.0, 66: -100.0}),
    ]
    llm.generate([f"warm {i} " * (i + 1) for i in range(len(mixed))], mixed)  # compiles every kernel these steps meet
    engine = llm.engine
    outputs: list = []
    requests = [llm._request(f"prompt {i} " * (3 * i + 1), mixed[i % len(mixed)], outputs) for i in range(9)]
    requests.append(llm._request("forked prompt", SamplingParams(max_tokens=5, temperature=1.0, seed=9), outputs))
    requests[-1].n = 3  # three choices share one prefill: the state is forked to two more slots
    for req in requests:
        engine.scheduler.add(req)
    launched = 0
    while engine.scheduler.has_work:
        step = engine.scheduler.schedule()
        if not step.runs_model:
            engine.scheduler.retire()
            continue
        torch.cuda.set_sync_debug_mode("error")
        try:
            handle = engine.runner.launch(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        engine.scheduler.postprocess(step, handle.result())
        launched += 1
    assert launched > 5 and all(r.sequences and all(s.finished for s in r.sequences) for r in requests)
