"""The life cycle of revisions: promote, split, roll back, deprecate, quarantine, pin."""

from __future__ import annotations

from sqlalchemy import select

from loraplex.registry import queries as q
from loraplex.registry.db import (
    Adapter,
    ParityReference,
    PinTier,
    Revision,
)
from loraplex.registry.errors import (
    AdapterNotFound,
    LifecycleError,
    RegistryError,
)
from loraplex.registry.parity import parse_reference
from loraplex.registry.reading import Reading
from loraplex.registry.records import PIN_TIERS, AdapterRecord, read_revision_record
from loraplex.registry.release import ReleaseChecks, parse_eval_set
from loraplex.registry.retention import retire_beyond_keep
from loraplex.registry.store import Store


class LifeCycle:
    """Changes of a name's traffic and of its revisions' statuses; each returns the adapter as
    `reading` then shows it."""

    def __init__(self, store: Store, reading: Reading):
        self.store = store
        self.reading = reading

    def promote(
        self,
        name: str,
        revision: str,
        weight: int = 100,
        checks: ReleaseChecks | None = None,
        force: bool = False,
    ) -> AdapterRecord:
        """Give `revision` `weight`% of the traffic (100: it becomes stable, and the revisions
        beyond the name's `keep` are retired; less: a canary beside the stable).

        A revision that has no traffic yet first passes the release checks; with no checks given,
        one that has an eval set is refused unless `force`.
        """
        if not 1 <= weight <= 100:
            raise LifecycleError(f"weight must be between 1 and 100, got {weight}")
        summary = self._release_checks(name, revision, checks, force)
        with self.store.write() as session:
            adapter = q.locked_adapter_or_404(session, name)
            row = q.revision_or_404(session, name, revision)
            q.refuse_unservable(row)
            stable = q.current_stable(session, name)
            if weight == 100:
                plan, new_stable = {revision: 100}, revision
            else:
                plan, new_stable = self._canary_plan(session, name, revision, weight, stable)
            q.apply_traffic(session, name, plan, stable=new_stable)
            self.store.audit(
                session,
                "promote",
                f"{name}@{revision}",
                weight=weight,
                traffic=plan,
                checks=summary,
            )
            if weight == 100:
                retire_beyond_keep(self.store, session, adapter)
        return self.reading.show(name)

    def _canary_plan(self, session, name, revision, weight, stable) -> tuple[dict[str, int], str]:
        if stable is None or stable.revision == revision:
            raise LifecycleError(
                f"{name}@{revision} cannot be a {weight}% canary: "
                + (
                    "it is the stable revision"
                    if stable
                    else f"{name} has no stable revision; promote with weight 100"
                )
            )
        others = [
            r.revision
            for r in q.serving(session, name)
            if r.revision not in (revision, stable.revision)
        ]
        if others:
            raise LifecycleError(
                f"{name}@{others[0]} is already in canary; promote it to 100 or roll back first"
            )
        return {revision: weight, stable.revision: 100 - weight}, stable.revision

    def _release_checks(
        self, name: str, revision: str, checks: ReleaseChecks | None, force: bool
    ) -> dict | str:
        with self.store.read() as session:
            adapter = session.get(Adapter, name)
            row = q.find_revision(session, name, revision, None) if adapter else None
            if row is None:
                raise AdapterNotFound(f"{name}@{revision}")
            q.refuse_unservable(row)
            if q.weights(session, name).get(row.id):
                return "already in traffic"
            record, eval_text = read_revision_record(session, adapter, row), row.eval_set
            kept = session.get(ParityReference, row.id)
            reference_text = kept.reference if kept is not None else None
        cases = parse_eval_set(eval_text) if eval_text else ()
        reference = parse_reference(reference_text) if reference_text else None
        if checks is None:
            if (cases or reference) and not force:
                what = "an eval set" if cases else "a parity reference"
                raise LifecycleError(
                    f"{record.model_id} has {what} but no release checks were given to run it "
                    "(promote through a running server's admin API, or force it)"
                )
            return "skipped (forced)" if cases or reference else "none configured"
        return checks.run(record, cases, reference)

    def set_traffic(
        self,
        name: str,
        weights: dict[str, int],
        checks: ReleaseChecks | None = None,
        force: bool = False,
    ) -> AdapterRecord:
        """Set the whole split at once (weights in percent, summing to 100; 0 removes a
        revision)."""
        plan = {rev: int(w) for rev, w in weights.items() if int(w) != 0}
        if any(w < 0 for w in plan.values()) or sum(plan.values()) != 100:
            raise LifecycleError(
                f"traffic weights must be non-negative and sum to 100, got {weights}"
            )
        if len(plan) > 2:
            raise LifecycleError(
                f"one canary at a time: a split names the stable and at most one canary, got {plan}"
            )
        summaries = {rev: self._release_checks(name, rev, checks, force) for rev in plan}
        with self.store.write() as session:
            adapter = q.locked_adapter_or_404(session, name)
            rows = {rev: q.revision_or_404(session, name, rev) for rev in plan}
            for row in rows.values():
                q.refuse_unservable(row)
            stable = q.current_stable(session, name)
            new_stable = (
                stable.revision
                if stable and stable.revision in plan
                else max(plan, key=lambda rev: (plan[rev], rows[rev].id))
            )
            q.apply_traffic(session, name, plan, stable=new_stable)
            self.store.audit(session, "set_traffic", name, traffic=plan, checks=summaries)
            if stable is None or stable.revision != new_stable:
                retire_beyond_keep(self.store, session, adapter)
        return self.reading.show(name)

    def rollback(self, name: str) -> AdapterRecord:
        """One call back: drop the canary if there is one, else return to the previous stable
        revision."""
        with self.store.write() as session:
            q.locked_adapter_or_404(session, name)
            stable = q.current_stable(session, name)
            canaries = [r for r in q.serving(session, name) if stable is None or r.id != stable.id]
            if stable is not None and canaries:
                target, dropped = stable, canaries
            else:
                target, dropped = (
                    q.previous_stable(session, name, stable),
                    [stable] if stable else [],
                )
            q.apply_traffic(session, name, {target.revision: 100}, stable=target.revision)
            for row in dropped:
                row.status, row.status_reason = "deprecated", f"rolled back to {target.revision}"
            self.store.audit(
                session, "rollback", name, to=target.revision, dropped=[r.revision for r in dropped]
            )
        return self.reading.show(name)

    def deprecate(
        self, name: str, revision: str | None = None, reason: str = "deprecated by operator"
    ) -> AdapterRecord:
        """Deprecate one revision (it must not serve traffic), or with no revision the whole
        name; `reason` is kept with each revision."""
        with self.store.write() as session:
            q.locked_adapter_or_404(session, name)
            if revision is None:
                q.apply_traffic(session, name, {}, stable=None)
                rows = session.scalars(
                    select(Revision).where(
                        Revision.adapter_name == name,
                        Revision.status.not_in(("quarantined", "retired")),
                    )
                ).all()
            else:
                rows = [q.revision_or_404(session, name, revision)]
                if q.weights(session, name).get(rows[0].id):
                    raise LifecycleError(
                        f"{name}@{revision} serves traffic; promote another revision or roll back "
                        "first"
                    )
                q.refuse_unservable(rows[0])
            for row in rows:
                row.status, row.status_reason = "deprecated", reason
            self.store.audit(session, "deprecate", f"{name}@{revision}" if revision else name)
        return self.reading.show(name)

    def quarantine(self, name: str, revision: str, reason: str) -> AdapterRecord:
        """Never serve this revision again; its traffic goes back to the stable (or the previous
        stable)."""
        with self.store.write() as session:
            q.locked_adapter_or_404(session, name)
            row = q.revision_or_404(session, name, revision)
            serving = {r.revision: w for r, w in q.serving_weights(session, name)}
            weight = serving.pop(revision, 0)
            stable = q.current_stable(session, name)
            if stable is not None and stable.id != row.id:
                heir = stable
            else:
                heir = q.previous_stable(session, name, row, required=False)
            if weight and heir is not None:
                serving[heir.revision] = serving.get(heir.revision, 0) + weight
            elif weight:
                serving = {}  # no earlier stable: never let a canary silently take all the traffic
            q.apply_traffic(
                session, name, serving, stable=heir.revision if heir and serving else None
            )
            row.status, row.status_reason = "quarantined", reason
            self.store.audit(
                session, "quarantine", f"{name}@{revision}", reason=reason, traffic=serving
            )
        return self.reading.show(name)

    def pin(self, name: str, pinned: bool = True, tier: str = "cpu") -> AdapterRecord:
        """A pinned adapter is kept resident by the cache in `tier` (never chosen for eviction from
        it); a server pins it there again at its next start. Unpinning also ends a warm policy of
        gpu or cpu (it becomes `on_demand`): that policy is a pin too, and the operator's call
        overrides the manifest's."""
        if pinned and tier not in PIN_TIERS:
            raise RegistryError(f"a pin's tier is gpu or cpu, not {tier!r}")
        with self.store.write() as session:
            adapter = q.locked_adapter_or_404(session, name)
            adapter.pinned = pinned
            row = session.get(PinTier, name)
            if not pinned:
                if adapter.warm_policy in PIN_TIERS:
                    adapter.warm_policy = "on_demand"
                if row is not None:
                    session.delete(row)
            elif row is None:
                session.add(PinTier(adapter_name=name, tier=tier))
            else:
                row.tier = tier
            self.store.audit(
                session, "pin" if pinned else "unpin", name, **({"tier": tier} if pinned else {})
            )
        return self.reading.show(name)

    def unpin(self, name: str) -> AdapterRecord:
        return self.pin(name, pinned=False)
