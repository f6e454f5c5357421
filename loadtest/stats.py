"""Small statistics for the reports: percentiles of latency samples and a least-squares line through memory points."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class Percentiles:
    """p50/p90/p99 and mean of a sample, in the sample's unit (None when the sample is empty)."""

    n: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        data = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
        if data.size == 0:
            return cls(n=0)
        p50, p90, p99 = (float(x) for x in np.percentile(data, PERCENTILES))
        return cls(n=int(data.size), mean=float(data.mean()), p50=p50, p90=p90, p99=p99)


@dataclass
class LinearFit:
    """y = intercept + slope * x by least squares over `n` points; `r2` is None when y does not vary."""

    slope: float
    intercept: float
    n: int
    r2: float | None
    x_min: float
    x_max: float

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LinearFit | None:
    """The least-squares line through (xs, ys); None with fewer than two distinct x values (no slope is defined)."""
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    if x.size < 2 or np.unique(x).size < 2:
        return None
    # Centre x first: contexts reach 1e5 and bytes 1e9, and the centred normal equations stay well conditioned.
    xm, ym = x.mean(), y.mean()
    dx, dy = x - xm, y - ym
    slope = float((dx * dy).sum() / (dx * dx).sum())
    intercept = float(ym - slope * xm)
    ss_tot = float((dy * dy).sum())
    residual = y - (intercept + slope * x)
    r2 = None if ss_tot == 0 else 1.0 - float((residual * residual).sum()) / ss_tot
    return LinearFit(slope=slope, intercept=intercept, n=int(x.size), r2=r2, x_min=float(x.min()), x_max=float(x.max()))
