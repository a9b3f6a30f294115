"""The placement controller on a real CPU fleet: gpu-hit share of round-robin, the router's
affinity picker, and affinity with `loraplex placement` running, over four real workers.

    python bench/placement_fleet.py [--runs 3] [--json bench/results/placement_fleet.json]

Four `loraplex serve` workers (bench/router.py's tiny model, `--max-loras 4`, `score`) behind one
`loraplex router`, restarted for every run so each starts cold; the adapters' bytes live only in
bench/router.py's shaped HTTP store. Every run sends the same requests: a sweep (each adapter once),
a first Zipf(0.9) pass that fills the workers' demand windows (the fleet has served this traffic
before), then the measured Zipf(0.9) pass with another seed, both open-loop (Poisson). In the
`placement` runs a controller runs from the first pass on, one round a second; its demand thresholds
are scaled to a short run, since the workers' demand window is 300 s and the trace lasts a minute.
The three set-ups alternate, run after run; the tier header of each measured response says where
the worker found the adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from router import build_fleet_registry, replay, summarize, workload

from loraplex.loadgen.procs import (
    ADMIN_TOKEN,
    Proc,
    start_router,
    start_together,
    start_worker,
    state,
    stop_together,
)

SETUPS = {"round-robin": "round-robin", "affinity": "affinity", "placement": "affinity"}
# The workers' demand window is 300 s and a run's passes last about 30 s, so a window's rate reads
# about 1/8 of the real one: the defaults' thresholds (hot from 0.05 rps, a worker per 8 rps) over
# 8. Hot from two requests in the window (the sweep gives each adapter one); an adapter is placed
# once hot for 5 s, and a placement stands 10 s.
CONTROLLER = [
    *("--min-rps", "0.006", "--per-replica-rps", "1.0", "--max-replicas", "2"),
    *("--min-dwell-s", "10", "--min-hot-s", "5", "--max-moves-per-hour", "3600"),
    *("--interval-s", "1"),
    *("--lease-s", "30", "--metrics-port", "0"),
]


def start_controller(registry_url: str, workers: list[str], data_dir: Path) -> Proc:
    data_dir.mkdir(parents=True, exist_ok=True)
    token_file = data_dir / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    args = ["placement", "--registry", registry_url, "--admin-token-file", str(token_file)]
    for url in workers:
        args += ["--worker", url]
    return Proc(args + CONTROLLER, data_dir / "log.txt")


def one_run(setup: str, run: Path, fleet: dict, traces: dict) -> dict:
    """One set-up on a fresh fleet: its measured pass's summary, and its placements at the end."""
    workers = start_together(
        [
            lambda i=i: start_worker(
                fleet["model_dir"],
                run / f"w{i}",
                {},
                *("--registry", fleet["registry_url"], "--allowed-roots", fleet["base_url"]),
                *("--max-loras", "4", "--max-cpu-loras", str(fleet["cpu_loras"])),
                *("--disk-cache-bytes", str(4 * fleet["biggest"]), "--eviction-policy", "score"),
                max_lora_rank=16,
            )
            for i in range(4)
        ]
    )
    urls = [w.url for w in workers]
    router = start_router(urls, run / "router", SETUPS[setup])
    controller = None
    try:
        time.sleep(1.0)
        key = fleet["key"]
        warm = asyncio.run(replay(router.url, traces["sweep"], key))
        if setup == "placement":
            controller = start_controller(fleet["registry_url"], urls, run / "controller")
        warm += asyncio.run(replay(router.url, traces["first"], key))
        records = asyncio.run(replay(router.url, traces["measured"], key))
        placed = sum(len(state(u).get("placed", [])) for u in urls)
        moves = controller_moves(controller) if controller is not None else {}
    finally:
        if controller is not None:
            controller.stop()
        router.stop()
        stop_together(workers)
    routes = Counter(str(r.get("route")).split("-")[0] for r in records)
    return {
        "setup": setup,
        **summarize(records),
        "warmup_errors": sum(r.get("status") != 200 for r in warm),
        "placed_at_end": placed,
        "placed_routes": routes["placed"],
        "moves": moves,
    }


def controller_moves(controller: Proc) -> dict[str, float]:
    """The controller's moves so far by kind, from its /metrics (`place`, `release`; done ones)."""
    text = httpx.get(f"{controller.url}/metrics", timeout=10).text
    found = re.findall(
        r'^loraplex_placement_moves_total\{kind="(\w+)",outcome="done"\} (\S+)$', text, re.M
    )
    return {kind: float(n) for kind, n in found}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=40)
    parser.add_argument("--requests", type=int, default=100, help="in each Zipf pass")
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--json", default="bench/results/placement_fleet.json")
    args = parser.parse_args(argv)
    console = Console(width=200)
    names = [f"ad{i:03d}" for i in range(args.adapters)]
    traces = {
        "sweep": [
            (0.1 * i, name) for i, name in enumerate(random.Random(7).sample(names, len(names)))
        ],
        "first": workload("zipf", args.adapters, args.requests, args.rate, seed=2),
        "measured": workload("zipf", args.adapters, args.requests, args.rate, seed=1),
    }
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir, registry_url, base_url, key, server, biggest = build_fleet_registry(
            tmp, args.adapters
        )
        fleet = {
            "model_dir": model_dir,
            "registry_url": registry_url,
            "base_url": base_url,
            "key": key,
            "biggest": biggest,
            "cpu_loras": args.adapters * 2 // 5,
        }
        try:
            for i in range(args.runs):
                for setup in args.setups.split(","):
                    row = {"run": i + 1, **one_run(setup, tmp / f"{setup}-{i}", fleet, traces)}
                    rows.append(row)
                    console.log(row)
                    write(args.json, rows, {})  # each run as it ends, should a later one fail
        finally:
            server.shutdown()
    report = summarize_runs(rows)
    print_table(console, rows, report)
    setup = {
        "workers": 4,
        "max_loras": 4,
        "max_cpu_loras": fleet["cpu_loras"],
        "adapters": args.adapters,
        "requests_per_pass": args.requests,
        "rate": args.rate,
        "controller": CONTROLLER,
        "wall_s": round(time.monotonic() - started, 1),
    }
    write(args.json, rows, {**report, "setup": setup})
    return 0


def write(path: str, rows: list[dict], more: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"rows": rows, **more}, indent=2))


def summarize_runs(rows: list[dict]) -> dict:
    """Per run, each set-up's gpu-hit share over round-robin's in the same run; the mean of each."""
    ratios: dict[str, list[float]] = {}
    for run in sorted({r["run"] for r in rows}):
        by = {r["setup"]: r for r in rows if r["run"] == run}
        base = by.get("round-robin", {}).get("gpu_hit")
        for setup, r in by.items():
            if base:
                ratios.setdefault(setup, []).append(round(r["gpu_hit"] / base, 2))
    means = {
        s: round(statistics.mean(r["gpu_hit"] for r in rows if r["setup"] == s), 3)
        for s in {r["setup"] for r in rows}
    }
    return {"ratios_to_round_robin": ratios, "mean_gpu_hit": means}


def print_table(console: Console, rows: list[dict], report: dict) -> None:
    table = Table(title="Placement on 4 CPU workers x 4 slots (gpu-hit share of the measured pass)")
    columns = ["run", "setup", "ok", "gpu_hit", "hit_cpu", "cold_starts", "ttft_p50_ms"]
    columns += ["ttft_p99_ms", "load_cv", "placed_at_end"]
    for c in columns:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    console.print(table)
    console.print(report)


if __name__ == "__main__":
    sys.exit(main())
