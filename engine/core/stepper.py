"""Stepper: the one driver of the engine step, schedule -> run -> postprocess, used by `LLM` and the server; a step
returns its outputs.

With `overlap` (the default on a GPU) the host work of a step overlaps the device work of the next: step k is
scheduled and launched, and only then are step k-1's tokens waited for and postprocessed, while the device runs
step k. The device thus never waits for detokenization, stop checks and emission. The price is one step of lag:
a sequence that step k-1 finishes (EOS, a stop string) has already been decoded once more by step k; that token
is dropped, and a session then holds one token more (its consumed tokens say so, so its next turn stays exact).

A step with a grammar-constrained decode row is launched in two parts: its forward pass; then, while the device runs
it, the previous step's tokens are read, the rows' grammars advanced and their masks filled, and the sampling is
launched under them; the rest of the previous step's host work (detokenizing, stop checks, emitting) comes after.
Only the sampling waits for the host, and only for the grammars' part of it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvfree.engine.core.model_runner import ModelRunner, StepHandle
from kvfree.engine.core.scheduler import Output, SampledTokens, ScheduledStep, Scheduler


@dataclass
class StepRecord:
    """What one `Stepper.step` did and how long it took (perf_counter seconds).

    wait: the part of the step spent blocked on the device (waiting for a step's tokens); the rest is host work.
    """

    start: float
    end: float
    decode_rows: int
    prefill_tokens: int
    wait: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class StepTotals:
    """Every step since start, summed (what a benchmark differences over an interval to see where the time went).

    seconds: wall time inside steps; wait: the part of it blocked on the device; decode_rows and prefill_tokens: the
    tokens the steps fed.
    """

    steps: int = 0
    seconds: float = 0.0
    wait: float = 0.0
    decode_rows: int = 0
    prefill_tokens: int = 0

    def add(self, record: StepRecord) -> None:
        self.steps += 1
        self.seconds += record.seconds
        self.wait += record.wait
        self.decode_rows += record.decode_rows
        self.prefill_tokens += record.prefill_tokens


class Stepper:
    """Steps a Scheduler's requests through a ModelRunner.

    Args:
        overlap: postprocess each step while the device runs the next (None: on a GPU only, where it helps; on a
            CPU the device work is the host's, so there is nothing to overlap).
        history: how many `StepRecord`s to keep.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        overlap: bool | None = None,
        history: int = 4096,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = runner.device.type == "cuda" if overlap is None else overlap
        self._in_flight: tuple[ScheduledStep, StepHandle] | None = None
        self.history: deque[StepRecord] = deque(maxlen=history)  # the latest steps, for benchmarks and metrics
        self.totals = StepTotals()
        self._wait = 0.0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    @property
    def steps(self) -> int:
        return self.totals.steps

    def step(self, send: Callable[[list[Output]], None] | None = None) -> list[Output]:
        """Schedule and launch one step; postprocess it (or, overlapped, the one before it). Returns what the
        postprocess produced: each request's new outputs, and the errors of requests that failed, in order.

        send: where the outputs of the step in flight go when they are ready before this step's launch (an eager
            prefill takes the host tens of milliseconds to launch, and streams should not wait for it): a serving
            loop sends them at once. Without it they are returned with the rest.
        """
        start, self._wait = time.perf_counter(), 0.0
        step = self.scheduler.schedule()
        outputs = list(step.refused)
        previous, self._in_flight = self._in_flight, None
        if previous is not None and step.prefill and not self.runner.replays_prefill(step):
            # Launching an eager prefill takes the host tens of milliseconds (hundreds of kernel launches): the
            # tokens of the step in flight go out first rather than wait for it. A replayed one (a CUDA graph) is
            # one upload and one replay to queue, so it goes first and the device does not idle behind the host.
            outputs += self._postprocess(*previous)
            previous = None
            if send is not None and outputs:
                send(outputs)
                outputs = []
        launched = None
        if step.runs_model and previous is not None and _follows_grammar(step):
            # A constrained row's mask depends on the token the step in flight is sampling: the forward pass goes
            # first; while the device runs it, that token is read and the grammars advanced, and the sampling is
            # launched under the new masks; the rest of the previous step's host work follows.
            logits = self.runner.forward(step)
            sampled = self._result(previous[1])
            self.scheduler.advance_grammars(previous[0], sampled)
            launched = (step, self.runner.sample(step, logits))
            outputs += self.scheduler.postprocess(previous[0], sampled)
            previous = None
        elif step.runs_model:
            launched = (step, self.runner.launch(step))
        if previous is not None:
            outputs += self._postprocess(*previous)
        if launched is not None:
            if self.overlap:
                self._in_flight = launched
            else:
                outputs += self._postprocess(*launched)
        if launched is None and previous is None:
            outputs += self.scheduler.retire()  # only aborted requests left: free their slots
        prefill_tokens = sum(map(len, step.chunks))
        record = StepRecord(start, time.perf_counter(), len(step.decode), prefill_tokens, self._wait)
        self.history.append(record)
        self.totals.add(record)
        return outputs

    def _postprocess(self, step: ScheduledStep, handle: StepHandle) -> list[Output]:
        return self.scheduler.postprocess(step, self._result(handle))

    def _result(self, handle: StepHandle) -> SampledTokens:
        """A launched step's tokens (waiting for the device, counted as the step's wait)."""
        start = time.perf_counter()
        sampled = handle.result()
        self._wait += time.perf_counter() - start
        return sampled

    def discard_in_flight(self) -> None:
        """Forget the step in flight without reading it (its requests are being failed)."""
        self._in_flight = None


def _follows_grammar(step: ScheduledStep) -> bool:
    """Whether a decode row of `step` is constrained by a grammar (its mask needs the previous step's token)."""
    return any(seq.matcher is not None for seq in step.decode)
