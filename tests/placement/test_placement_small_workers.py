"""The placement controller over small real workers: a `loraplex serve` worker at `--max-loras 2`
takes one placement despite the default `--min-free-slots 2`, and one at `--max-loras 1`, which pins
nothing, takes none: the controller says so once in its log and counts it in its metrics."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx

from loraplex.loadgen.procs import (
    start_placement,
    start_together,
    start_worker,
    state,
    stop_together,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import make_registry  # noqa: E402 (the server tests' registry: shared-a and more)

HOT = "shared-a"


def wait_for(predicate, what: str, timeout: float = 90.0):
    """A bound against hangs, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def metric(metrics_url: str, name: str) -> float | None:
    text = httpx.get(metrics_url, timeout=10).text
    found = re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found[0]) if found else None


def test_a_two_slot_worker_takes_one_placement_and_a_one_slot_worker_is_reported(
    llama_dir, llama_adapters, tmp_path
):
    registry = make_registry(tmp_path, llama_dir, llama_adapters)
    registry.close()
    url = f"sqlite:///{tmp_path}/registry.db"
    two, one = start_together(
        [
            lambda n=n: start_worker(
                llama_dir, tmp_path / f"w{n}", {}, "--registry", url, "--max-loras", str(n)
            )
            for n in (2, 1)
        ]
    )
    controller = None
    try:
        body = {"model": HOT, "prompt": "the fleet", "max_tokens": 2, "temperature": 0}
        for worker in (two, one, two, one):  # demand in both windows: hot for two replicas
            answer = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
        policy = ["--min-rps", "0.005", "--per-replica-rps", "0.005", "--max-replicas", "2"]
        policy += ["--min-hot-s", "0", "--interval-s", "0.5", "--lease-s", "60"]
        controller = start_placement(url, [two.url, one.url], tmp_path / "c", *policy)
        metrics = controller.url + "/metrics"
        key = f"{HOT}@r1"
        wait_for(lambda: key in state(two.url)["placed"], "the placement on the two-slot worker")
        rows = [a for a in state(two.url)["adapters"] if a["name"] == HOT]
        assert [(a["tier"], a["pinned"]) for a in rows] == [("gpu", "gpu")]
        wait_for(lambda: metric(metrics, "loraplex_placement_workers_up") == 2.0, "a round")
        assert metric(metrics, "loraplex_placement_workers_unplaceable") == 1.0
        assert metric(metrics, "loraplex_placement_placed_adapters") == 1.0
        assert state(one.url)["placed"] == []
        failed = 'loraplex_placement_moves_total{kind="place",outcome="failed"}'
        assert metric(metrics, failed) in (None, 0.0)  # never asked of the one-slot worker
        said = re.findall(
            r"worker (\S+) takes no placement: it has (\d+) device slot", _log(controller)
        )
        assert said == [(one.url, "1")]
    finally:
        if controller is not None:
            controller.stop()
        stop_together([two, one])


def _log(proc) -> str:
    return proc.log_path.read_text()
