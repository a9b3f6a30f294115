"""The chart's `store` section rendered by Helm's engine (helm-python-sdk): each kind of shared
artifact store (OCI, S3, a directory on a shared volume, the bundled distribution registry) becomes
the workers' allowed root, with its login or volume, every object valid; bad store values refused
naming the field; NOTES saying how to register into the store."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "loraplex"
OCI = {"url": "oci://registry.internal/loras", "secret": {"name": "loras-pull"}}
S3 = {"url": "s3://loras/prod", "secret": {"name": "loras-s3"}, "s3Endpoint": "http://minio:9000"}
VOLUME = {"url": "/srv/loras", "volume": {"claimName": "loras"}}


def _render(values: dict) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name="lp", namespace="ml", is_install=True)


def _worker(values: dict) -> tuple[dict, dict]:
    """(its serve.yaml settings, its pod spec)."""
    out = _render(values)
    text = next(t for p, t in out.items() if p.endswith("worker.yaml"))
    objects = [o for o in yaml.safe_load_all(text) if o]
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    config, deployment = objects[0], objects[1]
    return yaml.safe_load(config["data"]["serve.yaml"]), deployment["spec"]["template"]["spec"]


def _notes(values: dict) -> str:
    return next(t for p, t in _render(values).items() if p.endswith("NOTES.txt"))


def test_an_oci_store_is_the_workers_allowed_root_and_storage_base_with_its_login_mounted():
    settings, pod = _worker({"store": OCI})
    assert settings["allowed-roots"] == ["oci://registry.internal/loras"]
    container = pod["containers"][0]
    assert "--storage-base=oci://registry.internal/loras" in container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LORAPLEX_OCI_AUTH_FILE"] == "/var/run/secrets/loraplex-store/config.json"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "store-login")
    assert mount == {
        "name": "store-login",
        "mountPath": "/var/run/secrets/loraplex-store",
        "readOnly": True,
    }
    volume = next(v for v in pod["volumes"] if v["name"] == "store-login")
    assert volume["secret"] == {
        "secretName": "loras-pull",
        "optional": True,
        "items": [{"key": ".dockerconfigjson", "path": "config.json"}],
    }


def test_an_s3_store_is_the_storage_base_with_credentials_and_endpoint_from_the_environment():
    settings, pod = _worker({"store": S3})
    assert settings["allowed-roots"] == ["s3://loras/prod"]
    container = pod["containers"][0]
    # uploads through a worker go to the bucket, as `registry add` from a laptop does
    stores = [a for a in container["args"] if a.startswith(("--storage-base", "--store"))]
    assert stores == ["--storage-base=s3://loras/prod"]
    assert {"name": "AWS_ENDPOINT_URL", "value": "http://minio:9000"} in container["env"]
    assert container["envFrom"] == [{"secretRef": {"name": "loras-s3", "optional": True}}]


def test_a_volume_store_is_the_workers_store_at_its_path_and_joins_the_allowed_roots():
    values = {"store": VOLUME, "worker": {"serve": {"allowed-roots": ["/srv/other"]}}}
    settings, pod = _worker(values)
    assert settings["allowed-roots"] == ["/srv/other", "/srv/loras"]
    assert "--store=/srv/loras" in pod["containers"][0]["args"]
    # writable: uploads through a worker land in it
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "store")
    assert mount == {"name": "store", "mountPath": "/srv/loras"}
    volume = next(v for v in pod["volumes"] if v["name"] == "store")
    assert volume["persistentVolumeClaim"] == {"claimName": "loras"}


@pytest.mark.parametrize("key", ["store", "storage-base"])
def test_the_store_keys_in_worker_serve_are_refused_naming_the_store_section(key):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as refused:
        chart.render({"worker": {"serve": {key: "/srv/x"}}}, name="lp", is_install=True)
    assert f"the chart sets --{key} itself from store.url" in str(refused.value)


def test_the_bundled_store_is_a_distribution_registry_the_workers_push_to_and_read():
    values = {"store": {"bundled": {"enabled": True}}}
    settings, pod = _worker(values)
    url = "oci+http://lp-store:5000/loras"
    assert settings["allowed-roots"] == [url]
    assert f"--storage-base={url}" in pod["containers"][0]["args"]
    text = next(t for p, t in _render(values).items() if p.endswith("store.yaml"))
    service, stateful = [o for o in yaml.safe_load_all(text) if o]
    for obj in (service, stateful):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    assert service["spec"]["ports"] == [{"name": "oci", "port": 5000, "targetPort": "oci"}]
    spec = stateful["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["containers"][0]["readinessProbe"]["httpGet"] == {"path": "/v2/", "port": "oci"}
    notes = _notes(values)
    assert "loraplex publish DIR --name NAME --url http://127.0.0.1:8001" in notes
    assert not any(t.strip() for p, t in _render({}).items() if p.endswith("store.yaml"))


def test_without_a_store_nothing_is_added_and_notes_say_adapters_from_outside_cannot_load():
    settings, pod = _worker({})
    assert "allowed-roots" not in settings
    assert {v["name"] for v in pod["volumes"]}.isdisjoint({"store", "store-login"})
    notes = _notes({})
    assert "No store.url" in notes and "cannot load" in notes


@pytest.mark.parametrize(
    "store, command",
    [
        (OCI, "--storage-base oci://registry.internal/loras add DIR"),
        (S3, "--storage-base s3://loras/prod add DIR"),
        (VOLUME, "--store /srv/loras add DIR"),
    ],
)
def test_notes_say_how_to_register_into_the_store(store, command):
    assert f'loraplex registry --registry "$URL" {command} --name NAME --stable' in _notes(
        {"store": store}
    )


def test_notes_say_a_missing_postgres_secret_blocks_the_postgres_pod():
    notes = _notes({})
    assert "lp-postgres: without it its pod stays in\nCreateContainerConfigError" in notes


@pytest.mark.parametrize(
    "store, field",
    [
        ({"url": "ftp://files/loras"}, "/store/url"),
        ({"url": "oci://registry.internal/loras@sha256:ab"}, "/store/url"),
        ({"url": "loras"}, "/store/url"),
        ({"url": "/srv/loras"}, "/store/volume/claimName"),
        ({"s3Endpoint": "minio:9000"}, "/store/s3Endpoint"),
        ({"secret": {"name": "Bad Name"}}, "/store/secret/name"),
        ({"bucket": "x"}, "bucket"),
        ({"url": "oci://registry.internal/loras", "bundled": {"enabled": True}}, "/store/url"),
        ({"bundled": {"enabled": True, "storage": "lots"}}, "/store/bundled/storage"),
    ],
)
def test_a_bad_store_value_is_refused_naming_the_field(store, field):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as refused:
        chart.render({"store": store}, name="lp", is_install=True)
    assert field in str(refused.value)
