"""The shipped alert rules: promtool accepts them, its unit tests pass (each alert firing and not
firing), every rule carries what an operator needs, and the Helm chart ships the same bytes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/loraplex-rules.yaml"
RULE_TESTS = sorted((ROOT / "deploy/prometheus/tests").glob("*.yaml"))
CHART_COPY = ROOT / "deploy/helm/loraplex/files/loraplex-rules.yaml"
SEVERITIES = {"critical", "warning", "info"}
sys.path.insert(0, str(ROOT / "bench"))
from prometheus_proof import fast_rules  # noqa: E402


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (.ci/run does)")
    return path


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules():
    done = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_promtool_unit_tests_pass():
    done = subprocess.run(
        [promtool(), "test", "rules", *map(str, RULE_TESTS)],
        capture_output=True,
        text=True,
        cwd=RULES.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == len(RULE_TESTS)


def test_every_alert_is_tested_firing_and_quiet():
    firing, quiet = set(), set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case["alert_rule_test"]:
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in rules()}
    assert names - firing == set(), "alerts without a firing case"
    assert names - quiet == set(), "alerts without a quiet case"


def test_every_rule_says_what_to_do_and_why():
    for rule in rules():
        notes = rule["annotations"]
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        for field in ("summary", "description", "threshold"):
            assert len(notes.get(field, "")) > 20, (rule["alert"], field)


def test_the_chart_ships_the_same_rules():
    assert CHART_COPY.read_bytes() == RULES.read_bytes()


def test_the_end_to_end_copy_only_divides_the_durations():
    """bench/prometheus_proof.py's rules for the end-to-end test: every window, offset and `for:`
    of the shipped rules divided by 60, nothing else changed."""
    shipped = rules()
    fast = [r for g in yaml.safe_load(fast_rules(RULES.read_text()))["groups"] for r in g["rules"]]
    assert [r["alert"] for r in fast] == [r["alert"] for r in shipped]
    minutes = re.compile(r"(\[|offset )(\d+)m")
    for slow, quick in zip(shipped, fast):
        assert quick["expr"] == minutes.sub(r"\g<1>\g<2>s", slow["expr"]), slow["alert"]
        assert quick.get("for") == (slow["for"].replace("m", "s") if "for" in slow else None)
        assert (quick["labels"], quick["annotations"]) == (slow["labels"], slow["annotations"])
