"""Sampling filters fused into the verify ops (issue #6): per-request top-k, top-p and min-p.

- The definition: ``sampling_filters.filter_keep_mask`` (what the reference applies) against a
  brute-force loop over each row, on hand-made rows (ties at the k-th token and at the token
  crossing p, k = 1, k >= V, p tiny, p = 1, min_p = 0 and near 1, NaN / inf, greedy rows) and
  on random rows with ties.
- Support: no backend ever emits or accepts a token outside the filtered set.
- Exactness: the emitted tokens follow the filtered target (chi-square), probabilistic and
  deterministic drafts, chain (token and block verification) and tree.
- Agreement: the Triton kernels give the reference's tokens on batches with mixed per-request
  settings (in Triton's interpreter on CPU machines, also with a bracket buffer of 16 so that
  the counting passes of the threshold search run; on a GPU at real vocabulary sizes).
- The API: argument checks, the CUDA C++ kernel's refusal and backend "auto"'s routing to
  Triton, opcheck, torch.compile, fake shapes.
"""
import dataclasses

import numpy as np
import pytest
import torch

import specdec_kernels
from specdec_kernels import _ops as ops
from specdec_kernels.reference.sampling_filters import apply_top_k_top_p, filter_keep_mask
from specdec_kernels.testing import MarkovPair, first_tokens_tree, first_two_tokens
from utils import HAS_CUDA, TRITON_ON_CPU, check_invariants, chi_square_pvalue, gpu_backends, random_batch

FLT_MAX = float(torch.finfo(torch.float32).max)
P_MIN = 1e-4
SAMPLES = 20000
INTERPRETER = TRITON_ON_CPU and not HAS_CUDA and "triton" in gpu_backends()
# Where the statistical tests run: the reference, and every GPU backend that has the filters (the
# CUDA C++ kernels run their own threshold pass, on sm_90+ only).
DIST_BACKENDS = [("reference", "cpu"), ("cpu", "cpu")] + ([("triton", "cuda")] if HAS_CUDA and "triton" in gpu_backends() else []) + (
    [("cuda", "cuda")] if HAS_CUDA and ops.cuda_kernel_built() and ops.cuda_kernel_built(ops.TREE_REJECTION_SAMPLE)
    and ops.cuda_filters_supported(0) else [])
# Agreement with the reference: the Triton kernel, on the GPU or in the interpreter.
FUSED = [("cpu", "cpu")] + ([("triton", "cuda")] if HAS_CUDA and "triton" in gpu_backends() else
                             [("triton", "cpu")] if INTERPRETER else [])
interpreter_only = pytest.mark.skipif(not INTERPRETER, reason="interpreter test: CPU machines with TRITON_INTERPRET=1")


# --- the definition ---------------------------------------------------------------------------

def brute_force_keep(row, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0) -> np.ndarray:
    """docs/ALGORITHM.md §7 for one row, a loop in float64 (boolean keep mask)."""
    row = np.asarray(row, dtype=np.float64)
    row = np.where(np.isnan(row), -np.inf, np.where(row == np.inf, FLT_MAX, row))
    vocab = row.shape[0]
    keep = np.ones(vocab, dtype=bool)
    if not temperature > 0:
        return keep
    if 0 < top_k < vocab:
        keep &= row >= np.sort(row)[::-1][top_k - 1]
    if top_p < 1:
        kept = np.where(keep, row, -np.inf)
        best = kept.max()
        probs = np.exp((kept - best) / temperature) if np.isfinite(best) else np.zeros(vocab)
        probs = probs / max(probs.sum(), 1e-300)
        order = np.argsort(-kept, kind="stable")
        cut, mass = kept[order[-1]], 0.0
        for token in order:
            mass += probs[token]
            if mass >= top_p:
                cut = kept[token]
                break
        keep &= row >= cut
    if min_p > 0:
        keep &= (row - row.max()) / temperature >= np.log(min(min_p, 1.0))
    return keep


def _mask(rows, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0):
    rows = torch.as_tensor(rows, dtype=torch.float64)
    n = rows.shape[0]
    full = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    return filter_keep_mask(torch.nan_to_num(rows, nan=float("-inf"), posinf=FLT_MAX),
                            full(1.0 / temperature, torch.float64), full(top_k, torch.int64),
                            full(top_p, torch.float64), full(min_p, torch.float64))


@pytest.mark.parametrize("row,params,kept", [
    ([3.0, 1.0, 2.0, 2.0, 0.0], dict(top_k=2), [0, 2, 3]),             # ties with the k-th kept
    ([5.0, 5.0, 1.0, 0.0], dict(top_k=1), [0, 1]),                     # k = 1, tied maximum
    ([0.5] * 5, dict(top_k=1), [0, 1, 2, 3, 4]),                       # all tied
    ([1.0, 3.0, 2.0], dict(top_k=3), [0, 1, 2]),                       # k >= V: off
    ([1.0, 3.0, 2.0], dict(top_k=0), [0, 1, 2]),                       # k = 0: off
    ([2.0, 2.0, 1.0, 0.0], dict(top_p=1e-6), [0, 1]),                  # p tiny: the top ties
    ([4.0, 1.0, 0.0], dict(top_p=1.0), [0, 1, 2]),                     # p = 1: off
    ([np.log(0.4), np.log(0.3), np.log(0.3), np.log(1e-9)], dict(top_p=0.5), [0, 1, 2]),  # crossing ties kept
    ([np.log(0.52), np.log(0.3), np.log(0.18)], dict(top_p=0.5), [0]),  # the crossing token itself
    ([1.0, 0.0, -1.0], dict(min_p=0.0), [0, 1, 2]),                    # min_p = 0: off
    ([1.0, 1.0 - 1e-4, 0.0], dict(min_p=0.999), [0, 1]),               # min_p near 1
    ([1.0, 1.0, 0.5], dict(min_p=1.0), [0, 1]),                        # min_p = 1: the max and its ties
    ([0.0, np.log(0.5), np.log(0.2)], dict(min_p=0.3), [0, 1]),        # prob >= min_p * max prob
    ([1.0, float("nan"), float("inf"), 0.0], dict(top_k=3), [0, 2, 3]),  # NaN never kept, +inf = FLT_MAX
    ([3.0, 1.0, 2.0], dict(top_k=1, temperature=0.0), [0, 1, 2]),      # greedy rows: unfiltered
    # top-p measures the top-k-kept distribution: renormalized over {0, 1}, token 0 holds
    # 0.55 >= 0.5 (over the whole row it holds 0.38 < 0.5, and token 1 would be kept too).
    ([np.log(0.38), np.log(0.31), np.log(0.30), np.log(0.01)], dict(top_k=2, top_p=0.5), [0]),
])
def test_definition_by_hand(row, params, kept):
    params = dict(params)
    temperature = params.pop("temperature", 1.0)
    expected = np.zeros(len(row), dtype=bool)
    expected[kept] = True
    assert np.array_equal(brute_force_keep(row, **params, temperature=temperature), expected)
    if temperature > 0:
        assert np.array_equal(_mask([row], **params, temperature=temperature)[0].numpy(), expected)
    # The drafters' helper (float32): filtered-out logits become -inf, NaN too.
    out = apply_top_k_top_p(torch.tensor([row], dtype=torch.float32), params.get("top_k"), params.get("top_p"),
                            min_p=params.get("min_p"), temperature=temperature)
    if temperature > 0:
        assert np.array_equal((out[0] > float("-inf")).numpy(), expected)


def random_filters(batch: int, vocab: int, seed: int, out_of_range: bool = False):
    """Mixed per-request settings: each filter off for some requests, edge values for others."""
    g = torch.Generator().manual_seed(seed)
    top_k = torch.randint(1, max(2, min(vocab, 64)), (batch,), generator=g)
    pick = torch.randint(0, 5, (batch,), generator=g)
    top_k = torch.where(pick == 0, 0, torch.where(pick == 1, 1, torch.where(pick == 2, vocab + 3, top_k)))
    top_p = torch.rand(batch, generator=g) * 0.98 + 0.01
    pick = torch.randint(0, 5, (batch,), generator=g)
    top_p = torch.where(pick == 0, 1.0, torch.where(pick == 1, 1e-6, top_p))
    min_p = torch.rand(batch, generator=g) * 0.3
    pick = torch.randint(0, 5, (batch,), generator=g)
    min_p = torch.where(pick <= 1, 0.0, torch.where(pick == 2, 0.999, min_p))
    if out_of_range:  # without validate=True these act as documented: off, top-1, max only
        top_k[0], top_p[1 % batch], min_p[2 % batch] = -3, 0.0, 1.7
    return top_k.to(torch.int32), top_p.float(), min_p.float()


def test_definition_on_random_rows_with_ties():
    g = torch.Generator().manual_seed(0)
    rows, vocab = 400, 50
    logits = (torch.randn(rows, vocab, generator=g) * 2).round(decimals=1)  # many ties
    logits[:, 10] = logits[:, 11]
    logits[::7, 20:] = float("-inf")
    top_k, top_p, min_p = random_filters(rows, vocab, seed=1)
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    keep = filter_keep_mask(logits.double(), 1 / temperature.double(), top_k, top_p.double(), min_p.double())
    for r in range(rows):
        expected = brute_force_keep(logits[r].numpy(), int(top_k[r]), float(top_p[r]), float(min_p[r]),
                                    float(temperature[r]))
        assert np.array_equal(keep[r].numpy(), expected), r


# --- support: never a token outside the filtered set ---------------------------------------------

def _with_specials(args, seed):
    """random_batch's logits with NaN / +inf / -inf entries and exact ties sprinkled in."""
    logits = args[0].clone()
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(logits.shape, generator=g)
    logits[u < 0.02] = float("nan")
    logits[(u > 0.02) & (u < 0.03)] = float("-inf")
    logits[:, 1] = logits[:, 2]
    logits[0, 3] = float("inf")
    return (logits,) + tuple(args[1:])


def _check_support(args, top_k, top_p, min_p, out, num):
    logits, drafts, cu, _, temperature, _, _, max_spec_len = args
    logits, out, num = logits.cpu().float(), out.cpu().long(), num.cpu().long()
    for b in range(cu.shape[0] - 1):
        for t in range(int(num[b]) + 1):
            row = logits[int(cu[b]) + b + t].numpy()
            keep = brute_force_keep(row, int(top_k[b]), float(top_p[b]), float(min_p[b]), float(temperature[b]))
            token = int(out[b, t])
            assert 0 <= token < row.shape[0] and keep[token], (b, t, token)
            assert not np.isnan(row[token])


@pytest.mark.parametrize("backend,device", DIST_BACKENDS + ([("triton", "cpu")] if INTERPRETER else []))
@pytest.mark.parametrize("draft_probs", [False, True])
def test_support_chain(backend, device, draft_probs):
    vocab, batch = (300, 8) if device == "cpu" and backend == "triton" else (2000, 64)
    for seed in range(1 if backend == "triton" and device == "cpu" else 3):
        args = _with_specials(random_batch(batch, 4, vocab, draft_probs=draft_probs, seed=seed, accept_boost=6.0),
                              seed)
        filters = random_filters(batch, vocab, seed=seed + 10)
        to = [None if t is None else t.to(device) for t in args[:7]]
        out, num = specdec_kernels.rejection_sample(*to, args[7], "token", *(f.to(device) for f in filters),
                                                    backend=backend)
        _check_support(args, *filters, out, num)


# --- exactness: the emitted tokens follow the filtered target -------------------------------------

VOCAB = 8


def _pair() -> MarkovPair:
    """Flat enough that every case below keeps 2+ tokens and cuts 2+ in the first row."""
    return MarkovPair.random(VOCAB, seed=11, spread=1.0, mask_token=VOCAB - 1)


def filtered_law(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """softmax(logits / T) restricted to what the filters keep, rows of ``logits`` [.., V]."""
    rows = logits.float().double().reshape(-1, logits.shape[-1]).numpy()
    out = np.zeros_like(rows)
    for i, row in enumerate(rows):
        keep = brute_force_keep(row, top_k, top_p, min_p, temperature)
        w = np.where(keep & np.isfinite(row), np.exp((row - row[keep].max()) / temperature), 0.0)
        out[i] = w / w.sum()
    return out.reshape(logits.shape)


CHAIN_CASES = {
    # name: (deterministic drafts, temperature, top_k, top_p, min_p, method)
    "top_k_probabilistic": (False, 1.0, 3, 1.0, 0.0, "token"),
    "top_p_deterministic": (True, 0.8, 0, 0.8, 0.0, "token"),
    "min_p_probabilistic": (False, 1.2, 0, 1.0, 0.15, "token"),
    "all_probabilistic": (False, 1.0, 5, 0.85, 0.05, "token"),
    "all_deterministic": (True, 1.3, 4, 0.9, 0.1, "token"),
    "block_all_probabilistic": (False, 1.0, 5, 0.85, 0.05, "block"),
}


def _chain_filtered_sampler(backend, top_k, top_p, min_p, method):
    def run(logits, drafts, cu, probs, temp, seeds, offs, k):
        batch = cu.shape[0] - 1
        device = logits.device
        return specdec_kernels.rejection_sample(
            logits, drafts, cu, probs, temp, seeds, offs, k, method,
            torch.full((batch,), top_k, dtype=torch.int32, device=device),
            torch.full((batch,), top_p, dtype=torch.float32, device=device),
            torch.full((batch,), min_p, dtype=torch.float32, device=device), backend=backend)
    return run


@pytest.mark.parametrize("backend,device", DIST_BACKENDS)
@pytest.mark.parametrize("case", list(CHAIN_CASES))
def test_chain_follows_the_filtered_target(backend, device, case):
    deterministic, temperature, top_k, top_p, min_p, method = CHAIN_CASES[case]
    pair = _pair()
    counts = torch.full((SAMPLES,), 3)
    first, second = first_two_tokens(_chain_filtered_sampler(backend, top_k, top_p, min_p, method), pair, SAMPLES,
                                     counts, temperature, deterministic, seed=123, device=device)
    law_first = filtered_law(pair.q0, temperature, top_k, top_p, min_p)
    law_next = filtered_law(pair.Q, temperature, top_k, top_p, min_p)
    law = law_first[:, None] * law_next
    assert (law_first == 0).sum() >= 2, "the filters must cut something for the test to mean anything"
    counts2 = np.zeros((VOCAB, VOCAB))
    np.add.at(counts2, (first.numpy(), second.numpy()), 1)
    p_first = chi_square_pvalue(np.bincount(first.numpy(), minlength=VOCAB), law_first)
    p_joint = chi_square_pvalue(counts2, law)
    assert p_first > P_MIN, f"first token does not follow the filtered target: p = {p_first:.2e}"
    assert p_joint > P_MIN, f"first two tokens do not follow the filtered target: p = {p_joint:.2e}"


def test_control_unfiltered_law_is_rejected():
    """The fit can tell the filtered target from the unfiltered one (and from filtering only
    the draft rows: the bonus and residual rows must be filtered too)."""
    pair = _pair()
    first, second = first_two_tokens(_chain_filtered_sampler("reference", 5, 0.85, 0.05, "token"), pair, SAMPLES,
                                     torch.full((SAMPLES,), 3), 1.0, False, seed=123)
    counts2 = np.zeros((VOCAB, VOCAB))
    np.add.at(counts2, (first.numpy(), second.numpy()), 1)
    assert chi_square_pvalue(counts2, pair.joint_law(1.0).numpy()) < 1e-8


TREE_SHAPE = [-1, 0, 0, 1, 1, 2]


def _tree_filtered_sampler(backend, top_k, top_p, min_p):
    def run(logits, tokens, parents, cu, probs, temp, seeds, offs, depth):
        batch = cu.shape[0] - 1
        device = logits.device
        return specdec_kernels.tree_rejection_sample(
            logits, tokens, parents, cu, probs, temp, seeds, offs, depth,
            torch.full((batch,), top_k, dtype=torch.int32, device=device),
            torch.full((batch,), top_p, dtype=torch.float32, device=device),
            torch.full((batch,), min_p, dtype=torch.float32, device=device), backend=backend)
    return run


@pytest.mark.parametrize("backend,device", DIST_BACKENDS)
@pytest.mark.parametrize("deterministic,temperature,top_k,top_p,min_p", [
    (False, 1.0, 3, 0.9, 0.0), (True, 1.0, 0, 0.75, 0.1), (False, 0.8, 3, 1.0, 0.2)])
def test_tree_follows_the_filtered_target(backend, device, deterministic, temperature, top_k, top_p, min_p):
    vocab = 5
    pair = MarkovPair.random(vocab, seed=21, spread=1.2)
    tokens = first_tokens_tree(_tree_filtered_sampler(backend, top_k, top_p, min_p), pair, SAMPLES, TREE_SHAPE,
                               temperature, deterministic, seed=7, num_tokens=2, device=device)
    law_first = filtered_law(pair.q0, temperature, top_k, top_p, min_p)
    law = law_first[:, None] * filtered_law(pair.Q, temperature, top_k, top_p, min_p)
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (tokens[:, 0].numpy(), tokens[:, 1].numpy()), 1)
    assert (law_first == 0).sum() >= 1
    p = chi_square_pvalue(counts, law)
    assert p > P_MIN, f"the first two tokens do not follow the filtered target: p = {p:.2e}"


# --- the threshold search alone ---------------------------------------------------------------------

try:
    import triton
    import triton.language as tl

    from specdec_kernels.triton.filters import _row_threshold

    @triton.jit
    def _row_threshold_kernel(logits_ptr, vocab, cmax_ptr, submax_ptr, scratch_ptr, buf_ptr, max_ptr, sum_ptr,
                              temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, thr_ptr, num_chunks, scratch_stride,
                              CHUNKS_PAD: tl.constexpr, CAP: tl.constexpr, PIVOT_TILE: tl.constexpr):
        r = tl.program_id(0)
        k = 1.4426950408889634 / tl.load(temp_ptr + r)
        thr, _kept_n = _row_threshold(
            logits_ptr + r * vocab, cmax_ptr + r * num_chunks, submax_ptr + r * num_chunks * 8,
            scratch_ptr + r * scratch_stride, buf_ptr + r * CAP, tl.load(max_ptr + r), tl.load(sum_ptr + r), k,
            tl.load(top_k_ptr + r), tl.load(top_p_ptr + r), tl.load(min_p_ptr + r), vocab, num_chunks,
            num_chunks * 8, CHUNKS_PAD, 256, CAP, 8, PIVOT_TILE, 16, 32, 64, 64)
        tl.store(thr_ptr + r, thr)
except ImportError:  # triton is optional
    _row_threshold_kernel = None


def row_threshold(logits, temperature, top_k, top_p, min_p, cap, pivot_tile=1):
    """The kernels' threshold search on rows [R, V] (float32), fed what the threshold pass's
    stream gives it: the maxima of every 256 and every 32 logits, the row max and sum. Returns
    the thresholds (with the CAP-entry bracket buffer and pivot passes of ``pivot_tile`` chunks
    a tile; the fine top-k path's sizes are the package's defaults)."""
    device = logits.device
    rows, vocab = logits.shape
    chunks = (vocab + 255) // 256
    padded = torch.full((rows, chunks * 256), float("-inf"), device=device)
    padded[:, :vocab] = torch.nan_to_num(logits, nan=float("-inf"), posinf=FLT_MAX)
    k = 1.4426950408889634 / temperature
    m_c = padded.view(rows, chunks, 256).max(-1).values
    m_sub = padded.view(rows, chunks * 8, 32).max(-1).values
    row_max = padded.max(-1).values
    shift = torch.where(row_max > float("-inf"), row_max, 0.0)
    row_sum = torch.exp2((padded - shift[:, None]) * k[:, None]).sum(-1)
    pad = triton.next_power_of_2(chunks)
    thr = torch.empty(rows, device=device)
    stride = pad + 64 * 8 + cap
    _row_threshold_kernel[(rows,)](
        padded[:, :vocab].contiguous(), vocab, m_c.contiguous(), m_sub.contiguous(),
        torch.zeros(rows * stride, dtype=torch.int32, device=device), torch.zeros(rows * cap, device=device),
        row_max, row_sum, temperature, top_k.to(torch.int32), top_p, min_p, thr, chunks, stride, CHUNKS_PAD=pad,
        CAP=cap, PIVOT_TILE=pivot_tile)
    return thr


@pytest.mark.skipif(not (INTERPRETER or HAS_CUDA and "triton" in gpu_backends()), reason="needs Triton")
@pytest.mark.parametrize("vocab", [1, 7, 256, 300, 3000])
@pytest.mark.parametrize("cap", [2, 16, 512])
@pytest.mark.parametrize("pivot_tile", [1, 2])
def test_threshold_search_keeps_the_sorted_definition(vocab, cap, pivot_tile):
    """Kept set = the sort-based one exactly (thresholds are row values, no float near-ties on
    these rows); buffers from 2 (every row needs counting passes, and single-value brackets end
    them) to 512; pivot passes of one and two chunks a tile."""
    device = "cuda" if HAS_CUDA else "cpu"
    g = torch.Generator().manual_seed(vocab + cap)
    rows = 12
    logits = (torch.randn(rows, vocab, generator=g) * 3).round()  # integers: many ties
    logits[0] = 0.5                                               # one value
    logits[1, : vocab // 2] = float("-inf")                       # -inf half
    logits[2] = torch.randn(vocab, generator=g).exp() * 4         # heavy tail
    logits[3, vocab // 3:] = float("nan")
    temperature = torch.rand(rows, generator=g) + 0.2
    top_k, top_p, min_p = random_filters(rows, vocab, seed=vocab * cap)
    top_k[4], top_p[4], min_p[4] = 0, 0.9, 0.0                    # top-p alone
    top_k[5], top_p[5], min_p[5] = max(vocab - 1, 1), 1.0, 0.0    # k beyond the finite values
    top_k[6], top_p[6], min_p[6] = 0, 1.0, 0.3                    # min-p alone
    top_k[1] = max(vocab - 1, 1)
    thr = row_threshold(logits.to(device), temperature.to(device), top_k.to(device), top_p.to(device),
                        min_p.to(device), cap, pivot_tile).cpu()
    clean = torch.nan_to_num(logits, nan=float("-inf"))
    keep = filter_keep_mask(clean.double(), 1 / temperature.double(), top_k, top_p.double(), min_p.double())
    finite = clean > float("-inf")  # -inf tokens have no mass, kept or not
    for r in range(rows):
        got = (clean[r] >= thr[r]) & finite[r]
        assert torch.equal(got, keep[r] & finite[r]), (r, int(top_k[r]), float(top_p[r]), float(min_p[r]))


@pytest.mark.skipif(not (INTERPRETER or HAS_CUDA and "triton" in gpu_backends()), reason="needs Triton")
@pytest.mark.parametrize("vocab", [700, 8193])
@pytest.mark.parametrize("stats_programs,stats_group", [(0, 8), (64, 8), (0, 16)])  # 64: 5 splits of 1 tile
def test_threshold_pass_keeps_the_sorted_definition(vocab, stats_programs, stats_group):
    """The whole threshold pass (stats stream, then search; triton.filters.launch_row_thresholds)
    on a ragged chain batch: every filtered row's threshold keeps exactly the sort-based set,
    its chunk maxima are the row's, and the slots of greedy requests, unfiltered requests and
    padding read -inf. Covers top-p alone (the search program's own row sum), the fine top-k
    path (k <= 64) and the chunk-level one (k > 64); the stats stream split as the verification
    kernel's (2 splits) or by the config's stats_programs_per_sm, in tiles of 8 or 16 chunks."""
    from specdec_kernels.reference.philox import SAMPLE_CHUNK
    from specdec_kernels.triton import filters as tf
    from specdec_kernels.triton.config import FilterConfig, VerifyConfig
    cfg = FilterConfig(stats_programs_per_sm=stats_programs, stats_group=stats_group)
    GROUP, NUM_WARPS = VerifyConfig().group, VerifyConfig().num_warps
    device = "cuda" if HAS_CUDA else "cpu"
    g = torch.Generator().manual_seed(vocab)
    n = torch.tensor([2, 0, 1, 2, 2, 1])
    B, L = len(n), 2
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).to(torch.int32)
    rows = int(n.sum()) + B
    logits = (torch.randn(rows, vocab, generator=g) * 2).round(decimals=1)  # ties
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 0.9, 1.0])
    top_k = torch.tensor([0, 50, 3, 0, 5, 100], dtype=torch.int32)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3, 0.95, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    slots = B * (L + 1)
    num_chunks = (vocab + SAMPLE_CHUNK - 1) // SAMPLE_CHUNK
    num_groups = (num_chunks + GROUP - 1) // GROUP
    groups_per_split = (num_groups + 1) // 2
    num_splits = (num_groups + groups_per_split - 1) // groups_per_split
    f_n, i_n = tf.threshold_workspace_sizes(slots, num_groups, num_chunks, cfg)
    f32 = torch.full((f_n,), float("nan"), device=device)  # nothing may be read before written
    i32 = torch.zeros(i_n, dtype=torch.int32, device=device)
    drafts = torch.randint(0, vocab, (int(n.sum()),), generator=g, dtype=torch.int32)
    drafts[0] = logits[0].argmax()  # a kept draft token: the chunk table must leave it out
    res = tf.launch_row_thresholds(
        f32, i32, logits.to(device), cu.to(device), temperature.to(device), top_k.to(device), top_p.to(device),
        min_p.to(device), tree=False, num_requests=B, slots=slots, max_rows=L + 1, num_splits=num_splits,
        num_groups=num_groups, num_warps=NUM_WARPS, excluded_drafts=drafts.to(device), config=cfg)
    thr, cmax = res.thr.cpu(), res.cmax.cpu().view(slots, num_chunks)
    kept_w, kept_m, kept_z = res.kept_w.cpu().view(slots, num_chunks), res.kept_m.cpu(), res.kept_z.cpu()
    padded = torch.full((rows, num_chunks * SAMPLE_CHUNK), float("-inf"))
    padded[:, :vocab] = logits
    from_kept_set = 0
    for b in range(B):
        for t in range(L + 1):
            slot = b * (L + 1) + t
            filtered = temperature[b] > 0 and (0 < top_k[b] < vocab or top_p[b] < 1 or min_p[b] > 0)
            if t > n[b] or not filtered:
                assert thr[slot] == float("-inf") and kept_z[slot] == 0, (b, t)
                continue
            row = int(cu[b]) + b + t
            keep = filter_keep_mask(logits[row].double(), 1 / temperature[b].double(), top_k[b], top_p[b].double(),
                                    min_p[b].double())
            assert torch.equal(logits[row] >= thr[slot], keep), (b, t)
            assert torch.equal(cmax[slot], padded[row].view(num_chunks, SAMPLE_CHUNK).max(-1).values), (b, t)
            if kept_z[slot] == 0:  # streamed by the verification kernel
                continue
            # Verified from its kept set: the statistics and chunk table the stream would give.
            from_kept_set += 1
            k = 1.4426950408889634 / float(temperature[b])
            kept_row = torch.where(keep, logits[row].double(), float("-inf"))
            assert kept_m[slot] == logits[row].max(), (b, t)
            z = torch.exp2((kept_row - kept_row.max()) * k).sum()
            assert torch.allclose(kept_z[slot].double(), z, rtol=1e-5), (b, t)
            if t < n[b]:
                kept_row[int(drafts[int(cu[b]) + t])] = float("-inf")
            table = torch.full((num_chunks * SAMPLE_CHUNK,), float("-inf"), dtype=torch.float64)
            table[:vocab] = kept_row
            table = torch.exp2((table.view(num_chunks, SAMPLE_CHUNK) - cmax[slot, :, None].double()) * k).sum(-1)
            assert torch.allclose(kept_w[slot].double(), table, rtol=1e-5, atol=0), (b, t)
    assert from_kept_set >= 6, "the kept-set path was not exercised"


# --- agreement with the reference -------------------------------------------------------------------

def _agree(backend, device, args, filters, method="token"):
    ref = specdec_kernels.rejection_sample(*args, method, *filters, backend="reference")
    to = [None if t is None else t.to(device) for t in args[:7]]
    out, num = specdec_kernels.rejection_sample(*to, args[7], method, *(f.to(device) for f in filters),
                                                backend=backend)
    check_invariants(out, num, args)
    same = (out.cpu() == ref[0]).all(1) & (num.cpu() == ref[1])
    return same.float().mean().item()


def _use_filter_config(**changes):
    """Calls inside the block launch the threshold pass with these FilterConfig changes."""
    from specdec_kernels.triton import config
    return config.use(filters=dataclasses.replace(config.active()[1], **changes))


@pytest.fixture
def small_bracket():
    """A bracket buffer of 16 tokens: most rows then need counting passes before the sort."""
    with _use_filter_config(cap=16):
        yield


@pytest.fixture(params=[True, False], ids=["kept_set", "streamed"])
def kept_set(request):
    """Rows whose kept set the threshold search held verified from it (the default), or every
    filtered row streamed again (FilterConfig(kept_set=False))."""
    with _use_filter_config(kept_set=request.param):
        yield request.param


@interpreter_only
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("method", ["token", "block"])
def test_triton_interpreter_agrees_with_reference(kept_set, draft_probs, method):
    args = _with_specials(random_batch(6, 3, 700, draft_probs=draft_probs, seed=31 + draft_probs), 5)
    assert _agree("triton", "cpu", args, random_filters(6, 700, seed=3 + draft_probs, out_of_range=True),
                  method) == 1.0


WIDE_ID_BACKENDS = FUSED + ([("cuda", "cuda")] if HAS_CUDA and "triton" in gpu_backends()
                             and ops.cuda_kernel_built() else [])


@pytest.mark.parametrize("backend,device", WIDE_ID_BACKENDS)
def test_wide_draft_id_is_not_excluded_from_the_kept_set(backend, device):
    """An int64 draft id of 2^32 + x is outside [0, V): rejected, and its row's final token
    comes from the whole filtered q, x included (the reference's rule). The kept-set chunk
    table of the threshold pass (deterministic drafts) must not truncate the id to x and leave
    x out. Every row keeps 2 tokens (top-k 2): x = the row's best, y the second, 300 tokens
    apart (in another chunk of the table); a table without x would emit y every time."""
    vocab, batch = 700, 16
    logits = torch.full((2 * batch, vocab), -8.0)
    best = torch.arange(batch) * 37 % vocab
    rows = torch.arange(batch) * 2
    logits[rows, best] = 1.0
    logits[rows, (best + 300) % vocab] = 0.5
    logits[rows + 1, 5] = 1.0
    drafts = best.to(torch.int64) + 2**32
    cu = torch.arange(batch + 1, dtype=torch.int32)
    args = (logits, drafts, cu, None, torch.ones(batch), torch.arange(batch) * 7919 + 3, None, 1)
    filters = (torch.full((batch,), 2), torch.ones(batch), torch.zeros(batch))
    ref = specdec_kernels.rejection_sample(*args, "token", *filters, backend="reference")
    assert (ref[1] == 0).all()
    assert (ref[0][:, 0] == best).any() and (ref[0][:, 0] != best).any(), "premise: both kept tokens emitted"
    assert _agree(backend, device, args, filters) == 1.0


@interpreter_only
@pytest.mark.parametrize("vocab,dtype", [(300, torch.float32), (2000, torch.bfloat16), (1, torch.float32)])
def test_triton_interpreter_counting_passes_agree(small_bracket, vocab, dtype):
    args = random_batch(6, 2, vocab, dtype=dtype, draft_probs=False, seed=vocab)
    logits = args[0].clone()
    if vocab > 1:
        logits[0] = 0.25          # a whole row of ties
        logits[1, : vocab // 2] = float("-inf")
    args = (logits,) + tuple(args[1:])
    for seed in range(2):
        top_k, top_p, min_p = random_filters(6, vocab, seed=seed)
        top_k[1] = vocab - 1      # the k-th value is -inf: split off by the first pass
        assert _agree("triton", "cpu", args, (top_k, top_p, min_p)) == 1.0


@interpreter_only
@pytest.mark.parametrize("draft_probs", [False, True])
def test_triton_interpreter_skips_tiles_without_kept_chunks(kept_set, draft_probs):
    """V = 8193 (5 tiles of 8 chunks): with top-k 3 most tiles hold no kept token, and the
    kernels skip them (their table entries written empty), in the chain and the tree kernel, or
    (kept_set) do not read the row at all; request 3 has min-p alone (never from a kept set: its
    rows are streamed either way); requests 4..7 have every filter off (their rows take the plain
    loop of a filtered call)."""
    from specdec_kernels.reference.philox import SAMPLE_CHUNK
    vocab = 8193
    args = random_batch(8, 3, vocab, draft_probs=draft_probs, seed=77 + draft_probs)
    args = args[:4] + (torch.tensor([1.0, 0.8, 1.2, 0.9, 1.0, 0.7, 1.1, 1.3]),) + args[5:]  # none greedy
    off = [0, 0, 0, 0]  # requests 4..7: every filter off (4 of them: enough tokens to notice a wrong stream)
    filters = (torch.tensor([3, 0, 40, 0] + off), torch.tensor([1.0, 0.5, 0.95, 1.0] + [1.0] * 4),
               torch.tensor([0.0, 0.0, 0.2, 0.3] + [0.0] * 4))
    # The premise: a top-3 row keeps at most 3 chunks, so at least 2 of its 5 tiles have none.
    tiles = (vocab + 8 * SAMPLE_CHUNK - 1) // (8 * SAMPLE_CHUNK)
    assert tiles - 3 >= 2
    assert _agree("triton", "cpu", args, filters) == 1.0
    from test_tree import _random_trees
    logits, tokens, parents, cu = _random_trees(8, vocab, seed=5 + draft_probs)
    probs = torch.softmax(torch.randn(logits.shape, generator=torch.Generator().manual_seed(2)), -1) \
        if draft_probs else None
    temp, seeds = args[4], torch.arange(8) * 31 + 5
    ref = specdec_kernels.tree_rejection_sample(logits, tokens, parents, cu, probs, temp, seeds, None, 4, *filters,
                                                backend="reference")
    got = specdec_kernels.tree_rejection_sample(logits, tokens, parents, cu, probs, temp, seeds, None, 4, *filters,
                                                backend="triton")
    for r, o in zip(ref, got):
        assert torch.equal(r, o)


@interpreter_only
@pytest.mark.parametrize("draft_probs", [False, True])
def test_triton_interpreter_tree_agrees_with_reference(small_bracket, kept_set, draft_probs):
    from test_tree import _random_trees
    vocab = 700
    logits, tokens, parents, cu = _random_trees(8, vocab, seed=vocab + draft_probs)
    probs = torch.softmax(torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)), -1) \
        if draft_probs else None
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.6, 1.0, 2.0, 0.9])
    seeds = torch.arange(8) * 1000 + 17
    filters = random_filters(8, vocab, seed=9, out_of_range=True)
    ref = specdec_kernels.tree_rejection_sample(logits, tokens, parents, cu, probs, temp, seeds, None, 4, *filters,
                                                backend="reference")
    got = specdec_kernels.tree_rejection_sample(logits, tokens, parents, cu, probs, temp, seeds, None, 4, *filters,
                                                backend="triton")
    plain = specdec_kernels.tree_rejection_sample(logits, tokens, parents, cu, probs, temp, seeds, None, 4,
                                                  backend="reference")
    for r, o in zip(ref, got):
        assert torch.equal(r, o)
    assert not torch.equal(ref[0], plain[0]), "the filters changed nothing: a weak test"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or "triton" not in gpu_backends(), reason="needs Triton on a CUDA GPU")
@pytest.mark.parametrize("vocab", [128256, 151936])  # the GPU vocabularies
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("method", ["token", "block"])
def test_gpu_triton_agrees_with_reference(vocab, dtype, draft_probs, method, backend="triton"):
    total, agree = 0, 0.0
    for seed in range(2):
        batch = 64
        # On the CPU: _agree runs the reference there and moves the inputs to the GPU.
        args = random_batch(batch, 4, vocab, dtype=dtype, draft_probs=draft_probs, seed=100 * seed + vocab % 97)
        filters = random_filters(batch, vocab, seed=seed)
        filters[0][: batch // 4] = 50  # the benchmark's setting on a quarter of the requests
        filters[1][: batch // 4] = 0.9
        rate = _agree(backend, "cuda", args, filters, method)
        agree += rate * batch
        total += batch
    assert agree / total >= 0.99, f"{agree / total:.2%} of {total} requests agree"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or "triton" not in gpu_backends(), reason="needs Triton on a CUDA GPU")
@pytest.mark.parametrize("draft_probs", [False, True])
def test_gpu_triton_tree_agrees_with_reference(draft_probs, backend="triton"):
    from test_tree import _random_trees
    vocab = 32000
    logits, tokens, parents, cu = _random_trees(32, vocab, seed=3)
    probs = torch.softmax(torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)), -1) \
        if draft_probs else None
    temp = torch.rand(32, generator=torch.Generator().manual_seed(2)) + 0.3
    seeds = torch.arange(32) * 1000 + 17
    filters = random_filters(32, vocab, seed=4)
    ref = specdec_kernels.tree_rejection_sample(logits, tokens, parents, cu, probs, temp, seeds, None, 4, *filters,
                                                backend="reference")
    cuda = [None if t is None else t.cuda() for t in (logits, tokens, parents, cu, probs, temp, seeds)]
    got = specdec_kernels.tree_rejection_sample(*cuda, None, 4, *(f.cuda() for f in filters), backend=backend)
    same = (ref[0] == got[0].cpu()).all(1) & (ref[2] == got[2].cpu())
    assert same.float().mean().item() >= 0.97


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not ops.cuda_kernel_built(ops.TREE_REJECTION_SAMPLE)
                    or not ops.cuda_filters_supported(0), reason="needs the CUDA tree kernel on an sm_90+ GPU")
@pytest.mark.parametrize("draft_probs", [False, True])
def test_gpu_cuda_tree_filters_agree_with_reference(draft_probs):
    """The CUDA tree kernel after its own threshold pass (backend="cuda")."""
    test_gpu_triton_tree_agrees_with_reference(draft_probs, backend="cuda")


@pytest.mark.parametrize("backend,device", DIST_BACKENDS + ([("triton", "cpu")] if INTERPRETER else []))
def test_greedy_requests_ignore_filters(backend, device):
    args = random_batch(6, 3, 300, draft_probs=True, seed=2)
    temperature = torch.zeros(6)
    args = args[:4] + (temperature,) + args[5:]
    to = [None if t is None else t.to(device) for t in args[:7]]
    plain = specdec_kernels.rejection_sample(*to, args[7], backend=backend)
    filters = (torch.ones(6, dtype=torch.int32), torch.full((6,), 1e-3), torch.full((6,), 0.9))
    got = specdec_kernels.rejection_sample(*to, args[7], "token", *(f.to(device) for f in filters), backend=backend)
    assert torch.equal(plain[0], got[0]) and torch.equal(plain[1], got[1])


def test_filters_off_equal_no_filters():
    args = random_batch(8, 3, 100, draft_probs=True, seed=4)
    off = (torch.zeros(8, dtype=torch.int64), torch.ones(8), torch.zeros(8))
    plain = specdec_kernels.rejection_sample(*args, backend="reference")
    got = specdec_kernels.rejection_sample(*args, "token", *off, backend="reference")
    assert torch.equal(plain[0], got[0]) and torch.equal(plain[1], got[1])


# --- the API ------------------------------------------------------------------------------------------

def _args():
    return list(random_batch(3, 2, 11, draft_probs=True, seed=0))


@pytest.mark.parametrize("name,value,exc,match", [
    ("top_k", torch.ones(3), TypeError, "top_k must have dtype"),
    ("top_k", torch.ones(4, dtype=torch.int32), ValueError, r"top_k must have shape \(B,\) = \(3,\)"),
    ("top_p", torch.ones(3, 1), ValueError, "top_p must be 1-D"),
    ("top_p", torch.ones(3, dtype=torch.int32), TypeError, "top_p must have dtype"),
    ("min_p", [0.1, 0.1, 0.1], TypeError, "min_p must be a torch.Tensor"),
])
def test_filter_argument_errors(name, value, exc, match):
    with pytest.raises(exc, match=match):
        specdec_kernels.rejection_sample(*_args(), **{name: value})
    # Three requests of one node each.
    tree = (torch.randn(3, 11), torch.zeros(3, dtype=torch.int64), torch.full((3,), -1, dtype=torch.int32),
            torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    with pytest.raises(exc, match=match):
        specdec_kernels.tree_rejection_sample(*tree, max_depth=1, **{name: value})


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_filter_device_error():
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in _args()]
    with pytest.raises(ValueError, match="top_p is on cpu"):
        specdec_kernels.rejection_sample(*args, top_p=torch.ones(3))


@pytest.mark.parametrize("name,value,match", [
    ("top_k", torch.tensor([0, -1, 3]), r"top_k\[1\] = -1 must be >= 0"),
    ("top_p", torch.tensor([1.0, 0.0, 0.5]), r"top_p\[1\] = 0.0 must be in \(0, 1\]"),
    ("top_p", torch.tensor([1.5, 1.0, 0.5]), r"top_p\[0\] = 1.5 must be in \(0, 1\]"),
    ("top_p", torch.tensor([1.0, 1.0, float("nan")]), r"top_p\[2\] = nan"),
    ("min_p", torch.tensor([0.0, 0.2, 1.2]), r"min_p\[2\] = 1.2\d* must be in \[0, 1\]"),
])
def test_filter_ranges_with_validate(name, value, match):
    specdec_kernels.rejection_sample(*_args(), **{name: value})  # no content check: runs
    with pytest.raises(ValueError, match=match):
        specdec_kernels.rejection_sample(*_args(), **{name: value}, validate=True)


def test_fake_shapes_with_filters():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        logits = torch.empty(13, 100, dtype=torch.bfloat16)
        ids = torch.empty(10, dtype=torch.int64)
        cu = torch.empty(4, dtype=torch.int32)
        f = (torch.empty(3, dtype=torch.int32), torch.empty(3), torch.empty(3))
        out, num = torch.ops.specdec.rejection_sample(logits, ids, cu, None, None, None, None, 6, "token", *f)
        t_out, nodes, t_num = torch.ops.specdec.tree_rejection_sample(
            logits[:10], ids, ids, cu, None, None, None, None, 4, *f)
    assert out.shape == (3, 7) and num.shape == (3,)
    assert t_out.shape == (3, 5) and nodes.shape == (3, 5) and t_num.shape == (3,)


DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile_with_filters(device):
    args = [None if t is None or not isinstance(t, torch.Tensor) else t.to(device)
            for t in random_batch(5, 3, 37, draft_probs=True, seed=2)]
    args[7] = 3
    filters = [f.to(device) for f in random_filters(5, 37, seed=1)]
    # The public op (on CUDA: the C++ kernel with its threshold pass, sm_90+), and its twin that
    # always runs Triton on CUDA (what "auto" calls with filters on older GPUs).
    ops_to_check = [torch.ops.specdec._rejection_sample_triton.default]
    cuda_filters = device == "cpu" or ops.cuda_kernel_built() and ops.cuda_filters_supported(0)
    if cuda_filters or not ops.cuda_kernel_built():
        ops_to_check.append(torch.ops.specdec.rejection_sample.default)
    if cuda_filters:
        ops_to_check.append(torch.ops.specdec._rejection_sample_cuda_filters.default)
    for op in ops_to_check:
        torch.library.opcheck(op, (*args, "token", *filters))

    def verify(logits, ids, cu, probs, temperature, seeds, offsets, top_k, top_p, min_p):
        out, num = specdec_kernels.rejection_sample(logits, ids, cu, probs, temperature, seeds, offsets, 3,
                                                    "token", top_k, top_p, min_p)
        return out, num + 1

    compiled = torch.compile(verify, fullgraph=True, dynamic=True)
    out, num = compiled(*args[:7], *filters)
    ref_out, ref_num = verify(*args[:7], *filters)
    assert torch.equal(out, ref_out) and torch.equal(num, ref_num)


@pytest.mark.parametrize("device", DEVICES)
def test_tree_opcheck_with_filters(device):
    from test_tree import _random_trees
    logits, tokens, parents, cu = _random_trees(4, 11, seed=5)
    filters = tuple(f.to(device) for f in random_filters(4, 11, seed=2))
    args = tuple(t.to(device) for t in (logits, tokens, parents, cu)) + (
        None, None, torch.arange(4, device=device), None, 3) + filters
    ops_to_check = [torch.ops.specdec._tree_rejection_sample_triton.default]
    cuda_filters = device == "cpu" or ops.cuda_kernel_built(ops.TREE_REJECTION_SAMPLE) and ops.cuda_filters_supported(0)
    if cuda_filters or not ops.cuda_kernel_built(ops.TREE_REJECTION_SAMPLE):
        ops_to_check.append(torch.ops.specdec.tree_rejection_sample.default)
    if cuda_filters:
        ops_to_check.append(torch.ops.specdec._tree_rejection_sample_cuda_filters.default)
    for op in ops_to_check:
        torch.library.opcheck(op, args)

    @torch.compile(fullgraph=True)
    def verify(*a):
        out, nodes, num = specdec_kernels.tree_rejection_sample(*a)
        return out, nodes, num + 1

    out, nodes, num = verify(*args)
    ref = specdec_kernels.tree_rejection_sample(*args)
    assert torch.equal(out, ref[0]) and torch.equal(nodes, ref[1]) and torch.equal(num, ref[2] + 1)


CUDA_FILTERS = HAS_CUDA and ops.cuda_kernel_built() and ops.cuda_filters_supported(0)
NEEDS_CUDA_FILTERS = pytest.mark.skipif(not CUDA_FILTERS, reason="needs the CUDA kernels on an sm_90+ GPU")


@pytest.mark.gpu
@NEEDS_CUDA_FILTERS
@pytest.mark.parametrize("vocab", [128256, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("method", ["token", "block"])
def test_gpu_cuda_filters_agree_with_reference(vocab, dtype, draft_probs, method):
    """The CUDA chain kernel after its own threshold pass (backend="cuda")."""
    test_gpu_triton_agrees_with_reference(vocab, dtype, draft_probs, method, backend="cuda")


def _near_tie(row: torch.Tensor, temperature: float, top_p: float) -> bool:
    """Whether a row's top-p crossing lies within float rounding of p: the cumulative mass (float64,
    descending) of some token is within 1e-5 (relative) of p * Z. Kernels that sum in float32 or
    fixed point may cross one token earlier or later there, as docs/ALGORITHM.md §7 says."""
    x = torch.nan_to_num(row.double(), nan=float("-inf"), posinf=FLT_MAX)
    w = torch.exp((x - x.max()) / temperature).sort(descending=True).values
    cum = w.cumsum(0)
    goal = top_p * cum[-1]
    return bool(((cum - goal).abs() <= 1e-5 * cum[-1]).any())


# The threshold pass's worst cases: flat rows (top-p alone at high temperature), top-p near 1 and
# at 0, top-k near V, ties, -inf and NaN blocks, tiny and odd vocabularies.
THRESHOLD_VOCABS = [1, 7, 700, 8193, 32000, 128256, 151936]
THRESHOLD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _threshold_case(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = torch.tensor([2, 0, 1, 2, 2, 1, 3, 1])
    B = len(n)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).to(torch.int32)
    rows = int(n.sum()) + B
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0:3] = logits[0:3].round(decimals=0)  # heavy ties
    logits[3, : vocab // 2] = float("-inf")
    logits[4, ::5] = float("nan")
    temperature = torch.tensor([0.8, 0.7, 0.0, 1.3, 2.0, 1.0, 0.8, 0.5])
    top_k = torch.tensor([0, 50, 3, 0, max(vocab - 1, 0), vocab - 100 if vocab > 200 else 2, 0, 1], dtype=torch.int32)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.9999, 0.95, 0.0, 0.9, 0.3])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 1.0])
    return logits, cu, n, temperature, top_k, top_p, min_p


@pytest.mark.gpu
@NEEDS_CUDA_FILTERS
@pytest.mark.parametrize("vocab", THRESHOLD_VOCABS)
@pytest.mark.parametrize("dtype", THRESHOLD_DTYPES)
def test_gpu_cuda_threshold_pass_keeps_the_sorted_definition(vocab, dtype):
    """_row_thresholds_cuda on a ragged chain batch (and the same rows as tree nodes): every
    filtered row keeps exactly the sort-based set (filter_keep_mask, float64), except a top-p
    crossing within float rounding of p; -inf for greedy requests, unfiltered ones and padding."""
    logits, cu, n, temperature, top_k, top_p, min_p = _threshold_case(vocab, seed=vocab)
    logits = logits.to(dtype)
    B, L = len(n), 4
    # A row stride that is not the vocabulary (and, for odd V, rows not 16-byte aligned).
    wide = torch.full((logits.shape[0], vocab + 3), float("nan"), dtype=dtype)
    wide[:, :vocab] = logits
    dev = [t.cuda() for t in (cu, temperature, top_k, top_p, min_p)]
    thr = torch.ops.specdec._row_thresholds_cuda(wide.cuda()[:, :vocab], dev[0], *dev[1:], False, L).cpu()
    # The same rows as tree nodes: request b's nodes are its chain rows.
    cu_nodes = (cu + torch.arange(B + 1, dtype=torch.int32)).cuda()
    tree_thr = torch.ops.specdec._row_thresholds_cuda(logits.cuda(), cu_nodes, *dev[1:], True, 1).cpu()
    ties = 0
    for b in range(B):
        for t in range(L):
            slot = b * L + t
            filtered = temperature[b] > 0 and (0 < top_k[b] < vocab or top_p[b] < 1 or min_p[b] > 0)
            if t > n[b] or not filtered:
                assert thr[slot] == float("-inf"), (b, t)
                continue
            row = int(cu[b]) + b + t
            assert tree_thr[row] == thr[slot]
            x = logits[row].float()
            if not (x > float("-inf")).any():  # no valid logit: nothing to keep
                continue
            keep = filter_keep_mask(torch.nan_to_num(x, nan=float("-inf"), posinf=FLT_MAX).double(),
                                    1 / temperature[b].double(), top_k[b], top_p[b].double(), min_p[b].double())
            got = torch.nan_to_num(x, nan=float("-inf")) >= thr[slot]
            if not torch.equal(got, keep):
                assert top_p[b] < 1 and _near_tie(x, float(temperature[b]), float(top_p[b])), (b, t, vocab)
                ties += 1
    assert ties <= 1


@pytest.mark.gpu
@NEEDS_CUDA_FILTERS
@pytest.mark.parametrize("vocab", [700, 32000, 128256, 151936])
@pytest.mark.parametrize("dtype", THRESHOLD_DTYPES)
def test_gpu_cuda_threshold_pass_big_batch_same_thresholds(vocab, dtype):
    """A big batch splits each row over half as many CTAs (kThrSmallCluster, where two such CTAs
    fit an SM): the same integer sums, so the same thresholds bit for bit as the small batch that
    test_gpu_cuda_threshold_pass_keeps_the_sorted_definition checks against the sorted set."""
    logits, cu, n, temperature, top_k, top_p, min_p = _threshold_case(vocab, seed=vocab + 2)
    logits = logits.to(dtype).cuda()
    B, L, copies = len(n), 4, 6  # 32 slots, then 192: above two waves of 8-CTA clusters on any GPU
    args = [t.cuda() for t in (temperature, top_k, top_p, min_p)]
    small = torch.ops.specdec._row_thresholds_cuda(logits, cu.cuda(), *args, False, L).cpu()
    n_big = n.repeat(copies)
    cu_big = torch.cat([torch.zeros(1, dtype=torch.int64), n_big.cumsum(0)]).to(torch.int32)
    big = torch.ops.specdec._row_thresholds_cuda(logits.repeat(copies, 1), cu_big.cuda(),
                                                 *[t.repeat(copies) for t in args], False, L).cpu()
    assert torch.equal(big, small.repeat(copies))


@pytest.mark.gpu
@NEEDS_CUDA_FILTERS
@pytest.mark.parametrize("vocab", THRESHOLD_VOCABS)
@pytest.mark.parametrize("dtype", THRESHOLD_DTYPES)
def test_gpu_cuda_threshold_pass_min_p_alone(vocab, dtype):
    """Min-p without top_k / top_p runs the max-only pass (row_min_p_threshold_kernel): the same
    thresholds, bit for bit, as the full pass given top-k and top-p switched off per request, and
    exactly the sort-based set; -inf for greedy requests, min_p = 0 and padding."""
    logits, cu, n, temperature, _, _, _ = _threshold_case(vocab, seed=vocab + 1)
    logits = logits.to(dtype)
    B, L = len(n), 4
    min_p = torch.tensor([0.1, 0.0, 0.05, 0.2, 1e-4, 0.5, 0.05, 1.0])
    wide = torch.full((logits.shape[0], vocab + 3), float("nan"), dtype=dtype)
    wide[:, :vocab] = logits
    rows = wide.cuda()[:, :vocab]
    cu_d, temp_d, min_p_d = cu.cuda(), temperature.cuda(), min_p.cuda()
    alone = torch.ops.specdec._row_thresholds_cuda(rows, cu_d, temp_d, None, None, min_p_d, False, L).cpu()
    off_k = torch.zeros(B, dtype=torch.int32, device="cuda")
    off_p = torch.ones(B, device="cuda")
    full = torch.ops.specdec._row_thresholds_cuda(rows, cu_d, temp_d, off_k, off_p, min_p_d, False, L).cpu()
    assert torch.equal(alone, full)
    cu_nodes = (cu + torch.arange(B + 1, dtype=torch.int32)).cuda()
    tree_thr = torch.ops.specdec._row_thresholds_cuda(logits.cuda(), cu_nodes, temp_d, None, None, min_p_d, True,
                                                      1).cpu()
    for b in range(B):
        for t in range(L):
            slot = b * L + t
            if t > n[b] or not (temperature[b] > 0 and min_p[b] > 0):
                assert alone[slot] == float("-inf"), (b, t)
                continue
            row = int(cu[b]) + b + t
            assert tree_thr[row] == alone[slot]
            x = logits[row].float()
            if not (x > float("-inf")).any():
                continue
            keep = filter_keep_mask(torch.nan_to_num(x, nan=float("-inf"), posinf=FLT_MAX).double(),
                                    1 / temperature[b].double(), None, None, min_p[b].double())
            assert torch.equal(torch.nan_to_num(x, nan=float("-inf")) >= alone[slot], keep), (b, t, vocab)


@pytest.mark.gpu
@NEEDS_CUDA_FILTERS
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_gpu_cuda_threshold_pass_flat_rows_top_p(vocab):
    """Top-p alone on flat rows (random logits, temperature 0.8 .. 4, p from 0.05 to 0.9999): the
    case a counting search needs the most passes for."""
    g = torch.Generator().manual_seed(1)
    B = 64
    logits = torch.randn(B, vocab, generator=g) * 3
    temperature = torch.rand(B, generator=g) * 3.2 + 0.8
    top_p = torch.tensor([0.05, 0.5, 0.9, 0.99, 0.9999, 0.999999, 0.7, 0.95] * (B // 8))
    cu = torch.zeros(B + 1, dtype=torch.int32)
    thr = torch.ops.specdec._row_thresholds_cuda(logits.cuda(), cu.cuda(), temperature.cuda(), None, top_p.cuda(),
                                                 None, False, 1).cpu()
    exact = 0
    for b in range(B):
        keep = filter_keep_mask(logits[b].double(), 1 / temperature[b].double(), None, top_p[b].double(), None)
        got = logits[b] >= thr[b]
        if torch.equal(got, keep):
            exact += 1
            continue
        # p within float rounding of a crossing (near 1 a token's mass is below the sums' rounding)
        assert _near_tie(logits[b], float(temperature[b]), float(top_p[b])), \
            (b, float(top_p[b]), float(temperature[b]), int(got.sum()), int(keep.sum()))
    assert exact >= B * 3 // 4, f"only {exact} of {B} rows keep exactly the sorted set"


@pytest.mark.gpu
@NEEDS_CUDA_FILTERS
def test_gpu_cuda_threshold_pass_is_deterministic():
    """Integer sums: the same thresholds bit for bit on every run."""
    logits = torch.randn(40, 128256, device="cuda") * 3
    cu = torch.zeros(41, dtype=torch.int32, device="cuda")
    temp = torch.full((40,), 0.8, device="cuda")
    top_p = torch.linspace(0.1, 0.999, 40, device="cuda")
    top_k = torch.tensor([0, 5000] * 20, dtype=torch.int32, device="cuda")
    first = torch.ops.specdec._row_thresholds_cuda(logits, cu, temp, top_k, top_p, None, False, 1)
    for _ in range(5):
        assert torch.equal(torch.ops.specdec._row_thresholds_cuda(logits, cu, temp, top_k, top_p, None, False, 1),
                           first)


# Direct calls of the C++ ops with a bad argument, each in its own process: a crash (a build that
# linked its own libstdc++ segfaulted on such errors: docs/ROBUSTNESS.md) fails one case instead
# of ending the test run.
_BAD_CALL_SETUP = """
import torch, specdec_kernels
op = torch.ops.specdec._rejection_sample_cuda_filtered
b, V = 4, 4096
logits = torch.randn(b, V, device="cuda", dtype=torch.bfloat16)
ids = torch.zeros(0, dtype=torch.int32, device="cuda"); cu = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
temp = torch.ones(b, device="cuda"); seeds = torch.arange(b, device="cuda")
thr = torch.full((b,), -1e30, device="cuda")
try:
    {call}
    torch.cuda.synchronize()
    print("no error")
except RuntimeError as e:
    print("error:", str(e).splitlines()[0])
"""
BAD_CALLS = {
    "row_thresholds must be 1-D with": "op(logits, ids, cu, None, temp, seeds, None, 0, 'token', thr[1:])",
    "row_thresholds must be float32": "op(logits, ids, cu, None, temp, seeds, None, 0, 'token', thr.double())",
    # the threshold pass's checks (csrc/bindings/filters_cuda.cu)
    "top_k must have shape": "torch.ops.specdec.rejection_sample(logits, ids, cu, None, temp, seeds, None, 0, 'token', "
                             "torch.ones(b + 1, dtype=torch.int32, device='cuda'))",
    "top_k must have dtype": "torch.ops.specdec.rejection_sample(logits, ids, cu, None, temp, seeds, None, 0, 'token', "
                             "torch.ones(b, device='cuda'))",
    "top_p must be a floating": "torch.ops.specdec.rejection_sample(logits, ids, cu, None, temp, seeds, None, 0, "
                                "'token', None, torch.ones(b, dtype=torch.int32, device='cuda'))",
    # the public op's own checks (csrc/bindings/common.h), for comparison
    "draft_probs must have shape": "torch.ops.specdec.rejection_sample(logits, ids, cu, "
                                   "torch.rand(3, V, device='cuda'), temp, seeds, None, 0)",
    "temperature must have shape": "torch.ops.specdec.rejection_sample(logits, ids, cu, None, temp[1:], seeds, None, 0)",
}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not ops.cuda_kernel_built(), reason="needs the CUDA kernel on a GPU")
@pytest.mark.parametrize("expected", list(BAD_CALLS))
def test_gpu_cuda_ops_reject_bad_arguments_by_name(expected):
    if expected.startswith(("top_k", "top_p")) and not CUDA_FILTERS:
        pytest.skip("the CUDA threshold pass needs sm_90")
    import os
    import subprocess
    import sys
    code = _BAD_CALL_SETUP.replace("{call}", BAD_CALLS[expected])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.abspath(specdec_kernels.__file__))), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, f"the call crashed (rc {run.returncode}): {run.stderr[-600:]}"
    assert expected in run.stdout, run.stdout


@pytest.mark.gpu
@NEEDS_CUDA_FILTERS
def test_cuda_kernel_op_runs_filters_and_auto_uses_it():
    """The public op's CUDA kernel runs the threshold pass itself (engines calling torch.ops get
    the filters), and "auto" is that kernel."""
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in random_batch(8, 3, 1000, draft_probs=True, seed=0)]
    filters = [f.cuda() for f in random_filters(8, 1000, seed=0)]
    op_out = torch.ops.specdec.rejection_sample(*args, "token", *filters)
    ref = specdec_kernels.rejection_sample(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in args], "token",
                                           *[f.cpu() for f in filters], backend="reference")
    assert (op_out[0].cpu() == ref[0]).all(1).float().mean() >= 0.99
    for backend in ("auto", "cuda"):
        got = specdec_kernels.rejection_sample(*args, "token", *filters, backend=backend)
        assert torch.equal(got[0], op_out[0]) and torch.equal(got[1], op_out[1])


# --- GPU: CUDA graphs and back-to-back launches with filters --------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or "triton" not in gpu_backends(), reason="needs Triton on a CUDA GPU")
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_gpu_graph_replay_with_filters(draft_probs, backend):
    if backend == "cuda" and not ops.cuda_kernel_built():
        pytest.skip("CUDA kernel not built")
    args = list(random_batch(24, 4, 32000, dtype=torch.bfloat16, draft_probs=draft_probs, seed=5, device="cuda"))
    filters = [f.cuda() for f in random_filters(24, 32000, seed=5)]
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args] + [f.clone() for f in filters]
    specdec_kernels.rejection_sample(*static[:8], "token", *static[8:], backend=backend)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, num = specdec_kernels.rejection_sample(*static[:8], "token", *static[8:], backend=backend)
    for step in range(3):
        static[5].copy_(args[5] + step)
        static[8].copy_(torch.roll(filters[0], step))  # new per-request settings each replay
        graph.replay()
        ref = specdec_kernels.rejection_sample(*args[:5], args[5] + step, *args[6:8], "token",
                                               torch.roll(filters[0], step), *filters[1:], backend=backend)
        torch.cuda.synchronize()
        assert torch.equal(out, ref[0]) and torch.equal(num, ref[1])


@pytest.mark.gpu
@pytest.mark.timeout(600)  # first calls compile ~8 kernel variants: over 180 s on an H200 machine
@pytest.mark.skipif(not HAS_CUDA or "triton" not in gpu_backends(), reason="needs Triton on a CUDA GPU")
def test_gpu_back_to_back_filtered_calls_keep_counters_clean():
    """Filtered and unfiltered launches of varying shapes in a row (the per-row counters reset)."""
    agree = 0
    for i in range(30):
        # Few kernel variants to compile (each takes tens of seconds on the GPU machine): one
        # CHUNKS_PAD, one ROWS_PAD, two batch sizes (ragged rows: a few split counts).
        vocab = [4097, 7000][i % 2]
        batch = [28, 32][(i // 2) % 2]
        args = random_batch(batch, 3, vocab, draft_probs=i % 2 == 0, seed=i, device="cuda")
        filters = [f.cuda() for f in random_filters(batch, vocab, seed=i)] if i % 3 != 1 else [None] * 3
        out = specdec_kernels.rejection_sample(*args, "token", *filters, backend="triton")
        ref = specdec_kernels.rejection_sample(*args, "token", *filters, backend="reference")
        agree += int(torch.equal(out[0].cpu(), ref[0].cpu()))
    assert agree >= 28
