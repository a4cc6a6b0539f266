"""Chain verification, the float64 oracle of ``torch.ops.specdec.rejection_sample`` (token-wise
and block verification; docs/ALGORITHM.md §1-4, §6)."""
from __future__ import annotations

import torch

from .common import apply_filters, chunked_categorical, first_argmax, gather_rows, sanitize_logits
from .philox import STREAM_ACCEPT, philox_words, uniform_from_word


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
    lenience: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain verification over a ragged batch; arguments as ``torch.ops.specdec.rejection_sample``.

    ``method="token"`` verifies draft by draft (docs/ALGORITHM.md §1); ``method="block"``
    verifies the block jointly (Sun et al. 2024; docs/ALGORITHM.md §6) with the same streams.
    ``top_k`` / ``top_p`` / ``min_p`` ([B] or None) filter every target row of a random request
    by the sort-based definition of ``sampling_filters`` (docs/ALGORITHM.md §7) before anything
    else: the filtered-out logits become -inf. ``lenience`` ([B] in (0, 1] or None; token method
    only) relaxes the accept tests of docs/ALGORITHM.md §8: u l p(x) < q(x), the residual
    max(0, q - l p), greedy p(x) >= l max p at T = 1; l = 1 is the exact op, bit for bit.

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
    if lenience is not None and method != "token":
        raise ValueError("lenience is not defined for method='block': pass lenience=None, or method='token'")
    # The kernels read lenience as float32: the reference rounds it there too.
    lam = None if lenience is None else lenience.to(device=device, dtype=torch.float32).to(compute_dtype)
    seeds = seeds.to(torch.int64)
    offsets = offsets.to(torch.int64)

    cu = cu_num_draft_tokens.to(torch.int64)
    n = (cu[1:] - cu[:-1]).clamp(0, L)  # drafts beyond max_spec_len are ignored
    b_idx = torch.arange(B, device=device)
    t = torch.arange(L + 1, device=device)

    # Target rows [B, L+1, V]: rows t <= n of each request, the rest (and bad indices) masked.
    row_idx = cu[:-1, None] + b_idx[:, None] + t[None, :]
    row_ok = (t[None, :] <= n[:, None]) & (row_idx >= 0) & (row_idx < R)
    logits = sanitize_logits(gather_rows(target_logits, row_idx).to(compute_dtype))
    logits.masked_fill_(~row_ok[..., None], float("-inf"))

    if temperature is None:
        temperature = torch.ones(B, dtype=torch.float32, device=device)
    temp = temperature.to(compute_dtype)
    greedy = ~(temp > 0)  # 0, negative and NaN temperatures are greedy
    inv_temp = torch.where(greedy, 1.0, 1.0 / temp)
    logits = apply_filters(logits, greedy, inv_temp, top_k, top_p, min_p)

    # q = softmax(logits / T) per row; rows without a valid logit get q = 0 everywhere.
    row_max = logits.max(-1, keepdim=True).values
    shift = torch.where(row_max > float("-inf"), row_max, 0.0)
    q = (logits - shift).mul_(inv_temp[:, None, None]).exp_()  # exp(-inf) = 0 for masked entries
    q.div_(q.sum(-1, keepdim=True).clamp(min=torch.finfo(compute_dtype).tiny))
    argmax = first_argmax(logits)  # [B, L+1]

    # Draft tokens [B, L]; invalid ones (out of range, past n, bad index) become -1.
    td = t[:L]
    d_idx = cu[:-1, None] + td[None, :]
    d_ok = (td[None, :] < n[:, None]) & (d_idx >= 0) & (d_idx < N)
    x = torch.where(d_ok, gather_rows(draft_token_ids, d_idx).to(torch.int64), -1)
    x_ok = d_ok & (x >= 0) & (x < V)
    x_c = x.clamp(0, V - 1)

    q_x = torch.where(x_ok, q[:, :L].gather(2, x_c[..., None]).squeeze(-1), 0.0)
    if draft_probs is not None:
        p_rows = gather_rows(draft_probs, d_idx)  # [B, L, V]
        p_x = torch.where(x_ok, p_rows.gather(2, x_c[..., None]).squeeze(-1).to(compute_dtype), 0.0)
    else:
        p_x = torch.ones_like(q_x)
    a0, _, _, _ = philox_words(
        seeds[:, None], offsets[:, None], STREAM_ACCEPT, td[None, :] + 1, torch.zeros_like(td)[None, :]
    )
    u = uniform_from_word(a0, compute_dtype)
    if lam is not None:
        p_x = lam[:, None] * p_x  # u * (l p(x)) < q(x); l = 1 leaves p(x) as it is
    accept_random = u * p_x < q_x
    accept_greedy = x == argmax[:, :L]
    if lam is not None:
        # Lenient greedy (l < 1): also accept a draft whose logit is within ln(l) of the row max.
        lx = torch.where(x_ok, logits[:, :L].gather(2, x_c[..., None]).squeeze(-1), float("-inf"))
        near = (lx - row_max[:, :L, 0]) >= torch.log(lam)[:, None]
        accept_greedy = accept_greedy | ((lam < 1)[:, None] & near)
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
        p_star = gather_rows(draft_probs, cu[:-1] + t_star).to(compute_dtype)
        if lam is not None:
            p_star = lam[:, None] * p_star  # the lenient residual max(0, q - l p)
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

