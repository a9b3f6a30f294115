"""`loraplex plan --workers N`: the workload on a fleet of N workers at the planned capacities, with
its hit rates, cold starts, the registry's load under the push model, and the simulator's speed.
`loraplex plan --pool SPEC ...`: the same on a fleet of pools, and each pool sized: the fewest
workers that keep its TTFT p99 within 2x its warm TTFT."""

from __future__ import annotations

import dataclasses
import statistics
import time

from rich.table import Table

from loraplex.settings.serve_values import VLLM_HOST_CACHE_PER_SLOT
from loraplex.sim import workload as workloads
from loraplex.sim.pools import SimPool
from loraplex.sim.report import summarize
from loraplex.sim.simulator import SimConfig, Simulation, policy_factory, simulate

TTFT_OVER_WARM = 2.0
"""A pool is sized to the fewest workers whose TTFT p99 stays within this times its warm TTFT."""


def fleet_for_workload(
    plan,
    trace: list[workloads.Request],
    workers: int,
    registry_changes_per_s: float = 0.0,
    pools: tuple[SimPool, ...] = (),
) -> dict:
    """One simulation of the `score` policy on `workers` workers (or on `pools`), each with the
    plan's slots, host cache and disk cache, adapters sized by the plan's adapters' bytes per unit
    of rank."""
    config = _config(plan, workers, registry_changes_per_s, pools)
    started = time.perf_counter()
    sim = simulate(trace, config, policy_factory("score"))
    wall = time.perf_counter() - started
    figures = summarize(sim)
    return {
        "workers": config.workers,
        "requests": len(trace),
        "adapters": len({r.model for r in trace if r.adapter is not None}),
        "tenants": len({r.tenant for r in trace}),
        "simulated_s": sim.span_s,
        "hit_rate": figures["hit_rate"],
        "cold_start_rate": figures["cold_start_rate"],
        "registry": figures["registry"],
        "ttft_p99_s": figures["latency"]["all"]["ttft_s"]["p99"],
        **_sharing_figures(figures),
        "wall_s": wall,
        "requests_per_wall_s": len(trace) / wall if wall > 0 else float("inf"),
        **({"pools": size_pools(plan, trace, pools, sim)} if pools else {}),
    }


def _sharing_figures(figures: dict) -> dict:
    """Per tenant its TTFT p99 and (with fair share) its requests held back; with prefixes: the
    fleet's prefix-cache hit rate."""
    held = figures["fair_share"]["held_back"] if "fair_share" in figures else None
    out: dict = {
        "per_tenant": {
            t: {"ttft_p99_s": f["ttft_s"]["p99"]}
            | ({} if held is None else {"held_back": held.get(t, 0)})
            for t, f in figures["tenants"].items()
        }
    }
    if "prefix_cache" in figures:
        out["prefix_hit_rate"] = figures["prefix_cache"]["hit_rate"]
    return out


def size_pools(plan, trace, pools: tuple[SimPool, ...], declared: Simulation) -> list[dict]:
    """Per pool, as declared: its requests, hit rate, TTFT p99 and warm TTFT (the median of its
    gpu hits); and the fewest workers (up to twice the declared count, the other pools as
    declared) whose TTFT p99 is within TTFT_OVER_WARM of that warm TTFT (None: not within
    twice)."""
    out = []
    for i, pool in enumerate(pools):
        figures = _pool_ttft(declared, pool.spec.name)
        needed = None
        for count in range(1, 2 * pool.workers + 1):
            resized = pools[:i] + (dataclasses.replace(pool, workers=count),) + pools[i + 1 :]
            sim = simulate(trace, _config(plan, 0, 0.0, resized), policy_factory("score"))
            p99 = _pool_ttft(sim, pool.spec.name)["ttft_p99_s"]
            if figures["warm_ttft_s"] and p99 <= TTFT_OVER_WARM * figures["warm_ttft_s"]:
                needed = count
                break
        out.append({"pool": pool.spec.name, "workers": pool.workers, **figures, "needed": needed})
    return out


def _pool_ttft(sim: Simulation, name: str) -> dict:
    assert sim.pools is not None
    group = [s for s in sim.requests if s.tier != "refused" and sim.pools.name_of(s.worker) == name]
    ttft = sorted(s.first_token_at - s.req.time for s in group)
    warm = [s.first_token_at - s.req.time for s in group if s.tier == "gpu"]
    return {
        "requests": len(group),
        "gpu_hit_rate": len(warm) / len(group) if group else 0.0,
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else 0.0,
        "warm_ttft_s": statistics.median(warm) if warm else None,
        "refused": sum(s.tier == "refused" for s in sim.requests),
    }


def _config(plan, workers: int, registry_changes_per_s: float, pools) -> SimConfig:
    per_rank = sum(a.serving_bytes / a.rank for a in plan.adapters) / len(plan.adapters)
    d = plan.defaults
    return SimConfig(
        engine=plan.engine,
        max_cpu_loras=plan.max_cpu_loras,
        gpu_slots=d.max_loras,
        max_num_seqs=d.max_num_seqs,
        cpu_bytes=d.cpu_cache_bytes,
        disk_bytes=d.disk_cache_bytes,
        workers=max(1, workers),
        bytes_per_rank=int(per_rank),
        tenant_budgets=plan.budgets,
        registry_changes_per_s=registry_changes_per_s,
        service=plan.calibration.service,
        costs=plan.calibration.costs,
        pools=pools,
        **plan.options,
    )


def fleet_table(plan) -> Table:
    f, d = plan.fleet, plan.defaults
    host = f"cpu {d.cpu_cache_bytes / 2**30:.1f} GiB"
    if plan.engine == "vllm":
        count = plan.max_cpu_loras or VLLM_HOST_CACHE_PER_SLOT * d.max_loras
        host = f"engine vllm, cpu {count} adapters"
    table = Table(
        title=f"workload {plan.workload} on {f['workers']} workers (simulated, policy score; "
        f"each max-loras {d.max_loras}, max-num-seqs {d.max_num_seqs}, {host})",
        caption=_router_caption(plan.options),
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    reg = f["registry"]
    rows = (
        ("requests, adapters, tenants", f"{f['requests']:,}, {f['adapters']:,}, {f['tenants']:,}"),
        ("gpu hit", f"{f['hit_rate']['gpu']:.2%}"),
        ("cpu hit", f"{f['hit_rate']['cpu']:.2%}"),
        ("cold starts (disk or remote)", f"{f['cold_start_rate']:.2%}"),
        ("TTFT p99", _ms(f["ttft_p99_s"])),
        *_sharing_rows(f),
        ("registry queries per second", f"{reg['queries_per_s']:.2f}"),
        ("registry notifications per second", f"{reg['notifications_per_s']:.2f}"),
        ("queries per request, second half", f"{reg['queries_per_request_second_half']:.4f}"),
        ("simulated requests per wall second", f"{f['requests_per_wall_s']:,.0f}"),
    )
    for name, value in rows:
        table.add_row(name, value)
    return table


def _router_caption(options: dict) -> str | None:
    """The router's behaviour the simulations ran with, as its flags (None: the defaults)."""
    if not options:
        return None
    words = [f"--router {options['router']}"] if "router" in options else []
    if options.get("fair_share"):
        words.append(f"--fair-share --holdback-window-s {options['holdback_window_s']:g}")
        weights = ",".join(f"{t}={w:g}" for t, w in options["tenant_weights"])
        words += [f"--tenant-weights {weights}"] if weights else []
    if "kv_prefix_blocks" in options:
        words.append(f"--kv-prefix-blocks {options['kv_prefix_blocks']}")
    return "router: " + " ".join(words)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _sharing_rows(f: dict) -> list[tuple[str, str]]:
    rows = []
    if "prefix_hit_rate" in f:
        rows.append(("prefix-cache hit", f"{f['prefix_hit_rate']:.2%}"))
    for tenant, t in f["per_tenant"].items():
        rows.append((f"tenant {tenant}: TTFT p99", _ms(t["ttft_p99_s"])))
        if "held_back" in t:
            rows.append((f"tenant {tenant}: requests held back", f"{t['held_back']:,}"))
    return rows


def pools_plan_table(plan) -> Table:
    """Per pool: its declared workers and figures, and the workers it needs."""
    table = Table(
        title=f"pools: workers each needs for TTFT p99 within {TTFT_OVER_WARM:g}x its warm TTFT "
        "(simulated, policy score)",
        caption="needed: the fewest workers, the other pools as declared; - : not within twice "
        "the declared count",
    )
    columns = ("pool", "workers", "requests", "gpu hit", "warm TTFT", "p99 TTFT", "needed")
    for col in columns:
        table.add_column(col, justify="left" if col == "pool" else "right", no_wrap=True)
    for p in plan.fleet["pools"]:
        warm = p["warm_ttft_s"]
        table.add_row(
            p["pool"],
            str(p["workers"]),
            f"{p['requests']:,}",
            f"{p['gpu_hit_rate']:.2%}",
            "-" if warm is None else f"{warm * 1000:.0f} ms",
            f"{p['ttft_p99_s'] * 1000:.0f} ms",
            "-" if p["needed"] is None else str(p["needed"]),
        )
    return table
