"""Training and checking the demo models: plain torch AdamW on transformers' Llama, LoRA through
peft.

Training is data-parallel: every rank holds the same model, samples its own share of each batch and
averages gradients with the other ranks (torch.distributed), so the ranks stay bit-identical.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from loraplex.demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, SEP_ID, VOCAB_SIZE, encode_text
from loraplex.demo.transforms import (
    INPUT_ALPHABET,
    MAX_LEN,
    MIN_LEN,
    OUTPUT_ALPHABET,
    random_string,
)

IGNORE = -100
BOS_DROP_RATE = 0.25
"""Share of training prompts without `<s>`, so a client that sends just `TEXT<sep>` still gets the
answer."""

Progress = Callable[[int], None]  # called with the number of steps just done
Sampler = Callable[[random.Random, int], tuple[str, str]]  # (rng, input length) -> (input, target)


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float
    batch_size: int = 64
    """Across all ranks."""
    warmup: int = 30
    lr_b_ratio: float = 1.0
    """LoRA+: lora_B's learning rate is lr times this; it makes LoRA learn in fewer steps."""


def base_config() -> LlamaConfig:
    """4 layers, hidden 128, head_dim 32 (vLLM on CPU refuses head size 16), grouped-query
    attention."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        dtype="float32",
    )


@dataclass(frozen=True)
class Batch:
    """Examples packed side by side into rows, each attending only to itself."""

    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W], from 0 at the start of every example
    attention_mask: torch.Tensor  # [R, 1, W, W] bool: causal, within one example
    labels: torch.Tensor  # [R, W], IGNORE except on `OUT</s>`


def make_batch(pairs: list[tuple[str, str]], rng: random.Random, row_width: int = 64) -> Batch:
    """`<s>IN<sep>OUT</s>` examples packed into rows of `row_width` tokens.

    Packing instead of padding every example to the longest saves a third of the compute; the
    block-diagonal mask and restarted positions make each example's logits exactly what they would
    be alone.
    """
    examples = []
    for text, target in pairs:
        prompt = ([BOS_ID] if rng.random() >= BOS_DROP_RATE else []) + encode_text(text) + [SEP_ID]
        answer = encode_text(target) + [EOS_ID]
        examples.append((prompt + answer, [IGNORE] * len(prompt) + answer))
    rows = _pack(examples, max(row_width, max(len(ids) for ids, _ in examples)))
    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    input_ids, position_ids, labels, segments = [], [], [], []
    for row in rows:
        pad = width - sum(len(ids) for ids, _ in row)
        input_ids.append([t for ids, _ in row for t in ids] + [PAD_ID] * pad)
        labels.append([t for _, lab in row for t in lab] + [IGNORE] * pad)
        position_ids.append([p for ids, _ in row for p in range(len(ids))] + [0] * pad)
        # Each pad is a segment of its own, so its attention row is never empty.
        segments.append(
            [i for i, (ids, _) in enumerate(row) for _ in ids] + [-1 - j for j in range(pad)]
        )
    segment_ids = torch.tensor(segments)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
    return Batch(
        torch.tensor(input_ids), torch.tensor(position_ids), mask[:, None], torch.tensor(labels)
    )


def _pack(
    examples: list[tuple[list[int], list[int]]], row_width: int
) -> list[list[tuple[list[int], list[int]]]]:
    """First-fit decreasing: longest examples first, each into the first row with room."""
    rows: list[list[tuple[list[int], list[int]]]] = []
    room: list[int] = []
    for example in sorted(examples, key=lambda e: -len(e[0])):
        size = len(example[0])
        index = next((i for i, free in enumerate(room) if free >= size), None)
        if index is None:
            rows.append([])
            room.append(row_width)
            index = len(rows) - 1
        rows[index].append(example)
        room[index] -= size
    return rows


def _lr_factor(config: TrainConfig) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to 10%."""

    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        done = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * done))

    return factor


def _world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _average_gradients(params: list[torch.nn.Parameter], world_size: int) -> None:
    """One all-reduce over all gradients, flattened; every rank ends with the same averaged
    values."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(chunk.view_as(grad))


def _train(
    model: torch.nn.Module,
    sample: Sampler,
    config: TrainConfig,
    seed: int,
    progress: Progress | None,
) -> None:
    rank, world_size = _world()
    if config.batch_size % world_size:
        raise ValueError(f"batch size {config.batch_size} does not split over {world_size} ranks")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    groups = [
        {"params": [p for name, p in named if "lora_B" not in name], "lr": config.lr},
        {
            "params": [p for name, p in named if "lora_B" in name],
            "lr": config.lr * config.lr_b_ratio,
        },
    ]
    groups = [group for group in groups if group["params"]]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(config))
    rng = random.Random(f"{seed}-rank{rank}")
    model.train()
    for _ in range(config.steps):
        pairs = [
            sample(rng, rng.randint(MIN_LEN, MAX_LEN))
            for _ in range(config.batch_size // world_size)
        ]
        batch = make_batch(pairs, rng)
        loss = model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            labels=batch.labels,
        ).loss
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        if world_size > 1:
            _average_gradients(params, world_size)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        if progress:
            progress(1)
    model.eval()


def _training_string(rng: random.Random, length: int, alphabet: str, exclude: set[str]) -> str:
    """A random string not in `exclude`; half of them with runs of a repeated letter (like
    "xttvvv").

    Uniform strings seldom have runs, and runs are where copying goes wrong: with one letter twice
    in a row, the model must count positions rather than find the letter.
    """
    while True:
        if rng.random() < 0.5:
            text = random_string(rng, length, alphabet)
        else:
            chars = [rng.choice(alphabet)]
            while len(chars) < length:
                chars.append(chars[-1] if rng.random() < 0.3 else rng.choice(alphabet))
            text = "".join(chars)
        if text not in exclude:
            return text


def train_base(
    config: TrainConfig, seed: int, exclude: set[str], progress: Progress | None = None
) -> LlamaForCausalLM:
    """A fresh Llama trained to copy strings over the whole output alphabet (so every output byte is
    trained)."""

    def sample(rng: random.Random, length: int) -> tuple[str, str]:
        alphabet = INPUT_ALPHABET if rng.random() < 0.5 else OUTPUT_ALPHABET
        text = _training_string(rng, length, alphabet, exclude)
        return text, text

    torch.manual_seed(seed)
    model = LlamaForCausalLM(base_config())
    _train(model, sample, config, seed, progress)
    return model


def train_adapter(
    base: LlamaForCausalLM,
    transform: Callable[[str], str],
    lora: LoraConfig,
    config: TrainConfig,
    seed: int,
    exclude: set[str],
    progress: Progress | None = None,
) -> PeftModel:
    """A LoRA adapter on a frozen copy of `base` that maps lowercase strings to
    `transform(text)`."""

    def sample(rng: random.Random, length: int) -> tuple[str, str]:
        text = _training_string(rng, length, INPUT_ALPHABET, exclude)
        return text, transform(text)

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), lora)
    _train(model, sample, config, seed, progress)
    return model


def _answer(tokens: list[int]) -> str | None:
    """The text before `</s>`, or None when `</s>` never came or another special token came
    first."""
    if EOS_ID not in tokens:
        return None
    answer = tokens[: tokens.index(EOS_ID)]
    if any(t >= 256 for t in answer):
        return None
    return bytes(answer).decode("utf-8", "replace")


@torch.no_grad()
def greedy_outputs(
    model: torch.nn.Module, inputs: list[str], max_new_tokens: int, batch_size: int = 128
) -> list[str | None]:
    """Greedy completions of `<s>TEXT<sep>` prompts with transformers' generate, cut at `</s>`."""
    outputs: list[str | None] = []
    for start in range(0, len(inputs), batch_size):
        prompts = [
            [BOS_ID, *encode_text(text), SEP_ID] for text in inputs[start : start + batch_size]
        ]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])  # left padding
        attention_mask = (input_ids != PAD_ID).long()
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
        outputs += [_answer(row) for row in generated[:, width:].tolist()]
    return outputs


def exact_match(
    model: torch.nn.Module, transform: Callable[[str], str], inputs: list[str]
) -> float:
    """Share of inputs whose greedy completion is exactly `transform(text)` then `</s>`; split over
    the ranks."""
    rank, world_size = _world()
    mine = inputs[rank::world_size]
    expected = [transform(text) for text in mine]
    max_new = max(len(e.encode("utf-8")) for e in expected) + 1
    matches = sum(o == e for o, e in zip(greedy_outputs(model, mine, max_new), expected))
    if world_size > 1:
        total = torch.tensor([matches])
        dist.all_reduce(total)
        matches = int(total.item())
    return matches / len(inputs)
