"""Fixtures of the server tests (helpers in harness.py): `start(...)` runs a server, `running` is
one shared by a module's tests, `adapter_variants` gives 20 adapters with distinct bytes."""

from __future__ import annotations

import contextlib

import pytest
from harness import ADMIN_TOKEN, MODEL, Running, api_keys, make_registry, serving, variant

from loraplex.engines.native.client import EngineClient
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.server.app import ServerConfig, create_app


@pytest.fixture(scope="session")
def adapter_variants(llama_adapters, tmp_path_factory):
    """20 adapter directories with distinct bytes (from attn-r8 and mlp-r4)."""
    root = tmp_path_factory.mktemp("variants")
    sources = [llama_adapters["attn-r8"], llama_adapters["mlp-r4"]]
    return [variant(sources[i % 2], root / f"v{i:02d}", 1.0 + 0.05 * i) for i in range(20)]


@pytest.fixture(scope="session")
def start(llama_dir, llama_adapters, tmp_path_factory, request):
    """start(keys=True, engine={...}, engine_core=None, **server_config) -> context manager yielding
    a Running server; `engine_core` "process" runs the engine in its own process (default: the
    run's --engine-core)."""

    @contextlib.contextmanager
    def run(
        keys: bool = True,
        engine: dict | None = None,
        registry_setup=None,
        engine_core: str | None = None,
        **config,
    ):
        tmp = tmp_path_factory.mktemp("server")
        registry = make_registry(tmp, llama_dir, llama_adapters)
        if registry_setup is not None:
            registry_setup(registry)
        engine_args = dict(
            model_dir=llama_dir,
            dtype="float32",
            max_loras=2,
            kv_cache_memory_bytes=8 * 2**20,
            max_lora_rank=16,
        )
        engine_args.update(engine or {})
        config.setdefault("admin_token", ADMIN_TOKEN)
        config.setdefault("audit_log", tmp / "audit.jsonl")
        core = engine_core or request.config.getoption("engine_core")
        make = EngineClient if core == "process" else LLMEngine
        app = create_app(
            make(EngineConfig(**engine_args)),
            registry,
            ServerConfig(MODEL, **config),
            api_keys() if keys else None,
        )
        try:
            with serving(app) as url:
                yield Running(url, app.state.server, registry, tmp)
        finally:
            registry.close()

    return run


@pytest.fixture(scope="module")
def running(start):
    """One server shared by a module's tests (alice/bob keys, admin on, default limits)."""
    with start() as r:
        yield r
