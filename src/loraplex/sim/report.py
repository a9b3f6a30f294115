"""What a simulation's run comes to: hit rates, costs, latencies and per-tenant figures
(`summarize`), and policies compared on one trace against the optimum's bound (`compare`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import numpy as np

from loraplex.sim.simulator import (
    TIERS,
    SimConfig,
    SimRequest,
    Simulation,
    policy_factory,
    simulate,
)
from loraplex.sim.workload import Request


def _percentiles(values) -> dict[str, float | None]:
    a = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if not len(a):
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def hot_adapters(trace: list[Request], count: int, floor: float = 0.05) -> set[str]:
    """The `count` most requested adapters (name@revision) of a trace, leaving out those with fewer
    than `floor` of the top one's requests (a one-off is not hot however many slots there are)."""
    ranked = Counter(r.model for r in trace if r.adapter is not None).most_common(count)
    return {m for m, n in ranked if ranked and n >= max(2, floor * ranked[0][1])}


def summarize(sim: Simulation, hot: set[str] | None = None) -> dict:
    """Hit rates per tier, byte hit rate, reloads after eviction, thrash ratio, miss cost, admission
    wait, TTFT / TPOT percentiles (all, warm, cold, per tier, hot adapters) and per-tenant
    figures."""
    served = [s for s in sim.requests if s.tier != "refused"]  # a pool served it
    seqs = [s for s in served if s.ref is not None]
    n = len(seqs) or 1
    tiers = Counter(s.tier for s in seqs)
    total_bytes = sum(s.nbytes for s in seqs) or 1
    caches = [w.cache for w in sim.workers]
    evictions = sum(c.ledger.num_evictions for c in caches)
    reloads = sum(c.ledger.reloads_after_eviction for c in caches)
    h2d = sum(w.pool.copy_seconds for w in sim.workers)
    loads = sum(w.load_seconds for w in sim.workers)
    if hot is None:
        hot = hot_adapters(sim.trace, sim.config.gpu_slots * sim.config.workers)
    by_tenant: dict[str, list[SimRequest]] = {}
    for s in served:
        by_tenant.setdefault(s.req.tenant, []).append(s)
    makespan = max((s.finish_at for s in served), default=0.0)
    return {
        "requests": len(sim.requests),
        "finished": sim.finished,
        "refused": sim.refused,
        "hit_rate": {t: tiers[t] / n for t in TIERS},
        "byte_hit_rate": {
            "gpu": sum(s.nbytes for s in seqs if s.tier == "gpu") / total_bytes,
            "gpu+cpu": sum(s.nbytes for s in seqs if s.tier in ("gpu", "cpu")) / total_bytes,
        },
        "cold_start_rate": (tiers["disk"] + tiers["remote"]) / n,
        "registry": sim.registry.figures(len(sim.requests), sim.span_s),
        "miss_cost": h2d + loads,
        "miss_cost_parts": {"h2d": h2d, "load": loads},
        "activations": sum(w.pool.copies for w in sim.workers),
        "adapter_requests": len(seqs),
        "loads": dict(sum((w.loads for w in sim.workers), Counter())),
        "evictions": evictions,
        "reloads_after_eviction": reloads,
        "thrash_ratio": reloads / evictions if evictions else 0.0,
        "latency": {
            "all": _latency(served),
            "warm": _latency([s for s in served if s.tier in ("gpu", "cpu")]),
            "cold": _latency([s for s in served if s.tier in ("disk", "remote")]),
            **{f"tier_{t}": _latency([s for s in served if s.tier == t]) for t in TIERS},
            "hot": _latency([s for s in seqs if s.req.model in hot]),
        },
        "tenants": {t: _tenant_figures(g, caches) for t, g in sorted(by_tenant.items())},
        "peak": {
            "slots": max(w.peak_slots for w in sim.workers),
            "cpu_bytes": max(w.peak_cpu_bytes for w in sim.workers),
            "disk_bytes": max(w.disk.peak for w in sim.workers),
        },
        "simulated_s": makespan,
        **({"pools": _pool_figures(sim, seqs)} if sim.pools is not None else {}),
        **({"prefix_cache": sim.prefixes.figures()} if sim.prefixes is not None else {}),
        **({"fair_share": _fair_figures(sim)} if sim.fair is not None else {}),
    }


def _pool_figures(sim: Simulation, seqs: list[SimRequest]) -> dict[str, dict]:
    """Per pool: its workers, the adapter requests it served, their hit and cold start rates and
    TTFT."""
    pools = sim.pools
    assert pools is not None
    out: dict[str, dict] = {}
    for spec in pools.specs:
        group = [s for s in seqs if pools.name_of(s.worker) == spec.name]
        n = len(group) or 1
        out[spec.name] = {
            "workers": sum(1 for p in pools.pool_of if p.name == spec.name),
            "requests": len(group),
            "gpu_hit_rate": sum(s.tier == "gpu" for s in group) / n,
            "cold_start_rate": sum(s.tier in ("disk", "remote") for s in group) / n,
            "ttft_s": _latency(group)["ttft_s"],
        }
    return out


def _fair_figures(sim: Simulation) -> dict:
    """Requests that waited their turn at the router, and per tenant those granted a worker and
    those that waited while a free place was kept for another tenant (held back)."""
    fair = sim.fair
    assert fair is not None
    return {
        "waited": fair.waited,
        "granted": dict(sorted(fair.queue.granted_total.items())),
        "held_back": dict(sorted(fair.held_back.items())),
    }


def _latency(group: list[SimRequest]) -> dict:
    """TTFT, TPOT and admission wait percentiles of a group of requests."""
    ttft = [s.first_token_at - s.req.time for s in group]
    tpot = [
        (s.finish_at - s.first_token_at) / (s.req.output_tokens - 1)
        for s in group
        if s.req.output_tokens > 1
    ]
    wait = [s.admitted_at - s.req.time for s in group]
    return {
        "count": len(group),
        "ttft_s": _percentiles(ttft),
        "tpot_s": _percentiles(tpot),
        "queue_wait_s": _percentiles(wait),
    }


def _tenant_figures(group: list[SimRequest], caches) -> dict:
    """One tenant's requests, budget waits, hit and cold start rates, and latencies."""
    # Rates over the tenant's adapter requests, as the run's: a base-model request has no
    # adapter to miss.
    adapter = [s for s in group if s.ref is not None]
    m = len(adapter) or 1
    name = group[0].req.tenant if group else None
    budget_waits = sum(c.ledger.budget_waits.get(name, 0) for c in caches)
    return {
        "requests": len(group),
        "adapter_requests": len(adapter),
        "budget_waits": budget_waits,
        "gpu_hit_rate": sum(s.tier == "gpu" for s in adapter) / m,
        "cold_start_rate": sum(s.tier in ("disk", "remote") for s in adapter) / m,
        **_latency(group),
    }


def bound(sim: Simulation, admitted: bool = False) -> dict:
    """The optimum's lower bound for this trace and configuration (capacities pooled over workers),
    over the requests in arrival order, or with `admitted` in the order the run admitted them."""
    from loraplex.sim.optimal import lower_bound

    c = sim.config
    requests = [s for s in sim.requests if s.ref is not None]
    if admitted:  # stable: requests admitted in one step keep their arrival order
        requests.sort(key=lambda s: (math.isnan(s.admitted_at), s.admitted_at))
    seq = [s.ref.key for s in requests]
    if not seq:
        return {"miss_cost": 0.0, "parts": {}, "gpu_misses_min": 0, "gpu_hit_rate_max": 1.0}
    return lower_bound(
        seq,
        sim.nbytes,
        gpu_slots=c.gpu_slots * c.workers,
        cpu_bytes=c.cpu_bytes * c.workers,
        max_cpu_loras=None if c.max_cpu_loras is None else c.max_cpu_loras * c.workers,
        disk_bytes=None if c.disk_bytes is None else c.disk_bytes * c.workers,
        local=c.local_adapters,
        costs=c.costs,
    )


def compare(
    trace: list[Request],
    config: SimConfig,
    policies: list[str],
    hot: set[str] | None = None,
    on_run: Callable[[str], None] = lambda name: None,
    optimal: bool = True,
) -> dict[str, dict]:
    """One entry per policy plus "optimal": the lower bound's miss cost, with the latencies and hit
    rates of a farthest-next-use oracle run; each policy's entry carries its gap to both. Without
    `optimal`, the policies alone (their gaps None)."""
    import time

    hot = hot if hot is not None else hot_adapters(trace, config.gpu_slots * config.workers)
    entries, sims = {}, {}
    for name in [*policies, "optimal"] if optimal else policies:
        start, start_cpu = time.perf_counter(), time.process_time()
        sim = sims[name] = simulate(trace, config, policy_factory(name))
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        entries[name] = summarize(sim, hot)
        entries[name]["wall_s"], entries[name]["cpu_s"] = wall, cpu
        entries[name]["requests_per_wall_s"] = len(trace) / wall if wall > 0 else math.inf
        entries[name]["requests_per_cpu_s"] = len(trace) / cpu if cpu > 0 else math.inf
        if name == "optimal":
            lb = bound(sim)
            oracle = entries[name]
            oracle["miss_cost_oracle"] = oracle["miss_cost"]
            oracle["miss_cost"] = lb["miss_cost"]
            oracle["lower_bound"] = lb
        on_run(name)
    if optimal:
        _gaps_to_optimum(entries, sims)
    else:
        for entry in entries.values():
            entry["gap"] = entry["gap_oracle"] = None
    return entries


def _gaps_to_optimum(entries: dict[str, dict], sims: dict[str, Simulation]) -> None:
    """Each entry's gap to the optimum's bound and to the oracle run."""
    from loraplex.sim.optimal import gap

    least = min(e.get("miss_cost_oracle", e["miss_cost"]) for e in entries.values())
    if least < entries["optimal"]["miss_cost"]:
        # A run paid less than the bound on the arrival order allows: waiting requests of one
        # adapter were admitted together, with one load. Each run's cost is at least the bound on
        # the order it admitted; the least of those holds for every run.
        lb = min((bound(sim, admitted=True) for sim in sims.values()), key=lambda b: b["miss_cost"])
        if lb["miss_cost"] < entries["optimal"]["miss_cost"]:
            entries["optimal"]["miss_cost"] = lb["miss_cost"]
            entries["optimal"]["lower_bound"] = {**lb, "order": "admission"}
    optimum, oracle = entries["optimal"]["miss_cost"], entries["optimal"]["miss_cost_oracle"]
    for entry in entries.values():
        entry["gap"] = gap(entry["miss_cost"], optimum)
        entry["gap_oracle"] = gap(entry.get("miss_cost_oracle", entry["miss_cost"]), oracle)
