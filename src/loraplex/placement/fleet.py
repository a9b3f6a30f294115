"""The fleet as one `PlacementPolicy.plan` works on it: who holds which adapter, the room left on
each worker (slots, bytes), each tenant's placements, and each worker's placed demand.

A worker's placed demand (its load) is the sum, over the adapters placed on it, of the adapter's
fleet demand shared evenly among the workers it is placed on. Draining workers hold placements
but take none and count in no replica count or load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from loraplex.placement.records import AdapterView, WorkerView


def placeable_slots(slots: int, share: float, min_free_slots: int) -> int:
    """How many of a worker's `slots` placement may pin: `share` of them, leaving
    `min_free_slots` unpinned, yet one on a worker of two or more slots (a worker pins all its
    slots but one, so the reserve never takes the only one it would pin)."""
    return max(0, min(int(slots * share), slots - min_free_slots), min(1, slots - 1))


class Fleet:
    def __init__(
        self,
        workers: Sequence[WorkerView],
        adapters: Mapping[str, AdapterView],
        demand: Mapping[str, float],
        slot_share: float,
        tenant_budgets: Mapping[str, int],
        min_free_slots: int = 1,
    ):
        self.adapters = adapters
        self.demand = demand
        self.tenant_budgets = tenant_budgets
        self._workers = {w.name: w for w in sorted(workers, key=lambda w: w.name)}
        self._placed = {w.name: set(w.placed) for w in self._workers.values()}
        self._slots = {
            w.name: placeable_slots(w.slots, slot_share, min_free_slots)
            for w in self._workers.values()
        }
        self._bytes = {n: sum(self._nbytes(k) for k in p) for n, p in self._placed.items()}
        self._holders: dict[str, set[str]] = {}
        self._tenants: dict[str, int] = {}
        self._load = dict.fromkeys(self._workers, 0.0)
        for w in self._workers.values():
            for key in sorted(w.placed):  # sorted: sums of floats in one order, every process
                self._count_tenant(key, +1)
                if not w.draining:
                    self._holders.setdefault(key, set()).add(w.name)
        for key, names in self._holders.items():
            for name in names:
                self._load[name] += self.share(key)

    def _nbytes(self, key: str) -> int:
        a = self.adapters.get(key)
        return a.nbytes if a else 0

    def _count_tenant(self, key: str, delta: int) -> None:
        a = self.adapters.get(key)
        if a is not None and a.tenant is not None:
            self._tenants[a.tenant] = self._tenants.get(a.tenant, 0) + delta

    def live(self) -> Iterable[WorkerView]:
        return self._workers.values()

    def draining(self) -> list[WorkerView]:
        return [w for w in self._workers.values() if w.draining]

    def worker(self, name: str) -> WorkerView:
        return self._workers[name]

    def placed_on(self, name: str) -> set[str]:
        return self._placed[name]

    def registered(self) -> list[str]:
        return [k for k in self.demand if k in self.adapters]

    def placed_keys(self) -> set[str]:
        return {k for k, names in self._holders.items() if names}

    def replicas(self, key: str) -> int:
        return len(self._holders.get(key, ()))

    def share(self, key: str) -> float:
        """The demand each holder of `key` serves."""
        return self.demand.get(key, 0.0) / max(1, self.replicas(key))

    def load(self, name: str) -> float:
        return self._load[name]

    def mean_load(self) -> float:
        loads = [self._load[w.name] for w in self._workers.values() if not w.draining]
        return sum(loads) / len(loads) if loads else 0.0

    def hot_workers(self, threshold: float) -> list[str]:
        hot = [n for n, w in self._workers.items() if not w.draining and self._load[n] > threshold]
        return sorted(hot, key=lambda n: (-self._load[n], n))

    def most_loaded_holders(self, key: str) -> list[str]:
        return sorted(self._holders.get(key, ()), key=lambda n: (-self._load[n], n))

    def shares_by_size(self, name: str) -> list[str]:
        keys = self._placed[name] & self.placed_keys()
        return sorted(keys, key=lambda k: (-self.share(k), k))

    def tier(self, key: str, name: str) -> int | None:
        """0: the adapter's tenant's dedicated pool; 1: a shared pool; None: it may not go there."""
        a, w = self.adapters[key], self._workers[name]
        if w.draining or name in self._holders.get(key, ()) or key in self._placed[name]:
            return None
        if w.base != a.base or w.max_rank < a.rank:
            return None
        if not w.tenants:
            return 1
        return 0 if a.tenant is not None and a.tenant in w.tenants else None

    def has_room(self, key: str, name: str, freed: str | None = None) -> bool:
        """Whether `name` can take `key` (once `freed`, if given, leaves it)."""
        a = self.adapters[key]
        slots = len(self._placed[name]) - (freed is not None)
        nbytes = self._bytes[name] - (self._nbytes(freed) if freed else 0)
        if slots + 1 > self._slots[name] or nbytes + a.nbytes > self._workers[name].host_bytes:
            return False
        budget = self.tenant_budgets.get(a.tenant) if a.tenant is not None else None
        if budget is None:
            return True
        frees_one = freed is not None and self.adapters.get(freed, a).tenant == a.tenant
        return self._tenants.get(a.tenant, 0) - frees_one < budget  # type: ignore[arg-type]

    def candidates(self, key: str, ignore_room: bool = False) -> list[str]:
        """The workers that may take `key`, best first: its tenant's pool before the shared
        ones, the lowest max rank that serves it (packing by rank), a worker that already gets
        its traffic, the least placed demand."""
        a = self.adapters[key]
        ranked = []
        for name, w in self._workers.items():
            tier = self.tier(key, name)
            if tier is None or not (ignore_room or self.has_room(key, name)):
                continue
            cold = 0 if w.demand.get(key) else 1
            ranked.append(((tier, w.max_rank - a.rank, cold, self._load[name], name), name))
        return [name for _, name in sorted(ranked)]

    def best_worker(self, key: str, below: float | None = None) -> str | None:
        for name in self.candidates(key):
            if below is None or self._load[name] < below:
                return name
        return None

    def place(self, key: str, name: str) -> None:
        self._reshare(key, +1, name)
        self._placed[name].add(key)
        self._bytes[name] += self._nbytes(key)
        self._count_tenant(key, +1)

    def release(self, key: str, name: str) -> None:
        if name in self._holders.get(key, ()):
            self._reshare(key, -1, name)
        self._placed[name].discard(key)
        self._bytes[name] -= self._nbytes(key)
        self._count_tenant(key, -1)

    def _reshare(self, key: str, delta: int, name: str) -> None:
        """Adds (+1) or removes (-1) `name` as a holder of `key`, moving its demand's shares."""
        holders = self._holders.setdefault(key, set())
        old = self.share(key) if holders else 0.0
        for h in sorted(holders):
            self._load[h] -= old
        if delta > 0:
            holders.add(name)
        else:
            holders.discard(name)
        new = self.share(key) if holders else 0.0
        for h in sorted(holders):
            self._load[h] += new
        if delta < 0:
            self._load[name] = max(0.0, self._load[name])
