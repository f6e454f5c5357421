"""lm-evaluation-harness against a real server: `lm_eval --model local-completions` (tokenizing through the server's
`/tokenizer_info` and `/tokenize`, scoring with `echo`, `logprobs` and `max_tokens: 1` on `/v1/completions`) runs a
six-question multiple-choice task from tests/fixtures/lm_eval/ against the embedded checkpoint served on a loopback
port, and every loglikelihood it logs equals what `LLM` computes for the same strings (prompt logprobs, fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfree.checkpoints import default_checkpoint_path
from kvfree.engine import LLM, SamplingParams
from tests.paths import ROOT
from tests.server_fixtures import serve

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need its `api` extra

TASK_DIR = ROOT / "tests" / "fixtures" / "lm_eval"
NAME = "kvfree-default"


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> list[dict]:
    """lm-eval's logged samples of the task, run against a served embedded checkpoint."""
    out = tmp_path_factory.mktemp("lm-eval")
    server = serve(default_checkpoint_path(), NAME, max_sessions=4)
    try:
        args = f"model={NAME},base_url={server.url}/v1/completions,num_concurrent=2,max_retries=1," \
               "tokenized_requests=True,tokenizer_backend=remote"  # fmt: skip
        command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                   "--tasks", "kvfree_tiny_choice", "--include_path", str(TASK_DIR), "--log_samples",
                   "--output_path", str(out)]  # fmt: skip
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        result = subprocess.run(command, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    finally:
        server.stop()
    (path,) = Path(out).glob("*/samples_kvfree_tiny_choice_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_question_was_scored_on_every_choice(samples):
    assert len(samples) == 6
    for s in samples:
        assert len(s["resps"]) == len(s["doc"]["choices"]) == len(s["arguments"])
        assert s["acc"] in (0.0, 1.0)


def test_loglikelihoods_through_the_server_equal_llms(samples):
    llm = LLM(default_checkpoint_path(), device="cpu", dtype="float32", max_sessions=8)
    tok = llm.tokenizer
    pairs, served = [], []
    for s in samples:
        for i, args in enumerate(s["arguments"].values()):
            context, continuation = args["arg_0"], args["arg_1"]
            whole, context_ids = tok.encode(context + continuation), tok.encode(context)  # lm-eval's split
            pairs.append((whole, len(context_ids)))
            served.append(float(s["resps"][i][0][0]))
    outs = llm.generate([w for w, _ in pairs], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    for (whole, n_context), out, want in zip(pairs, outs, served, strict=True):
        assert len(out.prompt_logprobs) == len(whole) and out.prompt_logprobs[0] is None
        got = sum(lp.logprob for lp in out.prompt_logprobs[n_context:])
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (whole, got, want)
