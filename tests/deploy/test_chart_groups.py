"""The chart's worker groups, rendered by Helm's own engine (helm-python-sdk, offline): a
Deployment or StatefulSet per group with its own base model, rank and settings, one InferencePool
and Endpoint Picker per base model, the router's `--pool` flags read back by `loraplex router`
itself, each group's HorizontalPodAutoscaler or KEDA ScaledObject, and the values the schema or
the chart refuses."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from loraplex.cli import app

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "loraplex"
SCHEMAS = ROOT / "deploy" / "schemas"
K8S_VERSION = kubernetes_validate.latest_version()
GROUPS = {
    "router": {"enabled": True},
    "inferencePool": {"enabled": True},
    "workerGroups": [
        {
            "name": "gold",
            "model": {"servedName": "llama-3-8b"},
            "maxRank": 16,
            "tenants": ["acme", "beta"],
            "replicas": 2,
            "serve": {"max-loras": 16},
            "autoscaling": {"mode": "hpa", "maxReplicas": 3},
        },
        {"name": "shared", "model": {"servedName": "llama-3-8b"}, "maxRank": 64, "replicas": 1},
        {
            "name": "qwen",
            "model": {"servedName": "qwen2-7b", "claimName": "qwen-weights"},
            "replicas": 2,
            "autoscaling": {"mode": "keda", "minReplicas": 2, "maxReplicas": 5},
        },
    ],
}


def _render(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="lp", namespace="ml", is_install=True)
    streams = [yaml.safe_load_all(t) for p, t in sorted(out.items()) if p.endswith(".yaml")]
    return [obj for stream in streams for obj in stream if obj]


def _objects(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _args(workload: dict) -> list[str]:
    return workload["spec"]["template"]["spec"]["containers"][0]["args"]


def _router_config(objects: list[dict], tmp_path: Path) -> dict:
    """The router's rendered arguments as `loraplex router --print-config` reads them."""
    (tmp_path / "token").write_text("admin-token\n")
    args = [
        a.replace("$(LORAPLEX_REGISTRY_URL)", "postgresql://registry/loraplex").replace(
            "/var/run/secrets/loraplex-admin/token", str(tmp_path / "token")
        )
        for a in _args(_objects(objects, "Deployment")["lp-router"])
    ]
    done = CliRunner().invoke(app, ["router", *args, "--print-config"])
    assert done.exit_code == 0, done.output
    return yaml.safe_load(done.stdout)


def test_each_group_is_its_own_statefulset_with_its_base_rank_and_settings():
    objects = _render(GROUPS)
    sets = _objects(objects, "StatefulSet")
    assert set(sets) == {"lp-worker-gold", "lp-worker-shared", "lp-worker-qwen", "lp-registry"}
    assert "lp-worker" not in _objects(objects, "Deployment")
    served = {
        n: a for n, s in sets.items() if n != "lp-registry" for a in _args(s) if "served" in a
    }
    assert served == {
        "lp-worker-gold": "--served-model-name=llama-3-8b",
        "lp-worker-shared": "--served-model-name=llama-3-8b",
        "lp-worker-qwen": "--served-model-name=qwen2-7b",
    }
    # autoscaled groups leave replicas to their autoscaler
    assert [sets[n]["spec"].get("replicas") for n in served] == [None, 1, None]
    claims = {
        n: v["persistentVolumeClaim"]["claimName"]
        for n in served
        for v in sets[n]["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "model"
    }
    assert claims["lp-worker-qwen"] == "qwen-weights"
    assert claims["lp-worker-gold"] == "loraplex-base-model"
    configs = _objects(objects, "ConfigMap")
    settings = {n: yaml.safe_load(configs[n]["data"]["serve.yaml"]) for n in served}
    assert settings["lp-worker-gold"]["max-loras"] == 16  # the group's over worker.serve
    assert settings["lp-worker-gold"]["max-lora-rank"] == 16  # from maxRank
    assert settings["lp-worker-shared"]["max-loras"] == 8  # worker.serve's
    assert settings["lp-worker-shared"]["max-lora-rank"] == 64
    assert "max-lora-rank" not in settings["lp-worker-qwen"]
    assert settings["lp-worker-gold"]["disk-cache-bytes"] == "40GiB"
    for obj in objects:
        if obj["kind"] not in {"InferencePool", "ScaledObject"}:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_a_groups_settings_pass_serves_checks(tmp_path, llama_dir):
    settings = yaml.safe_load(
        _objects(_render(GROUPS), "ConfigMap")["lp-worker-gold"]["data"]["serve.yaml"]
    )
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(settings))
    args = ["serve", "--model", llama_dir, "--config", tmp_path / "serve.yaml"]
    args += ["--data-dir", tmp_path / "data", "--port", "0", "--print-config"]
    done = CliRunner().invoke(app, list(map(str, args)))
    assert done.exit_code == 0, done.output
    assert yaml.safe_load(done.stdout)["max-lora-rank"] == 16


def test_the_router_gets_one_pool_per_group_naming_each_pod_by_its_stable_name(tmp_path):
    objects = _render(GROUPS)
    config = _router_config(objects, tmp_path)
    pools = {p["name"]: p for p in config["pool"]}
    assert config["worker"] == []
    assert {
        n: (p["base-model"], p.get("max-rank"), p.get("tenants")) for n, p in pools.items()
    } == {
        "gold": ("llama-3-8b", 16, ["acme", "beta"]),
        "shared": ("llama-3-8b", 64, None),
        "qwen": ("qwen2-7b", None, None),
    }
    # up to maxReplicas where the group autoscales (the router finds the absent pods unhealthy)
    assert {n: len(p["workers"]) for n, p in pools.items()} == {"gold": 3, "shared": 1, "qwen": 5}
    sets, services = _objects(objects, "StatefulSet"), _objects(objects, "Service")
    for name, pool in pools.items():
        workload = sets[f"lp-worker-{name}"]
        headless = services[workload["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None"
        assert (
            headless["spec"]["selector"].items()
            <= workload["spec"]["template"]["metadata"]["labels"].items()
        )
        for ordinal, url in enumerate(pool["workers"]):
            parts = urlsplit(url)
            assert (
                parts.hostname
                == f"lp-worker-{name}-{ordinal}.{headless['metadata']['name']}.ml.svc"
            )
            assert parts.port == 8000


def test_the_default_group_behind_the_router_is_its_shared_pool_of_workers(tmp_path):
    objects = _render({"router": {"enabled": True}, "worker": {"replicas": 3}})
    config = _router_config(objects, tmp_path)
    assert config["pool"] == []
    assert config["worker"] == [
        f"http://lp-worker-{i}.lp-worker-pods.ml.svc:8000" for i in range(3)
    ]
    assert set(_objects(objects, "StatefulSet")) == {"lp-worker", "lp-registry"}
    assert {"lp-worker", "lp-worker-pods", "lp-router"} <= set(_objects(objects, "Service"))


def test_one_inference_pool_and_endpoint_picker_per_base_model():
    objects = _render(GROUPS)
    pools = _objects(objects, "InferencePool")
    assert set(pools) == {"lp-llama-3-8b", "lp-qwen2-7b"}
    schema = json.loads((SCHEMAS / "inferencepool.inference.networking.k8s.io-v1.json").read_text())
    pods = {
        n: s["spec"]["template"]["metadata"]["labels"]
        for n, s in _objects(objects, "StatefulSet").items()
    }
    for name, pool in pools.items():
        jsonschema.validate(pool, schema)
        chosen = {
            n
            for n, labels in pods.items()
            if pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
        }
        expected = {
            "lp-llama-3-8b": {"lp-worker-gold", "lp-worker-shared"},
            "lp-qwen2-7b": {"lp-worker-qwen"},
        }
        assert chosen == expected[name]
        assert pool["spec"]["endpointPickerRef"]["name"] == f"{name}-epp"
        epp = _objects(objects, "Deployment")[f"{name}-epp"]
        assert f"--pool-name={name}" in _args(epp)
        assert f"{name}-epp" in _objects(objects, "ConfigMap")


def test_the_hpa_scales_a_group_on_the_adapters_series_and_keda_on_prometheus_queries():
    objects = _render(GROUPS)
    hpas = _objects(objects, "HorizontalPodAutoscaler")
    assert set(hpas) == {"lp-worker-gold"}
    spec = hpas["lp-worker-gold"]["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "lp-worker-gold",
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 3)
    targets = {
        m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in spec["metrics"]
    }
    assert targets == {
        "loraplex_num_requests_waiting": "4000m",
        "loraplex_kv_cache_usage_perc": "800m",
    }
    scaled = _objects(objects, "ScaledObject")
    assert set(scaled) == {"lp-worker-qwen"}
    keda = scaled["lp-worker-qwen"]["spec"]
    assert keda["scaleTargetRef"]["name"] == "lp-worker-qwen"
    assert (keda["minReplicaCount"], keda["maxReplicaCount"]) == (2, 5)
    queries = [(t["metadata"]["query"], t["metadata"]["threshold"]) for t in keda["triggers"]]
    pods = 'namespace="ml",pod=~"lp-worker-qwen-[0-9]+"'
    assert queries == [
        (f"sum(vllm:num_requests_waiting{{{pods}}})", "4"),
        (f"avg(vllm:kv_cache_usage_perc{{{pods}}})", "0.8"),
    ]


def test_the_default_values_render_one_deployment_and_no_router_or_autoscaler():
    objects = _render({"worker": {"autoscaling": {"mode": "hpa"}}})
    assert set(_objects(objects, "Deployment")) == {"lp-worker"}
    assert "lp-router" not in _objects(objects, "Service")
    hpa = _objects(objects, "HorizontalPodAutoscaler")["lp-worker"]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    assert "replicas" not in _objects(objects, "Deployment")["lp-worker"]["spec"]


def test_the_groups_values_pass_helm_lint_strict():
    report = helm.lint(CHART, GROUPS, strict=True)
    assert report["errors"] == [], report


def _group(**extra) -> dict:
    return {"workerGroups": [{"name": "gold", "model": {"servedName": "llama"}, **extra}]}


@pytest.mark.parametrize(
    "values, field",
    [
        (
            {"workerGroups": [{"name": "Gold", "model": {"servedName": "llama"}}]},
            "/workerGroups/0/name",
        ),
        (
            {"workerGroups": [{"name": "default", "model": {"servedName": "llama"}}]},
            "/workerGroups/0/name",
        ),
        ({"workerGroups": [{"name": "gold"}]}, "model"),
        (_group(model={"servedName": "meta/llama"}), "/workerGroups/0/model/servedName"),
        (_group(maxRank=0), "/workerGroups/0/maxRank"),
        (_group(tenants=["a,b"]), "/workerGroups/0/tenants/0"),
        (_group(replica=2), "replica"),
        (_group(serve={"max-loras": 0}), "/workerGroups/0/serve/max-loras"),
        (_group(serve={"port": 9000}), "/workerGroups/0/serve/port"),
        (_group(autoscaling={"mode": "vpa"}), "/workerGroups/0/autoscaling/mode"),
        (_group(autoscaling={"kvCacheUsage": 1.5}), "/workerGroups/0/autoscaling/kvCacheUsage"),
        (_group(autoscaling={"keda": {"serverAddress": "prometheus:9090"}}), "serverAddress"),
        (
            {"worker": {"engine": "vllm"}, **_group(serve={"cpu-cache-bytes": "8GiB"})},
            "cpu-cache-bytes",
        ),
        ({"router": {"enabled": True, "port": 0}}, "/router/port"),
    ],
)
def test_a_bad_group_value_is_refused_by_the_schema_naming_the_field(values, field):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as refused:
        chart.render(values, name="lp", is_install=True)
    assert field in str(refused.value)
    report = helm.lint(CHART, values, strict=True)
    assert any(field in error for error in report["errors"]), report


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"workerGroups": [_group()["workerGroups"][0]] * 2},
            "workerGroups: the name gold is given twice",
        ),
        (
            _group(autoscaling={"mode": "hpa", "minReplicas": 4, "maxReplicas": 2}),
            "worker group gold: autoscaling.maxReplicas 2 is below minReplicas 4",
        ),
        (
            _group(maxRank=64, serve={"max-lora-rank": 16}),
            "worker group gold: serve's max-lora-rank 16 is below its maxRank 64",
        ),
    ],
)
def test_what_the_schema_cannot_say_the_chart_refuses(values, message):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError) as refused:
        chart.render(values, name="lp", is_install=True)
    assert message in str(refused.value)  # helm install and template; lint only logs a `fail`


def test_the_notes_name_each_group_and_how_to_watch_it():
    with helm.Chart.load(CHART) as chart:
        out = chart.render(GROUPS, name="lp", namespace="ml", is_install=True)
    notes = next(t for p, t in out.items() if p.endswith("NOTES.txt"))
    assert "lp-worker-gold: base model llama-3-8b, 1-3 workers (hpa)" in notes
    assert "lp-worker-shared: base model llama-3-8b, 1 worker(s)" in notes
    assert "The router: service lp-router, port 8080" in notes
    for group in ("gold", "shared", "qwen"):
        assert f"kubectl rollout status statefulset/lp-worker-{group}" in notes
