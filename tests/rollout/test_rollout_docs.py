"""What the rollout guide says about its settings and eval runs is what the code does: the canary
pool's share (0 means none, in `rollout start --help` and docs/registry.md alike) and each eval
case's sampling."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from loraplex.cli import app
from loraplex.rollout.workers import canary_pool
from loraplex.server.rollout_admin import EVAL_MAX_TOKENS

ROOT = Path(__file__).resolve().parents[2]


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_canary_share_zero_means_no_pool_in_the_help_the_guide_and_the_code():
    help_text = _flat(CliRunner().invoke(app, ["rollout", "start", "--help"]).stdout)
    entry = help_text.split("--canary-share F", 1)[1].split("LORAPLEX_ROLLOUT_CANARY_SHARE", 1)[0]
    assert "at least one; 0: none" in entry, entry
    guide = (ROOT / "docs" / "registry.md").read_text()
    row = next(line for line in guide.splitlines() if line.startswith("| `--canary-share F`"))
    assert "at least one; 0: none" in row, row
    workers = ("http://a", "http://b", "http://c")
    assert canary_pool(workers, (), 0.0) == ()
    assert canary_pool(workers, (), 0.01) == ("http://a",)  # at least one
    assert canary_pool(workers, (), 0.5) == ("http://a", "http://b")


def test_the_eval_cases_sampling_is_documented_as_the_server_runs_it():
    """Each case: the prompt as plain text, greedy, at most EVAL_MAX_TOKENS tokens."""
    guide = _flat((ROOT / "docs" / "registry.md").read_text())
    assert (
        "Each case is one completion of its prompt as plain text (no chat template), greedy "
        f"(temperature 0), of at most {EVAL_MAX_TOKENS} tokens"
    ) in guide
