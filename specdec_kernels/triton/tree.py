"""Fused Triton kernel for tree verification: ``_tree_rejection_sample_kernel`` -> launcher.

One launch per call. Phase 1 is the chain kernel's stream (``stream``,
``stream_split``: half-chunk tiles, the FMA exponent, the L2 prefetch, the register cap; a
split's first tile is loaded before its request is found): one
program per (node row, split) streams the row once and writes its record (max, sum of
exp2((l - max) k), greedy argmax) and, for random requests, its chunk table. The program that
finishes a request last (an atomic counter) walks the request's tree exactly as the reference
does (docs/ALGORITHM.md §5): children in index order; deterministic drafts shrink the
residual to q without the rejected children, draft probabilities to (q - a p)+ with one
scalar a per node (a pass over the node's rows per rejection). The final token comes from
the node's chunk table (chunks holding excluded tokens are recomputed exactly) or, with draft
probabilities, from a residual table written by one more pass. One extra program per request
writes the outputs of requests without nodes.

This first version walks with scalar, dependent loads; it is tested against the reference
(interpreter in CI). The walk's decisions can all be made in parallel (a child's test depends
only on its earlier siblings), which is the planned fast path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.philox import SAMPLE_CHUNK, STREAM_ACCEPT, STREAM_SAMPLE
from . import config as _config
from .common import (CU_BLOCK, PROGRAMS_PER_SM, asm_table_enabled, open_uniform, owner_request, philox_words,
                     prefetch_tiles, request_lenience, row_split, sanitize, sanitized_cu, uniform, workspace)
from .filters import launch_row_thresholds, threshold_workspace_sizes
from .stream import first_tile, kept_set_record, row_table, stream_split, tile_lanes

NODE_BLOCK = 64  # nodes scanned per step when looking for children
# Unfiltered tree calls take the chain kernel's register cap too: the stream is the chain
# kernel's (``stream.stream_split``), whose loop is written for that cap (DECISIONS.md,
# "triton-tree-chain-stream").


@triton.jit
def _node_stats(rec_m_ptr, rec_s_ptr, rec_am_ptr, row, num_splits, k, SPLITS_PAD: tl.constexpr):
    """Row max, sum of exp2((l - max) k) and first argmax of one node, from its split records."""
    s = tl.arange(0, SPLITS_PAD)
    mask = s < num_splits
    m = tl.load(rec_m_ptr + row * num_splits + s, mask=mask, other=float("-inf"), cache_modifier=".cg")
    sv = tl.load(rec_s_ptr + row * num_splits + s, mask=mask, other=0.0, cache_modifier=".cg")
    am = tl.load(rec_am_ptr + row * num_splits + s, mask=mask, other=-1, cache_modifier=".cg")
    row_max = tl.max(m, 0)
    live = m > float("-inf")
    row_sum = tl.sum(tl.where(live, sv * tl.exp2((m - row_max) * k), 0.0), 0)
    argmax = tl.min(tl.where(live & (m == row_max), am, 2147483647), 0)
    return row_max, row_sum, tl.where(row_max > float("-inf"), argmax, -1)


@triton.jit
def _node_threshold(thr_ptr, row, HAS_FILTERS: tl.constexpr):
    """The filter threshold of a node's row (-inf: unfiltered; the records and the chunk table
    already leave out what it filters)."""
    thr = tl.full([], float("-inf"), tl.float32)
    if HAS_FILTERS:
        thr = tl.load(thr_ptr + row)
    return thr


@triton.jit
def _next_child(parents_ptr, cu_lo, n, v, after, NODE_BLOCK: tl.constexpr):
    """The first child of local node v with local index > after, -1 if none. A parent link
    counts only if 0 <= parent < child (the reference's rule)."""
    found = tl.full([], -1, tl.int64)
    start = after + 1
    while (found < 0) & (start < n):
        idx = start + tl.arange(0, NODE_BLOCK)
        par = tl.load(parents_ptr + cu_lo + idx, mask=idx < n, other=-1).to(tl.int64)
        hit = (idx < n) & (par == v) & (par < idx)
        first = tl.min(tl.where(hit, idx, 2147483647), 0)
        found = tl.where(first < 2147483647, first, -1)
        start += NODE_BLOCK
    return found


@triton.jit
def _is_child_token(lanes, tokens_ptr, parents_ptr, cu_lo, n, v, vocab_size, NODE_BLOCK: tl.constexpr):
    """For a vector of vocabulary lanes: True where the lane is the (valid) token of a child of
    v -- the residual excludes exactly those once all of v's children were rejected."""
    # Nodes 8 at a time: a [lanes, NODE_BLOCK] match would hold 128 values a thread for a chunk's
    # 256 lanes, and ptxas then compiles the whole kernel to 32 registers and a 3.6 KB stack.
    CHILD_BLOCK: tl.constexpr = 8
    hit = tl.zeros(lanes.shape, tl.int1)
    for start in range(1, n, CHILD_BLOCK):
        idx = start + tl.arange(0, CHILD_BLOCK)
        par = tl.load(parents_ptr + cu_lo + idx, mask=idx < n, other=-1).to(tl.int64)
        tok = tl.load(tokens_ptr + cu_lo + idx, mask=idx < n, other=-1).to(tl.int64)
        child = (idx < n) & (par == v) & (par < idx) & (tok >= 0) & (tok < vocab_size)
        match = (lanes[:, None] == tok[None, :]) & child[None, :]
        hit = hit | (tl.max(match.to(tl.int32), 1) > 0)
    return hit


@triton.jit
def _residual_mass(row_ptr, p_ptr, vocab_size, row_max, row_sum, k, a, thr, BLOCK: tl.constexpr,
                   FILTERED: tl.constexpr):
    """sum_x max(q(x) - a p(x), 0) over a node's rows (q = exp2((l - max) k) / sum, 0 below the
    threshold ``thr`` with FILTERED)."""
    total = tl.zeros([], tl.float32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_row = offs < vocab_size
        lg = sanitize(tl.load(row_ptr + offs, mask=in_row, other=float("-inf")).to(tl.float32))
        if FILTERED:
            lg = tl.where(lg >= thr, lg, float("-inf"))
        q = tl.exp2((lg - row_max) * k) / row_sum
        p = tl.load(p_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
        r = tl.where(q > 0.0, tl.maximum(q - a * p, 0.0), 0.0)
        total += tl.sum(tl.where(r == r, r, 0.0), 0)
    return total


@triton.jit
def _tree_final_token(
    row_ptr, p_ptr, table_m_row, table_w_row, table_r_row, tokens_ptr, parents_ptr, cu_lo, n, v,
    exclude_children, a, row_max, row_sum, k, seed, offset, vocab_size, num_chunks, thr,
    HAS_DRAFT_PROBS: tl.constexpr, CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr,
    NODE_BLOCK: tl.constexpr, STREAM_SAMPLE: tl.constexpr, FILTERED: tl.constexpr,
):
    """Sample the residual at node v (local index = its sampling node): the chunk race, then the
    inverse CDF in the winning chunk. -1 if the residual and q both have no mass. With FILTERED,
    q is 0 below the row's threshold ``thr`` (the chunk table is already restricted)."""
    c = tl.arange(0, CHUNKS_PAD)
    in_table = c < num_chunks
    lane = tl.arange(0, CHUNK)
    if HAS_DRAFT_PROBS:
        # (q - a p)+ per chunk; a = 0 is q itself, whose table phase 1 already wrote.
        residual = a > 0.0
        if residual:
            for ch in range(0, num_chunks):
                offs = ch * CHUNK + lane
                in_row = offs < vocab_size
                lg = sanitize(tl.load(row_ptr + offs, mask=in_row, other=float("-inf")).to(tl.float32))
                if FILTERED:
                    lg = tl.where(lg >= thr, lg, float("-inf"))
                q = tl.exp2((lg - row_max) * k) / row_sum
                p = tl.load(p_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
                r = tl.where(q > 0.0, tl.maximum(q - a * p, 0.0), 0.0)
                tl.store(table_r_row + ch, tl.sum(tl.where(r == r, r, 0.0), 0))
            tl.debug_barrier()
            w = tl.load(table_r_row + c, mask=in_table, other=0.0, cache_modifier=".cg")
            score = tl.log2(w)
        else:
            w = tl.load(table_w_row + c, mask=in_table, other=0.0, cache_modifier=".cg")
            m = tl.load(table_m_row + c, mask=in_table, other=float("-inf"), cache_modifier=".cg")
            score = tl.log2(w) + (m - row_max) * k
    else:
        w = tl.load(table_w_row + c, mask=in_table, other=0.0, cache_modifier=".cg")
        m = tl.load(table_m_row + c, mask=in_table, other=float("-inf"), cache_modifier=".cg")
        if exclude_children:
            # Chunks holding a rejected child's token: recompute their totals without them.
            for start in range(1, n, NODE_BLOCK):
                idx = start + tl.arange(0, NODE_BLOCK)
                par = tl.load(parents_ptr + cu_lo + idx, mask=idx < n, other=-1).to(tl.int64)
                tok = tl.load(tokens_ptr + cu_lo + idx, mask=idx < n, other=-1).to(tl.int64)
                child = (idx < n) & (par == v) & (par < idx) & (tok >= 0) & (tok < vocab_size)
                for j in range(0, NODE_BLOCK):
                    tj = tl.sum(tl.where(tl.arange(0, NODE_BLOCK) == j, tok, 0), 0)
                    cj = tl.sum(tl.where(tl.arange(0, NODE_BLOCK) == j, child.to(tl.int32), 0), 0)
                    if cj > 0:
                        ch = tj // CHUNK
                        offs = ch * CHUNK + lane
                        lg = sanitize(tl.load(row_ptr + offs, mask=offs < vocab_size,
                                               other=float("-inf")).to(tl.float32))
                        if FILTERED:
                            lg = tl.where(lg >= thr, lg, float("-inf"))
                        m_c = tl.max(lg, 0)
                        wl = tl.exp2((lg - tl.where(m_c > float("-inf"), m_c, 0.0)) * k)
                        out = _is_child_token(offs, tokens_ptr, parents_ptr, cu_lo, n, v, vocab_size, NODE_BLOCK)
                        w = tl.where(c == ch, tl.sum(tl.where(out, 0.0, wl), 0), w)
        score = tl.log2(w) + (m - row_max) * k
    w0, w1 = philox_words(seed, offset, STREAM_SAMPLE, v, c)
    score = tl.where(w > 0.0, score - tl.log2(-tl.log2(open_uniform(w1))), float("-inf"))
    best = tl.max(score, 0)
    chunk = tl.min(tl.where(score == best, c, 2147483647), 0)
    chunk = tl.where(best > float("-inf"), chunk, -1)
    # Inverse CDF inside the winning chunk, with the same weights.
    offs = chunk * CHUNK + lane
    in_row = (offs < vocab_size) & (chunk >= 0)
    lg = sanitize(tl.load(row_ptr + offs, mask=in_row, other=float("-inf")).to(tl.float32))
    if FILTERED:
        lg = tl.where(lg >= thr, lg, float("-inf"))
    q = tl.exp2((lg - row_max) * k) / row_sum
    if HAS_DRAFT_PROBS:
        p = tl.load(p_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
        wl = tl.where(q > 0.0, tl.maximum(q - a * p, 0.0), 0.0)
        wl = tl.where(wl == wl, wl, 0.0)
    else:
        wl = q
        if exclude_children:
            wl = tl.where(_is_child_token(offs, tokens_ptr, parents_ptr, cu_lo, n, v, vocab_size, NODE_BLOCK),
                          0.0, wl)
    prefix = tl.cumsum(wl, 0)
    total = tl.max(prefix, 0)
    u0, u1 = philox_words(seed, offset, STREAM_SAMPLE, v, chunk)
    token = tl.min(tl.where((wl > 0.0) & (prefix >= uniform(u0) * total), offs, 2147483647), 0)
    return tl.where((chunk >= 0) & (token < 2147483647), token, -1)


@triton.jit
def _tree_rejection_sample_kernel(
    logits_ptr, logits_row_stride, tokens_ptr, parents_ptr, cu_ptr,
    draft_probs_ptr, draft_probs_row_stride,
    temperature_ptr, seeds_ptr, offsets_ptr, lenience_ptr,
    out_tokens_ptr, out_nodes_ptr, out_num_accepted_ptr,
    rec_m_ptr, rec_s_ptr, rec_am_ptr, table_m_ptr, table_w_ptr, table_r_ptr, counter_ptr,
    thr_ptr, cmax_ptr, kept_w_ptr, kept_m_ptr, kept_z_ptr,
    num_requests, num_nodes, vocab_size, max_depth,
    num_splits, groups_per_split, num_groups, num_chunks, units_phase1,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    DEPTH_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr,
    CHUNK: tl.constexpr, GROUP: tl.constexpr, NODE_BLOCK: tl.constexpr, CU_BLOCK: tl.constexpr,
    STREAM_ACCEPT: tl.constexpr, STREAM_SAMPLE: tl.constexpr,
    HAS_FILTERS: tl.constexpr,
    ASM_TABLE: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
    FAST_EXP: tl.constexpr = False,  # unfiltered calls only (the launcher's rule)
    HAS_LENIENCE: tl.constexpr = False,
):
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    unit = tl.program_id(0)
    # Phase-1 units are (node row, split); the others one per request (below).
    row = (unit // num_splits).to(tl.int64)
    s_idx = unit % num_splits
    # Phase 1 streams the chain kernel's way (``stream_split``).
    lane, chunk_in_group = tile_lanes(CHUNK, GROUP)
    first_raw = None
    first_raw_hi = None
    if not HAS_FILTERS:
        # A unit's row is known before its request: the split's first tile is loaded before the
        # request's offsets are searched (a unit past phase 1 loads nothing).
        first_raw, first_raw_hi = first_tile(logits_ptr + row * logits_row_stride, s_idx * groups_per_split, lane,
                                              chunk_in_group, vocab_size, unit < units_phase1, CHUNK, GROUP)
    if unit < units_phase1:
        b = owner_request(cu_ptr, row, num_requests, CU_BLOCK)
    else:
        row = tl.full([], -1, tl.int64)
        s_idx = 0
        b = unit - units_phase1
    cu_lo = sanitized_cu(cu_ptr, b, num_requests, num_nodes, CU_BLOCK)
    n = sanitized_cu(cu_ptr, b + 1, num_requests, num_nodes, CU_BLOCK) - cu_lo
    if b < num_requests:
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
        depth_lanes = tl.arange(0, DEPTH_PAD)
        finalize = unit < 0
        if unit >= units_phase1:
            # A request without nodes has no root: it emits nothing.
            if n <= 0:
                tl.store(out_tokens_ptr + b * (max_depth + 1) + depth_lanes, tl.full([DEPTH_PAD], -1, tl.int32),
                         mask=depth_lanes <= max_depth)
                tl.store(out_nodes_ptr + b * (max_depth + 1) + depth_lanes, tl.full([DEPTH_PAD], -1, tl.int32),
                         mask=depth_lanes <= max_depth)
                tl.store(out_num_accepted_ptr + b, 0)
        elif (row >= cu_lo) & (row < cu_lo + n):
            # Phase 1: stream this split of the node's row (the chain kernel's stream).
            row_ptr = logits_ptr + row * logits_row_stride
            g_lo = s_idx * groups_per_split
            g_hi = tl.minimum(g_lo + groups_per_split, num_groups)
            table_m_row = table_m_ptr + row * num_chunks
            table_w_row = table_w_ptr + row * num_chunks
            # Sampling filters: logits below the row's threshold count as -inf, chunks whose
            # max is below it are not read, and a row whose whole kept set the threshold pass
            # held (kept_z > 0) is not read at all (``filters``).
            thr_row = _node_threshold(thr_ptr, row, HAS_FILTERS)
            kept_z = tl.zeros([], tl.float32)
            if HAS_FILTERS:
                kept_z = tl.load(kept_z_ptr + row)
            if kept_z > 0.0:
                # Its statistics are the pass's, its chunk table too (``row_table``).
                m_run, s_run, am_run = kept_set_record(kept_m_ptr, kept_z, row, s_idx)
            else:
                m_run, s_run, am_run = stream_split(
                    row_ptr, True, g_lo, g_hi, vocab_size, cmax_ptr + row * num_chunks, thr_row, lane,
                    chunk_in_group, k, greedy, tl.full([], -1, tl.int32), table_m_row, table_w_row, num_chunks,
                    CHUNK, GROUP, HAS_FILTERS, first_raw, not HAS_FILTERS, first_raw_hi, ASM_TABLE,
                    PREFETCH, FAST_EXP)
            rec = row * num_splits + s_idx
            tl.store(rec_m_ptr + rec, m_run)
            tl.store(rec_s_ptr + rec, s_run)
            tl.store(rec_am_ptr + rec, am_run)
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + b, 1, sem="acq_rel") + 1
            finalize = done == n * num_splits
        if finalize:
            tl.debug_barrier()
            # The walk (docs/ALGORITHM.md §5), from the root; lenient requests relax its tests (§8).
            lam = request_lenience(lenience_ptr, b, HAS_LENIENCE)
            v = tl.zeros([], tl.int64)
            depth = tl.zeros([], tl.int32)
            out_tok = tl.full([DEPTH_PAD], -1, tl.int64)
            out_node = tl.where(depth_lanes == 0, 0, -1).to(tl.int64)
            row_max, row_sum, argmax = _node_stats(rec_m_ptr, rec_s_ptr, rec_am_ptr, cu_lo, num_splits, k, SPLITS_PAD)
            thr = _node_threshold(thr_ptr, cu_lo, HAS_FILTERS)
            a = tl.zeros([], tl.float32)      # draft probabilities: residual (q - a p)+
            mass = tl.full([], 1.0, tl.float32)  # its total (exactly 1 while a = 0)
            q_out = tl.zeros([], tl.float32)  # deterministic drafts: q of the rejected children
            cand = tl.where(max_depth > 0, _next_child(parents_ptr, cu_lo, n, v, v, NODE_BLOCK), -1)
            while cand >= 0:
                x = tl.load(tokens_ptr + cu_lo + cand).to(tl.int64)
                x_ok = (x >= 0) & (x < vocab_size)
                vrow = cu_lo + v
                lx = sanitize(tl.load(logits_ptr + vrow * logits_row_stride + x, mask=x_ok,
                                       other=NEG_INF).to(tl.float32))
                q_x = tl.where(x_ok & (lx > NEG_INF) & (row_max > NEG_INF) & (lx >= thr),
                               tl.exp2((lx - row_max) * k) / row_sum, 0.0)
                a0, a1 = philox_words(seed, offset, STREAM_ACCEPT, cand, 0)
                u = uniform(a0)
                dup = x < -1
                if greedy:
                    accept = x_ok & (x == argmax)
                    if HAS_LENIENCE:
                        # Also a child within ln(l) of the row max (l < 1; l = 1 is the exact rule).
                        accept = accept | (x_ok & (lx - row_max >= tl.where(lam < 1.0, tl.log(lam), float("inf"))))
                else:
                    if HAS_DRAFT_PROBS:
                        p_x = tl.load(draft_probs_ptr + vrow * draft_probs_row_stride + x, mask=x_ok,
                                      other=0.0).to(tl.float32)
                        if HAS_LENIENCE:
                            accept = x_ok & (u * (lam * p_x) * mass < tl.maximum(q_x - a * p_x, 0.0))
                        else:
                            accept = x_ok & (u * p_x * mass < tl.maximum(q_x - a * p_x, 0.0))
                    else:
                        # A repeated sibling token was already rejected: its residual mass is 0.
                        dup = tl.sum(_is_child_token(tl.zeros([1], tl.int64) + x, tokens_ptr, parents_ptr, cu_lo,
                                                     cand, v, vocab_size, NODE_BLOCK).to(tl.int32), 0) > 0
                        if HAS_LENIENCE:
                            accept = x_ok & (not dup) & (u * lam * (1.0 - q_out) < q_x)
                        else:
                            accept = x_ok & (not dup) & (u * (1.0 - q_out) < q_x)
                if accept:
                    out_tok = tl.where(depth_lanes == depth, x, out_tok)
                    depth += 1
                    out_node = tl.where(depth_lanes == depth, cand, out_node)
                    v = cand
                    row_max, row_sum, argmax = _node_stats(rec_m_ptr, rec_s_ptr, rec_am_ptr, cu_lo + v, num_splits,
                                                           k, SPLITS_PAD)
                    thr = _node_threshold(thr_ptr, cu_lo + v, HAS_FILTERS)
                    a = tl.zeros([], tl.float32)
                    mass = tl.full([], 1.0, tl.float32)
                    q_out = tl.zeros([], tl.float32)
                    cand = tl.where(depth < max_depth, _next_child(parents_ptr, cu_lo, n, v, v, NODE_BLOCK), -1)
                else:
                    if x_ok & (not greedy):
                        if HAS_DRAFT_PROBS:
                            if HAS_LENIENCE:
                                a = a + lam * mass  # the residual loses l p_v per rejection
                            else:
                                a = a + mass
                            mass = _residual_mass(logits_ptr + vrow * logits_row_stride,
                                                  draft_probs_ptr + vrow * draft_probs_row_stride, vocab_size,
                                                  row_max, row_sum, k, a, thr, GROUP * CHUNK, HAS_FILTERS)
                        else:
                            q_out += tl.where(dup, 0.0, q_x)
                    cand = _next_child(parents_ptr, cu_lo, n, v, cand, NODE_BLOCK)
            token = argmax
            if not greedy:
                vrow = cu_lo + v
                table_m_row, table_w_row = row_table(table_m_ptr, table_w_ptr, vrow, cmax_ptr, kept_w_ptr,
                                                      kept_z_ptr, vrow, num_chunks, HAS_FILTERS)
                token = _tree_final_token(
                    logits_ptr + vrow * logits_row_stride, draft_probs_ptr + vrow * draft_probs_row_stride,
                    table_m_row, table_w_row, table_r_ptr + b * num_chunks, tokens_ptr, parents_ptr, cu_lo, n, v,
                    depth < max_depth, a, row_max, row_sum, k, seed, offset, vocab_size, num_chunks, thr,
                    HAS_DRAFT_PROBS, CHUNKS_PAD, CHUNK, NODE_BLOCK, STREAM_SAMPLE, HAS_FILTERS)
                if token < 0:
                    # An empty residual (all of q's support rejected, or q == p up to rounding): q.
                    token = _tree_final_token(
                        logits_ptr + vrow * logits_row_stride, draft_probs_ptr + vrow * draft_probs_row_stride,
                        table_m_row, table_w_row, table_r_ptr + b * num_chunks, tokens_ptr, parents_ptr, cu_lo, n,
                        v, False, tl.zeros([], tl.float32), row_max, row_sum, k, seed, offset, vocab_size, num_chunks,
                        thr, HAS_DRAFT_PROBS, CHUNKS_PAD, CHUNK, NODE_BLOCK, STREAM_SAMPLE, HAS_FILTERS)
            out_tok = tl.where(depth_lanes == depth, token, out_tok)
            tl.store(out_tokens_ptr + b * (max_depth + 1) + depth_lanes, out_tok.to(tl.int32),
                     mask=depth_lanes <= max_depth)
            tl.store(out_nodes_ptr + b * (max_depth + 1) + depth_lanes, out_node.to(tl.int32),
                     mask=depth_lanes <= max_depth)
            tl.store(out_num_accepted_ptr + b, depth)
            tl.store(counter_ptr + b, 0)


def tree_rejection_sample_triton(
    target_logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    cu_num_nodes: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor | None,
    max_depth: int,
    num_splits: int | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    config: _config.VerifyConfig | None = None,
    filter_config: _config.FilterConfig | None = None,
    lenience: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused tree kernel (after the threshold pass of ``filters`` when a filter is
    given) on validated inputs (unit stride along the vocabulary). ``config`` /
    ``filter_config``: launch parameters (None = ``config.active()``). ``lenience``: float32 [B]
    or None (exact; the kernel is then compiled without it)."""
    cfg = config or _config.active()[0]
    device = target_logits.device
    N, V = target_logits.shape
    B = cu_num_nodes.shape[0] - 1
    D = int(max_depth)
    out_tokens = torch.empty((B, D + 1), dtype=torch.int32, device=device)
    out_nodes = torch.empty((B, D + 1), dtype=torch.int32, device=device)
    num_accepted = torch.empty((B,), dtype=torch.int32, device=device)
    if B == 0:
        return out_tokens, out_nodes, num_accepted
    num_chunks = triton.cdiv(max(V, 1), SAMPLE_CHUNK)
    num_groups = triton.cdiv(num_chunks, cfg.group)
    num_splits, groups_per_split = row_split(device, N, num_groups, num_splits,
                                             cfg.programs_per_sm or PROGRAMS_PER_SM)
    units_phase1 = N * num_splits
    n_table = N * num_chunks
    n_f32 = 2 * units_phase1 + 2 * n_table + B * num_chunks
    # Sampling filters: the threshold pass's workspace follows (per node row).
    has_filters = top_k is not None or top_p is not None or min_p is not None
    flt_f32, flt_i32 = threshold_workspace_sizes(N, num_groups, num_chunks, filter_config) if has_filters else (0, 0)
    f32, i32, counters = workspace(device, n_f32 + flt_f32, units_phase1 + flt_i32, B + 1)
    filt = (f32,) * 5  # unused without filters
    if has_filters:
        filt = launch_row_thresholds(
            f32[n_f32:n_f32 + flt_f32], i32[units_phase1:units_phase1 + flt_i32], target_logits, cu_num_nodes,
            temperature, top_k, top_p, min_p, tree=True, num_requests=B, slots=N, max_rows=1,
            num_splits=num_splits, num_groups=num_groups, num_warps=cfg.num_warps, cu_block=CU_BLOCK,
            config=filter_config)
    rec_m = f32[:units_phase1]
    rec_s = f32[units_phase1:2 * units_phase1]
    table_m = f32[2 * units_phase1:2 * units_phase1 + n_table]
    table_w = f32[2 * units_phase1 + n_table:2 * units_phase1 + 2 * n_table]
    table_r = f32[2 * units_phase1 + 2 * n_table:n_f32]
    has_draft_probs = draft_probs is not None
    _tree_rejection_sample_kernel[(units_phase1 + B,)](
        target_logits, target_logits.stride(0), tokens, parents, cu_num_nodes,
        draft_probs if has_draft_probs else target_logits,
        draft_probs.stride(0) if has_draft_probs else 0,
        temperature if temperature is not None else seeds, seeds,
        offsets if offsets is not None else seeds,
        lenience if lenience is not None else seeds,
        out_tokens, out_nodes, num_accepted,
        rec_m, rec_s, i32, table_m, table_w, table_r, counters,
        *filt,
        B, N, V, D, num_splits, groups_per_split, num_groups, num_chunks, units_phase1,
        HAS_DRAFT_PROBS=has_draft_probs,
        HAS_TEMPERATURE=temperature is not None,
        HAS_OFFSETS=offsets is not None,
        DEPTH_PAD=triton.next_power_of_2(D + 1),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        CHUNKS_PAD=triton.next_power_of_2(num_chunks),
        CHUNK=SAMPLE_CHUNK, GROUP=cfg.group, NODE_BLOCK=NODE_BLOCK, CU_BLOCK=CU_BLOCK,
        STREAM_ACCEPT=STREAM_ACCEPT, STREAM_SAMPLE=STREAM_SAMPLE,
        HAS_FILTERS=has_filters,
        ASM_TABLE=asm_table_enabled(device, cfg.asm_table),
        PREFETCH=prefetch_tiles(device, target_logits.dtype, cfg.prefetch),
        FAST_EXP=not has_filters,
        HAS_LENIENCE=lenience is not None,
        num_warps=cfg.num_warps,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg > 0 and not has_filters else {}),
    )
    return out_tokens, out_nodes, num_accepted

