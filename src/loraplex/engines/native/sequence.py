"""A request's life in the engine: its sequence state (its sampling parameters and outputs are
`engines.requests`')."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.engines.native.errors import InvalidRequest, NonFiniteLogits  # noqa: F401  (raised here; defined without torch)
from loraplex.engines.requests import (  # noqa: F401  (the engine's own names for them)
    SAMPLING_EPS,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
)

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher

    from loraplex.engines.native.tokenizer import OutputDecoder
    from loraplex.residency.key import AdapterRef


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the sequences of one request may hold equal values
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None = None  # None for the base model
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    fork_blocks: list[int] = field(default_factory=list)
    """Blocks kept for the copies of the last prompt block that the sequence's forks take."""
    num_hashed: int = 0
    """Prompt blocks whose hash is known (`BlockManager.cache_computed`); `prefix_hash` is the last
    one's."""
    prefix_hash: bytes = b""
    num_computed: int = 0
    """Tokens whose keys and values are in the KV cache."""
    num_scheduled: int = 0
    """Tokens this step computes (a prefill chunk, or 1 for a decode)."""
    lora_slot: int = -1
    holds_adapter: bool = False
    finish_reason: str | None = None
    index: int = 0
    """Which of the request's sequences this is (n > 1, best_of)."""
    num_forks: int = 0
    """Sequences still to fork from this one once its prompt is in the KV cache."""
    cumulative_logprob: float = 0.0
    """Of the sampled tokens, under the model's distribution (best_of ranks by it)."""
    prompt_logprobs: list[dict | None] | None = None
    matcher: GrammarMatcher | None = None
    """The grammar's state when the output is structured."""
    text: str = ""
    detokenizer: OutputDecoder | None = None
    """The output's incremental decoder (`Tokenizer.output_decoder`)."""
    stop_from: int = 0
    """Characters of `text` from before min_tokens was reached: stop strings are looked for after
    them."""
    sent_chars: int = 0
    sent_tokens: int = 0
    generator: torch.Generator | None = None
    first_token_at: float | None = None
    admitted_at: float | None = None
    cache_tier: str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
