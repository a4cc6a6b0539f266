"""Fused Triton kernel for chain verification: ``_rejection_sample_kernel`` -> launcher.

One launch per call. The grid has one program per (request, row, split) — a split is a
range of SAMPLE_CHUNK-wide vocabulary chunks of one target row — and, with draft
probabilities, one more program per (request, split) for the residual:

- phase 1 (every row): stream the logits once in their own dtype and keep, per split, the
  row max, the sum of exp2((l - max) * log2e / T), the first argmax, and the sample of the
  row drawn with the chunked sampler of docs/ALGORITHM.md (for deterministic drafts the
  draft token is left out of it: that is the residual; the bonus row leaves nothing out).
  Each program writes one record to the workspace and counts itself on its request; a
  row's first program also records its draft token's logit and draft probability, loaded
  while it streams, so the accept tests read only records. Tiles are two half-chunk tensors
  and the chunk tables are stored from registers (``stream_tile``, ``store_table``); with
  16-bit logits on sm_90 L2 is asked for the tile two ahead (``prefetch_l2``).
- without draft probabilities the last phase-1 program of a request (the counter tells)
  combines the records, runs the accept tests of all positions at once and writes the
  outputs: every logit is read once, nothing else is read.
- with draft probabilities the residual max(0, q - p) needs the row's final statistics, so
  phase-2 programs wait for their request's phase 1, recompute the (cheap) decision, sample
  their split of the one rejected row from the residual, and the last of them writes the
  outputs. Programs take their phase from a ticket counter, so a phase-2 program only ever
  waits for programs that are already running or done (no deadlock, also in the
  interpreter, which runs programs one after another).

Counters are reset by the program that finishes last, so the cached workspace is always
zero between calls and the launch is CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.philox import SAMPLE_CHUNK, STREAM_ACCEPT, STREAM_SAMPLE
from . import config as _config
from .common import (PROGRAMS_PER_SM, asm_table_enabled, gdc_launch_dependents, gdc_wait, pdl_enabled,
                     philox_words, prefetch_tiles, request_lenience, row_split, sanitize, token_in_vocab, uniform,
                     workspace)
from .filters import launch_row_thresholds, threshold_workspace_sizes
from .stream import first_tile, kept_set_record, race_winner, row_table, store_table, stream_split, tile_lanes

PROGRAMS_PER_SM_WIDE = 8


@triton.jit
def _sample_in_chunk(row_ptr, p_ptr, chunk, vocab_size, row_ok, k, excluded, row_max, row_sum,
                     seed, offset, node, RESIDUAL: tl.constexpr, CHUNK: tl.constexpr,
                     STREAM_SAMPLE: tl.constexpr, scale=1.0, thr=0.0, FILTERED: tl.constexpr = False):
    """Inverse CDF inside one chunk: the smallest lane with w > 0 and prefix >= u * total.

    Weights: q relative to the chunk max with ``excluded`` left out, or (RESIDUAL) the
    residual max(0, scale * q - p) with q = exp2((l - row_max) k) / row_sum (scale = P_tau of
    block verification, 1 otherwise); with FILTERED, q is 0 below the row's threshold ``thr``.
    -1 if the chunk is empty.
    """
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = (offs < vocab_size) & row_ok & (chunk >= 0)
    if RESIDUAL:
        w = _residual(row_ptr, p_ptr, offs, in_row, row_max, row_sum, k, scale, thr, FILTERED)
    else:
        lg = sanitize(tl.load(row_ptr + offs, mask=in_row, other=float("-inf")).to(tl.float32))
        if FILTERED:
            lg = tl.where(lg >= thr, lg, float("-inf"))  # filtered out: as if -inf
        m = tl.max(lg, 0)
        w = tl.where(lg > float("-inf"), tl.exp2((lg - m) * k), 0.0)
        w = tl.where(offs == excluded, 0.0, w)
    prefix = tl.cumsum(w, 0)
    total = tl.max(prefix, 0)  # prefix is non-decreasing: its max is the chunk total
    w0, w1 = philox_words(seed, offset, STREAM_SAMPLE, node, chunk)
    threshold = uniform(w0) * total
    token = tl.min(tl.where((w > 0.0) & (prefix >= threshold), offs, 2147483647), 0)
    return tl.where(token == 2147483647, -1, token)


@triton.jit
def _row_argmax(row_ptr, row_ok, vocab_size, BLOCK: tl.constexpr):
    """Lowest index of the row maximum, -1 without a valid logit. A slow path: the stream
    keeps argmaxes for greedy requests only, and random ones need it only as a fallback."""
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 2147483647, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lg = sanitize(tl.load(row_ptr + offs, mask=(offs < vocab_size) & row_ok, other=float("-inf")).to(tl.float32))
        m = tl.max(lg, 0)
        idx = tl.min(tl.where(lg == m, offs, 2147483647), 0)
        take = m > best_val
        best_idx = tl.where(take, idx, best_idx)
        best_val = tl.where(take, m, best_val)
    return tl.where(best_val > float("-inf"), best_idx, -1)


@triton.jit
def _draft_token_values(row_ptr, p_row_ptr, x, load, HAS_DRAFT_PROBS: tl.constexpr):
    """A draft row's token x (in [0, V), or -1): its target logit, sanitized (-inf if x is -1),
    and its draft probability (0 without draft probabilities), read only where ``load``."""
    ok = load & (x >= 0)
    lx = sanitize(tl.load(row_ptr + x, mask=ok, other=float("-inf")).to(tl.float32))
    px = tl.zeros([], tl.float32)
    if HAS_DRAFT_PROBS:
        px = tl.load(p_row_ptr + x, mask=ok, other=0.0).to(tl.float32)
    return lx, px


@triton.jit
def _request_decision(
    b, n, cu_lo, draft_ids_ptr, num_drafts, rec_m_ptr, rec_s_ptr, rec_am_ptr, rec_lx_ptr, rec_px_ptr, num_rows,
    vocab_size, max_spec_len, num_splits, seed, offset, k, greedy, thr_ptr,
    HAS_DRAFT_PROBS: tl.constexpr, ROWS_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    STREAM_ACCEPT: tl.constexpr, HAS_FILTERS: tl.constexpr, lam=1.0, HAS_LENIENCE: tl.constexpr = False,
):
    """Combine a request's phase-1 records and run its accept tests, all positions at once.
    HAS_LENIENCE: the request's lenience ``lam`` relaxes them (docs/ALGORITHM.md §8).

    Returns (t_star, drafts, row_max, row_sum, argmax, ..., thr): t_star = accepted drafts;
    the per-row vectors are indexed by position (argmax is -1 for random requests); thr is
    each row's filter threshold (-inf: unfiltered), and the records already leave out what it
    filters.
    """
    t = tl.arange(0, ROWS_PAD)
    s = tl.arange(0, SPLITS_PAD)
    rec = (b * (max_spec_len + 1) + t[:, None]) * num_splits + s[None, :]
    rec_mask = (t[:, None] <= n) & (s[None, :] < num_splits)
    m = tl.load(rec_m_ptr + rec, mask=rec_mask, other=float("-inf"), cache_modifier=".cg")
    sv = tl.load(rec_s_ptr + rec, mask=rec_mask, other=0.0, cache_modifier=".cg")
    am = tl.load(rec_am_ptr + rec, mask=rec_mask, other=-1, cache_modifier=".cg")

    row_max = tl.max(m, 1)
    live = m > float("-inf")
    row_sum = tl.sum(tl.where(live, sv * tl.exp2((m - row_max[:, None]) * k), 0.0), 1)
    argmax = tl.min(tl.where(live & (m == row_max[:, None]), am, 2147483647), 1)
    argmax = tl.where(row_max > float("-inf"), argmax, -1)
    thr = tl.full([ROWS_PAD], float("-inf"), tl.float32)
    if HAS_FILTERS:
        thr = tl.load(thr_ptr + b * (max_spec_len + 1) + t, mask=t <= n, other=float("-inf"))

    # Accept tests: draft t is tested against row t.
    is_draft = t < n
    d = cu_lo + t
    d_ok = is_draft & (d >= 0) & (d < num_drafts)
    x = tl.load(draft_ids_ptr + d, mask=d_ok, other=-1).to(tl.int64)
    x_ok = d_ok & (x >= 0) & (x < vocab_size)
    row = cu_lo + b + t
    x_ok_row = x_ok & (row >= 0) & (row < num_rows)
    # The draft token's logit and draft probability, read by each row's first unit
    # (``_draft_token_values``): loaded with the records, not after the draft ids.
    slot = b * (max_spec_len + 1) + t
    lx = tl.load(rec_lx_ptr + slot, mask=x_ok_row, other=float("-inf"), cache_modifier=".cg")
    q_x = tl.where(x_ok_row & (lx > float("-inf")) & (row_max > float("-inf")) & (lx >= thr),
                   tl.exp2((lx - row_max) * k) / row_sum, 0.0)
    if HAS_DRAFT_PROBS:
        p_x = tl.load(rec_px_ptr + slot, mask=x_ok, other=0.0, cache_modifier=".cg")
    else:
        p_x = tl.full([ROWS_PAD], 1.0, tl.float32)
    a0, a1 = philox_words(seed, offset, STREAM_ACCEPT, t + 1, tl.zeros([ROWS_PAD], tl.int32))
    u = uniform(a0)
    if greedy:
        accept = x_ok & (x == argmax)
        if HAS_LENIENCE:
            # Also a draft within ln(l) of the row max (l < 1; l = 1 is the exact rule).
            accept = accept | (x_ok & (lx - row_max >= tl.where(lam < 1.0, tl.log(lam), float("inf"))))
    else:
        if HAS_LENIENCE:
            accept = x_ok & (u * (lam * p_x) < q_x)
        else:
            accept = x_ok & (u * p_x < q_x)
    t_star = tl.min(tl.where(is_draft & (accept == 0), t, n), 0)
    return t_star, x, row_max, row_sum, argmax, q_x, p_x, u, x_ok, thr


@triton.jit
def _residual(row_ptr, p_ptr, offs, in_row, m_w, s_w, k, scale, thr_w, HAS_FILTERS: tl.constexpr):
    """The residual max(0, scale q - p) of one row at ``offs`` (0 outside ``in_row``, where q is
    0, and where it would be NaN), q = exp2((l - m_w) k) / s_w, 0 below the filter threshold."""
    lg = sanitize(tl.load(row_ptr + offs, mask=in_row, other=float("-inf")).to(tl.float32))
    q = tl.where(lg > float("-inf"), tl.exp2((lg - m_w) * k) / s_w, 0.0)
    if HAS_FILTERS:
        q = tl.where(lg >= thr_w, q, 0.0)
    p = tl.load(p_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
    r = tl.where(q > 0.0, tl.maximum(scale * q - p, 0.0), 0.0)
    return tl.where(r == r, r, 0.0)


@triton.jit
def _block_ratios(q_x, p_x, x_ok, n, t):
    """Block verification's running joint ratio: P_next[t] = P after draft t, i.e.
    min(1, P_prev q(x_t) / p(x_t)) with P_0 = 1 (division-free where p(x_t) = 0), and n', the
    drafts up to the first invalid id (which ends the chain)."""
    n_eff = tl.min(tl.where((t < n) & (x_ok == 0), t, n), 0)
    p_next = tl.zeros_like(q_x)
    prev = tl.full([], 1.0, tl.float32)
    for i in range(0, n_eff):
        num = prev * _pick(q_x, t, i)
        den = _pick(p_x, t, i)
        cur = tl.where(num >= den, tl.where(num > 0.0, 1.0, 0.0), num / tl.where(den > 0.0, den, 1.0))
        p_next = tl.where(t == i, cur, p_next)
        prev = cur
    return p_next, n_eff


@triton.jit
def _block_tau(p_next, residual_mass, u, t, n_eff):
    """tau = the largest i = t + 1 <= n' with eta_i < h_i, h_i = R_i / (R_i + 1 - P_i)
    (1 when the denominator is 0), h_n' = P_n'; returns (tau, P_tau)."""
    den = residual_mass + 1.0 - p_next
    h = tl.where(den > 0.0, residual_mass / tl.where(den > 0.0, den, 1.0), 1.0)
    h = tl.where(t + 1 == n_eff, p_next, h)
    accept = (u < h) & (t + 1 <= n_eff)
    tau = tl.max(tl.where(accept, t + 1, 0), 0).to(tl.int64)
    return tau, tl.where(tau == 0, 1.0, _pick(p_next, t, tau - 1))


@triton.jit
def _write_outputs(b, t_star, drafts, token, out_tokens_ptr, out_num_accepted_ptr, max_spec_len,
                   ROWS_PAD: tl.constexpr):
    t = tl.arange(0, ROWS_PAD)
    vals = tl.where(t < t_star, drafts, tl.where(t == t_star, token, -1))
    tl.store(out_tokens_ptr + b * (max_spec_len + 1) + t, vals.to(tl.int32), mask=t <= max_spec_len)
    tl.store(out_num_accepted_ptr + b, t_star.to(tl.int32))


@triton.jit
def _pick(vec, t, idx):
    """vec[idx] for a vector indexed by t (a scalar gather from registers)."""
    return tl.sum(tl.where(t == idx, vec, 0), 0)


@triton.jit
def _rejection_sample_kernel(
    logits_ptr, logits_row_stride,
    draft_ids_ptr, num_drafts,
    cu_ptr,
    draft_probs_ptr, draft_probs_row_stride,
    temperature_ptr, seeds_ptr, offsets_ptr, lenience_ptr,
    out_tokens_ptr, out_num_accepted_ptr,
    rec_m_ptr, rec_s_ptr, rec_am_ptr, rec_lx_ptr, rec_px_ptr, table_m_ptr, table_w_ptr, table_r_ptr, residual_sum_ptr,
    counter_ptr,
    thr_ptr, cmax_ptr, kept_w_ptr, kept_m_ptr, kept_z_ptr,
    num_requests, num_rows, vocab_size, max_spec_len,
    num_splits, groups_per_split, residual_splits, residual_groups_per_split, residual_rows, num_groups,
    num_chunks, units_phase1, units_total,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    BLOCK_VERIFY: tl.constexpr,
    ROWS_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr,
    CHUNK: tl.constexpr, GROUP: tl.constexpr,
    STREAM_ACCEPT: tl.constexpr, STREAM_SAMPLE: tl.constexpr,
    HAS_FILTERS: tl.constexpr, UNIFORM: tl.constexpr, USE_PDL: tl.constexpr,
    ASM_TABLE: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
    FAST_EXP: tl.constexpr = False,  # unfiltered calls only (the launcher's rule)
    HAS_LENIENCE: tl.constexpr = False,
):
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    if USE_PDL:
        # Programmatic dependent launch (sm_90+): nothing is read or written before the kernel
        # ahead of this one in the stream has completed; then the next launch may begin.
        gdc_wait()
        gdc_launch_dependents()
    if HAS_DRAFT_PROBS:
        # Tickets hand out units in the order programs start (see module docstring).
        unit = tl.atomic_add(counter_ptr + 2 * num_requests, 1, sem="relaxed")
    else:
        unit = tl.program_id(0)
    is_phase1 = unit < units_phase1
    if is_phase1:
        s_idx = unit % num_splits
        row_unit = unit // num_splits
        b = row_unit // (max_spec_len + 1)
        t = row_unit % (max_spec_len + 1)
    else:
        # Residual unit: (request, residual row, split); token mode has one residual row (t*),
        # block mode one per draft row.
        s_idx = (unit - units_phase1) % residual_splits
        b = (unit - units_phase1) // residual_splits // residual_rows
        t = (unit - units_phase1) // residual_splits % residual_rows
    HALF: tl.constexpr = CHUNK // 2
    lane, chunk_in_group = tile_lanes(CHUNK, GROUP)
    if is_phase1:
        g_lo = s_idx * groups_per_split
        g_hi = tl.minimum(g_lo + groups_per_split, num_groups)
    else:
        g_lo = s_idx * residual_groups_per_split
        g_hi = tl.minimum(g_lo + residual_groups_per_split, num_groups)
    if UNIFORM:
        # Rows before offsets (DECISIONS.md, "triton-rows-before-offsets"): every request has
        # max_spec_len drafts, so with well-formed offsets (cu[b] = b * max_spec_len) row (b, t) is
        # b (max_spec_len + 1) + t and its draft b max_spec_len + t. The split's first tile and the
        # draft id are loaded with the request's fields instead of after them; the fields confirm
        # the guess below.
        guess_ptr = logits_ptr + (b * (max_spec_len + 1) + t).to(tl.int64) * logits_row_stride
        first_raw, first_raw_hi = first_tile(guess_ptr, g_lo, lane, chunk_in_group, vocab_size, is_phase1, CHUNK,
                                              GROUP)
        x_guess = token_in_vocab(
            tl.load(draft_ids_ptr + b * max_spec_len + t, mask=(t < max_spec_len) & is_phase1, other=-1), vocab_size)
        guess_excluded = tl.full([], -1, tl.int32)
        if not HAS_DRAFT_PROBS:
            guess_excluded = x_guess
        # The finalizer's reads of the draft token, issued now and stored after the stream.
        guess_lx, guess_px = _draft_token_values(guess_ptr, draft_probs_ptr + (b * max_spec_len + t).to(tl.int64) *
                                                 draft_probs_row_stride, x_guess, (s_idx == 0) & is_phase1,
                                                 HAS_DRAFT_PROBS)
    cu_lo = tl.load(cu_ptr + b).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1).to(tl.int64) - cu_lo, 0), max_spec_len)
    if HAS_TEMPERATURE:
        temp = tl.load(temperature_ptr + b).to(tl.float32)
    else:
        temp = tl.full([], 1.0, tl.float32)
    greedy = not (temp > 0.0)
    k = tl.where(greedy, LOG2E, LOG2E / temp)
    seed = tl.load(seeds_ptr + b).to(tl.int64)
    if HAS_OFFSETS:
        offset = tl.load(offsets_ptr + b).to(tl.int64)
    else:
        offset = tl.zeros([], tl.int64)
    lam = request_lenience(lenience_ptr, b, HAS_LENIENCE)

    if is_phase1:
        # Chunk tables are per (request, position) slot, not per row: a unit that streamed a
        # wrong guess (malformed offsets) streams its own row again into its own slot.
        slot = b * (max_spec_len + 1) + t
        table_m_row = table_m_ptr + slot * num_chunks
        table_w_row = table_w_ptr + slot * num_chunks
        if UNIFORM:
            m_run, s_run, am_run = stream_split(
                guess_ptr, True, g_lo, g_hi, vocab_size, cmax_ptr, NEG_INF, lane, chunk_in_group, k, greedy,
                guess_excluded, table_m_row, table_w_row, num_chunks, CHUNK, GROUP, False, first_raw, True,
                first_raw_hi, ASM_TABLE, PREFETCH, FAST_EXP)
            miss = (cu_lo != b * max_spec_len) | (n != max_spec_len)
            draft_lx, draft_px = guess_lx, guess_px
        else:
            draft_lx = tl.full([], NEG_INF, tl.float32)
            draft_px = tl.zeros([], tl.float32)
            m_run = tl.full([], NEG_INF, tl.float32)
            s_run = tl.zeros([], tl.float32)
            am_run = tl.full([], -1, tl.int32)
            miss = tl.full([], True, tl.int1)
        if miss:
            # Ragged batches, and the guess's misses (malformed offsets only).
            if t <= n:
                row = cu_lo + b + t
                row_ok = (row >= 0) & (row < num_rows)
                row_ptr = logits_ptr + row * logits_row_stride
                d = cu_lo + t
                x = tl.full([], -1, tl.int32)
                if (t < n) & (d >= 0) & (d < num_drafts):
                    x = token_in_vocab(tl.load(draft_ids_ptr + d), vocab_size)
                draft_lx, draft_px = _draft_token_values(row_ptr, draft_probs_ptr + d * draft_probs_row_stride, x,
                                                         (s_idx == 0) & row_ok, HAS_DRAFT_PROBS)
                excluded = tl.full([], -1, tl.int32)
                if not HAS_DRAFT_PROBS:
                    excluded = x
                # Sampling filters: the threshold pass (``filters``) gave the row's threshold
                # (-inf: unfiltered) and chunk maxima; chunks whose max is below it are not read, and
                # a row whose whole kept set the pass held (kept_z > 0) is not read at all.
                thr_row = tl.full([], NEG_INF, tl.float32)
                kept_z = tl.zeros([], tl.float32)
                if HAS_FILTERS:
                    thr_row = tl.load(thr_ptr + slot)
                    kept_z = tl.load(kept_z_ptr + slot)
                if kept_z > 0.0:
                    # Its statistics are the pass's, its chunk table too (``row_table``).
                    m_run, s_run, am_run = kept_set_record(kept_m_ptr, kept_z, slot, s_idx)
                else:
                    m_run, s_run, am_run = stream_split(
                        row_ptr, row_ok, g_lo, g_hi, vocab_size, cmax_ptr + slot * num_chunks, thr_row, lane,
                        chunk_in_group, k, greedy, excluded, table_m_row, table_w_row, num_chunks, CHUNK, GROUP,
                        HAS_FILTERS, None, False, None, ASM_TABLE, PREFETCH, FAST_EXP)
        if t <= n:
            rec = slot * num_splits + s_idx
            tl.store(rec_m_ptr + rec, m_run)
            tl.store(rec_s_ptr + rec, s_run)
            tl.store(rec_am_ptr + rec, am_run)
            if (s_idx == 0) & (t < n):
                tl.store(rec_lx_ptr + slot, draft_lx)
                if HAS_DRAFT_PROBS:
                    tl.store(rec_px_ptr + slot, draft_px)
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + b, 1, sem="acq_rel") + 1
            if not HAS_DRAFT_PROBS:
                if done == (n + 1) * num_splits:
                    tl.debug_barrier()
                    t_star, drafts, row_max, row_sum, argmax, q_x, p_x, u, x_ok, thr = _request_decision(
                        b, n, cu_lo, draft_ids_ptr, num_drafts, rec_m_ptr, rec_s_ptr, rec_am_ptr, rec_lx_ptr,
                        rec_px_ptr, num_rows, vocab_size, max_spec_len, num_splits, seed, offset,
                        k, greedy, thr_ptr, HAS_DRAFT_PROBS, ROWS_PAD, SPLITS_PAD,
                        STREAM_ACCEPT, HAS_FILTERS, lam, HAS_LENIENCE)
                    rows = tl.arange(0, ROWS_PAD)
                    if BLOCK_VERIFY:
                        if not greedy:
                            # Point-mass drafts: R_i = P_i (1 - q(x_{i+1})), all scalars; the
                            # residual at tau is q without x_tau, whatever P_tau.
                            p_next, n_eff = _block_ratios(q_x, p_x, x_ok, n, rows)
                            q_following = tl.sum(tl.where(rows[None, :] == rows[:, None] + 1, q_x[None, :], 0.0), 1)
                            t_star, _p_tau = _block_tau(p_next, p_next * (1.0 - q_following), u, rows, n_eff)
                    token = _pick(argmax, rows, t_star)
                    if not greedy:
                        row = cu_lo + b + t_star
                        row_ok = (row >= 0) & (row < num_rows)
                        row_ptr = logits_ptr + row * logits_row_stride
                        x_star = tl.where(t_star < n, _pick(drafts, rows, t_star), -1)
                        slot_star = b * (max_spec_len + 1) + t_star
                        table_m_row, table_w_row = row_table(table_m_ptr, table_w_ptr, slot_star, cmax_ptr,
                                                              kept_w_ptr, kept_z_ptr, slot_star, num_chunks,
                                                              HAS_FILTERS)
                        chunk = race_winner(table_m_row, table_w_row, num_chunks, _pick(row_max, rows, t_star), k,
                                             seed, offset, t_star, True, CHUNKS_PAD, STREAM_SAMPLE)
                        token = _sample_in_chunk(row_ptr, draft_probs_ptr, chunk, vocab_size, row_ok, k,
                                                 x_star, 0.0, 1.0, seed, offset, t_star, False, CHUNK,
                                                 STREAM_SAMPLE, 1.0, _pick(thr, rows, t_star), HAS_FILTERS)
                        if token < 0:
                            # q minus the rejected draft is empty only if q is a point mass.
                            token = _row_argmax(row_ptr, row_ok, vocab_size, GROUP * CHUNK)
                    _write_outputs(b, t_star, drafts, token, out_tokens_ptr, out_num_accepted_ptr,
                                   max_spec_len, ROWS_PAD)
                    tl.store(counter_ptr + b, 0)
    else:
        # Phase 2 (draft probabilities): wait for the request's phase 1.
        need = ((n + 1) * num_splits).to(tl.int32)
        seen = tl.atomic_add(counter_ptr + b, 0, sem="acquire")
        while seen < need:
            seen = tl.atomic_add(counter_ptr + b, 0, sem="acquire")
        tl.debug_barrier()
        t_star, drafts, row_max, row_sum, argmax, q_x, p_x, u, x_ok, thr = _request_decision(
            b, n, cu_lo, draft_ids_ptr, num_drafts, rec_m_ptr, rec_s_ptr, rec_am_ptr, rec_lx_ptr, rec_px_ptr,
            num_rows, vocab_size, max_spec_len, num_splits, seed, offset,
            k, greedy, thr_ptr, HAS_DRAFT_PROBS, ROWS_PAD, SPLITS_PAD,
            STREAM_ACCEPT, HAS_FILTERS, lam, HAS_LENIENCE)
        rows = tl.arange(0, ROWS_PAD)
        if BLOCK_VERIFY:
            # Every draft row r < n' gets its residual max(0, P_r q_r - p_r): its mass R_r and
            # its chunk table (tau is known only once all of them are summed).
            p_next, n_eff = _block_ratios(q_x, p_x, x_ok, n, rows)
            work_row = t
            scale = tl.where(t == 0, 1.0, _pick(p_next, rows, t - 1))
            does_work = (not greedy) & (t < n_eff)
        else:
            # An invalid draft id at t* (e.g. -1 padding) ends the chain: its row's q sample is final.
            x_star = _pick(drafts, rows, t_star)
            work_row = t_star
            scale = tl.full([], 1.0, tl.float32)
            does_work = (not greedy) & (t_star < n) & (x_star >= 0) & (x_star < vocab_size)
        m_w = _pick(row_max, rows, work_row)
        s_w = _pick(row_sum, rows, work_row)
        if HAS_LENIENCE:
            # The lenient residual max(0, q - l p) = l max(0, q / l - p): the same law, with l
            # folded into q's normalizer (the race and the inverse CDF are scale-free), so the
            # residual loop is the exact call's (token method only: block rejects lenience).
            s_w = s_w * lam
        thr_w = _pick(thr, rows, work_row)
        row = cu_lo + b + work_row
        row_ok = (row >= 0) & (row < num_rows)
        row_ptr = logits_ptr + row * logits_row_stride
        p_ptr = draft_probs_ptr + (cu_lo + work_row) * draft_probs_row_stride
        slot = b * residual_rows + t
        if does_work:
            mass = tl.zeros([GROUP], tl.float32)  # per tile row: no cross-warp sum in the loop
            for grp in range(g_lo, g_hi):
                chunks = grp * GROUP + chunk_in_group
                offs = chunks[:, None] * CHUNK + lane
                r = _residual(row_ptr, p_ptr, offs, (offs < vocab_size) & row_ok, m_w, s_w, k, scale, thr_w,
                              HAS_FILTERS)
                r += _residual(row_ptr, p_ptr, offs + HALF, (offs + HALF < vocab_size) & row_ok, m_w, s_w, k,
                               scale, thr_w, HAS_FILTERS)
                r_c = tl.sum(r, 1)
                store_table(table_r_ptr + slot * num_chunks + chunks, r_c, chunks < num_chunks, ASM_TABLE)
                mass += r_c
            tl.store(residual_sum_ptr + slot * residual_splits + s_idx, tl.sum(mass, 0))
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + num_requests + b, 1, sem="acq_rel")
        if done == residual_rows * residual_splits - 1:
            tl.debug_barrier()
            needs_residual = does_work
            res_slot = (b * residual_rows).to(tl.int64)  # the block branch adds the int64 t_star
            if BLOCK_VERIFY:
                if not greedy:
                    # R_i (rows 1..n'-1) from the residual units' sums, then tau.
                    rr = tl.arange(0, ROWS_PAD)[:, None]
                    ss = tl.arange(0, SPLITS_PAD)[None, :]
                    sums = tl.load(residual_sum_ptr + (b * residual_rows + rr) * residual_splits + ss,
                                   mask=(rr < n_eff) & (rr < residual_rows) & (ss < residual_splits),
                                   other=0.0, cache_modifier=".cg")
                    row_mass = tl.sum(sums, 1)  # indexed by row r
                    r_following = tl.sum(tl.where(rows[None, :] == rows[:, None] + 1, row_mass[None, :], 0.0), 1)
                    t_star, scale = _block_tau(p_next, r_following, u, rows, n_eff)
                    needs_residual = t_star < n_eff
                    res_slot = b * residual_rows + t_star
                    m_w = _pick(row_max, rows, t_star)
                    s_w = _pick(row_sum, rows, t_star)
                    thr_w = _pick(thr, rows, t_star)
                    row = cu_lo + b + t_star
                    row_ok = (row >= 0) & (row < num_rows)
                    row_ptr = logits_ptr + row * logits_row_stride
                    p_ptr = draft_probs_ptr + (cu_lo + t_star) * draft_probs_row_stride
            token = _pick(argmax, rows, t_star)
            if not greedy:
                token = tl.full([], -1, tl.int32)
                if needs_residual:
                    table_r_row = table_r_ptr + res_slot * num_chunks
                    chunk = race_winner(table_r_row, table_r_row, num_chunks, m_w, k, seed, offset,
                                         t_star, False, CHUNKS_PAD, STREAM_SAMPLE)
                    token = _sample_in_chunk(row_ptr, p_ptr, chunk, vocab_size, row_ok, k, -1, m_w,
                                             s_w, seed, offset, t_star, True, CHUNK, STREAM_SAMPLE, scale,
                                             thr_w, HAS_FILTERS)
                if token < 0:
                    # q's own sample of row t*: the bonus, an invalid draft's row, or a residual
                    # with no mass (q == p up to rounding), with the same noise.
                    slot_star = b * (max_spec_len + 1) + t_star
                    table_m_row, table_w_row = row_table(table_m_ptr, table_w_ptr, slot_star, cmax_ptr, kept_w_ptr,
                                                          kept_z_ptr, slot_star, num_chunks, HAS_FILTERS)
                    chunk = race_winner(table_m_row, table_w_row, num_chunks, m_w, k, seed, offset, t_star, True,
                                         CHUNKS_PAD, STREAM_SAMPLE)
                    token = _sample_in_chunk(row_ptr, p_ptr, chunk, vocab_size, row_ok, k, -1, m_w,
                                             s_w, seed, offset, t_star, False, CHUNK, STREAM_SAMPLE, 1.0,
                                             thr_w, HAS_FILTERS)
            _write_outputs(b, t_star, drafts, token, out_tokens_ptr, out_num_accepted_ptr,
                           max_spec_len, ROWS_PAD)
            tl.store(counter_ptr + b, 0)
            tl.store(counter_ptr + num_requests + b, 0)
    if HAS_DRAFT_PROBS:
        finished = tl.atomic_add(counter_ptr + 2 * num_requests + 1, 1, sem="acq_rel")
        if finished == units_total - 1:
            tl.store(counter_ptr + 2 * num_requests, 0)
            tl.store(counter_ptr + 2 * num_requests + 1, 0)


# --------------------------------------------------------------------------- launcher


def wide_logit_rows(logits_dtype: torch.dtype, has_draft_probs: bool, num_rows: int, has_filters: bool) -> bool:
    """Calls whose splits aim at PROGRAMS_PER_SM_WIDE programs per SM: 4-byte logits with draft
    probabilities and at least 640 rows (B = 128 at K = 4), unfiltered (DECISIONS.md,
    "triton-programs-per-sm")."""
    return logits_dtype.itemsize == 4 and has_draft_probs and num_rows >= 640 and not has_filters


def programs_per_sm(cfg: _config.VerifyConfig, logits_dtype: torch.dtype, has_draft_probs: bool, num_rows: int,
                    has_filters: bool) -> int:
    """The programs per SM a call's row split aims at: the config's, or the shipped rule."""
    if cfg.programs_per_sm is not None:
        return cfg.programs_per_sm
    wide = wide_logit_rows(logits_dtype, has_draft_probs, num_rows, has_filters)
    return PROGRAMS_PER_SM_WIDE if wide else PROGRAMS_PER_SM


def rejection_sample_triton(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor | None,
    max_spec_len: int,
    num_splits: int | None = None,
    method: str = "token",
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    config: _config.VerifyConfig | None = None,
    filter_config: _config.FilterConfig | None = None,
    lenience: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused kernel (after the threshold pass of ``filters`` when a filter is given).
    Inputs are assumed validated (``specdec_kernels._ops``); the vocabulary dim of
    ``target_logits`` and ``draft_probs`` must be contiguous. ``config`` / ``filter_config``:
    launch parameters (None = ``config.active()``). ``lenience``: float32 [B] or None (exact;
    the kernel is then compiled without it)."""
    cfg = config or _config.active()[0]
    if method not in ("token", "block"):
        raise ValueError(f"method must be 'token' or 'block', got {method!r}")
    if lenience is not None and method != "token":
        raise ValueError("lenience is not defined for method='block': pass lenience=None, or method='token'")
    device = target_logits.device
    R, V = target_logits.shape
    B = cu_num_draft_tokens.shape[0] - 1
    L = int(max_spec_len)
    out_tokens = torch.empty((B, L + 1), dtype=torch.int32, device=device)
    num_accepted = torch.empty((B,), dtype=torch.int32, device=device)
    if B == 0:
        return out_tokens, num_accepted
    num_chunks = triton.cdiv(max(V, 1), SAMPLE_CHUNK)
    num_groups = triton.cdiv(num_chunks, cfg.group)
    has_draft_probs = draft_probs is not None
    has_filters = top_k is not None or top_p is not None or min_p is not None
    per_sm = programs_per_sm(cfg, target_logits.dtype, has_draft_probs, R, has_filters)
    num_splits, groups_per_split = row_split(device, R, num_groups, num_splits, per_sm)
    # The residual reads one row per request: split it so the phase keeps the GPU busy too.
    residual_splits, residual_groups_per_split = row_split(device, B, num_groups, None, per_sm)
    # Block verification with draft probabilities needs every draft row's residual.
    residual_rows = max(L, 1) if method == "block" else 1
    units_phase1 = B * (L + 1) * num_splits
    units_phase2 = B * residual_rows * residual_splits if has_draft_probs else 0
    units_total = units_phase1 + units_phase2
    # Records: (max, sum) per unit in f32, argmax per unit in i32; chunk tables (max, total)
    # per (request, position) slot; residual tables and residual masses per (request, residual
    # row); the draft token's logit and draft probability per slot.
    slots = B * (L + 1)
    n_table = slots * num_chunks
    n_residual = B * residual_rows * num_chunks
    n_records = 2 * units_phase1 + 2 * n_table + n_residual + B * residual_rows * residual_splits
    n_f32 = n_records + 2 * slots
    # Sampling filters: the threshold pass's workspace follows (per slot (request, row)).
    flt_f32, flt_i32 = (threshold_workspace_sizes(slots, num_groups, num_chunks, filter_config) if has_filters
                        else (0, 0))
    f32, i32, counters = workspace(device, n_f32 + flt_f32, units_phase1 + flt_i32, 2 * B + 2)
    filt = (f32,) * 5  # unused without filters
    if has_filters:
        filt = launch_row_thresholds(
            f32[n_f32:n_f32 + flt_f32], i32[units_phase1:units_phase1 + flt_i32], target_logits,
            cu_num_draft_tokens, temperature, top_k, top_p, min_p, tree=False, num_requests=B, slots=slots,
            max_rows=L + 1, num_splits=num_splits, num_groups=num_groups, num_warps=cfg.num_warps,
            excluded_drafts=None if has_draft_probs else draft_token_ids, config=filter_config)
    use_pdl = pdl_enabled(device)
    rec_m = f32[:units_phase1]
    rec_s = f32[units_phase1:2 * units_phase1]
    table_m = f32[2 * units_phase1:2 * units_phase1 + n_table]
    table_w = f32[2 * units_phase1 + n_table:2 * units_phase1 + 2 * n_table]
    table_r = f32[2 * units_phase1 + 2 * n_table:2 * units_phase1 + 2 * n_table + n_residual]
    residual_sum = f32[2 * units_phase1 + 2 * n_table + n_residual:n_records]
    rec_lx = f32[n_records:n_records + slots]
    rec_px = f32[n_records + slots:n_f32]
    _rejection_sample_kernel[(units_total,)](
        target_logits, target_logits.stride(0),
        draft_token_ids, draft_token_ids.shape[0],
        cu_num_draft_tokens,
        draft_probs if has_draft_probs else target_logits,
        draft_probs.stride(0) if has_draft_probs else 0,
        temperature if temperature is not None else seeds,
        seeds,
        offsets if offsets is not None else seeds,
        lenience if lenience is not None else seeds,
        out_tokens, num_accepted,
        rec_m, rec_s, i32, rec_lx, rec_px, table_m, table_w, table_r, residual_sum, counters,
        *filt,
        B, R, V, L,
        num_splits, groups_per_split, residual_splits, residual_groups_per_split, residual_rows, num_groups,
        num_chunks, units_phase1, units_total,
        HAS_DRAFT_PROBS=has_draft_probs,
        HAS_TEMPERATURE=temperature is not None,
        HAS_OFFSETS=offsets is not None,
        BLOCK_VERIFY=method == "block",
        ROWS_PAD=triton.next_power_of_2(L + 1),
        # Pads both split counts: the block finalizer sums every residual split's mass.
        SPLITS_PAD=triton.next_power_of_2(max(num_splits, residual_splits)),
        CHUNKS_PAD=triton.next_power_of_2(num_chunks),
        CHUNK=SAMPLE_CHUNK,
        GROUP=cfg.group,
        STREAM_ACCEPT=STREAM_ACCEPT,
        STREAM_SAMPLE=STREAM_SAMPLE,
        HAS_FILTERS=has_filters,
        # Every request with max_spec_len drafts (the padded wrapper, an engine at one K): rows
        # are guessed before the offsets arrive. Filtered rows read their threshold first.
        UNIFORM=draft_token_ids.shape[0] == B * L and not has_filters,
        USE_PDL=use_pdl,
        ASM_TABLE=asm_table_enabled(device, cfg.asm_table),
        PREFETCH=prefetch_tiles(device, target_logits.dtype, cfg.prefetch),
        FAST_EXP=not has_filters,
        HAS_LENIENCE=lenience is not None,
        num_warps=cfg.num_warps,
        **({"launch_pdl": True} if use_pdl else {}),
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg > 0 and not has_filters else {}),
    )
    return out_tokens, num_accepted
