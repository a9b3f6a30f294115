"""Faults under traffic: two real `loraplex serve` workers and a real `loraplex router`, all on one
PostgreSQL registry. A worker is SIGKILLed mid-run, then PostgreSQL stops and starts again, while
three clients stream greedy completions. No answer is wrong, only requests streaming from the
killed worker fail, requests are answered while PostgreSQL is down, and the registry keeps every
revision and takes a new one that the fleet then serves."""

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from tinymodels import peft_reference, reference_greedy

from loraplex.artifacts import ArtifactStore
from loraplex.loadgen.faults import ClosedLoop, fault_counts, stream_greedy
from loraplex.loadgen.procs import start_router, start_together, start_worker, stop_together
from loraplex.registry import Registry
from loraplex.router.serve import registry_callers

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
    traffic = ClosedLoop(router.url, ["base", *NAMES], PROMPT, TOKENS)
    try:
        traffic.wait_for_more(15)
        victim = workers[1]
        victim.kill()
        killed_at = time.monotonic()
        traffic.wait_for_more(15)
        pg_ctl(postgres_server, "-m", "immediate", "stop")
        down_from = time.monotonic()
        traffic.wait_for_more(10)  # served while PostgreSQL is down
        # longer than the workers keep a registry answer on keys (5 s): they serve on the last one
        time.sleep(max(0.0, down_from + 6 - time.monotonic()))
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
            wait_for(lambda: stream_greedy(http, router.url, "pattern", PROMPT, 1)["done"])
        traffic.models.append("pattern")
        traffic.wait_for_more(20)
    finally:
        records = traffic.stop()
    counts = fault_counts(records, expected, victim.url, killed_at, (down_from, down_until))
    assert (counts.wrong, counts.failed_elsewhere) == (0, 0), records
    assert counts.failed <= 3  # at most one per client: those streaming from the victim
    assert counts.answered_while_registry_down >= 10 - 3  # less those sent before it stopped
    after_ok = [r for r in records if r["sent"] > down_until and r.get("status") == 200]
    assert {r["worker"] for r in after_ok} == {workers[0].url}
    assert after == before | {("pattern", "r1")} and len(before) == len(NAMES)
    assert any(r["model"] == "pattern" and r["done"] for r in records)


def test_the_router_keeps_its_callers_tenants_while_postgres_is_down(pg_url, postgres_server):
    """A key's tenant, remembered for a minute, stands past that while the registry cannot be
    read (a dedicated pool keeps its tenant's traffic); a key never seen gets no tenant, and
    neither answer is remembered, so the registry is asked again once it is back."""
    registry = Registry(pg_url)
    registry.init()
    registry.add_tenant("acme", 3)
    seen, unseen = registry.create_key("acme"), registry.create_key("acme")
    now = [0.0]
    caller_of = registry_callers(registry, clock=lambda: now[0])
    assert caller_of(seen) == ("acme", 3)
    pg_ctl(postgres_server, "-m", "immediate", "stop")
    try:
        now[0] += 61
        assert caller_of(seen) == ("acme", 3)
        assert caller_of(unseen) == (None, 0)
    finally:
        pg_ctl(postgres_server, "restart", "-l", str(postgres_server / "log"))
    assert caller_of(unseen) == ("acme", 3)
    registry.close()
