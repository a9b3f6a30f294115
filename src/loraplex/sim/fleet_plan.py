"""`loraplex plan --workers N`: the workload on a fleet of N workers at the planned capacities, with
its hit rates, cold starts, the registry's load under the push model, and the simulator's speed."""

from __future__ import annotations

import time

from rich.table import Table

from loraplex.settings.serve_values import VLLM_HOST_CACHE_PER_SLOT
from loraplex.sim import workload as workloads
from loraplex.sim.report import summarize
from loraplex.sim.simulator import SimConfig, policy_factory, simulate


def fleet_for_workload(
    plan, trace: list[workloads.Request], workers: int, registry_changes_per_s: float = 0.0
) -> dict:
    """One simulation of the `score` policy on `workers` workers, each with the plan's slots, host
    cache and disk cache, adapters sized by the plan's adapters' bytes per unit of rank."""
    per_rank = sum(a.serving_bytes / a.rank for a in plan.adapters) / len(plan.adapters)
    d = plan.defaults
    config = SimConfig(
        engine=plan.engine,
        max_cpu_loras=plan.max_cpu_loras,
        gpu_slots=d.max_loras,
        cpu_bytes=d.cpu_cache_bytes,
        disk_bytes=d.disk_cache_bytes,
        workers=workers,
        bytes_per_rank=int(per_rank),
        tenant_budgets=plan.budgets,
        registry_changes_per_s=registry_changes_per_s,
        service=plan.calibration.service,
        costs=plan.calibration.costs,
    )
    started = time.perf_counter()
    sim = simulate(trace, config, policy_factory("score"))
    wall = time.perf_counter() - started
    figures = summarize(sim)
    return {
        "workers": workers,
        "requests": len(trace),
        "adapters": len({r.model for r in trace if r.adapter is not None}),
        "tenants": len({r.tenant for r in trace}),
        "simulated_s": sim.span_s,
        "hit_rate": figures["hit_rate"],
        "cold_start_rate": figures["cold_start_rate"],
        "registry": figures["registry"],
        "wall_s": wall,
        "requests_per_wall_s": len(trace) / wall if wall > 0 else float("inf"),
    }


def fleet_table(plan) -> Table:
    f, d = plan.fleet, plan.defaults
    host = f"cpu {d.cpu_cache_bytes / 2**30:.1f} GiB"
    if plan.engine == "vllm":
        count = plan.max_cpu_loras or VLLM_HOST_CACHE_PER_SLOT * d.max_loras
        host = f"engine vllm, cpu {count} adapters"
    table = Table(
        title=f"workload {plan.workload} on {f['workers']} workers (simulated, policy score; "
        f"each max-loras {d.max_loras}, {host})"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    reg = f["registry"]
    rows = (
        ("requests, adapters, tenants", f"{f['requests']:,}, {f['adapters']:,}, {f['tenants']:,}"),
        ("gpu hit", f"{f['hit_rate']['gpu']:.2%}"),
        ("cpu hit", f"{f['hit_rate']['cpu']:.2%}"),
        ("cold starts (disk or remote)", f"{f['cold_start_rate']:.2%}"),
        ("registry queries per second", f"{reg['queries_per_s']:.2f}"),
        ("registry notifications per second", f"{reg['notifications_per_s']:.2f}"),
        ("queries per request, second half", f"{reg['queries_per_request_second_half']:.4f}"),
        ("simulated requests per wall second", f"{f['requests_per_wall_s']:,.0f}"),
    )
    for name, value in rows:
        table.add_row(name, value)
    return table
