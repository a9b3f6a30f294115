"""`until_gone`: the awaited work is cancelled when the client leaves first, and only then; the
handler's task carries no cancellation past it."""

import asyncio

import pytest

from loraplex.server.disconnect import ClientGone, until_gone


async def _client_leaves_during(work) -> int:
    """`work` under `until_gone`, the client leaving after 10 ms: ClientGone raised, then the
    handler goes on; the cancellations left on its task (none: `until_gone` took its own back)."""
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    loop.call_later(0.01, gone.set_result, None)
    with pytest.raises(ClientGone):
        await until_gone(work, gone)
    await asyncio.sleep(0.01)  # would raise CancelledError if a cancellation were left
    return asyncio.current_task().cancelling()


def test_work_that_ends_first_gives_its_result_and_a_later_leave_cancels_nothing():
    async def scenario():
        loop = asyncio.get_running_loop()
        gone = loop.create_future()
        result = await until_gone(asyncio.sleep(0, "answer"), gone)
        gone.set_result(None)  # the client leaves after the work ended
        await asyncio.sleep(0.01)  # would raise CancelledError if the leave still cancelled us
        return result, asyncio.current_task().cancelling()

    assert asyncio.run(scenario()) == ("answer", 0)


def test_a_client_that_leaves_first_cancels_the_work_and_raises_client_gone():
    unwound = []

    async def work():
        try:
            await asyncio.sleep(60)
        finally:
            unwound.append(True)

    assert asyncio.run(_client_leaves_during(work())) == 0
    assert unwound == [True]


def test_work_that_answers_its_cancellation_with_an_error_is_still_a_client_gone():
    """As vLLM's serving code does: a cancelled request returns an error response (Client
    disconnected), which our handler raises."""

    async def work():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise ValueError("Client disconnected") from None

    assert asyncio.run(_client_leaves_during(work())) == 0


@pytest.mark.parametrize("client_leaves_too", [False, True])
def test_a_cancellation_from_elsewhere_is_not_taken_for_a_client_gone(client_leaves_too):
    """A shutdown cancels the handler: it stays cancelled, even when the client leaves at the same
    moment."""

    async def handler(gone):
        return await until_gone(asyncio.sleep(60), gone)

    async def scenario():
        gone = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(handler(gone))
        await asyncio.sleep(0.01)
        if client_leaves_too:
            gone.set_result(None)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_the_works_own_error_is_raised():
    async def failing():
        raise ValueError("bad request")

    async def scenario():
        gone = asyncio.get_running_loop().create_future()
        await until_gone(failing(), gone)

    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(scenario())
