"""Places held back for other tenants: one per other active tenant of the same band (or a
higher one) under its share, while the tenant asking holds its share or more; none for a tenant
alone, none once the others are quiet past the window; at most half the places."""

from loraplex.router.fleet import Worker
from loraplex.router.holdback import Holdback, room_of
from loraplex.router.picker import WorkerView


def busy(holdback: Holdback, tenant: str, requests: int) -> None:
    for _ in range(requests):
        holdback.opened(tenant)


def test_a_tenant_over_its_share_leaves_one_place_per_active_tenant_under_its_share():
    holdback = Holdback(window_s=5.0)
    holdback.arrived("a", 0, now=0.0)
    busy(holdback, "a", 3)
    assert holdback.held("a", places=8, now=1.0) == 0  # alone: the whole fleet
    holdback.arrived("b", 0, now=1.0)
    assert holdback.held("a", places=8, now=2.0) == 0  # 3 of 8: under its share of 4
    busy(holdback, "a", 1)
    assert holdback.held("a", places=8, now=2.0) == 1
    busy(holdback, "b", 4)
    assert holdback.held("a", places=8, now=2.0) == 0  # b holds its share
    assert holdback.held("b", places=8, now=2.0) == 0  # a is not under its share
    for _ in range(4):
        holdback.closed("b")
    assert holdback.held("a", places=8, now=6.0) == 1  # b sent within the window
    assert holdback.held("a", places=8, now=6.5) == 0  # b quiet past it


def test_a_caller_of_no_tenant_makes_no_tenant_active():
    holdback = Holdback(window_s=5.0)
    holdback.arrived("a", 0, now=0.0)
    busy(holdback, "a", 8)
    holdback.arrived(None, 0, now=0.0)  # a key that no tenant holds
    assert holdback.held("a", places=8, now=1.0) == 0


def test_an_open_request_keeps_a_tenant_active_past_the_window():
    holdback = Holdback(window_s=1.0)
    holdback.arrived("a", 0, now=0.0)
    holdback.arrived("b", 0, now=0.0)
    busy(holdback, "a", 4)
    busy(holdback, "b", 1)
    assert holdback.held("a", places=4, now=10.0) == 1
    holdback.closed("b")
    assert holdback.held("a", places=4, now=10.0) == 0


def test_weights_bands_and_the_bound():
    holdback = Holdback(window_s=5.0, weights={"gold": 3.0})
    for tenant, priority in (("gold", 0), ("plain", 0), ("low", -1), ("urgent", 5)):
        holdback.arrived(tenant, priority, now=0.0)
    busy(holdback, "gold", 5)  # its share: 3/4 of 8 = 6
    assert holdback.held("gold", places=8, now=1.0) == 0
    busy(holdback, "gold", 1)
    assert holdback.held("gold", places=8, now=1.0) == 2  # plain and urgent, not low
    assert holdback.held("urgent", places=8, now=1.0) == 0  # alone in its band: all of it
    busy(holdback, "low", 8)
    assert holdback.held("low", places=8, now=1.0) == 2  # plain, urgent (gold has its 6)
    for tenant in "cdefgh":
        holdback.arrived(tenant, 0, now=1.0)
    assert holdback.held("gold", places=8, now=1.0) == 4  # half the places at most
    assert Holdback(window_s=0).held("gold", places=8, now=1.0) == 0


def test_room_counts_the_reported_running_places_and_the_router_s_open_requests():
    workers = [Worker("http://a", last=WorkerView("http://a", capacity=4)) for _ in range(2)]
    workers[0].in_flight, workers[1].in_flight = 3, 6
    unreported = Worker("http://c", in_flight=2)
    assert room_of([*workers, unreported]) == (8, 1)
