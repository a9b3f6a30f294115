"""The operator's path with an S3 bucket as the chart's store (`store.url: s3://...`, its Secret of
AWS variables, `store.s3Endpoint`): two workers' containers as Helm renders them, run as local
processes on a throwaway PostgreSQL registry; an adapter added from an operator's laptop (its own
HOME) and one published through the first worker both land in the bucket, and the second worker,
whose disk has neither, answers both as HF+PEFT does. A tampered object is a 503, and a laptop
with a wrong secret gets one line and records nothing.

The bucket is moto's S3 server on loopback (tests/s3server.py): no S3-compatible server runs on
this machine or in CI, so it stands in for S3 at the HTTP API, signatures checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from s3server import BUCKET, moto_s3
from test_store_smoke import (
    ADMIN_TOKEN,
    API_KEY,
    ROOT,
    _addresses,
    _complete,
    _loraplex,
    _peft_answer,
    _render,
    _start_worker,
)
from tinymodels import make_adapter

from loraplex.artifacts import ArtifactStore
from loraplex.registry import Registry

STORE = f"s3://{BUCKET}/prod"


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as endpoint:
        yield endpoint


def _rendered_s3_worker(endpoint: str) -> tuple[dict, str]:
    values = {"url": STORE, "secret": {"name": "loras-s3"}, "s3Endpoint": endpoint}
    config, deployment = _render(values)["worker.yaml"][:2]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return container, config["data"]["serve.yaml"]


def _pod_env(container: dict, secret: dict[str, str], registry: str) -> dict[str, str]:
    """The worker's environment as the kubelet gives it: the Secret its envFrom names (the
    container's own values are added by `_start_worker`)."""
    assert container["envFrom"] == [{"secretRef": {"name": "loras-s3", "optional": True}}]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")}
    env |= {k: v for k, v in secret.items() if k != "AWS_ENDPOINT_URL"}
    return env | {"LORAPLEX_REGISTRY_URL": registry}


def _operator(home: Path, aws: dict[str, str], *args) -> subprocess.CompletedProcess:
    """`loraplex registry ...` from the laptop: its own HOME and its AWS login."""
    return subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "registry", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(ROOT / "src"), **aws},
    )


def _revision(pg_url: str, name: str):
    registry = Registry(pg_url, create=False)
    try:
        return registry.show(name).revisions[0]
    finally:
        registry.close()


def test_s3_store_fleet_serves_what_a_laptop_adds_and_a_worker_publishes(
    s3, pg_url, llama_dir, tmp_path
):
    container, serve_yaml = _rendered_s3_worker(s3.url)
    assert f"--storage-base={STORE}" in container["args"]
    assert yaml.safe_load(serve_yaml)["allowed-roots"] == [STORE]
    assert {"name": "AWS_ENDPOINT_URL", "value": s3.url} in container["env"]
    adapters = {
        name: make_adapter(llama_dir, tmp_path / name, seed=seed, r=4, lora_alpha=8)
        for name, seed in (("sql", 7), ("pub", 9), ("bad", 13))
    }
    laptop, at = tmp_path / "laptop", ["--registry", pg_url]
    aws = s3.env()
    assert _operator(laptop, aws, *at, "init").returncode == 0
    for name in ("sql", "bad"):
        added = _operator(
            laptop, aws, *at, "--storage-base", STORE, "add", adapters[name], "--name", name,
            "--base-model", llama_dir, "--stable", "--json",
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        assert json.loads(added.stdout)["storage_uri"].startswith(f"{STORE}/")
    assert not (laptop / ".local" / "share" / "loraplex" / "registry.db").exists()
    _tamper(s3, _revision(pg_url, "bad").storage_uri)

    env = _pod_env(container, aws, pg_url)
    started, urls = [], []
    try:
        for pod in (tmp_path / "pod-a", tmp_path / "pod-b"):
            started.append(_start_worker(pod, container, serve_yaml, llama_dir, dict(env)))
        for proc, _ in started:
            urls.append(_addresses(proc, ("loraplex serving", "loraplex admin API")))
        token = tmp_path / "pod-a" / "var/run/secrets/loraplex-admin/token"
        assert token.read_text().strip() == ADMIN_TOKEN
        published = _loraplex(
            laptop, "publish", adapters["pub"], "--name", "pub", "--url", urls[0][1],
            "--admin-token-file", token, "--stable",
        )  # fmt: skip
        assert published.returncode == 0, published.stderr
        headers = {"Authorization": f"Bearer {API_KEY}"}
        answers = {name: _complete(urls[1][0], name, headers) for name in adapters}
    finally:
        for proc, log in started:
            proc.terminate()
            proc.wait(60)
            log.close()
    assert _revision(pg_url, "pub").storage_uri.startswith(f"{STORE}/")
    # the second worker's disk had neither: it fetched both from the bucket
    fetched = ArtifactStore(tmp_path / "pod-b" / "var/lib/loraplex/cache").digests()
    assert fetched == sorted(_revision(pg_url, name).digest for name in ("sql", "pub"))
    for name in ("sql", "pub"):
        assert answers[name].status_code == 200, answers[name].text
        expected = _peft_answer(llama_dir, adapters[name], "hello", 6)
        assert answers[name].json()["choices"][0]["text"] == expected, name
    assert answers["bad"].status_code == 503, answers["bad"].text
    assert answers["bad"].json()["error"]["message"] == (
        "adapter bad@r1 failed its digest check and is not served"
    )
    assert "digest mismatch" in (tmp_path / "pod-b" / "stderr.log").read_text()


def _tamper(s3, uri: str) -> None:
    """Flip the last byte of the weights under `uri` (the same size: only the digest tells)."""
    client = s3.client()
    key = uri.removeprefix(f"s3://{BUCKET}/") + "/adapter_model.safetensors"
    weights = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    weights[-1] ^= 0x01
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(weights))


def test_a_wrong_secret_is_one_line_and_records_nothing(s3, pg_url, llama_dir, tmp_path):
    adapter = make_adapter(llama_dir, tmp_path / "sql", seed=7, r=4, lora_alpha=8)
    laptop, at = tmp_path / "laptop", ["--registry", pg_url]
    assert _operator(laptop, {}, *at, "init").returncode == 0
    added = _operator(laptop, s3.env(secret="not-the-secret"), *at, "--storage-base", STORE,
                      "add", adapter, "--name", "sql", "--base-model", llama_dir)  # fmt: skip
    assert added.returncode == 1
    lines = added.stderr.splitlines()
    assert len(lines) == 1, added.stderr
    assert (
        lines[0].startswith(f"error: {STORE}/") and "S3 answered SignatureDoesNotMatch" in lines[0]
    )
    assert lines[0].endswith("check the AWS credentials (AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE and its credentials file) and "
                             "the bucket's policy")  # fmt: skip
    listed = _operator(laptop, {}, *at, "list", "--json")
    assert json.loads(listed.stdout) == []
