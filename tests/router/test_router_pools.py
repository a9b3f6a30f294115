"""The router's pools over real sockets: workers of two bases, a dedicated pool and a shared one,
a misconfigured worker, the load the picker reads. The workers are small stand-ins at the HTTP
boundary that report a base model and a max rank as `loraplex serve` does and say who answered."""

import sys
import threading
import time
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from loraplex.router.app import RouterConfig, create_router_app
from loraplex.router.pools import PoolSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import serving  # noqa: E402 (the tests' uvicorn-in-a-thread runner)

TOKEN = "admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
KEYS = {"acme-key": ("acme", 0), "beta-key": ("beta", 0)}


def state_of(base: str, rank: int = 16, waiting: int = 0) -> dict:
    return {
        "base_model": base,
        "base_model_digest": f"sha256:{base}",
        "max_lora_rank": rank,
        "adapters": [{"name": "sql", "revision": "r1", "tier": "gpu", "loading": False}],
        "load": {"waiting": waiting, "running": 0, "free_slots": 1},
    }


def stand_in(state: dict, models: tuple[str, ...] = (), answer_after_s: float = 0.0) -> Starlette:
    """Answers completions with 200 naming the model, except `ghost` (404, as an unknown name);
    lists `models` to a caller with a key (401 without one)."""

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def admin_state(request: Request):
        return JSONResponse(state)

    async def completions(request: Request):
        body = await request.json()
        time.sleep(answer_after_s)  # blocks this stand-in only: its requests take turns
        if body["model"] == "ghost":
            error = {"message": "no model ghost", "code": "model_not_found", "param": "model"}
            return JSONResponse({"error": error}, status_code=404)
        return JSONResponse({"choices": [{"text": body["model"]}]})

    async def list_models(request: Request):
        if "authorization" not in request.headers:
            return JSONResponse({"error": {"code": "invalid_api_key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": m} for m in models]})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/admin/state", admin_state),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", list_models),
        ]
    )


def complete(url: str, model: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{url}/v1/completions", json={"model": model, "prompt": "x"}, headers=headers, timeout=30
    )


def served_by(answers: list[httpx.Response]) -> set[tuple[int, str | None, str | None]]:
    return {
        (r.status_code, r.headers.get("x-loraplex-pool"), r.headers.get("x-loraplex-worker"))
        for r in answers
    }


def listed(url: str) -> dict[str, dict]:
    workers = httpx.get(f"{url}/admin/workers", headers=ADMIN).json()["workers"]
    return {w["url"]: w for w in workers}


def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    """Until the predicate holds (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_steady_rate_on_resident_adapters_never_looks_saturated():
    """Four clients, each sending its next request when the last is answered: the router never
    has more than four open, so no worker passes the saturation threshold of 5, however long since
    the last poll (the polls are rare here: counting every request sent since the last poll
    called each worker saturated after its sixth)."""
    with serving(stand_in(state_of("base-a"))) as one, serving(stand_in(state_of("base-a"))) as two:
        config = RouterConfig(
            workers=(one, two), admin_token=TOKEN, poll_interval_s=30, stale_after_s=300
        )
        with serving(create_router_app(config)) as url:
            routes: list[str] = []

            def client():
                for _ in range(30):
                    answer = complete(url, "sql")
                    routes.append(f"{answer.status_code} {answer.headers['x-loraplex-route']}")

            clients = [threading.Thread(target=client) for _ in range(4)]
            for c in clients:
                c.start()
            for c in clients:
                c.join()
            assert routes == ["200 affinity-gpu"] * 120
            assert {u: w["in_flight"] for u, w in listed(url).items()} == {one: 0, two: 0}


def test_a_bare_base_model_goes_to_its_base_and_one_nobody_serves_is_named():
    with (
        serving(stand_in(state_of("base-a"))) as a,
        serving(stand_in(state_of("base-b"))) as b,
    ):
        pools = (
            PoolSpec("pool-a", base_model="base-a", max_rank=16, workers=(a,)),
            PoolSpec("pool-b", base_model="base-b", workers=(b,)),
            PoolSpec("pool-c", base_model="base-c"),
        )
        config = RouterConfig(workers=(), admin_token=TOKEN, pools=pools)
        with serving(create_router_app(config)) as url:
            assert served_by([complete(url, "base-a") for _ in range(8)]) == {(200, "pool-a", a)}
            assert served_by([complete(url, "base-b") for _ in range(8)]) == {(200, "pool-b", b)}
            nobody = complete(url, "base-c")
            assert nobody.status_code == 404 and "x-loraplex-worker" not in nobody.headers
            assert nobody.json()["error"] == {
                "message": "no worker serves base model base-c",
                "type": "invalid_request_error",
                "code": "model_not_available",
                "param": "model",
            }
            seen = listed(url)
            assert (seen[a]["pool"], seen[a]["base_model"], seen[a]["max_lora_rank"]) == (
                "pool-a",
                "base-a",
                16,
            )


def test_a_misconfigured_worker_gets_no_request_and_is_shown():
    with (
        serving(stand_in(state_of("base-a"))) as good,
        serving(stand_in(state_of("base-b"))) as wrong_base,
        serving(stand_in(state_of("base-a", rank=8))) as low_rank,
    ):
        pool = PoolSpec("pool-a", base_model="base-a", max_rank=16, workers=(good, wrong_base))
        config = RouterConfig(workers=(), admin_token=TOKEN, pools=(pool,))
        with serving(create_router_app(config)) as url:
            answers = [complete(url, "sql") for _ in range(10)] + [complete(url, "base-a")]
            assert served_by(answers) == {(200, "pool-a", good)}
            seen = listed(url)
            assert seen[good]["misconfigured"] is None
            assert seen[wrong_base]["misconfigured"] == (
                "serves base model base-b, pool pool-a is for base-a"
            )
            metrics = httpx.get(f"{url}/metrics").text
            line = f'loraplex_router_worker_misconfigured{{pool="pool-a",worker="{wrong_base}"}}'
            assert f"{line} 1.0" in metrics
            added = httpx.post(
                f"{url}/admin/workers", headers=ADMIN, json={"url": low_rank, "pool": "pool-a"}
            )
            assert added.json() == {"added": low_rank, "pool": "pool-a"}
            assert "max LoRA rank 8" in listed(url)[low_rank]["misconfigured"]
            httpx.request("DELETE", f"{url}/admin/workers", headers=ADMIN, json={"url": good})
            refused = complete(url, "base-a")
            assert refused.status_code == 404
            assert refused.json()["error"]["message"] == (
                "no worker serves base model base-a (2 misconfigured worker(s) excluded: see "
                "GET /admin/workers)"
            )
            unknown_pool = httpx.post(
                f"{url}/admin/workers", headers=ADMIN, json={"url": good, "pool": "gold"}
            )
            assert unknown_pool.status_code == 400 and "no pool 'gold'" in unknown_pool.text
            not_a_name = httpx.post(
                f"{url}/admin/workers", headers=ADMIN, json={"url": good, "pool": ["pool-a"]}
            )
            assert not_a_name.status_code == 400
            assert not_a_name.json()["error"]["param"] == "pool"


def test_a_tenant_uses_its_dedicated_pool_then_the_shared_one_when_that_is_saturated():
    """Without the fair-share queue (`queue_per_tenant=0`), a request for saturated pools goes to
    the dedicated pool's saturated pick."""
    gold_state, shared_state = state_of("base-a"), state_of("base-a")
    with serving(stand_in(gold_state)) as gold, serving(stand_in(shared_state)) as shared:
        pools = (
            PoolSpec("gold", base_model="base-a", tenants=("acme",), workers=(gold,)),
            PoolSpec("shared", base_model="base-a", workers=(shared,)),
        )
        config = RouterConfig(
            workers=(),
            admin_token=TOKEN,
            pools=pools,
            caller_of=lambda key: KEYS.get(key, (None, 0)),
            poll_interval_s=0.05,
            queue_per_tenant=0,
        )
        with serving(create_router_app(config)) as url:
            acme = [complete(url, "sql", "acme-key") for _ in range(6)]
            assert served_by(acme) == {(200, "gold", gold)}
            beta = [complete(url, "sql", "beta-key") for _ in range(6)]
            assert served_by(beta) == {(200, "shared", shared)}
            gold_state["load"]["waiting"] = 9  # above the saturation threshold of 5
            wait_for(lambda: listed(url)[gold]["waiting"] == 9, "the router to see gold's queue")
            spilled = [complete(url, "sql", "acme-key") for _ in range(6)]
            assert served_by(spilled) == {(200, "shared", shared)}
            assert {r.headers["x-loraplex-route"] for r in spilled} == {"affinity-gpu"}
            shared_state["load"]["waiting"] = 9
            wait_for(lambda: listed(url)[shared]["waiting"] == 9, "the router to see shared's")
            both_full = [complete(url, "sql", "acme-key") for _ in range(3)]
            assert served_by(both_full) == {(200, "gold", gold)}
            assert {r.headers["x-loraplex-route"] for r in both_full} == {"saturated-fallback"}
            # beta may never use gold, saturated or not
            assert served_by([complete(url, "sql", "beta-key") for _ in range(3)]) == {
                (200, "shared", shared)
            }


def test_a_404_from_a_worker_does_not_mark_the_adapter_as_loading_there():
    with serving(stand_in(state_of("base-a"))) as one:
        config = RouterConfig(workers=(one,), admin_token=TOKEN, poll_interval_s=30)
        app = create_router_app(config)
        with serving(app) as url:
            refused = complete(url, "ghost")
            assert refused.status_code == 404 and "x-loraplex-pool" not in refused.headers
            assert complete(url, "cold").status_code == 200
            assert app.state.fleet.workers[one].sent == {"cold"}


def test_models_through_the_router_are_every_pool_the_caller_may_use():
    with (
        serving(stand_in(state_of("base-a"), models=("base-a", "sql", "a1"))) as a,
        serving(stand_in(state_of("base-b"), models=("base-b", "sql", "b1"))) as b,
        serving(stand_in(state_of("base-g"), models=("base-g", "gold-only"))) as g,
    ):
        pools = (
            PoolSpec("pool-a", base_model="base-a", workers=(a,)),
            PoolSpec("pool-b", base_model="base-b", workers=(b,)),
            PoolSpec("gold", base_model="base-g", tenants=("acme",), workers=(g,)),
        )
        config = RouterConfig(
            workers=(),
            admin_token=TOKEN,
            pools=pools,
            caller_of=lambda key: KEYS.get(key, (None, 0)),
        )
        with serving(create_router_app(config)) as url:

            def ids(key: str) -> list[str]:
                answer = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
                assert answer.status_code == 200
                return sorted(m["id"] for m in answer.json()["data"])

            assert ids("beta-key") == ["a1", "b1", "base-a", "base-b", "sql"]
            assert ids("acme-key") == ["a1", "b1", "base-a", "base-b", "base-g", "gold-only", "sql"]
            assert served_by([complete(url, "base-g", "acme-key")]) == {(200, "gold", g)}
            closed = complete(url, "base-g", "beta-key")
            assert closed.status_code == 404
            assert closed.json()["error"]["message"] == "no pool open to tenant beta serves base-g"
            anonymous = httpx.get(f"{url}/v1/models")
            assert anonymous.status_code == 401  # the workers' own refusal
