"""The registry's leases (table `leases`) on a real SQLite file and, where a PostgreSQL cluster can
start, on PostgreSQL: one holder at a time, renewed by it, taken over once it runs out, is given
back, or its process is gone; several processes taking a new lease at once leave one holder."""

from __future__ import annotations

import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from loraplex.registry import Registry
from loraplex.registry.leases import Leases


@pytest.fixture(params=["sqlite", "postgresql"])
def registry(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/registry.db"
    else:
        url = request.getfixturevalue("pg_url")
    made = Registry(url)
    made.init()
    yield made
    made.close()


def test_one_holder_renews_and_another_waits_until_it_is_given_back(registry):
    leases = Leases(registry)
    first = leases.take("placement", "host-a:1", 60)
    assert first.holder == "host-a:1" and first.alive()
    assert leases.take("placement", "host-b:2", 60).holder == "host-a:1"
    renewed = leases.take("placement", "host-a:1", 120)
    assert renewed.holder == "host-a:1" and renewed.expires_at > first.expires_at
    leases.release("placement", "host-b:2")  # not its lease: nothing happens
    assert leases.get("placement").holder == "host-a:1"
    leases.release("placement", "host-a:1")
    assert leases.get("placement").holder is None
    assert leases.take("placement", "host-b:2", 60).holder == "host-b:2"
    assert leases.take("other-job", "host-a:1", 60).holder == "host-a:1"  # leases are per name


def test_a_lease_that_ran_out_or_whose_process_is_gone_is_taken_over(registry):
    leases = Leases(registry)
    leases.take("placement", "host-a:1", 0)  # runs out at once
    assert leases.take("placement", "host-b:2", 60).holder == "host-b:2"
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = f"{socket.gethostname()}:{gone.stdout.strip()}"
    leases.release("placement", "host-b:2")
    assert leases.take("placement", dead, 3600).holder == dead
    assert not leases.get("placement").alive()
    assert leases.take("placement", "host-c:3", 60).holder == "host-c:3"


@pytest.mark.parametrize("given_back", [False, True], ids=["new", "given-back"])
def test_several_taking_a_free_lease_at_once_leave_one_holder(registry, given_back):
    leases = Leases(registry)
    if given_back:  # its row is there, held by no one
        leases.take("placement", "host-x:9", 60)
        leases.release("placement", "host-x:9")
    holders = [f"host-{i}:{i}" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        seen = list(pool.map(lambda h: leases.take("placement", h, 60).holder, holders))
    winner = leases.get("placement").holder
    assert winner in holders
    assert seen == [winner] * 6
