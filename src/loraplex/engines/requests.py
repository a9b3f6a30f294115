"""What a generation request is and what it gives back, in a module without torch: the sampling
parameters the server builds from an OpenAI request, and the outputs the engine streams back."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engines.errors import InvalidRequest

SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output follows, as vLLM's StructuredOutputsParams (`json`, `json_object`): one
    is set."""

    json_schema: str | None = None
    """A JSON schema, serialized."""
    json_object: bool = False
    """Any JSON object."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: no top-k."""
    min_p: float = 0.0
    """Tokens less likely than min_p times the most likely one are dropped (0: none)."""
    n: int = 1
    """Sequences returned for the prompt; they share the prompt's KV blocks."""
    best_of: int | None = None
    """Sequences generated (at least n); the n with the highest cumulative logprob are returned."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    """None: no logprobs; N: the chosen token's logprob and the N most likely alternatives."""
    prompt_logprobs: int | None = None
    """None: none; N: each prompt token's logprob (the first has none) and its N most likely
    alternatives."""
    structured: StructuredOutput | None = None

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 or positive"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.n >= 1, "n", "must be at least 1"),
            (self.best_of is None or self.best_of >= self.n, "best_of", "must be at least n"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                "must be in [0, 20]",
            ),
            (self.seed is None or -(2**63) <= self.seed < 2**64, "seed", "must fit in 64 bits"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise InvalidRequest(name, f"{name} {why}")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def is_greedy(self) -> bool:
        """As vLLM: a temperature under 1e-5 is greedy (dividing the logits by it overflows to inf,
        then NaN)."""
        return self.temperature < SAMPLING_EPS

    @property
    def num_seqs(self) -> int:
        """Sequences generated for the prompt."""
        return self.best_of or self.n

    @property
    def needs_penalties(self) -> bool:
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
        )


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas since the last output)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: Exception | None = None
    index: int = 0
    """Which of the request's sequences produced it (n > 1, best_of)."""
    cumulative_logprob: float | None = None
    """Of all the sequence's tokens so far, when best_of asks for it."""
    prompt_logprobs: list[dict | None] | None = None
    """On the request's first output, when asked: one entry per prompt token (None for the first).
    """
    cache_tier: str | None = None
    """The tier the request's adapter was in when the request arrived (gpu, cpu, disk or remote)."""
    queue_wait_s: float | None = None
    """Arrival to admission into the running batch."""
