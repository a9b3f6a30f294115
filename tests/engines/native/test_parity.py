"""Our model and LoRA ops against Hugging Face transformers + PEFT, logits and greedy tokens."""

import dataclasses

import pytest
import torch
from tinymodels import make_adapters, make_model, peft_reference, reference_greedy, reference_logits

from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
    [20, 21, 22],
    [30, 31, 32, 33, 34],
    [40, 41, 42, 43],
    [50, 51, 52, 53, 54, 55],
    [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70],
]

MODELS = {
    "llama": dict(kind="llama"),
    "llama-tied-sharded": dict(kind="llama", tie_word_embeddings=True, shard=True),
    "llama3-rope": dict(
        kind="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": dict(kind="qwen2"),
    "qwen3": dict(kind="qwen3"),
    "mistral-window8": dict(kind="mistral"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def world(request, tmp_path_factory):
    spec = dict(MODELS[request.param])
    kind, shard = spec.pop("kind"), spec.pop("shard", False)
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_model(root / "model", kind, **spec)
    if shard:
        import transformers

        transformers.AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(
            model_dir, max_shard_size="50KB"
        )
        (model_dir / "model.safetensors").unlink(missing_ok=True)
        assert (model_dir / "model.safetensors.index.json").is_file()
    adapters = make_adapters(model_dir, root / "adapters")
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            dtype="float32",
            max_loras=len(adapters),
            kv_cache_memory_bytes=4 * 2**20,
            max_lora_rank=16,
        )
    )
    refs = {n: engine.adapter_ref(n, p) for n, p in adapters.items()}
    yield engine, refs, peft_reference(model_dir, adapters)
    engine.close()


def test_mixed_batch_logits_match_peft(world):
    engine, refs, ref_model = world
    names = [None, *refs]  # base-only rows and every adapter, in one step
    adapters = [refs[n] if n else None for n in names]
    ours = engine.score(PROMPTS, adapters)
    for prompt, name, logits in zip(PROMPTS, names, ours):
        expected = reference_logits(ref_model, prompt, name)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0, msg=f"adapter {name}")
    # The adapters really change the output, so the comparison above has teeth.
    base = engine.score([PROMPTS[1]], [None])[0]
    assert (base - ours[1]).abs().max() > 1e-2


def test_each_adapter_alone_matches_peft(world):
    engine, refs, ref_model = world
    for name, ref in refs.items():
        logits = engine.score([PROMPTS[0]], [ref])[0]
        torch.testing.assert_close(
            logits, reference_logits(ref_model, PROMPTS[0], name), atol=1e-4, rtol=0
        )


def test_greedy_generation_matches_token_for_token_with_join_and_leave(world):
    engine, refs, ref_model = world
    names = [None, *refs]
    jobs = [(PROMPTS[i % len(PROMPTS)], names[i % len(names)], 6 + 3 * (i % 3)) for i in range(8)]
    got: dict[str, list[int]] = {}
    ids = []
    for step in range(200):
        if step % 2 == 0 and len(ids) < len(jobs):  # a new request joins every other step
            prompt, name, n = jobs[len(ids)]
            ids.append(
                engine.add_request(
                    prompt,
                    SamplingParams(max_tokens=n, temperature=0),
                    refs[name] if name else None,
                )
            )
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        if len(ids) == len(jobs) and not engine.has_work():
            break
    for rid, (prompt, name, n) in zip(ids, jobs):
        assert got[rid] == reference_greedy(ref_model, prompt, name, n), f"adapter {name}"


def test_chunked_prefill_matches_peft_logits_and_greedy_tokens(world):
    """Prompts prefilled in chunks of at most 7 tokens a step (beside the decodes of the others):
    every prompt position's logprob, and the greedy tokens after it, are HF + PEFT's (the sliding
    window model too)."""
    engine, refs, ref_model = world
    names = [None, *refs]
    config = engine.scheduler.config
    engine.scheduler.config = dataclasses.replace(config, max_num_batched_tokens=7)
    try:
        jobs = [(PROMPTS[i % len(PROMPTS)], names[i % len(names)]) for i in range(6)]
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=0)
        ids = [engine.add_request(p, params, refs[n] if n else None) for p, n in jobs]
        tokens, prompt_lp, steps = {i: [] for i in ids}, {}, 0
        while engine.has_work():
            for out in engine.step():
                assert out.error is None
                tokens[out.request_id] += out.token_ids
                if out.prompt_logprobs is not None:
                    prompt_lp[out.request_id] = out.prompt_logprobs
            steps += 1
            assert sum(s.num_scheduled for s in engine.scheduler.running) <= 7
    finally:
        engine.scheduler.config = config
    for rid, (prompt, name) in zip(ids, jobs):
        assert tokens[rid] == reference_greedy(ref_model, prompt, name, 5), name
        expected = torch.log_softmax(reference_logits(ref_model, prompt, name), -1)
        got = [e["logprob"] for e in prompt_lp[rid][1:]]
        want = expected[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)


def _greedy_with_hits(engine, prompt, ref, max_tokens=5):
    """Greedy tokens of one request, and the prompt tokens it found in the prefix cache."""
    before = engine.blocks.num_hit_tokens
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    tokens = engine.generate([prompt], params, [ref])[0]
    return tokens, engine.blocks.num_hit_tokens - before


def test_prefix_cache_shares_blocks_within_one_adapter_revision_only(world):
    """A prompt that starts as an earlier one of the same adapter revision reuses its full blocks
    and gives HF + PEFT's tokens; the same prompt under another adapter, the base model, or another
    revision of the adapter finds nothing, and a revision the worker forgets takes its blocks."""
    engine, refs, ref_model = world
    size = engine.blocks.block_size
    names = [None, *refs]
    for k, name in enumerate(names):
        # two full blocks, a prefix of its own
        prefix = [100 + k * 3 + i % 50 for i in range(2 * size)]
        ref = refs[name] if name else None
        assert _greedy_with_hits(engine, prefix + [1, 2, 3], ref)[1] == 0
        second, hits = _greedy_with_hits(engine, prefix + [4, 5], ref)
        assert hits == 2 * size
        assert second == reference_greedy(ref_model, prefix + [4, 5], name, 5), name
        for other in names:  # nobody else's blocks
            if other != name:
                other_ref = refs[other] if other else None
                assert _greedy_with_hits(engine, prefix + [4, 5], other_ref)[1] == 0, (name, other)
    name = next(iter(refs))
    digest = refs[name].key.adapter_digest
    again = engine.adapter_ref(name, refs[name].path, revision="r2", digest=digest)
    prefix = [300 + i % 40 for i in range(2 * size)]
    _greedy_with_hits(engine, prefix + [1], refs[name])
    # same bytes, another revision: its own blocks
    assert _greedy_with_hits(engine, prefix + [2], again)[1] == 0
    assert _greedy_with_hits(engine, prefix + [3], refs[name])[1] == 2 * size
    # the other revision leaves the worker (retired, unloaded): its cached blocks go with it
    cached = len(engine.blocks.cached)
    engine.adapters.forget(again.key)
    assert _greedy_with_hits(engine, prefix + [4], refs[name])[1] == 2 * size
    assert len(engine.blocks.cached) == cached - 2
    assert _greedy_with_hits(engine, prefix + [5], again)[1] == 0


def test_decode_over_many_blocks_of_mixed_lengths_matches_peft(world):
    """Contexts of 1 to 6 KV blocks decode side by side (several attention groups, the sliding
    window's blocks only where the model has one): greedy tokens are HF + PEFT's."""
    engine, refs, ref_model = world
    size = engine.blocks.block_size
    names = [None, *refs]
    jobs = [
        ([(7 * i + j) % 500 + 2 for j in range(length)], names[i % len(names)])
        for i, length in enumerate((3, size + 1, 2 * size + 5, 3 * size, 5 * size + 9, 2))
    ]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = engine.generate(
        [p for p, _ in jobs], params, [refs[n] if n else None for _, n in jobs]
    )
    for (prompt, name), got in zip(jobs, outputs):
        assert got == reference_greedy(ref_model, prompt, name, 12), f"adapter {name}"
