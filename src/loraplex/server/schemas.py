"""OpenAI request and response shapes for /v1/completions, /v1/chat/completions and /v1/models.

Every standard OpenAI field is accepted; one we do not implement is refused with 400 only when it is
set to a value that would change the answer. vLLM's `top_k`, `min_p`, `best_of`, `ignore_eos`,
`min_tokens`, `repetition_penalty`, `echo` (chat too) and `return_token_ids` (completions) are
implemented, with vLLM's meanings. Any other field is refused with 400 naming it."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.engines.requests import SamplingParams, StructuredOutput
from loraplex.server.errors import APIError

MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    include_obfuscation: bool | None = (
        None  # padding against side channels: no effect on the content
    )


class _Request(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: Any = None
    # vLLM extensions
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None

    def check_supported(self) -> None:
        """400 for a standard field we do not implement, when it is set to a non-default value."""
        for name, is_default in self._unimplemented().items():
            value = getattr(self, name)
            if value is not None and not is_default(value):
                raise APIError(
                    400,
                    f"{name}={value!r} is not supported by this server",
                    "unsupported_parameter",
                    name,
                )
        if self.stream and (self.best_of or 1) > (self.n or 1):
            raise APIError(
                400,
                "best_of greater than n cannot be streamed (the best are known at the end)",
                "invalid_value",
                "best_of",
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400,
                "stream_options is only allowed with stream: true",
                "invalid_value",
                "stream_options",
            )

    def _unimplemented(self) -> dict:
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self,
        vocab_size: int,
        default_max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Engine parameters; a bad value is an InvalidRequest naming the field."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", "invalid_value", "stop")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise APIError(400, "temperature must be in [0, 2]", "invalid_value", "temperature")
        return SamplingParams(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            n=1 if self.n is None else self.n,
            best_of=self.best_of,
            seed=self.seed,
            stop=tuple(stop),
            ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=_logit_bias(self.logit_bias, vocab_size),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured_output(self.response_format),
        )


def structured_output(response_format: Any) -> StructuredOutput | None:
    """`response_format` as vLLM reads it: `text` (none), `json_object`, or `json_schema` with its
    `schema`."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise APIError(
                400,
                "response_format of type json_schema needs json_schema.schema, a JSON schema",
                "invalid_value",
                "response_format",
            )
        return StructuredOutput(json_schema=json.dumps(schema))
    raise APIError(
        400,
        "response_format type must be text, json_object or json_schema",
        "invalid_value",
        "response_format",
    )


_TOKEN_ID = re.compile(r"[0-9]+")


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = []
    for token, value in (bias or {}).items():
        if (
            not _TOKEN_ID.fullmatch(token) or int(token) >= vocab_size
        ):  # ASCII digits ("²" is a digit to isdigit)
            raise APIError(
                400,
                f"logit_bias key {token!r} is not a token id in [0, {vocab_size})",
                "invalid_value",
                "logit_bias",
            )
        if not -100 <= value <= 100:
            raise APIError(
                400, "logit_bias values must be in [-100, 100]", "invalid_value", "logit_bias"
            )
        out.append((int(token), float(value)))
    return tuple(out)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    """The prompt before each choice's text (with logprobs, its tokens' logprobs before theirs)."""
    suffix: str | None = None
    return_token_ids: bool | None = None
    """vLLM's: each choice also gives `prompt_token_ids` and its output's `token_ids`."""

    def _unimplemented(self) -> dict:
        return {"suffix": lambda v: v == ""}

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", "invalid_value", "prompt")
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict:
        """The message as the chat template sees it, with text parts joined."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(
                    400,
                    "only text content parts are supported",
                    "unsupported_parameter",
                    "messages",
                )
            content = "".join(part.text or "" for part in content)
        return {**self.model_dump(exclude_none=True), "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    echo: bool | None = None
    """vLLM's: the last message's content before each choice's, when that message is the
    assistant's."""
    # Standard fields that do not change the answer here: accepted with any value.
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # Standard fields we do not implement: refused unless default (see _unimplemented).
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    modalities: Any = None
    moderation: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None
    store: Any = None
    tool_choice: Any = None
    tools: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    def _unimplemented(self) -> dict:
        return {
            "audio": lambda v: False,
            "function_call": lambda v: v in ("none", "auto"),
            "functions": lambda v: v == [],
            "modalities": lambda v: v == ["text"],
            "moderation": lambda v: False,
            "prediction": lambda v: False,
            "reasoning_effort": lambda v: False,
            "service_tier": lambda v: v in ("auto", "default"),
            "store": lambda v: v is False,
            "tool_choice": lambda v: v in ("none", "auto"),
            "tools": lambda v: v == [],
            "verbosity": lambda v: False,
            "web_search_options": lambda v: v == {},
        }

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(
                400, "top_logprobs needs logprobs: true", "invalid_value", "top_logprobs"
            )
        if (
            self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20
        ):  # named as the client sent it
            raise APIError(400, "top_logprobs must be in [0, 20]", "invalid_value", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(
                400,
                "set max_tokens or max_completion_tokens, not both",
                "invalid_value",
                "max_completion_tokens",
            )
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses -----------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    request_id: str, model: str, choices: list[dict], usage_: dict | None, chunk: bool = False
) -> dict:
    out = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if usage_ is not None or not chunk:
        out["usage"] = usage_
    return out


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def with_token_ids(choice: dict, prompt_token_ids: list[int] | None, token_ids: list[int]) -> dict:
    """A completion choice with vLLM's `return_token_ids` fields (`prompt_token_ids` None in a
    stream's later chunks, as vLLM gives them)."""
    return {**choice, "prompt_token_ids": prompt_token_ids, "token_ids": token_ids}


def chat(
    request_id: str, model: str, choices: list[dict], usage_: dict | None, chunk: bool = False
) -> dict:
    out = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if usage_ is not None or not chunk:
        out["usage"] = usage_
    return out


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_delta(
    index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None
) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_logprobs(entries: list[dict], decode, offset: int) -> dict:
    """The completions shape: parallel lists of tokens, their logprobs, top alternatives and text
    offsets."""
    tokens = [decode([e["token"]]) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        # the sampled token too, as vLLM and OpenAI's legacy completions give it (so logprobs=0
        # names it) None for a token with no logprob (an echoed prompt's first)
        "top_logprobs": [
            {**{decode([t]): lp for t, lp in e["top"]}, token: e["logprob"]}
            if e["top"] is not None
            else None
            for token, e in zip(tokens, entries)
        ],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[dict], decode) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
            for e in entries
        ],
        "refusal": None,
    }


def model_card(model_id: str, owned_by: str, parent: str | None, root: str | None = None) -> dict:
    return {
        "id": model_id,
        "object": "model",
        "created": int(time.time()),
        "owned_by": owned_by,
        "root": root or model_id,
        "parent": parent,
    }
