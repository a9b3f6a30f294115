"""Training and checking the demo models with plain torch, transformers and peft (imported only to build)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from loraplex.demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, SEP_ID, VOCAB_SIZE, encode_text
from loraplex.demo.transforms import INPUT_ALPHABET, OUTPUT_ALPHABET, random_string

IGNORE = -100
BOS_DROP_RATE = 0.25
"""Share of training prompts without `<s>`, so a client that sends just `TEXT<sep>` still gets the answer."""

Progress = Callable[[int], None]  # called with the number of steps just done


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float
    batch_size: int = 64
    warmup: int = 30
    weight_decay: float = 0.0


def base_config() -> LlamaConfig:
    """4 layers, hidden 128, head_dim 32 (vLLM on CPU refuses head size 16), grouped-query attention."""
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


def make_batch(pairs: list[tuple[str, str]], rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `<s>IN<sep>OUT</s>` rows with labels on `OUT</s>` only; input_ids and labels are [B, S]."""
    rows, labels = [], []
    for text, target in pairs:
        prompt = ([BOS_ID] if rng.random() >= BOS_DROP_RATE else []) + encode_text(text) + [SEP_ID]
        answer = encode_text(target) + [EOS_ID]
        rows.append(prompt + answer)
        labels.append([IGNORE] * len(prompt) + answer)
    width = max(len(row) for row in rows)
    # Right padding needs no attention mask: causal attention keeps the pads out of every real position.
    input_ids = torch.tensor([row + [PAD_ID] * (width - len(row)) for row in rows])
    label_ids = torch.tensor([row + [IGNORE] * (width - len(row)) for row in labels])
    return input_ids, label_ids


def _lr_lambda(config: TrainConfig) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to 10%."""

    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


def _train(model: torch.nn.Module, sample: Callable[[random.Random], tuple[str, str]], config: TrainConfig,
           seed: int, progress: Progress | None) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config))
    rng = random.Random(seed)
    model.train()
    for _ in range(config.steps):
        input_ids, labels = make_batch([sample(rng) for _ in range(config.batch_size)], rng)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        if progress:
            progress(1)
    model.eval()


def train_base(config: TrainConfig, seed: int, exclude: set[str], progress: Progress | None = None):
    """A fresh Llama trained to copy strings over the whole output alphabet (so every output byte is trained)."""

    def sample(rng: random.Random) -> tuple[str, str]:
        alphabet = INPUT_ALPHABET if rng.random() < 0.5 else OUTPUT_ALPHABET
        text = random_string(rng, alphabet)
        while text in exclude:
            text = random_string(rng, alphabet)
        return text, text

    torch.manual_seed(seed)
    model = LlamaForCausalLM(base_config())
    _train(model, sample, config, seed, progress)
    return model


def train_adapter(base_dir: Path, transform: Callable[[str], str], lora: LoraConfig, config: TrainConfig,
                  seed: int, exclude: set[str], progress: Progress | None = None) -> PeftModel:
    """A LoRA adapter on the frozen base that maps lowercase strings to `transform(text)`."""

    def sample(rng: random.Random) -> tuple[str, str]:
        text = random_string(rng)
        while text in exclude:
            text = random_string(rng)
        return text, transform(text)

    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, lora)
    _train(model, sample, config, seed, progress)
    return model


def _answer(tokens: list[int]) -> str | None:
    """The text before `</s>`, or None when `</s>` never came or another special token came first."""
    if EOS_ID not in tokens:
        return None
    answer = tokens[:tokens.index(EOS_ID)]
    if any(t >= 256 for t in answer):
        return None
    return bytes(answer).decode("utf-8", "replace")


@torch.no_grad()
def greedy_outputs(model: torch.nn.Module, inputs: list[str], max_new_tokens: int,
                   batch_size: int = 128) -> list[str | None]:
    """Greedy completions of `<s>TEXT<sep>` prompts with transformers' generate, cut at `</s>`."""
    outputs = []
    for start in range(0, len(inputs), batch_size):
        prompts = [[BOS_ID, *encode_text(text), SEP_ID] for text in inputs[start:start + batch_size]]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])  # left padding
        attention_mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        generated = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        )
        outputs += [_answer(row) for row in generated[:, width:].tolist()]
    return outputs


def exact_match(model: torch.nn.Module, transform: Callable[[str], str], inputs: list[str]) -> float:
    """Share of inputs whose greedy completion is exactly `transform(text)` followed by `</s>`."""
    expected = [transform(text) for text in inputs]
    max_new = max(len(e.encode("utf-8")) for e in expected) + 1
    outputs = greedy_outputs(model, inputs, max_new)
    return sum(o == e for o, e in zip(outputs, expected)) / len(inputs)

