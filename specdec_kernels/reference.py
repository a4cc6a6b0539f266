"""CPU reference of the verify step: the oracle every backend is tested against.

Vectorized PyTorch (no Python loop over requests), any compute dtype (float64 by default).
It implements docs/ALGORITHM.md literally: the random numbers come from the same Philox
streams as the kernels, so for the same seeds the kernels must emit the same tokens except
where two float computations of one quantity fall on either side of a threshold.
"""
from __future__ import annotations

import torch

from .philox import (
    SAMPLE_CHUNK,
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    open_uniform_from_word,
    philox_words,
    uniform_from_word,
)
from .sampling_filters import filter_keep_mask, filter_params

FLT_MAX = torch.finfo(torch.float32).max


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never sampled), +inf -> FLT_MAX (the largest finite float32)."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=FLT_MAX, neginf=float("-inf"))


def chunked_categorical(
    weights: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, nodes: torch.Tensor
) -> torch.Tensor:
    """One token per row of ``weights`` [R, V] (>= 0, unnormalized), -1 where a row has no mass.

    Chunk c = entries [c*SAMPLE_CHUNK, (c+1)*SAMPLE_CHUNK). With (w0, w1) the first two
    Philox words of counter (c, STREAM_SAMPLE<<24 | node, offset), u = uniform(w0) and
    v = open_uniform(w1):
      - inside chunk c the candidate is the smallest i with w_i > 0 and C_i >= u * W_c
        (C = inclusive prefix sum over the chunk, W_c its total);
      - the chunk is the winner of an exponential race: argmax_c log2(W_c) - log2(-log2(v_c)),
        lowest c on ties, chunks with W_c = 0 out.
    P(token = i) = W_c/W * w_i/W_c = w_i/W.
    """
    R, V = weights.shape
    device = weights.device
    if R == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    weights = torch.nan_to_num(weights, nan=0.0).clamp(min=0)
    n_chunks = (V + SAMPLE_CHUNK - 1) // SAMPLE_CHUNK
    padded = torch.zeros(R, n_chunks * SAMPLE_CHUNK, dtype=weights.dtype, device=device)
    padded[:, :V] = weights
    w = padded.view(R, n_chunks, SAMPLE_CHUNK)
    prefix = w.cumsum(-1)
    total = prefix[..., -1]
    lanes = torch.arange(n_chunks, device=device)
    w0, w1, _, _ = philox_words(
        seeds[:, None], offsets[:, None], STREAM_SAMPLE, nodes[:, None], lanes[None, :]
    )
    u = uniform_from_word(w0, weights.dtype)
    v = open_uniform_from_word(w1, weights.dtype)
    hit = (w > 0) & (prefix >= (u * total)[..., None])
    has_hit = hit.any(-1)
    in_chunk = hit.to(torch.int8).argmax(-1)  # first True
    score = torch.where(
        (total > 0) & has_hit, torch.log2(total) - torch.log2(-torch.log2(v)), float("-inf")
    )
    best = score.argmax(-1)  # first maximum
    found = score.gather(1, best[:, None]).squeeze(1) > float("-inf")
    token = best * SAMPLE_CHUNK + in_chunk.gather(1, best[:, None]).squeeze(1)
    return torch.where(found, token, -1)


def _rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t[idx] with idx clamped into range; zeros when t has no rows (callers mask the result)."""
    if t.shape[0] == 0:
        return torch.zeros(*idx.shape, *t.shape[1:], dtype=t.dtype, device=t.device)
    return t[idx.clamp(0, t.shape[0] - 1)]


def _first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Lowest index of the maximum along the last dim; -1 where the row has no value > -inf."""
    row_max = logits.max(-1).values
    idx = torch.argmax(logits, -1)  # torch returns the first maximal index
    return torch.where(row_max > float("-inf"), idx, -1)


@torch.no_grad()
def rejection_sample_reference(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor | None,
    max_spec_len: int,
    compute_dtype: torch.dtype = torch.float64,
    method: str = "token",
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain verification over a ragged batch; arguments as ``torch.ops.specdec.rejection_sample``.

    ``method="token"`` verifies draft by draft (docs/ALGORITHM.md §1); ``method="block"``
    verifies the block jointly (Sun et al. 2024; docs/ALGORITHM.md §6) with the same streams.
    ``top_k`` / ``top_p`` / ``min_p`` ([B] or None) filter every target row of a random request
    by the sort-based definition of ``sampling_filters`` (docs/ALGORITHM.md §7) before anything
    else: the filtered-out logits become -inf.

    Returns (output_token_ids [B, max_spec_len+1] int32, num_accepted [B] int32).
    Out-of-range row or draft indices (a malformed ``cu_num_draft_tokens``) read as rows with
    no valid logit and as invalid draft ids, as in the kernels: nothing is read out of bounds.
    """
    device = target_logits.device
    R, V = target_logits.shape
    N = draft_token_ids.shape[0]
    B = cu_num_draft_tokens.shape[0] - 1
    L = int(max_spec_len)
    if offsets is None:
        offsets = torch.zeros(B, dtype=torch.int64, device=device)
    seeds = seeds.to(torch.int64)
    offsets = offsets.to(torch.int64)

    cu = cu_num_draft_tokens.to(torch.int64)
    n = (cu[1:] - cu[:-1]).clamp(0, L)  # drafts beyond max_spec_len are ignored
    b_idx = torch.arange(B, device=device)
    t = torch.arange(L + 1, device=device)

    # Target rows [B, L+1, V]: rows t <= n of each request, the rest (and bad indices) masked.
    row_idx = cu[:-1, None] + b_idx[:, None] + t[None, :]
    row_ok = (t[None, :] <= n[:, None]) & (row_idx >= 0) & (row_idx < R)
    logits = sanitize_logits(_rows(target_logits, row_idx).to(compute_dtype))
    logits.masked_fill_(~row_ok[..., None], float("-inf"))

    if temperature is None:
        temperature = torch.ones(B, dtype=torch.float32, device=device)
    temp = temperature.to(compute_dtype)
    greedy = ~(temp > 0)  # 0, negative and NaN temperatures are greedy
    inv_temp = torch.where(greedy, 1.0, 1.0 / temp)
    logits = _apply_filters(logits, greedy, inv_temp, top_k, top_p, min_p)

    # q = softmax(logits / T) per row; rows without a valid logit get q = 0 everywhere.
    row_max = logits.max(-1, keepdim=True).values
    shift = torch.where(row_max > float("-inf"), row_max, 0.0)
    q = (logits - shift).mul_(inv_temp[:, None, None]).exp_()  # exp(-inf) = 0 for masked entries
    q.div_(q.sum(-1, keepdim=True).clamp(min=torch.finfo(compute_dtype).tiny))
    argmax = _first_argmax(logits)  # [B, L+1]

    # Draft tokens [B, L]; invalid ones (out of range, past n, bad index) become -1.
    td = t[:L]
    d_idx = cu[:-1, None] + td[None, :]
    d_ok = (td[None, :] < n[:, None]) & (d_idx >= 0) & (d_idx < N)
    x = torch.where(d_ok, _rows(draft_token_ids, d_idx).to(torch.int64), -1)
    x_ok = d_ok & (x >= 0) & (x < V)
    x_c = x.clamp(0, V - 1)

    q_x = torch.where(x_ok, q[:, :L].gather(2, x_c[..., None]).squeeze(-1), 0.0)
    if draft_probs is not None:
        p_rows = _rows(draft_probs, d_idx)  # [B, L, V]
        p_x = torch.where(x_ok, p_rows.gather(2, x_c[..., None]).squeeze(-1).to(compute_dtype), 0.0)
    else:
        p_x = torch.ones_like(q_x)
    a0, _, _, _ = philox_words(
        seeds[:, None], offsets[:, None], STREAM_ACCEPT, td[None, :] + 1, torch.zeros_like(td)[None, :]
    )
    u = uniform_from_word(a0, compute_dtype)
    accept_random = u * p_x < q_x
    accept_greedy = x == argmax[:, :L]
    accept = torch.where(greedy[:, None], accept_greedy, accept_random) & x_ok
    num_accepted = accept.to(torch.int64).cumprod(-1).sum(-1) if L else torch.zeros(B, dtype=torch.int64, device=device)
    scale = torch.ones(B, dtype=compute_dtype, device=device)  # P_tau of block verification
    if method == "block":
        block_accepted, scale = _block_verify(q, p_rows if draft_probs is not None else None, x, x_ok, n, q_x,
                                              p_x, u, compute_dtype)
        num_accepted = torch.where(greedy, num_accepted, block_accepted)
        scale = torch.where(greedy, 1.0, scale)
    elif method != "token":
        raise ValueError(f"method must be 'token' or 'block', got {method!r}")

    # The final token comes from row t* = num_accepted.
    t_star = num_accepted
    rejected = t_star < n
    q_star = q[b_idx, t_star]  # [B, V]
    x_star = torch.where(rejected, x[b_idx, t_star.clamp(max=max(L - 1, 0))] if L else -1, -1)
    if draft_probs is not None:
        p_star = _rows(draft_probs, cu[:-1] + t_star).to(compute_dtype)
        residual = torch.where(q_star > 0, (scale[:, None] * q_star - p_star).clamp(min=0), 0.0)
        residual = torch.nan_to_num(residual, nan=0.0)
        # An invalid draft id (e.g. -1 padding) ends the chain: nothing to subtract, sample q.
        x_star_ok = (x_star >= 0) & (x_star < V)
        w_final = torch.where((rejected & x_star_ok)[:, None], residual, q_star)
    else:
        lane = torch.arange(V, device=device)
        excluded = lane[None, :] == x_star[:, None]
        w_final = torch.where(excluded, 0.0, q_star)
    token = chunked_categorical(w_final, seeds, offsets, t_star)
    argmax_star = argmax[b_idx, t_star]
    if draft_probs is not None:
        # Residual with no mass (q == p up to rounding): sample from q with the same noise.
        fallback = chunked_categorical(q_star, seeds, offsets, t_star)
    else:
        # q minus the rejected draft has no mass only if q is a point mass: that point is argmax.
        fallback = argmax_star
    token = torch.where(token < 0, fallback, token)
    token = torch.where(greedy, argmax_star, token)

    out = torch.full((B, L + 1), -1, dtype=torch.int64, device=device)
    keep = td[None, :] < t_star[:, None]
    out[:, :L] = torch.where(keep, x, -1)
    out.scatter_(1, t_star[:, None], token[:, None])
    return out.to(torch.int32), num_accepted.to(torch.int32)


def _apply_filters(logits, greedy, inv_temp, top_k, top_p, min_p):
    """Logits [B, ..., V] with what top-k / top-p / min-p filter out set to -inf (random rows of
    filtered requests only; the parameters are per request, [B])."""
    if top_k is None and top_p is None and min_p is None:
        return logits
    device = logits.device
    top_k, top_p, min_p = (None if t is None else t.to(device) for t in (top_k, top_p, min_p))
    params = filter_params(greedy, top_k, top_p, min_p)
    shape = logits.shape[:-1]
    extra = (1,) * (len(shape) - 1)

    def per_row(t):
        return None if t is None else t.reshape(-1, *extra).expand(shape)

    keep = filter_keep_mask(logits, per_row(inv_temp), *(per_row(t) for t in params))
    return logits.masked_fill(~keep, float("-inf"))


def _block_verify(q, p_rows, x, x_ok, n, q_x, p_x, u, compute_dtype):
    """Block verification (Sun et al. 2024): the number of accepted drafts tau and P_tau.

    With 1-based positions i = 1..n': P_0 = 1, P_i = min(1, P_{i-1} q_i(x_i) / p_i(x_i));
    h_i = R_i / (R_i + 1 - P_i) for i < n' (1 if the denominator is 0), h_n' = P_n', where
    R_i = sum_x max(P_i q_{i+1}(x) - p_{i+1}(x), 0), or P_i (1 - q_{i+1}(x_{i+1})) for
    deterministic drafts; tau = the largest i with eta_i < h_i (0 if none), eta_i = the accept
    uniform of draft i. n' stops at the first invalid draft id (which ends the chain).
    """
    B, L = x.shape
    device = x.device
    if L == 0:
        return torch.zeros(B, dtype=torch.int64, device=device), torch.ones(B, dtype=compute_dtype, device=device)
    invalid = ~x_ok & (torch.arange(L, device=device)[None, :] < n[:, None])
    n_eff = torch.where(invalid.any(-1), invalid.to(torch.int64).argmax(-1), n)
    P = torch.ones(B, L + 1, dtype=compute_dtype, device=device)
    for i in range(L):  # the running joint ratio, division-free where p(x) = 0
        num = P[:, i] * q_x[:, i]
        den = p_x[:, i]
        P[:, i + 1] = torch.where(num >= den, torch.where(num > 0, 1.0, 0.0),
                                  num / torch.where(den > 0, den, 1.0))
    pos = torch.arange(1, L + 1, device=device)  # 1-based position i
    P_i = P[:, 1:]  # [B, L]: P_1 .. P_L
    R = torch.zeros(B, L, dtype=compute_dtype, device=device)
    if L > 1:
        if p_rows is not None:
            q_next, p_next = q[:, 1:L], p_rows[:, 1:L].to(compute_dtype)
            w = torch.where(q_next > 0, (P_i[:, :L - 1, None] * q_next - p_next).clamp(min=0), 0.0)
            R[:, :L - 1] = torch.nan_to_num(w, nan=0.0).sum(-1)
        else:
            R[:, :L - 1] = P_i[:, :L - 1] * (1 - q_x[:, 1:L])
    denominator = R + 1 - P_i
    h = torch.where(denominator > 0, R / torch.where(denominator > 0, denominator, 1.0), 1.0)
    h = torch.where(pos[None, :] == n_eff[:, None], P_i, h)
    accept = (u < h) & (pos[None, :] <= n_eff[:, None])
    tau = torch.where(accept, pos[None, :], 0).max(-1).values
    return tau, P.gather(1, tau[:, None]).squeeze(1)


def _tree_links(parents: torch.Tensor, cu: torch.Tensor, num_nodes: int):
    """Global first-child and next-sibling links (index order), -1 where none.

    A node's parent link counts only if 0 <= parent < its local index (so the root, local node
    0, is never a child); malformed links make a node unreachable, never an out-of-bounds read.
    """
    device = parents.device
    g = torch.arange(num_nodes, device=device)
    owner = torch.searchsorted(cu[1:], g, right=True)  # request of each node
    local = g - cu[owner]
    par = parents.to(torch.int64)
    linked = (local > 0) & (par >= 0) & (par < local)
    par_global = torch.where(linked, cu[owner] + par, -1)
    first_child = torch.full((num_nodes,), -1, dtype=torch.int64, device=device)
    next_sibling = torch.full((num_nodes,), -1, dtype=torch.int64, device=device)
    kids = g[linked]
    if kids.numel():
        key = par_global[linked] * (num_nodes + 1) + kids  # sort by (parent, index)
        order = torch.argsort(key)
        kids, kid_par = kids[order], par_global[linked][order]
        first = torch.ones_like(kids, dtype=torch.bool)
        first[1:] = kid_par[1:] != kid_par[:-1]
        first_child[kid_par[first]] = kids[first]
        same = kid_par[1:] == kid_par[:-1]
        next_sibling[kids[:-1][same]] = kids[1:][same]
    return first_child, next_sibling


@torch.no_grad()
def tree_rejection_sample_reference(
    target_logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    cu_num_nodes: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor | None,
    max_depth: int,
    compute_dtype: torch.dtype = torch.float64,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree verification over a ragged batch (docs/ALGORITHM.md §5); arguments as
    ``torch.ops.specdec.tree_rejection_sample``. The filters act on every node's row as in
    ``rejection_sample_reference``.

    Walks every request's tree from its root, all requests at once, one child test per step.
    Returns (output_token_ids [B, max_depth+1], accepted_nodes [B, max_depth+1],
    num_accepted [B]), all int32.
    """
    device = target_logits.device
    N, V = target_logits.shape
    B = cu_num_nodes.shape[0] - 1
    D = int(max_depth)
    if offsets is None:
        offsets = torch.zeros(B, dtype=torch.int64, device=device)
    seeds, offsets = seeds.to(torch.int64), offsets.to(torch.int64)
    cu = cu_num_nodes.to(torch.int64).clamp(0, N)
    cu = torch.maximum(cu, torch.cummax(cu, 0).values)  # a decreasing cu reads as empty requests
    n_nodes = cu[1:] - cu[:-1]
    first_child, next_sibling = _tree_links(parents, cu, N)
    if temperature is None:
        temperature = torch.ones(B, dtype=torch.float32, device=device)
    temp = temperature.to(compute_dtype)
    greedy = ~(temp > 0)
    inv_temp = torch.where(greedy, 1.0, 1.0 / temp)
    b_idx = torch.arange(B, device=device)
    lane = torch.arange(V, device=device)

    def target_rows(nodes: torch.Tensor):
        """(q [B, V], argmax [B]) of the given global nodes (-1: a row with no valid logit)."""
        lg = sanitize_logits(_rows(target_logits, nodes).to(compute_dtype))
        lg.masked_fill_((nodes < 0)[:, None], float("-inf"))
        lg = _apply_filters(lg, greedy, inv_temp, top_k, top_p, min_p)
        row_max = lg.max(-1, keepdim=True).values
        shift = torch.where(row_max > float("-inf"), row_max, 0.0)
        q = (lg - shift).mul_(inv_temp[:, None]).exp_()
        q.div_(q.sum(-1, keepdim=True).clamp(min=torch.finfo(compute_dtype).tiny))
        return q, _first_argmax(lg)

    # Walk state per request.
    has_root = n_nodes > 0
    node = torch.where(has_root, cu[:-1], -1)          # current node (global)
    cand = torch.where(has_root, _rows(first_child, node), -1)  # next child to test
    depth = torch.zeros(B, dtype=torch.int64, device=device)
    cand = torch.where(depth >= D, -1, cand)
    a = torch.zeros(B, dtype=compute_dtype, device=device)       # residual (q - a p)+
    excluded = torch.zeros(B, V, dtype=torch.bool, device=device)  # residual q without these
    path = torch.full((B, D + 1), -1, dtype=torch.int64, device=device)
    out = torch.full((B, D + 1), -1, dtype=torch.int64, device=device)
    path[:, 0] = torch.where(has_root, 0, -1)
    q, argmax = target_rows(node)
    p = _rows(draft_probs, node).to(compute_dtype) if draft_probs is not None else None

    while bool((cand >= 0).any()):
        testing = cand >= 0
        x = torch.where(testing, _rows(tokens, cand).to(torch.int64), -1)
        x_ok = testing & (x >= 0) & (x < V)
        xc = x.clamp(0, V - 1)
        q_x = q.gather(1, xc[:, None]).squeeze(1)
        local_cand = cand - cu[:-1]  # the child's node index: its accept uniform's counter
        u = uniform_from_word(philox_words(seeds, offsets, STREAM_ACCEPT, local_cand,
                                           torch.zeros_like(cand))[0], compute_dtype)
        if p is not None:
            # r = (q - a p)+ / mass; mass is exactly 1 before any rejection at this node.
            p_x = p.gather(1, xc[:, None]).squeeze(1)
            mass = torch.where(a == 0, 1.0, (q - a[:, None] * p).clamp(min=0).sum(-1))
            r_x = (q_x - a * p_x).clamp(min=0)
            accept_random = u * p_x * mass < r_x
        else:
            # r = q / (1 - q(E)) outside the rejected children E.
            free = 1.0 - torch.where(excluded, q, 0.0).sum(-1)
            accept_random = (u * free < q_x) & ~excluded.gather(1, xc[:, None]).squeeze(1)
        accept = x_ok & torch.where(greedy, x == argmax, accept_random)
        rejected = testing & ~accept
        # Rejection: shrink the residual (invalid ids subtract nothing), move to the next sibling.
        if p is not None:
            a = torch.where(rejected & x_ok & ~greedy, a + mass, a)
        else:
            excluded[b_idx[rejected & x_ok], xc[rejected & x_ok]] = True
        cand = torch.where(rejected, _rows(next_sibling, cand), cand)
        # Acceptance: emit the token, descend, start a fresh residual at the child.
        if bool(accept.any()):
            out[b_idx[accept], depth[accept]] = x[accept]
            depth = depth + accept.to(torch.int64)
            path[b_idx[accept], depth[accept]] = local_cand[accept]
            node = torch.where(accept, cand, node)
            nxt = _rows(first_child, cand)
            cand = torch.where(accept, torch.where(depth >= D, -1, nxt), cand)
            a = torch.where(accept, 0.0, a)
            excluded[accept] = False
            q_new, argmax_new = target_rows(torch.where(accept, node, -1))
            q = torch.where(accept[:, None], q_new, q)
            argmax = torch.where(accept, argmax_new, argmax)
            if p is not None:
                p = torch.where(accept[:, None], _rows(draft_probs, node).to(compute_dtype), p)

    # The final token, from the residual at the node where the walk stopped.
    if p is not None:
        w = (q - a[:, None] * p).clamp(min=0)
        w = torch.where(q > 0, torch.nan_to_num(w, nan=0.0), 0.0)
    else:
        w = torch.where(excluded, 0.0, q)
    local_node = torch.where(has_root, node - cu[:-1], 0)
    token = chunked_categorical(w, seeds, offsets, local_node)
    # An empty residual (all of q's support rejected, or q == p up to rounding): q itself.
    token = torch.where(token < 0, chunked_categorical(q, seeds, offsets, local_node), token)
    token = torch.where(greedy, argmax, token)
    token = torch.where(has_root, token, -1)
    out.scatter_(1, depth[:, None], token[:, None])
    return out.to(torch.int32), path.to(torch.int32), depth.to(torch.int32)
