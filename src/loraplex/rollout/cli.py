"""`loraplex rollout NAME REV` (the controller, until the rollout ends), `loraplex rollout status
NAME` and `loraplex rollout abort NAME`."""

from __future__ import annotations

import functools
import getpass
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError
from typer.core import TyperGroup

from loraplex.outputs import unwritable
from loraplex.registry import Registry, RegistryError
from loraplex.registry.cli import default_data_dir
from loraplex.registry.errors import LifecycleError
from loraplex.registry.rollouts import RolloutRecord, RolloutStore
from loraplex.rollout.controller import Controller, Plan
from loraplex.rollout.judge import Limits, StepRule
from loraplex.rollout.sources import PrometheusSource, SourceError, WorkerSource
from loraplex.rollout.workers import QualityGate, WorkerError, canary_pool, prewarm, wait_active
from loraplex.settings.command import PlainTyper, add_settings_command
from loraplex.settings.rollout import (
    ENV_PREFIX,
    REPLAY_ENV_PREFIX,
    ReplaySettings,
    RolloutSettings,
)
from loraplex.tables import print_table

ACTIVATE_TIMEOUT_S = 120.0


class RolloutGroup(TyperGroup):
    """`rollout NAME REV` runs `rollout start NAME REV`: a first word that is not a command is the
    start's (an adapter named `status` or `abort` is rolled out with `rollout start`)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["start", *args]
        return super().parse_args(ctx, args)


app = PlainTyper(
    name="rollout",
    cls=RolloutGroup,
    help="Step a revision's traffic 1 → 10 → 50 → 100%, judged against the stable, rolled back "
    "on its own.",
    no_args_is_help=True,
    add_completion=False,
)


def _errors(command):
    """Registry, worker and source errors as one line on stderr, exit 1."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (RegistryError, SourceError, WorkerError, OSError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except SQLAlchemyError as exc:
            reason = getattr(exc, "orig", None) or exc
            typer.echo(f"error: the registry database: {str(reason).splitlines()[0]}", err=True)
            raise typer.Exit(1) from None

    return run


def open_registry(url: str | None, data_dir: Path | None) -> Registry:
    """The registry, which must exist already (a missing SQLite file is an error, not made)."""
    data = data_dir or default_data_dir()
    return Registry(
        url or f"sqlite:///{data / 'registry.db'}",
        actor=f"rollout:{getpass.getuser()}",
        create=False,
    )


def _token(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        typer.echo(f"error: --admin-token-file {path}: cannot read a token from it", err=True)
        sys.exit(2)


def start(settings: RolloutSettings) -> None:
    """Roll a revision out step by step; runs until it is promoted or rolled back."""
    token = _token(settings.admin_token_file)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(headers=headers, timeout=120) as client:
        registry = open_registry(settings.registry, settings.data_dir)
        try:
            record = _errors(run_controller)(settings, registry, client)
        finally:
            registry.close()
    raise typer.Exit(0 if record.phase == "promoted" else 3)


def run_controller(
    settings: RolloutSettings, registry: Registry, client: httpx.Client
) -> RolloutRecord:
    plan = Plan(
        settings.name,
        settings.revision,
        settings.steps,
        Limits(
            settings.max_error_ratio,
            settings.error_rate_floor,
            settings.max_ttft_ratio,
            settings.max_tpot_ratio,
            settings.max_error_rate,
            settings.max_ttft_p99_s,
            settings.max_tpot_p99_s,
        ),
        StepRule(settings.step_s, settings.min_requests, settings.step_timeout_s),
        settings.poll_s,
        settings.lease_s,
        canary_pool(settings.workers(), settings.named_canary_workers(), settings.canary_share),
    )
    source = (
        PrometheusSource(settings.prometheus_url, client)
        if settings.prometheus_url and settings.source == "prometheus"
        else WorkerSource(settings.workers(), client)
    )
    pool = plan.canary_workers
    gate = None
    if settings.quality_gate and (pool or settings.workers()):
        gate = QualityGate((*pool, *settings.workers())[0], client, settings.quality_margin)

    def prepare() -> None:
        prewarm(client, pool, settings.name, settings.revision)
        cold = wait_active(client, pool, settings.name, settings.revision, ACTIVATE_TIMEOUT_S)
        if cold:
            typer.echo(f"warning: not in a device slot yet on {', '.join(cold)}", err=True)

    def on_split() -> None:
        assert settings.on_split is not None  # given only then
        split = ",".join(f"{rev}={w}" for rev, w in registry.show(settings.name).traffic)
        env = {**os.environ, ENV_PREFIX + "NAME": settings.name, ENV_PREFIX + "SPLIT": split}
        done = subprocess.run(settings.on_split, shell=True, env=env, check=False)
        if done.returncode:
            typer.echo(f"warning: --on-split exited {done.returncode} after {split}", err=True)

    controller = Controller(
        plan,
        registry,
        source,
        gate,
        prepare if pool else None,
        on_split if settings.on_split else None,
        say=typer.echo,
    )
    return controller.run()


add_settings_command(
    app,
    RolloutSettings,
    start,
    "start",
    ENV_PREFIX,
    arguments=(("name", "The adapter name"), ("revision", "The revision to roll out")),
)

RegistryOption = Annotated[
    str | None,
    typer.Option(
        "--registry",
        metavar="URL",
        envvar=ENV_PREFIX + "REGISTRY",
        help="Registry URL (default: sqlite:///DATA_DIR/registry.db)",
    ),
]
DataDirOption = Annotated[
    Path | None,
    typer.Option(
        "--data-dir", metavar="DIR", envvar=ENV_PREFIX + "DATA_DIR", help="Data directory"
    ),
]


@app.command()
def status(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The adapter name")],
    registry: RegistryOption = None,
    data_dir: DataDirOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Where a name's rollout stands, the split now, and whether a controller drives it."""
    _errors(_status)(name, registry, data_dir, json_out)


def _status(name: str, url: str | None, data_dir: Path | None, json_out: bool) -> None:
    reg = open_registry(url, data_dir)
    try:
        record = RolloutStore(reg).get(name)
        traffic = reg.show(name).traffic
    finally:
        reg.close()
    if record is None:
        raise LifecycleError(f"{name} has never been rolled out")
    if json_out:
        typer.echo(json.dumps({**record.to_dict(), "traffic": dict(traffic)}, indent=2))
        return
    for line in status_lines(record, traffic):
        typer.echo(line)


def status_lines(record: RolloutRecord, traffic: tuple[tuple[str, int], ...]) -> list[str]:
    split = " ".join(f"{rev} {w}%" for rev, w in traffic) or "no traffic"
    step = f"step {record.step + 1} of {len(record.steps)} ({record.weight}%)"
    decision = record.last_decision or {}
    if decision.get("before_traffic") and not record.is_active:
        step = f"before the traffic of {step}, the canary at {decision.get('weight', 0)}%"
    lines = [
        f"{record.name}@{record.revision} against {record.stable_revision}: {record.phase}, {step}"
        + (f": {record.reason}" if record.reason else ""),
        f"split now: {split}",
    ]
    if record.is_active and record.lease_alive():
        assert record.lease_expires_at is not None  # a live lease has its expiry
        lines.append(
            f"controller: {record.holder}, lease until {record.lease_expires_at:%H:%M:%S} UTC"
        )
    elif record.is_active:
        lines.append(
            f"controller: none (the last, {record.holder or '-'}, stopped); the split stays as it "
            f"is; `loraplex rollout {record.name} {record.revision}` resumes it"
        )
    if decision:
        lines.append(f"last decision: {decision_line(decision)}")
    return lines


def decision_line(decision: dict) -> str:
    parts = [decision.get("action", "?"), f"step {decision.get('step', '?')}"]
    for who in ("canary", "stable"):
        f = decision.get(who)
        if f:
            parts.append(
                f"{who} {f['requests']:g} requests, {f['error_rate']:.2%} errors, "
                f"TTFT p99 {f['ttft_p99_ms']} ms, TPOT p99 {f['tpot_p99_ms']} ms"
            )
    reasons = decision.get("reasons")
    if reasons:
        parts.append("; ".join(reasons))
    return ": ".join(parts[:2]) + (" — " + " | ".join(parts[2:]) if parts[2:] else "")


@app.command()
def abort(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The adapter name")],
    registry: RegistryOption = None,
    data_dir: DataDirOption = None,
    reason: Annotated[
        str, typer.Option(metavar="TEXT", help="Why (kept in the audit event)")
    ] = "aborted",
) -> None:
    """Roll back now: the canary leaves traffic and the rollout ends (its controller stops)."""
    _errors(_abort)(name, registry, data_dir, reason)


def _abort(name: str, url: str | None, data_dir: Path | None, reason: str) -> None:
    reg = open_registry(url, data_dir)
    try:
        record = RolloutStore(reg).end(name, "aborted", reason, "rollout_abort")
        if dict(reg.show(name).traffic).get(record.revision):
            reg.rollback(name)
        typer.echo(f"{name}@{record.revision}: aborted; split now: " + _split(reg, name))
    finally:
        reg.close()


def _split(reg: Registry, name: str) -> str:
    return " ".join(f"{rev} {w}%" for rev, w in reg.show(name).traffic) or "no traffic"


def replay_command(settings: ReplaySettings) -> None:
    """Replay a rollout in virtual time over a simulated name whose canary carries a chosen
    regression: when it is caught, and what it served meanwhile."""
    from loraplex.rollout.replay import replay

    why = unwritable(settings.json) if settings.json is not None else None
    if why is not None:
        typer.echo(f"error: --json {settings.json}: {why}", err=True)
        raise typer.Exit(2)
    result = replay(settings)
    table = Table(title=f"replayed rollout: {result['outcome']} after {result['virtual_s']:g} s")
    for column in (
        "step",
        "%",
        "decision",
        "canary n",
        "5xx rate",
        "TTFT p99 ms",
        "TTFT x",
        "TPOT x",
    ):
        table.add_column(column, no_wrap=True)
    for d in result["decisions"]:
        if "canary" not in d:  # the start and the end: their figures are the decision's
            continue
        canary, ratios = d["canary"], d.get("ratios") or {}
        table.add_row(
            str(d["step"]),
            str(d["weight"]),
            d["action"].removeprefix("rollout_"),
            _shown(canary["requests"]),
            _shown(canary["error_rate"]),
            _shown(canary["ttft_p99_ms"]),
            _shown(ratios.get("ttft_p99")),
            _shown(ratios.get("tpot_p99")),
        )
    print_table(table)
    typer.echo(
        f"canary served {result['canary_requests']} requests ({result['canary_errors']} errors) "
        f"before: {result['reason']}"
    )
    if settings.json is not None:
        settings.json.write_text(json.dumps(result, indent=2, default=str))


def _shown(value) -> str:
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


add_settings_command(app, ReplaySettings, replay_command, "replay", REPLAY_ENV_PREFIX)
