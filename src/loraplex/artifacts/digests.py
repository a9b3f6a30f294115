"""Artifact digests and piece lists: what names an artifact may hold, the canonical sha256 over its
files, the per-piece hashes a registration records, and the one read that checks the bytes it
returns."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3

from loraplex.artifacts.errors import ArtifactUnavailable, DigestMismatch, UnsafeLocation

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# The only files an artifact may hold; a name that does not match never becomes a path.
ARTIFACT_NAME_RE = re.compile(
    r"^(adapter_config\.json|[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.safetensors)$"
)
CHUNK_BYTES = 1 << 20
# bytes read, then handed to the hasher, at a time: the packing waits on whole chunks
_READ_CHUNK = 4 << 20
_HUGE_PAGES_FROM = 16 << 20  # bytes; below, a file is read into heap memory
PIECE_BYTES_MIN = 1 << 20
PIECES_MAX = (
    256  # per artifact, about: bounds the list a registry row keeps (64 hex digits a piece)
)


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
    """The hash of every piece of every artifact file (pieces of `size` bytes from each file's
    start, the last one shorter), taken at registration in the same read as the digest. The same
    file names, sizes and piece hashes are the same bytes, so a load can check an artifact faster
    than by one sha256 over it: on several cores, and with BLAKE3, about twice sha256's speed on one
    core here (SHA-NI included). A piece list is trusted from the registry only, never from the
    store that holds the bytes."""

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
"""Piece hash name → constructor. Both release the GIL over a large buffer, so hasher threads run in
parallel."""


def piece_bytes(total: int) -> int:
    """The piece size for an artifact of `total` bytes: 1 MiB, doubled until it has about PIECES_MAX
    pieces."""
    size = PIECE_BYTES_MIN
    while size * PIECES_MAX < total:
        size *= 2
    return size


def canonical_digest(directory: str | Path) -> str:
    """sha256 over, for each artifact file in name order: b"<name>\\n<size>\\n" then the file's
    bytes."""
    return hash_artifact(Path(directory), pieces=False)[0]


def digest_and_pieces(directory: str | Path) -> tuple[str, Pieces]:
    """The canonical digest and the (BLAKE3) piece list, from one read of the files."""
    digest, lists = hash_artifact(Path(directory), pieces=True)
    return digest, lists[0]


def hash_artifact(directory: Path, pieces: bool) -> tuple[str, tuple[Pieces, Pieces] | None]:
    """The digest and, with `pieces`, the BLAKE3 and the sha256 piece lists, from one read."""
    names = artifact_files(directory)
    piece = (
        piece_bytes(sum((directory / name).stat().st_size for name in names))
        if pieces
        else CHUNK_BYTES
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
        if pieces and read != size:
            # the digest says `size`: the pieces must describe the same bytes
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
    """Every artifact file's bytes, read once into memory; DigestMismatch unless they hash to
    `digest`.

    The bytes returned are the bytes hashed: a file changed on disk after the check is never used,
    as it could be by hashing the file and then opening it again to parse it.

    With `use`, returns `use(files, hashed)` instead, which runs while a helper thread is still
    hashing, so that parsing and packing overlap the digest check (an artifact of one chunk or less
    is hashed on this thread as it is read: there is nothing to overlap). `hashed(name, end)`
    returns once the first `end` bytes of file `name` are hashed: `use` may overwrite bytes only
    below that. Its result is returned only when the digest matches and dropped otherwise; when
    both fail, the mismatch is what is raised.

    With `pieces` (the registry's piece list for `digest`), the files must have the listed names and
    sizes and each piece its listed hash, checked by a pool of threads (one sha256 runs on one core
    at about 1.4 GB/s, one BLAKE3 at about 2.7 GB/s).
    """
    check_digest(digest)
    directory = Path(directory)
    names = artifact_files(directory)
    if pieces is not None and names != [name for name, _, _ in pieces.files]:
        raise DigestMismatch(digest, f"other files ({', '.join(names) or 'none'})", str(directory))
    with _hashers(directory, names, pieces) as hasher:
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


def _hashers(directory: Path, names: list[str], pieces: Pieces | None):
    """The threads that hash an artifact's chunks while the next is read.

    sha256 and BLAKE3 release the GIL on large buffers, so helper threads hash each chunk while the
    next one is read (and while `use` runs). One running sha256 has one worker (its updates stay in
    order); pieces have one per core but the one this thread reads and packs on (a third thread on
    two cores is 5-20% slower), up to 8, and this thread hashes those no helper has begun when it
    waits for them (`_PieceCheck.wait`). Up to one chunk, a helper thread overlaps nothing and costs
    its start: this thread hashes.
    """
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    threads = (
        1 if pieces is None else max(1, min(cores - 1, 8, sum(len(h) for _, _, h in pieces.files)))
    )
    total = sum((directory / name).stat().st_size for name in names)
    return _OnThisThread() if total <= _READ_CHUNK else ThreadPoolExecutor(threads, "sha256")


class _OnThisThread:
    """A hasher pool that runs each call at once, on the thread that submits it."""

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 (raised by the future's result, as a pool's)
            future.set_exception(exc)
        return future

    def __enter__(self) -> _OnThisThread:
        return self

    def __exit__(self, *exc) -> bool:
        return False


class _Progress:
    """Chunks handed to the hasher threads, per file in order; `wait(name, end)` blocks until the
    first `end` bytes of `name` are hashed."""

    def __init__(self, hasher: ThreadPoolExecutor):
        self.hasher = hasher
        # name -> (end offset, its hashing), in order
        self.chunks: dict[str, list[tuple[int, Future | _Job]]] = {}
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
            # the file's size, as the canonical digest starts it
            data = _file_prefix(name, len(data))
        self.chunks.setdefault(name, []).append((end, self.hasher.submit(self.sha256.update, data)))

    def mismatch(self, digest: str) -> str | None:
        # after every update
        actual = "sha256:" + self.hasher.submit(self.sha256.hexdigest).result()
        return None if actual == digest else actual


class _PieceCheck(_Progress):
    """Each piece hashed on its own and compared with the registered list. A thread that waits for
    pieces hashes the ones no hasher thread has begun, instead of sitting idle: on two cores the
    load thread, once it has read the files, is the second hasher while packing waits for the
    check."""

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
    """A call run once, by whichever thread comes to it first (`run`); `result` runs it unless it
    has begun, then waits for it and returns its value or raises its error."""

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
    """The file's bytes, each chunk handed to `progress` once read. `expect`: (digest, size) the
    file must have."""
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
    """Private memory for a file's bytes. A large file goes on huge pages where the kernel grants
    them: a read into fresh 4 KiB pages spends two thirds of its time faulting them in (600 ms
    against 190 ms for 320 MB, x86_64 Linux). A small one goes on the heap, whose freed pages malloc
    hands out again without a fault."""
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
