"""Content-addressed artifact store, and fetchers that bring an artifact in from file://, http(s):// or s3://.

Layout under the root (the same tree serves as an http store, see `serve_store`):

    <root>/sha256/<hex>/adapter_config.json
    <root>/sha256/<hex>/adapter_model.safetensors
    <root>/sha256/<hex>/index.json        # {"digest", "files": [{"name", "size"}]}; not part of the digest
    <root>/tmp/                           # work dirs; an entry becomes visible only by one rename
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import mmap
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import blake3

from loraplex.lora_format import CONFIG_FILE, PICKLE_SUFFIXES
from loraplex.registry.errors import (
    AdapterRejected,
    ArtifactUnavailable,
    DigestMismatch,
    UnsafeLocation,
)

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# The only files an artifact may hold; a name that does not match never becomes a path.
ARTIFACT_NAME_RE = re.compile(
    r"^(adapter_config\.json|[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.safetensors)$"
)
INDEX_FILE = "index.json"
STALE_TEMP_S = 3600
_CHUNK = 1 << 20
_READ_CHUNK = (
    4 << 20
)  # bytes read, then handed to the hasher, at a time: the packing waits on whole chunks
_HUGE_PAGES_FROM = 16 << 20  # bytes; below, a file is read into heap memory
PIECE_BYTES_MIN = 1 << 20
PIECES_MAX = (
    256  # per artifact, about: bounds the list a registry row keeps (64 hex digits a piece)
)
MIN_DOWNLOAD_RATE = 1 << 20
"""Bytes per second a download must keep up on average, after its first `timeout_s`: each read's own timeout
does not end a store that trickles bytes, and such a download would hold a load thread for good."""


def check_digest(digest: str) -> str:
    """The digest itself, or UnsafeLocation when it is not `sha256:` and 64 lowercase hex digits."""
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise UnsafeLocation(f"{digest!r} is not a digest (expected sha256:<64 hex digits>)")
    return digest


def is_artifact_name(name: str) -> bool:
    return bool(ARTIFACT_NAME_RE.fullmatch(name)) and ".." not in name


def artifact_files(directory: Path) -> list[str]:
    """Names of the files that make up the artifact in `directory`, sorted (they are ASCII)."""
    return sorted(
        p.name for p in Path(directory).iterdir() if is_artifact_name(p.name) and p.is_file()
    )


@dataclass(frozen=True)
class Pieces:
    """The hash of every piece of every artifact file (pieces of `size` bytes from each file's start, the last one
    shorter), taken at registration in the same read as the digest. The same file names, sizes and piece hashes are
    the same bytes, so a load can check an artifact faster than by one sha256 over it: on several cores, and with
    BLAKE3, about twice sha256's speed on one core here (SHA-NI included). A piece list is trusted from the
    registry only, never from the store that holds the bytes."""

    size: int
    files: tuple[tuple[str, int, tuple[str, ...]], ...]
    """(name, bytes, hex hash of each piece), in name order."""
    algorithm: str = "blake3"
    """`blake3` (256-bit output), or `sha256` in lists recorded by versions without BLAKE3."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "piece_bytes": self.size,
                "algorithm": self.algorithm,
                "files": [
                    {"name": n, "size": size, self.algorithm: list(h)} for n, size, h in self.files
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Pieces:
        try:
            data = json.loads(text)
            size = int(data["piece_bytes"])
            # a list recorded by a version without BLAKE3 pieces names no algorithm
            algorithm = data.get("algorithm", "sha256")
            if algorithm not in PIECE_HASHES:
                raise ValueError(f"unknown piece hash {algorithm!r}")
            files = tuple(
                (str(f["name"]), int(f["size"]), tuple(map(str, f[algorithm])))
                for f in data["files"]
            )
        except (ValueError, KeyError, TypeError, OverflowError, AttributeError) as exc:
            raise ValueError(f"not a piece list ({exc})") from None
        for name, nbytes, hashes in files:
            if (
                size <= 0
                or nbytes < 0
                or len(hashes) != -(-nbytes // size)
                or not all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes)
            ):
                raise ValueError(f"not a piece list (file {name!r})")
        return cls(size, files, algorithm)


PIECE_HASHES: dict[str, Callable] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}
"""Piece hash name → constructor. Both release the GIL over a large buffer, so hasher threads run in parallel."""


def piece_bytes(total: int) -> int:
    """The piece size for an artifact of `total` bytes: 1 MiB, doubled until it has about PIECES_MAX pieces."""
    size = PIECE_BYTES_MIN
    while size * PIECES_MAX < total:
        size *= 2
    return size


def canonical_digest(directory: str | Path) -> str:
    """sha256 over, for each artifact file in name order: b"<name>\\n<size>\\n" then the file's bytes."""
    return _digest(Path(directory), pieces=False)[0]


def digest_and_pieces(directory: str | Path) -> tuple[str, Pieces]:
    """The canonical digest and the (BLAKE3) piece list, from one read of the files."""
    digest, lists = _digest(Path(directory), pieces=True)
    return digest, lists[0]


def _digest(directory: Path, pieces: bool) -> tuple[str, tuple[Pieces, Pieces] | None]:
    """The digest and, with `pieces`, the BLAKE3 and the sha256 piece lists, from one read."""
    names = artifact_files(directory)
    piece = (
        piece_bytes(sum((directory / name).stat().st_size for name in names)) if pieces else _CHUNK
    )
    h, files, sha_files = hashlib.sha256(), [], []
    for name in names:
        with (directory / name).open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(_file_prefix(name, size))
            hashes, sha_hashes, read = [], [], 0
            while chunk := f.read(piece):
                h.update(chunk)
                read += len(chunk)
                if pieces:
                    hashes.append(blake3.blake3(chunk).hexdigest())
                    sha_hashes.append(hashlib.sha256(chunk).hexdigest())
        if (
            pieces and read != size
        ):  # the digest says `size`: the pieces must describe the same bytes
            raise ArtifactUnavailable(f"{directory / name} changed while it was hashed")
        files.append((name, size, tuple(hashes)))
        sha_files.append((name, size, tuple(sha_hashes)))
    if not pieces:
        return "sha256:" + h.hexdigest(), None
    return "sha256:" + h.hexdigest(), (
        Pieces(piece, tuple(files), "blake3"),
        Pieces(piece, tuple(sha_files), "sha256"),
    )


def read_artifact(
    directory: str | Path, digest: str, use: Callable | None = None, pieces: Pieces | None = None
):
    """Every artifact file's bytes, read once into memory; DigestMismatch unless they hash to `digest`.

    The bytes returned are the bytes hashed: a file changed on disk after the check is never used, as it could be
    by hashing the file and then opening it again to parse it.

    With `use`, returns `use(files, hashed)` instead, which runs while a helper thread is still hashing, so that
    parsing and packing overlap the digest check. `hashed(name, end)` returns once the first `end` bytes of file
    `name` are hashed: `use` may overwrite bytes only below that. Its result is returned only when the digest
    matches and dropped otherwise; when both fail, the mismatch is what is raised.

    With `pieces` (the registry's piece list for `digest`), the files must have the listed names and sizes and
    each piece its listed hash, checked by a pool of threads (one sha256 runs on one core at about 1.4 GB/s, one
    BLAKE3 at about 2.7 GB/s).
    """
    check_digest(digest)
    directory = Path(directory)
    names = artifact_files(directory)
    if pieces is not None and names != [name for name, _, _ in pieces.files]:
        raise DigestMismatch(digest, f"other files ({', '.join(names) or 'none'})", str(directory))
    # sha256 and BLAKE3 release the GIL on large buffers, so helper threads hash each chunk while the next one is
    # read (and while `use` runs). One running sha256 has one worker (its updates stay in order); pieces have one
    # per core but the one this thread reads and packs on (a third thread on two cores is 5-20%
    # slower), up to 8, and this thread hashes those no helper has begun when it waits for them
    # (`_PieceCheck.wait`).
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    threads = (
        1 if pieces is None else max(1, min(cores - 1, 8, sum(len(h) for _, _, h in pieces.files)))
    )
    with ThreadPoolExecutor(threads, thread_name_prefix="sha256") as hasher:
        if pieces is None:
            progress = _HashProgress(hasher)
            files = {
                name: _read_hashing(directory / name, name, progress, _READ_CHUNK) for name in names
            }
        else:
            progress = _PieceCheck(hasher, pieces)
            files = {
                name: _read_hashing(directory / name, name, progress, pieces.size, (digest, size))
                for name, size, _ in pieces.files
            }
        result, error = files, None
        if use is not None:
            try:
                result = use(files, progress.wait)
            except Exception as exc:  # noqa: BLE001 (re-raised below, unless the bytes were not the artifact's)
                error = exc
        mismatch = progress.mismatch(digest)
    if mismatch is not None:
        raise DigestMismatch(digest, mismatch, str(directory)) from error
    if error is not None:
        raise error
    return result


class _Progress:
    """Chunks handed to the hasher threads, per file in order; `wait(name, end)` blocks until the first `end` bytes
    of `name` are hashed."""

    def __init__(self, hasher: ThreadPoolExecutor):
        self.hasher = hasher
        self.chunks: dict[
            str, list[tuple[int, Future | _Job]]
        ] = {}  # name -> (end offset, its hashing), in order
        self.hashed: dict[str, int] = {}  # name -> how many of its chunks are known to be hashed

    def wait(self, name: str, end: int) -> None:
        chunks, i = self.chunks.get(name, []), self.hashed.get(name, 0)
        while i < len(chunks) and (i == 0 or chunks[i - 1][0] < end):
            chunks[i][1].result()
            i += 1
        self.hashed[name] = i


class _HashProgress(_Progress):
    """One running sha256 over the files in order, fed chunk by chunk on the hasher thread."""

    def __init__(self, hasher: ThreadPoolExecutor):
        super().__init__(hasher)
        self.sha256 = hashlib.sha256()

    def add(self, name: str, data, end: int) -> None:
        if end == 0:
            data = _file_prefix(
                name, len(data)
            )  # the file's size, as the canonical digest starts it
        self.chunks.setdefault(name, []).append((end, self.hasher.submit(self.sha256.update, data)))

    def mismatch(self, digest: str) -> str | None:
        actual = (
            "sha256:" + self.hasher.submit(self.sha256.hexdigest).result()
        )  # after every update
        return None if actual == digest else actual


class _PieceCheck(_Progress):
    """Each piece hashed on its own and compared with the registered list. A thread that waits for pieces hashes
    the ones no hasher thread has begun, instead of sitting idle: on two cores the load thread, once it has read
    the files, is the second hasher while packing waits for the check."""

    def __init__(self, hasher: ThreadPoolExecutor, pieces: Pieces):
        super().__init__(hasher)
        self.expected = {name: hashes for name, _, hashes in pieces.files}
        self.hash = PIECE_HASHES[pieces.algorithm]
        self.jobs: list[_Job] = []  # every piece's, in the order read
        self.unclaimed = 0  # the jobs before this one are all begun

    def add(self, name: str, data, end: int) -> None:
        if end == 0:
            return  # the name and size were checked against the list before the read
        chunks = self.chunks.setdefault(name, [])
        job = _Job(_piece_matches, self.hash, data, self.expected[name][len(chunks)])
        chunks.append((end, job))
        self.jobs.append(job)
        self.hasher.submit(job.run)

    def wait(self, name: str, end: int) -> None:
        chunks, i = self.chunks.get(name, []), self.hashed.get(name, 0)
        while i < len(chunks) and (i == 0 or chunks[i - 1][0] < end):
            job = chunks[i][1]
            job.run()  # here, unless a hasher thread has begun it; then take later pieces meanwhile
            while not job.done.is_set() and self.unclaimed < len(self.jobs):
                self.jobs[self.unclaimed].run()
                self.unclaimed += 1
            job.result()
            i += 1
        self.hashed[name] = i

    def mismatch(self, digest: str) -> str | None:
        for name, chunks in self.chunks.items():
            for i, (_, matches) in enumerate(chunks):
                if not matches.result():
                    return f"other bytes in piece {i} of {name}"
        return None


class _Job:
    """A call run once, by whichever thread comes to it first (`run`); `result` runs it unless it has begun, then
    waits for it and returns its value or raises its error."""

    __slots__ = ("fn", "args", "claim", "done", "value", "error")

    def __init__(self, fn: Callable, *args):
        self.fn, self.args = fn, args
        self.claim = threading.Lock()  # held for good by the thread that runs it
        self.done = threading.Event()
        self.value = self.error = None

    def run(self) -> None:
        if not self.claim.acquire(blocking=False):
            return
        try:
            self.value = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 (raised by `result`, on the thread that asks)
            self.error = exc
        finally:
            self.done.set()

    def result(self):
        self.run()
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


def _piece_matches(hash_type: Callable, data, expected: str) -> bool:
    return hash_type(data).hexdigest() == expected


def _file_prefix(name: str, size: int) -> bytes:
    return f"{name}\n{size}\n".encode()


def _read_hashing(
    path: Path, name: str, progress, chunk_bytes: int, expect: tuple[str, int] | None = None
):
    """The file's bytes, each chunk handed to `progress` once read. `expect`: (digest, size) the file must have."""
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if expect is not None and size != expect[1]:
            raise DigestMismatch(
                expect[0], f"{name} of {size} bytes, not {expect[1]}", str(path.parent)
            )
        data = _file_buffer(size)
        progress.add(name, data, 0)
        for start in range(0, size, chunk_bytes):
            chunk = data[start : start + chunk_bytes]
            _read_exactly(f, chunk, path)
            progress.add(name, chunk, start + len(chunk))
    return data


def _file_buffer(size: int) -> memoryview:
    """Private memory for a file's bytes. A large file goes on huge pages where the kernel grants them: a read into
    fresh 4 KiB pages spends two thirds of its time faulting them in (600 ms against 190 ms for 320 MB, x86_64
    Linux). A small one goes on the heap, whose freed pages malloc hands out again without a fault."""
    if size < _HUGE_PAGES_FROM:
        return memoryview(bytearray(size))
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(buffer)


def _read_exactly(f, into: memoryview, path: Path) -> None:
    done = 0
    while done < len(into):
        n = f.readinto(into[done:])
        if not n:
            raise ArtifactUnavailable(f"{path} got shorter while it was read")
        done += n


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_synced(src: Path, dst: Path) -> None:
    with src.open("rb") as fin, dst.open("wb") as fout:
        shutil.copyfileobj(fin, fout, _CHUNK)
        fout.flush()
        os.fsync(fout.fileno())


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
        """The artifact's directory, after checking that its bytes still hash to `digest` (by its registered
        `pieces`, when given)."""
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
        """Copy an adapter directory in (adapter_config.json and *.safetensors only); returns its digest."""
        return self._put(Path(src_dir), pieces=False)[0]

    def put_with_pieces(self, src_dir: str | Path) -> tuple[str, Pieces]:
        """As `put`, with the (BLAKE3) piece list of the copy taken in the read that hashes it."""
        digest, lists = self._put(Path(src_dir), pieces=True)
        return digest, lists[0]

    def put_with_piece_lists(self, src_dir: str | Path) -> tuple[str, tuple[Pieces, Pieces]]:
        """As `put`, with the BLAKE3 and the sha256 piece lists of the copy (what a registration records)."""
        return self._put(Path(src_dir), pieces=True)

    def _put(self, src: Path, pieces: bool) -> tuple[str, tuple[Pieces, Pieces] | None]:
        names = _source_files(src)
        work = self.temp_dir()
        try:
            for name in names:
                _copy_synced(src / name, work / name)
            digest, listed = _digest(work, pieces)
            self.adopt(work, digest)
            return digest, listed
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def remove(self, digest: str) -> bool:
        path = self.path(digest)
        if not path.is_dir():
            return False
        trash = self.temp_dir()
        os.rename(
            path, trash / "gone"
        )  # disappears in one step; deleting the bytes may take longer
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
        """Move a verified work directory into place as `digest`; the caller has checked the digest."""
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
        _fsync_dir(work)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(work, target)
        except OSError:
            if not target.is_dir():  # not a concurrent put of the same bytes: a real failure
                raise
        _fsync_dir(target.parent)
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
            f"{pickles[0]} is a pickle file, which can run code when loaded; only *.safetensors is accepted",
        )
    names = [n for n in entries if is_artifact_name(n)]
    if CONFIG_FILE not in names:
        raise AdapterRejected("config", f"missing {CONFIG_FILE} in {src}")
    if not any(n.endswith(".safetensors") for n in names):
        raise AdapterRejected("weights", f"no *.safetensors file in {src}")
    return names


@dataclass(frozen=True)
class AllowList:
    """Where artifacts may come from: local roots for file:// and URL prefixes for http(s):// and s3://."""

    roots: tuple[Path, ...] = ()
    prefixes: tuple[str, ...] = ()

    @classmethod
    def parse(cls, items: list[str] | tuple[str, ...]) -> AllowList:
        """Each item is a directory or a URL prefix such as `https://artifacts.internal/loras` or `s3://bucket/p`."""
        roots, prefixes = [], []
        for item in items:
            if item.startswith(("http://", "https://", "s3://")):
                prefixes.append(item.rstrip("/"))
            else:
                path = unquote(urlsplit(item).path) if item.startswith("file://") else item
                roots.append(Path(path).resolve())
        return cls(roots=tuple(roots), prefixes=tuple(prefixes))

    def root_for(self, uri: str) -> Path:
        """The allowed root a file:// URI lies in (after following symlinks)."""
        parts = _split_checked(uri)
        if parts.netloc not in ("", "localhost"):
            raise UnsafeLocation(f"{uri}: file:// URIs must be local")
        path = Path(unquote(parts.path))
        if not path.is_absolute():
            raise UnsafeLocation(f"{uri}: a file:// URI needs an absolute path")
        real = path.resolve()
        for root in self.roots:
            if real.is_relative_to(root.resolve()):
                return root.resolve()
        raise UnsafeLocation(
            f"{uri} is outside the allowed roots ({', '.join(map(str, self.roots)) or 'none set'})"
        )

    def check(self, uri: str) -> None:
        """Raise UnsafeLocation unless `uri` lies under an allowed root or URL prefix."""
        parts = _split_checked(uri)
        if parts.scheme == "file":
            self.root_for(uri)
            return
        for prefix in self.prefixes:
            allowed = urlsplit(prefix)
            same_place = (allowed.scheme, allowed.hostname, allowed.port) == (
                parts.scheme,
                parts.hostname,
                parts.port,
            )
            base = allowed.path.rstrip("/")
            if same_place and (parts.path == base or parts.path.startswith(base + "/")):
                return
        raise UnsafeLocation(
            f"{uri} is not under an allowed storage prefix ({', '.join(self.prefixes) or 'none set'})"
        )


def _split_checked(uri: str):
    parts = urlsplit(uri)
    if parts.scheme not in ("file", "http", "https", "s3"):
        raise UnsafeLocation(f"{uri}: unsupported scheme {parts.scheme!r} (file, http, https, s3)")
    if parts.username or parts.password:
        raise UnsafeLocation(f"{uri}: credentials in a storage URI are refused")
    path = unquote(parts.path)
    if "\\" in path or "\0" in path or any(seg in ("..", ".") for seg in path.split("/")):
        raise UnsafeLocation(f"{uri}: '..', '.' and backslashes are refused in storage paths")
    return parts


def fetch_artifact(
    storage_uri: str,
    digest: str,
    dest: ArtifactStore,
    allowed: AllowList,
    timeout_s: float = 30.0,
    s3_client=None,
    http_client=None,
    min_rate: float = MIN_DOWNLOAD_RATE,
    pieces: Pieces | None = None,
) -> Path:
    """Bring an artifact into `dest` (download, verify, one rename) and return its local directory. A caller that
    fetches often passes its own `http_client` (an httpx.Client): a new one loads the CA bundle, about 50 ms of CPU
    with the GIL held.

    `timeout_s` bounds each network operation; a download as a whole must also end within `timeout_s` plus its
    bytes (from the store's index) at `min_rate` bytes per second, or it fails with ArtifactUnavailable.
    `pieces`: the registry's piece list for `digest`, to check the bytes on several cores."""
    check_digest(digest)
    if dest.has(digest):
        try:
            return dest.get(digest, pieces)
        except DigestMismatch:
            dest.remove(digest)  # a damaged local copy is replaced by a fresh download
    return fetch_and_read(
        storage_uri,
        digest,
        dest,
        allowed,
        None,
        timeout_s,
        s3_client,
        http_client,
        min_rate,
        pieces,
    ).path


@dataclass(frozen=True)
class Fetched:
    path: Path
    """The artifact's directory in the store."""
    result: object
    """What `read_artifact(path, digest, use, pieces)` gives."""
    download_s: float | None
    """Seconds the transfer took; None when the store had the artifact."""


def fetch_and_read(
    storage_uri: str,
    digest: str,
    dest: ArtifactStore,
    allowed: AllowList,
    use: Callable | None,
    timeout_s: float = 30.0,
    s3_client=None,
    http_client=None,
    min_rate: float = MIN_DOWNLOAD_RATE,
    pieces: Pieces | None = None,
) -> Fetched:
    """As `fetch_artifact`, and what `read_artifact(path, digest, use, pieces)` would then give, taken from the read
    that verifies the download before its rename: a remote load reads and hashes its bytes once, not twice. When
    the bytes match but `use` fails (an adapter this server cannot serve), the download is not kept: a failed load
    leaves the store as it was (its budget would push out an artifact that serves)."""
    check_digest(digest)
    if dest.has(digest):
        try:
            return Fetched(
                dest.path(digest), read_artifact(dest.path(digest), digest, use, pieces), None
            )
        except DigestMismatch:
            dest.remove(digest)  # a damaged local copy is replaced by a fresh download
    allowed.check(storage_uri)
    scheme = urlsplit(storage_uri).scheme
    work = dest.temp_dir()
    try:
        start = time.perf_counter()
        if scheme == "file":
            _fetch_file(storage_uri, work, allowed.root_for(storage_uri))
        elif scheme in ("http", "https"):
            _fetch_http(storage_uri, work, _Deadline(timeout_s, min_rate), http_client)
        else:
            _fetch_s3(storage_uri, work, _Deadline(timeout_s, min_rate), s3_client)
        download_s = time.perf_counter() - start
        try:
            if (
                use is None and pieces is None
            ):  # nothing to keep: hashed as it is read, not held in memory
                actual, result = canonical_digest(work), None
                if actual != digest:
                    raise DigestMismatch(digest, actual, storage_uri)
            else:
                result = read_artifact(work, digest, use, pieces)
        except DigestMismatch as exc:
            raise DigestMismatch(digest, exc.actual, storage_uri) from None
        return Fetched(dest.adopt(work, digest), result, download_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fetch_file(uri: str, work: Path, root: Path) -> None:
    src = Path(unquote(urlsplit(uri).path))
    if not src.is_dir():
        raise ArtifactUnavailable(f"{uri}: no such artifact directory")
    for name in artifact_files(src):
        if not (src / name).resolve().is_relative_to(root):
            raise UnsafeLocation(f"{uri}: {name} is a symlink out of the allowed root {root}")
        try:
            _copy_synced(src / name, work / name)
        except OSError as exc:
            raise ArtifactUnavailable(f"{uri}: cannot read {name} ({exc})") from None


def _checked_index(raw: bytes, uri: str) -> list[tuple[str, int]]:
    try:
        files = json.loads(raw)["files"]
        entries = [(str(f["name"]), int(f["size"])) for f in files]
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactUnavailable(f"{uri}/{INDEX_FILE} is not a valid index ({exc})") from None
    for name, size in entries:
        if not is_artifact_name(name) or size < 0:
            raise UnsafeLocation(
                f"{uri}/{INDEX_FILE} lists {name!r}, which is not an artifact file name"
            )
    return entries


class _Deadline:
    """When a download must be done by: `timeout_s` from now, plus its bytes at `min_rate`, once they are known."""

    def __init__(self, timeout_s: float, min_rate: float):
        self.timeout_s, self.min_rate = timeout_s, min_rate
        self.at = time.monotonic() + timeout_s
        self.limit_s = timeout_s

    def allow(self, entries: list[tuple[str, int]]) -> list[tuple[str, int]]:
        extra = sum(size for _, size in entries) / self.min_rate
        self.at += extra
        self.limit_s += extra
        return entries

    def check(self, where: str) -> None:
        if time.monotonic() > self.at:
            raise ArtifactUnavailable(
                f"{where}: the download took longer than {self.limit_s:.0f} s "
                f"(slower than {self.min_rate / 2**20:g} MiB/s)"
            )


def _fetch_http(uri: str, work: Path, deadline: _Deadline, client=None) -> None:
    import httpx  # here: only http stores need it, and it is slow to import for every CLI command

    base, timeout_s = uri.rstrip("/"), deadline.timeout_s
    try:
        with contextlib.ExitStack() as stack:
            if client is None:
                client = stack.enter_context(
                    httpx.Client(timeout=timeout_s, follow_redirects=False)
                )
            index = client.get(f"{base}/{INDEX_FILE}", timeout=timeout_s)
            index.raise_for_status()
            for name, size in deadline.allow(_checked_index(index.content, base)):
                with (
                    client.stream("GET", f"{base}/{name}", timeout=timeout_s) as response,
                    (work / name).open("wb") as out,
                ):
                    response.raise_for_status()
                    _write_bounded(
                        response.iter_bytes(), out, size, f"{base}/{name}", deadline
                    )  # as they come
    except httpx.HTTPError as exc:
        raise ArtifactUnavailable(f"{uri}: {type(exc).__name__}: {exc}") from None


def _write_bounded(chunks, out, size: int, where: str, deadline: _Deadline) -> None:
    written = 0
    for chunk in chunks:
        deadline.check(where)
        written += len(chunk)
        if written > size:
            raise ArtifactUnavailable(f"{where} sent more than the {size} bytes its index lists")
        out.write(chunk)
    deadline.check(where)
    out.flush()
    os.fsync(out.fileno())


def _fetch_s3(uri: str, work: Path, deadline: _Deadline, client) -> None:
    parts = urlsplit(uri)
    timeout_s = deadline.timeout_s
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if client is None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ArtifactUnavailable(
                "s3:// storage needs boto3: pip install 'loraplex[s3]'"
            ) from None
        client = boto3.client(
            "s3", config=Config(connect_timeout=timeout_s, read_timeout=timeout_s)
        )
    try:
        index = client.get_object(Bucket=bucket, Key=f"{prefix}/{INDEX_FILE}")["Body"].read()
        for name, size in deadline.allow(_checked_index(index, uri)):
            body = client.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"]
            with (work / name).open("wb") as out:
                _write_bounded(
                    iter(lambda: body.read(_CHUNK), b""), out, size, f"{uri}/{name}", deadline
                )
    except (UnsafeLocation, ArtifactUnavailable):
        raise
    except Exception as exc:  # botocore raises many unrelated types; all mean "not available now"
        raise ArtifactUnavailable(f"{uri}: {type(exc).__name__}: {exc}") from None


@contextlib.contextmanager
def serve_store(store: ArtifactStore, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve the store read-only over http in a thread; yields the base URL (`<base>/<hex>` is an artifact).

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
