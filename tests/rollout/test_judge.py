"""A step's verdict: roll back on a breach once judged, advance after its time, wait otherwise."""

from __future__ import annotations

from loraplex.rollout.figures import RevisionFigures
from loraplex.rollout.judge import (
    ADVANCE,
    ROLLBACK,
    WAIT,
    Limits,
    StepRule,
    judge,
    judged_quantile,
)

RULE = StepRule(step_s=10, min_requests=20, timeout_s=60)


def figures(n: int, errors: int = 0, ttft: float = 0.02, tpot: float = 0.005) -> RevisionFigures:
    f = RevisionFigures()
    for i in range(n):
        f.record(i >= errors, ttft, tpot)
    return f


def test_a_canary_like_the_stable_advances_after_its_step_time_only():
    canary, stable = figures(30), figures(3000)
    assert judge(canary, stable, Limits(), RULE, 5).action == WAIT
    verdict = judge(canary, stable, Limits(), RULE, 10)
    assert verdict.action == ADVANCE
    assert verdict.figures["canary"]["requests"] == 30
    assert verdict.figures["ratios"]["ttft_p99"] == 1.0


def test_a_slow_canary_is_rolled_back_on_its_ttft_ratio_as_soon_as_it_is_judged():
    verdict = judge(figures(20, ttft=0.05), figures(3000), Limits(), RULE, 1)
    assert verdict.action == ROLLBACK
    # 20 requests estimate a p90 (their third slowest), not a p99: the p90 is what is compared
    assert verdict.reasons[0] == "TTFT p90 54.2 ms against the stable's 22.2 ms (2.44x, limit 1.5x)"
    assert verdict.figures["ratios"]["ttft_p99"] > 2


def test_errors_are_judged_by_ratio_above_the_floor():
    stable = figures(1000)
    one_in_200 = figures(200, errors=1)  # 0.5%: under the 1% floor, ratio 1
    assert judge(one_in_200, stable, Limits(), RULE, 10).action == ADVANCE
    many = judge(figures(100, errors=5), stable, Limits(), RULE, 10)
    assert many.action == ROLLBACK and "error rate 5.00%" in many.reasons[0]


def test_absolute_limits_and_tpot():
    limits = Limits(max_ttft_p99_s=0.01, max_tpot_ratio=1.2)
    verdict = judge(figures(30, tpot=0.02), figures(3000), limits, RULE, 10)
    assert verdict.action == ROLLBACK
    assert any(r.startswith("TPOT p93.3") for r in verdict.reasons)
    assert "TTFT p93.3 22.2 ms above 10.0 ms" in verdict.reasons


def test_too_few_requests_waits_then_rolls_back_at_the_timeout():
    assert judge(figures(5, ttft=9.0), figures(100), Limits(), RULE, 30).action == WAIT
    verdict = judge(figures(5), figures(100), Limits(), RULE, 60)
    assert verdict.action == ROLLBACK and "fewer than the 20" in verdict.reasons[0]


def _with_slowest(n: int, slowest: float, ttft: float = 0.014) -> RevisionFigures:
    f = figures(n - 1, ttft=ttft)
    f.record(True, slowest, 0.005)
    return f


def test_a_quantile_is_judged_only_with_enough_requests_above_it():
    assert [judged_quantile(n) for n in (5, 6, 20, 40, 100, 200, 5000)] == [
        None, 1 - 2 / 6, 0.9, 0.95, 0.98, 0.99, 0.99,
    ]  # fmt: skip


def test_one_slow_request_of_thirty_does_not_roll_back_a_canary_like_the_stable():
    rule = StepRule(step_s=10, min_requests=30, timeout_s=60)
    canary = _with_slowest(30, 0.0278)  # its "p99" is this one request: twice the stable's
    stable = _with_slowest(3000, 0.0142, ttft=0.0142)
    assert canary.summary()["ttft_p99_ms"] > 1.5 * stable.summary()["ttft_p99_ms"]
    assert judge(canary, stable, Limits(), rule, 10).action == ADVANCE


def test_a_slow_tail_is_caught_once_there_are_requests_enough_for_a_p99():
    tail = figures(980)
    for _ in range(20):
        tail.record(True, 0.2, 0.005)  # 2% at ten times the stable's: the p99 among them
    verdict = judge(tail, figures(3000), Limits(), RULE, 10)
    assert verdict.action == ROLLBACK and verdict.reasons[0].startswith("TTFT p99 ")
