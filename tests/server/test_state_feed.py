"""The numbered routing view of /admin/state: generations, deltas, removals, resets."""

from loraplex.server.state_feed import Generation, StateFeed


def row(name: str, tier: str = "cpu", loading: bool = False, revision: str = "1") -> dict:
    return {
        "name": name,
        "revision": revision,
        "digest": f"sha256:{name}{revision}",
        "model": name,
        "tier": tier,
        "loading": loading,
        "hits": 3,
        "last_access_s_ago": 1.5,
    }


def state(*rows: dict, waiting: int = 0) -> dict:
    return {"adapters": list(rows), "load": {"waiting": waiting, "free_slots": 1}, "max_loras": 2}


def test_nothing_changed_is_the_same_generation_and_an_empty_delta():
    feed = StateFeed()
    first = feed.observe(state(*(row(f"a{i}") for i in range(50))))
    # counters a routing row does not carry change: the same generation
    again = [
        {**r, "hits": 9, "last_access_s_ago": 7.0}
        for r in state(*(row(f"a{i}") for i in range(50)))["adapters"]
    ]
    assert feed.observe(state(*again)) == first
    delta = feed.view(first)
    assert (delta["reset"], delta["adapters"], delta["removed"]) == (False, [], [])
    assert delta["generation"] == str(first) and delta["load"]["waiting"] == 0


def test_a_delta_holds_only_the_rows_changed_and_removed_since():
    feed = StateFeed()
    g1 = feed.observe(state(row("a"), row("b"), row("c")))
    g2 = feed.observe(state(row("a", "gpu"), row("b")))  # a moved to gpu, c left
    assert g2.number == g1.number + 1
    delta = feed.view(g1)
    assert [(r["name"], r["tier"]) for r in delta["adapters"]] == [("a", "gpu")]
    assert delta["removed"] == ["c@1/sha256:c1"]
    g3 = feed.observe(state(row("a", "gpu"), row("b"), row("c", loading=True)))
    assert [(r["name"], r["loading"]) for r in feed.view(g2)["adapters"]] == [("c", True)]
    assert feed.view(g2)["removed"] == []  # c came back: no longer removed
    assert len(feed.view(None)["adapters"]) == 3 and feed.view(None)["reset"]
    assert feed.view(g3)["adapters"] == []


def test_load_changes_make_a_generation_with_no_rows():
    feed = StateFeed()
    g1 = feed.observe(state(row("a")))
    g2 = feed.observe(state(row("a"), waiting=4))
    assert g2 != g1
    delta = feed.view(g1)
    assert delta["adapters"] == [] and delta["load"]["waiting"] == 4


def test_another_epoch_or_a_generation_older_than_the_removals_kept_gets_everything():
    feed = StateFeed(max_removed=2)
    g1 = feed.observe(state(*(row(f"a{i}") for i in range(5))))
    for keep in (4, 3, 2):
        feed.observe(state(*(row(f"a{i}") for i in range(keep))))
    old = feed.view(g1)  # three removals happened since g1, two are kept
    assert old["reset"] and len(old["adapters"]) == 2 and old["removed"] == []
    other = feed.view(Generation("someone-else", g1.number))
    assert other["reset"] and len(other["adapters"]) == 2


def test_generations_parse_from_etags_and_refuse_junk():
    g = Generation("ab12", 7)
    assert Generation.parse(g.etag) == g == Generation.parse(f"W/{g.etag}")
    assert Generation.parse(str(g)) == g
    for junk in ("", "7", "ab12.", "ab12.x", '"'):
        assert Generation.parse(junk) is None


def test_only_resident_or_loading_adapters_are_routing_rows():
    feed = StateFeed()
    g1 = feed.observe(state(row("a", "gpu"), row("b", "disk"), row("c", "remote", loading=True)))
    assert sorted(r["name"] for r in feed.view(None)["adapters"]) == ["a", "c"]
    # a leaving host memory for disk leaves the view; more adapters on disk change nothing
    g2 = feed.observe(state(row("a", "disk"), row("b", "disk"), row("c", "cpu"), row("d", "disk")))
    delta = feed.view(g1)
    assert delta["removed"] == ["a@1/sha256:a1"]
    assert [(r["name"], r["tier"]) for r in delta["adapters"]] == [("c", "cpu")]
    assert feed.observe(state(row("c", "cpu"), *(row(f"x{i}", "disk") for i in range(100)))) == g2
