"""The controller over a real SQLite registry, with figures given by the test (the sources are
tested against real workers in tests/e2e/test_rollout_e2e.py): its steps, decisions, audit events,
lease and resume."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from tinymodels import make_adapter
from typer.testing import CliRunner

from loraplex.artifacts import ArtifactStore
from loraplex.registry import LifecycleError, Registry
from loraplex.registry.rollouts import LeaseHeld, RolloutStore
from loraplex.rollout.cli import app as rollout_app
from loraplex.rollout.cli import status_lines
from loraplex.rollout.controller import Controller, Plan
from loraplex.rollout.figures import RevisionFigures
from loraplex.rollout.judge import Limits, StepRule

PLAN = Plan("ad", "r2", (1, 10, 50, 100), Limits(), StepRule(0, 10, 5), poll_s=0.0, lease_s=30)


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-adapters")
    return [
        make_adapter(llama_dir, root / f"v{i}", seed=i, r=4, target_modules=["q_proj"])
        for i in (1, 2)
    ]


@pytest.fixture
def registry(tmp_path, llama_dir, adapters):
    url = f"sqlite:///{tmp_path}/registry.db"
    reg = Registry(url, ArtifactStore(tmp_path / "store"), base_model_dir=llama_dir)
    reg.init()
    reg.add_revision(adapters[0], "ad", revision="r1", status="stable")
    reg.add_revision(adapters[1], "ad", revision="r2")
    yield reg
    reg.close()


class Figures:
    """A source whose figures the test sets: `canary` and `stable` per read, and a hook run at
    each read (an operator acting meanwhile)."""

    def __init__(self, canary: RevisionFigures, stable: RevisionFigures, hook=None):
        self.canary, self.stable, self.hook, self.reads = canary, stable, hook, 0

    def mark(self, name):
        return None

    def since(self, mark, name):
        self.reads += 1
        if self.hook is not None:
            self.hook(self.reads)
        return {"r2": self.canary, "r1": self.stable}


def made(n: int, ttft: float = 0.02) -> RevisionFigures:
    f = RevisionFigures()
    for _ in range(n):
        f.record(True, ttft, 0.004)
    return f


def controller(registry, source, plan=PLAN) -> Controller:
    return Controller(plan, registry, source, say=lambda line: None, sleep=lambda s: None)


def actions(registry) -> list[str]:
    return [e.action for e in reversed(registry.audit_events(100, target="ad"))]


def test_a_good_revision_steps_through_every_weight_to_stable(registry):
    seen = []
    source = Figures(made(30), made(3000), hook=lambda _: seen.append(registry.show("ad").traffic))
    record = controller(registry, source).run()
    assert record.phase == "promoted"
    assert registry.show("ad").traffic == (("r2", 100),)
    assert seen == [(("r2", 1), ("r1", 99)), (("r2", 10), ("r1", 90)), (("r2", 50), ("r1", 50))]
    assert actions(registry)[2:] == [
        "rollout_start",
        *["set_traffic", "rollout_advance"] * 3,
        "promote",
        "rollout_promote",
    ]
    advances = [e for e in registry.audit_events(100, target="ad") if e.action == "rollout_advance"]
    assert sorted(e.detail["weight"] for e in advances) == [1, 10, 50]
    assert all(e.detail["canary"]["requests"] == 30 for e in advances)
    assert all(e.detail["ratios"]["ttft_p99"] == 1.0 for e in advances)
    assert RolloutStore(registry).get("ad").holder is None  # the lease is given back


def test_each_change_of_the_split_runs_the_hook_with_the_split_made(registry):
    seen = []
    hook = lambda: seen.append(registry.show("ad").traffic)  # noqa: E731
    plan = Plan("ad", "r2", (10, 100), Limits(), StepRule(0, 10, 5), poll_s=0.0, lease_s=30)
    source = Figures(made(30), made(3000))
    quiet = Controller(
        plan, registry, source, on_split=hook, say=lambda _: None, sleep=lambda _: None
    )
    assert quiet.run().phase == "promoted"
    assert seen == [(("r2", 10), ("r1", 90)), (("r2", 100),)]


def test_a_slow_revision_is_rolled_back_at_its_first_step_with_its_figures(registry):
    record = controller(registry, Figures(made(30, ttft=0.08), made(3000))).run()
    assert record.phase == "rolled_back" and "TTFT p" in record.reason
    adapter = registry.show("ad")
    assert adapter.traffic == (("r1", 100),)
    assert next(r for r in adapter.revisions if r.revision == "r2").status == "deprecated"
    event = next(e for e in registry.audit_events(100, "ad") if e.action == "rollout_rollback")
    assert event.detail["step"] == 1 and event.detail["weight"] == 1
    assert event.detail["ratios"]["ttft_p99"] > 3


def test_a_quarantine_during_the_rollout_ends_it(registry):
    def operator(reads):
        if reads == 2:
            registry.quarantine("ad", "r2", "bad bytes")

    record = controller(registry, Figures(made(30), made(3000), hook=operator)).run()
    assert record.phase == "ended" and "quarantined (bad bytes)" in record.reason
    assert registry.show("ad").traffic == (("r1", 100),)


def test_a_manual_rollback_during_the_rollout_ends_it(registry):
    hook = lambda reads: reads == 1 and registry.rollback("ad")  # noqa: E731
    record = controller(registry, Figures(made(5), made(3000), hook=hook)).run()
    assert record.phase == "ended" and "left traffic" in record.reason


def test_abort_rolls_back_and_stops_the_controller(registry):
    runner = CliRunner()

    def operator(reads):
        if reads == 2:
            result = runner.invoke(rollout_app, ["abort", "ad", "--registry", registry.url])
            assert result.exit_code == 0, result.output
            assert "split now: r1 100%" in result.output

    record = controller(registry, Figures(made(5), made(3000), hook=operator)).run()
    assert record.phase == "aborted"
    assert registry.show("ad").traffic == (("r1", 100),)
    assert "rollout_abort" in actions(registry)


def test_a_second_controller_is_refused_naming_the_first(registry):
    store = RolloutStore(registry)
    store.begin("ad", "r2", "r1", PLAN.steps, {}, lease_s=60, holder="node-a:4242")
    with pytest.raises(LeaseHeld, match="controller node-a:4242"):
        controller(registry, Figures(made(30), made(3000))).run()


def test_a_killed_controller_leaves_the_split_and_a_restart_resumes(registry):
    # The first controller decided step 2 (10%) and died before it changed the split (still 1%).
    store = RolloutStore(registry)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    holder = f"{socket.gethostname()}:{dead}"  # its process is gone: no need to wait its lease out
    store.begin("ad", "r2", "r1", PLAN.steps, {}, lease_s=600, holder=holder)
    registry.set_traffic("ad", {"r2": 1, "r1": 99}, force=True)
    store.record("ad", holder, "rollout_advance", {"step": 1}, step=1)
    record = store.get("ad")
    lines = status_lines(record, registry.show("ad").traffic)
    assert "split now: r2 1% r1 99%" in lines[1]
    assert lines[2].startswith(f"controller: none (the last, {holder}, stopped)")
    seen = []
    source = Figures(made(30), made(3000), hook=lambda _: seen.append(registry.show("ad").traffic))
    assert controller(registry, source).run().phase == "promoted"
    assert seen[0] == (("r2", 10), ("r1", 90))  # resumed at its step, not from the start
    assert "rollout_resume" in actions(registry)


def test_a_rollout_of_another_revision_under_way_is_refused(registry, adapters, tmp_path):
    store = RolloutStore(registry)
    store.begin("ad", "r2", "r1", PLAN.steps, {}, lease_s=0.001, holder="node-a:1")
    other = Plan("ad", "r3", PLAN.steps, Limits(), PLAN.rule, 0.0, 30)
    with pytest.raises(Exception, match="a rollout of ad@r2 is under way"):
        controller(registry, Figures(made(30), made(3000)), other).run()


def test_refused_while_another_canary_is_in_traffic_or_of_the_stable(registry, adapters, tmp_path):
    other = make_adapter(
        registry.registration.base_model_dir,
        tmp_path / "v3",
        seed=3,
        r=4,
        target_modules=["q_proj"],
    )
    registry.add_revision(other, "ad", revision="r3")
    registry.promote("ad", "r3", 10, force=True)
    with pytest.raises(LifecycleError, match="ad@r3 is in canary"):
        controller(registry, Figures(made(30), made(3000))).run()
    registry.rollback("ad")
    stable = Plan("ad", "r1", PLAN.steps, Limits(), PLAN.rule, 0.0, 30)
    with pytest.raises(LifecycleError, match="ad@r1 is the stable revision already"):
        controller(registry, Figures(made(30), made(3000)), stable).run()
    assert RolloutStore(registry).get("ad") is None  # nothing was begun


def test_the_lease_is_renewed_through_a_long_call(registry):
    plan = Plan("ad", "r2", (10, 100), Limits(), StepRule(0, 10, 5), poll_s=0.0, lease_s=0.3)
    store = RolloutStore(registry)
    expiries = []

    def slow_prepare():  # the canary pool's prewarm, say: several leases long
        for _ in range(6):
            time.sleep(0.2)
            expiries.append(store.get("ad").lease_expires_at)

    c = Controller(
        plan,
        registry,
        Figures(made(30), made(3000)),
        prepare=slow_prepare,
        say=lambda _: None,
        sleep=lambda _: None,
    )
    assert c.run().phase == "promoted"
    assert len(set(expiries)) >= 3  # renewed meanwhile, not only at each look


def test_status_and_abort_from_the_cli(registry):
    runner = CliRunner()
    missing = runner.invoke(rollout_app, ["status", "ad", "--registry", registry.url])
    assert missing.exit_code == 1 and "ad has never been rolled out" in missing.output
    controller(registry, Figures(made(30, ttft=0.5), made(3000))).run()
    shown = runner.invoke(rollout_app, ["status", "ad", "--registry", registry.url])
    assert shown.exit_code == 0, shown.output
    assert "rolled_back" in shown.output and "last decision: rollout_end" in shown.output
    again = runner.invoke(rollout_app, ["abort", "ad", "--registry", registry.url])
    assert again.exit_code == 1 and "no rollout under way" in again.output


def test_a_rollback_decided_before_a_kill_is_applied_on_resume(registry):
    store = RolloutStore(registry)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    holder = f"{socket.gethostname()}:{dead}"
    store.begin("ad", "r2", "r1", PLAN.steps, {}, lease_s=600, holder=holder)
    registry.set_traffic("ad", {"r2": 1, "r1": 99}, force=True)
    store.record(
        "ad", holder, "rollout_rollback", {"reasons": ["slow"]}, phase="rolling_back", reason="slow"
    )
    record = controller(registry, Figures(made(30), made(3000))).run()
    assert record.phase == "rolled_back" and record.reason == "slow"
    assert registry.show("ad").traffic == (("r1", 100),)


def test_the_cli_refuses_bad_input_with_one_line(registry):
    runner = CliRunner()
    no_worker = runner.invoke(rollout_app, ["ad", "r2", "--registry", registry.url])
    assert no_worker.exit_code == 2
    assert no_worker.output.strip() == "error: --source workers needs at least one --worker URL"
    unknown = runner.invoke(
        rollout_app, ["nope", "r1", "--registry", registry.url, "--worker", "http://127.0.0.1:9"]
    )
    assert unknown.exit_code == 1 and "error: model 'nope' not found" in unknown.output
    steps = runner.invoke(rollout_app, ["ad", "r2", "--steps", "50,10,100"])
    assert steps.exit_code == 2 and "rising percents ending in 100" in steps.output


def test_status_as_json(registry):
    controller(registry, Figures(made(30), made(3000))).run()
    shown = CliRunner().invoke(rollout_app, ["status", "ad", "--registry", registry.url, "--json"])
    assert shown.exit_code == 0, shown.output
    body = json.loads(shown.output)
    assert body["phase"] == "promoted" and body["traffic"] == {"r2": 100}
    assert body["steps"] == [1, 10, 50, 100] and body["controller_alive"] is False
    assert body["last_decision"]["action"] == "rollout_promote"


class RefusingGate:
    """A quality gate whose eval-set result the test sets: the canary fails it."""

    def check(self, name, canary, stable):
        from loraplex.rollout.workers import GateResult

        detail = {"canary": "0/8", "stable": "8/8"}
        return GateResult(False, detail, "eval set passed 0/8 (0%) against the stable's 8/8")


def test_a_revision_the_quality_gate_refuses_is_rolled_back_before_any_traffic(registry):
    plan = Plan("ad", "r2", (10, 50, 100), Limits(), StepRule(0, 10, 5), poll_s=0.0, lease_s=30)
    source = Figures(made(30), made(3000))
    refused = Controller(
        plan, registry, source, RefusingGate(), say=lambda _: None, sleep=lambda _: None
    )
    record = refused.run()
    assert record.phase == "rolled_back" and source.reads == 0
    adapter = registry.show("ad")
    assert adapter.traffic == (("r1", 100),)
    r2 = next(r for r in adapter.revisions if r.revision == "r2")
    assert (r2.status, r2.status_reason) == ("deprecated", "rolled back to r1")
    event = next(e for e in registry.audit_events(100, "ad") if e.action == "rollout_rollback")
    assert event.detail["weight"] == 0 and event.detail["step_weight"] == 10
    assert event.detail["before_traffic"] is True
    line = status_lines(record, adapter.traffic)[0]
    assert line.startswith(
        "ad@r2 against r1: rolled_back, before the traffic of step 1 of 3 (10%), the canary at 0%"
    ), line
