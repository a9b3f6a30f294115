"""The router's prefix index: prompt blocks as a hash chain salted by the adapter revision, a
bounded index per worker, and the picker's prefix term."""

import random

from loraplex.router.catalog import AdapterCatalog, RevisionFacts
from loraplex.router.picker import Picker, PickerConfig, WorkerView
from loraplex.router.prefixes import BLOCK_CHARS, PrefixIndex, block_hashes, prompt_text
from loraplex.router.routing import Wanted, prefix_key

SYSTEM = ("You are the billing assistant of Acme. Answer in one short sentence. " * 7)[:448]


def test_a_shared_prefix_gives_shared_leading_blocks_under_one_revision_only():
    one = block_hashes(SYSTEM + "Where is my invoice?", "sha256:r1")
    two = block_hashes(SYSTEM + "Cancel my plan, please.", "sha256:r1")
    full = len(SYSTEM) // BLOCK_CHARS
    assert len(one) == len(SYSTEM + "Where is my invoice?") // BLOCK_CHARS
    assert one[:full] == two[:full]
    assert block_hashes(SYSTEM, "sha256:r2")[0] != one[0]  # another revision: nothing shared
    assert block_hashes("short", "sha256:r1") == ()  # no full block
    assert block_hashes(list(range(40)), "s") == block_hashes(list(range(32)) + [0], "s")


def test_the_prompt_as_the_router_sees_it():
    assert prompt_text({"prompt": "hello"}) == "hello"
    assert prompt_text({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]
    }
    assert prompt_text(chat) == "<system>be brief\n<user>hi\n"
    assert prompt_text({"prompt": 7}) is None and prompt_text({}) is None


def test_the_index_matches_the_leading_blocks_and_drops_the_least_recent_beyond_its_bound():
    index = PrefixIndex(capacity=8)
    a = block_hashes(SYSTEM + "a" * 64, "r1")  # 8 blocks
    index.add(a)
    assert len(a) == 8 and index.match(a) == 1.0
    assert index.match(block_hashes(SYSTEM + "b" * 64, "r1")) == 7 / 8
    assert index.match(block_hashes(SYSTEM, "r2")) == 0.0
    other = block_hashes("x" * 256, "r1")  # 4 blocks: the oldest 4 of `a` go, its last ones
    index.add(other)
    assert len(index) == 8
    assert index.match(other) == 1.0
    assert index.match(a) == 4 / 8  # the first blocks stay longest: its prefix still matches
    index.add(a)
    assert index.match(a) == 1.0 and index.match(other) == 0.0


def test_the_prefix_key_is_the_revision_digest_the_registry_resolves_to():
    rows = [
        RevisionFacts("ad", "r1", "llama", "sha256:b", 8, True, (), True, "sha256:one"),
        RevisionFacts("ad", "r2", "llama", "sha256:b", 8, True, (), False, "sha256:two"),
        RevisionFacts("split", "r1", "llama", "sha256:b", 8, True, (), True, "sha256:s1"),
        RevisionFacts("split", "r2", "llama", "sha256:b", 8, True, (), True, "sha256:s2"),
    ]
    catalog = AdapterCatalog(lambda: 1, lambda: rows, refresh_s=0)
    assert prefix_key(catalog, Wanted("ad", "acme")) == "sha256:one"
    assert prefix_key(catalog, Wanted("ad@r2", "acme")) == "sha256:two"
    assert prefix_key(catalog, Wanted("split", "acme")) == "split"  # the worker picks: its name
    assert prefix_key(None, Wanted("ad", "acme")) == "ad"


def w(url, **kw):
    return WorkerView(url, gpu=frozenset({"x"}), **kw)


def test_the_prefix_keeps_a_prompt_on_its_worker_until_it_carries_five_more_requests():
    picker = Picker(rng=random.Random(0))
    for load in range(5):
        assert picker.pick([w("a", running=load, prefix=1.0), w("b")], "x").url == "a"
    assert picker.pick([w("a", running=5, prefix=0.5), w("b")], "x").url == "b"
    busy = w("a", running=2, active_tokens=900, prefix=1.0)
    assert picker.pick([busy, w("b", active_tokens=10)], "x").url == "a"
    off = Picker(config=PickerConfig(w_prefix=0), rng=random.Random(0))
    urls = {off.pick([w("a", prefix=1.0), w("b")], "x").url for _ in range(40)}
    assert urls == {"a", "b"}  # a tie without the prefix term


def test_a_cold_adapter_follows_its_prefix_rather_than_the_hash_ring():
    cold = [WorkerView(u, prefix=0.9 if u == "w7" else 0.0) for u in (f"w{i}" for i in range(8))]
    pick = Picker(rng=random.Random(0)).pick(cold, "never-seen")
    assert pick.url == "w7" and pick.reason == "affinity-none"
    hashed = Picker(rng=random.Random(0)).pick([WorkerView(v.url) for v in cold], "never-seen")
    assert hashed.reason == "cold-hash"
