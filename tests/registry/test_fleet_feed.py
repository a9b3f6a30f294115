"""Three `loraplex serve` processes on one PostgreSQL registry: a registration, a promotion, a
quarantine and a rollback made by another process reach every worker by LISTEN/NOTIFY, and
requests at steady state send the database no statement at all (the workers' connections log
every statement to the cluster's log, counted between two markers)."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest

KEY = "alice-key-0123456789"
NUM_WORKERS = 3


def _start(llama_dir: Path, url: str, tmp: Path, index: int) -> subprocess.Popen:
    keys = tmp / "keys"
    keys.write_text(f"alice {KEY}\n")
    (tmp / "store").mkdir(exist_ok=True)  # an allowed root is a directory that exists
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loraplex.cli",
            "serve",
            "--model",
            str(llama_dir),
            "--served-model-name",
            "tiny",
            "--registry",
            url,
            "--port",
            "0",
            "--data-dir",
            str(tmp / f"worker{index}"),
            "--engine-core",
            "thread",
            "--dtype",
            "float32",
            "--api-keys",
            str(keys),
            "--allowed-roots",
            str(tmp / "store"),  # the registry's store (make_registry's), fetched from by URI
        ],
        stdout=subprocess.PIPE,
        stderr=open(tmp / f"worker{index}.log", "w"),
        text=True,
    )


def _address(proc: subprocess.Popen, timeout: float = 180.0) -> str:
    found: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith("loraplex serving"):
                found.append(line.rsplit(" ", 1)[-1].strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert found, "a worker did not start"
    return found[0]


def _served(url: str, model: str) -> str | int:
    """The revision that served `model` (its x-loraplex-adapter), or the status of a refusal."""
    response = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": "x", "max_tokens": 1},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    return (
        response.headers["x-loraplex-adapter"]
        if response.status_code == 200
        else (response.status_code)
    )


def _models(url: str) -> list[str]:
    response = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    return [m["id"] for m in response.json()["data"]]


def _on_every_worker(urls, predicate, what: str, timeout: float = 30.0) -> None:
    """Poll until every worker shows it (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        pending = [u for u in pending if not predicate(u)]
        if pending and time.monotonic() > deadline:
            raise AssertionError(f"{what} did not reach {pending}")
        time.sleep(0.02)


def _logged_between(log: Path, start: str, end: str) -> list[str]:
    """The statements the cluster logged between the markers `start` and `end`."""
    lines = log.read_text(errors="replace").splitlines()
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i, line in enumerate(lines) if end in line)
    return [line for line in lines[first + 1 : last] if "statement:" in line]


@pytest.fixture
def fleet(llama_dir, pg_url, make_registry, tmp_path):
    registry = make_registry(pg_url)
    registry.add_tenant("alice")
    logged = pg_url.replace("&options=", "&options=-clog_statement%3Dall%20")
    procs = [_start(llama_dir, logged, tmp_path, i) for i in range(NUM_WORKERS)]
    try:
        yield registry, [_address(p) for p in procs]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_changes_reach_every_worker_and_steady_requests_send_no_transaction(
    fleet, adapter_v1, adapter_v2, postgres_server
):
    registry, urls = fleet
    registry.add_revision(adapter_v1, "a", shared=True, status="stable")
    _on_every_worker(urls, lambda u: "a" in _models(u), "the registration")
    assert {_served(u, "a") for u in urls} == {"a@r1"}

    registry.add_revision(adapter_v2, "a", revision="r2")
    registry.promote("a", "r2", 100, force=True)
    _on_every_worker(urls, lambda u: _served(u, "a") == "a@r2", "the promotion")
    registry.quarantine("a", "r2", "bad bytes")
    _on_every_worker(urls, lambda u: _served(u, "a") == "a@r1", "the quarantine")
    assert {_served(u, "a@r2") for u in urls} == {404}

    registry.add_revision(adapter_v2, "b", shared=True, status="stable")
    registry.add_revision(adapter_v1, "b", revision="r2")
    registry.promote("b", "r2", 100, force=True)
    _on_every_worker(urls, lambda u: _served(u, "b") == "b@r2", "the second promotion")
    registry.rollback("b")
    _on_every_worker(urls, lambda u: _served(u, "b") == "b@r1", "the rollback")
    for url in urls:  # none flips back
        assert {_served(url, "b") for _ in range(5)} == {"b@r1"}

    with psycopg.connect(
        host=str(postgres_server), user="postgres", dbname="postgres", autocommit=True
    ) as conn:
        conn.execute("SET log_statement = 'all'")
        time.sleep(0.5)  # the last notification handled
        conn.execute("SELECT 'lpx-window-start'")
        served = [_served(url, model) for _ in range(10) for url in urls for model in "ab"]
        listed = [_models(url) for url in urls]
        conn.execute("SELECT 'lpx-window-end'")
    assert set(served) == {"a@r1", "b@r1"} and all("b" in m for m in listed)
    log = postgres_server / "log"
    assert _logged_between(log, "lpx-window-start", "lpx-window-end") == []
    before = _logged_between(log, "LISTEN", "lpx-window-start")
    assert any("registry_changes" in line for line in before)  # the workers' statements are there
