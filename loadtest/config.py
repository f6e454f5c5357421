"""What a load test does: one `LoadTestConfig`, and the two profiles its defaults come from.

`quick` finishes in under two minutes on a CPU against the tiny checkpoints (a server and a baseline): short
contexts, 1-4 concurrent clients, a ~20 s soak. `gpu` is the sweep for a real device: contexts 1K
to 128K, 1 to 256 concurrent clients, a 45-second soak, about seven minutes in all. Every list and bound can be
overridden flag by flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvfree.loadtest.workload import LengthDistribution, WorkloadSpec

SCENARIOS = ("context", "concurrency", "soak")


def _powers_of_two(low: int, high: int) -> list[int]:
    return [2**k for k in range(int(math.log2(low)), int(math.log2(high)) + 1)]


@dataclass
class LoadTestConfig:
    """Everything one run needs; the defaults are the quick profile. Lengths are tokens, except the prompt lengths
    of the chat workload (characters: one token each with kvfree's byte-level tokenizer)."""

    url: str
    out: Path
    profile: str
    baseline_url: str | None = None
    model: str | None = None  # None: the first id of GET /v1/models
    baseline_model: str | None = None
    api_key: str | None = None
    baseline_api_key: str | None = None
    scenarios: tuple[str, ...] = SCENARIOS
    seed: int = 0
    ignore_eos: bool = True  # send `ignore_eos` (kvfree and vLLM extension) so outputs have the lengths asked for
    # context sweep
    contexts: list[int] = field(default_factory=lambda: _powers_of_two(64, 1024))
    decode_tokens: int = 16
    # More lengths for the sessions-that-fit table, where it is extrapolated from the fit (unless measured).
    capacity_contexts: list[int] = field(default_factory=lambda: [4096, 16384, 32768, 131072])
    device_memory_gib: float = 80.0
    # concurrency sweep
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4])
    requests_per_worker: int = 4
    min_requests_per_level: int = 8
    level_seconds: float = 15.0
    temperature: float = 0.7
    workload: WorkloadSpec = field(
        default_factory=lambda: WorkloadSpec(LengthDistribution(48, 0.6, 8, 192), LengthDistribution(12, 0.4, 4, 24))
    )
    # session soak
    soak_seconds: float = 20.0
    soak_sessions: int | None = None  # None: twice the server's pool slots
    soak_turns: int = 50
    soak_max_tokens: int = 8
    soak_user_chars: int = 24
    soak_concurrency: int | None = None  # None: the pool's slot count
    inject_mismatch: bool = False
    # bounds
    request_timeout: float = 60.0
    time_limit: float = 110.0  # the whole run; scenarios not finished by then stop and say so

    @property
    def max_connections(self) -> int:
        return max([*self.concurrency, self.soak_concurrency or 0, 8]) * 2 + 8


PROFILES: dict[str, dict] = {
    "quick": {},  # the defaults of LoadTestConfig
    # Sized to finish in about seven minutes on one H100/H200 against a ~370M model and its attention baseline
    # (PyTorch reference kernels), server start-up included.
    "gpu": {
        "contexts": [1024, 4096, 16384, 32768, 65536, 131072],
        "decode_tokens": 16,
        "capacity_contexts": [262144, 1048576],
        "concurrency": [1, 16, 64, 256],
        "requests_per_worker": 1,
        "min_requests_per_level": 8,
        "level_seconds": 30.0,
        "workload": WorkloadSpec(LengthDistribution(512, 1.0, 32, 4096), LengthDistribution(32, 0.5, 8, 128)),
        "soak_seconds": 45.0,
        "soak_turns": 100,
        "soak_max_tokens": 16,
        "request_timeout": 120.0,
        "time_limit": 400.0,
    },
}


def profile_config(profile: str, url: str, out: Path, **overrides) -> LoadTestConfig:
    """The profile's config with `overrides` (only those not None) applied on top."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    base = LoadTestConfig(url=url, out=out, profile=profile, **PROFILES[profile])
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
