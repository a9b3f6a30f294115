"""deploy/kubernetes/ (rendered from the Helm chart) checked offline: core objects by
kubernetes-validate (its bundled schemas of the newest Kubernetes it knows), the custom resources
and the EPP's config by jsonschema against deploy/schemas/, and the worker's command line run for
real with a missing Secret and a wrong registry URL."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from loraplex.artifacts import ArtifactStore
from loraplex.registry import Registry
from loraplex.registry.cli import app as registry_cli

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
SCHEMAS = ROOT / "deploy" / "schemas"
K8S_VERSION = kubernetes_validate.latest_version()
CUSTOM = {
    (
        "inference.networking.k8s.io/v1",
        "InferencePool",
    ): "inferencepool.inference.networking.k8s.io-v1.json",
    ("llm-d.ai/v1alpha2", "InferenceModelRewrite"): "inferencemodelrewrite.llm-d.ai-v1alpha2.json",
}
EPP_CONFIG = "endpointpickerconfig.llm-d.ai-v1alpha1.json"


def _objects() -> list[dict]:
    return [
        doc
        for path in sorted(MANIFESTS.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
    ]


def _by_kind(kind: str, name: str) -> dict:
    return next(o for o in _objects() if o["kind"] == kind and o["metadata"]["name"] == name)


def _validate(obj: dict) -> None:
    schema = CUSTOM.get((obj["apiVersion"], obj["kind"]))
    if schema is None:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    else:
        jsonschema.validate(obj, json.loads((SCHEMAS / schema).read_text()))


def _epp_config() -> dict:
    return yaml.safe_load(_by_kind("ConfigMap", "loraplex-epp")["data"]["epp-config.yaml"])


def _worker() -> dict:
    return _by_kind("Deployment", "loraplex-worker")["spec"]["template"]


@pytest.mark.parametrize("obj", _objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_manifest_is_valid(obj):
    _validate(obj)


def test_the_validators_refuse_a_wrong_field():
    deployment = _by_kind("Deployment", "loraplex-worker")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    pool = json.loads(json.dumps(_by_kind("InferencePool", "loraplex")))
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    with pytest.raises(jsonschema.ValidationError):
        _validate(pool)
    config = _epp_config()
    config["plugins"][1]["parameters"]["engineConfigs"][0]["loraSpec"] = "vllm:lora requests"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, json.loads((SCHEMAS / EPP_CONFIG).read_text()))


def test_the_epp_config_scores_the_pool_by_lora_affinity_queue_and_kv():
    config = _epp_config()
    jsonschema.validate(config, json.loads((SCHEMAS / EPP_CONFIG).read_text()))
    types = {p["type"] for p in config["plugins"]}
    assert {
        "lora-affinity-scorer",
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "max-score-picker",
    } <= types
    refs = {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert refs <= {p.get("name", p["type"]) for p in config["plugins"]}
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    engine = extractor["parameters"]["engineConfigs"][0]
    # The worker pods carry the engine type the EPP maps to the series the server exports.
    assert _worker()["metadata"]["labels"]["llm-d.ai/engine-type"] == engine["name"] == "loraplex"
    assert engine["loraSpec"] == "vllm:lora_requests_info"


def test_the_pool_selects_the_workers_on_their_inference_port():
    pool = _by_kind("InferencePool", "loraplex")
    labels = _worker()["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container = _worker()["spec"]["containers"][0]
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http}]
    epp = _by_kind("Service", pool["spec"]["endpointPickerRef"]["name"])
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in {
        p["port"] for p in epp["spec"]["ports"]
    }


def test_the_worker_probes_health_and_readiness_and_reads_its_secrets_and_disk_volume():
    container = _worker()["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    volumes = {v["name"]: v for v in _worker()["spec"]["volumes"]}
    secrets = {v["secret"]["secretName"] for v in volumes.values() if "secret" in v}
    assert secrets == {"loraplex-keys", "loraplex-admin"}
    env = {e["name"]: e for e in container["env"]}
    assert env["LORAPLEX_REGISTRY_URL"]["valueFrom"]["secretKeyRef"]["name"] == "loraplex-registry"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "ephemeral" in volumes[mounts["/var/lib/loraplex"]]
    assert "--data-dir=/var/lib/loraplex" in container["args"]


def test_export_k8s_writes_valid_rewrites_of_the_registry_split(
    llama_dir, llama_adapters, tmp_path
):
    registry = Registry(
        f"sqlite:///{tmp_path}/registry.db",
        ArtifactStore(tmp_path / "artifacts"),
        base_model_dir=llama_dir,
        max_lora_rank=16,
    )
    registry.init()
    registry.add_revision(llama_adapters["attn-r8"], "sql_v", shared=True, status="stable")
    registry.add_revision(llama_adapters["mlp-r4"], "sql_v", revision="canary")
    registry.promote("sql_v", "canary", 10, force=True)
    registry.add_revision(llama_adapters["regex-r4"], "idle")  # staging: no traffic, no rewrite
    registry.close()
    out = CliRunner().invoke(
        registry_cli,
        [
            "--registry",
            f"sqlite:///{tmp_path}/registry.db",
            "--store",
            str(tmp_path / "artifacts"),
            "export",
            "k8s",
            "--namespace",
            "ml",
        ],
    )
    assert out.exit_code == 0, out.output
    objects = list(yaml.safe_load_all(out.output))
    assert len(objects) == 1
    for obj in objects:
        _validate(obj)
    rewrite = objects[0]
    assert re.fullmatch(r"loraplex-sql-v-[0-9a-f]{8}", rewrite["metadata"]["name"])
    assert rewrite["metadata"]["namespace"] == "ml"
    pool = _by_kind("InferencePool", "loraplex")
    assert rewrite["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    targets = rewrite["spec"]["rules"][0]["targets"]
    assert sorted((t["modelRewrite"], t["weight"]) for t in targets) == [
        ("sql_v@canary", 10),
        ("sql_v@r1", 90),
    ]


def _serve_args(tmp_path: Path, model_dir: Path, env: dict[str, str]) -> list[str]:
    """The worker container's command line, run here: its paths under tmp_path, `$(VAR)` expanded
    from `env` as the kubelet does (an unset variable stays as written), on a free local port."""
    container = _worker()["spec"]["containers"][0]
    args = []
    for arg in container["args"]:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), arg)
        flag, _, value = arg.partition("=")
        if flag == "--model":
            value = str(model_dir)
        elif flag in ("--host", "--port", "--admin-port"):
            value = {"--host": "127.0.0.1", "--port": "0", "--admin-port": "0"}[flag]
        elif value.startswith("/"):
            value = str(tmp_path / value.lstrip("/"))
        args.append(f"{flag}={value}")
    return [sys.executable, "-m", "loraplex.cli", *container["command"][1:], *args]


def _secret_files(tmp_path: Path, keys: bool = True, admin: bool = True) -> None:
    """The worker's mounted files under tmp_path: its settings (the ConfigMap) and the Secrets."""
    settings = tmp_path / "etc/loraplex/serve.yaml"
    settings.parent.mkdir(parents=True)
    settings.write_text(_by_kind("ConfigMap", "loraplex-worker")["data"]["serve.yaml"])
    if keys:
        (tmp_path / "var/run/secrets/loraplex-keys").mkdir(parents=True)
        (tmp_path / "var/run/secrets/loraplex-keys/api-keys").write_text(
            "acme acme-key-0123456789\n"
        )
    if admin:
        (tmp_path / "var/run/secrets/loraplex-admin").mkdir(parents=True)
        (tmp_path / "var/run/secrets/loraplex-admin/token").write_text("admin-token-0123456789\n")


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )


def test_a_missing_secret_stops_the_worker_with_a_line_naming_it(llama_dir, tmp_path):
    _secret_files(tmp_path, keys=False)
    done = _run(
        _serve_args(tmp_path, llama_dir, {"LORAPLEX_REGISTRY_URL": f"sqlite:///{tmp_path}/r.db"})
    )
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith("error: --api-keys: ")
    assert "loraplex-keys/api-keys" in done.stderr and "Traceback" not in done.stderr


def test_a_missing_registry_secret_names_the_variable(llama_dir, tmp_path):
    _secret_files(tmp_path)
    done = _run(_serve_args(tmp_path, llama_dir, {}))
    assert done.returncode == 2
    last = done.stderr.splitlines()[-1]
    assert last == (
        "error: --registry $(LORAPLEX_REGISTRY_URL): the environment variable "
        "LORAPLEX_REGISTRY_URL "
        "is not set (in Kubernetes: the Secret or key it comes from is missing)"
    )


def test_a_wrong_registry_url_stops_the_worker_with_a_line_naming_the_registry(llama_dir, tmp_path):
    _secret_files(tmp_path)
    url = "postgresql+psycopg://loraplex:secret@127.0.0.1:1/loraplex"
    done = _run(_serve_args(tmp_path, llama_dir, {"LORAPLEX_REGISTRY_URL": url}))
    assert done.returncode == 2
    last = done.stderr.splitlines()[-1]
    assert last.startswith("error: --registry: cannot open the registry: ") and "refused" in last
    assert "secret" not in last  # the URL's password stays out of the log
