"""Fetchers that bring an artifact into the store from file://, http(s)://, s3:// or an OCI
registry (oci://), verified before its one rename into place, and the allowlist of places they may
read from."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from loraplex.artifacts.digests import (
    CHUNK_BYTES,
    Pieces,
    artifact_files,
    canonical_digest,
    check_digest,
    is_artifact_name,
    read_artifact,
)
from loraplex.artifacts.errors import ArtifactUnavailable, DigestMismatch, UnsafeLocation
from loraplex.artifacts.oci import OCI_SCHEMES, OciRef, OciRepository, RegistryAuth, parse_layers
from loraplex.artifacts.s3 import S3Location, s3_client, s3_error
from loraplex.artifacts.store import INDEX_FILE, ArtifactStore, copy_synced

MIN_DOWNLOAD_RATE = 1 << 20
"""Bytes per second a download must keep up on average, after its first `timeout_s`: each read's own
timeout does not end a store that trickles bytes, and such a download would hold a load thread for
good."""


@dataclass(frozen=True)
class AllowList:
    """Where artifacts may come from: local roots for file:// and URL prefixes for http(s)://, s3://
    and oci:// (a registry host and a repository, or a parent of repositories)."""

    roots: tuple[Path, ...] = ()
    prefixes: tuple[str, ...] = ()

    @classmethod
    def parse(cls, items: list[str] | tuple[str, ...]) -> AllowList:
        """Each item is a directory or a URL prefix such as `https://artifacts.internal/loras` or
        `s3://bucket/p`, or `oci://registry.internal/loras`."""
        roots, prefixes = [], []
        for item in items:
            if item.startswith(("http://", "https://", "s3://", "oci://", "oci+http://")):
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
            # an OCI manifest is `REPOSITORY@sha256:...`: the repository is what lies under a prefix
            path = parts.path.partition("@")[0] if parts.scheme in OCI_SCHEMES else parts.path
            if same_place and (path == base or path.startswith(base + "/")):
                return
        raise UnsafeLocation(
            f"{uri} is not under an allowed storage prefix "
            f"({', '.join(self.prefixes) or 'none set'})"
        )


def _split_checked(uri: str):
    parts = urlsplit(uri)
    if parts.scheme not in ("file", "http", "https", "s3", *OCI_SCHEMES):
        raise UnsafeLocation(
            f"{uri}: unsupported scheme {parts.scheme!r} (file, http, https, s3, oci, oci+http)"
        )
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
    oci_auth: RegistryAuth | None = None,
) -> Path:
    """Bring an artifact into `dest` (download, verify, one rename) and return its local directory.
    A caller that fetches often passes its own `http_client` (an httpx.Client): a new one loads the
    CA bundle, about 50 ms of CPU with the GIL held.

    `timeout_s` bounds each network operation; a download as a whole must also end within
    `timeout_s` plus its bytes (from the store's index) at `min_rate` bytes per second, or it fails
    with ArtifactUnavailable. `pieces`: the registry's piece list for `digest`, to check the bytes
    on several cores. `oci_auth`: logins for oci:// stores (default: `RegistryAuth.from_environ()`,
    read at the fetch)."""
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
        oci_auth,
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
    oci_auth: RegistryAuth | None = None,
) -> Fetched:
    """As `fetch_artifact`, and what `read_artifact(path, digest, use, pieces)` would then give,
    taken from the read that verifies the download before its rename: a remote load reads and hashes
    its bytes once, not twice. When the bytes match but `use` fails (an adapter this server cannot
    serve), the download is not kept: a failed load leaves the store as it was (its budget would
    push out an artifact that serves)."""
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
        elif scheme in OCI_SCHEMES:
            deadline = _Deadline(timeout_s, min_rate)
            _fetch_oci(storage_uri, work, deadline, http_client, oci_auth)
        else:
            _fetch_s3(storage_uri, work, _Deadline(timeout_s, min_rate), s3_client)
        download_s = time.perf_counter() - start
        try:
            if use is None and pieces is None:
                # nothing to keep: hashed as it is read, not held in memory
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
            copy_synced(src / name, work / name)
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
    """When a download must be done by: `timeout_s` from now, plus its bytes at `min_rate`, once
    they are known."""

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
                    # as they come
                    _write_bounded(response.iter_bytes(), out, size, f"{base}/{name}", deadline)
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
    where = S3Location.parse(uri)
    client = s3_client(deadline.timeout_s) if client is None else client
    try:
        index = client.get_object(Bucket=where.bucket, Key=where.key(INDEX_FILE))["Body"].read()
        for name, size in deadline.allow(_checked_index(index, uri)):
            body = client.get_object(Bucket=where.bucket, Key=where.key(name))["Body"]
            with (work / name).open("wb") as out:
                _write_bounded(
                    iter(functools.partial(body.read, CHUNK_BYTES), b""),
                    out,
                    size,
                    f"{uri}/{name}",
                    deadline,
                )
    except (UnsafeLocation, ArtifactUnavailable):
        raise
    except Exception as exc:  # botocore raises many unrelated types; all mean "not available now"
        raise s3_error(uri, exc) from None


def _fetch_oci(
    uri: str, work: Path, deadline: _Deadline, client, auth: RegistryAuth | None
) -> None:
    """The manifest `uri` names, then each file's blob, every one checked against its sha256 as
    it is written (the caller then checks the adapter's own digest over the files)."""
    ref = OciRef.parse(uri)
    if ref.digest is None:
        raise UnsafeLocation(f"{uri}: name the manifest by its digest (@sha256:...)")
    import httpx  # here: only http and oci stores need it

    auth = RegistryAuth.from_environ() if auth is None else auth
    try:
        with contextlib.ExitStack() as stack:
            if client is None:
                client = stack.enter_context(httpx.Client(timeout=deadline.timeout_s))
            repo = OciRepository(ref, auth, client, deadline.timeout_s)
            layers = parse_layers(repo.manifest(ref.digest), uri)
            deadline.allow([(layer.name, layer.size) for layer in layers])
            for layer in layers:
                where = f"{uri} ({layer.name})"
                with repo.blob(layer.digest) as chunks, (work / layer.name).open("wb") as out:
                    h = hashlib.sha256()
                    _write_bounded(_hashed(chunks, h), out, layer.size, where, deadline)
                actual = "sha256:" + h.hexdigest()
                if actual != layer.digest:
                    raise DigestMismatch(layer.digest, actual, where)
    except httpx.HTTPError as exc:
        raise ArtifactUnavailable(f"{uri}: {type(exc).__name__}: {exc}") from None


def _hashed(chunks, h):
    for chunk in chunks:
        h.update(chunk)
        yield chunk
