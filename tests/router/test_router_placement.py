"""The router honours the placement controller and the pools' roles, over real sockets: a worker
an adapter is placed on takes its requests until saturated, a draining worker gets none, a `warm`
pool takes a pinned adapter's requests first and a `canary` pool a rollout's canary. The workers
are the stand-ins of the other router tests (HTTP boundary, real uvicorn); the registry is a real
SQLite file."""

import time

import httpx
import pytest
from test_router_pools import TOKEN, complete, serving, stand_in, state_of, wait_for
from test_router_splits import split_registry, worker  # noqa: F401 (a fixture, used by name)

from loraplex.registry import Registry
from loraplex.router.app import RouterConfig, create_router_app
from loraplex.router.catalog import registry_catalog
from loraplex.router.pools import PoolSpec
from loraplex.router.splits import registry_splits
from loraplex.settings.pools import parse_pool

ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def workers_seen(url: str) -> dict[str, dict]:
    listed = httpx.get(f"{url}/admin/workers", headers=ADMIN).json()["workers"]
    return {w["url"]: w for w in listed}


def test_a_placed_adapter_goes_to_its_workers_until_they_are_saturated():
    placed, other = state_of("base-a"), state_of("base-a")
    placed["placed"] = ["sql@r1"]
    with serving(stand_in(placed)) as a, serving(stand_in(other)) as b:
        config = RouterConfig(workers=(a, b), admin_token=TOKEN, poll_interval_s=0.05)
        with serving(create_router_app(config)) as url:
            wait_for(lambda: workers_seen(url)[a]["placed"] == ["sql@r1"], "the placement")
            answers = [complete(url, "sql") for _ in range(12)]
            assert {(r.status_code, r.headers["x-loraplex-worker"]) for r in answers} == {(200, a)}
            assert {r.headers["x-loraplex-route"] for r in answers} == {"placed-affinity-gpu"}
            pinned = [complete(url, "sql@r1") for _ in range(4)]
            assert {r.headers["x-loraplex-worker"] for r in pinned} == {a}
            placed["load"] = {**placed["load"], "waiting": 9}  # beyond saturation (5)
            wait_for(lambda: workers_seen(url)[a]["waiting"] == 9, "the saturation")
            answers = [complete(url, "sql") for _ in range(6)]
            assert {r.headers["x-loraplex-worker"] for r in answers} == {b}
            assert not any(r.headers["x-loraplex-route"].startswith("placed") for r in answers)


def test_a_draining_worker_gets_no_new_request():
    draining, other = state_of("base-a"), state_of("base-a")
    draining.update(placed=["sql@r1"], drain="draining")
    with serving(stand_in(draining)) as a, serving(stand_in(other)) as b:
        config = RouterConfig(workers=(a, b), admin_token=TOKEN, poll_interval_s=0.05)
        with serving(create_router_app(config)) as url:
            wait_for(lambda: workers_seen(url)[a]["drain"] == "draining", "the drain")
            answers = [complete(url, m) for m in ("sql", "base-a", "other") * 4]
            assert {(r.status_code, r.headers["x-loraplex-worker"]) for r in answers} == {(200, b)}
            draining["drain"] = None
            wait_for(lambda: workers_seen(url)[a]["drain"] is None, "the end of the drain")
            assert complete(url, "sql").headers["x-loraplex-worker"] == a  # placed there


def test_a_pinned_adapter_goes_to_the_warm_pool_first(split_registry):  # noqa: F811
    registry = Registry(split_registry)
    state = {**state_of("base-a"), "base_model_digest": None}  # the registry's base, unnamed
    with serving(stand_in(state)) as hot, serving(stand_in(dict(state))) as b:
        pools = (PoolSpec("hot", role="warm", workers=(hot,)),)
        config = RouterConfig(
            workers=(b,),
            admin_token=TOKEN,
            pools=pools,
            catalog=registry_catalog(registry),
            poll_interval_s=0.05,
        )
        with serving(create_router_app(config)) as url:
            cold = [complete(url, "sql") for _ in range(12)]
            assert {r.status_code for r in cold} == {200}
            assert not any(r.headers["x-loraplex-route"].startswith("warm") for r in cold)
            registry.pin("sql", True, "gpu")
            time.sleep(1.1)  # the catalog reads the registry again at most every second
            answers = [complete(url, "sql") for _ in range(12)]
            assert {(r.status_code, r.headers["x-loraplex-pool"]) for r in answers} == {
                (200, "hot")
            }
            assert {r.headers["x-loraplex-route"] for r in answers} == {"warm-pool-affinity-gpu"}
    registry.close()


def test_a_canary_goes_to_the_canary_pool(split_registry):  # noqa: F811
    """No rollout names canary workers: the `canary` pool takes the canary's share, though the
    other worker holds the canary revision in a slot."""
    holder_got: list[str] = []
    canary_got: list[str] = []
    with (
        serving(worker(["r1", "r2"], holder_got)) as holder,
        serving(worker(["r1"], canary_got)) as canary,
    ):
        config = RouterConfig(
            workers=(holder,),
            admin_token=TOKEN,
            pools=(PoolSpec("canaries", role="canary", workers=(canary,)),),
            splits=registry_splits(Registry(split_registry)),
            poll_interval_s=0.05,
        )
        with serving(create_router_app(config)) as url:
            reasons = []
            for i in range(40):
                body = {"model": "sql", "prompt": "x", "user": f"u{i}"}
                r = httpx.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200
                reasons.append(r.headers["x-loraplex-route"])
    assert "sql@r2" not in holder_got
    assert canary_got.count("sql@r2") == reasons.count("canary-pool") >= 4


def test_a_pools_role_is_read_and_checked():
    spec = parse_pool("name=hot,role=warm,workers=http://w1")
    assert (spec.role, spec.as_dict()["role"]) == ("warm", "warm")
    assert parse_pool(spec.as_dict()) == spec
    with pytest.raises(ValueError, match="role 'gold': use warm or canary"):
        parse_pool("name=hot,role=gold")
