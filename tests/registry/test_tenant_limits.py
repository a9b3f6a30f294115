"""Tenant request limits: registry fields set by `tenant add`, shown by `tenant list`, audited, and
added to a registry made before the columns existed."""

import json
import sqlite3

import pytest
from typer.testing import CliRunner

from loraplex.registry import Registry
from loraplex.registry.cli import app


@pytest.fixture
def cli(tmp_path):
    """cli(*args) -> result, on a registry under tmp_path/data."""
    runner = CliRunner()

    def run(*args: str, ok: bool = True):
        result = runner.invoke(app, ["--data-dir", str(tmp_path / "data"), *map(str, args)])
        assert (result.exit_code == 0) == ok, (result.exit_code, result.output, result.exception)
        return result

    run("init")
    return run


def test_tenant_limits_are_set_listed_and_audited(cli, tmp_path):
    added = cli(
        "tenant",
        "add",
        "acme",
        "--priority",
        "2",
        "--max-concurrent-requests",
        "8",
        "--max-waiting",
        "16",
    ).stdout.strip()
    assert added == "tenant acme (priority 2, max concurrent requests 8, max waiting 16)"
    cli("tenant", "add", "beta")
    rows = {t["name"]: t for t in json.loads(cli("tenant", "list", "--json").stdout)}
    assert (rows["acme"]["max_concurrent_requests"], rows["acme"]["max_waiting"]) == (8, 16)
    assert (rows["beta"]["max_concurrent_requests"], rows["beta"]["max_waiting"]) == (None, None)
    assert "default" in cli("tenant", "list").stdout
    # 0 gives the limit back to the server; a negative one is refused
    cli("tenant", "add", "acme", "--priority", "2", "--max-waiting", "0")
    acme = json.loads(cli("tenant", "list", "--json").stdout)[0]
    assert (acme["max_concurrent_requests"], acme["max_waiting"]) == (8, None)
    refused = cli("tenant", "add", "acme", "--max-concurrent-requests", "-1", ok=False)
    assert refused.stderr.strip().startswith("error: max_concurrent_requests -1: give at least 1")
    registry = Registry(f"sqlite:///{tmp_path / 'data' / 'registry.db'}")
    events = [(e.action, e.detail) for e in registry.audit_events() if e.action == "tenant_limits"]
    registry.close()
    assert events == [
        ("tenant_limits", {"max_waiting": None}),  # the newest first
        ("tenant_limits", {"max_concurrent_requests": 8, "max_waiting": 16}),
    ]
    # refused: no change
    assert json.loads(cli("tenant", "list", "--json").stdout)[0]["priority"] == 2


def test_a_registry_made_before_the_limit_columns_gains_them_on_open(tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    registry = Registry(url)
    registry.init()
    registry.add_tenant("acme", 3)
    registry.close()
    with sqlite3.connect(tmp_path / "registry.db") as conn:  # the table as an older version made it
        conn.execute("ALTER TABLE tenants DROP COLUMN max_concurrent_requests")
        conn.execute("ALTER TABLE tenants DROP COLUMN max_waiting")
    registry = Registry(url)
    assert [(t.name, t.priority, t.max_waiting) for t in registry.list_tenants()] == [
        ("acme", 3, None)
    ]
    assert registry.set_tenant_limits("acme", max_waiting=4).max_waiting == 4
    registry.close()
