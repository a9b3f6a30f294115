"""Capacity planning: adapter bytes by the formula and on disk, what fits per tier, and the smallest
cache and slot count that keep a workload's cold starts under a target (found with the
simulator)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.table import Table

from loraplex.engines.native.config import EngineConfig
from loraplex.lora_format import CONFIG_FILE, DTYPE_BYTES, AdapterRejected, read_adapter
from loraplex.model_config import ModelConfig, ModelConfigError
from loraplex.residency.budgets import Budget
from loraplex.sim import workload as workloads
from loraplex.sim.calibration import Calibration
from loraplex.sim.fleet_plan import fleet_for_workload, fleet_table, pools_plan_table
from loraplex.sim.prefix_cache import with_system_prompts
from loraplex.sim.report import summarize
from loraplex.sim.simulator import SimConfig, policy_factory, simulate

GiB = 2**30
SERVING_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
COLD_START_TARGETS = (0.01, 0.05)
"""Cold start: a request whose adapter was only on disk or remote (a load before its first
token)."""
SLOT_MISS_TARGET = 0.10
"""Slot miss: a request whose adapter was in host memory but in no slot (it waits for a
host-to-device copy); cold starts are the cpu cache's to avoid, slot misses the slots'. On vLLM,
whose device slots are vLLM's own, the requests whose batch copied their adapter into a slot."""


class PlanError(ValueError):
    """The plan's inputs cannot be read; the message says which and why."""


@dataclass(frozen=True)
class AdapterSize:
    name: str
    rank: int
    estimated_bytes: int
    """Σ over injected linear layers (d_in + d_out) × rank × bytes per parameter, as stored."""
    actual_bytes: int
    """The tensors' bytes as stored (safetensors header, or the registry's record)."""
    file_bytes: int | None
    """Bytes on disk (None from a registry)."""
    serving_bytes: int
    """The host copy at the serving dtype: what the cpu tier holds and a slot load copies."""
    kept_in: str | None = None
    """gpu or cpu when the registry pins the adapter there or its warm policy keeps it there (what a
    server pins at start, ahead of demand); None: on demand."""


@dataclass
class Plan:
    model: str
    serving_dtype: str
    max_lora_rank: int
    slot_bytes: int
    """One slot: every linear module of every layer at max_lora_rank, serving dtype."""
    adapters: list[AdapterSize]
    defaults: EngineConfig
    sizing: list[dict] = field(default_factory=list)
    workload: str | None = None
    budgets: dict[str, Budget] = field(default_factory=dict)
    """The registry tenants' residency budgets: the sizing simulations run with them."""
    fleet: dict | None = None
    """With workers: the workload's run on the fleet (`loraplex.sim.fleet_plan`)."""
    calibration: Calibration = field(default_factory=Calibration)
    """The load and step costs the workload's simulations run with."""
    engine: str = "native"
    """Whose residency the simulations run (`SimConfig.engine`): on vllm the host cache is sized in
    adapters (max_cpu_loras), not bytes."""
    max_cpu_loras: int | None = None
    """vllm: the host cache a fleet runs with (None: 4 per slot, as serve's)."""
    options: dict = field(default_factory=dict)
    """The router's behaviour the simulations run with: `SimConfig`'s router, fair_share,
    tenant_weights, holdback_window_s and kv_prefix_blocks (`share_report.sharing_options`)."""


def serving_dtype(config: ModelConfig) -> str:
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(config.torch_dtype, "float32")


def slot_bytes(config: ModelConfig, max_rank: int, dtype_bytes: int) -> int:
    per_layer = sum(sum(config.linear_shape(m)) for m in config.linear_modules)
    return config.num_layers * per_layer * max_rank * dtype_bytes


def from_folder(folder: Path, config: ModelConfig, dtype_bytes: int) -> list[AdapterSize]:
    if not Path(folder).is_dir():
        raise PlanError(
            f"{folder} is not a directory (--adapters takes a folder of adapter directories)"
        )
    dirs = sorted(p for p in Path(folder).iterdir() if (p / CONFIG_FILE).is_file())
    if not dirs:
        raise PlanError(f"{folder} holds no adapter directories (folders with {CONFIG_FILE})")
    out = []
    for path in dirs:
        try:
            spec = read_adapter(path, config, max_rank=2**16)
        except AdapterRejected as exc:
            raise PlanError(f"adapter {path.name}: {exc}") from None
        files = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        # The host copy holds every number in the serving dtype, whatever dtype (or two) the file
        # stores.
        out.append(
            AdapterSize(
                path.name,
                spec.rank,
                spec.estimated_bytes,
                spec.actual_bytes,
                files,
                spec.elements * dtype_bytes,
            )
        )
    return out


def budgets_from_registry(url: str) -> dict[str, Budget]:
    """The tenants' residency budgets kept in the registry (read after `from_registry` opened
    it)."""
    from loraplex.registry.registry import open_existing

    registry = open_existing(url)
    try:
        return {
            t.name: Budget(t.max_gpu_slots, t.max_cpu_bytes)
            for t in registry.list_tenants()
            if t.max_gpu_slots is not None or t.max_cpu_bytes is not None
        }
    finally:
        registry.close()


def from_registry(url: str, dtype_bytes: int) -> list[AdapterSize]:
    from loraplex.registry.errors import RegistryError
    from loraplex.registry.registry import open_existing
    from loraplex.registry.store import shown_url

    try:
        registry = open_existing(url)  # read only, as every command that reads it
        try:
            records = registry.list_adapters()
        finally:
            registry.close()
    except RegistryError as exc:  # missing, not initialized, unsupported, unreachable, no driver
        raise PlanError(f"--registry: {exc}") from None
    out = []
    for record in records:
        rev = record.stable or (record.revisions[-1] if record.revisions else None)
        if rev is None:
            continue
        # The registry keeps bytes, not numbers: a revision stored in two dtypes ("mixed") is
        # counted as if all in the narrower one, so its host copy is over- rather than
        # under-estimated.
        stored = DTYPE_BYTES.get(rev.dtype, 2)
        out.append(
            AdapterSize(
                record.name,
                rev.rank,
                rev.estimated_bytes,
                rev.actual_bytes,
                None,
                rev.estimated_bytes * dtype_bytes // stored,
                _kept_in(record),
            )
        )
    if not out:
        raise PlanError(f"the registry at {shown_url(url)} lists no adapters")
    return out


def _kept_in(record) -> str | None:
    """The tier the server pins a name's serving revisions in: its pin's, else its warm policy's."""
    if record.pinned:
        return record.pin_tier or "cpu"
    return record.warm_policy if record.warm_policy in ("gpu", "cpu") else None


def fits(sizes: list[int], budget: int) -> int:
    """How many adapters fit in `budget` bytes, smallest first."""
    used = count = 0
    for size in sorted(sizes):
        if used + size > budget:
            break
        used, count = used + size, count + 1
    return count


SIZES_A_WORKLOAD = (
    "--workers, --pool, --num-adapters, --rate, --duration-s, --tenants, "
    "--registry-changes-per-s, --router, --fair-share, --kv-prefix-blocks and "
    "--system-prompt-tokens size a workload: give --workload"
)


def make_plan(
    model_dir: Path,
    registry: str | None = None,
    adapters_dir: Path | None = None,
    workload: str | None = None,
    progress=None,
    workers: int = 1,
    shape: dict | None = None,
    registry_changes_per_s: float = 0.0,
    calibration: Calibration | None = None,
    engine: str = "native",
    max_cpu_loras: int | None = None,
    pools: tuple = (),
    options: dict | None = None,
    system_prompt_tokens: int = 0,
    **capacities,
) -> Plan:
    """`capacities`: EngineConfig's max_loras, max_lora_rank, max_num_seqs, cpu_cache_bytes and
    disk_cache_bytes (serve's flags; the engine's defaults otherwise); `engine`, `max_cpu_loras`:
    serve's, for the simulations (on vllm the cpu cache is sized in adapters). With `workers`
    above 1 the workload (reshaped by `shape`, as `workload.named`) runs on that fleet at those
    capacities, in place of the one-worker sizing; with `pools` (`sim.pools.SimPool`) on those
    pools, each pool sized (`fleet_plan.size_pools`). The simulations run at `calibration`'s
    costs (the package's by default) and with `options` (`Plan.options`: the router's
    behaviour), each adapter's requests led by a system prompt of `system_prompt_tokens`."""
    sizing = (workers > 1, shape, registry_changes_per_s, pools, options, system_prompt_tokens)
    if not workload and any(sizing):
        raise PlanError(SIZES_A_WORKLOAD)
    try:
        config = ModelConfig.from_dir(model_dir)
        defaults = EngineConfig(model_dir=model_dir, **capacities)
    except (ModelConfigError, ValueError) as exc:
        raise PlanError(str(exc)) from None
    dtype = serving_dtype(config)
    nbytes = SERVING_DTYPE_BYTES[dtype]
    sizes = (
        from_registry(registry, nbytes) if registry else from_folder(adapters_dir, config, nbytes)
    )
    plan = Plan(
        str(model_dir),
        dtype,
        defaults.max_lora_rank,
        slot_bytes(config, defaults.max_lora_rank, nbytes),
        sizes,
        defaults,
        workload=workload,
        budgets=budgets_from_registry(registry) if registry else {},
        calibration=calibration or Calibration(),
        engine=engine,
        max_cpu_loras=max_cpu_loras,
        options=dict(options or {}),
    )
    if workload:
        trace = with_system_prompts(load_workload(workload, shape), system_prompt_tokens)
        with progress or contextlib.nullcontext():
            if workers > 1 or pools:
                plan.fleet = fleet_for_workload(plan, trace, workers, registry_changes_per_s, pools)
            else:
                plan.sizing = size_for_workload(plan, workload, trace, progress)
    return plan


def load_workload(workload: str, shape: dict | None = None) -> list[workloads.Request]:
    """The trace of a named workload or a file; PlanError when it cannot be read or has no requests
    (an empty trace would "reach" every target with no cache at all)."""
    try:
        trace = workloads.load(workload, **(shape or {}))
    except OSError as exc:
        raise PlanError(f"cannot read workload {workload}: {exc.strerror or exc}") from None
    except (
        ValueError
    ) as exc:  # an unknown name, or a bad trace line (the message names file and line)
        raise PlanError(str(exc)) from None
    if not trace:
        raise PlanError(f"workload {workload}: the trace has no requests to size for")
    return trace


def _sizing_base(
    plan: Plan, workload: str, trace: list[workloads.Request]
) -> tuple[SimConfig, int]:
    """The workload's default capacity as a simulator configuration, and the bytes of the distinct
    adapters its trace asks for."""
    per_rank = sum(a.serving_bytes / a.rank for a in plan.adapters) / len(plan.adapters)
    cap = workloads.default_capacity(workload)
    base = SimConfig(
        engine=plan.engine,
        gpu_slots=cap.gpu_slots,
        cpu_bytes=cap.cpu_bytes,
        disk_bytes=cap.disk_bytes,
        max_num_seqs=plan.defaults.max_num_seqs,
        bytes_per_rank=int(per_rank),
        tenant_budgets=plan.budgets,
        service=plan.calibration.service,
        costs=plan.calibration.costs,
        **plan.options,
    )
    working_set = sum(
        int(per_rank) * r.rank for r in {r.model: r for r in trace if r.adapter}.values()
    )
    return base, working_set


def size_for_workload(
    plan: Plan, workload: str, trace: list[workloads.Request], progress=None
) -> list[dict]:
    """The smallest cpu cache for each cold-start target and the smallest slot count for the
    slot-miss target, each the first size of its grid, in order, whose simulator run of the `score`
    policy meets it (runs are shared between the targets)."""
    base, working_set = _sizing_base(plan, workload, trace)
    cache: dict[tuple[int, int], dict] = {}
    task = progress.add_task("sizing", total=None) if progress else None

    vllm = plan.engine == "vllm"  # `cpu` counts adapters in vLLM's host cache, not bytes

    def run(slots: int, cpu: int) -> dict:
        if (slots, cpu) not in cache:
            held = {"max_cpu_loras": max(cpu, slots)} if vllm else {"cpu_bytes": cpu}
            sim = simulate(trace, replace(base, gpu_slots=slots, **held), policy_factory("score"))
            cache[slots, cpu] = summarize(sim)
            if progress:
                progress.update(task, description=f"sizing: {len(cache)} simulations")
        return cache[slots, cpu]

    rows = []
    grid = _cpu_grid(base.gpu_slots, trace, working_set, vllm)
    unit = "cpu_loras" if vllm else "cpu_bytes"
    for target in COLD_START_TARGETS:
        best = _smallest(
            grid, lambda cpu, target=target: run(base.gpu_slots, cpu)["cold_start_rate"] <= target
        )
        rows.append(
            {
                "what": "cpu cache",
                "target": f"cold starts ≤ {target:.0%}",
                "gpu_slots": base.gpu_slots,
                unit: best,
                "rate": None if best is None else run(base.gpu_slots, best)["cold_start_rate"],
            }
        )
        if best is None:
            largest = run(base.gpu_slots, grid[-1])["cold_start_rate"]
            largest_text = f"{grid[-1]} adapters" if vllm else _size(grid[-1])
            rows[-1]["why"] = _cold_start_floor(trace, target, largest, largest_text)
    cpu_for_slots = rows[-1][unit] if rows[-1][unit] is not None else grid[-1]
    slots_grid = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]

    slot_misses = functools.partial(_slot_misses, vllm=vllm)
    best = _smallest(slots_grid, lambda s: slot_misses(run(s, cpu_for_slots)) <= SLOT_MISS_TARGET)
    rows.append(
        {
            "what": "gpu slots",
            "target": f"slot misses ≤ {SLOT_MISS_TARGET:.0%}",
            "gpu_slots": best,
            unit: cpu_for_slots,
            "rate": None if best is None else slot_misses(run(best, cpu_for_slots)),
        }
    )
    if best is None:
        largest = slot_misses(run(slots_grid[-1], cpu_for_slots))
        rows[-1]["why"] = f"{largest:.2%} at {slots_grid[-1]} slots, the largest tried"
    return rows


def _cpu_grid(
    slots: int, trace: list[workloads.Request], working_set: int, vllm: bool
) -> list[int]:
    """The cpu cache sizes tried: bytes up to half again the workload's adapters' (vllm: adapters,
    from no place beyond the slots to half again the distinct adapters the trace asks for)."""
    fractions = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0, 1.5)
    if not vllm:
        return [0] + [int(working_set * f) for f in fractions]
    distinct = len({r.model for r in trace if r.adapter})
    return sorted({slots} | {max(slots, round(distinct * f)) for f in fractions})


def _slot_misses(figures: dict, vllm: bool) -> float:
    if not vllm:
        return figures["hit_rate"]["cpu"]
    # vLLM orders its device slots itself: the requests that had an adapter copied in
    return figures["activations"] / max(1, figures["adapter_requests"])


def _cold_start_floor(
    trace: list[workloads.Request], target: float, largest: float, size: str
) -> str:
    """Why no cpu cache meets a cold-start target: the rate at the largest size tried, and the
    floor of first requests (each adapter's first request is cold whatever the cache)."""
    requested = [r.model for r in trace if r.adapter]
    distinct = len(set(requested))
    floor = distinct / max(len(requested), 1)
    why = f"{largest:.2%} at {size}, the largest tried"
    if floor > target:
        why += (
            f"; the first request of each of its {distinct} adapters is cold whatever the "
            f"cache: {floor:.2%} at least"
        )
    return why


def _smallest(grid: list[int], ok) -> int | None:
    """The first grid value that satisfies `ok`, trying them in order: a simulated rate need not
    fall with every step of capacity (a Zipf trace's slot misses are 2.7% at 4 slots, 3.7% at 8),
    so a bisection could skip the smallest size that meets a target."""
    return next((value for value in grid if ok(value)), None)


def _adapters(n: int | None) -> str:
    return "-" if n is None else f"{n} adapters"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def tables(plan: Plan) -> list[Table]:
    out = [_sizes_table(plan), _tiers_table(plan)]
    if plan.sizing:
        out.append(_sizing_table(plan))
    if plan.fleet:
        out.append(fleet_table(plan))
    if plan.fleet and plan.fleet.get("pools"):
        out.append(pools_plan_table(plan))
    return out


def _sizes_table(plan: Plan) -> Table:
    sizes = Table(title=f"adapters for {plan.model} (serving dtype {plan.serving_dtype})")
    for col in ("adapter", "rank", "formula", "tensors", "files", "host copy", "kept in"):
        sizes.add_column(col, justify="left" if col == "adapter" else "right")
    for a in plan.adapters:
        sizes.add_row(
            a.name,
            str(a.rank),
            _size(a.estimated_bytes),
            _size(a.actual_bytes),
            _size(a.file_bytes),
            _size(a.serving_bytes),
            a.kept_in or "on demand",
        )
    return sizes


def _tiers_table(plan: Plan) -> Table:
    d = plan.defaults
    host = [a.serving_bytes for a in plan.adapters]
    disk = [a.file_bytes or a.actual_bytes for a in plan.adapters]
    over = sum(a.rank > plan.max_lora_rank for a in plan.adapters)
    kept = {tier: [a for a in plan.adapters if a.kept_in == tier] for tier in ("gpu", "cpu")}
    # Pinned in gpu: a slot each and a host copy; in cpu: a host copy.
    kept_host = sum(a.serving_bytes for a in (*kept["gpu"], *kept["cpu"]))
    tiers = Table(
        title=f"what fits (max-loras {d.max_loras}, cpu {_size(d.cpu_cache_bytes)}, "
        f"disk {_size(d.disk_cache_bytes)})"
    )
    columns = ("tier", "capacity", "per adapter", "adapters that fit", "of", "kept by pins / warm")
    for col in columns:
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    slots_kept = f"{len(kept['gpu'])} slots"
    if len(kept["gpu"]) > d.max_loras:
        slots_kept += " (more than the slots)"
    tiers.add_row(
        "gpu slots",
        f"{d.max_loras} × {_size(plan.slot_bytes)} (rank {plan.max_lora_rank})",
        _size(plan.slot_bytes),
        f"{d.max_loras} at a time" + (f"; {over} over max rank" if over else ""),
        str(len(plan.adapters)),
        slots_kept,
    )
    host_kept = _size(kept_host)
    if kept_host > d.cpu_cache_bytes:
        host_kept += " (more than the cache)"
    tiers.add_row(
        "cpu",
        _size(d.cpu_cache_bytes),
        _size(sum(host) // len(host)),
        str(fits(host, d.cpu_cache_bytes)),
        str(len(plan.adapters)),
        host_kept,
    )
    tiers.add_row(
        "disk",
        _size(d.disk_cache_bytes),
        _size(sum(disk) // len(disk)),
        str(fits(disk, d.disk_cache_bytes)),
        str(len(plan.adapters)),
        "",
    )
    return tiers


def _sizing_table(plan: Plan) -> Table:
    sizing = Table(
        title=f"smallest capacity for workload {plan.workload} (simulated, policy score, engine "
        f"{plan.engine}, max-num-seqs {plan.defaults.max_num_seqs})"
    )
    for col in ("sizing", "target", "gpu slots", "cpu cache", "rate reached"):
        sizing.add_column(col, justify="left" if col in ("sizing", "target") else "right")
    reasons = [f"{row['target']} not reached: {row['why']}" for row in plan.sizing if "why" in row]
    if reasons:
        sizing.caption = "\n".join(reasons)
    for row in plan.sizing:
        rate = "not reached" if row["rate"] is None else f"{row['rate']:.2%}"
        sizing.add_row(
            row["what"],
            row["target"],
            str(row["gpu_slots"] or "-"),
            _size(row["cpu_bytes"]) if "cpu_bytes" in row else _adapters(row["cpu_loras"]),
            rate,
        )
    return sizing
