"""`loraplex registry ...` through typer's CliRunner, and once as a real process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from loraplex.artifacts import ArtifactStore
from loraplex.registry import Registry
from loraplex.registry.cli import app


@pytest.fixture
def cli(tmp_path):
    """cli(*args) -> result, on a registry under tmp_path/data (the default layout of
    --data-dir)."""
    runner = CliRunner()

    def run(*args: str, ok: bool = True):
        result = runner.invoke(app, ["--data-dir", str(tmp_path / "data"), *map(str, args)])
        assert (result.exit_code == 0) == ok, (result.exit_code, result.output, result.exception)
        return result

    run("init")
    return run


def test_add_promote_rollback_and_read_back_as_json(
    cli, adapter_v1, adapter_v2, llama_dir, tmp_path
):
    added = json.loads(
        cli(
            "add",
            adapter_v1,
            "--name",
            "chat",
            "--base-model",
            llama_dir,
            "--stable",
            "--warm",
            "gpu",
            "--json",
        ).stdout
    )
    assert (added["revision"], added["status"], added["warm_policy"]) == ("r1", "stable", "gpu")
    assert (
        "added chat@r2"
        in cli("add", adapter_v2, "--name", "chat", "--base-model", llama_dir).stdout
    )
    assert cli("promote", "chat", "r2", "--weight", "10").stdout.strip() == "chat: r2 10% r1 90%"
    listed = json.loads(cli("list", "--json").stdout)
    assert [(a["name"], a["traffic"]) for a in listed] == [("chat", {"r2": 10, "r1": 90})]
    assert cli("traffic", "chat", "r1=70", "r2=30").stdout.strip() == "chat: r2 30% r1 70%"
    assert cli("rollback", "chat").stdout.strip() == "chat: r1 100%"
    shown = json.loads(cli("show", "chat", "--json").stdout)
    assert {r["revision"]: r["status"] for r in shown["revisions"]} == {
        "r1": "stable",
        "r2": "deprecated",
    }
    assert "chat: revisions" in cli("show", "chat").stdout and "chat" in cli("list").stdout
    assert cli("pin", "chat").stdout.strip() == "chat: pinned in cpu"
    assert json.loads(cli("show", "chat", "--json").stdout)["pinned"] is True
    assert cli("pin", "chat", "--tier", "gpu").stdout.strip() == "chat: pinned in gpu"
    assert json.loads(cli("show", "chat", "--json").stdout)["pin_tier"] == "gpu"
    assert "pinned in gpu" in cli("show", "chat").stdout
    refused = cli("pin", "chat", "--tier", "disk", ok=False)
    assert (
        refused.exit_code == 1
        and refused.stderr.strip() == "error: a pin's tier is gpu or cpu, not 'disk'"
    )
    cli("quarantine", "chat", "r2", "--reason", "bad outputs")
    cli("deprecate", "chat")
    actions = [e["action"] for e in json.loads(cli("audit", "--json").stdout)]
    assert actions == [
        "deprecate",
        "quarantine",
        "pin",
        "pin",
        "rollback",
        "set_traffic",
        "promote",
        "add",
        "add",
    ]
    assert "promote" in cli("audit").stdout
    # the database and the store are where --data-dir says
    registry = Registry(f"sqlite:///{tmp_path / 'data' / 'registry.db'}")
    assert registry.store.root == tmp_path / "data" / "artifacts" and registry.store.has(
        added["digest"]
    )
    registry.close()


def test_refusals_print_one_line_and_exit_1(cli, adapter_factory, llama_dir):
    biased = adapter_factory("lora-bias", lora_bias=True)
    result = cli("add", biased, "--name", "chat", "--base-model", llama_dir, ok=False)
    assert (
        result.exit_code == 1
        and result.stderr.strip()
        == "error: lora_bias: LoRA with a bias on B (lora_bias) is not supported"
    )
    assert cli("show", "nope", ok=False).stderr.strip() == "error: model 'nope' not found"
    assert "must be REV=PERCENT" in cli("traffic", "chat", "r1", ok=False).stderr


def test_keep_delete_and_gc(cli, adapter_v1, adapter_v2, adapter_v3, llama_dir, tmp_path):
    for path in (adapter_v1, adapter_v2):
        cli("add", path, "--name", "chat", "--base-model", llama_dir, "--stable", "--keep", "2")
    assert json.loads(cli("show", "chat", "--json").stdout)["keep"] == 2
    cli("add", adapter_v3, "--name", "chat", "--base-model", llama_dir)  # r3, staged
    assert "keeps the newest 2" in " ".join(cli("show", "chat").stdout.split())  # rich wraps
    refused = cli("delete", "chat", "r2", ok=False)
    assert (refused.exit_code, refused.stderr) == (
        1,
        "error: chat@r2 is the stable revision; promote another revision first\n",
    )
    assert cli("delete", "chat", "r1").stdout.strip() == "chat@r1: retired"
    assert cli("list", "--status", "retired").stdout.count("chat") == 1
    # r2 is the stable and r3 the newest: nothing more to retire until r3 is promoted
    assert cli("keep", "chat", "1").stdout.strip() == "chat: keeps the newest 1 revisions"
    cli("promote", "chat", "r3")
    assert cli("keep", "chat", "x", ok=False).stderr.strip() == (
        "error: K must be a number or none, got 'x'"
    )
    assert cli("keep", "chat", "none").stdout.strip() == "chat: keeps every revision"
    assert [
        r["revision"] for r in json.loads(cli("show", "chat", "--json").stdout)["revisions"]
    ] == ["r3"]
    shown = json.loads(cli("show", "chat", "--retired", "--json").stdout)
    statuses = {r["revision"]: r["status"] for r in shown["revisions"]}
    assert (statuses, shown["keep"]) == ({"r1": "retired", "r2": "retired", "r3": "stable"}, None)
    events = json.loads(cli("audit", "--json").stdout)
    actions = [(e["action"], e["target"]) for e in events if e["action"] != "delete_artifact"]
    assert actions[:5] == [
        ("keep", "chat"),
        ("retire", "chat@r2"),
        ("promote", "chat@r3"),
        ("keep", "chat"),
        ("delete", "chat@r1"),
    ]
    # each retirement deleted its artifact once committed: nothing is left for gc
    retired = [r["digest"] for r in shown["revisions"][:2]]
    deleted = [e["target"] for e in reversed(events) if e["action"] == "delete_artifact"]
    assert deleted == retired
    store = tmp_path / "data" / "artifacts" / "sha256"
    assert cli("gc").stdout.strip() == "removed 0 artifact(s)"
    assert [p.name for p in store.iterdir()] == [shown["revisions"][2]["digest"][7:]]


def test_tenants_and_keys(cli, tmp_path):
    assert (
        cli("tenant", "add", "acme", "--priority", "3").stdout.strip() == "tenant acme (priority 3)"
    )
    key = cli("key", "create", "acme").stdout.strip()
    registry = Registry(f"sqlite:///{tmp_path / 'data' / 'registry.db'}")
    assert registry.tenant_for_key(key) == "acme"
    keys = json.loads(cli("key", "list", "--json").stdout)
    assert [(k["key_id"], k["tenant"], k["revoked_at"]) for k in keys] == [(key[:12], "acme", None)]
    assert key not in cli("key", "list").stdout  # shown once, at creation, never again
    cli("key", "revoke", key[:12])
    assert registry.tenant_for_key(key) is None
    assert json.loads(cli("tenant", "list", "--json").stdout)[0]["priority"] == 3
    assert cli("key", "create", "ghost", ok=False).stderr.startswith(
        "error: unknown tenant 'ghost'"
    )
    registry.close()


def test_signed_registration(cli, adapter_v1, llama_dir, tmp_path):
    private, public = tmp_path / "release.pem", tmp_path / "release.pub"
    cli("keygen", private, public)
    trusted = ("--trusted-key", public)
    refused = cli(
        *trusted, "add", adapter_v1, "--name", "chat", "--base-model", llama_dir, ok=False
    )
    assert "signature: the revision is unsigned" in refused.stderr
    signature = cli("sign", adapter_v1, "--key", private).stdout.strip()
    added = json.loads(
        cli(
            *trusted,
            "add",
            adapter_v1,
            "--name",
            "chat",
            "--base-model",
            llama_dir,
            "--signature",
            signature,
            "--json",
        ).stdout
    )
    assert added["signature"] == signature
    assert cli("digest", adapter_v1).stdout.strip() == added["digest"]


def test_show_reports_canary_and_stable_from_the_audit_log(
    cli, adapter_v1, adapter_v2, llama_dir, tmp_path
):
    cli("add", adapter_v1, "--name", "chat", "--base-model", llama_dir, "--stable")
    cli("add", adapter_v2, "--name", "chat", "--base-model", llama_dir)
    cli("promote", "chat", "r2", "--weight", "10")
    log = tmp_path / "audit.jsonl"
    rows = [
        dict(
            request_id=f"r{i}",
            tenant="default",
            adapter="chat",
            revision="r1",
            digest="x",
            ttft_ms=float(10 + i),
            tpot_ms=2.0,
            status=200,
        )
        for i in range(100)
    ]
    rows += [
        dict(
            request_id=f"c{i}",
            tenant="default",
            adapter="chat",
            revision="r2",
            digest="y",
            ttft_ms=50.0,
            tpot_ms=float(i),
            status=503 if i < 3 else 200,
        )
        for i in range(10)
    ]
    rows.append(dict(request_id="o", adapter="other", revision="r1", ttft_ms=1.0, status=200))
    log.write_text("\n".join(map(json.dumps, rows)) + "\nnot json\n")
    stats = {
        s["revision"]: s
        for s in json.loads(cli("show", "chat", "--audit-log", log, "--json").stdout)["stats"]
    }
    r1, r2 = stats["r1"], stats["r2"]
    assert (r1["requests"], r1["errors"], r1["ttft_p50_ms"], r1["ttft_p99_ms"]) == (
        100,
        0,
        59.0,
        108.0,
    )
    assert (r2["requests"], r2["error_rate"], r2["tpot_p50_ms"], r2["tpot_p99_ms"]) == (
        10,
        0.3,
        4.0,
        9.0,
    )
    table = cli("show", "chat", "--audit-log", log).stdout
    assert "requests by revision" in table and "30.0%" in table


def test_default_registry_is_under_home(adapter_v1, llama_dir, tmp_path):
    runner = CliRunner(env={"HOME": str(tmp_path)})
    assert runner.invoke(app, ["init"]).exit_code == 0
    result = runner.invoke(
        app, ["add", str(adapter_v1), "--name", "chat", "--base-model", str(llama_dir)]
    )
    assert result.exit_code == 0, result.output
    data = tmp_path / ".local" / "share" / "loraplex"
    registry = Registry(f"sqlite:///{data / 'registry.db'}", ArtifactStore(data / "artifacts"))
    assert [a.name for a in registry.list_adapters()] == ["chat"]
    registry.close()


def test_real_process(cli, adapter_v1, llama_dir, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loraplex.registry.cli",
            "--data-dir",
            str(tmp_path / "data"),
            "add",
            str(adapter_v1),
            "--name",
            "chat",
            "--base-model",
            str(llama_dir),
            "--stable",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["traffic_weight"] == 100
    assert json.loads(cli("list", "--json").stdout)[0]["traffic"] == {"r1": 100}


def test_a_file_that_is_not_a_registry_is_one_line_too(tmp_path):
    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_text("not a database\n" * 100)
    result = CliRunner().invoke(app, ["--registry", f"sqlite:///{not_a_db}", "list"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: the registry database: file is not a database")
    assert len(result.stderr.strip().splitlines()) == 1


def test_add_of_an_adapter_naming_another_base_model_warns_unless_strict(
    cli, adapter_v1, llama_dir, tmp_path
):
    hub_named = tmp_path / "hub-named"
    shutil.copytree(adapter_v1, hub_named)
    config = json.loads((hub_named / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"
    (hub_named / "adapter_config.json").write_text(json.dumps(config))
    command = [
        sys.executable,
        "-m",
        "loraplex.registry.cli",
        "--data-dir",
        str(tmp_path / "data"),
        "add",
        str(hub_named),
        "--name",
        "chat",
        "--base-model",
        str(llama_dir),
    ]
    strict = subprocess.run(
        [*command, "--strict-base-model-name"], capture_output=True, text=True, timeout=120
    )
    assert strict.returncode == 1 and len(strict.stderr.strip().splitlines()) == 1, strict.stderr
    assert strict.stderr.startswith(
        "error: base_model_name_or_path: the adapter was trained on "
        "'meta-llama/Llama-3.1-8B-Instruct'"
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "added chat@r1" in done.stdout, done.stderr
    assert "trained on 'meta-llama/Llama-3.1-8B-Instruct'" in done.stderr
    assert "--strict-base-model-name" in done.stderr
