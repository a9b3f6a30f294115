"""What the native engine's two front ends, the in-process `LLMEngine` and the `EngineClient` of an
engine process, give the server alike: the token request layer, no adapter to hold around a request
(the scheduler takes its slot as it admits it), greedy text and scored tokens for release checks,
the model."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from loraplex.engines.contract import Engine, Generation, RequestLayers, TokenEngine
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.sequence import SamplingParams
from loraplex.engines.native.streams import complete_text
from loraplex.engines.native.tokenizer import Tokenizer
from loraplex.residency.key import AdapterRef

L = TypeVar("L")


class NativeFront(Engine, TokenEngine):
    config: EngineConfig
    tokenizer: Tokenizer

    @property
    def generation(self) -> Generation:
        raise NotImplementedError

    def request_layer(self, layers: RequestLayers[L]) -> L:
        return layers.over_tokens(self)

    async def acquire(self, ref: AdapterRef | None) -> None:
        """Nothing to hold here: the scheduler takes the adapter's slot as it admits the
        request (and gives it back as the request ends)."""
        return None

    def release(self, ref: AdapterRef | None, held: None) -> None:
        pass

    async def complete_text(self, prompt: str, ref: AdapterRef, max_tokens: int = 32) -> str:
        return await complete_text(self.generation, self.tokenizer, prompt, ref, max_tokens)

    async def score_tokens(self, ids: list[int], ref: AdapterRef | None) -> list[float]:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        entries: list = []
        async for out in self.generation.generate(list(ids), params, ref):
            entries = out.prompt_logprobs or entries
        return [float(e["logprob"]) for e in entries[1 : len(ids)]]

    @property
    def model_dir(self) -> Path:
        return self.config.model_dir
