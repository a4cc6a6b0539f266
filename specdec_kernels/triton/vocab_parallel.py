"""Fused Triton kernels of the vocabulary-parallel verification (``specdec_kernels.distributed``): chains,
then trees.

``rejection_sample_vocab_parallel`` runs four collectives; between them the local work is
one or two launches each (B requests, L = max_spec_len, W ranks, B' = 2B rows with draft
probabilities -- the residual and q, sampled with the same noise -- else B):

    _chain_local_stats_kernel     (B(L+1) x S)        row max / sum / argmax of S segments of the
                                                      shard's rows, the drafts' l(x), p(x)
    -- all_gather 1: [W, B(L+1), 3S+2] --
    _chain_final_totals_kernel    (B x chunk groups)  accept tests, stop row, per-chunk sums of
                                                      its weights, the edge chunks' partial sums
    -- all_gather 2: [W, B', 5] --
    _chunk_race_kernel            (B' programs)       edge sums merged, the race among owned chunks
    -- all_gather 3: [W, B', 2] --
    _chunk_pick_kernel            (B' programs)       winner, inverse CDF in this shard's part of it
    -- all_reduce(MIN) 4: [B', 2] --
    _chain_finish_kernel          (cdiv(B, 128))      the final token into the output

Every program that needs the accept decision of its request recomputes it from the
gathered statistics (a few dozen numbers and L Philox draws), so no launch is spent on it.
The arithmetic is the torch path's (``specdec_kernels.distributed``): the same formulas in float32, the
race scores in float64, the same random streams, so the tokens are the same.

``tree_rejection_sample_vocab_parallel`` (N nodes, D = max_depth, R = max_children - 1
residual rounds with draft probabilities, else 0) runs the same collectives with 2B final
rows (the stop rows' residuals, then their q as the fallback), sharing the race:

    _tree_local_stats_kernel      (N x S)             row max / sum / argmax of S segments of
                                                      every node row, each child's l(x), p(x)
                                                      in its parent's row
    -- all_gather 1: [W, N, 3S+2] --
    _tree_residual_mass_kernel    (N), R times        this shard's N_j of the rows with more than
      -- all_reduce(SUM) 1b: [N] --                  j children, a_j from the earlier rounds
    _tree_final_totals_kernel     (B x chunk groups)  the walk (each node's children tested in
                                                      order), the stop row, per-chunk sums
    -- all_gather 2: [W, 2B, 5] --
    _chunk_race_kernel            (2B programs)
    -- all_gather 3: [W, 2B, 2] --
    _tree_chunk_pick_kernel       (2B programs)
    -- all_reduce(MIN) 4: [2B, 2] --
    _tree_finish_kernel           (cdiv(B, 128))

The walk costs each program at most D node scans of a few dozen numbers per child, which is
why it is repeated instead of stored: no launch between collectives 1 and 2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.philox import SAMPLE_CHUNK
from .common import philox_words, sanitize, uniform

CHUNK = SAMPLE_CHUNK
BLOCK = 1024               # columns per step of the row-statistics loop
CHUNKS_PER_PROGRAM = 8     # chunks of 256 per program of the totals kernel (amortizes the decision)
FINISH_BLOCK = 128
TARGET_PROGRAMS = 512      # statistics programs to aim for (row segments on small batches)
BLOCK_B = 128              # request offsets per step of the trees' owner / bounds loops
NODE_TILE = 16             # a node's candidate children tested per step of the tree walk
_ACCEPT = tl.constexpr(0)  # philox.STREAM_ACCEPT
_SAMPLE = tl.constexpr(1)  # philox.STREAM_SAMPLE
_TINY = tl.constexpr(1.1754943508222875e-38)

# Element types of the pointer arguments whose names say nothing (python_tests/triton_sm90_compile.py).
POINTER_TYPES = {
    "seed_ptr": "*i64", "offset_ptr": "*i64", "node_ptr": "*i64", "lane_ptr": "*i64", "w0_ptr": "*i64",
    "w1_ptr": "*i64",
    "stats_ptr": "*fp32", "gathered_ptr": "*fp32", "totals_ptr": "*fp32", "edges_ptr": "*fp32",
    "state_f_ptr": "*fp32", "race_ptr": "*fp64", "picks_ptr": "*i64", "state_i_ptr": "*i64",
    "cu_ptr": "*i32", "out_ptr": "*i32", "num_acc_ptr": "*i32", "mass_ptr": "*fp32",
}


@triton.jit
def _shard_row_stats(base, n, inv_t, BLOCK: tl.constexpr):
    """(max, sum of exp((l - max) * inv_t), first argmax or 2^31 - 1) of the n sanitized logits
    at ``base``: one read, per-lane online max / sum."""
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    s_vec = tl.zeros([BLOCK], tl.float32)
    a_vec = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = sanitize(tl.load(base + cols, mask=cols < n, other=float("-inf")).to(tl.float32))
        m_new = tl.maximum(m_vec, x)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        s_vec = s_vec * tl.exp((m_vec - shift) * inv_t) + tl.exp((x - shift) * inv_t)
        a_vec = tl.where(x > m_vec, cols, a_vec)
        m_vec = m_new
    m = tl.max(m_vec, 0)
    shift = tl.where(m > float("-inf"), m, 0.0)
    total = tl.sum(s_vec * tl.exp((m_vec - shift) * inv_t), 0)
    arg = tl.min(tl.where((m_vec == m) & (m_vec > float("-inf")), a_vec, 2147483647), 0)
    return m, total, arg


@triton.jit
def _store_segment_stats(stats_ptr, i, S, sg, seg_base, count, inv_t, col0, lo, vocab_size, BLOCK: tl.constexpr):
    """Segment sg of row i (count logits at seg_base, shard column col0) -> stats[i, 3 sg : 3 sg
    + 3] = (max, sum, first argmax as a global id, vocab_size: none); returns the row's stats
    pointer (collective 1's payload, [3 S + 2] per row)."""
    m, total, arg = _shard_row_stats(seg_base, count, inv_t, BLOCK)
    arg = tl.where(m > float("-inf"), arg + lo + col0, vocab_size)
    out = stats_ptr + tl.cast(i, tl.int64) * (3 * S + 2)
    tl.store(out + 3 * sg, m)
    tl.store(out + 3 * sg + 1, total)
    tl.store(out + 3 * sg + 2, arg.to(tl.float32))  # ids travel as floats: exact below 2^24 (checked)
    return out


@triton.jit
def _fold_partials(g_max, g_sum, g_am, inv_t, vocab_size):
    """Global (max, sum of exp((l - max) * inv_t), first argmax as int64, -1 without a valid
    logit) of rows from their W x S segment partials along axis 0 (1-D: one row; 2-D: a column
    per row), as gathered from collective 1."""
    m_keep = tl.max(g_max, 0, keep_dims=True)
    live = g_max > float("-inf")
    shift = tl.where(m_keep > float("-inf"), m_keep, 0.0)
    row_sum = tl.sum(tl.where(live, g_sum * tl.exp((g_max - shift) * inv_t), 0.0), 0)
    argmax = tl.min(tl.where(live & (g_max == m_keep), g_am, vocab_size * 1.0), 0).to(tl.int64)
    row_max = tl.max(g_max, 0)
    return row_max, row_sum, tl.where(row_max > float("-inf"), argmax, -1)


@triton.jit
def _inv_temperature(temperature_ptr, b, HAS_TEMP: tl.constexpr):
    """(1 / T, greedy) of request b: T = 1 without temperatures, greedy where not T > 0."""
    if HAS_TEMP:
        temp = tl.load(temperature_ptr + b).to(tl.float32)
    else:
        temp = tl.full([], 1.0, tl.float32)
    greedy = ~(temp > 0.0)
    inv_t = tl.where(greedy, 1.0, tl.math.div_rn(1.0, tl.where(greedy, 1.0, temp)))  # IEEE, as torch's 1 / T
    return inv_t, greedy


@triton.jit
def _chain_local_stats_kernel(logits_ptr, l_stride, draft_probs_ptr, p_stride, draft_ids_ptr, cu_ptr,
                              temperature_ptr, stats_ptr, N, R, L, S, seg, lo, n_cols, vocab_size,
                              HAS_PROBS: tl.constexpr, HAS_TEMP: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, s), i = b (L+1) + t: segment s (columns [s seg, (s+1) seg)) of row t of
    request b on this shard -> stats[i, 3s : 3s+3] = (max, sum of exp((l - max) / T), first
    argmax as a global id, vocab_size: none). Segments keep small batches from leaving most
    SMs idle on long rows; the consumers fold them in like more ranks. Program s = 0 also
    writes stats[i, 3S : 3S+2] = (l(x_t), p(x_t)), -inf unless draft x_t (t < L) lies in
    this shard."""
    i = tl.program_id(0)
    sg = tl.program_id(1)
    b = i // (L + 1)
    t = i % (L + 1)
    cu_lo = tl.load(cu_ptr + b).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1).to(tl.int64) - cu_lo, 0), L)
    row = cu_lo + b + t
    row_ok = (t <= n) & (row >= 0) & (row < R)
    inv_t, _ = _inv_temperature(temperature_ptr, b, HAS_TEMP)
    base = logits_ptr + tl.where(row_ok, row, 0) * l_stride
    start = sg * seg
    count = tl.where(row_ok, tl.minimum(tl.maximum(n_cols - start, 0), seg), 0)
    out = _store_segment_stats(stats_ptr, i, S, sg, base + start, count, inv_t, start, lo, vocab_size, BLOCK)
    if sg == 0:
        d = cu_lo + t
        d_ok = (t < n) & (d >= 0) & (d < N)
        x = tl.load(draft_ids_ptr + tl.where(d_ok, d, 0), mask=d_ok, other=-1).to(tl.int64)
        mine = d_ok & (x >= lo) & (x < lo + n_cols)
        col = tl.where(mine, x - lo, 0)
        l_x = tl.where(mine & row_ok, sanitize(tl.load(base + col, mask=mine & row_ok, other=0.0).to(tl.float32)),
                       float("-inf"))
        if HAS_PROBS:
            p_x = tl.load(draft_probs_ptr + tl.where(d_ok, d, 0) * p_stride + col, mask=mine,
                          other=0.0).to(tl.float32)
            p_x = tl.where(mine, p_x, float("-inf"))
        else:
            p_x = tl.full([], float("-inf"), tl.float32)
        tl.store(out + 3 * S, l_x)
        tl.store(out + 3 * S + 1, p_x)


@triton.jit
def _chain_decision(gathered_ptr, draft_ids_ptr, cu_ptr, seeds_ptr, offsets_ptr, b, B, N, R, L, W, S, vocab_size,
                    inv_t, greedy, HAS_PROBS: tl.constexpr, WS_PAD: tl.constexpr, W_PAD: tl.constexpr,
                    L1_PAD: tl.constexpr):
    """Request b's accept tests on the gathered statistics, as every rank runs them: the global
    row statistics from the W x S segment partials, then accept x_t iff u_t p(x_t) < q(x_t)
    (greedy: x_t = argmax) for the leading t. Returns (t-lane vector, drafts x [L1_PAD],
    t_star, x_star (-1: none), the stop row (-1: none), its max, sum and argmax, the
    draft-probability row at t_star, seed, offset)."""
    t = tl.arange(0, L1_PAD)
    F = 3 * S + 2  # floats per row and rank
    ws = tl.arange(0, WS_PAD)  # (rank, segment) pairs in vocabulary order
    ok = (ws[:, None] < W * S) & (t[None, :] <= L)
    ptr = gathered_ptr + (((ws // S)[:, None].to(tl.int64) * B + b) * (L + 1) + t[None, :]) * F + 3 * (ws % S)[:, None]
    row_max, row_sum, argmax = _fold_partials(tl.load(ptr, mask=ok, other=float("-inf")),
                                              tl.load(ptr + 1, mask=ok, other=0.0),
                                              tl.load(ptr + 2, mask=ok, other=0.0), inv_t, vocab_size)
    shift = tl.where(row_max > float("-inf"), row_max, 0.0)
    w = tl.arange(0, W_PAD)
    okw = (w[:, None] < W) & (t[None, :] <= L)
    ptr_x = gathered_ptr + ((w[:, None].to(tl.int64) * B + b) * (L + 1) + t[None, :]) * F + 3 * S
    lx = tl.max(tl.load(ptr_x, mask=okw, other=float("-inf")), 0)
    if HAS_PROBS:
        px = tl.max(tl.load(ptr_x + 1, mask=okw, other=float("-inf")), 0)
    else:
        px = tl.full([L1_PAD], 1.0, tl.float32)

    cu_lo = tl.load(cu_ptr + b).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1).to(tl.int64) - cu_lo, 0), L)
    d = cu_lo + t
    d_ok = (t < n) & (d >= 0) & (d < N)
    x = tl.load(draft_ids_ptr + tl.where(d_ok, d, 0), mask=d_ok, other=-1).to(tl.int64)
    x_ok = d_ok & (x >= 0) & (x < vocab_size)
    q_x = tl.where(x_ok & (lx > float("-inf")) & (row_max > float("-inf")),
                   tl.exp((lx - shift) * inv_t) / tl.maximum(row_sum, 1e-38), 0.0)
    seed = tl.load(seeds_ptr + b).to(tl.int64)
    offset = tl.load(offsets_ptr + b).to(tl.int64)
    a0, _ = philox_words(seed, offset, _ACCEPT, t + 1, t * 0)
    u = uniform(a0)
    accept = tl.where(greedy, x == argmax, u * px < q_x) & x_ok
    t_star = tl.min(tl.where(~accept & (t < L), t, L), 0)  # the first rejection (L: none)
    at = t == t_star
    x_star = tl.where(t_star < n, tl.sum(tl.where(at, x, 0), 0), -1)
    row = cu_lo + b + t_star
    row_star = tl.where((t_star <= n) & (row >= 0) & (row < R), row, -1)
    m_star = tl.sum(tl.where(at, row_max, 0.0), 0)
    s_star = tl.sum(tl.where(at, row_sum, 0.0), 0)
    am_star = tl.sum(tl.where(at, argmax, 0), 0)
    prob_row = tl.minimum(tl.maximum(cu_lo + t_star, 0), tl.maximum(N - 1, 0))
    return t, x, t_star, x_star, row_star, m_star, s_star, am_star, prob_row, seed, offset


@triton.jit
def _final_weights(logits_ptr, l_stride, draft_probs_ptr, p_stride, row, prob_row, cols, ok, m, s, inv_t,
                   x_star_local, HAS_PROBS: tl.constexpr):
    """(w, q) of the stop row at the local columns ``cols`` (``ok``: in the shard): q from the
    global statistics; w = the residual (q - p)+ after a rejected draft (0 where q = 0, NaN ->
    0), with draft probabilities; q without the rejected draft's column otherwise."""
    ok = ok & (row >= 0)
    x = sanitize(tl.load(logits_ptr + tl.maximum(row, 0) * l_stride + cols, mask=ok,
                          other=float("-inf")).to(tl.float32))
    shift = tl.where(m > float("-inf"), m, 0.0)
    q = tl.where(x > float("-inf"), tl.exp((x - shift) * inv_t) / tl.maximum(s, _TINY), 0.0)
    if HAS_PROBS:
        p = tl.load(draft_probs_ptr + prob_row * p_stride + cols, mask=ok, other=0.0).to(tl.float32)
        d = q - p
        res = tl.where((q > 0) & (d > 0), d, 0.0)
        w = tl.where(x_star_local != -1, res, q)  # residual only after a rejected valid draft
    else:
        w = tl.where(cols == x_star_local, 0.0, q)
    return w, q


@triton.jit
def _clean_sum(w, axis: tl.constexpr):
    """Sum, NaN -> 0, clamped at 0 (the torch path's nan_to_num().clamp(min=0))."""
    s = tl.sum(w, axis)
    return tl.maximum(tl.where(s == s, s, 0.0), 0.0)


@triton.jit
def _chain_final_totals_kernel(logits_ptr, l_stride, draft_probs_ptr, p_stride, draft_ids_ptr, cu_ptr,
                               temperature_ptr, seeds_ptr, offsets_ptr, gathered_ptr, totals_ptr, edges_ptr,
                               state_i_ptr, state_f_ptr, out_ptr, num_acc_ptr,
                               B, N, R, L, W, S, lo, n_cols, vocab_size, c_first, n_chunks,
                               HAS_PROBS: tl.constexpr, HAS_TEMP: tl.constexpr, WS_PAD: tl.constexpr,
                               W_PAD: tl.constexpr, L1_PAD: tl.constexpr, CHUNKS_PER_PROGRAM: tl.constexpr,
                               CHUNK: tl.constexpr):
    """Program (b, j): request b's decision (every program), then this shard's part of global
    chunks c_first + j*CHUNKS_PER_PROGRAM + (0..) of its stop row: totals[b, c] = sum of w
    (and, with draft probabilities, totals[B + b, c] = sum of q). Program j = 0 also writes
    the request's state for the later kernels, its output row (accepted drafts, -1) and
    num_accepted; the programs holding the first and last chunk the edge row of
    collective 2: (c_first, first chunk's sum, c_last, last chunk's sum (0 if one chunk),
    n_chunks)."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    inv_t, greedy = _inv_temperature(temperature_ptr, b, HAS_TEMP)
    t, x, t_star, x_star, row, m, s, am, prob_row, seed, offset = _chain_decision(
        gathered_ptr, draft_ids_ptr, cu_ptr, seeds_ptr, offsets_ptr, b, B, N, R, L, W, S, vocab_size, inv_t, greedy,
        HAS_PROBS, WS_PAD, W_PAD, L1_PAD)
    x_star_ok = (x_star >= 0) & (x_star < vocab_size)
    if HAS_PROBS:
        x_star_local = tl.where(x_star_ok, 0, -1)  # only "rejected or not" matters
    else:
        x_star_local = tl.where(x_star_ok & (x_star >= lo) & (x_star < lo + n_cols), x_star - lo, -1)
    if j == 0:
        si = state_i_ptr + b * 5
        tl.store(si, t_star)
        tl.store(si + 1, row)
        tl.store(si + 2, prob_row)
        tl.store(si + 3, x_star_local)
        tl.store(si + 4, am)
        tl.store(state_f_ptr + b * 2, m)
        tl.store(state_f_ptr + b * 2 + 1, s)
        tl.store(out_ptr + b * (L + 1) + t, tl.where(t < t_star, x, -1).to(tl.int32), mask=t <= L)
        tl.store(num_acc_ptr + b, t_star.to(tl.int32))
    c = j * CHUNKS_PER_PROGRAM + tl.arange(0, CHUNKS_PER_PROGRAM)
    cols = (c_first + c[:, None]) * CHUNK - lo + tl.arange(0, CHUNK)[None, :]
    ok = (cols >= 0) & (cols < n_cols) & (c[:, None] < n_chunks)
    w, q = _final_weights(logits_ptr, l_stride, draft_probs_ptr, p_stride, row, prob_row, cols, ok, m, s,
                          inv_t, x_star_local, HAS_PROBS)
    tot_w = _clean_sum(w, 1)
    in_range = c < n_chunks
    tl.store(totals_ptr + b.to(tl.int64) * n_chunks + c, tot_w, mask=in_range)
    _store_edges(edges_ptr + b * 5, tot_w, c, j, c_first, n_chunks)
    if HAS_PROBS:  # q of the same row, sampled with the same noise: the fallback of an empty residual
        tot_q = _clean_sum(q, 1)
        tl.store(totals_ptr + (B + b).to(tl.int64) * n_chunks + c, tot_q, mask=in_range)
        _store_edges(edges_ptr + (B + b) * 5, tot_q, c, j, c_first, n_chunks)


@triton.jit
def _store_edges(edge_ptr, tot, c, j, c_first, n_chunks):
    """One row of collective 2's edges: the first chunk's sum and the fields that do not depend
    on the sums by program 0, the last chunk's sum by the program that holds it. (tl.cast, not
    .to: Triton passes an integer argument equal to 1 as a Python int, which has no .to.)"""
    if j == 0:
        tl.store(edge_ptr, tl.cast(c_first, tl.float32))
        tl.store(edge_ptr + 1, tl.sum(tl.where(c == 0, tot, 0.0), 0))
        tl.store(edge_ptr + 2, tl.cast(c_first + n_chunks - 1, tl.float32))
        tl.store(edge_ptr + 4, tl.cast(n_chunks, tl.float32))
        if n_chunks <= 1:
            tl.store(edge_ptr + 3, 0.0)
    has_last = (c == n_chunks - 1) & (n_chunks > 1)
    tl.store(edge_ptr + 3 + c * 0, tot, mask=has_last)


@triton.jit
def _chunk_race_kernel(totals_ptr, edges_ptr, race_ptr, state_i_ptr, seeds_ptr, offsets_ptr,
                       B, W, my_rank, lo, hi, c_first, n_chunks, state_stride,
                       W_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Program r (row r of B' = the final rows, then their q rows): adds the other ranks'
    partial sums of the shared edge chunks to totals[r] (in place: the pick kernel reads
    them), then races the chunks that start in this shard: race[r] = (best score
    log2(W_c) - log2(-log2(v_c)) in float64, its chunk; -inf, c_first without any). The
    Philox node is state_i[b, 0] (chains and trees alike)."""
    r = tl.program_id(0)
    B2 = tl.num_programs(0)
    b = r % B
    c = tl.arange(0, CHUNKS_PAD)
    chunk = c_first + c
    in_range = c < n_chunks
    tot = tl.load(totals_ptr + r.to(tl.int64) * n_chunks + c, mask=in_range, other=0.0)
    for w in tl.static_range(W_PAD):  # rank by rank, in the torch path's order of additions
        first, last = _edge_masses(edges_ptr, w, B2, r, (w < W) & (w != my_rank), chunk)
        tot += first
        tot += last
    tl.store(totals_ptr + r.to(tl.int64) * n_chunks + c, tot, mask=in_range)
    owned = in_range & (chunk * CHUNK >= lo) & (chunk * CHUNK < hi)  # each chunk raced by one rank
    seed = tl.load(seeds_ptr + b).to(tl.int64)
    offset = tl.load(offsets_ptr + b).to(tl.int64)
    node = tl.load(state_i_ptr + b * state_stride).to(tl.int32)  # the Philox node: t_star, or the tree's stop node
    _, w1 = philox_words(seed, offset, _SAMPLE, node + c * 0, chunk)
    v = ((w1 >> 8) + 1).to(tl.float64) * (1.0 / 16777216.0)
    score = tl.where((tot > 0) & owned, tl.log2(tot.to(tl.float64)) - tl.log2(-tl.log2(v)), float("-inf"))
    best = tl.max(score, 0)
    best_chunk = tl.min(tl.where(score == best, chunk, 2147483647), 0)
    best_chunk = tl.where(best > float("-inf"), best_chunk, c_first)
    tl.store(race_ptr + r * 2, best)
    tl.store(race_ptr + r * 2 + 1, best_chunk.to(tl.float64))


@triton.jit
def _edge_masses(edges_ptr, w, B2, r, include, chunk):
    """What rank w's edge record of row r (first chunk, its mass, last chunk, its mass, count)
    holds for ``chunk`` (a scalar or a vector of global chunk ids): (the first entry's mass, the
    last entry's mass), 0 where it is another chunk or ``include`` is false. Two terms, so
    callers add them in the torch path's order."""
    e = edges_ptr + tl.cast(w * B2 + r, tl.int64) * 5
    ef = tl.load(e, mask=include, other=-1.0).to(tl.int64)
    el = tl.load(e + 2, mask=include, other=-1.0).to(tl.int64)
    cnt = tl.load(e + 4, mask=include, other=0.0)
    first = tl.where(include & (cnt >= 1) & (chunk == ef), tl.load(e + 1, mask=include, other=0.0), 0.0)
    last = tl.where(include & (cnt >= 2) & (chunk == el), tl.load(e + 3, mask=include, other=0.0), 0.0)
    return first, last


@triton.jit
def _race_winner(totals_ptr, edges_ptr, race_ptr, r, B2, W, my_rank, c_first, n_chunks, W_PAD: tl.constexpr):
    """Row r's race winner over the ranks (highest score, lowest chunk on ties): (winner, found,
    in_shard: the winner has columns here, its merged total here, the mass of the lower ranks'
    part of it)."""
    w = tl.arange(0, W_PAD)
    scores = tl.load(race_ptr + (w * B2 + r) * 2, mask=w < W, other=float("-inf"))
    chunks = tl.load(race_ptr + (w * B2 + r) * 2 + 1, mask=w < W, other=0.0)
    top = tl.max(scores, 0)
    found = top > float("-inf")
    winner = tl.min(tl.where(scores == top, chunks, float("inf")), 0)
    winner = tl.where(found, winner, 0.0).to(tl.int64)
    local_win = winner - c_first
    in_shard = found & (local_win >= 0) & (local_win < n_chunks)
    win_total = tl.load(totals_ptr + tl.cast(r, tl.int64) * n_chunks + tl.where(in_shard, local_win, 0),
                        mask=in_shard, other=0.0)
    before = tl.zeros([], tl.float32)  # the mass of the lower ranks' part of the winning chunk
    for v in tl.static_range(W_PAD):  # shards tile the vocabulary in rank order
        first, last = _edge_masses(edges_ptr, v, B2, r, v < my_rank, winner)
        before += first
        before += last
    return winner, found, in_shard, win_total, before


@triton.jit
def _store_pick(picks_ptr, r, wt, valid, gcol, before, threshold, vocab_size):
    """In-chunk inverse CDF of this shard's weights ``wt`` of the winning chunk, offset by the
    lower ranks' mass: picks[r] = (first crossing or vocab_size, -(last positive entry or -1))."""
    wt = tl.where(valid & (wt == wt), tl.maximum(wt, 0.0), 0.0)
    prefix = before + tl.cumsum(wt, 0)
    positive = valid & (wt > 0)
    first = tl.min(tl.where(positive & (prefix >= threshold), gcol, vocab_size), 0)
    last = tl.max(tl.where(positive, gcol, -1), 0)
    tl.store(picks_ptr + r * 2, first.to(tl.int64))
    tl.store(picks_ptr + r * 2 + 1, -last.to(tl.int64))


@triton.jit
def _chunk_pick_kernel(logits_ptr, l_stride, draft_probs_ptr, p_stride, temperature_ptr, seeds_ptr, offsets_ptr,
                       totals_ptr, edges_ptr, race_ptr, state_i_ptr, state_f_ptr, picks_ptr,
                       B, W, my_rank, lo, hi, c_first, n_chunks, vocab_size,
                       HAS_PROBS: tl.constexpr, HAS_TEMP: tl.constexpr, W_PAD: tl.constexpr,
                       CHUNK: tl.constexpr):
    """Program r: the race's winner over the ranks (highest score, lowest chunk on ties), then
    the in-chunk inverse CDF on this shard's columns of it, offset by the mass of the lower
    ranks' part of the chunk: picks[r] = (first crossing or vocab_size, -(last positive entry
    or -1)), for the all_reduce(MIN)."""
    r = tl.program_id(0)
    B2 = tl.num_programs(0)
    b = r % B
    winner, found, in_shard, win_total, before = _race_winner(totals_ptr, edges_ptr, race_ptr, r, B2, W, my_rank,
                                                              c_first, n_chunks, W_PAD)
    t_star = tl.load(state_i_ptr + b * 5)
    seed = tl.load(seeds_ptr + b).to(tl.int64)
    offset = tl.load(offsets_ptr + b).to(tl.int64)
    w0, _ = philox_words(seed, offset, _SAMPLE, t_star.to(tl.int32), winner.to(tl.int32))
    threshold = uniform(w0) * win_total
    gcol = winner * CHUNK + tl.arange(0, CHUNK)
    valid = tl.where(in_shard, (gcol >= lo) & (gcol < hi), False)  # (scalar & vector trips the interpreter)
    inv_t, _ = _inv_temperature(temperature_ptr, b, HAS_TEMP)
    row = tl.load(state_i_ptr + b * 5 + 1)
    prob_row = tl.load(state_i_ptr + b * 5 + 2)
    x_star_local = tl.load(state_i_ptr + b * 5 + 3)
    m = tl.load(state_f_ptr + b * 2)
    s = tl.load(state_f_ptr + b * 2 + 1)
    cols = tl.where(valid, gcol - lo, 0)
    wt, q = _final_weights(logits_ptr, l_stride, draft_probs_ptr, p_stride, row, prob_row, cols, valid, m, s,
                           inv_t, x_star_local, HAS_PROBS)
    if HAS_PROBS:
        wt = tl.where(r >= B, q, wt)  # rows B.. are the q rows
    _store_pick(picks_ptr, r, wt, valid, gcol, before, threshold, vocab_size)


@triton.jit
def _chain_finish_kernel(picks_ptr, state_i_ptr, temperature_ptr, out_ptr, B, L, vocab_size,
                         HAS_PROBS: tl.constexpr, HAS_TEMP: tl.constexpr, BLOCK: tl.constexpr):
    """Requests b: the token from the reduced picks (the lowest crossing, else the last positive
    entry; -1 without mass), the q row's token when the residual had none (draft
    probabilities) or the argmax (a point-mass draft), the argmax for greedy requests;
    written at out[b, t_star]."""
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = b < B
    first = tl.load(picks_ptr + b * 2, mask=ok, other=0)
    last = -tl.load(picks_ptr + b * 2 + 1, mask=ok, other=0)
    token = tl.where(first < vocab_size, first, last)
    token = tl.where(token >= 0, token, -1)
    am = tl.load(state_i_ptr + b * 5 + 4, mask=ok, other=-1)
    if HAS_PROBS:
        first_q = tl.load(picks_ptr + (B + b) * 2, mask=ok, other=0)
        last_q = -tl.load(picks_ptr + (B + b) * 2 + 1, mask=ok, other=0)
        fallback = tl.where(first_q < vocab_size, first_q, last_q)
        token = tl.where(token < 0, tl.where(fallback >= 0, fallback, -1), token)
    else:
        token = tl.where(token < 0, am, token)
    if HAS_TEMP:
        greedy = ~(tl.load(temperature_ptr + b, mask=ok, other=1.0).to(tl.float32) > 0.0)
        token = tl.where(greedy, am, token)
    t_star = tl.load(state_i_ptr + b * 5, mask=ok, other=0)
    tl.store(out_ptr + b * (L + 1) + t_star, token.to(tl.int32), mask=ok)


# ---- trees (``tree_rejection_sample_vocab_parallel``) ------------------------------------------
# Node i of the flat [N] arrays belongs to request owner(i) under the torch path's sanitized
# offsets cu' = cummax(clamp(cu, 0, N)); child j of node v (same request, v < j) is tested iff
# its parent link is valid (0 <= parents[j] < j - cu'[b]) and its token is in [0, V).

@triton.jit
def _clamped_cu(cu_ptr, k, B, N):
    return tl.minimum(tl.maximum(tl.load(cu_ptr + k, mask=k <= B, other=0).to(tl.int64), 0), N)


@triton.jit
def _tree_owner(cu_ptr, i, B, N, BLOCK_B: tl.constexpr):
    """(owner, cu'[owner]) of node i: owner = #{k >= 1 : cu'[k] <= i} (B past cu'[B]), as the
    torch path's searchsorted. cu'[k] <= i exactly for k below the first k with
    clamp(cu[k]) > i, so two min/max passes over cu replace the prefix max."""
    f = tl.full([], 0, tl.int32) + B + 1
    for k0 in range(0, B + 1, BLOCK_B):
        k = k0 + tl.arange(0, BLOCK_B)
        c = _clamped_cu(cu_ptr, k, B, N)
        f = tl.minimum(f, tl.min(tl.where((k <= B) & (c > i), k, B + 1), 0))
    owner = tl.maximum(f - 1, 0)
    start = tl.zeros([], tl.int64)
    for k0 in range(0, owner + 1, BLOCK_B):
        k = k0 + tl.arange(0, BLOCK_B)
        start = tl.maximum(start, tl.max(tl.where(k <= owner, _clamped_cu(cu_ptr, k, B, N), 0), 0))
    return owner, start


@triton.jit
def _tree_bounds(cu_ptr, b, B, N, BLOCK_B: tl.constexpr):
    """(cu'[b], cu'[b + 1]): request b's nodes (prefix maxima of the clamped offsets)."""
    start = tl.zeros([], tl.int64)
    end = tl.zeros([], tl.int64)
    for k0 in range(0, b + 2, BLOCK_B):
        k = k0 + tl.arange(0, BLOCK_B)
        c = _clamped_cu(cu_ptr, k, B, N)
        start = tl.maximum(start, tl.max(tl.where(k <= b, c, 0), 0))
        end = tl.maximum(end, tl.max(tl.where(k <= b + 1, c, 0), 0))
    return start, end


@triton.jit
def _fold_row(gathered_ptr, row, N, W, S, inv_t, vocab_size, WS_PAD: tl.constexpr):
    """Global (max, sum of exp((l - max) * inv_t), argmax or -1) of node row ``row`` from the
    W x S segment partials of collective 1 (the chain's fold, for one row)."""
    ws = tl.arange(0, WS_PAD)
    ok = ws < W * S
    ptr = gathered_ptr + ((ws // S).to(tl.int64) * N + row) * (3 * S + 2) + 3 * (ws % S)
    return _fold_partials(tl.load(ptr, mask=ok, other=float("-inf")), tl.load(ptr + 1, mask=ok, other=0.0),
                          tl.load(ptr + 2, mask=ok, other=0.0), inv_t, vocab_size)


@triton.jit
def _children_tile(tokens_ptr, parents_ptr, v, start, end, t0, vocab_size, NODE_TILE: tl.constexpr):
    """Nodes j = v + 1 + t0 + (0 .. NODE_TILE-1) of v's request: (j, token, tested child of v)."""
    j = v + 1 + t0 + tl.arange(0, NODE_TILE)
    ok = j < end
    par = tl.load(parents_ptr + j, mask=ok, other=-1).to(tl.int64)
    x = tl.load(tokens_ptr + j, mask=ok, other=-1).to(tl.int64)
    kid = ok & (par >= 0) & (par == v - start) & (x >= 0) & (x < vocab_size)  # (par < j - start as v < j)
    return j, x, kid


@triton.jit
def _residual_coeffs(mass_ptr, v, N, k, rounds):
    """(a_k, N_k) of row v at k (any shape, 0 <= k <= rounds + 1) from the all-reduced masses
    mass[r - 1, v] = N_r: a_0 = 0, a_1 = 1, a_{r+1} = a_r + N_r (float32, in the torch path's
    order), N_0 = 1."""
    a_k = tl.where(k >= 1, 1.0, 0.0)
    n_k = tl.where(k >= 0, 1.0, 1.0)
    a = tl.full([], 1.0, tl.float32)
    for r in range(1, rounds + 1):
        n_r = tl.load(mass_ptr + (r - 1) * N + v)
        n_k = tl.where(k == r, n_r, n_k)
        a = a + n_r
        a_k = tl.where(k == r + 1, a, a_k)
    return a_k, n_k


@triton.jit
def _scan_children(tokens_ptr, parents_ptr, gathered_ptr, mass_ptr, v, start, end, active, N, W, S, rounds,
                   vocab_size, inv_t, greedy, seed, offset, HAS_PROBS: tl.constexpr, WS_PAD: tl.constexpr,
                   W_PAD: tl.constexpr, NODE_TILE: tl.constexpr):
    """Node v's children in index order (``active`` False: none): (first accepted child or N,
    number of tested children, v's row max, sum, argmax). A child's test needs only its earlier
    siblings (docs/ALGORITHM.md §5): with draft probabilities the residual coefficients after
    as many rejections, without them the mass of the earlier distinct tokens (a repeat of an
    earlier sibling's token is rejected)."""
    m, s, am = _fold_row(gathered_ptr, tl.minimum(v, N - 1), N, W, S, inv_t, vocab_size, WS_PAD)
    shift = tl.where(m > float("-inf"), m, 0.0)
    first = tl.zeros([], tl.int64) + N
    count = tl.zeros([], tl.int64)
    q_before = tl.zeros([], tl.float64)  # q of the earlier distinct siblings (float64, as the torch path)
    n_after = tl.where(active, end - v - 1, 0).to(tl.int32)
    w = tl.arange(0, W_PAD)
    for t0 in range(0, n_after, NODE_TILE):
        j, x, kid = _children_tile(tokens_ptr, parents_ptr, v, start, end, t0, vocab_size, NODE_TILE)
        # l_v(x), p_v(x): on the rank that holds x, -inf on the others
        okw = (w[:, None] < W) & kid[None, :]
        ptr = gathered_ptr + (w[:, None].to(tl.int64) * N + j[None, :]) * (3 * S + 2) + 3 * S
        lx = tl.max(tl.load(ptr, mask=okw, other=float("-inf")), 0)
        # (tl.where: scalar & vector trips the interpreter)
        has_q = tl.where(m > float("-inf"), kid & (lx > float("-inf")), False)
        q_x = tl.where(has_q, tl.exp((lx - shift) * inv_t) / tl.maximum(s, _TINY), 0.0)
        loc = (j - start).to(tl.int32)
        a0, _a1 = philox_words(seed, offset, _ACCEPT, loc, loc * 0)
        u = uniform(a0)
        kid_n = kid.to(tl.int64)
        if HAS_PROBS:
            px = tl.max(tl.load(ptr + 1, mask=okw, other=float("-inf")), 0)
            rank = tl.minimum(count + tl.cumsum(kid_n, 0) - kid_n, rounds)  # earlier tested siblings
            a_c, n_c = _residual_coeffs(mass_ptr, v, N, rank, rounds)
            d = q_x - a_c * px
            accept_random = u * px * n_c < tl.where(d < 0, 0.0, d)  # (clamp(min=0) keeps NaN: no accept)
        else:
            k = tl.arange(0, NODE_TILE)
            dup = tl.max(((x[:, None] == x[None, :]) & kid[None, :] & (k[None, :] < k[:, None])).to(tl.int32), 1) > 0
            for e0 in range(0, t0, NODE_TILE):  # earlier tiles
                _je, xe, kid_e = _children_tile(tokens_ptr, parents_ptr, v, start, end, e0, vocab_size, NODE_TILE)
                dup = dup | (tl.max(((x[:, None] == xe[None, :]) & kid_e[None, :]).to(tl.int32), 1) > 0)
            val = tl.where(kid & ~dup, q_x, 0.0).to(tl.float64)
            excluded = q_before + (tl.cumsum(val, 0) - val)
            q_before += tl.sum(val, 0)
            accept_random = (u * (1.0 - excluded).to(tl.float32) < q_x) & ~dup
        accept = kid & tl.where(greedy, x == am, accept_random)
        first = tl.minimum(first, tl.min(tl.where(accept, j, N), 0))
        count += tl.sum(kid_n, 0)
    return first, count, m, s, am


@triton.jit
def _tree_local_stats_kernel(logits_ptr, l_stride, draft_probs_ptr, p_stride, tokens_ptr, parents_ptr, cu_ptr,
                             temperature_ptr, stats_ptr, B, N, S, seg, lo, n_cols, vocab_size,
                             HAS_PROBS: tl.constexpr, HAS_TEMP: tl.constexpr, BLOCK_B: tl.constexpr,
                             BLOCK: tl.constexpr):
    """Program (i, s): segment s of node row i on this shard -> stats[i, 3s : 3s+3] = (max, sum
    of exp((l - max) / T), first argmax as a global id, vocab_size: none), T of i's request.
    Program s = 0 also writes stats[i, 3S : 3S+2] = (l(x_i), p(x_i)) in the parent's row, -inf
    unless node i is a tested child whose token lies in this shard (the chain's layout)."""
    i = tl.program_id(0)
    sg = tl.program_id(1)
    owner, start = _tree_owner(cu_ptr, i, B, N, BLOCK_B)
    inv_t, _ = _inv_temperature(temperature_ptr, tl.minimum(owner, B - 1), HAS_TEMP)
    col0 = sg * seg
    count = tl.minimum(tl.maximum(n_cols - col0, 0), seg)
    out = _store_segment_stats(stats_ptr, i, S, sg, logits_ptr + i.to(tl.int64) * l_stride + col0, count, inv_t,
                               col0, lo, vocab_size, BLOCK)
    if sg == 0:
        loc = i - start
        par = tl.load(parents_ptr + i).to(tl.int64)
        x = tl.load(tokens_ptr + i).to(tl.int64)
        kid = (loc > 0) & (par >= 0) & (par < loc) & (owner < B) & (x >= 0) & (x < vocab_size)
        mine = kid & (x >= lo) & (x < lo + n_cols)
        prow = tl.where(kid, start + par, 0)
        col = tl.where(mine, x - lo, 0)
        l_x = tl.load(logits_ptr + prow * l_stride + col, mask=mine, other=0.0).to(tl.float32)
        tl.store(out + 3 * S, tl.where(mine, sanitize(l_x), float("-inf")))
        if HAS_PROBS:
            p_x = tl.load(draft_probs_ptr + prow * p_stride + col, mask=mine, other=0.0).to(tl.float32)
            tl.store(out + 3 * S + 1, tl.where(mine, p_x, float("-inf")))
        else:
            tl.store(out + 3 * S + 1, float("-inf"))


@triton.jit
def _tree_residual_mass_kernel(logits_ptr, l_stride, draft_probs_ptr, p_stride, tokens_ptr, parents_ptr, cu_ptr,
                               temperature_ptr, gathered_ptr, mass_ptr, B, N, W, S, j_round, n_cols, vocab_size,
                               HAS_TEMP: tl.constexpr, WS_PAD: tl.constexpr, BLOCK_B: tl.constexpr,
                               NODE_TILE: tl.constexpr, BLOCK: tl.constexpr):
    """Program v, round j: mass[j - 1, v] = this shard's part of N_j = sum_x (q(x) - a_j p(x))+
    over node row v (q from the global statistics, a_j from the earlier rounds' all-reduced
    masses); rows with at most j tested children read nothing (their N_j is never used)."""
    v = tl.program_id(0)
    owner, start = _tree_owner(cu_ptr, v, B, N, BLOCK_B)
    b = tl.minimum(owner, B - 1)
    _, end = _tree_bounds(cu_ptr, b, B, N, BLOCK_B)
    n_after = tl.where(owner < B, end - v - 1, 0).to(tl.int32)
    count = tl.zeros([], tl.int32)
    for t0 in range(0, n_after, NODE_TILE):
        _j, _x, kid = _children_tile(tokens_ptr, parents_ptr, v, start, end, t0, vocab_size, NODE_TILE)
        count += tl.sum(kid.to(tl.int32), 0)
    acc = tl.zeros([BLOCK], tl.float32)
    if count > j_round:
        inv_t, _greedy = _inv_temperature(temperature_ptr, b, HAS_TEMP)
        m, s, _am = _fold_row(gathered_ptr, v, N, W, S, inv_t, vocab_size, WS_PAD)
        a, _n = _residual_coeffs(mass_ptr, v, N, j_round, j_round - 1)
        shift = tl.where(m > float("-inf"), m, 0.0)
        total = tl.maximum(s, _TINY)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            x = sanitize(tl.load(logits_ptr + v.to(tl.int64) * l_stride + cols, mask=cols < n_cols,
                                  other=float("-inf")).to(tl.float32))
            p = tl.load(draft_probs_ptr + v.to(tl.int64) * p_stride + cols, mask=cols < n_cols,
                        other=0.0).to(tl.float32)
            d = tl.exp((x - shift) * inv_t) / total - a * p
            acc += tl.where(d < 0, 0.0, d)  # NaN propagates, as torch's clamp(min=0)
    tl.store(mass_ptr + (j_round - 1) * N + v, tl.sum(acc, 0))


@triton.jit
def _tree_final_weights(logits_ptr, l_stride, draft_probs_ptr, p_stride, tokens_ptr, parents_ptr, row, start, end,
                        exclude, cols, ok, m, s, a, inv_t, lo, vocab_size, HAS_PROBS: tl.constexpr):
    """(w, q) of the stop row ``row`` (-1: none) at the local columns ``cols``: q from the global
    statistics; w = the residual (q - a p)+ (0 where q = 0, NaN -> 0) with draft probabilities,
    else q without the tokens of the stop node's tested children (when ``exclude``)."""
    ok = tl.where(row >= 0, ok, False)
    r = tl.maximum(row, 0).to(tl.int64)
    x = sanitize(tl.load(logits_ptr + r * l_stride + cols, mask=ok, other=float("-inf")).to(tl.float32))
    shift = tl.where(m > float("-inf"), m, 0.0)
    q = tl.where(x > float("-inf"), tl.exp((x - shift) * inv_t) / tl.maximum(s, _TINY), 0.0)
    if HAS_PROBS:
        p = tl.load(draft_probs_ptr + r * p_stride + cols, mask=ok, other=0.0).to(tl.float32)
        d = q - a * p
        w = tl.where((q > 0) & (d > 0), d, 0.0)
    else:
        w = q
        n_after = tl.where(exclude & (row >= 0), end - row - 1, 0).to(tl.int32)
        for k in range(0, n_after):  # a handful of children: one token each
            j = row + 1 + k
            par = tl.load(parents_ptr + j).to(tl.int64)
            xj = tl.load(tokens_ptr + j).to(tl.int64)
            kid = (par >= 0) & (par == row - start) & (xj >= 0) & (xj < vocab_size)
            w = tl.where(tl.where(kid, cols == xj - lo, False), 0.0, w)
    return w, q


@triton.jit
def _tree_final_totals_kernel(logits_ptr, l_stride, draft_probs_ptr, p_stride, tokens_ptr, parents_ptr, cu_ptr,
                              temperature_ptr, seeds_ptr, offsets_ptr, gathered_ptr, mass_ptr, totals_ptr, edges_ptr,
                              state_i_ptr, state_f_ptr, out_ptr, path_ptr, num_acc_ptr,
                              B, N, D, W, S, rounds, lo, n_cols, vocab_size, c_first, n_chunks,
                              HAS_PROBS: tl.constexpr, HAS_TEMP: tl.constexpr, WS_PAD: tl.constexpr,
                              W_PAD: tl.constexpr, BLOCK_B: tl.constexpr, NODE_TILE: tl.constexpr,
                              CHUNKS_PER_PROGRAM: tl.constexpr, CHUNK: tl.constexpr):
    """Program (b, j): request b's walk from its root (every program: at most D steps, each
    testing the current node's children in order until one is accepted), then this shard's
    part of global chunks c_first + j*CHUNKS_PER_PROGRAM + (0..) of the stop row:
    totals[b, c] = sum of w, totals[B + b, c] = sum of q (the fallback, sampled with the same
    noise), and the edge rows of collective 2. Program j = 0 also writes the output rows
    (accepted tokens, accepted nodes, -1), num_accepted and the state of the later kernels:
    state_i[b] = (stop node's local index (the Philox node), stop row or -1, depth, exclude the
    stop's children, has a root, stop row's argmax, request end, 0), state_f[b] = (max, sum, a)."""
    b = tl.program_id(0)
    jp = tl.program_id(1)
    write = jp == 0
    inv_t, greedy = _inv_temperature(temperature_ptr, b, HAS_TEMP)
    start, end = _tree_bounds(cu_ptr, b, B, N, BLOCK_B)
    has_root = end > start
    seed = tl.load(seeds_ptr + b).to(tl.int64)
    offset = tl.load(offsets_ptr + b).to(tl.int64)
    node = start
    moving = has_root
    depth = tl.zeros([], tl.int64)
    n_kids = tl.zeros([], tl.int64)  # tested children of the stop node (where the walk stopped early)
    out_row = out_ptr + b.to(tl.int64) * (D + 1)
    path_row = path_ptr + b.to(tl.int64) * (D + 1)
    tl.store(path_row, tl.where(has_root, 0, -1).to(tl.int32), mask=write)
    tl.store(out_row + D, -1, mask=write)
    for step in range(D):
        nxt = tl.zeros([], tl.int64) + N
        cnt = tl.zeros([], tl.int64)
        if moving:  # a walk that stopped stays: its node has no accepted child
            nxt, cnt, _m, _s, _am = _scan_children(tokens_ptr, parents_ptr, gathered_ptr, mass_ptr, node, start, end,
                                                   moving, N, W, S, rounds, vocab_size, inv_t, greedy, seed, offset,
                                                   HAS_PROBS, WS_PAD, W_PAD, NODE_TILE)
        move = moving & (nxt < N)
        n_kids = tl.where(moving & ~move, cnt, n_kids)
        x = tl.load(tokens_ptr + tl.where(move, nxt, 0), mask=move, other=-1).to(tl.int32)
        tl.store(out_row + step, tl.where(move, x, -1), mask=write)
        tl.store(path_row + step + 1, tl.where(move, nxt - start, -1).to(tl.int32), mask=write)
        node = tl.where(move, nxt, node)
        depth += move.to(tl.int64)
        moving = move
    limited = depth >= D  # children not tested: the residual is q itself
    row = tl.where(has_root, node, -1)
    m, s, am = _fold_row(gathered_ptr, tl.where(has_root, node, N - 1), N, W, S, inv_t, vocab_size, WS_PAD)
    if HAS_PROBS:
        a_k, _ = _residual_coeffs(mass_ptr, tl.where(has_root, node, 0), N, tl.minimum(n_kids, rounds + 1), rounds)
        a = tl.where(limited, 0.0, a_k)
    else:
        a = tl.zeros([], tl.float32)
    if write:
        si = state_i_ptr + b * 8
        tl.store(si, tl.where(has_root, node - start, 0))
        tl.store(si + 1, row)
        tl.store(si + 2, depth)
        tl.store(si + 3, (~limited).to(tl.int64))
        tl.store(si + 4, has_root.to(tl.int64))
        tl.store(si + 5, am)
        tl.store(si + 6, end)
        tl.store(si + 7, start)
        tl.store(state_f_ptr + b * 3, m)
        tl.store(state_f_ptr + b * 3 + 1, s)
        tl.store(state_f_ptr + b * 3 + 2, a)
        tl.store(num_acc_ptr + b, depth.to(tl.int32))
    c = jp * CHUNKS_PER_PROGRAM + tl.arange(0, CHUNKS_PER_PROGRAM)
    cols = (c_first + c[:, None]) * CHUNK - lo + tl.arange(0, CHUNK)[None, :]
    ok = (cols >= 0) & (cols < n_cols) & (c[:, None] < n_chunks)
    w, q = _tree_final_weights(logits_ptr, l_stride, draft_probs_ptr, p_stride, tokens_ptr, parents_ptr, row, start,
                               end, ~limited, cols, ok, m, s, a, inv_t, lo, vocab_size, HAS_PROBS)
    in_range = c < n_chunks
    tot_w = _clean_sum(w, 1)
    tl.store(totals_ptr + b.to(tl.int64) * n_chunks + c, tot_w, mask=in_range)
    _store_edges(edges_ptr + b * 5, tot_w, c, jp, c_first, n_chunks)
    tot_q = _clean_sum(q, 1)
    tl.store(totals_ptr + (B + b).to(tl.int64) * n_chunks + c, tot_q, mask=in_range)
    _store_edges(edges_ptr + (B + b) * 5, tot_q, c, jp, c_first, n_chunks)


@triton.jit
def _tree_chunk_pick_kernel(logits_ptr, l_stride, draft_probs_ptr, p_stride, tokens_ptr, parents_ptr,
                            temperature_ptr, seeds_ptr, offsets_ptr, totals_ptr, edges_ptr, race_ptr, state_i_ptr,
                            state_f_ptr, picks_ptr, B, W, my_rank, lo, hi, c_first, n_chunks, vocab_size,
                            HAS_PROBS: tl.constexpr, HAS_TEMP: tl.constexpr, W_PAD: tl.constexpr,
                            CHUNK: tl.constexpr):
    """``_chunk_pick_kernel`` for the trees' stop rows (rows B.. are their q rows)."""
    r = tl.program_id(0)
    B2 = tl.num_programs(0)
    b = r % B
    winner, found, in_shard, win_total, before = _race_winner(totals_ptr, edges_ptr, race_ptr, r, B2, W, my_rank,
                                                              c_first, n_chunks, W_PAD)
    si = state_i_ptr + b * 8
    seed = tl.load(seeds_ptr + b).to(tl.int64)
    offset = tl.load(offsets_ptr + b).to(tl.int64)
    w0, _ = philox_words(seed, offset, _SAMPLE, tl.load(si).to(tl.int32), winner.to(tl.int32))
    threshold = uniform(w0) * win_total
    gcol = winner * CHUNK + tl.arange(0, CHUNK)
    valid = tl.where(in_shard, (gcol >= lo) & (gcol < hi), False)
    inv_t, _ = _inv_temperature(temperature_ptr, b, HAS_TEMP)
    cols = tl.where(valid, gcol - lo, 0)
    wt, q = _tree_final_weights(logits_ptr, l_stride, draft_probs_ptr, p_stride, tokens_ptr, parents_ptr,
                                tl.load(si + 1), tl.load(si + 7), tl.load(si + 6), tl.load(si + 3) != 0, cols, valid,
                                tl.load(state_f_ptr + b * 3), tl.load(state_f_ptr + b * 3 + 1),
                                tl.load(state_f_ptr + b * 3 + 2), inv_t, lo, vocab_size, HAS_PROBS)
    _store_pick(picks_ptr, r, tl.where(r >= B, q, wt), valid, gcol, before, threshold, vocab_size)


@triton.jit
def _tree_finish_kernel(picks_ptr, state_i_ptr, temperature_ptr, out_ptr, B, D, vocab_size,
                        HAS_TEMP: tl.constexpr, BLOCK: tl.constexpr):
    """Requests b: the token from the reduced picks, the q row's when the residual had no mass,
    the stop row's argmax for greedy requests, -1 without a root; written at out[b, depth]."""
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = b < B
    first = tl.load(picks_ptr + b * 2, mask=ok, other=0)
    last = -tl.load(picks_ptr + b * 2 + 1, mask=ok, other=0)
    token = tl.where(first < vocab_size, first, last)
    first_q = tl.load(picks_ptr + (B + b) * 2, mask=ok, other=0)
    last_q = -tl.load(picks_ptr + (B + b) * 2 + 1, mask=ok, other=0)
    fallback = tl.where(first_q < vocab_size, first_q, last_q)
    token = tl.where(token >= 0, token, tl.where(fallback >= 0, fallback, -1))
    if HAS_TEMP:
        greedy = ~(tl.load(temperature_ptr + b, mask=ok, other=1.0).to(tl.float32) > 0.0)
        token = tl.where(greedy, tl.load(state_i_ptr + b * 8 + 5, mask=ok, other=-1), token)
    token = tl.where(tl.load(state_i_ptr + b * 8 + 4, mask=ok, other=0) != 0, token, -1)
    depth = tl.load(state_i_ptr + b * 8 + 2, mask=ok, other=0)
    tl.store(out_ptr + b * (D + 1) + depth, token.to(tl.int32), mask=ok)


# ---- launchers (one per kernel; tensors on one device, logits / probs with unit column stride) --

def _pad(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def row_segments(rows: int, vocab_size: int, world: int) -> int:
    """Segments per shard row of the statistics kernel: enough programs to fill a GPU
    (~TARGET_PROGRAMS) on small batches, segments of at least 4 BLOCKs. A function of values
    every rank shares (collective 1's payload has the same shape on every rank)."""
    longest = triton.cdiv(vocab_size, max(world, 1))  # about the largest shard
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, max(rows, 1)), triton.cdiv(longest, 4 * BLOCK)))


def chain_local_stats(logits, draft_probs, draft_ids, cu, temperature, L: int, lo: int, vocab_size: int, S: int):
    """[B * (L+1), 3 S + 2] float32: collective 1's payload (``_chain_local_stats_kernel``)."""
    R, n_cols = logits.shape
    B = cu.shape[0] - 1
    N = draft_ids.shape[0]
    stats = torch.empty(B * (L + 1), 3 * S + 2, dtype=torch.float32, device=logits.device)
    has_probs = draft_probs is not None and N > 0
    seg = triton.cdiv(triton.cdiv(max(n_cols, 1), S), BLOCK) * BLOCK  # whole BLOCKs per segment
    _chain_local_stats_kernel[(B * (L + 1), S)](
        logits, logits.stride(0), draft_probs if has_probs else logits, draft_probs.stride(0) if has_probs else 0,
        draft_ids, cu, logits if temperature is None else temperature, stats, N, R, L, S, seg, lo, n_cols,
        vocab_size, HAS_PROBS=has_probs, HAS_TEMP=temperature is not None, BLOCK=BLOCK, num_warps=4)
    return stats


def chain_final_totals(logits, draft_probs, draft_ids, cu, temperature, seeds, offsets, gathered, L: int, lo: int,
                       vocab_size: int, c_first: int, n_chunks: int):
    """(totals [B', n_chunks], edges [B', 5] float32, state_i [B, 5] int64, state_f [B, 2]
    float32, out [B, L+1] int32 without the final tokens, num_accepted [B] int32)."""
    R, n_cols = logits.shape
    B = cu.shape[0] - 1
    N = draft_ids.shape[0]
    W = gathered.shape[0]
    S = (gathered.shape[-1] - 2) // 3
    has_probs = draft_probs is not None and N > 0
    rows = 2 * B if has_probs else B
    dev = logits.device
    totals = torch.empty(rows, n_chunks, dtype=torch.float32, device=dev)
    edges = torch.empty(rows, 5, dtype=torch.float32, device=dev)
    state_i = torch.empty(B, 5, dtype=torch.int64, device=dev)
    state_f = torch.empty(B, 2, dtype=torch.float32, device=dev)
    out = torch.empty(B, L + 1, dtype=torch.int32, device=dev)
    num_acc = torch.empty(B, dtype=torch.int32, device=dev)
    grid = (B, triton.cdiv(max(n_chunks, 1), CHUNKS_PER_PROGRAM))  # program j = 0 always runs
    _chain_final_totals_kernel[grid](
        logits, logits.stride(0), draft_probs if has_probs else logits, draft_probs.stride(0) if has_probs else 0,
        draft_ids, cu, logits if temperature is None else temperature, seeds, offsets, gathered, totals, edges,
        state_i, state_f, out, num_acc, B, N, R, L, W, S, lo, n_cols, vocab_size, c_first, n_chunks,
        HAS_PROBS=has_probs, HAS_TEMP=temperature is not None, WS_PAD=_pad(W * S), W_PAD=_pad(W), L1_PAD=_pad(L + 1),
        CHUNKS_PER_PROGRAM=CHUNKS_PER_PROGRAM, CHUNK=CHUNK, num_warps=4)
    return totals, edges, state_i, state_f, out, num_acc


def chunk_race(totals, all_edges, state_i, seeds, offsets, my_rank: int, lo: int, hi: int, c_first: int):
    """race [B', 2] float64 (collective 3's payload); merges the edge sums into ``totals``."""
    rows, n_chunks = totals.shape
    W = all_edges.shape[0]
    race = torch.empty(rows, 2, dtype=torch.float64, device=totals.device)
    _chunk_race_kernel[(rows,)](totals, all_edges, race, state_i, seeds, offsets, state_i.shape[0], W, my_rank,
                                lo, hi, c_first, n_chunks, state_i.stride(0), W_PAD=_pad(W),
                                CHUNKS_PAD=_pad(n_chunks), CHUNK=CHUNK, num_warps=4)
    return race


def chunk_pick(logits, draft_probs, temperature, seeds, offsets, totals, all_edges, all_race, state_i, state_f,
               my_rank: int, lo: int, hi: int, c_first: int, vocab_size: int):
    """picks [B', 2] int64: (first crossing, -last positive entry), collective 4's payload."""
    rows, n_chunks = totals.shape
    B = state_i.shape[0]
    W = all_edges.shape[0]
    has_probs = rows == 2 * B and draft_probs is not None
    picks = torch.empty(rows, 2, dtype=torch.int64, device=totals.device)
    _chunk_pick_kernel[(rows,)](
        logits, logits.stride(0), draft_probs if has_probs else logits, draft_probs.stride(0) if has_probs else 0,
        logits if temperature is None else temperature, seeds, offsets, totals, all_edges, all_race, state_i,
        state_f, picks, B, W, my_rank, lo, hi, c_first, n_chunks, vocab_size,
        HAS_PROBS=has_probs, HAS_TEMP=temperature is not None, W_PAD=_pad(W), CHUNK=CHUNK, num_warps=4)
    return picks


def chain_finish(picks, state_i, temperature, out, vocab_size: int) -> None:
    """Writes the final tokens into ``out`` [B, L+1]."""
    B, L1 = out.shape
    _chain_finish_kernel[(triton.cdiv(B, FINISH_BLOCK),)](
        picks, state_i, out if temperature is None else temperature, out, B, L1 - 1, vocab_size,
        HAS_PROBS=picks.shape[0] == 2 * B, HAS_TEMP=temperature is not None, BLOCK=FINISH_BLOCK, num_warps=4)


# ---- tree launchers --------------------------------------------------------------------------

def _tree_common(logits, draft_probs, temperature):
    """(probs pointer, its row stride, temperature pointer, HAS_PROBS, HAS_TEMP): a tensor stands
    in for an absent argument (never read)."""
    has_probs = draft_probs is not None
    return (draft_probs if has_probs else logits, draft_probs.stride(0) if has_probs else 0,
            logits if temperature is None else temperature, has_probs, temperature is not None)


def tree_local_stats(logits, draft_probs, tokens, parents, cu, temperature, lo: int, vocab_size: int, S: int):
    """[N, 3 S + 2] float32: collective 1's payload (``_tree_local_stats_kernel``)."""
    N, n_cols = logits.shape
    probs, p_stride, temp, has_probs, has_temp = _tree_common(logits, draft_probs, temperature)
    stats = torch.empty(N, 3 * S + 2, dtype=torch.float32, device=logits.device)
    seg = triton.cdiv(triton.cdiv(max(n_cols, 1), S), BLOCK) * BLOCK
    _tree_local_stats_kernel[(N, S)](
        logits, logits.stride(0), probs, p_stride, tokens, parents, cu, temp, stats, cu.shape[0] - 1, N, S, seg, lo,
        n_cols, vocab_size, HAS_PROBS=has_probs, HAS_TEMP=has_temp, BLOCK_B=BLOCK_B, BLOCK=BLOCK, num_warps=4)
    return stats


def tree_residual_mass(logits, draft_probs, tokens, parents, cu, temperature, gathered, mass, j: int,
                       vocab_size: int) -> None:
    """Writes this shard's part of round j's residual masses into mass[j - 1] (``mass`` [rounds, N])."""
    N, n_cols = logits.shape
    _, _, temp, _, has_temp = _tree_common(logits, draft_probs, temperature)
    W, S = gathered.shape[0], (gathered.shape[-1] - 2) // 3
    _tree_residual_mass_kernel[(N,)](
        logits, logits.stride(0), draft_probs, draft_probs.stride(0), tokens, parents, cu, temp, gathered, mass,
        cu.shape[0] - 1, N, W, S, j, n_cols, vocab_size, HAS_TEMP=has_temp, WS_PAD=_pad(W * S), BLOCK_B=BLOCK_B,
        NODE_TILE=NODE_TILE, BLOCK=BLOCK, num_warps=4)


def tree_final_totals(logits, draft_probs, tokens, parents, cu, temperature, seeds, offsets, gathered, mass,
                      rounds: int, D: int, lo: int, vocab_size: int, c_first: int, n_chunks: int):
    """(totals [2B, n_chunks], edges [2B, 5] float32, state_i [B, 8] int64, state_f [B, 3]
    float32, out [B, D+1] int32 without the final tokens, accepted nodes [B, D+1] int32,
    num_accepted [B] int32)."""
    N, n_cols = logits.shape
    B = cu.shape[0] - 1
    W, S = gathered.shape[0], (gathered.shape[-1] - 2) // 3
    probs, p_stride, temp, has_probs, has_temp = _tree_common(logits, draft_probs, temperature)
    dev = logits.device
    totals = torch.empty(2 * B, n_chunks, dtype=torch.float32, device=dev)
    edges = torch.empty(2 * B, 5, dtype=torch.float32, device=dev)
    state_i = torch.empty(B, 8, dtype=torch.int64, device=dev)
    state_f = torch.empty(B, 3, dtype=torch.float32, device=dev)
    out = torch.empty(B, D + 1, dtype=torch.int32, device=dev)
    path = torch.empty(B, D + 1, dtype=torch.int32, device=dev)
    num_acc = torch.empty(B, dtype=torch.int32, device=dev)
    grid = (B, triton.cdiv(max(n_chunks, 1), CHUNKS_PER_PROGRAM))  # program j = 0 always runs
    _tree_final_totals_kernel[grid](
        logits, logits.stride(0), probs, p_stride, tokens, parents, cu, temp, seeds, offsets, gathered, mass, totals,
        edges, state_i, state_f, out, path, num_acc, B, N, D, W, S, rounds, lo, n_cols, vocab_size, c_first, n_chunks,
        HAS_PROBS=has_probs, HAS_TEMP=has_temp, WS_PAD=_pad(W * S), W_PAD=_pad(W), BLOCK_B=BLOCK_B,
        NODE_TILE=NODE_TILE, CHUNKS_PER_PROGRAM=CHUNKS_PER_PROGRAM, CHUNK=CHUNK, num_warps=4)
    return totals, edges, state_i, state_f, out, path, num_acc


def tree_chunk_pick(logits, draft_probs, tokens, parents, temperature, seeds, offsets, totals, all_edges, all_race,
                    state_i, state_f, my_rank: int, lo: int, hi: int, c_first: int, vocab_size: int):
    """picks [2B, 2] int64: collective 4's payload (``_tree_chunk_pick_kernel``)."""
    rows, n_chunks = totals.shape
    probs, p_stride, temp, has_probs, has_temp = _tree_common(logits, draft_probs, temperature)
    picks = torch.empty(rows, 2, dtype=torch.int64, device=totals.device)
    _tree_chunk_pick_kernel[(rows,)](
        logits, logits.stride(0), probs, p_stride, tokens, parents, temp, seeds, offsets, totals, all_edges, all_race,
        state_i, state_f, picks, state_i.shape[0], all_edges.shape[0], my_rank, lo, hi, c_first, n_chunks, vocab_size,
        HAS_PROBS=has_probs, HAS_TEMP=has_temp, W_PAD=_pad(all_edges.shape[0]), CHUNK=CHUNK, num_warps=4)
    return picks


def tree_finish(picks, state_i, temperature, out, vocab_size: int) -> None:
    """Writes the final tokens into ``out`` [B, D+1]."""
    B, D1 = out.shape
    _tree_finish_kernel[(triton.cdiv(B, FINISH_BLOCK),)](
        picks, state_i, out if temperature is None else temperature, out, B, D1 - 1, vocab_size,
        HAS_TEMP=temperature is not None, BLOCK=FINISH_BLOCK, num_warps=4)


@triton.jit
def _philox01_kernel(seed_ptr, offset_ptr, node_ptr, lane_ptr, w0_ptr, w1_ptr, n,
                     STREAM: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    w0, w1 = philox_words(tl.load(seed_ptr + i, mask=m, other=0), tl.load(offset_ptr + i, mask=m, other=0),
                          STREAM, tl.load(node_ptr + i, mask=m, other=0), tl.load(lane_ptr + i, mask=m, other=0))
    tl.store(w0_ptr + i, w0.to(tl.int64) & 0xFFFFFFFF, mask=m)
    tl.store(w1_ptr + i, w1.to(tl.int64) & 0xFFFFFFFF, mask=m)


def philox01(seeds: torch.Tensor, offsets: torch.Tensor, stream: int, node: torch.Tensor,
             lane: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Words 0 and 1 of ``reference.philox.philox_words`` for int64 tensors of one shape, as
    int64, in one launch (the vocabulary-parallel torch path's draws)."""
    flat = [t.contiguous().view(-1) for t in (seeds, offsets, node, lane)]
    n = flat[0].numel()
    w0 = torch.empty(n, dtype=torch.int64, device=seeds.device)
    w1 = torch.empty_like(w0)
    block = 256
    _philox01_kernel[(triton.cdiv(n, block),)](*flat, w0, w1, n, STREAM=stream, BLOCK=block)
    return w0.view(seeds.shape), w1.view(seeds.shape)
