"""Helpers for the server tests: a real server on a real port (uvicorn in a thread) over a tiny
engine and a SQLite registry.

Tenants: `alice` and `bob` (keys below); adapters `shared-a` (everyone), `alice-a` (alice only),
`bob-a` (bob only), all stable.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import uvicorn
from safetensors.torch import load_file, save_file

from loraplex.artifacts import ArtifactStore
from loraplex.registry import Registry
from loraplex.server.app import Server
from loraplex.server.preflight import bind

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789ab"}
ADMIN_TOKEN = "admin-token-0123456789"
MODEL = "tiny"


@dataclass
class Running:
    url: str
    server: Server
    registry: Registry
    tmp: Path

    def client(self, tenant: str | None = "alice", **kwargs) -> openai.OpenAI:
        key = KEYS[tenant] if tenant else "none"
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **kwargs)

    def async_client(self, tenant: str | None = "alice", **kwargs) -> openai.AsyncOpenAI:
        key = KEYS[tenant] if tenant else "none"
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **kwargs)

    def admin(
        self, method: str, path: str, token: str | None = ADMIN_TOKEN, **kwargs
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kwargs)

    def state(self) -> dict:
        response = self.admin("GET", "/admin/state")
        response.raise_for_status()
        return response.json()

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition"):
        """Poll until the predicate holds (a bound against hangs, not a timing assertion)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def serving(app, host: str = "127.0.0.1"):
    """Run an ASGI app on a free port in a thread; yields its base URL, stops it at the end."""
    sock = bind(host, 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def variant(src: Path, out: Path, scale: float) -> Path:
    """A copy of an adapter with B scaled: same shapes, other bytes (another digest)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    tensors = {
        k: (v * scale if "lora_B" in k else v)
        for k, v in load_file(src / "adapter_model.safetensors").items()
    }
    save_file(tensors, out / "adapter_model.safetensors")
    return out


def make_registry(tmp: Path, llama_dir: Path, llama_adapters: dict) -> Registry:
    """Tenants alice and bob; shared-a (everyone), alice-a (alice only), bob-a (bob only), all
    stable."""
    registry = Registry(
        f"sqlite:///{tmp}/registry.db",
        ArtifactStore(tmp / "artifacts"),
        base_model_dir=llama_dir,
        max_lora_rank=16,
    )
    registry.init()
    for tenant in KEYS:
        registry.add_tenant(tenant)
    registry.add_revision(llama_adapters["attn-r8"], "shared-a", shared=True, status="stable")
    registry.add_revision(llama_adapters["mlp-r4"], "alice-a", tenant="alice", status="stable")
    registry.add_revision(llama_adapters["regex-r4"], "bob-a", tenant="bob", status="stable")
    return registry


def api_keys() -> dict[str, str]:
    """What `read_api_keys` makes of a keys file with KEYS: sha256(key) -> tenant."""
    return {hashlib.sha256(key.encode()).hexdigest(): tenant for tenant, key in KEYS.items()}
