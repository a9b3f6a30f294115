"""`loraplex rollout replay`: the real controller in virtual time over a simulated name."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from loraplex.rollout.cli import app
from loraplex.rollout.replay import replay
from loraplex.settings.rollout import ReplaySettings


def test_no_regression_is_promoted_through_every_step():
    result = replay(ReplaySettings(rate=50, seed=3))
    assert result["outcome"] == "promoted"
    advances = [d for d in result["decisions"] if d["action"] == "rollout_advance"]
    assert [d["weight"] for d in advances] == [1, 10, 50]
    assert all(d["canary"]["requests"] >= 100 for d in advances)
    assert result["virtual_s"] >= 3 * 300  # each step lasted at least --step-s


def test_a_slower_canary_is_caught_at_its_first_step_having_served_one_window():
    result = replay(ReplaySettings(rate=50, ttft_factor=3.0, seed=3))
    assert result["outcome"] == "rolled_back" and "TTFT p" in result["reason"]
    decision = next(d for d in result["decisions"] if d["action"] == "rollout_rollback")
    assert decision["step"] == 1 and decision["ratios"]["ttft_p99"] > 1.5
    assert 100 <= result["canary_requests"] < 120  # one window's --min-requests, not more


def test_errors_and_the_same_seed_gives_the_same_replay():
    failing = ReplaySettings(rate=50, canary_error_rate=0.1, seed=5)
    first, again = replay(failing), replay(failing)
    assert first["outcome"] == "rolled_back" and "error rate" in first["reason"]
    assert first["canary_requests"] == again["canary_requests"]
    assert first["decisions"][-1]["reasons"] == again["decisions"][-1]["reasons"]


def test_the_command_prints_the_decisions_and_writes_json(tmp_path):
    out = tmp_path / "replay.json"
    result = CliRunner().invoke(
        app, ["replay", "--tpot-factor", "2.5", "--rate", "40", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "rollback" in result.output and "TPOT p" in result.output
    written = json.loads(out.read_text())
    assert written["outcome"] == "rolled_back" and written["canary_requests"] > 0
    bad = CliRunner().invoke(app, ["replay", "--steps", "10,50"])
    assert bad.exit_code == 2 and "ending in 100" in bad.output


def test_an_unwritable_json_path_is_one_line_before_the_replay(tmp_path):
    for bad, why in ((tmp_path, "a directory"), ("/proc/replay.json", "cannot write in /proc")):
        result = CliRunner().invoke(app, ["replay", "--rate", "40", "--json", str(bad)])
        assert result.exit_code == 2, result.output
        assert f"--json {bad}: {why}" in result.output
        assert "rollback" not in result.output and "Traceback" not in result.output
