"""A rollout replayed in virtual time: the real controller (steps, judge, audit events) over a
scratch registry and a simulated name whose canary carries a chosen regression, to size steps and
windows before a real rollout: how long a regression takes to be caught, and how many requests it
serves meanwhile."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy.orm import Session

from loraplex.registry import Registry, db
from loraplex.registry.db import Adapter, Revision, Traffic, utcnow
from loraplex.registry.traffic import choose
from loraplex.rollout.controller import Controller, Plan
from loraplex.rollout.figures import RevisionFigures
from loraplex.rollout.judge import Limits, StepRule
from loraplex.settings.rollout import ReplaySettings

NAME, STABLE, CANARY = "replayed", "stable", "canary"


@dataclass(frozen=True)
class Profile:
    """How one revision answers: median latencies, their lognormal sigma, its 5xx rate."""

    ttft_s: float
    tpot_s: float
    sigma: float
    error_rate: float


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class SimulatedName:
    """A figure source: each read first serves the requests of the virtual time since the last
    (a Poisson count at `rate`), each to a revision by the registry's split as it is."""

    def __init__(
        self,
        registry: Registry,
        profiles: dict[str, Profile],
        rate: float,
        seed: int,
        clock: VirtualClock,
    ):
        self.registry, self.profiles, self.rate, self.clock = registry, profiles, rate, clock
        self.rng = np.random.default_rng(seed)
        self.total = {rev: RevisionFigures() for rev in profiles}
        self.served_at = 0.0

    def serve(self) -> None:
        elapsed, self.served_at = self.clock.now - self.served_at, self.clock.now
        weights = list(self.registry.show(NAME).traffic)
        for point in self.rng.random(self.rng.poisson(self.rate * elapsed)):
            revision = choose(weights, float(point))
            p = self.profiles[revision]
            ttft, tpot = self.rng.lognormal(np.log([p.ttft_s, p.tpot_s]), p.sigma)
            self.total[revision].record(self.rng.random() >= p.error_rate, ttft, tpot)

    def mark(self, name: str) -> dict[str, RevisionFigures]:
        self.serve()
        return {rev: RevisionFigures.from_json(f.to_json()) for rev, f in self.total.items()}

    def since(self, mark: dict[str, RevisionFigures], name: str) -> dict[str, RevisionFigures]:
        self.serve()
        return {rev: f.since(mark[rev]) for rev, f in self.total.items()}


def scratch_registry(root: Path) -> Registry:
    """A registry holding one name with a stable revision at 100% and a staged canary (rows only:
    the replay serves no bytes)."""
    registry = Registry(f"sqlite:///{root / 'replay.db'}", actor="replay")
    registry.init()
    with Session(db.writer(registry.engine)) as session, session.begin():
        session.add(
            Adapter(
                name=NAME,
                shared=True,
                priority=0,
                warm_policy="on_demand",
                pinned=False,
                created_at=utcnow(),
            )
        )
        rows = [
            _revision(label, "stable" if label == STABLE else "staging")
            for label in (STABLE, CANARY)
        ]
        session.add_all(rows)
        session.flush()
        session.add(Traffic(adapter_name=NAME, revision_id=rows[0].id, weight=100))
    return registry


def _revision(label: str, status: str) -> Revision:
    return Revision(
        adapter_name=NAME,
        revision=label,
        digest=f"sha256:{label:0>64}"[:71],
        base_model="replay",
        rank=8,
        lora_alpha=16,
        dtype="float16",
        target_modules="q_proj",
        estimated_bytes=0,
        actual_bytes=0,
        storage_uri="replay://",
        status=status,
        created_at=utcnow(),
        stable_since=utcnow() if status == "stable" else None,
    )


def replay(s: ReplaySettings) -> dict:
    """The decisions (as the audit events hold them) and a summary of one replayed rollout."""
    stable = Profile(s.stable_ttft_s, s.stable_tpot_s, s.spread, s.stable_error_rate)
    canary = Profile(
        s.stable_ttft_s * s.ttft_factor,
        s.stable_tpot_s * s.tpot_factor,
        s.spread,
        s.canary_error_rate,
    )
    limits = Limits(
        s.max_error_ratio,
        s.error_rate_floor,
        s.max_ttft_ratio,
        s.max_tpot_ratio,
        s.max_error_rate,
        s.max_ttft_p99_s,
        s.max_tpot_p99_s,
    )
    plan = Plan(
        NAME,
        CANARY,
        s.steps,
        limits,
        StepRule(s.step_s, s.min_requests, s.step_timeout_s),
        s.poll_s,
        lease_s=3600.0,
    )
    clock = VirtualClock()
    with tempfile.TemporaryDirectory(prefix="loraplex-replay-") as root:
        registry = scratch_registry(Path(root))
        try:
            fleet = SimulatedName(registry, {STABLE: stable, CANARY: canary}, s.rate, s.seed, clock)
            controller = Controller(
                plan,
                registry,
                fleet,
                say=lambda line: None,
                sleep=clock.sleep,
                clock=lambda: clock.now,
            )
            record = controller.run()
            events = [
                e
                for e in reversed(registry.audit_events(10_000, NAME))
                if e.action.startswith("rollout_")
            ]
        finally:
            registry.close()
    decisions = [{"action": e.action, **e.detail} for e in events]
    served = fleet.total[CANARY]
    return {
        "outcome": record.phase,
        "reason": record.reason,
        "virtual_s": round(clock.now, 3),
        "canary_requests": int(served.requests),
        "canary_errors": int(served.errors),
        "decisions": decisions,
    }
