"""The prefix cache on the CPU: a request without a session resumes from the checkpoints earlier requests left (the
end of a prompt, a message boundary, the end of an output), gives the tokens and logprobs a cold prefill gives, for
recurrent layers and a KV cache alike; checkpoints stay with their owner, yield slots to sessions, and are dropped
rather than fail a request."""

from __future__ import annotations

import pytest
import torch

from kvfree.engine import LLM, SamplingParams
from kvfree.engine.core.model_runner import ModelRunner
from kvfree.engine.core.scheduler import Request, Scheduler
from kvfree.engine.core.stepper import Stepper
from kvfree.engine.protocol import RequestOutput
from kvfree.engine.sessions.manager import SessionManager
from kvfree.engine.sessions.prefix_cache import PrefixCache
from kvfree.engine.state.pool import StatePool
from tests.conftest import make_model, random_ids
from tests.paths import TINY_CHECKPOINT

pytestmark = pytest.mark.usefixtures("one_thread")

# A recurrent state, a gated delta rule, a per-token KV cache and a sliding window: every kind of state a checkpoint
# must carry whole.
LAYERS = ["mamba2", "attention", "gdn", "swa"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model():
    return make_model(LAYERS, seed=11, mlp=True)


@pytest.fixture(scope="module")
def tokenizer():
    return LLM(TINY_CHECKPOINT, max_sessions=1).tokenizer


class Engine:
    """A scheduler and stepper over `model` with `slots` pool slots, the prefix cache on or off."""

    def __init__(self, model, tokenizer, slots: int = 8, cache: bool = True, host_budget: int = 1 << 30,
                 max_host_sessions: int = 16) -> None:  # fmt: skip
        pool = StatePool(model, capacity=slots, max_context=256)
        self.sessions = SessionManager(pool, fingerprint="test", max_host_sessions=max_host_sessions)
        self.cache = PrefixCache(self.sessions.tiers, host_budget) if cache else None
        self.scheduler = Scheduler(self.sessions, tokenizer, max_batch_tokens=64, prefix_cache=self.cache)
        self.stepper = Stepper(self.scheduler, ModelRunner(model, pool), overlap=False)
        self._ids = 0

    def run(self, prompts: list[list[int]], owner: str | None = None, **kw) -> list[tuple[list[int], list, int]]:
        """Each prompt's (greedy tokens, their logprobs, cached_tokens), all queued at once."""
        outs: dict[str, list[RequestOutput]] = {}
        for prompt in prompts:
            self._ids += 1
            rid = f"r{self._ids}"
            outs[rid] = []
            self.scheduler.add(Request(rid, prompt, kw.pop("params", GREEDY), owner=owner, **kw))
        while self.stepper.has_work:
            for rid, out in self.stepper.step():
                assert not isinstance(out, Exception), out
                outs[rid].append(out)
        return [([t for o in got for t in o.token_ids], [lp.logprob for o in got for lp in o.logprobs],
                 got[-1].cached_tokens) for got in outs.values()]  # fmt: skip


def cold(model, tokenizer, prompt: list[int]) -> tuple[list[int], list]:
    tokens, logprobs, cached = Engine(model, tokenizer, cache=False).run([prompt])[0]
    assert cached == 0
    return tokens, logprobs


def resumed(engine: Engine, prompt: list[int], model, tokenizer, **kw) -> int:
    """Run `prompt` on `engine`: its greedy tokens and logprobs are a cold engine's; returns its cached tokens."""
    out, logprobs, cached = engine.run([prompt], **kw)[0]
    assert (out, pytest.approx(logprobs, abs=1e-4)) == cold(model, tokenizer, prompt)
    return cached


def test_a_resent_conversation_resumes_from_the_end_of_the_last_output_exactly(model, tokenizer):
    engine = Engine(model, tokenizer)
    first = random_ids(40, seed=1)
    out1, _, cached1 = engine.run([first])[0]
    assert cached1 == 0
    # The agent's next turn: the whole conversation again, the reply and a new message after it. The state holds
    # the prompt and every output token but the last (sampled, never fed).
    second = first + out1 + random_ids(9, seed=2)
    out2, logprobs2, cached2 = engine.run([second])[0]
    assert cached2 == len(first) + len(out1) - 1
    want_tokens, want_logprobs = cold(model, tokenizer, second)
    assert out2 == want_tokens
    assert torch.allclose(torch.tensor(logprobs2), torch.tensor(want_logprobs), atol=1e-4)


def test_a_prompt_sharing_only_the_last_prompt_resumes_from_its_end(model, tokenizer):
    engine = Engine(model, tokenizer)
    first = random_ids(33, seed=3)
    engine.run([first])
    branch = first + random_ids(7, seed=4)  # the reply re-rendered differently, say: only the prompt is shared
    assert resumed(engine, branch, model, tokenizer) == len(first)


def test_a_message_boundary_inside_the_prompt_is_kept_and_found(model, tokenizer):
    engine = Engine(model, tokenizer)
    system = random_ids(21, seed=5)
    engine.run([system + random_ids(12, seed=6)], checkpoint_at=(len(system),))
    other = system + random_ids(15, seed=7)  # another conversation under the same system prompt
    assert resumed(engine, other, model, tokenizer) == len(system)


def test_checkpoints_are_found_only_by_their_owner(model, tokenizer):
    engine = Engine(model, tokenizer)
    prompt = random_ids(30, seed=8)
    engine.run([prompt], owner="key-a")
    assert engine.run([prompt + [5, 6, 7]], owner="key-b")[0][2] == 0
    assert engine.run([prompt + [5, 6, 7]], owner="key-a")[0][2] == len(prompt)


def test_checkpoints_yield_their_slots_and_come_back_from_host_memory(model, tokenizer):
    """Two slots, many conversations: every request runs; the checkpoints that had to leave the pool live on in
    host memory and are found there, exactly."""
    engine = Engine(model, tokenizer, slots=2)
    prompts = [random_ids(20, seed=100 + i) for i in range(6)]
    for p in prompts:
        engine.run([p])
    assert engine.sessions.tiers.pool.used_slots <= 2 and engine.cache.held_bytes()["host"] > 0
    assert resumed(engine, prompts[0] + [9, 9, 9], model, tokenizer) >= len(prompts[0])


def test_without_host_budget_checkpoints_are_dropped_not_requests(model, tokenizer):
    engine = Engine(model, tokenizer, slots=2, host_budget=0)
    results = engine.run([random_ids(20, seed=200 + i) for i in range(5)])
    assert all(len(tokens) == GREEDY.max_tokens for tokens, _, _ in results)
    assert engine.cache.held_bytes()["host"] == 0 and engine.cache.counters.dropped > 0
    assert len(engine.cache) <= 2


def test_a_session_whose_turn_was_cut_resumes_from_the_boundary_not_from_nothing(model, tokenizer):
    """A session's turn is aborted with part of its reply fed; the client re-sends the same conversation: it resumes
    from the checkpoint at the end of the earlier turns (the front's boundary), not from a reset state."""
    engine = Engine(model, tokenizer)
    session = engine.sessions.create(owner=None)
    history = random_ids(25, seed=9)
    engine.scheduler.add(Request("t1", history, GREEDY, session=session))
    while engine.stepper.has_work:
        engine.stepper.step()
    turn = history + random_ids(6, seed=10)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.scheduler.add(Request("t2", turn, params, session=session, checkpoint_at=(len(history),)))
    for _ in range(4):
        engine.stepper.step()
    engine.scheduler.abort("t2")
    while engine.stepper.has_work:
        engine.stepper.step()
    assert session.num_tokens > len(turn)  # the cut reply is in the session
    assert resumed(engine, turn, model, tokenizer, session=session) == len(history)


def test_prompt_logprobs_are_each_tokens_logprob_under_the_model_and_never_from_a_checkpoint(model, tokenizer):
    """Scored in chunks across several prefill steps (the budget is 64 tokens), the prompt's logprobs equal the
    model's own log-softmax over the whole prompt at once, top-k included; a prompt a checkpoint covers is
    prefilled whole again, so it is scored whole."""
    engine = Engine(model, tokenizer)
    prompt = random_ids(150, seed=12)
    engine.run([prompt])  # leaves checkpoints of the prompt
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    engine.scheduler.add(Request("scored", prompt + [7], params))
    outs = []
    while engine.stepper.has_work:
        outs += [o for rid, o in engine.stepper.step() if rid == "scored"]
    got = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    assert outs[-1].cached_tokens == 0 and len(got) == len(prompt) + 1 and got[0] is None
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt + [7]]))[0], dim=-1)  # the training forward
    for i, entry in enumerate(got[1:], start=1):
        token = (prompt + [7])[i]
        assert entry.token_id == token
        assert abs(entry.logprob - want[i - 1, token].item()) < 1e-4
        top = want[i - 1].topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert max(abs(lp - v) for (_, lp), v in zip(entry.top, top.values.tolist(), strict=True)) < 1e-4
