"""The vLLM engine's staged copies (what vLLM reads): a kept copy is used again without a copy from
the source, hashed again unless its fingerprint shows it unchanged since it was verified, and staged
again when its bytes differ. No vLLM here: staging runs before anything reaches it."""

from __future__ import annotations

import json
import os
import time

import pytest
from tinymodels import make_adapter

from loraplex.artifacts import canonical_digest
from loraplex.engines.vllm import staging as staging_module
from loraplex.engines.vllm.slots import EngineRuntime, vllm_residency
from loraplex.residency import fetch as fetch_module
from loraplex.residency.key import AdapterKey, AdapterRef

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def staging(llama_dir, tmp_path, monkeypatch):
    source = make_adapter(llama_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"])
    digest = canonical_digest(source)
    ref = AdapterRef(AdapterKey("sha256:" + "0" * 64, "a", "1", digest), path=source)
    hashed = []  # the directories whose bytes were read and hashed

    def read_artifact(directory, *args, **kwargs):
        hashed.append(os.fspath(directory))
        return real(directory, *args, **kwargs)

    real = staging_module.read_artifact
    # the staged copy's check (staging) and the source's read (the residency's fetch)
    monkeypatch.setattr(staging_module, "read_artifact", read_artifact)
    monkeypatch.setattr(fetch_module, "read_artifact", read_artifact)
    adapters = vllm_residency(EngineRuntime(None, tmp_path / "stage"), max_loras=2, max_cpu_loras=2)
    yield adapters, ref, hashed
    adapters.close()


def test_a_kept_staged_copy_is_used_again_without_a_copy_or_a_hash_while_unchanged(staging):
    adapters, ref, hashed = staging
    nbytes, _, shape = adapters.backend.staging.stage(ref)
    staged = adapters.backend.staging.path(ref.key) / WEIGHTS
    inode = staged.stat().st_ino
    for _ in range(3):  # the kept copy: the same size and shape
        assert adapters.backend.staging.stage(ref)[::2] == (nbytes, shape)
    assert hashed == [os.fspath(ref.path)]  # the source only: the copy is as it was written
    assert adapters.backend.staging.is_unchanged(ref.key)
    assert staged.stat().st_ino == inode
    assert staged.stat().st_mode & 0o222 == 0  # read-only
    assert adapters.backend.staging.stage_dir.stat().st_mode & 0o077 == 0  # private


def _tamper(staged):
    """Other bytes of the same size, the file's mtime put back: only its ctime tells."""
    before = staged.stat()
    data = bytearray(staged.read_bytes())
    data[-32:] = bytes(b ^ 0xFF for b in data[-32:])
    staged.chmod(0o644)
    staged.write_bytes(bytes(data))
    staged.chmod(0o444)
    os.utime(staged, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = staged.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )


def test_a_staged_copy_changed_on_disk_after_it_was_verified_is_hashed_and_refused(staging):
    adapters, ref, hashed = staging
    adapters.backend.staging.stage(ref)
    adapters.backend.staging.stage(ref)  # trusted: not hashed
    staged = adapters.backend.staging.path(ref.key) / WEIGHTS
    time.sleep(0.05)  # past a coarse file-system clock's tick: the write below gets a later ctime
    _tamper(staged)
    assert not adapters.backend.staging.is_unchanged(
        ref.key
    )  # the re-add after an unpin refuses it
    adapters.backend.staging.stage(ref)
    assert staged.read_bytes() == (ref.path / WEIGHTS).read_bytes()  # staged again
    # the copy hashed (its fingerprint changed), refused, and staged again from the source
    assert hashed == [os.fspath(ref.path), os.fspath(staged.parent), os.fspath(ref.path)]
    assert adapters.backend.staging.is_unchanged(ref.key)


def test_a_staged_copy_that_changed_while_it_was_hashed_is_not_trusted(staging):
    adapters, ref, hashed = staging
    adapters.backend.staging.stage(ref)
    target = adapters.backend.staging.path(ref.key)
    real = staging_module.read_artifact

    def read_then_change(directory, *args, **kwargs):
        files = real(directory, *args, **kwargs)
        (target / "extra.txt").write_text("x")  # an entry added while the copy was hashed
        return files

    staging_module.read_artifact = read_then_change
    try:
        assert adapters.backend.staging.verify(target, ref.key.adapter_digest) is None
    finally:
        staging_module.read_artifact = real


def test_copies_left_by_an_earlier_process_are_bounded_by_the_budget(llama_dir, tmp_path):
    source = make_adapter(llama_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"])
    stage = tmp_path / "stage"
    old, new = stage / ("1" * 64), stage / ("2" * 64)
    for copy in (old, new):
        copy.mkdir(parents=True)
        (copy / WEIGHTS).write_bytes((source / WEIGHTS).read_bytes())
    os.utime(old, ns=(0, 0))  # the older of the two
    (stage / ".work").mkdir()  # an unfinished staging
    size = (source / WEIGHTS).stat().st_size
    adapters = vllm_residency(
        EngineRuntime(None, stage, kept_bytes=size), max_loras=2, max_cpu_loras=2
    )
    adapters.close()
    assert sorted(p.name for p in stage.iterdir() if not p.name.startswith(".removed")) == [
        new.name
    ]


def test_the_shape_vllm_checks_is_the_config_and_the_tensor_layout_not_the_values(
    llama_dir, tmp_path
):
    pytest.importorskip("vllm.lora.peft_helper")  # which config fields vLLM reads

    def shape(name, seed, **lora):
        made = make_adapter(llama_dir, tmp_path / name, seed=seed, **lora)
        return staging_module.vllm_shape({p.name: p.read_bytes() for p in made.iterdir()})

    qv = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    first = shape("a", 1, **qv)
    assert first is not None and shape("b", 2, **qv) == first  # other weights, same shape
    assert shape("c", 1, **{**qv, "r": 8}) != first  # a rank over the limit is refused by vLLM
    assert shape("d", 1, **{**qv, "target_modules": ["q_proj", "k_proj"]}) != first
    assert shape("e", 1, **{**qv, "lora_alpha": 16}) != first
    renamed = tmp_path / "a" / "adapter_config.json"
    config = json.loads(renamed.read_text())
    renamed.chmod(0o644)
    renamed.write_text(json.dumps({**config, "revision": "v2", "base_model_name_or_path": "x"}))
    files = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
    assert staging_module.vllm_shape(files) == first  # fields vLLM does not read
    assert staging_module.vllm_shape({"adapter_config.json": b"{}"}) is None  # no weights
    assert staging_module.vllm_shape({"adapter_config.json": b"{", WEIGHTS: b"x" * 8}) is None
