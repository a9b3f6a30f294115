"""The simulator applies the tenants' residency budgets as the server does: a sweeping tenant held
to one slot leaves the steady tenant's adapters on the device, waits instead, and every request
still finishes."""

from loraplex.residency.budgets import Budget
from loraplex.sim import workload as W
from loraplex.sim.report import hot_adapters, summarize
from loraplex.sim.simulator import SimConfig, policy_factory, simulate

GiB = 2**30


def two_tenants() -> list[W.Request]:
    """`online` on 3 hot adapters, 8 requests a second for 20 s; at 5 s `batch` sweeps 40 adapters
    within a second."""
    trace = [W.Request(i / 8, "online", f"hot-{i % 3}", 64, 8) for i in range(160)]
    trace += [W.Request(5 + i / 40, "batch", f"sweep-{i:02d}", 64, 8) for i in range(40)]
    return sorted(trace, key=lambda r: r.time)


def run(budgets: dict[str, Budget] | None) -> dict:
    trace = two_tenants()
    config = SimConfig(gpu_slots=4, cpu_bytes=2 * GiB, tenant_budgets=budgets)
    return summarize(simulate(trace, config, policy_factory("lru")), hot_adapters(trace, 3))


def test_a_budget_keeps_the_hot_adapters_on_the_device_through_a_sweep():
    free, held = run(None), run({"batch": Budget(gpu_slots=1)})
    assert free["finished"] == held["finished"] == 200
    assert held["tenants"]["batch"]["budget_waits"] > 0 == free["tenants"]["batch"]["budget_waits"]
    assert held["tenants"]["online"]["budget_waits"] == 0
    online_free, online_held = free["tenants"]["online"], held["tenants"]["online"]
    assert online_held["gpu_hit_rate"] > online_free["gpu_hit_rate"]


def test_a_budget_beyond_the_capacity_is_capped_at_it():
    config = SimConfig(gpu_slots=4, cpu_bytes=GiB, tenant_budgets={"t": Budget(9, 2 * GiB)})
    assert config.budgets().limit("t", "gpu") == 4 and config.budgets().limit("t", "cpu") == GiB


def test_plan_reads_the_registry_tenants_budgets(tmp_path):
    from loraplex.registry import Registry
    from loraplex.sim.plan import budgets_from_registry

    url = f"sqlite:///{tmp_path}/registry.db"
    registry = Registry(url)
    registry.init()
    registry.add_tenant("batch", max_gpu_slots=2, max_cpu_bytes=GiB)
    registry.add_tenant("online")
    registry.close()
    assert budgets_from_registry(url) == {"batch": Budget(2, GiB)}
