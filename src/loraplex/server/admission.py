"""Admission control: a bounded waiting queue and a per-tenant concurrency limit (429 with Retry-After)."""

from __future__ import annotations

from loraplex.server.errors import overloaded


class Ticket:
    """One admitted request: waiting until its first output, in flight until closed."""

    def __init__(self, admission: "Admission", tenant: str):
        self.admission = admission
        self.tenant = tenant
        self.is_waiting = True
        self.is_closed = False

    def started(self) -> None:
        if self.is_waiting:
            self.is_waiting = False
            self.admission.num_waiting -= 1

    def close(self) -> None:
        if self.is_closed:
            return
        self.started()
        self.is_closed = True
        self.admission.in_flight[self.tenant] -= 1
        if not self.admission.in_flight[self.tenant]:
            del self.admission.in_flight[self.tenant]


class Admission:
    """Counts requests on the event loop thread (no locks); refuses instead of queueing without bound."""

    def __init__(self, max_waiting: int, max_per_tenant: int | None, retry_after_s: int = 1):
        self.max_waiting = max_waiting
        self.max_per_tenant = max_per_tenant
        self.retry_after_s = retry_after_s
        self.num_waiting = 0
        self.in_flight: dict[str, int] = {}

    def admit(self, tenant: str) -> Ticket:
        """A ticket, or a 429 APIError (code `server_overloaded` or `tenant_quota_exceeded`)."""
        if self.num_waiting >= self.max_waiting:
            raise overloaded(f"The server is at capacity ({self.num_waiting} requests waiting); retry later.",
                             self.retry_after_s, "server_overloaded")
        if self.max_per_tenant is not None and self.in_flight.get(tenant, 0) >= self.max_per_tenant:
            raise overloaded(f"Tenant {tenant!r} has {self.max_per_tenant} requests in flight, its limit; "
                             "retry later.", self.retry_after_s, "tenant_quota_exceeded")
        self.num_waiting += 1
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        return Ticket(self, tenant)

    @property
    def num_in_flight(self) -> int:
        return sum(self.in_flight.values())

