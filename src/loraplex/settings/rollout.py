"""`loraplex rollout NAME REV`'s settings, declared once (flags, `--config` keys,
`LORAPLEX_ROLLOUT_*` variables, docs). NAME and REV are the command's arguments, not settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.settings.fields import at_least, positive, setting, share
from loraplex.settings.pools import PoolSpec, parse_pools
from loraplex.settings.sim import _joined, comma_list

WHERE, STEPS, LIMITS, QUALITY, POOL = "Where", "Steps", "Limits", "Quality gate", "Canary pool"
ENV_PREFIX = "LORAPLEX_ROLLOUT_"
SOURCES = ("workers", "prometheus")


def _percent(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole percent") from None
    if not 1 <= value <= 100:
        raise ValueError(f"{value}: a step is a percent from 1 to 100")
    return value


def _url(url: str) -> str | None:
    return None if url.startswith(("http://", "https://")) else "is not an http(s) URL"


@dataclass(frozen=True)
class RolloutSettings:
    name: str = field(default="")
    """The adapter name (the command's first argument)."""
    revision: str = field(default="")
    """The revision rolled out (its second)."""
    registry: str | None = setting(
        None,
        "Registry URL",
        panel=WHERE,
        metavar="URL",
        default_text="sqlite:///DATA_DIR/registry.db",
    )
    data_dir: Path | None = setting(
        None, "Data directory", panel=WHERE, metavar="DIR", default_text="~/.local/share/loraplex"
    )
    worker: tuple[str, ...] = setting(
        (),
        "A worker's base URL (figures, eval runs, the canary pool); repeat for each",
        panel=WHERE,
        metavar="URL",
        doc="the workers (`loraplex serve`): the `workers` source reads their figures, the "
        "quality gate runs on the first of the canary pool, the pool comes from them",
    )
    admin_token_file: Path | None = setting(
        None, "The workers' admin token", panel=WHERE, metavar="FILE"
    )
    on_split: str | None = setting(
        None,
        "A shell command run after each change of the split",
        panel=WHERE,
        metavar="CMD",
        doc="a shell command run after each change of the split the controller makes, with "
        "`LORAPLEX_ROLLOUT_NAME` and `LORAPLEX_ROLLOUT_SPLIT` (`r2=10,r1=90`) set: a gateway "
        "that keeps its own copy, e.g. `loraplex registry export k8s | kubectl apply -f -`; "
        "a failure is a warning",
    )
    source: str = setting(
        "workers",
        "Where the figures come from",
        panel=WHERE,
        choices=SOURCES,
        doc="`workers`: each worker's `GET /admin/revisions`, merged; `prometheus`: the "
        "`loraplex_revision_*` series by PromQL (see the figures' sources below)",
    )
    prometheus_url: str | None = setting(
        None, "Prometheus base URL (with --source prometheus)", panel=WHERE, metavar="URL"
    )
    steps: tuple[int, ...] = setting(
        (1, 10, 50, 100),
        "The canary's percent at each step, ending in 100",
        panel=STEPS,
        metavar="P,...",
        parse=comma_list(_percent),
        show=_joined,
        default_text="1,10,50,100",
        doc="the canary's share at each step, rising, ending in 100 (the promotion)",
    )
    step_s: float = setting(
        300.0,
        "The least time a step lasts before it advances",
        panel=STEPS,
        check=at_least(0),
        doc="the least time each step lasts before it advances: long enough for the "
        "traffic's daily pattern not to matter within one window",
    )
    min_requests: int = setting(
        100,
        "The least canary requests in a step's window before it is judged",
        panel=STEPS,
        check=at_least(1),
        doc="the least canary requests in a step's window before it is judged, so that a p99 "
        "rests on enough requests (100: the p99 is the slowest request but one)",
    )
    step_timeout_s: float = setting(
        3600.0,
        "A step without --min-requests by then is rolled back",
        panel=STEPS,
        check=positive,
        doc="a step that has not seen `--min-requests` canary requests by then is rolled back: "
        "a revision that cannot be judged is not promoted",
    )
    poll_s: float = setting(
        5.0, "Seconds between looks at the figures and the registry", panel=STEPS, check=positive
    )
    lease_s: float = setting(
        30.0,
        "The controller's lease: another may take over this long after it stops renewing",
        panel=STEPS,
        check=positive,
        doc="how long the controller's lease lasts without renewal (it renews at every look): "
        "a second controller is refused while it runs; one on the same host takes over at once "
        "when the first's process is gone",
    )
    max_error_ratio: float = setting(
        2.0,
        "Canary error rate / stable's, at most",
        panel=LIMITS,
        check=positive,
        doc="the canary's error rate (5xx) over the stable's, at most; both floored at "
        "`--error-rate-floor`",
    )
    error_rate_floor: float = setting(
        0.01,
        "Error rates below this count as this in the ratio",
        panel=LIMITS,
        check=share,
        doc="error rates below this count as this in the ratio, so that one error against a "
        "stable with none is not an infinite ratio",
    )
    max_ttft_ratio: float = setting(
        1.5,
        "Canary TTFT p99 / stable's, at most (a lower quantile while too few requests for it)",
        panel=LIMITS,
        check=positive,
        doc="the canary's TTFT p99 over the stable's, at most; with fewer requests than a p99 "
        "needs, the highest quantile both windows estimate, the one their third slowest request "
        "gives (p90 of 20 requests); the histograms' buckets are 25% apart, so 1.5 is two "
        "buckets",
    )
    max_tpot_ratio: float = setting(
        1.5,
        "Canary TPOT p99 / stable's, at most (a lower quantile while too few requests for it)",
        panel=LIMITS,
        check=positive,
    )
    max_error_rate: float | None = setting(
        None, "The canary's error rate, at most (absolute)", panel=LIMITS, check=share
    )
    max_ttft_p99_s: float | None = setting(
        None, "The canary's TTFT p99, at most (absolute)", panel=LIMITS, check=positive
    )
    max_tpot_p99_s: float | None = setting(
        None, "The canary's TPOT p99, at most (absolute)", panel=LIMITS, check=positive
    )
    quality_gate: bool = setting(
        True,
        "Run the revision's eval set at each step (when it has one)",
        panel=QUALITY,
        doc="at each step, before its traffic, run the revision's eval set on a worker with "
        "the canary and with the stable; a canary whose pass rate is lower than the stable's "
        "by more than the margin is rolled back",
    )
    quality_margin: float = setting(
        0.0,
        "How far the canary's pass rate may fall below the stable's",
        panel=QUALITY,
        check=share,
    )
    canary_workers: tuple[str, ...] = setting(
        (),
        "Workers (of --worker) that prewarm and activate the canary before its traffic",
        panel=POOL,
        metavar="URL",
        default_text="the --canary-share of them",
    )
    pool: tuple[PoolSpec, ...] = setting(
        (),
        "A pool as the router takes it; a `role=canary` pool's workers are the canary workers",
        panel=POOL,
        metavar="SPEC",
        parse=parse_pools,
        show=lambda pools: [p.as_dict() for p in pools],
        doc="the fleet's pools, in `loraplex router --pool`'s form: their workers are workers "
        "too, and without `--canary-workers` the workers of the `role=canary` pools prewarm "
        "and activate the canary (the router sends them its traffic)",
    )
    canary_share: float = setting(
        1.0,
        "Without --canary-workers: this share of the workers, at least one; 0: none",
        panel=POOL,
        check=share,
        doc="without `--canary-workers`: the first this share of the `--worker`s, at least one; "
        "0: none (the canary loads where its first requests land)",
    )

    def __post_init__(self):
        if not self.steps or list(self.steps) != sorted(set(self.steps)) or self.steps[-1] != 100:
            raise ValueError(
                f"--steps {_joined(self.steps)}: give rising percents ending in 100 (1,10,50,100)"
            )
        for url in (*self.worker, *self.canary_workers, self.prometheus_url or "http://"):
            if _url(url):
                raise ValueError(f"{url!r} is not an http(s) URL")
        unknown = [u for u in self.canary_workers if u not in self.workers()]
        if unknown:
            raise ValueError(
                f"--canary-workers {unknown[0]} is not one of the workers (--worker, --pool)"
            )
        if self.source == "prometheus" and self.prometheus_url is None:
            raise ValueError("--source prometheus needs --prometheus-url")
        if self.source == "workers" and not self.workers():
            raise ValueError("--source workers needs at least one --worker URL")

    def workers(self) -> tuple[str, ...]:
        """`--worker`s, then the pools' workers, each once."""
        pooled = (u for p in self.pool for u in p.workers)
        return tuple(dict.fromkeys((*self.worker, *pooled)))

    def named_canary_workers(self) -> tuple[str, ...]:
        """`--canary-workers`, else the workers of the `canary` pools."""
        roled = tuple(u for p in self.pool if p.role == "canary" for u in p.workers)
        return self.canary_workers or roled


DEFAULTS = RolloutSettings(worker=("http://defaults",))
"""Each setting's default."""


def _same(name: str):
    """A field declared as `RolloutSettings` declares it: one declaration for both commands."""
    f = next(f for f in dataclasses.fields(RolloutSettings) if f.name == name)
    return field(default=f.default, metadata=f.metadata)


REPLAY = "Replay"
REPLAY_ENV_PREFIX = "LORAPLEX_ROLLOUT_REPLAY_"


@dataclass(frozen=True)
class ReplaySettings:
    """`loraplex rollout replay`: the controller over a simulated name, in virtual time."""

    rate: float = setting(20.0, "Requests a second for the name", panel=REPLAY, check=positive)
    stable_ttft_s: float = setting(0.05, "The stable's median TTFT", panel=REPLAY, check=positive)
    stable_tpot_s: float = setting(0.01, "The stable's median TPOT", panel=REPLAY, check=positive)
    spread: float = setting(
        0.3,
        "Sigma of the latencies' lognormal",
        panel=REPLAY,
        check=at_least(0),
        doc="sigma of the lognormal the latencies are drawn from (0.3: p99 about 2x the median)",
    )
    stable_error_rate: float = setting(0.0, "The stable's 5xx rate", panel=REPLAY, check=share)
    ttft_factor: float = setting(
        1.0, "The canary's TTFT: the stable's times this", panel=REPLAY, check=positive
    )
    tpot_factor: float = setting(
        1.0, "The canary's TPOT: the stable's times this", panel=REPLAY, check=positive
    )
    canary_error_rate: float = setting(0.0, "The canary's 5xx rate", panel=REPLAY, check=share)
    seed: int = setting(0, "Seed of the simulated traffic", panel=REPLAY)
    json: Path | None = setting(
        None, "Write the decisions and the summary as JSON here", panel=REPLAY, metavar="FILE"
    )
    steps: tuple[int, ...] = _same("steps")
    step_s: float = _same("step_s")
    min_requests: int = _same("min_requests")
    step_timeout_s: float = _same("step_timeout_s")
    poll_s: float = _same("poll_s")
    max_error_ratio: float = _same("max_error_ratio")
    error_rate_floor: float = _same("error_rate_floor")
    max_ttft_ratio: float = _same("max_ttft_ratio")
    max_tpot_ratio: float = _same("max_tpot_ratio")
    max_error_rate: float | None = _same("max_error_rate")
    max_ttft_p99_s: float | None = _same("max_ttft_p99_s")
    max_tpot_p99_s: float | None = _same("max_tpot_p99_s")

    def __post_init__(self):
        if not self.steps or list(self.steps) != sorted(set(self.steps)) or self.steps[-1] != 100:
            raise ValueError(
                f"--steps {_joined(self.steps)}: give rising percents ending in 100 (1,10,50,100)"
            )
