"""Reading a server's `GET /metrics` (Prometheus text format): samples, kvfree's memory gauges, and latency
percentiles estimated from the difference of two histogram scrapes.

Only the text format is parsed here (no prometheus_client dependency): the load generator runs anywhere httpx does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

# kvfree's histograms (server/metrics.py): client-side numbers are the primary ones, these are a cross-check.
TTFT_HISTOGRAM = "kvfree_time_to_first_token_seconds"
ITL_HISTOGRAM = "kvfree_inter_token_latency_seconds"


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


@dataclass
class MetricsSnapshot:
    """One scrape: sample name -> list of (labels, value). Names keep their suffixes (`_bucket`, `_total`...)."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        snap = cls()
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue  # a line of another exposition dialect: skip it rather than fail the run
            name, raw_labels, raw_value = m.groups()
            try:
                value = float(raw_value)
            except ValueError:
                continue
            labels = {k: _unescape(v) for k, v in _LABEL.findall(raw_labels or "")}
            snap.samples.setdefault(name, []).append((labels, value))
        return snap

    def value(self, name: str, **labels: str) -> float | None:
        """The first sample of `name` whose labels include `labels`, or None when the server does not export it."""
        for sample_labels, value in self.samples.get(name, []):
            if all(sample_labels.get(k) == v for k, v in labels.items()):
                return value
        return None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """{label value: sample value} for every sample of `name` (e.g. sessions by location)."""
        return {lab[label]: v for lab, v in self.samples.get(name, []) if label in lab}

    def histogram(self, name: str) -> tuple[list[tuple[float, float]], float, float] | None:
        """(cumulative buckets [(le, count)] sorted by le, sum, count) of histogram `name`, or None."""
        buckets = [(float(lab["le"]), v) for lab, v in self.samples.get(f"{name}_bucket", []) if "le" in lab]
        if not buckets:
            return None
        return sorted(buckets), self.value(f"{name}_sum") or 0.0, self.value(f"{name}_count") or 0.0

    @property
    def is_kvfree(self) -> bool:
        return "kvfree_pool_slots_total" in self.samples


@dataclass
class ServerMemory:
    """kvfree's memory gauges at one moment (None: not exported by this server). Bytes unless said otherwise."""

    state_bytes_in_use: float | None = None
    state_bytes_per_session: float | None = None  # at the server's reserved max_context for the attention baseline
    pool_slots_used: float | None = None
    pool_slots_total: float | None = None
    gpu_memory_allocated: float | None = None  # 0 on a CPU server
    gpu_memory_reserved: float | None = None
    sessions: dict[str, float] = field(default_factory=dict)  # by location: gpu, host, disk

    @classmethod
    def of(cls, snap: MetricsSnapshot) -> ServerMemory:
        return cls(
            state_bytes_in_use=snap.value("kvfree_state_bytes_in_use"),
            state_bytes_per_session=snap.value("kvfree_state_bytes_per_session"),
            pool_slots_used=snap.value("kvfree_pool_slots_used"),
            pool_slots_total=snap.value("kvfree_pool_slots_total"),
            gpu_memory_allocated=snap.value("kvfree_gpu_memory_allocated_bytes"),
            gpu_memory_reserved=snap.value("kvfree_gpu_memory_reserved_bytes"),
            sessions=snap.by_label("kvfree_sessions", "location"),
        )


def histogram_quantiles(
    before: MetricsSnapshot | None, after: MetricsSnapshot | None, name: str, quantiles: tuple[float, ...]
) -> dict[str, float] | None:
    """Quantiles of the observations made between two scrapes of histogram `name`, interpolated linearly inside
    buckets as Prometheus' `histogram_quantile` does (so they are only as fine as the buckets). None when the
    histogram is missing or nothing was observed in between."""
    if after is None:
        return None
    late = after.histogram(name)
    if late is None:
        return None
    early = before.histogram(name) if before is not None else None
    early_counts = dict(early[0]) if early else {}
    buckets = [(le, count - early_counts.get(le, 0.0)) for le, count in late[0]]
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    out: dict[str, float] = {}
    for q in quantiles:
        rank = q * total
        prev_le, prev_count = 0.0, 0.0
        value = math.nan
        for le, count in buckets:
            if count >= rank:
                if math.isinf(le):
                    value = prev_le  # above the largest finite bucket: its bound is all that is known
                else:
                    width = count - prev_count
                    value = prev_le + (le - prev_le) * ((rank - prev_count) / width if width > 0 else 1.0)
                break
            prev_le, prev_count = le, count
        out[f"p{round(q * 100):d}"] = value
    return out


def engine_pace(before: MetricsSnapshot | None, after: MetricsSnapshot | None, wall: float) -> dict[str, float] | None:
    """Where a kvfree engine's time went between two scrapes `wall` seconds apart, from its counters since start
    (server/metrics.py): the steps it ran, the mean step, the share of the interval it was stepping (`busy_share`; the
    rest it idled waiting for requests or handled commands), the share of its step time spent waiting for the device
    (`device_wait_share`; near 0: the engine's host work sets the pace, near 1: the GPU does), and the decode rows and
    prefill tokens of a mean step. None when the server does not export them or ran no step in between."""
    names = {
        "steps": "kvfree_engine_steps",
        "busy": "kvfree_engine_busy_seconds",
        "wait": "kvfree_engine_device_wait_seconds",
        "decode": "kvfree_engine_decode_rows",
        "prefill": "kvfree_engine_prefill_tokens",
    }
    if before is None or after is None or wall <= 0:
        return None
    delta: dict[str, float] = {}
    for key, name in names.items():
        early, late = before.value(name), after.value(name)
        if early is None or late is None:
            return None
        delta[key] = late - early
    if delta["steps"] <= 0 or delta["busy"] <= 0:
        return None
    steps = delta["steps"]
    return {
        "steps": steps,
        "step_ms_mean": 1000 * delta["busy"] / steps,
        "busy_share": delta["busy"] / wall,
        "device_wait_share": delta["wait"] / delta["busy"],
        "decode_rows_per_step": delta["decode"] / steps,
        "prefill_tokens_per_step": delta["prefill"] / steps,
    }
