"""The content-addressed store and the fetchers: digests, atomic puts, verification, allowlists,
http, s3."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import blake3
import pytest

from loraplex.artifacts import (
    AllowList,
    ArtifactStore,
    ArtifactUnavailable,
    DigestMismatch,
    Pieces,
    UnsafeLocation,
    canonical_digest,
    digest_and_pieces,
    fetch_and_read,
    fetch_artifact,
    is_artifact_name,
    read_artifact,
    serve_store,
)
from loraplex.artifacts import digests as digests_module
from loraplex.lora_format import AdapterRejected


def fake_adapter(path: Path, payload: bytes = b"weights") -> Path:
    """Store tests need only the file layout, not a loadable adapter."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 4}')
    (path / "adapter_model.safetensors").write_bytes(payload)
    return path


def test_canonical_digest_is_the_documented_byte_layout(tmp_path):
    src = fake_adapter(tmp_path / "a")
    (src / "README.md").write_text("not part of the artifact")
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = (src / name).read_bytes()
        h.update(name.encode() + b"\n" + str(len(data)).encode() + b"\n" + data)
    assert canonical_digest(src) == "sha256:" + h.hexdigest()


def test_digest_changes_with_names_and_bytes(tmp_path):
    a = canonical_digest(fake_adapter(tmp_path / "a", b"xy"))
    b = canonical_digest(fake_adapter(tmp_path / "b", b"xz"))
    c = fake_adapter(tmp_path / "c", b"xy")
    (c / "adapter_model.safetensors").rename(c / "other.safetensors")
    assert len({a, b, canonical_digest(c)}) == 3


def test_put_get_is_idempotent_and_keeps_only_artifact_files(tmp_path, adapter_v1):
    store = ArtifactStore(tmp_path / "store")
    digest = store.put(adapter_v1)
    assert digest == canonical_digest(adapter_v1)
    assert store.put(adapter_v1) == digest
    path = store.get(digest)
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "index.json",
    ]
    assert (path / "adapter_model.safetensors").read_bytes() == (
        adapter_v1 / "adapter_model.safetensors"
    ).read_bytes()
    index = json.loads((path / "index.json").read_text())
    assert index["digest"] == digest and {f["name"] for f in index["files"]} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    assert store.size(digest) == sum(
        (adapter_v1 / n).stat().st_size
        for n in ("adapter_config.json", "adapter_model.safetensors")
    )
    assert store.digests() == [digest]
    assert list((tmp_path / "store" / "tmp").iterdir()) == []  # no work dir left behind
    assert store.remove(digest) and not store.has(digest) and not store.remove(digest)


def test_a_put_from_the_stores_work_area_links_the_files_and_any_other_copies_them(
    tmp_path, adapter_v1
):
    store = ArtifactStore(tmp_path / "store")
    owned = store.temp_dir() / "adapter"  # an upload's directory, on the store's file system
    shutil.copytree(adapter_v1, owned)
    digest, _ = store.put_with_piece_lists(owned)
    stored = store.get(digest) / "adapter_model.safetensors"
    assert stored.stat().st_ino == (owned / "adapter_model.safetensors").stat().st_ino
    shutil.rmtree(owned.parent)  # the upload's directory goes: the store keeps its name
    assert stored.read_bytes() == (adapter_v1 / "adapter_model.safetensors").read_bytes()
    assert canonical_digest(store.get(digest)) == digest
    other = ArtifactStore(tmp_path / "other")
    digest, _ = other.put_with_piece_lists(adapter_v1)
    copied = other.get(digest) / "adapter_model.safetensors"
    assert copied.stat().st_ino != (adapter_v1 / "adapter_model.safetensors").stat().st_ino


def test_put_refuses_pickles_and_incomplete_dirs(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    src = fake_adapter(tmp_path / "a")
    (src / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterRejected, match="adapter_model.bin is a pickle file"):
        store.put(src)
    (src / "adapter_model.bin").unlink()
    (src / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterRejected, match=r"no \*.safetensors file"):
        store.put(src)
    assert store.digests() == []


def test_flipped_byte_is_refused_by_get(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    digest = store.put(fake_adapter(tmp_path / "a", bytes(range(256))))
    weights = store.path(digest) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match=f"expected {digest}"):
        store.get(digest)


def check_by(src: Path, by_pieces: bool | str) -> dict:
    """read_artifact's keywords for the check: none (one sha256), the piece list taken now, as at
    registration (BLAKE3), or with "sha256" the same pieces hashed by sha256, as lists recorded
    by versions without BLAKE3 pieces are."""
    if not by_pieces:
        return {}
    pieces = digest_and_pieces(src)[1]
    if by_pieces == "sha256":
        pieces = sha256_pieces(src, pieces)
    return {"pieces": pieces}


def sha256_pieces(src: Path, like: Pieces) -> Pieces:
    """The piece list `like` with each piece's sha256 in place of its BLAKE3."""
    files = []
    for name, size, _ in like.files:
        data = (src / name).read_bytes()
        files.append(
            (
                name,
                size,
                tuple(
                    hashlib.sha256(data[i : i + like.size]).hexdigest()
                    for i in range(0, size, like.size)
                ),
            )
        )
    return Pieces(like.size, tuple(files), "sha256")


@pytest.fixture
def chunked(monkeypatch):
    """Read chunks and pieces of `size` bytes."""

    def chunked(size: int) -> None:
        monkeypatch.setattr(digests_module, "_READ_CHUNK", size)
        monkeypatch.setattr(digests_module, "PIECE_BYTES_MIN", size)

    return chunked


def test_pieces_are_taken_in_the_read_that_hashes_the_digest(tmp_path, chunked):
    chunked(1000)
    # 2560 bytes: pieces of 1000, 1000 and 560
    src = fake_adapter(tmp_path / "a", bytes(range(256)) * 10)
    digest, pieces = digest_and_pieces(src)
    assert digest == canonical_digest(src) and pieces.size == 1000
    data = (src / "adapter_model.safetensors").read_bytes()
    config = (src / "adapter_config.json").read_bytes()
    assert pieces.files == (
        ("adapter_config.json", len(config), (blake3.blake3(config).hexdigest(),)),
        (
            "adapter_model.safetensors",
            2560,
            tuple(blake3.blake3(data[i : i + 1000]).hexdigest() for i in (0, 1000, 2000)),
        ),
    )
    assert pieces.algorithm == "blake3"
    assert Pieces.from_json(pieces.to_json()) == pieces
    listed = json.loads(pieces.to_json())
    # A list recorded by a version without BLAKE3 pieces: sha256 pieces, no "algorithm" field.
    old = sha256_pieces(src, pieces)
    unnamed = json.loads(old.to_json())
    del unnamed["algorithm"]
    assert Pieces.from_json(json.dumps(unnamed)) == old and old.files != pieces.files
    for bad in (
        {**listed, "piece_bytes": 0},
        {"files": listed["files"]},
        {**listed, "piece_bytes": float("inf")},
        {**listed, "files": [{**listed["files"][1], "blake3": listed["files"][1]["blake3"][:2]}]},
        {**listed, "files": [{**listed["files"][0], "blake3": ["XYZ"]}]},
        {**listed, "algorithm": "md5"},
        {**listed, "algorithm": ["blake3"]},
        unnamed | {"files": listed["files"]},
    ):
        # BLAKE3 hashes without the name: taken for sha256
        with pytest.raises(ValueError, match="not a piece list"):
            Pieces.from_json(json.dumps(bad))


def test_a_file_that_changes_while_its_pieces_are_taken_is_refused(tmp_path, monkeypatch):
    """The digest hashes a file's size as fstat gives it; pieces of more (or fewer) bytes would
    describe other bytes than the digest does, and then accept them."""
    src = fake_adapter(tmp_path / "a", bytes(range(256)) * 10)
    real_fstat = os.fstat

    def fstat_then_append(fd):  # a writer appends right after the size is taken
        result = real_fstat(fd)
        if result.st_size == 2560:
            with (src / "adapter_model.safetensors").open("ab") as f:
                f.write(b"EVIL")
        return result

    monkeypatch.setattr(digests_module.os, "fstat", fstat_then_append)
    with pytest.raises(ArtifactUnavailable, match="changed while it was hashed"):
        digest_and_pieces(src)


def test_piece_size_keeps_the_list_short():
    mib = 1 << 20
    sizes = [digests_module.piece_bytes(n) for n in (0, 256 * mib, 256 * mib + 1, 4096 * mib)]
    assert sizes == [mib, mib, 2 * mib, 16 * mib]


@pytest.mark.parametrize("by_pieces", [False, True, "sha256"])
@pytest.mark.parametrize("chunk", [7, 1 << 24])  # many chunks per file, and one
def test_read_artifact_returns_exactly_the_bytes_it_hashed(tmp_path, chunked, chunk, by_pieces):
    chunked(chunk)
    src = fake_adapter(tmp_path / "a", bytes(range(256)) * 40)
    (src / "extra.safetensors").write_bytes(b"")  # an empty artifact file counts too
    (src / "notes.txt").write_text("not part of the artifact")
    files = read_artifact(src, canonical_digest(src), **check_by(src, by_pieces))
    names = ["adapter_config.json", "adapter_model.safetensors", "extra.safetensors"]
    assert {name: bytes(data) for name, data in files.items()} == {
        name: (src / name).read_bytes() for name in names
    }


@pytest.mark.parametrize("by_pieces", [False, True, "sha256"])
def test_read_artifact_refuses_a_flipped_byte(tmp_path, chunked, by_pieces):
    chunked(1000)
    src = fake_adapter(tmp_path / "a", bytes(range(256)) * 40)
    digest, check = canonical_digest(src), check_by(src, by_pieces)
    data = bytearray((src / "adapter_model.safetensors").read_bytes())
    data[5000] ^= 0x01
    (src / "adapter_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match=f"expected {digest}") as refused:
        read_artifact(src, digest, **check)
    if by_pieces:
        assert "other bytes in piece 5 of adapter_model.safetensors" in str(refused.value)
    with pytest.raises(UnsafeLocation, match="is not a digest"):
        read_artifact(src, "md5:" + "0" * 32)


class StalledHashers:
    """A hasher pool whose threads never come to this load's pieces (as when they are busy
    elsewhere)."""

    def __init__(self, *args, **kwargs):
        self.submitted = 0

    def submit(self, fn, *args):
        self.submitted += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_load_waiting_for_pieces_hashes_them_itself(tmp_path, chunked, monkeypatch):
    """The thread waiting for the piece check hashes the pieces no hasher thread has begun (on two
    cores, the second hasher): with every hasher thread elsewhere the load still ends, checked,
    instead of waiting for good."""
    chunked(1000)
    src = fake_adapter(tmp_path / "a", bytes(range(256)) * 40)
    digest, pieces = digest_and_pieces(src)
    monkeypatch.setattr(digests_module, "ThreadPoolExecutor", StalledHashers)
    seen = []

    def use(files, hashed):
        hashed("adapter_model.safetensors", 5000)
        seen.append(bytes(files["adapter_model.safetensors"][:5000]))
        return "used"

    done = []
    worker = threading.Thread(
        target=lambda: done.append(read_artifact(src, digest, use=use, pieces=pieces))
    )
    worker.start()
    worker.join(timeout=30)
    assert done == ["used"] and seen == [(bytes(range(256)) * 40)[:5000]]
    data = bytearray((src / "adapter_model.safetensors").read_bytes())
    data[9000] ^= 0x01
    (src / "adapter_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match="other bytes in piece 9 of adapter_model.safetensors"):
        read_artifact(src, digest, use=use, pieces=pieces)


@pytest.mark.parametrize("by_pieces", [False, True, "sha256"])
def test_an_artifact_of_one_chunk_is_hashed_without_a_helper_thread(
    tmp_path, chunked, monkeypatch, by_pieces
):
    def no_threads(*args, **kwargs):
        raise AssertionError("a helper thread for one chunk")

    src = fake_adapter(tmp_path / "a", bytes(range(256)) * 40)
    chunked(sum(f.stat().st_size for f in src.iterdir()))
    monkeypatch.setattr(digests_module, "ThreadPoolExecutor", no_threads)
    digest, check = canonical_digest(src), check_by(src, by_pieces)
    files = read_artifact(src, digest, use=lambda files, hashed: dict(files), **check)
    assert bytes(files["adapter_model.safetensors"]) == bytes(range(256)) * 40
    data = bytearray((src / "adapter_model.safetensors").read_bytes())
    data[5000] ^= 0x01
    (src / "adapter_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match=f"expected {digest}"):
        read_artifact(src, digest, **check)


@pytest.mark.parametrize("by_pieces", [False, True, "sha256"])
@pytest.mark.parametrize("chunk", [7, 1 << 24])
def test_read_artifact_use_runs_with_the_hash_and_may_overwrite_what_is_hashed(
    tmp_path, chunked, chunk, by_pieces
):
    chunked(chunk)
    src = fake_adapter(tmp_path / "a", bytes(range(256)) * 40)
    original = (src / "adapter_model.safetensors").read_bytes()
    check = check_by(src, by_pieces)

    def overwrite(files, hashed):
        # zeroes the weights from the front, each piece once the hash has read it
        data = files["adapter_model.safetensors"]
        for end in range(100, len(data) + 100, 100):
            hashed("adapter_model.safetensors", min(end, len(data)))
            data[end - 100 : end] = bytes(len(data[end - 100 : end]))
        return bytes(data)

    # were a piece overwritten before it was hashed, the digest would not match
    assert read_artifact(src, canonical_digest(src), use=overwrite, **check) == bytes(len(original))


@pytest.mark.parametrize("by_pieces", [False, True, "sha256"])
def test_read_artifact_drops_what_use_made_of_bytes_that_do_not_match(tmp_path, chunked, by_pieces):
    chunked(1000)
    src = fake_adapter(tmp_path / "a", bytes(range(256)) * 40)
    digest, check = canonical_digest(src), check_by(src, by_pieces)
    used = []
    data = bytearray((src / "adapter_model.safetensors").read_bytes())
    data[5000] ^= 0x01
    (src / "adapter_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match=f"expected {digest}"):
        read_artifact(src, digest, use=lambda files, hashed: used.append(1) or "packed", **check)
    assert used == [1]

    def refuse(files, hashed):
        raise ValueError("not a safetensors file")

    with pytest.raises(DigestMismatch):
        # a mismatch is the error, whatever the parser said of the bytes
        read_artifact(src, digest, use=refuse, **check)
    with pytest.raises(ValueError, match="not a safetensors file"):
        # the bytes are the artifact's: its error
        read_artifact(src, canonical_digest(src), use=refuse, **check_by(src, by_pieces))


def test_read_by_pieces_refuses_other_files_and_sizes(tmp_path, chunked):
    """Pieces that all match do not make the artifact: the files' names and sizes must be the listed
    ones too."""
    chunked(1000)
    payload = bytes(range(256)) * 8  # 2048 bytes: pieces end at 1000, 2000, 2048
    weights = "adapter_model.safetensors"
    cases = {
        "truncated at a piece boundary": lambda d: (d / weights).write_bytes(payload[:2000]),
        "a byte added": lambda d: (d / weights).write_bytes(payload + b"x"),
        "a file added": lambda d: (d / "more.safetensors").write_bytes(b""),
        "a file renamed": lambda d: (d / weights).rename(d / "other.safetensors"),
        "a file gone": lambda d: (d / "adapter_config.json").unlink(),
    }
    for what, change in cases.items():
        src = fake_adapter(tmp_path / what, payload)
        digest, pieces = digest_and_pieces(src)
        change(src)
        with pytest.raises(DigestMismatch, match=f"expected {digest}"):
            read_artifact(src, digest, pieces=pieces)
        with pytest.raises(DigestMismatch, match=f"expected {digest}"):
            read_artifact(src, digest, use=lambda files, hashed: "packed", pieces=pieces)


def test_digests_never_become_paths(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    for bad in (
        "sha256:../../etc",
        "../x",
        "sha256:" + "A" * 64,
        "md5:" + "0" * 32,
        "sha256:" + "0" * 64 + "\n",
    ):
        with pytest.raises(UnsafeLocation, match="is not a digest"):
            store.get(bad)


def test_fetch_file_verifies_and_moves_into_place(tmp_path):
    remote = ArtifactStore(tmp_path / "remote")
    digest = remote.put(fake_adapter(tmp_path / "a"))
    local = ArtifactStore(tmp_path / "local")
    allowed = AllowList(roots=(tmp_path / "remote",))
    path = fetch_artifact(remote.uri(digest), digest, local, allowed)
    assert path == local.path(digest) and local.get(digest) == path
    wrong = "sha256:" + "0" * 64
    with pytest.raises(DigestMismatch, match=f"expected {wrong}"):
        fetch_artifact(remote.uri(digest), wrong, local, allowed)
    assert not local.has(wrong)


@pytest.mark.parametrize("by_pieces", [False, True])
def test_fetch_and_read_checks_and_uses_a_download_in_one_read(tmp_path, monkeypatch, by_pieces):
    """A remote load reads and hashes the downloaded bytes once: the read that verifies them before
    the rename is the one whose bytes `use` gets (they were read twice, from the work directory and
    again from the store)."""
    remote = ArtifactStore(tmp_path / "remote")
    src = fake_adapter(tmp_path / "a", bytes(range(256)) * 40)
    digest = remote.put(src)
    check = check_by(src, by_pieces)
    reads = []
    real_read = digests_module._read_hashing
    monkeypatch.setattr(
        digests_module,
        "_read_hashing",
        lambda path, name, *args: reads.append(name) or real_read(path, name, *args),
    )

    def use(files, hashed):
        for name in files:
            hashed(name, len(files[name]))
        return {name: bytes(data) for name, data in files.items()}

    local = ArtifactStore(tmp_path / "local")
    with serve_store(remote) as base:
        fetched = fetch_and_read(
            f"{base}/{digest.removeprefix('sha256:')}",
            digest,
            local,
            AllowList(prefixes=(base,)),
            use,
            **check,
        )
    assert reads == ["adapter_config.json", "adapter_model.safetensors"]  # once each
    assert fetched.path == local.path(digest) and local.get(digest) == fetched.path
    assert fetched.result == {name: (src / name).read_bytes() for name in reads}
    assert fetched.download_s is not None and fetched.download_s > 0
    # Already in the store: read (and checked) from there, no download.
    again = fetch_and_read(
        remote.uri(digest), digest, local, AllowList(roots=(tmp_path / "remote",)), use, **check
    )
    assert again.download_s is None and again.result == fetched.result


def test_fetch_and_read_keeps_no_download_that_use_fails_on(tmp_path):
    """A failed load leaves every tier as it was: bytes that match but do not pack are not kept,
    where they would count against the disk budget and push out an artifact that serves."""
    remote = ArtifactStore(tmp_path / "remote")
    digest = remote.put(fake_adapter(tmp_path / "a"))
    local = ArtifactStore(tmp_path / "local")

    def use(files, hashed):
        raise ValueError("not an adapter this server can serve")

    with pytest.raises(ValueError, match="not an adapter"):
        fetch_and_read(
            remote.uri(digest), digest, local, AllowList(roots=(tmp_path / "remote",)), use
        )
    assert not local.has(digest) and local.digests() == []
    assert list((local.root / "tmp").iterdir()) == []  # nor its work directory
    wrong = "sha256:" + "0" * 64
    with pytest.raises(DigestMismatch, match=f"expected {wrong}"):
        # a mismatch is what is raised when both fail
        fetch_and_read(
            remote.uri(digest), wrong, local, AllowList(roots=(tmp_path / "remote",)), use
        )
    assert not local.has(wrong)


def test_fetch_replaces_a_damaged_local_copy(tmp_path):
    remote = ArtifactStore(tmp_path / "remote")
    digest = remote.put(fake_adapter(tmp_path / "a", b"good bytes"))
    local = ArtifactStore(tmp_path / "local")
    assert local.put(tmp_path / "a") == digest
    (local.path(digest) / "adapter_model.safetensors").write_bytes(b"bad! bytes")
    fetch_artifact(remote.uri(digest), digest, local, AllowList(roots=(tmp_path / "remote",)))
    assert (local.get(digest) / "adapter_model.safetensors").read_bytes() == b"good bytes"


def test_path_traversal_and_outside_roots_are_refused(tmp_path):
    remote = ArtifactStore(tmp_path / "remote")
    digest = remote.put(fake_adapter(tmp_path / "a"))
    local = ArtifactStore(tmp_path / "local")
    allowed = AllowList(roots=(tmp_path / "remote",), prefixes=("http://127.0.0.1:9/store",))
    hexd = digest.removeprefix("sha256:")
    cases = {
        f"file://{tmp_path}/remote/sha256/../../a": "'..'",
        f"file://{tmp_path}/remote/sha256/%2e%2e/%2e%2e/a": "'..'",
        f"file://{tmp_path}/a": "outside the allowed roots",
        f"http://127.0.0.1:9/store/../{hexd}": "'..'",
        f"http://127.0.0.1:9/store/%2E%2E/secret/{hexd}": "'..'",
        f"http://127.0.0.1:9/storex/{hexd}": "not under an allowed storage prefix",
        f"http://127.0.0.1:10/store/{hexd}": "not under an allowed storage prefix",
        f"http://127.0.0.1:9@evil.example/store/{hexd}": "credentials",
        f"ftp://127.0.0.1/store/{hexd}": "unsupported scheme",
    }
    for uri, message in cases.items():
        with pytest.raises(UnsafeLocation, match=message):
            fetch_artifact(uri, digest, local, allowed)
    assert local.digests() == []


def test_symlinks_out_of_the_root_are_refused(tmp_path):
    outside = fake_adapter(tmp_path / "outside")
    digest = canonical_digest(outside)
    root = tmp_path / "root"
    root.mkdir()
    (root / "linked-dir").symlink_to(outside, target_is_directory=True)
    linked_file = root / "linked-file"
    linked_file.mkdir()
    (linked_file / "adapter_config.json").write_text('{"r": 4}')
    (linked_file / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    local = ArtifactStore(tmp_path / "local")
    allowed = AllowList(roots=(root,))
    with pytest.raises(UnsafeLocation, match="outside the allowed roots"):
        fetch_artifact((root / "linked-dir").as_uri(), digest, local, allowed)
    with pytest.raises(
        UnsafeLocation, match="adapter_model.safetensors is a symlink out of the allowed root"
    ):
        fetch_artifact(linked_file.as_uri(), digest, local, allowed)
    assert local.digests() == []


def test_allowlist_parse():
    allowed = AllowList.parse(
        ["/srv/loras/", "file:///data/x", "https://artifacts.example/loras/", "s3://bucket/p"]
    )
    assert allowed.roots == (Path("/srv/loras"), Path("/data/x"))
    assert allowed.prefixes == ("https://artifacts.example/loras", "s3://bucket/p")
    allowed.check("https://artifacts.example/loras/abc")
    allowed.check("s3://bucket/p/abc")
    with pytest.raises(UnsafeLocation):
        allowed.check("s3://other-bucket/p/abc")


@pytest.mark.parametrize("by_pieces", [False, True, "sha256"])
def test_http_fetch_from_a_real_local_server(tmp_path, by_pieces):
    remote = ArtifactStore(tmp_path / "remote")
    # several chunks
    digest, pieces = remote.put_with_pieces(fake_adapter(tmp_path / "a", os.urandom(3 << 20)))
    assert len(pieces.files[1][2]) == 3
    check = {"pieces": pieces} if by_pieces else {}
    local = ArtifactStore(tmp_path / "local")
    with serve_store(remote) as base:
        uri = f"{base}/{digest.removeprefix('sha256:')}"
        path = fetch_artifact(uri, digest, local, AllowList(prefixes=(base,)), **check)
        assert canonical_digest(path) == digest
        weights = "adapter_model.safetensors"
        assert (path / weights).read_bytes() == (remote.path(digest) / weights).read_bytes()
        # the local copy
        assert fetch_artifact(uri, digest, local, AllowList(prefixes=(base,)), **check) == path
        # Bytes changed in the remote store are refused, and so is a damaged local copy (replaced,
        # not used).
        data = bytearray((remote.path(digest) / weights).read_bytes())
        data[(2 << 20) + 5] ^= 1
        (remote.path(digest) / weights).write_bytes(bytes(data))
        (path / weights).write_bytes(bytes(data))
        with pytest.raises(DigestMismatch, match=f"expected {digest}") as refused:
            fetch_artifact(uri, digest, local, AllowList(prefixes=(base,)), **check)
    assert uri in str(refused.value) and not local.has(digest)
    if by_pieces:
        assert "piece 2 of adapter_model.safetensors" in str(refused.value)


def test_http_tampered_bytes_and_bad_index_are_refused(tmp_path):
    remote = ArtifactStore(tmp_path / "remote")
    digest = remote.put(fake_adapter(tmp_path / "a", b"0123456789"))
    hexd = digest.removeprefix("sha256:")
    local = ArtifactStore(tmp_path / "local")
    with serve_store(remote) as base:
        allowed = AllowList(prefixes=(base,))
        (remote.path(digest) / "adapter_model.safetensors").write_bytes(b"0123456780")
        with pytest.raises(DigestMismatch, match=f"expected {digest}"):
            fetch_artifact(f"{base}/{hexd}", digest, local, allowed)
        index = remote.path(digest) / "index.json"
        index.write_text(json.dumps({"files": [{"name": "../../escape.safetensors", "size": 1}]}))
        with pytest.raises(UnsafeLocation, match="not an artifact file name"):
            fetch_artifact(f"{base}/{hexd}", digest, local, allowed)
        index.write_text(json.dumps({"files": [{"name": "adapter_model.safetensors", "size": 3}]}))
        with pytest.raises(ArtifactUnavailable, match="more than the 3 bytes"):
            fetch_artifact(f"{base}/{hexd}", digest, local, allowed)
        with pytest.raises(ArtifactUnavailable, match="404"):
            fetch_artifact(f"{base}/{'0' * 64}", "sha256:" + "0" * 64, local, allowed)
    assert local.digests() == []
    assert list((tmp_path / "local" / "tmp").iterdir()) == []


def test_http_store_down_or_silent_is_unavailable(tmp_path):
    digest = "sha256:" + "1" * 64
    local = ArtifactStore(tmp_path / "local")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ArtifactUnavailable, match="ConnectError"):
        fetch_artifact(
            f"http://127.0.0.1:{port}/{'1' * 64}",
            digest,
            local,
            AllowList(prefixes=(f"http://127.0.0.1:{port}",)),
        )
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        with pytest.raises(ArtifactUnavailable, match="Timeout"):
            fetch_artifact(
                f"http://127.0.0.1:{port}/{'1' * 64}",
                digest,
                local,
                AllowList(prefixes=(f"http://127.0.0.1:{port}",)),
                timeout_s=0.3,
            )


def test_http_store_that_trickles_bytes_is_cut_off_by_the_whole_download_deadline(tmp_path):
    """Each read gets a byte well within its timeout, so only the deadline over the whole download
    ends it."""
    remote = ArtifactStore(tmp_path / "remote")
    digest = remote.put(fake_adapter(tmp_path / "a", os.urandom(4000)))
    hexd = digest.removeprefix("sha256:")
    index = (remote.path(digest) / "index.json").read_bytes()

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            name = self.path.rsplit("/", 1)[-1]
            body = index if name == "index.json" else (remote.path(digest) / name).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(len(body) if name != "index.json" else 1):
                chunk = body if name == "index.json" else body[i : i + 1]
                try:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                except OSError:
                    return  # the client gave up
                time.sleep(0.05)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    local = ArtifactStore(tmp_path / "local")
    try:
        with pytest.raises(ArtifactUnavailable, match="the download took longer than 2 s"):
            # deadline: 1 s + the index's bytes (about 4.1 kB) at 4 kB/s; the trickle needs minutes
            fetch_artifact(
                f"{base}/{hexd}",
                digest,
                local,
                AllowList(prefixes=(base,)),
                timeout_s=1.0,
                min_rate=4000,
            )
    finally:
        server.shutdown()
        server.server_close()
    assert local.digests() == [] and list((tmp_path / "local" / "tmp").iterdir()) == []


def test_artifact_names_are_matched_whole():
    assert is_artifact_name("adapter_model.safetensors") and is_artifact_name("adapter_config.json")
    for bad in (
        "adapter_model.safetensors\n",
        "adapter_config.json\n",
        "../adapter_model.safetensors",
        "x.bin",
    ):
        assert not is_artifact_name(bad)
