"""The engine on a GPU (skipped elsewhere; run by kernels/gpu_run.sh on the device): CUDA-graph decode through the
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
