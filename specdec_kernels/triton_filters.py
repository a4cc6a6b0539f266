"""Top-k / top-p / min-p inside the Triton kernels: a threshold search per row, no sort of the row.

docs/ALGORITHM.md §7 has the semantics and the algorithm; ``sampling_filters`` the sort-based
definition. In short: the filtered distribution of a row is ``q(x) ~ exp2((l(x) - M) k)`` for
the tokens with ``l(x) >= t``, one threshold logit ``t`` per row, so a kernel needs ``t`` and
the kept mass ``Z_t`` -- and, for the chunked sampler, the row's chunk table restricted to
``l >= t``. ``_row_filter`` computes them from what the stream already produced (the row's
max ``M``, its sum ``Z`` and its chunk maxima ``m_c``):

- *min-p* is a closed form: ``t_mp`` = the smallest float ``v`` with ``(v - M) k >= log2(min_p)``
  (a bisection over the float's bit pattern, no memory traffic).
- *top-k* and *top-p* are the largest row value ``v`` with ``count(l >= v) >= k``, resp.
  ``mass(l >= v) >= p * Z_k`` (``Z_k`` = the mass top-k keeps). Both predicates are monotone
  in ``v``, so the answer is found in a bracket ``[lo, hi)`` of order-preserving integer keys
  of the float logits: a lower bound from the chunk maxima (each is a distinct token, so a
  value with k chunk maxima at or above it is <= the k-th largest logit, and one whose chunk
  maxima above it already hold the target mass bounds top-p; two rounds of 16 pivots over
  the chunk maxima in registers find a tight one; top-p also has the closed-form bound
  ``M + log2((1 - p) Z_k / 2V) / k``), then
  * one pass over the chunks whose max is >= lo gathers the bracket's tokens into a buffer of
    ``CAP`` entries; if they fit, the buffer is sorted (64 or ``CAP`` entries, in registers)
    and the answer read off exactly as the sort-based definition does;
  * otherwise passes with ``PIVOTS`` pivots each count the tokens and their mass above every
    pivot, narrowing the bracket ~17x per pass, until it fits (or holds one value, which is
    then the answer).
- ``t = max(t_k, t_p, t_mp)``; one more pass over the chunks whose max is >= t writes the
  restricted chunk totals and ``Z_t``.

Only rows of filtered requests run any of this (the last unit of the row, after the stream);
everything reads L2-resident data: the chunk table and the few chunks above the bound.
"""
from __future__ import annotations

import triton
import triton.language as tl

KEY_NEG_INF = tl.constexpr(-2139095041)  # _key(-inf)


@triton.jit
def _clean(logits):
    """NaN -> -inf, +inf -> FLT_MAX (the kernels' sanitize)."""
    return tl.clamp(logits, float("-inf"), 3.4028234663852886e38)


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
def _qualify(m_c, in_table, lo, list_ptr):
    """Write the ids of the chunks whose max has key >= lo to list_ptr (ascending) and return
    how many: only those can hold a token with key >= lo. (The loops read the list back one
    tile ahead; chunk ids computed in registers per tile cost two cross-warp reductions per
    tile, which measured slower.)"""
    c = tl.arange(0, m_c.shape[0])
    hit = in_table & (_key(m_c) >= lo)
    pos = tl.cumsum(hit.to(tl.int32), 0) - 1
    tl.store(list_ptr + pos, c, mask=hit)
    tl.debug_barrier()
    return tl.sum(hit.to(tl.int32), 0)


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
        lg = tl.reshape(_clean(raw.to(tl.float32)), [TILE * CHUNK])
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
                TILE: tl.constexpr, CHUNK: tl.constexpr, ACCUMULATE: tl.constexpr):
    """The pivots of the bracket [lo, hi) (``_pivots``) and, for each, the count and the mass
    exp2((l - row_max) k) of the bracket's tokens at or above it; also the bracket's count.
    Pipelined as ``_gather``. ACCUMULATE: the [TILE * CHUNK, PIVOTS] comparisons accumulate
    element-wise across tiles and are reduced once at the end (registers); otherwise each tile
    is reduced (two cross-warp round trips and barriers per tile, which makes a pass over a
    whole row -- top-p alone on a flat row -- latency-bound)."""
    piv = _pivots(lo, hi, scale, PIVOTS)
    if ACCUMULATE:
        acc_cnt = tl.zeros([TILE * CHUNK, PIVOTS], tl.int32)
        acc_mass = tl.zeros([TILE * CHUNK, PIVOTS], tl.float32)
    else:
        cnt = tl.zeros([PIVOTS], tl.int32)
        mass = tl.zeros([PIVOTS], tl.float32)
    acc_in = tl.zeros([TILE * CHUNK], tl.int32)
    chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, 0, TILE)
    raw_nxt, offs_nxt, ok_nxt = _load_listed(row_ptr, chunk_nxt, listed_nxt, vocab_size, CHUNK)
    chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, TILE, TILE)
    for start in range(0, n_listed, TILE):
        raw, ok = raw_nxt, ok_nxt
        raw_nxt, offs_nxt, ok_nxt = _load_listed(row_ptr, chunk_nxt, listed_nxt, vocab_size, CHUNK)
        chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, start + 2 * TILE, TILE)
        lg = tl.reshape(_clean(raw.to(tl.float32)), [TILE * CHUNK])
        key = _key(lg)
        inside = tl.reshape(ok, [TILE * CHUNK]) & (key >= lo) & (key < hi)
        e = tl.where(inside, tl.exp2((lg - row_max) * k), 0.0)
        if ACCUMULATE:
            above = inside[:, None] & (key[:, None] >= piv[None, :])
            acc_cnt += above.to(tl.int32)
            acc_mass += tl.where(above, e[:, None], 0.0)
        else:
            c, m = _count_above(key, e, inside, piv, PIVOTS)
            cnt += c
            mass += m
        acc_in += inside.to(tl.int32)
    if ACCUMULATE:
        cnt = tl.sum(acc_cnt, 0)
        mass = tl.sum(acc_mass, 0)
    return piv, cnt, mass, tl.sum(acc_in, 0)


@triton.jit
def _search(row_ptr, m_c, in_table, list_ptr, idx_ptr, buf_ptr, vocab_size, row_max, k, scale,
            by_mass, goal_count, goal_mass, lo, hi,
            CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr, TILE: tl.constexpr,
            PIVOT_TILE: tl.constexpr, PIVOTS: tl.constexpr, PIVOT_ACCUMULATE: tl.constexpr):
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
                                           PIVOTS, PIVOT_TILE, CHUNK, PIVOT_ACCUMULATE)
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
def _rewrite_table(row_ptr, m_c, in_table, table_m_row, table_w_row, list_ptr, vocab_size, t_key, row_max, k,
                   excluded, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """Restrict the row's chunk table to the kept tokens (key >= t_key): W_c = sum over them of
    exp2((l - m_c) k), ``excluded`` left out as in the stream, 0 for chunks with none; returns
    Z_t = sum over the kept tokens of exp2((l - row_max) k) (``excluded`` included). One pass
    over the chunks whose max is kept, pipelined as ``_gather``."""
    c = tl.arange(0, m_c.shape[0])
    hit = in_table & (_key(m_c) >= t_key)
    tl.store(table_w_row + c, tl.zeros_like(m_c), mask=in_table & (hit == 0))
    n_listed = _qualify(m_c, in_table, t_key, list_ptr)
    thr = _unkey(t_key)
    z = tl.zeros([], tl.float32)
    chunk_cur, listed_cur = _list_tile(list_ptr, n_listed, 0, TILE)
    raw_cur, offs_cur, ok_cur = _load_listed(row_ptr, chunk_cur, listed_cur, vocab_size, CHUNK)
    m_cur = tl.load(table_m_row + chunk_cur, mask=listed_cur, other=0.0, cache_modifier=".cg")
    chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, TILE, TILE)
    for start in range(0, n_listed, TILE):
        raw, offs, ok, chunk, listed, m_t = raw_cur, offs_cur, ok_cur, chunk_cur, listed_cur, m_cur
        raw_cur, offs_cur, ok_cur = _load_listed(row_ptr, chunk_nxt, listed_nxt, vocab_size, CHUNK)
        m_cur = tl.load(table_m_row + chunk_nxt, mask=listed_nxt, other=0.0, cache_modifier=".cg")
        chunk_cur, listed_cur = chunk_nxt, listed_nxt
        chunk_nxt, listed_nxt = _list_tile(list_ptr, n_listed, start + 2 * TILE, TILE)
        lg = _clean(raw.to(tl.float32))
        m_safe = tl.where(listed & (m_t > float("-inf")), m_t, 0.0)
        # exp2((l - m_c) k) of the kept tokens, one tile row per chunk.
        kept = ok & (lg >= thr)
        w = tl.where(kept, tl.exp2((lg - m_safe[:, None]) * k), 0.0)
        total = tl.sum(w, 1)
        z += tl.sum(tl.where(total > 0.0, total * tl.exp2((m_safe - row_max) * k), 0.0), 0)
        w_out = tl.sum(tl.where(offs == excluded, 0.0, w), 1)
        tl.store(table_w_row + chunk, w_out, mask=listed)
    return z


@triton.jit
def _segment_sum(va, fa, vb, fb):
    """Combine of a segmented inclusive sum over (value, starts a segment) pairs."""
    return tl.where(fb, vb, va + vb), fa | fb


@triton.jit
def _rewrite_from_buffer(buf_ptr, idx_ptr, n_b, table_m_row, table_w_row, in_table, t_key, row_max, k,
                         excluded, S: tl.constexpr, CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """``_rewrite_table`` when the buffer holds every token with key >= t_key (a complete
    bracket [lo, top) with lo <= t_key): the kept tokens and their chunks come from the buffer,
    in index order, so a segmented sum gives each chunk's total without touching the row."""
    i = tl.arange(0, S)
    valid = i < n_b
    v = tl.load(buf_ptr + i, mask=valid, other=float("-inf"))
    idx = tl.load(idx_ptr + i, mask=valid, other=0)
    kept = valid & (_key(v) >= t_key)
    chunk = idx // CHUNK
    m_k = tl.load(table_m_row + chunk, mask=kept, other=0.0, cache_modifier=".cg")
    c = tl.arange(0, CHUNKS_PAD)
    tl.store(table_w_row + c, tl.zeros([CHUNKS_PAD], tl.float32), mask=in_table)
    w = tl.where(kept & (idx != excluded), tl.exp2((v - m_k) * k), 0.0)
    z = tl.sum(tl.where(kept, tl.exp2((v - row_max) * k), 0.0), 0)
    prev_chunk = tl.load(idx_ptr + i - 1, mask=valid & (i > 0), other=-CHUNK) // CHUNK
    total, _ = tl.associative_scan((w, chunk != prev_chunk), 0, _segment_sum)
    next_chunk = tl.load(idx_ptr + i + 1, mask=i + 1 < n_b, other=-CHUNK) // CHUNK
    # Chunks with a kept token get their total (after the zeros: a CTA barrier orders them).
    has_kept, _ = tl.associative_scan((kept.to(tl.int32), chunk != prev_chunk), 0, _segment_sum)
    tl.debug_barrier()
    tl.store(table_w_row + chunk, total, mask=valid & (next_chunk != chunk) & (has_kept > 0))
    return z


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
def _row_filter(row_ptr, table_m_row, table_w_row, scratch_ptr, buf_ptr, row_max, row_sum, k,
                top_k, top_p, min_p, excluded, vocab_size, num_chunks,
                CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr, TILE: tl.constexpr,
                PIVOT_TILE: tl.constexpr, PIVOTS: tl.constexpr, PIVOT_ACCUMULATE: tl.constexpr):
    """(threshold t, Z_t) of one row of a filtered request, its chunk table restricted to l >= t.

    row_max / row_sum: the row's max and sum of exp2((l - max) k) from the stream; top_k (int32,
    clamped to [-1, V]), top_p, min_p: the request's filters. A row without a valid logit keeps
    t = -inf and its sum. Brackets of up to SMALL tokens are sorted at that size. scratch_ptr:
    this row's int32 scratch, CHUNKS_PAD + CAP entries (the chunk list, then the bracket's
    vocabulary indices); buf_ptr: its CAP float32 entries (the bracket's values).
    """
    SMALL: tl.constexpr = 64 if CAP > 64 else CAP
    list_ptr = scratch_ptr
    idx_ptr = scratch_ptr + CHUNKS_PAD
    t_key = tl.full([], KEY_NEG_INF, tl.int32)
    z = row_sum
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
        m_c = tl.load(table_m_row + c, mask=in_table, other=float("-inf"), cache_modifier=".cg")
        # A typical spread of the row's logits, for pivots below an open bracket.
        scale = tl.maximum(row_max - tl.min(tl.where(in_table & (m_c > float("-inf")), m_c, row_max), 0), 1.0)
        # top-k: the k-th largest logit; Z_k the mass of what it keeps.
        t_k = tl.full([], KEY_NEG_INF, tl.int32)
        t_p = tl.full([], KEY_NEG_INF, tl.int32)
        z_k = row_sum
        p_done = p_on == 0
        hi = top
        mass_above = tl.zeros([], tl.float32)
        # The buffer holds every token with key >= buf_lo (buf_n of them) when complete: the
        # table is then rewritten from it instead of from the row.
        complete = tl.zeros([], tl.int32) > 0
        buf_lo = top
        buf_n = tl.zeros([], tl.int32)
        if k_on:
            lo0 = _chunk_bound(m_c, in_table, row_max, k, False, top_k, 0.0, PIVOTS)
            if not p_on:
                lo0 = tl.maximum(lo0, t_mp)  # below t_mp the exact k-th value does not matter
            lo, hi, n_above, mass_above, n_b = _search(
                row_ptr, m_c, in_table, list_ptr, idx_ptr, buf_ptr, vocab_size, row_max, k, scale,
                False, top_k, 0.0, lo0, top, CHUNKS_PAD, CHUNK, CAP, TILE, PIVOT_TILE, PIVOTS, PIVOT_ACCUMULATE)
            complete = (hi == top) & (n_b <= CAP)
            buf_lo = lo
            buf_n = n_b
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
                True, 0, target, lo1, top, CHUNKS_PAD, CHUNK, CAP, TILE, PIVOT_TILE, PIVOTS, PIVOT_ACCUMULATE)
            complete = (hi == top) & (n_b <= CAP)
            buf_lo = lo
            buf_n = n_b
            if n_b <= SMALL:
                t_p = _resolve_top_p(buf_ptr, n_b, lo, n_above, mass_above, target, row_max, k, SMALL)
            elif n_b <= CAP:
                t_p = _resolve_top_p(buf_ptr, n_b, lo, n_above, mass_above, target, row_max, k, CAP)
            else:
                t_p = lo
        # Every filter keeps the row's max; the clamp only guards against float surprises.
        t_key = tl.minimum(tl.maximum(tl.maximum(t_k, t_p), t_mp), top - 1)
        if complete & (t_key >= buf_lo):
            if buf_n <= SMALL:
                z = _rewrite_from_buffer(buf_ptr, idx_ptr, buf_n, table_m_row, table_w_row, in_table, t_key,
                                         row_max, k, excluded, SMALL, CHUNKS_PAD, CHUNK)
            else:
                z = _rewrite_from_buffer(buf_ptr, idx_ptr, buf_n, table_m_row, table_w_row, in_table, t_key,
                                         row_max, k, excluded, CAP, CHUNKS_PAD, CHUNK)
        else:
            z = _rewrite_table(row_ptr, m_c, in_table, table_m_row, table_w_row, list_ptr, vocab_size, t_key,
                               row_max, k, excluded, CHUNK, TILE)
    return _unkey(t_key), z


def filter_workspace_sizes(rows: int, num_chunks: int, cap: int) -> tuple[int, int]:
    """(float32 entries, int32 entries) of the per-row filter scratch: threshold, Z_t and the
    CAP-entry bracket buffer's values in float32; the chunk list (padded to a power of 2) and
    the bracket's vocabulary indices in int32 (``filter_scratch_stride`` per row)."""
    return rows * (2 + cap), rows * filter_scratch_stride(num_chunks, cap)


def filter_scratch_stride(num_chunks: int, cap: int) -> int:
    """int32 scratch entries per row: CHUNKS_PAD (the chunk list) + CAP (bracket indices)."""
    return triton.next_power_of_2(max(num_chunks, 1)) + cap
