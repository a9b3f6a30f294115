"""Tokenizer from `tokenizer.json` and chat template from `tokenizer_config.json` (jinja2, plain
fallback)."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from loraplex.model_config import ModelConfigError


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ModelConfigError(f"{model_dir}: missing tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 (the tokenizers library raises a bare Exception for a bad file)
            raise ModelConfigError(f"{model_dir}: tokenizer.json: {exc}") from None
        config_path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if not isinstance(config, dict):
            raise ModelConfigError(f"{model_dir}: tokenizer_config.json is not a JSON object")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(template) if template else None
        except jinja2.TemplateSyntaxError as exc:
            raise ModelConfigError(
                f"{model_dir}: tokenizer_config.json: chat_template: {exc}"
            ) from None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object (for libraries that build on it, as xgrammar does)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def output_decoder(self, prompt_ids: list[int]) -> OutputDecoder:
        return OutputDecoder(self._tok, prompt_ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except Exception as exc:  # noqa: BLE001 (the messages reach the template: a TypeError there is theirs too)
            raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def _raise(message: str):
    raise jinja2.TemplateError(message)


class OutputDecoder:
    """Decodes a sequence's output a token at a time, as vLLM's incremental detokenizer: primed with
    the last prompt tokens, so the text comes out as it reads after the prompt (a SentencePiece
    tokenizer drops the space it marks on the first token of a text, which the output's first token
    is not)."""

    def __init__(self, tok: HFTokenizer, prompt_ids: list[int]):
        self._tok = tok
        self._stream = DecodeStream(ids=prompt_ids[-8:], skip_special_tokens=True)

    def step(self, token: int) -> str:
        """The text `token` completes ("" while the output ends in half a character)."""
        try:
            return self._stream.step(self._tok, token) or ""
        except Exception as exc:  # tokenizers raises a bare Exception
            if not str(exc).startswith("Invalid prefix encountered"):
                raise
            # Output that is not monotonic UTF-8 breaks the stream's state: start a new one.
            self._stream = DecodeStream(skip_special_tokens=True)
            return self._stream.step(self._tok, token) or ""
