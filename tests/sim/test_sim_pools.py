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
