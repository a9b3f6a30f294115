"""A split name's revision is picked at the router (registry weights, sticky by user) and sent as
`name@revision`, so the canary's share goes to the worker holding the canary. Real registry
(SQLite), real router over sockets, stand-in workers at the HTTP boundary that record what they
were sent."""

import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from tinymodels import make_adapter

from loraplex.artifacts import ArtifactStore
from loraplex.registry import Registry
from loraplex.registry.rollouts import RolloutStore
from loraplex.router.app import RouterConfig, create_router_app
from loraplex.router.splits import Splits, registry_splits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import serving  # noqa: E402

TOKEN = "admin-token-0123456789"


def worker(revisions: list[str], got: list[str], waiting: int = 0) -> Starlette:
    state = {
        "adapters": [
            {"name": "sql", "revision": r, "tier": "gpu", "loading": False} for r in revisions
        ],
        "load": {"waiting": waiting, "running": 0, "free_slots": 2},
    }

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def admin_state(request):
        return JSONResponse(state)

    async def completions(request):
        got.append(json.loads(await request.body())["model"])
        return JSONResponse({"choices": [{"text": "ok"}]})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/admin/state", admin_state),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


@pytest.fixture
def split_registry(llama_dir, tmp_path):
    """`sql`: r1 stable, r2 a 30% canary."""
    url = f"sqlite:///{tmp_path}/registry.db"
    registry = Registry(url, ArtifactStore(tmp_path / "store"), base_model_dir=llama_dir)
    registry.init()
    for i, revision in enumerate(("r1", "r2"), start=1):
        adapter = make_adapter(
            llama_dir, tmp_path / revision, seed=i, r=4, target_modules=["q_proj"]
        )
        registry.add_revision(
            adapter, "sql", revision=revision, status="stable" if i == 1 else "staging"
        )
    registry.promote("sql", "r2", 30, force=True)
    yield url
    registry.close()


def route(url: str, pool_waiting: int, named_pool: bool = False):
    """60 requests with distinct users through a router over the pool (r1 and r2 in slots) and
    another worker (r1): (models the pool got, models the other got, the routes' reasons).
    `named_pool`: a rollout under way names the other worker as its canary pool."""
    pool_got, other_got, reasons = [], [], []
    with (
        serving(worker(["r1", "r2"], pool_got, waiting=pool_waiting)) as pool,
        serving(worker(["r1"], other_got)) as other,
    ):
        if named_pool:
            registry = Registry(url)
            RolloutStore(registry).begin(
                "sql", "r2", "r1", (30, 100), {"canary_workers": [other]}, 60, holder="c:1"
            )
            registry.set_traffic("sql", {"r2": 30, "r1": 70}, force=True)  # moves the count
            registry.close()
        # polled often and never stale: what is tested is the split, not staleness
        config = RouterConfig(
            workers=(pool, other),
            admin_token=TOKEN,
            splits=registry_splits(Registry(url)),
            stale_after_s=600,
            poll_interval_s=0.02,
        )
        with serving(create_router_app(config)) as router:
            for i in range(60):
                body = {"model": "sql", "prompt": "x", "user": f"u{i}"}
                r = httpx.post(f"{router}/v1/completions", json=body)
                assert r.status_code == 200
                reasons.append(r.headers["x-loraplex-route"])
                time.sleep(0.05)  # a poll between requests: the router's own in-flight count
            pinned = httpx.post(f"{router}/v1/completions", json={"model": "sql@r1", "prompt": "x"})
            assert pinned.status_code == 200
    return pool_got, other_got, reasons


def test_the_canary_share_goes_to_the_worker_holding_it_while_it_has_room(split_registry):
    pool_got, other_got, reasons = route(split_registry, pool_waiting=0)
    assert "sql@r2" not in other_got  # every canary request went to the pool's worker
    canary = pool_got.count("sql@r2")
    assert 8 <= canary <= 30, (canary, len(pool_got), len(other_got))  # 30% of 60, by user hash
    assert reasons.count("canary-pool") == canary
    assert set(pool_got + other_got) == {"sql@r1", "sql@r2"}


def test_a_rollouts_named_pool_takes_the_canary(split_registry):
    pool_got, other_got, reasons = route(split_registry, pool_waiting=0, named_pool=True)
    assert "sql@r2" not in pool_got  # the worker named, not the one that happens to hold it
    assert other_got.count("sql@r2") == reasons.count("canary-pool") >= 8


def test_beyond_the_pools_room_the_canary_spreads(split_registry):
    pool_got, other_got, reasons = route(split_registry, pool_waiting=9)  # saturated
    assert "canary-pool" not in reasons
    assert other_got.count("sql@r2") >= 8  # the pool full, the canary's share goes elsewhere


def test_sticky_by_user_and_read_again_only_when_the_registry_changed():
    reads = []
    count = [1]

    def read_splits():
        reads.append(count[0])
        return {"sql": [("r2", 10), ("r1", 90)]}, {}

    splits = Splits(lambda: count[0], read_splits, refresh_s=0.0)
    first = {u: splits.model_for("sql", u) for u in ("a", "b", "c", "d")}
    assert all(splits.model_for("sql", u) == m for u, m in first.items())
    assert splits.model_for("other", "a") == "other"
    assert splits.model_for("sql@r1", "a") == "sql@r1"
    assert reads == [1]
    count[0] = 2
    splits.model_for("sql", "a")
    assert reads == [1, 2]
