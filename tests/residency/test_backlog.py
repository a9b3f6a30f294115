"""A backlog of waiting requests whose adapters do not all fit in host memory, on the real cache
(simulated)."""

import pytest

from loraplex.sim import workload as W
from loraplex.sim.simulator import SimConfig, policy_factory, simulate


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_a_backlog_wider_than_host_memory_does_not_load_adapters_over_and_over(policy):
    """The seed scenario on one slot: requests of many adapters wait, and their host copies do not
    all fit in the 2 GiB host cache. A load that pushed out another waiting request's copy made that
    one load again, and so on:
    10,268 (lru) and 48,486 (score) disk loads for 1,365 requests. Loads now wait for room, so each
    request costs at most about one."""
    trace = W.load("hot-burst")
    cap = W.default_capacity("hot-burst")
    sim = simulate(
        trace,
        SimConfig(gpu_slots=1, cpu_bytes=cap.cpu_bytes, disk_bytes=cap.disk_bytes),
        policy_factory(policy),
    )
    assert sim.finished == len(trace)
    loads = sum(sim.workers[0].loads.values())
    assert loads < len(trace), dict(sim.workers[0].loads)
