"""The front's side of a request's text: the engine sends token ids, this turns them into text and finds stop strings.

The engine checks only token-level stops (EOS, stop token ids, max_tokens) for the server's requests; detokenizing
each token and searching for stop strings happen here, in the HTTP front, so that they never take the engine's
time (with the engine in its own process, they run on another core). When a choice's stop string completes, its
tokens after the stop are dropped (the engine may already have sampled a few more) and it finishes with "stop";
the caller then stops that choice in the engine (the whole request once every choice has finished).
"""

from __future__ import annotations

from dataclasses import replace

from kvfree.engine.protocol import RequestOutput, SamplingParams
from kvfree.engine.text.text_output import TextOutput
from kvfree.engine.text.tokenizer import Tokenizer


class ChoiceTexts:
    """The text of each of a request's `n` choices, as its outputs arrive."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, n: int) -> None:
        self._texts = [TextOutput(tokenizer, params.stop, params.skip_special_tokens) for _ in range(n)]
        self.finished = [False] * n
        self._end_tokens = params.end_token_ids(tokenizer.eos_token_id)

    @property
    def all_finished(self) -> bool:
        return all(self.finished)

    def add(self, out: RequestOutput) -> RequestOutput | None:
        """`out` (token ids, no text) with its text, cut at a stop string; None for what follows a finished choice."""
        i = out.index
        if self.finished[i]:
            return None
        text, kept, finish = self._texts[i], len(out.token_ids), out.finish_reason
        # An engine "stop" on the EOS or a stop token: that token has no text of its own (as offline generation).
        # (A "stop" where the output's grammar is complete ends on a token of the reply.)
        ends_on_stop_token = finish == "stop" and out.token_ids and out.token_ids[-1] in self._end_tokens
        speaking = out.token_ids[:-1] if ends_on_stop_token else out.token_ids
        for k, token in enumerate(speaking):
            if text.add(token):
                kept, finish = k + 1, "stop"
                break
        self.finished[i] = finish is not None
        delta = text.take_delta(final=finish is not None)
        if kept < len(out.token_ids):  # cut at a stop string: what the engine sampled after it is not the reply's
            return replace(out, token_ids=out.token_ids[:kept], logprobs=out.logprobs[:kept], text=delta,
                           finish_reason=finish)  # fmt: skip
        out.text, out.finish_reason = delta, finish  # (a fresh object from the engine: nothing else holds it)
        return out
