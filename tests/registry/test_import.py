"""`loraplex registry import` (a JSONL file, a directory of adapters) on SQLite and PostgreSQL:
the digests and checks of `add`, one transaction for the lot, a bad item refused with nothing
recorded, a second import of the same bytes recording nothing new; and `registry list` paged and
filtered by tenant and status."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from loraplex.artifacts import canonical_digest
from loraplex.registry.bulk import ImportItem, ImportRefused
from loraplex.registry.cli import app


@pytest.fixture(scope="module")
def variants(adapter_v1, tmp_path_factory):
    """12 adapters of adapter_v1's shapes, each with bytes of its own."""
    root = tmp_path_factory.mktemp("variants")
    tensors = load_file(adapter_v1 / "adapter_model.safetensors")
    out = []
    for i in range(12):
        d = root / f"ad-{i:02d}"
        d.mkdir()
        (d / "adapter_config.json").write_bytes((adapter_v1 / "adapter_config.json").read_bytes())
        scaled = {k: v * (1 + 0.01 * i) if "lora_B" in k else v for k, v in tensors.items()}
        save_file(scaled, d / "adapter_model.safetensors")
        out.append(d)
    return out


def test_add_revisions_records_all_in_one_transaction_with_adds_digests(registry, variants):
    registry.add_tenant("alice")
    items = [
        ImportItem(path=p, name=p.name, tenant="alice" if i % 2 else None, stable=i < 8)
        for i, p in enumerate(variants)
    ]
    before = registry.change_count()
    result = registry.add_revisions(items)
    assert registry.change_count() == before + 1  # one transaction
    assert result.num_new == 12
    assert [r.digest for r in result.records] == [canonical_digest(p) for p in variants]
    for record in result.records[:2] + result.records[-2:]:  # as the registry reads them back
        assert record == registry.get_revision(record.name, "r1")
    listed = {a.name: a for a in registry.list_adapters()}
    assert sorted(listed) == [p.name for p in variants]
    assert listed["ad-01"].owner_tenant == "alice" and listed["ad-00"].shared
    assert listed["ad-03"].traffic == (("r1", 100),) and listed["ad-09"].traffic == ()
    assert {e.action for e in registry.audit_events(limit=100)} >= {"add"}
    assert len([e for e in registry.audit_events(limit=100) if e.action == "add"]) == 12

    again = registry.add_revisions(items)  # the same bytes under the same names
    assert again.num_new == 0 and [r.revision for r in again.records] == ["r1"] * 12


def test_a_bad_item_refuses_the_import_and_records_nothing(
    registry, variants, adapter_factory, wide_base_dir
):
    wide = adapter_factory("wide", base=wide_base_dir)  # shapes the tiny Llama refuses
    good = ImportItem(path=variants[0], name="good")
    before = registry.change_count()
    with pytest.raises(ImportRefused, match="item 2 \\(Bad\\)"):
        registry.add_revisions([good, ImportItem(path=variants[1], name="Bad")])
    with pytest.raises(ImportRefused, match="unknown tenant 'nobody'"):
        registry.add_revisions([good, ImportItem(path=variants[1], name="b", tenant="nobody")])
    with pytest.raises(ImportRefused, match="named twice"):
        registry.add_revisions([good, good])
    with pytest.raises(ImportRefused, match="item 2 \\(w, "):
        registry.add_revisions([good, ImportItem(path=wide, name="w")])
    assert registry.change_count() == before and registry.list_adapters() == []


@pytest.fixture
def cli(tmp_path, llama_dir):
    runner = CliRunner()

    def run(*args, code: int = 0):
        result = runner.invoke(app, ["--data-dir", str(tmp_path / "data"), *map(str, args)])
        assert result.exit_code == code, (result.exit_code, result.output, result.exception)
        return result

    run("init")
    run("tenant", "add", "alice")
    run("tenant", "add", "bob")
    return run


def test_import_a_jsonl_file_and_a_directory_then_page_and_filter_the_list(
    cli, variants, llama_dir, tmp_path
):
    lines = [
        {"path": str(p), "name": p.name, "tenant": "alice", "stable": True} for p in variants[:6]
    ]
    (tmp_path / "catalog.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = cli("import", tmp_path / "catalog.jsonl", "--base-model", llama_dir).stdout
    assert out.startswith("imported 6 adapters (6 new revisions)")
    extra = tmp_path / "more"
    extra.mkdir()
    for p in variants[6:]:
        (extra / f"dir-{p.name}").symlink_to(p)
    out = cli("import", extra, "--base-model", llama_dir, "--shared").stdout
    assert out.startswith("imported 6 adapters (6 new revisions)")

    def names(*args):
        return [a["name"] for a in json.loads(cli("list", "--json", *args).stdout)]

    everything = names()
    assert len(everything) == 12 and everything == sorted(everything)
    first = names("--limit", "5")
    second = names("--limit", "5", "--after", first[-1])
    assert first + second + names("--after", second[-1]) == everything
    assert names("--tenant", "bob") == [f"dir-{p.name}" for p in variants[6:]]  # shared only
    assert len(names("--tenant", "alice")) == 12
    assert names("--status", "stable") == [p.name for p in variants[:6]]
    assert names("--status", "staging") == [f"dir-{p.name}" for p in variants[6:]]
    assert "more may follow: --after ad-01" in cli("list", "--limit", "2").stdout
    refused = cli("list", "--status", "gone", code=2)
    assert refused.stderr.strip().splitlines()[-1].startswith("error: --status gone")


def test_a_bad_line_exits_2_with_one_line_and_records_nothing(cli, variants, llama_dir, tmp_path):
    good = {"path": str(variants[0]), "name": "good"}
    cases = [
        ("not json", "line 2: not JSON"),
        (json.dumps({"path": "x"}), 'line 2: give an object with "path" and "name"'),
        (json.dumps({**good, "name": "other", "colour": 1}), "line 2: unknown field 'colour'"),
        (json.dumps({"path": str(variants[1]), "name": "NO"}), "item 2 (NO)"),
    ]
    for line, message in cases:
        (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n" + line + "\n")
        result = cli("import", tmp_path / "bad.jsonl", "--base-model", llama_dir, code=2)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
    assert json.loads(cli("list", "--json").stdout) == []


def test_an_import_sets_keep_and_retires_beyond_it(registry, variants):
    registry.add_revision(variants[0], "policy", status="stable")
    items = [
        ImportItem(path=variants[1], name="policy", stable=True, keep=1),
        ImportItem(path=variants[2], name="fresh", keep=2),
    ]
    result = registry.add_revisions(items)
    assert [(r.model_id, r.status) for r in result.records] == [
        ("policy@r2", "stable"),
        ("fresh@r1", "staging"),
    ]
    shown = registry.show("policy", retired=True)
    assert [(r.revision, r.status) for r in shown.revisions] == [
        ("r1", "retired"),
        ("r2", "stable"),
    ]
    assert (shown.keep, registry.show("fresh").keep) == (1, 2)
    with pytest.raises(ImportRefused, match="item 1 .*keep: a name keeps at least 1"):
        registry.add_revisions([ImportItem(path=variants[3], name="other", keep=0)])
