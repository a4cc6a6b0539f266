"""Vocabulary-parallel verification over torch.distributed (gloo, spawned CPU processes):
every rank returns the single-device op's tokens on the gathered logits, for shards of any
size (V not divisible by the world size, shards smaller than a sampling chunk)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import specdec_kernels
from specdec_kernels.distributed import rejection_sample_vocab_parallel
from utils import random_batch

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


def _worker(rank, world, init_file, case_index, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    _, vocab, probs, batch = CASES[case_index]
    args = random_batch(batch, 4, vocab, draft_probs=probs, seed=100 + case_index)
    logits, ids, cu, draft_probs, temp, seeds, offs, k = args
    lo, hi = _shard_bounds(vocab, world)[rank]
    out, num = rejection_sample_vocab_parallel(
        logits[:, lo:hi].contiguous(), ids, cu, None if draft_probs is None else draft_probs[:, lo:hi].contiguous(),
        temp, seeds, offs, k, vocab_start=lo, vocab_size=vocab)
    torch.save((out, num), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_vocab_parallel_equals_single_device(case_index):
    world, vocab, probs, batch = CASES[case_index]
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "init")
        mp.spawn(_worker, args=(world, init_file, case_index, out_dir), nprocs=world, join=True)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    for out, num in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(num, results[0][1]), "ranks disagree"
    args = random_batch(batch, 4, vocab, draft_probs=probs, seed=100 + case_index)
    ref_out, ref_num = specdec_kernels.rejection_sample(*args, backend="reference")
    same = (results[0][0] == ref_out).all(1) & (results[0][1] == ref_num)
    assert same.float().mean() >= 0.999, f"{int((~same).sum())} of {batch} requests differ from the single-device op"
