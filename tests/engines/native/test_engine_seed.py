"""`EngineConfig.seed` (`serve --seed`): requests without a seed of their own sample from the
engine's generator, so the same seed gives the same samples and another seed others."""

from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams


def _samples(llama_dir, seed: int) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            kv_cache_memory_bytes=2**20,
            max_lora_rank=16,
            seed=seed,
        )
    )
    try:
        params = SamplingParams(max_tokens=12, temperature=1.0)
        return [engine.generate([[3, 4, 5]], params)[0] for _ in range(2)]
    finally:
        engine.close()


def test_engine_seed_makes_unseeded_sampling_reproducible(llama_dir):
    first = _samples(llama_dir, 3)
    assert _samples(llama_dir, 3) == first
    assert first[0] != first[1]  # one generator for the engine, not one per request
    assert _samples(llama_dir, 4) != first
