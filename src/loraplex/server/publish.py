"""Publishing an adapter without a shared file system: `POST /admin/adapters/{name}/upload` takes
one tar archive of the adapter's files (`adapter_config.json`, safetensors, optionally
`adapter.sig`) in the request body, streamed into a work directory of the artifact store, and
registers it as any registration does (digest, validation, store), with the fast path of a
trainer's next version (`registry.fast_path`). A refused upload leaves nothing behind."""

from __future__ import annotations

import asyncio
import io
import os
import queue
import shutil
import tarfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from loraplex.artifacts import ArtifactStore
from loraplex.lora_format import CONFIG_FILE, PICKLE_SUFFIXES, AdapterRejected
from loraplex.registry import RegistryError
from loraplex.registry.fast_path import SIGNATURE_FILE
from loraplex.server import cutover
from loraplex.server.errors import APIError

if TYPE_CHECKING:
    from loraplex.server.server import Server

DEFAULT_WAIT_S = 60.0
"""How long an upload with `wait=ready` waits for readiness when it names no `timeout`."""
QUEUE_FULL_WAIT_S = 0.002
"""How long an upload's receiving waits for room when the unpacking thread is behind."""
ARCHIVE_TYPES = ("application/x-tar", "application/tar", "application/gzip", "application/x-gzip")


async def upload(
    name: str,
    request: Request,
    revision: str | None = None,
    stable: bool = False,
    keep: int | None = None,
    tenant: str | None = None,
    shared: bool | None = None,
    wait: str | None = None,
    timeout: float = DEFAULT_WAIT_S,
) -> dict:
    """Register the adapter in the body (a tar archive, gzip allowed) as a new revision of `name`:
    `stable` puts all of the name's traffic on it at once, `keep` sets how many revisions the name
    keeps servable. `wait=ready`: answer once this worker holds the new revision in host memory
    (or after `timeout` seconds), with its readiness under `cutover`."""
    server: Server = request.app.state.server
    began = time.perf_counter()
    limit = server.config.settings.max_upload_bytes
    _check_headers(request, limit)
    _check_wait(wait, timeout)
    store = _artifact_store(server)
    work = await run_in_threadpool(store.temp_dir)
    timings = {}
    try:
        adapter_dir = work / "adapter"
        received = await receive(request, adapter_dir, limit)
        timings["receive_s"] = time.perf_counter() - began
        record = await run_in_threadpool(
            server.registry.add_revision,
            adapter_dir,
            name,
            revision=revision,
            tenant=tenant,
            shared=shared,
            base_model_dir=server.engine.model_dir,
            status="stable" if stable else "staging",
            keep=keep,
            fast_path=True,
        )
        timings["register_s"] = time.perf_counter() - began - sum(timings.values())
    finally:
        await run_in_threadpool(shutil.rmtree, work, True)
    server.metrics.published_bytes.inc(received)
    server.metrics.publish_seconds.observe(time.perf_counter() - began)
    await run_in_threadpool(server.pins.warm_name, record.name)  # its pin or warm policy
    answer = record.to_dict()
    if wait is not None:
        here = str(request.base_url).rstrip("/")
        answer["cutover"] = await cutover.cutover_here(server, here, answer, timeout)
        if answer["cutover"]["ready"]:
            server.metrics.publish_ready_seconds.observe(time.perf_counter() - began)
    answer["timings"] = {k: round(v, 4) for k, v in timings.items()}
    return answer


def _check_wait(wait: str | None, timeout: float) -> None:
    if wait not in (None, "ready"):
        raise APIError(
            400,
            f"wait={wait!r}: the one wait is `ready` (every worker holds the new revision)",
            "invalid_value",
            "wait",
        )
    cutover.check_wait_s(timeout, "timeout")


def _check_headers(request: Request, limit: int) -> None:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in ARCHIVE_TYPES:
        raise APIError(
            415 if kind else 400,
            f"send the adapter as one tar archive (Content-Type application/x-tar), not {kind!r}",
            "invalid_value",
            "content-type",
            type="invalid_request_error",
        )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The upload is larger than the limit of {limit} bytes (--max-upload-bytes).",
        "request_too_large",
    )


def _artifact_store(server: Server) -> ArtifactStore:
    """The store an upload is received into; refused before the body is read when the workers
    could not read what it would store."""
    unreachable = server.registry.registration.unreachable_store
    if unreachable is not None:
        raise RegistryError(unreachable)
    store = server.registry.store
    if store is None:
        raise RegistryError(
            "no artifact store configured for this registry (pass store=ArtifactStore(DIR))"
        )
    return store


async def receive(request: Request, out: Path, limit: int) -> int:
    """The body, a tar archive, unpacked into `out` as it arrives (`unpack`, on a thread); the
    bytes received. 413 once the body or the files pass `limit` bytes."""
    body = _Body()
    unpacking = asyncio.ensure_future(run_in_threadpool(body.read_by, unpack, out, limit))
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise _too_large(limit)
            await body.put(chunk)
            if body.reader_gone:
                break  # refused: its error is raised below
        await body.put(b"")
    except BaseException:
        body.stop()
        await asyncio.gather(unpacking, return_exceptions=True)
        raise
    await unpacking
    return received


class _Body(io.RawIOBase):
    """The request body as the unpacking thread reads it: chunks handed over a bounded queue
    (b"": the end)."""

    def __init__(self):
        self._chunks: queue.Queue[bytes] = queue.Queue(maxsize=64)
        self._rest = memoryview(b"")
        self.reader_gone = self.sender_gone = False

    def read_by(self, reader: Callable[..., Path], *args) -> Path:
        """`reader(self, *args)`, on the thread that reads the body."""
        try:
            return reader(self, *args)
        finally:
            self.reader_gone = True

    async def put(self, chunk: bytes) -> None:
        while not self.reader_gone:
            try:
                self._chunks.put_nowait(chunk)
                return
            except queue.Full:  # the thread writes slower than the body comes
                await asyncio.sleep(QUEUE_FULL_WAIT_S)

    def stop(self) -> None:
        """The sender stopped: the reader ends with an error rather than wait."""
        self.sender_gone = True

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._rest:
            try:
                chunk = self._chunks.get(timeout=QUEUE_FULL_WAIT_S * 50)
            except queue.Empty:
                if self.sender_gone:
                    raise EOFError("the upload stopped before its end") from None
                continue
            if not chunk:
                self._chunks.put(b"")  # every later read sees the end too
                return 0
            self._rest = memoryview(chunk)
        n = min(len(buffer), len(self._rest))
        buffer[:n] = self._rest[:n]
        self._rest = self._rest[n:]
        return n


def unpack(body: io.RawIOBase, out: Path, limit: int) -> Path:
    """The archive's files in `out`, each written to disk and synced as it comes: regular files
    at its top level, named as an adapter's files are; AdapterRejected naming the first one that
    is not, and for a pickle."""
    out.mkdir()
    total = 0
    try:
        with tarfile.open(fileobj=io.BufferedReader(body, 1 << 20), mode="r|*") as tar:
            for member in tar:
                name = _member_name(member)
                if name is None:
                    continue
                total += member.size
                if total > limit:
                    raise _too_large(limit)
                with tar.extractfile(member) as src, (out / name).open("xb") as dst:  # type: ignore[union-attr]
                    shutil.copyfileobj(src, dst, 1 << 20)
                    dst.flush()
                    os.fsync(dst.fileno())  # while the next file arrives; the store links it
    except (tarfile.TarError, EOFError) as exc:
        raise AdapterRejected("archive", f"the body is not a tar archive ({exc})") from None
    except FileExistsError as exc:
        raise AdapterRejected(
            "archive", f"{Path(str(exc.filename)).name} is in the archive twice"
        ) from None
    if not (out / CONFIG_FILE).is_file():
        raise AdapterRejected("config", f"missing {CONFIG_FILE} in the archive")
    return out


def _member_name(member: tarfile.TarInfo) -> str | None:
    """The file's name in the adapter directory; None for the archive's top directory."""
    path = PurePosixPath(member.name)
    parts = [p for p in path.parts if p != "."]
    if member.isdir() and not parts:
        return None
    name = parts[0] if len(parts) == 1 else None
    if name is None or not member.isfile():
        raise AdapterRejected(
            "archive",
            f"{member.name}: an upload holds regular files at the top of the archive only",
        )
    if name.endswith(PICKLE_SUFFIXES):
        raise AdapterRejected(
            "weights",
            f"{name} is a pickle file, which can run code when loaded; only *.safetensors is "
            "accepted",
        )
    if name not in (CONFIG_FILE, SIGNATURE_FILE) and not name.endswith(".safetensors"):
        raise AdapterRejected(
            "archive",
            f"{name}: an upload holds {CONFIG_FILE}, *.safetensors and {SIGNATURE_FILE} only",
        )
    return name
