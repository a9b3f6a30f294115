"""The base model's shape, read from a Hugging Face `config.json` (no torch: the registry uses it
too)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# LoRA-targetable linear layers of one decoder layer of a split base (Llama's), by the names PEFT
# uses.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# fused module -> its parts, in the order their outputs are stacked in its weight's rows
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# every linear module name of any supported base, split and fused: the LoRA slots' module indices
ALL_LINEAR_MODULES = LINEAR_MODULES + tuple(FUSED_MODULES)
# the architectures whose q/k/v and gate/up projections are fused (one weight each)
_FUSED_BASES = ("phi3",)


class ModelConfigError(ValueError):
    """The model directory cannot be served; the message names what is missing or unsupported."""


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts block (Qwen3-MoE's): a router picks `top_k` of `num_experts` experts
    per token, each a gated MLP whose weights are stacked into 3-D tensors (HF's
    `gate_up_proj` [experts, 2 * intermediate, hidden] and `down_proj` [experts, hidden,
    intermediate])."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool

    @classmethod
    def from_dict(cls, raw: dict) -> MoeShape:
        if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
            raise ModelConfigError(
                "unsupported mlp_only_layers / decoder_sparse_step: dense layers between the "
                "mixture-of-experts layers are not supported"
            )
        return cls(
            num_experts=raw.get("num_experts") or raw["num_local_experts"],
            top_k=raw["num_experts_per_tok"],
            intermediate_size=raw["moe_intermediate_size"],
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        )

    def expert_shape(self, hidden_size: int, parameter: str) -> tuple[int, int]:
        """(d_in, d_out) of one expert's `gate_up_proj` or `down_proj`."""
        if parameter == "gate_up_proj":
            return hidden_size, 2 * self.intermediate_size
        return self.intermediate_size, hidden_size


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    sliding_windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    experts: MoeShape | None = None
    """The mixture-of-experts block every decoder layer has in place of the MLP (None: a dense
    MLP)."""

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{model_dir}: missing config.json")
        raw = json.loads(path.read_text())
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        if not isinstance(gen, dict):
            raise ModelConfigError(f"{model_dir}: generation_config.json is not a JSON object")
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ModelConfigError("config.json is not a JSON object")
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type", "")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            if archs or model_type not in by_type:
                found = ", ".join(archs) or model_type or "none"
                raise ModelConfigError(
                    f"unsupported architecture {found}; supported: "
                    f"{', '.join(SUPPORTED_ARCHITECTURES)}"
                )
            arch = by_type[model_type]
        model_type = SUPPORTED_ARCHITECTURES[arch]
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {raw['hidden_act']!r}; only silu")
        heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rotary = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if rotary != 1.0:
            raise ModelConfigError(f"unsupported partial_rotary_factor {rotary}; only 1.0")
        rope_theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        rope["rope_type"] = rope_type
        generation = generation or {}
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            sliding_windows=_sliding_windows(raw, model_type),
            eos_token_ids=_as_ids(generation.get("eos_token_id", raw.get("eos_token_id"))),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            experts=MoeShape.from_dict(raw) if model_type == "qwen3_moe" else None,
        )

    @property
    def fused(self) -> bool:
        """Whether the base's q/k/v and gate/up projections are fused (`qkv_proj`,
        `gate_up_proj`)."""
        return self.model_type in _FUSED_BASES

    @property
    def linear_modules(self) -> tuple[str, ...]:
        """The LoRA-targetable linear modules a decoder layer of this base has."""
        if self.experts is not None:  # its MLP's weights are the experts' 3-D ones
            return LINEAR_MODULES[:4]
        if self.fused:
            return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        return LINEAR_MODULES

    def linear_shape(self, module: str) -> tuple[int, int]:
        """(d_in, d_out) of one of the ALL_LINEAR_MODULES, whichever layout the base has."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden_size, q_dim),
            "k_proj": (self.hidden_size, kv_dim),
            "v_proj": (self.hidden_size, kv_dim),
            "o_proj": (q_dim, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
            "qkv_proj": (self.hidden_size, q_dim + 2 * kv_dim),
            "gate_up_proj": (self.hidden_size, 2 * self.intermediate_size),
        }
        return shapes[module]

    def slot_shape(self, module: str) -> tuple[int, int]:
        """(d_in, d_out) a LoRA slot holds for one of the ALL_LINEAR_MODULES: (0, 0) for a module
        the base does not have."""
        return self.linear_shape(module) if module in self.linear_modules else (0, 0)

    @staticmethod
    def module_path(layer: int, module: str) -> str:
        """The module's name inside the HF model, as PEFT keys it
        (`model.layers.3.self_attn.q_proj`)."""
        mlp = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
        block = "mlp" if module in mlp else "self_attn"
        return f"model.layers.{layer}.{block}.{module}"


def _sliding_windows(raw: dict, model_type: str) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    layers = raw["num_hidden_layers"]
    if model_type in ("mistral", "phi3"):  # every layer attends within the window, when one is set
        return (window,) * layers
    layer_types = raw.get("layer_types")
    if not raw.get("use_sliding_window") or not window:
        return (None,) * layers
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    first_sliding = raw.get("max_window_layers", 28)  # transformers' default for Qwen2 and Qwen3
    return tuple(window if i >= first_sliding else None for i in range(layers))


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def base_model_digest(model_dir: str | Path) -> str:
    """sha256 over config.json and the weights' names and sizes (cheap; identifies a base model
    build)."""
    root = Path(model_dir)
    h = hashlib.sha256()
    h.update((root / "config.json").read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        h.update(f"{path.name}:{path.stat().st_size}\n".encode())
        with path.open("rb") as f:
            h.update(f.read(1 << 16))  # the header: every tensor's name, dtype, shape and offsets
    return "sha256:" + h.hexdigest()
