"""What the server, the admin API, the metrics and the pin reconciler need of an engine and of its
adapters' residency: the protocols the native engine (in this process or in its own) and the vLLM
engine declare, and the records that cross the native engine's process boundary. The server holds
an `Engine` and imports no engine module (`server/engines.py` builds one)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from loraplex.engines.requests import RequestOutput, SamplingParams
from loraplex.model_config import ModelConfig
from loraplex.residency.budgets import TenantBudgets
from loraplex.residency.events import Event
from loraplex.residency.key import AdapterKey, AdapterRef


@dataclass(frozen=True)
class Residency:
    """Where one adapter is, as the engine last reported it."""

    tier: str
    """gpu, cpu, disk or remote."""
    pinned: str | None
    """The tier it is pinned to, if any."""
    loading: bool
    in_host_memory: bool
    in_use: bool
    """A request holds it."""


@dataclass
class ResidencySnapshot:
    """Every adapter the native engine's cache knows, numbered so that the newest of those the
    two sockets bring wins."""

    seq: int
    slots: list[AdapterKey | None]
    residency: dict[AdapterKey, Residency]


class AdapterResidency(Protocol):
    """An engine's adapter operations and residency, read by the server, the admin API, the
    metrics and the pin reconciler."""

    budgets: TenantBudgets
    """The tenants' residency budgets last applied."""
    on_event: Callable[[Event], None]
    """Called with each residency event (`residency.events`) for the metrics and the server."""

    def tier_of(self, key: AdapterKey) -> str: ...
    def pinned(self, key: AdapterKey) -> str | None: ...
    def is_loading(self, key: AdapterKey) -> bool: ...
    def in_host_memory(self, key: AdapterKey) -> bool: ...
    def pin(self, ref: AdapterRef, tier: str) -> None: ...
    def unpin(self, key: AdapterKey) -> None: ...
    def restore_pin(self, key: AdapterKey, pinned: str | None) -> None: ...
    def prewarm(self, ref: AdapterRef, tier: str = "cpu") -> None: ...
    def evict(self, key: AdapterKey) -> None: ...
    def forget(self, key: AdapterKey) -> None: ...
    def set_budgets(self, budgets: TenantBudgets) -> None: ...
    def budget_state(self) -> dict[str, Any]: ...
    def state(self) -> dict[str, Any]:
        """`/admin/state`'s residency: every adapter and the slots."""
        ...

    def when_loaded(self, key: AdapterKey) -> Future[Any]:
        """Done once no load of `key` is in progress."""
        ...

    def when_released(self, key: AdapterKey) -> Future[Any]:
        """Done once no request holds `key`."""
        ...


class Generation(Protocol):
    """Token-level generation: the one signature of a request submitted to an engine that the
    server's own OpenAI layer runs (the native engine on a thread or in its own process)."""

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: AdapterRef | None = None,
        request_id: str | None = None,
        counted: bool = True,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs as the request advances (of all its sequences, told apart by `index`); leaving
        the iterator early (a client gone) aborts the request. `counted`: reported as a cache hit
        or miss (a client request of several prompts reports its first)."""
        ...


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> str: ...


class TokenEngine(Protocol):
    """An engine whose OpenAI requests the server parses, tokenizes and answers itself."""

    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int

    @property
    def generation(self) -> Generation:
        """Where the requests run, once the engine has started."""
        ...


class OpenAIServing(Protocol):
    """An engine's own OpenAI request layer (vLLM's): it parses the request bodies and answers
    them, with every parameter it serves; the server puts tenancy, resolution, admission and
    residency in front. Its requests and answers are its own types; it raises the engines'
    errors (`engines.errors`)."""

    @property
    def served_model_name(self) -> str:
        """The base model's name in its answers."""
        ...

    def parse(self, body: bytes, chat: bool) -> Any:
        """The request; raises pydantic's ValidationError for a body it refuses."""
        ...

    def track(self, request_id: str) -> None:
        """Count the tokens of the request of this id (a client request: n > 1 is several)."""
        ...

    def untrack(self, request_id: str) -> RequestUsage | None: ...

    def answer(self, request: Any, chat: bool, model: str, held: Any) -> Awaitable[Any]:
        """The engine's answer (a response object, or its stream of server-sent events) to
        `request` served as `model` with the adapter `held` (`Engine.acquire`'s)."""
        ...


@dataclass
class RequestUsage:
    """The tokens and timings of one client request that an engine's own layer served."""

    prompt_tokens: int = 0
    completion_tokens: dict[str, int] = field(default_factory=dict)
    """Per generation (n > 1 is several)."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    """time.monotonic() of the first and the last token."""


L = TypeVar("L")
L_co = TypeVar("L_co", covariant=True)


class RequestLayers(Protocol[L_co]):
    """The server's two ways of running an OpenAI request, of which an engine picks the one that
    serves it (`Engine.request_layer`)."""

    def over_tokens(self, engine: TokenEngine) -> L_co:
        """The server's own layer: it parses, tokenizes and formats; the engine generates."""
        ...

    def over_serving(self, serving: OpenAIServing) -> L_co:
        """The engine's own layer answers; the server resolves, admits and holds the adapter."""
        ...


class Engine(Protocol):
    """What the server, the admin API and the metrics need of an engine (native: in this process
    or in its own; vLLM). A request runs admit → `acquire` → the engine's request layer →
    `release`; where the engines differ, the difference is in their implementation of these."""

    adapters: AdapterResidency
    max_model_len: int
    base_model_digest: str

    @property
    def model_dir(self) -> Path:
        """The base model's directory."""
        ...

    @property
    def is_alive(self) -> bool:
        """False once the engine has stopped serving (its step loop or process ended)."""
        ...

    async def start(self) -> None:
        """On the server's event loop, before the first request."""
        ...

    def stop(self) -> None: ...

    def live_figures(self) -> dict[str, Any]:
        """Waiting and running requests, KV use, the adapters running and waiting, the slots and
        their max rank: what `/admin/state`, the metrics and gateways read."""
        ...

    async def acquire(self, ref: AdapterRef | None) -> Any:
        """Hold the request's adapter (None: the base model) for its run; what is held goes to
        the request layer and back to `release`. Raises AdapterUnavailable."""
        ...

    def release(self, ref: AdapterRef | None, held: Any) -> None:
        """Give back what `acquire` held, once the request has ended."""
        ...

    async def complete_text(self, prompt: str, ref: AdapterRef, max_tokens: int = 32) -> str:
        """Greedy completion of `prompt` with the adapter (the release checks)."""
        ...

    async def score_tokens(self, ids: list[int], ref: AdapterRef | None) -> list[float]:
        """The log-probability of each of `ids[1:]` after the ones before it, under the adapter
        (None: the base model): the parity gate's release check."""
        ...

    def request_layer(self, layers: RequestLayers[L]) -> L:
        """The layer of `layers` that runs this engine's OpenAI requests."""
        ...
