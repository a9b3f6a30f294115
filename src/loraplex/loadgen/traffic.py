"""The load generator behind `loraplex bench serve`: replay a trace against an OpenAI-compatible
server (a loraplex worker, a router, or vLLM) over HTTP, and summarize what came back by the cache
tier each answer reports in `x-loraplex-cache-tier`.

Open loop (the default): each request is sent at its trace time × `time_scale`, whether or not
earlier ones have finished. Closed loop (`clients=N`): N clients, each sends the next request of the
trace as soon as its previous one has finished. Every request is a streamed `/v1/completions` call,
so TTFT is the time to the first chunk that carries text.

    summary = run(LoadConfig(url="http://127.0.0.1:8000", clients=4), workload.named("zipf")[:200])
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import httpx
import numpy as np

from loraplex.sim.workload import Request

TIER_HEADER = "x-loraplex-cache-tier"
TIERS = ("gpu", "cpu", "disk", "remote", "unknown")
"""`unknown`: the server sent no tier (vLLM, or an error before the adapter was resolved)."""
COLD_TIERS = ("cpu", "disk", "remote")
"""A cold start: the adapter was not in a gpu slot when the request arrived."""
STORAGE_TIERS = ("disk", "remote")
"""Of those, a load from storage (not in memory): what `loraplex_cold_starts_total` and `loraplex
plan` count."""
PERCENTILES = (50, 95, 99)
PROMPT_UNITS = ("char", "word")
_FILLER = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "was",
    "with",
    "as",
    "at",
    "by",
    "this",
)


class LoadError(Exception):
    """The run cannot start (server unreachable, bad URL, no base model name); the message is one
    line."""


@dataclass(frozen=True)
class LoadConfig:
    url: str
    """The server's or router's base URL (a trailing `/v1` is dropped)."""
    clients: int | None = None
    """None: open loop at the trace's times; N: closed loop with N clients."""
    time_scale: float = 1.0
    """Open loop: send at trace time × time_scale (0.5 replays the trace twice as fast)."""
    base_model: str | None = None
    """`model` for requests without an adapter; None asks `/v1/models` for the model without a
    parent."""
    api_key: str | None = None
    """The bearer for every request, or for tenants missing from `tenant_keys`."""
    tenant_keys: dict[str, str] = field(default_factory=dict)
    """tenant -> key: each trace request uses its tenant's key."""
    prompt_unit: str = "char"
    """How a prompt of N tokens is built: N characters (byte-level tokenizers) or N words (BPE
    tokenizers)."""
    timeout_s: float = 600.0
    """Per request: connect and the wait for each chunk."""

    def __post_init__(self):
        object.__setattr__(self, "url", _base_url(self.url))
        if self.clients is not None and self.clients < 1:
            raise ValueError("clients must be at least 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if self.prompt_unit not in PROMPT_UNITS:
            raise ValueError(f"prompt_unit {self.prompt_unit!r}: use {' or '.join(PROMPT_UNITS)}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    @property
    def mode(self) -> str:
        return "open" if self.clients is None else "closed"

    def headers(self, tenant: str) -> dict[str, str]:
        key = self.tenant_keys.get(tenant, self.api_key)
        return {"Authorization": f"Bearer {key}"} if key else {}


def _base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"bad URL {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"bad URL {url!r}: it must start with http:// or https://")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ValueError(f"bad URL {url!r}: port {parsed.port} is not in 1-65535")
    return url.removesuffix("/v1")


@dataclass(frozen=True)
class Record:
    """One request's outcome. Times in seconds; `sent_s` from the start of the run."""

    index: int
    tenant: str
    model: str
    code: str
    """The HTTP status ("200", "404", …), `stream:<error code>` for an error inside a 200 stream, or
    `connect`, `timeout`, `transport` when no answer came back."""
    tier: str
    sent_s: float
    lag_s: float | None = 0.0
    """How late it left against its trace time (open loop); None in closed loop, where it has no
    time."""
    """Open loop: how late it was sent against its trace time (the generator's own delay)."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.code == "200"

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# -- the trace -------------------------------------------------------------------------------------
def prepare_trace(
    trace: Sequence[Request],
    *,
    duration_s: float | None = None,
    limit: int | None = None,
    adapters: Sequence[str] = (),
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[Request]:
    """The part of a trace to send: its first `duration_s` seconds, at most `limit` requests,
    lengths capped, and with `adapters` given, the trace's adapters renamed to those (see
    `map_adapters`)."""
    out = [r for r in trace if duration_s is None or r.time < duration_s]
    out = out[:limit] if limit is not None else out
    if adapters:
        out = map_adapters(out, adapters)
    return [
        replace(
            r,
            prompt_tokens=min(r.prompt_tokens, max_prompt_tokens or r.prompt_tokens),
            output_tokens=min(r.output_tokens, max_output_tokens or r.output_tokens),
        )
        for r in out
    ]


def map_adapters(trace: Sequence[Request], names: Sequence[str]) -> list[Request]:
    """Rename the trace's adapters to the served `names`: the k-th most requested adapter becomes
    names[k mod n], so the popular ones stay popular. Requests for the base model stay as they
    are."""
    counts = Counter(r.adapter for r in trace if r.adapter is not None)
    order = sorted(counts, key=lambda a: -counts[a])  # stable: ties keep their first appearance
    rename = {a: names[k % len(names)] for k, a in enumerate(order)}
    return [
        r if r.adapter is None else replace(r, adapter=rename[r.adapter], revision="1")
        for r in trace
    ]


def make_prompt(index: int, num_tokens: int, unit: str = "char") -> str:
    """A deterministic prompt of about `num_tokens` tokens. It starts with the request's index, so
    no two requests share a prefix (a server's prefix cache would otherwise make every prompt after
    the first free)."""
    head = f"{index}:"
    if unit == "char":
        body = " ".join(_FILLER[(index + i) % len(_FILLER)] for i in range(num_tokens // 2 + 1))
        return (head + " " + body)[: max(num_tokens, len(head))]
    words = [_FILLER[(index + i) % len(_FILLER)] for i in range(max(0, num_tokens - 2))]
    return " ".join([head, *words])


def completion_body(request: Request, index: int, model: str, unit: str) -> dict:
    return {
        "model": model,
        "prompt": make_prompt(index, request.prompt_tokens, unit),
        "max_tokens": request.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# -- one request -----------------------------------------------------------------------------------
async def send(
    client: httpx.AsyncClient,
    config: LoadConfig,
    request: Request,
    index: int,
    model: str,
    start: float,
    due_s: float | None = None,
) -> Record:
    """Send one streamed completion and time it; never raises for what the server or the network
    does. `due_s`:
    when it should leave (open loop)."""
    t0 = time.perf_counter()
    sent = {
        "index": index,
        "tenant": request.tenant,
        "model": model,
        "sent_s": t0 - start,
        "lag_s": None if due_s is None else max(0.0, t0 - start - due_s),
    }
    body = completion_body(request, index, model, config.prompt_unit)
    try:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers=config.headers(request.tenant)
        ) as r:
            tier = r.headers.get(TIER_HEADER, "")
            tier = tier if tier in TIERS else "unknown"
            if r.status_code != 200:
                await r.aread()
                return Record(
                    **sent, code=str(r.status_code), tier=tier, e2e_s=time.perf_counter() - t0
                )
            code, ttft, tokens = await _read_stream(r, t0)
    except httpx.ConnectError:
        return Record(**sent, code="connect", tier="unknown")
    except httpx.TimeoutException:
        return Record(**sent, code="timeout", tier="unknown")
    except httpx.TransportError:
        return Record(**sent, code="transport", tier="unknown")
    return Record(
        **sent,
        code=code,
        tier=tier,
        ttft_s=ttft,
        e2e_s=time.perf_counter() - t0,
        output_tokens=tokens,
    )


async def _read_stream(r: httpx.Response, t0: float) -> tuple[str, float | None, int]:
    """(code, ttft, completion tokens) from server-sent events; tokens from `usage`, else the text
    chunks."""
    ttft, text_chunks, usage_tokens = None, 0, None
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            return "stream:invalid_json", ttft, text_chunks
        if not isinstance(chunk, dict):  # `null`, a list: JSON, but no event of the API
            return "stream:invalid_event", ttft, text_chunks
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            return f"stream:{error.get('code') or 'error'}", ttft, text_chunks
        listed = chunk.get("choices")
        choices = [c for c in listed if isinstance(c, dict)] if isinstance(listed, list) else []
        has_text = any(c.get("text") for c in choices)
        text_chunks += has_text
        if ttft is None and (has_text or any(c.get("finish_reason") for c in choices)):
            # text, or the end of an answer whose text was all held back
            ttft = time.perf_counter() - t0
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
    return "200", ttft, text_chunks if usage_tokens is None else usage_tokens


# -- a run -----------------------------------------------------------------------------------------
async def run_load(
    config: LoadConfig,
    trace: Sequence[Request],
    on_record: Callable[[Record], None] | None = None,
    per_request: bool = False,
) -> dict:
    """Send the trace (open or closed loop, as `config` says) and return the summary (see
    `summarize`), with every request's record under `records` when `per_request`. Raises LoadError
    when the server cannot be reached."""
    limits = httpx.Limits(
        max_connections=config.clients, max_keepalive_connections=config.clients or 100
    )
    timeout = httpx.Timeout(config.timeout_s, connect=min(30.0, config.timeout_s), pool=None)
    async with httpx.AsyncClient(base_url=config.url, limits=limits, timeout=timeout) as client:
        base_model = await preflight(client, config, trace)
        models = [r.adapter or base_model or "" for r in trace]
        records: list[Record] = []

        def done(record: Record) -> None:
            records.append(record)
            if on_record is not None:
                on_record(record)

        start = time.perf_counter()
        if config.clients is None:
            await _open_loop(client, config, trace, models, start, done)
        else:
            await _closed_loop(client, config, trace, models, start, done)
        duration = time.perf_counter() - start
    records.sort(key=lambda r: r.index)
    summary = {
        "config": {
            "url": config.url,
            "mode": config.mode,
            "clients": config.clients,
            "time_scale": config.time_scale,
            "prompt_unit": config.prompt_unit,
        },
        **summarize(records, duration),
    }
    if per_request:
        summary["records"] = [{**asdict(r), "tpot_s": r.tpot_s} for r in records]
    return summary


def run(
    config: LoadConfig,
    trace: Sequence[Request],
    on_record: Callable[[Record], None] | None = None,
    per_request: bool = False,
) -> dict:
    """`run_load` from synchronous code."""
    return asyncio.run(run_load(config, trace, on_record, per_request))


async def preflight(
    client: httpx.AsyncClient, config: LoadConfig, trace: Sequence[Request]
) -> str | None:
    """Check that the server answers, and find the base model's name when the trace needs it."""
    tenant = trace[0].tenant if trace else ""
    try:
        r = await client.get(
            "/v1/models", headers=config.headers(tenant), timeout=min(30.0, config.timeout_s)
        )
    except httpx.TransportError as exc:
        raise LoadError(f"cannot reach {config.url}: {exc or type(exc).__name__}") from None
    if config.base_model is not None or all(req.adapter is not None for req in trace):
        return config.base_model
    try:
        listing = r.json() if r.status_code == 200 else {}
    except ValueError:
        listing = {}
    listed = listing.get("data") if isinstance(listing, dict) else None
    cards = (
        [c for c in listed if isinstance(c, dict) and isinstance(c.get("id"), str)]
        if isinstance(listed, list)
        else []
    )
    bases = [c["id"] for c in cards if not c.get("parent")]
    if not bases:
        raise LoadError(
            f"the trace asks for the base model and {config.url}/v1/models names none "
            f"(HTTP {r.status_code}): give its name with --base-model"
        )
    return bases[0]


async def _open_loop(client, config: LoadConfig, trace, models, start: float, done) -> None:
    tasks = []

    async def one(i: int, due: float) -> None:
        done(await send(client, config, trace[i], i, models[i], start, due))

    for i, request in enumerate(trace):
        due = request.time * config.time_scale
        delay = start + due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)


async def _closed_loop(client, config: LoadConfig, trace, models, start: float, done) -> None:
    queue = iter(range(len(trace)))  # shared by the clients: each takes the next index

    async def client_loop() -> None:
        for i in queue:
            done(await send(client, config, trace[i], i, models[i], start))

    await asyncio.gather(*(client_loop() for _ in range(min(config.clients, len(trace)) or 1)))


# -- the summary -----------------------------------------------------------------------------------
def percentiles(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50/p95/p99 (linear interpolation) of the values × scale; None for an empty list."""
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    points = np.percentile(np.asarray(values, dtype=float) * scale, PERCENTILES)
    return {f"p{q}": round(float(v), 3) for q, v in zip(PERCENTILES, points)}


def latency(records: Sequence[Record]) -> dict:
    """n and TTFT/TPOT/e2e percentiles in ms over successful records."""
    return {
        "n": len(records),
        "ttft_ms": percentiles([r.ttft_s for r in records if r.ttft_s is not None], 1000),
        "tpot_ms": percentiles([r.tpot_s for r in records if r.tpot_s is not None], 1000),
        "e2e_ms": percentiles([r.e2e_s for r in records if r.e2e_s is not None], 1000),
    }


def summarize(records: Sequence[Record], duration_s: float) -> dict:
    """Throughput, errors by code, the tier split and cold starts, and latency overall and per tier.

    The tier split, the latencies and the cold starts count successful requests only;
    `cold_start_rate` is over those whose tier is known."""
    ok = [r for r in records if r.ok]
    by_tier = {t: [r for r in ok if r.tier == t] for t in TIERS}
    num_known = len(ok) - len(by_tier["unknown"])
    num_cold = sum(len(by_tier[t]) for t in COLD_TIERS)
    num_storage = sum(len(by_tier[t]) for t in STORAGE_TIERS)
    per_s = (lambda x: round(x / duration_s, 3)) if duration_s > 0 else (lambda x: None)
    lags = [r.lag_s for r in records if r.lag_s is not None]
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": round(duration_s, 3),
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "output_tokens_per_s": per_s(sum(r.output_tokens for r in ok)),
        },
        "output_tokens": sum(r.output_tokens for r in ok),
        "errors": dict(sorted(Counter(r.code for r in records if not r.ok).items())),
        "tiers": {t: len(rs) for t, rs in by_tier.items()},
        "cold_starts": num_cold,
        "cold_start_rate": round(num_cold / num_known, 4) if num_known else None,
        "storage_loads": num_storage,
        "storage_load_rate": round(num_storage / num_known, 4) if num_known else None,
        "latency": {"all": latency(ok), **{t: latency(rs) for t, rs in by_tier.items() if rs}},
        "send_lag_ms": percentiles(lags, 1000),
    }
