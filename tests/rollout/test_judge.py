"""A step's verdict: roll back on a breach once judged, advance after its time, wait otherwise."""

from __future__ import annotations

from loraplex.rollout.figures import RevisionFigures
from loraplex.rollout.judge import ADVANCE, ROLLBACK, WAIT, Limits, StepRule, judge

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
    assert "TTFT p99" in verdict.reasons[0] and "limit 1.5x" in verdict.reasons[0]
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
    assert any("TPOT p99" in r for r in verdict.reasons)
    assert any("above 10.0 ms" in r for r in verdict.reasons)


def test_too_few_requests_waits_then_rolls_back_at_the_timeout():
    assert judge(figures(5, ttft=9.0), figures(100), Limits(), RULE, 30).action == WAIT
    verdict = judge(figures(5), figures(100), Limits(), RULE, 60)
    assert verdict.action == ROLLBACK and "fewer than the 20" in verdict.reasons[0]
