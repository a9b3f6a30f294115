"""The admission rule of a step, shared by the engine's scheduler and the simulator's workers.

Waiting requests are admitted first come, first served while the step has room. A request whose
adapter cannot be taken is passed over and later ones go ahead; once an adapter is found blocked
(loading, or its acquire can only fail) its other requests are passed over for the rest of the step,
because a load ends, and a slot frees, only between steps.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")  # a waiting request
K = TypeVar("K", bound=Hashable)  # an adapter's cache key


class Take(enum.Enum):
    """What asking for a request's adapter gave."""

    TAKEN = "taken"
    """The request holds the adapter's slot."""
    BLOCKED = "blocked"
    """Nothing this step can change: the adapter is loading (or every slot is held)."""
    REFUSED = "refused"
    """Not now: no slot could be freed, or the step's LoRA bytes are spent; a later step may
    differ."""


@dataclass
class Admission(Generic[K]):
    """What a step's admission left behind."""

    blocked: dict[K, None] = field(default_factory=dict)
    """Adapters found blocked, in the order found."""
    refused: bool = False
    """Some request was refused an adapter that time alone may free."""


def admit_waiting(
    waiting: Iterable[R],
    *,
    has_room: Callable[[R], bool],
    adapter_of: Callable[[R], K | None],
    take_adapter: Callable[[R], Take],
    admit: Callable[[R], None],
) -> Admission[K]:
    """Admit from `waiting` (iterated over a copy) until one request finds no room.

    `has_room` says whether the step can take the request (sequence count, token budget, memory);
    the first that does not fit stops admission, so later requests never overtake it for those.
    `take_adapter` asks for the request's adapter; `admit` moves the request into the batch.
    """
    result: Admission[K] = Admission()
    for req in list(waiting):
        if not has_room(req):
            break
        key = adapter_of(req)
        if key is not None:
            if key in result.blocked:
                continue
            took = take_adapter(req)
            if took is Take.BLOCKED:
                result.blocked[key] = None
                continue
            if took is Take.REFUSED:
                result.refused = True
                continue
        admit(req)
    return result
