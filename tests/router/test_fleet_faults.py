"""Faults under traffic: two real `loraplex serve` workers and a real `loraplex router`, all on one
PostgreSQL registry. A worker is SIGKILLed mid-run, then PostgreSQL stops and starts again, while
three clients stream greedy completions. No answer is wrong, only requests streaming from the
killed worker fail, requests are answered while PostgreSQL is down, and the registry keeps every
revision and takes a new one that the fleet then serves."""

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from tinymodels import peft_reference, reference_greedy

from loraplex.artifacts import ArtifactStore
from loraplex.loadgen.procs import start_router, start_together, start_worker, stop_together
from loraplex.registry import Registry

PROMPT = [5, 17, 42, 99, 7, 3]
TOKENS = 12
NAMES = ("attn-r8", "mlp-r4", "regex-r4")


def pg_ctl(server: Path, *args: str) -> None:
    """`pg_ctl` on the tests' cluster (as the postgres user when running as root, as it was
    started); `restart` on a stopped cluster starts it with the options it last ran with."""
    binary = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))[-1]
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    command = [*as_user, str(binary), "-D", str(server / "data"), "-w", *args]
    subprocess.run(command, check=True, capture_output=True, timeout=120)


def stream(http: httpx.Client, url: str, model: str) -> dict:
    """One streamed greedy completion: its status, the worker the router named, its token ids, and
    whether the stream ended with [DONE] (else the error that broke it)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    # logprobs: a chunk for every token, so each one's id comes back (a token whose text is held
    # back, half a character, otherwise comes in no chunk)
    body |= {"ignore_eos": True, "stream": True, "return_token_ids": True, "logprobs": 0}
    record: dict = {"model": model, "ids": [], "done": False, "sent": time.monotonic()}
    try:
        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            record["status"], record["worker"] = r.status_code, r.headers.get("x-loraplex-worker")
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    record["done"] = True
                elif line.startswith("data: "):
                    for choice in json.loads(line[6:]).get("choices", []):
                        record["ids"] += choice.get("token_ids") or []
    except httpx.HTTPError as exc:
        record["error"] = type(exc).__name__
    record["ended"] = time.monotonic()
    return record


class Traffic:
    """Clients streaming completions over `models` until stopped."""

    def __init__(self, url: str, models: list[str], clients: int = 3):
        self.url, self.models, self.records = url, models, []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(c,)) for c in range(clients)]
        for t in self.threads:
            t.start()

    def client(self, offset: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = offset
            while not self.stopping.is_set():
                self.records.append(stream(http, self.url, self.models[i % len(self.models)]))
                i += 1

    def wait_for_more(self, count: int, timeout: float = 120) -> None:
        """Until `count` more requests ended (a bound against hangs, not a timing assertion)."""
        target, deadline = len(self.records) + count, time.monotonic() + timeout
        while len(self.records) < target:
            assert time.monotonic() < deadline, "the traffic stopped"
            time.sleep(0.05)

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join()


def revisions(url: str) -> set[tuple[str, str]]:
    registry = Registry(url)
    try:
        return {(a.name, r.revision) for a in registry.list_adapters() for r in a.revisions}
    finally:
        registry.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(predicate, timeout: float = 60) -> None:
    """Until the predicate holds (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.fixture
def fleet(llama_dir, llama_adapters, pg_url, tmp_path):
    registry = Registry(pg_url, store=ArtifactStore(tmp_path / "store"))
    registry.init()
    for name in NAMES:
        registry.add_revision(
            llama_adapters[name], name, "r1", status="stable", base_model_dir=llama_dir
        )
    registry.close()
    extra = ("--registry", pg_url, "--max-loras", "2", "--served-model-name", "base")
    extra += ("--allowed-roots", str(tmp_path))
    workers = start_together(
        [lambda i=i: start_worker(llama_dir, tmp_path / f"w{i}", {}, *extra) for i in range(2)]
    )
    router = start_router(
        [w.url for w in workers], tmp_path / "router", "affinity", "--registry", pg_url
    )
    try:
        wait_for(lambda: _answers(f"{router.url}/health"))
        yield workers, router
    finally:
        router.stop()
        stop_together(workers)


def test_a_killed_worker_and_a_restarted_postgres_lose_nothing(
    fleet, llama_dir, llama_adapters, pg_url, postgres_server, tmp_path
):
    workers, router = fleet
    reference = peft_reference(llama_dir, {n: llama_adapters[n] for n in (*NAMES, "pattern")})
    expected = {n: reference_greedy(reference, PROMPT, n, TOKENS) for n in (*NAMES, "pattern")}
    expected["base"] = reference_greedy(reference, PROMPT, None, TOKENS)
    before = revisions(pg_url)
    traffic = Traffic(router.url, ["base", *NAMES])
    try:
        traffic.wait_for_more(15)
        victim = workers[1]
        victim.kill()
        killed_at = time.monotonic()
        traffic.wait_for_more(15)
        pg_ctl(postgres_server, "-m", "immediate", "stop")
        down_from = time.monotonic()
        traffic.wait_for_more(10)  # served while PostgreSQL is down
        down_until = time.monotonic()
        pg_ctl(postgres_server, "restart", "-l", str(postgres_server / "log"))
        traffic.wait_for_more(15)
        added = Registry(pg_url, store=ArtifactStore(tmp_path / "store"))
        added.add_revision(
            llama_adapters["pattern"], "pattern", "r1", status="stable", base_model_dir=llama_dir
        )
        added.close()
        after = revisions(pg_url)
        with httpx.Client(timeout=120) as http:
            wait_for(lambda: stream(http, router.url, "pattern").get("status") == 200)
        traffic.models.append("pattern")
        traffic.wait_for_more(20)
    finally:
        traffic.stop()
    records = traffic.records
    failed = [r for r in records if not (r.get("status") == 200 and r["done"])]
    assert all(r.get("worker") == victim.url and r["sent"] < killed_at for r in failed), failed
    assert len(failed) <= 3  # at most one per client: those streaming from the victim
    answered = [r for r in records if r not in failed]
    wrong = [(r["model"], r["ids"]) for r in answered if r["ids"] != expected[r["model"]]]
    assert not wrong, wrong
    assert any(down_from < r["sent"] and r["ended"] < down_until for r in answered)
    assert {r["worker"] for r in answered if r["sent"] > down_until} == {workers[0].url}
    assert after == before | {("pattern", "r1")} and len(before) == len(NAMES)
    assert any(r["model"] == "pattern" for r in answered)
