"""A fleet-wide cutover on real processes: three `loraplex serve` workers on one SQLite registry
and a `loraplex router`, a trainer publishing through the router with `wait=True`; one worker is
killed (SIGKILL) while the publish waits on it."""

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loraplex.client import Publisher
from loraplex.loadgen.procs import (
    ADMIN_TOKEN,
    start_router,
    start_together,
    start_worker,
    state,
    stop_together,
)
from loraplex.registry import Registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import variant  # noqa: E402 (the server tests' helpers)

NAME = "policy"


@pytest.fixture(scope="module")
def fleet(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cutover-e2e")
    url = f"sqlite:///{root / 'registry.db'}"
    registry = Registry(url, base_model_dir=llama_dir, max_lora_rank=16)
    registry.init()
    extra = ("--registry", url, "--max-loras", "2")
    workers = start_together(
        [lambda i=i: start_worker(llama_dir, root / f"w{i}", {}, *extra) for i in range(3)]
    )
    router = start_router([w.url for w in workers], root / "router")
    try:
        wait_until(lambda: answers(f"{router.url}/ready"))  # it prints its address before listening
        yield registry, workers, router
    finally:
        router.stop()
        stop_together(workers)
        registry.close()


def holds(url: str, revision: str) -> bool:
    return any(
        a["name"] == NAME and a["revision"] == revision and a["tier"] in ("gpu", "cpu")
        for a in state(url)["adapters"]
    )


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(predicate, timeout_s: float = 120.0) -> None:
    """A bound against hangs, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_a_worker_killed_mid_cutover_is_reported_and_the_rest_serve(
    fleet, llama_adapters, tmp_path
):
    registry, workers, router = fleet
    versions = [
        variant(llama_adapters["attn-r8"], tmp_path / f"v{i}", 1 + i / 10) for i in range(2)
    ]
    with Publisher(router.url, ADMIN_TOKEN) as publisher:
        first = publisher.publish_dir(NAME, versions[0], stable=True, keep=2, wait=True)
        assert first.cutover is not None and first.cutover.ready, first.cutover
        assert sorted(w.worker for w in first.cutover.workers) == sorted(w.url for w in workers)
        # the third worker stops answering, so that the publish waits on it; then it is killed
        victim = workers[2]
        os.kill(victim.p.pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(publisher.publish_dir, NAME, versions[1], stable=True, wait=True)
            wait_until(lambda: all(holds(w.url, "r2") for w in workers[:2]))
            assert not waiting.done()  # the publish still waits, on the stopped worker
            victim.kill()
            second = waiting.result(timeout=120)
    cutover = second.cutover
    assert cutover is not None and not cutover.ready
    assert [w.worker for w in cutover.not_ready] == [victim.url]
    assert cutover.not_ready[0].error
    assert {w.worker for w in cutover.workers if w.ready} == {w.url for w in workers[:2]}
    assert registry.show(NAME).stable.revision == second.revision == "r2"
    for model in (NAME, second.model):  # the rest serve the new version, the bare name included
        for _ in range(4):
            answer = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": model, "prompt": "x", "max_tokens": 1},
                timeout=120,
            )
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-loraplex-adapter"] == second.model
            assert answer.headers["x-loraplex-worker"] in {w.url for w in workers[:2]}
