"""Fixtures: real PEFT adapters on the tiny Llama (tests/tinymodels.py), registries on SQLite files
and on the throwaway PostgreSQL cluster of tests/conftest.py when the machine has one."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinymodels import make_adapter, make_model

from loraplex.artifacts import ArtifactStore
from loraplex.registry import Registry
from loraplex.registry.catalog import Catalog

ATTN = ["q_proj", "v_proj"]


@pytest.fixture(scope="session")
def adapter_factory(llama_dir, tmp_path_factory):
    """make(key, **lora_args) -> directory of a real PEFT adapter on `llama_dir`, built once per
    key."""
    root = tmp_path_factory.mktemp("registry-adapters")
    made: dict[str, Path] = {}

    def make(key: str, base: Path | None = None, seed: int = 0, **lora_args) -> Path:
        if key not in made:
            lora_args.setdefault("r", 4)
            lora_args.setdefault("lora_alpha", 8)
            lora_args.setdefault("target_modules", ATTN)
            made[key] = make_adapter(base or llama_dir, root / key, seed=seed, **lora_args)
        return made[key]

    return make


@pytest.fixture(scope="session")
def adapter_v1(adapter_factory):
    return adapter_factory("v1", seed=1)


@pytest.fixture(scope="session")
def adapter_v2(adapter_factory):
    return adapter_factory("v2", seed=2)


@pytest.fixture(scope="session")
def adapter_v3(adapter_factory):
    return adapter_factory("v3", seed=3, r=8, target_modules=["q_proj", "k_proj", "down_proj"])


@pytest.fixture(scope="session")
def other_base_dir(tmp_path_factory):
    """Same shapes as the tiny Llama, another name: adapters made on it belong to another base
    model."""
    return make_model(tmp_path_factory.mktemp("other-base"), "llama")


@pytest.fixture(scope="session")
def wide_base_dir(tmp_path_factory):
    """Hidden size 32: adapters made on it do not fit the tiny Llama's shapes."""
    return make_model(
        tmp_path_factory.mktemp("wide"), "llama", hidden_size=32, intermediate_size=64
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty database: a SQLite file, and (second run) a PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/registry.db"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path}/registry.db"


@pytest.fixture
def make_registry(tmp_path, llama_dir):
    """make(url, **kwargs) -> an initialized Registry with a store in tmp_path; closed at the
    end."""
    opened: list[Registry] = []

    def make(url: str, **kwargs) -> Registry:
        kwargs.setdefault("store", ArtifactStore(tmp_path / "store"))
        kwargs.setdefault("base_model_dir", llama_dir)
        registry = Registry(url, **kwargs)
        registry.init()
        opened.append(registry)
        return registry

    yield make
    for registry in opened:
        registry.close()


@pytest.fixture
def registry(make_registry, db_url):
    return make_registry(db_url)


@pytest.fixture
def sqlite_registry(make_registry, sqlite_url):
    return make_registry(sqlite_url)


@pytest.fixture
def resolve():
    """resolve(registry, tenant, model, user=None): the answer of a catalog of `registry` with every
    commit made so far applied, as a server's catalog gives it."""
    catalogs: dict[Registry, Catalog] = {}

    def resolve(registry: Registry, tenant: str, model: str, user: str | None = None):
        if registry not in catalogs:
            catalogs[registry] = Catalog(registry)
        catalog = catalogs[registry]
        catalog.refresh()
        return catalog.resolve(tenant, model, user)

    return resolve
