"""Fused Triton kernel for chain verification: ``_rejection_sample_kernel`` -> launcher.

One launch per call. The grid has one program per (request, row, split) — a split is a
range of SAMPLE_CHUNK-wide vocabulary chunks of one target row — and, with draft
probabilities, one more program per (request, split) for the residual:

- phase 1 (every row): stream the logits once in their own dtype and keep, per split, the
  row max, the sum of exp2((l - max) * log2e / T), the first argmax, and the sample of the
  row drawn with the chunked sampler of docs/ALGORITHM.md (for deterministic drafts the
  draft token is left out of it: that is the residual; the bonus row leaves nothing out).
  Each program writes one record to the workspace and counts itself on its request.
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

from .philox import NODE_BITS, SAMPLE_CHUNK, STREAM_ACCEPT, STREAM_SAMPLE

LOG2E = 1.4426950408889634
FLT_MAX = 3.4028234663852886e38
BIG_INDEX = 2147483647
NUM_WARPS = 8


@triton.jit
def _philox_words(seed, offset, stream: tl.constexpr, node, lane):
    """Philox4x32-10 words 0 and 1 of counter (lane, stream<<24 | node, offset_lo, offset_hi)."""
    k0 = tl.cast(seed, tl.uint32)
    k1 = tl.cast(seed >> 32, tl.uint32)
    c0 = tl.cast(lane, tl.uint32)  # lane/node may be plain ints in the interpreter
    c1 = (tl.cast(node, tl.uint32) & 0xFFFFFF) | (stream << 24)
    c2 = tl.cast(offset, tl.uint32)
    c3 = tl.cast(offset >> 32, tl.uint32)
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1


@triton.jit
def _uniform(word):
    return (word >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _open_uniform(word):
    return ((word >> 8) + 1).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _sanitize(logits):
    logits = tl.where(logits != logits, float("-inf"), logits)
    return tl.minimum(logits, 3.4028234663852886e38)


@triton.jit
def _sample_chunk(w, offs, seed, offset, node, chunk, STREAM_SAMPLE: tl.constexpr):
    """Chunk candidate (inverse CDF) and race score log2(W) - log2(-log2(v)) of weights ``w``."""
    prefix = tl.cumsum(w, 0)
    total = tl.max(prefix, 0)  # prefix is non-decreasing: its max is the chunk total
    w0, w1 = _philox_words(seed, offset, STREAM_SAMPLE, node, chunk)
    threshold = _uniform(w0) * total
    cand = tl.min(tl.where((w > 0) & (prefix >= threshold), offs, 2147483647), 0)
    score = tl.where(total > 0, tl.log2(total) - tl.log2(-tl.log2(_open_uniform(w1))), float("-inf"))
    return cand, score


@triton.jit
def _request_decision(
    b, n, cu_lo, logits_ptr, logits_row_stride, draft_ids_ptr, num_drafts, draft_probs_ptr,
    draft_probs_row_stride, rec_f32_ptr, rec_i32_ptr, units_phase1, num_rows, vocab_size,
    max_spec_len, num_splits, seed, offset, k, greedy,
    HAS_DRAFT_PROBS: tl.constexpr, ROWS_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    STREAM_ACCEPT: tl.constexpr,
):
    """Combine a request's phase-1 records and run its accept tests, all positions at once.

    Returns (t_star, drafts, row_max, row_sum, argmax, sample) where t_star is the number of
    accepted drafts and the four per-row vectors are indexed by position.
    """
    t = tl.arange(0, ROWS_PAD)
    s = tl.arange(0, SPLITS_PAD)
    rec = (b * (max_spec_len + 1) + t[:, None]) * num_splits + s[None, :]
    rec_mask = (t[:, None] <= n) & (s[None, :] < num_splits)
    m = tl.load(rec_f32_ptr + rec, mask=rec_mask, other=float("-inf"), cache_modifier=".cg")
    sv = tl.load(rec_f32_ptr + units_phase1 + rec, mask=rec_mask, other=0.0, cache_modifier=".cg")
    g = tl.load(rec_f32_ptr + 2 * units_phase1 + rec, mask=rec_mask, other=float("-inf"), cache_modifier=".cg")
    am = tl.load(rec_i32_ptr + rec, mask=rec_mask, other=-1, cache_modifier=".cg")
    cand = tl.load(rec_i32_ptr + units_phase1 + rec, mask=rec_mask, other=-1, cache_modifier=".cg")

    row_max = tl.max(m, 1)
    live = m > float("-inf")
    shift = (m - row_max[:, None]) * k
    row_sum = tl.sum(tl.where(live, sv * tl.exp2(shift), 0.0), 1)
    argmax = tl.min(tl.where(live & (m == row_max[:, None]), am, 2147483647), 1)
    argmax = tl.where(row_max > float("-inf"), argmax, -1)
    score = tl.where(live & (g > float("-inf")), g + shift, float("-inf"))
    best = tl.max(score, 1)
    best_split = tl.min(tl.where(score == best[:, None], s[None, :], 2147483647), 1)
    sample = tl.sum(tl.where(s[None, :] == best_split[:, None], cand, 0), 1)
    sample = tl.where(best > float("-inf"), sample, -1)

    # Accept tests: draft t is tested against row t.
    is_draft = t < n
    d = cu_lo + t
    d_ok = is_draft & (d >= 0) & (d < num_drafts)
    x = tl.load(draft_ids_ptr + d, mask=d_ok, other=-1).to(tl.int64)
    x_ok = d_ok & (x >= 0) & (x < vocab_size)
    row = cu_lo + b + t
    x_ok_row = x_ok & (row >= 0) & (row < num_rows)
    lx = tl.load(logits_ptr + row * logits_row_stride + x, mask=x_ok_row, other=float("-inf")).to(tl.float32)
    lx = _sanitize(lx)
    q_x = tl.where(x_ok_row & (lx > float("-inf")) & (row_max > float("-inf")),
                   tl.exp2((lx - row_max) * k) / row_sum, 0.0)
    if HAS_DRAFT_PROBS:
        p_x = tl.load(draft_probs_ptr + d * draft_probs_row_stride + x, mask=x_ok, other=0.0).to(tl.float32)
    else:
        p_x = tl.full([ROWS_PAD], 1.0, tl.float32)
    a0, a1 = _philox_words(seed, offset, STREAM_ACCEPT, t + 1, tl.zeros([ROWS_PAD], tl.int32))
    u = _uniform(a0)
    if greedy:
        accept = x_ok & (x == argmax)
    else:
        accept = x_ok & (u * p_x < q_x)
    t_star = tl.min(tl.where(is_draft & (accept == 0), t, n), 0)
    return t_star, x, row_max, row_sum, argmax, sample


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
    temperature_ptr, seeds_ptr, offsets_ptr,
    out_tokens_ptr, out_num_accepted_ptr,
    rec_f32_ptr, rec_i32_ptr, counter_ptr,
    num_requests, num_rows, vocab_size, max_spec_len,
    num_splits, chunks_per_split, num_chunks, units_phase1, units_total,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    ROWS_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
    STREAM_ACCEPT: tl.constexpr, STREAM_SAMPLE: tl.constexpr,
):
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
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
        s_idx = (unit - units_phase1) % num_splits
        b = (unit - units_phase1) // num_splits
        t = 0
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
    offs0 = tl.arange(0, CHUNK)
    c_lo = s_idx * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, num_chunks)

    if is_phase1:
        if t <= n:
            row = cu_lo + b + t
            row_ok = (row >= 0) & (row < num_rows)
            row_ptr = logits_ptr + row * logits_row_stride
            excluded = tl.full([], -1, tl.int32)
            if not HAS_DRAFT_PROBS:
                d = cu_lo + t
                if (t < n) & (d >= 0) & (d < num_drafts):
                    excluded = tl.load(draft_ids_ptr + d).to(tl.int32)
            do_sample = not greedy
            m_run = tl.full([], NEG_INF, tl.float32)
            s_run = tl.zeros([], tl.float32)
            am_run = tl.full([], -1, tl.int32)
            g_run = tl.full([], NEG_INF, tl.float32)
            cand_run = tl.full([], -1, tl.int32)
            for c in range(c_lo, c_hi):
                offs = c * CHUNK + offs0
                lg = tl.load(row_ptr + offs, mask=(offs < vocab_size) & row_ok, other=NEG_INF).to(tl.float32)
                lg = _sanitize(lg)
                m_c = tl.max(lg, 0)
                am_c = tl.min(tl.where(lg == m_c, offs, 2147483647), 0)
                w = tl.where(lg > NEG_INF, tl.exp2((lg - m_c) * k), 0.0)
                s_c = tl.sum(w, 0)
                if do_sample:
                    cand_c, score_c = _sample_chunk(tl.where(offs == excluded, 0.0, w), offs, seed,
                                                    offset, t, c, STREAM_SAMPLE)
                else:
                    cand_c = tl.full([], -1, tl.int32)
                    score_c = tl.full([], NEG_INF, tl.float32)
                m_new = tl.maximum(m_run, m_c)
                run_live = m_run > NEG_INF
                c_live = m_c > NEG_INF
                s_run = tl.where(run_live, s_run * tl.exp2((m_run - m_new) * k), 0.0) \
                    + tl.where(c_live, s_c * tl.exp2((m_c - m_new) * k), 0.0)
                am_run = tl.where(m_c > m_run, am_c, am_run)
                g_old = tl.where(run_live, g_run + (m_run - m_new) * k, NEG_INF)
                g_new = tl.where(c_live, score_c + (m_c - m_new) * k, NEG_INF)
                take = g_new > g_old
                g_run = tl.where(take, g_new, g_old)
                cand_run = tl.where(take, cand_c, cand_run)
                m_run = m_new
            rec = (b * (max_spec_len + 1) + t) * num_splits + s_idx
            tl.store(rec_f32_ptr + rec, m_run)
            tl.store(rec_f32_ptr + units_phase1 + rec, s_run)
            tl.store(rec_f32_ptr + 2 * units_phase1 + rec, g_run)
            tl.store(rec_i32_ptr + rec, am_run)
            tl.store(rec_i32_ptr + units_phase1 + rec, cand_run)
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + b, 1, sem="acq_rel")
            if not HAS_DRAFT_PROBS:
                if done == (n + 1) * num_splits - 1:
                    tl.debug_barrier()
                    t_star, drafts, row_max, row_sum, argmax, sample = _request_decision(
                        b, n, cu_lo, logits_ptr, logits_row_stride, draft_ids_ptr, num_drafts,
                        draft_probs_ptr, draft_probs_row_stride, rec_f32_ptr, rec_i32_ptr,
                        units_phase1, num_rows, vocab_size, max_spec_len, num_splits, seed, offset,
                        k, greedy, HAS_DRAFT_PROBS, ROWS_PAD, SPLITS_PAD, STREAM_ACCEPT)
                    rows = tl.arange(0, ROWS_PAD)
                    am_star = _pick(argmax, rows, t_star)
                    sample_star = _pick(sample, rows, t_star)
                    # q minus the rejected draft is empty only if q is a point mass: its argmax.
                    token = tl.where(greedy | (sample_star < 0), am_star, sample_star)
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
        t_star, drafts, row_max, row_sum, argmax, sample = _request_decision(
            b, n, cu_lo, logits_ptr, logits_row_stride, draft_ids_ptr, num_drafts,
            draft_probs_ptr, draft_probs_row_stride, rec_f32_ptr, rec_i32_ptr,
            units_phase1, num_rows, vocab_size, max_spec_len, num_splits, seed, offset,
            k, greedy, HAS_DRAFT_PROBS, ROWS_PAD, SPLITS_PAD, STREAM_ACCEPT)
        rows = tl.arange(0, ROWS_PAD)
        # An invalid draft id at t* (e.g. -1 padding) ends the chain: its row's q sample is final.
        x_star = _pick(drafts, rows, t_star)
        needs_residual = (not greedy) & (t_star < n) & (x_star >= 0) & (x_star < vocab_size)
        res_base = rec_f32_ptr + 3 * units_phase1
        res_idx = b * num_splits + s_idx
        if needs_residual:
            m_star = _pick(row_max, rows, t_star)
            s_star = _pick(row_sum, rows, t_star)
            row = cu_lo + b + t_star
            row_ok = (row >= 0) & (row < num_rows)
            row_ptr = logits_ptr + row * logits_row_stride
            d = cu_lo + t_star
            p_ptr = draft_probs_ptr + d * draft_probs_row_stride
            g_run = tl.full([], NEG_INF, tl.float32)
            cand_run = tl.full([], -1, tl.int32)
            for c in range(c_lo, c_hi):
                offs = c * CHUNK + offs0
                in_row = (offs < vocab_size) & row_ok
                lg = _sanitize(tl.load(row_ptr + offs, mask=in_row, other=NEG_INF).to(tl.float32))
                q = tl.where(lg > NEG_INF, tl.exp2((lg - m_star) * k) / s_star, 0.0)
                p = tl.load(p_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
                r = tl.where(q > 0.0, tl.maximum(q - p, 0.0), 0.0)
                r = tl.where(r == r, r, 0.0)
                cand_c, score_c = _sample_chunk(r, offs, seed, offset, t_star, c, STREAM_SAMPLE)
                take = score_c > g_run
                g_run = tl.where(take, score_c, g_run)
                cand_run = tl.where(take, cand_c, cand_run)
            tl.store(res_base + res_idx, g_run)
            tl.store(rec_i32_ptr + 2 * units_phase1 + res_idx, cand_run)
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + num_requests + b, 1, sem="acq_rel")
        if done == num_splits - 1:
            tl.debug_barrier()
            am_star = _pick(argmax, rows, t_star)
            sample_star = _pick(sample, rows, t_star)
            token = tl.where(greedy, am_star, sample_star)
            if needs_residual:
                s = tl.arange(0, SPLITS_PAD)
                g = tl.load(res_base + b * num_splits + s, mask=s < num_splits, other=NEG_INF,
                            cache_modifier=".cg")
                cand = tl.load(rec_i32_ptr + 2 * units_phase1 + b * num_splits + s,
                               mask=s < num_splits, other=-1, cache_modifier=".cg")
                best = tl.max(g, 0)
                best_split = tl.min(tl.where(g == best, s, 2147483647), 0)
                residual_token = tl.sum(tl.where(s == best_split, cand, 0), 0)
                # A residual with no mass (q == p up to rounding) falls back to q's sample.
                token = tl.where(best > NEG_INF, residual_token, sample_star)
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

_WORKSPACES: dict = {}


def _workspace(device: torch.device, n_f32: int, n_i32: int, n_counters: int):
    """Cached per-device workspace: records (never read before written) and counters (zero
    between calls: the last program resets them). Allocated once, grown when needed. Calls on
    one stream (and graph replays) reuse it safely; two calls running at the same time on two
    streams of one device would share it, which is not supported (docs/API.md)."""
    key = device
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].numel() < n_f32 or ws[1].numel() < n_i32 or ws[2].numel() < n_counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "specdec triton backend: the workspace must grow during CUDA graph capture; "
                "call the op once eagerly with the largest batch before capturing")
        old = ws or (torch.empty(0), torch.empty(0), torch.empty(0))
        ws = (
            torch.empty(max(n_f32, 2 * old[0].numel(), 1 << 16), dtype=torch.float32, device=device),
            torch.empty(max(n_i32, 2 * old[1].numel(), 1 << 16), dtype=torch.int32, device=device),
            torch.zeros(max(n_counters, 2 * old[2].numel(), 1 << 12), dtype=torch.int32, device=device),
        )
        _WORKSPACES[key] = ws
    return ws


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: a few splits so the combine paths are exercised


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused kernel. Inputs are assumed validated (``specdec_kernels.ops``);
    the vocabulary dim of ``target_logits`` and ``draft_probs`` must be contiguous."""
    device = target_logits.device
    R, V = target_logits.shape
    B = cu_num_draft_tokens.shape[0] - 1
    L = int(max_spec_len)
    out_tokens = torch.empty((B, L + 1), dtype=torch.int32, device=device)
    num_accepted = torch.empty((B,), dtype=torch.int32, device=device)
    if B == 0:
        return out_tokens, num_accepted
    num_chunks = triton.cdiv(max(V, 1), SAMPLE_CHUNK)
    if num_splits is None:
        num_splits = triton.cdiv(_target_programs(device), max(R, 1))
    num_splits = max(1, min(num_splits, num_chunks))
    chunks_per_split = triton.cdiv(num_chunks, num_splits)
    num_splits = triton.cdiv(num_chunks, chunks_per_split)
    has_draft_probs = draft_probs is not None
    units_phase1 = B * (L + 1) * num_splits
    units_phase2 = B * num_splits if has_draft_probs else 0
    units_total = units_phase1 + units_phase2
    rec_f32, rec_i32, counters = _workspace(
        device, 3 * units_phase1 + units_phase2, 2 * units_phase1 + units_phase2, 2 * B + 2)
    _rejection_sample_kernel[(units_total,)](
        target_logits, target_logits.stride(0),
        draft_token_ids, draft_token_ids.shape[0],
        cu_num_draft_tokens,
        draft_probs if has_draft_probs else target_logits,
        draft_probs.stride(0) if has_draft_probs else 0,
        temperature if temperature is not None else seeds,
        seeds,
        offsets if offsets is not None else seeds,
        out_tokens, num_accepted,
        rec_f32, rec_i32, counters,
        B, R, V, L,
        num_splits, chunks_per_split, num_chunks, units_phase1, units_total,
        HAS_DRAFT_PROBS=has_draft_probs,
        HAS_TEMPERATURE=temperature is not None,
        HAS_OFFSETS=offsets is not None,
        ROWS_PAD=triton.next_power_of_2(L + 1),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        CHUNK=SAMPLE_CHUNK,
        STREAM_ACCEPT=STREAM_ACCEPT,
        STREAM_SAMPLE=STREAM_SAMPLE,
        num_warps=NUM_WARPS,
    )
    return out_tokens, num_accepted
