"""The simulator on a fleet: simulated requests per wall and CPU second at catalogs of 1,000 and
100,000 adapters, the same fleet and traffic, side by side in one run.

    python bench/sim_fleet.py [--workers 64] [--rate 320] [--duration-s 120]
        [--catalogs 1000,100000] [--json bench/results/sim_fleet.json]

Zipf(0.9) traffic over the catalog, 16 tenants, one registry change per second, the `score`
policy, 16 slots and 8 GiB of host cache per worker (what `loraplex simulate --workload zipf
--workers 64 --num-adapters N --rate 320 --tenants 16 --registry-changes-per-s 1 --no-optimal`
runs). What the ratio shows: a simulated request costs about the same whatever the catalog (no
scan of it per request); what differs between the columns is the traffic's own shape (a longer
tail misses more, and a miss is a load and an eviction).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loraplex.sim import workload as W
from loraplex.sim.report import summarize
from loraplex.sim.simulator import SimConfig, policy_factory, simulate


def run(workers: int, rate: float, duration_s: float, catalog: int) -> dict:
    trace = W.named("zipf", num_adapters=catalog, rate=rate, duration_s=duration_s, tenants=16)
    config = SimConfig(
        gpu_slots=16, cpu_bytes=8 * 2**30, workers=workers, registry_changes_per_s=1.0
    )
    wall, cpu = time.perf_counter(), time.process_time()
    sim = simulate(trace, config, policy_factory("score"))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    s = summarize(sim)
    return {
        "catalog": catalog,
        "requests": len(trace),
        "adapters_seen": len({r.model for r in trace}),
        "gpu_hit": round(s["hit_rate"]["gpu"], 4),
        "cold_starts": round(s["cold_start_rate"], 4),
        "evictions": s["evictions"],
        "registry_queries_per_s": round(s["registry"]["queries_per_s"], 2),
        "notifications_per_s": round(s["registry"]["notifications_per_s"], 2),
        "wall_s": round(wall, 2),
        "requests_per_wall_s": round(len(trace) / wall),
        "requests_per_cpu_s": round(len(trace) / cpu),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--rate", type=float, default=320.0)
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--catalogs", default="1000,100000")
    parser.add_argument("--json", default="bench/results/sim_fleet.json")
    args = parser.parse_args(argv)
    console = Console(width=160)
    rows = []
    for catalog in map(int, args.catalogs.split(",")):
        rows.append(run(args.workers, args.rate, args.duration_s, catalog))
        console.log(rows[-1])
    table = Table(
        title=f"simulator speed: {args.workers} workers, {args.rate:g} req/s for "
        f"{args.duration_s:g} s, Zipf(0.9)"
    )
    for col in rows[0]:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*(f"{v:,}" if isinstance(v, int) else str(v) for v in row.values()))
    console.print(table)
    ratio = rows[-1]["requests_per_cpu_s"] / rows[0]["requests_per_cpu_s"]
    console.print({"requests_per_cpu_s_largest_over_smallest": round(ratio, 3)})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "rows": rows,
                "ratio_requests_per_cpu_s": ratio,
                "setup": vars(args),
                "machine": {
                    "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "date": time.strftime("%Y-%m-%d"),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
