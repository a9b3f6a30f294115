"""Fixes for two vLLM LoRA bugs, carried as a `vllm.general_plugins` entry point (`register`), so
vLLM applies them in each of its processes (API server, engine core, workers). Each applies only
to the vLLM versions that have the bug and logs once in each process where it is active; the bug
reports are in docs/vllm-notes.md.

- `no_lora_rows` (CPU backend): the torch ops of vLLM's CPU punica wrapper gather each row's
  weights as `stacked[index]`, and a row without a LoRA has index -1, which Python indexing reads
  as the last slot: a base row in a batch beside LoRA rows gets whichever adapter holds that slot.
  Replaced by ops that give each row its own slot's weights and -1 rows none (`_per_slot`).
  vLLM 0.33 fixed its ops itself (`fixed_upstream`).
- `pinned_slots` (scheduler): the scheduler admits up to max_loras distinct adapters into a batch,
  while the worker also keeps the pinned adapters in their slots; a batch with more unpinned
  adapters than unpinned slots evicts one of its own adapters and fails. The engine core now tells
  its scheduler which adapters are pinned, and each step the scheduler's LoRA budget leaves out the
  slots that pinned adapters outside the running requests hold.
"""

from __future__ import annotations

import copy
import logging

import torch

log = logging.getLogger("vllm.loraplex")  # under vLLM's logger, which its processes print

PLUGIN_NAME = "loraplex"  # the entry point's name: VLLM_PLUGINS lists it (or leaves it out)
PINNED_ATTR = "loraplex_pinned_loras"  # on vLLM's Scheduler: the ids pinned in the worker


def affected(version: str) -> dict[str, bool]:
    """Which fixes a vLLM version needs: each bug is confirmed in the source of these versions
    (no_lora_rows: 0.32; pinned_slots: 0.32 to 0.34, whose patch targets are the same)."""
    from packaging.version import Version

    v = Version(version)
    return {
        "no_lora_rows": Version("0.32") <= v < Version("0.33"),
        "pinned_slots": Version("0.32") <= v < Version("0.35"),
    }


def fixed_upstream(version: str) -> dict[str, bool]:
    """Which bugs a vLLM version fixes by itself: vLLM 0.33's CPU LoRA ops give rows of index -1
    no LoRA (read in the sources of 0.33.0 and 0.34.0); the scheduler still counts no pins."""
    from packaging.version import Version

    return {"no_lora_rows": Version(version) >= Version("0.33"), "pinned_slots": False}


def handled(fix: str) -> bool:
    """Whether the vLLM processes this one starts run without the bug of `fix`: their vLLM has
    fixed it, or the plugin applies loraplex's fix (`applies`)."""
    import vllm

    return fixed_upstream(vllm.__version__)[fix] or applies(fix)


def applies(fix: str) -> bool:
    """Whether the vLLM processes this one starts apply `fix` ("no_lora_rows" on the CPU backend
    only): their vLLM needs it, the plugin is installed, and VLLM_PLUGINS does not leave it out."""
    from importlib.metadata import entry_points

    import vllm
    from vllm import envs

    if not affected(vllm.__version__)[fix]:
        return False
    allowed = envs.VLLM_PLUGINS
    if allowed is not None and PLUGIN_NAME not in allowed:
        return False
    found = entry_points(group="vllm.general_plugins", name=PLUGIN_NAME)
    return any(ep.value == f"{__name__}:register" for ep in found)


def register() -> None:
    """vLLM's plugin hook: apply the fixes this vLLM needs."""
    import vllm
    from vllm.platforms import current_platform

    needed = affected(vllm.__version__)
    if needed["no_lora_rows"] and current_platform.is_cpu() and patch_no_lora_rows():
        log.info(
            "loraplex: CPU LoRA ops patched (rows without a LoRA take none), vLLM %s",
            vllm.__version__,
        )
    if needed["pinned_slots"] and patch_pinned_slots():
        log.info("loraplex: the scheduler counts pinned LoRA slots, vLLM %s", vllm.__version__)


# -- no_lora_rows ------------------------------------------------------------------------------
def _per_slot(inputs: torch.Tensor, stacked: torch.Tensor, indices: torch.Tensor, dtype):
    """Each row times its slot's weights (`inputs[r] @ stacked[slot].T`); rows of -1 (no LoRA) give
    zeros. With few slots for many rows (prefill), one matmul per slot; with about as many slots
    as rows (decode), one gather of each row's weights, as vLLM's ops do, masked."""
    inputs = inputs.to(dtype)
    weights = stacked.flatten(0, -3) if stacked.dim() == 4 else stacked  # [L, out, in]
    result = torch.zeros(inputs.shape[0], weights.shape[1], dtype=dtype, device=inputs.device)
    slots = [s for s in torch.unique(indices).tolist() if s >= 0]
    if not slots:
        return result
    if len(slots) * 4 >= inputs.shape[0]:
        has_lora = indices >= 0
        rows = weights[indices.clamp(min=0)].to(dtype)  # [T, out, in]
        result = torch.einsum("ti,toi->to", inputs, rows)  # einsum: faster than bmm here
        return result.masked_fill_(~has_lora.unsqueeze(-1), 0)
    for slot in slots:
        rows = (indices == slot).nonzero().squeeze(1)
        result[rows] = inputs[rows] @ weights[slot].to(dtype).T
    return result


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    # inputs: [T, in], lora_a_weights: [L, 1, r, in], output_tensor: [T, >= r]
    outputs = _per_slot(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
    # inputs: [T, r], lora_b_weights: [L, 1, out, r]; the adapter's out may be padded either way
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    rows = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    width = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += outputs[:rows, :width]
    else:
        output_tensor[:, :width] = outputs[:rows, :width]


def bgmv_expand_slice(
    inputs,
    lora_b_weights,
    output_tensor,
    lora_indices_tensor,
    slice_offset,
    slice_size,
    add_inputs=True,
):
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    target = output_tensor[:, slice_offset : slice_offset + slice_size]
    if add_inputs:
        target += outputs
    else:
        target.copy_(outputs)


def _token_indices(seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor):
    """Per-token slots from the per-segment slots of the sgmv ops."""
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(
    inputs,
    lora_a_weights,
    output_tensor,
    b_seq_start_loc,
    seq_len_tensor,
    lora_indices_tensor,
    batches,
    max_seq_length,
    token_nums,
    scaling,
):
    indices = _token_indices(seq_len_tensor, lora_indices_tensor)
    bgmv_shrink(inputs, lora_a_weights, output_tensor, indices, scaling)


def sgmv_expand(
    inputs,
    lora_b_weights,
    output_tensor,
    b_seq_start_loc,
    seq_len_tensor,
    lora_indices_tensor,
    batches,
    max_seq_length,
    token_nums,
    add_inputs=False,
):
    indices = _token_indices(seq_len_tensor, lora_indices_tensor)
    bgmv_expand(inputs, lora_b_weights, output_tensor, indices, add_inputs)


def sgmv_expand_slice(
    inputs,
    lora_b_weights,
    output_tensor,
    b_seq_start_loc,
    seq_len_tensor,
    lora_indices_tensor,
    batches,
    max_seq_length,
    token_nums,
    slice_offset,
    slice_size,
    add_inputs=False,
):
    indices = _token_indices(seq_len_tensor, lora_indices_tensor)
    bgmv_expand_slice(
        inputs, lora_b_weights, output_tensor, indices, slice_offset, slice_size, add_inputs
    )


_CPU_OPS = (
    bgmv_shrink,
    bgmv_expand,
    bgmv_expand_slice,
    sgmv_shrink,
    sgmv_expand,
    sgmv_expand_slice,
)


def patch_no_lora_rows() -> bool:
    """Point the CPU punica wrapper at the ops above; False when it already is."""
    from vllm.lora.punica_wrapper import punica_cpu

    if punica_cpu.bgmv_shrink is bgmv_shrink:
        return False
    for op in _CPU_OPS:
        setattr(punica_cpu, op.__name__, op)
    return True


# -- pinned_slots ------------------------------------------------------------------------------
def lora_budget(max_loras: int, pinned: set[int], running: set[int]) -> int:
    """Distinct adapters the scheduler may put in a step's batch: the slots less those held by
    pinned adapters without running requests (a pinned adapter in the batch counts once, in it),
    and never fewer than the adapters already running, which the scheduler keeps running."""
    return min(max_loras, max(max_loras - len(pinned - running), len(running)))


def _running_loras(scheduler) -> set[int]:
    return {
        r.lora_request.lora_int_id
        for r in scheduler.running
        if r.lora_request is not None and r.lora_request.lora_int_id > 0
    }


def patch_pinned_slots() -> bool:
    """Make EngineCore.pin_lora / remove_lora keep the scheduler's set of pinned ids, and
    Scheduler.schedule use `lora_budget` in place of max_loras; False when already patched."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    if Scheduler.schedule.__module__ == __name__:
        return False
    schedule, pin_lora, remove_lora = (
        Scheduler.schedule,
        EngineCore.pin_lora,
        EngineCore.remove_lora,
    )

    def pinning(self, lora_id: int) -> bool:
        pinned = pin_lora(self, lora_id)
        if pinned:
            _pins(self.scheduler).add(lora_id)
        return pinned

    def removing(self, lora_id: int) -> bool:
        _pins(self.scheduler).discard(lora_id)  # vLLM drops a removed adapter's pin
        return remove_lora(self, lora_id)

    def scheduling(self, *args, **kwargs):
        pinned = getattr(self, PINNED_ATTR, None)
        full = self.lora_config
        if not pinned or full is None:
            return schedule(self, *args, **kwargs)
        budget = lora_budget(full.max_loras, pinned, _running_loras(self))
        self.lora_config = _with_max_loras(self, full, budget)
        try:
            return schedule(self, *args, **kwargs)
        finally:
            self.lora_config = full

    setattr(Scheduler, "schedule", scheduling)  # noqa: B010 (a method replaced on purpose)
    setattr(EngineCore, "pin_lora", pinning)  # noqa: B010
    setattr(EngineCore, "remove_lora", removing)  # noqa: B010
    return True


def _pins(scheduler) -> set[int]:
    if not hasattr(scheduler, PINNED_ATTR):
        setattr(scheduler, PINNED_ATTR, set())
    return getattr(scheduler, PINNED_ATTR)


def _with_max_loras(scheduler, config, max_loras: int):
    """The scheduler's LoRA config with another max_loras: a copy per value, kept on it. Set
    without validation, which refuses 0 (no slot free)."""
    if max_loras == config.max_loras:
        return config
    copies = scheduler.__dict__.setdefault("loraplex_lora_configs", {})
    if max_loras not in copies:
        copies[max_loras] = copy.copy(config)
        object.__setattr__(copies[max_loras], "max_loras", max_loras)
    return copies[max_loras]
