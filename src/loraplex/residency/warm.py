"""The warm sets and the host cache's rules, over plain data: which adapters the demand keeps in a
slot (the gpu warm set) and in host memory (the cpu warm set), which of a runtime's host copies
goes for a load (`host_cache_victim`) and which comes back ahead of its requests
(`host_cache_restore`), and which busy adapters of the gpu warm set a runtime pins in its slots
(`warm_pins`). Placement (`placement.py`) decides the native cache's slots and host copies with
them; the vLLM residency decides vLLM's host cache and pinned slots with them."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol

from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import Candidate, DemandTracker

WARM_FLOOR = 2.0  # short-window (gpu) or 1-hour (cpu) requests that put an adapter in a warm set
PIN_BUSY, KEEP_BUSY = 0.5, 0.25
"""An adapter of the gpu warm set is pinned in a runtime's slots once it has had requests running
half the recent time (`BusyShare`), and keeps its pin down to a quarter: a pinned slot that idles
is one the other adapters lose."""
BUSY_WINDOW_S = 10.0  # the decay of `BusyShare`


@dataclass(slots=True)
class BusyShare:
    """The share of recent time an adapter had requests running: its 0/1 busy state averaged over
    time, decayed over BUSY_WINDOW_S."""

    share: float = 0.0
    at: float = 0.0
    busy: bool = False

    def set(self, busy: bool, now: float) -> None:
        self.share, self.at, self.busy = self.read(now), now, busy

    def read(self, now: float) -> float:
        kept = math.exp(-max(0.0, now - self.at) / BUSY_WINDOW_S)
        return self.share * kept + (1.0 - kept) * self.busy


class HostCached(Protocol):
    """What a runtime's host cache weighs of an adapter (`host_cache_victim`,
    `host_cache_restore`): the vLLM engine's `Resident`, or an `Adapter`."""

    ref: AdapterRef
    last_access: float
    loaded_at: float  # its last activation into a slot
    nbytes: int


def gpu_warm_set(
    demand: DemandTracker, now: float, cap: int, overdue_gaps: float | None
) -> list[AdapterKey]:
    """The gpu warm set, most demanded first: up to `cap` adapters with at least WARM_FLOOR
    requests in the short window, leaving out those whose requests stopped (a policy's
    `overdue_gaps`; None: none is left out)."""
    chosen = demand.top(now, 0, WARM_FLOOR, cap)  # in rank order, as one by one
    if overdue_gaps is None or not demand.any_overdue(chosen, now, overdue_gaps):
        return chosen
    # the next ones take the places of those whose requests stopped
    ranked = itertools.takewhile(lambda item: item[1] >= WARM_FLOOR, demand.ranked(now, 0))
    live = (k for k, _ in ranked if not demand.overdue(k, now, overdue_gaps))
    return list(itertools.islice(live, cap))


def cpu_warm_set(
    demand: DemandTracker,
    now: float,
    fits: Callable[[AdapterKey], bool],
    overdue_gaps: float | None,
) -> list[AdapterKey]:
    """The cpu warm set, most demanded first: adapters with at least WARM_FLOOR requests over the
    hour's window, leaving out those whose requests stopped (their hour's count would keep them for
    minutes), for as long as `fits` takes the next one (the native cache: up to half its host
    bytes; the vLLM engine: up to half its host cache's places)."""
    chosen = []
    for key, count in demand.ranked(now, 1):
        if count < WARM_FLOOR:
            break
        if overdue_gaps is not None and demand.overdue(key, now, overdue_gaps):
            continue
        if not fits(key):
            break
        chosen.append(key)
    return chosen


def host_cache_restore(
    policy,
    demand: DemandTracker,
    now: float,
    cpu_warm: Sequence[AdapterKey],
    held: Collection[AdapterKey],
    places: int,
    removable: Sequence[tuple[AdapterKey, HostCached]],
    entries: Mapping[AdapterKey, HostCached],
    gpu_warm: Set[AdapterKey],
    loads: float,
) -> tuple[AdapterKey, AdapterKey | None] | None:
    """For a runtime's host cache of `places` adapters (the vLLM engine's), holding `held`: the
    adapter of the cpu warm set to add back ahead of its requests, and the one to remove for it
    (None: a place is free). None: none now.

    Only an adapter expected back before the host cache turns over is added: one whose
    short-window request count, times the places, is at least `loads` (the short-window count of
    the loads that requests caused); one expected later would be pushed out again before its next
    request. It takes a free place, or that of the policy's victim among `removable` (idle, not
    pinned) outside both warm sets."""
    warm = set(cpu_warm) | gpu_warm
    turnover = loads / max(1, places)
    for key in cpu_warm:
        if key in held:
            continue
        if demand.short(key, now) < turnover:
            return None
        if len(held) < places:
            return key, None
        others = [(k, e) for k, e in removable if k not in warm]
        if not others:
            return None
        return key, host_cache_victim(policy, others, (key, entries[key]), demand, gpu_warm, now)
    return None


def warm_pins(
    demand: DemandTracker,
    now: float,
    room: int,
    overdue_gaps: float | None,
    held: Iterable[AdapterKey],
    pinned: Set[AdapterKey],
    busy: Callable[[AdapterKey], float],
    exclude: Collection[AdapterKey] = (),
) -> list[AdapterKey]:
    """What a runtime whose unpin is costly (the vLLM engine: an unpin is a remove and an add
    again) pins of the gpu warm set in its device slots, most demanded first: the adapters of
    `held` (its host cache) but `exclude` (the operator's pins) with the set's demand (at least
    WARM_FLOOR short-window requests, not overdue) that had requests running half the recent time
    (`busy`: PIN_BUSY, or KEEP_BUSY for one `pinned` already), all of them or none. With more of
    them than `room`, a part pinned leaves the others fewer slots to share with the rest of the
    traffic than none pinned (docs/cache.md has the measurement)."""
    chosen = []
    for key in held:
        if key in exclude or busy(key) < (KEEP_BUSY if key in pinned else PIN_BUSY):
            continue
        if demand.short(key, now) < WARM_FLOOR:
            continue
        if overdue_gaps is not None and demand.overdue(key, now, overdue_gaps):
            continue
        chosen.append(key)
        if len(chosen) > room:
            return []
    weights = dict(zip(chosen, demand.shorts(chosen, now)))
    return sorted(chosen, key=weights.__getitem__, reverse=True)


def host_cache_victim(
    policy,
    removable: Sequence[tuple[AdapterKey, HostCached]],
    incoming: tuple[AdapterKey, HostCached],
    demand: DemandTracker,
    gpu_warm: Set[AdapterKey],
    now: float,
) -> AdapterKey | None:
    """Of the adapters a runtime's host cache may drop (`removable`: none pinned or in use), the
    one to drop so that `incoming` fits (the vLLM engine's host cache): the policy's victim,
    weighed by its short-window demand and the gpu warm set; the least recently used when the
    policy's protections refuse them all, since a request waits for the room. None: none."""

    def candidate(key: AdapterKey, e: HostCached) -> Candidate:
        ref = e.ref
        return Candidate(
            key,
            e.nbytes,
            e.last_access,
            e.loaded_at,
            demand.short(key, now),
            ref.tenant,
            ref.priority,
            0.0,
            key in gpu_warm,
        )

    candidates = [candidate(k, e) for k, e in removable]
    victim = policy.choose_victim(candidates, now, candidate(*incoming))
    if victim is None and candidates:
        victim = min(candidates, key=lambda c: c.last_access).key
    return victim
