"""Tiny random models (transformers) and adapters (peft) built locally for the tests; nothing is
downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512


def save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [
        "the quick brown fox jumps over the lazy dog " * 4,
        "hello world, adapters and slots " * 4,
    ]
    tok.train_from_iterator(text, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "chat_template": '
        '"{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\\n{% endfor %}'
        '{% if add_generation_prompt %}assistant:{% endif %}"}'
    )


def make_model(out: Path, kind: str = "llama", **overrides) -> Path:
    """Save a tiny random model of one architecture with its tokenizer; returns the directory."""
    import transformers

    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        eos_token_id=1,
        bos_token_id=0,
    )
    common.update(overrides)
    config = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(head_dim=32, **common),
        "mistral": lambda: transformers.MistralConfig(**{"sliding_window": 8, **common}),
        "phi3": lambda: transformers.Phi3Config(pad_token_id=0, **common),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            **common,
        ),
    }[kind]()
    torch.manual_seed(0)
    model = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }[kind](config)
    with torch.no_grad():  # make biases and norms non-trivial so they are really checked
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # a router that picks its experts clearly
                p.normal_(std=0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(out)
    return out


def make_split_twin(phi3_dir: Path, out: Path) -> Path:
    """The Phi-3 model as a Llama (the same function): its fused weights' rows as the parts'
    weights."""
    import transformers

    phi3 = transformers.Phi3ForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32)
    cfg = phi3.config
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_parameters["rope_theta"],
            eos_token_id=cfg.eos_token_id,
            bos_token_id=cfg.bos_token_id,
        )
    )
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    state = {}
    for key, value in phi3.state_dict().items():
        if key.endswith("qkv_proj.weight"):
            for name, part in zip(("q", "k", "v"), value.split([q, kv, kv])):
                state[key.replace("qkv_proj", f"{name}_proj")] = part
        elif key.endswith("gate_up_proj.weight"):
            for name, part in zip(("gate", "up"), value.chunk(2)):
                state[key.replace("gate_up_proj", f"{name}_proj")] = part
        else:
            state[key] = value
    llama.load_state_dict(state)
    out.mkdir(parents=True)
    llama.save_pretrained(out)
    save_tokenizer(out)
    return out


# name -> LoraConfig arguments; covers ranks 4/8/16, alpha != r, rslora, attention-only, MLP-only,
# patterns.
ADAPTERS = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r4": dict(r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all-r16-rslora": dict(
        r=16,
        lora_alpha=8,
        use_rslora=True,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "pattern": dict(
        r=8,
        lora_alpha=32,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 4},
        alpha_pattern={"down_proj": 3},
        layers_to_transform=[1],
    ),
    "regex-r4": dict(r=4, lora_alpha=6, target_modules=r".*\.(k_proj|up_proj)"),
}


def make_adapter(model_dir: Path, out: Path, seed: int = 0, base=None, **lora_args) -> Path:
    import copy

    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = (
        copy.deepcopy(base)
        if base is not None
        else transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    )
    peft_model = get_peft_model(
        base, LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **lora_args)
    )
    with (
        torch.no_grad()
    ):  # init_lora_weights=False gives non-zero B; make the effect clearly visible
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
            elif "modules_to_save" in name or "trainable_tokens_delta" in name:
                p.add_(torch.randn_like(p) * 0.5)  # full weights and token rows: the trained ones
    peft_model.save_pretrained(out)
    return out


def make_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    return {
        name: make_adapter(model_dir, root / name, seed=i, base=base, **args)
        for i, (name, args) in enumerate(ADAPTERS.items())
    }


def peft_reference(model_dir: Path, adapters: dict[str, Path]):
    """HF transformers + PEFT with every adapter loaded: the reference our numbers are checked
    against."""
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@torch.no_grad()
def reference_logits(model, prompt: list[int], adapter: str | None) -> torch.Tensor:
    return model(torch.tensor([prompt]), adapter_names=[adapter or "__base__"]).logits[0]


@torch.no_grad()
def reference_greedy(
    model, prompt: list[int], adapter: str | None, max_new_tokens: int
) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    if adapter is None:
        with model.disable_adapter():
            out = model.generate(ids, **kwargs)
    else:
        model.set_adapter(adapter)
        out = model.generate(ids, **kwargs)
    return out[0, len(prompt) :].tolist()
