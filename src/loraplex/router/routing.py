"""Which worker a request goes to: the workers that can serve it (its base model, its adapter's
rank) in the pools its tenant may use, the tenant's dedicated pools first and the shared ones
when those are saturated; inside them, the picker."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loraplex.router.catalog import AdapterCatalog
from loraplex.router.fleet import Fleet, Worker
from loraplex.router.picker import Pick, Picker, WorkerView
from loraplex.router.pools import Need, PoolSpec, serves, tiers
from loraplex.router.splits import Splits, pool_first


@dataclass(frozen=True)
class Refusal:
    """No worker may serve the request: the answer's status, code and message."""

    status: int
    code: str
    message: str


@dataclass(frozen=True)
class Wanted:
    """A request as routing reads it."""

    model: str | None
    """The adapter (or base model) as sent; None: no model named."""
    tenant: str | None
    priority: int = 0
    canary: bool = False
    prompt: tuple[int, ...] = ()
    """The hash chain of its prompt's blocks (`router/prefixes.py`); none: no prefix scoring."""
    warm: bool = False
    """Its adapter is pinned or in tier A (a warm policy of gpu): a `warm` pool's workers first."""


def need_of(fleet: Fleet, catalog: AdapterCatalog | None, r: Wanted) -> Need:
    """A base model by its served name (any worker's, or any pool's declared), else what the
    registry says of the adapter (nothing without a registry)."""
    if r.model is None:
        return Need()
    if r.model in base_names(fleet):
        return Need(base_model=r.model, label=r.model)
    return catalog.need(r.model, r.tenant) if catalog is not None else Need()


def prefix_key(catalog: AdapterCatalog | None, r: Wanted) -> str:
    """What the request's KV prefix is reusable under: its adapter revision's digest when the
    registry resolves the name to one revision, else the name as sent."""
    if r.model is None:
        return ""
    if catalog is not None:
        facts = [f for f in catalog.revisions(r.model) if f.may_use(r.tenant)]
        if len(facts) == 1 and facts[0].digest:
            return facts[0].digest
    return r.model


def base_names(fleet: Fleet) -> set[str]:
    reported = {w.reported.base_model for w in fleet.workers.values()}
    declared = {p.base_model for p in fleet.pools.values()}
    return {name for name in reported | declared if name}


def eligible(workers: list[Worker], pools: list[PoolSpec], need: Need) -> list[Worker]:
    """The workers of `pools` that can serve `need` and stand in their pool, healthy or not."""
    names = {p.name for p in pools}
    return [
        w
        for w in workers
        if w.pool.name in names and w.problem is None and serves(w.pool, w.reported, need)
    ]


def route(
    fleet: Fleet, picker: Picker, splits: Splits | None, need: Need, r: Wanted
) -> Pick | Refusal:
    """The pick among the eligible workers: a canary's pool first (a split name's canary workers,
    else a `canary` pool), then the workers its adapter is placed on, then a `warm` pool for a
    pinned or tier-A adapter, then the tenant's dedicated pools, then the shared ones."""
    workers = list(fleet.workers.values())
    groups = [eligible(workers, pools, need) for pools in tiers(fleet.pools.values(), r.tenant)]
    if not any(groups):
        return refusal(fleet, need, r)
    views = {v.url: v for v in fleet.views(r.prompt)}
    in_groups = [[views[w.url] for w in group] for group in groups if group]
    every = [v for group in in_groups for v in group]
    if r.canary and r.model is not None:
        canary_pool = splits.pools.get(r.model.partition("@")[0], ()) if splits else ()
        pooled = pool_first(
            picker, every, r.model, r.priority, canary_pool or role_workers(fleet, "canary")
        )
        if pooled is not None:
            return pooled
    if r.model is not None:
        placed = tuple(w.url for w in workers if placed_here(w, r.model))
        chosen = among(picker, every, placed, r, "placed")
        if chosen is None and r.warm:
            chosen = among(picker, every, role_workers(fleet, "warm"), r, "warm-pool")
        if chosen is not None:
            return chosen
    return first_with_room(picker, in_groups, r)


def placed_here(worker: Worker, model: str) -> bool:
    """Whether the placement controller placed `model` (a bare name: any of its revisions) on
    the worker."""
    return placed_in(worker.placed, model)


def placed_in(placed: Iterable[str], model: str) -> bool:
    """Whether `model` (a bare name: any of its revisions) is among the placements `placed`
    (`name@revision`)."""
    if "@" in model:
        return model in placed
    return any(p.partition("@")[0] == model for p in placed)


def role_workers(fleet: Fleet, role: str) -> tuple[str, ...]:
    """The workers of the pools of `role`."""
    return tuple(w.url for w in fleet.workers.values() if w.pool.role == role)


def among(
    picker: Picker, views: list[WorkerView], urls: tuple[str, ...], r: Wanted, reason: str
) -> Pick | None:
    """The pick among the eligible workers of `urls` while one of them has room (None: none
    eligible, or all saturated); the other eligible workers follow in the ranking, for the
    retry."""
    chosen_from = [v for v in views if v.healthy and v.url in urls]
    if not chosen_from:
        return None
    chosen = picker.pick(chosen_from, r.model, r.priority)
    if chosen.url is None or chosen.reason.startswith("saturated"):
        return None
    others = [v.url for v in views if v.healthy and v.url not in chosen.ranking]
    return Pick((*chosen.ranking, *others), f"{reason}-{chosen.reason}")


def first_with_room(picker: Picker, groups: list[list[WorkerView]], r: Wanted) -> Pick:
    """The pick in the first group with a worker below saturation; when none has one, the first
    group's (fallback or shed). The other groups' workers follow in the ranking, for the retry."""
    picks = []
    for views in groups:
        chosen = picker.pick(views, r.model, r.priority)
        picks.append(chosen)
        if chosen.url is not None and not chosen.reason.startswith("saturated"):
            break
    else:
        chosen = next((p for p in picks if p.url is not None), picks[0])
    rest = [v.url for group in groups for v in group if v.healthy and v.url not in chosen.ranking]
    if chosen.url is None:
        return chosen
    return Pick((*chosen.ranking, *rest), chosen.reason)


def no_room(reason: str) -> Refusal:
    """No worker can take the request now: 429 `saturated` when it is shed (every worker it may
    use is saturated and its tenant's priority is below the shedding band), else 503; both are
    worth a retry later."""
    status, code = (429, "saturated") if reason == "saturated-shed" else (503, "no_worker")
    return Refusal(status, code, f"no worker can take the request now ({reason})")


def refusal(fleet: Fleet, need: Need, r: Wanted) -> Refusal:
    """Why no worker of the pools the tenant may use can serve the request."""
    workers = list(fleet.workers.values())
    anywhere = eligible(workers, list(fleet.pools.values()), need)
    misfits = [w for w in workers if w.problem is not None]
    if anywhere:
        where = f"tenant {r.tenant}" if r.tenant else "this caller"
        message = f"no pool open to {where} serves {r.model}"
    elif need.rank and eligible(workers, list(fleet.pools.values()), Need(**_base_only(need))):
        message = f"no worker serves adapters of rank {need.rank} on base model {need.label}"
    elif need.label:
        message = f"no worker serves base model {need.label}"
    else:
        message = "no worker in the pools"
    if misfits:
        message += f" ({len(misfits)} misconfigured worker(s) excluded: see GET /admin/workers)"
    if not need.label:
        return Refusal(503, "no_worker", message)
    return Refusal(404, "model_not_available", message)


def _base_only(need: Need) -> dict:
    return {"base_model": need.base_model, "base_digests": need.base_digests, "label": need.label}
