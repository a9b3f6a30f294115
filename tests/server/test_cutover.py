"""Waiting for a publish's cutover on one real server: `?wait=ready` answers once the worker holds
the new revision, a prewarm with `wait_s` reports a revision's readiness (a failed load included),
the metrics of held and retired revisions, and a publish racing a rollback."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import variant
from test_publish import TAR, archive, files_of

from loraplex.registry import AdapterNotFound


def upload(running, name: str, src, **params) -> httpx.Response:
    return httpx.post(
        f"{running.url}/admin/adapters/{name}/upload",
        params={k: str(v).lower() if isinstance(v, bool) else v for k, v in params.items()},
        content=archive(files_of(src)),
        headers=TAR,
        timeout=120,
    )


def series(running, name: str, labels: str = "") -> float | None:
    text = httpx.get(f"{running.url}/metrics", timeout=30).text
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return None if match is None else float(match[1])


@pytest.fixture(scope="module")
def versions(llama_adapters, tmp_path_factory):
    """Nine versions of attn-r8: its config, other bytes (the last one's are removed from the
    store by a test)."""
    root = tmp_path_factory.mktemp("cutover")
    return [variant(llama_adapters["attn-r8"], root / f"v{i}", 1.0 + 0.05 * i) for i in range(9)]


def resident(running, name: str) -> dict[str, str]:
    return {a["revision"]: a["tier"] for a in running.state()["adapters"] if a["name"] == name}


def test_an_upload_that_waits_answers_once_the_worker_holds_the_revision(running, versions):
    timed = series(running, "loraplex_adapter_publish_ready_seconds_count") or 0.0
    response = upload(running, "wait-a", versions[0], stable=True, wait="ready", timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    cutover = answer["cutover"]
    assert cutover["ready"] is True and len(cutover["workers"]) == 1
    row = cutover["workers"][0]
    assert row["worker"] == running.url and row["ready"] and row["error"] is None
    assert row["model"] == f"wait-a@{answer['revision']}" and row["tier"] in ("gpu", "cpu")
    # held in host memory by the time the answer came: no request has asked for it yet
    assert resident(running, "wait-a")[answer["revision"]] in ("gpu", "cpu")
    assert set(answer["timings"]) == {"receive_s", "register_s"}
    assert series(running, "loraplex_adapter_publish_ready_seconds_count") == timed + 1
    plain = upload(running, "wait-a", versions[1], stable=True).json()
    assert "cutover" not in plain  # without a wait the answer comes at once


@pytest.mark.parametrize(
    "params, param",
    [({"wait": "loaded"}, "wait"), ({"wait": "ready", "timeout": 0}, "timeout")],
)
def test_a_bad_wait_is_refused_and_registers_nothing(running, versions, params, param):
    response = upload(running, "wait-bad", versions[2], **params)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    with pytest.raises(AdapterNotFound):
        running.registry.show("wait-bad")


def prewarm(running, name: str, revision: str) -> dict:
    response = running.admin(
        "POST", f"/admin/adapters/{name}/prewarm", json={"revision": revision, "wait_s": 30}
    )
    assert response.status_code == 200, response.text
    return response.json()["ready"][0]


def test_a_failed_load_is_reported_not_ready(running, versions):
    record = upload(running, "wait-broken", versions[8]).json()  # staging: nothing loads it
    store = running.registry.store
    store.remove(record["digest"])  # its bytes gone from the store: its load fails
    row = prewarm(running, "wait-broken", record["revision"])
    assert row["ready"] is False and row["error"], row
    assert row["tier"] not in ("gpu", "cpu")


def test_held_and_retired_revisions_follow_keep(running, versions):
    retired = series(running, "loraplex_adapter_revisions_retired_total")
    made = []
    for src in versions[4:8]:
        answer = upload(running, "wait-keep", src, stable=True, keep=2, wait="ready")
        assert answer.status_code == 200, answer.text
        assert answer.json()["cutover"]["ready"]
        made.append(answer.json()["revision"])
    # four published at keep 2: the two oldest retired, and unloaded here
    listed = [r.revision for r in running.registry.show("wait-keep").revisions]
    assert listed == made[2:]
    running.wait_for(lambda: set(resident(running, "wait-keep")) == set(made[2:]), what="unloads")
    held = series(running, "loraplex_adapter_revisions_held", '{adapter="wait-keep"}')
    assert held == 2
    running.wait_for(
        lambda: series(running, "loraplex_adapter_revisions_retired_total") == retired + 2,
        what="the retired count",
    )
    row = prewarm(running, "wait-keep", made[0])  # retired: never ready again
    assert row["ready"] is False and "not servable" in row["error"]
    assert series(running, "loraplex_adapter_revisions_held", '{adapter="shared-a"}') is None


def consistent(running, name: str, keep: int) -> dict:
    """The registry's state of `name` is one consistent state:
    - exactly one revision takes traffic, at weight 100, and it is the one stable revision;
    - the revisions not retired are exactly the newest `keep` by creation (every add here is
      stable, so each add retired all older ones), and the one in traffic is among them;
    - every revision not retired has its artifact in the store;
    - the audit log agrees: the revision in traffic is the one the name's last stable add or
      rollback event put there;
    - the server resolves the bare name to that revision.
    Returns the adapter's record."""
    adapter = running.registry.show(name)
    serving = [r for r in adapter.revisions if r.traffic_weight]
    assert len(serving) == 1 and serving[0].traffic_weight == 100, adapter.traffic
    assert [r.revision for r in adapter.revisions if r.status == "stable"] == [serving[0].revision]
    everything = running.registry.show(name, retired=True).revisions
    newest = {r.revision for r in sorted(everything, key=lambda r: r.created_at)[-keep:]}
    assert {r.revision for r in adapter.revisions} == newest and serving[0].revision in newest
    for record in adapter.revisions:
        assert running.registry.store.has(record.digest), record.revision
    last = next(
        e
        for e in running.registry.audit_events(1000, name)
        if e.action == "rollback" or (e.action == "add" and e.detail.get("status") == "stable")
    )
    put_there = last.detail["to"] if last.action == "rollback" else last.target.split("@")[1]
    assert put_there == serving[0].revision, (last, serving[0].revision)
    answer = running.client().completions.with_raw_response.create(
        model=name, prompt="x", max_tokens=1
    )
    assert answer.headers["x-loraplex-adapter"] == f"{name}@{serving[0].revision}"
    return adapter


def test_a_publish_racing_a_rollback_ends_in_one_consistent_state(running, versions):
    name, keep = "race", 3
    for src in versions[:2]:
        assert upload(running, name, src, stable=True, keep=keep).status_code == 200
    with ThreadPoolExecutor(2) as pool:
        for src in versions[2:8]:
            published = pool.submit(upload, running, name, src, stable=True)
            rolled = pool.submit(running.admin, "POST", f"/admin/adapters/{name}/rollback")
            assert published.result().status_code == 200, published.result().text
            # a rollback finds a previous stable revision, or says there is none (nothing changed)
            assert rolled.result().status_code in (200, 409), rolled.result().text
            consistent(running, name, keep)
