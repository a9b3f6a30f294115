"""The policy's views of a worker, from `/admin/state` as each engine answers it: demand per
adapter revision in requests per second over the demand window, and the host bytes that bound
placement (the native engine's capacity; the vLLM engine's host cache is counted in adapters)."""

from loraplex.placement.views import DEMAND_WINDOW_S, UNBOUNDED_BYTES, worker_view
from loraplex.settings.pools import PoolSpec


def state(cache: dict) -> dict:
    return {
        "base_model_digest": "sha256:base",
        "max_lora_rank": 16,
        "placed": ["a@r1"],
        "drain": "draining",
        "adapters": [
            {"name": "a", "revision": "r1", "demand_5m": 30.0},
            {"name": "b", "revision": "r2", "demand_5m": 0.0},
        ],
        "load": {"num_slots": 4},
        "cache": cache,
    }


def test_a_native_workers_view():
    view = worker_view(
        "http://w", PoolSpec("gold", tenants=("acme",)), state({"cpu_bytes_capacity": 1000})
    )
    assert (view.name, view.pool, view.base, view.max_rank, view.slots) == (
        "http://w",
        "gold",
        "sha256:base",
        16,
        4,
    )
    assert (view.host_bytes, view.draining, view.placed, view.tenants) == (
        1000,
        True,
        frozenset({"a@r1"}),
        frozenset({"acme"}),
    )
    assert dict(view.demand) == {"a@r1": 30.0 / DEMAND_WINDOW_S, "b@r2": 0.0}


def test_a_vllm_worker_is_bound_by_its_slots_not_bytes():
    view = worker_view("http://v", PoolSpec("default"), state({"cpu_loras_capacity": 16}))
    assert view.host_bytes == UNBOUNDED_BYTES and view.slots == 4
    assert worker_view("http://x", PoolSpec("default"), state({})).host_bytes == 0
