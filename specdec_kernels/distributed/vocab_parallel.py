"""Vocabulary-parallel verification (chains and trees) over torch.distributed.

When the target's LM head is tensor-parallel, each rank holds the logits of one contiguous
vocabulary shard ``[vocab_start, vocab_start + V_local)``. Engines usually all-gather the
[rows, V] logits to sample; verification only needs per-row statistics and one sampled token
per request, so here the shards stay where they are and the ranks exchange O(rows) numbers
(plus a few per request and rank) in four small collectives:

1. all_gather of per-row (max, sum of exp((l - max)/T), first argmax) and of each draft's
   (l(x), p(x)) in the row that scores it: every rank then runs the same accept tests
   (docs/ALGORITHM.md §1 / §5) and finds where the chain or the tree walk stops;
2. all_gather of each rank's two edge partial sums of the final row's sampling weights: the
   chunks of 256 entries that straddle shard boundaries get their totals;
3. all_gather of each rank's best chunk of the race (§3) among the chunks that start in its
   shard: the winning chunk;
4. all_reduce(MIN) of the in-chunk inverse-CDF token (each rank offsets its prefix sums by
   the partial sums of the ranks before it inside the chunk).

Trees with draft probabilities add one all_reduce of N numbers per sibling beyond the
first (the residual mass after j rejected siblings depends on the mass after j - 1):
``max_children - 1`` rounds between 1 and 2.

The random streams are keyed by the global vocabulary index (chunk c of the global row), so
every rank draws exactly the noise the single-device op draws, and the outputs equal the
single-device op's on the gathered logits for the same seeds (except at float near-ties);
all ranks return the same outputs.

Local work:

- chain op, CUDA tensors: five fused Triton launches (``triton.vocab_parallel``), one before
  each collective and one after the last -- row statistics and the drafts' values in one
  read of the shard | accept tests, stop row and per-chunk sums of its weights | edge merge
  and chunk race | in-chunk inverse CDF | the final token -- and no other kernel (output
  buffers aside). $SPECDEC_VP_TRITON=1 forces this path on CPU tensors (in Triton's
  interpreter, TRITON_INTERPRET=1: the tests), =0 selects the torch path everywhere;
- tree op, CUDA tensors: the same five fused launches (``triton.vocab_parallel``) -- row
  statistics and the children's values | the walk (every program repeats it from the
  gathered numbers), the stop row and per-chunk sums of its weights | race | pick | final
  token -- plus one launch before each residual-mass all_reduce (draft probabilities);
  $SPECDEC_VP_TRITON as for chains (validated on one GPU with 2 and 4 ranks sharing it:
  python_tests/test_distributed_gpu.py);
- CPU tensors (gloo), float64, or logits / draft probabilities with a non-unit column stride:
  vectorized PyTorch, the same arithmetic (on CUDA tensors its Philox draws are one Triton
  launch, ``_philox01_kernel``; the older row statistics / residual mass / chunk totals
  kernels below need unit strides, which now take the fused path: only their own test
  reaches them).

NCCL on GPUs, gloo on CPUs (gloo also takes CUDA tensors: the tests run several ranks on one
GPU that way, python_tests/test_distributed_gpu.py); no host synchronization inside when the widths (``max_spec_len``
/ ``max_depth``, ``max_children``) and the seeds are given; CUDA-graph capturable.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..checks import INDEX_DTYPES, LOGIT_DTYPES, check_request_params, check_tensor, check_width
from ..reference.philox import (
    SAMPLE_CHUNK,
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    open_uniform_from_word,
    philox_words,
    uniform_from_word,
)
from ..reference import gather_rows, sanitize_logits

try:  # the Triton kernels' Philox, for one fused launch instead of ~340 small torch ops per draw
    import triton

    from ..triton import vocab_parallel as _tvp
except Exception:  # noqa: BLE001 -- triton is optional: the torch Philox is used instead
    triton = None

__all__ = ["rejection_sample_vocab_parallel", "tree_rejection_sample_vocab_parallel"]

_NEG_INF = float("-inf")
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _use_triton(t: torch.Tensor, compute_dtype: torch.dtype) -> bool:
    """The Triton kernels on ``t``'s device: on CUDA tensors, and on CPU tensors in Triton's
    interpreter when forced ($SPECDEC_VP_TRITON=1, or ``_INTERPRET`` that the tests toggle);
    $SPECDEC_VP_TRITON=0 = never (the vectorized torch path everywhere)."""
    if triton is None or compute_dtype != torch.float32:
        return False
    mode = os.environ.get("SPECDEC_VP_TRITON")
    if mode == "0":
        return False
    return t.is_cuda or mode == "1" or _INTERPRET


def _row_stats(logits: torch.Tensor, rows: torch.Tensor, inv_t: torch.Tensor, lo: int, vocab_size: int,
               compute_dtype: torch.dtype):
    """Per entry i, row ``rows[i]`` of the shard (-1: none) at inverse temperature ``inv_t[i]``:
    (max, sum of exp((l - max) * inv_t), first argmax as a global id; -inf, 0, vocab_size without
    a valid logit), logits sanitized (reference.sanitize_logits). One read of the rows."""
    n, v_local = rows.shape[0], logits.shape[1]
    device = logits.device
    if v_local == 0 or n == 0 or logits.shape[0] == 0:
        return (torch.full((n,), _NEG_INF, dtype=compute_dtype, device=device),
                torch.zeros(n, dtype=compute_dtype, device=device),
                torch.full((n,), vocab_size, dtype=torch.int64, device=device))
    rows = torch.where(rows < logits.shape[0], rows, -1).contiguous()
    lg = sanitize_logits(gather_rows(logits, rows).to(compute_dtype))
    lg.masked_fill_((rows < 0)[:, None], _NEG_INF)
    row_max, arg = lg.max(-1)
    shift = torch.where(row_max > _NEG_INF, row_max, 0.0)
    row_sum = ((lg - shift[:, None]) * inv_t[:, None]).exp().sum(-1)
    arg = torch.where(row_max > _NEG_INF, arg + lo, vocab_size)
    return row_max, row_sum, arg


def _residual_mass(logits, probs, row_max, row_sum, inv_t, a, need, compute_dtype):
    """Per row of the shard: sum_x (q(x) - a p(x))+ with q = exp((l - row_max) * inv_t) / row_sum
    (the global statistics); rows where ``need`` is False may return anything."""
    N, v_local = logits.shape
    device = logits.device
    if v_local == 0:
        return torch.zeros(N, dtype=compute_dtype, device=device)
    lg = sanitize_logits(logits.to(compute_dtype))
    shift = torch.where(row_max > _NEG_INF, row_max, 0.0)
    q = ((lg - shift[:, None]) * inv_t[:, None]).exp() / row_sum.clamp(min=torch.finfo(compute_dtype).tiny)[:, None]
    return (q - a[:, None] * probs.to(compute_dtype)).clamp(min=0).sum(-1)


def _philox01(seeds, offsets, stream: int, node, lane) -> tuple[torch.Tensor, torch.Tensor]:
    """Words 0 and 1 of ``philox.philox_words`` (same arguments, broadcast), as int64: one
    Triton launch on CUDA tensors (and in Triton's interpreter), the torch Philox otherwise."""
    seeds, offsets, node, lane = torch.broadcast_tensors(*(t.to(torch.int64) for t in (seeds, offsets, node, lane)))
    if not _use_triton(seeds, torch.float32) or seeds.numel() == 0:
        w0, w1, _, _ = philox_words(seeds, offsets, stream, node, lane)
        return w0, w1
    return _tvp.philox01(seeds, offsets, stream, node, lane)


# all_gather_into_tensor was renamed all_gather_single (torch 2.14 deprecates the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[world, *t.shape]: every rank's ``t`` (same shape and dtype on every rank), gathered
    into one tensor (the concatenated form, which gloo and NCCL both take)."""
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = torch.empty((world * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather_single(out, t, group=group)
    return out.view((world,) + tuple(t.shape))


def rejection_sample_vocab_parallel(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    max_spec_len: int | None = None,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` on vocabulary shards: the same arguments, except that
    ``target_logits`` [N + B, V_local] (and ``draft_probs`` [N, V_local]) hold this rank's
    shard ``[vocab_start, vocab_start + V_local)`` of a vocabulary of ``vocab_size`` entries.

    Every rank must pass the same ``draft_token_ids``, ``cu_num_draft_tokens``,
    ``temperature``, ``seeds``, ``offsets`` and ``max_spec_len`` (seeds absent: rank 0 draws
    them and broadcasts them); shards must tile ``[0, vocab_size)`` in rank order, any sizes
    (V need not be divisible by the world size). Returns the single-device op's outputs,
    identical on every rank: ``output_token_ids`` [B, max_spec_len + 1] and ``num_accepted``
    [B], int32.
    """
    check_tensor("target_logits", target_logits, ndim=2, dtypes=LOGIT_DTYPES)
    device = target_logits.device
    check_tensor("draft_token_ids", draft_token_ids, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    R, v_local = target_logits.shape
    N = draft_token_ids.shape[0]
    B = cu_num_draft_tokens.shape[0] - 1
    if R != N + B:
        raise ValueError(f"target_logits has {R} rows; expected N + B = {N} + {B}")
    if not 0 <= vocab_start <= vocab_start + v_local <= vocab_size:
        raise ValueError(f"the shard [vocab_start, vocab_start + V_local) = [{vocab_start}, {vocab_start + v_local}) "
                         f"must lie in [0, vocab_size = {vocab_size})")
    if draft_probs is not None and tuple(draft_probs.shape) != (N, v_local):
        raise ValueError(f"draft_probs must have shape (N, V_local) = ({N}, {v_local}), got {tuple(draft_probs.shape)}")
    if vocab_size > (1 << 24 if compute_dtype == torch.float32 else 1 << 53):  # ids travel as floats
        raise ValueError(f"vocab_size = {vocab_size} is too large for token ids in {compute_dtype}: use float64")
    if max_spec_len is None:
        max_spec_len = int((cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]).max()) if B else 0
    L = int(max_spec_len)
    if seeds is None:
        seeds = torch.randint(-(2**63), 2**63 - 1, (B,), dtype=torch.int64, device=device)
        dist.broadcast(seeds, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    lo, hi = vocab_start, vocab_start + v_local
    if B > 0 and _use_triton(target_logits, compute_dtype) and target_logits.stride(1) == 1 and \
            (draft_probs is None or draft_probs.stride(1) == 1):
        if offsets is None:
            offsets = torch.zeros(B, dtype=torch.int64, device=device)
        return _chain_fused(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature, seeds,
                            offsets, L, lo, hi, vocab_size, group)
    seeds = seeds.to(torch.int64)
    offsets = torch.zeros(B, dtype=torch.int64, device=device) if offsets is None else offsets.to(torch.int64)

    # ---- local row statistics [B, L+1] and draft positions (the reference's layout) ----------
    cu = cu_num_draft_tokens.to(torch.int64)
    n = (cu[1:] - cu[:-1]).clamp(0, L)
    b_idx = torch.arange(B, device=device)
    t = torch.arange(L + 1, device=device)
    row_idx = cu[:-1, None] + b_idx[:, None] + t[None, :]
    row_ok = (t[None, :] <= n[:, None]) & (row_idx >= 0) & (row_idx < R)
    temp = (torch.ones(B, device=device) if temperature is None else temperature).to(compute_dtype)
    greedy = ~(temp > 0)
    inv_temp = torch.where(greedy, 1.0, 1.0 / temp)
    local_max, local_sum, local_argmax = (v.view(B, L + 1) for v in _row_stats(
        target_logits, torch.where(row_ok, row_idx, -1).view(-1), inv_temp[:, None].expand(B, L + 1).reshape(-1),
        lo, vocab_size, compute_dtype))
    lane = torch.arange(v_local, device=device)

    td = t[:L]
    d_idx = cu[:-1, None] + td[None, :]
    d_ok = (td[None, :] < n[:, None]) & (d_idx >= 0) & (d_idx < N)
    x = torch.where(d_ok, gather_rows(draft_token_ids, d_idx).to(torch.int64), -1)
    x_ok = d_ok & (x >= 0) & (x < vocab_size)
    mine = x_ok & (x >= lo) & (x < hi)
    x_local = (x - lo).clamp(0, max(v_local - 1, 0))
    rows_x = row_idx[:, :L].clamp(0, max(R - 1, 0))
    l_x = torch.where(mine & row_ok[:, :L],
                      sanitize_logits(target_logits[rows_x, x_local].to(compute_dtype)) if v_local and R else 0.0,
                      _NEG_INF)
    if draft_probs is not None:
        p_x = torch.where(mine, draft_probs[d_idx.clamp(0, max(N - 1, 0)), x_local].to(compute_dtype)
                          if v_local and N else 0.0, _NEG_INF)
    else:
        p_x = torch.full_like(l_x, _NEG_INF)

    # ---- collective 1: row statistics and the drafted tokens' values ------------------------
    pad = torch.full((B, 1), _NEG_INF, dtype=compute_dtype, device=device)
    stats = torch.stack([local_max, local_sum, local_argmax.to(compute_dtype),
                         torch.cat([l_x, pad], 1), torch.cat([p_x, pad], 1)], -1)  # [B, L+1, 5]
    gathered = _all_gather(stats, group)  # [W, B, L+1, 5]
    g_max, g_sum, g_am, g_lx, g_px = gathered.unbind(-1)
    row_max = g_max.max(0).values
    live = g_max > _NEG_INF
    row_sum = torch.where(live, g_sum * ((g_max - torch.where(row_max > _NEG_INF, row_max, 0.0)[None])
                                         * inv_temp[None, :, None]).exp(), 0.0).sum(0)
    argmax = torch.where(live & (g_max == row_max[None]), g_am, float(vocab_size)).min(0).values.to(torch.int64)
    argmax = torch.where(row_max > _NEG_INF, argmax, -1)
    lx = g_lx.max(0).values[:, :L]
    px = g_px.max(0).values[:, :L] if draft_probs is not None else torch.ones(B, L, dtype=compute_dtype, device=device)

    # ---- accept tests, identical on every rank ----------------------------------------------
    rm, rs = row_max[:, :L], row_sum[:, :L]
    q_x = torch.where(x_ok & (lx > _NEG_INF) & (rm > _NEG_INF),
                      ((lx - torch.where(rm > _NEG_INF, rm, 0.0)) * inv_temp[:, None]).exp() / rs.clamp(min=1e-38), 0.0)
    a0, _ = _philox01(seeds[:, None], offsets[:, None], STREAM_ACCEPT, td[None, :] + 1, torch.zeros_like(td)[None, :])
    u = uniform_from_word(a0, compute_dtype)
    accept = torch.where(greedy[:, None], x == argmax[:, :L], u * px < q_x) & x_ok
    t_star = accept.to(torch.int64).cumprod(-1).sum(-1) if L else torch.zeros(B, dtype=torch.int64, device=device)
    rejected = t_star < n
    x_star = torch.where(rejected, x[b_idx, t_star.clamp(max=max(L - 1, 0))] if L else -1, -1)
    x_star_ok = (x_star >= 0) & (x_star < vocab_size)

    # ---- the final token from the final row's residual (its weights formed on this shard) -------
    rows_star = torch.where(row_ok[b_idx, t_star], row_idx[b_idx, t_star], -1)
    m_star, s_star = row_max[b_idx, t_star], row_sum[b_idx, t_star]
    if draft_probs is not None and N > 0:
        final = _FinalRows(target_logits, rows_star, m_star, s_star, inv_temp, lo, compute_dtype, probs=draft_probs,
                           prob_rows=(cu[:-1] + t_star).clamp(0, N - 1),
                           a=torch.ones(B, dtype=compute_dtype, device=device), use_residual=rejected & x_star_ok)
        # a residual without mass: q itself, same noise (both rows in the same three collectives)
        token, fallback = _sample_sharded(final, True, seeds, offsets, t_star, lo, hi, vocab_size, group)
        token = torch.where(token < 0, fallback, token)
    else:
        excluded = (lane[None, :] + lo) == x_star[:, None] if draft_probs is None else None
        final = _FinalRows(target_logits, rows_star, m_star, s_star, inv_temp, lo, compute_dtype, excluded=excluded)
        token, _ = _sample_sharded(final, False, seeds, offsets, t_star, lo, hi, vocab_size, group)
        # q minus the draft is empty only for a point mass: its argmax
        token = torch.where(token < 0, argmax[b_idx, t_star], token)
    token = torch.where(greedy, argmax[b_idx, t_star], token)

    out = torch.full((B, L + 1), -1, dtype=torch.int64, device=device)
    out[:, :L] = torch.where(td[None, :] < t_star[:, None], x, -1)
    out.scatter_(1, t_star[:, None], token[:, None])
    return out.to(torch.int32), t_star.to(torch.int32)


def _local_chunks(lo: int, hi: int) -> tuple[int, int]:
    """(first global chunk this shard touches, how many): the first and the last may be shared
    with the neighbouring shards."""
    c_first = lo // SAMPLE_CHUNK
    c_last = (hi - 1) // SAMPLE_CHUNK if hi > lo else c_first - 1
    return c_first, max(c_last - c_first + 1, 0)


def _chain_fused(logits, draft_ids, cu, draft_probs, temperature, seeds, offsets, L, lo, hi, vocab_size, group):
    """The chain op's Triton path: five launches around the four collectives
    (``triton.vocab_parallel``), the same tokens as the torch path below."""
    rank = dist.get_rank(group)
    S = _tvp.row_segments(logits.shape[0], vocab_size, dist.get_world_size(group))
    stats = _tvp.chain_local_stats(logits, draft_probs, draft_ids, cu, temperature, L, lo, vocab_size, S)
    gathered = _all_gather(stats, group)  # collective 1: [W, B (L+1), 3 S + 2]
    c_first, n_chunks = _local_chunks(lo, hi)
    totals, edges, state_i, state_f, out, num_acc = _tvp.chain_final_totals(
        logits, draft_probs, draft_ids, cu, temperature, seeds, offsets, gathered, L, lo, vocab_size, c_first,
        n_chunks)
    all_edges = _all_gather(edges, group)  # collective 2: [W, B', 5]
    race = _tvp.chunk_race(totals, all_edges, state_i, seeds, offsets, rank, lo, hi, c_first)
    all_race = _all_gather(race, group)  # collective 3: [W, B', 2]
    picks = _tvp.chunk_pick(logits, draft_probs, temperature, seeds, offsets, totals, all_edges, all_race, state_i,
                            state_f, rank, lo, hi, c_first, vocab_size)
    dist.all_reduce(picks, op=dist.ReduceOp.MIN, group=group)  # collective 4
    _tvp.chain_finish(picks, state_i, temperature, out, vocab_size)
    return out, num_acc


class _FinalRows:
    """The final rows' sampling weights on this shard, computed from the raw shard on demand
    (never materialized on CUDA): q = exp((l - max) / T) / sum with the global statistics, and
    w = the residual: (q - a p)+ where ``use_residual`` (zero where q = 0, NaN -> 0, as the
    reference), q without the ``excluded`` columns, or q itself.

    logits [*, V_local] with ``rows`` [R] (-1: no row); probs with ``prob_rows`` [R] or None;
    excluded [R, V_local] bool or None; row_max, row_sum, inv_t, a [R] float; use_residual [R].
    """

    def __init__(self, logits, rows, row_max, row_sum, inv_t, lo, compute_dtype, *, probs=None, prob_rows=None,
                 a=None, use_residual=None, excluded=None):
        self.logits, self.rows, self.lo, self.cd = logits, rows.contiguous(), lo, compute_dtype
        self.row_max, self.row_sum, self.inv_t = row_max.contiguous(), row_sum.contiguous(), inv_t.to(compute_dtype)
        self.probs, self.prob_rows, self.excluded = probs, prob_rows, excluded
        self.a, self.use_residual = a, use_residual
        self.R, self.v_local = rows.shape[0], logits.shape[1]

    def entries(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w, q) at the local columns ``cols`` [R, C] (in range)."""
        if self.logits.shape[0] == 0:
            lg = torch.full(cols.shape, _NEG_INF, dtype=self.cd, device=cols.device)
        else:
            lg = sanitize_logits(self.logits[self.rows.clamp(min=0)[:, None], cols].to(self.cd))
            lg = torch.where((self.rows >= 0)[:, None], lg, _NEG_INF)
        shift = torch.where(self.row_max > _NEG_INF, self.row_max, 0.0)
        q = torch.where(lg > _NEG_INF, ((lg - shift[:, None]) * self.inv_t[:, None]).exp()
                        / self.row_sum.clamp(min=torch.finfo(self.cd).tiny)[:, None], 0.0)
        if self.probs is not None:
            p = self.probs[self.prob_rows[:, None], cols].to(self.cd)
            res = torch.where(q > 0, torch.nan_to_num((q - self.a[:, None] * p).clamp(min=0), nan=0.0), 0.0)
            w = torch.where(self.use_residual[:, None], res, q)
        elif self.excluded is not None:
            w = torch.where(self.excluded.gather(1, cols), 0.0, q)
        else:
            w = q
        return w, q

    def chunk_totals(self, c_first: int, n_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums of w and of q over this shard's part of the global chunks c_first .. + n_chunks."""
        R, v_local, device = self.R, self.v_local, self.logits.device
        if n_chunks == 0 or R == 0:
            z = torch.zeros(R, n_chunks, dtype=self.cd, device=device)
            return z, z.clone()
        cols = torch.arange(v_local, device=device)[None, :].expand(R, v_local)
        w, q = self.entries(cols)
        front = self.lo - c_first * SAMPLE_CHUNK
        back = n_chunks * SAMPLE_CHUNK - front - v_local
        return tuple(torch.nn.functional.pad(t, (front, back)).view(R, n_chunks, SAMPLE_CHUNK).sum(-1) for t in (w, q))


def _sample_sharded(final: _FinalRows, with_q: bool, seeds, offsets, nodes, lo: int, hi: int, vocab_size: int,
                    group) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``reference.chunked_categorical`` of each final row's global w (and, ``with_q``, of q with
    the same noise): same chunks, same noise, same token (-1 without mass). Three collectives;
    only the winning chunk's entries are ever formed in full."""
    R = final.R
    device = final.logits.device
    B = 2 * R if with_q else R
    dtype = final.cd
    # Chunks this shard touches (the first and last may be shared with the neighbours).
    c_first, n_local_chunks = _local_chunks(lo, hi)
    c_last = c_first + n_local_chunks - 1
    tot_w, tot_q = final.chunk_totals(c_first, n_local_chunks)
    part = torch.cat([tot_w, tot_q]) if with_q else tot_w  # [B, n_local_chunks]
    part = torch.nan_to_num(part.to(dtype), nan=0.0).clamp(min=0)
    seeds, offsets, nodes = ((t.repeat(2) if with_q else t) for t in (seeds, offsets, nodes))
    # ---- collective 2: the partial sums of the (at most two) edge chunks of every shard -----
    edges = torch.stack([
        torch.full((B,), float(c_first), dtype=dtype, device=device),
        part[:, 0] if n_local_chunks else torch.zeros(B, dtype=dtype, device=device),
        torch.full((B,), float(c_last), dtype=dtype, device=device),
        part[:, -1] if n_local_chunks > 1 else torch.zeros(B, dtype=dtype, device=device),
        torch.full((B,), float(n_local_chunks), dtype=dtype, device=device),
    ], -1)  # [B, 5]
    all_edges = _all_gather(edges, group)  # [W, B, 5]
    my_rank = dist.get_rank(group)
    totals = part.clone()
    if n_local_chunks:
        # Add other ranks' partial sums of the chunks this shard shares with them.
        for w in range(all_edges.shape[0]):
            if w == my_rank:
                continue
            ef, pf, el, pl, cnt = all_edges[w].unbind(-1)
            for chunk_idx, partial, valid in ((ef, pf, cnt >= 1), (el, pl, cnt >= 2)):
                local = chunk_idx.to(torch.int64) - c_first
                hit = valid & (local >= 0) & (local < n_local_chunks)
                # (a masked scatter, not totals[hit, ...]: boolean indexing would sync the host)
                totals.scatter_add_(1, torch.where(hit, local, 0)[:, None], torch.where(hit, partial, 0.0)[:, None])
    # Race over the chunks that start in this shard (each chunk is raced by exactly one rank).
    chunk_ids = torch.arange(c_first, c_first + n_local_chunks, device=device)
    owned = (chunk_ids * SAMPLE_CHUNK >= lo) & (chunk_ids * SAMPLE_CHUNK < hi)
    if n_local_chunks:
        _, w1 = _philox01(seeds[:, None], offsets[:, None], STREAM_SAMPLE, nodes[:, None], chunk_ids[None, :])
        v = open_uniform_from_word(w1, torch.float64)
        score = torch.where((totals > 0) & owned[None, :],
                            torch.log2(totals.to(torch.float64)) - torch.log2(-torch.log2(v)), _NEG_INF)
        best_local = score.max(-1)
        best_chunk = chunk_ids[best_local.indices]
        best_score = best_local.values
    else:
        best_chunk = torch.zeros(B, dtype=torch.int64, device=device)
        best_score = torch.full((B,), _NEG_INF, dtype=torch.float64, device=device)
    # ---- collective 3: the race's winner -----------------------------------------------------
    race = _all_gather(torch.stack([best_score, best_chunk.to(torch.float64)], -1), group)  # [W, B, 2]
    scores, chunks = race[..., 0], race[..., 1]
    top = scores.max(0).values
    winner = torch.where(scores == top[None], chunks, float("inf")).min(0).values
    found = top > _NEG_INF
    winner = torch.where(found, winner, 0.0).to(torch.int64)
    # In-chunk inverse CDF: the chunk total, and the mass held by lower vocabulary ranks.
    local_win = winner - c_first
    in_shard = found & (local_win >= 0) & (local_win < n_local_chunks)
    win_local = local_win.clamp(0, max(n_local_chunks - 1, 0))
    win_total = torch.where(in_shard, totals[torch.arange(B, device=device), win_local] if n_local_chunks else 0.0,
                            0.0)
    before = torch.zeros(B, dtype=dtype, device=device)
    for w in range(all_edges.shape[0]):
        if w >= my_rank:
            continue  # shards tile the vocabulary in rank order: lower ranks hold lower entries
        ef, pf, el, pl, cnt = all_edges[w].unbind(-1)
        before += torch.where((cnt >= 1) & (ef.to(torch.int64) == winner), pf, 0.0)
        before += torch.where((cnt >= 2) & (el.to(torch.int64) == winner), pl, 0.0)
    w0, _ = _philox01(seeds, offsets, STREAM_SAMPLE, nodes, winner)
    threshold = uniform_from_word(w0, dtype) * win_total
    # The winning chunk's entries on this shard: SAMPLE_CHUNK columns per row.
    gcol = winner[:, None] * SAMPLE_CHUNK + torch.arange(SAMPLE_CHUNK, device=device)[None, :]  # global ids
    valid = in_shard[:, None] & (gcol >= lo) & (gcol < hi)
    cols = (gcol - lo).clamp(0, max(hi - lo - 1, 0))
    if hi > lo:
        if with_q:
            w_a, _ = final.entries(cols[:R])
            _, q_b = final.entries(cols[R:])
            w_win = torch.cat([w_a, q_b])
        else:
            w_win, _ = final.entries(cols)
        w_win = torch.where(valid, torch.nan_to_num(w_win.to(dtype), nan=0.0).clamp(min=0), 0.0)
    else:
        w_win = torch.zeros(B, SAMPLE_CHUNK, dtype=dtype, device=device)
    prefix = before[:, None] + w_win.cumsum(-1)
    positive = valid & (w_win > 0)
    hit = positive & (prefix >= threshold[:, None])
    first = torch.where(hit, gcol, vocab_size).min(-1).values
    # Rounding may leave the threshold above every prefix (the totals were summed in another
    # order): then the answer is the chunk's last positive entry, as in exact arithmetic.
    last = torch.where(positive, gcol, -1).max(-1).values
    # ---- collective 4: the token (the lowest crossing over the ranks, else the last entry) ---
    picks = torch.stack([first, -last], -1)
    dist.all_reduce(picks, op=dist.ReduceOp.MIN, group=group)
    first, last = picks[:, 0], -picks[:, 1]
    token = torch.where(first < vocab_size, first, last)
    token = torch.where(found & (token >= 0), token, -1)
    return (token[:R], token[R:]) if with_q else (token, None)


def _segment_scan(key: torch.Tensor, values: torch.Tensor):
    """For entries sorted by ``key`` (stable, index order inside a key): each entry's count of
    earlier entries with the same key and its exclusive sum of ``values`` over them.
    Sync-free (one argsort and cumsums)."""
    n = key.shape[0]
    order = torch.sort(key, stable=True).indices
    sk = key[order]
    first = torch.ones(n, dtype=torch.bool, device=key.device)
    first[1:] = sk[1:] != sk[:-1]
    pos = torch.arange(n, device=key.device)
    start = torch.where(first, pos, 0).cummax(0).values
    sv = values[order]
    excl = sv.cumsum(0) - sv
    seg_sum = excl - excl[start]
    count = torch.empty_like(pos).scatter_(0, order, pos - start)
    return count, torch.empty_like(seg_sum).scatter_(0, order, seg_sum)


@torch.no_grad()
def _check_max_children(parents: torch.Tensor, cu_num_nodes: torch.Tensor, max_children: int) -> None:
    """Validation mode (syncs): no node has more than ``max_children`` children."""
    n = parents.shape[0]
    cu = cu_num_nodes.to(torch.int64)
    g = torch.arange(n, device=parents.device)
    owner = torch.searchsorted(cu[1:], g, right=True).clamp(max=cu.shape[0] - 2)
    par = parents.to(torch.int64)
    linked = (par >= 0) & (par < g - cu[owner])
    counts = torch.zeros(n + 1, dtype=torch.int64, device=parents.device).scatter_add_(
        0, torch.where(linked, cu[owner] + par, n), linked.to(torch.int64))[:n]
    widest = int(counts.max())
    if widest > max_children:
        node = int(counts.argmax())
        raise ValueError(f"max_children = {max_children}, but node {node} (request {int(owner[node])}) has {widest} "
                         "children: the residual rounds would stop early and give wrong tokens")


class _TreeLinks(NamedTuple):
    """A batch's tree structure under the reference's rules for malformed links, sync-free."""
    cu: torch.Tensor        # [B + 1] sanitized offsets: clamp(running max of cu, 0, N)
    g: torch.Tensor         # [N] global node index
    owner: torch.Tensor     # [N] request of each node (B past cu[-1])
    local: torch.Tensor     # [N] index within the request
    x: torch.Tensor         # [N] tokens, int64
    child: torch.Tensor     # [N] a tested child that can be accepted (valid link and token)
    par_g: torch.Tensor     # [N] global parent of a child, N otherwise
    n_children: torch.Tensor  # [N] valid children of each node


def _tree_links(tokens, parents, cu_num_nodes, vocab_size: int) -> _TreeLinks:
    n = parents.shape[0]
    cu = cu_num_nodes.to(torch.int64).clamp(0, n)
    cu = torch.maximum(cu, torch.cummax(cu, 0).values)
    g = torch.arange(n, device=parents.device)
    owner = torch.searchsorted(cu[1:], g, right=True)
    local = g - cu[owner]
    par, x = parents.to(torch.int64), tokens.to(torch.int64)
    child = (local > 0) & (par >= 0) & (par < local) & (owner < cu.shape[0] - 1) & (x >= 0) & (x < vocab_size)
    par_g = torch.where(child, cu[owner] + par, n)
    n_children = torch.zeros(n + 1, dtype=torch.int64, device=parents.device).scatter_add_(
        0, par_g, child.to(torch.int64))[:n]
    return _TreeLinks(cu, g, owner, local, x, child, par_g, n_children)


def _tree_fused(logits, tokens, parents, cu, draft_probs, temperature, seeds, offsets, D, rounds, lo, hi,
                vocab_size, group):
    """The tree op's Triton path: five launches around the four collectives, plus one before each
    of the ``rounds`` all_reduces of the residual masses (``triton.vocab_parallel``); the same
    tokens as the torch path below."""
    N = logits.shape[0]
    rank = dist.get_rank(group)
    S = _tvp.row_segments(N, vocab_size, dist.get_world_size(group))
    stats = _tvp.tree_local_stats(logits, draft_probs, tokens, parents, cu, temperature, lo, vocab_size, S)
    gathered = _all_gather(stats, group)  # collective 1: [W, N, 3 S + 2]
    mass = torch.empty(max(rounds, 1), N, dtype=torch.float32, device=logits.device)
    for j in range(1, rounds + 1):
        _tvp.tree_residual_mass(logits, draft_probs, tokens, parents, cu, temperature, gathered, mass, j, vocab_size)
        dist.all_reduce(mass[j - 1], op=dist.ReduceOp.SUM, group=group)  # collectives 1b
    c_first, n_chunks = _local_chunks(lo, hi)
    totals, edges, state_i, state_f, out, path, num_acc = _tvp.tree_final_totals(
        logits, draft_probs, tokens, parents, cu, temperature, seeds, offsets, gathered, mass, rounds, D, lo,
        vocab_size, c_first, n_chunks)
    all_edges = _all_gather(edges, group)  # collective 2: [W, 2B, 5]
    race = _tvp.chunk_race(totals, all_edges, state_i, seeds, offsets, rank, lo, hi, c_first)
    all_race = _all_gather(race, group)  # collective 3: [W, 2B, 2]
    picks = _tvp.tree_chunk_pick(logits, draft_probs, tokens, parents, temperature, seeds, offsets, totals, all_edges,
                                 all_race, state_i, state_f, rank, lo, hi, c_first, vocab_size)
    dist.all_reduce(picks, op=dist.ReduceOp.MIN, group=group)  # collective 4
    _tvp.tree_finish(picks, state_i, temperature, out, vocab_size)
    return out, path, num_acc


def tree_rejection_sample_vocab_parallel(
    target_logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    cu_num_nodes: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    max_depth: int | None = None,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    max_children: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tree_rejection_sample`` on vocabulary shards of the logits.

    Each rank holds the columns ``[vocab_start, vocab_start + V_local)`` of the target logits
    (and of the draft probabilities); the shards must tile ``[0, vocab_size)`` in rank order
    (any sizes: V need not be divisible by the world size, a shard may be smaller than a
    sampling chunk or empty). The ranks exchange O(number of nodes) numbers, never the logits,
    and every rank returns the single-device op's outputs on the gathered logits for the same
    seeds (except at float near-ties).

    Parameters
    ----------
    target_logits : Tensor [N, V_local], float32 / bfloat16 / float16
        This rank's shard of the target logits; row v scores the token after node v.
    tokens, parents, cu_num_nodes
        The draft trees, as in ``tree_rejection_sample`` (global token ids). Identical on
        every rank.
    draft_probs : Tensor [N, V_local] or None
        This rank's shard of the draft distributions (None: deterministic drafts).
    temperature, seeds, offsets : Tensor [B] or None
        As in ``tree_rejection_sample``, identical on every rank. Seeds absent: rank 0 of
        ``group`` draws them and broadcasts them (one more collective).
    max_depth : int or None
        Output width - 1. None = the largest node count - 1, which synchronizes.
    vocab_start : int
        Global id of this shard's first column.
    vocab_size : int
        The full vocabulary size V.
    group : ProcessGroup or None
        The tensor-parallel group (None: the default group). NCCL for CUDA tensors, gloo
        for CPU tensors (gloo with CUDA tensors works too: slower, through host memory).
    max_children : int or None
        With ``draft_probs`` only: an upper bound on the number of children of any node. The
        residual after j rejected siblings needs a global sum that depends on the previous
        one, so the walk takes ``max_children - 1`` extra rounds of one all_reduce of N
        numbers each. None = counted from ``parents``, which synchronizes: pass it on the hot
        path (it is a property of the tree shape). A value below the true count gives wrong
        tokens for the nodes with more children: the validation mode checks it.
    compute_dtype : torch.dtype
        Float type of the local arithmetic and of the exchanged statistics: float32 (on CUDA
        tensors the fused Triton kernels) or float64 (vectorized PyTorch).
    validate : bool or None
        Check contents that need a device sync: ``max_children`` covers every node's children.
        None = $SPECDEC_VALIDATE == "1".

    Returns
    -------
    output_token_ids : Tensor [B, max_depth + 1], int32
    accepted_nodes : Tensor [B, max_depth + 1], int32
    num_accepted : Tensor [B], int32
        As ``tree_rejection_sample``, identical on every rank.

    Notes
    -----
    Collectives: (1) all_gather of every row's (max, sum of exp((l - max)/T), first argmax)
    and every node's (l_parent(x), p_parent(x)); with ``draft_probs``, ``max_children - 1``
    all_reduce(SUM) rounds of the residual masses; then the walk runs locally and
    identically on every rank (every accept decision depends only on these numbers and the
    child's earlier siblings: decided for all nodes at once, then a chase of at most
    ``max_depth`` steps from the root); (2)-(4) the three collectives of the sharded sampler
    of the chain version, for the residual and for q at each request's stop node. No host
    synchronization inside when ``max_depth``, ``seeds`` and (with ``draft_probs``)
    ``max_children`` are given.
    """
    check_tensor("target_logits", target_logits, ndim=2, dtypes=LOGIT_DTYPES)
    device = target_logits.device
    N, v_local = target_logits.shape
    for name, t in (("tokens", tokens), ("parents", parents)):
        check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, device=device)
        if t.shape[0] != N:
            raise ValueError(f"{name} must have one entry per node (target_logits row): shape ({N},), "
                             f"got {tuple(t.shape)}")
    check_tensor("cu_num_nodes", cu_num_nodes, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if cu_num_nodes.shape[0] < 1:
        raise ValueError("cu_num_nodes must have B + 1 >= 1 entries (a leading 0)")
    B = cu_num_nodes.shape[0] - 1
    for name, value in (("vocab_start", vocab_start), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= vocab_start <= vocab_start + v_local <= vocab_size:
        raise ValueError(f"the shard [vocab_start, vocab_start + V_local) = [{vocab_start}, {vocab_start + v_local}) "
                         f"must lie in [0, vocab_size = {vocab_size})")
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, ndim=2, dtypes=LOGIT_DTYPES, device=device)
        if tuple(draft_probs.shape) != (N, v_local):
            raise ValueError(f"draft_probs must have shape (N, V_local) = ({N}, {v_local}), "
                             f"got {tuple(draft_probs.shape)}")
    check_request_params(temperature, seeds, offsets, B, device)
    if compute_dtype not in (torch.float32, torch.float64):
        raise TypeError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
    if vocab_size > (1 << 24 if compute_dtype == torch.float32 else 1 << 53):
        raise ValueError(f"vocab_size = {vocab_size} is too large for token ids in {compute_dtype}: use float64")
    if max_depth is None:
        counts = cu_num_nodes[1:] - cu_num_nodes[:-1]
        max_depth = max(int(counts.max()) - 1, 0) if B else 0
    check_width("max_depth", max_depth)
    if max_children is not None:
        check_width("max_children", max_children)
        if draft_probs is not None and N and (validate if validate is not None
                                              else os.environ.get("SPECDEC_VALIDATE") == "1"):
            _check_max_children(parents, cu_num_nodes, int(max_children))
    D = int(max_depth)
    lo, hi = vocab_start, vocab_start + v_local
    cd = compute_dtype
    if B == 0 or N == 0:  # the same on every rank: no collective
        empty = torch.full((B, D + 1), -1, dtype=torch.int32, device=device)
        return empty, empty.clone(), torch.zeros(B, dtype=torch.int32, device=device)
    if seeds is None:
        seeds = torch.randint(-(2**63), 2**63 - 1, (B,), dtype=torch.int64, device=device)
        dist.broadcast(seeds, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    seeds = seeds.to(torch.int64)
    offsets = torch.zeros(B, dtype=torch.int64, device=device) if offsets is None else offsets.to(torch.int64)
    if _use_triton(target_logits, cd) and target_logits.stride(1) == 1 and \
            (draft_probs is None or draft_probs.stride(1) == 1):
        if draft_probs is not None and max_children is None:  # the most tested children of a node; syncs
            max_children = int(_tree_links(tokens, parents, cu_num_nodes, vocab_size).n_children.max())
        rounds = max(int(max_children) - 1, 0) if draft_probs is not None else 0
        return _tree_fused(target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature, seeds, offsets, D,
                           rounds, lo, hi, vocab_size, group)

    out = torch.full((B, D + 1), -1, dtype=torch.int64, device=device)
    path = torch.full((B, D + 1), -1, dtype=torch.int64, device=device)

    # ---- tree structure (the reference's rules for malformed links), sync-free ----------------
    cu, g, owner, local, x, child, par_g, n_children = _tree_links(tokens, parents, cu_num_nodes, vocab_size)
    req = owner.clamp(max=B - 1)  # request of each node (nodes past cu[-1] are never reached)
    pr = par_g.clamp(max=N - 1)
    temp = (torch.ones(B, device=device) if temperature is None else temperature).to(cd)
    greedy = ~(temp > 0)
    inv_temp = torch.where(greedy, 1.0, 1.0 / temp)
    inv_t = inv_temp[req]  # per row
    tiny = torch.finfo(cd).tiny

    # ---- local statistics of every row, and each child's logit / draft prob in its parent's row
    local_max, local_sum, local_arg = _row_stats(target_logits, g, inv_t, lo, vocab_size, cd)
    mine = child & (x >= lo) & (x < hi)
    x_local = (x - lo).clamp(0, max(v_local - 1, 0))
    l_x = torch.where(mine, sanitize_logits(target_logits[pr, x_local].to(cd)) if v_local else 0.0, _NEG_INF)
    if draft_probs is not None:
        p_x = torch.where(mine, draft_probs[pr, x_local].to(cd) if v_local else 0.0, _NEG_INF)
    else:
        p_x = torch.full_like(l_x, _NEG_INF)

    # ---- collective 1 ---------------------------------------------------------------------------
    # (ids travel as floats: exact below 2^24 in float32, checked above)
    stats = torch.stack([local_max, local_sum, local_arg.to(cd), l_x, p_x], -1)  # [N, 5]
    gathered = _all_gather(stats, group)  # [W, N, 5]
    g_max, g_sum, g_lx, g_px = gathered[..., 0], gathered[..., 1], gathered[..., 3], gathered[..., 4]
    g_arg = gathered[..., 2].to(torch.int64)
    row_max = g_max.max(0).values
    row_shift = torch.where(row_max > _NEG_INF, row_max, 0.0)
    live = g_max > _NEG_INF
    row_sum = torch.where(live, g_sum * ((g_max - row_shift[None]) * inv_t[None]).exp(), 0.0).sum(0)
    argmax = torch.where(live & (g_max == row_max[None]), g_arg, vocab_size).min(0).values
    argmax = torch.where(row_max > _NEG_INF, argmax, -1)
    lx = g_lx.max(0).values
    px = g_px.max(0).values if draft_probs is not None else torch.ones(N, dtype=cd, device=device)

    # ---- every child's accept test (its parent's row; its earlier siblings were rejected) -------
    m_par, s_par = row_max[pr], row_sum[pr]
    q_x = torch.where(child & (lx > _NEG_INF) & (m_par > _NEG_INF),
                      ((lx - torch.where(m_par > _NEG_INF, m_par, 0.0)) * inv_t).exp() / s_par.clamp(min=tiny), 0.0)
    u = uniform_from_word(_philox01(seeds[req], offsets[req], STREAM_ACCEPT, local, torch.zeros_like(local))[0], cd)
    if draft_probs is not None:
        # a_j, N_j after j rejections at a node: a_0 = 0, N_0 = 1, a_{j+1} = a_j + N_j,
        # N_j = sum_x (q - a_j p)+ -- a global sum per round (docs/ALGORITHM.md §5).
        if max_children is None:
            max_children = int(n_children.max())
        rounds = max(int(max_children) - 1, 0)
        a_tab = torch.zeros(N, rounds + 2, dtype=cd, device=device)
        a_tab[:, 1] = 1.0
        mass_tab = torch.ones(N, rounds + 1, dtype=cd, device=device)
        for j in range(1, rounds + 1):  # rows with at most j children need no N_j
            part = _residual_mass(target_logits, draft_probs, row_max, row_sum, inv_t, a_tab[:, j],
                                  n_children > j, cd)
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)  # collectives 1b
            mass_tab[:, j] = part
            a_tab[:, j + 1] = a_tab[:, j] + part
        rank_j, _ = _segment_scan(par_g, torch.zeros(N, dtype=torch.float64, device=device))
        rank_j = rank_j.clamp(max=rounds)
        a_c, mass_c = a_tab[pr, rank_j], mass_tab[pr, rank_j]
        accept_random = u * px * mass_c < (q_x - a_c * px).clamp(min=0)
    else:
        # Residual = q without the distinct tokens E of the earlier siblings: a duplicate of an
        # earlier sibling's token is rejected; 1 - q(E) from an exclusive segmented sum.
        order = torch.arange(N, device=device)
        xk = torch.where(child, x, 0)
        order = order[torch.sort(xk[order], stable=True).indices]
        order = order[torch.sort(par_g[order], stable=True).indices]
        sp, sx = par_g[order], xk[order]
        dup_sorted = torch.zeros(N, dtype=torch.bool, device=device)
        dup_sorted[1:] = (sp[1:] == sp[:-1]) & (sx[1:] == sx[:-1]) & (sp[1:] < N)
        dup = torch.empty_like(dup_sorted).scatter_(0, order, dup_sorted)
        _, q_excluded = _segment_scan(par_g, torch.where(child & ~dup, q_x, 0.0).to(torch.float64))
        free = (1.0 - q_excluded).to(cd)
        accept_random = (u * free < q_x) & ~dup
    accept = child & torch.where(greedy[req], x == argmax[pr], accept_random)
    first_acc = torch.full((N + 1,), N, dtype=torch.int64, device=device).scatter_reduce_(
        0, torch.where(accept, par_g, N), torch.where(accept, g, N), "amin")[:N]

    # ---- the walk: a chase of at most max_depth steps, identical on every rank ---------------------
    b_idx = torch.arange(B, device=device)
    has_root = cu[1:] > cu[:-1]
    node = torch.where(has_root, cu[:-1], N)
    path[:, 0] = torch.where(has_root, 0, -1)
    depth = torch.zeros(B, dtype=torch.int64, device=device)
    first_acc_ext = torch.cat([first_acc, torch.full((1,), N, dtype=torch.int64, device=device)])
    x_ext = torch.cat([x, torch.full((1,), -1, dtype=torch.int64, device=device)])
    for s in range(D):
        nxt = first_acc_ext[node]
        move = nxt < N  # a request that stopped stays: its node has no accepted child
        out[:, s] = torch.where(move, x_ext[nxt], -1)
        path[:, s + 1] = torch.where(move, nxt - cu[:-1], -1)
        node = torch.where(move, nxt, node)
        depth += move.to(torch.int64)
    stop = node.clamp(max=N - 1)
    limited = depth >= D  # children not tested: the residual is q itself

    # ---- the final token from the stop node's residual (and q as the fallback) ------------------
    m_s, s_s = row_max[stop], row_sum[stop]
    if draft_probs is not None:
        a_fin = torch.where(limited, 0.0, a_tab[stop, n_children[stop].clamp(max=a_tab.shape[1] - 1)])
        final = _FinalRows(target_logits, stop, m_s, s_s, inv_temp, lo, cd, probs=draft_probs, prob_rows=stop,
                           a=a_fin, use_residual=torch.ones(B, dtype=torch.bool, device=device))
    else:
        kid = child & (par_g == stop[req]) & ~limited[req] & mine
        excluded = torch.zeros(B, v_local + 1, dtype=torch.bool, device=device)
        excluded.index_put_((req, torch.where(kid, x - lo, v_local)), torch.ones_like(kid))
        final = _FinalRows(target_logits, stop, m_s, s_s, inv_temp, lo, cd, excluded=excluded[:, :v_local])
    local_stop = torch.where(has_root, stop - cu[:-1], 0)
    token, fallback = _sample_sharded(final, True, seeds, offsets, local_stop, lo, hi, vocab_size, group)
    token = torch.where(token < 0, fallback, token)
    token = torch.where(greedy, argmax[stop], token)
    token = torch.where(has_root, token, -1)
    out.scatter_(1, depth[:, None], token[:, None])
    return out.to(torch.int32), path.to(torch.int32), depth.to(torch.int32)
