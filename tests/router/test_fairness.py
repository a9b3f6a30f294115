"""The fair-share queue: priority bands first, weighted fair shares of tenants within a band,
first come first within a tenant."""

import asyncio

import pytest

from loraplex.router.fairness import FairQueue, QueueFull


def granted_order(queue: FairQueue, rooms: int) -> list[str]:
    """Who the next `rooms` grants go to."""
    order: list[str] = []
    left = [rooms]

    def grant(waiter):
        if not left[0]:
            return None
        left[0] -= 1
        order.append(waiter.what)
        return waiter.what

    queue.admit(grant)
    return order


def test_a_burst_gets_its_share_not_the_line():
    async def run():
        queue = FairQueue()
        for i in range(30):
            queue.join("a", 0, f"a{i}")
        first = granted_order(queue, 5)  # the burst alone: it takes every room
        for i in range(3):
            queue.join("b", 0, f"b{i}")
        later = granted_order(queue, 8)
        return first, later, queue

    first, later, queue = asyncio.run(run())
    assert first == ["a0", "a1", "a2", "a3", "a4"]
    assert later == ["b0", "a5", "b1", "a6", "b2", "a7", "a8", "a9"]
    assert queue.granted_total == {"a": 10, "b": 3} and queue.waiting("a") == 20


def test_weights_and_priority_bands():
    async def run():
        queue = FairQueue(weights={"gold": 3.0})
        for i in range(8):
            queue.join("gold", 0, f"g{i}")
            queue.join("plain", 0, f"p{i}")
        shares = granted_order(queue, 8)
        queue.join("urgent", 5, "u0")
        return shares, granted_order(queue, 1)

    shares, urgent = asyncio.run(run())
    assert shares.count("g0") == 1 and sum(x[0] == "g" for x in shares) == 6  # 3:1
    assert urgent == ["u0"]  # a higher band goes first, whatever the tags


def test_a_full_queue_refuses_and_a_cancelled_waiter_is_dropped():
    async def run():
        queue = FairQueue(limit=2)
        one = queue.join("a", 0, "a0")
        queue.join("a", 0, "a1")
        with pytest.raises(QueueFull):
            queue.join("a", 0, "a2")
        queue.join("b", 0, "b0")
        one.granted.cancel()
        return granted_order(queue, 3), len(queue)

    order, left = asyncio.run(run())
    assert order == ["a1", "b0"] and left == 0
