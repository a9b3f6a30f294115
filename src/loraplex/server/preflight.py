"""The checks `serve` makes on this machine's files and network before it writes, binds or loads
anything, made without doing any of it: `serve` runs them first, and `serve --print-config` runs
them as its whole check."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from loraplex.artifacts import AllowList, is_oci_uri
from loraplex.artifacts.s3 import is_s3_uri
from loraplex.registry.db import check_database_url
from loraplex.registry.errors import RegistryError
from loraplex.registry.registration import check_storage_base
from loraplex.server.startup import StartupError
from loraplex.settings.serve import ServeSettings

ROOT_SCHEMES = ("file", "http", "https", "s3", "oci", "oci+http")
"""The schemes an --allowed-roots URL prefix may have (a plain path is a directory)."""


def check_machine(options: ServeSettings, ports: bool) -> None:
    """The data directory, the store, the allowed roots, --lora-modules, the registry URL's form,
    and with `ports` that the ports are free to listen on (each bound and let go at once)."""
    check_writable_dir(options.data_dir, "--data-dir")
    if options.store is not None:
        check_writable_dir(options.store, "--store")
    check_push_base(options.storage_base)
    check_allowed_roots(options.allowed_roots)
    for name, path in options.lora_modules:
        if not Path(path).is_dir():
            raise StartupError(f"--lora-modules {name}={path}: no such directory")
    check_registry_url(options.registry_url, "--registry" if options.registry else "--data-dir")
    if not ports:
        return
    check_port(options.host, options.port, "--port")
    if options.admin_port is not None:
        check_port(options.host, options.admin_port, "--admin-port")


def check_writable_dir(path: Path, flag: str) -> None:
    """A directory serve may write in, or may make: the nearest one that exists must be a
    directory this process can write."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StartupError(f"{flag} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StartupError(f"{flag} {path}: {existing} is not writable")


def check_push_base(base: str | None) -> None:
    """--storage-base: an OCI repository or an S3 prefix, the stores a worker uploads revisions
    to."""
    if base is None:
        return
    try:
        check_storage_base(base)
    except RegistryError as exc:
        raise StartupError(f"--storage-base: {exc}") from None
    if not (is_oci_uri(base) or is_s3_uri(base)):
        raise StartupError(
            f"--storage-base {base}: serve uploads revisions to an OCI repository "
            "(oci://HOST/REPOSITORY, oci+http:// for plain http) or an S3 prefix "
            "(s3://BUCKET/PREFIX) only; for a directory every worker mounts, give --store DIR"
        )


def check_allowed_roots(roots: tuple[str, ...]) -> None:
    """Each item a directory that exists, or a URL prefix of a scheme artifacts are read from."""
    for item in roots:
        scheme, sep, _ = item.partition("://")
        if sep and scheme not in ROOT_SCHEMES:
            raise StartupError(
                f"--allowed-roots {item}: unsupported scheme {scheme!r}; give a directory or a URL "
                f"prefix of {', '.join(ROOT_SCHEMES)}"
            )
        if sep and scheme != "file":
            continue
        root = AllowList.parse([item]).roots[0]
        if not root.is_dir():
            raise StartupError(f"--allowed-roots {item}: no such directory")


def check_registry_url(url: str, flag: str) -> None:
    unset = re.fullmatch(r"\$\((\w+)\)", url)  # a Kubernetes reference to an unset variable
    if unset:
        raise StartupError(
            f"--registry {url}: the environment variable {unset[1]} is not set "
            "(in Kubernetes: the Secret or key it comes from is missing)"
        )
    try:
        check_database_url(url)
    except RegistryError as exc:
        raise StartupError(f"{flag}: cannot open the registry: {exc}") from None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (connections queue from now on, before the app has started)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; without
    # it every response's second write waits for the client's delayed ACK (about 40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def listen(host: str, port: int, flag: str) -> socket.socket:
    try:
        return bind(host, port)
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
        raise StartupError(f"{flag} {port}: cannot listen on {host}: {exc}") from None


def check_port(host: str, port: int, flag: str) -> None:
    listen(host, port, flag).close()
