"""Faults under traffic: two real `loraplex serve` workers, a real `loraplex router` and two real
`loraplex placement` controllers, all on one PostgreSQL registry. A worker is SIGKILLed mid-run,
then PostgreSQL stops and starts again, while three clients stream greedy completions. No answer is
wrong, only requests streaming from the killed worker fail, requests are answered while PostgreSQL
is down, the killed worker's placements are placed again on the live one, one controller acts
throughout (it outlives the outage and keeps its lease) while the other waits, no placement is
lost across the restart, and the registry keeps every revision and takes a new one that the fleet
then serves and places."""

import re
import time

import httpx
import pytest
from tinymodels import peft_reference, reference_greedy

from loraplex.artifacts import ArtifactStore
from loraplex.loadgen.faults import ClosedLoop, fault_counts, stream_greedy
from loraplex.loadgen.postgres import pg_ctl
from loraplex.loadgen.procs import (
    ADMIN_TOKEN,
    start_placement,
    start_router,
    start_together,
    start_worker,
    state,
    stop_together,
)
from loraplex.registry import Registry
from loraplex.registry.leases import Leases
from loraplex.router.serve import registry_callers

PROMPT = [5, 17, 42, 99, 7, 3]
TOKENS = 12
NAMES = ("attn-r8", "mlp-r4", "regex-r4")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# every adapter with traffic is hot, each on one worker; moves as soon as the policy wants them;
# a worker's five slots may all be placed but the one it keeps: the live worker takes all four
CONTROLLER = ("--min-rps", "0.005", "--per-replica-rps", "1000", "--max-replicas", "1")
CONTROLLER += ("--slot-share", "1", "--min-dwell-s", "0", "--interval-s", "0.5")
CONTROLLER += ("--lease-s", "60", "--min-hot-s", "0", "--min-free-slots", "1")


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


def placed(url: str) -> set[str]:
    """The adapter revisions placed on a worker, from its state (none when it does not answer)."""
    try:
        return set(state(url)["placed"])
    except httpx.HTTPError:
        return set()


def routed_placements(router: str) -> dict[str, set[str]]:
    """Worker URL -> the placements the router routes by (its last poll of each worker)."""
    listed = httpx.get(f"{router}/admin/workers", headers=ADMIN, timeout=30).json()["workers"]
    return {w["url"]: set(w.get("placed") or ()) for w in listed}


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found[0]) if found else 0.0


def holder(controller) -> str:
    """The lease holder a controller names itself (from its log)."""
    return re.findall(r"placement controller (\S+): ", controller.log_path.read_text())[0]


@pytest.fixture
def fleet(llama_dir, llama_adapters, pg_url, tmp_path):
    registry = Registry(pg_url, store=ArtifactStore(tmp_path / "store"))
    registry.init()
    for name in NAMES:
        registry.add_revision(
            llama_adapters[name], name, "r1", status="stable", base_model_dir=llama_dir
        )
    registry.close()
    extra = ("--registry", pg_url, "--max-loras", "5", "--served-model-name", "base")
    extra += ("--allowed-roots", str(tmp_path))
    workers = start_together(
        [lambda i=i: start_worker(llama_dir, tmp_path / f"w{i}", {}, *extra) for i in range(2)]
    )
    urls = [w.url for w in workers]
    procs = list(workers)
    try:
        procs.append(start_router(urls, tmp_path / "router", "affinity", "--registry", pg_url))
        wait_for(lambda: _answers(f"{procs[-1].url}/health"))
        procs.append(start_placement(pg_url, urls, tmp_path / "c1", *CONTROLLER))
        wait_for(lambda: ": active" in procs[-1].log_path.read_text())
        procs.append(start_placement(pg_url, urls, tmp_path / "c2", *CONTROLLER))
        wait_for(lambda: "waiting (the lease is" in procs[-1].log_path.read_text())
        yield workers, *procs[2:]
    finally:
        stop_together(procs[2:])
        stop_together(workers)


def test_a_killed_worker_and_a_restarted_postgres_lose_nothing(
    fleet, llama_dir, llama_adapters, pg_url, postgres_server, tmp_path
):
    workers, router, active, waiting = fleet
    urls = [w.url for w in workers]
    reference = peft_reference(llama_dir, {n: llama_adapters[n] for n in (*NAMES, "pattern")})
    expected = {n: reference_greedy(reference, PROMPT, n, TOKENS) for n in (*NAMES, "pattern")}
    expected["base"] = reference_greedy(reference, PROMPT, None, TOKENS)
    before = revisions(pg_url)
    keys = {f"{n}@r1" for n in NAMES}
    traffic = ClosedLoop(router.url, ["base", *NAMES], PROMPT, TOKENS)
    try:
        wait_for(lambda: set().union(*map(placed, urls)) == keys, 120)
        traffic.wait_for_more(15)
        victim = max(workers, key=lambda w: len(placed(w.url)))  # it holds a placement
        live = next(u for u in urls if u != victim.url)
        victim.kill()
        killed_at = time.monotonic()
        wait_for(lambda: placed(live) == keys, 120)  # the victim's placements, placed again
        wait_for(lambda: routed_placements(router.url)[live] == keys)
        traffic.wait_for_more(15)
        pg_ctl(postgres_server, "-m", "immediate", "stop")
        down_from = time.monotonic()
        traffic.wait_for_more(10)  # served while PostgreSQL is down
        # longer than the workers keep a registry answer on keys (5 s): they serve on the last one
        time.sleep(max(0.0, down_from + 6 - time.monotonic()))
        kept_while_down = placed(live), routed_placements(router.url)[live]
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
        # the active controller acts after the restart: it places the new adapter too
        wait_for(lambda: placed(live) == keys | {"pattern@r1"}, 120)
        traffic.wait_for_more(20)
    finally:
        records = traffic.stop()
    counts = fault_counts(records, expected, victim.url, killed_at, (down_from, down_until))
    assert (counts.wrong, counts.failed_elsewhere) == (0, 0), records
    assert counts.failed <= 3  # at most one per client: those streaming from the victim
    assert counts.answered_while_registry_down >= 10 - 3  # less those sent before it stopped
    after_ok = [r for r in records if r["sent"] > down_until and r.get("status") == 200]
    assert {r["worker"] for r in after_ok} == {live}
    assert after == before | {("pattern", "r1")} and len(before) == len(NAMES)
    assert any(r["model"] == "pattern" and r["done"] for r in records)
    # no placement lost across the restart, in the worker's state and in the router's routing
    assert kept_while_down == (keys, keys)
    assert routed_placements(router.url)[live] >= keys
    # one controller acted throughout: it outlived the outage holding its lease; the other waited
    registry = Registry(pg_url)
    assert Leases(registry).get("placement").holder == holder(active)
    registry.close()
    assert (active.p.poll(), waiting.p.poll()) == (None, None)
    assert metric(active.url, "loraplex_placement_leader") == 1.0
    assert metric(waiting.url, "loraplex_placement_leader") == 0.0
    assert ": active" not in waiting.log_path.read_text()
    assert not re.search(
        r"^loraplex_placement_moves_total\{",
        httpx.get(f"{waiting.url}/metrics", timeout=10).text,
        re.M,
    )
    assert (active.stop(), waiting.stop()) == (0, 0)


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
