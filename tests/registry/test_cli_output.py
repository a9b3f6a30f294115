"""The registry CLI for people and for pipes: piped tables keep every value whole, every listing has
--json, a read-only command never creates a database, an unknown URL scheme is one line naming the
supported ones, and an operator's `add` never records a path only their machine has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraplex.registry.cli import app

NAME = "acme-private-support-assistant"


@pytest.fixture
def data(tmp_path) -> Path:
    return tmp_path / "data"


def _cli(data: Path, *args, code: int = 0):
    result = CliRunner().invoke(app, ["--data-dir", str(data), *map(str, args)])
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    return result


@pytest.fixture
def registered(data, adapter_v1, llama_dir):
    """A registry under `data` with NAME (long enough for a terminal table to cut it) and a
    tenant, a key and an audit trail."""
    _cli(data, "init")
    _cli(data, "tenant", "add", "acme-corporation-private")
    _cli(data, "add", adapter_v1, "--name", NAME, "--tenant", "acme-corporation-private")
    _cli(data, "key", "create", "acme-corporation-private")
    return data


def _piped(data: Path, *args: str) -> list[list[str]]:
    """The command run as a real process with stdout a pipe: its lines split on tabs."""
    done = subprocess.run(
        [sys.executable, "-m", "loraplex.registry.cli", "--data-dir", str(data), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "40"},  # a narrow terminal's width: nothing is cut
    )
    assert done.returncode == 0, done.stderr
    return [line.split("\t") for line in done.stdout.splitlines()]


def test_a_piped_list_keeps_names_whole_for_grep(registered):
    rows = _piped(registered, "list")
    assert rows[0] == ["# adapters"]
    assert rows[1] == [
        "name",
        "traffic",
        "revisions",
        "owner",
        "access",
        "warm",
        "priority",
        "pinned",
    ]
    assert rows[2][:5] == [NAME, "-", "1", "acme-corporation-private", "acme-corporation-private"]


def test_a_piped_show_keeps_the_digest_date_and_headers_whole(registered):
    shown = json.loads(_cli(registered, "show", NAME, "--json").stdout)
    revision = shown["revisions"][0]
    rows = _piped(registered, "show", NAME)
    assert rows[0][0].startswith(NAME) and "owner acme-corporation-private" in rows[0][0]
    assert rows[1] == [f"# {NAME}: revisions"]
    assert rows[2] == [
        "revision",
        "status",
        "traffic %",
        "digest",
        "rank",
        "modules",
        "est. bytes",
        "created",
    ]
    assert rows[3][0] == "r1" and rows[3][3] == revision["digest"]
    assert rows[3][7] == revision["created_at"]  # ISO 8601, seconds and zone included


def test_piped_audit_tenant_and_key_tables_are_whole(registered):
    audit = _piped(registered, "audit")
    assert audit[1] == ["id", "at", "actor", "action", "target", "detail"]
    assert [r[3] for r in audit[2:]] == ["key_create", "add", "tenant_add"]
    assert audit[2][4] == "acme-corporation-private"
    assert _piped(registered, "tenant", "list")[2][0] == "acme-corporation-private"
    keys = _piped(registered, "key", "list")
    listed = json.loads(_cli(registered, "key", "list", "--json").stdout)
    assert keys[2][:3] == [listed[0]["key_id"], "acme-corporation-private", listed[0]["created_at"]]


@pytest.mark.parametrize(
    "command",
    [["list"], ["show", NAME], ["audit"], ["tenant", "list"], ["key", "list"]],
)
def test_every_listing_has_json(registered, command):
    value = json.loads(_cli(registered, *command, "--json").stdout)
    assert value  # each lists what `registered` made


@pytest.mark.parametrize(
    "command",
    [
        ["list"],
        ["show", "chat"],
        ["audit"],
        ["tenant", "list"],
        ["key", "list"],
        ["export", "k8s"],
        ["add", "DIR", "--name", "chat"],
    ],
)
def test_a_command_on_a_missing_registry_creates_nothing(tmp_path, command):
    data = tmp_path / "empty"
    data.mkdir()
    result = _cli(data, *command, code=1)
    assert result.stderr.strip() == (
        f"error: no registry at {data / 'registry.db'}: create it with `loraplex registry init` "
        "(or name one with --registry or --data-dir)"
    )
    assert list(data.iterdir()) == []
    assert not (tmp_path / "nowhere").exists()
    _cli(tmp_path / "nowhere", "list", code=1)
    assert not (tmp_path / "nowhere").exists()


def test_rollout_status_on_a_missing_registry_creates_nothing(tmp_path):
    from loraplex.cli import app as main_app

    result = CliRunner().invoke(
        main_app, ["rollout", "status", "chat", "--data-dir", str(tmp_path / "d")]
    )
    assert result.exit_code == 1
    assert result.stderr.startswith("error: no registry at ")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    "url, named",
    [
        ("mysql://root:secret@db/loras", "scheme 'mysql'"),
        ("mongodb://db/loras", "scheme 'mongodb'"),
        ("registry.db", "no scheme"),
    ],
)
def test_an_unsupported_registry_url_is_one_line_naming_the_supported_schemes(url, named):
    result = CliRunner().invoke(app, ["--registry", url, "list"])
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: unsupported registry URL ({named}): give sqlite:///FILE, postgresql://... or "
        "postgresql+psycopg://...\n"
    )
    assert "secret" not in result.stderr


def test_serve_refuses_an_unsupported_registry_url_in_one_line(llama_dir, tmp_path):
    from loraplex.cli import app as main_app

    result = CliRunner().invoke(
        main_app,
        ["serve", "--model", str(llama_dir), "--registry", "mysql://u:pw@db/x"],
    )
    assert result.exit_code == 2
    assert result.stderr == (
        "error: --registry: cannot open the registry: unsupported registry URL (scheme 'mysql'): "
        "give sqlite:///FILE, postgresql://... or postgresql+psycopg://...\n"
    )


def test_add_to_a_server_database_refuses_a_store_only_this_machine_has(
    pg_url, adapter_v1, tmp_path
):
    home_store = tmp_path / "home" / "artifacts"
    result = CliRunner().invoke(
        app,
        ["--registry", pg_url, "--data-dir", str(tmp_path / "home"), "add", str(adapter_v1)]
        + ["--name", "sql"],
    )
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: the registry is a server database, but revisions would be stored in {home_store} "
        "on this machine only, where workers cannot read them: give --storage-base with the "
        "cluster's store (oci://HOST/REPOSITORY or s3://BUCKET/PREFIX, which revisions are "
        "uploaded to), or --store DIR "
        "on a volume the workers mount at the same path\n"
    )
    assert not home_store.exists()


def test_add_to_a_server_database_with_a_store_named_records_its_path(
    pg_url, adapter_v1, llama_dir, tmp_path
):
    shared = tmp_path / "shared-volume"
    base = ["--registry", pg_url, "--store", str(shared)]
    assert CliRunner().invoke(app, [*base, "init"]).exit_code == 0
    result = CliRunner().invoke(
        app, [*base, "add", str(adapter_v1), "--name", "sql", "--base-model", str(llama_dir)]
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(CliRunner().invoke(app, [*base, "show", "sql", "--json"]).stdout)
    uri = shown["revisions"][0]["storage_uri"]
    assert uri.startswith(shared.resolve().as_uri() + "/sha256/")


def test_an_http_storage_base_says_add_copies_nothing_there(data, adapter_v1, llama_dir):
    _cli(data, "init")
    base = "https://artifacts.internal/loras"
    result = CliRunner().invoke(
        app,
        ["--data-dir", str(data), "--storage-base", base, "add", str(adapter_v1)]
        + ["--name", "sql", "--base-model", str(llama_dir)],
    )
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        f"note: add copies nothing to {base}: copy {data / 'artifacts' / 'sha256'} there "
        "before workers load these revisions\n"
    )


@pytest.mark.parametrize("base", ["ftp://files/loras", "registry.internal/loras", "oci://"])
def test_an_unsupported_storage_base_is_one_line_naming_the_supported_schemes(data, base):
    _cli(data, "init")
    result = _cli(data, "--storage-base", base, "list", code=1)
    assert result.stderr == (
        f"error: storage base {base!r}: give oci://HOST/REPOSITORY (oci+http:// for plain "
        "http) or s3://BUCKET/PREFIX, which revisions are uploaded to, or an http://, https:// or "
        "file:// URL the store's sha256/ directory is at\n"
    )
