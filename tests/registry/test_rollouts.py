"""The rollouts table: a rollout's state, its controller's lease and its decisions as audit events,
on SQLite and PostgreSQL; an older database gets the table when it is opened."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text

from loraplex.registry import Registry
from loraplex.registry.rollouts import LeaseHeld, RolloutEnded, RolloutStore

STEPS = (1, 10, 50, 100)


@pytest.fixture
def with_canary(registry, adapter_v1, adapter_v2):
    registry.add_revision(adapter_v1, "ad", revision="r1", status="stable")
    registry.add_revision(adapter_v2, "ad", revision="r2")
    return registry


def test_lease_decisions_and_ending(with_canary):
    store = RolloutStore(with_canary)
    record, resumed = store.begin("ad", "r2", "r1", STEPS, {"step_s": 1}, 60, holder="a:1")
    assert not resumed and (record.step, record.weight, record.phase) == (0, 1, "running")
    assert record.lease_alive() and record.settings == {"step_s": 1}
    decided = store.record("ad", "a:1", "rollout_advance", {"step": 1, "canary": {"n": 3}}, step=1)
    assert (decided.step, decided.weight) == (1, 10)
    assert decided.last_decision == {"action": "rollout_advance", "step": 1, "canary": {"n": 3}}
    with pytest.raises(LeaseHeld, match="by the controller a:1"):
        store.begin("ad", "r2", "r1", STEPS, {}, 60, holder="b:2")
    with pytest.raises(LeaseHeld, match="held by a:1, not b:2"):
        store.renew("ad", "b:2", 60)
    again, resumed = store.begin("ad", "r2", "r1", STEPS, {}, 60, holder="a:1")
    assert resumed and again.step == 1  # the same controller, restarted: it resumes
    ended = store.end("ad", "aborted", "by hand", "rollout_abort")
    assert ended.phase == "aborted" and not ended.is_active
    with pytest.raises(RolloutEnded):
        store.record("ad", "a:1", "rollout_advance", {}, step=2)
    fresh, resumed = store.begin("ad", "r2", "r1", STEPS, {}, 60, holder="b:2")
    assert not resumed and fresh.step == 0 and fresh.holder == "b:2"
    store.release("ad", "b:2")
    assert store.get("ad").holder is None
    actions = [e.action for e in reversed(with_canary.audit_events(50, "ad"))]
    assert actions[-5:] == [
        "rollout_start",
        "rollout_advance",
        "rollout_resume",
        "rollout_abort",
        "rollout_start",
    ]
    advance = next(e for e in with_canary.audit_events(50, "ad") if e.action == "rollout_advance")
    assert advance.target == "ad@r2" and advance.detail["canary"] == {"n": 3}


def test_an_expired_lease_is_taken_over_and_an_unknown_name_refused(with_canary):
    store = RolloutStore(with_canary)
    store.begin("ad", "r2", "r1", STEPS, {}, lease_s=0.001, holder="gone:1")
    record, resumed = store.begin("ad", "r2", "r1", STEPS, {}, 60, holder="b:2")
    assert resumed and record.holder == "b:2"
    assert store.eval_set("ad", "r2") is None
    with pytest.raises(Exception, match="not found"):
        store.eval_set("ad", "r9")


def test_an_older_database_gets_the_table_when_opened(make_registry, sqlite_url, adapter_v1):
    first = make_registry(sqlite_url)
    first.add_revision(adapter_v1, "ad", revision="r1", status="stable")
    with first.engine.begin() as conn:
        conn.execute(text("DROP TABLE rollouts"))
    first.close()
    reopened = Registry(sqlite_url)  # opened, not `init`: what a server or a controller does
    try:
        assert inspect(reopened.engine).has_table("rollouts")
        assert RolloutStore(reopened).get("ad") is None
    finally:
        reopened.close()
