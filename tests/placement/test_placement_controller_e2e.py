"""The placement controller with real processes: three `loraplex serve` workers on one SQLite
registry, a `loraplex router` in front, and `loraplex placement` controllers. A hot adapter is
placed on a bounded set of workers and the router sends its requests there; one controller is
active at a time and a second takes over when the first is killed; a drained worker's placements
move first and it gets no request; a killed worker's placements are placed again elsewhere while
every answer stays right."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loraplex.loadgen.procs import (
    ADMIN_TOKEN,
    Proc,
    start_router,
    start_together,
    start_worker,
    state,
    stop_together,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import make_registry  # noqa: E402 (the server tests' registry: shared-a and more)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
HOT = "shared-a"


def wait_for(predicate, what: str, timeout: float = 90.0):
    """A bound against hangs, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def start_controller(registry_url: str, workers: list[str], data_dir: Path) -> Proc:
    data_dir.mkdir(parents=True, exist_ok=True)
    token_file = data_dir / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    args = ["placement", "--registry", registry_url, "--admin-token-file", str(token_file)]
    for url in workers:
        args += ["--worker", url]
    # a few requests make an adapter hot, on two workers; moves as soon as the policy wants them
    args += ["--min-rps", "0.005", "--per-replica-rps", "0.005", "--max-replicas", "2"]
    args += ["--min-dwell-s", "0", "--min-hot-s", "0", "--interval-s", "0.5", "--lease-s", "60"]
    args += ["--metrics-port", "0"]
    return Proc(args, data_dir / "log.txt")


@pytest.fixture(scope="module")
def fleet(llama_dir, llama_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("placement-e2e")
    registry = make_registry(root, llama_dir, llama_adapters)
    registry.close()
    url = f"sqlite:///{root}/registry.db"
    workers = start_together(
        [
            lambda i=i: start_worker(
                llama_dir, root / f"w{i}", {}, "--registry", url, "--max-loras", "4"
            )
            for i in range(3)
        ]
    )
    urls = [w.url for w in workers]
    router = start_router(urls, root / "router", "affinity", "--poll-interval-s", "0.2")
    try:
        wait_for(lambda: _answers(f"{router.url}/health"), "the router to accept connections")
        yield {"root": root, "registry": url, "workers": workers, "router": router.url}
    finally:
        router.stop()
        stop_together([w for w in workers if w.p.poll() is None])


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def complete(url: str, model: str = HOT) -> httpx.Response:
    body = {"model": model, "prompt": "the fleet", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def placed_on(urls: list[str], key: str) -> list[str]:
    return [u for u in urls if key in _state(u).get("placed", [])]


def _state(url: str) -> dict:
    try:
        return state(url)
    except httpx.HTTPError:
        return {}


def metric(metrics_url: str, name: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    found = re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found[0]) if found else 0.0


def test_a_hot_adapter_is_placed_and_routed_to_its_workers_then_a_drain_moves_it(fleet):
    router, urls = fleet["router"], [w.url for w in fleet["workers"]]
    reference = complete(urls[0])
    assert reference.status_code == 200, reference.text
    for _ in range(4):  # demand in the workers' windows: hot enough for two replicas
        assert (
            complete(router).json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
        )
    key = f"{HOT}@r1"
    controller = start_controller(fleet["registry"], urls, fleet["root"] / "c1")
    fleet["controller"] = controller
    try:
        holders = wait_for(
            lambda: len(placed_on(urls, key)) == 2 and placed_on(urls, key), "two placements"
        )
        metrics = controller.url + "/metrics"
        assert metric(metrics, "loraplex_placement_leader") == 1.0
        assert metric(metrics, 'loraplex_placement_moves_total{kind="place",outcome="done"}') >= 2
        wait_for(
            lambda: metric(metrics, "loraplex_placement_placed_adapters") == 2.0, "the placed gauge"
        )
        for holder in holders:  # warm there: in a device slot, pinned
            rows = [a for a in state(holder)["adapters"] if a["name"] == HOT]
            assert [(a["tier"], a["pinned"]) for a in rows] == [("gpu", "gpu")]
        wait_for(lambda: all(_router_sees(router, u, key) for u in holders), "the router's view")
        answers = [complete(router) for _ in range(6)]
        assert {a.headers["x-loraplex-worker"] for a in answers} <= set(holders)
        assert all(a.headers["x-loraplex-route"].startswith("placed-") for a in answers)
        assert {a.json()["choices"][0]["text"] for a in answers} == {
            reference.json()["choices"][0]["text"]
        }

        drained = holders[0]  # as the chart's preStop hook does it
        token_file = fleet["root"] / "c1" / "admin-token"
        command = [sys.executable, "-m", "loraplex.cli", "drain", "--url", drained]
        command += ["--admin-token-file", str(token_file), "--timeout", "120"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"{drained} drained"
        assert _state(drained)["placed"] == []
        now_on = placed_on(urls, key)
        assert len(now_on) == 2 and drained not in now_on  # placed elsewhere before the release
        wait_for(lambda: _router_drain(router, drained) == "drained", "the router to see it")
        answers = [complete(router) for _ in range(6)]
        assert drained not in {a.headers["x-loraplex-worker"] for a in answers}
        assert all(a.status_code == 200 for a in answers)
        undrain = httpx.delete(f"{drained}/admin/drain", headers=ADMIN, timeout=30)
        assert undrain.status_code == 200 and undrain.json()["drain"] is None
    except BaseException:
        controller.stop()
        raise


def test_one_controller_is_active_and_a_second_takes_over_when_it_is_killed(fleet):
    first = fleet["controller"]
    urls = [w.url for w in fleet["workers"]]
    second = start_controller(fleet["registry"], urls, fleet["root"] / "c2")
    try:
        wait_for(lambda: "waiting (the lease is" in second.log_path.read_text(), "it to wait")
        assert metric(second.url + "/metrics", "loraplex_placement_leader") == 0.0
        assert metric(first.url + "/metrics", "loraplex_placement_leader") == 1.0
        first.kill()
        wait_for(lambda: ": active" in second.log_path.read_text(), "the second to take over")
        assert metric(second.url + "/metrics", "loraplex_placement_leader") == 1.0
        fleet["controller"] = second
    except BaseException:
        second.stop()
        raise


def test_a_killed_workers_placements_are_placed_again_and_answers_stay_right(fleet):
    router, workers = fleet["router"], fleet["workers"]
    controller = fleet["controller"]
    key = f"{HOT}@r1"
    urls = [w.url for w in workers]
    try:
        reference = complete(urls[0]).json()["choices"][0]["text"]
        holders = wait_for(
            lambda: len(placed_on(urls, key)) == 2 and placed_on(urls, key), "two placements"
        )
        victim = next(w for w in workers if w.url == holders[0])
        victim.kill()
        live = [u for u in urls if u != victim.url]
        answers = [complete(router) for _ in range(4)]  # during the move: answered, and right
        assert [a.status_code for a in answers] == [200] * 4
        assert {a.json()["choices"][0]["text"] for a in answers} == {reference}
        wait_for(lambda: sorted(placed_on(live, key)) == sorted(live), "placed again")
        answers = [complete(router) for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4
        assert {a.json()["choices"][0]["text"] for a in answers} == {reference}
        assert {a.headers["x-loraplex-worker"] for a in answers} <= set(live)
    finally:
        controller.stop()


def _router_workers(router: str) -> dict[str, dict]:
    listed = httpx.get(f"{router}/admin/workers", headers=ADMIN, timeout=30).json()["workers"]
    return {w["url"]: w for w in listed}


def _router_sees(router: str, url: str, key: str) -> bool:
    return key in _router_workers(router)[url].get("placed", [])


def _router_drain(router: str, url: str) -> str | None:
    return _router_workers(router)[url].get("drain")
