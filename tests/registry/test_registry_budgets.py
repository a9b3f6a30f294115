"""Tenants' residency budgets in the registry: set, shown, audited, refused when bad (nothing
changes), and their columns added to a database made before them."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import create_engine, inspect
from typer.testing import CliRunner

from loraplex.registry import Registry, RegistryError
from loraplex.registry.cli import app


@pytest.fixture
def cli(tmp_path):
    runner = CliRunner()

    def run(*args: str, code: int = 0):
        result = runner.invoke(app, ["--data-dir", str(tmp_path / "data"), *map(str, args)])
        assert result.exit_code == code, (result.exit_code, result.output, result.exception)
        return result

    run("init")
    return run


def listed(cli) -> dict:
    return {
        t["name"]: (t["max_gpu_slots"], t["max_cpu_bytes"])
        for t in json.loads(cli("tenant", "list", "--json").stdout)
    }


def test_budgets_are_set_shown_cleared_and_audited(cli, tmp_path):
    out = cli("tenant", "add", "batch", "--max-gpu-slots", "2", "--max-cpu-bytes", "64MiB").stdout
    assert out.strip() == "tenant batch (priority 0, gpu slots 2, cpu bytes 64MiB)"
    cli("tenant", "add", "online")
    assert listed(cli) == {"batch": (2, 64 * 2**20), "online": (None, None)}
    cli("tenant", "set", "batch", "--max-cpu-bytes", "none")
    cli("tenant", "set", "online", "--max-gpu-slots", "0")
    assert listed(cli) == {"batch": (2, None), "online": (0, None)}
    table = cli("tenant", "list").stdout
    assert "max gpu slots" in table and "default" in table
    registry = Registry(f"sqlite:///{tmp_path}/data/registry.db")
    events = [
        (e.action, e.target, e.detail)
        for e in registry.audit_events()
        if e.action.startswith("tenant")
    ]
    assert events[:3] == [
        ("tenant_budget", "online", {"max_gpu_slots": 0}),
        ("tenant_budget", "batch", {"max_cpu_bytes": None}),
        ("tenant_add", "online", {"priority": 0}),
    ]
    registry.close()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--max-gpu-slots", "-1"), "--max-gpu-slots"),
        (("--max-gpu-slots", "2.5"), "--max-gpu-slots"),
        (("--max-cpu-bytes", "lots"), "--max-cpu-bytes"),
        (("--max-cpu-bytes", "-1MiB"), "--max-cpu-bytes"),
        (("--max-gpu-slots", "1", "--max-cpu-bytes", "x"), "--max-cpu-bytes"),
    ],
)
def test_bad_budgets_are_refused_naming_the_flag_and_change_nothing(cli, args, flag):
    cli("tenant", "add", "batch", "--max-gpu-slots", "2")
    result = cli("tenant", "set", "batch", *args, code=1)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], result.stderr
    assert listed(cli) == {"batch": (2, None)}
    assert cli("tenant", "set", "ghost", "--max-gpu-slots", "1", code=1).stderr.startswith(
        "error: unknown tenant"
    )


def test_the_api_refuses_bad_budgets_naming_the_field(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path}/registry.db")
    registry.init()
    registry.add_tenant("batch", max_gpu_slots=1)
    for budget, field in (
        ({"max_gpu_slots": -1}, "max_gpu_slots"),
        ({"max_cpu_bytes": "1GiB"}, "max_cpu_bytes"),
        ({"max_gpu_slots": True}, "max_gpu_slots"),
        ({"slots": 1}, "slots"),
    ):
        with pytest.raises(RegistryError, match=field):
            registry.set_budget("batch", **budget)
    assert [(t.max_gpu_slots, t.max_cpu_bytes) for t in registry.list_tenants()] == [(1, None)]
    registry.close()


def test_a_database_made_before_the_budget_columns_gets_them_on_open(tmp_path):
    url = f"sqlite:///{tmp_path}/registry.db"
    registry = Registry(url)
    registry.init()
    registry.add_tenant("old", priority=2)
    registry.close()
    engine = create_engine(url)
    with engine.begin() as conn:  # the table as the version before budgets made it
        conn.exec_driver_sql("ALTER TABLE tenants DROP COLUMN max_gpu_slots")
        conn.exec_driver_sql("ALTER TABLE tenants DROP COLUMN max_cpu_bytes")
    assert "max_gpu_slots" not in {c["name"] for c in inspect(engine).get_columns("tenants")}
    engine.dispose()
    registry = Registry(url)
    assert [(t.name, t.priority, t.max_gpu_slots) for t in registry.list_tenants()] == [
        ("old", 2, None)
    ]
    registry.set_budget("old", max_gpu_slots=3)
    assert registry.list_tenants()[0].max_gpu_slots == 3
    registry.close()
