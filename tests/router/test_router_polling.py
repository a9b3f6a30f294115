"""The router polls real loraplex workers (uvicorn over real sockets, native engines, SQLite
registries) for the routing view of /admin/state by generation: with nothing changing its bytes per
poll stay the same however many adapters a worker holds, and a residency change on a worker reaches
the router's view and its routing."""

import contextlib
import sys
import time
from pathlib import Path

import httpx
import pytest

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
    variant,
)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MORE = 60


@pytest.fixture(scope="module")
def variants(llama_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("polling-variants")
    return [
        variant(llama_adapters["attn-r8"], root / f"v{i:02d}", 1.0 + 0.01 * i) for i in range(MORE)
    ]


@contextlib.contextmanager
def worker(tmp: Path, llama_dir, llama_adapters, variants):
    """A loraplex worker whose registry holds the harness's three adapters and `v00`... shared."""
    registry = make_registry(tmp, llama_dir, llama_adapters)
    for i, path in enumerate(variants):
        registry.add_revision(path, f"v{i:02d}", shared=True, status="stable")
    engine = LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            max_loras=2,
            kv_cache_memory_bytes=8 * 2**20,
            max_lora_rank=16,
        )
    )
    config = ServerConfig(MODEL, admin_token=ADMIN_TOKEN, audit_log=tmp / "audit.jsonl")
    try:
        with serving(create_app(engine, registry, config, api_keys())) as url:
            yield url
    finally:
        registry.close()


def admin(url: str, method: str, path: str, **kwargs) -> httpx.Response:
    response = httpx.request(method, f"{url}{path}", headers=ADMIN, timeout=60, **kwargs)
    assert response.status_code == 200, response.text
    return response


def wait_for(predicate, what: str, timeout: float = 60.0):
    """A bound against hangs, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def prewarm(url: str, names: list[str]) -> None:
    for name in names:
        admin(url, "POST", f"/admin/adapters/{name}/prewarm", json={"tier": "cpu"})
    wait_for(
        lambda: (
            all(
                a["tier"] == "cpu" and not a["loading"]
                for a in admin(url, "GET", "/admin/state").json()["adapters"]
                if a["name"] in names
            )
            and {a["name"] for a in admin(url, "GET", "/admin/state").json()["adapters"]}
            >= set(names)
        ),
        f"{names} in cpu",
    )


def settled(fleet, url: str, names: set[str]) -> bool:
    """The router's view of the worker holds `names` in cpu, and its last poll got a 304."""
    w = fleet.workers[url]
    return w.last is not None and names <= set(w.last.cpu) and w.generation and not w.state_bytes


def idle_delta_bytes(url: str, generation: str) -> int:
    """Body bytes of a delta since the current generation, less the generation's own length."""
    r = admin(url, "GET", "/admin/state", params={"view": "routing", "since": generation})
    body = r.json()
    assert (body["adapters"], body["removed"], body["reset"]) == ([], [], False)
    return len(r.content) - len(body["generation"])


def test_idle_polls_cost_the_same_bytes_at_3_and_63_adapters(
    llama_dir, llama_adapters, variants, tmp_path
):
    with worker(tmp_path, llama_dir, llama_adapters, variants) as url:
        few = ["shared-a", "alice-a", "bob-a"]
        prewarm(url, few)
        router = create_router_app(
            RouterConfig(workers=(url,), admin_token=ADMIN_TOKEN, poll_interval_s=0.05)
        )
        with serving(router):
            fleet = router.state.fleet
            wait_for(lambda: settled(fleet, url, set(few)), "the router's view of 3 adapters")
            full_few = len(admin(url, "GET", "/admin/state").content)
            delta_few = idle_delta_bytes(url, fleet.workers[url].generation)
            before = fleet.workers[url].generation

            many = few + [f"v{i:02d}" for i in range(MORE)]
            prewarm(url, many[3:])
            wait_for(lambda: settled(fleet, url, set(many)), "the router's view of 63 adapters")
            full_many = len(admin(url, "GET", "/admin/state").content)
            delta_many = idle_delta_bytes(url, fleet.workers[url].generation)

            assert fleet.workers[url].generation != before  # the change came as a new generation
            assert full_many > 5 * full_few  # the whole answer grows with the adapters held
            assert delta_many == delta_few  # an idle delta does not
            # and a poll that sends its generation gets 304 with no body
            r = httpx.get(
                f"{url}/admin/state",
                params={"view": "routing", "since": fleet.workers[url].generation},
                headers={**ADMIN, "If-None-Match": f'"{fleet.workers[url].generation}"'},
            )
            assert (r.status_code, r.content) == (304, b"")
            # bad input is refused, naming the parameter; no admin token, no view
            for params, param in (
                ({"view": "rows"}, "view"),
                ({"view": "routing", "since": "x"}, "since"),
            ):
                bad = httpx.get(f"{url}/admin/state", params=params, headers=ADMIN)
                assert (bad.status_code, bad.json()["error"]["param"]) == (400, param)
            assert httpx.get(f"{url}/admin/state", params={"view": "routing"}).status_code == 401


def test_a_residency_change_reaches_the_routers_view_and_routing(
    llama_dir, llama_adapters, variants, tmp_path
):
    with (
        worker(tmp_path / "a", llama_dir, llama_adapters, variants) as a,
        worker(tmp_path / "b", llama_dir, llama_adapters, variants) as b,
    ):
        prewarm(b, ["v05"])
        router = create_router_app(
            RouterConfig(workers=(a, b), admin_token=ADMIN_TOKEN, poll_interval_s=0.05)
        )
        with serving(router) as router_url:
            fleet = router.state.fleet
            wait_for(lambda: "v05" in fleet.workers[b].index.cpu, "v05 seen on b")

            def route() -> str:
                body = {"model": "v05", "prompt": "hello", "max_tokens": 2, "temperature": 0}
                key = {"Authorization": f"Bearer {KEYS['alice']}"}
                r = httpx.post(f"{router_url}/v1/completions", json=body, headers=key, timeout=60)
                assert r.status_code == 200, r.text
                return r.headers["x-loraplex-worker"]

            assert route() == b
            # v05 moves: evicted on b, prewarmed on a
            wait_for(
                lambda: admin(b, "POST", "/admin/adapters/v05/evict", json={}).json()["evicted"],
                "v05 evicted on b",
            )
            prewarm(a, ["v05"])
            wait_for(
                lambda: (
                    "v05" in fleet.workers[a].index.cpu
                    and "v05" not in fleet.workers[b].index.cpu
                    and "v05" not in fleet.workers[b].index.gpu
                ),
                "the router's view of the move",
            )
            assert route() == a
