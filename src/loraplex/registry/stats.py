"""Per-revision request counts, error rate and latency percentiles, read from the server's audit log
(JSONL)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class RevisionStats:
    revision: str
    requests: int
    errors: int
    error_rate: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of the values, None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def is_error(status) -> bool:
    """`status` is an HTTP code or a word; 2xx/3xx, "ok" and "success" are not errors."""
    if isinstance(status, bool) or status is None:
        return status is False
    if isinstance(status, int | float):
        return status >= 400
    text = str(status).strip().lower()
    if text.isdigit():
        return int(text) >= 400
    return text not in ("ok", "success", "completed", "stop", "length")


def revision_stats(audit_log: str | Path, name: str) -> list[RevisionStats]:
    """One entry per revision of `name` seen in the log (lines that are not JSON objects are
    skipped)."""
    by_revision: dict[str, list[dict]] = {}
    with Path(audit_log).open() as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict):
                continue
            adapter, _, pinned = str(row.get("adapter") or "").partition("@")
            if adapter == name:
                by_revision.setdefault(str(row.get("revision") or pinned or "?"), []).append(row)
    return [_summarize(rev, rows) for rev, rows in sorted(by_revision.items())]


def _summarize(revision: str, rows: list[dict]) -> RevisionStats:
    errors = sum(is_error(r.get("status")) for r in rows)
    ttft = [float(r["ttft_ms"]) for r in rows if isinstance(r.get("ttft_ms"), int | float)]
    tpot = [float(r["tpot_ms"]) for r in rows if isinstance(r.get("tpot_ms"), int | float)]
    return RevisionStats(
        revision=revision,
        requests=len(rows),
        errors=errors,
        error_rate=errors / len(rows),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_p99_ms=percentile(tpot, 99),
    )
