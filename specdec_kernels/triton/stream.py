"""The row stream the chain and tree kernels share: tiles of GROUP chunks of SAMPLE_CHUNK logits
read once in their own dtype, per-split running (max, sum, argmax) and the per-chunk tables the
chunked sampler races over (docs/ALGORITHM.md §3, §7)."""
from __future__ import annotations

import triton
import triton.language as tl

from .common import INTERPRETED, logits_f32, open_uniform, philox_words


@triton.jit
def store_table(ptrs, values, mask, ASM: tl.constexpr):
    """Store a [GROUP] vector of per-chunk values in the layout the tile's reductions leave it.
    tl.store first gives each value one owning thread, which moves the vector through shared
    memory behind two CTA barriers per store; ASM (compiled for CUDA only, not the interpreter)
    stores straight from the registers: every lane holding a value stores it, and the lanes of a
    warp that share a value share its address, so the warp still writes it once."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.f32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,f,r", [ptrs.to(tl.int64), values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def prefetch_l2(ptr, nbytes, flag):
    """Ask L2 for nbytes at ptr (16-byte aligned, a multiple of 16) where flag: one bulk prefetch
    (cp.async.bulk.prefetch.L2, sm_90), issued for thread 0; nothing is loaded into registers."""
    tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p, q; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.ne.b32 q, $2, 0; "
        "and.pred p, p, q; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.b32 $0, 0; }",
        "=r,l,r,r", [ptr.to(tl.int64, bitcast=True), flag.to(tl.int32), nbytes.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def stream_tile(raw, tile_start, chunks, tile_lane, k, greedy, excluded, m_vec, s_vec, am_vec,
                 table_m_row, table_w_row, num_chunks, CHUNK: tl.constexpr, GROUP: tl.constexpr,
                 thr=float("-inf"), FILTERED: tl.constexpr = False, raw_hi=None, ASM_TABLE: tl.constexpr = False,
                 FAST: tl.constexpr = False):
    """Fold one [GROUP, CHUNK] tile of a row into the per-tile-row running max / sum / argmax,
    and write the tile's chunk table (random requests). FILTERED: logits below the row's
    threshold ``thr`` count as -inf (sampling filters). The tile comes as two [GROUP, CHUNK / 2]
    tensors, ``raw`` the chunks' first halves (offsets ``tile_lane``) and ``raw_hi`` their second
    halves; they are combined element-wise before each reduction, so a chunk's reductions span
    half the lanes (bf16) or one warp instead of two (fp32; DECISIONS.md, "triton-halves").
    FAST: no sanitize, and the exponent as one FMA, exp2(fma(l, k, -mk)) with mk = m k rounded:
    each weight is exp2((l - m) k) times 2^(m k - mk), so the chunk's sum is scaled by
    2^-(m k - mk), a rounding residual that an FMA gives exactly, back to the exact form's
    (unscaled, each chunk would carry its own factor: up to 4% at m k ~ 1.4e6). Valid wherever
    m k is finite and no logit is NaN; the caller checks that after the split and streams it
    again without FAST where it is not (``stream_split``)."""
    HALF: tl.constexpr = CHUNK // 2
    lg = logits_f32(raw, not FAST)
    if FILTERED:
        lg = tl.where(lg >= thr, lg, float("-inf"))
    lg_hi = logits_f32(raw_hi, not FAST)
    if FILTERED:
        lg_hi = tl.where(lg_hi >= thr, lg_hi, float("-inf"))
    m_c = tl.max(tl.maximum(lg, lg_hi), 1)
    m_safe = tl.where(m_c > float("-inf"), m_c, 0.0)
    # The interpreter's fma is a float32 multiply and add, rounded twice: it takes the exact form.
    FMA: tl.constexpr = FAST and not INTERPRETED
    if FMA:
        # One FMA a logit; -inf logits still give 0. mk's rounding residual, exact by FMA, scales
        # the chunk's sum back (below).
        mk = m_safe * k
        w = tl.exp2(tl.fma(lg, k, -mk[:, None]))
        w_hi = tl.exp2(tl.fma(lg_hi, k, -mk[:, None]))
        scale = tl.exp2(-tl.fma(m_safe, k, -mk))  # 2^-(m k - mk): the weights hold 2^(m k - mk)
    else:
        w = tl.exp2((lg - m_safe[:, None]) * k)  # exp2(-inf) = 0: masked lanes need no select
        w_hi = tl.exp2((lg_hi - m_safe[:, None]) * k)
    s_c = tl.sum(w + w_hi, 1)
    if FMA:
        s_c = s_c * scale
    if greedy:
        # The lowest index of the max: a first half's beats its second half's.
        idx = tl.where(lg == m_c[:, None], tile_start + tile_lane,
                       tl.where(lg_hi == m_c[:, None], tile_start + tile_lane + HALF, 2147483647))
        am_c = tl.min(idx, 1)
        am_vec = tl.where(m_c > m_vec, am_c, am_vec)
    else:
        w_chunk = s_c
        rel = excluded - tile_start
        if (rel >= 0) & (rel < GROUP * CHUNK):
            # Deterministic drafts: the draft token's chunk total leaves it out.
            w_chunk = tl.sum(tl.where(tile_lane == rel, 0.0, w) + tl.where(tile_lane + HALF == rel, 0.0, w_hi), 1)
            if FMA:
                w_chunk = w_chunk * scale  # as s_c above
        if FAST:
            # A chunk of NaN and -inf only: its max is -inf (the max drops NaN), its sum NaN; the
            # exact total is 0 (the split's sum drops the chunk's below).
            w_chunk = tl.where(m_c > float("-inf"), w_chunk, 0.0)
        store_table(table_m_row + chunks, m_c, chunks < num_chunks, ASM_TABLE)
        store_table(table_w_row + chunks, w_chunk, chunks < num_chunks, ASM_TABLE)
    m_new = tl.maximum(m_vec, m_c)
    s_vec = tl.where(m_vec > float("-inf"), s_vec * tl.exp2((m_vec - m_new) * k), 0.0) \
        + tl.where(m_c > float("-inf"), s_c * tl.exp2((m_c - m_new) * k), 0.0)
    return m_new, s_vec, am_vec


@triton.jit
def stream_full_tiles(row_ptr, g_lo, g_hi, tile_lane, chunk_in_group, k, greedy, excluded, m_vec, s_vec, am_vec,
                       table_m_row, table_w_row, num_chunks, CHUNK: tl.constexpr, GROUP: tl.constexpr,
                       first_raw=None, HAS_FIRST: tl.constexpr = False, first_raw_hi=None,
                       ASM_TABLE: tl.constexpr = False, PREFETCH: tl.constexpr = 0, FAST: tl.constexpr = False):
    """Stream whole tiles g_lo .. g_hi - 1 of a row (no masks): the next tile is loaded before
    this one is reduced. HAS_FIRST: tile g_lo is ``first_raw`` (and ``first_raw_hi``), loaded by
    the caller. PREFETCH > 1: L2 is asked for the tile PREFETCH ahead (``prefetch_l2``) where the
    row is 16-byte aligned, so the load one tile ahead finds it there. FAST: ``stream_tile``'s."""
    HALF: tl.constexpr = CHUNK // 2
    if HAS_FIRST:
        raw_next = first_raw
        raw_next_hi = first_raw_hi
    else:
        raw_next = tl.load(row_ptr + g_lo * (GROUP * CHUNK) + tile_lane)
        raw_next_hi = tl.load(row_ptr + g_lo * (GROUP * CHUNK) + HALF + tile_lane)
    if PREFETCH > 1:
        tile_bytes = tl.full([], GROUP * CHUNK, tl.int32) * (row_ptr.dtype.element_ty.primitive_bitwidth // 8)
        aligned = (row_ptr.to(tl.int64, bitcast=True) % 16) == 0
        for d in tl.static_range(1, PREFETCH):
            prefetch_l2(row_ptr + (g_lo + d) * (GROUP * CHUNK), tile_bytes, aligned & (g_lo + d < g_hi))
    for grp in range(g_lo, g_hi):
        if PREFETCH > 1:
            prefetch_l2(row_ptr + (grp + PREFETCH) * (GROUP * CHUNK), tile_bytes, aligned & (grp + PREFETCH < g_hi))
        raw = raw_next
        raw_hi = raw_next_hi
        raw_next = tl.load(row_ptr + (grp + 1) * (GROUP * CHUNK) + tile_lane, mask=grp + 1 < g_hi, other=0.0)
        raw_next_hi = tl.load(row_ptr + (grp + 1) * (GROUP * CHUNK) + HALF + tile_lane, mask=grp + 1 < g_hi,
                              other=0.0)
        m_vec, s_vec, am_vec = stream_tile(
            raw, grp * (GROUP * CHUNK), grp * GROUP + chunk_in_group, tile_lane, k, greedy, excluded, m_vec, s_vec,
            am_vec, table_m_row, table_w_row, num_chunks, CHUNK, GROUP, float("-inf"), False, raw_hi,
            ASM_TABLE, FAST)
    return m_vec, s_vec, am_vec


@triton.jit
def stream_kept_tiles(row_ptr, g_lo, g_hi, cmax_row, thr, tile_lane, chunk_in_group, k, greedy, excluded, m_vec,
                       s_vec, am_vec, table_m_row, table_w_row, num_chunks, CHUNK: tl.constexpr,
                       GROUP: tl.constexpr, ASM_TABLE: tl.constexpr = False):
    """``stream_full_tiles`` for a filtered row (threshold thr > -inf): logits below thr count
    as -inf, chunks whose max (cmax_row, the threshold pass's) is below it are not loaded, and a
    tile without a kept chunk only writes its empty table entries (the loop is instruction-bound:
    skipping loads alone saves no time). Chunk maxima are read two tiles ahead."""
    HALF: tl.constexpr = CHUNK // 2
    keep_next = kept_chunks(cmax_row, g_lo * GROUP + chunk_in_group, thr, num_chunks)
    keep_after = kept_chunks(cmax_row, (g_lo + 1) * GROUP + chunk_in_group,
                              tl.where(g_lo + 1 < g_hi, thr, float("-inf")), num_chunks)
    raw_next = tl.load(row_ptr + g_lo * (GROUP * CHUNK) + tile_lane, mask=keep_next[:, None], other=float("-inf"))
    raw_next_hi = tl.load(row_ptr + g_lo * (GROUP * CHUNK) + HALF + tile_lane, mask=keep_next[:, None],
                          other=float("-inf"))
    for grp in range(g_lo, g_hi):
        raw = raw_next
        raw_hi = raw_next_hi
        keep_cur = keep_next
        keep_next = keep_after & (grp + 1 < g_hi)
        keep_after = kept_chunks(cmax_row, (grp + 2) * GROUP + chunk_in_group,
                                  tl.where(grp + 2 < g_hi, thr, float("-inf")), num_chunks)
        raw_next = tl.load(row_ptr + (grp + 1) * (GROUP * CHUNK) + tile_lane, mask=keep_next[:, None],
                           other=float("-inf"))
        raw_next_hi = tl.load(row_ptr + (grp + 1) * (GROUP * CHUNK) + HALF + tile_lane, mask=keep_next[:, None],
                              other=float("-inf"))
        if tl.max(keep_cur.to(tl.int32), 0) > 0:
            m_vec, s_vec, am_vec = stream_tile(
                raw, grp * (GROUP * CHUNK), grp * GROUP + chunk_in_group, tile_lane, k, greedy, excluded, m_vec,
                s_vec, am_vec, table_m_row, table_w_row, num_chunks, CHUNK, GROUP, thr, True, raw_hi,
                ASM_TABLE)
        else:
            empty_chunks(table_m_row, table_w_row, grp * GROUP + chunk_in_group, num_chunks, greedy)
    return m_vec, s_vec, am_vec


@triton.jit
def tile_lanes(CHUNK: tl.constexpr, GROUP: tl.constexpr):
    """(lane, chunk_in_group) of ``stream_split``'s tiles: GROUP chunks of CHUNK logits, one chunk
    per tile row, as two [GROUP, CHUNK / 2] tensors, the chunks' halves (``stream_tile``)."""
    lane = tl.arange(0, CHUNK // 2)[None, :]
    return lane, tl.arange(0, GROUP)


@triton.jit
def first_tile(row_ptr, g_lo, lane, chunk_in_group, vocab_size, load, CHUNK: tl.constexpr, GROUP: tl.constexpr):
    """Tile g_lo of a row as ``stream_split`` takes it ahead of the stream (``first_raw``,
    ``first_raw_hi``): entries past the vocabulary -inf, nothing read where not ``load``."""
    offs = g_lo * (GROUP * CHUNK) + chunk_in_group[:, None] * CHUNK + lane
    raw = tl.load(row_ptr + offs, mask=(offs < vocab_size) & load, other=float("-inf"))
    raw_hi = tl.load(row_ptr + CHUNK // 2 + offs, mask=(offs + CHUNK // 2 < vocab_size) & load,
                     other=float("-inf"))
    return raw, raw_hi


@triton.jit
def stream_split(row_ptr, row_ok, g_lo, g_hi, vocab_size, cmax_row, thr, lane, chunk_in_group, k, greedy,
                  excluded, table_m_row, table_w_row, num_chunks, CHUNK: tl.constexpr, GROUP: tl.constexpr,
                  HAS_FILTERS: tl.constexpr, first_raw=None, HAS_FIRST: tl.constexpr = False, first_raw_hi=None,
                  ASM_TABLE: tl.constexpr = False, PREFETCH: tl.constexpr = 0, FAST: tl.constexpr = False):
    """Phase 1 of one split (tiles g_lo .. g_hi - 1) of a row: its max, its sum of
    exp2((l - max) k) and first argmax (-1 for random requests), and its chunk table. Logits
    below the row's threshold thr count as -inf. HAS_FIRST (unfiltered rows only): tile g_lo,
    loaded with entries past the vocabulary as -inf, is ``first_raw`` (``first_raw_hi``).
    ``lane`` spans half a chunk and tiles are loaded as two halves (``stream_tile``).
    FAST (unfiltered calls): streamed first with ``stream_tile``'s FMA form, which gives the
    exact form's values when every chunk max times k is finite and no logit is NaN; then the
    split's max times k is below +inf and its sum finite. Where that fails (+inf or NaN logits,
    logits beyond +-FLT_MAX / k) the split is streamed again in the exact form, which rewrites its
    chunk table."""
    m_vec, s_vec, am_vec = stream_split_tiles(
        row_ptr, row_ok, g_lo, g_hi, vocab_size, cmax_row, thr, lane, chunk_in_group, k, greedy, excluded,
        table_m_row, table_w_row, num_chunks, CHUNK, GROUP, HAS_FILTERS, first_raw, HAS_FIRST, first_raw_hi,
        ASM_TABLE, PREFETCH, FAST)
    m_run, s_run, am_run = combine_tile_rows(m_vec, s_vec, am_vec, k)
    if FAST:
        if not ((m_run * k < float("inf")) & (s_run < float("inf"))):  # also catches a NaN sum
            m_vec, s_vec, am_vec = stream_split_tiles(
                row_ptr, row_ok, g_lo, g_hi, vocab_size, cmax_row, thr, lane, chunk_in_group, k, greedy, excluded,
                table_m_row, table_w_row, num_chunks, CHUNK, GROUP, HAS_FILTERS, None, False, None,
                ASM_TABLE, PREFETCH, False)
            m_run, s_run, am_run = combine_tile_rows(m_vec, s_vec, am_vec, k)
    return m_run, s_run, am_run


@triton.jit
def stream_split_tiles(row_ptr, row_ok, g_lo, g_hi, vocab_size, cmax_row, thr, lane, chunk_in_group, k, greedy,
                        excluded, table_m_row, table_w_row, num_chunks, CHUNK: tl.constexpr, GROUP: tl.constexpr,
                        HAS_FILTERS: tl.constexpr, first_raw, HAS_FIRST: tl.constexpr, first_raw_hi,
                        ASM_TABLE: tl.constexpr, PREFETCH: tl.constexpr, FAST: tl.constexpr):
    """``stream_split``'s stream: the per-tile-row running max / sum / argmax of its tiles."""
    NEG_INF: tl.constexpr = float("-inf")
    HALF: tl.constexpr = CHUNK // 2
    # Per tile row (= chunk position) running max / sum / first argmax; the tile rows are
    # combined once at the end, so the loop has no cross-warp reduction.
    m_vec = tl.full([GROUP], NEG_INF, tl.float32)
    s_vec = tl.zeros([GROUP], tl.float32)
    am_vec = tl.full([GROUP], 2147483647, tl.int32)
    tile_lane = chunk_in_group[:, None] * CHUNK + lane
    full_groups = vocab_size // (GROUP * CHUNK)
    full_hi = tl.minimum(g_hi, full_groups)
    if row_ok & (g_lo < full_hi):
        # Whole tiles. Unfiltered rows (thr = -inf: always without HAS_FILTERS, where the
        # compiler drops the other branch) take the plain loop, also in a filtered call.
        if thr > NEG_INF:
            m_vec, s_vec, am_vec = stream_kept_tiles(
                row_ptr, g_lo, full_hi, cmax_row, thr, tile_lane, chunk_in_group, k, greedy,
                excluded, m_vec, s_vec, am_vec, table_m_row, table_w_row, num_chunks, CHUNK, GROUP,
                ASM_TABLE)
        else:
            m_vec, s_vec, am_vec = stream_full_tiles(
                row_ptr, g_lo, full_hi, tile_lane, chunk_in_group, k, greedy, excluded, m_vec, s_vec,
                am_vec, table_m_row, table_w_row, num_chunks, CHUNK, GROUP, first_raw, HAS_FIRST, first_raw_hi,
                ASM_TABLE, PREFETCH, FAST)
    tail = tl.maximum(g_lo, full_groups)
    if row_ok & (tail < g_hi):
        # The last, partial tile of the vocabulary.
        offs = tail * (GROUP * CHUNK) + tile_lane
        in_row = offs < vocab_size
        in_row_hi = offs + HALF < vocab_size
        if HAS_FILTERS:
            kept = kept_chunks(cmax_row, tail * GROUP + chunk_in_group, thr, num_chunks)[:, None]
            in_row = in_row & kept
            in_row_hi = in_row_hi & kept
        if HAS_FIRST:
            raw = tl.where(tail == g_lo, first_raw,
                           tl.load(row_ptr + offs, mask=in_row & (tail != g_lo), other=NEG_INF))
        else:
            raw = tl.load(row_ptr + offs, mask=in_row, other=NEG_INF)
        if HAS_FIRST:
            raw_hi = tl.where(tail == g_lo, first_raw_hi,
                              tl.load(row_ptr + HALF + offs, mask=in_row_hi & (tail != g_lo), other=NEG_INF))
        else:
            raw_hi = tl.load(row_ptr + HALF + offs, mask=in_row_hi, other=NEG_INF)
        m_vec, s_vec, am_vec = stream_tile(
            raw, tail * (GROUP * CHUNK), tail * GROUP + chunk_in_group, tile_lane, k, greedy,
            excluded, m_vec, s_vec, am_vec, table_m_row, table_w_row, num_chunks, CHUNK, GROUP,
            thr, HAS_FILTERS, raw_hi, ASM_TABLE, FAST)
    return m_vec, s_vec, am_vec


@triton.jit
def combine_tile_rows(m_vec, s_vec, am_vec, k):
    """A split's record -- max, sum of exp2((l - max) k), first argmax (-1: none) -- from the
    running values of its tile rows."""
    m_run = tl.max(m_vec, 0)
    live = m_vec > float("-inf")
    s_run = tl.sum(tl.where(live, s_vec * tl.exp2((m_vec - m_run) * k), 0.0), 0)
    am_run = tl.min(tl.where(live & (m_vec == m_run), am_vec, 2147483647), 0)
    return m_run, s_run, tl.where(am_run == 2147483647, -1, am_run)


@triton.jit
def kept_set_record(kept_m_ptr, kept_z, slot, s_idx):
    """The split record of a row verified from its kept set (kept_z > 0, random requests only):
    the threshold pass's max and kept sum as split 0's, empty records for the other splits."""
    m_run = tl.where(s_idx == 0, tl.load(kept_m_ptr + slot), float("-inf"))
    return m_run, tl.where(s_idx == 0, kept_z, 0.0), tl.full([], -1, tl.int32)


@triton.jit
def row_table(table_m_ptr, table_w_ptr, table_slot, cmax_ptr, kept_w_ptr, kept_z_ptr, slot, num_chunks,
               HAS_FILTERS: tl.constexpr):
    """A row's chunk table (maxima, totals): the one its stream wrote (at ``table_slot``: the
    tree kernel indexes its tables by row, the chain kernel by slot), or the threshold pass's for
    a row verified from its kept set (kept_z > 0)."""
    table_m_row = table_m_ptr + table_slot * num_chunks
    table_w_row = table_w_ptr + table_slot * num_chunks
    if HAS_FILTERS:
        if tl.load(kept_z_ptr + slot) > 0.0:
            table_m_row = cmax_ptr + slot * num_chunks
            table_w_row = kept_w_ptr + slot * num_chunks
    return table_m_row, table_w_row


@triton.jit
def race_winner(table_m_ptr, table_w_ptr, num_chunks, row_max, k, seed, offset, node,
                 HAS_MAX: tl.constexpr, CHUNKS_PAD: tl.constexpr, STREAM_SAMPLE: tl.constexpr):
    """The chunk race of one row from its table of chunk totals: the chunk maximizing
    log2(W_c) [+ (m_c - row_max) k] - log2(-log2(v_c)); -1 if every chunk is empty.
    With HAS_MAX the totals are relative to the chunk maxima m_c, else absolute."""
    c = tl.arange(0, CHUNKS_PAD)
    in_table = c < num_chunks
    w = tl.load(table_w_ptr + c, mask=in_table, other=0.0, cache_modifier=".cg")
    score = tl.log2(w)
    if HAS_MAX:
        m = tl.load(table_m_ptr + c, mask=in_table, other=float("-inf"), cache_modifier=".cg")
        score = score + (m - row_max) * k
    w0, w1 = philox_words(seed, offset, STREAM_SAMPLE, node, c)
    score = tl.where(w > 0.0, score - tl.log2(-tl.log2(open_uniform(w1))), float("-inf"))
    best = tl.max(score, 0)
    winner = tl.min(tl.where(score == best, c, 2147483647), 0)
    return tl.where(best > float("-inf"), winner, -1)


@triton.jit
def kept_chunks(cmax_row, chunks, thr, num_chunks):
    """Which chunks hold a logit >= thr (their max from the threshold pass is): all of them,
    without a load, when thr = -inf. Chunks past the table's end read as kept (callers mask
    their logits by the vocabulary)."""
    # (a where, not `scalar & vector`: the interpreter cannot `&` a scalar comparison with a vector)
    cmax = tl.load(cmax_row + chunks, mask=tl.where(thr > float("-inf"), chunks < num_chunks, False),
                   other=float("inf"))
    return cmax >= thr


@triton.jit
def empty_chunks(table_m_row, table_w_row, chunks, num_chunks, greedy):
    """The chunk table entries of chunks with no kept logit (what ``stream_tile`` writes for an
    all -inf tile: max -inf, total 0; greedy rows keep no table)."""
    if not greedy:
        in_table = chunks < num_chunks
        tl.store(table_m_row + chunks, tl.full(chunks.shape, float("-inf"), tl.float32), mask=in_table)
        tl.store(table_w_row + chunks, tl.zeros(chunks.shape, tl.float32), mask=in_table)
