"""Seeded request traces: arrivals, adapter popularity, rank mixes, tenants; JSONL in and out.

A trace is a list of `Request`s sorted by time. Generators are pure functions of a `WorkloadSpec`
and its seed, so the same spec always gives the same trace. Named workloads (`hot-burst`, `zipf`,
`uniform`, `diurnal`, `rollout`, and `power` for S-LoRA's sampler) carry default capacities that
make their cache pressure visible.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from loraplex.settings.sim import SHAPED, WORKLOADS

GiB = 2**30

# Ranks as S-LoRA mixes them (up to 64 here: the default max_lora_rank); a mix is {rank: weight}.
DEFAULT_RANKS = {8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0}


@dataclass(frozen=True)
class Request:
    time: float
    """Arrival, in seconds from the start of the trace."""
    tenant: str
    adapter: str | None
    """Adapter name; None asks for the base model."""
    prompt_tokens: int
    output_tokens: int
    rank: int = 16
    revision: str = "1"
    priority: int = 0
    """The tenant's priority (higher is more important)."""
    prefix: str | None = None
    """The shared prompt its prompt starts with (a system prompt), by name; None: none."""
    prefix_tokens: int = 0
    """That shared prompt's tokens, counted in `prompt_tokens`."""

    @property
    def model(self) -> str | None:
        """`name@revision`, the adapter's identity as the cache and the router see it."""
        return None if self.adapter is None else f"{self.adapter}@{self.revision}"


@dataclass(frozen=True)
class Tenant:
    name: str
    share: float = 1.0
    """Fraction of the traffic (normalised over tenants)."""
    priority: int = 0


@dataclass(frozen=True)
class Capacity:
    """Defaults for a workload; the simulate flags override them."""

    gpu_slots: int = 8
    cpu_bytes: int = 4 * GiB
    disk_bytes: int | None = None
    """None: every artifact stays on the worker's disk once fetched (a local NVMe holds the adapter
    set)."""


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "zipf"
    seed: int = 0
    duration_s: float = 900.0
    rate: float = 6.0
    """Mean arrivals per second."""
    arrival: str = "poisson"
    """poisson, or gamma (inter-arrival times with coefficient of variation `cv`)."""
    cv: float = 1.0
    num_adapters: int = 200
    popularity: str = "zipf"
    """zipf (P(k-th most popular) ∝ k^-s), power (S-LoRA's sampler with exponent α), or uniform."""
    s: float = 0.9
    alpha: float = 1.0
    ranks: dict[int, float] = field(default_factory=lambda: dict(DEFAULT_RANKS))
    """{rank: weight}; each adapter draws its rank once."""
    tenants: tuple[Tenant, ...] = (Tenant("default"),)
    prompt_tokens: tuple[int, int] = (64, 512)
    """Uniform range, inclusive (S-LoRA draws both lengths uniformly)."""
    output_tokens: tuple[int, int] = (16, 128)

    def __post_init__(self):
        if self.rate <= 0 or self.duration_s <= 0 or self.num_adapters < 1:
            raise ValueError("rate, duration_s and num_adapters must be positive")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival {self.arrival!r}: use poisson or gamma")
        if self.popularity not in ("zipf", "power", "uniform"):
            raise ValueError(f"popularity {self.popularity!r}: use zipf, power or uniform")
        if self.cv <= 0:
            raise ValueError("cv must be positive")


# -- the pieces ------------------------------------------------------------------------------------
def arrival_times(
    rng: np.random.Generator,
    rate: float,
    duration_s: float,
    arrival: str = "poisson",
    cv: float = 1.0,
) -> np.ndarray:
    """Arrival times in [0, duration_s): Poisson, or a gamma renewal process with the given CV."""
    expected = int(rate * duration_s * 1.2 + 10 * math.sqrt(rate * duration_s) + 10)
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, expected)
    else:
        shape = 1.0 / cv**2  # gamma: CV = 1/sqrt(shape); mean = shape * scale
        gaps = rng.gamma(shape, 1.0 / (rate * shape), expected)
    times = np.cumsum(gaps)
    while times[-1] < duration_s:  # rare: draw more
        more = arrival_times(rng, rate, duration_s - times[-1], arrival, cv) + times[-1]
        times = np.concatenate([times, more])
    return times[times < duration_s]


def popularity_weights(n: int, popularity: str, s: float = 0.9, alpha: float = 1.0) -> np.ndarray:
    """P(adapter i), i = 0 the most popular."""
    k = np.arange(1, n + 1, dtype=float)
    if popularity == "uniform":
        w = np.ones(n)
    elif popularity == "zipf":
        w = k**-s
    else:
        # S-LoRA's sampler: adapter floor(n · x) with x ~ numpy power(α), whose CDF is x^α, so
        # P(i) = ((i+1)/n)^α − (i/n)^α; sorted so that i = 0 is the most popular (α < 1 skews, α = 1
        # is uniform).
        w = np.sort(np.diff((np.arange(n + 1) / n) ** alpha))[::-1]
    return w / w.sum()


def draw_ranks(rng: np.random.Generator, n: int, mix: dict[int, float]) -> np.ndarray:
    ranks = np.array(sorted(mix))
    p = np.array([mix[r] for r in ranks], dtype=float)
    return rng.choice(ranks, size=n, p=p / p.sum())


def _lengths(rng: np.random.Generator, n: int, span: tuple[int, int]) -> np.ndarray:
    return rng.integers(span[0], span[1] + 1, n)


def _tenant_of(rng: np.random.Generator, n: int, tenants: tuple[Tenant, ...]) -> np.ndarray:
    p = np.array([t.share for t in tenants], dtype=float)
    return rng.choice(len(tenants), size=n, p=p / p.sum())


def generate(spec: WorkloadSpec) -> list[Request]:
    """The trace of a plain spec: arrivals × popularity × rank mix × tenants (adapters are
    tenant-owned)."""
    rng = np.random.default_rng(spec.seed)
    times = arrival_times(rng, spec.rate, spec.duration_s, spec.arrival, spec.cv)
    n = len(times)
    adapter_ranks = draw_ranks(rng, spec.num_adapters, spec.ranks)
    weights = popularity_weights(spec.num_adapters, spec.popularity, spec.s, spec.alpha)
    chosen = rng.choice(spec.num_adapters, size=n, p=weights)
    owner = _tenant_of(rng, spec.num_adapters, spec.tenants)  # each adapter belongs to one tenant
    prompts, outputs = _lengths(rng, n, spec.prompt_tokens), _lengths(rng, n, spec.output_tokens)
    width = len(str(spec.num_adapters - 1))
    out = []
    for t, a, p, o in zip(times, chosen, prompts, outputs):
        tenant = spec.tenants[owner[a]]
        out.append(
            Request(
                round(float(t), 6),
                tenant.name,
                f"{spec.name}-{a:0{width}d}",
                int(p),
                int(o),
                int(adapter_ranks[a]),
                "1",
                tenant.priority,
            )
        )
    return out


# -- the named scenarios ---------------------------------------------------------------------------
def hot_burst(
    seed: int = 0,
    num_hot: int = 4,
    num_cold: int = 200,
    rate_hot: float = 4.0,
    burst_start_s: float = 120.0,
    burst_s: float = 60.0,
    duration_s: float = 300.0,
) -> list[Request]:
    """The seed scenario: steady interactive traffic on a few hot adapters (tenant `interactive`,
    priority 1), then a batch tenant (priority 0) sweeping many cold adapters once each, short
    scoring-style requests, during [burst_start, burst_start + burst_s)."""
    rng = np.random.default_rng(seed)
    hot_times = arrival_times(rng, rate_hot, duration_s)
    hot_ranks = draw_ranks(rng, num_hot, {16: 1.0, 32: 1.0})
    out = []
    for t in hot_times:
        a = int(rng.integers(num_hot))
        out.append(
            Request(
                round(float(t), 6),
                "interactive",
                f"hot-{a}",
                int(rng.integers(64, 257)),
                int(rng.integers(16, 65)),
                int(hot_ranks[a]),
                "1",
                1,
            )
        )
    cold_times = np.sort(rng.uniform(burst_start_s, burst_start_s + burst_s, num_cold))
    cold_ranks = draw_ranks(rng, num_cold, {8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0})
    for i, t in enumerate(cold_times):
        out.append(
            Request(
                round(float(t), 6),
                "batch",
                f"cold-{i:03d}",
                int(rng.integers(128, 513)),
                int(rng.integers(8, 33)),
                int(cold_ranks[i]),
                "1",
                0,
            )
        )
    return sorted(out, key=lambda r: r.time)


def diurnal(
    seed: int = 0,
    num_adapters: int = 200,
    mean_rate: float = 6.0,
    period_s: float = 600.0,
    duration_s: float = 1200.0,
    s: float = 0.9,
    amplitude: float = 0.6,
    tenants: int = 2,
) -> list[Request]:
    """A daily cycle compressed to `period_s`: the rate swings by ±amplitude, and the popular set
    shifts from one group's adapters (day) to another's (night), so the hot set changes with the
    hour. With two tenants they are `day` and `night`; with more, each group's adapters belong to
    half of them in turn (`day-0`, `day-1`, ..., `night-0`, ...)."""
    rng = np.random.default_rng(seed)
    per_group = max(1, tenants // 2)
    peak = mean_rate * (1 + amplitude)
    # thinning of a Poisson process at the peak rate
    candidates = arrival_times(rng, peak, duration_s)
    phase = 2 * math.pi * candidates / period_s
    keep = rng.uniform(0, 1, len(candidates)) < (1 + amplitude * np.sin(phase)) / (1 + amplitude)
    times = candidates[keep]
    half = max(1, num_adapters // 2)
    ranks = draw_ranks(rng, 2 * half, DEFAULT_RANKS)
    weights = popularity_weights(half, "zipf", s)
    width = max(3, len(str(2 * half - 1)))
    # `rng.choice(half, p=weights)` made once: its CDF, searched with one uniform draw per request
    # (the same draws; a catalog of 100,000 makes the CDF per request slow)
    cdf = weights.cumsum()
    cdf /= cdf[-1]
    out = []
    for t in times:
        day = (math.sin(2 * math.pi * t / period_s) + 1) / 2  # 1 at noon, 0 at midnight
        # day traffic → the `day` tenants, night → the `night` ones
        group = 0 if rng.uniform() < 0.15 + 0.7 * day else 1
        a = int(cdf.searchsorted(rng.random(), side="right")) + group * half
        tenant = ("day", "night")[group]
        if per_group > 1:
            tenant = f"{tenant}-{a % per_group}"
        out.append(
            Request(
                round(float(t), 6),
                tenant,
                f"diurnal-{a:0{width}d}",
                int(rng.integers(64, 513)),
                int(rng.integers(16, 129)),
                int(ranks[a]),
                "1",
                0,
            )
        )
    return out


def rollout(
    seed: int = 0,
    num_adapters: int = 100,
    rate: float = 6.0,
    duration_s: float = 900.0,
    s: float = 0.9,
    rolled: int = 5,
    steps: tuple[float, ...] = (0.01, 0.1, 0.5, 1.0),
) -> list[Request]:
    """Zipf traffic; midway the `rolled` most popular adapters get revision 2, with canary weights
    stepping through `steps` (1% → 10% → 50% → 100%), sticky per request draw. Both revisions share
    the traffic while the canary runs, so the cache holds two keys per rolled name."""
    base = generate(
        WorkloadSpec(
            name="rollout",
            seed=seed,
            duration_s=duration_s,
            rate=rate,
            num_adapters=num_adapters,
            s=s,
        )
    )
    rng = np.random.default_rng(seed + 1)
    start, step_len = duration_s / 2, duration_s / 2 / len(steps)
    width = len(str(num_adapters - 1))
    rolled_names = {f"rollout-{i:0{width}d}" for i in range(rolled)}
    out = []
    for r in base:
        if r.adapter in rolled_names and r.time >= start:
            weight = steps[min(len(steps) - 1, int((r.time - start) // step_len))]
            if rng.uniform() < weight:
                r = replace(r, revision="2")
        out.append(r)
    return out


NAMED = WORKLOADS

CAPACITIES = {
    # The issue's seed scenario: 4 slots for 4 hot adapters; a small disk budget, so an adapter
    # pushed out of memory falls back to the remote store (as on a worker whose disk holds little
    # beyond the hot set).
    "hot-burst": Capacity(gpu_slots=4, cpu_bytes=2 * GiB, disk_bytes=4 * GiB),
    "zipf": Capacity(gpu_slots=16, cpu_bytes=8 * GiB, disk_bytes=None),
    "power": Capacity(gpu_slots=16, cpu_bytes=8 * GiB, disk_bytes=None),
    "uniform": Capacity(gpu_slots=16, cpu_bytes=8 * GiB, disk_bytes=None),
    "diurnal": Capacity(gpu_slots=16, cpu_bytes=8 * GiB, disk_bytes=None),
    "rollout": Capacity(gpu_slots=16, cpu_bytes=8 * GiB, disk_bytes=None),
}


def named(name: str, seed: int = 0, **shape) -> list[Request]:
    """The trace of a named workload. `shape` reshapes a generated one (`SHAPED`): num_adapters,
    rate, duration_s, tenants (each adapter one tenant's, equal shares); ValueError for another
    workload or another key."""
    if shape and name not in SHAPED:
        raise ValueError(
            f"workload {name!r} takes no --num-adapters, --rate, --duration-s or --tenants "
            f"(those reshape {', '.join(SHAPED)})"
        )
    unknown = set(shape) - {"num_adapters", "rate", "duration_s", "tenants"}
    if unknown:
        raise ValueError(f"unknown workload shape {', '.join(sorted(unknown))}")
    if name == "hot-burst":
        return hot_burst(seed)
    if name == "diurnal":
        renamed = {"rate": "mean_rate"}
        return diurnal(seed, **{renamed.get(k, k): v for k, v in shape.items()})
    if name == "rollout":
        return _with_tenants(rollout(seed, **_spec_shape(shape)), shape.get("tenants"))
    popularity = {"zipf": {"s": 0.9}, "power": {"popularity": "power", "alpha": 0.5}}
    if name in ("zipf", "power", "uniform"):
        spec = WorkloadSpec(name=name, seed=seed, **popularity.get(name, {"popularity": name}))
        spec = replace(spec, **_spec_shape(shape))
        if shape.get("tenants"):
            spec = replace(
                spec, tenants=tuple(Tenant(f"tenant-{i}") for i in range(shape["tenants"]))
            )
        return generate(spec)
    raise ValueError(f"unknown workload {name!r}: use one of {', '.join(NAMED)} or a .jsonl trace")


def _spec_shape(shape: dict) -> dict:
    return {k: v for k, v in shape.items() if k in ("num_adapters", "rate", "duration_s")}


def _with_tenants(trace: list[Request], tenants: int | None) -> list[Request]:
    """Each adapter owned by one of `tenants` tenants, in turn by its number."""
    if not tenants:
        return trace
    return [
        replace(r, tenant=f"tenant-{int(r.adapter.rsplit('-', 1)[1]) % tenants}") for r in trace
    ]


# -- JSONL -----------------------------------------------------------------------------------------
def write_trace(requests: list[Request], path: str | Path) -> None:
    """One JSON object per line; a request without a shared prompt has no `prefix` keys."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(_record(r), separators=(",", ":")) + "\n" for r in requests)


def _record(r: Request) -> dict:
    record = asdict(r)
    if r.prefix is None:
        del record["prefix"], record["prefix_tokens"]
    return record


class TraceError(ValueError):
    """A trace file cannot be read; the message names the file and the line."""


def read_trace(path: str | Path) -> list[Request]:
    """A trace written by `write_trace`, or an audit log (lines with `ts` and `request_id`).

    Raises TraceError naming the file and line of a line that is not a JSON object or lacks a number
    it needs."""
    path = Path(path)
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(
                f"{path} line {number}: not JSON ({exc.msg}, column {exc.colno})"
            ) from None
        if not isinstance(record, dict):
            raise TraceError(f"{path} line {number}: not a JSON object")
        records.append((number, record))
    is_audit = bool(records) and "ts" in records[0][1] and "request_id" in records[0][1]
    requests = []
    for number, record in records:
        try:
            request = _from_audit_line(record) if is_audit else _from_trace_line(record)
        except ValueError as exc:
            raise TraceError(f"{path} line {number}: {exc}") from None
        if request is not None:
            requests.append(request)
    if is_audit:
        return _from_zero(requests)
    return sorted(requests, key=lambda r: r.time)


def _number(record: dict, key: str, convert=float, default=None):
    """record[key] as a finite number; `default` (when given) stands for a missing, null or zero
    value. Raises ValueError naming the key, so that a bad line says what is wrong with it."""
    value = record.get(key)
    if default is not None and not value:
        value = default
    try:
        number = convert(value)
        if not math.isfinite(number):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ValueError(
            f"{key!r} is missing or not a number"
            if value is None
            else f"{key!r} is not a finite number: {value!r}"
        ) from None
    return number


def _from_trace_line(d: dict) -> Request:
    return Request(
        _number(d, "time"),
        d.get("tenant", "default"),
        d.get("adapter"),
        _number(d, "prompt_tokens", int),
        max(1, _number(d, "output_tokens", int)),
        _number(d, "rank", int, 16),
        str(d.get("revision") or "1"),
        _number(d, "priority", int, 0),
        *_prefix(d),
    )


def _prefix(d: dict) -> tuple[str | None, int]:
    """A trace line's shared prompt and its tokens (at most the prompt's)."""
    prefix = d.get("prefix")
    if prefix is None:
        return None, 0
    tokens = _number(d, "prefix_tokens", int, 0)
    if not 0 <= tokens <= _number(d, "prompt_tokens", int):
        raise ValueError(f"'prefix_tokens' must be from 0 to 'prompt_tokens': {tokens}")
    return str(prefix), tokens


def _from_audit_line(d: dict) -> Request | None:
    """The request of an audit line that was served (2xx), else None. The line's `ts` is written
    when the request ends, so the arrival is taken as ts − (ttft + tpot × (completion_tokens −
    1))."""
    if d.get("status") is not None and not 200 <= _number(d, "status", int) < 300:
        return None
    completion = _number(d, "completion_tokens", int, 0)
    elapsed_ms = _number(d, "ttft_ms", float, 0.0) + _number(d, "tpot_ms", float, 0.0) * max(
        0, completion - 1
    )
    return Request(
        _number(d, "ts") - elapsed_ms / 1000,
        d.get("tenant") or "default",
        d.get("adapter"),
        max(1, _number(d, "prompt_tokens", int, 1)),
        max(1, completion),
        _number(d, "rank", int, 16),
        str(d.get("revision") or "1"),
        0,
    )


def _from_zero(requests: list[Request]) -> list[Request]:
    """The requests sorted by arrival, shifted so that the first arrives at 0."""
    if not requests:
        return []
    start = min(r.time for r in requests)
    return sorted(
        (replace(r, time=round(r.time - start, 6)) for r in requests), key=lambda r: r.time
    )


def load(workload: str, seed: int = 0, **shape) -> list[Request]:
    """A named workload (reshaped by `shape`, as `named`), or a trace / audit log file."""
    if workload.endswith(".jsonl") or Path(workload).is_file():
        if shape:
            raise ValueError(
                f"{workload}: a trace file takes no --num-adapters, --rate, --duration-s or "
                "--tenants"
            )
        return read_trace(workload)
    return named(workload, seed, **shape)


def default_capacity(workload: str) -> Capacity:
    return CAPACITIES.get(workload, Capacity())
