"""`loraplex rollout` over a fleet of pools: the workers of a `role=canary` pool are the canary
workers (they prewarm and activate the canary, and the router sends them its traffic) unless
`--canary-workers` names others; the pools' workers are workers too."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from loraplex.rollout.cli import app as rollout_app
from loraplex.rollout.workers import canary_pool
from loraplex.settings.pools import parse_pools
from loraplex.settings.rollout import RolloutSettings

POOLS = ["name=main,workers=http://w1+http://w2", "name=canaries,role=canary,workers=http://w3"]


def test_the_canary_pools_workers_are_the_canary_workers():
    settings = RolloutSettings("ad", "r2", worker=("http://w0",), pool=parse_pools(POOLS))
    assert settings.workers() == ("http://w0", "http://w1", "http://w2", "http://w3")
    pool = canary_pool(settings.workers(), settings.named_canary_workers(), 1.0)
    assert pool == ("http://w3",)
    named = RolloutSettings(
        "ad", "r2", pool=parse_pools(POOLS), canary_workers=("http://w2",)
    ).named_canary_workers()
    assert named == ("http://w2",)
    plain = RolloutSettings("ad", "r2", worker=("http://w0", "http://w1"), canary_share=0.5)
    assert canary_pool(plain.workers(), plain.named_canary_workers(), 0.5) == ("http://w0",)


def test_the_command_takes_pools_and_checks_canary_workers_against_them():
    runner = CliRunner()
    args = ["ad", "r2", *(a for p in POOLS for a in ("--pool", p))]
    shown = runner.invoke(rollout_app, [*args, "--print-config"])
    assert shown.exit_code == 0, shown.output
    pools = yaml.safe_load(shown.output)["pool"]
    assert [(p["name"], p.get("role")) for p in pools] == [("main", None), ("canaries", "canary")]
    ok = runner.invoke(rollout_app, [*args, "--canary-workers", "http://w2", "--print-config"])
    assert ok.exit_code == 0, ok.output
    stray = runner.invoke(rollout_app, [*args, "--canary-workers", "http://w9"])
    assert stray.exit_code == 2
    assert "--canary-workers http://w9 is not one of the workers (--worker, --pool)" in stray.output
