"""The parts of a PEFT adapter beyond LoRA on decoder linear layers, read from its config and
safetensors header (no torch): LoRA on `lm_head` and `embed_tokens`, full replacement weights
(`modules_to_save`) and trainable tokens. DoRA's magnitudes belong to the decoder modules
(`lora_format`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from loraplex.lora_common import DTYPE_BYTES, AdapterRejected, config_selects, rank_and_scaling
from loraplex.model_config import ModelConfig

HEAD_MODULES = ("lm_head", "embed_tokens")
# each head module's name inside the HF model, as PEFT keys it
HEAD_PATHS = {"lm_head": "lm_head", "embed_tokens": "model.embed_tokens"}
TOKENS_KEY = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
_HEAD_KEY = re.compile(
    r"^base_model\.model\.(lm_head|model\.embed_tokens)\."
    r"(lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B|lora_magnitude_vector|weight)$"
)
# the LoRA tensors' names on each head module (PEFT's Linear and Embedding layers)
_LORA_SIDES = {
    "lm_head": {"lora_A.weight": "A", "lora_B.weight": "B", "lora_magnitude_vector": "M"},
    "embed_tokens": {
        "lora_embedding_A": "A",
        "lora_embedding_B": "B",
        "lora_magnitude_vector": "M",
    },
}


@dataclass(frozen=True)
class HeadLora:
    """A LoRA on a head module: on lm_head A is [r, hidden] and B [vocab, r]; on embed_tokens
    (PEFT's lora_embedding_A and _B) A is [r, vocab] and B [hidden, r]."""

    module: str
    rank: int
    scaling: float
    key_a: str
    key_b: str


@dataclass(frozen=True)
class FullWeight:
    """A module in `modules_to_save`: the adapter's own [vocab, hidden] weight replaces the
    base's."""

    module: str
    key: str


@dataclass(frozen=True)
class TrainableTokens:
    """PEFT's trainable tokens: the embedding rows of `indices` replaced by the stored [n, hidden]
    rows; `tied`: the base ties lm_head to the embedding, so lm_head's rows are replaced too."""

    indices: tuple[int, ...]
    key: str
    tied: bool


@dataclass(frozen=True)
class Variants:
    head_loras: tuple[HeadLora, ...] = ()
    full: tuple[FullWeight, ...] = ()
    tokens: TrainableTokens | None = None
    elements: int = 0  # numbers in their tensors
    estimated_bytes: int = 0  # their bytes as stored

    @property
    def empty(self) -> bool:
        return not (self.head_loras or self.full or self.tokens)

    def keys(self) -> list[str]:
        """Every tensor they read."""
        keys = [k for h in self.head_loras for k in (h.key_a, h.key_b)]
        keys += [f.key for f in self.full]
        return keys + ([self.tokens.key] if self.tokens else [])


def is_variant_key(key: str) -> bool:
    return key == TOKENS_KEY or _HEAD_KEY.fullmatch(key) is not None


def check_variant_config(config: dict) -> None:
    """The config fields of the variants: modules_to_save, trainable_token_indices, weight tying."""
    saved = config.get("modules_to_save") or []
    if not isinstance(saved, list) or any(m not in HEAD_MODULES for m in saved):
        raise AdapterRejected(
            "modules_to_save",
            f"{saved} is not supported; only full weights of lm_head and embed_tokens",
        )
    if config.get("ensure_weight_tying"):
        raise AdapterRejected(
            "ensure_weight_tying", "adapters that tie lm_head to embed_tokens are not supported"
        )
    indices = config.get("trainable_token_indices")
    if isinstance(indices, dict):
        if set(indices) - {"embed_tokens"}:
            raise AdapterRejected(
                "trainable_token_indices",
                f"trainable tokens on {sorted(set(indices) - {'embed_tokens'})} are not "
                "supported; only on embed_tokens",
            )
        indices = indices.get("embed_tokens")
    if indices is not None and not (
        isinstance(indices, list) and all(type(i) is int for i in indices)
    ):
        raise AdapterRejected("trainable_token_indices", f"{indices!r} is not a list of token ids")


def read_variants(
    config: dict, header: dict, keys: list[str], model: ModelConfig, max_rank: int
) -> Variants:
    """The variants the tensors `keys` of the header make, checked against the config and the
    base; AdapterRejected naming what does not fit."""
    by_module: dict[str, dict[str, str]] = {}
    token_key = None
    for key in keys:
        if key == TOKENS_KEY:
            token_key = key
            continue
        match = _HEAD_KEY.fullmatch(key)
        assert match is not None  # is_variant_key
        module = "lm_head" if match[1] == "lm_head" else "embed_tokens"
        side = "full" if match[2] == "weight" else _LORA_SIDES[module].get(match[2])
        if side is None:
            raise AdapterRejected("weights", f"{key} is not a LoRA tensor of {module}")
        by_module.setdefault(module, {})[side] = key
    head_loras, full = [], []
    for module, sides in sorted(by_module.items()):
        if "full" in sides:
            full.append(_full_weight(config, header, model, module, sides))
        if set(sides) - {"full"}:
            head_loras.append(_head_lora(config, header, model, max_rank, module, sides))
    tokens = _trainable_tokens(config, header, model, token_key)
    _check_combinations(config, model, head_loras, full, tokens)
    keys = [k for h in head_loras for k in (h.key_a, h.key_b)] + [f.key for f in full]
    keys += [tokens.key] if tokens else []
    elements = sum(math.prod(header[k]["shape"]) for k in keys)
    stored = sum(math.prod(header[k]["shape"]) * DTYPE_BYTES[header[k]["dtype"]] for k in keys)
    return Variants(tuple(head_loras), tuple(full), tokens, elements, stored)


def _check_dtype(header: dict, key: str) -> None:
    if header[key]["dtype"] not in DTYPE_BYTES:
        raise AdapterRejected(
            "dtype", f"{key} has dtype {header[key]['dtype']}; allowed: {', '.join(DTYPE_BYTES)}"
        )


def _full_weight(config: dict, header: dict, model: ModelConfig, module: str, sides) -> FullWeight:
    key = sides["full"]
    _check_dtype(header, key)
    if module not in (config.get("modules_to_save") or []):
        raise AdapterRejected(
            "modules_to_save",
            f"{key} is a full {module} weight, but the config's modules_to_save does not name "
            f"{module} (PEFT would not load it)",
        )
    expected = [model.vocab_size, model.hidden_size]
    if header[key]["shape"] != expected:
        raise AdapterRejected(
            "shape", f"{key} is {header[key]['shape']}; the base's {module} is {expected}"
        )
    return FullWeight(module, key)


def _head_lora(
    config: dict, header: dict, model: ModelConfig, max_rank: int, module: str, sides
) -> HeadLora:
    if config.get("use_dora") or "M" in sides:
        raise AdapterRejected("use_dora", f"DoRA on {module} is not supported")
    if set(sides) - {"full"} != {"A", "B"}:
        raise AdapterRejected("weights", f"{module}: lora_A and lora_B must both be present")
    for side in ("A", "B"):
        _check_dtype(header, sides[side])
    vocab, hidden = model.vocab_size, model.hidden_size
    d_in, d_out = (hidden, vocab) if module == "lm_head" else (vocab, hidden)
    shape_a, shape_b = header[sides["A"]]["shape"], header[sides["B"]]["shape"]
    rank = shape_a[0] if len(shape_a) == 2 else -1
    if rank < 1 or shape_a != [rank, d_in] or shape_b != [d_out, rank]:
        raise AdapterRejected(
            "shape",
            f"{module}: A {shape_a} and B {shape_b} do not fit the base "
            f"(expected [r, {d_in}] and [{d_out}, r])",
        )
    if rank > max_rank:
        raise AdapterRejected("rank", f"rank {rank} of {module} is above max_lora_rank {max_rank}")
    path = HEAD_PATHS[module]
    targets = config.get("target_modules")
    if targets == "all-linear" or not config_selects(config, path, None):
        raise AdapterRejected(
            "target_modules",
            f"{module} has LoRA weights, but the config's target_modules do not select it (PEFT "
            "would not load them)",
        )
    r, scaling = rank_and_scaling(config, path)
    if r != rank:
        raise AdapterRejected("r", f"{module}: config says rank {r}, tensors have {rank}")
    return HeadLora(module, rank, scaling, sides["A"], sides["B"])


def _trainable_tokens(
    config: dict, header: dict, model: ModelConfig, key: str | None
) -> TrainableTokens | None:
    indices = config.get("trainable_token_indices")
    if isinstance(indices, dict):
        indices = indices.get("embed_tokens")
    if not indices and key is None:
        return None
    if not indices or key is None:
        raise AdapterRejected(
            "trainable_token_indices",
            "the config's trainable_token_indices and the tensor "
            f"{TOKENS_KEY.rsplit('.', 1)[-1]} come together; one is missing",
        )
    _check_dtype(header, key)
    if len(set(indices)) != len(indices) or not all(0 <= i < model.vocab_size for i in indices):
        raise AdapterRejected(
            "trainable_token_indices",
            f"token ids must be distinct and below the vocabulary size {model.vocab_size}",
        )
    expected = [len(indices), model.hidden_size]
    if header[key]["shape"] != expected:
        raise AdapterRejected(
            "shape", f"{key} is {header[key]['shape']}; {len(indices)} tokens need {expected}"
        )
    return TrainableTokens(tuple(indices), key, model.tie_word_embeddings)


def _check_combinations(config, model: ModelConfig, head_loras, full, tokens) -> None:
    """Refuse what two variants on one module would make ambiguous."""
    lora = {h.module for h in head_loras}
    for f in full:
        if f.module in lora:
            raise AdapterRejected(
                "modules_to_save", f"{f.module} carries both a LoRA and full weights"
            )
    missing = set(config.get("modules_to_save") or []) - {f.module for f in full}
    if missing:
        raise AdapterRejected(
            "modules_to_save", f"the config names {sorted(missing)}, but no full weights are stored"
        )
    if tokens is None:
        return
    on_embedding = lora | {f.module for f in full}
    if "embed_tokens" in on_embedding or (tokens.tied and "lm_head" in on_embedding):
        raise AdapterRejected(
            "trainable_token_indices",
            "trainable tokens beside a LoRA or full weights on the embedding are not supported",
        )
