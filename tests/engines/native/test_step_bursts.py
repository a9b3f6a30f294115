"""`LLMEngine.step(halve_bursts=True)`, as the engine process steps: a burst of more than half of
max_num_seqs requests, with nothing running, joins in two halves; anything less, or a burst while
sequences run, joins whole."""

import pytest
from tinymodels import peft_reference, reference_greedy

from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            max_loras=2,
            max_num_seqs=8,
            kv_cache_memory_bytes=2**21,
        )
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_model(llama_dir, llama_adapters):
    return peft_reference(llama_dir, {"attn-r8": llama_adapters["attn-r8"]})


def _finished(outputs) -> dict[str, list[int]]:
    return {o.request_id: o.token_ids for o in outputs if o.finished}


def test_a_burst_joins_in_two_halves_first_come_first_served(engine, base_model):
    prompts = [[10 + i, 11 + i, 12 + i] for i in range(7)]
    ids = [engine.add_request(p, ONE_TOKEN) for p in prompts]
    first = _finished(engine.step(halve_bursts=True))
    assert list(first) == ids[:4]  # 7 wait, more than 8 // 2: 4 (7 / 2 rounded up) join
    second = _finished(engine.step(halve_bursts=True))
    assert list(second) == ids[4:]  # 3 wait, not more than 4: all of them join
    assert not engine.has_work()
    tokens = first | second
    for prompt, request_id in zip(prompts, ids):
        assert tokens[request_id] == reference_greedy(base_model, prompt, None, 1)


def test_without_halving_a_burst_joins_whole(engine):
    ids = [engine.add_request([20 + i, 21 + i], ONE_TOKEN) for i in range(7)]
    assert list(_finished(engine.step())) == ids
    assert not engine.has_work()


def test_a_burst_while_sequences_run_joins_whole(engine):
    running = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    engine.step(halve_bursts=True)  # its prefill: it runs now
    ids = [engine.add_request([30 + i, 31 + i], ONE_TOKEN) for i in range(6)]
    outputs = engine.step(halve_bursts=True)
    assert list(_finished(outputs)) == ids  # 6 > 4 wait, but a step runs anyway: no halving
    assert running in {o.request_id for o in outputs}
    while engine.has_work():
        engine.step(halve_bursts=True)
