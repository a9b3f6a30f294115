"""The first half of every load, both engines': the checked bytes from a local path or through
the disk tier, and the errors a request is told."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.artifacts import AllowList, ArtifactStore, canonical_digest
from loraplex.residency.disk import DiskTier
from loraplex.residency.errors import AdapterUnavailable, ArtifactCorrupt
from loraplex.residency.fetch import fetch
from loraplex.residency.key import AdapterKey, AdapterRef

BASE = "sha256:" + "0" * 64


def _adapter(path: Path, payload: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 4}')
    (path / "adapter_model.safetensors").write_bytes(payload)
    return path


def _key(digest: str) -> AdapterKey:
    return AdapterKey(BASE, "a", "r1", digest)


def test_a_local_path_gives_its_bytes_and_a_disk_stage(tmp_path):
    source = _adapter(tmp_path / "a", b"weights")
    fetched = fetch(AdapterRef(_key(canonical_digest(source)), path=source), None)
    assert fetched.result["adapter_model.safetensors"] == b"weights"
    assert fetched.source == "disk" and list(fetched.stages) == ["disk"]


def test_the_disk_tier_downloads_once_then_reads_its_copy(tmp_path):
    remote = ArtifactStore(tmp_path / "remote")
    digest = remote.put(_adapter(tmp_path / "a", b"weights"))
    disk = DiskTier(tmp_path / "disk", 1 << 20, AllowList(roots=(tmp_path / "remote",)))
    ref = AdapterRef(_key(digest), storage_uri=remote.uri(digest))
    first, second = fetch(ref, disk), fetch(ref, disk)
    assert first.source == "remote" and list(first.stages) == ["disk", "download"]
    assert second.source == "disk" and list(second.stages) == ["disk"]
    assert bytes(second.result["adapter_model.safetensors"]) == b"weights"


def test_use_gets_the_bytes_and_its_result_is_returned(tmp_path):
    source = _adapter(tmp_path / "a", b"weights")
    ref = AdapterRef(_key(canonical_digest(source)), path=source)
    fetched = fetch(ref, None, use=lambda files, hashed: sorted(files))
    assert fetched.result == ["adapter_config.json", "adapter_model.safetensors"]


def test_bytes_that_miss_their_digest_are_corrupt_and_the_public_text_names_no_path(tmp_path):
    source = _adapter(tmp_path / "a", b"weights")
    ref = AdapterRef(_key("sha256:" + "1" * 64), path=source)
    with pytest.raises(ArtifactCorrupt) as caught:
        fetch(ref, None)
    assert caught.value.public == f"adapter {ref.key} failed its digest check and is not served"
    assert str(tmp_path) not in caught.value.public


def test_no_source_or_a_refused_pack_is_unavailable(tmp_path):
    source = _adapter(tmp_path / "a", b"weights")
    key = _key(canonical_digest(source))
    with pytest.raises(AdapterUnavailable, match="no local path and no storage URI"):
        fetch(AdapterRef(key, storage_uri="file:///elsewhere"), None)

    def refuse(files, hashed):
        raise ValueError("not an adapter this server can serve")

    with pytest.raises(AdapterUnavailable, match="not an adapter") as caught:
        fetch(AdapterRef(key, path=source), None, use=refuse)
    assert not isinstance(caught.value, ArtifactCorrupt)
    assert caught.value.public == f"adapter {key} could not be loaded; try again later"
