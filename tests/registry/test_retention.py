"""Retention: a name keeps its newest K revisions servable; the older ones, and those an operator
deletes, are retired: never resolved or listed again, no grace period, an audit event each, and
their artifacts deleted from the store once no revision refers to the same bytes."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from sqlalchemy import inspect
from test_fleet_feed import KEY, _address, _models, _on_every_worker, _served

from loraplex.artifacts import ArtifactStore
from loraplex.registry import AdapterNotFound, AdapterRejected, LifecycleError, Registry
from loraplex.registry.catalog import Catalog
from loraplex.registry.rollouts import RolloutStore


@pytest.fixture(scope="module")
def versions(adapter_factory):
    """Five adapters with distinct bytes: r1..r5 of a policy."""
    return [adapter_factory(f"policy-{i}", seed=100 + i) for i in range(1, 6)]


def _statuses(registry: Registry, name: str) -> dict[str, str]:
    return {r.revision: r.status for r in registry.show(name, retired=True).revisions}


def _retirements(registry: Registry, name: str) -> list[tuple[str, str]]:
    events = registry.audit_events(100, target=name)
    return [(e.action, e.target) for e in reversed(events) if e.action in ("retire", "delete")]


def test_a_name_keeps_its_newest_k_revisions(registry, versions, resolve):
    for path in versions:  # an update loop: each revision stable as it comes
        registry.add_revision(path, "policy", status="stable", keep=2)
    assert _statuses(registry, "policy") == {
        "r1": "retired",
        "r2": "retired",
        "r3": "retired",
        "r4": "deprecated",
        "r5": "stable",
    }
    assert _retirements(registry, "policy") == [
        ("retire", "policy@r1"),
        ("retire", "policy@r2"),
        ("retire", "policy@r3"),
    ]
    assert [r.revision for r in registry.show("policy").revisions] == ["r4", "r5"]
    assert resolve(registry, "default", "policy").revision == "r5"
    assert resolve(registry, "default", "policy@r4").revision == "r4"
    for retired in ("r1", "r2", "r3"):
        with pytest.raises(AdapterNotFound):
            resolve(registry, "default", f"policy@{retired}")
    # the previous stable is kept warm; the retired ones get no grace period
    assert [r.model_id for r in registry.grace_revisions()] == ["policy@r4"]
    registry.rollback("policy")  # back to the kept one
    assert resolve(registry, "default", "policy").revision == "r4"
    with pytest.raises(LifecycleError, match="policy@r3 is retired"):
        registry.promote("policy", "r3")


def test_the_catalog_of_another_process_drops_retired_revisions(
    registry, make_registry, db_url, versions
):
    catalog = Catalog(make_registry(db_url))  # a server's, on its own connection
    for path in versions[:3]:
        registry.add_revision(path, "policy", status="stable")
    catalog.refresh()
    assert [r.revision for r in catalog.adapter("policy").revisions] == ["r1", "r2", "r3"]
    registry.set_keep("policy", 1)
    changed = catalog.refresh()
    assert changed.adapters == {"policy"}
    assert [r.revision for r in catalog.adapter("policy").revisions] == ["r3"]
    assert catalog.adapter("policy").keep == 1
    with pytest.raises(AdapterNotFound):
        catalog.resolve("default", "policy@r2")
    assert catalog.resolve("default", "policy").revision == "r3"


def test_the_split_and_a_rollout_under_way_are_never_retired(registry, versions):
    r1, r2, r3, r4, r5 = versions
    registry.add_revision(r1, "policy", status="stable")
    registry.add_revision(r2, "policy")
    registry.add_revision(r3, "policy")
    registry.promote("policy", "r2", 10)  # r2 canary beside r1
    RolloutStore(registry).begin("policy", "r3", "r1", (1, 100), {}, lease_s=60)
    registry.add_revision(r4, "policy")
    registry.add_revision(r5, "policy")
    registry.set_keep("policy", 1)
    assert _statuses(registry, "policy") == {
        "r1": "stable",
        "r2": "canary",
        "r3": "staging",  # the rollout's
        "r4": "retired",
        "r5": "staging",
    }
    assert _retirements(registry, "policy") == [("retire", "policy@r4")]


def test_a_promotion_retires_beyond_keep_and_staged_revisions_wait_for_it(registry, versions):
    r1, r2, r3 = versions[:3]
    registry.add_revision(r1, "policy", status="stable", keep=1)
    registry.add_revision(r2, "policy")
    registry.add_revision(r3, "policy")
    assert _statuses(registry, "policy") == {"r1": "stable", "r2": "staging", "r3": "staging"}
    registry.promote("policy", "r3")
    assert _statuses(registry, "policy") == {"r1": "retired", "r2": "retired", "r3": "stable"}


def test_delete_is_refused_for_the_stable_the_split_and_a_quarantine(registry, versions, resolve):
    r1, r2, r3, r4 = versions[:4]
    registry.add_revision(r1, "policy", status="stable")
    registry.add_revision(r2, "policy")
    registry.add_revision(r3, "policy")
    registry.add_revision(r4, "policy")
    registry.promote("policy", "r2", 10)
    registry.quarantine("policy", "r4", "bad outputs")
    refusals = {
        "r1": "policy@r1 is the stable revision; promote another revision first",
        "r2": "policy@r2 is in a traffic split or a rollout; roll back or promote another "
        "revision first",
        "r4": "policy@r4 is quarantined: its row is kept so that its bytes are never registered "
        "again",
    }
    for revision, message in refusals.items():
        with pytest.raises(LifecycleError) as info:
            registry.delete_revision("policy", revision)
        assert str(info.value) == message
    assert resolve(registry, "default", "policy@r3").revision == "r3"
    registry.delete_revision("policy", "r3")
    with pytest.raises(AdapterNotFound):
        resolve(registry, "default", "policy@r3")
    with pytest.raises(LifecycleError, match="already retired"):
        registry.delete_revision("policy", "r3")
    with pytest.raises(AdapterNotFound):
        registry.delete_revision("policy", "r9")
    assert _retirements(registry, "policy") == [("delete", "policy@r3")]
    assert _statuses(registry, "policy")["r3"] == "retired"


def _artifact_events(registry: Registry) -> list[str]:
    events = registry.audit_events(200, target=None)
    return [e.target for e in reversed(events) if e.action == "delete_artifact"]


def test_retirement_deletes_the_artifacts_no_revision_refers_to(registry, adapter_factory):
    """10 publishes at keep 3, no gc: the store holds the newest 3 of the name, and the bytes
    another name has too stay until that name retires them as well."""
    paths = [adapter_factory(f"publish-{i}", seed=300 + i) for i in range(10)]
    shared = registry.add_revision(paths[0], "other", status="stable")  # r1's bytes, elsewhere
    published = [registry.add_revision(p, "policy", status="stable", keep=3) for p in paths]
    store = registry.store
    kept = {r.digest for r in published[-3:]}
    assert set(store.digests()) == kept | {shared.digest}
    for record in published[-3:]:
        assert store.get(record.digest).is_dir()  # still hashes to its digest
    assert _artifact_events(registry) == [r.digest for r in published[1:7]]
    assert registry.gc_artifacts(3600) == []  # nothing left for gc
    assert (store.path(shared.digest) / "adapter_model.safetensors").read_bytes() == (
        paths[0] / "adapter_model.safetensors"
    ).read_bytes()
    registry.set_keep("other", 1)
    registry.add_revision(paths[1], "other", status="stable")  # other's r1 retired: now unheld
    assert not store.has(shared.digest)
    assert set(store.digests()) == kept | {published[1].digest}  # other@r2's bytes came back
    assert _artifact_events(registry)[-1] == shared.digest
    retire_events = [e for e in registry.audit_events(200) if e.action == "retire"]
    assert len(retire_events) == 8  # the audit log keeps each retired revision's record


def test_a_registration_racing_the_deletion_keeps_its_artifact(registry, adapter_factory):
    """The same bytes registered under another name while a retirement deletes them: stored
    before the deletion and recorded after it, they are put back in the registration's
    transaction; recorded before the deletion's transaction, they are not deleted."""
    from loraplex.registry.retention import release_artifacts

    first, second, third = (adapter_factory(f"race-{i}", seed=400 + i) for i in range(3))
    old = registry.add_revision(first, "policy", status="stable", keep=1)
    registration = registry.registration
    stored = registration.check_and_store(first, None, None, None, None, None)
    registry.add_revision(second, "policy", status="stable")  # retires r1: its bytes go
    assert not registry.store.has(old.digest)
    with registry.db.write() as session:  # the racing registration's transaction
        adapter = registration.adapter_for_add(session, "twin", None, None, "CAUSAL_LM", None, 0)
        twin = registration.insert_revision(session, adapter, stored, None, "stable")
    assert twin.digest == old.digest
    assert registry.store.get(twin.digest).is_dir()  # back, and it hashes to its digest
    # a deletion whose transaction comes after a registration of the same bytes keeps them
    newer = registry.add_revision(third, "policy", status="stable")
    assert release_artifacts(registry.db, {old.digest: old.storage_uri}) == []
    assert release_artifacts(registry.db, {newer.digest: newer.storage_uri}) == []
    assert registry.store.has(old.digest) and registry.store.has(newer.digest)


def test_a_retired_revisions_bytes_come_back_as_a_new_revision(registry, versions):
    r1, r2 = versions[:2]
    first = registry.add_revision(r1, "policy", status="stable", keep=1)
    registry.add_revision(r2, "policy", status="stable")
    assert not registry.store.has(first.digest)
    with pytest.raises(AdapterRejected, match="policy@r1 is retired and its label is not used"):
        registry.add_revision(r1, "policy", revision="r1")
    again = registry.add_revision(r1, "policy", status="stable")
    assert (again.revision, again.digest, again.status) == ("r3", first.digest, "stable")
    assert registry.store.has(first.digest)
    assert _statuses(registry, "policy") == {"r1": "retired", "r2": "retired", "r3": "stable"}


def test_keep_is_checked(registry, versions):
    registry.add_revision(versions[0], "policy")
    with pytest.raises(AdapterRejected, match="keep: a name keeps at least 1 revision"):
        registry.set_keep("policy", 0)
    with pytest.raises(AdapterRejected, match="keep"):
        registry.add_revision(versions[1], "policy", keep=-1)
    assert registry.show("policy").keep is None
    assert registry.set_keep("policy", 3).keep == 3
    assert registry.set_keep("policy", None).keep is None
    keeps = [e.detail for e in registry.audit_events(10, target="policy") if e.action == "keep"]
    assert keeps == [{"keep": None}, {"keep": 3}]


def test_a_registry_made_before_keep_gains_the_column_on_open(
    db_url, versions, llama_dir, tmp_path
):
    registry = Registry(db_url, ArtifactStore(tmp_path / "store"), base_model_dir=llama_dir)
    registry.init()
    registry.add_revision(versions[0], "policy", status="stable")
    engine = registry.engine
    with engine.begin() as conn:  # the table as an older version made it
        conn.exec_driver_sql("ALTER TABLE adapters DROP COLUMN keep")
    assert "keep" not in {c["name"] for c in inspect(engine).get_columns("adapters")}
    registry.close()
    registry = Registry(db_url, ArtifactStore(tmp_path / "store"), base_model_dir=llama_dir)
    try:
        assert registry.show("policy").keep is None
        registry.add_revision(versions[1], "policy", status="stable", keep=1)
        assert _statuses(registry, "policy") == {"r1": "retired", "r2": "stable"}
        with registry.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT keep FROM adapters").all() == [(1,)]
    finally:
        registry.close()


ADMIN_TOKEN = "admin-token-0123456789abcdef"


def _serve(llama_dir, url: str, tmp_path, *extra) -> subprocess.Popen:
    """A `loraplex serve` worker on the registry at `url` (alice's key is test_fleet_feed's)."""
    (tmp_path / "keys").write_text(f"alice {KEY}\n")
    command = [
        sys.executable, "-m", "loraplex.cli", "serve", "--model", llama_dir,
        "--served-model-name", "tiny", "--registry", url, "--port", "0",
        "--data-dir", tmp_path / "worker", "--engine-core", "thread", "--dtype", "float32",
        "--api-keys", tmp_path / "keys", "--allowed-roots", tmp_path / "store", *extra,
    ]  # fmt: skip
    log = open(tmp_path / "worker.log", "w")
    return subprocess.Popen(list(map(str, command)), stdout=subprocess.PIPE, stderr=log, text=True)


def _pins(url: str, name: str) -> dict[str, str | None]:
    """Each resident revision of `name` on the worker, and the tier it is pinned in."""
    state = httpx.get(
        f"{url}/admin/state", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    ).json()
    return {a["revision"]: a["pinned"] for a in state["adapters"] if a["name"] == name}


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    """Poll until it holds (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_worker_stops_serving_what_is_retired(
    make_registry, sqlite_url, versions, llama_dir, tmp_path
):
    """A real `loraplex serve` on the registry: retirements made by another process reach it by the
    change feed; `name@retired` is 404 there, the bare name the newest, and /v1/models lists only
    what serves."""
    registry = make_registry(sqlite_url)
    registry.add_tenant("alice")
    for path in versions[:2]:
        registry.add_revision(path, "policy", shared=True, status="stable")
    worker = _serve(llama_dir, sqlite_url, tmp_path)
    try:
        url = _address(worker)
        assert (_served(url, "policy"), _served(url, "policy@r1")) == ("policy@r2", "policy@r1")
        registry.add_revision(versions[2], "policy", status="stable", keep=2)  # r1 retired
        _on_every_worker([url], lambda u: _served(u, "policy@r1") == 404, "the retirement")
        assert (_served(url, "policy"), _served(url, "policy@r2")) == ("policy@r3", "policy@r2")
        registry.delete_revision("policy", "r2")
        _on_every_worker([url], lambda u: _served(u, "policy@r2") == 404, "the deletion")
        assert _served(url, "policy") == "policy@r3"
        assert [m for m in _models(url) if m.startswith("policy")] == ["policy"]
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def test_a_worker_unpins_a_pinned_names_retired_revision(
    make_registry, sqlite_url, versions, llama_dir, tmp_path
):
    """A name pinned in gpu that keeps 1 revision: its promotion retires the previous stable in the
    same commit; the worker moves the pin to the new stable and leaves the retired one no pin, not
    even a grace one."""
    registry = make_registry(sqlite_url)
    registry.add_tenant("alice")
    registry.add_revision(versions[0], "policy", shared=True, status="stable", keep=1)
    registry.pin("policy", tier="gpu")
    (tmp_path / "admin.token").write_text(ADMIN_TOKEN + "\n")
    worker = _serve(llama_dir, sqlite_url, tmp_path, "--admin-token-file", tmp_path / "admin.token")
    try:
        url = _address(worker)
        _wait_for(lambda: _pins(url, "policy") == {"r1": "gpu"}, "r1 pinned at start")
        registry.add_revision(versions[1], "policy", status="stable")
        _wait_for(lambda: _pins(url, "policy").get("r2") == "gpu", "the pin to move to r2")
        assert _pins(url, "policy").get("r1") is None  # unpinned (or evicted already)
        assert (_served(url, "policy@r1"), _served(url, "policy")) == (404, "policy@r2")
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
