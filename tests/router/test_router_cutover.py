"""A publish through the router that waits for the cutover: two real workers (uvicorn over
sockets) on one SQLite registry, a router in front; the wait covers the revision's pools, reports
a worker that does not answer, and a trainer gone mid-upload leaves nothing on the workers."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loraplex.artifacts import ArtifactStore
from loraplex.client import Publisher
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.registry import AdapterNotFound, Registry
from loraplex.router.app import RouterConfig, create_router_app
from loraplex.router.catalog import AdapterCatalog, RevisionFacts
from loraplex.router.cutover import pool_workers, upload_worker
from loraplex.router.fleet import Fleet
from loraplex.router.pools import PoolSpec, Reported
from loraplex.server.app import ServerConfig, create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import (  # noqa: E402 (the server tests' helpers)
    ADMIN_TOKEN,
    KEYS,
    MODEL,
    api_keys,
    make_registry,
    serving,
    variant,
)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def engine(llama_dir):
    config = EngineConfig(
        model_dir=llama_dir,
        dtype="float32",
        max_loras=2,
        kv_cache_memory_bytes=8 * 2**20,
        max_lora_rank=16,
    )
    return LLMEngine(config)


@pytest.fixture(scope="module")
def fleet(llama_dir, llama_adapters, tmp_path_factory):
    """(router URL, worker URLs, the registry) for two native workers on one registry file."""
    tmp = tmp_path_factory.mktemp("router-cutover")
    first = make_registry(tmp, llama_dir, llama_adapters)
    second = Registry(
        first.url, ArtifactStore(tmp / "artifacts"), base_model_dir=llama_dir, max_lora_rank=16
    )
    config = ServerConfig(MODEL, admin_token=ADMIN_TOKEN)
    workers = [create_app(engine(llama_dir), r, config, api_keys()) for r in (first, second)]
    with serving(workers[0]) as url0, serving(workers[1]) as url1:
        router = create_router_app(
            RouterConfig(workers=(url0, url1), admin_token=ADMIN_TOKEN, poll_interval_s=0.05)
        )
        with serving(router) as router_url:
            yield router_url, [url0, url1], first
    second.close()
    first.close()


@pytest.fixture(scope="module")
def versions(llama_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("router-cutover-versions")
    return [variant(llama_adapters["mlp-r4"], root / f"v{i}", 1.0 + 0.1 * i) for i in range(4)]


def resident(url: str, name: str) -> dict[str, str]:
    state = httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=30).json()
    return {a["revision"]: a["tier"] for a in state["adapters"] if a["name"] == name}


def test_a_waited_publish_returns_once_every_worker_holds_the_revision(fleet, versions):
    router_url, workers, registry = fleet
    with Publisher(router_url, ADMIN_TOKEN) as publisher:
        published = publisher.publish_dir("fleet-a", versions[0], stable=True, wait=True)
    cutover = published.cutover
    assert cutover is not None and cutover.ready and not cutover.not_ready
    assert sorted(w.worker for w in cutover.workers) == sorted(workers)
    for url in workers:  # each holds it before any request asked for it
        assert resident(url, "fleet-a")[published.revision] in ("gpu", "cpu")
    assert registry.get_revision("fleet-a", published.revision).digest == published.digest
    metrics = httpx.get(f"{router_url}/metrics", timeout=30).text
    assert "loraplex_router_publish_ready_seconds_count 1.0" in metrics
    answer = httpx.post(
        f"{router_url}/v1/completions",
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        json={"model": "fleet-a", "prompt": "x", "max_tokens": 1},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-loraplex-adapter"] == published.model


def dead_url() -> str:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_worker_that_does_not_answer_is_reported_and_the_others_go_on(fleet, versions):
    router_url, workers, _ = fleet
    gone = dead_url()
    added = httpx.post(f"{router_url}/admin/workers", headers=ADMIN, json={"url": gone}, timeout=30)
    assert added.status_code == 200, added.text
    try:
        with Publisher(router_url, ADMIN_TOKEN) as publisher:
            published = publisher.publish_dir("fleet-b", versions[1], stable=True, wait=True)
    finally:
        httpx.request("DELETE", f"{router_url}/admin/workers", headers=ADMIN, json={"url": gone})
    cutover = published.cutover
    assert cutover is not None and not cutover.ready
    assert [w.worker for w in cutover.not_ready] == [gone]
    assert "ConnectError" in (cutover.not_ready[0].error or "")
    for url in workers:
        assert resident(url, "fleet-b")[published.revision] in ("gpu", "cpu")


def test_the_publish_command_waits_and_prints_each_worker(fleet, versions, tmp_path):
    router_url, workers, _ = fleet
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN + "\n")
    command = [sys.executable, "-m", "loraplex.cli", "publish", "--url", router_url, "--wait"]
    command += ["--admin-token-file", str(token), "--name", "fleet-cli", "--stable"]
    done = subprocess.run([*command, str(versions[2])], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    head, *lines = done.stdout.splitlines()
    assert head.startswith("fleet-cli@r1 sha256:")
    assert sorted(line.split()[0] for line in lines) == sorted(workers)
    assert all(line.split()[1] == "ready" for line in lines), lines


def test_a_bad_wait_through_the_router_is_refused(fleet, versions):
    router_url, _, registry = fleet
    refused = httpx.post(
        f"{router_url}/admin/adapters/fleet-bad/upload?wait=soon",
        headers={**ADMIN, "Content-Type": "application/x-tar"},
        content=b"x" * 1024,
        timeout=30,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "wait"
    with pytest.raises(AdapterNotFound):
        registry.show("fleet-bad")


def test_a_trainer_gone_mid_upload_through_the_router_leaves_nothing(fleet, versions):
    router_url, _, registry = fleet
    store = registry.store
    work = store.root / "tmp"

    def leftovers():
        return set(store.digests()), sorted(p.name for p in work.iterdir()) if work.is_dir() else []

    before = leftovers()
    body = (versions[3] / "adapter_model.safetensors").read_bytes()
    host, port = router_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = (
            f"POST /admin/adapters/fleet-gone/upload?wait=ready HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {ADMIN_TOKEN}\r\nContent-Type: application/x-tar\r\n"
            f"Content-Length: {10 * len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)  # a tenth of the body, then the trainer is gone
        wait_until(lambda: len(leftovers()[1]) > len(before[1]))  # the worker's work directory
    wait_until(lambda: leftovers() == before)
    with pytest.raises(AdapterNotFound):
        registry.show("fleet-gone")

    def open_requests() -> list[int]:
        rows = httpx.get(f"{router_url}/admin/workers", headers=ADMIN, timeout=30).json()
        return [w["in_flight"] for w in rows["workers"]]

    wait_until(lambda: open_requests() == [0, 0])  # the router counts the upload done


def wait_until(predicate, rounds: int = 600) -> None:
    """A bound against hangs (30 s), not a timing assertion."""
    for _ in range(rounds):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_the_wait_covers_the_pools_that_may_serve_the_revision():
    shared, bobs = "http://shared:1", "http://bobs:1"
    fleet = Fleet([shared], None, pools=(PoolSpec("bob", tenants=("bob",), workers=(bobs,)),))
    record = {"base_model_digest": None, "rank": 4, "shared": False}
    assert pool_workers(fleet, {**record, "allowed_tenants": ["alice"]}) == [shared]
    assert pool_workers(fleet, {**record, "allowed_tenants": ["bob"]}) == [shared, bobs]
    assert pool_workers(fleet, {**record, "shared": True, "allowed_tenants": []}) == [shared, bobs]
    ranked = Fleet([shared], None, pools=(PoolSpec("big", max_rank=64, workers=(bobs,)),))
    ranked.workers[shared].pool = PoolSpec("default", max_rank=2)
    assert pool_workers(ranked, {**record, "shared": True}) == [bobs]


def published_bytes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    lines = [ln for ln in text.splitlines() if ln.startswith("loraplex_adapter_published_bytes")]
    return sum(float(ln.split()[-1]) for ln in lines if "_total" in ln)


def test_uploads_are_spread_over_the_workers(fleet, versions):
    router_url, workers, _ = fleet
    before = [published_bytes(url) for url in workers]
    with Publisher(router_url, ADMIN_TOKEN) as publisher:
        publisher.publish_dir("fleet-spread", versions[0], stable=True)
        publisher.publish_dir("fleet-spread", versions[1], stable=True)
    after = [published_bytes(url) for url in workers]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_an_upload_goes_to_a_worker_of_the_names_pool():
    """A name whose revisions are on base B goes to a worker of B's pool, in turn among the
    equally busy ones; a new name to any healthy worker; none healthy: None."""
    a1, b1, b2 = "http://a1:1", "http://b1:1", "http://b2:1"
    pools = (
        PoolSpec("a", base_model_digest="sha256:" + "a" * 64, workers=(a1,)),
        PoolSpec("b", base_model_digest="sha256:" + "b" * 64, workers=(b1, b2)),
    )
    fleet = Fleet([], None, pools=pools)
    facts = RevisionFacts("on-b", "r1", "base-b", "sha256:" + "b" * 64, 8, True, (), True)
    catalog = AdapterCatalog(lambda: 1, lambda: [facts], refresh_s=0)
    assert [upload_worker(fleet, catalog, "on-b", turn) for turn in range(3)] == [b1, b2, b1]
    fleet.workers[b1].in_flight = 1  # busy: the other one of the pool
    assert upload_worker(fleet, catalog, "on-b", 0) == b2
    new = {upload_worker(fleet, catalog, "new-name", turn) for turn in range(3)}
    assert new == {a1, b2}  # the least busy, whatever their pool
    fleet.workers[b2].reported = Reported(base_model_digest="sha256:" + "c" * 64)
    assert upload_worker(fleet, catalog, "on-b", 0) == b1  # b2 runs another base
    for worker in fleet.workers.values():
        worker.healthy = False
    assert upload_worker(fleet, catalog, "on-b", 0) is None
