"""Faults under traffic: a worker SIGKILLed and the registry's PostgreSQL restarted mid-run.

    python bench/fleet_faults.py [--json bench/results/fleet_faults.json]

A throwaway PostgreSQL cluster (initdb + pg_ctl on a socket in a temp dir) holds the registry:
three PEFT adapters of a tiny Llama. Three `loraplex serve` workers (native engine), one
`loraplex router` and two `loraplex placement` controllers (one active through the registry's
lease, one waiting) read it. Three closed-loop clients stream greedy completions (12 tokens) over
the adapters and the bare base throughout. Phases: steady, every adapter placed on two workers;
one worker SIGKILLed, its placements placed again on the live ones; PostgreSQL stopped
(`-m immediate`) for a few seconds and started again; a new adapter registered after the restart,
added to the traffic and placed. Every answer is checked against HF transformers + PEFT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).parent))
from hetero_fleet import wait_for_health
from tinymodels import ADAPTERS, make_adapter, make_model, peft_reference, reference_greedy

from loraplex.artifacts import ArtifactStore
from loraplex.loadgen.faults import ClosedLoop, fault_counts, stream_greedy
from loraplex.loadgen.postgres import as_postgres, pg_ctl, run_tool
from loraplex.loadgen.procs import (
    ADMIN_TOKEN,
    Proc,
    start_placement,
    start_router,
    start_together,
    start_worker,
    state,
    stop_together,
)
from loraplex.registry import Registry
from loraplex.registry.leases import Leases

PROMPT = [5, 17, 42, 99, 7, 3]
TOKENS = 12
NAMES = ("attn-r8", "mlp-r4", "regex-r4")
LATE = "pattern"
# every adapter with traffic is hot and on two workers; a worker's five slots may all be placed but
# the one it keeps, so the two live workers take every adapter, the late one too
CONTROLLER = ("--min-rps", "0.005", "--per-replica-rps", "0.005", "--max-replicas", "2")
CONTROLLER += ("--slot-share", "1", "--min-free-slots", "1", "--min-hot-s", "0")
CONTROLLER += ("--interval-s", "0.5", "--lease-s", "30")


class Postgres:
    """A throwaway cluster in `work` (as the postgres user when running as root: initdb refuses
    root)."""

    def __init__(self, work: Path):
        self.work = work
        work.mkdir(parents=True)
        work.chmod(0o755)
        if as_postgres():
            shutil.chown(work, "postgres")
        run_tool("initdb", "-D", str(work / "data"), "-A", "trust", "-U", "postgres", "--no-sync")
        options = f"-k {work} -c listen_addresses='' -c fsync=off"
        self.ctl("-o", options, "-l", str(work / "log"), "start")
        self.url = f"postgresql://postgres@/postgres?host={work}"

    def ctl(self, *args: str) -> None:
        """`pg_ctl ... ACTION`; `restart` on a stopped cluster starts it with its last options."""
        pg_ctl(self.work, *args)


def build(root: Path, pg: Postgres):
    model = make_model(root / "llama", "llama")
    adapters = {
        n: make_adapter(model, root / n, seed=i, **ADAPTERS[n])
        for i, n in enumerate((*NAMES, LATE))
    }
    reference = peft_reference(model, adapters)
    expected = {n: reference_greedy(reference, PROMPT, n, TOKENS) for n in adapters}
    expected["base"] = reference_greedy(reference, PROMPT, None, TOKENS)
    registry = Registry(pg.url, store=ArtifactStore(root / "store"))
    registry.init()
    for name in NAMES:
        registry.add_revision(adapters[name], name, "r1", status="stable", base_model_dir=model)
    registry.close()
    return model, adapters, expected


def revisions(url: str) -> set[tuple[str, str]]:
    registry = Registry(url)
    try:
        return {(a.name, r.revision) for a in registry.list_adapters() for r in a.revisions}
    finally:
        registry.close()


def phase(at: float, killed_at: float, down_from: float, down_until: float) -> str:
    if at < killed_at:
        return "before the kill"
    if at < down_from:
        return "after the kill"
    return "registry down" if at < down_until else "after the restart"


def placements(urls: list[str]) -> dict[str, set[str]]:
    """Worker URL -> the adapter revisions placed there, from each live worker's state."""
    found = {}
    for url in urls:
        try:
            found[url] = set(state(url)["placed"])
        except httpx.HTTPError:
            pass
    return found


def routed(router: str) -> dict[str, set[str]]:
    """Worker URL -> the placements the router routes by."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    listed = httpx.get(f"{router}/admin/workers", headers=headers, timeout=30).json()["workers"]
    return {w["url"]: set(w.get("placed") or ()) for w in listed}


def wait_until(predicate, timeout: float = 300.0) -> float:
    """Seconds until `predicate` holds (polled every 0.1 s)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise TimeoutError("the fleet did not get there")
        time.sleep(0.1)
    return time.monotonic() - started


def on_two(urls: list[str], keys: set[str]) -> bool:
    """Each key placed on two of `urls`' workers."""
    placed = placements(urls)
    return all(sum(k in p for p in placed.values()) >= 2 for k in keys)


def start_controllers(url: str, workers: list[str], root: Path) -> list[Proc]:
    """The active controller, then one that waits for its lease."""
    active = start_placement(url, workers, root / "c1", *CONTROLLER)
    wait_until(lambda: ": active" in active.log_path.read_text(), 120)
    standby = start_placement(url, workers, root / "c2", *CONTROLLER)
    wait_until(lambda: "waiting (the lease is" in standby.log_path.read_text(), 120)
    return [active, standby]


def run(root: Path, pg: Postgres, down_s: float) -> dict:
    model, adapters, expected = build(root, pg)
    extra = ("--registry", pg.url, "--max-loras", "5", "--served-model-name", "base")
    extra += ("--allowed-roots", str(root))
    workers = start_together(
        [lambda i=i: start_worker(model, root / f"w{i}", {}, *extra) for i in range(3)]
    )
    urls = [w.url for w in workers]
    procs = [start_router(urls, root / "router", "affinity", "--registry", pg.url)]
    router, keys = procs[0], {f"{n}@r1" for n in NAMES}
    before, fig = revisions(pg.url), {}
    try:
        wait_for_health(router.url)
        procs += start_controllers(pg.url, urls, root)
        traffic = ClosedLoop(router.url, ["base", *NAMES], PROMPT, TOKENS)
        fig["placed_s"] = round(wait_until(lambda: on_two(urls, keys)), 1)
        traffic.wait_for_more(60)
        held = placements(urls)
        victim = max(workers, key=lambda w: len(held.get(w.url, ())))
        live = [u for u in urls if u != victim.url]
        fig["victim_placements"] = sorted(held[victim.url])
        victim.kill()
        killed_at = time.monotonic()
        fig["placed_again_s"] = round(wait_until(lambda: on_two(live, keys)), 1)
        traffic.wait_for_more(60)
        down_from, down_until, fig["placements_lost_across_restart"] = restart(
            pg, down_s, traffic, live, router.url
        )
        registry = Registry(pg.url, store=ArtifactStore(root / "store"))
        registry.add_revision(adapters[LATE], LATE, "r1", status="stable", base_model_dir=model)
        registry.close()
        after = revisions(pg.url)
        with httpx.Client(timeout=120) as http:
            while not stream_greedy(http, router.url, LATE, PROMPT, 1)["done"]:
                time.sleep(0.2)
        traffic.models.append(LATE)
        fig["late_placed_s"] = round(wait_until(lambda: on_two(live, {f"{LATE}@r1"})), 1)
        traffic.wait_for_more(60)
        records = traffic.stop()
        fig |= controller_figures(pg.url, *procs[1:])
    finally:
        stop_together(procs)
        stop_together(workers)
    counts = fault_counts(records, expected, victim.url, killed_at, (down_from, down_until))
    return {
        **dataclasses.asdict(counts),
        "registry_down_s": round(down_until - down_from, 1),
        "revisions_before": len(before),
        "revisions_after_one_added": len(after),
        "revisions_kept": before <= after,
        "late_adapter_answered": sum(r["model"] == LATE and r["done"] for r in records),
        "routed_to_placement": sum(str(r.get("route")).startswith("placed") for r in records),
        **fig,
        **failures(records, victim.url, (killed_at, down_from, down_until)),
    }


def restart(
    pg: Postgres, down_s: float, traffic: ClosedLoop, live: list[str], router: str
) -> tuple[float, float, int]:
    """PostgreSQL stopped for `down_s` and started again, under traffic: when it was down, and
    the placements lost across it."""
    kept = placements(live), {u: p for u, p in routed(router).items() if u in live}
    pg.ctl("-m", "immediate", "stop")
    down_from = time.monotonic()
    time.sleep(down_s)
    down_until = time.monotonic()
    pg.ctl("restart", "-l", str(pg.work / "log"))
    traffic.wait_for_more(60)
    return down_from, down_until, lost(kept, placements(live), routed(router))


def lost(kept: tuple[dict, dict], placed: dict, routed_now: dict) -> int:
    """Placements (on workers, and in the router's routing) held before the restart and gone
    after it."""
    on_workers, in_router = kept
    gone = sum(len(p - placed.get(u, set())) for u, p in on_workers.items())
    return gone + sum(len(p - routed_now.get(u, set())) for u, p in in_router.items())


def controller_figures(url: str, active: Proc, standby: Proc) -> dict:
    """Whether both controllers lived through the run, who holds the lease, and each one's
    moves."""
    registry = Registry(url)
    holder = Leases(registry).get("placement").holder
    registry.close()
    logs = [p.log_path.read_text() for p in (active, standby)]
    return {
        "controllers_running": sum(p.p.poll() is None for p in (active, standby)),
        "lease_holder_is_first": f"controller {holder}: active" in logs[0],
        "standby_became_active": ": active" in logs[1],
        "moves_active": moves(active.url),
        "moves_standby": moves(standby.url),
    }


def moves(metrics_url: str) -> dict[str, int]:
    """kind/outcome -> the controller's moves, from its /metrics."""
    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    found = re.findall(
        r'^loraplex_placement_moves_total\{kind="(\w+)",outcome="(\w+)"\} (\S+)$', text, re.M
    )
    return {f"{kind} {outcome}": int(float(n)) for kind, outcome, n in found}


def failures(records: list[dict], victim: str, times: tuple[float, float, float]) -> dict:
    """The failed requests by phase and by kind, and the first error bodies."""
    failed = [r for r in records if not (r.get("status") == 200 and r["done"])]
    return {
        "failed_by_phase": dict(Counter(phase(r["sent"], *times) for r in failed)),
        "first_failure_bodies": sorted({r["body"] for r in failed if "body" in r})[:3],
        "failed_by_kind": dict(
            Counter(
                f"{r.get('status', r.get('error'))} on victim={r.get('worker') == victim}"
                for r in failed
            )
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry-down-s", type=float, default=5.0)
    parser.add_argument("--json", default="bench/results/fleet_faults.json")
    args = parser.parse_args(argv)
    console = Console(width=160)
    root = Path(tempfile.mkdtemp(prefix="loraplex-faults-"))
    root.chmod(0o755)  # the postgres user reaches its cluster below
    pg = Postgres(root / "pg")
    try:
        row = run(root / "fleet", pg, args.registry_down_s)
    finally:
        pg.ctl("-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)
    table = Table(
        title="A worker SIGKILLed and PostgreSQL restarted under traffic (3 workers, "
        "2 placement controllers)"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in row.items():
        table.add_row(key, str(value))
    console.print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
