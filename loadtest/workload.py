"""What the load generator sends: seeded prompt and output lengths, prompt text, and token-id prompts.

Every draw comes from a `random.Random(seed)`, so the same flags send the same requests to both servers of a
side-by-side run and to the same server on another day.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Plain English words: prompts look like text to any tokenizer (with kvfree's byte-level tokenizer one character
# is one token, so a prompt of N characters is N tokens; a BPE tokenizer gives roughly N/4).
_WORD_TEXT = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but what "
    "all were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now people "
    "my made over did down only way find use may water long little very after words called just where most know "
    "server state session memory token model context length request stream latency recurrent cache prompt reply"
)
_WORDS = tuple(_WORD_TEXT.split())

# Token ids used for token-id prompts: printable ASCII bytes, valid in any vocabulary of 127 tokens or more, and
# never a special token of kvfree's byte-level tokenizer (ids 256+).
TOKEN_ID_LOW, TOKEN_ID_HIGH = 32, 127


@dataclass(frozen=True)
class LengthDistribution:
    """A lognormal length (median, sigma of log) rounded and clipped to [low, high]."""

    median: int
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(0.0, self.sigma) * self.median) if self.sigma > 0 else self.median
        return max(self.low, min(self.high, value))


@dataclass(frozen=True)
class WorkloadSpec:
    """Prompt length (characters) and output length (`max_tokens`) distributions of the concurrency sweep."""

    prompt: LengthDistribution
    output: LengthDistribution


@dataclass(frozen=True)
class RequestSpec:
    """One chat request: the user message and the number of tokens to generate."""

    prompt: str
    max_tokens: int


def filler_text(rng: random.Random, n_chars: int) -> str:
    """Words drawn from `_WORDS`, cut to exactly `n_chars` characters (at least 1)."""
    n_chars = max(1, n_chars)
    words: list[str] = []
    size = 0
    while size < n_chars:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:n_chars].rstrip() or "hello"


def sample_requests(spec: WorkloadSpec, n: int, seed: int) -> list[RequestSpec]:
    """`n` requests with lengths from `spec`, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len = spec.prompt.sample(rng)
        max_tokens = spec.output.sample(rng)
        out.append(RequestSpec(prompt=filler_text(rng, prompt_len), max_tokens=max_tokens))
    return out


def random_token_ids(rng: random.Random, n: int) -> list[int]:
    """`n` token ids in [TOKEN_ID_LOW, TOKEN_ID_HIGH): a prompt of exactly `n` tokens on any server."""
    return [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(n)]


def user_turn(seed: int, session: int, turn: int, n_chars: int) -> str:
    """The user message of `turn` in soak session `session`: distinct per session (so that a session continued
    from another one's state would answer differently) and the same whatever order concurrent turns run in."""
    rng = random.Random(seed * 1_000_003 + session * 10_007 + turn)
    return f"Session {session}, turn {turn}: {filler_text(rng, n_chars)}"
