"""Top-k / top-p / min-p for the Triton kernels: a threshold pass before verification, no sort.

docs/ALGORITHM.md §7 has the semantics and the algorithm; ``sampling_filters`` the sort-based
definition. The filtered distribution of a row is ``q(x) ~ exp2((l(x) - M) k)`` for the tokens
with ``l(x) >= t``, one threshold logit ``t`` per row, so the verification kernels need only
``t``: they treat every logit below it as -inf and skip the chunks whose max is below it.
``launch_row_thresholds`` computes it in two launches:

- ``_filter_stats_kernel`` streams each filtered row once (split as the verification kernel
  splits it) for the maxima of its 256-logit chunks ``m_c`` and of its 32-logit sub-chunks,
  and its max ``M`` (the sum ``Z``, needed only by top-p without top-k, is then computed by the
  search's program);
- ``_filter_threshold_kernel`` (one program per row) runs ``_row_threshold``:

  * *min-p* is a closed form: ``t_mp`` = the smallest float ``v`` with ``(v - M) k >=
    log2(min_p)`` (a bisection over the float's bit pattern, no memory traffic).
  * *top-k* and *top-p* are the largest row value ``v`` with ``count(l >= v) >= k``, resp.
    ``mass(l >= v) >= p * Z_k`` (``Z_k`` = the mass top-k keeps). Both predicates are
    monotone in ``v``, so the answer is found in a bracket ``[lo, hi)`` of order-preserving
    integer keys of the float logits: a lower bound from the chunk maxima (each is a distinct
    token, so a value with k chunk maxima at or above it is <= the k-th largest logit, and one
    whose chunk maxima above it already hold the target mass bounds top-p; two rounds of 16
    pivots over the chunk maxima in registers find a tight one; top-p also has the closed-form
    bound ``M + log2((1 - p) Z_k / 2V) / k``), then
    - one pass over the chunks whose max is >= lo gathers the bracket's tokens into a buffer
      of ``CAP`` entries; if they fit, the buffer is sorted (64 or ``CAP`` entries, in
      registers) and the answer read off exactly as the sort-based definition does;
    - otherwise passes with ``PIVOTS`` pivots each count the tokens and their mass above every
      pivot, narrowing the bracket ~17x per pass, until it fits (or holds one value, which is
      then the answer).
  * ``t = max(t_k, t_p, t_mp)``; -inf for rows of unfiltered or greedy requests.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..reference.philox import SAMPLE_CHUNK
from . import config as _config
from .common import (CU_BLOCK, PROGRAMS_PER_SM, inner_contiguous, owner_request, row_split, sanitize, sanitized_cu,
                     token_in_vocab, workspace)

KEY_NEG_INF = tl.constexpr(-2139095041)  # _key(-inf)


@triton.jit
def _at(vec, idx_vec, idx):
    """vec[idx] of a register vector indexed by idx_vec."""
    return tl.sum(tl.where(idx_vec == idx, vec, 0), 0)


@triton.jit
def _key(x):
    """Order-preserving int32 key of a float32 without NaN: x < y <=> key(x) < key(y), and
    -0.0 and +0.0 both map to 0 (so key equality is float equality)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where((b & 0x7FFFFFFF) == 0, 0, b)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unkey(key):
    """The float32 of a key (keys between _key(-inf) and _key(+inf) are never NaN)."""
    b = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _count_above(keys, weights, ok, piv, PIVOTS: tl.constexpr):
    """For each pivot key: how many of the ``ok`` keys are >= it, and their total weight. One
    [N, PIVOTS] comparison and two reductions (each reduction across warps is a shared-memory
    round trip and a barrier: their number, not the arithmetic, sets this loop's cost)."""
    above = ok[:, None] & (keys[:, None] >= piv[None, :])
    cnt = tl.sum(above.to(tl.int32), 0)
    mass = tl.sum(tl.where(above, weights[:, None], 0.0), 0)
    return cnt, mass


@triton.jit
def _min_p_key(row_max, k, log2_min_p):
    """Key of the smallest float v with (v - row_max) * k >= log2_min_p (finite): bisection on
    the key, 33 steps. row_max itself qualifies (log2_min_p <= 0)."""
    lo = tl.full([], KEY_NEG_INF, tl.int64)
    hi = _key(row_max).to(tl.int64)
    for _step in range(33):
        mid = (lo + hi) >> 1
        ok = (_unkey(mid.to(tl.int32)) - row_max) * k >= log2_min_p
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid + 1)
    return hi.to(tl.int32)


@triton.jit
def _list_at_or_above(maxima, ok, lo, ids, list_ptr):
    """Write the ids of the ``ok`` entries whose max has key >= lo to list_ptr (in order) and
    return how many: only those (chunks, sub-chunks) can hold a token with key >= lo."""
    hit = ok & (_key(maxima) >= lo)
    pos = tl.cumsum(hit.to(tl.int32), 0) - 1
    tl.store(list_ptr + pos, ids, mask=hit)
    tl.debug_barrier()
    return tl.sum(hit.to(tl.int32), 0)


@triton.jit
def _qualify(m_c, in_table, lo, list_ptr):
    """``_list_at_or_above`` of the chunk table (ids ascending). (The loops read the list back
    one tile ahead; chunk ids computed in registers per tile cost two cross-warp reductions per
    tile, which measured slower.)"""
    return _list_at_or_above(m_c, in_table, lo, tl.arange(0, m_c.shape[0]), list_ptr)


@triton.jit
def _list_tile(list_ptr, n_listed, start, TILE: tl.constexpr):
    """Listed chunks start .. start + TILE - 1: their ids ([TILE], 0 past the end) and which exist."""
    j = start + tl.arange(0, TILE)
    listed = j < n_listed
    return tl.load(list_ptr + j, mask=listed, other=0), listed


@triton.jit
def _load_listed(row_ptr, chunk, listed, vocab_size, CHUNK: tl.constexpr):
    """The raw logits of the listed chunks, one tile row per chunk: [TILE, CHUNK] (and offsets,
    in-range mask)."""
    offs = chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    ok = listed[:, None] & (offs < vocab_size)
    return tl.load(row_ptr + offs, mask=ok, other=float("-inf")), offs, ok


@triton.jit
def _gather(row_ptr, list_ptr, n_listed, lo, hi, buf_ptr, idx_ptr, vocab_size, CAP: tl.constexpr,
            TILE: tl.constexpr, CHUNK: tl.constexpr):
    """Copy the logits with lo <= key < hi of the listed chunks, and their vocabulary indices,
    to buf_ptr / idx_ptr (the first CAP of them, in index order) and return how many there are
    (possibly more than CAP). Software-pipelined: tile i + 1's logits and tile i + 2's chunk
    ids are in flight while tile i is processed."""
    count = tl.zeros([], tl.int32)
    chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, 0, TILE)
    raw_nxt, offs_nxt, ok_nxt = _load_listed(row_ptr, chunk_nxt, listed_nxt, vocab_size, CHUNK)
    chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, TILE, TILE)
    for start in range(0, n_listed, TILE):
        raw, offs, ok = raw_nxt, offs_nxt, ok_nxt
        raw_nxt, offs_nxt, ok_nxt = _load_listed(row_ptr, chunk_nxt, listed_nxt, vocab_size, CHUNK)
        chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, start + 2 * TILE, TILE)
        lg = tl.reshape(sanitize(raw.to(tl.float32)), [TILE * CHUNK])
        key = _key(lg)
        inside = (tl.reshape(ok, [TILE * CHUNK]) & (key >= lo) & (key < hi)).to(tl.int32)
        pos = count + tl.cumsum(inside, 0) - 1
        keep = (inside > 0) & (pos < CAP)
        tl.store(buf_ptr + pos, lg, mask=keep)
        tl.store(idx_ptr + pos, tl.reshape(offs, [TILE * CHUNK]), mask=keep)
        count += tl.sum(inside, 0)
    tl.debug_barrier()
    return count


@triton.jit
def _pivots(lo, hi, scale, PIVOTS: tl.constexpr):
    """PIVOTS non-decreasing keys strictly inside (lo, hi) (needs hi - lo >= 2). Any pivots are
    correct; these cut a bracket by ~PIVOTS + 1 per pass:
    - equally spaced values when the bracket's width is within 1024 typical spreads
      (D = max(scale, |hi|), ``scale`` >= 1 a spread of the row's logits);
    - hi - D * 4^(11 - i) when it is wider or open below (lo = -inf), the lowest pivot then
      -FLT_MAX, so that -inf tokens (which no filter needs) are split off at once;
    - equally spaced keys when it spans few floats (or hi = +inf)."""
    i = tl.arange(0, PIVOTS)
    lo64 = lo.to(tl.int64)
    span = hi.to(tl.int64) - lo64
    piv = (lo64 + span * (i + 1) // (PIVOTS + 1)).to(tl.int32)
    lo_f = _unkey(lo)
    hi_f = _unkey(hi)
    d = tl.maximum(scale, tl.abs(hi_f))
    wide = (span > 1048576) & (hi_f < float("inf"))
    width = hi_f - lo_f
    by_value = wide & (width <= 1024.0 * d)
    open_below = wide & (width > 1024.0 * d)  # also lo = -inf (width = inf)
    lo_s = tl.where(by_value, lo_f, 0.0)
    w_s = tl.where(by_value, width, 0.0)
    piv_v = _key(lo_s + w_s * ((i + 1).to(tl.float32) / (PIVOTS + 1)))
    hi_s = tl.where(open_below, hi_f, 0.0)
    d_s = tl.where(open_below, d, 0.0)
    piv_b = _key(hi_s - d_s * tl.exp2((22 - 2 * i).to(tl.float32)))
    first_finite = tl.where(lo == KEY_NEG_INF, KEY_NEG_INF + 1, piv_b)  # _key(-FLT_MAX)
    piv_b = tl.where(i == 0, first_finite, piv_b)
    piv = tl.where(by_value, piv_v, tl.where(open_below, piv_b, piv))
    return tl.minimum(tl.maximum(piv, lo + 1), hi - 1)


@triton.jit
def _pivot_pass(row_ptr, list_ptr, n_listed, lo, hi, row_max, k, scale, vocab_size, PIVOTS: tl.constexpr,
                TILE: tl.constexpr, CHUNK: tl.constexpr):
    """The pivots of the bracket [lo, hi) (``_pivots``) and, for each, the count and the mass
    exp2((l - row_max) k) of the bracket's tokens at or above it; also the bracket's count.
    Pipelined as ``_gather``. The [TILE * CHUNK, PIVOTS] comparisons accumulate element-wise
    across tiles and are reduced once at the end, in registers (reducing each tile costs two
    cross-warp round trips and barriers per tile, which makes a pass over a whole row -- top-p
    alone on a flat row -- latency-bound; DECISIONS.md, "filter-pivot-accumulate")."""
    piv = _pivots(lo, hi, scale, PIVOTS)
    acc_cnt = tl.zeros([TILE * CHUNK, PIVOTS], tl.int32)
    acc_mass = tl.zeros([TILE * CHUNK, PIVOTS], tl.float32)
    acc_in = tl.zeros([TILE * CHUNK], tl.int32)
    chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, 0, TILE)
    raw_nxt, offs_nxt, ok_nxt = _load_listed(row_ptr, chunk_nxt, listed_nxt, vocab_size, CHUNK)
    chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, TILE, TILE)
    for start in range(0, n_listed, TILE):
        raw, ok = raw_nxt, ok_nxt
        raw_nxt, offs_nxt, ok_nxt = _load_listed(row_ptr, chunk_nxt, listed_nxt, vocab_size, CHUNK)
        chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, start + 2 * TILE, TILE)
        lg = tl.reshape(sanitize(raw.to(tl.float32)), [TILE * CHUNK])
        key = _key(lg)
        inside = tl.reshape(ok, [TILE * CHUNK]) & (key >= lo) & (key < hi)
        e = tl.where(inside, tl.exp2((lg - row_max) * k), 0.0)
        above = inside[:, None] & (key[:, None] >= piv[None, :])
        acc_cnt += above.to(tl.int32)
        acc_mass += tl.where(above, e[:, None], 0.0)
        acc_in += inside.to(tl.int32)
    cnt = tl.sum(acc_cnt, 0)
    mass = tl.sum(acc_mass, 0)
    return piv, cnt, mass, tl.sum(acc_in, 0)


@triton.jit
def _search(row_ptr, m_c, in_table, list_ptr, idx_ptr, buf_ptr, vocab_size, row_max, k, scale,
            by_mass, goal_count, goal_mass, lo, hi,
            CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr, TILE: tl.constexpr,
            PIVOT_TILE: tl.constexpr, PIVOTS: tl.constexpr):
    """Narrow [lo, hi) around the answer -- the largest key v with f(v): count(key >= v) >=
    goal_count, or (by_mass) mass(key >= v) >= goal_mass -- given f(lo) (a lower bound; if it
    is not, the answer is taken to be lo) and nothing to count at or above hi.

    Returns (lo, hi, n_above, mass_above, n_b): n_above / mass_above count the tokens with key
    >= hi; n_b the tokens in [lo, hi), which are in the buffer (values and indices, in index
    order) when n_b <= CAP (else the bracket holds a single key, lo, which is then the answer).
    """
    n_above = tl.zeros([], tl.int32)
    mass_above = tl.zeros([], tl.float32)
    n_listed = _qualify(m_c, in_table, lo, list_ptr)
    # Each listed chunk's max is in the bracket: more than CAP of them cannot fit.
    n_b = n_listed
    if n_listed <= CAP:
        n_b = _gather(row_ptr, list_ptr, n_listed, lo, hi, buf_ptr, idx_ptr, vocab_size, CAP, TILE, CHUNK)
    passes = tl.zeros([], tl.int32)
    i = tl.arange(0, PIVOTS)
    while (n_b > CAP) & (hi.to(tl.int64) - lo.to(tl.int64) > 1):
        n_listed = _qualify(m_c, in_table, lo, list_ptr)
        piv, cnt, mass, n_in = _pivot_pass(row_ptr, list_ptr, n_listed, lo, hi, row_max, k, scale, vocab_size,
                                           PIVOTS, PIVOT_TILE, CHUNK)
        holds = tl.where(by_mass, mass_above + mass >= goal_mass, n_above + cnt >= goal_count)
        n_true = tl.max(tl.where(holds, i + 1, 0), 0)  # the answer is in [piv[n_true-1], piv[n_true])
        n_from = tl.where(n_true > 0, _at(cnt, i, n_true - 1), n_in)
        n_up = tl.where(n_true < PIVOTS, _at(cnt, i, n_true), 0)
        mass_up = tl.where(n_true < PIVOTS, _at(mass, i, n_true), 0.0)
        new_lo = tl.where(n_true > 0, _at(piv, i, n_true - 1), lo)
        hi = tl.where(n_true < PIVOTS, _at(piv, i, n_true), hi)
        lo = new_lo
        n_b = n_from - n_up
        n_above += n_up
        mass_above += mass_up
        passes += 1
    if ((passes > 0) | (n_listed > CAP)) & (n_b <= CAP):
        n_listed = _qualify(m_c, in_table, lo, list_ptr)
        _gather(row_ptr, list_ptr, n_listed, lo, hi, buf_ptr, idx_ptr, vocab_size, CAP, TILE, CHUNK)
    return lo, hi, n_above, mass_above, n_b


@triton.jit
def _sorted_buffer(buf_ptr, n_b, row_max, k, CAP: tl.constexpr):
    """The buffer's n_b logits sorted descending (-inf padded) and their exp2((l - row_max) k)."""
    idx = tl.arange(0, CAP)
    valid = idx < n_b
    s = tl.sort(tl.load(buf_ptr + idx, mask=valid, other=float("-inf")), descending=True)
    e = tl.where(valid, tl.exp2((s - row_max) * k), 0.0)
    return s, e


@triton.jit
def _read_off(s, e, n_b, lo, n_above, mass_above, by_mass, goal_count, goal_mass, CAP: tl.constexpr):
    """The answer's key from the sorted bracket: the (goal_count - n_above)-th value, or the
    first whose cumulative mass (from mass_above) reaches goal_mass; lo if none."""
    idx = tl.arange(0, CAP)
    valid = idx < n_b
    cum = mass_above + tl.cumsum(e, 0)
    j_mass = tl.min(tl.where(valid & (cum >= goal_mass), idx, CAP), 0)
    j = tl.where(by_mass, j_mass, goal_count - n_above - 1)
    found = (j >= 0) & (j < n_b)
    return tl.where(found, _key(_at(s, idx, j)), lo)


@triton.jit
def _chunk_bound(m_c, in_table, row_max, k, by_mass, goal_count, goal_mass, PIVOTS: tl.constexpr):
    """A lower bound (key) on the answer from the chunk maxima alone: each is a distinct token,
    so a v with count(m_c >= v) >= goal_count (or mass of those maxima >= goal_mass) has
    f(v). Two rounds of PIVOTS values between the smallest finite chunk max and the row max
    find the largest such v on a grid; KEY_NEG_INF if not even the smallest one qualifies."""
    finite = in_table & (m_c > float("-inf"))
    lo = tl.min(tl.where(finite, m_c, float("inf")), 0)
    hi = row_max
    e = tl.where(finite, tl.exp2((m_c - row_max) * k), 0.0)
    i = tl.arange(0, PIVOTS)
    frac = i.to(tl.float32) / PIVOTS
    valid = lo <= hi
    for r in tl.static_range(2):
        piv = tl.where(i == 0, lo, lo + (hi - lo) * frac)
        cnt, mass = _count_above(_key(m_c), e, finite, _key(piv), PIVOTS)
        holds = tl.where(by_mass, mass >= goal_mass, cnt >= goal_count)
        n_true = tl.max(tl.where(holds, i + 1, 0), 0)
        if r == 0:
            valid = valid & (n_true > 0)
        new_lo = tl.where(n_true > 0, _at(piv, i, n_true - 1), lo)
        hi = tl.where(n_true < PIVOTS, _at(piv, i, n_true), hi)
        lo = new_lo
    return tl.where(valid, _key(lo), KEY_NEG_INF)


@triton.jit
def _resolve_top_k(buf_ptr, n_b, lo, n_above, mass_above, top_k, top_p, p_on, row_max, k, S: tl.constexpr):
    """From the sorted bracket of the top-k search: t_k, Z_k (the mass top-k keeps) and, when
    the same bracket holds the top-p answer (the mass above it is short of p Z_k), t_p."""
    s, e = _sorted_buffer(buf_ptr, n_b, row_max, k, S)
    t_k = _read_off(s, e, n_b, lo, n_above, mass_above, False, top_k, 0.0, S)
    z_k = mass_above + tl.sum(tl.where(_key(s) >= t_k, e, 0.0), 0)
    target = top_p * z_k
    p_here = p_on & (mass_above < target)
    t_p = tl.full([], KEY_NEG_INF, tl.int32)
    if p_here:
        t_p = _read_off(s, e, n_b, lo, n_above, mass_above, True, 0, target, S)
    return t_k, z_k, t_p, p_here


@triton.jit
def _resolve_top_p(buf_ptr, n_b, lo, n_above, mass_above, target, row_max, k, S: tl.constexpr):
    s, e = _sorted_buffer(buf_ptr, n_b, row_max, k, S)
    return _read_off(s, e, n_b, lo, n_above, mass_above, True, 0, target, S)


@triton.jit
def _fine_bracket(row_ptr, submax_row, m_c, in_table, list_ptr, sub_list_ptr, idx_ptr, buf_ptr, vocab_size,
                  num_subs, row_max, k, top_k, lo0, top, CAP: tl.constexpr, PIVOTS: tl.constexpr,
                  SUB: tl.constexpr, SUBS_PER_CHUNK: tl.constexpr, FINE_CHUNKS: tl.constexpr,
                  FINE_SUBS: tl.constexpr):
    """top-k's bracket [lo, top) from the SUB-logit maxima, gathered into the buffer in one tile:
    (lo, n_b, ok); ok = False when it does not apply (more than FINE_CHUNKS chunks at or above
    lo0, more than FINE_SUBS sub-chunks at or above lo, or more than CAP tokens), and the caller
    falls back to ``_search``.

    The chunks whose max is >= lo0 are listed; their sub-chunk maxima (distinct tokens, like the
    chunk maxima) give a tighter bound lo >= lo0 with count(l >= lo) >= top_k; every token at or
    above lo lies in a listed sub-chunk whose max is >= lo, and those are gathered."""
    n_listed = _qualify(m_c, in_table, lo0, list_ptr)
    lo = lo0
    n_b = tl.full([], CAP + 1, tl.int32)
    ok = n_listed < 0
    if n_listed <= FINE_CHUNKS:
        j = tl.arange(0, FINE_CHUNKS)
        chunk = tl.load(list_ptr + j, mask=j < n_listed, other=0)
        sid = chunk[:, None] * SUBS_PER_CHUNK + tl.arange(0, SUBS_PER_CHUNK)[None, :]
        live = (j[:, None] < n_listed) & (sid < num_subs)
        sv = tl.load(submax_row + sid, mask=live, other=float("-inf"), cache_modifier=".cg")
        sid = tl.reshape(sid, [FINE_CHUNKS * SUBS_PER_CHUNK])
        sv = tl.reshape(sv, [FINE_CHUNKS * SUBS_PER_CHUNK])
        live = tl.reshape(live, [FINE_CHUNKS * SUBS_PER_CHUNK])
        lo = tl.maximum(lo0, _chunk_bound(sv, live, row_max, k, False, top_k, 0.0, PIVOTS))
        n_sub = _list_at_or_above(sv, live, lo, sid, sub_list_ptr)
        if n_sub <= FINE_SUBS:
            n_b = _gather(row_ptr, sub_list_ptr, n_sub, lo, top, buf_ptr, idx_ptr, vocab_size, CAP, FINE_SUBS, SUB)
            ok = n_b <= CAP
    return lo, n_b, ok


@triton.jit
def _bracket_indices(scratch_ptr, CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                     FINE_CHUNKS: tl.constexpr):
    """Where a row's scratch keeps the bracket's vocabulary indices (after its chunk list and
    the fine path's sub-chunk list; ``filter_scratch_stride``)."""
    return scratch_ptr + CHUNKS_PAD + FINE_CHUNKS * (CHUNK // SUB)


@triton.jit
def _row_threshold(row_ptr, cmax_row, submax_row, scratch_ptr, buf_ptr, row_max, row_sum, k, top_k, top_p,
                   min_p, vocab_size, num_chunks, num_subs, CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr,
                   CAP: tl.constexpr, TILE: tl.constexpr, PIVOT_TILE: tl.constexpr, PIVOTS: tl.constexpr,
                   SUB: tl.constexpr, FINE_CHUNKS: tl.constexpr, FINE_SUBS: tl.constexpr):
    """The threshold logit t of one row of a filtered request: the row keeps exactly l >= t.

    row_max / row_sum: the row's max and its sum of exp2((l - max) k) (only read for top-p
    without top-k; the kernel computes it only then);
    cmax_row / submax_row: its maxima per CHUNK and per SUB logits; top_k (int32, clamped to
    [-1, V]), top_p, min_p: the request's filters. -inf for a row without a valid logit.
    Brackets of up to SMALL tokens are sorted at that size. scratch_ptr: this row's int32
    scratch (``filter_scratch_stride``: the chunk list, the sub-chunk list, then the bracket's
    vocabulary indices); buf_ptr: its CAP float32 entries (the bracket's values).

    Returns (t, kept_n): kept_n >= 0 when the buffer holds the row's whole kept set (every token
    >= t, and kept_n entries in all, in index order: some may lie below t), else -1.
    """
    SMALL: tl.constexpr = 64 if CAP > 64 else CAP
    list_ptr = scratch_ptr
    sub_list_ptr = scratch_ptr + CHUNKS_PAD
    idx_ptr = _bracket_indices(scratch_ptr, CHUNKS_PAD, CHUNK, SUB, FINE_CHUNKS)
    t_key = tl.full([], KEY_NEG_INF, tl.int32)
    # The buffer's state: it holds every token with key >= buf_lo (buf_n of them) or buf_n = -1.
    buf_n = tl.full([], -1, tl.int32)
    buf_lo = tl.full([], KEY_NEG_INF, tl.int32)
    if row_max > float("-inf"):
        k_on = (top_k > 0) & (top_k < vocab_size)
        p_on = top_p < 1.0
        mp = tl.minimum(min_p, 1.0)
        top = _key(row_max) + 1  # nothing at or above
        t_mp = tl.full([], KEY_NEG_INF, tl.int32)
        if mp > 0.0:
            t_mp = _min_p_key(row_max, k, tl.log2(mp))
        c = tl.arange(0, CHUNKS_PAD)
        in_table = c < num_chunks
        m_c = tl.load(cmax_row + c, mask=in_table, other=float("-inf"), cache_modifier=".cg")
        # A typical spread of the row's logits, for pivots below an open bracket.
        scale = tl.maximum(row_max - tl.min(tl.where(in_table & (m_c > float("-inf")), m_c, row_max), 0), 1.0)
        # top-k: the k-th largest logit; Z_k the mass of what it keeps.
        t_k = tl.full([], KEY_NEG_INF, tl.int32)
        t_p = tl.full([], KEY_NEG_INF, tl.int32)
        z_k = row_sum
        p_done = p_on == 0
        hi = top
        mass_above = tl.zeros([], tl.float32)
        if k_on:
            lo0 = _chunk_bound(m_c, in_table, row_max, k, False, top_k, 0.0, PIVOTS)
            if not p_on:
                lo0 = tl.maximum(lo0, t_mp)  # below t_mp the exact k-th value does not matter
            # Small k: the bracket from the 32-logit maxima, gathered in one tile (most rows);
            # else (or if it does not fit) the chunk-level search.
            fine_ok = top_k < 0
            lo = lo0
            n_b = tl.zeros([], tl.int32)
            if top_k <= FINE_CHUNKS:
                lo, n_b, fine_ok = _fine_bracket(
                    row_ptr, submax_row, m_c, in_table, list_ptr, sub_list_ptr, idx_ptr, buf_ptr, vocab_size,
                    num_subs, row_max, k, top_k, lo0, top, CAP, PIVOTS, SUB, CHUNK // SUB, FINE_CHUNKS, FINE_SUBS)
            if fine_ok:
                hi = top
                n_above = tl.zeros([], tl.int32)
                mass_above = tl.zeros([], tl.float32)
            else:
                lo, hi, n_above, mass_above, n_b = _search(
                    row_ptr, m_c, in_table, list_ptr, idx_ptr, buf_ptr, vocab_size, row_max, k, scale,
                    False, top_k, 0.0, lo, top, CHUNKS_PAD, CHUNK, CAP, TILE, PIVOT_TILE, PIVOTS)
            if n_b <= SMALL:
                t_k, z_k, t_p, p_here = _resolve_top_k(buf_ptr, n_b, lo, n_above, mass_above, top_k, top_p,
                                                       p_on, row_max, k, SMALL)
                p_done = p_done | p_here
            elif n_b <= CAP:
                t_k, z_k, t_p, p_here = _resolve_top_k(buf_ptr, n_b, lo, n_above, mass_above, top_k, top_p,
                                                       p_on, row_max, k, CAP)
                p_done = p_done | p_here
            else:
                t_k = lo  # the bracket holds one value
                z_k = mass_above + n_b.to(tl.float32) * tl.exp2((_unkey(lo) - row_max) * k)
            buf_n = tl.where((hi == top) & (n_b <= CAP), n_b, -1)
            buf_lo = lo
        # top-p over what top-k kept: the largest value whose mass at or above reaches p Z_k.
        if p_done == 0:
            target = top_p * z_k
            # Tokens below v0 = M + (log2((1 - p) Z_k / (2 V))) / k hold less than (1 - p) Z_k / 2
            # (at most V of them, each below exp2((v0 - M) k)): the answer is >= v0.
            v0 = row_max + tl.log2((1.0 - top_p) * z_k / (2.0 * vocab_size)) / k
            lo1 = tl.minimum(_key(v0), top - 1)
            lo1 = tl.maximum(tl.maximum(tl.maximum(t_k, t_mp), lo1),
                             _chunk_bound(m_c, in_table, row_max, k, True, 0, target, PIVOTS))
            if k_on & (mass_above >= target):
                lo1 = tl.maximum(lo1, hi)  # the answer lies above the top-k bracket
            lo1 = tl.minimum(lo1, top - 1)  # the max always qualifies (p <= 0 keeps it alone)
            lo, hi, n_above, mass_above, n_b = _search(
                row_ptr, m_c, in_table, list_ptr, idx_ptr, buf_ptr, vocab_size, row_max, k, scale,
                True, 0, target, lo1, top, CHUNKS_PAD, CHUNK, CAP, TILE, PIVOT_TILE, PIVOTS)
            if n_b <= SMALL:
                t_p = _resolve_top_p(buf_ptr, n_b, lo, n_above, mass_above, target, row_max, k, SMALL)
            elif n_b <= CAP:
                t_p = _resolve_top_p(buf_ptr, n_b, lo, n_above, mass_above, target, row_max, k, CAP)
            else:
                t_p = lo
            buf_n = tl.where((hi == top) & (n_b <= CAP), n_b, -1)
            buf_lo = lo
        # Every filter keeps the row's max; the clamp only guards against float surprises.
        t_key = tl.minimum(tl.maximum(tl.maximum(t_k, t_p), t_mp), top - 1)
    return _unkey(t_key), tl.where(t_key >= buf_lo, buf_n, -1)


@triton.jit
def _segment_add(w_a, c_a, w_b, c_b):
    """Combine of a segmented sum (segments = runs of equal ids, as in an index-ordered list)."""
    return tl.where(c_a == c_b, w_a + w_b, w_b), c_b


@triton.jit
def _kept_set_table(buf_ptr, idx_ptr, n_b, thr, cmax_row, kept_w_row, row_max, k, excluded, num_chunks,
                    S: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """What the verification kernel's stream would give for a row whose whole kept set is in the
    buffer (n_b entries, index order): the chunk table -- per chunk the total of
    exp2((l - m_c) k) over its kept tokens but ``excluded`` (m_c = the chunk's max, cmax_row; 0
    for chunks without a kept token) -- written to kept_w_row, and the row's sum of
    exp2((l - row_max) k) over the kept tokens (returned)."""
    i = tl.arange(0, S)
    valid = i < n_b
    lg = tl.load(buf_ptr + i, mask=valid, other=float("-inf"))
    idx = tl.load(idx_ptr + i, mask=valid, other=0)
    idx_next = tl.load(idx_ptr + i + 1, mask=i + 1 < n_b, other=-1)
    kept = valid & (lg >= thr)
    chunk = idx // CHUNK
    m_c = tl.load(cmax_row + chunk, mask=kept, other=0.0)
    w = tl.where(kept & (idx != excluded), tl.exp2((lg - m_c) * k), 0.0)
    total, _ = tl.associative_scan((w, chunk), 0, _segment_add)
    # A chunk's total sits at its last buffer entry; chunks whose max is below thr hold nothing
    # kept (both stores may write 0 to a chunk of only unkept buffer entries).
    last = valid & ((idx_next < 0) | (idx_next // CHUNK != chunk))
    tl.store(kept_w_row + chunk, total, mask=last)
    c = tl.arange(0, CHUNKS_PAD)
    cmax = tl.load(cmax_row + c, mask=c < num_chunks, other=float("inf"))
    tl.store(kept_w_row + c, tl.zeros([CHUNKS_PAD], tl.float32), mask=(c < num_chunks) & (cmax < thr))
    return tl.sum(tl.where(kept, tl.exp2((lg - row_max) * k), 0.0), 0)


# --------------------------------------------------------------------------- threshold pass

FILTER_PIVOTS = 16
# The finer maxima of the stats stream (every FILTER_SUB logits) and the fine top-k path's sizes:
# up to FILTER_FINE_CHUNKS listed chunks (also its largest k), FILTER_FINE_SUBS gathered sub-chunks.
FILTER_SUB = 32
FILTER_FINE_CHUNKS = 64
FILTER_FINE_SUBS = 64
FILTER_SUM_BLOCK = 4096  # logits per step of the search program's row sum (top-p without top-k)


@triton.jit
def _request_filters(b, greedy, vocab_size, top_k_ptr, top_p_ptr, min_p_ptr, HAS_TOP_K: tl.constexpr,
                     HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """Request b's (top_k clamped to [-1, V], top_p, min_p, filtered): only random requests with
    a filter on are filtered (greedy ones ignore the filters)."""
    top_k = tl.zeros([], tl.int32)
    top_p = tl.full([], 1.0, tl.float32)
    min_p = tl.zeros([], tl.float32)
    if HAS_TOP_K:
        top_k = tl.minimum(tl.maximum(tl.load(top_k_ptr + b).to(tl.int64), -1), vocab_size).to(tl.int32)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + b).to(tl.float32)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + b).to(tl.float32)
    filtered = (not greedy) & (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0) | (min_p > 0.0))
    return top_k, top_p, min_p, filtered


@triton.jit
def _slot_row(cu_ptr, slot, temperature_ptr, num_requests, num_rows, max_rows, TREE: tl.constexpr,
              HAS_TEMPERATURE: tl.constexpr, CU_BLOCK: tl.constexpr):
    """The target row of a threshold slot as the verification kernel maps it: (request b, row,
    valid, k = log2(e) / T, greedy, draft): chain: slot = b * (max_spec_len + 1) + t,
    row = cu[b] + b + t for t <= n (max_rows = max_spec_len + 1), draft = the index cu[b] + t of
    the draft row t tests (-1 for the bonus row t = n); tree: slot = node row, b its owner under
    the sanitized offsets, draft = -1."""
    LOG2E: tl.constexpr = 1.4426950408889634
    if TREE:
        row = slot.to(tl.int64)
        b = owner_request(cu_ptr, row, num_requests, CU_BLOCK)
        cu_lo = sanitized_cu(cu_ptr, b, num_requests, num_rows, CU_BLOCK)
        n = sanitized_cu(cu_ptr, b + 1, num_requests, num_rows, CU_BLOCK) - cu_lo
        valid = (b < num_requests) & (row >= cu_lo) & (row < cu_lo + n)
        draft = tl.full([], -1, tl.int64)
    else:
        b = slot // max_rows
        t = slot % max_rows
        cu_lo = tl.load(cu_ptr + b).to(tl.int64)
        n = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1).to(tl.int64) - cu_lo, 0), max_rows - 1)
        row = cu_lo + b + t
        valid = (t <= n) & (row >= 0) & (row < num_rows)
        draft = tl.where(t < n, cu_lo + t, -1)
    if HAS_TEMPERATURE:
        temp = tl.load(temperature_ptr + b, mask=b < num_requests, other=1.0).to(tl.float32)
    else:
        temp = tl.full([], 1.0, tl.float32)
    greedy = not (temp > 0.0)
    return b, row, valid, tl.where(greedy, LOG2E, LOG2E / temp), greedy, draft


@triton.jit
def _filter_stats_kernel(
    logits_ptr, logits_row_stride, cu_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    rec_m_ptr, cmax_ptr, submax_ptr,
    num_requests, num_rows, vocab_size, max_rows, num_splits, groups_per_split, num_groups, num_chunks, num_subs,
    TREE: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr, CU_BLOCK: tl.constexpr,
):
    """Threshold pass, step 1: one program per (slot, split) of a filtered row streams its split
    once and writes the max of every chunk (cmax) and of every SUB logits (submax), per slot,
    and the split's max. Maxima only: the search needs the row's sum only for top-p without
    top-k, and computes it then (a lighter stream for everything else). Unfiltered slots do
    nothing."""
    unit = tl.program_id(0)
    slot = unit // num_splits
    s_idx = unit % num_splits
    b, row, valid, k, greedy, _draft = _slot_row(cu_ptr, slot, temperature_ptr, num_requests, num_rows, max_rows,
                                                 TREE, HAS_TEMPERATURE, CU_BLOCK)
    filtered = tl.zeros([], tl.int1)
    if valid:
        _, _, _, filtered = _request_filters(b, greedy, vocab_size, top_k_ptr, top_p_ptr, min_p_ptr,
                                             HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
    if filtered:
        row_ptr = logits_ptr + row * logits_row_stride
        cmax_row = cmax_ptr + slot.to(tl.int64) * num_chunks
        submax_row = submax_ptr + slot.to(tl.int64) * num_subs
        # A tile is GROUP chunks seen as [GROUP * CHUNK / SUB, SUB]: one sub-chunk per tile row.
        SUBS: tl.constexpr = GROUP * CHUNK // SUB
        sub_in_group = tl.arange(0, SUBS)
        tile_lane = sub_in_group[:, None] * SUB + tl.arange(0, SUB)[None, :]
        g_lo = s_idx * groups_per_split
        g_hi = tl.minimum(g_lo + groups_per_split, num_groups)
        m_vec = tl.full([SUBS], float("-inf"), tl.float32)
        offs = g_lo * (GROUP * CHUNK) + tile_lane
        raw_next = tl.load(row_ptr + offs, mask=(offs < vocab_size) & (g_lo < g_hi), other=float("-inf"))
        for grp in range(g_lo, g_hi):
            raw = raw_next
            offs = (grp + 1) * (GROUP * CHUNK) + tile_lane
            raw_next = tl.load(row_ptr + offs, mask=(offs < vocab_size) & (grp + 1 < g_hi), other=float("-inf"))
            lg = sanitize(raw.to(tl.float32))
            m_s = tl.max(lg, 1)
            subs = grp * SUBS + sub_in_group
            tl.store(submax_row + subs, m_s, mask=subs < num_subs)
            chunks = grp * GROUP + tl.arange(0, GROUP)
            tl.store(cmax_row + chunks, tl.max(tl.reshape(m_s, [GROUP, CHUNK // SUB]), 1), mask=chunks < num_chunks)
            m_vec = tl.maximum(m_vec, m_s)
        tl.store(rec_m_ptr + unit, tl.max(m_vec, 0))


@triton.jit
def _row_sum(row_ptr, vocab_size, row_max, k, BLOCK: tl.constexpr):
    """sum of exp2((l - row_max) k) over a row (sanitized logits), BLOCK logits per step, the
    next block loaded before this one is summed."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    raw_next = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf"))
    for start in range(0, vocab_size, BLOCK):
        raw = raw_next
        nxt = start + BLOCK + offs
        raw_next = tl.load(row_ptr + nxt, mask=nxt < vocab_size, other=float("-inf"))
        acc += tl.exp2((sanitize(raw.to(tl.float32)) - row_max) * k)
    return tl.sum(acc, 0)


@triton.jit
def _filter_threshold_kernel(
    logits_ptr, logits_row_stride, cu_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    rec_m_ptr, cmax_ptr, submax_ptr, thr_ptr, scratch_ptr, buf_ptr, kept_w_ptr, kept_m_ptr, kept_z_ptr,
    draft_ids_ptr, num_drafts,
    num_requests, num_rows, vocab_size, max_rows, num_splits, num_chunks, num_subs, scratch_stride,
    TREE: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr,
    CU_BLOCK: tl.constexpr, CAP: tl.constexpr, TILE: tl.constexpr, PIVOT_TILE: tl.constexpr,
    PIVOTS: tl.constexpr, SUB: tl.constexpr, FINE_CHUNKS: tl.constexpr,
    FINE_SUBS: tl.constexpr, SUM_BLOCK: tl.constexpr, KEPT_SET: tl.constexpr, EXCLUDE_DRAFT: tl.constexpr,
):
    """Threshold pass, step 2: one program per slot writes thr[slot], the row's threshold logit
    (``_row_threshold``) for a filtered row and -inf for every other slot. KEPT_SET: when the
    search's buffer holds the row's whole kept set, also what verification needs of the row --
    its max (kept_m), its kept sum (kept_z > 0) and its chunk table (kept_w; the chunk maxima
    are cmax) -- so the verification kernel need not stream it; kept_z = 0 for every other slot.
    EXCLUDE_DRAFT (chain without draft probabilities): the table leaves out row t's draft token
    for t < n, as the chain kernel's stream does."""
    slot = tl.program_id(0)
    b, row, valid, k, greedy, draft = _slot_row(cu_ptr, slot, temperature_ptr, num_requests, num_rows, max_rows,
                                                TREE, HAS_TEMPERATURE, CU_BLOCK)
    thr = tl.full([], float("-inf"), tl.float32)
    kept_z = tl.zeros([], tl.float32)
    if valid:
        top_k, top_p, min_p, filtered = _request_filters(b, greedy, vocab_size, top_k_ptr, top_p_ptr, min_p_ptr,
                                                         HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
        if filtered:
            s = tl.arange(0, SPLITS_PAD)
            m = tl.load(rec_m_ptr + slot.to(tl.int64) * num_splits + s, mask=s < num_splits, other=float("-inf"),
                        cache_modifier=".cg")
            row_max = tl.max(m, 0)
            row_ptr = logits_ptr + row * logits_row_stride
            # Only top-p without top-k needs the row's sum (Z_k = Z): one more pass, in this program.
            row_sum = tl.zeros([], tl.float32)
            if (top_p < 1.0) & ((top_k <= 0) | (top_k >= vocab_size)) & (row_max > float("-inf")):
                row_sum = _row_sum(row_ptr, vocab_size, row_max, k, SUM_BLOCK)
            cmax_row = cmax_ptr + slot.to(tl.int64) * num_chunks
            scratch_row = scratch_ptr + slot.to(tl.int64) * scratch_stride
            buf_row = buf_ptr + slot.to(tl.int64) * CAP
            thr, kept_n = _row_threshold(
                row_ptr, cmax_row, submax_ptr + slot.to(tl.int64) * num_subs, scratch_row, buf_row, row_max,
                row_sum, k, top_k, top_p, min_p, vocab_size, num_chunks, num_subs, CHUNKS_PAD, CHUNK, CAP, TILE,
                PIVOT_TILE, PIVOTS, SUB, FINE_CHUNKS, FINE_SUBS)
            if KEPT_SET:
                if kept_n >= 0:
                    excluded = tl.full([], -1, tl.int32)
                    if EXCLUDE_DRAFT:
                        if (draft >= 0) & (draft < num_drafts):
                            excluded = token_in_vocab(tl.load(draft_ids_ptr + draft), vocab_size)
                    idx_row = _bracket_indices(scratch_row, CHUNKS_PAD, CHUNK, SUB, FINE_CHUNKS)
                    kept_w_row = kept_w_ptr + slot.to(tl.int64) * num_chunks
                    SMALL: tl.constexpr = 64 if CAP > 64 else CAP
                    if kept_n <= SMALL:
                        kept_z = _kept_set_table(buf_row, idx_row, kept_n, thr, cmax_row, kept_w_row, row_max, k,
                                                 excluded, num_chunks, SMALL, CHUNK, CHUNKS_PAD)
                    else:
                        kept_z = _kept_set_table(buf_row, idx_row, kept_n, thr, cmax_row, kept_w_row, row_max, k,
                                                 excluded, num_chunks, CAP, CHUNK, CHUNKS_PAD)
                    tl.store(kept_m_ptr + slot, row_max)
    tl.store(thr_ptr + slot, thr)
    tl.store(kept_z_ptr + slot, kept_z)


def filter_scratch_stride(chunks_pad: int, cap: int) -> int:
    """int32 scratch entries per row of the search: the chunk list (chunks_pad), the fine path's
    sub-chunk list, the bracket's vocabulary indices (``cap``)."""
    return chunks_pad + FILTER_FINE_CHUNKS * (SAMPLE_CHUNK // FILTER_SUB) + cap


def threshold_workspace_sizes(slots: int, num_groups: int, num_chunks: int,
                              config: _config.FilterConfig | None = None) -> tuple[int, int]:
    """(float32 entries, int32 entries) of the threshold pass for ``slots`` rows of
    ``num_groups`` tiles: per slot its split maxima (at most one split per tile), its chunk and
    sub-chunk maxima, its threshold, its kept-set chunk table, max and sum, and the cap-entry
    bracket buffer (float32); its search scratch (int32, ``filter_scratch_stride``)."""
    cap = (config or _config.active()[1]).cap
    chunks_pad = triton.next_power_of_2(max(num_chunks, 1))
    num_subs = num_chunks * (SAMPLE_CHUNK // FILTER_SUB)
    return (slots * (num_groups + 2 * num_chunks + num_subs + 3 + cap),
            slots * filter_scratch_stride(chunks_pad, cap))


class RowThresholds(NamedTuple):
    """What the threshold pass gives the verification kernels (views of its workspace):
    thr [slots] (-inf: unfiltered), cmax [slots * num_chunks] (chunk maxima), and for the rows
    whose whole kept set the search held: kept_z [slots] (their kept sum; 0 for every other
    row), kept_m [slots] (their max), kept_w [slots * num_chunks] (their chunk table)."""
    thr: torch.Tensor
    cmax: torch.Tensor
    kept_w: torch.Tensor
    kept_m: torch.Tensor
    kept_z: torch.Tensor


def _stats_split(cfg: _config.FilterConfig, slots: int, num_chunks: int, num_splits: int, max_splits: int,
                 device) -> tuple[int, int, int]:
    """(chunks per tile, splits, tiles per split) of the stats stream: ``cfg.stats_group`` chunks
    per tile, over the verification kernel's number of splits or ``cfg.stats_programs_per_sm``
    programs per SM (2 "SMs" off the GPU); at most max_splits (the split maxima's workspace)."""
    group = cfg.stats_group
    num_groups = triton.cdiv(num_chunks, group)
    if cfg.stats_programs_per_sm > 0:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        num_splits = triton.cdiv(cfg.stats_programs_per_sm * sms, max(slots, 1))
    splits = max(1, min(num_splits, num_groups, max_splits))
    per_split = triton.cdiv(num_groups, splits)
    return group, triton.cdiv(num_groups, per_split), per_split


def launch_row_thresholds(f32: torch.Tensor, i32: torch.Tensor, target_logits: torch.Tensor,
                          cu: torch.Tensor, temperature, top_k, top_p, min_p, *, tree: bool, num_requests: int,
                          slots: int, max_rows: int, num_splits: int, num_groups: int, num_warps: int,
                          cu_block: int = CU_BLOCK, excluded_drafts: torch.Tensor | None = None,
                          config: _config.FilterConfig | None = None) -> RowThresholds:
    """Run the threshold pass (two launches, no host sync) over ``slots`` target rows (the stats
    stream splits each row in ``num_splits``, the verification kernel's count, unless
    ``config.stats_programs_per_sm`` says otherwise; ``num_groups``, the verification kernel's tiles
    per row, bounds it) and return its ``RowThresholds`` (views of the workspace ``f32``, sized
    by ``threshold_workspace_sizes``). The verification kernel then treats every logit below its
    row's threshold as -inf and skips the chunks whose max is below it, or, for a row whose whole
    kept set the search held (kept_z > 0), does not read the row at all. excluded_drafts (chain
    without draft probabilities): the draft token ids, left out of row t's kept-set chunk table
    for t < n. ``config``: launch parameters (None = ``config.active()``)."""
    cfg = config or _config.active()[1]
    R, V = target_logits.shape
    num_chunks = triton.cdiv(max(V, 1), SAMPLE_CHUNK)
    num_subs = num_chunks * (SAMPLE_CHUNK // FILTER_SUB)
    chunks_pad = triton.next_power_of_2(num_chunks)
    # (rec_m holds num_groups split maxima per slot)
    stats_group, stats_splits, stats_tiles_per_split = _stats_split(cfg, slots, num_chunks, num_splits, num_groups,
                                                                    target_logits.device)
    sizes = [slots * num_groups, slots * num_chunks, slots * num_subs, slots, slots * num_chunks, slots, slots]
    rec_m, cmax, submax, thr, kept_w, kept_m, kept_z = torch.split(f32[:sum(sizes)], sizes)
    buf = f32[sum(sizes):]
    dummy = cu
    common = dict(TREE=tree, HAS_TEMPERATURE=temperature is not None, HAS_TOP_K=top_k is not None,
                  HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None, CHUNK=SAMPLE_CHUNK, CU_BLOCK=cu_block)
    args = (target_logits, target_logits.stride(0), cu, dummy if temperature is None else temperature,
            dummy if top_k is None else top_k, dummy if top_p is None else top_p, dummy if min_p is None else min_p)
    _filter_stats_kernel[(slots * stats_splits,)](
        *args, rec_m, cmax, submax, num_requests, R, V, max_rows, stats_splits, stats_tiles_per_split,
        triton.cdiv(num_chunks, stats_group), num_chunks, num_subs, GROUP=stats_group, SUB=FILTER_SUB,
        num_warps=num_warps, **common)
    extra = {"maxnreg": cfg.maxnreg} if cfg.maxnreg > 0 else {}
    _filter_threshold_kernel[(slots,)](
        *args, rec_m, cmax, submax, thr, i32, buf, kept_w, kept_m, kept_z,
        dummy if excluded_drafts is None else excluded_drafts,
        0 if excluded_drafts is None else excluded_drafts.shape[0], num_requests, R, V, max_rows, stats_splits,
        num_chunks, num_subs, filter_scratch_stride(chunks_pad, cfg.cap),
        SPLITS_PAD=triton.next_power_of_2(stats_splits),
        CHUNKS_PAD=chunks_pad, CAP=cfg.cap,
        TILE=cfg.tile, PIVOT_TILE=cfg.pivot_tile, PIVOTS=FILTER_PIVOTS,
        SUB=FILTER_SUB, FINE_CHUNKS=FILTER_FINE_CHUNKS, FINE_SUBS=FILTER_FINE_SUBS, SUM_BLOCK=FILTER_SUM_BLOCK,
        KEPT_SET=cfg.kept_set, EXCLUDE_DRAFT=excluded_drafts is not None, num_warps=cfg.num_warps,
        **common, **extra)
    return RowThresholds(thr, cmax, kept_w, kept_m, kept_z)
