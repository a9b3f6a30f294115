"""Admission control: a bounded waiting queue and per-tenant limits on requests in flight and
waiting (429 with Retry-After)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loraplex.server.errors import overloaded

if TYPE_CHECKING:
    from loraplex.engines.contract import Engine
    from loraplex.server.adapters import AdapterResolver, Target
    from loraplex.server.middleware import RequestContext


class Ticket:
    """One admitted request: waiting until its first output, in flight until closed."""

    def __init__(self, admission: Admission, tenant: str):
        self.admission = admission
        self.tenant = tenant
        self.is_waiting = True
        self.is_closed = False

    def started(self) -> None:
        if self.is_waiting:
            self.is_waiting = False
            self.admission.num_waiting -= 1
            _decrement(self.admission.waiting, self.tenant)

    def close(self) -> None:
        if self.is_closed:
            return
        self.started()
        self.is_closed = True
        _decrement(self.admission.in_flight, self.tenant)


def _decrement(counts: dict[str, int], tenant: str) -> None:
    counts[tenant] -= 1
    if not counts[tenant]:
        del counts[tenant]


class Admission:
    """Counts requests on the event loop thread (no locks); refuses instead of letting
    requests wait without bound."""

    def __init__(self, max_waiting: int, max_per_tenant: int | None, retry_after_s: int = 1):
        self.max_waiting = max_waiting
        self.max_per_tenant = max_per_tenant
        self.retry_after_s = retry_after_s
        self.num_waiting = 0
        self.in_flight: dict[str, int] = {}
        self.waiting: dict[str, int] = {}

    def admit(
        self, tenant: str, max_in_flight: int | None = None, max_waiting: int | None = None
    ) -> Ticket:
        """A ticket, or a 429 APIError (code `server_overloaded` or `tenant_quota_exceeded`).
        `max_in_flight` and `max_waiting`: the tenant's own limits (its registry fields), which
        replace the server's per-tenant limit and add one under the server's queue bound."""
        if self.num_waiting >= self.max_waiting:
            raise overloaded(
                f"The server is at capacity ({self.num_waiting} requests waiting); retry later.",
                self.retry_after_s,
                "server_overloaded",
            )
        limit = max_in_flight if max_in_flight is not None else self.max_per_tenant
        if limit is not None and self.in_flight.get(tenant, 0) >= limit:
            raise overloaded(
                f"Tenant {tenant!r} has {limit} requests in flight, its limit; retry later.",
                self.retry_after_s,
                "tenant_quota_exceeded",
            )
        if max_waiting is not None and self.waiting.get(tenant, 0) >= max_waiting:
            raise overloaded(
                f"Tenant {tenant!r} has {max_waiting} requests waiting, its limit; retry later.",
                self.retry_after_s,
                "tenant_quota_exceeded",
            )
        self.num_waiting += 1
        self.waiting[tenant] = self.waiting.get(tenant, 0) + 1
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        return Ticket(self, tenant)

    @property
    def num_in_flight(self) -> int:
        return sum(self.in_flight.values())


class Admitted:
    """One admitted request's hold on the server and the engine: its ticket, its target counted in
    use (the resolver's), and what the engine's `acquire` held; `finish` gives them back, once."""

    def __init__(
        self,
        ticket: Ticket,
        engine: Engine,
        resolver: AdapterResolver,
        ctx: RequestContext,
        target: Target,
    ):
        self.ticket, self.engine, self.resolver = ticket, engine, resolver
        self.ctx, self.target = ctx, target
        self.held: Any = None
        """What the engine's `acquire` gave (vLLM: the adapter's LoRARequest; native: nothing)."""
        self.is_held = False
        self.is_finished = False
        self._at_finish: list[Callable[[], None]] = []
        resolver.started(target)

    async def acquire(self) -> None:
        self.held = await self.engine.acquire(self.target.ref)
        self.is_held = True

    def started(self) -> None:
        """Out of the waiting queue: running in the engine."""
        self.ticket.started()

    def at_finish(self, record: Callable[[], None]) -> None:
        """Call `record` once the request has finished (its usage and timings)."""
        self._at_finish.append(record)

    def finish(self) -> None:
        if self.is_finished:
            return
        self.is_finished = True
        if self.is_held:
            self.engine.release(self.target.ref, self.held)
        self.ticket.close()
        self.resolver.finished(self.target)
        for record in self._at_finish:
            record()
