"""`loraplex serve`: build the registry, the engine and the app from the command line's options, and run
uvicorn (one port, or two with the admin API on its own) with a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.lora_format import AdapterRejected
from loraplex.registry import AdapterNotFound, ArtifactStore, Registry, RegistryError
from loraplex.registry.registry import default_store_for
from loraplex.server.app import ServerConfig, create_admin_app, create_app
from loraplex.server.auth import read_admin_token, read_api_keys

log = logging.getLogger("loraplex.server")


class StartupError(Exception):
    """A bad option or input found before serving; the message is the one line printed (exit code 2)."""


@dataclass(frozen=True)
class ServeOptions:
    model: Path
    data_dir: Path
    served_model_name: str | None = None
    lora_modules: tuple[tuple[str, Path], ...] = ()
    max_loras: int = 4
    max_cpu_loras: int | None = None
    cpu_cache_bytes: int | None = None
    disk_cache_bytes: int | None = None
    max_lora_rank: int = 64
    eviction_policy: str = "score"
    dtype: str = "auto"
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    registry: str | None = None
    api_keys: Path | None = None
    admin_token_file: Path | None = None
    admin_port: int | None = None
    allowed_roots: tuple[str, ...] = ()

    @property
    def registry_url(self) -> str:
        return self.registry or f"sqlite:///{self.data_dir / 'registry.db'}"


def parse_lora_module(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise StartupError(f"--lora-modules {text}: expected NAME=DIR")
    return name, Path(path)


def open_registry(options: ServeOptions) -> Registry:
    url = options.registry_url
    store = default_store_for(url) or ArtifactStore(options.data_dir / "artifacts")
    registry = Registry(url, store, base_model_dir=options.model, max_lora_rank=options.max_lora_rank,
                        actor="serve")
    registry.init()
    return registry


def register_lora_modules(registry: Registry, modules: tuple[tuple[str, Path], ...]) -> None:
    """Each `--lora-modules` adapter as a shared, stable revision (validated against the base model first)."""
    for name, path in modules:
        try:
            try:
                existing = registry.show(name)
            except AdapterNotFound:
                existing = None
            if existing is not None and existing.owner_tenant is not None and not existing.shared:
                raise StartupError(f"--lora-modules {name}: the name belongs to tenant {existing.owner_tenant}")
            record = registry.add_revision(path, name, shared=True, status="stable")
            if record.traffic_weight != 100:  # the same bytes as an earlier revision that had left traffic
                registry.promote(name, record.revision, 100, force=True)
        except (AdapterRejected, RegistryError, OSError) as exc:
            raise StartupError(f"--lora-modules {name}: {exc}") from None


def build(options: ServeOptions) -> tuple[FastAPI, FastAPI | None]:
    """The main app and, with --admin-port, the admin app; raises StartupError for bad input."""
    if not (options.model / "config.json").is_file():
        raise StartupError(f"--model {options.model}: not a model directory (no config.json)")
    if options.max_cpu_loras is not None and options.cpu_cache_bytes is not None:
        raise StartupError("give --max-cpu-loras or --cpu-cache-bytes, not both")
    try:
        api_keys = read_api_keys(options.api_keys) if options.api_keys else None
        token = read_admin_token(options.admin_token_file) if options.admin_token_file else None
    except (OSError, ValueError) as exc:
        raise StartupError(str(exc)) from None
    if options.admin_port is not None and token is None:
        raise StartupError("--admin-port needs --admin-token-file")
    registry = open_registry(options)
    register_lora_modules(registry, options.lora_modules)
    engine = LLMEngine(engine_config(options, registry))
    config = ServerConfig(
        served_model_name=options.served_model_name or options.model.resolve().name,
        admin_token=token,
        admin_on_main_app=options.admin_port is None,
        allowed_roots=options.allowed_roots,
        audit_log=options.data_dir / "audit.jsonl",
    )
    app = create_app(engine, registry, config, api_keys)
    return app, create_admin_app(app.state.server) if options.admin_port is not None else None


def engine_config(options: ServeOptions, registry: Registry) -> EngineConfig:
    sizes = {}
    if options.cpu_cache_bytes is not None:
        sizes["cpu_cache_bytes"] = options.cpu_cache_bytes
    if options.disk_cache_bytes is not None:
        sizes["disk_cache_bytes"] = options.disk_cache_bytes
    # The registry's own store is a trusted source of artifacts for the cache's disk tier.
    roots = (*options.allowed_roots, str(registry.store.root.resolve())) if registry.store else options.allowed_roots
    try:
        return EngineConfig(
            model_dir=options.model, dtype=options.dtype, device=options.device, max_loras=options.max_loras,
            max_lora_rank=options.max_lora_rank, max_cpu_loras=options.max_cpu_loras,
            eviction_policy=options.eviction_policy, disk_cache_dir=options.data_dir / "cache",
            allowed_roots=tuple(roots), **sizes,
        )
    except ValueError as exc:
        raise StartupError(str(exc)) from None


# ---- running -------------------------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """Calls `on_exit` when a signal asks to stop (stop admitting), and exits 0 after a graceful shutdown
    (uvicorn would raise the signal again); `handles_signals=False` for a second server in the process."""

    def __init__(self, config: uvicorn.Config, on_exit=None, handles_signals: bool = True):
        super().__init__(config)
        self.on_exit = on_exit
        self.handles_signals = handles_signals

    def handle_exit(self, sig, frame) -> None:
        if self.on_exit is not None:
            self.on_exit()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        if not self.handles_signals:
            yield
            return
        with super().capture_signals():
            yield


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (connections queue from now on, before the app has started)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; without it every
    # response's second write waits for the client's delayed ACK (about 40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(options: ServeOptions) -> None:
    """Serve until SIGTERM/SIGINT; StartupError for bad options (before anything listens)."""
    setup_logging()
    try:
        main_sock = bind(options.host, options.port)
        admin_sock = bind(options.host, options.admin_port) if options.admin_port is not None else None
    except OSError as exc:
        raise StartupError(f"cannot listen on {options.host}: {exc}") from None
    app, admin_app = build(options)
    server = app.state.server
    if server.auth.is_open():
        log.warning("no API keys configured: serving OPEN as tenant 'default' on %s; create keys with "
                    "`loraplex registry key create TENANT` or pass --api-keys FILE", options.host)
    if not server.config.admin_token:
        log.info("admin API off (no --admin-token-file)")
    uv_options = dict(log_config=None, access_log=False, timeout_graceful_shutdown=server.config.shutdown_timeout_s,
                      lifespan="on")
    admin = _Uvicorn(uvicorn.Config(admin_app, lifespan="off", log_config=None, access_log=False),
                     handles_signals=False) if admin_app else None

    def on_exit() -> None:
        server.begin_shutdown()
        if admin is not None:
            admin.should_exit = True

    main = _Uvicorn(uvicorn.Config(app, **uv_options), on_exit=on_exit)
    print(f"loraplex serving {server.config.served_model_name} on {_url(options.host, main_sock)}", flush=True)
    if admin_sock is not None:
        print(f"loraplex admin API on {_url(options.host, admin_sock)}", flush=True)

    async def serve_all() -> None:
        servers = [main.serve(sockets=[main_sock])]
        if admin is not None:
            servers.append(admin.serve(sockets=[admin_sock]))
        await asyncio.gather(*servers)

    asyncio.run(serve_all())


class JsonLogFormatter(logging.Formatter):
    """Structured logs: one JSON object a line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
