"""The cache policies a simulation compares: the runtime ones (lru, score), the baselines (lfu,
gdsf) and the oracles (a0, the popularity oracle; optimal, farthest next use: references, not
policies)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Simulation = Any  # the simulator's (`simulator.Simulation`), which imports this module


def policy_factory(name: str) -> Callable[[Simulation], object]:
    """A new policy per worker cache: the runtime ones (lru, score), the baselines (lfu, gdsf), or
    the oracles (`a0`: true popularity; `optimal`: farthest next use)."""
    from loraplex.residency.policy import GDSFPolicy, LFUPolicy, make_policy
    from loraplex.sim.optimal import OraclePolicy, PopularityOracle

    if name == "optimal":
        return lambda sim: OraclePolicy(sim.next_use)
    if name == "a0":
        return lambda sim: PopularityOracle(sim.request_counts())
    if name == "lfu":
        return lambda sim: LFUPolicy()
    if name == "gdsf":
        return lambda sim: GDSFPolicy()
    make_policy(name)  # refuses an unknown name now
    return lambda sim: make_policy(name)
