"""Structured outputs (`response_format`): JSON grammars compiled by xgrammar, one matcher per
sequence, and each structured row's allowed tokens applied to its row of the step's logits (the
other rows untouched)."""

from __future__ import annotations

import threading

import torch

from loraplex.engines.native.errors import InvalidRequest
from loraplex.engines.native.sequence import Sequence, StructuredOutput
from loraplex.engines.native.tokenizer import Tokenizer


class Grammars:
    """Compiles a request's grammar into a fresh matcher; the compiler (and its cache) is built at
    first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = eos_ids
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        with self._lock:
            if self._compiler is None:
                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self._vocab_size, stop_token_ids=list(self._eos_ids) or None
                )
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def matcher(self, spec: StructuredOutput):
        """A matcher at the grammar's start; a schema xgrammar refuses is an InvalidRequest on
        response_format."""
        import xgrammar as xgr

        compiler = self._get_compiler()
        schema = spec.json_schema if spec.json_schema is not None else '{"type": "object"}'
        try:
            compiled = compiler.compile_json_schema(schema)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequest(
                "response_format", f"response_format: the JSON schema cannot be used: {reason}"
            ) from None
        return xgr.GrammarMatcher(compiled)


def grammar_mask(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """-inf in each structured row for the tokens its grammar does not allow next."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    for j, i in enumerate(rows):
        seqs[i].matcher.fill_next_token_bitmask(bitmask, j)
    part = logits[rows]
    xgr.apply_token_bitmask_inplace(part, bitmask.to(logits.device))
    logits[rows] = part
