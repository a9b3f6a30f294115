"""Iteration-level scheduling: who decodes, who joins, who is preempted, in each step."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from loraplex.engines.native.admission import Take, admit_waiting
from loraplex.engines.native.block_manager import BlockManager
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.sequence import Sequence, Status
from loraplex.residency.ledger import Entry
from loraplex.residency.residency import Residency
from loraplex.residency.slot_pool import SlotPoolBackend


@dataclass
class ScheduledBatch:
    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefills + self.decodes

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockManager,
        adapters: Residency[Entry, SlotPoolBackend],
    ):
        self.config = config
        self.blocks = blocks
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.adapter is not None:
            self.adapters.backend.add_waiting(seq.adapter.key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, max_new: int | None = None) -> ScheduledBatch:
        """The running sequences first, in admission order (a decode, or the next chunk of a
        prefill), then the waiting ones, within max_num_batched_tokens; with `max_new`, at most
        that many waiting requests join."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                # preempted a moment ago to make room for an earlier sequence, or no budget left
                continue
            remaining = len(seq) - seq.num_computed
            # a prefill that did not fit in one step: its next chunk (its blocks are there)
            if remaining > 1:
                seq.num_scheduled = min(remaining, budget)
                batch.prefills.append(seq)
                budget -= seq.num_scheduled
                continue
            while not self.blocks.can_append(seq):
                victim = self.running[-1]  # the latest admitted gives way
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.append(seq)
                seq.num_scheduled = 1
                batch.decodes.append(seq)
                budget -= 1
        self._admit(batch, budget, max_new)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int, max_new: int | None) -> None:
        lora_bytes = self._lora_bytes(self.running)
        admitted = 0
        hits: dict[int, object] = {}  # each request's cached prefix blocks, found by has_room

        def has_room(seq: Sequence) -> bool:
            # First come, first served for memory too: later requests do not overtake.
            if len(self.running) + seq.num_forks >= self.config.max_num_seqs or budget == 0:
                return False
            if admitted == max_new:
                return False
            hits[id(seq)] = self.blocks.prefix_hits(seq)
            return self.blocks.can_allocate(seq, hits[id(seq)])

        def take(seq: Sequence) -> Take:
            if self.take_adapter(seq, lora_bytes):
                return Take.TAKEN
            return Take.BLOCKED if seq.adapter.key in self.adapters.loading else Take.REFUSED

        def admit(seq: Sequence) -> None:
            nonlocal budget, lora_bytes, admitted
            admitted += 1
            self._stop_waiting(seq)
            self.blocks.allocate(seq, hits.pop(id(seq)))
            seq.status = Status.RUNNING
            seq.admitted_at = seq.admitted_at or time.monotonic()
            self.running.append(seq)
            seq.num_scheduled = min(len(seq) - seq.num_computed, budget)  # the rest in later steps
            batch.prefills.append(seq)
            budget -= seq.num_scheduled
            lora_bytes = self._lora_bytes(self.running)

        admit_waiting(
            self._in_turn(),
            has_room=has_room,
            take_adapter=take,
            admit=admit,
            adapter_of=lambda seq: None if seq.adapter is None else seq.adapter.key,
        )

    def _in_turn(self) -> list[Sequence]:
        """The waiting requests in arrival order, those that their tenant's budget keeps waiting
        after the others (for a bounded time: `SlotPoolBackend.defers`), so that a slot that frees
        goes to a tenant within budget."""
        if not self.adapters.backend.budget_waiting:
            return list(self.waiting)
        first, later = [], []
        for seq in self.waiting:
            held = seq.adapter is not None and self.adapters.backend.defers(seq.adapter)
            (later if held else first).append(seq)
        return first + later

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Run `child` beside its prefilled parent on the parent's KV blocks and adapter slot;
        returns the block the runner copies for it, if any (`BlockManager.fork`)."""
        pair = self.blocks.fork(parent, child)
        if child.adapter is not None:
            child.lora_slot, child.holds_adapter = self.adapters.acquire(child.adapter), True
        child.status, child.admitted_at = Status.RUNNING, parent.admitted_at
        child.num_computed, child.num_hashed = parent.num_computed, parent.num_hashed
        child.prefix_hash = parent.prefix_hash
        self.running.append(child)
        return pair

    def take_adapter(self, seq: Sequence, lora_bytes: int) -> bool:
        if self._over_lora_budget(seq.adapter.key, lora_bytes):
            return False
        slot = self.adapters.acquire(seq.adapter)
        if slot is None:
            return False
        seq.lora_slot, seq.holds_adapter = slot, True
        return True

    def _over_lora_budget(self, key, lora_bytes: int) -> bool:
        """A new adapter would take the step's LoRA bytes past the limit (the first always fits)."""
        limit = self.config.max_lora_bytes_per_step
        if limit is None or not lora_bytes:
            return False
        in_batch = any(s.adapter is not None and s.adapter.key == key for s in self.running)
        return not in_batch and lora_bytes + self.adapters.nbytes_of(key) > limit

    def _lora_bytes(self, seqs: list[Sequence]) -> int:
        keys = {s.adapter.key for s in seqs if s.adapter is not None}
        return sum(self.adapters.nbytes_of(k) for k in keys)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's memory; it waits at the front and recomputes its tokens when
        readmitted."""
        self.running.remove(seq)
        self.release(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        self.waiting.appendleft(seq)
        if seq.adapter is not None:
            self.adapters.backend.add_waiting(seq.adapter.key)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self._stop_waiting(seq)
        self.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _stop_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        if seq.adapter is not None:
            self.adapters.backend.drop_waiting(seq.adapter.key)

    def release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.holds_adapter:
            self.adapters.release(seq.adapter.key, seq.adapter.tenant)
            seq.holds_adapter, seq.lora_slot = False, -1
