"""The chart's placement controller and pool roles, rendered by Helm's own engine: the controller
gets the groups as `--pool`s on the workers' admin port (read back by `loraplex placement`
itself), the router's pools carry their roles, and each worker's preStop hook drains it."""

from __future__ import annotations

import copy

import pytest
import yaml
from test_chart_groups import GROUPS, _args, _objects, _render, _router_config
from typer.testing import CliRunner

from loraplex.cli import app


def _values() -> dict:
    values = copy.deepcopy(GROUPS)
    values["workerGroups"][0]["role"] = "warm"
    values["workerGroups"][1]["role"] = "canary"
    values["placement"] = {"enabled": True, "drainTimeoutSeconds": 40}
    return values


def _workers(objects: list[dict]) -> list[dict]:
    workers = [o for n, o in _objects(objects, "StatefulSet").items() if "-worker-" in n]
    assert len(workers) == len(GROUPS["workerGroups"])
    return workers


def test_the_controller_gets_every_group_on_the_admin_port_and_reads_it_back(tmp_path):
    objects = _render(_values())
    (tmp_path / "token").write_text("admin-token\n")
    args = [
        a.replace("$(LORAPLEX_REGISTRY_URL)", "postgresql://registry/loraplex").replace(
            "/var/run/secrets/loraplex-admin/token", str(tmp_path / "token")
        )
        for a in _args(_objects(objects, "Deployment")["lp-placement"])
    ]
    done = CliRunner().invoke(app, ["placement", *args, "--print-config"])
    assert done.exit_code == 0, done.output
    config = yaml.safe_load(done.stdout)
    pools = {p["name"]: p for p in config["pool"]}
    assert (pools["gold"]["role"], pools["shared"]["role"]) == ("warm", "canary")
    assert "role" not in pools["qwen"]
    assert pools["shared"]["workers"] == [
        "http://lp-worker-shared-0.lp-worker-shared-pods.ml.svc:8001"
    ]
    assert (config["interval-s"], config["metrics-port"]) == (10, 9100)


def test_the_routers_pools_carry_their_roles(tmp_path):
    config = _router_config(_render(_values()), tmp_path)
    roles = {p["name"]: p.get("role") for p in config["pool"]}
    assert roles == {"gold": "warm", "shared": "canary", "qwen": None}


def test_each_worker_drains_before_it_stops():
    for worker in _workers(_render(_values())):
        spec = worker["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] == 45 + 40
        hook = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert hook == [
            "loraplex",
            "drain",
            "--url=http://127.0.0.1:8001",
            "--admin-token-file=/var/run/secrets/loraplex-admin/token",
            "--timeout=40",
        ]


def test_without_placement_no_hook_and_without_the_router_no_controller():
    for worker in _workers(_render(GROUPS)):
        spec = worker["spec"]["template"]["spec"]
        assert "lifecycle" not in spec["containers"][0]
        assert spec["terminationGracePeriodSeconds"] == 45
    with pytest.raises(Exception, match="placement.enabled needs router.enabled"):
        _render({"placement": {"enabled": True}})
    with pytest.raises(Exception, match="role"):
        _render({**GROUPS, "workerGroups": [{**GROUPS["workerGroups"][1], "role": "gold"}]})
