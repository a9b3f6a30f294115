"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over flattened tokens, a paged KV cache and LoRA slots."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.lora import MODULE_INDEX, LoraGroups, LoRASlotPool, add_lora
from loraplex.model_config import ModelConfig


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk in the step: its tokens [first, first + length) of the step, at
    positions [start, start + length) of the sequence."""

    first: int
    length: int
    start: int = 0
    # [start + length] flat KV positions it attends to, when start > 0
    context: torch.Tensor | None = None


@dataclass
class AttentionMeta:
    """Where the step's tokens sit; built once per step by the runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] flat KV-cache position each new token writes to
    positions: torch.Tensor  # [T]
    prefills: list[PrefillSpan]
    decode_tokens: torch.Tensor | None = None  # [B] token index of each decoding sequence
    decode_kv: torch.Tensor | None = (
        None  # [B, L] flat KV-cache positions of each decoding sequence's context
    )
    decode_lens: torch.Tensor | None = None  # [B] context length, the new token included
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, L] True where a decoding token may attend."""
        if window not in self._masks:
            cols = torch.arange(self.decode_kv.shape[1], device=self.decode_kv.device)
            lens = self.decode_lens[:, None]
            mask = cols[None, :] < lens
            if window is not None:
                mask &= cols[None, :] > lens - 1 - window
            self._masks[window] = mask[:, None, None, :]
        return self._masks[window]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LoRALinear(nn.Linear):
    """A linear layer that adds each token's adapter delta from the slot pool."""

    lora_a: torch.Tensor | None = None  # [max_loras, max_rank, d_in], a view into the slot pool
    lora_bt: torch.Tensor | None = None  # [max_loras, max_rank, d_out]

    def __init__(self, d_in: int, d_out: int, bias: bool, name: str):
        super().__init__(d_in, d_out, bias=bias)
        self.index = MODULE_INDEX[name]

    def forward(self, x: torch.Tensor, lora: list[LoraGroups] | None) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if lora is not None and self.lora_a is not None:
            add_lora(y, x, self.lora_a, self.lora_bt, lora[self.index])
        return y


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope = cfg.rope_scaling
    if rope["rope_type"] == "linear":
        return inv_freq / rope["factor"]
    if rope["rope_type"] == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.window = window
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = LoRALinear(cfg.hidden_size, q_dim, bias, "q_proj")
        self.k_proj = LoRALinear(cfg.hidden_size, kv_dim, bias, "k_proj")
        self.v_proj = LoRALinear(cfg.hidden_size, kv_dim, bias, "v_proj")
        self.o_proj = LoRALinear(q_dim, cfg.hidden_size, False, "o_proj")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self, x, cos, sin, attn: AttentionMeta, kv: tuple[torch.Tensor, torch.Tensor], lora
    ):
        n = x.shape[0]
        q = self.q_proj(x, lora).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x, lora).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, lora).view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv  # [num_positions, kv_heads, head_dim]
        k_cache[attn.slot_mapping] = k
        v_cache[attn.slot_mapping] = v
        out = torch.empty_like(q)
        for span in attn.prefills:
            rows = slice(span.first, span.first + span.length)
            out[rows] = self._prefill(q, k, v, span, k_cache, v_cache)
        if attn.decode_tokens is not None:
            out[attn.decode_tokens] = self._decode(q[attn.decode_tokens], k_cache, v_cache, attn)
        return self.o_proj(out.view(n, -1), lora)

    def _prefill(self, q, k, v, span: PrefillSpan, k_cache, v_cache):
        # [L, H, D] -> [1, H, L, D]
        first, length = span.first, span.length
        q = q[first : first + length].transpose(0, 1).unsqueeze(0)
        if span.context is None:  # from position 0: the chunk's own keys and values
            k, v = (t[first : first + length].transpose(0, 1).unsqueeze(0) for t in (k, v))
        # a later chunk: every earlier position's keys and values, from the cache (this chunk's are
        # in)
        else:
            k, v = (c[span.context].transpose(0, 1).unsqueeze(0) for c in (k_cache, v_cache))
        if span.start == 0 and (self.window is None or length <= self.window):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            rows = torch.arange(span.start, span.start + length, device=q.device)[:, None]
            cols = torch.arange(span.start + length, device=q.device)[None, :]
            mask = cols <= rows
            if self.window is not None:
                mask &= cols > rows - self.window
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)

    def _decode(self, q, k_cache, v_cache, attn: AttentionMeta):
        # q: [B, H, D] -> [B, H, 1, D]; context gathered from the paged cache: [B, kv_heads, L, D]
        k = k_cache[attn.decode_kv].transpose(1, 2)
        v = v_cache[attn.decode_kv].transpose(1, 2)
        mask = attn.decode_mask(self.window)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return out.squeeze(2)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = LoRALinear(cfg.hidden_size, cfg.intermediate_size, False, "gate_proj")
        self.up_proj = LoRALinear(cfg.hidden_size, cfg.intermediate_size, False, "up_proj")
        self.down_proj = LoRALinear(cfg.intermediate_size, cfg.hidden_size, False, "down_proj")

    def forward(self, x, lora):
        return self.down_proj(F.silu(self.gate_proj(x, lora)) * self.up_proj(x, lora), lora)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None):
        super().__init__()
        self.self_attn = Attention(cfg, window)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn, kv, lora):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, kv, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w) for w in cfg.sliding_windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Module names mirror Hugging Face's, so a checkpoint's state dict loads as it is."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def attach_lora(self, pool: LoRASlotPool) -> None:
        for layer_index, layer in enumerate(self.model.layers):
            for proj in (
                *_attn_projs(layer.self_attn),
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
                layer.mlp.down_proj,
            ):
                proj.lora_a = pool.a[layer_index][proj.index]
                proj.lora_bt = pool.bt[layer_index][proj.index]

    def forward(
        self, input_ids, attn: AttentionMeta, kv_caches, lora: list[LoraGroups] | None
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened step tokens."""
        x = self.model.embed_tokens(input_ids)
        freqs = attn.positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, attn, kv, lora)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _attn_projs(attn: Attention):
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
