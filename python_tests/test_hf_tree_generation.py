"""Tree mode of speculative generation with HF models (specdec_kernels.hf: TreeDrafter, TreeSpec).

The tiny random Llama pair of test_hf_generation.py (no downloads): greedy output equals the
target's own greedy ``generate``, sampled output follows the target's exact sampling law (first
two tokens, chi-square, with negative controls that must fail), both KV caches hold exactly
committed tokens after every step (accepted paths through the trees are gathered), every step's
trees pass ``tree_utils.check_tree``.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_kernels.hf import speculative as hf  # noqa: E402
from specdec_kernels.tree_utils import check_tree  # noqa: E402
from test_hf_generation import (  # noqa: E402,F401  (models and one_thread are fixtures)
    EOS,
    PROMPTS,
    VOCAB,
    cache_tensors,
    exact_first_two,
    fresh_cache,
    models,
    one_thread,
    target_greedy,
)
from utils import chi_square_pvalue  # noqa: E402


class CheckedTreeDrafter(hf.TreeDrafter):
    """A TreeDrafter that validates every step's trees and counts what they looked like."""

    def __init__(self, model, spec: hf.TreeSpec):
        super().__init__(model, spec)
        self.num_trees = 0
        self.num_branching_trees = 0  # trees where some node has two or more children
        self.max_nodes = 0

    def propose_batch(self, requests, tokens, num_drafts, sampling, generators):
        trees = super().propose_batch(requests, tokens, num_drafts, sampling, generators)
        assert len(trees) == len(requests)
        parents = torch.tensor([p for tree in trees for p in [-1] + list(tree.parents)], dtype=torch.int32)
        node_tokens = torch.cat([torch.cat([torch.tensor([request_tokens[-1]]), tree.tokens.cpu()])
                                 for request_tokens, tree in zip(tokens, trees)])
        cu = torch.tensor([0] + list(np.cumsum([tree.tokens.numel() + 1 for tree in trees])), dtype=torch.int32)
        check_tree(parents, node_tokens, cu, vocab_size=VOCAB, deterministic=True, max_depth=self.spec.max_depth)
        for tree, limit in zip(trees, num_drafts):
            assert isinstance(tree, hf.DraftTokenTree)
            assert tree.depth <= min(limit, self.spec.max_depth)
            assert tree.tokens.numel() <= self.spec.num_draft_nodes
            children = [0] * (tree.tokens.numel() + 1)
            for parent in tree.parents:
                children[parent] += 1
            assert max(children) <= self.spec.top_k
            self.num_trees += 1
            self.num_branching_trees += max(children) >= 2
            self.max_nodes = max(self.max_nodes, tree.tokens.numel())
        return trees


def recording_keeps(lm: hf.CachedCausalLM) -> list[list[int]]:
    """Record the columns of every ``keep`` of ``lm`` (a list that fills up as it runs)."""
    calls = []
    keep = lm.keep

    def recorded(request, columns):
        calls.append(list(columns))
        keep(request, columns)

    lm.keep = recorded
    return calls


def is_prefix(columns: list[int]) -> bool:
    return columns == list(range(len(columns)))


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,stop_at_eos", [
    (hf.TreeSpec(num_draft_nodes=8, top_k=3, max_depth=4), True),
    (hf.TreeSpec(num_draft_nodes=8, top_k=3, max_depth=4), False),
    (hf.TreeSpec(num_draft_nodes=5, top_k=2, max_depth=3, beam_width=2), False),
])
def test_greedy_equals_target_generate(models, spec, stop_at_eos):
    target, draft = models
    drafter = CheckedTreeDrafter(draft, spec)
    target_lm = hf.CachedCausalLM(target)
    keeps = recording_keeps(target_lm)
    result = hf.speculative_generate(target, drafter, PROMPTS, max_new_tokens=16,
                                     eos_token_id=None if stop_at_eos else [], target_lm=target_lm)
    for prompt, tokens in zip(PROMPTS, result.tokens):
        assert tokens == target_greedy(target, prompt, 16, EOS if stop_at_eos else None)
    stats = result.stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.tokens_per_step > 1
    assert stats.num_generated_tokens == sum(len(t) for t in result.tokens)
    assert stats.num_request_steps == drafter.num_trees == sum(result.steps)
    assert drafter.num_branching_trees > 0 and drafter.max_nodes == spec.num_draft_nodes
    # Some accepted path went through a node that was not the first child: a real gather.
    assert any(not is_prefix(columns) for columns in keeps)


def test_greedy_eager_attention(models):
    """Eager attention adds the 4D mask to the scores: the additive mask works there too."""
    target, draft = (copy.deepcopy(model) for model in models)
    for model in (target, draft):
        model.set_attn_implementation("eager")
    result = hf.speculative_generate(target, draft, PROMPTS, max_new_tokens=12, tree=hf.TreeSpec(8, 3, 4),
                                     eos_token_id=[])
    for prompt, tokens in zip(PROMPTS, result.tokens):
        assert tokens == target_greedy(target, prompt, 12, None)


def test_tree_option_equals_tree_drafter_and_chain_shaped_tree_equals_chain_mode(models):
    """``tree=TreeSpec(...)`` with a draft model is the TreeDrafter; a top-1 tree is the greedy
    draft chain, so it takes the very steps of chain mode."""
    target, draft = models
    spec = hf.TreeSpec(num_draft_nodes=3, top_k=1, max_depth=3)
    via_option = hf.speculative_generate(target, draft, PROMPTS, max_new_tokens=12, tree=spec, eos_token_id=[])
    via_drafter = hf.speculative_generate(target, hf.TreeDrafter(draft, spec), PROMPTS, max_new_tokens=12,
                                          eos_token_id=[])
    chain = hf.speculative_generate(target, draft, PROMPTS, max_new_tokens=12, num_draft_tokens=3, eos_token_id=[])
    assert via_option.tokens == via_drafter.tokens == chain.tokens
    assert via_option.steps == chain.steps and via_option.accepted == chain.accepted
    # num_draft_tokens caps the depth of the trees.
    capped = hf.speculative_generate(target, CheckedTreeDrafter(draft, hf.TreeSpec(8, 3, 4)), PROMPTS,
                                     max_new_tokens=12, num_draft_tokens=1, eos_token_id=[])
    assert capped.tokens == chain.tokens
    assert all(num_accepted <= num_steps for num_accepted, num_steps in zip(capped.accepted, capped.steps))


def test_greedy_negative_control_without_tree_mask(models, monkeypatch):
    """Scoring the tree nodes as one causal sequence (siblings see each other, positions by column)
    gives the target wrong logits: greedy tree decoding must then leave the target's output."""
    target, draft = models

    def causal_mask_and_positions(self, start, end, root, tree_parents, device):
        allowed = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        additive = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        return additive[None, None], torch.arange(start, end)[None, :]

    monkeypatch.setattr(hf.CachedCausalLM, "_tree_mask_and_positions", causal_mask_and_positions)
    result = hf.speculative_generate(target, draft, PROMPTS, max_new_tokens=16, tree=hf.TreeSpec(8, 3, 4),
                                     eos_token_id=[])
    assert any(tokens != target_greedy(target, prompt, 16, None) for prompt, tokens in zip(PROMPTS, result.tokens))


def test_greedy_requests_in_a_mixed_batch(models):
    target, draft = models
    temperature = [0.0, 0.9, 0.0, 1.3]
    result = hf.speculative_generate(target, CheckedTreeDrafter(draft, hf.TreeSpec(6, 2, 3)), PROMPTS,
                                     max_new_tokens=10, temperature=temperature, top_p=0.95, seed=3)
    for prompt, tokens, temp in zip(PROMPTS, result.tokens, temperature):
        if temp == 0:
            assert tokens == target_greedy(target, prompt, 10)


class FixedDraftsDrafter(hf.Drafter):
    """Deterministic drafts through the per-request ``propose`` seam: even requests get the chain
    [3, 4], odd ones the tree root -> {3, 4}, 3 -> 5 (depth capped by ``num_drafts``)."""

    def propose(self, request, tokens, num_drafts, sampling, generator):
        if request % 2 == 0:
            return hf.DraftChain(torch.tensor([3, 4][:num_drafts]))
        if num_drafts == 1:
            return hf.DraftTokenTree(torch.tensor([3, 4]), [0, 0])
        return hf.DraftTokenTree(torch.tensor([3, 4, 5]), [0, 0, 1])


def test_custom_drafter_mixing_trees_and_deterministic_chains(models):
    """Deterministic chains join trees in one op call (as chain-shaped trees); greedy output is
    the target's whatever the drafts."""
    target, _ = models
    result = hf.speculative_generate(target, FixedDraftsDrafter(), PROMPTS, max_new_tokens=9, eos_token_id=[])
    for prompt, tokens in zip(PROMPTS, result.tokens):
        assert tokens == target_greedy(target, prompt, 9, None)
    assert result.stats.num_draft_tokens > 0


# --------------------------------------------------------------------------------------------
# Sampling law
# --------------------------------------------------------------------------------------------

SAMPLING_SPEC = hf.TreeSpec(num_draft_nodes=4, top_k=3, max_depth=2)


def first_two_counts(target, draft, num_requests, seed, **sampling):
    prompt = PROMPTS[0]
    target_lm = hf.CachedCausalLM(target)
    keeps = recording_keeps(target_lm)
    # 3 new tokens with depth-2 trees: the first two cross every path (first or later child
    # accepted at depth 1 and 2, all children rejected, then a second step).
    result = hf.speculative_generate(target, CheckedTreeDrafter(draft, SAMPLING_SPEC), [prompt] * num_requests,
                                     max_new_tokens=3, seed=seed, eos_token_id=[], target_lm=target_lm, **sampling)
    tokens = np.array([t[:2] for t in result.tokens])
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    return counts, result.stats, keeps


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 0.9)])
def test_sampling_follows_target_law(models, top_k, top_p):
    target, draft = models
    temperature = 0.8
    counts, stats, keeps = first_two_counts(target, draft, 2000, seed=21, temperature=temperature, top_k=top_k,
                                            top_p=top_p)
    # Both outcomes are frequent, and accepted paths leave the first-child chain.
    assert 1.2 < stats.tokens_per_step < 2.5
    assert sum(not is_prefix(columns) for columns in keeps) > 100
    exact = exact_first_two(target, PROMPTS[0], temperature, top_k, top_p)
    # Filtered-out pairs have probability 0: a single sample there gives p = 0.
    assert chi_square_pvalue(counts, exact) > 1e-4


def test_sampling_negative_control_wrong_verify_temperature(models, monkeypatch):
    """Verifying the trees at twice the temperature samples the target at 1.6, not 0.8: the test
    must see it."""
    target, draft = models
    real = hf.tree_rejection_sample

    def wrong_temperature(logits, tokens, parents, cu, draft_probs, temperature, *args, **kwargs):
        return real(logits, tokens, parents, cu, draft_probs, temperature * 2, *args, **kwargs)

    monkeypatch.setattr(hf, "tree_rejection_sample", wrong_temperature)
    counts, _, _ = first_two_counts(target, draft, 600, seed=22, temperature=0.8)
    assert chi_square_pvalue(counts, exact_first_two(target, PROMPTS[0], 0.8)) < 1e-4


# --------------------------------------------------------------------------------------------
# Caches
# --------------------------------------------------------------------------------------------

def assert_cache_holds(lm: hf.CachedCausalLM, model, request: int, tokens: list[int]) -> None:
    """The cache of ``request`` equals a fresh forward over ``tokens``."""
    cache = lm.cache(request)
    assert lm.num_cached(request) == cache.get_seq_length() == len(tokens)
    for (k, v), (k_ref, v_ref) in zip(cache_tensors(cache), cache_tensors(fresh_cache(model, tokens))):
        assert k.shape == k_ref.shape
        torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_hold_exactly_committed_tokens(models, temperature):
    target, draft = models
    target_lm = hf.CachedCausalLM(target)
    drafter = CheckedTreeDrafter(draft, hf.TreeSpec(num_draft_nodes=6, top_k=3, max_depth=3))
    target_keeps, draft_keeps = recording_keeps(target_lm), recording_keeps(drafter.lm)
    draft_lags = set()

    def check(info: hf.StepInfo):
        for b in info.active:
            tokens = info.tokens[b]
            # Target: every committed token but the newest (the next forward's first input).
            assert_cache_holds(target_lm, target, b, tokens[:-1])
            # Draft: the same, or one less when the last accepted node was a leaf it never fed.
            lag = len(tokens) - drafter.lm.num_cached(b)
            assert lag in (1, 2)
            assert_cache_holds(drafter.lm, draft, b, tokens[:-lag])
            draft_lags.add(lag)

    result = hf.speculative_generate(target, drafter, PROMPTS, max_new_tokens=16, temperature=temperature, seed=5,
                                     eos_token_id=[], on_step=check, target_lm=target_lm)
    assert result.stats.num_steps > 3
    assert draft_lags == {1, 2}
    # Both caches were compacted through non-contiguous columns at least once.
    assert any(not is_prefix(columns) for columns in target_keeps)
    assert any(not is_prefix(columns) for columns in draft_keeps)
    assert all(target_lm.cache(b) is None and drafter.lm.cache(b) is None for b in range(len(PROMPTS)))


def test_cached_lm_tree_forward_and_keep(models):
    """CachedCausalLM on its own: a tree forward over a chain prefix gives each node the logits of
    its root-to-node path, keep() gathers a path, and a node may hang off an older chain column."""
    target, _ = models
    lm = hf.CachedCausalLM(target)
    prefix = [1, 5, 9, 3]
    lm.forward(0, torch.tensor(prefix[:-1]), 1)  # cache: the prefix but its last token (the root)
    # Root 3 at column 3, then nodes: 7 (col 4) and 2 (col 5) under the root, 11 (col 6) under 7,
    # 4 (col 7) under 2, 8 (col 8) under 11.
    tokens = [3, 7, 2, 11, 4, 8]
    parents = [2, 3, 3, 4, 5, 6]
    logits = lm.forward(0, torch.tensor(tokens), len(tokens), parents)
    paths = {3: [3], 4: [3, 7], 5: [3, 2], 6: [3, 7, 11], 7: [3, 2, 4], 8: [3, 7, 11, 8]}
    with torch.no_grad():
        for column, path in paths.items():
            expected = target(torch.tensor([prefix[:-1] + path])).logits[0, -1]
            torch.testing.assert_close(logits[column - 3], expected, rtol=1e-4, atol=1e-5)
    assert lm.parent_column(0, 6) == 4 and lm.parent_column(0, 2) == 1
    with pytest.raises(ValueError, match="path"):
        lm.keep(0, [0, 1, 2, 3, 5, 6])  # 6's parent is 4
    lm.keep(0, [0, 1, 2, 3, 4, 6])
    assert_cache_holds(lm, target, 0, prefix + [7, 11])
    # A node under column 1: columns 2.. become the tree; the node sees columns 0, 1 and itself.
    logits = lm.forward(0, torch.tensor([12]), 1, [1])
    with torch.no_grad():
        expected = target(torch.tensor([prefix[:2] + [12]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-5)
    lm.keep(0, [0, 1, 6])
    assert_cache_holds(lm, target, 0, prefix[:2] + [12])
    with pytest.raises(ValueError, match="earlier column"):
        lm.forward(0, torch.tensor([4]), 1, [3])


# --------------------------------------------------------------------------------------------
# Seeds, limits, errors
# --------------------------------------------------------------------------------------------

def test_seeds_make_requests_reproducible_and_limits(models):
    target, draft = models
    kwargs = dict(max_new_tokens=7, temperature=1.0, top_k=8, eos_token_id=[], tree=hf.TreeSpec(6, 3, 3))
    seeds = [101, 202, 303]
    batch = hf.speculative_generate(target, draft, PROMPTS[:3], seed=seeds, **kwargs)
    for b in range(3):
        # Independent of the other requests, also near the end, where the budgets cap the depths.
        alone = hf.speculative_generate(target, draft, [PROMPTS[b]], seed=[seeds[b]], **kwargs)
        assert alone.tokens[0] == batch.tokens[b]
    other = hf.speculative_generate(target, draft, PROMPTS[:3], seed=[1, 2, 3], **kwargs)
    assert other.tokens != batch.tokens
    assert all(len(t) == 7 for t in batch.tokens)  # max_new_tokens caps the trees' depth near the end


def test_errors(models):
    target, draft = models
    with pytest.raises(ValueError, match="TreeDrafter"):
        hf.speculative_generate(target, hf.ModelDrafter(draft), PROMPTS, tree=hf.TreeSpec())
    with pytest.raises(ValueError, match="top_k"):
        hf.TreeSpec(num_draft_nodes=4, top_k=0)
    # A sliding window cannot be combined with a custom tree mask.
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    mistral = MistralForCausalLM(config).eval()
    with pytest.raises(ValueError, match="sliding-window"):
        hf.speculative_generate(mistral, mistral, PROMPTS, max_new_tokens=4, tree=hf.TreeSpec(4, 2, 2))

    class SampledChainThenTrees(hf.Drafter):
        """Request 0 gets a sampled chain, the others trees: one op call cannot verify both."""

        def propose(self, request, tokens, num_drafts, sampling, generator):
            if request == 0:
                return hf.DraftChain(torch.tensor([3]), torch.full((1, VOCAB), 1.0 / VOCAB))
            return hf.DraftTokenTree(torch.tensor([3, 4]), [0, 0])

    with pytest.raises(ValueError, match="sampled chains"):
        hf.speculative_generate(target, SampledChainThenTrees(), PROMPTS, max_new_tokens=4, temperature=1.0)
