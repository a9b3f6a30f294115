"""n and best_of on shared KV blocks, min_p, prompt logprobs, penalties in one batch and structured
outputs, against HF transformers + PEFT (and xgrammar's own matcher for the grammar)."""

import json

import pytest
import torch
from tinymodels import peft_reference, reference_greedy, reference_logits

from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import InvalidRequest, SamplingParams, StructuredOutput

# 10 tokens: 2 full blocks of 4 and a partly filled one
PROMPT = [
    5,
    6,
    7,
    8,
    9,
    10,
    11,
    12,
    13,
    14,
]


@pytest.fixture(scope="module")
def world(llama_dir, llama_adapters):
    engine = LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            max_loras=2,
            block_size=4,
            kv_cache_memory_bytes=2 * 2**20,
            max_lora_rank=16,
        )
    )
    adapters = {"attn-r8": llama_adapters["attn-r8"]}
    refs = {n: engine.adapter_ref(n, p) for n, p in adapters.items()}
    yield engine, refs, peft_reference(llama_dir, adapters)
    engine.close()


def _run(engine, requests):
    """Add (prompt, params, adapter) requests, step until done: {(request index, seq index): output
    list}."""
    ids = [engine.add_request(p, sp, a) for p, sp, a in requests]
    got = {}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            got.setdefault((ids.index(out.request_id), out.index), []).append(out)
    return got


def _tokens(outs):
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:8]], ids=["partial-last-block", "full-blocks"])
@pytest.mark.parametrize("adapter", [None, "attn-r8"])
def test_n_sequences_share_the_prompt_blocks_and_match_separate_requests(world, prompt, adapter):
    engine, refs, ref_model = world
    ref = refs[adapter] if adapter else None
    free = engine.blocks.num_free
    rid = engine.add_request(
        prompt, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True), ref
    )
    outs = {}
    while not outs:  # the adapter's load, then the prefill and the fork into 3 sequences
        for out in engine.step():
            outs.setdefault(out.index, []).append(out)
    assert sorted(outs) == [0, 1, 2]
    # One copy of the prompt's blocks, and a copy of a partly filled last block for each further
    # sequence.
    copies = 2 if len(prompt) % engine.blocks.block_size else 0
    assert free - engine.blocks.num_free == engine.blocks.blocks_for(len(prompt)) + copies
    while engine.has_work():
        for out in engine.step():
            assert out.request_id == rid
            outs[out.index].append(out)
    # every shared block went back once, when its last sequence ended
    assert engine.blocks.num_free == free
    # Each sequence is what a request of its own with the child's seed (seed + index, as vLLM)
    # gives.
    alone = _run(
        engine,
        [
            (
                prompt,
                SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True),
                ref,
            )
            for i in range(3)
        ],
    )
    for i in range(3):
        assert _tokens(outs[i]) == _tokens(alone[(i, 0)])
    # Greedy: every sequence is HF + PEFT's greedy continuation (the forked KV is read right).
    greedy = _run(
        engine, [(prompt, SamplingParams(n=2, max_tokens=6, temperature=0, ignore_eos=True), ref)]
    )
    expected = reference_greedy(ref_model, prompt, adapter, 6)
    assert _tokens(greedy[(0, 0)]) == _tokens(greedy[(0, 1)]) == expected


def test_best_of_reports_each_sequences_cumulative_logprob_under_the_model(world):
    engine, refs, ref_model = world
    got = _run(
        engine,
        [
            (
                PROMPT,
                SamplingParams(
                    n=1, best_of=3, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True
                ),
                refs["attn-r8"],
            )
        ],
    )
    assert sorted(got) == [(0, 0), (0, 1), (0, 2)]
    for outs in got.values():
        tokens = _tokens(outs)
        logits = reference_logits(ref_model, PROMPT + tokens, "attn-r8")
        lp = torch.log_softmax(logits[len(PROMPT) - 1 : -1], -1)
        expected = float(lp.gather(1, torch.tensor(tokens)[:, None]).sum())
        assert outs[-1].cumulative_logprob == pytest.approx(expected, abs=1e-3)


def test_prompt_logprobs_match_hf(world):
    engine, refs, ref_model = world
    got = _run(engine, [(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=3), refs["attn-r8"])])
    first, *rest = got[(0, 0)]
    entries = first.prompt_logprobs
    assert len(entries) == len(PROMPT) and entries[0] is None
    assert all(o.prompt_logprobs is None for o in rest)  # only on the first output
    lp = torch.log_softmax(reference_logits(ref_model, PROMPT, "attn-r8"), -1)
    for j, entry in enumerate(entries[1:], start=1):
        assert entry["token"] == PROMPT[j]
        assert entry["logprob"] == pytest.approx(float(lp[j - 1, PROMPT[j]]), abs=1e-4)
        top_t = lp[j - 1].topk(3).indices
        assert [t for t, _ in entry["top"]] == top_t.tolist()


def _penalized(logits, params, prompt, output):
    """The reference: vLLM's order and formulas applied to one row."""
    row = logits.clone()
    for token, bias in params.logit_bias:
        row[token] += bias
    seen = torch.tensor(sorted(set(prompt + output)))
    values = row[seen]
    row[seen] = torch.where(
        values > 0, values / params.repetition_penalty, values * params.repetition_penalty
    )
    if output:
        ids, counts = torch.tensor(output).unique(return_counts=True)
        row[ids] -= params.presence_penalty + params.frequency_penalty * counts.float()
    return row


def test_penalties_and_bias_in_one_mixed_batch_match_a_per_row_reference(world):
    engine, refs, ref_model = world
    mixes = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(
            max_tokens=8,
            temperature=0,
            ignore_eos=True,
            presence_penalty=1.0,
            frequency_penalty=0.7,
        ),
        SamplingParams(
            max_tokens=8,
            temperature=0,
            ignore_eos=True,
            logit_bias=((300, 3.0), (7, -2.0)),
            repetition_penalty=0.8,
        ),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(
            max_tokens=8, temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=1, ignore_eos=True
        ),
    ]
    prompts = [PROMPT, PROMPT[:5], [40, 41, 42, 43], [20, 21, 22], PROMPT]
    adapters = [None, "attn-r8", None, "attn-r8", None]
    got = _run(
        engine, [(p, sp, refs[a] if a else None) for p, sp, a in zip(prompts, mixes, adapters)]
    )
    for i in range(4):  # the greedy rows, each against its own reference loop
        output = []
        for _ in range(8):
            logits = reference_logits(ref_model, prompts[i] + output, adapters[i])[-1]
            output.append(int(_penalized(logits, mixes[i], prompts[i], output).argmax()))
        assert _tokens(got[(i, 0)]) == output, i


def test_min_p_keeps_only_tokens_near_the_most_likely(world):
    engine, _, ref_model = world
    greedy = _run(
        engine, [(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), None)]
    )
    full = _run(
        engine,
        [
            (
                PROMPT,
                SamplingParams(max_tokens=6, temperature=1.0, min_p=1.0, seed=2, ignore_eos=True),
                None,
            )
        ],
    )
    # min_p 1: only the most likely token is left
    assert _tokens(full[(0, 0)]) == _tokens(greedy[(0, 0)])
    got = _run(
        engine,
        [
            (
                PROMPT,
                SamplingParams(max_tokens=12, temperature=1.5, min_p=0.3, seed=s, ignore_eos=True),
                None,
            )
            for s in range(4)
        ],
    )
    for outs in got.values():
        tokens = _tokens(outs)
        probs = (
            reference_logits(ref_model, PROMPT + tokens, None)[len(PROMPT) - 1 : -1]
            .div(1.5)
            .softmax(-1)
        )
        chosen = probs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert bool((chosen >= 0.3 * probs.max(-1).values - 1e-6).all())


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "spec",
    [StructuredOutput(json_schema=json.dumps(SCHEMA)), StructuredOutput(json_object=True)],
    ids=["json_schema", "json_object"],
)
def test_structured_rows_follow_their_grammar_and_leave_the_others_alone(world, spec):
    """Greedy under the grammar is HF + PEFT's argmax over the tokens xgrammar's own matcher allows;
    the plain requests in the same batch are HF's plain greedy."""
    import xgrammar as xgr

    engine, refs, ref_model = world
    structured = SamplingParams(max_tokens=24, temperature=0, structured=spec)
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = _run(
        engine,
        [
            (PROMPT, structured, refs["attn-r8"]),
            (PROMPT, plain, None),
            (PROMPT[:6], plain, refs["attn-r8"]),
        ],
    )
    assert _tokens(got[(1, 0)]) == reference_greedy(ref_model, PROMPT, None, 8)
    assert _tokens(got[(2, 0)]) == reference_greedy(ref_model, PROMPT[:6], "attn-r8", 8)
    matcher = engine.grammars.matcher(spec)
    bitmask = xgr.allocate_token_bitmask(1, engine.model_config.vocab_size)
    output = []
    for _ in range(24):
        logits = reference_logits(ref_model, PROMPT + output, "attn-r8")[-1:].clone()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        output.append(token)
        if token in engine.eos_ids or not matcher.accept_token(token) or matcher.is_terminated():
            break
    outs = got[(0, 0)]
    assert _tokens(outs) == output
    text = "".join(o.text for o in outs)
    if outs[-1].finish_reason == "stop":  # the grammar ended: the text is the JSON it describes
        value = json.loads(text)
        assert isinstance(value, dict)
        if spec.json_schema:
            assert set(value) == {"name", "age"}


def test_a_refused_schema_or_a_group_too_big_is_an_invalid_request_and_serving_goes_on(world):
    engine = world[0]
    with pytest.raises(InvalidRequest) as bad:
        engine.add_request(
            PROMPT, SamplingParams(structured=StructuredOutput(json_schema='{"type": "wizard"}'))
        )
    assert bad.value.param == "response_format"
    with pytest.raises(InvalidRequest) as bad:
        engine.add_request(
            PROMPT, SamplingParams(structured=StructuredOutput(json_schema="{not json"))
        )
    assert bad.value.param == "response_format"
    with pytest.raises(InvalidRequest) as big:
        engine.add_request(PROMPT, SamplingParams(n=2, best_of=engine.config.max_num_seqs + 1))
    assert big.value.param == "best_of"
    with pytest.raises(InvalidRequest) as small:
        SamplingParams(n=3, best_of=2)
    assert small.value.param == "best_of"
    got = _run(
        engine, [(PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), None)]
    )
    assert len(_tokens(got[(0, 0)])) == 3
    assert not engine.requests and engine.blocks.num_free == engine.blocks.num_blocks


def test_n_times_the_prompt_that_does_not_fit_the_kv_cache_is_refused(llama_dir):
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    engine = LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            block_size=4,
            max_model_len=32,
            kv_cache_memory_bytes=64 * per_token,
        )
    )
    assert engine.blocks.num_blocks == 16
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0, ignore_eos=True)
    with pytest.raises(InvalidRequest) as big:
        # 3 blocks for the prompt, one more for each further sequence
        engine.add_request(PROMPT, SamplingParams(n=15, max_tokens=4))
    assert big.value.param == "n" and "KV blocks" in str(big.value)
    # 14 sequences fit together (3 + 13 blocks): they run, preempting and recomputing as they grow.
    got = _run(
        engine,
        [
            (
                PROMPT,
                SamplingParams(n=14, max_tokens=4, temperature=1.0, seed=0, ignore_eos=True),
                None,
            )
        ],
    )
    assert sorted(i for _, i in got) == list(range(14)) and all(
        len(_tokens(o)) == 4 for o in got.values()
    )
    assert _tokens(got[(0, 0)]) == _tokens(_run(engine, [(PROMPT, params, None)])[(0, 0)])
    assert engine.blocks.num_free == 16
    engine.close()


def test_abort_ends_every_sequence_of_the_request(world):
    engine, refs, _ = world
    params = SamplingParams(n=4, max_tokens=50, ignore_eos=True, repetition_penalty=1.2)
    rid = engine.add_request(PROMPT, params, refs["attn-r8"])
    while len(engine.requests.get(rid, ())) < 4:
        # its adapter's load, then the prefill and the fork
        engine.step()
    assert len(engine.sampler.penalties.rows) == 4
    engine.abort(rid)
    while engine.has_work():
        engine.step()
    assert not engine.requests and engine.blocks.num_free == engine.blocks.num_blocks
    assert all(e.refcount == 0 for e in engine.adapters.entries.values())
    assert not engine.sampler.penalties.rows
