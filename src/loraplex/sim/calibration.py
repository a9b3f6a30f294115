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

from loraplex.sim.simulator import LoadCosts, ServiceModel, TierCost

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
