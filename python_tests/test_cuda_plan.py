"""The CUDA kernels' host plans (how a call is cut into work units), checked without a GPU.

`torch.ops.specdec._rejection_sample_plan` / `_tree_rejection_sample_plan` run the torch-free
plan functions of csrc/kernels/ for given sizes and a given number of resident CTAs (on an H100:
132 SMs x 4 CTAs for 16-bit logits without draft probabilities, x 3 for fp32 with fp32 draft
probabilities and for the tree kernel). The cases pin the shipped rules measured in
docs/DECISIONS.md ("cuda-one-wave", "cuda-units-large-batches", "cuda-tree-one-wave"): one wave for small batches, 4 units per CTA for batches whose rows fill a wave,
and the tree's one-wave rule; `units_per_slot > 0` is the benchmarks' override (rules off).
"""
import itertools

import pytest
import torch

import specdec_kernels  # noqa: F401  (loads the extension)

# The schema is always defined (csrc/ops.cpp); a kernel only in builds with the CUDA extension.
HAS_PLAN = torch._C._dispatch_has_kernel_for_dispatch_key("specdec::_rejection_sample_plan",
                                                           "CompositeImplicitAutograd")
pytestmark = pytest.mark.skipif(not HAS_PLAN, reason="the CUDA extension is not built")

V = 128256  # 501 chunks of 256, 16 tiles of 8192
H100_16BIT = 132 * 4
H100_FP32_DRAFT = 132 * 3
H100_TREE = 132 * 3


def chain_plan(batch, k, *, probs=False, ctas=H100_16BIT, block=False, units_per_slot=0, vocab=V):
    """[num_splits, tiles_per_split, units_phase1, units_total, residual_splits, residual_tiles,
    prefetch_residual]."""
    return list(torch.ops.specdec._rejection_sample_plan(batch * (k + 1), batch, vocab, k, probs, ctas,
                                                         int(block), units_per_slot))


@pytest.mark.parametrize("batch,expected", [
    (1, [16, 1, 80, 80]),      # 5 rows x 16 one-tile splits
    (8, [8, 2, 320, 320]),     # one wave: 640 one-tile units would take two
    (16, [6, 3, 480, 480]),    # one wave: 640 x 2 tiles -> 480 x 3
    (24, [8, 2, 960, 960]),    # one wave would need 4-tile units: more than kRsOneWaveMaxTiles
    (32, [6, 3, 960, 960]),    # the same: not 480 x 6
    (64, [4, 4, 1280, 1280]),  # one wave would need 16-tile units: more than twice as coarse
    (128, [4, 4, 2560, 2560]),  # 640 rows fill a wave of 528: 4 units per CTA
    (256, [2, 8, 2560, 2560]),  # 1280 rows: ceil(2112 / 1280) = 2 splits
])
def test_chain_plan_without_draft_probs(batch, expected):
    assert chain_plan(batch, 4)[:4] == expected


def test_chain_plan_large_batch_rule_counts_rows_against_resident_ctas():
    # 105 requests x 5 rows = 525 < 528: 2 units per CTA; 106 x 5 = 530: 4.
    assert chain_plan(105, 4)[:2] == [3, 6]  # ceil(1056 / 525) = 3 splits
    assert chain_plan(106, 4)[:2] == [4, 4]  # ceil(2112 / 530) = 4 splits


def test_chain_plan_with_draft_probs():
    # fp32 + fp32 draft on an H100: 396 resident CTAs; 640 rows fill them -> 4 units per CTA for
    # phase 1 (3 splits of 6 tiles) and for the 128 residual rows (8 splits of 2).
    assert chain_plan(128, 4, probs=True, ctas=H100_FP32_DRAFT) == [3, 6, 1920, 1920 + 1024, 8, 2, 0]
    # B = 32: no one-wave rule with draft probabilities; 2 units per CTA (ceil(792 / 160) = 5
    # wanted -> 4-tile splits -> 4 of them; the 32 residual rows: 16 one-tile splits).
    assert chain_plan(32, 4, probs=True, ctas=H100_FP32_DRAFT) == [4, 4, 640, 640 + 32 * 16, 16, 1, 0]
    # B = 1: 80 + 16 units, all resident at once: the residual units prefetch while they wait.
    assert chain_plan(1, 4, probs=True, ctas=H100_FP32_DRAFT) == [16, 1, 80, 96, 16, 1, 1]


@pytest.mark.parametrize("batch", [1, 8, 32, 128])
def test_chain_plan_override_turns_the_rules_off(batch):
    # units_per_slot 2 is the plan before the rules: ceil(1056 / rows) splits of the row.
    rows = batch * 5
    splits = min(16, -(-2 * H100_16BIT // rows))
    per = -(-16 // splits)
    assert chain_plan(batch, 4, units_per_slot=2)[:2] == [-(-16 // per), per]


def test_chain_plan_covers_every_row_once():
    for batch, k, probs, block, ctas, vocab in itertools.product(
            [1, 3, 8, 32, 100, 106, 128, 512], [0, 1, 4, 8], [False, True], [False, True], [264, 396, 528],
            [7, 32000, V]):
        case = dict(batch=batch, k=k, probs=probs, block=block, ctas=ctas, vocab=vocab)
        splits, per, phase1, total, rsplits, rper, prefetch = chain_plan(batch, k, probs=probs, ctas=ctas, block=block,
                                                               vocab=vocab)
        tiles = -(-(-(-vocab // 256)) // 32)
        assert 1 <= splits <= 64 and 1 <= per <= 16, case
        assert (splits - 1) * per < tiles <= splits * per, case  # no empty split, every tile in one
        assert phase1 == batch * (k + 1) * splits, case
        if probs:
            assert (rsplits - 1) * rper < tiles <= rsplits * rper, case
            assert total == phase1 + batch * (max(k, 1) if block else 1) * rsplits, case
            assert prefetch == int(total <= ctas), case
        else:
            assert total == phase1 and prefetch == 0, case


def tree_plan(batch, nodes, *, probs=False, ctas=H100_TREE, units_per_slot=0):
    return list(torch.ops.specdec._tree_rejection_sample_plan(batch * nodes, batch, V, probs, ctas, units_per_slot))


@pytest.mark.parametrize("batch,units_per_slot,expected", [
    (1, 0, [6, 3, 384, 385]),   # one wave: 384 three-tile units + 1 empty-request unit <= 396
    (1, 2, [8, 2, 512, 513]),   # the override: 512 two-tile units, two waves
    (2, 0, [3, 6, 384, 386]),
    (32, 0, [1, 16, 2048, 2080]),  # one unit per row
])
def test_tree_plan(batch, units_per_slot, expected):
    assert tree_plan(batch, 64, units_per_slot=units_per_slot) == expected


def test_tree_plan_one_wave_rule_is_off_with_draft_probs():
    assert tree_plan(1, 64, probs=True) == tree_plan(1, 64, units_per_slot=2)
