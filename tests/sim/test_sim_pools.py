"""`simulate --pool`: the fleet as pools, routed by the router's own rules (`router.routing`): a
tenant's dedicated pool first, shared pools for the rest, a rank no pool open to the tenant serves
refused."""

import json

from typer.testing import CliRunner

from loraplex.sim.cli import app
from loraplex.sim.pools import parse_sim_pool
from loraplex.sim.report import summarize
from loraplex.sim.simulator import SimConfig, policy_factory, simulate
from loraplex.sim.workload import Request, write_trace


def _trace() -> list[Request]:
    """acme and beta, one request every 0.5 s each; beta's every fifth at rank 64."""
    out = []
    for i in range(80):
        t = i * 0.25
        if i % 2:
            out.append(Request(t, "acme", f"acme-{i % 3}", 20, 4, rank=8))
        else:
            rank = 64 if i % 10 == 0 else 8
            out.append(Request(t, "beta", f"beta-{i % 5}", 20, 4, rank=rank))
    return out


def _pools():
    return (
        parse_sim_pool("name=acme,workers=1,tenants=acme"),
        parse_sim_pool("name=shared,workers=2,max-rank=16"),
    )


def test_a_dedicated_pool_takes_its_tenant_and_no_other():
    sim = simulate(_trace(), SimConfig(gpu_slots=4, pools=_pools()), policy_factory("lru"))
    assert sim.config.workers == 3
    by_worker = {(s.req.tenant, s.worker) for s in sim.requests if s.tier != "refused"}
    assert {w for t, w in by_worker if t == "beta"} <= {1, 2}  # never acme's worker 0
    assert ("acme", 0) in by_worker
    s = summarize(sim)
    assert s["refused"] == 8  # beta's rank-64 requests: no pool open to beta serves rank 64
    assert s["pools"]["acme"]["workers"] == 1 and s["pools"]["shared"]["workers"] == 2
    served = s["pools"]["acme"]["requests"] + s["pools"]["shared"]["requests"]
    assert served == len(sim.requests) - 8
    assert s["finished"] == len(sim.requests) - 8


def test_simulate_pools_on_the_command_line(tmp_path):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out.json"
    write_trace(_trace(), trace)
    args = ["simulate", "--workload", str(trace), "--no-optimal", "--gpu-slots", "4"]
    pools = ["--pool", "name=acme,workers=1,tenants=acme", "--pool", "name=shared,workers=2"]
    result = CliRunner().invoke(app, [*args, *pools, "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "pools" in result.output and "acme" in result.output
    run = json.loads(out.read_text())["runs"][0]
    assert run["workers"] == 3
    assert [p["name"] for p in run["pools"]] == ["acme", "shared"]
    assert run["policies"]["lru"]["refused"] == 0  # the shared pool declares no max rank
    bad = CliRunner().invoke(app, [*args, "--pool", "name=a,workers=none"])
    assert bad.exit_code == 2 and "workers='none' is not a count" in bad.output


def test_a_pool_is_declared_as_the_router_declares_it():
    pool = parse_sim_pool("name=q,base-model=qwen,max-rank=16,workers=http://a:8000+http://b:8000")
    assert (pool.workers, pool.spec.base_model, pool.spec.max_rank) == (2, "qwen", 16)
    assert parse_sim_pool("name=q,workers=3").workers == 3


def _two_tenants(path, beta_per_s: float) -> None:
    """acme: 4 requests a second over two adapters; beta: `beta_per_s` over four; 100 s."""
    trace = [Request(i / 4, "acme", f"acme-{i % 2}", 32, 32, rank=8) for i in range(400)]
    step = 1 / beta_per_s
    trace += [
        Request(i * step + 0.5 * step, "beta", f"beta-{i % 4}", 32, 32, rank=8)
        for i in range(int(100 * beta_per_s))
    ]
    write_trace(sorted(trace, key=lambda r: r.time), path)


def test_plan_sizes_each_pool(llama_dir, llama_adapters, tmp_path):
    """`plan --pool`: the workload on the declared pools, and per pool the fewest workers whose
    TTFT p99 stays within twice its warm TTFT; a busier pool needs more."""
    from loraplex.sim import plan as planner

    _two_tenants(tmp_path / "trace.jsonl", beta_per_s=100)
    folder = next(iter(llama_adapters.values())).parent
    pools = (
        parse_sim_pool("name=acme,workers=2,tenants=acme"),
        parse_sim_pool("name=shared,workers=4"),
    )
    plan = planner.make_plan(
        llama_dir, adapters_dir=folder, workload=str(tmp_path / "trace.jsonl"), pools=pools
    )
    assert plan.fleet["workers"] == 6
    acme, shared = plan.fleet["pools"]
    assert (acme["pool"], acme["workers"], shared["pool"], shared["workers"]) == (
        "acme",
        2,
        "shared",
        4,
    )
    assert acme["requests"] + shared["requests"] == 400 + 10_000 and acme["refused"] == 0
    assert acme["needed"] == 1
    assert shared["needed"] is not None and shared["needed"] > acme["needed"]
    tables = planner.tables(plan)
    assert "pools: workers each needs" in str(tables[-1].title)


def test_plan_pools_need_a_workload_and_a_good_spec(llama_dir, llama_adapters):
    folder = str(next(iter(llama_adapters.values())).parent)
    args = ["plan", "--model", str(llama_dir), "--adapters", folder]
    no_workload = CliRunner().invoke(app, [*args, "--pool", "name=a,workers=1"])
    assert no_workload.exit_code == 2
    assert "--pool" in no_workload.output and "give --workload" in no_workload.output
    bad = CliRunner().invoke(app, [*args, "--workload", "zipf", "--pool", "name=a,workers=0"])
    assert bad.exit_code == 2 and "workers must be at least 1" in bad.output
