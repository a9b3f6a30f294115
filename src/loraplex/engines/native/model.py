"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3 with its fused projections, and
Qwen3-MoE with its experts, `moe`) over flattened tokens, a paged KV cache and LoRA slots."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engines.native.lora import MODULE_INDEX, LoraGroups, LoRASlotPool, add_lora
from loraplex.engines.native.moe import ExpertSlots, SparseMoeBlock
from loraplex.engines.native.variants import SlotHeads
from loraplex.model_config import ModelConfig


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk in the step: its tokens [first, first + length) of the step, at
    positions [start, start + length) of the sequence."""

    first: int
    length: int
    start: int = 0
    # when start > 0: the blocks that hold its positions [0, start + length), which it attends to
    context_blocks: torch.Tensor | None = None


class DecodeGroup(NamedTuple):
    """Decoding sequences that read the same number of KV blocks: one attention call."""

    rows: torch.Tensor  # [G] their tokens' indices in the step
    blocks: torch.Tensor  # [G * n] the n blocks each reads, in order
    mask: torch.Tensor  # [G, 1, 1, n * block_size] True where its token may attend


def group_by_blocks(counts: list[int], max_padding: float = 0.25) -> list[list[int]]:
    """Indices grouped for one attention call each, the longest first: a group takes the next
    sequence while the blocks it pads (to its first one's count) stay within max_padding of the
    blocks it reads."""
    groups: list[list[int]] = []
    total = 0  # blocks the last group reads
    for i in sorted(range(len(counts)), key=lambda i: -counts[i]):
        if groups:
            padded = counts[groups[-1][0]] * (len(groups[-1]) + 1)  # with i, padding included
            if padded <= (1 + max_padding) * (total + counts[i]):
                groups[-1].append(i)
                total += counts[i]
                continue
        groups.append([i])
        total = counts[i]
    return groups


class GatherBuffers:
    """Where attention gathers the KV blocks it reads: one pair shared by every layer and step,
    grown to the largest read so far, so no layer allocates (and faults in) fresh memory."""

    def __init__(self, block_numel: int, dtype: torch.dtype, device):
        self.k = torch.empty(0, block_numel, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)

    def gather(self, kv: tuple[torch.Tensor, torch.Tensor], blocks: torch.Tensor):
        """The blocks' keys and values, [len(blocks), block_size * kv_heads * head_dim] each."""
        n = blocks.numel()
        if n > self.k.shape[0]:
            self.k = self.k.new_empty(n, self.k.shape[1])
            self.v = torch.empty_like(self.k)
        k_cache, v_cache = (c.view(-1, self.k.shape[1]) for c in kv)  # [num_blocks, block numel]
        k = torch.index_select(k_cache, 0, blocks, out=self.k[:n])
        v = torch.index_select(v_cache, 0, blocks, out=self.v[:n])
        return k, v


@dataclass
class AttentionMeta:
    """Where the step's tokens sit; built once per step by the runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] flat KV-cache position each new token writes to
    positions: torch.Tensor  # [T]
    prefills: list[PrefillSpan]
    block_size: int
    buffers: GatherBuffers
    decode_start: int = 0  # the decoding sequences' tokens are the step's last ones
    decode_tables: list[list[int]] = field(default_factory=list)  # each one's blocks, in order
    decode_lens: list[int] = field(default_factory=list)  # its context, the new token included
    _groups: dict = field(default_factory=dict)

    def decode_groups(self, window: int | None) -> list[DecodeGroup]:
        """The decoding sequences grouped by the blocks they read (the window's, when one is
        given), built once per step for each window."""
        if window not in self._groups:
            self._groups[window] = self._build_groups(window)
        return self._groups[window]

    def _build_groups(self, window: int | None) -> list[DecodeGroup]:
        size, device = self.block_size, self.slot_mapping.device
        firsts = [0 if window is None else max(0, n - window) // size for n in self.decode_lens]
        ends = [-(-n // size) for n in self.decode_lens]
        groups = []
        for members in group_by_blocks([e - f for f, e in zip(firsts, ends)]):
            width = ends[members[0]] - firsts[members[0]]
            blocks = []
            for i in members:
                own = self.decode_tables[i][firsts[i] : ends[i]]
                blocks += own + own[-1:] * (width - len(own))  # padding: masked out below
            first = torch.tensor([firsts[i] for i in members], device=device)[:, None]
            lens = torch.tensor([self.decode_lens[i] for i in members], device=device)[:, None]
            cols = torch.arange(width * size, device=device)[None, :] + first * size
            mask = cols < lens
            if window is not None:
                mask &= cols > lens - 1 - window
            rows = torch.tensor([self.decode_start + i for i in members], device=device)
            blocks = torch.tensor(blocks, dtype=torch.long, device=device)
            groups.append(DecodeGroup(rows, blocks, mask[:, None, None, :]))
        return groups


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
    dora_scale: torch.Tensor | None = None  # [max_loras + 1, d_out], DoRA's scales per slot
    packed: torch.Tensor | None = None  # the weight in oneDNN's layout (`pack_for_cpu`)
    row_norms_sq: torch.Tensor | None = None  # [d_out] ||W||² of each output row, float32

    def __init__(self, d_in: int, d_out: int, bias: bool, name: str):
        super().__init__(d_in, d_out, bias=bias)
        self.index = MODULE_INDEX[name]

    def forward(self, x: torch.Tensor, lora: list[LoraGroups] | None) -> torch.Tensor:
        group = lora[self.index] if lora is not None and self.lora_a is not None else None
        if group is None or group.dora_rows is None:
            y = self._base(x, self.bias)
            if group is not None:
                add_lora(y, x, self.lora_a, self.lora_bt, group)
            return y
        # DoRA (PEFT's): scale ⊙ (x·Wᵀ + s·x·Aᵀ·Bᵀ) + bias, each token at its slot's scale
        y = self._base(x, None)
        add_lora(y, x, self.lora_a, self.lora_bt, group)
        y *= self.dora_scale[group.dora_rows]
        return y if self.bias is None else y + self.bias

    def _base(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def dora_norm(self, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        """||W + s·B·A|| of each output row (PEFT's DoRA weight norm) from a slot's A [r, d_in]
        and scaled Bᵀ [r, d_out], without forming the [d_out, d_in] sum: ||W_i||² + 2·(s·B·A·Wᵀ)_ii
        + (s·B·A·Aᵀ·s·Bᵀ)_ii."""
        if self.row_norms_sq is None:
            self.row_norms_sq = self.weight.detach().float().pow(2).sum(1)
        a32, bt32 = a.float(), bt.float()
        wa = self._base(a, None).float()  # [r, d_out] = A·Wᵀ
        cross = (bt32 * wa).sum(0)
        square = (bt32 * ((a32 @ a32.t()) @ bt32)).sum(0)
        return (self.row_norms_sq + 2 * cross + square).clamp_min(0).sqrt()


def pack_for_cpu(model: nn.Module) -> bool:
    """Put the base weights of the linear layers in oneDNN's blocked layout, once, as vLLM's CPU
    backend does: a float32 matmul of a few rows (a decode step's) then reads its weight in the
    order the kernel wants, 20-40% less time than `F.linear` on the same weight. The plain weight
    is dropped (the packed one holds the same numbers). False: this build of torch cannot (no
    oneDNN), and the layers stay as they are."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        weight = m.weight.detach()
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return False
    try:  # a CPU oneDNN cannot pack for (as vLLM, the plain layers then stay)
        packed = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 8) for m in layers]
    except RuntimeError:
        return False
    for m, weight in zip(layers, packed):
        m.packed = weight
        m.row_norms_sq = m.weight.detach().float().pow(2).sum(1)  # DoRA's norms need it
        m.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    return True


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
        self.sizes = (q_dim, kv_dim, kv_dim)
        bias = cfg.attention_bias
        if cfg.fused:  # one weight, q's rows then k's then v's
            self.qkv_proj = LoRALinear(cfg.hidden_size, sum(self.sizes), bias, "qkv_proj")
        else:
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
        q, k, v = self._qkv(x, lora)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv  # [num_positions, kv_heads, head_dim]
        k_cache[attn.slot_mapping] = k
        v_cache[attn.slot_mapping] = v
        out = torch.empty_like(q)
        for span in attn.prefills:
            rows = slice(span.first, span.first + span.length)
            out[rows] = self._prefill(q, k, v, span, kv, attn.buffers)
        for group in attn.decode_groups(self.window) if attn.decode_lens else ():
            out[group.rows] = self._decode(q[group.rows], kv, group, attn.buffers)
        return self.o_proj(out.view(n, -1), lora)

    def _qkv(self, x, lora) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x, lora).split(self.sizes, dim=-1)
            return q.contiguous(), k.contiguous(), v.contiguous()
        return self.q_proj(x, lora), self.k_proj(x, lora), self.v_proj(x, lora)

    def _prefill(self, q, k, v, span: PrefillSpan, kv, buffers: GatherBuffers):
        # [L, H, D] -> [1, H, L, D]
        first, length = span.first, span.length
        q = q[first : first + length].transpose(0, 1).unsqueeze(0)
        if span.context_blocks is None:  # from position 0: the chunk's own keys and values
            k, v = (t[first : first + length].transpose(0, 1).unsqueeze(0) for t in (k, v))
        else:  # a later chunk: every position's keys and values so far, this chunk's included
            shape = (-1, self.num_kv_heads, self.head_dim)
            k, v = (
                t.view(shape)[: span.start + length].transpose(0, 1).unsqueeze(0)
                for t in buffers.gather(kv, span.context_blocks)
            )
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

    def _decode(self, q, kv, group: DecodeGroup, buffers: GatherBuffers):
        # q: [G, H, D] -> [G, kv_heads, H / kv_heads, D]: a KV head's query heads as rows, so
        # grouped-query attention reads each key once; keys and values: [G, kv_heads, L, D]
        num_seqs, group_size = q.shape[0], self.num_heads // self.num_kv_heads
        q = q.view(num_seqs, self.num_kv_heads, group_size, self.head_dim)
        shape = (num_seqs, -1, self.num_kv_heads, self.head_dim)
        k, v = (t.view(shape).transpose(1, 2) for t in buffers.gather(kv, group.blocks))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=self.scale)
        return out.reshape(num_seqs, self.num_heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        if cfg.fused:  # one weight, gate's rows then up's
            self.gate_up_proj = LoRALinear(hidden, 2 * inter, False, "gate_up_proj")
        else:
            self.gate_proj = LoRALinear(hidden, inter, False, "gate_proj")
            self.up_proj = LoRALinear(hidden, inter, False, "up_proj")
        self.down_proj = LoRALinear(inter, hidden, False, "down_proj")

    def forward(self, x, lora):
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x, lora).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x, lora), self.up_proj(x, lora)
        return self.down_proj(F.silu(gate) * up, lora)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, index: int):
        super().__init__()
        self.self_attn = Attention(cfg, window)
        self.mlp = MLP(cfg) if cfg.experts is None else SparseMoeBlock(cfg, index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn, kv, lora, experts=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, kv, lora)
        if experts is None:
            return x + self.mlp(self.post_attention_layernorm(x), lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora, experts)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        windows = enumerate(cfg.sliding_windows)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w, i) for i, w in windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Module names mirror Hugging Face's, so a checkpoint's state dict loads as it is."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.heads: SlotHeads | None = None
        self.experts: ExpertSlots | None = None  # a mixture-of-experts base's

    def attach_lora(self, pool: LoRASlotPool) -> None:
        for layer_index, layer in enumerate(self.model.layers):
            for proj in _projs(layer):
                proj.lora_a = pool.a[layer_index][proj.index]
                proj.lora_bt = pool.bt[layer_index][proj.index]
                proj.dora_scale = pool.dora.scales[layer_index][proj.index]
        self.heads = pool.heads
        if self.config.experts is not None:
            self.experts = pool.experts
        pool.dora.norm_of = self._dora_norm

    def _dora_norm(self, layer: int, index: int, a: torch.Tensor, bt: torch.Tensor):
        proj = next(p for p in _projs(self.model.layers[layer]) if p.index == index)
        return proj.dora_norm(a, bt)

    def forward(
        self,
        input_ids,
        attn: AttentionMeta,
        kv_caches,
        lora: list[LoraGroups] | None,
        token_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened step tokens (`token_slots`: each one's
        adapter slot, for the adapters' own embeddings)."""
        x = self.model.embed_tokens(input_ids)
        if self.heads is not None and token_slots and self.heads.any_in(token_slots):
            x = self.heads.embed(input_ids, x, token_slots)
        freqs = attn.positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        experts = None
        if self.experts is not None and lora is not None:
            experts = self.experts.step(token_slots, x.device)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, attn, kv, lora, experts)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor, slots: list[int] | None = None) -> torch.Tensor:
        """Logits [N, vocab] of hidden [N, hidden] (`slots`: each row's adapter slot, for the
        adapters' own lm_head)."""
        logits = self.lm_head(hidden)
        if self.heads is not None and slots and self.heads.any_in(slots):
            self.heads.logits(hidden, logits, slots)
        return logits.float()


def _projs(layer: DecoderLayer) -> list[LoRALinear]:
    return [m for m in layer.modules() if isinstance(m, LoRALinear)]
