"""Places held back for other tenants: one per other active tenant of the same band (or a
higher one) under its share, while the tenant asking holds its share or more; none for a tenant
alone, none once the others are quiet past the window; at most half the places; everything
counted on the workers the request may use."""

from loraplex.router.fleet import Worker
from loraplex.router.holdback import Holdback, Place, places_of
from loraplex.router.picker import WorkerView

W = {"http://w"}
"""One worker, standing for the workers a request may use."""


def busy(
    holdback: Holdback, tenant: str, requests: int, url: str = "http://w", now: float = 0.0
) -> None:
    for _ in range(requests):
        holdback.opened(tenant, url, now)


def test_a_tenant_over_its_share_leaves_one_place_per_active_tenant_under_its_share():
    holdback = Holdback(window_s=5.0)
    holdback.arrived("a", 0, 0.0, W)
    busy(holdback, "a", 3)
    assert holdback.held("a", W, places=8, now=1.0) == 0  # alone: the whole fleet
    holdback.arrived("b", 0, 1.0, W)
    assert holdback.held("a", W, places=8, now=2.0) == 0  # 3 of 8: under its share of 4
    busy(holdback, "a", 1)
    assert holdback.held("a", W, places=8, now=2.0) == 1
    busy(holdback, "b", 4)
    assert holdback.held("a", W, places=8, now=2.0) == 0  # b holds its share
    assert holdback.held("b", W, places=8, now=2.0) == 0  # a is not under its share
    for _ in range(4):
        holdback.closed("b", "http://w")
    assert holdback.held("a", W, places=8, now=6.0) == 4  # b sent within the window, 4 at once
    assert holdback.held("a", W, places=8, now=6.5) == 0  # b quiet past it


def test_a_tenant_whose_requests_overlapped_lately_is_kept_as_many_places_up_to_its_share():
    holdback = Holdback(window_s=5.0)
    for tenant in "abc":
        holdback.arrived(tenant, 0, 0.0, W)
    busy(holdback, "a", 8)  # its share: 4 of 12
    assert holdback.held("a", W, places=12, now=1.0) == 2  # b and c: one each
    busy(holdback, "b", 1, now=1.0)
    busy(holdback, "b", 1, now=1.1)  # two at once
    assert holdback.held("a", W, places=12, now=1.2) == 2  # b holds its peak: one more for it
    holdback.closed("b", "http://w")
    holdback.closed("b", "http://w")
    assert holdback.held("a", W, places=12, now=2.0) == 3  # room for b's two again, c's one
    holdback.arrived("b", 0, 30.0, W)
    holdback.arrived("c", 0, 30.0, W)
    assert holdback.held("a", W, places=12, now=30.0) == 3  # a peak outlasts the window
    holdback.arrived("b", 0, 62.0, W)
    holdback.arrived("c", 0, 62.0, W)
    assert holdback.held("a", W, places=12, now=62.0) == 2  # b's is a minute old: forgotten
    busy(holdback, "c", 6, now=63.0)  # over its share: c is kept no more than its share of 4
    for _ in range(6):
        holdback.closed("c", "http://w")
    busy(holdback, "b", 6, now=63.0)
    for _ in range(6):
        holdback.closed("b", "http://w")
    assert holdback.held("a", W, places=12, now=64.0) == 6  # 4 for b, 4 for c: half of 12


def test_a_caller_of_no_tenant_makes_no_tenant_active():
    holdback = Holdback(window_s=5.0)
    holdback.arrived("a", 0, 0.0, W)
    busy(holdback, "a", 8)
    holdback.arrived(None, 0, 0.0, W)  # a key that no tenant holds
    assert holdback.held("a", W, places=8, now=1.0) == 0


def test_an_open_request_keeps_a_tenant_active_past_the_window():
    holdback = Holdback(window_s=1.0)
    holdback.arrived("a", 0, 0.0, W)
    holdback.arrived("b", 0, 0.0, W)
    busy(holdback, "a", 4)
    busy(holdback, "b", 1)
    assert holdback.held("a", W, places=4, now=10.0) == 1
    holdback.closed("b", "http://w")
    assert holdback.held("a", W, places=4, now=10.0) == 0


def test_weights_bands_and_the_bound():
    holdback = Holdback(window_s=5.0, weights={"gold": 3.0})
    for tenant, priority in (("gold", 0), ("plain", 0), ("low", -1), ("urgent", 5)):
        holdback.arrived(tenant, priority, 0.0, W)
    busy(holdback, "gold", 5)  # its share: 3/4 of 8 = 6
    assert holdback.held("gold", W, places=8, now=1.0) == 0
    busy(holdback, "gold", 1)
    assert holdback.held("gold", W, places=8, now=1.0) == 2  # plain and urgent, not low
    assert holdback.held("urgent", W, places=8, now=1.0) == 0  # alone in its band: all of it
    busy(holdback, "low", 8)
    assert holdback.held("low", W, places=8, now=1.0) == 2  # plain, urgent (gold has its 6)
    for tenant in "cdefgh":
        holdback.arrived(tenant, 0, 1.0, W)
    assert holdback.held("gold", W, places=8, now=1.0) == 4  # half the places at most
    assert Holdback(window_s=0).held("gold", W, places=8, now=1.0) == 0


def test_requests_and_activity_count_on_the_workers_a_request_may_use():
    """Pool x is worker x, pool y worker y, 4 places each."""
    holdback = Holdback(window_s=5.0)
    holdback.arrived("a", 0, 0.0, {"x"})
    holdback.arrived("b", 0, 0.0, {"y"})
    busy(holdback, "a", 4, url="x")
    assert holdback.held("a", {"x"}, places=4, now=1.0) == 0  # b is active on pool y only
    assert holdback.held("a", {"y"}, places=4, now=1.0) == 0  # a is busy on pool x only
    busy(holdback, "a", 2, url="y")
    assert holdback.held("a", {"y"}, places=4, now=1.0) == 1  # 2 of 4 there: its share
    assert holdback.held("a", {"x", "y"}, places=8, now=1.0) == 1  # 6 of 8 over both
    holdback.closed("a", "y")
    assert holdback.held("a", {"y"}, places=4, now=1.0) == 0


def test_places_are_the_reported_running_places_and_the_router_s_open_requests():
    workers = [Worker(url, last=WorkerView(url, capacity=4)) for url in ("http://a", "http://b")]
    workers[0].in_flight, workers[1].in_flight = 3, 6
    unreported = Worker("http://c", in_flight=2)
    places = places_of([*workers, unreported])
    assert places == [Place("http://a", 4, 3), Place("http://b", 4, 6), Place("http://c", 0, 2)]
    holdback = Holdback(window_s=5.0)
    holdback.arrived("b", 0, 0.0, ["http://a"])
    busy(holdback, "a", 3, url="http://a")
    busy(holdback, "a", 4, url="http://b")
    assert holdback.keeps_from("a", places, now=1.0)  # one free place, owed to b
    assert not holdback.keeps_from("b", places, now=1.0)
    assert not holdback.keeps_from("a", places[1:], now=1.0)  # b is not active on b nor c


def test_arrivals_past_the_window_are_forgotten_those_within_it_still_count():
    holdback = Holdback(window_s=5.0)
    holdback.arrived("quiet", 0, 0.0, {"http://gone", "http://w"})
    holdback.arrived("b", 0, 0.0, W)
    holdback.arrived("a", 0, 5.0, W)  # b's arrival, 5 s old, is still within the window
    busy(holdback, "a", 8)
    assert holdback.held("a", W, places=8, now=5.0) == 2  # quiet and b: each owed a place
    holdback.arrived("b", 0, 7.0, W)
    holdback.arrived("a", 0, 10.5, W)  # the fleet has no http://gone: no arrival goes there
    assert set(holdback._seen) == {("b", "http://w"), ("a", "http://w")}
    assert holdback.held("a", W, places=8, now=10.5) == 1  # b only


def test_the_arrivals_kept_stay_within_two_windows_over_a_long_run():
    """A tenant per second for a day, each on its own worker: what is kept is bounded by the
    window, not by the run."""
    holdback = Holdback(window_s=30.0)
    most = 0
    for second in range(86_400):
        holdback.arrived(f"t{second}", 0, float(second), {f"http://w{second % 500}"})
        most = max(most, len(holdback._seen))
    assert most <= 2 * 30 + 1  # a second's arrivals, for the last two windows
    holdback.arrived("last", 0, 86_400.0, W)
    assert all(86_400.0 - at <= 60.0 for at in holdback._seen.values())
    nothing_held = Holdback(window_s=0)
    nothing_held.arrived("a", 0, 0.0, W)
    assert not nothing_held._seen
