"""PEFT saves the base's own embedding and lm_head weights beside a LoRA on them
(`save_embedding_layers`, as `….base_layer.weight`): the served base has them already, so the
canonical form leaves them out, once their shape shows they are the served base's."""

from __future__ import annotations

import re

from loraplex.formats.draft import Draft
from loraplex.lora_format import AdapterRejected
from loraplex.model_config import ModelConfig

_BASE_COPY = re.compile(r"^base_model\.model\.(?:lm_head|model\.embed_tokens)\.base_layer\.weight$")


def drop_base_copies(draft: Draft, model: ModelConfig) -> Draft:
    """The draft without PEFT's copies of the base's embedding weights; AdapterRejected when a copy
    has another shape than the base's (a resized vocabulary, which this base cannot serve)."""
    copies = [key for key in draft.pieces if _BASE_COPY.fullmatch(key)]
    expected = [model.vocab_size, model.hidden_size]
    for key in copies:
        shape = draft.pieces[key].shape(draft.header)
        if shape != expected:
            raise AdapterRejected(
                "shape",
                f"{key} is {shape}, the base's is {expected}: the adapter was trained on a "
                "resized vocabulary",
            )
        del draft.pieces[key]
    if copies:
        draft.changes.append(
            f"left out {len(copies)} copies of the base's own embedding weights "
            "(PEFT's save_embedding_layers)"
        )
    return draft
