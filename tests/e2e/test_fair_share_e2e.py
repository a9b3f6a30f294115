"""Fair share at the router over real processes: one `loraplex serve` worker (native engine) that
runs one sequence at a time, a SQLite registry with two tenants, a real `loraplex router`. A tenant
that bursts gets its share, not the line: the other tenant's steady requests are answered while
most of the burst still waits. Without the router's queue the burst holds the worker's own
first-come queue and the steady tenant waits behind all of it."""

import re
import threading

import httpx
import pytest

from loraplex.loadgen.procs import start_router, start_worker
from loraplex.registry import Registry

BURST = 20


@pytest.fixture(scope="module")
def fleet(llama_dir, llama_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("fair-e2e")
    url = f"sqlite:///{root / 'registry.db'}"
    registry = Registry(url, base_model_dir=llama_dir)
    registry.init()
    keys = {}
    for tenant, adapter in (("acme", "attn-r8"), ("globex", "mlp-r4")):
        registry.add_tenant(tenant, 0)
        keys[tenant] = registry.create_key(tenant)
        registry.add_revision(llama_adapters[adapter], f"{tenant}-ad", "r1", tenant=tenant)
        registry.promote(f"{tenant}-ad", "r1", 100, force=True)
    registry.close()
    extra = ("--registry", url, "--max-num-seqs", "1", "--max-loras", "2")
    worker = start_worker(llama_dir, root / "w", {}, *extra)
    try:
        yield root, worker.url, url, keys
    finally:
        worker.stop()


def complete(url: str, tenant: str, keys: dict[str, str], tokens: int) -> httpx.Response:
    body = {
        "model": f"{tenant}-ad",
        "prompt": "hello",
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {keys[tenant]}"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)


def waiting_at(router_url: str, tenant: str) -> float:
    text = httpx.get(f"{router_url}/metrics", timeout=30).text
    found = re.search(rf'^loraplex_router_tenant_waiting{{tenant="{tenant}"}} (\S+)$', text, re.M)
    return float(found[1]) if found else 0.0


def burst_then_steady(router_url: str, keys: dict[str, str], queued: bool) -> list[str]:
    """acme sends BURST requests at once, then globex three one after another; the order in
    which the answers come back, by tenant."""
    for _ in range(600):  # until the router listens
        try:
            if httpx.get(f"{router_url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            threading.Event().wait(0.05)
    done: list[str] = []
    answers: list[httpx.Response] = []

    def send(tenant: str) -> None:
        answer = complete(router_url, tenant, keys, 200 if tenant == "acme" else 4)
        answers.append(answer)
        done.append(tenant)

    burst = [threading.Thread(target=send, args=("acme",)) for _ in range(BURST)]
    for t in burst:
        t.start()
    for _ in range(600):  # until the burst has reached the router (a bound, not a timing)
        if queued and waiting_at(router_url, "acme") >= BURST - 6:
            break
        if not queued and _open_on_worker(router_url) >= BURST:
            break
        threading.Event().wait(0.05)
    else:
        raise AssertionError(f"the burst never reached the router whole: {done}")
    for _ in range(3):
        send("globex")
    for t in burst:
        t.join()
    assert [a.status_code for a in answers] == [200] * (BURST + 3), [a.text for a in answers]
    return done


def _open_on_worker(router_url: str) -> int:
    listed = httpx.get(
        f"{router_url}/admin/workers",
        headers={"Authorization": "Bearer e2e-admin-token-0123456789"},
        timeout=30,
    ).json()["workers"]
    return sum(w["in_flight"] for w in listed)


def test_a_burst_does_not_starve_a_steady_tenant(fleet):
    root, worker, registry_url, keys = fleet
    common = ("--registry", registry_url, "--saturation-waiting", "0", "--poll-interval-s", "0.1")
    router = start_router([worker], root / "fair", "affinity", *common)
    try:
        done = burst_then_steady(router.url, keys, queued=True)
    finally:
        router.stop()
    last_steady = max(i for i, tenant in enumerate(done) if tenant == "globex")
    # each steady request waits for the requests already on the worker (one running, one
    # waiting), then goes first: all three are answered while much of the burst still waits
    assert done[last_steady:].count("acme") >= 4, done


def test_without_the_queue_the_burst_takes_the_line(fleet):
    root, worker, registry_url, keys = fleet
    common = ("--registry", registry_url, "--saturation-waiting", "0", "--queue-per-tenant", "0")
    router = start_router([worker], root / "fcfs", "affinity", *common)
    try:
        done = burst_then_steady(router.url, keys, queued=False)
    finally:
        router.stop()
    first_steady = done.index("globex")
    assert done[:first_steady].count("acme") >= BURST - 2, done
