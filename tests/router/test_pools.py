"""Pools as declared (flags, `--config`) and what a worker of one may serve: plain data."""

import subprocess
import sys

import pytest
import yaml

from loraplex.router.catalog import AdapterCatalog, RevisionFacts
from loraplex.router.pools import Need, PoolSpec, Reported, misconfigured, serves, tiers
from loraplex.settings.fields import SettingError, Sources, resolve
from loraplex.settings.pools import parse_pool
from loraplex.settings.router import RouterSettings

LLAMA = PoolSpec("llama", base_model="base-llama", max_rank=16, workers=("http://a",))


def test_a_pool_from_a_flag_and_from_a_config_mapping_is_the_same():
    flag = parse_pool(
        "name=gold,base-model=base-llama,max-rank=16,tenants=acme+beta,"
        "workers=http://a:1/+http://b:2"
    )
    mapping = parse_pool(
        {
            "name": "gold",
            "base-model": "base-llama",
            "max-rank": 16,
            "tenants": ["acme", "beta"],
            "workers": ["http://a:1", "http://b:2"],
        }
    )
    assert flag == mapping
    assert flag.tenants == ("acme", "beta") and flag.workers == ("http://a:1", "http://b:2")
    assert parse_pool(flag.as_dict()) == flag  # --print-config reads back


@pytest.mark.parametrize(
    "raw, words",
    [
        ("base-model=x", "needs a name"),
        ("name=p,colour=red", "pool key 'colour'"),
        ("name=p,max-rank=big", "not an integer"),
        ("name=p,max-rank=0", "at least 1"),
        ("name=p,workers=ftp://x", "is not an http"),
        ("name=p,oops", "expected KEY=VALUE"),
    ],
)
def test_a_bad_pool_is_one_error_naming_what_is_wrong(raw, words):
    with pytest.raises(ValueError, match=words):
        parse_pool(raw)


def _settings(**sources) -> RouterSettings:
    return resolve(RouterSettings, Sources(**sources))


def test_router_settings_take_pools_from_a_config_file_and_check_them_together():
    pools = [
        {"name": "llama", "base-model": "base-llama", "max-rank": 16, "workers": ["http://a"]},
        {"name": "qwen", "base-model": "base-qwen", "workers": ["http://b"]},
    ]
    s = _settings(file={"pool": pools}, file_name="r.yaml")
    assert [p.name for p in s.pool] == ["llama", "qwen"] and s.worker == ()
    twice = [pools[0], {**pools[1], "workers": ["http://a"]}]
    with pytest.raises(SettingError, match="worker http://a is in pools llama and qwen"):
        _settings(file={"pool": twice}, file_name="r.yaml")
    with pytest.raises(SettingError, match="pool name 'llama' is taken"):
        _settings(file={"pool": [pools[0], {**pools[1], "name": "llama"}]}, file_name="r.yaml")
    dedicated = [{**pools[0], "tenants": ["acme"]}]
    with pytest.raises(SettingError, match="needs --registry"):
        _settings(file={"pool": dedicated}, file_name="r.yaml")
    with pytest.raises(SettingError, match="--worker or --pool is required"):
        _settings()
    with pytest.raises(SettingError, match="is in a --pool too"):
        _settings(file={"pool": pools}, file_name="r.yaml", flags={"worker": ["http://a/"]})


def test_the_router_command_prints_its_pools_as_a_config_it_reads_back(tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {"pool": [{"name": "llama", "base-model": "base-llama", "workers": ["http://a"]}]}
        )
    )
    run = [sys.executable, "-m", "loraplex.cli", "router", "--config", str(config)]
    printed = subprocess.run([*run, "--print-config"], capture_output=True, text=True, check=True)
    again = tmp_path / "again.yaml"
    again.write_text(printed.stdout)
    assert yaml.safe_load(printed.stdout)["pool"] == [
        {"name": "llama", "base-model": "base-llama", "workers": ["http://a"]}
    ]
    reread = subprocess.run(
        [*run[:-1], str(again), "--print-config"], capture_output=True, text=True, check=True
    )
    assert reread.stdout == printed.stdout
    bad = subprocess.run([*run, "--pool", "name=x,max-rank=y"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "--pool: pool x: max-rank 'y' is not an integer" in bad.stderr


def test_a_worker_that_reports_another_base_or_a_lower_rank_does_not_stand_in_its_pool():
    assert misconfigured(LLAMA, Reported("base-llama", "sha256:1", 16)) is None
    assert misconfigured(LLAMA, Reported("base-llama", "sha256:1", 64)) is None
    assert "serves base model base-qwen" in misconfigured(LLAMA, Reported("base-qwen", None, 16))
    assert "max LoRA rank 8" in misconfigured(LLAMA, Reported("base-llama", None, 8))
    pinned = PoolSpec("p", base_model_digest="sha256:1")
    assert "digest sha256:2" in misconfigured(pinned, Reported("x", "sha256:2", 8))
    assert misconfigured(LLAMA, Reported()) is None  # a vLLM server says nothing to check


def test_a_request_goes_only_where_its_base_and_rank_are_served():
    reported = Reported("base-llama", "sha256:llama", 16)
    assert serves(LLAMA, reported, Need(base_model="base-llama"))
    assert not serves(LLAMA, reported, Need(base_model="base-qwen"))
    assert serves(LLAMA, reported, Need(base_digests=frozenset({"sha256:llama"}), rank=16))
    assert not serves(LLAMA, reported, Need(base_digests=frozenset({"sha256:qwen"}), rank=8))
    assert not serves(LLAMA, Reported("base-llama", "sha256:llama", 64), Need(rank=32))
    # what the worker does not report, its pool's declaration stands for
    assert not serves(LLAMA, Reported(), Need(base_model="base-qwen"))
    assert serves(PoolSpec("any"), Reported(), Need(base_model="base-qwen", rank=64))


def test_a_tenant_tries_its_dedicated_pools_then_the_shared_ones():
    gold = PoolSpec("gold", tenants=("acme",))
    shared = PoolSpec("shared")
    assert tiers([gold, shared], "acme") == ([gold], [shared])
    assert tiers([gold, shared], "beta") == ([], [shared])
    assert tiers([gold, shared], None) == ([], [shared])


def test_the_catalog_names_an_adapters_base_only_to_a_tenant_that_may_use_it():
    def facts(revision, digest, rank, serving, shared=True, allowed=()):
        return RevisionFacts("ad", revision, "llama", digest, rank, shared, allowed, serving)

    rows = [facts("r1", "sha256:l", 8, True), facts("r2", "sha256:l", 16, False)]
    counts = iter(range(100))
    catalog = AdapterCatalog(lambda: next(counts), lambda: rows, refresh_s=0)
    need = catalog.need("ad", None)
    assert need.base_digests == {"sha256:l"} and need.rank == 8
    assert "llama (the base of ad@r1)" == need.label
    assert catalog.need("ad@r2", None).rank == 16
    assert catalog.need("zz", None) == Need()
    rows[:] = [facts("r1", "sha256:l", 8, True, shared=False, allowed=("acme",))]
    assert catalog.need("ad", "acme").rank == 8
    assert catalog.need("ad", "beta") == Need()  # another tenant's: its worker's 404 answers
