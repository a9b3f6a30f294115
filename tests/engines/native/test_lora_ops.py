"""The batched LoRA op against the per-token reference loop, over segment and gathered paths."""

import random

import pytest
import torch

from loraplex.engines.native.lora import EMPTY_SLOT, add_lora, add_lora_reference, build_lora_groups


@pytest.mark.parametrize("min_segment", [1, 8])
@pytest.mark.parametrize("seed", range(6))
def test_batched_op_matches_per_token_loop(seed, min_segment):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_slots, max_rank, d_in, d_out = 5, 32, 48, 40
    ranks = [rng.choice([4, 8, 16, 32]) for _ in range(num_slots)]
    a = torch.zeros(num_slots, max_rank, d_in)
    bt = torch.zeros(num_slots, max_rank, d_out)
    for s, r in enumerate(ranks):  # padded slots: rows past the adapter's rank stay zero
        a[s, :r] = torch.randn(r, d_in)
        bt[s, :r] = torch.randn(r, d_out)
    # Runs of mixed lengths: long ones take the segment path, short ones the gathered path.
    token_slots = []
    for _ in range(rng.randint(3, 12)):
        token_slots += [rng.choice([EMPTY_SLOT, *range(num_slots)])] * rng.choice([1, 2, 3, 9, 20])
    x = torch.randn(len(token_slots), d_in)
    expected = torch.randn(len(token_slots), d_out)
    got = expected.clone()
    module_ranks = [(r,) * 7 for r in ranks]
    groups = build_lora_groups(token_slots, module_ranks, "cpu", min_segment)
    if groups is None:
        assert all(s == EMPTY_SLOT for s in token_slots)
        return
    add_lora(got, x, a, bt, groups[0])
    add_lora_reference(expected, x, a, bt, token_slots)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_groups_use_segments_for_long_runs_and_one_gather_at_the_largest_rank_for_short_ones():
    token_slots = [0] * 10 + [1, 2, 1] + [EMPTY_SLOT] * 4 + [3]
    ranks = [(8,) * 7, (16,) * 7, (4, 0, 4, 4, 4, 4, 4), (64, 0, 64, 64, 64, 64, 64)]
    groups = build_lora_groups(token_slots, ranks, "cpu", min_segment=8)  # the CUDA setting
    assert groups[0].segments == [(0, 10, 0, 8)]
    [(tokens, slots, rank)] = groups[0].gathered
    assert (tokens.tolist(), slots.tolist(), rank) == ([10, 11, 12, 17], [1, 2, 1, 3], 64)
    # module 1: only slot 1 targets it among the gathered tokens
    assert groups[1].gathered[0][2] == 16
    assert all(g.gathered[0][0] is tokens for g in groups)  # the indices are built once per step


def test_module_not_targeted_by_an_adapter_is_skipped():
    ranks = [(8, 0, 0, 0, 0, 0, 0)]
    groups = build_lora_groups([0, 0], ranks, "cpu")
    assert groups[0].segments and not groups[1].gathered and not groups[1].segments


def test_cpu_computes_every_run_as_a_segment():
    group = build_lora_groups([0, 0, 1, 2], [(8,) * 7, (16,) * 7, (4,) * 7], "cpu")[0]
    assert group.segments == [(0, 2, 0, 8), (2, 3, 1, 16), (3, 4, 2, 4)] and not group.gathered
