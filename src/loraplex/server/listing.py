"""`GET /v1/models` from the catalog: each adapter's card encoded once and kept while its catalog
entry stays the same, each tenant's listing kept until the catalog or the drains change.

Cards are kept as bytes (which the garbage collector never scans) and a listing is joined from them,
so that listing 100,000 adapters after a change costs a join, not 100,000 dicts to build, encode and
later collect. The whole list is joined in parts of PART cards, sent one after another: no join of
the whole body holds the interpreter while the event loop waits for it.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.registry.catalog import Catalog, Entry
from loraplex.server.schemas import model_card

_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
MAX_PAGE = 10_000
PART = 1_000
"""Cards per part of the whole list's body (about 100 KB)."""


@dataclass(frozen=True)
class Listing:
    ids: list[str]  # the base model's first, then the adapters' by name
    cards: list[bytes]  # each one's JSON
    parts: tuple[bytes, ...]  # the whole list's JSON body, in parts


class ModelListing:
    def __init__(
        self,
        catalog: Catalog,
        served_name: str,
        may_see: Callable[[str | None], bool],
        draining: set[str],
    ):
        """`may_see(base_model_digest)`: whether a revision was made for this server's base model;
        `draining`: names being unloaded (listed by no one)."""
        self.catalog, self.served_name, self.may_see, self.draining = (
            catalog,
            served_name,
            may_see,
            draining,
        )
        self._entries: dict[str, Entry] = {}  # name -> the entry its card was made from
        self._cards: dict[str, bytes | None] = {}  # name -> its card (None: nothing it serves)
        self._listings: dict[tuple[str, frozenset[str]], Listing] = {}
        self._version = -1

    def listing(self, tenant: str) -> Listing:
        if self._version != self.catalog.version:  # stale: all of them
            self._listings, self._version = {}, self.catalog.version
        key = (tenant, frozenset(self.draining))
        listing = self._listings.get(key)
        if listing is None:
            listing = self._listings[key] = self._make(tenant)
        return listing

    def body(
        self, tenant: str, after: str | None = None, limit: int | None = None
    ) -> tuple[bytes, ...]:
        """The JSON body, in parts: the whole list, or with `limit` or `after` one page as OpenAI's
        lists page (`has_more`, `first_id`, `last_id`; an `after` removed meanwhile still marks its
        place)."""
        listing = self.listing(tenant)
        if after is None and limit is None:
            return listing.parts
        ids = listing.ids
        if after is None:
            start = 0
        elif after == ids[0]:
            start = 1
        else:  # the adapters' ids are sorted after the base model's
            start = bisect.bisect_right(ids, after, lo=1)
        end = min(len(ids), start + (MAX_PAGE if limit is None else limit))
        page = b",".join(listing.cards[start:end])
        tail = _JSON.encode(
            {
                "first_id": ids[start] if end > start else None,
                "last_id": ids[end - 1] if end > start else None,
                "has_more": end < len(ids),
            }
        )
        return (b'{"object":"list","data":[' + page + b"]," + tail[1:].encode(),)

    def prepare(self, names) -> None:
        """Encode the cards of these names now (the catalog changed them), so that the next
        listing only joins."""
        for name in names:
            entry = self.catalog.entries.get(name)
            if entry is not None:
                self._card(name, entry)

    def _make(self, tenant: str) -> Listing:
        ids = [self.served_name]
        cards = [_JSON.encode(model_card(self.served_name, "loraplex", None)).encode()]
        draining = self.draining
        for entry in self.catalog.visible_entries(tenant):
            name = entry.adapter.name
            card = self._card(name, entry)
            if card is not None and name not in draining:
                ids.append(name)
                cards.append(card)
        pieces = [b",".join(cards[i : i + PART]) for i in range(0, len(cards), PART)]
        # the base model's card leads: the first piece is never empty
        head = b'{"object":"list","data":[' + pieces[0]
        return Listing(ids, cards, (head, *(b"," + p for p in pieces[1:]), b"]}"))

    def _card(self, name: str, entry: Entry) -> bytes | None:
        if self._entries.get(name) is entry:
            return self._cards[name]
        adapter = entry.adapter
        serving = [
            r for r in adapter.revisions if r.traffic_weight and self.may_see(r.base_model_digest)
        ]
        card = None
        if serving:
            owner = "shared" if adapter.shared else adapter.owner_tenant or "shared"
            main = max(serving, key=lambda r: r.traffic_weight)
            card = _JSON.encode(
                model_card(name, owner, self.served_name, root=main.model_id)
            ).encode()
        self._entries[name], self._cards[name] = entry, card
        return card
