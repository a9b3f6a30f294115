"""The registry's core behaviour, run against a SQLite file and against PostgreSQL (when a cluster
can start)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from sqlalchemy import text

from loraplex.artifacts import Pieces, digest_and_pieces
from loraplex.registry import (
    AdapterNotFound,
    AdapterRejected,
    LifecycleError,
    Registry,
    RegistryError,
    ReleaseCheckFailed,
    ReleaseChecks,
    RevisionUnavailable,
    SchemaTooNew,
)
from loraplex.registry.traffic import pick


@pytest.fixture
def canary(registry, adapter_v1, adapter_v2):
    """chat: r1 stable, r2 a 10% canary."""
    registry.add_revision(adapter_v1, "chat", status="stable")
    registry.add_revision(adapter_v2, "chat")
    registry.promote("chat", "r2", 10)
    return registry


def test_add_resolve_and_immutable_revisions(registry, adapter_v1, adapter_v2, resolve):
    first = registry.add_revision(adapter_v1, "chat", status="stable")
    assert (first.revision, first.status, first.traffic_weight) == ("r1", "stable", 100)
    assert resolve(registry, "anyone", "chat") == first
    assert resolve(registry, "anyone", "chat@r1").digest == first.digest
    events = len(registry.audit_events())
    assert registry.add_revision(adapter_v1, "chat") == first  # same bytes again: the same revision
    assert len(registry.audit_events()) == events
    with pytest.raises(
        AdapterRejected, match="chat@r1 exists with digest .*; revisions are immutable"
    ):
        registry.add_revision(adapter_v2, "chat", revision="r1")
    second = registry.add_revision(adapter_v2, "chat", revision="2024-06-01")
    assert second.status == "staging" and resolve(registry, "anyone", "chat") == first
    assert resolve(registry, "anyone", "chat@2024-06-01").revision == "2024-06-01"
    assert [r.revision for r in registry.show("chat").revisions] == ["r1", "2024-06-01"]
    assert registry.get_revision("chat", "r1") == first


def test_other_tenants_get_the_same_answer_as_for_an_unknown_name(
    registry, adapter_v1, adapter_v2, resolve
):
    registry.add_tenant("acme")
    registry.add_tenant("beta", priority=2)
    registry.add_revision(adapter_v1, "secret", tenant="acme", status="stable")
    registry.add_revision(adapter_v2, "public", status="stable")  # no tenant: shared
    assert resolve(registry, "acme", "secret").owner_tenant == "acme"

    def error_of(tenant, model):
        with pytest.raises(AdapterNotFound) as info:
            resolve(registry, tenant, model)
        return type(info.value), str(info.value).replace(model, "MODEL")

    forbidden = [error_of("beta", m) for m in ("secret", "secret@r1", "secret@r9")]
    unknown = [error_of("beta", m) for m in ("nothing", "nothing@r1", "Bad/Name")]
    assert len(set(forbidden + unknown)) == 1 and forbidden[0] == (
        AdapterNotFound,
        "model 'MODEL' not found",
    )
    assert [a.name for a in registry.list_adapters("beta")] == ["public"]
    assert [a.name for a in registry.list_adapters("acme")] == ["public", "secret"]

    registry.grant("secret", "beta")
    assert resolve(registry, "beta", "secret").allowed_tenants == ("acme", "beta")
    registry.revoke_grant("secret", "beta")
    assert error_of("beta", "secret") == forbidden[0]
    with pytest.raises(AdapterRejected, match="not owned by tenant 'beta'"):
        registry.add_revision(adapter_v2, "secret", tenant="beta")
    with pytest.raises(AdapterRejected, match="unknown tenant 'nobody'"):
        registry.add_revision(adapter_v2, "other", tenant="nobody")


def test_canary_split_over_10000_resolutions(canary, resolve):
    # 10,000 on SQLite: ±2 points is 6.7 sigma at 10%. PostgreSQL costs a round trip per resolution,
    # so there 1,000 within ±6 points (6.3 sigma): the same code path, a smaller sample.
    n, tolerance = (10_000, 2) if canary.engine.dialect.name == "sqlite" else (1_000, 6)
    counts = Counter(resolve(canary, "default", "chat").revision for _ in range(n))
    assert abs(100 * counts["r2"] / n - 10) <= tolerance, counts
    # by user: deterministic; the pure split is checked on 10,000 users below
    canary.promote("chat", "r2", 50)
    counts = Counter(
        resolve(canary, "default", "chat", user=f"user-{i}").revision for i in range(1_000)
    )
    assert abs(counts["r2"] / 10 - 50) <= 6, counts


@pytest.mark.parametrize("weight", [1, 10, 50, 90])
def test_sticky_split_over_10000_users(weight):
    counts = Counter(
        pick("chat", [("canary", weight), ("stable", 100 - weight)], f"user-{i}")
        for i in range(10_000)
    )
    assert abs(counts["canary"] / 100 - weight) <= 2, counts


def test_sticky_users_never_flip_while_weights_hold(canary, adapter_v3, resolve):
    users = [f"user-{i}" for i in range(200)]
    first = {u: resolve(canary, "default", "chat", user=u).revision for u in users}
    assert set(first.values()) == {"r1", "r2"}
    canary.add_revision(adapter_v3, "chat")  # changes that leave the weights alone
    canary.pin("chat")
    for _ in range(3):
        assert {u: resolve(canary, "default", "chat", user=u).revision for u in users} == first
    canary.promote("chat", "r2", 50)  # a growing canary keeps the users it had
    after = {u: resolve(canary, "default", "chat", user=u).revision for u in users}
    assert all(after[u] == "r2" for u in users if first[u] == "r2")


def test_promote_and_rollback_life_cycle(canary, adapter_v3, resolve):
    canary.add_revision(adapter_v3, "chat")
    with pytest.raises(LifecycleError, match="chat@r2 is already in canary"):
        canary.promote("chat", "r3", 5)
    adapter = canary.promote("chat", "r2", 100)
    assert adapter.traffic == (("r2", 100),)
    assert {r.revision: r.status for r in adapter.revisions} == {
        "r1": "deprecated",
        "r2": "stable",
        "r3": "staging",
    }
    # left traffic just now: keep it warm
    assert [r.revision for r in canary.grace_revisions()] == ["r1"]
    canary.reading.grace_period = timedelta(0)
    assert canary.grace_revisions() == []

    adapter = canary.rollback("chat")
    assert adapter.traffic == (("r1", 100),)
    r2 = next(r for r in adapter.revisions if r.revision == "r2")
    assert (r2.status, r2.status_reason) == ("deprecated", "rolled back to r1")
    assert {resolve(canary, "default", "chat", user=f"u{i}").revision for i in range(200)} == {"r1"}

    canary.promote("chat", "r3", 20)
    adapter = canary.rollback("chat")  # with a canary: drop it, keep the stable
    assert adapter.traffic == (("r1", 100),)
    with pytest.raises(LifecycleError, match="it is the stable revision"):
        canary.promote("chat", "r1", 50)
    with pytest.raises(LifecycleError, match="weight must be between 1 and 100"):
        canary.promote("chat", "r3", 0)


def test_rollback_needs_an_earlier_stable(registry, adapter_v1, adapter_v2):
    registry.add_revision(adapter_v1, "chat", status="stable")
    with pytest.raises(LifecycleError, match="chat has no earlier stable revision to roll back to"):
        registry.rollback("chat")
    registry.add_revision(adapter_v2, "solo")
    with pytest.raises(
        LifecycleError, match="solo has no stable revision; promote with weight 100"
    ):
        registry.promote("solo", "r1", 10)


def test_changes_by_another_process_are_seen_at_once(canary, db_url, make_registry, resolve):
    other = make_registry(db_url)  # another worker on the same database
    users = [f"user-{i}" for i in range(100)]
    assert {resolve(canary, "default", "chat", user=u).revision for u in users} == {"r1", "r2"}
    other.rollback("chat")
    assert {resolve(canary, "default", "chat", user=u).revision for u in users} == {"r1"}
    other.quarantine("chat", "r1", "bad")
    with pytest.raises(RevisionUnavailable):
        resolve(canary, "default", "chat")


def test_the_change_count_moves_with_another_workers_changes_on_any_thread(
    registry, db_url, make_registry
):
    other = make_registry(db_url)  # another worker on the same database
    before = registry.change_count()
    other.add_tenant("acme")
    assert registry.change_count() == before + 1
    seen: list[int] = []
    reader = threading.Thread(target=lambda: seen.append(registry.change_count()))
    reader.start()
    reader.join()
    other.add_tenant("globex")
    assert seen == [before + 1] and registry.change_count() == before + 2


def test_quarantined_revisions_are_never_served(canary, resolve):
    adapter = canary.quarantine("chat", "r2", "digest mismatch on worker-3")
    assert adapter.traffic == (("r1", 100),)
    assert {resolve(canary, "default", "chat").revision for _ in range(300)} == {"r1"}
    with pytest.raises(
        RevisionUnavailable, match=r"chat@r2 is quarantined \(digest mismatch on worker-3\)"
    ):
        resolve(canary, "default", "chat@r2")
    with pytest.raises(LifecycleError, match="quarantined"):
        canary.promote("chat", "r2", 100)
    # quarantining the stable hands its traffic to the previous stable, if any; else nothing is
    # served
    canary.quarantine("chat", "r1", "bad")
    with pytest.raises(RevisionUnavailable, match="chat has no revision in service"):
        resolve(canary, "default", "chat")


def test_quarantined_stable_falls_back_to_the_previous_stable(
    registry, adapter_v1, adapter_v2, resolve
):
    registry.add_revision(adapter_v1, "chat", status="stable")
    registry.add_revision(adapter_v2, "chat", status="stable")
    assert registry.quarantine("chat", "r2", "bad bytes").traffic == (("r1", 100),)
    assert resolve(registry, "default", "chat").revision == "r1"


def test_deprecate_and_set_traffic(canary, adapter_v3, resolve):
    with pytest.raises(LifecycleError, match="chat@r2 serves traffic"):
        canary.deprecate("chat", "r2")
    canary.add_revision(adapter_v3, "chat")
    assert (
        next(r for r in canary.deprecate("chat", "r3").revisions if r.revision == "r3").status
        == "deprecated"
    )
    adapter = canary.set_traffic("chat", {"r1": 70, "r2": 30})
    assert dict(adapter.traffic) == {"r1": 70, "r2": 30}
    assert {r.revision: r.status for r in adapter.revisions if r.traffic_weight} == {
        "r1": "stable",
        "r2": "canary",
    }
    with pytest.raises(LifecycleError, match="sum to 100"):
        canary.set_traffic("chat", {"r1": 70, "r2": 20})
    adapter = canary.deprecate("chat")
    assert adapter.traffic == () and {r.status for r in adapter.revisions} == {"deprecated"}
    with pytest.raises(RevisionUnavailable):
        resolve(canary, "default", "chat")
    assert (
        resolve(canary, "default", "chat@r1").status == "deprecated"
    )  # pinned requests still work


def test_release_checks_gate_the_first_traffic(registry, adapter_v1, adapter_v2, tmp_path):
    evals = tmp_path / "evals.jsonl"
    evals.write_text(
        '{"prompt": "2+2=", "expected": "4"}\n{"prompt": "capital of France", "contains": '
        '"Paris"}\n'
    )
    registry.add_revision(adapter_v1, "chat", status="stable")
    registry.add_revision(adapter_v2, "chat", eval_set=evals)
    calls = []

    def prewarm(record):
        calls.append(("prewarm", record.model_id))

    def good(record, prompt):
        calls.append(("complete", prompt))
        return {"2+2=": " 4 ", "capital of France": "It is Paris."}.get(prompt, "hello there")

    def wrong(record, prompt):
        return "5" if prompt == "2+2=" else "Paris"

    with pytest.raises(LifecycleError, match="has an eval set but no release checks were given"):
        registry.promote("chat", "r2", 10)
    with pytest.raises(
        ReleaseCheckFailed,
        match=r"eval set passed 1/2 \(50%\), below the required 100%; "
        r"first failure: prompt '2\+2=' gave '5', expected '4'",
    ):
        registry.promote("chat", "r2", 10, checks=ReleaseChecks(complete=wrong))
    with pytest.raises(ReleaseCheckFailed, match="prewarm failed: OSError: worker-1 out of memory"):
        registry.promote(
            "chat",
            "r2",
            10,
            checks=ReleaseChecks(
                prewarm=lambda r: (_ for _ in ()).throw(OSError("worker-1 out of memory")),
                complete=good,
            ),
        )
    with pytest.raises(ReleaseCheckFailed, match="health probe: 'ping' gave an empty completion"):
        registry.promote(
            "chat",
            "r2",
            10,
            checks=ReleaseChecks(
                complete=lambda r, p: "" if p == "ping" else good(r, p), health_prompt="ping"
            ),
        )
    assert registry.show("chat").traffic == (("r1", 100),)  # every refusal left the traffic alone

    calls.clear()
    registry.promote("chat", "r2", 10, checks=ReleaseChecks(prewarm=prewarm, complete=good))
    assert calls == [
        ("prewarm", "chat@r2"),
        ("complete", "2+2="),
        ("complete", "capital of France"),
        ("complete", "Hello"),
    ]
    # already serving
    registry.promote("chat", "r2", 50, checks=ReleaseChecks(prewarm=prewarm, complete=wrong))
    assert dict(registry.show("chat").traffic) == {"r2": 50, "r1": 50}
    assert registry.audit_events(1)[0].detail["checks"] == "already in traffic"
    registry.promote("chat", "r2", 100)
    registry.rollback("chat")
    lenient = ReleaseChecks(complete=wrong, min_pass_rate=0.5)
    # r2 left traffic: checked again, and passes at 50%
    registry.promote("chat", "r2", 10, checks=lenient)


def test_tenants_and_api_keys(registry):
    registry.add_tenant("acme")
    key = registry.create_key("acme")
    assert registry.tenant_for_key(key) == "acme"
    assert registry.tenant_for_key(key + "x") is None and registry.tenant_for_key("") is None
    with registry.engine.connect() as conn:
        stored = [tuple(map(str, row)) for row in conn.execute(text("SELECT * FROM api_keys"))]
    assert stored and not any(key in value for row in stored for value in row)  # never in clear
    key_id = registry.revoke_key(key[:12])
    assert key_id == key[:12] and registry.tenant_for_key(key) is None
    assert registry.list_keys("acme")[0].revoked_at is not None
    with pytest.raises(RegistryError, match="unknown tenant 'ghost'"):
        registry.create_key("ghost")
    with pytest.raises(RegistryError, match="no API key with id"):
        registry.revoke_key("lpx-missing")
    assert registry.add_tenant("acme", priority=5).priority == 5
    assert [(t.name, t.priority) for t in registry.list_tenants()] == [("acme", 5)]


def test_a_pin_keeps_its_tier(db_url, make_registry, adapter_v1, adapter_v2):
    registry = make_registry(db_url)
    registry.add_revision(adapter_v1, "chat", status="stable")
    registry.add_revision(adapter_v2, "code", status="stable", warm_policy="gpu")
    assert registry.show("chat").pin_tier is None
    assert registry.pin("chat", tier="gpu").pin_tier == "gpu"
    assert registry.pin("chat", tier="cpu").pin_tier == "cpu"
    registry.pin("chat", tier="gpu")
    assert {a.name: a.pin_tier for a in registry.list_adapters()} == {"chat": "gpu", "code": None}
    # read back by another process's registry
    assert make_registry(db_url).show("chat").pin_tier == "gpu"
    assert registry.audit_events(target="chat")[0].detail == {"tier": "gpu"}
    with pytest.raises(RegistryError, match="gpu or cpu"):
        registry.pin("chat", tier="disk")
    assert registry.show("chat").pin_tier == "gpu"
    unpinned = registry.unpin("chat")
    assert (
        unpinned.pin_tier is None and not unpinned.pinned and unpinned.to_dict()["pin_tier"] is None
    )
    # A warm policy of gpu or cpu is a pin too: unpinning ends it (the operator's call overrides the
    # manifest's).
    assert registry.unpin("code").warm_policy == "on_demand"
    assert registry.audit_events(target="code")[0].action == "unpin"
    # registered again with one
    registry.add_revision(adapter_v1, "code", revision="r2", warm_policy="gpu")
    assert registry.show("code").warm_policy == "gpu"
    # Pinned by a version that kept no tier (no row): the warm policy's tier, else cpu, as those
    # versions did.
    with registry.engine.begin() as conn:
        conn.execute(text("UPDATE adapters SET pinned = :p"), {"p": True})
    assert {a.name: a.pin_tier for a in registry.list_adapters()} == {"chat": "cpu", "code": "gpu"}
    # A database made by the previous version has no pin_tiers table: a process that only reads it
    # (`registry list`, `plan --registry`) adds it, as `init` does, instead of failing on "no such
    # table".
    with registry.engine.begin() as conn:
        conn.execute(text("DROP TABLE pin_tiers"))
    reader = Registry(db_url)
    assert {a.name: a.pin_tier for a in reader.list_adapters()} == {"chat": "cpu", "code": "gpu"}
    assert reader.pin("chat", tier="gpu").pin_tier == "gpu"
    reader.close()


def test_every_change_writes_an_audit_event(registry, adapter_v1, adapter_v2):
    registry.db.actor = "alice"
    registry.add_tenant("acme")
    registry.add_revision(adapter_v1, "chat", status="stable")
    registry.add_revision(adapter_v2, "chat")
    registry.promote("chat", "r2", 10)
    registry.set_traffic("chat", {"r1": 80, "r2": 20})
    registry.rollback("chat")
    registry.pin("chat")
    registry.unpin("chat")
    registry.grant("chat", "acme")
    registry.revoke_grant("chat", "acme")
    registry.quarantine("chat", "r2", "bad")
    registry.deprecate("chat")
    registry.revoke_key(registry.create_key("acme")[:12])
    events = registry.audit_events()
    assert [e.action for e in reversed(events)] == [
        "tenant_add",
        "add",
        "add",
        "promote",
        "set_traffic",
        "rollback",
        "pin",
        "unpin",
        "grant",
        "revoke_grant",
        "quarantine",
        "deprecate",
        "key_create",
        "key_revoke",
    ]
    assert {e.actor for e in events} == {"alice"}
    assert events[0].at >= events[-1].at
    assert [e.action for e in registry.audit_events(target="chat")][-2:] == ["add", "add"]


def test_a_registry_message_never_shows_the_urls_password(pg_url):
    """The password in a PostgreSQL URL (trust auth here, so it is accepted and unused) is `***` in
    the not-initialized error."""
    with_password = pg_url.replace("postgres@", "postgres:s3cret-pw@", 1)
    bare = Registry(with_password)
    with pytest.raises(RegistryError) as refused:
        bare.list_adapters()
    bare.close()
    assert "s3cret-pw" not in str(refused.value)
    assert "postgres:***@" in str(refused.value)


def test_schema_version_is_checked_at_start(db_url, make_registry):
    bare = Registry(db_url)
    with pytest.raises(RegistryError, match="not initialized: run `loraplex registry init`"):
        bare.list_adapters()
    bare.close()
    registry = make_registry(db_url)
    registry.init()  # idempotent
    with registry.engine.begin() as conn:
        conn.execute(text("UPDATE schema_version SET version = version + 1"))
    with pytest.raises(SchemaTooNew, match="newer than this loraplex understands"):
        Registry(db_url)


def test_registration_records_the_pieces_of_the_stored_bytes(
    db_url, make_registry, adapter_v1, adapter_v2
):
    registry = make_registry(db_url)
    record = registry.add_revision(adapter_v1, "chat", status="stable")
    digest, pieces = digest_and_pieces(registry.store.path(record.digest))
    assert digest == record.digest and registry.pieces(record.digest) == pieces
    assert registry.pieces("sha256:" + "0" * 64) is None
    # A database from before the piece tables: opening it adds them (older versions ignore them);
    # revisions registered before have no pieces (their loads check the digest alone) until their
    # bytes are added again.
    with registry.engine.begin() as conn:
        conn.execute(text("DROP TABLE artifact_pieces"))
        conn.execute(text("DROP TABLE artifact_pieces_blake3"))
    again = make_registry(db_url)
    assert again.pieces(record.digest) is None
    # the same bytes: the same revision
    assert again.add_revision(adapter_v1, "chat").revision == record.revision
    assert again.pieces(record.digest) == pieces
    other = again.add_revision(adapter_v2, "chat")
    assert again.pieces(other.digest) == digest_and_pieces(adapter_v2)[1]
    # The sha256 list stays in artifact_pieces, in the format versions without BLAKE3 pieces read
    # (they refuse another hash): servers of both can share the registry. A database with only that
    # list (made by such a version) is checked by it, and gets the BLAKE3 list when the bytes are
    # added again.
    with again.engine.begin() as conn:
        sha_list = conn.execute(
            text("SELECT pieces FROM artifact_pieces WHERE digest = :d"), {"d": record.digest}
        ).scalar_one()
        conn.execute(text("DELETE FROM artifact_pieces_blake3"))
    listed = json.loads(sha_list)
    data = (registry.store.path(record.digest) / listed["files"][-1]["name"]).read_bytes()
    assert (
        listed["files"][-1]["sha256"][0]
        == hashlib.sha256(data[: listed["piece_bytes"]]).hexdigest()
    )
    assert (
        again.pieces(record.digest) == Pieces.from_json(sha_list)
        and again.pieces(record.digest).algorithm == "sha256"
    )
    assert again.add_revision(adapter_v1, "chat").revision == record.revision
    assert again.pieces(record.digest) == pieces and pieces.algorithm == "blake3"


def test_rollback_is_atomic_under_concurrent_resolves(registry, adapter_v1, adapter_v2, resolve):
    registry.add_revision(adapter_v1, "chat", status="stable")
    registry.add_revision(adapter_v2, "chat", status="stable")  # r1 is now the previous stable
    seen: list[tuple[int, int, str]] = []  # (start ns, end ns, revision) of every resolution
    errors: list[BaseException] = []
    stop = threading.Event()

    def resolver(worker: int) -> None:
        i = 0
        while not stop.is_set():
            start = time.monotonic_ns()
            try:
                revision = resolve(registry, "default", "chat", user=f"w{worker}-{i % 50}").revision
            except BaseException as exc:  # noqa: BLE001 - every failure is a test failure
                errors.append(exc)
                return
            seen.append((start, time.monotonic_ns(), revision))
            i += 1

    def wait_for_more(count: int) -> None:
        target = len(seen) + count
        while len(seen) < target and not errors:
            time.sleep(0.005)

    threads = [threading.Thread(target=resolver, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    phases = []  # (rollback started, rollback returned, revision serving afterwards)
    try:
        for _ in range(6):
            wait_for_more(40)
            before = time.monotonic_ns()
            serving = registry.rollback("chat").traffic[0][0]
            phases.append((before, time.monotonic_ns(), serving))
        wait_for_more(40)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert [p[2] for p in phases] == ["r1", "r2", "r1", "r2", "r1", "r2"]
    boundaries = [(0, 0, "r2"), *phases, (2**63, 2**63, None)]
    for (_, done, serving), (next_start, _, _) in zip(boundaries, boundaries[1:]):
        # a resolution that began after one rollback returned and ended before the next began sees
        # only that state
        inside = {rev for start, end, rev in seen if start >= done and end <= next_start}
        assert inside == {serving}, (serving, inside)
    assert {rev for _, _, rev in seen} == {"r1", "r2"}


def test_names_and_revisions_are_matched_whole(registry, adapter_v1, resolve):
    """A trailing newline would pass a pattern ending in `$` and then break the response header that
    names it."""
    with pytest.raises(AdapterRejected, match="must match"):
        registry.add_revision(adapter_v1, "chat\n")
    with pytest.raises(AdapterRejected, match="must match"):
        registry.add_revision(adapter_v1, "chat", revision="r1\n")
    with pytest.raises(AdapterNotFound):
        resolve(registry, "anyone", "chat\n")


def test_a_split_has_one_canary_at_most(canary, adapter_v3):
    canary.add_revision(adapter_v3, "chat")
    with pytest.raises(LifecycleError, match="one canary at a time"):
        canary.set_traffic("chat", {"r1": 50, "r2": 25, "r3": 25})
    assert sorted(dict(canary.show("chat").traffic)) == ["r1", "r2"]


def test_the_same_bytes_under_a_new_label_are_refused_quarantined_ones_included(
    registry, adapter_v1, resolve
):
    first = registry.add_revision(adapter_v1, "chat", status="stable")
    with pytest.raises(AdapterRejected, match="these are the bytes of chat@r1"):
        registry.add_revision(adapter_v1, "chat", revision="r1-again")
    registry.quarantine("chat", first.revision, "bad")
    with pytest.raises(AdapterRejected, match=r"chat@r1 \(quarantined\)"):
        registry.add_revision(adapter_v1, "chat", revision="r1-again", status="stable")
    with pytest.raises(RevisionUnavailable):
        resolve(registry, "anyone", "chat")


def test_two_processes_creating_the_same_fresh_registry_both_succeed(tmp_path):
    """Two servers starting at once on a new registry file: the second waits for the first's tables
    (it failed on the database lock, or inserted the same first rows twice)."""
    script = (
        "import sys, time\nfrom loraplex.registry import Registry\nregistry = "
        "Registry(sys.argv[1])\n"
        "while time.time() < float(sys.argv[2]):\n    pass\nregistry.init()\nregistry.close()\n"
    )
    for trial in range(3):
        url, start = f"sqlite:///{tmp_path}/registry-{trial}.db", time.time() + 2.0
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, url, str(start)], stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errors
        registry = Registry(url)
        registry.init()
        assert registry.list_adapters() == []
        registry.close()


def _age(path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_gc_removes_only_old_entries_no_revision_refers_to(registry, adapter_v1, adapter_v2):
    used = registry.add_revision(adapter_v1, "chat").digest
    orphan = registry.store.put(adapter_v2)  # as a refused registration leaves it
    _age(registry.store.path(used), 7200)
    _age(registry.store.path(orphan), 7200)
    assert registry.gc_artifacts(3600) == [orphan]
    assert registry.store.has(used) and not registry.store.has(orphan)


def test_an_old_entry_used_again_is_young_for_gc(registry, adapter_v2):
    orphan = registry.store.put(adapter_v2)
    _age(registry.store.path(orphan), 7200)
    assert registry.store.put(adapter_v2) == orphan  # the same bytes again: the entry is reused...
    assert registry.gc_artifacts(3600) == []  # ...and no longer looks abandoned


def test_a_registration_whose_artifact_a_gc_removed_puts_it_back(registry, adapter_v2):
    """The artifact is put before the registration's transaction; a gc may remove it in between (it
    was an old orphan): the registration, under the write lock, finds it gone and puts it back."""
    store, put, calls = registry.store, registry.store.put, []

    def put_then_gc(src):
        digest = put(src)
        if not calls:
            store.remove(digest)  # what a concurrent gc did once the first put had returned
        calls.append(digest)
        return digest

    store.put = put_then_gc
    try:
        record = registry.add_revision(adapter_v2, "chat")
    finally:
        store.put = put
    assert store.has(record.digest) and registry.store.get(record.digest)


def test_a_name_with_only_staged_revisions_says_how_to_promote(
    registry, adapter_v1, adapter_v2, resolve
):
    registry.add_revision(adapter_v1, "chat")
    with pytest.raises(RevisionUnavailable) as info:
        resolve(registry, "default", "chat")
    assert str(info.value) == (
        "chat has no revision in service: r1 is staged, not promoted; promote one with "
        "`loraplex registry promote chat r1` (or POST /admin/adapters/chat/promote)"
    )
    registry.add_revision(adapter_v2, "chat")
    with pytest.raises(RevisionUnavailable, match="r1, r2 are staged.* promote chat r2`"):
        resolve(registry, "default", "chat")
    registry.promote("chat", "r2", 100)
    assert resolve(registry, "default", "chat").revision == "r2"
