"""`loraplex simulate` and `loraplex plan`: typer command functions (mounted by loraplex.cli) and
their output.

python -m loraplex.sim.cli simulate --workload hot-burst --policy lru,score --gpu-slots 4,8 --json
out.json
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from loraplex.outputs import unwritable
from loraplex.residency.budgets import Budget
from loraplex.settings.command import PLAIN, add_settings_command
from loraplex.settings.pools import check_pools
from loraplex.settings.serve_values import VLLM_HOST_CACHE_PER_SLOT
from loraplex.settings.sim import (
    PLAN_ENV,
    SIMULATE_ENV,
    PlanSettings,
    SimulateSettings,
    workload_shape,
)
from loraplex.sim import workload as workloads
from loraplex.sim.calibration import Calibration, CalibrationError, read_calibration
from loraplex.sim.plot import plot_capacity, size_label
from loraplex.sim.pools import SimPool, parse_sim_pool
from loraplex.sim.prefix_cache import with_system_prompts
from loraplex.sim.report import compare, hot_adapters
from loraplex.sim.share_report import routing_check, sharing_options, sharing_tables
from loraplex.sim.simulator import SimConfig, config_dict
from loraplex.units import parse_size

GiB = 2**30


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _gap(x: float | None) -> str:
    if x is None:  # run without the optimum
        return "-"
    return "∞" if math.isinf(x) else f"{100 * x:+.1f}%"


def run_sweep(
    traces: dict[str, list[workloads.Request]],
    policies: list[str],
    slots: list[int | None],
    cpu: list[int | None],
    workers: int,
    console: Console,
    budgets: dict[str, Budget] | None = None,
    registry_changes_per_s: float = 0.0,
    optimal: bool = True,
    calibration: Calibration | None = None,
    engine: str = "native",
    max_cpu_loras: int | None = None,
    pools: tuple[SimPool, ...] = (),
    routing: str = "router",
    options: dict | None = None,
    max_num_seqs: int = SimConfig.max_num_seqs,
) -> list[dict]:
    """Every (workload, gpu slots, cpu bytes) cell, each with every policy and the optimum (unless
    not `optimal`), at `calibration`'s costs (the package's by default)."""
    cells = [(w, s, c) for w in traces for s in slots for c in cpu]
    calibration = calibration or Calibration()
    runs = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating", total=len(cells) * (len(policies) + optimal))
        for name, n_slots, n_cpu in cells:
            trace = traces[name]
            cap = workloads.default_capacity(name)
            config = SimConfig(
                pools=pools,
                routing=routing,
                engine=engine,
                max_cpu_loras=max_cpu_loras,
                max_num_seqs=max_num_seqs,
                gpu_slots=n_slots or cap.gpu_slots,
                cpu_bytes=cap.cpu_bytes if n_cpu is None else n_cpu,
                disk_bytes=cap.disk_bytes,
                workers=workers,
                service=calibration.service,
                costs=calibration.costs,
                tenant_budgets=budgets,
                registry_changes_per_s=registry_changes_per_s,
                **(options or {}),
            )
            progress.update(
                task,
                description=f"{name} slots={config.gpu_slots} cpu={size_label(config.cpu_bytes)}",
            )
            hot = hot_adapters(trace, config.gpu_slots * config.workers)
            entries = compare(
                trace, config, policies, hot, lambda _: progress.advance(task), optimal
            )
            record = _run_record(name, trace, config, hot, entries)
            runs.append(record | ({"options": options} if options else {}))
    return runs


def _run_record(name: str, trace, config: SimConfig, hot: set[str], entries: dict) -> dict:
    """One cell of a sweep as the tables and the JSON read it."""
    return {
        "workload": name,
        "requests": len(trace),
        "gpu_slots": config.gpu_slots,
        "cpu_bytes": config.cpu_bytes,
        "disk_bytes": config.disk_bytes,
        "workers": config.workers,
        "pools": [{**p.spec.as_dict(), "workers": p.workers} for p in config.pools],
        "engine": config.engine,
        "routing": config.routing,
        "max_cpu_loras": config.max_cpu_loras,
        "max_num_seqs": config.max_num_seqs,
        "adapters": len({r.model for r in trace if r.adapter is not None}),
        "hot_adapters": sorted(hot),
        "policies": entries,
    }


def _host_label(run: dict) -> str:
    """A run's host memory: bytes (native), or vLLM's host cache in adapters."""
    if run.get("engine", "native") == "native":
        return size_label(run["cpu_bytes"])
    count = run.get("max_cpu_loras") or VLLM_HOST_CACHE_PER_SLOT * run["gpu_slots"]
    return f"{count} adapters"


def compact_table(runs: list[dict]) -> Table:
    """The figures a reader decides on: hit rates, miss cost and its gap to the optimum, hot p99.

    The sweep's axes (workload, gpu slots, cpu) are columns only where they vary; the title holds
    the others, so that the table fits a terminal of 80 columns.
    """
    axes = {
        "workload": lambda r: Path(r["workload"]).name,
        "slots": lambda r: str(r["gpu_slots"]),
        "cpu": _host_label,
    }
    varying = [a for a, value in axes.items() if len({value(r) for r in runs}) > 1]
    fixed = [f"{a} {axes[a](runs[0])}" for a in axes if a not in varying]
    if runs[0].get("engine", "native") != "native":
        fixed.append(f"engine {runs[0]['engine']}")
    table = Table(
        title=", ".join(["simulation", *fixed]),
        caption="optimal (bound): the least miss cost any policy can pay; gap: over it; "
        "miss s: seconds of loads and copies; "
        "hot p99: TTFT of the hot adapters, ms; --wide: every column",
    )
    for col in (*varying, "policy", "gpu hit", "cpu hit", "cold", "miss s", "gap", "hot p99"):
        justify = "left" if col in ("workload", "policy") else "right"
        table.add_column(col, justify=justify, no_wrap=True, min_width=len(col))
    for run in runs:
        for name, e in run["policies"].items():
            rates = e["hit_rate"]
            table.add_row(
                *(axes[a](run) for a in varying),
                name,
                _pct(rates["gpu"]),
                _pct(rates["cpu"]),
                _pct(rates["disk"] + rates["remote"]),
                f"{e['miss_cost']:.1f}",
                _gap(e["gap"]),
                _ms(e["latency"]["hot"]["ttft_s"]["p99"]),
            )
        if len(runs) > 1:
            table.add_section()
    return table


def fleet_table(runs: list[dict]) -> Table:
    """Per run and policy: the fleet's hit rates, cold starts, the registry's load and the
    simulator's own speed."""
    first = runs[0]
    table = Table(
        title=f"fleet: {first['workers']} workers, {first['requests']:,} requests over "
        f"{first['adapters']:,} adapters" + (" (the first run)" if len(runs) > 1 else ""),
        caption="q/s: registry queries per second (resolves: a name's first request on a "
        "worker, or its first after a change); notif/s: notifications delivered per second; "
        "q/req ½: queries per request over the trace's second half; sim/s: simulated requests "
        "per wall second",
    )
    many = len({r["workload"] for r in runs}) > 1
    columns = ("policy", "gpu hit", "cold", "q/s", "notif/s")
    for col in (*(("workload",) if many else ()), *columns, "q/req ½", "sim/s"):
        justify = "left" if col in ("workload", "policy") else "right"
        table.add_column(col, justify=justify, no_wrap=True, min_width=len(col))
    for run in runs:
        for name, e in run["policies"].items():
            reg = e["registry"]
            table.add_row(
                *((Path(run["workload"]).name,) if many else ()),
                name,
                _pct(e["hit_rate"]["gpu"]),
                _pct(e["cold_start_rate"]),
                f"{reg['queries_per_s']:.1f}",
                f"{reg['notifications_per_s']:.1f}",
                f"{reg['queries_per_request_second_half']:.3f}",
                f"{e['requests_per_wall_s']:,.0f}",
            )
    return table


def pools_table(runs: list[dict]) -> Table:
    """Per run, policy and pool: its workers, the requests it served and their hit rates; the
    requests no pool open to their tenant serves."""
    table = Table(
        title="pools",
        caption="refused: requests no pool open to their tenant serves (the router's 404)",
    )
    for col in ("policy", "pool", "workers", "requests", "gpu hit", "cold", "p99 TTFT", "refused"):
        justify = "left" if col in ("policy", "pool") else "right"
        table.add_column(col, justify=justify, no_wrap=True, min_width=len(col))
    for run in runs:
        for name, e in run["policies"].items():
            for pool, f in e.get("pools", {}).items():
                table.add_row(
                    name,
                    pool,
                    str(f["workers"]),
                    f"{f['requests']:,}",
                    _pct(f["gpu_hit_rate"]),
                    _pct(f["cold_start_rate"]),
                    _ms(f["ttft_s"]["p99"]),
                    f"{e['refused']:,}",
                )
    return table


def results_table(runs: list[dict], title: str = "simulation") -> Table:
    """Every figure of every run (`--wide`)."""
    table = Table(title=title)
    for col in (
        "workload",
        "slots",
        "cpu",
        "policy",
        "gpu",
        "cpu hit",
        "disk",
        "remote",
        "byte hit",
        "thrash",
        "miss cost s",
        "gap",
        "vs oracle",
        "TTFT p50 ms",
        "p99",
        "warm p99",
        "cold p99",
        "hot p99",
        "TPOT p99",
        "wait p99",
    ):
        table.add_column(col, justify="left" if col in ("workload", "policy") else "right")
    for run in runs:
        for name, e in run["policies"].items():
            lat = e["latency"]
            table.add_row(
                run["workload"],
                str(run["gpu_slots"]),
                size_label(run["cpu_bytes"]),
                name + (" (bound)" if name == "optimal" else ""),
                *(_pct(e["hit_rate"][t]) for t in ("gpu", "cpu", "disk", "remote")),
                _pct(e["byte_hit_rate"]["gpu"]),
                f"{e['thrash_ratio']:.2f}",
                f"{e['miss_cost']:.1f}",
                _gap(e["gap"]),
                _gap(e["gap_oracle"]),
                _ms(lat["all"]["ttft_s"]["p50"]),
                _ms(lat["all"]["ttft_s"]["p99"]),
                _ms(lat["warm"]["ttft_s"]["p99"]),
                _ms(lat["cold"]["ttft_s"]["p99"]),
                _ms(lat["hot"]["ttft_s"]["p99"]),
                _ms(lat["all"]["tpot_s"]["p99"]),
                _ms(lat["all"]["queue_wait_s"]["p99"]),
            )
        table.add_section()
    return table


def tenant_table(run: dict) -> Table:
    table = Table(
        title=(
            f"per tenant: {run['workload']}, {run['gpu_slots']} slots, cpu "
            f"{size_label(run['cpu_bytes'])}"
        )
    )
    columns = (
        "policy",
        "tenant",
        "requests",
        "gpu hit",
        "cold starts",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "wait p99 ms",
        "budget waits",
    )
    for col in columns:
        table.add_column(col, justify="left" if col in ("policy", "tenant") else "right")
    for name, e in run["policies"].items():
        for tenant, t in e["tenants"].items():
            table.add_row(
                name,
                tenant,
                str(t["requests"]),
                _pct(t["gpu_hit_rate"]),
                _pct(t["cold_start_rate"]),
                _ms(t["ttft_s"]["p50"]),
                _ms(t["ttft_s"]["p99"]),
                _ms(t["queue_wait_s"]["p99"]),
                str(t.get("budget_waits", "-")),
            )
    return table


def simulate(s: SimulateSettings) -> None:
    """Replay a workload through the real cache, policies and router picker on a simulated clock."""
    calibration = _calibration(s.calibration)
    console = Console()
    names, policies = list(dict.fromkeys(s.workload)), list(s.policy)
    for name in names:
        if name not in workloads.NAMED and not Path(name).is_file():
            raise typer.BadParameter(
                f"{name!r} is neither a named workload ({', '.join(workloads.NAMED)}) "
                "nor a trace file",
                param_hint="--workload",
            )
    for path, flag in ((s.json, "--json"), (s.plot, "--plot")):
        problem = path and unwritable(path)
        if problem:
            typer.echo(f"error: {flag} {path}: {problem}", err=True)
            raise typer.Exit(2)
    slots: list[int | None] = list(s.gpu_slots) or [None]
    cpu: list[int | None] = list(s.cpu_bytes) or [None]
    workers, wide, json_out, plot = s.workers, s.wide, s.json, s.plot
    budgets = dict(_tenant_budget(text) for text in s.tenant_budget)
    routing_check(s)
    options, prompts = sharing_options(s), s.system_prompt_tokens
    traces = {n: with_system_prompts(_load_workload(n, workload_shape(s)), prompts) for n in names}
    pools = _pools(s.pool)
    changes = s.registry_changes_per_s

    def sweep_of(cells: dict[str, list[workloads.Request]], n_slots: list) -> list[dict]:
        args = (workers, console, budgets, changes, s.optimal, calibration)
        kw = {
            "engine": s.engine,
            "max_cpu_loras": s.max_cpu_loras,
            "routing": s.routing,
            "max_num_seqs": s.max_num_seqs,
        }
        return run_sweep(cells, policies, n_slots, cpu, *args, **kw, pools=pools, options=options)

    runs = sweep_of(traces, slots)
    _print_tables(console, runs, wide, fleet=workers > 1 or bool(changes or pools))
    if json_out is not None:  # before the plot: a plotting failure must not lose the runs
        meta = {
            "config": config_dict(SimConfig(service=calibration.service, costs=calibration.costs)),
            "note": "config: the defaults of every run; each run lists its capacities",
        }
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1, default=str))
        console.print(f"json: {json_out}")
    if plot is not None:
        sweep = runs
        if len(slots) == 1 and len(cpu) == 1:
            # one capacity per workload: sweep ½×, 1×, 2×, 4× its own slots
            sweep = []
            for run in runs:
                base = run["gpu_slots"]
                around = sorted({max(1, base // 2), base, base * 2, base * 4})
                one = {run["workload"]: traces[run["workload"]]}
                sweep += sweep_of(one, around)
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot_capacity(sweep, plot)
        console.print(f"plot: {plot}")


def _print_tables(console: Console, runs: list[dict], wide: bool, fleet: bool) -> None:
    if wide:
        console.print(results_table(runs))
        if len(runs) == 1:
            console.print(tenant_table(runs[0]))
    else:
        console.print(compact_table(runs))
    if fleet:
        console.print(fleet_table(runs))
    if any(run["pools"] for run in runs):
        console.print(pools_table(runs))
    for table in sharing_tables(runs):
        console.print(table)


def _calibration(path: Path | None) -> Calibration:
    """The calibration `--calibration` names (the package's without one); a bad file is one line
    on stderr and exit 2, before any run."""
    try:
        return read_calibration(path)
    except CalibrationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _load_workload(name: str, shape: dict | None = None) -> list[workloads.Request]:
    """The trace of a named workload (reshaped by `shape`) or a file; a BadParameter when a line is
    bad, the shape does not apply, or there is no request."""
    try:
        trace = workloads.load(name, **(shape or {}))
    except (OSError, ValueError) as exc:  # a TraceError names the file and line
        raise typer.BadParameter(str(exc), param_hint="--workload") from None
    if not trace:
        raise typer.BadParameter(
            f"{name}: the trace has no requests to simulate", param_hint="--workload"
        )
    return trace


def _pools(specs: tuple[str, ...]) -> tuple[SimPool, ...]:
    try:
        pools = tuple(parse_sim_pool(spec) for spec in specs)
        check_pools(p.spec for p in pools)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--pool") from None
    return pools


def _tenant_budget(text: str) -> tuple[str, Budget]:
    """`batch=2`, `batch=2:512MiB`, `batch=:512MiB` -> (tenant, Budget)."""
    tenant, _, spec = text.partition("=")
    slots, _, size = spec.partition(":")
    try:
        if not tenant or not spec:
            raise ValueError("use TENANT=SLOTS[:SIZE]")
        return tenant, Budget(int(slots) if slots else None, parse_size(size) if size else None)
    except ValueError as exc:
        raise typer.BadParameter(f"{text!r}: {exc}", param_hint="--tenant-budget") from None


def plan(s: PlanSettings) -> None:
    """Adapter bytes (formula, actual), how many fit per tier, the smallest cache for a workload."""
    from loraplex.sim import plan as planner

    calibration = _calibration(s.calibration)
    console = Console()
    try:
        report = planner.make_plan(
            s.model,
            registry=s.registry,
            adapters_dir=s.adapters,
            workload=s.workload,
            progress=Progress(console=console, transient=True),
            workers=s.workers,
            shape=workload_shape(s),
            registry_changes_per_s=s.registry_changes_per_s,
            max_loras=s.max_loras,
            max_lora_rank=s.max_lora_rank,
            max_num_seqs=s.max_num_seqs,
            cpu_cache_bytes=s.cpu_cache_bytes,
            disk_cache_bytes=s.disk_cache_bytes,
            calibration=calibration,
            engine=s.engine,
            max_cpu_loras=s.max_cpu_loras,
            pools=_pools(s.pool),
            options=sharing_options(s),
            system_prompt_tokens=s.system_prompt_tokens,
        )
    except planner.PlanError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for table in planner.tables(report):
        console.print(table)


def routers(
    workers: int = typer.Option(4, "--workers"),
    policy: str = typer.Option("score", "--policy", help="The cache policy of every worker."),
    gpu_slots: int = typer.Option(8, "--gpu-slots"),
    cpu_bytes: str = typer.Option("4GiB", "--cpu-bytes"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """Developer entry point: the router's pickers side by side on Zipf traffic scaled to the fleet
    (6 requests/s per worker over 200 adapters)."""
    from loraplex.router.picker import POLICIES as ROUTERS
    from loraplex.sim.report import summarize
    from loraplex.sim.simulator import policy_factory
    from loraplex.sim.simulator import simulate as run

    console = Console()
    trace = workloads.generate(workloads.WorkloadSpec(name="zipf", rate=6.0 * workers))
    hot = hot_adapters(trace, gpu_slots * workers)
    rows = {}
    for router in ROUTERS:
        config = SimConfig(
            gpu_slots=gpu_slots,
            cpu_bytes=parse_size(cpu_bytes),
            workers=workers,
            router=router,
        )
        sim = run(trace, config, policy_factory(policy))
        rows[router] = summarize(sim, hot)
        rows[router]["per_worker_requests"] = [
            sum(s.worker == w for s in sim.requests) for w in range(workers)
        ]
    title = (
        f"routers: {workers} workers × {gpu_slots} slots, cpu {cpu_bytes} each, "
        f"cache policy {policy}, {len(trace)} requests"
    )
    table = _routers_table(rows, title)
    console.print(table)
    if json_out is not None:
        json_out.write_text(
            json.dumps(
                {
                    "workers": workers,
                    "gpu_slots": gpu_slots,
                    "cpu_bytes": parse_size(cpu_bytes),
                    "policy": policy,
                    "routers": rows,
                },
                indent=1,
                default=str,
            )
        )


def _routers_table(rows: dict, title: str) -> Table:
    """One row per router picker: hit rates, cold starts, miss cost, latencies, spread."""
    table = Table(title=title)
    for col in (
        "router",
        "gpu",
        "cpu hit",
        "cold starts",
        "miss cost s",
        "TTFT p50 ms",
        "p99",
        "hot p99",
        "wait p99",
        "requests per worker",
    ):
        table.add_column(col, justify="left" if col == "router" else "right")
    for router, e in rows.items():
        lat = e["latency"]
        table.add_row(
            router,
            _pct(e["hit_rate"]["gpu"]),
            _pct(e["hit_rate"]["cpu"]),
            _pct(e["cold_start_rate"]),
            f"{e['miss_cost']:.1f}",
            _ms(lat["all"]["ttft_s"]["p50"]),
            _ms(lat["all"]["ttft_s"]["p99"]),
            _ms(lat["hot"]["ttft_s"]["p99"]),
            _ms(lat["all"]["queue_wait_s"]["p99"]),
            " ".join(map(str, e["per_worker_requests"])),
        )
    return table


app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Workload simulation and capacity planning.",
    rich_markup_mode=PLAIN,
)


def add_sim_commands(target: typer.Typer) -> None:
    add_settings_command(target, SimulateSettings, simulate, "simulate", SIMULATE_ENV)
    add_settings_command(target, PlanSettings, plan, "plan", PLAN_ENV)


add_sim_commands(app)
app.command("routers")(routers)

if __name__ == "__main__":
    app()
