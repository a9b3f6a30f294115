"""The parity gate over a real server: `registry write-reference` (HF+PEFT) makes a revision's
reference, `registry reference` attaches it, `registry verify` has the server score its tokens. The
revision as trained passes; a copy whose LoRA scale is off by 10%, which greedy text does not tell
apart, is refused."""

from __future__ import annotations

import json

import pytest
from harness import KEYS, variant
from typer.testing import CliRunner

from loraplex.registry.cli import app
from loraplex.registry.parity import Reference, Scored, judge, parse_reference

SEQUENCES = [[1, 5, 17, 3, 40, 22, 9, 11, 60, 2], [2, 30, 31, 32, 7, 8, 90, 14]]


@pytest.fixture(scope="module")
def gate(start, llama_adapters, llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gate")
    trained = llama_adapters["attn-r8"]
    off = variant(trained, tmp / "off-by-10pct", 1.1)  # B × 1.1: the LoRA scale 10% too high
    again = variant(trained, tmp / "retrained", 1.000001)  # other bytes, the same adapter

    def setup(registry):
        registry.add_revision(trained, "gate", revision="1", shared=True, status="stable")
        registry.add_revision(off, "gate", revision="2", shared=True)
        registry.add_revision(again, "gate", revision="3", shared=True)

    with start(registry_setup=setup) as running:
        cli = CliRunner()
        args = ["--registry", f"sqlite:///{running.tmp}/registry.db"]
        args += ["--store", str(running.tmp / "artifacts")]
        tokens = tmp / "tokens.jsonl"
        tokens.write_text("".join(json.dumps({"ids": s}) + "\n" for s in SEQUENCES))
        ref = tmp / "reference.json"
        wrote = cli.invoke(
            app,
            ["write-reference", str(trained), "--model", str(llama_dir), "--tokens", str(tokens)]
            + ["--out", str(ref)],
        )
        assert wrote.exit_code == 0, wrote.output
        for revision in ("1", "2", "3"):
            attached = cli.invoke(app, [*args, "reference", "gate", revision, str(ref)])
            assert attached.exit_code == 0, attached.output
            assert "2 sequences, 18 tokens" in attached.output
        yield running, cli, args, ref


def _verify(gate, revision: str):
    running, cli, args, _ = gate
    return cli.invoke(
        app,
        [*args, "verify", "gate", revision, "--url", running.url, "--api-key", KEYS["alice"]],
    )


def test_the_revision_as_trained_passes(gate):
    result = _verify(gate, "1")
    assert result.exit_code == 0, result.output
    assert "gate@1 passes" in result.output


def test_a_scale_off_by_ten_percent_is_refused_though_its_greedy_text_is_the_same(gate):
    running = gate[0]
    client = running.client("alice")
    texts = [
        client.completions.create(
            model=f"gate@{rev}", prompt="hello there", max_tokens=8, temperature=0
        )
        .choices[0]
        .text
        for rev in ("1", "2")
    ]
    assert texts[0] == texts[1]  # greedy text does not tell them apart
    result = _verify(gate, "2")
    assert result.exit_code == 1, result.output
    assert "gate@2 refused" in result.output
    events = running.registry.audit_events(target="gate@2")
    assert [e.detail["passed"] for e in events if e.action == "verify"][:1] == [False]


def test_promotion_runs_the_parity_gate_as_a_release_check(gate):
    """The admin API's promote scores the reference on the server's own engine: the 10%-off
    revision is refused with the gate's line, the retrained one goes into traffic."""
    running = gate[0]
    refused = running.admin("POST", "/admin/adapters/gate/promote", json={"revision": "2"})
    assert refused.status_code == 409, refused.text
    assert "parity gate" in refused.text and "refused" in refused.text
    promoted = running.admin(
        "POST", "/admin/adapters/gate/promote", json={"revision": "3", "weight": 50}
    )
    assert promoted.status_code == 200, promoted.text
    assert promoted.json()["traffic"] == {"1": 50, "3": 50}
    audit = running.registry.audit_events(target="gate@3")
    checks = [e.detail for e in audit if e.action == "promote"]
    assert checks and checks[0]["checks"]["parity"]["tokens"] == 16


def test_verify_needs_a_reference_and_a_reference_must_be_whole(gate, tmp_path):
    running, cli, args, ref = gate
    running.registry.add_revision(
        gate[3].parent / "off-by-10pct", "bare", revision="1", shared=True
    )
    missing = cli.invoke(app, [*args, "verify", "bare", "1", "--url", running.url])
    assert missing.exit_code == 1 and "has no reference" in missing.output
    broken = tmp_path / "broken.json"
    data = json.loads(ref.read_text())
    data["sequences"][0]["adapter"].pop()
    broken.write_text(json.dumps(data))
    refused = cli.invoke(app, [*args, "reference", "gate", "1", str(broken)])
    assert refused.exit_code == 1
    assert "one adapter and one base log-probability per id" in refused.output


def test_the_verdict_is_the_distance_against_factor_floors():
    reference = Reference((Scored((1, 2, 3), (-1.0, -2.0), (-1.5, -2.5)),))
    near = judge(reference, [[-1.001, -2.001]], [[-1.5005, -2.5005]])
    assert (
        near.passed and near.distance == pytest.approx(1e-3) and near.floor == pytest.approx(5e-4)
    )
    far = judge(reference, [[-1.1, -2.1]], [[-1.5005, -2.5005]])
    assert not far.passed
    exact = judge(reference, [[-1.0, -2.0]], [[-1.5, -2.5]])  # a floor of 0 counts as MIN_FLOOR
    assert exact.passed and exact.floor == 0.0
    assert parse_reference(reference.to_json()) == reference
