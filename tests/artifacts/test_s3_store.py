"""The s3:// store against moto's S3 server on loopback (tests/s3server.py: no S3-compatible server
runs here, and AWS is the boundary these tests cannot reach): uploads by digest in the store's
`<hex>/` layout, fetches verified against the digest, a tampered object refused, credentials from
the AWS environment or a credentials file, and a refused login in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from s3server import BUCKET, moto_s3

from loraplex.artifacts import (
    AllowList,
    ArtifactStore,
    ArtifactUnavailable,
    DigestMismatch,
    UnsafeLocation,
    canonical_digest,
    fetch_artifact,
)
from loraplex.artifacts.s3 import push_s3

BASE = f"s3://{BUCKET}/prod"
ALLOWED = AllowList.parse([BASE])


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def stored(adapter_v1, tmp_path) -> tuple[ArtifactStore, str]:
    store = ArtifactStore(tmp_path / "laptop")
    return store, store.put(adapter_v1)


def _keys(client, prefix: str) -> list[str]:
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in listed)


def test_an_upload_is_the_store_entry_under_its_hex_and_a_fetch_gets_the_same_bytes(
    s3, stored, tmp_path, monkeypatch
):
    store, digest = stored
    hexd = digest.removeprefix("sha256:")
    for name, value in s3.env().items():  # boto3's own chain, as a Secret's variables give it
        monkeypatch.setenv(name, value)
    uri = push_s3(store.path(digest), digest, BASE)
    assert uri == f"{BASE}/{hexd}"
    entry = f"prod/{hexd}/"
    names = ["adapter_config.json", "adapter_model.safetensors", "index.json"]
    assert _keys(s3.client(), entry) == [entry + n for n in names]
    worker = ArtifactStore(tmp_path / "worker")
    path = fetch_artifact(uri, digest, worker, ALLOWED)
    assert canonical_digest(path) == digest
    for name in names:
        assert (path / name).read_bytes() == (store.path(digest) / name).read_bytes()
    with pytest.raises(UnsafeLocation, match="not under an allowed storage prefix"):
        fetch_artifact(uri, digest, ArtifactStore(tmp_path / "w2"), AllowList.parse(["s3://x/p"]))


def test_credentials_come_from_a_mounted_credentials_file(s3, stored, tmp_path, monkeypatch):
    store, digest = stored
    credentials = tmp_path / "secret" / "credentials"
    credentials.parent.mkdir()
    credentials.write_text(
        f"[default]\naws_access_key_id = {s3.key_id}\naws_secret_access_key = {s3.secret}\n"
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    uri = push_s3(store.path(digest), digest, BASE)
    path = fetch_artifact(uri, digest, ArtifactStore(tmp_path / "worker"), ALLOWED)
    assert canonical_digest(path) == digest


def test_a_tampered_object_is_refused_and_nothing_is_kept(s3, stored, tmp_path):
    store, digest = stored
    client = s3.client()
    uri = push_s3(store.path(digest), digest, f"s3://{BUCKET}/tampered", client=client)
    key = f"tampered/{digest.removeprefix('sha256:')}/adapter_model.safetensors"
    weights = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    weights[-1] ^= 0x01  # the same size: only the digest can tell
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(weights))
    worker = ArtifactStore(tmp_path / "worker")
    allowed = AllowList.parse([f"s3://{BUCKET}/tampered"])
    with pytest.raises(DigestMismatch) as refused:
        fetch_artifact(uri, digest, worker, allowed, s3_client=client)
    assert refused.value.expected == digest and refused.value.actual != digest
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(weights) + b"more")
    with pytest.raises(ArtifactUnavailable, match="sent more than the"):
        fetch_artifact(uri, digest, worker, allowed, s3_client=client)
    assert worker.digests() == [] and list((tmp_path / "worker" / "tmp").iterdir()) == []


@pytest.mark.parametrize(
    ("key_id", "secret", "code"),
    [(None, "not-the-secret", "SignatureDoesNotMatch"), ("AKIANOSUCHKEY0000000", None, "Invalid")],
)
def test_a_refused_login_is_one_line_naming_the_credentials(
    s3, stored, tmp_path, key_id, secret, code
):
    store, digest = stored
    client = s3.client(key_id, secret)
    with pytest.raises(ArtifactUnavailable) as pushed:
        push_s3(store.path(digest), digest, BASE, client=client)
    hexd = digest.removeprefix("sha256:")
    message = str(pushed.value)
    assert message.startswith(f"{BASE}/{hexd}: S3 answered {code}") and "\n" not in message
    assert message.endswith("check the AWS credentials (AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE and its credentials file) and "
                            "the bucket's policy")  # fmt: skip
    with pytest.raises(ArtifactUnavailable, match=f"S3 answered {code}"):
        fetch_artifact(f"{BASE}/{hexd}", digest, ArtifactStore(tmp_path / "w"), ALLOWED, 30, client)


def test_no_credentials_at_all_is_one_line(s3, stored, tmp_path, monkeypatch):
    store, digest = stored
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for
    with pytest.raises(ArtifactUnavailable, match="Unable to locate credentials: check the AWS"):
        push_s3(Path(store.path(digest)), digest, BASE)


def test_a_retired_revisions_objects_leave_the_bucket_and_come_back_when_registered_again(
    s3, adapter_v1, llama_dir, tmp_path, monkeypatch
):
    """A name keeping 1 revision on an S3 storage base: the retired revision's objects are deleted
    with its local copy, audited; its bytes registered again are uploaded again, to the same URI."""
    from tinymodels import make_adapter

    from loraplex.registry import Registry

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    base = f"s3://{BUCKET}/retired"
    v2 = make_adapter(llama_dir, tmp_path / "v2", seed=2, r=4, target_modules=["q_proj"])
    reg = Registry(
        f"sqlite:///{tmp_path / 'registry.db'}",
        ArtifactStore(tmp_path / "store"),
        base_model_dir=llama_dir,
        storage_base=base,
    )
    client = s3.client()
    try:
        reg.init()
        first = reg.add_revision(adapter_v1, "policy", status="stable", keep=1)
        first_keys = _keys(client, f"retired/{first.digest.removeprefix('sha256:')}/")
        assert len(first_keys) == 3
        second = reg.add_revision(v2, "policy", status="stable")
        assert _keys(client, f"retired/{first.digest.removeprefix('sha256:')}/") == []
        assert len(_keys(client, f"retired/{second.digest.removeprefix('sha256:')}/")) == 3
        assert not reg.store.has(first.digest)
        [event] = [e for e in reg.audit_events(50) if e.action == "delete_artifact"]
        assert event.detail == {"local": True, "s3": first.storage_uri, "s3_deleted": True}
        again = reg.add_revision(adapter_v1, "other", status="stable")
        assert again.storage_uri == first.storage_uri
        assert _keys(client, f"retired/{first.digest.removeprefix('sha256:')}/") == first_keys
    finally:
        reg.close()
