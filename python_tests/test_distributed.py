"""Vocabulary-parallel verification over torch.distributed (gloo, spawned CPU processes):
every rank returns the single-device op's tokens on the gathered logits, for shards of any
size (V not divisible by the world size, shards smaller than a sampling chunk), for chains
and for trees."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import specdec_kernels
from specdec_kernels.distributed import rejection_sample_vocab_parallel, tree_rejection_sample_vocab_parallel
from utils import TRITON_ON_CPU, random_batch

try:
    from specdec_kernels.triton import vocab_parallel as _tvp
except ImportError:  # no triton: the torch path only
    _tvp = None

CASES = [
    # (world size, vocab, draft probabilities, batch)
    (2, 1000, False, 24),
    (2, 9000, True, 16),
    (3, 7, True, 24),
    (3, 1025, False, 24),
    (3, 600, True, 24),
]


def _shard_bounds(vocab: int, world: int) -> list[tuple[int, int]]:
    """Ragged contiguous shards: the first vocab % world ranks get one more entry."""
    base, extra = divmod(vocab, world)
    bounds, start = [], 0
    for r in range(world):
        size = base + (r < extra)
        bounds.append((start, start + size))
        start += size
    return bounds


def _chain_call(rank, world, case_index):
    _, vocab, probs, batch = CASES[case_index]
    logits, ids, cu, draft_probs, temp, seeds, offs, k = random_batch(batch, 4, vocab, draft_probs=probs,
                                                                      seed=100 + case_index)
    lo, hi = _shard_bounds(vocab, world)[rank]
    return rejection_sample_vocab_parallel(
        logits[:, lo:hi].contiguous(), ids, cu, None if draft_probs is None else draft_probs[:, lo:hi].contiguous(),
        temp, seeds, offs, k, vocab_start=lo, vocab_size=vocab)


# Without a GPU, conftest runs Triton in its interpreter: every chain and tree case runs twice,
# on the fused Triton path that CUDA tensors take (forced on these CPU tensors with
# SPECDEC_VP_TRITON=1) and on the torch path (SPECDEC_VP_TRITON=0). The interpreter is slow:
# small shapes only.
PATHS = ("triton", "torch") if TRITON_ON_CPU else ("torch",)


def _select_path(triton_path: bool) -> None:
    from specdec_kernels.distributed import vocab_parallel as distributed
    distributed._INTERPRET = triton_path and TRITON_ON_CPU
    os.environ["SPECDEC_VP_TRITON"] = "1" if triton_path and TRITON_ON_CPU else "0"


# Edge configurations of the chain op, on the fused path (and the torch path):
# (vocab, shard bounds per world size or None for the ragged split, draft probabilities,
#  batch, max drafts, logits dtype, options) -- options: "no_temp", "no_offsets",
#  "no_seeds", "int32_ids", "no_drafts" (every n_b = 0), "L0" (max_spec_len = 0), "small_tiles"
#  (the fused kernels' tiles shrunk: rows split into several segments, one chunk per program)
CHAIN_EDGE_CASES = [
    (300, {2: [(0, 0), (0, 300)], 3: [(0, 1), (1, 257), (257, 300)]}, True, 12, 3, torch.float32,
     ("no_temp", "int32_ids")),                  # an empty shard / a 1-entry shard
    (700, None, False, 12, 3, torch.bfloat16, ("no_offsets", "small_tiles")),
    (500, None, True, 6, 2, torch.float32, ("no_drafts", "no_seeds")),
    (260, None, False, 6, 0, torch.float32, ("L0",)),
]


def _chain_edge_batch(i):
    vocab, _, probs, batch, k, dtype, opts = CHAIN_EDGE_CASES[i]
    logits, ids, cu, p, temp, seeds, offs, _ = random_batch(batch, max(k, 1), vocab, draft_probs=probs, seed=300 + i,
                                                            dtype=dtype)
    if "no_drafts" in opts or "L0" in opts:
        rows = torch.arange(cu.shape[0] - 1) + cu[1:].long()  # each request's bonus row
        logits, ids = logits[rows], ids[:0]
        p = None if p is None else p[:0]
        cu = torch.zeros_like(cu)
    if "int32_ids" in opts:
        ids = ids.to(torch.int32)
    return (logits, ids, cu, p, None if "no_temp" in opts else temp, None if "no_seeds" in opts else seeds,
            None if "no_offsets" in opts else offs, k)


def _chain_edge_calls(rank, world):
    results = []
    for i, (vocab, bounds, *_rest) in enumerate(CHAIN_EDGE_CASES):
        logits, ids, cu, p, temp, seeds, offs, k = _chain_edge_batch(i)
        lo, hi = ((bounds or {}).get(world) or _shard_bounds(vocab, world))[rank]
        per_path = {}
        for path in PATHS:
            _select_path(path == "triton")
            if seeds is None:
                torch.manual_seed(5)  # rank 0 draws the seeds: the same on both paths
            small = _tvp is not None and "small_tiles" in CHAIN_EDGE_CASES[i][-1]
            saved = (_tvp.BLOCK, _tvp.CHUNKS_PER_PROGRAM) if small else None
            if small:
                _tvp.BLOCK, _tvp.CHUNKS_PER_PROGRAM = 32, 1
            try:
                per_path[path] = rejection_sample_vocab_parallel(
                    logits[:, lo:hi].contiguous(), ids, cu, None if p is None else p[:, lo:hi].contiguous(), temp,
                    seeds, offs, k, vocab_start=lo, vocab_size=vocab)
            finally:
                if small:
                    _tvp.BLOCK, _tvp.CHUNKS_PER_PROGRAM = saved
        results.append(per_path)
    return results


def _worker(rank, world, init_file, out_dir):
    """Every chain and tree case of this world size in one process group (spawning dominates)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from specdec_kernels.distributed import vocab_parallel as distributed
    fused = distributed._chain_fused
    calls = []
    distributed._chain_fused = lambda *a, **k: calls.append(1) or fused(*a, **k)  # count the fused calls
    chain = {}
    for i, case in enumerate(CASES):
        if case[0] == world:
            for path in PATHS:
                _select_path(path == "triton")
                chain[i, path] = _chain_call(rank, world, i)
    edges = _chain_edge_calls(rank, world)
    # every chain call of the Triton path took the fused kernels
    n_chain = sum(case[0] == world for case in CASES) + len(CHAIN_EDGE_CASES)
    assert len(calls) == (n_chain if "triton" in PATHS else 0), (len(calls), n_chain)
    distributed._chain_fused = fused
    tree_fused = distributed._tree_fused
    calls.clear()
    distributed._tree_fused = lambda *a, **k: calls.append(1) or tree_fused(*a, **k)
    tree = _tree_calls(rank, world)
    residual = _residual_call(rank, world)
    tree_edges = _tree_edge_calls(rank, world)
    # every float32 tree call of the Triton path with nodes took the fused kernels
    n_tree = (sum(case[4] == torch.float32 for case in TREE_CASES[world]) + 2
              + sum("N0" not in case[-1] for case in TREE_EDGE_CASES))
    assert len(calls) == (n_tree if "triton" in PATHS else 0), (len(calls), n_tree)
    distributed._tree_fused = tree_fused
    torch.save((chain, tree, residual, edges, tree_edges), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


_SPAWNED = {}


def _results(world):
    """[(chain results by case, tree results, residual-case result)] per rank, one spawn per
    world size and session."""
    if world not in _SPAWNED:
        with tempfile.TemporaryDirectory() as out_dir:
            init_file = os.path.join(out_dir, "init")
            mp.spawn(_worker, args=(world, init_file, out_dir), nprocs=world, join=True)
            _SPAWNED[world] = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    return _SPAWNED[world]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_vocab_parallel_equals_single_device(case_index, path):
    world, vocab, probs, batch = CASES[case_index]
    results = [chain[case_index, path] for chain, *_ in _results(world)]
    for out, num in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(num, results[0][1]), "ranks disagree"
    args = random_batch(batch, 4, vocab, draft_probs=probs, seed=100 + case_index)
    ref_out, ref_num = specdec_kernels.rejection_sample(*args, backend="reference")
    same = (results[0][0] == ref_out).all(1) & (results[0][1] == ref_num)
    assert same.float().mean() >= 0.999, f"{int((~same).sum())} of {batch} requests differ from the single-device op"
    if path == "triton":  # the fused kernels do the torch path's arithmetic: the same tokens
        other = _results(world)[0][0][case_index, "torch"]
        assert torch.equal(results[0][0], other[0]) and torch.equal(results[0][1], other[1])


@pytest.mark.parametrize("world", sorted({c[0] for c in CASES}))
@pytest.mark.parametrize("edge_index", range(len(CHAIN_EDGE_CASES)))
def test_vocab_parallel_chain_edge_cases(world, edge_index):
    """Empty and 1-entry shards, no temperatures / offsets / seeds / drafts, int32 ids, bf16
    logits, max_spec_len 0: both paths, every rank, the single-device op's tokens."""
    per_rank = [edges[edge_index] for _, _, _, edges, _ in _results(world)]
    logits, ids, cu, p, temp, seeds, offs, k = _chain_edge_batch(edge_index)
    if seeds is None:
        torch.manual_seed(5)
        seeds = torch.randint(-(2**63), 2**63 - 1, (cu.shape[0] - 1,), dtype=torch.int64)
    ref_out, ref_num = specdec_kernels.rejection_sample(logits, ids, cu, p, temp, seeds, offs, k, backend="reference")
    for path in PATHS:
        out, num = per_rank[0][path]
        for other in per_rank[1:]:
            assert torch.equal(other[path][0], out) and torch.equal(other[path][1], num), f"{path}: ranks disagree"
        same = (out == ref_out).all(1) & (num == ref_num)
        assert same.float().mean() >= 0.999, f"{path}: {int((~same).sum())} requests differ from the single-device op"


# --- trees -----------------------------------------------------------------------------------

# world size -> configurations run by one spawn: (vocab, draft probabilities, max_depth,
# shard bounds or None for the ragged split, compute dtype, pass max_children, bushy: many
# children per node and few boosted drafts, so that walks often stop after several
# rejections at one node, the case of the residual-mass rounds)
TREE_CASES = {
    2: [(1000, False, 2, None, torch.float32, True, False),
        (9000, True, 4, None, torch.float32, False, False),
        (7, True, 5, None, torch.float32, True, False),      # tiny vocabulary: repeated i.i.d. children
        (5, False, 6, None, torch.float64, False, False),    # duplicate siblings of deterministic drafts
        (60, True, 3, None, torch.float32, True, True)],
    3: [(1025, True, 2, None, torch.float32, True, False),
        (600, False, 3, None, torch.float32, True, False),
        (300, True, 6, [(0, 1), (1, 257), (257, 300)], torch.float32, False, False),  # a 1-entry shard
        (700, False, 4, [(0, 0), (0, 512), (512, 700)], torch.float32, True, False),  # an empty shard
        (300, True, 3, [(0, 100), (100, 280), (280, 300)], torch.float32, False, True)],
}
TREE_BATCH = 40


def _tree_batch(vocab, probs, seed, batch=TREE_BATCH, bushy=False):
    """Random ragged trees (some malformed links and ids), children often the parent row's
    likely tokens; drafts i.i.d. from the draft row (probs) or mostly distinct (top-k like)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 11, (batch,), generator=g)
    counts[:2] = torch.tensor([0, 1])
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    n = int(cu[-1])
    logits = torch.randn(n, vocab, generator=g) * 2
    logits[torch.rand(n, vocab, generator=g) < 0.1] = float("-inf")
    logits[0, 0] = float("nan")
    logits[1, -1] = float("inf")
    p = torch.softmax(torch.randn(n, vocab, generator=g) * 2, -1)
    parents = torch.full((n,), -1, dtype=torch.int32)
    tokens = torch.zeros(n, dtype=torch.int64)
    for b in range(batch):
        s = int(cu[b])
        for j in range(1, int(counts[b])):
            if bushy:
                par = 0 if torch.rand(1, generator=g) < 0.6 else int(torch.randint(0, j, (1,), generator=g))
            else:
                par = j - 1 if torch.rand(1, generator=g) < 0.4 else int(torch.randint(0, j, (1,), generator=g))
            parents[s + j] = par
            row = s + par
            if probs:
                tokens[s + j] = int(torch.multinomial(p[row], 1, generator=g))
            else:  # the next untaken token of the draft's ranking, sometimes a repeat
                taken = tokens[s + 1:s + j][parents[s + 1:s + j] == par].tolist()
                ranked = [t for t in torch.argsort(p[row], descending=True).tolist() if t not in taken]
                tok = ranked[0] if (ranked and torch.rand(1, generator=g) < 0.7) or not taken else taken[0]
                tokens[s + j] = tok
            if torch.rand(1, generator=g) < (0.1 if bushy else 0.6):
                logits[row, tokens[s + j]] = logits[row].nan_to_num(nan=0, posinf=0, neginf=0).max() + 1.0
    if n > 12:
        tokens[5] = vocab + 3   # invalid ids
        tokens[9] = -1
        parents[7] = 40         # parent >= child
    temperature = torch.rand(batch, generator=g) * 1.4 + 0.3
    temperature[torch.rand(batch, generator=g) < 0.3] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 2**40, (batch,), generator=g)
    return logits, tokens, parents, cu, (p if probs else None), temperature, seeds, offsets


def _max_children(parents, cu):
    counts = {}
    for b in range(cu.shape[0] - 1):
        for j in range(int(cu[b]) + 1, int(cu[b + 1])):
            counts[(b, int(parents[j]))] = counts.get((b, int(parents[j])), 0) + 1
    return max(counts.values(), default=0)


# The interpreter runs the fused path on the first TRITON_TREE_REQUESTS requests of each tree
# batch (requests are independent: the same outputs as those rows of the whole batch).
TRITON_TREE_REQUESTS = 12


def _first_requests(batch, k):
    """The tree batch (logits, tokens, parents, cu, probs, temperature, seeds, offsets) cut to
    its first k requests (well-formed offsets only)."""
    logits, tokens, parents, cu, p, temp, seeds, offs = batch
    n = int(cu[k])
    return (logits[:n], tokens[:n], parents[:n], cu[:k + 1], None if p is None else p[:n],
            None if temp is None else temp[:k], None if seeds is None else seeds[:k], None if offs is None else offs[:k])


def _tree_calls(rank, world):
    """{(case, path): outputs}; case "seeds": seeds drawn inside (rank 0 broadcasts them, after
    the same manual_seed on both paths)."""
    results = {}
    for i, (vocab, probs, depth, bounds, dtype, pass_max_children, bushy) in enumerate(TREE_CASES[world]):
        batch = _tree_batch(vocab, probs, seed=10 * world + i, bushy=bushy)
        lo, hi = (bounds or _shard_bounds(vocab, world))[rank]
        for path in PATHS:
            _select_path(path == "triton")
            cut = _first_requests(batch, TRITON_TREE_REQUESTS) if path == "triton" else batch
            logits, tokens, parents, cu, p, temp, seeds, offs = cut
            results[i, path] = tree_rejection_sample_vocab_parallel(
                logits[:, lo:hi].contiguous(), tokens, parents, cu, None if p is None else p[:, lo:hi].contiguous(),
                temp, seeds, offs, depth, vocab_start=lo, vocab_size=vocab, compute_dtype=dtype,
                max_children=_max_children(parents, cu) if pass_max_children else None)
    batch = _tree_batch(100, True, seed=7, batch=TRITON_TREE_REQUESTS)
    logits, tokens, parents, cu, p, temp, _, _ = batch
    lo, hi = _shard_bounds(100, world)[rank]
    for path in PATHS:
        _select_path(path == "triton")
        torch.manual_seed(11)
        results["seeds", path] = tree_rejection_sample_vocab_parallel(
            logits[:, lo:hi], tokens, parents, cu, p[:, lo:hi], temp, max_depth=4, vocab_start=lo, vocab_size=100)
    return results


def _same_outputs(got, want) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", sorted(TREE_CASES))
def test_tree_vocab_parallel_equals_single_device(world, path):
    results = [tree for _, tree, *_ in _results(world)]
    keys = [k for k in results[0] if k[1] == path]
    for other in results[1:]:
        assert all(_same_outputs(other[k], results[0][k]) for k in keys), "ranks disagree"
    for i, (vocab, probs, depth, _, _, _, bushy) in enumerate(TREE_CASES[world]):
        args = _tree_batch(vocab, probs, seed=10 * world + i, bushy=bushy)
        batch = TRITON_TREE_REQUESTS if path == "triton" else TREE_BATCH
        ref = specdec_kernels.tree_rejection_sample(*_first_requests(args, batch), depth)
        out, nodes, num = results[0][i, path]
        same = (out == ref[0]).all(1) & (nodes == ref[1]).all(1) & (num == ref[2])
        assert same.float().mean() >= 0.999, \
            f"case {i}: {int((~same).sum())} of {batch} requests differ from the single-device op"
        if path == "torch":  # test-strength check (the whole batch)
            assert int(num.sum()) > batch // 4, "walks too shallow to exercise the tree"
    if path == "triton":  # the fused kernels do the torch path's arithmetic: the same outputs
        for k in keys:
            want = results[0][k[0], "torch"]
            assert _same_outputs(results[0][k], [t[:TRITON_TREE_REQUESTS] for t in want]), f"case {k[0]}: paths differ"


# Edge configurations of the tree op, on both paths: (vocab, shard bounds per world size or
# None for the ragged split, draft probabilities, batch, max_depth, logits dtype, options) --
# options: "no_temp", "no_offsets", "int32_ids" (tokens, parents, cu), "greedy" / "random"
# (every request), "N0" (no nodes at all), "bad_cu" (offsets that decrease, start above 0
# and pass N: the reference's clamps), "small_tiles" (the fused kernels' tiles shrunk: several
# node tiles per node's children, offset blocks and row segments), "no_max_children".
TREE_EDGE_CASES = [
    (300, {2: [(0, 0), (0, 300)], 3: [(0, 1), (1, 257), (257, 300)]}, True, 10, 3, torch.float32,
     ("no_temp", "int32_ids")),                   # an empty shard / a 1-entry shard
    (700, None, False, 10, 4, torch.bfloat16, ("no_offsets", "small_tiles", "random")),
    (40, None, True, 10, 3, torch.float32, ("small_tiles", "no_max_children")),
    (500, None, False, 8, 3, torch.float32, ("greedy", "bad_cu")),
    (260, None, True, 6, 0, torch.float32, ("bad_cu",)),  # max_depth 0: the root's q
    (260, None, False, 6, 2, torch.float32, ("N0",)),
]


def _tree_edge_batch(i):
    vocab, _, probs, batch, depth, dtype, opts = TREE_EDGE_CASES[i]
    logits, tokens, parents, cu, p, temp, seeds, offs = _tree_batch(vocab, probs, seed=400 + i, batch=batch,
                                                                    bushy="small_tiles" in opts)
    n = logits.shape[0]
    if "N0" in opts:
        logits, tokens, parents, cu = logits[:0], tokens[:0], parents[:0], torch.zeros_like(cu)
        p = None if p is None else p[:0]
    if "bad_cu" in opts:
        cu = cu.clone()
        cu[0], cu[3], cu[-1] = 2, cu[2] - 1, n + 5
    if "greedy" in opts:
        temp = torch.zeros_like(temp)
    if "random" in opts:
        temp = temp.clamp(min=0.5)
    if "int32_ids" in opts:
        tokens, parents, cu = tokens.to(torch.int32), parents.to(torch.int32), cu.to(torch.int32)
    else:
        parents, cu = parents.to(torch.int64), cu.to(torch.int64)
    return (logits.to(dtype), tokens, parents, cu, p, None if "no_temp" in opts else temp, seeds,
            None if "no_offsets" in opts else offs, depth)


def _clean_cu(cu, tokens):
    """The offsets as the ops read them: clamped to [0, N], non-decreasing."""
    return cu.to(torch.int64).clamp(0, tokens.shape[0]).cummax(0).values


def _tree_edge_calls(rank, world):
    results = []
    for i, (vocab, bounds, *_rest) in enumerate(TREE_EDGE_CASES):
        opts = TREE_EDGE_CASES[i][-1]
        logits, tokens, parents, cu, p, temp, seeds, offs, depth = _tree_edge_batch(i)
        lo, hi = ((bounds or {}).get(world) or _shard_bounds(vocab, world))[rank]
        per_path = {}
        for path in PATHS:
            _select_path(path == "triton")
            small = _tvp is not None and "small_tiles" in opts
            saved = (_tvp.BLOCK, _tvp.CHUNKS_PER_PROGRAM, _tvp.NODE_TILE, _tvp.BLOCK_B) if small else None
            if small:
                _tvp.BLOCK, _tvp.CHUNKS_PER_PROGRAM, _tvp.NODE_TILE, _tvp.BLOCK_B = 32, 1, 2, 2
            try:
                per_path[path] = tree_rejection_sample_vocab_parallel(
                    logits[:, lo:hi].contiguous(), tokens, parents, cu, None if p is None else p[:, lo:hi].contiguous(),
                    temp, seeds, offs, depth, vocab_start=lo, vocab_size=vocab,
                    max_children=None if "no_max_children" in opts else _max_children(parents, _clean_cu(cu, tokens)))
            finally:
                if small:
                    _tvp.BLOCK, _tvp.CHUNKS_PER_PROGRAM, _tvp.NODE_TILE, _tvp.BLOCK_B = saved
        results.append(per_path)
    return results


@pytest.mark.parametrize("world", sorted(TREE_CASES))
@pytest.mark.parametrize("edge_index", range(len(TREE_EDGE_CASES)))
def test_tree_vocab_parallel_edge_cases(world, edge_index):
    """Empty and 1-entry shards, no temperatures / offsets, int32 ids, bf16 logits, all-greedy
    and all-random batches, malformed offsets, max_depth 0, no nodes, shrunk tiles: both paths,
    every rank, the single-device op's outputs, and the same outputs on both paths."""
    per_rank = [tree_edges[edge_index] for *_, tree_edges in _results(world)]
    ref = specdec_kernels.tree_rejection_sample(*_tree_edge_batch(edge_index))
    for path in PATHS:
        got = per_rank[0][path]
        assert all(_same_outputs(other[path], got) for other in per_rank[1:]), f"{path}: ranks disagree"
        same = (got[0] == ref[0]).all(1) & (got[1] == ref[1]).all(1) & (got[2] == ref[2])
        assert same.float().mean() >= 0.999, f"{path}: {int((~same).sum())} requests differ from the single-device op"
    if "triton" in PATHS:
        assert _same_outputs(per_rank[0]["triton"], per_rank[0]["torch"]), "paths differ"


def _residual_batch(batch=300):
    """One small tree repeated with different seeds: a root whose three i.i.d. children are
    usually rejected (tokens with q/p <= 0.1), so the final token comes from (q - a p)+ with
    a = 1 + N_1 + N_2 ~ 1.7, among tokens whose ratios q/p (3, 2.2, 1.8, 1.3) straddle it:
    its law moves with every residual mass."""
    q_logits = torch.tensor([0.3, 0.22, 0.18, 0.26, 0.03, 0.01]).log()
    p = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.3, 0.2])
    n = 5  # root, children with tokens 4 5 4, and a grandchild under the first child
    logits = q_logits.repeat(batch * n, 1)
    probs = p.repeat(batch * n, 1)
    tokens = torch.tensor([0, 4, 5, 4, 1]).repeat(batch)
    parents = torch.tensor([-1, 0, 0, 0, 1], dtype=torch.int32).repeat(batch)
    cu = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32)
    seeds = torch.arange(batch, dtype=torch.int64) * 7919 + 11
    return logits, tokens, parents, cu, probs, torch.ones(batch), seeds, None, 2


def _residual_call(rank, world):
    logits, tokens, parents, cu, probs, temp, seeds, offs, depth = _residual_batch()
    lo, hi = _shard_bounds(6, world)[rank]
    results = {}
    for path in PATHS:
        _select_path(path == "triton")
        k = TRITON_RESIDUAL_REQUESTS if path == "triton" else seeds.shape[0]  # (the interpreter is slow)
        n = int(cu[k])
        results[path] = tree_rejection_sample_vocab_parallel(logits[:n, lo:hi].contiguous(), tokens[:n], parents[:n],
                                                             cu[:k + 1], probs[:n, lo:hi].contiguous(), temp[:k],
                                                             seeds[:k], offs, depth, vocab_start=lo, vocab_size=6,
                                                             max_children=3)
    return results


TRITON_RESIDUAL_REQUESTS = 30


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", sorted(TREE_CASES))
def test_tree_vocab_parallel_residual_after_several_rejections(world, path):
    results = [residual[path] for _, _, residual, *_ in _results(world)]
    for other in results[1:]:
        assert _same_outputs(other, results[0]), "ranks disagree"
    ref = specdec_kernels.tree_rejection_sample(*_residual_batch())
    out, nodes, num = results[0]
    k = num.shape[0]
    stopped_at_root = int((num == 0).sum())
    assert stopped_at_root > 2 * k // 3, "test-strength check: the root's children should usually be rejected"
    same = (out == ref[0][:k]).all(1) & (nodes == ref[1][:k]).all(1) & (num == ref[2][:k])
    assert same.float().mean() >= 0.999, f"{int((~same).sum())} of {same.numel()} requests differ"
    if path == "triton":
        want = _results(world)[0][2]["torch"]
        assert _same_outputs(results[0], [t[:k] for t in want]), "paths differ"


def test_tree_vocab_parallel_input_errors():
    """Malformed inputs raise before any collective (no process group needed)."""
    logits, tokens, parents, cu, p, temp, seeds, offs = _tree_batch(50, True, seed=1, batch=4)
    shard = logits[:, :20]
    kwargs = dict(vocab_start=0, vocab_size=50)
    with pytest.raises(ValueError, match="parents must have one entry per node"):
        tree_rejection_sample_vocab_parallel(shard, tokens, parents[:-1], cu, max_depth=3, **kwargs)
    with pytest.raises(ValueError, match=r"draft_probs must have shape \(N, V_local\)"):
        tree_rejection_sample_vocab_parallel(shard, tokens, parents, cu, p, max_depth=3, **kwargs)
    with pytest.raises(ValueError, match="shard .* must lie in"):
        tree_rejection_sample_vocab_parallel(shard, tokens, parents, cu, max_depth=3, vocab_start=40, vocab_size=50)
    with pytest.raises(TypeError, match="tokens must have dtype"):
        tree_rejection_sample_vocab_parallel(shard, tokens.float(), parents, cu, max_depth=3, **kwargs)
    with pytest.raises(ValueError, match="temperature must have shape"):
        tree_rejection_sample_vocab_parallel(shard, tokens, parents, cu, None, temp[:2], max_depth=3, **kwargs)
    with pytest.raises(ValueError, match="max_children must be >= 0"):
        tree_rejection_sample_vocab_parallel(shard, tokens, parents, cu, max_depth=3, max_children=-1, **kwargs)
    # Too small a max_children gives wrong tokens; the validation mode says so before any collective.
    widest = _max_children(parents, cu)
    assert widest >= 2
    with pytest.raises(ValueError, match=f"max_children = {widest - 1}, but node .* has {widest} children"):
        tree_rejection_sample_vocab_parallel(shard, tokens, parents, cu, p[:, :20], max_depth=3,
                                             max_children=widest - 1, validate=True, **kwargs)


def test_fused_philox_equals_torch_philox():
    """The one-launch Philox of the vocab-parallel ops (Triton: on CUDA, or in the interpreter
    that conftest switches on without a GPU) draws the torch Philox's words bit for bit."""
    from specdec_kernels.distributed.vocab_parallel import _philox01
    from specdec_kernels.reference.philox import philox_words
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (7, 1), generator=g, dtype=torch.int64)
    offsets = torch.randint(0, 2**62, (7, 1), generator=g, dtype=torch.int64)
    nodes = torch.randint(0, 2**25, (7, 1), generator=g)
    lanes = torch.arange(600)[None, :]
    for stream in (0, 1):
        got = _philox01(*(t.to(device) for t in (seeds, offsets)), stream, nodes.to(device), lanes.to(device))
        want = philox_words(seeds, offsets, stream, nodes, lanes)[:2]
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
