"""Settings declared once: `--print-config` round-trips, defaults < file < environment < flags,
one line naming the setting and its source for a bad value, whole option names in piped `--help`,
and docs tables that match the models."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from loraplex.cli import app
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.vllm.engine import VllmConfig
from loraplex.registry.signing import generate_keypair
from loraplex.residency.policy import ScorePolicy
from loraplex.settings import docs, schema
from loraplex.settings.fields import setting, settings_of
from loraplex.settings.serve import ServeSettings

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {d.command: d for d in docs.COMMANDS}


def _run(args, env=None):
    result = CliRunner().invoke(app, list(map(str, args)), env=env or {})
    return result.exit_code, result.stdout, result.stderr


def _config(args, env=None) -> dict:
    code, out, err = _run([*args, "--print-config"], env)
    assert code == 0, err
    return yaml.safe_load(out)


def _dirs(root: Path, *names: str) -> list[Path]:
    """Directories that exist (`--print-config` checks the paths serve would use)."""
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
    return [root / name for name in names]


def test_print_config_round_trips_through_config(tmp_path, llama_dir):
    a, b, r1, r2 = _dirs(tmp_path, "a", "b", "r1", "r2")
    public = tmp_path / "k.pub"
    public.write_bytes(generate_keypair()[1])
    args = [
        "serve", "--model", llama_dir, "--max-loras", "8", "--cpu-cache-bytes", "3GiB",
        "--lora-modules", f"a={a}", f"b={b}", "--allowed-roots", r1, r2,
        "--score-weights", "priority=2,size=0", "--trusted-key", public,
        "--no-enable-prefix-caching", "--vllm-arg=--enforce-eager", "--audit-log", "off",
        "--data-dir", tmp_path / "data", "--port", "0",
    ]  # fmt: skip
    code, first, err = _run([*args, "--print-config"])
    assert code == 0, err
    printed = yaml.safe_load(first)
    assert printed["max-loras"] == 8 and printed["cpu-cache-bytes"] == "3GiB"
    assert printed["lora-modules"] == {"a": str(a), "b": str(b)}
    assert printed["allowed-roots"] == [str(r1), str(r2)]
    assert printed["score-weights"] == {"priority": 2.0, "size": 0.0}
    assert printed["enable-prefix-caching"] is False
    assert set(printed) == {s.key for s in settings_of(ServeSettings)}
    (tmp_path / "serve.yaml").write_text(first)
    code, second, err = _run(["serve", "--config", tmp_path / "serve.yaml", "--print-config"])
    assert code == 0, err
    assert second == first
    for command, args in {
        "router": ["router", "--worker", "http://a:1", "--worker", "http://b:2"],
        "simulate": ["simulate", "--workload", "zipf,uniform", "--gpu-slots", "2,4"],
        "bench serve": ["bench", "serve", "--url", "http://x:1", "--workload", "zipf"],
    }.items():
        out = _run([*args, "--print-config"])[1]
        (tmp_path / "c.yaml").write_text(out)
        head = args[: 2 if command == "bench serve" else 1]
        assert _run([*head, "--config", tmp_path / "c.yaml", "--print-config"])[1] == out, command


def test_flags_override_the_environment_which_overrides_the_file(tmp_path, llama_dir):
    x, y = _dirs(tmp_path, "x", "y")
    public = tmp_path / "k"
    public.write_bytes(generate_keypair()[1])
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {llama_dir}\nmax-loras: 3\nmax_num_seqs: 5\nhost: 0.0.0.0\nport: 0\n"
        f"data-dir: {tmp_path / 'data'}\n"
    )
    env = {"LORAPLEX_MAX_LORAS": "5", "LORAPLEX_MAX_NUM_SEQS": "9"}
    base = ["serve", "--config", config]
    assert _config(base)["max-loras"] == 3
    both = _config(base, env)
    assert (both["max-loras"], both["max-num-seqs"], both["host"]) == (5, 9, "0.0.0.0")
    assert _config([*base, "--max-loras", "7"], env)["max-loras"] == 7
    multi = _config(
        base, {"LORAPLEX_LORA_MODULES": f"a={x} b={y}", "LORAPLEX_TRUSTED_KEY": str(public)}
    )
    assert multi["lora-modules"] == {"a": str(x), "b": str(y)}
    assert multi["trusted-key"] == [str(public)]
    assert _config(base, {"LORAPLEX_STRICT_BASE_MODEL_NAME": "yes"})["strict-base-model-name"]
    router = _config(["router"], {"LORAPLEX_ROUTER_WORKER": "http://a:1 http://b:2"})
    assert router["worker"] == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize(
    "args, env, config, message",
    [
        (["--max-loras", "x"], {}, None, "--max-loras: 'x' is not an integer"),
        (["--max-loras", "0"], {}, None, "--max-loras 0: must be at least 1"),
        ([], {"LORAPLEX_MAX_LORAS": "zero"}, None, "LORAPLEX_MAX_LORAS (environment): 'zero'"),
        (
            [],
            {"LORAPLEX_TENANT_GPU_SHARE": "2"},
            None,
            "LORAPLEX_TENANT_GPU_SHARE (environment): 2: must be a share in [0, 1]",
        ),
        ([], {}, "block-size: -1\n", "key 'block-size': -1: must be at least 1"),
        ([], {}, "eviction-policy: fifo\n", "key 'eviction-policy': fifo: use score | lru"),
        (["--cpu-cache-bytes", "lots"], {}, None, "--cpu-cache-bytes: bad size 'lots'"),
        (["--max-cpu-loras", "2", "--cpu-cache-bytes", "1GiB"], {}, None, "not both"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_setting_and_its_source(
    tmp_path, args, env, config, message
):
    extra = []
    if config is not None:
        (tmp_path / "serve.yaml").write_text(config)
        extra = ["--config", tmp_path / "serve.yaml"]
    code, out, err = _run(["serve", "--model", tmp_path, *extra, *args, "--print-config"], env)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_piped_help_names_every_option_whole_at_any_width(command):
    doc = COMMANDS[command]
    proc = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", *command.split(), "--help"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "40", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    words = set(proc.stdout.replace(",", " ").split())
    missing = [s.flag for s in settings_of(doc.model) if s.flag not in words]
    assert not missing and "--config" in words and "--print-config" in words, missing


@pytest.mark.parametrize("command", ["registry add", "registry tenant add", "demo", "registry"])
def test_piped_help_of_the_other_commands_cuts_no_option_name(command):
    proc = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", *command.split(), "--help"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "40", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0 and "--" in proc.stdout, proc.stderr
    assert "…" not in proc.stdout
    if command == "registry add":
        assert "--strict-base-model-name" in proc.stdout.split()


def test_the_docs_tables_are_the_models_and_drift_either_way_is_caught():
    assert docs.stale_guides(ROOT, write=False) == []
    guide = (ROOT / "docs/operator-guide.md").read_text()
    edited = guide.replace("| `LORAPLEX_MAX_LORAS` | 4 |", "| `LORAPLEX_MAX_LORAS` | 3 |")
    assert edited != guide and docs.render(edited, COMMANDS) == guide
    extended = dataclasses.make_dataclass(
        "Extended",
        [("max_knobs", int, setting(2, "Knobs", panel="Engine"))],
        bases=(ServeSettings,),
        frozen=True,
    )
    changed = {**COMMANDS, "serve": dataclasses.replace(COMMANDS["serve"], model=extended)}
    assert "`--max-knobs N` | `LORAPLEX_MAX_KNOBS` | 2 | Knobs |" in docs.render(guide, changed)


def test_engine_configurations_take_the_settings_under_their_names(tmp_path):
    s = ServeSettings(
        model=tmp_path,
        data_dir=tmp_path,
        max_loras=3,
        kv_cache_memory_bytes=2**20,
        tensor_parallel_size=2,
        enable_prefix_caching=False,
        vllm_arg=("--enforce-eager", "--swap-space=2"),
    )
    native = EngineConfig.from_settings(s)
    same = {f.name for f in dataclasses.fields(EngineConfig)} & set(ServeSettings.__annotations__)
    # None: the engine's own (2GiB of host cache)
    same -= {"cpu_cache_bytes"}
    assert len(same) > 15 and all(getattr(native, name) == getattr(s, name) for name in same)
    assert native.cpu_cache_bytes == 2 * 2**30 and native.disk_cache_dir == tmp_path / "cache"
    assert native.enable_prefix_caching is False
    # unset: the native engine's own default, on (vLLM keeps vLLM's)
    assert EngineConfig.from_settings(ServeSettings(model=tmp_path)).enable_prefix_caching is True
    vllm = VllmConfig.from_settings(s, "base", None)
    assert vllm.max_loras == 3
    args = vllm.vllm_args
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(2**20)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--no-enable-prefix-caching" in args and args[-3:] == (
        "--enforce-eager",
        "--swap-space",
        "2",
    )
    defaults = EngineConfig(model_dir=tmp_path)
    assert (defaults.max_loras, defaults.max_num_seqs) == (
        ServeSettings(model=tmp_path).max_loras,
        ServeSettings(model=tmp_path).max_num_seqs,
    )
    with pytest.raises(ValueError, match="max_loras 0: must be at least 1"):
        EngineConfig(model_dir=tmp_path, max_loras=0)


@pytest.mark.parametrize(
    "args, env, config, message",
    [
        (["--port", "70000"], {}, None, "--port 70000: must be in [0, 65535]"),
        ([], {"LORAPLEX_PORT": "-1"}, None, "LORAPLEX_PORT (environment): -1: must be in"),
        ([], {}, "port: 99999\n", "key 'port': 99999: must be in [0, 65535]"),
        (["--admin-port", "65536"], {}, None, "--admin-port 65536: must be in [0, 65535]"),
        (["--max-cpu-loras", "0"], {}, None, "--max-cpu-loras 0: must be at least 1"),
        (
            ["--engine", "vllm", "--cpu-cache-bytes", "1GiB"],
            {},
            None,
            "--cpu-cache-bytes: the vLLM engine counts its host cache in adapters; use "
            "--max-cpu-loras (--engine: the command line; --cpu-cache-bytes: the command line)",
        ),
        (
            [],
            {"LORAPLEX_CPU_CACHE_BYTES": "1GiB"},
            "engine: vllm\n",
            "(--engine: --config serve.yaml; --cpu-cache-bytes: LORAPLEX_CPU_CACHE_BYTES)",
        ),
        (
            ["--engine", "vllm", "--tenant-cpu-share", "0.5"],
            {},
            None,
            "--tenant-cpu-share: the vLLM engine's host cache is counted in adapters",
        ),
        (
            ["--engine", "vllm", "--max-loras", "8", "--max-cpu-loras", "4"],
            {},
            None,
            "--max-cpu-loras 4: the vLLM engine keeps at least --max-loras (8) in host memory",
        ),
        (
            ["--engine", "vllm", "--max-cpu-loras", "2"],
            {},
            None,
            "(--engine: the command line; --max-cpu-loras: the command line; "
            "--max-loras: the default)",
        ),
        (
            ["--eviction-policy", "lru", "--min-residency-s", "3"],
            {},
            None,
            "--score-weights and --min-residency-s apply to --eviction-policy score, not lru",
        ),
        (
            [],
            {},
            "max-loras: 3\nmax_loras: 5\n",
            "--config serve.yaml: keys 'max-loras' and 'max_loras' are one setting; give it once",
        ),
    ],
)
def test_print_config_refuses_what_serve_refuses_naming_the_source(
    tmp_path, monkeypatch, args, env, config, message
):
    monkeypatch.chdir(tmp_path)
    extra = []
    if config is not None:
        Path("serve.yaml").write_text(config)
        extra = ["--config", "serve.yaml"]
    for last in ("--print-config", "--data-dir=/nonexistent/x"):  # serve stops at the same line
        code, out, err = _run(["serve", "--model", tmp_path, *extra, *args, last], env)
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_print_config_shows_the_defaults_it_resolves(tmp_path, llama_dir):
    serve = ["serve", "--model", llama_dir, "--data-dir", tmp_path / "data", "--port", "0"]
    native = _config(serve)
    assert native["cpu-cache-bytes"] == "2GiB" and native["max-cpu-loras"] is None
    assert native["engine-core"] == "process"
    assert native["min-residency-s"] == ScorePolicy().min_residency_s
    vllm = _config([*serve, "--engine", "vllm", "--max-loras", "3"])
    s = ServeSettings(model=llama_dir, max_loras=3)
    assert vllm["max-cpu-loras"] == VllmConfig.from_settings(s, "b", None).host_cache_size == 12
    assert vllm["cpu-cache-bytes"] is None and vllm["engine-core"] is None
    assert _config([*serve, "--max-cpu-loras", "9"])["cpu-cache-bytes"] is None
    assert _config([*serve, "--eviction-policy", "lru"])["min-residency-s"] is None
    for printed in (native, vllm):
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(printed))
        assert _config(["serve", "--config", tmp_path / "c.yaml"]) == printed


def test_the_charts_serve_schema_is_made_from_the_settings_and_drift_is_caught(tmp_path):
    assert schema.stale_chart_schema(ROOT, write=False) == []
    assert all(schema.describable(s) for s in settings_of(ServeSettings))
    chart = tmp_path / schema.CHART_SCHEMA
    chart.parent.mkdir(parents=True)
    text = (ROOT / schema.CHART_SCHEMA).read_text()
    chart.write_text(text.replace('"minimum": 1', '"minimum": 2', 1))
    assert schema.stale_chart_schema(tmp_path, write=True) == [schema.CHART_SCHEMA]
    assert chart.read_text() == text
    serve = json.loads(text)["properties"]["worker"]["properties"]["serve"]["properties"]
    assert serve["max-loras"] == {
        "description": "Adapter slots on the device",
        "type": "integer",
        "minimum": 1,
    }
    assert serve["port"]["const"] == "the chart sets --port itself from worker.ports.http"
    assert set(serve) == {s.key for s in settings_of(ServeSettings)}


@pytest.mark.parametrize(
    "raw, message",
    [
        ("acme=0", "'acme=0': a weight must be above 0"),
        ("acme=-1", "'acme=-1': a weight must be above 0"),
        ("acme=x", "'acme=x': 'x' is not a number"),
        ("acme=inf", "'acme=inf': 'inf' is not a finite number"),
        ("=3", "'=3': expected TENANT=WEIGHT"),
        ("acme", "'acme': expected TENANT=WEIGHT"),
    ],
)
def test_router_tenant_weights_refuse_each_bad_part_in_one_line(raw, message):
    result = CliRunner().invoke(
        app, ["router", "--worker", "http://127.0.0.1:9", "--tenant-weights", raw, "--print-config"]
    )
    assert result.exit_code == 2
    assert message in result.output


def test_router_tenant_weights_read_flags_and_yaml_alike(tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"tenant-weights": {"acme": 3, "beta": 0.5}}))
    args = ["router", "--worker", "http://127.0.0.1:9", "--print-config"]
    from_flag = CliRunner().invoke(app, [*args, "--tenant-weights", "acme=3,beta=0.5"])
    from_file = CliRunner().invoke(app, [*args, "--config", str(config)])
    assert from_flag.exit_code == from_file.exit_code == 0, from_flag.output + from_file.output
    assert yaml.safe_load(from_flag.output)["tenant-weights"] == {"acme": 3.0, "beta": 0.5}
    assert yaml.safe_load(from_file.output)["tenant-weights"] == {"acme": 3.0, "beta": 0.5}
