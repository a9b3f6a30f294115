"""Per-revision figures of the names whose traffic is split (a canary beside its stable): what a
rollout controller compares, read from `GET /admin/revisions` or from the `loraplex_revision_*`
series. A name's figures exist only while its traffic is split, so their number is bounded by the
canaries in progress, not by the adapters."""

from __future__ import annotations

import math
import threading

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from loraplex.rollout.figures import BOUNDS_S, RevisionFigures


def is_error(status: int) -> bool:
    """A server-side failure: 5xx. A client's mistake (4xx) or its leaving (499) says nothing of the
    revision."""
    return status >= 500


class RevisionBook:
    """Name -> revision -> figures since the name's split was first seen here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: dict[str, dict[str, RevisionFigures]] = {}

    def record(
        self,
        name: str,
        revision: str,
        in_split: bool,
        status: int,
        ttft_s: float | None,
        tpot_s: float | None,
    ) -> None:
        """One finished request; one for a name no longer split drops the name's figures."""
        with self._lock:
            if not in_split:
                self._names.pop(name, None)
                return
            revisions = self._names.setdefault(name, {})
            figures = revisions.setdefault(revision, RevisionFigures())
            figures.record(not is_error(status), ttft_s, tpot_s)

    def snapshot(self, name: str | None = None) -> dict[str, dict[str, dict]]:
        """{name: {revision: figures as JSON}}, of one name or all."""
        with self._lock:
            names = [name] if name is not None else list(self._names)
            return {
                n: {rev: f.to_json() for rev, f in self._names[n].items()}
                for n in names
                if n in self._names
            }

    def items(self) -> list[tuple[str, str, RevisionFigures]]:
        with self._lock:
            return [
                (n, rev, RevisionFigures.from_json(f.to_json()))
                for n, revisions in self._names.items()
                for rev, f in revisions.items()
            ]


class RevisionCollector:
    """The book as Prometheus series `loraplex_revision_{requests,errors}_total` and
    `loraplex_revision_{ttft,tpot}_seconds` (histograms), labelled `adapter` and `revision`."""

    def __init__(self, book: RevisionBook):
        self.book = book

    def describe(self):
        return []

    def collect(self):
        labels = ["adapter", "revision"]
        requests = CounterMetricFamily(
            "loraplex_revision_requests", "Requests of a revision in a split", labels=labels
        )
        errors = CounterMetricFamily(
            "loraplex_revision_errors",
            "Requests of a revision in a split that failed on the server (5xx)",
            labels=labels,
        )
        ttft = HistogramMetricFamily(
            "loraplex_revision_ttft_seconds",
            "Time to first token of a revision in a split",
            labels=labels,
        )
        tpot = HistogramMetricFamily(
            "loraplex_revision_tpot_seconds",
            "Time per output token of a revision in a split",
            labels=labels,
        )
        for name, revision, figures in self.book.items():
            requests.add_metric([name, revision], figures.requests)
            errors.add_metric([name, revision], figures.errors)
            for family, histogram in ((ttft, figures.ttft), (tpot, figures.tpot)):
                family.add_metric([name, revision], _buckets(histogram.counts), histogram.sum_s)
        return [requests, errors, ttft, tpot]


def _buckets(counts: list[float]) -> list[tuple[str, float]]:
    """Cumulative counts by `le`, +Inf last."""
    out, cumulative = [], 0.0
    for bound, count in zip([*BOUNDS_S, math.inf], counts):
        cumulative += count
        out.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
    return out
