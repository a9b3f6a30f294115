"""The catalog in memory and the registry's change feed, on SQLite and PostgreSQL: a commit made by
another registry (another process's) reaches the catalog through the watcher (LISTEN/NOTIFY,
`data_version`) with nothing read while nothing changes; the catalog resolves as the registry does;
a feed pruned past a reader makes it read everything again."""

import asyncio
import threading
import time

import pytest
from sqlalchemy import event, text

from loraplex.registry import AdapterNotFound, RevisionUnavailable
from loraplex.registry.catalog import Catalog
from loraplex.registry.changes import ChangeWatcher


def _wait(predicate, what: str, timeout: float = 30.0):
    """Poll until the predicate holds (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _statements(engine) -> list[str]:
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda _c, _cur, sql, *_: seen.append(sql))
    return seen


@pytest.fixture
def watched(registry):
    catalog = Catalog(registry)
    catalog.refresh()
    watcher = ChangeWatcher(registry.engine, catalog.refresh, idle_s=0.2)
    watcher.start()
    yield catalog
    watcher.stop()


def test_another_registrys_commits_reach_the_catalog_by_push_and_idle_reads_nothing(
    watched, registry, make_registry, db_url, adapter_v1, adapter_v2
):
    other = make_registry(db_url)  # as another process: its own engine and connections
    other.add_tenant("alice")
    other.add_revision(adapter_v1, "a", tenant="alice", status="stable")
    _wait(lambda: watched.adapter("a") is not None, "the new adapter")
    assert watched.resolve("alice", "a").revision == "r1"
    with pytest.raises(AdapterNotFound):
        watched.resolve("bob", "a")  # another tenant's: as an unknown name

    other.add_revision(adapter_v2, "a", revision="r2")
    other.promote("a", "r2", 100, force=True)
    _wait(lambda: watched.adapter("a").traffic == (("r2", 100),), "the promotion")
    other.quarantine("a", "r2", "bad bytes")
    _wait(lambda: watched.adapter("a").traffic == (("r1", 100),), "the quarantine")
    with pytest.raises(RevisionUnavailable, match="quarantined"):
        watched.resolve("alice", "a@r2")
    assert watched.resolve("alice", "a") == registry.get_revision("a", "r1")

    time.sleep(0.3)  # the last notification handled
    seen = _statements(registry.engine)
    refreshes = watched.num_refreshes
    time.sleep(0.5)
    for _ in range(100):
        watched.resolve("alice", "a")
    assert (seen, watched.num_refreshes) == ([], refreshes)


def test_grants_and_tenant_changes_are_in_the_feed(watched, make_registry, db_url, adapter_v1):
    other = make_registry(db_url)
    other.add_tenant("alice")
    other.add_tenant("bob")
    other.add_revision(adapter_v1, "a", tenant="alice", status="stable")
    _wait(lambda: watched.adapter("a") is not None, "the adapter")
    other.grant("a", "bob")
    _wait(lambda: "bob" in watched.adapter("a").allowed_tenants, "the grant")
    assert [a.name for a in watched.visible("bob")] == ["a"]
    seen = []
    watched.subscribe(seen.append)
    other.add_tenant("bob", priority=3)
    _wait(lambda: any(c.tenants for c in seen), "the tenant change")
    assert all(c.adapters == frozenset() for c in seen), seen


def test_a_feed_pruned_past_the_reader_reads_the_whole_catalog(
    registry, make_registry, db_url, adapter_v1, adapter_v2
):
    catalog = Catalog(registry)
    catalog.refresh()
    registry.add_revision(adapter_v1, "a", shared=True, status="stable")
    assert catalog.refresh().adapters == frozenset({"a"})
    registry.add_revision(adapter_v2, "b", shared=True, status="stable")
    with registry.engine.begin() as conn:  # as the writers' pruning trigger would
        conn.execute(text("DELETE FROM registry_changes"))
    registry.add_tenant("carol")
    assert catalog.refresh().adapters is None  # everything, read again
    assert catalog.names == ["a", "b"]


def test_this_processs_commit_is_applied_before_the_next_resolution(registry, adapter_v1):
    catalog = Catalog(registry)
    catalog.refresh()
    registry.add_revision(adapter_v1, "a", shared=True, status="stable")
    refreshes = catalog.num_refreshes

    async def resolve_after_commit():
        await asyncio.gather(*(catalog.current() for _ in range(10)))  # one refresh for all
        return catalog.resolve("alice", "a").model_id

    assert asyncio.run(resolve_after_commit()) == "a@r1"
    assert catalog.num_refreshes == refreshes + 1

    async def nothing_pending():
        await catalog.current()

    asyncio.run(nothing_pending())
    assert catalog.num_refreshes == refreshes + 1


def test_a_refresh_on_another_thread_never_shows_a_half_applied_name(registry, adapter_v1):
    catalog = Catalog(registry)
    catalog.refresh()
    registry.add_revision(adapter_v1, "a", shared=True, status="stable")
    catalog.refresh()
    stop = threading.Event()
    seen = set()

    def read():
        while not stop.is_set():
            adapter = catalog.adapter("a")
            seen.add(tuple(r.traffic_weight for r in adapter.revisions))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(5):
            registry.deprecate("a")
            catalog.refresh()
            registry.promote("a", "r1", 100, force=True)
            catalog.refresh()
    finally:
        stop.set()
        reader.join()
    assert seen <= {(0,), (100,)}
