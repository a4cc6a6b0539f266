"""Tree helpers around the verify op (specdec_kernels/tree_utils.py): attention mask, position
ids, KV compaction, the EAGLE-2 builder and check_tree.

The HF transformers tests build a tiny random Llama (no download) and skip without transformers.
"""
from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from specdec_kernels.tree_utils import (
    DraftLevel,
    accepted_kv_indices,
    build_eagle_tree,
    check_tree,
    pad_nodes,
    tree_attention_mask,
    tree_depths,
    tree_position_ids,
    unpad_nodes,
)

# --------------------------------------------------------------------------------------------
# Random trees and brute-force oracles
# --------------------------------------------------------------------------------------------


def random_parents(num_nodes: int, gen: torch.Generator) -> list[int]:
    """Local parents of a random tree: each node hangs under a uniformly chosen earlier node."""
    if num_nodes == 0:
        return []
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]


def random_tree_batch(sizes: list[int], vocab: int, gen: torch.Generator):
    """(parents [N] int32, tokens [N] int64, cu_num_nodes [B+1] int32, per-request local parents).

    Sibling tokens are distinct (deterministic drafts), so the batch passes check_tree."""
    local_parents = [random_parents(n, gen) for n in sizes]
    tokens = []
    for parents in local_parents:
        if not parents:
            continue
        used: dict[int, set[int]] = {}
        toks = [int(torch.randint(0, vocab, (1,), generator=gen))]
        for p in parents[1:]:
            free = [t for t in range(vocab) if t not in used.setdefault(p, set())]
            tok = free[int(torch.randint(0, len(free), (1,), generator=gen))]
            used[p].add(tok)
            toks.append(tok)
        tokens += toks
    cu = torch.tensor([0] + list(itertools.accumulate(sizes)), dtype=torch.int32)
    return (torch.tensor(sum(local_parents, []), dtype=torch.int32), torch.tensor(tokens, dtype=torch.int64), cu,
            local_parents)


def ancestors_or_self(parents: list[int], node: int) -> list[int]:
    """Root-to-node path (local indices), by walking the parent links."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def brute_force_mask(local_parents, prefix_lens, kv_prefix_len, n_max, padding_side):
    B = len(local_parents)
    mask = torch.zeros(B, 1, n_max, kv_prefix_len + n_max, dtype=torch.bool)
    for b, parents in enumerate(local_parents):
        p = prefix_lens[b]
        prefix_cols = range(p) if padding_side == "right" else range(kv_prefix_len - p, kv_prefix_len)
        for i in range(n_max):
            if i >= len(parents):
                mask[b, 0, i, kv_prefix_len + i] = True  # padding row: itself only
                continue
            for c in prefix_cols:
                mask[b, 0, i, c] = True
            for j in ancestors_or_self(parents, i):
                mask[b, 0, i, kv_prefix_len + j] = True
    return mask


# --------------------------------------------------------------------------------------------
# Mask, depths, positions (torch only)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("seed", range(4))
def test_mask_matches_brute_force_ancestors(seed, padding_side):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(torch.randint(1, 20, (1,), generator=gen)) for _ in range(4)] + [0]
    parents, _, cu, local_parents = random_tree_batch(sizes, 50, gen)
    prefix_lens = [int(torch.randint(0, 9, (1,), generator=gen)) for _ in sizes]
    kv_prefix_len = max(prefix_lens) + 2  # a wider prefix block than needed
    n_max = max(sizes) + 1  # and one more query row than needed
    mask = tree_attention_mask(parents, cu, torch.tensor(prefix_lens), n_max=n_max,
                               kv_prefix_len=kv_prefix_len, padding_side=padding_side)
    expected = brute_force_mask(local_parents, prefix_lens, kv_prefix_len, n_max, padding_side)
    assert mask.allowed.dtype == torch.bool and torch.equal(mask.allowed, expected)
    assert mask.additive.dtype == torch.float32
    assert torch.equal(mask.additive == 0, expected)
    assert torch.all(mask.additive[~expected] == torch.finfo(torch.float32).min)

    # Defaults (n_max, kv_prefix_len from the data), a static-cache width and -inf fill.
    wide = tree_attention_mask(parents, cu, torch.tensor(prefix_lens), kv_len=kv_prefix_len + n_max + 5,
                               kv_prefix_len=kv_prefix_len, n_max=n_max, padding_side=padding_side,
                               dtype=torch.float16, masked_value=float("-inf"))
    assert torch.equal(wide.allowed[..., :kv_prefix_len + n_max], expected)
    assert not wide.allowed[..., kv_prefix_len + n_max:].any()
    assert wide.additive.dtype == torch.float16 and torch.isneginf(wide.additive[~wide.allowed]).all()
    tight = tree_attention_mask(parents, cu, torch.tensor(prefix_lens), padding_side=padding_side)
    assert tight.allowed.shape == (len(sizes), 1, max(sizes), max(prefix_lens) + max(sizes))


def test_mask_without_prefix_and_kv_len_check():
    parents = torch.tensor([-1, 0, 0, 1], dtype=torch.int32)
    cu = torch.tensor([0, 4])
    mask = tree_attention_mask(parents, cu)
    assert torch.equal(mask.allowed[0, 0].int(), torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]))
    with pytest.raises(ValueError, match="kv_len"):
        tree_attention_mask(parents, cu, kv_len=3)
    with pytest.raises(ValueError, match="padding_side"):
        tree_attention_mask(parents, cu, padding_side="middle")


def test_chain_mask_is_causal():
    parents = torch.arange(-1, 6, dtype=torch.int32)
    mask = tree_attention_mask(parents, torch.tensor([0, 7]), torch.tensor([3]))
    expected = torch.ones(7, 10, dtype=torch.bool).tril(diagonal=3)
    assert torch.equal(mask.allowed[0, 0], expected)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_sdpa_with_tree_mask_equals_causal_attention_per_path(padding_side):
    """torch SDPA over [prefix | tree] with either mask form == causal SDPA over prefix + path."""
    gen = torch.Generator().manual_seed(7)
    sizes, prefix_lens = [9, 5, 1], [4, 0, 6]
    parents, _, cu, local_parents = random_tree_batch(sizes, 40, gen)
    kv_prefix_len, n_max, heads, dim = max(prefix_lens), max(sizes), 2, 8
    kv_len = kv_prefix_len + n_max
    q = torch.randn(len(sizes), heads, n_max, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(len(sizes), heads, kv_len, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(len(sizes), heads, kv_len, dim, generator=gen, dtype=torch.float64)
    mask = tree_attention_mask(parents, cu, torch.tensor(prefix_lens), padding_side=padding_side,
                               dtype=torch.float64)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out_bool = sdpa(q, k, v, attn_mask=mask.allowed)
    out_add = sdpa(q, k, v, attn_mask=mask.additive)
    assert torch.isfinite(out_bool).all() and torch.isfinite(out_add).all()  # padding rows too
    for b, parents_b in enumerate(local_parents):
        p = prefix_lens[b]
        prefix_cols = list(range(p)) if padding_side == "right" else list(range(kv_prefix_len - p, kv_prefix_len))
        for i in range(sizes[b]):
            cols = prefix_cols + [kv_prefix_len + j for j in ancestors_or_self(parents_b, i)]
            causal = torch.ones(len(cols), len(cols), dtype=torch.bool).tril()
            # the query of node i is the last query of its path sequence
            qs = torch.zeros(1, heads, len(cols), dim, dtype=torch.float64)
            qs[:, :, -1] = q[b, :, i]
            ref = sdpa(qs, k[b:b + 1, :, cols], v[b:b + 1, :, cols], attn_mask=causal)[0, :, -1]
            torch.testing.assert_close(out_bool[b, :, i], ref, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out_add[b, :, i], ref, rtol=1e-12, atol=1e-12)


def test_depths_positions_and_padding_roundtrip():
    gen = torch.Generator().manual_seed(3)
    sizes = [12, 0, 1, 30, 7]
    parents, tokens, cu, local_parents = random_tree_batch(sizes, 100, gen)
    expected_depth = [len(ancestors_or_self(p, i)) - 1 for p in local_parents for i in range(len(p))]
    assert tree_depths(parents, cu).tolist() == expected_depth
    assert tree_depths(parents.to(torch.int64), cu.to(torch.int64)).tolist() == expected_depth
    prefix_lens = torch.tensor([5, 2, 0, 11, 3])
    pos = tree_position_ids(parents, cu, prefix_lens)
    assert pos.shape == (5, 30) and pos.dtype == torch.int64
    padded_depth = pad_nodes(torch.tensor(expected_depth), cu, fill=0)
    assert torch.equal(pos, prefix_lens[:, None] + padded_depth)
    assert torch.equal(tree_position_ids(parents, cu, n_max=31)[:, :30], padded_depth)
    padded_tokens = pad_nodes(tokens, cu, n_max=32, fill=-1)
    assert padded_tokens.shape == (5, 32) and (padded_tokens[1] == -1).all()
    assert torch.equal(unpad_nodes(padded_tokens, cu), tokens)
    rows = torch.randn(int(cu[-1]), 3)
    assert torch.equal(unpad_nodes(pad_nodes(rows, cu), cu), rows)
    # A deep chain needs several pointer-jumping rounds.
    chain = torch.arange(-1, 99, dtype=torch.int32)
    assert tree_depths(chain, torch.tensor([0, 100])).tolist() == list(range(100))
    assert tree_depths(torch.zeros(0, dtype=torch.int32), torch.tensor([0])).numel() == 0


def test_accepted_kv_indices_layout():
    accepted = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    num_accepted = torch.tensor([2, 0, 0], dtype=torch.int32)
    prefix_lens = torch.tensor([2, 4, 3])
    idx, lens = accepted_kv_indices(accepted, num_accepted, prefix_lens)
    assert lens.tolist() == [5, 5, 3]
    # right: prefix [0, P), tree node i at column 4 + i
    assert idx[0, :5].tolist() == [0, 1, 4, 6, 9]
    assert idx[1, :5].tolist() == [0, 1, 2, 3, 4]
    assert idx[2, :3].tolist() == [0, 1, 2]
    idx, lens = accepted_kv_indices(accepted, num_accepted, prefix_lens, padding_side="left")
    assert idx.shape == (3, 8)
    assert idx[0, 3:].tolist() == [2, 3, 4, 6, 9]
    assert idx[1, 3:].tolist() == [0, 1, 2, 3, 4]
    assert idx[2, 5:].tolist() == [1, 2, 3]
    assert (idx >= 0).all() and (idx < 4 + 4 + 4).all()


# --------------------------------------------------------------------------------------------
# HF transformers: a tiny random Llama
# --------------------------------------------------------------------------------------------

VOCAB = 32


def tiny_llama(attn_implementation: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.3,  # large enough that masking mistakes move the logits visibly
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def new_cache(model):
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def forward(model, input_ids, attention_mask=None, position_ids=None, cache=None):
    """Logits; ``cache`` (a DynamicCache) is extended in place. transformers 5.x renamed
    ``past_key_values`` to ``cache``; accept either."""
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    if cache is not None:
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        kwargs[name] = cache
        kwargs["use_cache"] = True
    with torch.no_grad():
        return model(**kwargs).logits


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def path_logits(model, prefix: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
    """[n, V]: logits of each node from a plain causal forward over prefix + root-to-node path."""
    rows = []
    for i in range(len(parents)):
        seq = prefix + [tokens[j] for j in ancestors_or_self(parents, i)]
        rows.append(forward(model, torch.tensor([seq]))[0, -1])
    return torch.stack(rows)


def two_requests():
    """Two requests with different prefix lengths and tree shapes."""
    gen = torch.Generator().manual_seed(11)
    sizes, prefixes = [8, 5], [[3, 7, 1], [9, 4, 4, 20, 2, 31]]
    parents, tokens, cu, local_parents = random_tree_batch(sizes, VOCAB, gen)
    return prefixes, parents, tokens, cu, local_parents


MASK_CASES = [("eager", "additive"), ("sdpa", "additive"), ("sdpa", "allowed")]


@pytest.mark.parametrize("attn,form", MASK_CASES)
def test_hf_llama_one_forward_over_prefix_and_tree(attn, form):
    """Prefix and tree in one forward: the prefix is a chain hanging above the root, so the whole
    request is one tree without a cached prefix."""
    model = tiny_llama(attn)
    prefixes, parents, tokens, cu, local_parents = two_requests()
    all_tokens, all_parents, sizes = [], [], []
    for b, prefix in enumerate(prefixes):
        toks = tokens[cu[b]:cu[b + 1]].tolist()
        n_prefix = len(prefix)
        all_tokens += prefix + toks
        all_parents += list(range(-1, n_prefix - 1)) + [n_prefix - 1] + [p + n_prefix for p in local_parents[b][1:]]
        sizes.append(n_prefix + len(toks))
    merged_cu = torch.tensor([0] + list(itertools.accumulate(sizes)))
    merged_parents = torch.tensor(all_parents, dtype=torch.int32)
    mask = tree_attention_mask(merged_parents, merged_cu)
    logits = forward(model, pad_nodes(torch.tensor(all_tokens), merged_cu),
                     attention_mask=getattr(mask, form), position_ids=tree_position_ids(merged_parents, merged_cu))
    assert torch.isfinite(logits).all()
    for b, prefix in enumerate(prefixes):
        toks = tokens[cu[b]:cu[b + 1]].tolist()
        expected = path_logits(model, prefix, toks, local_parents[b])
        got = logits[b, len(prefix):sizes[b]]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def prefill(model, prefixes, padding_side, form):
    """Fill a DynamicCache with the padded prefixes; returns (cache, prefix_lens, width)."""
    prefix_lens = torch.tensor([len(p) for p in prefixes])
    width = int(prefix_lens.max())
    cache = new_cache(model)
    if padding_side == "right":
        # A right-padded prefill is a batch of chains: the tree mask does it.
        chains = torch.cat([torch.arange(-1, n - 1, dtype=torch.int32) for n in prefix_lens.tolist()])
        chain_cu = torch.cat([torch.zeros(1, dtype=torch.int64), prefix_lens.cumsum(0)])
        mask = tree_attention_mask(chains, chain_cu)
        ids = pad_nodes(torch.tensor(sum(prefixes, [])), chain_cu)
        forward(model, ids, getattr(mask, form), tree_position_ids(chains, chain_cu), cache)
    else:
        # HF's own left-padded prefill (what generate() leaves in the cache): a 2D mask.
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prefixes])
        mask_2d = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes])
        positions = (mask_2d.cumsum(-1) - 1).clamp(min=0)
        forward(model, ids, mask_2d, positions, cache)
    return cache, prefix_lens, width


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("attn,form", MASK_CASES)
def test_hf_llama_tree_over_cached_prefix_and_kv_compaction(attn, form, padding_side):
    model = tiny_llama(attn)
    prefixes, parents, tokens, cu, local_parents = two_requests()
    cache, prefix_lens, width = prefill(model, prefixes, padding_side, form)

    # Verify pass: all tree nodes at once on top of the cached prefixes.
    mask = tree_attention_mask(parents, cu, prefix_lens, kv_prefix_len=width, padding_side=padding_side)
    logits = forward(model, pad_nodes(tokens, cu), getattr(mask, form),
                     tree_position_ids(parents, cu, prefix_lens), cache)
    assert torch.isfinite(logits).all()
    for b, prefix in enumerate(prefixes):
        expected = path_logits(model, prefix, tokens[cu[b]:cu[b + 1]].tolist(), local_parents[b])
        torch.testing.assert_close(unpad_nodes(logits, cu)[cu[b]:cu[b + 1]], expected, rtol=1e-5, atol=1e-5)

    # Accept the deepest path of request 0 and only the root of request 1, compact the cache.
    max_depth = 6
    depth0 = tree_depths(parents, cu)[: cu[1]]
    deepest = ancestors_or_self(local_parents[0], int(depth0.argmax()))
    accepted = torch.full((2, max_depth + 1), -1, dtype=torch.int32)
    accepted[0, :len(deepest)] = torch.tensor(deepest)
    accepted[1, 0] = 0
    num_accepted = torch.tensor([len(deepest) - 1, 0], dtype=torch.int32)
    kv_idx, kv_lens = accepted_kv_indices(accepted, num_accepted, prefix_lens, kv_prefix_len=width,
                                          padding_side=padding_side)
    out_len = kv_idx.shape[1]
    layers = cache_tensors(cache)
    for b, prefix in enumerate(prefixes):
        n = int(kv_lens[b])
        keep = slice(0, n) if padding_side == "right" else slice(out_len - n, out_len)
        path = [int(tokens[cu[b] + j]) for j in accepted[b, : int(num_accepted[b]) + 1].tolist()]
        assert n == len(prefix) + len(path)
        fresh = new_cache(model)
        forward(model, torch.tensor([prefix + path]), cache=fresh)
        for (keys, values), (fresh_keys, fresh_values) in zip(layers, cache_tensors(fresh)):
            assert keys.shape[2] == width + int(cu.diff().max())
            # One gather along the sequence axis compacts the whole batch.
            index = kv_idx[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
            torch.testing.assert_close(keys.gather(2, index)[b, :, keep], fresh_keys[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(values.gather(2, index)[b, :, keep], fresh_values[0], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# EAGLE-2 builder
# --------------------------------------------------------------------------------------------


def bigram_draft(vocab: int, seed: int, masked: int = 0):
    """A tiny torch-only draft: logits depend on the last two path tokens; the ``masked`` last
    vocabulary entries are -inf (never drafted)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, vocab, vocab, generator=gen) * 2

    def logits_of(paths: torch.Tensor) -> torch.Tensor:
        prev = paths[:, -2] if paths.shape[1] > 1 else paths[:, -1]
        out = table[prev, paths[:, -1]].clone()
        if masked:
            out[:, vocab - masked:] = float("-inf")
        return out

    return logits_of


def brute_force_top_nodes(root: int, logits_of, top_k: int, max_depth: int, num_nodes: int, beam=None):
    """{path tuple: score} of the kept nodes, by plain enumeration.

    beam=None: the top ``num_nodes`` of the full top-k tree of depth ``max_depth``;
    beam=w: EAGLE-2 literally (every level's children join the pool, the best w are expanded)."""
    pool = {}
    frontier = [((root,), 0.0)]
    for _ in range(max_depth):
        children = []
        for path, score in frontier:
            logp = torch.log_softmax(logits_of(torch.tensor([list(path)])).float(), -1)[0].clamp(max=0)
            values, toks = logp.topk(min(top_k, logp.numel()))
            for v, t in zip(values.tolist(), toks.tolist()):
                if v > float("-inf"):
                    children.append((path + (t,), score + v))
        pool.update(children)
        children.sort(key=lambda c: -c[1])
        frontier = children if beam is None else children[:beam]
    best = sorted(pool.items(), key=lambda c: -c[1])[:num_nodes]
    return dict(best)


def tree_paths(tree, b):
    """{path tuple: score} of request b's nodes, root excluded."""
    lo, hi = int(tree.cu_num_nodes[b]), int(tree.cu_num_nodes[b + 1])
    toks, pars = tree.tokens[lo:hi].tolist(), tree.parents[lo:hi].tolist()
    return {tuple(toks[j] for j in ancestors_or_self(pars, i)): float(tree.scores[lo + i]) for i in range(1, hi - lo)}


def check_structure(tree, vocab, num_draft_nodes, max_depth):
    check_tree(tree.parents, tree.tokens, tree.cu_num_nodes, vocab_size=vocab, deterministic=True,
               max_depth=max_depth)
    assert tree.parents.dtype == torch.int32 and tree.cu_num_nodes.dtype == torch.int32
    assert torch.equal(tree.depth.to(torch.int64), tree_depths(tree.parents, tree.cu_num_nodes))
    counts = tree.cu_num_nodes.diff()
    assert (counts <= num_draft_nodes + 1).all()
    for b in range(counts.numel()):
        lo, hi = int(tree.cu_num_nodes[b]), int(tree.cu_num_nodes[b + 1])
        depth, scores, par = tree.depth[lo:hi], tree.scores[lo:hi], tree.parents[lo:hi].long()
        assert par[0] == -1 and scores[0] == 0 and depth[0] == 0
        assert (par[1:] < torch.arange(1, hi - lo)).all()
        assert (scores[1:] <= scores[par[1:]]).all()            # a child never outscores its parent
        assert (depth[1:] >= depth[:-1]).all()                   # level order
        same_level = depth[1:] == depth[:-1]
        assert (scores[1:][same_level] <= scores[:-1][same_level]).all()  # best first in a level


@pytest.mark.parametrize("top_k,max_depth,num_nodes,beam", [
    (2, 4, 9, None), (3, 3, 20, None), (3, 3, 39, None), (4, 3, 7, None),
    (3, 4, 10, 3), (2, 5, 12, 2), (3, 3, 20, 9),
])
def test_builder_matches_brute_force(top_k, max_depth, num_nodes, beam):
    vocab = 12
    logits_of = bigram_draft(vocab, seed=top_k * 100 + max_depth)
    roots = torch.tensor([3, 0, 11])
    calls = []

    def draft(level: DraftLevel) -> torch.Tensor:
        calls.append(level)
        assert level.paths.shape == (level.request.numel(), level.depth + 1)
        assert torch.equal(level.paths[:, 0], roots[level.request])
        return logits_of(level.paths)

    tree = build_eagle_tree(roots, draft, num_draft_nodes=num_nodes, top_k=top_k, max_depth=max_depth,
                            beam_width=beam)
    check_structure(tree, vocab, num_nodes, max_depth)
    full_size = sum(top_k ** d for d in range(1, max_depth + 1))
    assert tree.cu_num_nodes.diff().tolist() == [1 + min(num_nodes, full_size)] * 3
    for b, root in enumerate(roots.tolist()):
        got = tree_paths(tree, b)
        expected = brute_force_top_nodes(root, logits_of, top_k, max_depth, num_nodes, beam)
        assert got.keys() == expected.keys()
        for path, score in expected.items():
            assert got[path] == pytest.approx(score, abs=1e-5)
    # parent_row links each call's rows to their parents in the previous call.
    for prev, cur in zip(calls, calls[1:]):
        assert (cur.parent_row >= 0).all()
        assert torch.equal(prev.paths[cur.parent_row], cur.paths[:, :-1])
        assert torch.equal(prev.request[cur.parent_row], cur.request)
    assert len(calls) <= max_depth and (calls[0].parent_row == -1).all()


def test_builder_small_support_and_edge_cases():
    vocab = 10
    logits_of = bigram_draft(vocab, seed=5, masked=8)  # only 2 draftable tokens per row
    tree = build_eagle_tree(torch.tensor([1, 4]), lambda lv: logits_of(lv.paths), num_draft_nodes=50,
                            top_k=4, max_depth=3)
    check_structure(tree, vocab, 50, 3)
    assert tree.cu_num_nodes.diff().tolist() == [1 + 2 + 4 + 8] * 2
    assert (tree.tokens.view(2, -1)[:, 1:] < 2).all()
    # No draft nodes / depth 0: the roots alone, the draft never called.
    for kwargs in (dict(num_draft_nodes=0, max_depth=3), dict(num_draft_nodes=5, max_depth=0)):
        tree = build_eagle_tree(torch.tensor([7, 2], dtype=torch.int32), lambda lv: pytest.fail("called"),
                                top_k=2, **kwargs)
        assert tree.tokens.tolist() == [7, 2] and tree.tokens.dtype == torch.int32
        assert tree.parents.tolist() == [-1, -1] and tree.cu_num_nodes.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="draft_logits_fn must return"):
        build_eagle_tree(torch.tensor([1]), lambda lv: torch.zeros(5, vocab), num_draft_nodes=3, top_k=2,
                         max_depth=2)
    with pytest.raises(ValueError, match="beam_width"):
        build_eagle_tree(torch.tensor([1]), lambda lv: None, num_draft_nodes=3, top_k=2, max_depth=2,
                         beam_width=0)


def test_builder_with_tiny_llama_draft():
    """The builder driven by an HF model (prefix + path per row), checked against enumeration."""
    model = tiny_llama("sdpa")
    prefixes = [[5, 9, 2], [17, 3, 3, 8, 30]]
    roots = torch.tensor([12, 0])

    def logits_of_request(b):
        return lambda paths: forward(model, torch.cat([torch.tensor(prefixes[b]).expand(paths.shape[0], -1),
                                                       paths], dim=1))[:, -1]

    def draft(level: DraftLevel) -> torch.Tensor:
        out = torch.empty(level.request.numel(), VOCAB)
        for b in level.request.unique().tolist():
            rows = level.request == b
            out[rows] = logits_of_request(b)(level.paths[rows])
        return out

    tree = build_eagle_tree(roots, draft, num_draft_nodes=12, top_k=3, max_depth=4)
    check_structure(tree, VOCAB, 12, 4)
    assert tree.cu_num_nodes.tolist() == [0, 13, 26]
    for b in range(2):
        expected = brute_force_top_nodes(int(roots[b]), logits_of_request(b), 3, 4, 12)
        got = tree_paths(tree, b)
        assert got.keys() == expected.keys()
        assert all(got[p] == pytest.approx(s, abs=1e-5) for p, s in expected.items())


# --------------------------------------------------------------------------------------------
# check_tree
# --------------------------------------------------------------------------------------------


def test_check_tree_accepts_valid_trees():
    gen = torch.Generator().manual_seed(0)
    for sizes in ([1], [5, 0, 17], [0], [], [64, 3]):
        parents, tokens, cu, _ = random_tree_batch(sizes, 40, gen)
        check_tree(parents, tokens, cu, vocab_size=40)
        check_tree(parents.long(), tokens.int(), cu.long(), vocab_size=40, deterministic=False, max_depth=64)
    # The root's token is not read by the op: -1 there is fine.
    check_tree(torch.tensor([-1, 0]), torch.tensor([-1, 3]), torch.tensor([0, 2]), vocab_size=4)


T = torch.tensor


@pytest.mark.parametrize("parents,tokens,cu,kwargs,message", [
    # root's parent != -1
    (T([-1, 0, 0, 0, 1]), T([1, 2, 3, 4, 5]), T([0, 3, 5]), {},
     r"parents\[3\] = 0 \(request 1, node 0\): a root \(local node 0\) must have parent -1"),
    # parent >= child
    (T([-1, 0, 2, 1]), T([1, 2, 3, 4]), T([0, 4]), {},
     r"parents\[2\] = 2 \(request 0, node 2\) is not smaller than the node's local index 2"),
    (T([-1, -1, 0, 1, 3]), T([1, 2, 3, 4, 5]), T([0, 1, 5]), {},
     r"parents\[4\] = 3 \(request 1, node 3\) is not smaller than the node's local index 3"),
    # parent out of range: past the request's nodes, or negative
    (T([-1, 0, 7, -1, 0]), T([1, 2, 3, 4, 5]), T([0, 3, 5]), {},
     r"parents\[2\] = 7 \(request 0, node 2\) is out of range: .* \[0, 3\)"),
    (T([-1, 0, -1]), T([1, 2, 3]), T([0, 3]), {},
     r"parents\[2\] = -1 \(request 0, node 2\) is out of range"),
    (T([-1, 0, -2]), T([1, 2, 3]), T([0, 3]), {},
     r"parents\[2\] = -2 \(request 0, node 2\) is out of range"),
    # a token outside [0, V)
    (T([-1, 0, 0, -1, 0]), T([1, 2, 3, 4, 9]), T([0, 3, 5]), dict(vocab_size=8),
     r"tokens\[4\] = 9 \(request 1, node 1\) is outside the vocabulary \[0, 8\)"),
    (T([-1, 0]), T([1, -3]), T([0, 2]), dict(vocab_size=8),
     r"tokens\[1\] = -3 \(request 0, node 1\) is outside"),
    # duplicate sibling tokens under deterministic drafts
    (T([-1, 0, 0, 1, 1, 1, 2]), T([0, 5, 6, 7, 8, 7, 7]), T([0, 7]), {},
     r"tokens: request 0 has duplicate sibling tokens 7 at nodes 3 and 5 \(tokens\[3\], tokens\[5\]\), "
     r"children of node 1"),
    (T([-1, -1, 0, 0]), T([4, 4, 2, 2]), T([0, 1, 4]), {},
     r"request 1 has duplicate sibling tokens 2 at nodes 1 and 2"),
    # offsets and lengths
    (T([-1, 0]), T([1, 2]), T([1, 2]), {}, r"cu_num_nodes\[0\] must be 0, got 1"),
    (T([-1, 0, -1]), T([1, 2, 3]), T([0, 2, 1, 3]), {}, r"non-decreasing: request 1"),
    (T([-1, 0]), T([1, 2]), T([0, 3]), {}, r"cu_num_nodes\[-1\] = 3 must equal the number of nodes N = 2"),
    (T([-1, 0]), T([1]), T([0, 2]), {}, r"tokens has 1 entries but parents has 2"),
    # deeper than max_depth
    (T([-1, 0, 1, 2]), T([1, 2, 3, 4]), T([0, 4]), dict(max_depth=2),
     r"node \(request 0, node 3\) \(parents\[3\]\) is at depth 3 > max_depth = 2"),
])
def test_check_tree_rejects(parents, tokens, cu, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_tree(parents, tokens, cu, **kwargs)


def test_check_tree_sampled_drafts_allow_duplicate_siblings_and_types():
    parents, tokens, cu = T([-1, 0, 0]), T([1, 2, 2]), T([0, 3])
    check_tree(parents, tokens, cu, deterministic=False)
    with pytest.raises(ValueError, match="duplicate sibling"):
        check_tree(parents, tokens, cu)
    with pytest.raises(TypeError, match="parents must have dtype int32 or int64"):
        check_tree(parents.float(), tokens, cu)
    with pytest.raises(TypeError, match="tokens must be a torch.Tensor"):
        check_tree(parents, [1, 2, 2], cu)
    with pytest.raises(ValueError, match="cu_num_nodes must be 1-D"):
        check_tree(parents, tokens, cu[None])
