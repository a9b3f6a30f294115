"""Ray Serve: one router deployment in front of the pool deployments of `run_pools`, routing as
`loraplex router` routes across pools. A request names only its model (an adapter, or a bare base
model); the router reads the adapter's revision in the registry (its base model and rank) and
sends the request to an eligible pool: the tenant's dedicated pools first, then the shared ones,
by `loraplex.router.pools` and `loraplex.router.routing`. Inside a pool, the pool's own request
router (`LoraplexRequestRouter`) picks the replica. A request no pool can serve gets the
router's OpenAI-shaped refusal.

    handles = run_pools(fleet)
    router = run_router(fleet)
    answer = await router.completions.remote({"model": "sql", "prompt": "..."}, "Bearer KEY")
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from loraplex.bearer import bearer
from loraplex.integrations.ray_serve import RayPool, serve
from loraplex.model_config import base_model_digest
from loraplex.registry.registry import open_existing
from loraplex.router.catalog import registry_catalog
from loraplex.router.fleet import Fleet
from loraplex.router.pools import Need, PoolSpec, tiers
from loraplex.router.routing import Refusal, Wanted, base_names, eligible, need_of, refusal
from loraplex.router.serve import registry_callers
from loraplex.settings.pools import check_pools


def pool_spec(pool: RayPool) -> PoolSpec:
    """The pool as the router declares one: its workers' served base model, the base model's
    digest (when the model directory is here to read), its max rank and its tenants."""
    options = pool.options
    model = Path(options.model)
    try:
        digest = base_model_digest(model)
    except OSError:  # a model directory only the replicas' nodes hold: the name is checked
        digest = None
    return PoolSpec(
        pool.name,
        base_model=options.served_model_name or model.resolve().name,
        base_model_digest=digest,
        max_rank=options.max_lora_rank,
        tenants=pool.tenants,
    )


class PoolChooser:
    """Which pool a request goes to. The fleet holds one member per pool (named after it) that
    stands for the pool's replicas: what the pool declares is what its workers serve, since they
    run its settings."""

    def __init__(self, specs: list[PoolSpec], capacity: dict[str, int], catalog, caller_of):
        self.fleet = Fleet([], None, pools=tuple(specs))
        for spec in specs:
            self.fleet.add(spec.name, spec.name, healthy=True)
        self.capacity, self.catalog, self.caller_of = capacity, catalog, caller_of
        self.in_flight: Counter[str] = Counter()

    def choose(self, model: str | None, authorization: str | None) -> str | Refusal:
        """The first eligible pool with room (requests open there below its replicas' room), in
        the tenant's dedicated pools first, then the shared ones, the lowest max rank first in
        each; when all are full, the first eligible one."""
        tenant, _ = self.caller_of(bearer(authorization) or "")
        wanted = Wanted(model, tenant)
        need = need_of(self.fleet, self.catalog, wanted)
        candidates = [
            spec.name
            for group in self._tiers(need, tenant)
            for spec in sorted(group, key=lambda s: s.max_rank or 0)
        ]
        if not candidates:
            return refusal(self.fleet, need, wanted)
        with_room = (p for p in candidates if self.in_flight[p] < self.capacity[p])
        return next(with_room, candidates[0])

    def _tiers(self, need: Need, tenant: str | None) -> list[list[PoolSpec]]:
        members = list(self.fleet.workers.values())
        return [
            [w.pool for w in eligible(members, pools, need)]
            for pools in tiers(self.fleet.pools.values(), tenant)
        ]

    def is_base(self, model: str) -> bool:
        return model in base_names(self.fleet)


class LoraplexPoolRouter:
    """The router deployment: each call goes to the chosen pool's deployment, as an adapter
    (Ray's multiplexed model) or for the bare base model."""

    def __init__(self, specs: list[PoolSpec], capacity: dict[str, int], registry_url: str):
        registry = open_existing(registry_url)
        self.chooser = PoolChooser(
            specs, capacity, registry_catalog(registry), registry_callers(registry)
        )
        self.pools = {spec.name: serve.get_app_handle(spec.name) for spec in specs}

    async def completions(self, body: dict, authorization: str | None = None) -> dict:
        """POST /v1/completions on a worker of the pool that serves `body["model"]`."""
        return await self._route("completions", body, authorization)

    async def chat_completions(self, body: dict, authorization: str | None = None) -> dict:
        return await self._route("chat_completions", body, authorization)

    async def _route(self, method: str, body: dict, authorization: str | None) -> dict:
        model = body.get("model") if isinstance(body, dict) else None
        model = model if isinstance(model, str) and model else None
        model = model or serve.get_multiplexed_model_id() or None
        pool = self.chooser.choose(model, authorization)
        if isinstance(pool, Refusal):
            return {"status": pool.status, "body": refusal_body(pool), "pool": None}
        handle = self.pools[pool]
        if model is not None and not self.chooser.is_base(model):
            handle = handle.options(multiplexed_model_id=model)
        self.chooser.in_flight[pool] += 1
        try:
            answer = await getattr(handle, method).remote(body, authorization)
        finally:
            self.chooser.in_flight[pool] -= 1
        return {**answer, "pool": pool}


def refusal_body(refused: Refusal) -> dict:
    """The OpenAI error body `loraplex router` answers a request no pool serves with."""
    return {
        "error": {
            "message": refused.message,
            "type": "invalid_request_error",
            "code": refused.code,
            "param": "model",
        }
    }


def router_app(
    pools: list[RayPool], max_ongoing_requests: int = 64, name: str = "loraplex-router"
) -> Any:
    """The router deployment over the pool applications `run_pools` started (the same `pools`
    and `max_ongoing_requests`), for `serve.run`; the pools share one registry."""
    specs = [pool_spec(pool) for pool in pools]
    check_pools(specs)
    registries = {str(pool.options.registry_url) for pool in pools}
    if len(registries) != 1:
        raise ValueError(f"pools on registries {sorted(registries)}: give them the fleet's one")
    capacity = {pool.name: pool.num_replicas * max_ongoing_requests for pool in pools}
    return (
        serve.deployment(LoraplexPoolRouter, name=name)
        .options(
            max_ongoing_requests=sum(capacity.values()),
            ray_actor_options={"num_cpus": 0},
        )
        .bind(specs, capacity, registries.pop())
    )


def run_router(pools: list[RayPool], max_ongoing_requests: int = 64, name: str = "loraplex-router"):
    """Runs `router_app` as a Serve application of its own, named `name`: its handle."""
    return serve.run(router_app(pools, max_ongoing_requests, name), name=name, route_prefix=None)
