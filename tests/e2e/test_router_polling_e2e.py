"""Two real `loraplex serve` workers and a real `loraplex router` (subprocesses, loopback): the
router polls each worker's routing view by generation, idle polls come back 304 with no body, and an
adapter moved from one worker's device slots to the other's reaches the router's view and its
routing."""

import functools
import time

import httpx
import pytest

from loraplex.loadgen.procs import start_router, start_together, start_worker, stop_together

ADMIN = {"Authorization": "Bearer e2e-admin-token-0123456789"}


@pytest.fixture(scope="module")
def fleet(llama_dir, llama_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("polling-e2e")
    paths = list(llama_adapters.values())
    adapters = {f"ad{i:02d}": paths[i % len(paths)] for i in range(6)}
    workers = start_together(
        [
            functools.partial(start_worker, llama_dir, root / f"w{i}", adapters, "--max-loras", "2")
            for i in range(2)
        ]
    )
    router = start_router([w.url for w in workers], root / "router")
    try:
        # it prints its address once bound, a moment before it accepts connections
        wait_for(lambda: _answers(f"{router.url}/health"), "the router to accept connections")
        yield router.url, [w.url for w in workers]
    finally:
        router.stop()
        stop_together(workers)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def seen(router: str) -> dict[str, dict]:
    listed = httpx.get(f"{router}/admin/workers", headers=ADMIN, timeout=30).json()["workers"]
    return {w["url"]: w for w in listed}


def wait_for(predicate, what: str, timeout: float = 60.0):
    """A bound against hangs, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def admin(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=ADMIN, timeout=60)


def idle(router: str, workers: list[str]) -> bool:
    """Every worker polled by generation, its last answer a 304 (0 body bytes)."""
    view = seen(router)
    return all(view[w]["healthy"] and view[w]["generation"] for w in workers) and all(
        view[w]["state_bytes"] == 0 for w in workers
    )


def route(router: str, model: str) -> str:
    body = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-loraplex-worker"]


def test_idle_polls_are_304_and_a_move_reaches_the_routers_view_and_routing(fleet):
    router, (a, b) = fleet
    wait_for(lambda: idle(router, [a, b]), "idle polls answered 304")
    generations = {w: seen(router)[w]["generation"] for w in (a, b)}

    assert admin(a, "/admin/adapters/ad01/prewarm", {"tier": "gpu"}).status_code == 200
    wait_for(lambda: "ad01" in seen(router)[a]["gpu"], "ad01 in a's slots, seen by the router")
    assert seen(router)[a]["generation"] != generations[a]
    assert route(router, "ad01") == a

    wait_for(
        lambda: admin(a, "/admin/adapters/ad01/evict", {}).status_code == 200, "ad01 evicted on a"
    )
    assert admin(b, "/admin/adapters/ad01/prewarm", {"tier": "gpu"}).status_code == 200
    wait_for(
        lambda: "ad01" in seen(router)[b]["gpu"] and "ad01" not in seen(router)[a]["gpu"],
        "the move seen by the router",
    )
    assert route(router, "ad01") == b
    wait_for(lambda: idle(router, [a, b]), "idle again")
