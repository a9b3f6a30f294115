"""How fast the simulator runs: requests simulated per second of CPU time, per workload and policy.

    python bench/sim_speed.py [--repeat 3] [--quick] [--cases zipf,overloaded]
        [--json bench/results/sim_speed.json]

The five named workloads at their default capacities (what `loraplex simulate` runs), a hit-heavy
single worker, an 8-worker fleet behind the affinity router and an overloaded one (waiting queues of
hundreds). CPU time (`time.process_time`) is the figure to compare: on a shared machine wall time
also counts the other jobs; both are reported, each the best of `--repeat` runs.
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

GiB = 2**30


def cases(quick: bool) -> dict[str, tuple]:
    """name → (trace, SimConfig keyword arguments, what it is)."""
    out = {}
    for name in ("hot-burst", "zipf", "uniform", "diurnal", "rollout"):
        cap = W.default_capacity(name)
        out[name] = (
            W.load(name),
            {"gpu_slots": cap.gpu_slots, "cpu_bytes": cap.cpu_bytes, "disk_bytes": cap.disk_bytes},
            "named workload, default capacity",
        )
    duration = 300.0 if quick else 900.0
    out["hit-heavy"] = (
        W.generate(
            W.WorkloadSpec(name="hit", s=1.2, num_adapters=50, rate=20.0, duration_s=duration)
        ),
        {"gpu_slots": 16, "cpu_bytes": 8 * GiB},
        "Zipf(1.2) over 50 adapters, 20 req/s, 16 slots",
    )
    out["fleet"] = (
        W.generate(W.WorkloadSpec(name="fleet", rate=48.0, duration_s=300.0)),
        {"gpu_slots": 8, "cpu_bytes": 4 * GiB, "workers": 8},
        "8 workers × 8 slots, Zipf(0.9) over 200 adapters, 48 req/s",
    )
    out["overloaded"] = (
        W.generate(
            W.WorkloadSpec(name="overloaded", rate=300.0, duration_s=20.0, num_adapters=1000)
        ),
        {"gpu_slots": 16, "cpu_bytes": 8 * GiB, "workers": 8},
        "8 workers × 16 slots, Zipf(0.9) over 1,000 adapters, 300 req/s: queues of hundreds",
    )
    if quick:
        out = {k: v for k, v in out.items() if k in ("zipf", "hit-heavy")}
    return out


def measure(trace, config: SimConfig, policy: str, repeat: int) -> dict:
    best_cpu = best_wall = float("inf")
    for _ in range(repeat):
        cpu, wall = time.process_time(), time.perf_counter()
        sim = simulate(trace, config, policy_factory(policy))
        best_cpu = min(best_cpu, time.process_time() - cpu)
        best_wall = min(best_wall, time.perf_counter() - wall)
    s = summarize(sim)
    return {
        "requests": len(trace),
        "cpu_s": best_cpu,
        "wall_s": best_wall,
        "requests_per_cpu_s": len(trace) / best_cpu,
        "requests_per_wall_s": len(trace) / best_wall,
        "simulated_s": s["simulated_s"],
        "gpu_hit_rate": s["hit_rate"]["gpu"],
        "miss_cost": s["miss_cost"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="zipf and hit-heavy only, shorter")
    parser.add_argument("--policy", default="lru,score")
    parser.add_argument("--cases", help="only these cases, comma-separated (default: all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    table = Table(title=f"simulator speed (best of {args.repeat})")
    for col in (
        "case",
        "policy",
        "requests",
        "cpu s",
        "requests / cpu s",
        "wall s",
        "simulated s / cpu s",
    ):
        table.add_column(col, justify="left" if col in ("case", "policy") else "right")
    chosen = cases(args.quick)
    if args.cases:
        unknown = set(args.cases.split(",")) - set(chosen)
        if unknown:
            parser.error(f"unknown cases {', '.join(sorted(unknown))}: use {', '.join(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.cases.split(",")}
    for name, (trace, kw, what) in chosen.items():
        for policy in args.policy.split(","):
            r = {
                "case": name,
                "what": what,
                "policy": policy,
                **measure(trace, SimConfig(**kw), policy, args.repeat),
            }
            rows.append(r)
            table.add_row(
                name,
                policy,
                str(r["requests"]),
                f"{r['cpu_s']:.2f}",
                f"{r['requests_per_cpu_s']:,.0f}",
                f"{r['wall_s']:.2f}",
                f"{r['simulated_s'] / r['cpu_s']:,.0f}",
            )
    Console().print(table)
    if args.json:
        machine = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
        }
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
