"""The rollout controller: step a canary through its weights, judge each step against the stable on
the same window, advance or roll back, and write each decision with its figures to the registry.

Every traffic change is one registry transaction (a split is never half-applied). The rollout's
own state is written before the change it decides, so a controller that dies between the two is
resumed from the registry: the split as it stands says which changes were made."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.registry import Registry, RegistryError
from loraplex.registry.errors import LifecycleError
from loraplex.registry.records import AdapterRecord
from loraplex.registry.rollouts import RolloutEnded, RolloutRecord, RolloutStore, this_holder
from loraplex.rollout.figures import RevisionFigures
from loraplex.rollout.judge import ADVANCE, ROLLBACK, Limits, StepRule, judge
from loraplex.rollout.sources import FigureSource
from loraplex.rollout.workers import QualityGate

log = logging.getLogger("loraplex.rollout")


@dataclass(frozen=True)
class Plan:
    """What one rollout runs by."""

    name: str
    revision: str
    steps: tuple[int, ...]
    limits: Limits
    rule: StepRule
    poll_s: float
    lease_s: float
    canary_workers: tuple[str, ...] = ()
    """The canary pool: recorded with the rollout, so that a router with the registry sends the
    canary's share there first."""

    def settings(self) -> dict:
        return {
            "canary_workers": list(self.canary_workers),
            "steps": list(self.steps),
            "limits": vars(self.limits),
            "step_s": self.rule.step_s,
            "min_requests": self.rule.min_requests,
            "step_timeout_s": self.rule.timeout_s,
        }


class Controller:
    def __init__(
        self,
        plan: Plan,
        registry: Registry,
        source: FigureSource,
        gate: QualityGate | None = None,
        prepare: Callable[[], None] | None = None,
        on_split: Callable[[], None] | None = None,
        say: Callable[[str], None] = print,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`prepare`: run once before the canary's first traffic (the canary pool's prewarm).
        `on_split`: run after each change of the split it makes (a gateway's configuration).
        `sleep` and `clock`: a replay's virtual time."""
        self.plan, self.registry, self.source, self.gate = plan, registry, source, gate
        self.prepare, self.say, self.sleep, self.clock = prepare, say, sleep, clock
        self.on_split = on_split
        self.is_new = False
        """A rollout begun here (not resumed): its canary pool is prepared before its traffic."""
        self.store = RolloutStore(registry)
        self.holder = this_holder()

    @property
    def name(self) -> str:
        return self.plan.name

    def run(self) -> RolloutRecord:
        """Until the rollout ends: promoted, rolled back, aborted, or ended by someone else."""
        record = self.begin()
        stop = threading.Event()
        # The lease is renewed at every look, and by this heartbeat through the long calls between
        # looks (the canary pool's prewarm, an eval set's run).
        heartbeat = threading.Thread(target=self._heartbeat, args=(stop,), daemon=True)
        heartbeat.start()
        try:
            if self.is_new and self.prepare is not None:
                self.prepare()
            while record.is_active:
                try:
                    record = self.run_step(record)
                except RolloutEnded:  # aborted between a look and a decision
                    record = self.stopped()
        finally:
            stop.set()
            heartbeat.join()
            self.store.release(self.name, self.holder)
        self.say(f"{self.name}@{self.plan.revision}: {record.phase} ({record.reason})")
        return record

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.plan.lease_s / 3):
            try:
                self.store.renew(self.name, self.holder, self.plan.lease_s)
            except Exception as exc:  # noqa: BLE001 (the next look renews, or stops on LeaseHeld)
                log.warning("lease not renewed: %s", exc)

    def begin(self) -> RolloutRecord:
        existing = self.store.get(self.name)
        if existing is not None and existing.is_active:  # resumed, or refused by `begin`
            stable = existing.stable_revision
        else:
            stable = _stable_of(self.registry.show(self.name), self.plan.revision)
        record, resumed = self.store.begin(
            self.name,
            self.plan.revision,
            stable,
            self.plan.steps,
            self.plan.settings(),
            self.plan.lease_s,
            self.holder,
        )
        if resumed:
            self.say(f"{self.name}@{record.revision}: resuming at step {record.step + 1}")
            return self.reconcile(record, resuming=True)
        self.say(f"{self.name}@{record.revision}: rolling out against {stable}")
        self.is_new = True
        return record

    def run_step(self, record: RolloutRecord) -> RolloutRecord:
        """Apply the step's weight, pass the quality gate, then watch its window to a verdict."""
        if record.phase == "rolling_back":
            return self.roll_back(record, None)
        record = self.reconcile(record)
        if not record.is_active:
            return self.stopped()
        quality = None
        if record.weight < 100 and self.gate is not None:  # before the step's traffic
            gate = self.gate.check(self.name, record.revision, record.stable_revision)
            quality = gate.detail
            # before the step's traffic: the canary still has the previous step's share
            decision = {
                "step": record.step + 1,
                "weight": record.steps[record.step - 1] if record.step else 0,
                "step_weight": record.weight,
                "before_traffic": True,
                "quality": quality,
            }
            if not gate.passed:
                return self.roll_back(record, {**decision, "reasons": [gate.reason]})
            self.say(f"{self.name}@{record.revision}: quality gate: {gate.reason}")
        self.apply(record)
        record = self.reconcile(self.store.renew(self.name, self.holder, self.plan.lease_s))
        if not record.is_active:
            return self.stopped()
        if record.weight == 100:
            return self.promoted(record)
        return self.watch(record, quality)

    def stopped(self) -> RolloutRecord:
        """The rollout as ended elsewhere; an abort that came after this controller's last change
        of the split is applied again (the canary leaves traffic)."""
        record = self.store.get(self.name)
        assert record is not None  # begun by this controller
        if record.phase == "aborted" and dict(self.registry.show(self.name).traffic).get(
            record.revision
        ):
            self.registry.rollback(self.name)
            self.split_changed()
        return record

    def watch(self, record: RolloutRecord, quality: dict | None) -> RolloutRecord:
        """Read the figures every poll until a verdict; `quality`: the step's gate, recorded with
        the decision."""
        mark, started = self.source.mark(self.name), self.clock()
        self.say(f"{self.name}@{record.revision}: step {record.step + 1}, {record.weight}%")
        while True:
            self.sleep(self.plan.poll_s)
            figures = self.source.since(mark, self.name)
            # the registry as it is after the figures were read: nothing they miss changed it
            record = self.reconcile(self.store.renew(self.name, self.holder, self.plan.lease_s))
            if not record.is_active:
                return self.stopped()
            canary = figures.get(record.revision) or RevisionFigures()
            stable = figures.get(record.stable_revision) or RevisionFigures()
            elapsed = self.clock() - started
            verdict = judge(canary, stable, self.plan.limits, self.plan.rule, elapsed)
            decision = {
                "step": record.step + 1,
                "weight": record.weight,
                **verdict.figures,
                **({"quality": quality} if quality is not None else {}),
                "reasons": list(verdict.reasons),
            }
            if verdict.action == ROLLBACK:
                return self.roll_back(record, decision)
            if verdict.action == ADVANCE:
                return self.store.record(
                    self.name, self.holder, "rollout_advance", decision, step=record.step + 1
                )

    def apply(self, record: RolloutRecord) -> None:
        """The step's split, unless the registry has it already (a resumed step)."""
        traffic = dict(self.registry.show(self.name).traffic)
        if record.weight == 100:
            if traffic != {record.revision: 100}:
                self.registry.promote(self.name, record.revision, 100, force=True)
                self.split_changed()
            return
        plan = {record.revision: record.weight, record.stable_revision: 100 - record.weight}
        if traffic != plan:
            self.registry.set_traffic(self.name, plan, force=True)
            self.split_changed()

    def split_changed(self) -> None:
        if self.on_split is not None:
            self.on_split()

    def promoted(self, record: RolloutRecord) -> RolloutRecord:
        decision = {"step": record.step + 1, "weight": 100, "reasons": ["every step passed"]}
        return self.store.record(
            self.name,
            self.holder,
            "rollout_promote",
            decision,
            phase="promoted",
            reason=f"stable at 100% after {len(record.steps)} steps",
        )

    def roll_back(self, record: RolloutRecord, decision: dict | None) -> RolloutRecord:
        """Record the decision (phase rolling_back), then drop the canary's traffic."""
        if decision is not None:
            reason = "; ".join(decision["reasons"])
            record = self.store.record(
                self.name,
                self.holder,
                "rollout_rollback",
                decision,
                phase="rolling_back",
                reason=reason,
            )
            self.say(
                f"{record.name}@{record.revision}: rolling back at step {record.step + 1}: {reason}"
            )
        adapter = self.registry.show(self.name)
        if dict(adapter.traffic).get(record.revision):
            self.registry.rollback(self.name)
            self.split_changed()
        elif _status(adapter, record.revision) in ("staging", "canary"):  # refused before traffic
            self.registry.deprecate(
                self.name, record.revision, reason=f"rolled back to {record.stable_revision}"
            )
        before = {
            k: v
            for k, v in (record.last_decision or {}).items()
            if k in ("before_traffic", "weight")
        }
        return self.store.record(
            self.name,
            self.holder,
            "rollout_end",
            {"step": record.step + 1, "reasons": [record.reason or "rolled back"], **before},
            phase="rolled_back",
        )

    def reconcile(self, record: RolloutRecord, resuming: bool = False) -> RolloutRecord:
        """The rollout as the registry's split has it: ended when someone else quarantined the
        canary, rolled it back or changed the split; on resume, the step the split is at."""
        if not record.is_active or record.phase == "rolling_back":
            return record
        adapter = self.registry.show(self.name)
        traffic = dict(adapter.traffic)
        canary = next(r for r in adapter.revisions if r.revision == record.revision)
        weight = traffic.get(record.revision, 0)
        if traffic == _split(record, record.step):
            return record
        if resuming and traffic == {record.revision: 100}:
            return self.promoted(record)
        if traffic == _split(record, record.step - 1) and canary.status != "deprecated":
            return record  # the step was decided, its split not yet made: `apply` makes it
        if canary.status == "quarantined":
            why = f"{record.name}@{record.revision} was quarantined ({canary.status_reason})"
        elif not weight:
            why = f"{record.name}@{record.revision} left traffic (a rollback by hand)"
        else:
            shown = " ".join(f"{rev} {w}%" for rev, w in adapter.traffic)
            why = f"the split was changed by someone else to {shown}"
        return self.store.record(
            self.name,
            self.holder,
            "rollout_end",
            {"step": record.step + 1, "traffic": traffic, "reasons": [why]},
            phase="ended",
            reason=why,
        )


def _split(record: RolloutRecord, step: int) -> dict[str, int]:
    """The split at a step (before the first: all of it to the stable)."""
    weight = record.steps[step] if step >= 0 else 0
    split = {record.revision: weight, record.stable_revision: 100 - weight}
    return {rev: w for rev, w in split.items() if w}


def _status(adapter: AdapterRecord, revision: str) -> str | None:
    return next((r.status for r in adapter.revisions if r.revision == revision), None)


def _stable_of(adapter: AdapterRecord, revision: str) -> str:
    """The stable revision the canary is compared with; refuses a rollout that has none to compare
    with, or of a revision that cannot be served."""
    by_label = {r.revision: r for r in adapter.revisions}
    canary = by_label.get(revision)
    if canary is None:
        raise RegistryError(f"{adapter.name}@{revision} is not registered")
    if canary.status == "quarantined":
        raise LifecycleError(f"{canary.model_id} is quarantined ({canary.status_reason})")
    stable = [r for r in adapter.revisions if r.status == "stable" and r.traffic_weight]
    if not stable:
        raise LifecycleError(
            f"{adapter.name} has no stable revision to compare {revision} with; promote one "
            f"first (`loraplex registry promote {adapter.name} REV`)"
        )
    others = [rev for rev, _ in adapter.traffic if rev not in (revision, stable[0].revision)]
    if others:
        raise LifecycleError(
            f"{adapter.name}@{others[0]} is in canary; roll it back (`loraplex registry rollback "
            f"{adapter.name}`) or promote it first: one canary at a time"
        )
    if revision == stable[0].revision:
        raise LifecycleError(f"{canary.model_id} is the stable revision already")
    return stable[0].revision
