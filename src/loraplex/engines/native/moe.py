"""The mixture-of-experts block (Qwen3-MoE's) and LoRA on its experts, per token's adapter.

The router and the experts compute what Hugging Face's `Qwen3MoeSparseMoeBlock` does: softmax over
the router's logits in float32, the top k, renormalised when `norm_topk_prob`, each chosen expert's
gated MLP weighted by its probability. An adapter's expert LoRA (PEFT's `target_parameters`) adds
s·x·A_eᵀ·B_eᵀ to expert e's `gate_up_proj` and `down_proj` outputs, for the tokens of that
adapter only."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engines.native.variants import EMPTY_SLOT, HostCopy
from loraplex.model_config import ModelConfig, ModelConfigError, MoeShape

_EXPERT_WEIGHT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight$")

# one expert LoRA on the device: A [experts, r, d_in], scaled Bᵀ [experts, r, d_out]
ExpertPair = tuple[torch.Tensor, torch.Tensor]


class ExpertSlots:
    """Per slot, the adapter's expert LoRAs on the device, by (layer, parameter). They live outside
    the slot pool's buffer: an expert LoRA is as large as the experts times the rank, and only
    adapters on a mixture-of-experts base carry one."""

    def __init__(self, num_slots: int):
        self.slots: list[dict[tuple[int, str], ExpertPair] | None] = [None] * num_slots

    def set_slot(self, slot: int, packed: HostCopy, model: ModelConfig, device) -> None:
        experts = packed.spec.experts
        if not experts:
            self.slots[slot] = None
            return
        assert model.experts is not None
        num = model.experts.num_experts
        loras = {}
        for e in experts:
            d_in, d_out = model.experts.expert_shape(model.hidden_size, e.parameter)
            a = packed.tensor(e.key_a, (num, e.rank, d_in))  # expert e's rows: e*r .. e*r + r - 1
            b = packed.tensor(e.key_b, (d_out, e.rank, num))  # expert e's columns: r_i * num + e
            bt = (b.float() * e.scaling).permute(2, 1, 0).to(b.dtype)  # [num, r, d_out]
            loras[e.layer, e.parameter] = (
                a.to(device, copy=True),
                bt.contiguous().to(device),
            )
        self.slots[slot] = loras

    def clear_slot(self, slot: int) -> None:
        self.slots[slot] = None

    def step(self, token_slots: list[int] | None, device) -> ExpertStep | None:
        """The step's expert LoRAs and which tokens each serves; None when no token's adapter has
        one (a dense model's steps, and a plain adapter's, stop here)."""
        if not token_slots or all(s is None for s in self.slots):
            return None
        present = sorted(
            s for s in set(token_slots) if s != EMPTY_SLOT and self.slots[s] is not None
        )
        if not present:
            return None
        return ExpertStep(
            torch.tensor(token_slots, device=device), [(s, self.slots[s]) for s in present]
        )


@dataclass
class ExpertStep:
    """One step's expert LoRAs: each token's slot and the slots that have expert LoRAs."""

    token_slots: torch.Tensor  # [T]
    loras: list[tuple[int, dict[tuple[int, str], ExpertPair]]]

    def add(self, y, x, tokens, layer: int, parameter: str, expert: int) -> None:
        """y += s·x·A_eᵀ·B_eᵀ for the rows whose token's adapter has a LoRA on the layer's
        `parameter`, in place. x: [n, d_in], y: [n, d_out] of the step's tokens `tokens` [n]."""
        slots = self.token_slots[tokens]
        for slot, loras in self.loras:
            pair = loras.get((layer, parameter))
            if pair is None:
                continue
            rows = (slots == slot).nonzero().squeeze(1)
            if rows.numel():
                a, bt = pair[0][expert], pair[1][expert]  # [r, d_in], [r, d_out]
                y[rows] += (x[rows] @ a.t()) @ bt


class Experts(nn.Module):
    """The experts' weights as Hugging Face stacks them (state dict keys
    `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`)."""

    def __init__(self, cfg: ModelConfig, moe: MoeShape):
        super().__init__()
        hidden, inter = cfg.hidden_size, moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden, inter))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        assert cfg.experts is not None
        self.moe = cfg.experts
        self.layer = layer
        self.gate = nn.Linear(cfg.hidden_size, self.moe.num_experts, bias=False)  # the router
        self.experts = Experts(cfg, self.moe)

    def forward(self, x: torch.Tensor, lora=None, step: ExpertStep | None = None) -> torch.Tensor:
        # x: [T, hidden]; `lora` (the dense layers' groups) has nothing here
        weights, chosen = self._route(x)  # [T, k] each
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            tokens, which = torch.where(chosen == expert)
            out.index_add_(
                0,
                tokens,
                self._expert(x[tokens], tokens, expert, step) * weights[tokens, which, None],
            )
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)  # [T, experts]
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen

    def _expert(self, x, tokens, expert: int, step: ExpertStep | None) -> torch.Tensor:
        gate_up = F.linear(x, self.experts.gate_up_proj[expert])
        if step is not None:
            step.add(gate_up, x, tokens, self.layer, "gate_up_proj", expert)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        y = F.linear(hidden, self.experts.down_proj[expert])
        if step is not None:
            step.add(y, hidden, tokens, self.layer, "down_proj", expert)
        return y


def stack_expert_weights(state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Checkpoints store each expert's `gate_proj`, `up_proj` and `down_proj` apart (`…experts.3.
    gate_proj.weight`; transformers writes them so): stacked in place into the 3-D weights the
    block holds (gate's rows before up's, as transformers' own conversion stacks them)."""
    if cfg.experts is None:
        return
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key in [k for k in state if _EXPERT_WEIGHT.fullmatch(k)]:
        match = _EXPERT_WEIGHT.fullmatch(key)
        assert match is not None
        parts.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = state.pop(key)
    num = cfg.experts.num_experts
    for prefix, by_name in parts.items():
        for name, experts in by_name.items():
            if sorted(experts) != list(range(num)):
                raise ModelConfigError(
                    f"{prefix}: {name}_proj weights of experts {sorted(experts)}; the config says "
                    f"{num} experts"
                )
        stacked = {
            name: torch.stack([experts[e] for e in range(num)]) for name, experts in by_name.items()
        }
        if {"gate", "up"} <= stacked.keys():
            state[f"{prefix}.gate_up_proj"] = torch.cat((stacked["gate"], stacked["up"]), dim=1)
        if "down" in stacked:
            state[f"{prefix}.down_proj"] = stacked["down"]
