"""The placement controller while its PostgreSQL registry is down: it keeps running and says so
once; its lease counts as held only until it runs out; once the registry is back exactly one of two
controllers takes the lease and acts, and a controller stopped during an outage exits cleanly."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx
import pytest

from loraplex.loadgen.postgres import pg_ctl
from loraplex.placement.controller import LEASE, PlacementController
from loraplex.placement.policy import PlacementPolicy
from loraplex.registry import Registry
from loraplex.registry.leases import Leases


def start_postgres(server: Path) -> None:
    """Start the stopped cluster with the options it last ran with (`restart` does that)."""
    if pg_ctl(server, "status", check=False) != 0:
        pg_ctl(server, "restart", "-l", str(server / "log"))


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    """A bound against hangs, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Running:
    """A controller with no workers, its rounds in a thread until `stop`."""

    def __init__(self, url: str, holder: str):
        self.registry = Registry(url)
        self.client = httpx.Client()
        # a holder on another host: its lease stands until it runs out, as across machines
        self.controller = PlacementController(
            [], self.registry, PlacementPolicy(), self.client, holder=holder, lease_s=4.0
        )
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.controller.run, args=(self.stopping, 0.1))
        self.thread.start()

    def leader_gauge(self) -> float | None:
        return self.controller.metrics.registry.get_sample_value("loraplex_placement_leader")

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(60)
        assert not self.thread.is_alive()
        self.client.close()
        self.registry.close()


@pytest.fixture
def controllers(pg_url, postgres_server):
    """Starts a controller on the registry (`holder` its lease's name); stops them after."""
    registry = Registry(pg_url)
    registry.init()
    registry.close()
    started: list[Running] = []

    def start(holder: str) -> Running:
        started.append(Running(pg_url, holder))
        return started[-1]

    yield start
    start_postgres(postgres_server)  # when a test failed with it down
    for running in started:
        if running.thread.is_alive():
            running.stop()


def test_the_lease_outlives_an_outage_only_until_it_runs_out_then_one_takes_it(
    controllers, pg_url, postgres_server, caplog
):
    caplog.set_level(logging.INFO, logger="loraplex.placement")
    first = controllers("host-a:1")
    wait_for(lambda: first.leader_gauge() == 1.0, "the first to lead")
    pg_ctl(postgres_server, "-m", "immediate", "stop")
    wait_for(lambda: first.leader_gauge() == 0.0, "its lease to run out while unreachable")
    assert first.thread.is_alive()
    unreachable = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert len(unreachable) == 1  # said once, not once per retry
    start_postgres(postgres_server)
    second = controllers("host-b:2")
    both = (first, second)
    wait_for(lambda: sum(c.controller.leading_now() for c in both) == 1, "one of them to take it")
    leader = next(c for c in both if c.controller.leading_now())
    registry = Registry(pg_url)
    assert Leases(registry).get(LEASE).holder == leader.controller.holder
    registry.close()
    for _ in range(20):  # the leader renews; the other keeps waiting
        assert [c.controller.leading_now() for c in both] == [c is leader for c in both]
        assert [c.leader_gauge() for c in both] == [float(c is leader) for c in both]
        time.sleep(0.1)
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_a_controller_stopped_while_the_registry_is_down_exits_and_its_lease_runs_out(
    controllers, pg_url, postgres_server
):
    first = controllers("host-a:1")
    wait_for(lambda: first.leader_gauge() == 1.0, "it to lead")
    pg_ctl(postgres_server, "-m", "immediate", "stop")
    first.stop()  # no release can reach the registry: it returns all the same
    assert first.leader_gauge() == 0.0
    start_postgres(postgres_server)
    second = controllers("host-b:2")
    wait_for(lambda: second.controller.leading_now(), "the other to take over once it ran out")
