"""A step's verdict from the canary's and the stable's figures over the same window (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.rollout.figures import RevisionFigures

ADVANCE, ROLLBACK, WAIT = "advance", "rollback", "wait"
MAX_QUANTILE = 0.99
"""The highest latency quantile judged."""
MIN_TAIL = 3
"""The slowest requests it takes to decide a quantile: the judged quantile is the one the third
slowest of a window gives, so that the "p99" of 30 requests is not their slowest one, which one
slow request decides."""


def judged_quantile(count: float) -> float | None:
    """The highest quantile, up to MAX_QUANTILE, that `count` observations estimate: the one their
    MIN_TAIL-th slowest gives (nearest rank; None: fewer than twice MIN_TAIL, too few)."""
    if count < 2 * MIN_TAIL:
        return None
    return min(MAX_QUANTILE, 1 - (MIN_TAIL - 1) / count)


@dataclass(frozen=True)
class Limits:
    """How much worse than the stable the canary may be (ratios), and absolute ceilings (None:
    none). Error rates below `error_rate_floor` count as the floor, so that one error against a
    stable with none is not an infinite ratio."""

    max_error_ratio: float = 2.0
    error_rate_floor: float = 0.01
    max_ttft_ratio: float = 1.5
    max_tpot_ratio: float = 1.5
    max_error_rate: float | None = None
    max_ttft_p99_s: float | None = None
    max_tpot_p99_s: float | None = None


@dataclass(frozen=True)
class StepRule:
    step_s: float
    """The least time a step lasts before it may advance."""
    min_requests: int
    """The least canary requests in the window before it is judged at all."""
    timeout_s: float
    """A step that has not seen `min_requests` by then is rolled back: it could not be judged."""


@dataclass(frozen=True)
class Verdict:
    action: str
    reasons: tuple[str, ...]
    figures: dict
    """What it was based on: both revisions' summaries and the ratios."""


def compare(canary: RevisionFigures, stable: RevisionFigures) -> dict:
    """Both summaries and the canary/stable ratios of error rate and of TTFT and TPOT p99."""
    c, s = canary.summary(), stable.summary()
    ratios = {
        "ttft_p99": _ratio(c["ttft_p99_ms"], s["ttft_p99_ms"]),
        "tpot_p99": _ratio(c["tpot_p99_ms"], s["tpot_p99_ms"]),
    }
    return {"canary": c, "stable": s, "ratios": ratios}


def breaches(canary: RevisionFigures, stable: RevisionFigures, limits: Limits) -> list[str]:
    """Each limit the canary is past, in words with its figures."""
    out = []
    floor = limits.error_rate_floor
    error_ratio = max(canary.error_rate, floor) / max(stable.error_rate, floor)
    if canary.errors and error_ratio > limits.max_error_ratio:
        out.append(
            f"error rate {canary.error_rate:.2%} against the stable's {stable.error_rate:.2%} "
            f"({error_ratio:.2f}x, limit {limits.max_error_ratio:g}x)"
        )
    if limits.max_error_rate is not None and canary.error_rate > limits.max_error_rate:
        out.append(f"error rate {canary.error_rate:.2%} above {limits.max_error_rate:.2%}")
    latencies = (
        ("TTFT", canary.ttft, stable.ttft, limits.max_ttft_ratio, limits.max_ttft_p99_s),
        ("TPOT", canary.tpot, stable.tpot, limits.max_tpot_ratio, limits.max_tpot_p99_s),
    )
    for label, mine, theirs, max_ratio, ceiling in latencies:
        out += _latency_breaches(label, mine, theirs, max_ratio)
        q = judged_quantile(mine.total)
        value = mine.quantile(q) if q is not None else None
        if ceiling is not None and value is not None and value > ceiling:
            out.append(f"{label} {_name(q)} {value * 1000:.1f} ms above {ceiling * 1000:.1f} ms")
    return out


def _latency_breaches(label: str, mine, theirs, max_ratio: float) -> list[str]:
    """The ratio of the highest quantile both histograms estimate, when past `max_ratio`."""
    q = judged_quantile(min(mine.total, theirs.total))
    if q is None:
        return []
    value, stable_value = mine.quantile(q), theirs.quantile(q)
    if value is None or not stable_value or value / stable_value <= max_ratio:
        return []
    return [
        f"{label} {_name(q)} {value * 1000:.1f} ms against the stable's "
        f"{stable_value * 1000:.1f} ms ({value / stable_value:.2f}x, limit {max_ratio:g}x)"
    ]


def _name(q: float | None) -> str:
    return f"p{q * 100:.3g}" if q is not None else "-"


def judge(
    canary: RevisionFigures,
    stable: RevisionFigures,
    limits: Limits,
    rule: StepRule,
    elapsed_s: float,
) -> Verdict:
    """Roll back on any breach once the canary has enough requests to judge; advance when the step
    has also lasted its time; roll back a step that never got enough requests; else wait."""
    figures = {**compare(canary, stable), "elapsed_s": round(elapsed_s, 3)}
    enough = canary.requests >= rule.min_requests
    if enough:
        found = breaches(canary, stable, limits)
        if found:
            return Verdict(ROLLBACK, tuple(found), figures)
        if elapsed_s >= rule.step_s:
            return Verdict(ADVANCE, ("within every limit",), figures)
    elif elapsed_s >= rule.timeout_s:
        reason = (
            f"{canary.requests:g} canary requests in {elapsed_s:.0f} s, fewer than the "
            f"{rule.min_requests} a step needs to be judged"
        )
        return Verdict(ROLLBACK, (reason,), figures)
    return Verdict(WAIT, (), figures)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None
