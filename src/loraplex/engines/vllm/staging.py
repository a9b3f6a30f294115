"""The staged copies vLLM reads: each adapter's digest-verified files in a private directory,
read-only, hashed again before an add unless their fingerprint shows them unchanged since they were
verified; the copies of adapters vLLM no longer holds are kept, up to a byte budget, for a re-add
without a copy from the source."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from loraplex.artifacts import DigestMismatch, read_artifact
from loraplex.lora_format import CONFIG_FILE, WEIGHTS_FILE, parse_safetensors_header
from loraplex.residency.disk import DiskTier
from loraplex.residency.fetch import fetch
from loraplex.residency.key import AdapterKey, AdapterRef


class Fingerprint(NamedTuple):
    """What the file system says of a staged copy: the directory's and each entry's inode, size,
    mtime and ctime. Writing a file, adding, removing or renaming an entry, or changing a mode
    changes a ctime, and no process can set a ctime back, so an equal fingerprint is the same
    bytes as when it was taken (docs/cache.md says where a ctime falls short)."""

    directory: tuple[int, int, int]
    files: tuple[tuple[str, int, int, int, int], ...]


def fingerprint(directory: Path) -> Fingerprint:
    d = os.stat(directory)
    files = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        st = entry.stat(follow_symlinks=False)
        files.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return Fingerprint((d.st_ino, d.st_mtime_ns, d.st_ctime_ns), tuple(files))


class Verified(NamedTuple):
    """A staged copy as its hash found it: its fingerprint then, its size and its `vllm_shape`."""

    fingerprint: Fingerprint
    nbytes: int
    shape: str | None


def vllm_shape(files: Mapping[str, bytes | memoryview]) -> str | None:
    """What vLLM's add checks of an adapter, as one digest: its files' names, the fields of its
    config that vLLM reads, and its tensors' names, dtypes and shapes. vLLM refuses an adapter for
    its rank, features, modules or sizes, never for its values: it takes an adapter of a shape it
    has taken. None: not an adapter it would read."""
    try:
        config = json.loads(bytes(files[CONFIG_FILE]))
        tensors = parse_safetensors_header(files[WEIGHTS_FILE]).tensors
    except (KeyError, ValueError):  # AdapterRejected is a ValueError
        return None
    read = _config_fields_vllm_reads()
    if isinstance(config, dict) and read is not None:  # not a name or a revision, say
        config = {k: v for k, v in config.items() if k in read}
    layout = sorted((name, t["dtype"], t["shape"]) for name, t in tensors.items())
    text = json.dumps([sorted(files), config, layout], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _config_fields_vllm_reads() -> frozenset[str] | None:
    """The `adapter_config.json` fields vLLM's adapter load reads (its `PEFTHelper`'s)."""
    try:
        from vllm.lora.peft_helper import PEFTHelper
    except ImportError:  # every field counts
        return None
    return frozenset(f.name for f in dataclasses.fields(PEFTHelper))


class StagedCopies:
    """The staging directory of one vLLM engine. `stage` runs on its worker threads; `in_use(name)`
    tells whether vLLM holds or a load reads the copy `name` (such a copy is never dropped)."""

    def __init__(
        self,
        stage_dir: Path,
        *,
        disk: DiskTier | None,
        kept_bytes: int,
        threads: int,
        in_use: Callable[[str], bool],
    ):
        self.stage_dir = Path(stage_dir)
        self.stage_dir.mkdir(parents=True, exist_ok=True)
        self.stage_dir.chmod(0o700)  # private: only loraplex's user can change a staged copy
        self.disk = disk
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="vllm-stage")
        self._in_use = in_use
        self._lock = threading.Lock()
        # Staged copies of adapters vLLM no longer holds, kept for a re-add up to `kept_bytes`
        # (name -> bytes, least recently removed first), and every staged copy as verified: a load
        # and the re-add after an unpin use it unhashed while its fingerprint is unchanged.
        self.kept_bytes = kept_bytes
        self._kept: OrderedDict[str, int] = OrderedDict()
        self._kept_total = 0
        self._verified: dict[str, Verified] = {}
        self._adopt_leftovers()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def stage(self, ref: AdapterRef) -> tuple[int, dict[str, float], str | None]:
        """Worker thread: the artifact's digest-checked bytes written to its staging directory (what
        vLLM reads), read-only; a staged copy is used again as verified while its fingerprint is
        unchanged and hashed again otherwise (`trusted`), so a file changed there is never served.
        Returns its size, the stages' seconds and its `vllm_shape`."""
        stages, target = {}, self.path(ref.key)
        start = time.perf_counter()
        if target.is_dir():
            verified = self.trusted(target) or self.verify(target, ref.key.adapter_digest)
            if verified is not None:
                stages["disk"] = time.perf_counter() - start
                return verified.nbytes, stages, verified.shape
            shutil.rmtree(target, ignore_errors=True)  # changed: staged again from the source
        checked_s = time.perf_counter() - start  # a changed staged copy's check, if any
        fetched = fetch(ref, self.disk)
        files = fetched.result
        stages.update(fetched.stages, disk=fetched.stages["disk"] + checked_s)
        work = self.stage_dir / f".{target.name}.{threading.get_ident()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for name, data in files.items():
            (work / name).write_bytes(data)
            (work / name).chmod(0o444)
        shutil.rmtree(target, ignore_errors=True)
        work.rename(target)
        nbytes, shape = sum(len(v) for v in files.values()), vllm_shape(files)
        with self._lock:
            self._verified[target.name] = Verified(fingerprint(target), nbytes, shape)
        return nbytes, stages, shape

    def verify(self, target: Path, digest: str) -> Verified | None:
        """The staged copy `target` hashed: as verified when its bytes are those of `digest`, else
        None. Its fingerprint is taken before and after, so that the hashed bytes are the
        fingerprint's (the one `trusted` checks)."""
        before = fingerprint(target)
        try:
            files = read_artifact(target, digest)
        except DigestMismatch:
            return None
        if fingerprint(target) != before:
            return None  # changed while it was hashed
        verified = Verified(before, sum(len(v) for v in files.values()), vllm_shape(files))
        with self._lock:
            self._verified[target.name] = verified
        return verified

    def trusted(self, target: Path) -> Verified | None:
        """The staged copy `target` as verified when nothing has changed it since: its fingerprint
        is the same now (a stat per entry, no read)."""
        with self._lock:
            verified = self._verified.get(target.name)
        if verified is None:
            return None
        try:
            now = fingerprint(target)
        except OSError:
            return None
        return verified if now == verified.fingerprint else None

    def is_unchanged(self, key: AdapterKey) -> bool:
        """Whether the staged copy of `key` is as verified (a stat per entry: fit for the loop)."""
        return self.trusted(self.path(key)) is not None

    def path(self, key: AdapterKey) -> Path:
        return self.stage_dir / key.adapter_digest.removeprefix("sha256:")

    def has(self, key: AdapterKey) -> bool:
        return self.path(key).is_dir()

    def unstage(self, key: AdapterKey, nbytes: int) -> None:
        """The staged copy of an adapter vLLM no longer holds (vLLM reads it only to add) is kept
        for a re-add while the kept copies fit in `kept_bytes`; the least recently removed go
        first."""
        target = self.path(key)
        if not target.is_dir() or target.name in self._kept:
            return
        self._kept[target.name] = max(1, nbytes)
        self._kept_total += self._kept[target.name]
        self._trim()

    def _adopt_leftovers(self) -> None:
        """Staged copies that an earlier process left count as kept, the oldest first, so the
        budget bounds them too (without a fingerprint, each is hashed before its first add); its
        unfinished work directories go."""
        if not self.stage_dir.is_dir():
            return
        copies = []
        for path in self.stage_dir.iterdir():
            if path.name.startswith("."):
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir():
                nbytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
                copies.append((path.stat().st_mtime_ns, path.name, max(1, nbytes)))
        for _, name, nbytes in sorted(copies):
            self._kept[name] = nbytes
            self._kept_total += nbytes
        self._trim()

    def _trim(self) -> None:
        while self._kept and self._kept_total > self.kept_bytes:
            name, nbytes = self._kept.popitem(last=False)
            self._kept_total -= nbytes
            if not self._in_use(name):
                self._drop(self.stage_dir / name)

    def reuse(self, key: AdapterKey) -> None:
        """A kept copy that a load staged from: vLLM holds it again, outside the kept bytes."""
        nbytes = self._kept.pop(self.path(key).name, None)
        if nbytes is not None:
            self._kept_total -= nbytes

    def _drop(self, target: Path) -> None:
        with self._lock:
            self._verified.pop(target.name, None)
        trash = self.stage_dir / f".removed.{target.name}.{uuid.uuid4().hex}"
        with contextlib.suppress(FileNotFoundError):
            target.rename(trash)  # at once: a later load of the key stages afresh
            self.executor.submit(shutil.rmtree, trash, True)
