"""The engine step on the CPU: what a GPU would pay per step (tensor ops, host syncs) does not grow with the batch,
overlapped stepping gives the same tokens and exact sessions, and `n > 1` choices are reproducible by seed."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvfree.engine import LLM, SamplingParams
from kvfree.engine.core.scheduler import Request, Scheduler
from kvfree.engine.core.stepper import Stepper
from kvfree.engine.protocol import RequestOutput
from kvfree.engine.sessions.manager import SessionManager
from tests.paths import TINY_CHECKPOINT

SCALAR_READS = {"aten._local_scalar_dense.default", "aten.item.default"}


class OpCounter(TorchDispatchMode):
    """Counts every tensor op dispatched (each a kernel launch on a GPU) and the scalar reads (device syncs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def scalar_reads(self) -> int:
        return sum(n for name, n in self.ops.items() if name in SCALAR_READS)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(TINY_CHECKPOINT, max_sessions=64)


# Where each request's outputs go, by request id (`_request` adds one): what a driver does with a step's outputs.
ROUTES: dict[str, list] = {}


class RoutingStepper(Stepper):
    """The stepper, each step's outputs appended to their requests' lists in ROUTES."""

    def step(self, send=None):
        outputs = super().step(send)
        for request_id, out in outputs:
            ROUTES.get(request_id, []).append(out)
        return outputs


def _engine(llm: LLM, overlap: bool, sessions: SessionManager | None = None) -> Stepper:
    if sessions is None:  # (not `or`: an empty manager is falsy)
        sessions = SessionManager(llm.pool, fingerprint="test", max_host_sessions=0)
    scheduler = Scheduler(sessions, llm.tokenizer, max_waiting=1024, max_batch_tokens=4096)
    return RoutingStepper(scheduler, llm.runner, overlap)


def _decode_step_ops(llm: LLM, sequences: int) -> tuple[OpCounter, OpCounter]:
    """Ops of one engine decode step of `sequences` seeded top-p sequences (every prompt already in), and of the
    model's decode call alone for as many sequences."""
    engine = _engine(llm, overlap=False)
    prompts = [llm.tokenizer.encode(f"prompt {i} " * (1 + i % 3)) for i in range(sequences)]
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=50, ignore_eos=True)
        engine.scheduler.add(Request(f"r{i}", ids, params))
    while any(not r.sequences or not r.sequences[0].prefill_done for r in engine.scheduler.running):
        engine.step()
    engine.step()  # one plain decode step first
    counter = OpCounter()
    with counter:
        engine.step()
    assert engine.history[-1].decode_rows == sequences and engine.history[-1].prefill_tokens == 0
    slots = [seq.slot for req in engine.scheduler.running for seq in req.sequences]
    model_only = OpCounter()
    with model_only, torch.inference_mode():
        llm.runner._decode(slots)  # noqa: SLF001
    for req in engine.scheduler.running:
        engine.scheduler.abort(req.request_id)
    while engine.has_work:
        engine.step()
    return counter, model_only


def test_decode_step_ops_do_not_grow_with_the_batch(llm):
    (small, small_model), (large, _) = _decode_step_ops(llm, 8), _decode_step_ops(llm, 64)
    # One op sequence for the whole batch (model, sampling, bookkeeping): nothing per sequence.
    assert large.total == small.total, (small.total, large.total)
    assert small.scalar_reads <= 2 and large.scalar_reads <= 2, (small.scalar_reads, large.scalar_reads)
    # What the engine adds to the model's own call (slot copies, the sampler with top-p and its counter-based
    # random numbers, the copy back) is a bounded constant.
    assert small.total - small_model.total < 160, (small.total, small_model.total)


def _collect(engine: Stepper, requests: list[Request]) -> None:
    for req in requests:
        engine.scheduler.add(req)
    while engine.has_work:
        engine.step()


def _request(rid: str, ids: list[int], params: SamplingParams, outputs: list, **kw) -> Request:
    """A request whose outputs the engine's steps append to `outputs`."""
    ROUTES[rid] = outputs
    return Request(rid, ids, params, **kw)


def _tokens(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for out in outputs if out.index == index for t in out.token_ids]


def test_overlapped_steps_give_the_same_tokens(llm):
    prompts = [llm.tokenizer.encode(p) for p in ["Hello", "The quick brown fox jumps", "a" * 40, "xyz"]]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.1, seed=6, max_tokens=15, stop_token_ids=[97, 98, 99]),
        SamplingParams(temperature=1.2, presence_penalty=1.0, seed=7, max_tokens=10, logprobs=2),
    ]
    results = []
    for overlap in (False, True):
        outputs = [[] for _ in prompts]
        _collect(
            _engine(llm, overlap),
            [
                _request(f"r{i}", p, sp, out)
                for i, (p, sp, out) in enumerate(zip(prompts, params, outputs, strict=True))
            ],
        )
        results.append([(_tokens(out), out[-1].finish_reason, out[-1].text) for out in outputs])
    assert results[0] == results[1]
    assert llm.pool.used_slots == 0


class RecordingRunner:
    """The real runner, recording when each step is launched and when its tokens are read; it says every prefill
    step replays a CUDA graph (`graphed`) or that each runs eagerly."""

    def __init__(self, runner, graphed: bool) -> None:
        self.runner, self.graphed, self.device = runner, graphed, runner.device
        self.events: list[tuple[str, int]] = []
        self.launched = 0

    def replays_prefill(self, step) -> bool:
        return self.graphed and bool(step.prefill)

    def launch(self, step):
        index, self.launched = self.launched, self.launched + 1
        self.events.append(("launch", index))
        handle, events = self.runner.launch(step), self.events

        class Recorded:
            def result(self):
                events.append(("read", index))
                return handle.result()

        return Recorded()


@pytest.mark.parametrize("graphed", [True, False])
def test_a_graphed_prefill_is_launched_before_the_step_in_flight_is_read(llm, graphed):
    """Overlapped, a prefill step that replays a graph (cheap to launch) is queued behind the step in flight before
    the host waits for that step's tokens; an eager one (a long launch) lets those tokens go out first."""
    runner = RecordingRunner(llm.runner, graphed)
    sessions = SessionManager(llm.pool, fingerprint="test", max_host_sessions=0)
    engine = Stepper(Scheduler(sessions, llm.tokenizer), runner, overlap=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.scheduler.add(Request("a", llm.tokenizer.encode("Hello"), params))
    engine.step()  # step 0: a's prompt
    engine.step()  # step 1: a decodes (step 0 read)
    engine.scheduler.add(Request("b", llm.tokenizer.encode("Another prompt"), params))
    del runner.events[:]
    engine.step()  # step 2: a decodes, b's prompt is fed
    assert engine.history[-1].prefill_tokens > 0
    assert runner.events == ([("launch", 2), ("read", 1)] if graphed else [("read", 1), ("launch", 2)])
    while engine.has_work:
        engine.step()
    assert llm.pool.used_slots == 0


def test_overlapped_session_turns_stay_exact(llm):
    """A turn that ends on a stop token leaves one token more in the session when steps overlap (the next step
    was already decoding it); the session records it, so the next turn is still exactly a full-history replay."""
    sessions = SessionManager(llm.pool, fingerprint="test", max_host_sessions=4)
    engine = _engine(llm, overlap=True, sessions=sessions)
    session = sessions.create(owner=None)
    greedy = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=list(range(100, 140)))
    history = llm.tokenizer.encode("Once upon a time")
    reasons = []
    for turn in range(3):
        outputs: list[RequestOutput] = []
        _collect(engine, [_request(f"t{turn}", history, greedy, outputs, session=session)])
        reply = _tokens(outputs)
        # The same history replayed from scratch, without a session.
        replay: list[RequestOutput] = []
        _collect(_engine(llm, overlap=False), [_request(f"f{turn}", history, greedy, replay)])
        assert reply == _tokens(replay), turn
        # A stop token was fed by the step already in flight; the last token of a "length" finish never is.
        stopped = outputs[-1].finish_reason == "stop"
        reasons.append(outputs[-1].finish_reason)
        assert session.num_tokens == len(history) + len(reply) - (0 if stopped else 1)
        history = history + reply + llm.tokenizer.encode(" and then")
    sessions.delete(session)
    assert "stop" in reasons


def test_n_choices_are_seeded_independently_and_reproducibly(llm):
    ids = llm.tokenizer.encode("Tell me a story")
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    outputs: list[RequestOutput] = []
    _collect(_engine(llm, overlap=True), [_request("n3", ids, params, outputs, n=3)])
    choices = [_tokens(outputs, k) for k in range(3)]
    assert len({tuple(c) for c in choices}) == 3  # independent draws
    for k, choice in enumerate(choices):
        alone: list[RequestOutput] = []
        seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234 + k, max_tokens=12, ignore_eos=True)
        _collect(_engine(llm, overlap=False), [_request(f"c{k}", ids, seeded, alone)])
        assert _tokens(alone) == choice, k
    assert llm.pool.used_slots == 0


def test_unseeded_requests_differ_and_the_global_rng_is_untouched(llm):
    ids = llm.tokenizer.encode("Hi")
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    torch.manual_seed(0)
    expected = torch.rand(4)  # what the global RNG gives next when nothing draws from it in between
    torch.manual_seed(0)
    runs = [llm.generate([ids], params)[0].token_ids for _ in range(3)]
    assert len({tuple(r) for r in runs}) == 3
    assert torch.equal(torch.rand(4), expected)  # the seeds of unseeded requests came from elsewhere


def test_new_prompts_wait_to_share_a_prefill_step_while_others_decode(llm):
    engine = _engine(llm, overlap=False)
    scheduler = engine.scheduler
    scheduler.max_batch_tokens = 64
    scheduler.prefill_batch_wait = 3600.0  # nothing waits that long here
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs: list[RequestOutput] = []
    scheduler.add(_request("a", llm.tokenizer.encode("first prompt"), params, outputs))
    engine.step()  # nothing decodes yet: prefilled at once
    assert engine.history[-1].prefill_tokens > 0
    scheduler.add(_request("b", llm.tokenizer.encode("a short one"), params, outputs))
    for _ in range(3):
        engine.step()  # "a" decodes; "b" waits for company
        assert engine.history[-1].prefill_tokens == 0 and engine.history[-1].decode_rows == 1
    scheduler.add(_request("c", llm.tokenizer.encode("x" * 60), params, outputs))
    engine.step()  # together the waiting prompts fill the step's budget: both go in
    assert engine.history[-1].prefill_tokens == 64 - 1
    scheduler.prefill_batch_wait = 0.0
    while engine.has_work:
        engine.step()
    assert sorted(len(_tokens([o for o in outputs if o.request_id == r])) for r in "abc") == [40, 40, 40]
    assert llm.pool.used_slots == 0


def test_each_request_gets_its_own_number_of_top_logprobs_in_a_mixed_batch(llm):
    """The step copies the batch's largest k back; each row keeps only the alternatives its request asked for."""
    ids = llm.tokenizer.encode("Logprobs, please")
    asks = [None, 0, 2, 5]
    outputs = [[] for _ in asks]
    requests = [
        _request(f"lp{i}", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=k), out)
        for i, (k, out) in enumerate(zip(asks, outputs, strict=True))
    ]
    _collect(_engine(llm, overlap=False), requests)
    for k, out in zip(asks, outputs, strict=True):
        entries = [lp for o in out for lp in o.logprobs]
        if k is None:
            assert entries == []
        else:
            assert len(entries) == 4 and all(len(e.top) == k for e in entries), (k, [len(e.top) for e in entries])


def _run_all(engine: Stepper, requests: list[Request]) -> None:
    for req in requests:
        engine.scheduler.add(req)
    while engine.has_work:
        engine.step()


@pytest.mark.parametrize("overlap", [False, True])
def test_aborting_one_choice_stops_it_while_the_others_run_to_their_end(llm, overlap):
    engine = _engine(llm, overlap)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    outputs: list[RequestOutput] = []
    engine.scheduler.add(_request("r", llm.tokenizer.encode("Hello"), params, outputs, n=3))
    while len(_tokens(outputs, 1)) < 3:
        engine.step()
    assert engine.scheduler.abort("r", 1) and not engine.scheduler.abort("r", 7)
    assert not engine.scheduler.abort("missing", 0)
    while engine.has_work:
        engine.step()
    finish = {out.index: out.finish_reason for out in outputs if out.finish_reason is not None}
    assert finish == {0: "length", 1: "abort", 2: "length"}
    assert len(_tokens(outputs, 0)) == len(_tokens(outputs, 2)) == 12
    assert 3 <= len(_tokens(outputs, 1)) <= 5  # what it had, and at most the step in flight (overlapped) after
    assert llm.pool.used_slots == 0


def test_a_request_no_slot_can_ever_be_freed_for_is_refused_not_kept_waiting():
    """Idle sessions in every slot, host memory full, no store: a sessionless request would wait forever for a
    slot; it fails with PoolExhausted instead. But requests whose sessions are resident run first, and once they
    end their sessions can move to host memory to make room: then the sessionless request waits and runs."""
    from kvfree.engine.protocol import PoolExhausted

    llm = LLM(TINY_CHECKPOINT, max_sessions=2)
    sessions = SessionManager(llm.pool, fingerprint="test", max_host_sessions=1)
    engine = _engine(llm, overlap=False, sessions=sessions)
    got: dict[str, list] = {}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def request(name: str, session=None) -> Request:
        ids = llm.tokenizer.encode(f"{name} says hi")
        return _request(name, ids, params, got.setdefault(name, []), session=session)

    s1, s2 = sessions.create(owner=None), sessions.create(owner=None)
    _run_all(engine, [request("warm1", s1), request("warm2", s2)])  # both resident now, idle
    # A (no session) first in line, then B and C on the resident sessions: nothing runs, and A cannot evict
    # sessions reserved for B and C. B and C run first; then s1 moves to host memory and A runs.
    _run_all(engine, [request("A"), request("B", s1), request("C", s2)])
    for name in ("A", "B", "C"):
        assert got[name][-1].finish_reason == "length", (name, got[name][-1])
    assert sessions.counters.evictions >= 1

    # Now host memory is full (one session) and both slots hold idle sessions: A can never get a slot.
    s3 = sessions.create(owner=None)
    _run_all(engine, [request("warm3", s3)])
    _run_all(engine, [request("A2")])
    assert isinstance(got["A2"][-1], PoolExhausted), got["A2"]
