"""Step time and time per output token by rank bucket: what both engines keep for the rank-skew
series (`loraplex_engine_step_seconds`, `loraplex_request_tpot_by_rank_seconds`). A handful of
buckets, never a label per adapter or per rank."""

from __future__ import annotations

import bisect
import threading

RANK_LIMITS = (8, 16, 64)
RANK_BUCKETS = ("base", "<=8", "<=16", "<=64", ">64")
"""`base`: no adapter (a step without one, a base-model request)."""
STEP_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TPOT_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def rank_bucket(rank: int | None) -> str:
    """The bucket of an adapter's rank; `base` for none (rank None or 0)."""
    if not rank:
        return "base"
    for limit in RANK_LIMITS:
        if rank <= limit:
            return f"<={limit}"
    return f">{RANK_LIMITS[-1]}"


class RankHistogram:
    """Observations per rank bucket, counted in fixed bounds (Prometheus `le` semantics: a value
    equal to a bound counts in it). Written by an engine's step loop, read by the metrics."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self._lock = threading.Lock()
        # per bucket: [count per bound, then the count above the last] and the sum
        self._counts = {b: [0] * (len(bounds) + 1) for b in RANK_BUCKETS}
        self._sums = dict.fromkeys(RANK_BUCKETS, 0.0)

    def observe(self, bucket: str, seconds: float) -> None:
        index = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            self._counts[bucket][index] += 1
            self._sums[bucket] += seconds

    def snapshot(self) -> dict:
        """Plain data (it crosses the engine process's wire): {"bounds", "buckets": {rank bucket:
        {"counts": per bound, not cumulative, the last above every bound; "sum"}}}."""
        with self._lock:
            return {
                "bounds": list(self.bounds),
                "buckets": {
                    b: {"counts": list(self._counts[b]), "sum": self._sums[b]} for b in RANK_BUCKETS
                },
            }


class RankSkew:
    """An engine's two rank-skew histograms."""

    def __init__(self):
        self.step = RankHistogram(STEP_BOUNDS)
        """Each step's duration, by the largest rank among the adapters in its batch."""
        self.tpot = RankHistogram(TPOT_BOUNDS)
        """Each finished sequence's time per output token after the first, by its adapter's rank."""

    def snapshot(self) -> dict:
        return {"step_seconds": self.step.snapshot(), "tpot_seconds": self.tpot.snapshot()}
