"""Ray Serve: one router deployment in front of the pool deployments of `run_pools`, routing as
`loraplex router` routes across pools. A request names only its model (an adapter, or a bare base
model); the router reads the adapter's revision in the registry (its base model and rank) and
sends the request to an eligible pool: the tenant's dedicated pools first, then the shared ones,
by `loraplex.router.pools` and `loraplex.router.routing`. A split name's revision is picked here
(`loraplex.router.splits`), a canary's going to a `canary` pool first, then the pools where the
placement controller placed the adapter on a replica with room, then a pinned or tier-A
adapter's `warm` pools. When every eligible pool is full, a tenant below the shedding band is
refused (`429 saturated`, as `loraplex router` sheds); another request waits in its tenant's
queue and pools that have room again take the waiters in fair order
(`loraplex.router.fairness`), with places held back for tenants owed them as the router holds
them (`loraplex.router.holdback`: a pool's room is its places). Inside a pool, the pool's own
request router (`LoraplexRequestRouter`) picks the replica. A request no pool can serve gets the
router's OpenAI-shaped refusal. `models` lists what the caller may use across the pools open to
it.

    handles = run_pools(fleet)
    router = run_router(fleet)
    answer = await router.completions.remote({"model": "sql", "prompt": "..."}, "Bearer KEY")
    listed = await router.models.remote("Bearer KEY")
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Set
from typing import Any

from loraplex.bearer import bearer
from loraplex.integrations.ray_serve import RayPool, pool_spec, serve
from loraplex.registry.registry import open_existing
from loraplex.router import model_lists
from loraplex.router.catalog import AdapterCatalog, registry_catalog
from loraplex.router.fairness import FairQueue, QueueFull, Waiter
from loraplex.router.fleet import Fleet
from loraplex.router.holdback import Holdback, Place
from loraplex.router.pools import Need, PoolSpec, tiers
from loraplex.router.routing import (
    Refusal,
    Wanted,
    base_names,
    eligible,
    need_of,
    no_room,
    refusal,
)
from loraplex.router.serve import registry_callers
from loraplex.router.splits import Splits, registry_splits
from loraplex.settings.pools import check_pools
from loraplex.settings.router import DEFAULTS as D

__all__ = ["PoolChooser", "LoraplexPoolRouter", "pool_spec", "router_app", "run_router"]
log = logging.getLogger("loraplex.ray")
WAITING_ROOM = 4096
"""Calls the router deployment takes beyond its pools' room: the requests waiting their turn."""
PLACED_TTL_S = 1.0
"""How long a pool's answer to whether an adapter is placed there stands (its request router
polls its replicas every 0.25 s)."""


class PoolChooser:
    """Which pool a request goes to. The fleet holds one member per pool (named after it) that
    stands for the pool's replicas: what the pool declares is what its workers serve, since they
    run its settings and a replica that does not match fails to start."""

    def __init__(
        self,
        specs: list[PoolSpec],
        capacity: dict[str, int],
        catalog: AdapterCatalog | None,
        caller_of,
        splits: Splits | None = None,
    ):
        self.fleet = Fleet([], None, pools=tuple(specs))
        for spec in specs:
            self.fleet.add(spec.name, spec.name, healthy=True)
        self.capacity, self.catalog, self.caller_of = capacity, catalog, caller_of
        self.splits = splits
        self.in_flight: Counter[str] = Counter()

    def wanted(
        self, model: str | None, authorization: str | None, user: str | None = None
    ) -> Wanted:
        """The request as routing reads it: its caller's tenant and priority, a split name's
        revision (sticky by `user`) and whether it is the canary, whether its adapter is warm."""
        tenant, priority = self.caller_of(bearer(authorization) or "")
        canary = False
        if model is not None and self.splits is not None:
            model, canary = self.splits.route(model, user)
        warm = bool(model and self.catalog is not None and self.catalog.warm(model))
        return Wanted(model, tenant, priority, canary, warm=warm)

    def candidates(self, wanted: Wanted, placed: Set[str] = frozenset()) -> list[str] | Refusal:
        """The eligible pools in the order tried, as `loraplex router` orders workers: a
        canary's `canary` pools first, then the pools of `placed` (where its adapter is placed),
        then a warm adapter's `warm` pools; then the tenant's dedicated pools, then the shared
        ones, in each the pools without a role first and the lowest max rank first."""
        need = need_of(self.fleet, self.catalog, wanted)
        order = [
            spec
            for group in self._tiers(need, wanted.tenant)
            for spec in sorted(group, key=lambda s: (s.role is not None, s.max_rank or 0))
        ]
        if not order:
            return refusal(self.fleet, need, wanted)
        return self.ordered(wanted, [spec.name for spec in order], placed)

    def ordered(self, wanted: Wanted, names: list[str], placed: Set[str]) -> list[str]:
        """`names` (eligible pools, in the tenant's order) with a canary's `canary` pools first,
        then the pools of `placed`, then a warm adapter's `warm` pools; stable within each."""
        roles = {name: self.fleet.pools[name].role for name in names}
        return sorted(
            names,
            key=lambda n: (
                wanted.canary and roles[n] != "canary",
                n not in placed,
                wanted.warm and roles[n] != "warm",
            ),
        )

    def with_room(self, candidates: list[str]) -> str | None:
        """The first pool whose requests open are below its room (None: all full)."""
        return next(iter(self.with_room_all(candidates)), None)

    def with_room_all(self, candidates: list[str]) -> list[str]:
        """The pools whose requests open are below their room, in the order given."""
        return [p for p in candidates if self.in_flight[p] < self.capacity[p]]

    def choose(self, model: str | None, authorization: str | None) -> str | Refusal:
        """The first eligible pool with room; when all are full, the first eligible one."""
        candidates = self.candidates(self.wanted(model, authorization))
        if isinstance(candidates, Refusal):
            return candidates
        return self.with_room(candidates) or candidates[0]

    def _tiers(self, need: Need, tenant: str | None) -> list[list[PoolSpec]]:
        members = list(self.fleet.workers.values())
        return [
            [w.pool for w in eligible(members, pools, need)]
            for pools in tiers(self.fleet.pools.values(), tenant)
        ]

    def is_base(self, model: str) -> bool:
        return model in base_names(self.fleet)

    def may_use(self, wanted: Wanted) -> bool:
        """Whether the request names a registered adapter its caller may use."""
        if wanted.model is None or self.catalog is None:
            return False
        return bool(self.catalog.need(wanted.model, wanted.tenant).base_digests)


class LoraplexPoolRouter:
    """The router deployment: each call goes to the chosen pool's deployment, as an adapter
    (Ray's multiplexed model) or for the bare base model; while every pool it may use is full,
    it waits its turn in its tenant's queue."""

    def __init__(
        self,
        specs: list[PoolSpec],
        capacity: dict[str, int],
        registry_url: str,
        queue_per_tenant: int = D.queue_per_tenant,
        tenant_weights: dict[str, float] | None = None,
        wait_s: float = D.request_timeout_s,
        shed_priority_below: int = D.shed_priority_below,
        holdback_window_s: float = D.holdback_window_s,
    ):
        registry = open_existing(registry_url)
        self.chooser = PoolChooser(
            specs,
            capacity,
            registry_catalog(registry),
            registry_callers(registry),
            registry_splits(registry),
        )
        self.queue: FairQueue[str] = FairQueue(dict(tenant_weights or {}), queue_per_tenant)
        self.holdback = Holdback(holdback_window_s, dict(tenant_weights or {}))
        self.wait_s, self.shed_priority_below = wait_s, shed_priority_below
        self.pools = {spec.name: serve.get_app_handle(spec.name) for spec in specs}
        self.placements: dict[tuple[str, str], tuple[float, bool]] = {}
        """(pool, model) -> when its pool last answered whether `model` is placed there, and
        the answer."""

    async def completions(self, body: dict, authorization: str | None = None) -> dict:
        """POST /v1/completions on a worker of the pool that serves `body["model"]`."""
        return await self._route("completions", body, authorization)

    async def chat_completions(self, body: dict, authorization: str | None = None) -> dict:
        return await self._route("chat_completions", body, authorization)

    async def _route(self, method: str, body: dict, authorization: str | None) -> dict:
        body = body if isinstance(body, dict) else {}
        model = body.get("model")
        model = model if isinstance(model, str) and model else None
        model = model or serve.get_multiplexed_model_id() or None
        user = body.get("user") if isinstance(body.get("user"), str) else None
        wanted = self.chooser.wanted(model, authorization, user)
        pool = await self._turn(wanted)
        if isinstance(pool, Refusal):
            return {"status": pool.status, "body": refusal_body(pool), "pool": None}
        if wanted.model != model:  # a split name's revision
            body = {**body, "model": wanted.model}
        handle = self.pools[pool]
        if wanted.model is not None and not self.chooser.is_base(wanted.model):
            handle = handle.options(multiplexed_model_id=wanted.model)
        try:
            answer = await getattr(handle, method).remote(body, authorization)
        finally:
            self.chooser.in_flight[pool] -= 1
            self.holdback.closed(wanted.tenant, pool)
            self.queue.admit(self._grant)
        return {**answer, "pool": pool}

    async def models(self, authorization: str | None = None) -> dict:
        """GET /v1/models across the pools open to the caller (its dedicated ones and the shared
        ones): each pool's list, a replica's worker's with the caller's key, merged, each model
        once, so every pool's base model is there; a worker's own refusal of the caller (401)
        when no pool lists any."""
        tenant, _ = self.chooser.caller_of(bearer(authorization) or "")
        groups = tiers(self.chooser.fleet.pools.values(), tenant)
        pools = [spec.name for group in groups for spec in group if spec.name in self.pools]
        asked = await asyncio.gather(*(self._listing(p, authorization) for p in pools))
        answers = [a for a in asked if a is not None]
        listed = [model_lists.entries(a["body"]) for a in answers if a["status"] == 200]
        if listed:
            return {"status": 200, "body": model_lists.merged(listed)}
        if answers:
            return answers[0]
        return {"status": 503, "body": refusal_body(Refusal(503, "no_worker", "no live replica"))}

    async def _listing(self, pool: str, authorization: str | None) -> dict | None:
        try:
            return await self.pools[pool].models.remote(authorization)
        except Exception as exc:  # noqa: BLE001 (a pool without a live replica lists nothing)
            log.warning("no model list from pool %s: %s", pool, exc)
            return None

    async def _turn(self, wanted: Wanted) -> str | Refusal:
        """The pool the request goes to, counted open there: the first eligible one with room
        (those where its adapter is placed first), else (every one full, or others waiting
        already: a newcomer does not pass them) its turn in its tenant's queue; without a queue,
        the first eligible one. While every eligible pool is full, a tenant below the shedding
        band is refused at once (`429 saturated`), as `loraplex router` sheds."""
        candidates = self.chooser.candidates(wanted)
        if isinstance(candidates, Refusal):
            return candidates
        placed = await self._placed(wanted, candidates)
        if placed:
            candidates = self.chooser.ordered(wanted, candidates, placed)
        room = self.chooser.with_room(candidates)
        if room is None and wanted.priority < self.shed_priority_below:
            return no_room("saturated-shed")
        self.holdback.arrived(wanted.tenant, wanted.priority, time.monotonic(), candidates)
        waits = len(self.queue) or self._holds_back(wanted.tenant, candidates)
        pool = None if waits else room
        if pool is None and not self.queue.limit:
            pool = candidates[0]
        if pool is None:
            return await self._wait(wanted, candidates)
        self._opened(wanted.tenant, pool)
        return pool

    def _holds_back(self, tenant: str | None, candidates: list[str]) -> bool:
        """Whether the free places of the pools `candidates` are kept for other tenants."""
        chooser = self.chooser
        places = [Place(p, chooser.capacity[p], chooser.in_flight[p]) for p in candidates]
        return self.holdback.keeps_from(tenant or "", places, time.monotonic())

    def _opened(self, tenant: str | None, pool: str) -> None:
        self.chooser.in_flight[pool] += 1
        self.holdback.opened(tenant, pool, time.monotonic())

    async def _placed(self, wanted: Wanted, candidates: list[str]) -> frozenset[str]:
        """The pools of `candidates` where the adapter is placed on a replica with room: each
        pool with room is asked through its handle (its request router sends the call to such a
        replica, `LoraplexReplica.placed`), its answer standing for `PLACED_TTL_S`. Only for a
        registered adapter the caller may use, with more than one pool to choose from."""
        model = wanted.model
        if model is None or len(candidates) < 2 or not self.chooser.may_use(wanted):
            return frozenset()
        now = time.monotonic()
        if len(self.placements) >= 10_000:  # one entry per pool and adapter: keep it bounded
            self.placements.clear()

        def fresh(pool: str) -> bool:
            return now - self.placements.get((pool, model), (-math.inf, False))[0] <= PLACED_TTL_S

        asked = [pool for pool in self.chooser.with_room_all(candidates) if not fresh(pool)]
        answers = await asyncio.gather(*(self._ask_placed(pool, model) for pool in asked))
        for pool, answer in zip(asked, answers, strict=True):
            self.placements[(pool, model)] = (now, answer)
        return frozenset(p for p in candidates if fresh(p) and self.placements[(p, model)][1])

    async def _ask_placed(self, pool: str, model: str) -> bool:
        handle = self.pools[pool].options(multiplexed_model_id=model)

        async def answer() -> bool:
            return bool(await handle.placed.remote())

        try:
            return await asyncio.wait_for(answer(), PLACED_TTL_S)
        except Exception as exc:  # noqa: BLE001 (no answer: nothing placed there, as far as known)
            log.info("pool %s did not say whether %s is placed there: %r", pool, model, exc)
            return False

    async def _wait(self, wanted: Wanted, candidates: list[str]) -> str | Refusal:
        tenant = wanted.tenant or ""
        try:
            waiter = self.queue.join(tenant, wanted.priority, candidates)
        except QueueFull:
            message = f"every pool is full and {self.queue.limit} requests of tenant "
            message += f"{tenant or '(unknown)'} are waiting already"
            return Refusal(429, "saturated", message)
        self.queue.admit(self._grant)
        try:
            return await asyncio.wait_for(waiter.granted, self.wait_s)
        except TimeoutError:
            return Refusal(503, "no_worker", f"no pool had room within {self.wait_s:g} s")
        except asyncio.CancelledError:  # the caller left: a pool it was granted is given back
            granted = waiter.granted
            if granted.done() and not granted.cancelled():
                self.chooser.in_flight[granted.result()] -= 1
                self.holdback.closed(wanted.tenant, granted.result())
                self.queue.admit(self._grant)
            raise
        finally:
            self.queue.leave(waiter)

    def _grant(self, waiter: Waiter[str]) -> str | None:
        """The waiter's pool when one of its pools has room and none of it is kept for another
        tenant (None: not yet), counted open."""
        candidates: list[str] = waiter.what  # type: ignore[assignment]
        pool = self.chooser.with_room(candidates)
        if pool is None or self._holds_back(waiter.tenant or None, candidates):
            return None
        self._opened(waiter.tenant or None, pool)
        return pool


def refusal_body(refused: Refusal) -> dict:
    """The OpenAI error body `loraplex router` answers a request it cannot route with."""
    of_model = refused.status == 404
    return {
        "error": {
            "message": refused.message,
            "type": "invalid_request_error" if of_model else "server_error",
            "code": refused.code,
            "param": "model" if of_model else None,
        }
    }


def router_app(
    pools: list[RayPool],
    max_ongoing_requests: int = 64,
    name: str = "loraplex-router",
    queue_per_tenant: int = D.queue_per_tenant,
    tenant_weights: dict[str, float] | None = None,
    shed_priority_below: int = D.shed_priority_below,
    holdback_window_s: float = D.holdback_window_s,
) -> Any:
    """The router deployment over the pool applications `run_pools` started (the same `pools`
    and `max_ongoing_requests`), for `serve.run`; the pools share one registry. A pool's room is
    `num_replicas` × `max_ongoing_requests`; beyond it, each tenant may have `queue_per_tenant`
    requests waiting (0: none wait, the first eligible pool takes them), granted by
    `tenant_weights` (tenant -> weight, 1 when not named), and a tenant whose registry priority
    is below `shed_priority_below` is refused instead; places are held back for a tenant owed
    them while it sent within `holdback_window_s` (0: none; `loraplex router
    --holdback-window-s`)."""
    specs = [pool_spec(pool) for pool in pools]
    check_pools(specs)
    registries = {str(pool.options.registry_url) for pool in pools}
    if len(registries) != 1:
        raise ValueError(f"pools on registries {sorted(registries)}: give them the fleet's one")
    capacity = {pool.name: pool.num_replicas * max_ongoing_requests for pool in pools}
    return (
        serve.deployment(LoraplexPoolRouter, name=name)
        .options(
            max_ongoing_requests=sum(capacity.values()) + WAITING_ROOM,
            ray_actor_options={"num_cpus": 0},
        )
        .bind(
            specs,
            capacity,
            registries.pop(),
            queue_per_tenant,
            tenant_weights,
            shed_priority_below=shed_priority_below,
            holdback_window_s=holdback_window_s,
        )
    )


def run_router(
    pools: list[RayPool],
    max_ongoing_requests: int = 64,
    name: str = "loraplex-router",
    **kwargs: Any,
):
    """Runs `router_app` as a Serve application of its own, named `name`: its handle. `kwargs`:
    `queue_per_tenant`, `tenant_weights`, `shed_priority_below`, `holdback_window_s`."""
    app = router_app(pools, max_ongoing_requests, name, **kwargs)
    return serve.run(app, name=name, route_prefix=None)
