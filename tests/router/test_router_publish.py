"""An adapter published through the router (`loraplex.client` against the router's URL) reaches a
real worker's upload endpoint over sockets and then serves through the router."""

import sys
from pathlib import Path

import httpx
import pytest

from loraplex.client import Publisher, PublishError
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.router.app import RouterConfig, create_router_app
from loraplex.server.app import ServerConfig, create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import (  # noqa: E402 (the server tests' helpers)
    ADMIN_TOKEN,
    KEYS,
    MODEL,
    api_keys,
    make_registry,
    serving,
)


@pytest.fixture(scope="module")
def fleet(llama_dir, llama_adapters, tmp_path_factory):
    """(router URL, worker's registry) for one native worker behind the router."""
    tmp = tmp_path_factory.mktemp("router-publish")
    registry = make_registry(tmp, llama_dir, llama_adapters)
    engine = LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            max_loras=2,
            kv_cache_memory_bytes=8 * 2**20,
            max_lora_rank=16,
        )
    )
    worker = create_app(engine, registry, ServerConfig(MODEL, admin_token=ADMIN_TOKEN), api_keys())
    with serving(worker) as worker_url:
        router = create_router_app(
            RouterConfig(workers=(worker_url,), admin_token=ADMIN_TOKEN, poll_interval_s=0.05)
        )
        with serving(router) as router_url:
            yield router_url, registry
    registry.close()


def test_a_publish_through_the_router_registers_on_a_worker_and_serves(fleet, llama_adapters):
    router_url, registry = fleet
    with Publisher(router_url, ADMIN_TOKEN) as publisher:
        published = publisher.publish_dir("via-router", llama_adapters["mlp-r4"], stable=True)
    assert registry.get_revision("via-router", published.revision).digest == published.digest
    answer = httpx.post(
        f"{router_url}/v1/completions",
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        json={"model": "via-router", "prompt": "x", "max_tokens": 1},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-loraplex-adapter"] == published.model


def test_the_router_refuses_an_upload_without_its_admin_token(fleet, llama_adapters):
    router_url, registry = fleet
    with Publisher(router_url, "wrong-token-0123456789") as publisher:
        with pytest.raises(PublishError) as refused:
            publisher.publish_dir("via-router-401", llama_adapters["mlp-r4"])
    assert refused.value.status == 401
