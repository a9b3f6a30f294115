"""The routing view of `GET /admin/state`, numbered, so that a gateway polls only what changed.

A routing row is what a gateway routes by: an adapter revision's tier and whether it is loading, for
the adapters resident in a slot or host memory or loading (so their number is bounded by the
worker's capacity, not by the catalog).
The head (the base model's name and digest, the max LoRA rank, draining, the names placed here and
the drain) and the load block (queue, running, tokens, KV use, slots) are a fixed handful of
figures. Each change to either makes a new generation; a poller that sends the generation it holds
gets `304 Not Modified` when nothing changed, or only the rows changed and removed since, so that
its bytes per poll follow the changes, not the number of adapters the worker holds.
"""

from __future__ import annotations

import secrets
import threading
from typing import NamedTuple

LOAD_FIELDS = (
    "waiting",
    "running",
    "max_num_seqs",
    "active_tokens",
    "kv_cache_usage",
    "recent_evictions",
    "free_slots",
    "num_slots",
)


class Generation(NamedTuple):
    """`EPOCH.N`: N counts changes since this feed began; a new process starts a new epoch, so a
    generation from before a restart is never taken for one of now."""

    epoch: str
    number: int

    def __str__(self) -> str:
        return f"{self.epoch}.{self.number}"

    @property
    def etag(self) -> str:
        return f'"{self}"'

    @classmethod
    def parse(cls, text: str) -> Generation | None:
        epoch, _, number = text.strip().removeprefix("W/").strip('"').partition(".")
        return cls(epoch, int(number)) if epoch and number.isdigit() else None


class RoutingRow(NamedTuple):
    """The fields of an `/admin/state` adapter row that routing reads."""

    name: str
    revision: str
    model: str
    tier: str
    loading: bool

    @classmethod
    def of(cls, adapter: dict) -> tuple[str, RoutingRow]:
        """The row's id (name, revision, digest) and its routing fields."""
        name, revision = adapter["name"], adapter["revision"]
        row = cls(
            name, revision, adapter.get("model", name), adapter["tier"], bool(adapter["loading"])
        )
        return f"{name}@{revision}/{adapter['digest']}", row

    def to_dict(self, row_id: str) -> dict:
        return {"id": row_id, **self._asdict()}


def _routed_by(adapter: dict) -> bool:
    """Whether routing reads the row: resident in a slot or host memory, or loading (an adapter
    on disk or only in the store counts as on no worker)."""
    return adapter["tier"] in ("gpu", "cpu") or bool(adapter["loading"])


class StateFeed:
    """Routing rows and load of the latest state seen, each row with the generation it last changed
    in, and the rows removed (kept until `max_removed` of them, then the oldest go and a poller from
    before them gets the whole view again)."""

    def __init__(self, max_removed: int = 4096):
        self.epoch = secrets.token_hex(4)
        self.number = 0
        self.rows: dict[str, RoutingRow] = {}
        self.changed_in: dict[str, int] = {}
        self.removed: dict[str, int] = {}  # id -> generation, oldest first
        self.floor = 0
        """The oldest generation a delta can start from."""
        self.head: dict = {}
        self.max_removed = max_removed
        self._lock = threading.Lock()

    @property
    def generation(self) -> Generation:
        return Generation(self.epoch, self.number)

    def observe(self, state: dict) -> Generation:
        """Take in a full `/admin/state` answer; a new generation if anything routing reads
        changed."""
        head = {
            "base_model": state.get("base_model"),
            "base_model_digest": state.get("base_model_digest"),
            "max_lora_rank": state.get("max_lora_rank"),
            "draining": bool(state.get("draining")),
            "placed": state.get("placed", []),
            "drain": state.get("drain"),
            "max_loras": state.get("max_loras"),
            "load": {k: state.get("load", {}).get(k, 0) for k in LOAD_FIELDS},
        }
        rows = dict(map(RoutingRow.of, filter(_routed_by, state.get("adapters", []))))
        with self._lock:
            changed = [i for i, row in rows.items() if self.rows.get(i) != row]
            gone = [i for i in self.rows if i not in rows]
            if changed or gone or head != self.head:
                self.number += 1
                for i in changed:
                    self.changed_in[i] = self.number
                    self.removed.pop(i, None)
                for i in gone:
                    del self.changed_in[i]
                    self.removed[i] = self.number
                self._trim_removed()
                self.rows, self.head = rows, head
            return self.generation

    def _trim_removed(self) -> None:
        while len(self.removed) > self.max_removed:
            oldest = next(iter(self.removed))
            self.floor = max(self.floor, self.removed.pop(oldest))

    def view(self, since: Generation | None = None) -> dict:
        """The rows changed after `since` and the ids removed after it; every row (`reset`) when
        `since` is of another epoch or older than the removals kept."""
        with self._lock:
            delta = since is not None and since.epoch == self.epoch and since.number >= self.floor
            after = since.number if delta and since is not None else -1
            return {
                "generation": str(self.generation),
                "reset": not delta,
                **self.head,
                "adapters": [
                    self.rows[i].to_dict(i)
                    for i, number in self.changed_in.items()
                    if number > after
                ],
                "removed": [i for i, number in self.removed.items() if number > after]
                if delta
                else [],
            }
