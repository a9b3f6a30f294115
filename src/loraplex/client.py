"""Publishing adapters from a trainer: `Publisher(url, admin_token)` sends an adapter to a loraplex
server's (or router's) upload endpoint, `POST /admin/adapters/{name}/upload`, as one tar archive
streamed in the request body, and returns the revision the registry made of it.

The adapter comes from a directory (`publish_dir`), a PEFT model (`publish_model`) or a state dict
and its config in memory (`publish_tensors`); no temporary directory is made. HTTP only: torch,
safetensors and PEFT are imported when an in-memory adapter is published.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CHUNK_BYTES = 1 << 20
BLOCK = tarfile.BLOCKSIZE


@dataclass(frozen=True)
class Published:
    """The revision a publish made (or found: the same bytes again give the same revision)."""

    name: str
    revision: str
    digest: str
    status: str
    record: dict[str, Any]
    """The registry's record of the revision, as the server answered it."""
    cutover: Cutover | None = None
    """With `wait=True`: each worker's readiness to serve the revision."""

    @property
    def model(self) -> str:
        """The model to request this revision by: `name@revision`."""
        return f"{self.name}@{self.revision}"


@dataclass(frozen=True)
class WorkerReadiness:
    """One worker's readiness for the new revision: `tier` is where its copy is (gpu, cpu: ready);
    `error` says why it is not ready (its load failed, the worker did not answer)."""

    worker: str
    ready: bool
    tier: str | None
    error: str | None
    seconds: float


@dataclass(frozen=True)
class Cutover:
    """A waited publish's readiness: `ready` once every worker of the name's pool holds it."""

    ready: bool
    seconds: float
    workers: tuple[WorkerReadiness, ...]

    @property
    def not_ready(self) -> tuple[WorkerReadiness, ...]:
        return tuple(w for w in self.workers if not w.ready)

    @classmethod
    def of(cls, answer: dict[str, Any]) -> Cutover:
        workers = tuple(
            WorkerReadiness(w["worker"], w["ready"], w.get("tier"), w.get("error"), w["seconds"])
            for w in answer["workers"]
        )
        return cls(answer["ready"], answer["seconds"], workers)


class PublishError(Exception):
    """The server refused the publish: its status and the OpenAI-shaped error's fields."""

    def __init__(self, status: int, message: str, code: str | None, param: str | None):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.code = code
        self.param = param


class Publisher:
    """A trainer's connection to one server or router URL, with the admin token."""

    def __init__(self, url: str, admin_token: str, timeout_s: float = 600.0):
        self._http = httpx.Client(
            base_url=url.rstrip("/"),
            headers={"Authorization": f"Bearer {admin_token}"},
            timeout=timeout_s,
        )

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def publish_dir(self, name: str, directory: str | Path, **options) -> Published:
        """The adapter directory's `adapter_config.json`, safetensors and `adapter.sig` (if any).
        `options`: stable, keep, revision, tenant, shared, wait, wait_timeout_s (`publish`)."""
        directory = Path(directory)
        files = sorted(
            p
            for p in directory.iterdir()
            if p.is_file()
            and (p.name in (CONFIG_FILE, "adapter.sig") or p.name.endswith(".safetensors"))
        )
        members = [(p.name, p.stat().st_size, _file_chunks(p)) for p in files]
        return self.publish(name, members, **options)

    def publish_tensors(
        self, name: str, tensors: Mapping[str, Any], config: Mapping[str, Any], **options
    ) -> Published:
        """A state dict (PEFT's keys, `base_model.model.….lora_A.weight`) and its adapter config,
        serialized in memory."""
        from safetensors.torch import save

        weights = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
        config_bytes = json.dumps(dict(config), indent=2, sort_keys=True, default=_jsonable)
        return self.publish(
            name,
            [_member(CONFIG_FILE, config_bytes.encode()), _member(WEIGHTS_FILE, weights)],
            **options,
        )

    def publish_model(
        self, name: str, model: Any, adapter: str = "default", **options
    ) -> Published:
        """A PEFT model's adapter `adapter`: its LoRA weights and its config, as
        `save_pretrained` would write them."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model, adapter_name=adapter)
        config = model.peft_config[adapter].to_dict()
        return self.publish_tensors(name, state, config, **options)

    def publish(
        self,
        name: str,
        members: list[tuple[str, int, Iterator[bytes]]],
        stable: bool = False,
        keep: int | None = None,
        revision: str | None = None,
        tenant: str | None = None,
        shared: bool | None = None,
        wait: bool = False,
        wait_timeout_s: float = 60.0,
    ) -> Published:
        """Send the files (name, size, their bytes in chunks) as one tar archive. `stable`: the
        new revision takes all of the name's traffic at once; `keep`: the name keeps its newest
        `keep` revisions servable, the older ones are retired; `wait`: return once every worker
        of the name's pool holds the new revision (or after `wait_timeout_s`), with each one's
        readiness in `cutover`."""
        params: dict[str, Any] = {"stable": str(stable).lower()}
        if wait:
            params.update(wait="ready", timeout=wait_timeout_s)
        optional = {"keep": keep, "revision": revision, "tenant": tenant, "shared": shared}
        for key, value in optional.items():
            if value is not None:
                params[key] = str(value).lower() if isinstance(value, bool) else value
        response = self._http.post(
            f"/admin/adapters/{name}/upload",
            params=params,
            content=tar_stream(members),
            headers={"Content-Type": "application/x-tar"},
        )
        if response.status_code != 200:
            raise _refusal(response)
        record = response.json()
        cutover = Cutover.of(record["cutover"]) if "cutover" in record else None
        return Published(
            record["name"], record["revision"], record["digest"], record["status"], record, cutover
        )


def tar_stream(members: list[tuple[str, int, Iterator[bytes]]]) -> Iterator[bytes]:
    """An uncompressed tar archive of regular files, made as it is sent."""
    for name, size, chunks in members:
        info = tarfile.TarInfo(name)
        info.size, info.mode = size, 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        sent = 0
        for chunk in chunks:
            sent += len(chunk)
            yield chunk
        if sent != size:
            raise ValueError(f"{name} changed while it was sent ({sent} bytes, not {size})")
        if size % BLOCK:
            yield bytes(BLOCK - size % BLOCK)
    yield bytes(2 * BLOCK)  # the end of the archive


def _member(name: str, data: bytes) -> tuple[str, int, Iterator[bytes]]:
    view = memoryview(data)
    chunks = (bytes(view[i : i + CHUNK_BYTES]) for i in range(0, len(view), CHUNK_BYTES))
    return name, len(data), chunks


def _file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


def _jsonable(value: Any) -> Any:
    """PEFT's configs hold sets (target_modules) and enums (task_type)."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    return getattr(value, "value", str(value))


def _refusal(response: httpx.Response) -> PublishError:
    try:
        error = response.json()["error"]
        return PublishError(
            response.status_code, error["message"], error.get("code"), error.get("param")
        )
    except (ValueError, KeyError, TypeError):
        return PublishError(response.status_code, response.text[:500], None, None)


__all__ = ["Cutover", "PublishError", "Published", "Publisher", "WorkerReadiness", "tar_stream"]
