"""Engine behaviour: refusals, memory pressure, sampling options, streaming and abort."""

import asyncio
import dataclasses
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinymodels import peft_reference, reference_greedy

from loraplex.artifacts import canonical_digest
from loraplex.engines.native.async_engine import AsyncEngine
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import InvalidRequest, SamplingParams
from loraplex.lora_format import AdapterRejected
from loraplex.residency.key import AdapterRef


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            max_loras=2,
            kv_cache_memory_bytes=2 * 2**20,
            max_lora_rank=16,
        )
    )
    yield eng
    eng.close()


def _copy(src, dst, edit_config=None, edit_tensors=None):
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        edit_config(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(dst / "adapter_model.safetensors")
        save_file(edit_tensors(tensors), dst / "adapter_model.safetensors")
    return dst


def _rename_first(tensors, old, new):
    key = next(k for k in tensors if old in k)
    tensors[key.replace(old, new)] = tensors.pop(key)
    return tensors


REFUSALS = {
    "dora": (dict(edit_config=lambda c: c.update(use_dora=True)), "use_dora"),
    "bias": (dict(edit_config=lambda c: c.update(bias="all")), "bias"),
    "modules_to_save": (
        dict(edit_config=lambda c: c.update(modules_to_save=["lm_head"])),
        "modules_to_save",
    ),
    "lm_head": (
        dict(edit_tensors=lambda t: _rename_first(t, "self_attn.q_proj", "lm_head")),
        "lm_head",
    ),
    "embedding": (
        dict(edit_tensors=lambda t: _rename_first(t, "layers.0.self_attn.q_proj", "embed_tokens")),
        "not a LoRA tensor of embed_tokens",  # PEFT names an embedding's LoRA lora_embedding_A
    ),
    "shape": (
        dict(
            edit_tensors=lambda t: {
                k: (v[:, :-1].contiguous() if "lora_A" in k else v) for k, v in t.items()
            }
        ),
        "do not fit",
    ),
    "missing-layer": (
        dict(edit_tensors=lambda t: _rename_first(t, "layers.0.", "layers.9.")),
        "layer 9",
    ),
}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_refused_adapter_kinds_get_their_error_and_serving_goes_on(
    kind, engine, llama_adapters, tmp_path
):
    edits, expected = REFUSALS[kind]
    bad = _copy(llama_adapters["attn-r8"], tmp_path / kind, **edits)
    with pytest.raises(AdapterRejected, match=expected):
        engine.adapter_ref("bad", bad)
    good = engine.adapter_ref("good", llama_adapters["mlp-r4"])
    assert (
        len(engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0), [good])[0])
        == 4
    )


def test_pickle_weights_are_refused_with_the_reason(engine, llama_adapters, tmp_path):
    bad = _copy(llama_adapters["attn-r8"], tmp_path / "pickled")
    torch.save(load_file(bad / "adapter_model.safetensors"), bad / "adapter_model.bin")
    (bad / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterRejected, match="pickle"):
        engine.adapter_ref("bad", bad)


def test_rank_above_max_lora_rank_is_refused(llama_dir, llama_adapters):
    eng = LLMEngine(
        EngineConfig(
            model_dir=llama_dir, dtype="float32", max_lora_rank=8, kv_cache_memory_bytes=2**20
        )
    )
    with pytest.raises(AdapterRejected, match="max_lora_rank 8"):
        eng.adapter_ref("big", llama_adapters["all-r16-rslora"])
    eng.close()


def _serve_side_by_side(engine, *refs, max_tokens):
    """Run one request per adapter ref together until done: (tokens, error) per request, in
    order."""
    ids = [
        engine.add_request([7, 8, 9], SamplingParams(max_tokens=max_tokens, temperature=0), r)
        for r in refs
    ]
    tokens, errors = {i: [] for i in ids}, {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.error:
                errors[out.request_id] = out.error
    return [(tokens[i], errors.get(i)) for i in ids]


def test_a_file_broken_after_validation_fails_only_its_requests(engine, llama_adapters, tmp_path):
    bad_dir = _copy(llama_adapters["attn-r8"], tmp_path / "later-broken")
    bad = engine.adapter_ref("later-broken", bad_dir, digest="sha256:" + "1" * 64)
    (bad_dir / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    good = engine.adapter_ref("good2", llama_adapters["mlp-r4"])
    (ok, ok_error), (bad_tokens, bad_error) = _serve_side_by_side(engine, good, bad, max_tokens=5)
    assert len(ok) == 5 and ok_error is None
    assert "later-broken" in str(bad_error) and bad_tokens == []
    assert all(e.refcount == 0 for e in engine.adapters.entries.values())
    assert engine.adapters.backend.num_waiting == {}  # the failed requests left the queue too


@pytest.mark.parametrize("swap", ["garbage", "pickle"])
def test_bytes_that_match_their_digest_but_are_not_safetensors_are_refused(
    engine, llama_adapters, tmp_path, swap
):
    bad_dir = _copy(llama_adapters["attn-r8"], tmp_path / f"swapped-{swap}")
    valid = engine.adapter_ref(f"swapped-{swap}", bad_dir)  # validated while the files were good
    weights = bad_dir / "adapter_model.safetensors"
    if swap == "garbage":
        weights.write_bytes(b"\x05\0\0\0\0\0\0\0hello" + bytes(64))
    else:
        torch.save(load_file(weights), bad_dir / "adapter_model.bin")
        weights.unlink()
    # The key names the digest of the bytes now there: the digest check passes, the bytes check must
    # not.
    bad = AdapterRef(
        dataclasses.replace(valid.key, adapter_digest=canonical_digest(bad_dir)), bad_dir
    )
    good = engine.adapter_ref("good3", llama_adapters["mlp-r4"])
    (ok, ok_error), (bad_tokens, bad_error) = _serve_side_by_side(engine, good, bad, max_tokens=3)
    assert len(ok) == 3 and ok_error is None
    assert "not servable" in str(bad_error) and bad_tokens == []
    assert (
        bad.key not in engine.adapters.backend.cpu and bad.key not in engine.adapters.backend.slots
    )


def test_an_adapter_with_nan_weights_fails_only_its_own_requests(engine, llama_adapters, tmp_path):
    """NaN in an adapter's weights gives its sequences NaN logits: that request fails alone, with
    the reason, sampled or greedy, and the rest of the batch goes on."""
    nan_dir = _copy(
        llama_adapters["attn-r8"],
        tmp_path / "nan",
        edit_tensors=lambda t: {
            k: v.fill_(float("nan")) if "lora_B" in k else v for k, v in t.items()
        },
    )
    bad = engine.adapter_ref("nan", nan_dir)
    good = engine.adapter_ref("good-nan", llama_adapters["mlp-r4"])
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=4, temperature=temperature, seed=1, ignore_eos=True)
        ids = [engine.add_request([7, 8, 9], params, r) for r in (good, bad, None)]
        outs = _drain(engine)
        tokens = {i: sum((o.token_ids for o in outs if o.request_id == i), []) for i in ids}
        errors = {o.request_id: o.error for o in outs if o.error is not None}
        assert [len(tokens[i]) for i in ids] == [4, 0, 4] and list(errors) == [ids[1]], temperature
        assert "non-finite logits" in str(errors[ids[1]]) and "nan" in str(errors[ids[1]])
    assert all(e.refcount == 0 for e in engine.adapters.entries.values())


@pytest.mark.parametrize(
    "extreme", [{"temperature": 1e-300}, {"temperature": 1e-6}, {"top_p": 1e-320}]
)
def test_extreme_sampling_values_sample_instead_of_failing_the_batch(engine, extreme):
    """A temperature under 1e-5 is greedy, as in vLLM (dividing by 1e-300 would make NaN, and the
    error in the step would fail every request in the batch); a top_p that is 0 in float32 keeps
    the most likely token."""
    greedy = engine.generate(
        [[3, 4, 5]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )[0]
    other = engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    )
    odd = engine.add_request(
        [3, 4, 5],
        SamplingParams(max_tokens=6, ignore_eos=True, seed=1, **({"temperature": 1.0} | extreme)),
    )
    outs = _drain(engine)
    assert not [o.error for o in outs if o.error is not None]
    assert len(sum((o.token_ids for o in outs if o.request_id == other), [])) == 6
    assert sum((o.token_ids for o in outs if o.request_id == odd), []) == greedy


def test_score_raises_a_failed_load_instead_of_retrying_it(engine, llama_adapters, tmp_path):
    """score()'s sequences wait in no queue, so a failed load was dropped and started again, in a
    loop, for good."""
    bad = engine.adapter_ref(
        "score-bad",
        _copy(llama_adapters["attn-r8"], tmp_path / "score-bad"),
        digest="sha256:" + "2" * 64,
    )
    good = engine.adapter_ref("score-good", llama_adapters["mlp-r4"])
    loads = engine.adapters.entries.get(good.key)
    with pytest.raises(Exception, match="digest") as failed:
        engine.score([[1, 2, 3], [4, 5, 6]], [good, bad])
    assert "score-bad" in str(failed.value)
    # the good one's reference is back
    assert all(e.refcount == 0 for e in engine.adapters.entries.values())
    assert engine.adapters.entries[bad.key].loads == 0 and loads is None
    assert len(engine.score([[1, 2, 3]], [good])[0]) == 3  # and scoring goes on


def test_kv_pressure_preempts_and_recomputes_without_corrupting_others(llama_dir, llama_adapters):
    # 12 blocks of 4 tokens: 8 sequences of 20 tokens cannot all fit, so some must wait or be
    # preempted.
    cfg = EngineConfig(
        model_dir=llama_dir,
        dtype="float32",
        max_loras=2,
        block_size=4,
        max_model_len=48,
        kv_cache_memory_bytes=12 * 4 * 2 * 2 * 2 * 16 * 4,
    )
    eng = LLMEngine(cfg)
    assert eng.blocks.num_blocks == 12
    ref = eng.adapter_ref("attn-r8", llama_adapters["attn-r8"])
    prompts = [[10 + i, 11 + i, 12 + i, 13 + i, 14 + i] for i in range(8)]
    adapters = [ref if i % 2 else None for i in range(8)]
    out = eng.generate(prompts, SamplingParams(max_tokens=15, temperature=0), adapters)
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.num_free == 12
    # preempted requests queued again, and left the queue once readmitted
    assert eng.adapters.backend.num_waiting == {}
    model = peft_reference(llama_dir, {"attn-r8": llama_adapters["attn-r8"]})
    for prompt, adapter, tokens in zip(prompts, adapters, out):
        assert tokens == reference_greedy(model, prompt, "attn-r8" if adapter else None, 15)
    eng.close()


def test_invalid_requests_are_refused_with_the_field(engine):
    with pytest.raises(InvalidRequest) as err:
        engine.add_request([1] * 300, SamplingParams(max_tokens=10))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(top_p=0)
    assert err.value.param == "top_p"
    with pytest.raises(InvalidRequest):
        engine.add_request([100000], SamplingParams())


def test_seeded_sampling_is_reproducible_and_options_apply(engine):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a, b = engine.generate([[3, 4, 5], [3, 4, 5]], p)
    assert a == b
    c = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=12, temperature=1.0, seed=8))[0]
    assert c != a
    # top_k=1 is greedy whatever the temperature.
    greedy = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert (
        engine.generate(
            [[3, 4, 5]], SamplingParams(max_tokens=8, temperature=2.0, top_k=1, seed=1)
        )[0]
        == greedy
    )
    # A strong logit bias wins every step; a stop token id ends the sequence on it.
    biased = engine.generate(
        [[3, 4, 5]], SamplingParams(max_tokens=5, temperature=0, logit_bias=((77, 100.0),))
    )[0]
    assert biased == [77] * 5
    stopped = engine.generate(
        [[3, 4, 5]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(greedy[2],))
    )
    assert stopped[0] == greedy[:3]
    # repetition penalty changes a greedy run that repeats tokens; min_tokens bans eos early.
    penalised = engine.generate(
        [[3, 4, 5]], SamplingParams(max_tokens=8, temperature=0, repetition_penalty=5.0)
    )
    assert len(set(penalised[0])) >= len(set(greedy))
    eos = engine.eos_ids[0]
    forced = engine.generate(
        [[3]], SamplingParams(max_tokens=6, temperature=0, min_tokens=4, logit_bias=((eos, 100.0),))
    )[0]
    assert forced[:4].count(eos) == 0 and forced[4] == eos and len(forced) == 5


def test_min_tokens_holds_back_stop_strings_too(engine):
    """As vLLM: before min_tokens, a stop string does not end the output (only eos and stop ids were
    held back)."""
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request([3, 4, 5], plain, request_id="plain")
    text = "".join(o.text for o in _drain(engine) if o.request_id == "plain")
    # (a tiny model's bytes)
    at = next(i for i in range(len(text) - 1) if "\ufffd" not in text[i : i + 2])
    stop = text[at : at + 2]
    early = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,))
    late = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,), min_tokens=10
    )
    engine.add_request([3, 4, 5], early, request_id="early")
    engine.add_request([3, 4, 5], late, request_id="late")
    outs = _drain(engine)
    ended = {o.request_id: o for o in outs if o.finished}
    assert ended["early"].finish_reason == "stop" and ended["early"].num_output_tokens < 10
    assert ended["late"].num_output_tokens >= 10
    late_text = "".join(o.text for o in outs if o.request_id == "late")
    # the early occurrence is kept: it came before min_tokens
    assert late_text.startswith(text[: at + 2])


def test_a_seed_beyond_64_bits_is_an_invalid_request(engine):
    with pytest.raises(InvalidRequest) as refused:
        SamplingParams(seed=2**64)
    assert refused.value.param == "seed"
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(
        seed=-(2**63)
    ).seed == -(2**63)


def _drain(engine):
    outs = []
    while engine.has_work():
        outs += engine.step()
    return outs


def test_logprobs_of_chosen_and_top_tokens(engine):
    rid = engine.add_request([3, 4, 5], SamplingParams(max_tokens=3, temperature=0, logprobs=2))
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == 3
    for lp in lps:
        assert lp["top"][0][0] == lp["token"] and lp["logprob"] == pytest.approx(lp["top"][0][1])
        assert lp["top"][0][1] >= lp["top"][1][1] and lp["logprob"] <= 0


def test_stop_strings_truncate_the_text(engine):
    full = engine.tokenizer.decode(
        engine.generate([[3, 4, 5]], SamplingParams(max_tokens=10, temperature=0))[0]
    )
    stop = full[3:5]
    assert stop
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=10, temperature=0, stop=(stop,)))
    text, reason = "", None
    while engine.has_work():
        for o in engine.step():
            text += o.text
            reason = o.finish_reason or reason
    assert text == full[: full.find(stop)] and reason == "stop"


def test_async_stream_and_abort_free_memory_at_once(engine, llama_adapters):
    aeng = AsyncEngine(engine)
    ref = engine.adapter_ref("attn-r8", llama_adapters["attn-r8"])
    free_before = engine.blocks.num_free

    async def main():
        tokens = []
        async for out in aeng.generate([3, 4, 5], SamplingParams(max_tokens=6, temperature=0), ref):
            tokens += out.token_ids
        assert len(tokens) == 6
        gen = aeng.generate(
            [3, 4, 5], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), ref
        )
        async for _ in gen:
            break  # the client goes away after the first token
        await gen.aclose()
        # the engine thread takes the abort between steps: a loaded box is slow
        deadline = time.monotonic() + 30
        while engine.has_work():
            assert time.monotonic() < deadline, "the aborted request never left the engine"
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert engine.blocks.num_free == free_before
        assert engine.adapters.entries[ref.key].refcount == 0
        assert engine.adapters.backend.num_waiting == {}
        assert not engine.requests
    finally:
        aeng._stopping = True
        aeng._wake.set()
        aeng._thread.join(5)


def test_output_text_keeps_the_space_a_sentencepiece_tokenizer_marks_on_its_first_token(
    llama_dir, tmp_path
):
    """Llama-2 and Mistral tokenizers (Metaspace) drop the space marked on the first token of a
    decoded text. The output's first token is not the text's first: decoded after the prompt's last
    tokens (as vLLM does), prompt and output join into the right text ("the quick brown fox", not
    "the quick brownfox")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model = shutil.copytree(llama_dir, tmp_path / "sp")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog " * 4],
        trainers.BpeTrainer(vocab_size=200, special_tokens=["<s>", "</s>", "<unk>"]),
    )
    tok.save(str(model / "tokenizer.json"))
    engine = LLMEngine(
        EngineConfig(model_dir=model, dtype="float32", device="cpu", kv_cache_memory_bytes=2**20)
    )
    try:
        prompt = engine.tokenizer.encode("the quick brown")
        fox = engine.tokenizer.encode(" fox", add_special_tokens=False)
        assert len(fox) == 1
        forced = SamplingParams(max_tokens=1, temperature=0, logit_bias=((fox[0], 100.0),))
        # the drop, out of context
        assert engine.tokenizer.decode(engine.generate([prompt], forced)[0]) == "fox"
        engine.add_request(prompt, forced)
        text = ""
        while engine.has_work():
            text += "".join(out.text for out in engine.step())
        assert text == " fox"
    finally:
        engine.close()
