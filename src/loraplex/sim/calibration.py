"""The simulator's calibration: what an adapter's load costs per tier (`LoadCosts`) and what an
engine step costs (`ServiceModel`). The defaults are those classes' own; `simulate --calibration
FILE` and `plan --calibration FILE` replace any of them with a JSON file of the shape
`Calibration.to_dict` writes (docs/capacity-planning.md, "Calibration")."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TierCost:
    latency_s: float
    """Fixed cost of one transfer."""
    bandwidth: float
    """Bytes per second."""

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class LoadCosts:
    """What bringing an adapter up one tier costs: remote → disk (download), disk → cpu (read,
    digest check, pack), cpu → gpu (host-to-device copy into a slot)."""

    remote: TierCost = TierCost(0.050, 200e6)
    disk: TierCost = TierCost(0.005, 2e9)
    h2d: TierCost = TierCost(0.0005, 12e9)
    source: str = "defaults"

    def to_dict(self) -> dict:
        return {
            **{
                t: {"latency_s": c.latency_s, "bandwidth_bytes_per_s": c.bandwidth}
                for t, c in (("remote", self.remote), ("disk", self.disk), ("h2d", self.h2d))
            },
            "source": self.source,
        }


@dataclass(frozen=True)
class ServiceModel:
    """Seconds of one engine step: a fixed part (reading the weights), per decoding sequence, per
    prefill token, and per distinct adapter in the batch (the grouped LoRA kernels), plus any
    host-to-device copies the step made.

    Defaults are a 7B model in bfloat16 on one data-center GPU: ~10 ms per decode step at small
    batch, ~16k prefill tokens/s, and a small per-adapter cost."""

    step_s: float = 0.010
    per_decode_s: float = 1.2e-4
    per_prefill_token_s: float = 6e-5
    per_adapter_s: float = 3e-4
    source: str = "defaults"

    def step_seconds(self, prefill_tokens: int, decodes: int, adapters: int) -> float:
        return (
            self.step_s
            + self.per_decode_s * decodes
            + self.per_prefill_token_s * prefill_tokens
            + self.per_adapter_s * adapters
        )

    @classmethod
    def from_engine_throughput(cls, path: str | Path) -> ServiceModel:
        """Calibrate from `bench/engine_throughput.py` JSON: the base-only row's time per output
        token gives the step cost, its total time the prefill cost, and the many-adapter row the
        per-adapter cost."""
        data = json.loads(Path(path).read_text())
        rows = {
            r["workload"]["num_adapters"]: r
            for r in data["rows"]
            if r.get("workload", {}).get("lora_bytes_per_step") is None
        }
        base = rows[0]
        w = base["workload"]
        tpot = base["ours"]["tpot_by_rank_s"]["base"]
        batch = min(w["num_requests"], 64)
        decode_total = tpot * (w["output_len"] - 1) * math.ceil(w["num_requests"] / batch)
        prefill_total = max(0.0, base["ours"]["seconds"] - decode_total)
        per_prefill = prefill_total / (w["num_requests"] * w["prompt_len"])
        many = max(rows)
        per_adapter = 0.0
        if many > 0:
            tpots = rows[many]["ours"]["tpot_by_rank_s"].values()
            per_adapter = max(0.0, (sum(tpots) / len(tpots) - tpot) / min(many, batch))
        return cls(
            step_s=tpot,
            per_decode_s=0.0,
            per_prefill_token_s=per_prefill,
            per_adapter_s=per_adapter,
            source=str(path),
        )


LOAD_STEPS = ("remote", "disk", "h2d")
"""`LoadCosts`'s fields: a download, a read into host memory, a copy into a slot."""
TIER_KEYS = ("latency_s", "bandwidth_bytes_per_s")
SERVICE_KEYS = tuple(f.name for f in fields(ServiceModel) if f.name != "source")
POSITIVE = ("bandwidth_bytes_per_s", "step_s")
"""Figures that must be above 0 (a divisor, and the step that moves the simulated clock); the
others may be 0."""


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Calibration:
    costs: LoadCosts = field(default_factory=LoadCosts)
    service: ServiceModel = field(default_factory=ServiceModel)

    def to_dict(self) -> dict[str, Any]:
        """The calibration file's form."""
        costs = {step: _tier_dict(getattr(self.costs, step)) for step in LOAD_STEPS}
        service = {k: getattr(self.service, k) for k in SERVICE_KEYS}
        return {"costs": costs, "service": service}


def _tier_dict(cost: TierCost) -> dict[str, float]:
    return {"latency_s": cost.latency_s, "bandwidth_bytes_per_s": cost.bandwidth}


def read_calibration(path: Path | None) -> Calibration:
    """The file's calibration, each figure it leaves out the default's; the defaults for None."""
    if path is None:
        return Calibration()
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CalibrationError(f"--calibration {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise CalibrationError(f"--calibration {path}: not JSON: {exc}") from None
    try:
        return _from_dict(data, str(path))
    except ValueError as exc:
        raise CalibrationError(f"--calibration {path}: {exc}") from None


def _from_dict(data: Any, source: str) -> Calibration:
    default = Calibration().to_dict()
    top = _object(data, ("costs", "service"), "the file")
    costs = _object(top.get("costs", {}), LOAD_STEPS, "costs")
    tiers = {}
    for step in LOAD_STEPS:
        where = f"costs.{step}"
        given = _object(costs.get(step, {}), TIER_KEYS, where)
        figures = {k: _figure(given, k, d, where) for k, d in default["costs"][step].items()}
        tiers[step] = TierCost(figures["latency_s"], figures["bandwidth_bytes_per_s"])
    given = _object(top.get("service", {}), SERVICE_KEYS, "service")
    service = {k: _figure(given, k, d, "service") for k, d in default["service"].items()}
    return Calibration(LoadCosts(**tiers, source=source), ServiceModel(**service, source=source))


def _object(value: Any, allowed: tuple[str, ...], where: str) -> dict:
    """`value`, checked to be an object whose keys are among `allowed`."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(allowed)})")
    return value


def _figure(given: dict, key: str, default: float, where: str) -> float:
    """`given[key]` checked, or `default` when it is left out."""
    if key not in given:
        return default
    value = given[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}.{key}: {value!r} is not a number")
    if key in POSITIVE and value <= 0:
        raise ValueError(f"{where}.{key}: {value!r} must be above 0")
    if value < 0:
        raise ValueError(f"{where}.{key}: {value!r} must be at least 0")
    return float(value)
