"""GPU only: vocabulary-parallel verification with 2 and 4 ranks sharing ONE CUDA device.

NCCL refuses two ranks on one GPU, so the ranks talk through gloo, which takes CUDA tensors
for every collective the ops use (all_gather into one tensor, all_reduce SUM / MIN, broadcast:
it stages them through pinned host memory). Four spawned processes, each with its own CUDA
context on device 0; world size 2 is a subgroup of ranks 0 and 1. The shards, the drafts and
every per-request tensor are CUDA tensors, so the local work of both paths runs on the GPU:
the fused Triton kernels of chains and trees (``triton.vocab_parallel``) and the torch path.
Every rank's outputs must equal the single-device op's (``specdec_kernels.rejection_sample`` /
``tree_rejection_sample``, default backend, the same GPU) on the full logits for the same
seeds, on both paths: the cases of test_distributed.py (ragged, 1-entry and empty shards,
draft probabilities, greedy and random requests mixed, malformed trees, bf16 logits, shrunk
tiles, a residual after several rejections) at full batch, plus V = 128256 and 151936.

What this does not validate: NCCL, a real interconnect between GPUs, TP timings
(docs/INTEGRATION.md, "On one GPU"). Run: bash scripts/gpu_vocab_parallel.sh.
"""
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import specdec_kernels
from specdec_kernels.distributed import rejection_sample_vocab_parallel, tree_rejection_sample_vocab_parallel
from specdec_kernels.distributed.vocab_parallel import _all_gather
from test_distributed import (CASES, CHAIN_EDGE_CASES, TREE_BATCH, TREE_CASES, TREE_EDGE_CASES, _chain_edge_batch,
                              _clean_cu, _max_children, _residual_batch, _shard_bounds, _tree_batch, _tree_edge_batch)
from utils import HAS_CUDA, random_batch

try:
    from specdec_kernels.triton import vocab_parallel as _tvp
except ImportError:  # no triton: the module's tests fail on the fused path's call counts
    _tvp = None

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (the ranks share device 0)")

WORLDS = (2, 4)
DEVICE = "cuda"  # every rank's device (index 0)
SPAWNED = max(WORLDS)
# $SPECDEC_VP_TRITON per path: unset = the default, the fused Triton kernels for chains and
# trees on CUDA tensors; "0" the torch path.
PATH_ENV = {"fused": None, "torch": "0"}

# Chains: the cases of test_distributed.py (whatever world size they were written for) and two
# real vocabularies whose drafts are boosted enough to be accepted to various depths:
# (vocab, draft probabilities, batch, seed, boost of the drafts' logits); 4 drafts at most.
CHAIN_CASES = [(vocab, probs, batch, 100 + i, 3.0) for i, (_, vocab, probs, batch) in enumerate(CASES)] + [
    (128256, True, 16, 150, 14.0),
    (151936, False, 32, 151, 14.0),
]
# Trees: TREE_CASES of both world sizes (3-rank shard bounds adapted by _bounds) and two real
# vocabularies: (vocab, draft probabilities, max_depth, shard bounds, compute dtype, pass
# max_children, bushy, seed, batch).
TREE_GPU_CASES = [(*case, 10 * w + i, TREE_BATCH)
                  for w in sorted(TREE_CASES) for i, case in enumerate(TREE_CASES[w])] + [
    (128256, True, 4, None, torch.float32, True, False, 70, 16),
    (151936, False, 3, None, torch.float32, False, False, 72, 16),
]
SEEDS_CASE = (100, 12, 4, 11)  # vocab, batch, max_depth, manual seed: the tree's seeds drawn inside


def _bounds(bounds, vocab: int, world: int) -> list[tuple[int, int]]:
    """Shard bounds for ``world`` ranks: None = the ragged split; a dict by world size or a
    list written for another world size keeps its tiny / empty shards: for 2 ranks the last
    two shards merge, for 4 an empty shard follows the first."""
    if isinstance(bounds, dict):
        bounds = bounds.get(world) or bounds.get(3)
    if bounds is None:
        return _shard_bounds(vocab, world)
    if len(bounds) == world:
        return list(bounds)
    assert len(bounds) == 3, bounds
    if world == 2:
        return [bounds[0], (bounds[1][0], bounds[2][1])]
    assert world == 4, world
    return [bounds[0], (bounds[0][1], bounds[0][1]), *bounds[1:]]


def _cuda(*tensors):
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


def _cpu(outputs):
    return tuple(t.cpu() for t in outputs)


def _chain_batch(i):
    vocab, probs, batch, seed, boost = CHAIN_CASES[i]
    return random_batch(batch, 4, vocab, draft_probs=probs, seed=seed, accept_boost=boost)


def _tree_case_batch(i):
    vocab, probs, depth, _, _, _, bushy, seed, batch = TREE_GPU_CASES[i]
    return (*_tree_batch(vocab, probs, seed=seed, batch=batch, bushy=bushy), depth)


def _seeds_batch():
    vocab, batch, depth, _ = SEEDS_CASE
    logits, tokens, parents, cu, p, temp, _, _ = _tree_batch(vocab, True, seed=7, batch=batch)
    return logits, tokens, parents, cu, p, temp, None, None, depth


def _drawn_seeds(batch: int, manual_seed: int) -> torch.Tensor:
    """The seeds rank 0 draws inside the op (on the CUDA device) after ``manual_seed``."""
    torch.manual_seed(manual_seed)
    return torch.randint(-(2**63), 2**63 - 1, (batch,), dtype=torch.int64, device=DEVICE).cpu()


def _small_tiles(on: bool, tree: bool):
    """Shrinks the fused kernels' tiles (several row segments, one chunk per program, several
    node tiles per node's children); returns the saved values to restore, or None."""
    if not on or _tvp is None:
        return None
    names = ("BLOCK", "CHUNKS_PER_PROGRAM") + (("NODE_TILE", "BLOCK_B") if tree else ())
    saved = {n: getattr(_tvp, n) for n in names}
    for n, v in zip(names, (32, 1, 2, 2)):
        setattr(_tvp, n, v)
    return saved


def _restore(saved):
    for n, v in (saved or {}).items():
        setattr(_tvp, n, v)


def _probe_collectives(group, world: int) -> dict:
    """Each collective the ops call, on CUDA tensors through gloo: {name: error or None}."""
    rank = dist.get_rank(group)
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 -- reported by the test, by collective
            errors[name] = f"{type(e).__name__}: {e}"

    def gather():
        got = _all_gather(torch.full((3, 2), float(rank), device=DEVICE), group)
        assert got.shape == (world, 3, 2) and got.device.type == DEVICE
        assert torch.equal(got[:, 0, 0].cpu(), torch.arange(world, dtype=torch.float32)), got

    def reduce(op, dtype, want):
        t = torch.full((5,), rank + 1, dtype=dtype, device=DEVICE)
        dist.all_reduce(t, op=op, group=group)
        assert t.device.type == DEVICE and bool((t.cpu() == want).all()), t

    def broadcast():
        t = torch.full((4,), 7 if rank == 0 else -1, dtype=torch.int64, device=DEVICE)
        dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
        assert bool((t.cpu() == 7).all()), t

    attempt("all_gather_single float32", gather)
    attempt("all_reduce SUM float32", lambda: reduce(dist.ReduceOp.SUM, torch.float32, world * (world + 1) / 2))
    attempt("all_reduce MIN float32", lambda: reduce(dist.ReduceOp.MIN, torch.float32, 1.0))
    attempt("all_reduce MIN int64", lambda: reduce(dist.ReduceOp.MIN, torch.int64, 1))
    attempt("broadcast int64", broadcast)
    return errors


def _run_world(rank: int, world: int, group) -> dict:
    """Every case on both paths with ``world`` ranks (this rank's shard): {key: outputs on CPU}."""
    from specdec_kernels.distributed import vocab_parallel as distributed
    out = {"probe": _probe_collectives(group, world)}
    if any(err is not None for err in out["probe"].values()):
        return out  # the same on every rank: the tests report the collectives
    calls = {"chain": 0, "tree": 0}
    chain_fused, tree_fused = distributed._chain_fused, distributed._tree_fused

    def counted(kind, fn):
        def call(*args, **kwargs):
            calls[kind] += args[0].device.type == DEVICE  # the fused kernels on a shard on the device
            return fn(*args, **kwargs)
        return call

    distributed._chain_fused, distributed._tree_fused = counted("chain", chain_fused), counted("tree", tree_fused)
    try:
        for path, env in PATH_ENV.items():
            if env is None:
                os.environ.pop("SPECDEC_VP_TRITON", None)
            else:
                os.environ["SPECDEC_VP_TRITON"] = env
            before = dict(calls)
            for i, (vocab, *_rest) in enumerate(CHAIN_CASES):
                logits, ids, cu, p, temp, seeds, offs, k = _chain_batch(i)
                lo, hi = _shard_bounds(vocab, world)[rank]
                out["chain", i, path] = _cpu(rejection_sample_vocab_parallel(
                    *_cuda(logits[:, lo:hi].contiguous(), ids, cu, None if p is None else p[:, lo:hi].contiguous(),
                           temp, seeds, offs), k, vocab_start=lo, vocab_size=vocab, group=group))
            for i, (vocab, bounds, *_rest) in enumerate(CHAIN_EDGE_CASES):
                logits, ids, cu, p, temp, seeds, offs, k = _chain_edge_batch(i)
                lo, hi = _bounds(bounds, vocab, world)[rank]
                if seeds is None:
                    torch.manual_seed(5)
                saved = _small_tiles("small_tiles" in CHAIN_EDGE_CASES[i][-1], tree=False)
                try:
                    out["chain_edge", i, path] = _cpu(rejection_sample_vocab_parallel(
                        *_cuda(logits[:, lo:hi].contiguous(), ids, cu, None if p is None else p[:, lo:hi].contiguous(),
                               temp, seeds, offs), k, vocab_start=lo, vocab_size=vocab, group=group))
                finally:
                    _restore(saved)
            for i, (vocab, _, _, bounds, dtype, pass_max_children, *_rest) in enumerate(TREE_GPU_CASES):
                logits, tokens, parents, cu, p, temp, seeds, offs, depth = _tree_case_batch(i)
                lo, hi = _bounds(bounds, vocab, world)[rank]
                out["tree", i, path] = _cpu(tree_rejection_sample_vocab_parallel(
                    *_cuda(logits[:, lo:hi].contiguous(), tokens, parents, cu,
                           None if p is None else p[:, lo:hi].contiguous(), temp, seeds, offs), depth,
                    vocab_start=lo, vocab_size=vocab, group=group, compute_dtype=dtype,
                    max_children=_max_children(parents, cu) if pass_max_children else None))
            logits, tokens, parents, cu, p, temp, _, _, depth = _seeds_batch()
            vocab, _, _, manual_seed = SEEDS_CASE
            lo, hi = _shard_bounds(vocab, world)[rank]
            torch.manual_seed(manual_seed)
            out["tree_seeds", path] = _cpu(tree_rejection_sample_vocab_parallel(
                *_cuda(logits[:, lo:hi], tokens, parents, cu, p[:, lo:hi], temp), max_depth=depth,
                vocab_start=lo, vocab_size=vocab, group=group))
            for i, (vocab, bounds, *_rest) in enumerate(TREE_EDGE_CASES):
                opts = TREE_EDGE_CASES[i][-1]
                logits, tokens, parents, cu, p, temp, seeds, offs, depth = _tree_edge_batch(i)
                lo, hi = _bounds(bounds, vocab, world)[rank]
                saved = _small_tiles("small_tiles" in opts, tree=True)
                try:
                    out["tree_edge", i, path] = _cpu(tree_rejection_sample_vocab_parallel(
                        *_cuda(logits[:, lo:hi].contiguous(), tokens, parents, cu,
                               None if p is None else p[:, lo:hi].contiguous(), temp, seeds, offs), depth,
                        vocab_start=lo, vocab_size=vocab, group=group,
                        max_children=None if "no_max_children" in opts else _max_children(parents,
                                                                                            _clean_cu(cu, tokens))))
                finally:
                    _restore(saved)
            logits, tokens, parents, cu, probs, temp, seeds, offs, depth = _residual_batch()
            lo, hi = _shard_bounds(6, world)[rank]
            out["residual", path] = _cpu(tree_rejection_sample_vocab_parallel(
                *_cuda(logits[:, lo:hi].contiguous(), tokens, parents, cu, probs[:, lo:hi].contiguous(), temp, seeds),
                offs, depth, vocab_start=lo, vocab_size=6, group=group, max_children=3))
            out["calls", path] = {k: calls[k] - before[k] for k in calls}
    finally:
        distributed._chain_fused, distributed._tree_fused = chain_fused, tree_fused
        os.environ.pop("SPECDEC_VP_TRITON", None)
    return out


def _worker(rank, init_file, out_dir):
    """One of SPAWNED processes on device 0: world size 2 (ranks 0 and 1, a subgroup), then 4."""
    torch.set_num_threads(2)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SPAWNED,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    for world in WORLDS:
        group = dist.new_group(list(range(world)))  # every rank joins every new_group call
        if rank < world:
            results[world] = _run_world(rank, world, group)
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


_SPAWNED = {}


def _results(world: int) -> list[dict]:
    """Per rank of ``world``: its outputs by key. One spawn per session; a failed spawn (its
    traceback names the rank and the case) fails every later test at once, without another."""
    if "error" in _SPAWNED:
        raise RuntimeError(f"the ranks' spawn failed (see the first failing test): {_SPAWNED['error']}")
    if "ranks" not in _SPAWNED:
        try:
            with tempfile.TemporaryDirectory() as out_dir:
                mp.spawn(_worker, args=(os.path.join(out_dir, "init"), out_dir), nprocs=SPAWNED, join=True)
                _SPAWNED["ranks"] = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(SPAWNED)]
        except Exception as e:
            _SPAWNED["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
            raise
    per_rank = [ranks[world] for ranks in _SPAWNED["ranks"][:world]]
    for r, results in enumerate(per_rank):
        failed = {name: err for name, err in results["probe"].items() if err is not None}
        assert not failed, f"gloo refused a collective on {DEVICE} tensors, rank {r} of {world}: {failed}"
    return per_rank


def _single_device(tree: bool, args) -> tuple:
    """The single-device op on the full logits, on the GPU (default backend); outputs on CPU."""
    if tree:
        *tensors, depth = args
        return _cpu(specdec_kernels.tree_rejection_sample(*_cuda(*tensors), depth))
    *tensors, k = args
    return _cpu(specdec_kernels.rejection_sample(*_cuda(*tensors), k))


def _check(world: int, key, args, tree: bool, what: str) -> tuple:
    """Both paths of ``key`` on every rank: the ranks agree, the outputs equal the single-device
    op's on >= 99.9% of requests (float near-ties aside: every request at these batch sizes),
    and the two paths agree. Returns the fused path's outputs."""
    per_rank = _results(world)
    want = _single_device(tree, args)
    for path in PATH_ENV:
        k = (*key, path) if isinstance(key, tuple) else (key, path)
        got = per_rank[0][k]
        for r, other in enumerate(per_rank[1:], 1):
            assert all(torch.equal(a, b) for a, b in zip(other[k], got)), f"{what} {path}: rank {r} differs from rank 0"
        same = torch.ones(got[-1].shape[0], dtype=torch.bool)
        for a, b in zip(got, want):
            same &= (a == b).all(1) if a.dim() == 2 else (a == b)
        assert same.float().mean() >= 0.999, \
            f"{what} {path}: {int((~same).sum())} of {same.numel()} requests differ from the single-device op"
    return per_rank[0][(*key, "fused") if isinstance(key, tuple) else (key, "fused")]


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_vocab_parallel_gloo_takes_cuda_tensors(world):
    """Every collective the ops use runs on CUDA tensors through gloo on every rank (_results
    checks the probe; without them the ranks run no case)."""
    assert len(_results(world)) == world


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case_index", range(len(CHAIN_CASES)))
def test_gpu_vocab_parallel_chain_equals_single_device(world, case_index):
    _, num = _check(world, ("chain", case_index), _chain_batch(case_index), False, f"chain case {case_index}")
    if CHAIN_CASES[case_index][-1] > 3.0:  # test-strength check of the boosted cases
        # (H200, fdbc35a: 14 drafts accepted over 16 requests at V = 128256, 31 over 32 at 151936)
        assert int(num.sum()) > num.shape[0] // 2 and int(num.max()) >= 2, \
            "chains accepted too few drafts to exercise the accept tests"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("edge_index", range(len(CHAIN_EDGE_CASES)))
def test_gpu_vocab_parallel_chain_edge_cases(world, edge_index):
    logits, ids, cu, p, temp, seeds, offs, k = _chain_edge_batch(edge_index)
    if seeds is None:
        seeds = _drawn_seeds(cu.shape[0] - 1, 5)
    _check(world, ("chain_edge", edge_index), (logits, ids, cu, p, temp, seeds, offs, k), False,
           f"chain edge case {edge_index}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case_index", range(len(TREE_GPU_CASES)))
def test_gpu_vocab_parallel_tree_equals_single_device(world, case_index):
    args = _tree_case_batch(case_index)
    _, _, num = _check(world, ("tree", case_index), args, True, f"tree case {case_index}")
    batch = num.shape[0]
    assert int(num.sum()) > batch // 4, "test-strength check: walks too shallow to exercise the tree"


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_vocab_parallel_tree_seeds_drawn_inside(world):
    logits, tokens, parents, cu, p, temp, _, _, depth = _seeds_batch()
    _, batch, _, manual_seed = SEEDS_CASE
    seeds = _drawn_seeds(batch, manual_seed)
    _check(world, "tree_seeds", (logits, tokens, parents, cu, p, temp, seeds, None, depth), True, "tree, seeds drawn")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("edge_index", range(len(TREE_EDGE_CASES)))
def test_gpu_vocab_parallel_tree_edge_cases(world, edge_index):
    _check(world, ("tree_edge", edge_index), _tree_edge_batch(edge_index), True, f"tree edge case {edge_index}")


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_vocab_parallel_tree_residual_after_several_rejections(world):
    _, _, num = _check(world, "residual", _residual_batch(), True, "residual tree")
    assert int((num == 0).sum()) > 2 * num.shape[0] // 3, \
        "test-strength check: the root's children should usually be rejected"


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_vocab_parallel_took_the_fused_kernels(world):
    """By default (no $SPECDEC_VP_TRITON) every chain call and every float32 tree call with
    nodes took the fused Triton kernels on CUDA shards; the torch path never did (else the
    equalities above would compare the torch path with itself)."""
    n_chain = len(CHAIN_CASES) + len(CHAIN_EDGE_CASES)
    n_tree = (sum(case[4] == torch.float32 for case in TREE_GPU_CASES) + 2  # + seeds drawn, residual
              + sum("N0" not in case[-1] for case in TREE_EDGE_CASES))
    for r, per_rank in enumerate(_results(world)):
        assert per_rank["calls", "fused"] == {"chain": n_chain, "tree": n_tree}, (r, per_rank["calls", "fused"])
        assert per_rank["calls", "torch"] == {"chain": 0, "tree": 0}, (r, per_rank["calls", "torch"])
