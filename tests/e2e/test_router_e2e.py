"""Three real `loraplex serve` workers and a real `loraplex router`, all on loopback."""

import functools
import random
import threading
import time
from collections import Counter

import httpx
import pytest

from loraplex.loadgen.procs import start_router, start_together, start_worker, state, stop_together

NUM_ADAPTERS = 34  # ad00-ad09 for the first test, then twelve for each routing policy
ADMIN = {"Authorization": "Bearer e2e-admin-token-0123456789"}


@pytest.fixture(scope="module")
def fleet(llama_dir, llama_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("router-e2e")
    paths = list(llama_adapters.values())
    adapters = {f"ad{i:02d}": paths[i % len(paths)] for i in range(NUM_ADAPTERS)}
    workers = start_together(
        [
            functools.partial(start_worker, llama_dir, root / f"w{i}", adapters, "--max-loras", "2")
            for i in range(3)
        ]
    )
    try:
        yield root, workers, adapters, llama_dir
    finally:
        stop_together(workers)


def complete(url, model, max_tokens=2, stream=False):
    body = {
        "model": model,
        "prompt": "hello",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    return r


def wait_seen_idle_with(router_url: str, worker_url: str, name: str, timeout: float = 30.0) -> None:
    """Until the router's last poll of `worker_url` shows `name` in a slot and nothing running
    there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = httpx.get(f"{router_url}/admin/workers", headers=ADMIN, timeout=30).json()[
            "workers"
        ]
        view = next(w for w in listed if w["url"] == worker_url)
        if name in view["gpu"] and view["running"] == 0 and view["in_flight"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the router never saw {name} idle on {worker_url}")


def test_affinity_then_spill_then_failover_then_rejoin(fleet, tmp_path):
    root, workers, adapters, model_dir = fleet
    router = start_router([w.url for w in workers], tmp_path / "router")
    try:
        time.sleep(1.0)  # one poll round
        # 1. Repeated requests for one adapter stay on one worker while it is below saturation.
        seen = []
        for _ in range(6):
            r = complete(router.url, "ad00")
            assert r.status_code == 200, r.text
            seen.append(r.headers["x-loraplex-worker"])
            # the router knows where it is resident, and free
            wait_seen_idle_with(router.url, seen[-1], "ad00")
            # and a poll (every 0.5 s) has begun since the request ended: one made during it counts
            # its tokens against the worker, enough to send the next request to a worker with a free
            # slot
            time.sleep(1.1)
        assert len(set(seen[1:])) == 1, seen
        # 2. A burst above saturation spills to the other workers.
        burst = []

        def one():
            r = complete(router.url, "ad00", max_tokens=24)
            burst.append((r.status_code, r.headers.get("x-loraplex-worker")))

        threads = [threading.Thread(target=one) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(code == 200 for code, _ in burst)
        assert len({w for _, w in burst}) >= 2, Counter(w for _, w in burst)
        # 3. A killed worker costs no request that had not started: they are retried elsewhere.
        victim = workers[0]
        victim.kill()
        codes = [complete(router.url, f"ad{i:02d}").status_code for i in range(10)]
        assert codes == [200] * 10
        # 4. A restarted worker rejoins.
        workers[0] = start_worker(model_dir, root / "w0b", adapters, "--max-loras", "2")
        r = httpx.post(
            f"{router.url}/admin/workers", json={"url": workers[0].url}, headers=ADMIN, timeout=30
        )
        assert r.status_code == 200
        listed = httpx.get(f"{router.url}/admin/workers", headers=ADMIN).json()["workers"]
        assert any(w["url"] == workers[0].url and w["healthy"] for w in listed)
        metrics = httpx.get(f"{router.url}/metrics").text
        assert 'loraplex_router_picks_total{reason="affinity-gpu"}' in metrics
        assert "loraplex_router_retries_total" in metrics
    finally:
        router.stop()


def test_zipf_residency_concentrates_under_affinity(fleet, tmp_path):
    """The same Zipf sequence under each policy, each over twelve adapters no other test has used:
    the workers hold fewer copies of each adapter under affinity than under round-robin (which, from
    a fresh start, puts this sequence on exactly 24 worker slots)."""
    root, workers, adapters, _ = fleet
    spreads = {}
    for offset, policy in ((10, "affinity"), (22, "round-robin")):
        names = [f"ad{i:02d}" for i in range(offset, offset + 12)]
        router = start_router([w.url for w in workers], tmp_path / policy, policy=policy)
        try:
            time.sleep(1.0)
            rng = random.Random(0)
            weights = [1 / (i + 1) ** 0.9 for i in range(len(names))]
            for i in range(60):
                name = rng.choices(names, weights)[0]
                r = complete(router.url, name, max_tokens=1)
                assert r.status_code == 200
                if i % 10 == 9:
                    time.sleep(0.6)
        finally:
            router.stop()
        # Residency (gpu or cpu) of each adapter used, counted over the workers.
        resident = Counter()
        for w in workers:
            for a in state(w.url)["adapters"]:
                if a["name"] in names and a["tier"] in ("gpu", "cpu"):
                    resident[a["name"]] += 1
        spreads[policy] = sum(resident.values()) / len(resident)
    assert spreads["affinity"] < spreads["round-robin"], spreads
