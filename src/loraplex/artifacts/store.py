"""Content-addressed artifact store on local disk.

Layout under the root (the same tree serves as an http store, see `serve_store`):

    <root>/sha256/<hex>/adapter_config.json
    <root>/sha256/<hex>/adapter_model.safetensors
    <root>/sha256/<hex>/index.json   # {"digest", "files": [{"name", "size"}]}; not in the digest
    <root>/tmp/                      # work dirs; an entry becomes visible only by one rename
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from loraplex.artifacts.digests import (
    CHUNK_BYTES,
    Pieces,
    artifact_files,
    canonical_digest,
    check_digest,
    hash_artifact,
    is_artifact_name,
    read_artifact,
)
from loraplex.artifacts.errors import ArtifactUnavailable, DigestMismatch
from loraplex.lora_format import CONFIG_FILE, PICKLE_SUFFIXES, AdapterRejected

INDEX_FILE = "index.json"
STALE_TEMP_S = 3600


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_synced(src: Path, dst: Path) -> None:
    with src.open("rb") as fin, dst.open("wb") as fout:
        shutil.copyfileobj(fin, fout, CHUNK_BYTES)
        fout.flush()
        os.fsync(fout.fileno())


def link_synced(src: Path, dst: Path) -> None:
    """`dst` as a second name of `src` (a copy where the two are on different file systems), its
    bytes on disk."""
    try:
        os.link(src, dst)
    except OSError:
        copy_synced(src, dst)
        return
    with dst.open("rb") as f:
        os.fsync(f.fileno())


class ArtifactStore:
    """Adapter artifacts on local disk, addressed by their canonical digest."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        return self.root / "sha256" / check_digest(digest).removeprefix("sha256:")

    def uri(self, digest: str) -> str:
        return self.path(digest).absolute().as_uri()

    def has(self, digest: str) -> bool:
        return self.path(digest).is_dir()

    def get(self, digest: str, pieces: Pieces | None = None) -> Path:
        """The artifact's directory, after checking that its bytes still hash to `digest` (by its
        registered `pieces`, when given)."""
        path = self.path(digest)
        if not path.is_dir():
            raise ArtifactUnavailable(f"{digest} is not in the artifact store {self.root}")
        if pieces is not None:
            read_artifact(path, digest, pieces=pieces)
            return path
        actual = canonical_digest(path)
        if actual != digest:
            raise DigestMismatch(digest, actual, str(path))
        return path

    def size(self, digest: str) -> int:
        path = self.path(digest)
        if not path.is_dir():
            raise ArtifactUnavailable(f"{digest} is not in the artifact store {self.root}")
        return sum((path / name).stat().st_size for name in artifact_files(path))

    def digests(self) -> list[str]:
        base = self.root / "sha256"
        return sorted("sha256:" + p.name for p in base.iterdir()) if base.is_dir() else []

    def put(self, src_dir: str | Path) -> str:
        """Copy an adapter directory in (adapter_config.json and *.safetensors only); returns its
        digest."""
        return self._put(Path(src_dir), pieces=False)[0]

    def put_with_pieces(self, src_dir: str | Path) -> tuple[str, Pieces]:
        """As `put`, with the (BLAKE3) piece list of the copy taken in the read that hashes it."""
        digest, lists = self._put(Path(src_dir), pieces=True)
        return digest, lists[0]

    def put_with_piece_lists(self, src_dir: str | Path) -> tuple[str, tuple[Pieces, Pieces]]:
        """As `put`, with the BLAKE3 and the sha256 piece lists of the copy (what a registration
        records)."""
        return self._put(Path(src_dir), pieces=True)

    def _put(self, src: Path, pieces: bool) -> tuple[str, tuple[Pieces, Pieces] | None]:
        names = _source_files(src)
        # a directory in the store's own work area (an upload's) is the store's: nothing writes
        # its files again, so they are linked rather than copied
        take = link_synced if self.owns(src) else copy_synced
        work = self.temp_dir()
        try:
            for name in names:
                take(src / name, work / name)
            digest, listed = hash_artifact(work, pieces)
            self.adopt(work, digest)
            return digest, listed
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def owns(self, path: Path) -> bool:
        """Whether `path` is in one of the store's work directories (`temp_dir`)."""
        return path.resolve().is_relative_to((self.root / "tmp").resolve())

    def remove(self, digest: str) -> bool:
        path = self.path(digest)
        if not path.is_dir():
            return False
        trash = self.temp_dir()
        # disappears in one step; deleting the bytes may take longer
        os.rename(path, trash / "gone")
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def temp_dir(self) -> Path:
        """A fresh work directory on the store's file system (so that adopting it is one rename)."""
        base = self.root / "tmp"
        base.mkdir(parents=True, exist_ok=True)
        self._clean_stale(base)
        path = Path(tempfile.mkdtemp(prefix="work-", dir=base))
        path.chmod(0o755)
        return path

    def adopt(self, work: Path, digest: str) -> Path:
        """Move a verified work directory into place as `digest`; the caller has checked the
        digest."""
        target = self.path(digest)
        if target.is_dir():
            if canonical_digest(target) == digest:
                os.utime(target)  # in use again: young for the garbage collection's age guard
                return target
            self.remove(digest)  # a damaged copy is replaced, never trusted
        files = [{"name": n, "size": (work / n).stat().st_size} for n in artifact_files(work)]
        index = work / INDEX_FILE
        index.write_text(json.dumps({"digest": digest, "files": files}, indent=1))
        with index.open("rb+") as f:
            os.fsync(f.fileno())
        fsync_dir(work)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(work, target)
        except OSError:
            if not target.is_dir():  # not a concurrent put of the same bytes: a real failure
                raise
        fsync_dir(target.parent)
        return target

    @staticmethod
    def _clean_stale(base: Path) -> None:
        cutoff = time.time() - STALE_TEMP_S
        for entry in base.iterdir():
            with contextlib.suppress(OSError):
                if entry.stat().st_mtime < cutoff:
                    shutil.rmtree(entry)


def _source_files(src: Path) -> list[str]:
    if not src.is_dir():
        raise AdapterRejected("path", f"{src} is not a directory")
    entries = sorted(p.name for p in src.iterdir() if p.is_file())
    pickles = [n for n in entries if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise AdapterRejected(
            "weights",
            f"{pickles[0]} is a pickle file, which can run code when loaded; only *.safetensors is "
            "accepted",
        )
    names = [n for n in entries if is_artifact_name(n)]
    if CONFIG_FILE not in names:
        raise AdapterRejected("config", f"missing {CONFIG_FILE} in {src}")
    if not any(n.endswith(".safetensors") for n in names):
        raise AdapterRejected("weights", f"no *.safetensors file in {src}")
    return names


@contextlib.contextmanager
def serve_store(store: ArtifactStore, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve the store read-only over http in a thread; yields the base URL (`<base>/<hex>` is an
    artifact).

    The same as `python -m http.server --directory <root>/sha256 --bind 127.0.0.1 PORT`.
    """
    directory = store.root / "sha256"
    directory.mkdir(parents=True, exist_ok=True)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(directory), **kwargs)

        def log_message(self, format, *args):  # keep test and server output clean
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    thread = threading.Thread(target=server.serve_forever, name="artifact-http", daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
