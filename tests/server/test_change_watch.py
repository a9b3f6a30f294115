"""Resolution reads the registry's change count once per turn of the event loop, for every request
that arrived before the read began, and never answers a request with a count read before it
arrived: a real SQLite registry, a change committed between two requests."""

import asyncio
import time

from harness import make_registry

from loraplex.server.adapters import AdapterResolver, ChangeWatch


def test_one_read_serves_the_requests_before_it_and_a_later_request_sees_a_change(
    llama_dir, llama_adapters, tmp_path
):
    registry = make_registry(tmp_path, llama_dir, llama_adapters)
    reads = []
    watch = ChangeWatch(registry, clock=lambda: reads.append(None) or time.monotonic())

    async def scenario():
        arrived = time.monotonic()
        together = await asyncio.gather(*(watch.count_since(arrived) for _ in range(20)))
        registry.add_tenant("carol")  # a change, committed before the next request arrives
        earlier = await watch.count_since(arrived)  # arrived before the last read: shares it
        later = await watch.count_since(time.monotonic())
        return together, earlier, later

    try:
        together, earlier, later = asyncio.run(scenario())
        assert len(set(together)) == 1 and len(reads) == 2  # one read for the 20, one for `later`
        assert earlier == together[0] and later > together[0] == registry.change_count() - 1
    finally:
        registry.close()


def test_a_promotion_is_served_to_the_first_request_that_arrives_after_it(
    llama_dir, llama_adapters, tmp_path
):
    registry = make_registry(tmp_path, llama_dir, llama_adapters)
    first = registry.show("shared-a").revisions[0].revision
    second = registry.add_revision(llama_adapters["mlp-r4"], "shared-a", shared=True).revision
    digest = registry.show("shared-a").revisions[0].base_model_digest
    resolver = AdapterResolver(registry, digest, "tiny")

    async def resolve() -> str:
        count = await resolver.changes.count_since(time.monotonic())
        return resolver.resolve("alice", "shared-a", None, count).record.revision

    try:
        assert asyncio.run(resolve()) == first
        registry.promote("shared-a", second, 100, force=True)
        assert asyncio.run(resolve()) == second
    finally:
        registry.close()
