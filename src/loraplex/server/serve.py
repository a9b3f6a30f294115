"""`loraplex serve`: build the registry, the engine and the app from the command line's options, and
run uvicorn (one port, or two with the admin API on its own) with a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import uvicorn
from fastapi import FastAPI
from sqlalchemy.exc import ArgumentError, DatabaseError

from loraplex.artifacts import ArtifactError, ArtifactStore
from loraplex.host_memory import freeze_startup
from loraplex.lora_format import AdapterRejected
from loraplex.model_config import ModelConfig
from loraplex.registry import AdapterNotFound, Registry, RegistryError
from loraplex.registry.registry import default_store_for
from loraplex.registry.signing import load_public_key
from loraplex.registry.store import unreachable_store
from loraplex.server.auth import read_admin_token, read_api_keys
from loraplex.server.engines import engine_config, lora_module_check, make_engine
from loraplex.server.preflight import check_machine, check_registry_url, listen
from loraplex.server.protocol import OneSendPerTurn
from loraplex.server.startup import StartupError, flag_message
from loraplex.settings.serve import ServeSettings
from loraplex.settings.serve_values import SCORE_WEIGHTS

if TYPE_CHECKING:  # imported where used: it is slow to import for every CLI command
    from loraplex.server.config import ServerConfig

log = logging.getLogger("loraplex.server")
T = TypeVar("T")


def eviction_policy(options: ServeSettings):
    """The cache's policy, with `--score-weights` and `--min-residency-s` applied to score."""
    from loraplex.residency.policy import LRUPolicy, ScorePolicy

    if options.eviction_policy == "lru":  # the settings refuse score's terms with lru
        return LRUPolicy()
    fields = {SCORE_WEIGHTS[name]: weight for name, weight in options.score_weights}
    if options.min_residency_s is not None:
        fields["min_residency_s"] = options.min_residency_s
    return ScorePolicy(**fields)


def read_option_file(read: Callable[[Path], T], path: Path | None, flag: str) -> T | None:
    """`read(path)` for a file option (None without one); what is wrong with the file as a
    StartupError."""
    if path is None:
        return None
    try:
        return read(path)
    except UnicodeDecodeError as exc:
        raise StartupError(
            f"{flag}: {path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    except (
        OSError,
        ValueError,
    ) as exc:  # missing, unreadable, or a line that is not what it should be
        raise StartupError(f"{flag}: {exc}") from None


def make_dir(path: Path, flag: str) -> None:
    """The directory a flag names, with its parents."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StartupError(f"{flag} {path}: not a directory") from None
    except OSError as exc:
        raise StartupError(f"{flag} {path}: {exc.strerror or exc}") from None


def check_model_dir(model: Path) -> None:
    """Fail fast on the base model's config.json, before the registry opens and the weights load."""
    path = model / "config.json"
    if not path.is_file():
        raise StartupError(f"--model {model}: not a model directory (no config.json)")
    try:
        ModelConfig.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:  # unreadable, not JSON, or a ModelConfigError
        raise StartupError(f"--model {model}: config.json: {exc}") from None
    except KeyError as exc:
        raise StartupError(f"--model {model}: config.json has no {exc}") from None


def artifact_store(options: ServeSettings) -> ArtifactStore:
    """--store, else the SQLite registry's own store, else DATA_DIR/artifacts."""
    if options.store is not None:
        return ArtifactStore(options.store)
    return default_store_for(options.registry_url) or ArtifactStore(options.data_dir / "artifacts")


def open_registry(options: ServeSettings, trusted_keys: tuple = ()) -> Registry:
    # Not the URL in the message: a server database's URL may hold a password.
    flag = "--registry" if options.registry else f"--data-dir {options.data_dir}"
    url = options.registry_url
    check_registry_url(url, flag)
    try:
        store = artifact_store(options)
        registry = Registry(
            url,
            store,
            storage_base=options.storage_base,
            unreachable_store=unreachable_store(
                url, options.storage_base, options.store is not None, store.root
            ),
            base_model_dir=options.model,
            max_lora_rank=options.max_lora_rank,
            trusted_keys=trusted_keys,
            grace_period_s=options.grace_period_s,
            actor="serve",
            strict_base_model_name=options.strict_base_model_name,
        )
        registry.init()
    except (
        RegistryError,
        OSError,
        ImportError,
    ) as exc:  # ImportError: the database's driver is not installed
        raise StartupError(f"{flag}: cannot open the registry: {exc}") from None
    except (
        ArgumentError,
        DatabaseError,
    ) as exc:  # an unknown URL; a database that cannot be reached or read
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise StartupError(f"{flag}: cannot open the registry: {reason}") from None
    return registry


def register_lora_modules(
    registry: Registry,
    modules: tuple[tuple[str, Path], ...],
    engine_check: Callable[[Path], None] | None = None,
) -> None:
    """Each `--lora-modules` adapter as a shared, stable revision (validated against the base model
    first, and by `engine_check`: what the engine cannot serve is refused before it is added)."""
    for name, path in modules:
        try:
            if engine_check is not None:
                engine_check(path)
            try:
                existing = registry.show(name)
            except AdapterNotFound:
                existing = None
            if existing is not None and existing.owner_tenant is not None and not existing.shared:
                raise StartupError(
                    f"--lora-modules {name}: the name belongs to tenant {existing.owner_tenant}"
                )
            record = registry.add_revision(path, name, shared=True, status="stable")
            if (
                record.traffic_weight != 100
            ):  # the same bytes as an earlier revision that had left traffic
                registry.promote(name, record.revision, 100, force=True)
        except (AdapterRejected, RegistryError, ArtifactError, OSError) as exc:
            raise StartupError(f"--lora-modules {name}: {exc}") from None


class Inputs(NamedTuple):
    """What serve reads from its option files, and the configuration made from its options."""

    api_keys: dict | None
    admin_token: str | None
    metrics_token: str | None
    trusted_keys: tuple
    config: ServerConfig
    policy: object


def check_inputs(options: ServeSettings) -> Inputs:
    """The base model's config.json, the option files and the configurations made from the
    options, read and checked; StartupError naming the flag for the first that is wrong."""
    check_model_dir(options.model)
    api_keys = read_option_file(read_api_keys, options.api_keys, "--api-keys")
    token = read_option_file(read_admin_token, options.admin_token_file, "--admin-token-file")
    metrics_token = read_option_file(
        read_admin_token, options.metrics_token_file, "--metrics-token-file"
    )
    trusted = tuple(
        read_option_file(load_public_key, path, "--trusted-key") for path in options.trusted_key
    )
    config = server_config(options, token, metrics_token)
    policy = eviction_policy(options)
    engine_config(options)
    return Inputs(api_keys, token, metrics_token, trusted, config, policy)


def preflight(options: ServeSettings) -> None:
    """Every check serve makes before it writes, binds or loads, without doing any of it (the
    ports are bound and let go): what `serve --print-config` checks."""
    check_inputs(options)
    check_machine(options, ports=True)


def build(options: ServeSettings) -> tuple[FastAPI, FastAPI | None]:
    """The main app and, with --admin-port, the admin app; raises StartupError for bad input."""
    # Every option checked before anything is written (the registry, --lora-modules' revisions).
    inputs = check_inputs(options)
    check_machine(options, ports=False)  # `run` has bound them already
    make_dir(options.data_dir, "--data-dir")
    registry = open_registry(options, inputs.trusted_keys)
    register_lora_modules(registry, options.lora_modules, lora_module_check(options))
    config = inputs.config
    engine = make_engine(options, registry, config.served_model_name, inputs.policy)
    # torch, only once every option has passed: a bad one exits in a second, not after the import
    from loraplex.server.app import create_admin_app, create_app

    try:
        app = create_app(engine, registry, config, inputs.api_keys)
    except OSError as exc:  # the audit log cannot be opened
        raise StartupError(
            f"--audit-log {config.audit_log}: cannot open the audit log: {exc.strerror or exc}"
        ) from None
    return app, create_admin_app(app.state.server) if options.admin_port is not None else None


def server_config(
    options: ServeSettings, admin_token: str | None, metrics_token: str | None
) -> ServerConfig:
    from loraplex.server.config import ServerConfig

    try:
        return ServerConfig.from_settings(options, admin_token, metrics_token)
    except ValueError as exc:
        raise StartupError(flag_message(str(exc))) from None


# ---- running -------------------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """Calls `on_exit` when a signal asks to stop (stop admitting), and exits 0 after a graceful
    shutdown (uvicorn would raise the signal again); `handles_signals=False` for a second server in
    the process."""

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


def _url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _log_exposure(server, host: str) -> None:
    """Warn when the API is open to any caller; say when the admin API is off."""
    if server.auth.is_open():
        log.warning(
            "no API keys configured: serving OPEN as tenant 'default' on %s; create keys with "
            "`loraplex registry key create TENANT` or pass --api-keys FILE",
            host,
        )
    if not server.config.admin_token:
        log.info("admin API off (no --admin-token-file)")


def run(options: ServeSettings) -> None:
    """Serve until SIGTERM/SIGINT; StartupError for bad options (before anything listens)."""
    setup_logging()
    main_sock = listen(options.host, options.port, "--port")
    admin_sock = (
        listen(options.host, options.admin_port, "--admin-port")
        if options.admin_port is not None
        else None
    )
    app, admin_app = build(options)
    freeze_startup()
    server = app.state.server
    _log_exposure(server, options.host)
    uv_options = dict(
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=server.config.settings.shutdown_timeout_s,
        lifespan="on",
    )
    admin = (
        _Uvicorn(
            uvicorn.Config(admin_app, lifespan="off", log_config=None, access_log=False),
            handles_signals=False,
        )
        if admin_app
        else None
    )

    def on_exit() -> None:
        server.begin_shutdown()
        if admin is not None:
            admin.should_exit = True

    main = _Uvicorn(uvicorn.Config(app, http=OneSendPerTurn, **uv_options), on_exit=on_exit)
    print(
        f"loraplex serving {server.config.served_model_name} on {_url(options.host, main_sock)}",
        flush=True,
    )
    if admin_sock is not None:
        print(f"loraplex admin API on {_url(options.host, admin_sock)}", flush=True)

    async def serve_all() -> None:
        servers = [main.serve(sockets=[main_sock])]
        if admin is not None:
            servers.append(admin.serve(sockets=[admin_sock]))
        await asyncio.gather(*servers)

    # uvicorn's loop (uvloop where installed): `Server.run` would pick it, `asyncio.run` does not
    with asyncio.Runner(loop_factory=main.config.get_loop_factory()) as runner:
        runner.run(serve_all())


class JsonLogFormatter(logging.Formatter):
    """Structured logs: one JSON object a line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
