"""Where a rollout's figures come from: the workers' `GET /admin/revisions`, merged here, or
Prometheus' `loraplex_revision_*` series by PromQL. Both give, for a window, each revision's
counts and its histograms summed over the fleet; the percentiles are taken from those sums."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from loraplex.rollout.figures import BOUNDS_S, Histogram, RevisionFigures, merge

log = logging.getLogger("loraplex.rollout")


class SourceError(RuntimeError):
    """The figures could not be read (no worker answered, Prometheus refused the query)."""


class FigureSource(Protocol):
    def mark(self, name: str) -> Any:
        """A start of a window."""

    def since(self, mark: Any, name: str) -> dict[str, RevisionFigures]:
        """Each revision's figures from `mark` to now, over the fleet."""


@dataclass(frozen=True)
class WorkerMark:
    by_worker: dict[str, dict[str, RevisionFigures]]


class WorkerSource:
    """Each worker's cumulative figures; a window is the difference per worker, then the sum. A
    worker that does not answer is left out of that read (and logged)."""

    def __init__(self, workers: tuple[str, ...], client: httpx.Client):
        self.workers = workers
        self.client = client

    def read(self, name: str) -> dict[str, dict[str, RevisionFigures]]:
        out = {}
        for url in self.workers:
            try:
                r = self.client.get(f"{url}/admin/revisions", params={"name": name})
                r.raise_for_status()
                body = r.json()
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("%s: figures not read: %s", url, exc)
                continue
            if [round(b, 9) for b in body.get("bounds_s", ())] != list(BOUNDS_S):
                raise SourceError(f"{url} reports histograms on other bucket bounds")
            revisions = body.get("adapters", {}).get(name, {})
            out[url] = {rev: RevisionFigures.from_json(f) for rev, f in revisions.items()}
        if not out:
            raise SourceError(
                f"no worker answered GET /admin/revisions ({', '.join(self.workers)})"
            )
        return out

    def mark(self, name: str) -> WorkerMark:
        return WorkerMark(self.read(name))

    def since(self, mark: WorkerMark, name: str) -> dict[str, RevisionFigures]:
        parts = []
        for url, revisions in self.read(name).items():
            before = mark.by_worker.get(url, {})
            parts.append(
                {rev: f.since(before[rev]) if rev in before else f for rev, f in revisions.items()}
            )
        return merge(parts)


class PrometheusSource:
    """The fleet's counters summed by revision (and by `le` for the histograms) in PromQL at the
    window's start and now, then subtracted as the workers' source does: exact counts, no
    `increase()` extrapolation, a series born inside the window counted whole."""

    def __init__(self, url: str, client: httpx.Client, clock=time.time):
        self.url = url.rstrip("/")
        self.client = client
        self.clock = clock

    def mark(self, name: str) -> dict[str, RevisionFigures]:
        return self.read(name, self.clock())

    def since(self, mark: dict[str, RevisionFigures], name: str) -> dict[str, RevisionFigures]:
        now = self.read(name, self.clock())
        return {rev: f.since(mark[rev]) if rev in mark else f for rev, f in now.items()}

    def read(self, name: str, at: float) -> dict[str, RevisionFigures]:
        """Each revision's figures summed over the fleet as last scraped by `at`."""
        match = f'{{adapter="{name}"}}'
        out: dict[str, RevisionFigures] = {}
        for series, field in (("requests_total", "requests"), ("errors_total", "errors")):
            query = f"sum by (revision) (loraplex_revision_{series}{match})"
            for row in self.query(query, at):
                figures = out.setdefault(row["metric"]["revision"], RevisionFigures())
                setattr(figures, field, _value(row))
        for kind in ("ttft", "tpot"):
            for revision, histogram in self._histograms(kind, match, at).items():
                setattr(out.setdefault(revision, RevisionFigures()), kind, histogram)
        return out

    def _histograms(self, kind: str, match: str, at: float) -> dict[str, Histogram]:
        series = f"loraplex_revision_{kind}_seconds"
        buckets = self.query(f"sum by (revision, le) ({series}_bucket{match})", at)
        sums = self.query(f"sum by (revision) ({series}_sum{match})", at)
        by_revision: dict[str, dict[float, float]] = {}
        for row in buckets:
            le = row["metric"]["le"]
            bound = math.inf if le == "+Inf" else round(float(le), 9)
            by_revision.setdefault(row["metric"]["revision"], {})[bound] = _value(row)
        total = {row["metric"]["revision"]: _value(row) for row in sums}
        return {
            rev: Histogram.from_cumulative(b, total.get(rev, 0.0)) for rev, b in by_revision.items()
        }

    def query(self, promql: str, at: float) -> list[dict]:
        try:
            r = self.client.get(f"{self.url}/api/v1/query", params={"query": promql, "time": at})
            body = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise SourceError(f"Prometheus at {self.url}: {exc}") from None
        if body.get("status") != "success":
            raise SourceError(f"Prometheus refused {promql!r}: {body.get('error')}")
        return body["data"]["result"]


def _value(row: dict) -> float:
    value = float(row["value"][1])
    return 0.0 if math.isnan(value) else value
