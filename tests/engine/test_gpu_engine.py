"""The engine on a GPU (skipped elsewhere; run by tests/gpu_run.sh on the device): CUDA-graph decode through the
scheduler gives the tokens eager decode gives, for batches that hit, pad and exceed the graph buckets."""

from __future__ import annotations

import pytest
import torch

from kvfree import LLM, SamplingParams
from kvfree.engine.protocol import Grammar
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
    waits in `StepHandle.result()`, so its work on one step overlaps the device's on the previous one. Grammar masks
    too: filled on the host, uploaded from pinned memory, applied on the device."""
    llm = LLM(TINY_CHECKPOINT, max_sessions=16)
    mixed = [
        SamplingParams(max_tokens=6, temperature=0),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=3),
        SamplingParams(max_tokens=6, temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, seed=4),
        SamplingParams(max_tokens=6, temperature=0, logprobs=3),
        SamplingParams(max_tokens=6, temperature=0.9, seed=5, logit_bias={65: 5.0, 66: -100.0}),
        SamplingParams(max_tokens=6, temperature=0.9, seed=6, grammar=Grammar("regex", "[a-z]{3,12}")),
    ]
    llm.generate([f"warm {i} " * (i + 1) for i in range(len(mixed))], mixed)  # compiles every kernel these steps meet

    def steps(debug: bool) -> int:
        engine = llm.engine
        requests = [llm._request(f"prompt {i} " * (3 * i + 1), mixed[i % len(mixed)]) for i in range(9)]
        requests.append(llm._request("forked prompt", SamplingParams(max_tokens=5, temperature=1.0, seed=9)))
        requests[-1].n = 3  # three choices share one prefill: the state is forked to two more slots
        for req in requests:
            engine.scheduler.add(req)
        launched = 0
        while engine.scheduler.has_work:
            step = engine.scheduler.schedule()
            if not step.runs_model:
                engine.scheduler.retire()
                continue
            torch.cuda.set_sync_debug_mode("error" if debug else "default")
            try:
                handle = engine.runner.launch(step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            engine.scheduler.postprocess(step, handle.result())
            launched += 1
        assert all(r.sequences and all(s.finished for s in r.sequences) for r in requests)
        return launched

    # Once to capture the sampler graphs these steps meet (a capture syncs, once per bucket and kind of batch), then
    # the same steps again, where nothing may.
    steps(debug=False)
    assert steps(debug=True) > 5


def test_constrained_rows_beside_free_ones_on_the_gpu():
    """The overlapped engine with CUDA graphs: rows held to a grammar follow it (their step split into forward, then
    sampling under the masks of the tokens just read), and the free rows decode the tokens they decode when the same
    rows run free. Every row runs max_tokens (EOS ignored; a grammar that cannot be complete within them), so the
    batch keeps its shape."""
    llm = LLM(TINY_CHECKPOINT, max_sessions=16)
    assert llm.engine.overlap and llm.runner.graphs is not None
    endless = Grammar("lark", 'start: ITEM{30,}\nITEM: /[a-z]{1,6}[,;] /')  # >= 90 byte tokens
    prompts = [f"row {i}: " + "xyz" * i for i in range(8)]

    def run(constrain: bool) -> list[list[int]]:
        params = [SamplingParams(max_tokens=40, temperature=0.8, seed=i, ignore_eos=True,
                                 grammar=endless if constrain and i % 2 else None) for i in range(8)]  # fmt: skip
        return [o.token_ids for o in llm.generate(prompts, params)]

    free, mixed = run(False), run(True)
    assert [mixed[i] for i in range(0, 8, 2)] == [free[i] for i in range(0, 8, 2)]
    for i in range(1, 8, 2):
        matcher = llm.grammars.compile(endless)
        assert len(mixed[i]) == 40 and all(matcher.consume(t) for t in mixed[i]), llm.tokenizer.decode(mixed[i])


def test_sampler_graphs_draw_what_the_eager_sampler_draws():
    """Sampling replayed from a graph (per batch bucket and kind of batch) and launched op by op give the same tokens
    and logprobs, for greedy, sampled, filtered, penalised and constrained rows, batches that pad their bucket."""
    graphed = LLM(TINY_CHECKPOINT, max_sessions=16)
    eager = LLM(TINY_CHECKPOINT, max_sessions=16)
    eager.runner.sampler_graphs = None
    assert graphed.runner.sampler_graphs is not None
    kinds = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=0.9, seed=1),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=2),
        SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, seed=3),
        SamplingParams(max_tokens=12, temperature=1.0, seed=4, logprobs=2),
        SamplingParams(max_tokens=12, temperature=1.0, seed=5, grammar=Grammar("regex", "[a-z ]{5,30}")),
    ]
    for batch in ([kinds[0]], kinds[:2], kinds, kinds * 2):
        prompts = [f"p{i} " * (i + 2) for i in range(len(batch))]
        got, want = graphed.generate(prompts, batch), eager.generate(prompts, batch)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g.logprobs or [], w.logprobs or [], strict=True):
                assert abs(a.logprob - b.logprob) < 1e-4
    # Batches beyond the kinds captured at start-up (filtered, penalised, logprobs) were captured when met, and served.
    kinds = {flags for _, flags, _ in graphed.runner.sampler_graphs.graphs}
    assert any(f.top_p for f in kinds) and any(f.penalties for f in kinds) and any(f.logprobs for f in kinds)
