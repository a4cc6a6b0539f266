"""Shared helpers of the test suite: batches, samplers per backend, goodness-of-fit."""
from __future__ import annotations

import os

import numpy as np
import torch
from scipy import stats

import specdec_kernels
from specdec_kernels import _ops as ops

HAS_CUDA = torch.cuda.is_available()
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"


def gpu_backends(op: str = ops.REJECTION_SAMPLE) -> list[str]:
    """GPU backends of ``op`` this install can run (a CUDA kernel only where it was built)."""
    out = []
    if ops.rejection_sample_triton is not None:
        out.append("triton")
    if ops.cuda_kernel_built(op):
        out.append("cuda")
    return out


def sampler(backend: str, method: str = "token"):
    def run(target_logits, drafts, cu, draft_probs, temperature, seeds, offsets, max_spec_len):
        return specdec_kernels.rejection_sample(target_logits, drafts, cu, draft_probs, temperature,
                                                seeds, offsets, max_spec_len, method, backend=backend)
    return run


def chi_square_pvalue(observed: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit of ``observed`` counts to ``probs``; cells with a small expected count
    are pooled into one cell. A sample in a zero-probability cell gives p = 0."""
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = observed.sum()
    if np.any(observed[probs <= 0] > 0):
        return 0.0
    expected = probs * n
    big = expected >= min_expected
    obs = list(observed[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(observed[~big].sum())
        exp.append(expected[~big].sum())
    exp = np.array(exp)
    exp *= n / exp.sum()
    return float(stats.chisquare(np.array(obs), exp).pvalue)


def total_variation(observed: np.ndarray, probs: np.ndarray) -> float:
    observed = np.asarray(observed, dtype=np.float64).ravel()
    return 0.5 * float(np.abs(observed / observed.sum() - np.asarray(probs).ravel()).sum())


def random_batch(batch: int, max_drafts: int, vocab: int, *, dtype=torch.float32, draft_probs: bool,
                 seed: int, device="cpu", zero_draft_share: float = 0.25, accept_boost: float = 3.0,
                 uniform: bool = False):
    """A ragged batch of random logits; drafts are often the target's likely tokens so that
    chains get accepted to various depths. uniform: every request has max_drafts drafts (the
    padded layout). Returns the op's positional arguments."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_drafts + 1, (batch,), generator=g)
    counts[torch.rand(batch, generator=g) < zero_draft_share] = 0
    if uniform:
        counts.fill_(max_drafts)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    n = int(cu[-1])
    logits = torch.randn(n + batch, vocab, generator=g) * 2
    drafts = torch.randint(0, vocab, (n,), generator=g)
    rows = torch.arange(n) + torch.repeat_interleave(torch.arange(batch), counts)
    logits[rows, drafts] += accept_boost
    probs = None
    if draft_probs:
        probs = torch.softmax(torch.randn(n, vocab, generator=g) * 2, -1)
        probs[torch.arange(n), drafts] += 0.5
        probs /= probs.sum(-1, keepdim=True)
    temperature = torch.rand(batch, generator=g) * 1.5 + 0.1
    temperature[torch.rand(batch, generator=g) < 0.3] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 2**40, (batch,), generator=g)
    return (logits.to(dtype).to(device), drafts.to(device), cu.to(device),
            None if probs is None else probs.to(device), temperature.to(device), seeds.to(device),
            offsets.to(device), max_drafts)


def check_invariants(out: torch.Tensor, num_accepted: torch.Tensor, args) -> None:
    """Layout and range invariants of one call's outputs."""
    logits, drafts, cu, _, _, _, _, max_spec_len = args
    out, num_accepted, cu, drafts = out.cpu().long(), num_accepted.cpu().long(), cu.cpu().long(), drafts.cpu().long()
    vocab = logits.shape[1]
    batch = cu.shape[0] - 1
    assert out.shape == (batch, max_spec_len + 1) and num_accepted.shape == (batch,)
    counts = (cu[1:] - cu[:-1]).clamp(max=max_spec_len)
    assert bool(((num_accepted >= 0) & (num_accepted <= counts)).all())
    for b in range(batch):
        k = int(num_accepted[b])
        assert out[b, :k].tolist() == drafts[cu[b]:cu[b] + k].tolist()
        assert 0 <= int(out[b, k]) < vocab
        assert bool((out[b, k + 1:] == -1).all())
