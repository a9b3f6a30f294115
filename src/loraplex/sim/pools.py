"""`simulate --pool` and `plan --pool`: a fleet as pools, routed as the router routes them
(`router.pools`, `router.routing`): a request goes to the workers whose pool serves its adapter's
rank, in its tenant's dedicated pools first, then in the shared ones while those are saturated."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.router.picker import Pick, Picker, WorkerView
from loraplex.router.pools import Need, Reported, serves, tiers
from loraplex.router.routing import Wanted, first_with_room
from loraplex.settings.pools import PoolSpec, parse_pool


@dataclass(frozen=True)
class SimPool:
    spec: PoolSpec
    workers: int


def parse_sim_pool(text: str) -> SimPool:
    """The router's `--pool` spec: `name=N,workers=COUNT[,max-rank=R][,tenants=T1+T2]`, where
    `workers` is a count or, as the router takes it, URLs joined by `+` (their count); `base-model`
    is read and checked as the router's (ValueError saying what is wrong)."""
    fields = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"pool {text!r}: {part!r} is not KEY=VALUE")
        fields[key.strip()] = value.strip()
    count = fields.pop("workers", "1")
    if count.startswith(("http://", "https://")):
        workers = len(parse_pool({**fields, "workers": count}).workers)
    else:
        try:
            workers = int(count)
        except ValueError:
            raise ValueError(f"pool {text!r}: workers={count!r} is not a count") from None
    if workers < 1:
        raise ValueError(f"pool {text!r}: workers must be at least 1")
    return SimPool(parse_pool(fields), workers)


class PoolRouting:
    """Which simulated worker a request goes to, over `pools` (worker i belongs to the pool whose
    range holds i)."""

    def __init__(self, pools: tuple[SimPool, ...], picker: Picker):
        self.picker = picker
        self.pool_of: list[PoolSpec] = [p.spec for p in pools for _ in range(p.workers)]
        self.specs = [p.spec for p in pools]

    def pick(self, views: list[WorkerView], tenant: str, rank: int, model, priority) -> Pick | None:
        """The router's pick; None: no pool open to the tenant serves the rank."""
        need = Need(rank=rank)
        groups = []
        for allowed in tiers(self.specs, tenant):
            names = {p.name for p in allowed}
            groups.append(
                [
                    v
                    for v, pool in zip(views, self.pool_of)
                    if pool.name in names and serves(pool, Reported(), need)
                ]
            )
        groups = [g for g in groups if g]
        if not groups:
            return None
        return first_with_room(self.picker, groups, Wanted(model, tenant, priority))

    def name_of(self, worker: int) -> str:
        return self.pool_of[worker].name
