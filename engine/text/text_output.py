"""TextOutput: one choice's text as its tokens arrive, detokenized incrementally and cut at the first stop string.

The engine runs it for offline generation (`LLM`); a serving front runs it on its side of the engine (the engine then
only checks token-level stops: EOS, stop token ids, max_tokens), so that detokenizing and stop strings never take
the engine's time.
"""

from __future__ import annotations

from kvfree.engine.text.tokenizer import IncrementalDetokenizer, Tokenizer


class TextOutput:
    """The text of a sequence of tokens: `add` them one by one, `take_delta` what is new.

    The text (with any stop string cut off) = the pieces handed out by `take_delta()` + the rest. Only the rest is
    touched per token, so a token costs O(its characters) however long the output grows. While the output may go
    on, the tail that could still become a stop string is held back.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = list(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # characters a partial stop string can take
        self.stopped = False  # a stop string completed: the text ends before it
        self._sent: list[str] = []
        self._unsent = ""

    def add(self, token_id: int) -> bool:
        """Append one token's text; True when that completes a stop string (the text is then cut before it)."""
        new = self.detokenizer.add(token_id)
        self._unsent += new
        if self.stop and new:
            # A stop string can only complete inside the new text plus the longest stop's length before it, which
            # take_delta() holds back, so the window lies inside the unsent text.
            start = max(0, len(self._unsent) - len(new) - self._hold)
            hits = [i for s in self.stop if (i := self._unsent.find(s, start)) >= 0]
            if hits:
                self._unsent = self._unsent[: min(hits)]
                self.stopped = True
        return self.stopped

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out; unless `final` (the output ended), without the tail that could still become a
        stop string."""
        end = len(self._unsent)
        if not final and self.stop:
            end = max(0, end - self._hold)
        delta, self._unsent = self._unsent[:end], self._unsent[end:]
        if delta:
            self._sent.append(delta)
        return delta

    @property
    def text(self) -> str:
        return "".join(self._sent) + self._unsent
