"""Per-revision request figures that merge across workers: counts and latency histograms on one
fixed set of bucket bounds, so that a fleet's percentile comes from the summed buckets, never from
averaged percentiles. Pure (no loraplex imports): the server records them, the rollout controller
merges them."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

GROWTH = 1.25
"""Each bucket's upper bound is this times the previous one: a percentile is known within 25%."""
FIRST_BOUND_S = 0.0005
NUM_BOUNDS = 64
BOUNDS_S: tuple[float, ...] = tuple(round(FIRST_BOUND_S * GROWTH**i, 9) for i in range(NUM_BOUNDS))
"""Upper bounds in seconds, 0.5 ms to about 640 s; a last bucket above them takes the rest."""


@dataclass
class Histogram:
    """Observation counts per bucket of `BOUNDS_S` (the last one: above every bound)."""

    counts: list[float] = field(default_factory=lambda: [0.0] * (NUM_BOUNDS + 1))
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BOUNDS_S, seconds)] += 1
        self.sum_s += seconds

    @property
    def total(self) -> float:
        return sum(self.counts)

    def merged(self, other: Histogram) -> Histogram:
        return Histogram(
            [a + b for a, b in zip(self.counts, other.counts)], self.sum_s + other.sum_s
        )

    def since(self, earlier: Histogram) -> Histogram:
        """The observations made after `earlier` was read (the whole of this one when it counts
        fewer in some bucket: its process restarted meanwhile)."""
        deltas = [a - b for a, b in zip(self.counts, earlier.counts)]
        if min(deltas) < 0:
            return Histogram(list(self.counts), self.sum_s)
        return Histogram(deltas, max(0.0, self.sum_s - earlier.sum_s))

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the nearest-rank `q` quantile (q in 0..1), in
        seconds; None when empty. Above the last bound it is the last bound."""
        total = self.total
        if total <= 0:
            return None
        rank = max(1.0, math.ceil(q * total - 1e-9))
        cumulative = 0.0
        for index, count in enumerate(self.counts):
            cumulative += count
            if cumulative >= rank - 1e-9:
                return BOUNDS_S[min(index, NUM_BOUNDS - 1)]
        return BOUNDS_S[-1]

    def to_json(self) -> dict:
        """{"counts": {bucket index: count} of the buckets that hold any, "sum_s": seconds}."""
        return {"counts": {str(i): c for i, c in enumerate(self.counts) if c}, "sum_s": self.sum_s}

    @classmethod
    def from_json(cls, data: dict) -> Histogram:
        counts = [0.0] * (NUM_BOUNDS + 1)
        for index, count in (data.get("counts") or {}).items():
            i = int(index)
            if not 0 <= i <= NUM_BOUNDS or float(count) < 0:
                raise ValueError(f"bucket {index!r}: {count!r} is not a bucket count")
            counts[i] = float(count)
        return cls(counts, float(data.get("sum_s") or 0.0))

    @classmethod
    def from_cumulative(cls, by_bound: dict[float, float], sum_s: float = 0.0) -> Histogram:
        """From Prometheus-style cumulative counts by upper bound (`le`, +Inf included)."""
        cumulative = [by_bound.get(b, 0.0) for b in BOUNDS_S] + [by_bound.get(math.inf, 0.0)]
        counts = [max(0.0, c - p) for c, p in zip(cumulative, [0.0, *cumulative[:-1]])]
        return cls(counts, sum_s)


@dataclass
class RevisionFigures:
    """One revision's requests, errors and latency histograms (over a window, or since a start)."""

    requests: float = 0.0
    errors: float = 0.0
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)

    def record(self, ok: bool, ttft_s: float | None, tpot_s: float | None) -> None:
        self.requests += 1
        self.errors += 0 if ok else 1
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def merged(self, other: RevisionFigures) -> RevisionFigures:
        return RevisionFigures(
            self.requests + other.requests,
            self.errors + other.errors,
            self.ttft.merged(other.ttft),
            self.tpot.merged(other.tpot),
        )

    def since(self, earlier: RevisionFigures) -> RevisionFigures:
        if self.requests < earlier.requests:  # the worker restarted: all of this is new
            return self
        return RevisionFigures(
            self.requests - earlier.requests,
            max(0.0, self.errors - earlier.errors),
            self.ttft.since(earlier.ttft),
            self.tpot.since(earlier.tpot),
        )

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def summary(self) -> dict:
        """What a decision records: counts, the error rate, p50 and p99 in ms."""
        ms = lambda s: None if s is None else round(s * 1000, 3)  # noqa: E731
        return {
            "requests": round(self.requests, 3),
            "errors": round(self.errors, 3),
            "error_rate": round(self.error_rate, 6),
            "ttft_p50_ms": ms(self.ttft.quantile(0.5)),
            "ttft_p99_ms": ms(self.ttft.quantile(0.99)),
            "tpot_p50_ms": ms(self.tpot.quantile(0.5)),
            "tpot_p99_ms": ms(self.tpot.quantile(0.99)),
        }

    def to_json(self) -> dict:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "ttft": self.ttft.to_json(),
            "tpot": self.tpot.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict) -> RevisionFigures:
        return cls(
            float(data.get("requests", 0)),
            float(data.get("errors", 0)),
            Histogram.from_json(data.get("ttft") or {}),
            Histogram.from_json(data.get("tpot") or {}),
        )


def merge(parts: list[dict[str, RevisionFigures]]) -> dict[str, RevisionFigures]:
    """Revision -> figures summed over the parts (one per worker)."""
    out: dict[str, RevisionFigures] = {}
    for part in parts:
        for revision, figures in part.items():
            out[revision] = out[revision].merged(figures) if revision in out else figures
    return out
