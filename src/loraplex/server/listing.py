"""`GET /v1/models` from the catalog: each adapter's card encoded once and kept while its catalog
entry stays the same, each tenant's listing kept until the catalog or the drains change.

Cards are kept as bytes (which the garbage collector never scans) and a listing is joined from them,
so that listing 100,000 adapters after a change costs a join, not 100,000 dicts to build, encode and
later collect. The whole list is joined in parts of PART cards, sent one after another.

A listing is made on the event loop, TURN names at a time, the loop free for the streams between two
turns (about 2 ms each when every card is new). Made on a thread instead, it would hold the
interpreter's lock in 5 ms turns that the loop waits for, and longer whenever the lock's hand-over
waits for a free core.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _quoted

from loraplex.registry.catalog import Catalog, Entry
from loraplex.server.schemas import model_card

_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
MAX_PAGE = 10_000
PART = 1_000
"""Cards per part of the whole list's body (about 100 KB)."""
TURN = 256
"""Names a listing's making goes through between two turns of the event loop."""
_CARD = '{"id":%s,"object":"model","created":%d,"owned_by":%s,"root":%s,"parent":%s}'
"""An adapter's card: `model_card`'s JSON, made by one format, cheaper than encoding its dict."""


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
        max_model_len: Callable[[], int],
    ):
        """`may_see(base_model_digest)`: whether a revision was made for this server's base model;
        `draining`: names being unloaded (listed by no one); `max_model_len`: the engine's, on the
        base model's card as vLLM gives it."""
        self.catalog, self.served_name, self.may_see, self.draining = (
            catalog,
            served_name,
            may_see,
            draining,
        )
        self.max_model_len = max_model_len
        self._parent = _quoted(served_name)  # the adapters' cards' parent, as JSON
        self._entries: dict[str, Entry] = {}  # name -> the entry its card was made from
        self._cards: dict[str, bytes | None] = {}  # name -> its card (None: nothing it serves)
        self._listings: dict[tuple[str, frozenset[str]], Listing] = {}
        self._version = -1

    async def listing(self, tenant: str) -> Listing:
        version = self.catalog.version
        if self._version != version:  # stale: all of them
            self._listings, self._version = {}, version
        key = (tenant, frozenset(self.draining))
        listing = self._listings.get(key)
        if listing is None:
            listing = await self._make(tenant)
            if self._version == version == self.catalog.version:  # no change while it was made
                self._listings[key] = listing
        return listing

    async def body(
        self, tenant: str, after: str | None = None, limit: int | None = None
    ) -> tuple[bytes, ...]:
        """The JSON body, in parts: the whole list, or with `limit` or `after` one page as OpenAI's
        lists page (`has_more`, `first_id`, `last_id`; an `after` removed meanwhile still marks its
        place)."""
        listing = await self.listing(tenant)
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

    async def _make(self, tenant: str) -> Listing:
        ids = [self.served_name]
        base = {
            **model_card(self.served_name, "loraplex", None),
            "max_model_len": self.max_model_len(),
        }
        cards = [_JSON.encode(base).encode()]
        draining = self.draining
        names = list(self.catalog.names)
        parts: list[bytes] = []  # the body's, PART cards each, made as soon as they are there
        for start in range(0, len(names), TURN):
            for entry in self.catalog.visible_entries(tenant, names[start : start + TURN]):
                name = entry.adapter.name
                card = self._card(name, entry)
                if card is not None and name not in draining:
                    ids.append(name)
                    cards.append(card)
            if len(cards) - len(parts) * PART >= PART:
                _add_part(parts, cards)
            await asyncio.sleep(0)
        if len(cards) > len(parts) * PART:
            _add_part(parts, cards)
        return Listing(ids, cards, (*parts, b"]}"))

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
            card = adapter_card(name, owner, self._parent, main.model_id, int(time.time()))
        self._entries[name], self._cards[name] = entry, card
        return card


def adapter_card(name: str, owner: str, parent_json: str, root: str, created: int) -> bytes:
    """What `model_card(name, owner, parent, root)` encodes to, `parent_json` being the parent's
    JSON string."""
    return (_CARD % (_quoted(name), created, _quoted(owner), _quoted(root), parent_json)).encode()


def _add_part(parts: list[bytes], cards: list[bytes]) -> None:
    """The body's next part: the next PART cards (the base model's card leads the first)."""
    start = len(parts) * PART
    joined = b",".join(cards[start : start + PART])
    parts.append((b"," if parts else b'{"object":"list","data":[') + joined)
