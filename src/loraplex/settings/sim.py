"""`loraplex simulate`'s and `loraplex plan`'s settings, declared once (flags, `--config` keys,
`LORAPLEX_SIMULATE_*` / `LORAPLEX_PLAN_*` variables, docs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.settings.fields import at_least, check_fields, positive, setting, weights
from loraplex.settings.router import DEFAULTS as ROUTER
from loraplex.settings.router import POLICIES as ROUTER_POLICIES
from loraplex.settings.serve import DEFAULTS as SERVE
from loraplex.settings.serve_values import HOST_CACHE_BYTES, VLLM_HOST_CACHE_PER_SLOT
from loraplex.units import format_size, parse_size

SIMULATE_ENV, PLAN_ENV = "LORAPLEX_SIMULATE_", "LORAPLEX_PLAN_"
POLICIES = ("lru", "lfu", "gdsf", "score", "a0")
PLOT_FORMATS = (".png", ".svg", ".pdf")
"""The `--plot` files' formats (matplotlib's, by the file's suffix)."""
PLOT_FORMATS_TEXT = "use a .png, .svg or .pdf file"
WORKLOADS = ("hot-burst", "zipf", "uniform", "diurnal", "rollout", "power")
"""The named workloads `simulate`, `plan` and `bench serve` generate (`loraplex.sim.workload`)."""


def comma_list(item=str):
    """A reader of `a,b,c` (repeatable flags, a variable, or a YAML list) into a tuple of items."""

    def parse(raw: Any) -> tuple:
        parts = raw if isinstance(raw, list | tuple) else [raw]
        texts = [p.strip() for part in parts for p in str(part).split(",") if p.strip()]
        return tuple(item(t) for t in texts)

    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{value}: must be at least 1")
    return value


def _policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: use {', '.join(POLICIES)}")
    return name


def _joined(values: tuple) -> str:
    return ",".join(map(str, values))


SHAPED = ("zipf", "uniform", "power", "diurnal", "rollout")
"""The named workloads that --num-adapters, --rate, --duration-s and --tenants reshape."""


def _pool():
    return setting(
        (),
        "A pool of the fleet, as the router's --pool: name=N,workers=COUNT (or URL1+URL2: their "
        "count)[,max-rank=R][,tenants=T1+T2] (no tenants: shared); repeat per pool; the workers "
        "are the pools' (not --workers)",
        metavar="name=N,workers=COUNT,...",
    )


def _num_adapters() -> Any:
    return setting(
        None,
        "Adapters in the catalog of a generated workload (" + ", ".join(SHAPED) + ")",
        metavar="N",
        check=at_least(1),
        default_text="the workload's own",
    )


def _rate() -> Any:
    return setting(
        None,
        "Mean requests per second of a generated workload",
        metavar="R",
        check=positive,
        default_text="the workload's own",
    )


def _duration_s() -> Any:
    return setting(
        None,
        "Seconds of traffic of a generated workload",
        metavar="S",
        check=positive,
        default_text="the workload's own",
    )


def _tenants() -> Any:
    return setting(
        None,
        "Tenants owning a generated workload's adapters (each adapter one tenant's, equal shares)",
        metavar="N",
        check=at_least(1),
        default_text="the workload's own",
    )


def _registry_changes_per_s() -> Any:
    return setting(
        0.0,
        "Registry changes per second (promotions, traffic, quarantines), each to an adapter drawn "
        "by its traffic: notified to every worker, resolved again on its next request there",
        metavar="R",
        check=at_least(0),
    )


def _calibration() -> Any:
    return setting(
        None,
        "JSON file of load costs per tier and engine step costs (docs/capacity-planning.md, "
        "Calibration)",
        metavar="FILE",
        default_text="the package's",
    )


def _router() -> Any:
    return setting(
        "affinity",
        "The router's picker policy, as `loraplex router --policy`: " + ", ".join(ROUTER_POLICIES),
        choices=ROUTER_POLICIES,
    )


def _fair_share() -> Any:
    return setting(
        False,
        "Requests no worker has room for wait at the router in per-tenant queues, granted in "
        "weighted fair order, with places held back for tenants under their share, as the "
        "router's fair share (native engine; simulate: --routing router)",
    )


def _tenant_weights() -> Any:
    return setting(
        (),
        "Tenants' weights in the fair share: TENANT=W,...",
        metavar="TENANT=W,...",
        parse=weights(None, label="TENANT", above=0.0),
        show=dict,
        default_text="each 1",
    )


def _holdback_window_s() -> Any:
    return setting(
        ROUTER.holdback_window_s,
        "With --fair-share: keep places free for another tenant whose request arrived within "
        "this many seconds, as `loraplex router --holdback-window-s` (0: off)",
        metavar="S",
        check=at_least(0),
    )


def _kv_prefix_blocks() -> Any:
    return setting(
        0,
        "Each worker's KV cache for prompt prefixes, in 16-token blocks, and the router's prefix "
        "index at that size: prefix-aware routing and the prefix-cache hit rate (0: off)",
        metavar="N",
        check=at_least(0),
    )


def _system_prompt_tokens() -> Any:
    return setting(
        0,
        "Each adapter's requests start with its own system prompt of this many tokens (a "
        "base-model request: its tenant's), added to their prompts",
        metavar="N",
        check=at_least(0),
    )


def _max_num_seqs() -> Any:
    return setting(
        SERVE.max_num_seqs,
        "Sequences in each worker's running batch, as `loraplex serve --max-num-seqs`",
        metavar="N",
        check=at_least(1),
        doc="sequences in each simulated worker's running batch, as `loraplex serve "
        "--max-num-seqs`: a worker runs at most this many requests at once, the rest wait in its "
        "queue (and the router counts this many places per worker)",
    )


def workload_shape(s: SimulateSettings | PlanSettings) -> dict[str, Any]:
    """The reshaping of a generated workload that the settings give: {field: value} of those
    set."""
    names = ("num_adapters", "rate", "duration_s", "tenants")
    return {n: getattr(s, n) for n in names if getattr(s, n) is not None}


@dataclass(frozen=True)
class SimulateSettings:
    workload: tuple[str, ...] = setting(
        (),
        "Named workloads (" + ", ".join(WORKLOADS) + "), comma-separated, or trace / audit log "
        ".jsonl files",
        metavar="NAME|FILE,...",
        parse=comma_list(),
        show=_joined,
        default_text="required",
    )
    policy: tuple[str, ...] = setting(
        ("lru", "score"),
        f"Comma-separated policies: {', '.join(POLICIES)}",
        metavar="NAME,...",
        parse=comma_list(_policy),
        show=_joined,
    )
    gpu_slots: tuple[int, ...] = setting(
        (),
        "Slots per worker; a comma list sweeps",
        metavar="N,...",
        parse=comma_list(_positive_int),
        show=_joined,
        default_text="each workload's own",
    )
    cpu_bytes: tuple[int, ...] = setting(
        (),
        "Host cache per worker (4GiB); a comma list sweeps",
        metavar="SIZE,...",
        parse=comma_list(parse_size),
        show=lambda sizes: ",".join(map(format_size, sizes)),
        default_text="each workload's own",
    )
    workers: int = setting(1, "Workers behind the router's affinity picker", check=at_least(1))
    pool: tuple[str, ...] = _pool()
    engine: str = setting(
        "native",
        "Whose residency and scheduling each worker runs: native | vllm (vLLM's host cache of "
        "--max-cpu-loras adapters and its device slots)",
        choices=("native", "vllm"),
    )
    routing: str = setting(
        "router",
        "Who routes: router (the router's picker) | controller (the router honouring the "
        "placement controller's placements) | epp (an emulation of the llm-d EPP's default "
        "scorers); controller and epp: one pool, native engine",
        choices=("router", "controller", "epp"),
    )
    max_cpu_loras: int | None = setting(
        None,
        "Adapters in host memory at most (the vLLM engine's host cache)",
        check=at_least(1),
        default_text=f"vllm: {VLLM_HOST_CACHE_PER_SLOT} × slots",
    )
    max_num_seqs: int = _max_num_seqs()
    json: Path | None = setting(
        None, "Write every run: one entry per policy plus optimal", metavar="FILE"
    )
    plot: Path | None = setting(
        None,
        "Plot of hit rate and p99 TTFT against capacity: a .png, .svg or .pdf file",
        metavar="FILE",
        check=lambda path: None if path.suffix.lower() in PLOT_FORMATS else PLOT_FORMATS_TEXT,
    )
    wide: bool = setting(False, "Every column (about 200 wide) and the per-tenant table")
    tenant_budget: tuple[str, ...] = setting(
        (),
        "TENANT=SLOTS[:SIZE] (or TENANT=:SIZE): a tenant's residency budget; repeat per tenant",
        metavar="TENANT=SLOTS[:SIZE]",
    )
    optimal: bool = setting(
        True, "Also run the farthest-next-use oracle and the lower bound (slow on long traces)"
    )
    num_adapters: int | None = _num_adapters()
    rate: float | None = _rate()
    duration_s: float | None = _duration_s()
    tenants: int | None = _tenants()
    registry_changes_per_s: float = _registry_changes_per_s()
    calibration: Path | None = _calibration()
    router: str = _router()
    fair_share: bool = _fair_share()
    tenant_weights: tuple[tuple[str, float], ...] = _tenant_weights()
    holdback_window_s: float = _holdback_window_s()
    kv_prefix_blocks: int = _kv_prefix_blocks()
    system_prompt_tokens: int = _system_prompt_tokens()

    def __post_init__(self):
        check_fields(self, SimulateSettings)
        if not self.workload:
            raise ValueError("--workload is required")


@dataclass(frozen=True)
class PlanSettings:
    model: Path = setting(help="The base model directory (its config.json)", metavar="DIR")
    registry: str | None = setting(
        None, "Registry URL (sqlite:///... or postgresql://...)", metavar="URL"
    )
    adapters: Path | None = setting(None, "A folder of PEFT adapter directories", metavar="DIR")
    workload: str | None = setting(
        None, "Size the cache for this workload (name or .jsonl)", metavar="NAME|FILE"
    )
    max_loras: int = setting(SERVE.max_loras, "Slots, as serve's", check=at_least(1))
    max_lora_rank: int = setting(SERVE.max_lora_rank, "As serve's", check=at_least(1))
    max_num_seqs: int = _max_num_seqs()
    cpu_cache_bytes: int = setting(HOST_CACHE_BYTES, "As serve's", unit="size")
    disk_cache_bytes: int = setting(SERVE.disk_cache_bytes, "As serve's", unit="size")
    engine: str = setting(
        "native",
        "As serve's: whose residency the simulations run (vllm: the cpu cache is sized in "
        "adapters, vLLM's --max-cpu-loras)",
        choices=("native", "vllm"),
    )
    max_cpu_loras: int | None = setting(
        None,
        "vllm, with --workers: the host cache in adapters, as serve's",
        check=at_least(1),
        default_text=f"vllm: {VLLM_HOST_CACHE_PER_SLOT} × slots",
    )
    workers: int = setting(
        1,
        "Workers behind the router: above 1, the workload runs on a fleet at these capacities "
        "(hit rates, cold starts, registry load) in place of the one-worker sizing",
        check=at_least(1),
    )
    pool: tuple[str, ...] = _pool()
    num_adapters: int | None = _num_adapters()
    rate: float | None = _rate()
    duration_s: float | None = _duration_s()
    tenants: int | None = _tenants()
    registry_changes_per_s: float = _registry_changes_per_s()
    calibration: Path | None = _calibration()
    router: str = _router()
    fair_share: bool = _fair_share()
    tenant_weights: tuple[tuple[str, float], ...] = _tenant_weights()
    holdback_window_s: float = _holdback_window_s()
    kv_prefix_blocks: int = _kv_prefix_blocks()
    system_prompt_tokens: int = _system_prompt_tokens()

    def __post_init__(self):
        check_fields(self, PlanSettings)
        if (self.registry is None) == (self.adapters is None):
            raise ValueError("give one of --registry or --adapters")
