"""The cache inside the real engine: remote store over real HTTP, corrupted artifacts, the seed
scenario."""

import shutil

import pytest
from ports import held

from loraplex.artifacts import ArtifactStore, digest_and_pieces, serve_store
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.residency.errors import AdapterUnavailable
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import LRUPolicy, ScorePolicy

GREEDY = SamplingParams(max_tokens=2, temperature=0)


def run_one(engine, ref):
    """One request to completion; its reported tier and error."""
    engine.add_request([3, 4, 5], GREEDY, ref)
    tier, error, tokens = None, None, []
    while engine.has_work():
        for out in engine.step():
            tokens += out.token_ids
            error = out.error or error
            tier = out.cache_tier
    return tier, error, tokens


@pytest.fixture()
def remote(llama_adapters, tmp_path):
    store = ArtifactStore(tmp_path / "remote")
    digests = {name: store.put(path) for name, path in llama_adapters.items()}
    return store, digests


def make_engine(llama_dir, tmp_path, allowed, policy=None, max_loras=2, disk_bytes=10 * 2**20):
    return LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            max_loras=max_loras,
            max_lora_rank=16,
            kv_cache_memory_bytes=2**20,
            disk_cache_dir=tmp_path / "disk",
            disk_cache_bytes=disk_bytes,
            allowed_roots=(allowed,),
        ),
        policy=policy,
    )


def remote_ref(engine, base, name, digest, pieces=None):
    key = AdapterKey(engine.base_model_digest, name, "1", digest)
    return AdapterRef(key, storage_uri=f"{base}/{digest.removeprefix('sha256:')}", pieces=pieces)


def test_remote_store_down_fails_cold_adapters_while_resident_ones_serve(
    llama_dir, remote, tmp_path
):
    store, digests = remote
    with serve_store(store) as base:
        engine = make_engine(llama_dir, tmp_path, base)
        warm = remote_ref(engine, base, "warm", digests["attn-r8"])
        cold = remote_ref(engine, base, "cold", digests["mlp-r4"])
        tier, error, tokens = run_one(engine, warm)
        assert (tier, error, len(tokens)) == ("remote", None, 2)
        assert run_one(engine, warm)[0] == "gpu"
    port = int(base.rsplit(":", 1)[1])
    with held(port):  # the store is stopped now
        tier, error, tokens = run_one(engine, cold)
        assert tier == "remote" and isinstance(error, AdapterUnavailable) and tokens == []
        assert run_one(engine, warm)[:2] == ("gpu", None)
        assert engine.adapters.backend.slots.count(None) == 1  # the failed load took nothing
        with serve_store(store, port=port):
            # The same key is tried again on the next request and recovers.
            assert run_one(engine, cold)[1:] == (None, run_one(engine, cold)[2])
    engine.close()


# checked by the digest alone, or by the registry's pieces
@pytest.mark.parametrize("by_pieces", [False, True])
def test_corrupted_remote_artifact_is_refused_and_disturbs_nothing(
    llama_dir, remote, tmp_path, by_pieces
):
    store, digests = remote
    pieces = {
        d: digest_and_pieces(store.path(d))[1] if by_pieces else None for d in digests.values()
    }
    path = store.path(digests["all-r16-rslora"]) / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    path.write_bytes(bytes(data))
    with serve_store(store) as base:
        engine = make_engine(llama_dir, tmp_path, base)
        good = remote_ref(engine, base, "good", digests["attn-r8"], pieces[digests["attn-r8"]])
        bad = remote_ref(
            engine, base, "bad", digests["all-r16-rslora"], pieces[digests["all-r16-rslora"]]
        )
        assert run_one(engine, good)[1] is None
        slots, cpu = list(engine.adapters.backend.slots), set(engine.adapters.backend.cpu)
        _, error, tokens = run_one(engine, bad)
        assert "digest" in str(error).lower() and tokens == []
        assert (list(engine.adapters.backend.slots), set(engine.adapters.backend.cpu)) == (
            slots,
            cpu,
        )
        assert not engine.adapters.disk.has(digests["all-r16-rslora"])
        assert run_one(engine, good)[:2] == ("gpu", None)
        engine.close()


def test_disk_budget_filled_evicts_instead_of_failing(llama_dir, remote, tmp_path):
    store, digests = remote
    with serve_store(store) as base:
        one = store.size(digests["attn-r8"])
        engine = make_engine(llama_dir, tmp_path, base, disk_bytes=int(one * 1.5), max_loras=1)
        for name, digest in digests.items():
            assert run_one(engine, remote_ref(engine, base, name, digest))[1] is None
        assert (
            engine.adapters.disk.used_bytes() <= int(one * 1.5)
            or len(engine.adapters.disk.store.digests()) == 1
        )
        engine.close()


def seed_scenario(engine, refs_hot, refs_cold):
    """4 hot adapters with steady traffic, then a burst sweeping cold adapters once each."""
    for _ in range(3):
        for ref in refs_hot:
            run_one(engine, ref)
    tiers = []
    for i, cold in enumerate(refs_cold):
        run_one(engine, cold)
        tiers.append(run_one(engine, refs_hot[i % len(refs_hot)])[0])
        tiers.append(run_one(engine, refs_hot[(i + 2) % len(refs_hot)])[0])
    return tiers


def test_seed_scenario_score_keeps_hot_adapters_resident_and_lru_does_not(
    llama_dir, llama_adapters, tmp_path
):
    results = {}
    for policy in (ScorePolicy(min_residency_s=0.0), LRUPolicy()):
        engine = make_engine(
            llama_dir, tmp_path / policy.name, str(tmp_path), policy=policy, max_loras=4
        )
        paths = list(llama_adapters.values())
        hot = [engine.adapter_ref(f"hot{i}", paths[i % len(paths)]) for i in range(4)]
        cold = [engine.adapter_ref(f"cold{i}", paths[i % len(paths)]) for i in range(20)]
        tiers = seed_scenario(engine, hot, cold)
        results[policy.name] = tiers.count("gpu") / len(tiers)
        engine.close()
    assert results["score"] >= 0.9, results
    assert results["lru"] <= 0.5, results


def test_downloads_share_one_http_client_closed_with_the_engine(
    llama_dir, remote, tmp_path, monkeypatch
):
    import httpx

    made = []

    class Counted(httpx.Client):
        # a new client loads the CA bundle: ~50 ms of CPU with the GIL held
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(httpx, "Client", Counted)
    store, digests = remote
    with serve_store(store) as base:
        engine = make_engine(llama_dir, tmp_path, base, max_loras=1)
        for name, digest in digests.items():
            assert run_one(engine, remote_ref(engine, base, name, digest))[:2] == ("remote", None)
        assert len(digests) >= 3 and len(made) == 1
        engine.close()
    assert made[0].is_closed


def test_the_engine_keeps_what_lives_as_long_as_it_out_of_the_collectors_view(llama_dir, tmp_path):
    import gc

    engine = make_engine(llama_dir, tmp_path, str(tmp_path))
    # the model and the libraries: a full collection skips them
    assert gc.get_freeze_count() > 10_000
    engine.close()
    assert gc.get_freeze_count() == 0


ENGINE = dict(dtype="float32", max_loras=2, kv_cache_memory_bytes=2 * 2**20, max_lora_rank=16)


def _engine(llama_dir, **kw):
    return LLMEngine(EngineConfig(model_dir=llama_dir, **{**ENGINE, **kw}))


def _run(engine):
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    return outputs


def test_a_failed_reload_does_not_fail_requests_its_slot_can_serve(
    llama_dir, llama_adapters, tmp_path
):
    """A sits in a slot with its host copy gone; an operator's cpu prewarm of A fails on a broken
    file. A request for A waiting at that step is served from the slot, not failed with the load."""
    engine = _engine(llama_dir, max_cpu_loras=1)
    a_dir = shutil.copytree(llama_adapters["attn-r8"], tmp_path / "a")
    a, b = engine.adapter_ref("a", a_dir), engine.adapter_ref("b", llama_adapters["mlp-r4"])
    two = SamplingParams(max_tokens=2, temperature=0)
    engine.generate([[3, 4, 5]], two, [a])
    engine.generate([[3, 4, 5]], two, [b])
    cache = engine.adapters
    assert a.key in cache.backend.slots and a.key not in cache.backend.cpu  # one host copy: b's
    (a_dir / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    cache.prewarm(a, "cpu")
    assert isinstance(cache.loading[a.key].exception(), Exception)  # failed, not yet taken in
    engine.add_request([3, 4, 5], two, a, "r1")
    outputs = _run(engine)
    assert [(o.request_id, o.error) for o in outputs if o.finished] == [("r1", None)]
    assert next(o for o in outputs if o.finished).num_output_tokens == 2


def test_a_step_that_raises_still_answers_the_requests_its_failed_loads_ended(
    llama_dir, llama_adapters, tmp_path
):
    """The step took the failed load's requests off the books, then the forward pass raised:
    fail_all (what the async loop calls) must answer them too, or their clients wait forever."""
    engine = _engine(llama_dir)
    bad_dir = shutil.copytree(llama_adapters["attn-r8"], tmp_path / "bad")
    bad = engine.adapter_ref("bad", bad_dir, digest="sha256:" + "1" * 64)
    engine.add_request(
        [3, 4, 5], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), None, "base"
    )
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=2, temperature=0), bad, "cold")
    engine.step()  # admits base, starts bad's load
    engine.adapters.loading[bad.key].exception()

    def broken(*args, **kwargs):
        raise RuntimeError("device error (simulated)")

    engine.runner.run = broken
    with pytest.raises(RuntimeError):
        engine.step()
    answered = {
        o.request_id: type(o.error).__name__ for o in engine.fail_all(RuntimeError("step failed"))
    }
    assert answered == {"cold": "ArtifactCorrupt", "base": "RuntimeError"}


def hot_set_under_cold_burst(engine, hot, cold, clients=4, dt=0.05):
    """The hot set with room to spare: each hot adapter has a request every second (open-loop,
    staggered) on a clock that moves `dt` per step; after 10 s, `clients` clients sweep the cold
    adapters, each sending its next one when the last ends. Each step waits for the loads under way,
    so what happens depends on placement's decisions, not on how fast this machine loads. The tiers
    the hot requests found during the sweep, and how long each cold request waited for its first
    token."""
    now = [1000.0]
    engine.adapters.clock = lambda: now[0]
    hot_params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    cold_params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sent, queue, running, step = {}, list(cold), 0, 0
    hot_tiers, cold_waits = [], []

    def send(ref, params, kind):
        rid = f"{kind}-{len(sent)}"
        sent[rid] = (kind, now[0], [])
        engine.add_request([3, 4, 5, 6], params, ref, rid)

    while queue or running or step * dt < 10:
        for i, ref in enumerate(hot):
            if step % 20 == i * 5:
                send(ref, hot_params, "hot")
        if step * dt >= 10:
            while running < clients and queue:
                send(queue.pop(0), cold_params, "cold")
                running += 1
        for load in list(engine.adapters.loading.values()):
            load.exception()  # landed before the step: a load takes no time on this clock
        for out in engine.step():
            kind, sent_at, seen = sent[out.request_id]
            if not seen:
                seen.append(out)
                if kind == "cold":
                    cold_waits.append(now[0] - sent_at)
                elif step * dt >= 10:
                    hot_tiers.append(out.cache_tier)
            if out.finished and kind == "cold":
                running -= 1
        step += 1
        now[0] += dt
    return hot_tiers, cold_waits


def test_the_hot_set_survives_a_cold_burst_when_slots_are_to_spare(llama_dir, llama_adapters):
    """4 hot adapters on 6 slots (host memory for 6), 20 cold adapters swept by 4 clients: under
    `score` the cold requests take turns in the 2 spare slots and the hot requests find their
    adapters in a slot; under `lru` the cold requests push the idle hot adapters out."""
    paths = list(llama_adapters.values())
    found, waits = {}, {}
    for policy in (ScorePolicy(), LRUPolicy()):
        config = dict(max_loras=6, max_cpu_loras=6, kv_cache_memory_bytes=4 * 2**20)
        engine = LLMEngine(EngineConfig(model_dir=llama_dir, **{**ENGINE, **config}), policy=policy)
        hot = [engine.adapter_ref(f"hot{i}", paths[i % len(paths)]) for i in range(4)]
        cold = [engine.adapter_ref(f"cold{i}", paths[i % len(paths)]) for i in range(20)]
        tiers, cold_waits = hot_set_under_cold_burst(engine, hot, cold)
        engine.close()
        assert len(cold_waits) == 20 and len(tiers) >= 10
        found[policy.name] = tiers.count("gpu") / len(tiers)
        waits[policy.name] = max(cold_waits)
    assert found["score"] >= 0.95, found
    assert found["lru"] < 0.8, found
    # a cold request waits for a spare slot at most the policy's bound, plus a request's length
    assert waits["score"] <= ScorePolicy().spare_slot_wait_s + 0.5, waits
