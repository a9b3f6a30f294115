"""Property tests over random traces: real slot pool, real adapter files, real digests."""

import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.artifacts import canonical_digest, read_artifact
from loraplex.engines.native.lora import LoRASlotPool, pack_adapter
from loraplex.engines.native.slots import native_residency
from loraplex.lora_format import WEIGHTS_FILE, adapter_from_files
from loraplex.model_config import ModelConfig
from loraplex.residency.errors import AdapterInFlight, CapacityExceeded
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import LRUPolicy, ScorePolicy

NUM_SLOTS = 3


@pytest.fixture(scope="module")
def setup(llama_dir, llama_adapters, tmp_path_factory):
    cfg = ModelConfig.from_dir(llama_dir)

    def pack(files, hashed):
        return pack_adapter(
            adapter_from_files(files, cfg, 16),
            files[WEIGHTS_FILE],
            torch.float32,
            hashed=lambda end: hashed(WEIGHTS_FILE, end),
        )

    def read(ref):
        return read_artifact(ref.path, ref.key.adapter_digest, use=pack)

    refs = []
    for i in range(7):  # seven names over the fixture adapters; the last one's files are corrupted
        src = list(llama_adapters.values())[i % len(llama_adapters)]
        refs.append(
            AdapterRef(
                AdapterKey("base", f"a{i}", "1", canonical_digest(src)), src, tenant=f"t{i % 2}"
            )
        )
    bad_dir = tmp_path_factory.mktemp("bad") / "a"
    shutil.copytree(llama_adapters["attn-r8"], bad_dir)
    data = bytearray((bad_dir / "adapter_model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one flipped byte
    (bad_dir / "adapter_model.safetensors").write_bytes(bytes(data))
    refs.append(
        AdapterRef(
            AdapterKey("base", "bad", "1", canonical_digest(llama_adapters["attn-r8"])), bad_dir
        )
    )
    scratch = LoRASlotPool(cfg, 1, 16, torch.float32, "cpu")
    expected = {}
    for ref in refs[:-1]:
        scratch.set_slot(0, read(ref))
        expected[ref.key] = scratch.buffer[0].clone()
    packed_bytes = max(read(r).nbytes for r in refs[:-1])
    return cfg, pack, refs, expected, packed_bytes


OPS = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "release", "pin_gpu", "pin_cpu", "unpin", "evict", "prewarm"]),
        st.integers(0, 7),
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS, use_score=st.booleans())
def test_cache_invariants_hold_over_random_traces(setup, ops, use_score):
    cfg, pack, refs, expected, packed_bytes = setup
    now = [0.0]
    pool = LoRASlotPool(cfg, NUM_SLOTS, 16, torch.float32, "cpu")
    cache = native_residency(
        pool,
        pack,
        cpu_bytes=4 * packed_bytes,
        max_cpu_loras=4,
        policy=ScorePolicy(min_residency_s=0.5) if use_score else LRUPolicy(),
        clock=lambda: now[0],
    )
    held: list[AdapterRef] = []
    try:
        for op, i in ops:
            now[0] += 0.25
            ref = refs[i]
            before = (list(cache.backend.slots), set(cache.backend.cpu))
            pinned_gpu = {
                k for k in cache.backend.slots if k is not None and cache.entries[k].pinned == "gpu"
            }
            if op == "acquire":
                cache.record_request(ref)
                slot = cache.acquire(ref)
                failures = cache.backend.drain()
                if slot is None and not failures:
                    slot = cache.acquire(ref)
                if ref is refs[-1]:
                    # A corrupted artifact is refused on its digest and disturbs nothing.
                    assert slot is None and failures and "digest mismatch" in str(failures[0][1])
                    assert (list(cache.backend.slots), set(cache.backend.cpu)) == before
                elif slot is not None:
                    held.append(ref)
            elif op == "release" and held:
                cache.release(held.pop(i % len(held)).key)
            elif op in ("pin_gpu", "pin_cpu") and ref is not refs[-1]:
                try:
                    cache.pin(ref, op[4:])
                except CapacityExceeded:
                    pass
                cache.backend.drain()
            elif op == "unpin":
                cache.unpin(ref.key)
            elif op == "evict":
                entry = cache.entries.get(ref.key)
                if entry is not None and entry.refcount:
                    with pytest.raises(AdapterInFlight):
                        cache.evict(ref.key)
                else:
                    cache.evict(ref.key)
            elif op == "prewarm" and ref is not refs[-1]:
                cache.prewarm(ref, "gpu" if i % 2 else "cpu")
                cache.backend.drain()
            _check(cache, pool, held, expected, packed_bytes)
            if op not in ("unpin", "evict"):
                assert pinned_gpu <= set(cache.backend.slots), "a pinned adapter left its slot"
        for ref in held:
            cache.release(ref.key)
        assert all(e.refcount == 0 for e in cache.entries.values())
    finally:
        cache.close()


def _check(cache, pool, held, expected, packed_bytes):
    # In flight: every held adapter is still in its slot.
    for ref in held:
        assert ref.key in cache.backend.slots
    # Capacities.
    assert sum(1 for k in cache.backend.slots if k is not None) <= NUM_SLOTS
    assert len(cache.backend.cpu) <= 4
    assert sum(p.nbytes for p in cache.backend.cpu.values()) <= 4 * packed_bytes
    assert cache.tiers.cpu_bytes_used == sum(p.nbytes for p in cache.backend.cpu.values())
    # Every slot holds exactly the bytes of the full key it is filed under.
    for slot, key in enumerate(cache.backend.slots):
        if key is None:
            assert not pool.buffer[slot].any()
        else:
            assert torch.equal(pool.buffer[slot], expected[key])
    for key, entry in cache.entries.items():
        assert entry.refcount == sum(1 for r in held if r.key == key)


def test_pinned_gpu_adapters_survive_pressure(setup):
    cfg, pack, refs, _, packed_bytes = setup
    pool = LoRASlotPool(cfg, NUM_SLOTS, 16, torch.float32, "cpu")
    cache = native_residency(pool, pack, cpu_bytes=10 * packed_bytes, policy=LRUPolicy())
    cache.pin(refs[0], "gpu")
    cache.backend.drain()
    assert refs[0].key in cache.backend.slots
    for ref in refs[1:7] * 2:
        slot = cache.acquire(ref)
        cache.backend.drain()
        slot = slot if slot is not None else cache.acquire(ref)
        cache.release(ref.key)
        assert refs[0].key in cache.backend.slots
    cache.pin(refs[1], "gpu")
    with pytest.raises(CapacityExceeded, match="one must stay free"):
        cache.pin(refs[2], "gpu")
    cache.close()


def test_reload_after_eviction_counts_thrash(setup):
    cfg, pack, refs, _, packed_bytes = setup
    pool = LoRASlotPool(cfg, 1, 16, torch.float32, "cpu")
    cache = native_residency(pool, pack, cpu_bytes=10 * packed_bytes, policy=LRUPolicy())
    for ref in [refs[0], refs[1], refs[0], refs[1]]:
        if cache.acquire(ref) is None:
            cache.backend.drain()
            assert cache.acquire(ref) is not None
        cache.release(ref.key)
    assert cache.ledger.num_evictions == 3 and cache.ledger.reloads_after_eviction == 2
    assert cache.ledger.thrash_ratio() == pytest.approx(2 / 3)
    cache.close()
