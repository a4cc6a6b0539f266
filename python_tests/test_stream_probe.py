"""benchmarks/bench_stream_probe.py's Triton read-max probe reads every byte it is timed on.

The probe's time is only a floor if it reads exactly the rows the op's floor counts: every
per-row max (over that row's programs) must equal torch's, with the row's unique maximum and a
-inf planted at random columns, rows split over several programs, and the draft rows taken at a
stride (a draft row left out of the probe holds a larger value that must not show). Runs on the
GPU or in the Triton interpreter; the CUDA probe and the timing need a GPU and are not run here.
"""
import os
import sys

import pytest
import torch

pytest.importorskip("triton")
from utils import HAS_CUDA, TRITON_ON_CPU  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_stream_probe as probe  # noqa: E402

pytestmark = pytest.mark.skipif(not (HAS_CUDA or TRITON_ON_CPU), reason="needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("n_cols,block,want_splits", [(7, 16, 4), (1000, 64, 4), (1000, 128, 100)])
def test_split_rows_covers_each_row_once(n_cols, block, want_splits):
    splits, cols = probe.split_rows(n_cols, block, want_splits)
    assert cols % block == 0 and splits * cols >= n_cols and (splits - 1) * cols < n_cols  # no gap, no empty split


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_cols,block,want_splits", [(7, 16, 3), (1000, 64, 5), (1000, 256, 1)])
@pytest.mark.parametrize("with_draft", [False, True])
def test_stream_max_reads_every_row_and_column(dtype, n_cols, block, want_splits, with_draft):
    batch, k = 3, 2
    g = torch.Generator().manual_seed(n_cols * 7 + block + with_draft)
    splits, cols_per_split = probe.split_rows(n_cols, block, want_splits)
    # Each row's unique max (a skipped column changes the row's result) at an edge the kernel
    # handles -- first and last column, block and split boundaries -- or a random column.
    edges = [0, n_cols - 1, block - 1, block, cols_per_split - 1, cols_per_split, n_cols // 2]
    edges = list(dict.fromkeys(c for c in edges if c < n_cols)) + torch.randint(n_cols, (2,), generator=g).tolist()
    logits = torch.randn(batch * (k + 1), n_cols, generator=g)
    draft = torch.rand(batch * k, n_cols, generator=g)  # fp32 draft probabilities
    for r in range(logits.shape[0]):
        logits[r, edges[r % len(edges)]] = 50.0 + r
    for b in range(batch):  # the read draft rows, b * k: edges from the other end
        draft[b * k, edges[-1 - b % len(edges)]] = 60.0 + b
    for rows in (logits, draft):
        for r in range(rows.shape[0]):
            col = int(torch.randint(n_cols, (1,), generator=g))
            if rows[r, col] < 50:
                rows[r, col] = float("-inf")
    draft[1::k] = 1e4  # rows the probe must not read (draft rows b * k + 1)
    logits = logits.to(dtype).to(DEVICE)
    draft_rows = draft.to(DEVICE).view(batch, k, n_cols)[:, 0] if with_draft else None  # stride k * n_cols
    total_rows = logits.shape[0] + (batch if with_draft else 0)
    out = torch.full((total_rows * splits + 1,), float("nan"), device=DEVICE)  # one spare: nothing past the grid
    per_program = probe.stream_max(logits, draft_rows, out, block=block, num_warps=4, num_splits=splits).cpu()
    assert per_program.shape == (total_rows, splits)
    assert not per_program.isnan().any() and out[-1].isnan()
    want = torch.cat([logits.float().cpu()] + ([draft_rows.cpu()] if with_draft else [])).amax(-1)
    assert torch.equal(per_program.amax(-1), want)
    assert per_program.max() == want.max() < 1e4
