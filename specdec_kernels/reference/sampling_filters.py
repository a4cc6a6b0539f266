"""Top-k, top-p and min-p: the sort-based definition (docs/ALGORITHM.md §7).

The verify op applies these filters to the target itself (``top_k`` / ``top_p`` / ``min_p``
arguments of ``rejection_sample`` and ``tree_rejection_sample``; issue #6), with a threshold
search instead of a sort. This module is the definition they are tested against -- the CPU
reference calls ``filter_keep_mask`` in float64 -- and a helper for drafters, which
standardize their own distribution before sampling drafts (``apply_top_k_top_p``).

Semantics, per request, on the logits of one row (temperature ``T``; order of application
temperature -> top-k -> top-p -> min-p):

- NaN logits count as -inf and +inf as the largest float32 (as in the op); a -inf logit is
  never sampled, whatever the filters say.
- **top-k** keeps every token whose logit is >= the k-th largest logit of its row (tokens tied
  with the k-th are kept, so a row may keep more than k). ``k <= 0`` or ``k >= V``: off.
- **top-p** is applied after top-k, on the distribution that top-k leaves, renormalized:
  ``softmax(logits / T)`` over the kept tokens. Sort the kept tokens by logit, descending; the
  *crossing* token is the first whose cumulative probability reaches ``p``; keep every token
  whose logit is >= the crossing token's (its ties included). If rounding keeps the
  cumulative sum below ``p`` to the end, everything top-k kept stays. ``p >= 1`` (or NaN):
  off; ``p <= 0`` keeps the most likely token(s) only.
- **min-p** keeps the tokens with ``prob >= min_p * max prob``, i.e.
  ``(logit - max logit) / T >= ln(min_p)`` (the ratio does not depend on the normalization, so
  it is the same before or after top-k / top-p). ``min_p <= 0`` (or NaN): off; ``min_p >= 1``
  keeps the tokens tied with the maximum.
- Greedy rows (``T <= 0`` or NaN) are never filtered: every filter keeps the argmax, which is
  all a greedy request looks at.
"""
from __future__ import annotations

import torch

FLT_MAX = torch.finfo(torch.float32).max


def _sanitize(logits: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=FLT_MAX, neginf=float("-inf"))


@torch.no_grad()
def filter_keep_mask(
    values: torch.Tensor,
    inv_temp: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask of the tokens the filters keep (the definition above, by sorting).

    Parameters
    ----------
    values : Tensor [..., V], floating
        Sanitized logits (no NaN, no +inf), unscaled; the arithmetic runs in this dtype
        (the reference passes float64).
    inv_temp : Tensor [...]
        1 / T per row (> 0: greedy rows must have every filter off, see ``filter_params``).
    top_k, top_p, min_p : Tensor [...] or None
        Per row; None = off for every row.

    Returns
    -------
    Tensor [..., V] bool
    """
    vocab = values.shape[-1]
    keep = torch.ones_like(values, dtype=torch.bool)
    if vocab == 0 or (top_k is None and top_p is None and min_p is None):
        return keep
    neg_inf = torch.tensor(float("-inf"), dtype=values.dtype, device=values.device)
    sorted_desc = values.sort(dim=-1, descending=True).values
    row_max = sorted_desc[..., :1]
    threshold = neg_inf.expand(values.shape[:-1]).unsqueeze(-1)
    if top_k is not None:
        k = top_k.to(device=values.device, dtype=torch.int64)
        k_on = (k > 0) & (k < vocab)
        kth = sorted_desc.gather(-1, (k.clamp(1, vocab) - 1).unsqueeze(-1))
        threshold = torch.where(k_on.unsqueeze(-1), kth, threshold)
    if top_p is not None:
        p = top_p.to(device=values.device, dtype=values.dtype)
        p_on = p < 1  # False for NaN
        kept = sorted_desc >= threshold
        shift = torch.where(row_max > float("-inf"), row_max, 0.0)
        z = torch.where(kept, (sorted_desc - shift) * inv_temp.to(values.dtype).unsqueeze(-1), neg_inf)
        probs = z.exp()
        probs = probs / probs.sum(-1, keepdim=True).clamp(min=torch.finfo(values.dtype).tiny)
        crossing = (probs.cumsum(-1) >= p.unsqueeze(-1)) & kept
        j = torch.where(crossing.any(-1), crossing.to(torch.int8).argmax(-1), kept.sum(-1) - 1)
        tp = sorted_desc.gather(-1, j.clamp(min=0).unsqueeze(-1))
        threshold = torch.where(p_on.unsqueeze(-1), torch.maximum(threshold, tp), threshold)
    keep = values >= threshold
    if min_p is not None:
        mp = min_p.to(device=values.device, dtype=values.dtype)
        mp_on = mp > 0  # False for NaN
        log_mp = torch.log(mp.clamp(max=1).where(mp_on, 1.0))
        ratio_ok = (values - row_max) * inv_temp.to(values.dtype).unsqueeze(-1) >= log_mp.unsqueeze(-1)
        keep &= ratio_ok | ~mp_on.unsqueeze(-1)
    return keep


def filter_params(greedy: torch.Tensor, top_k=None, top_p=None, min_p=None):
    """Per-row filter parameters with every filter switched off on greedy rows."""
    return (None if top_k is None else torch.where(greedy, 0, top_k.to(torch.int64)),
            None if top_p is None else torch.where(greedy, 1.0, top_p.to(torch.float64)),
            None if min_p is None else torch.where(greedy, 0.0, min_p.to(torch.float64)))


def _per_row(value, num_rows: int, row_to_request: torch.Tensor | None, dtype: torch.dtype,
             device: torch.device, name: str) -> torch.Tensor | None:
    """A per-request parameter (None, a Python number or a [B] tensor) as a [num_rows] tensor."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return torch.full((num_rows,), value, dtype=dtype, device=device)
    value = value.to(device=device, dtype=dtype)
    if value.dim() != 1:
        raise ValueError(f"{name} must be a number or a 1-D tensor (one value per request), "
                         f"got shape {tuple(value.shape)}")
    if row_to_request is None:
        if value.shape[0] != num_rows:
            raise ValueError(f"{name} has {value.shape[0]} entries but logits has {num_rows} rows "
                             "(pass row_to_request when several rows belong to one request)")
        return value
    return value[row_to_request]


@torch.no_grad()
def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    *,
    min_p: torch.Tensor | float | None = None,
    temperature: torch.Tensor | float | None = None,
    row_to_request: torch.Tensor | None = None,
) -> torch.Tensor:
    """Set the logits that top-k / top-p / min-p filter out to -inf (one sort per row).

    The verify op applies the filters itself (its ``top_k`` / ``top_p`` / ``min_p``
    arguments); this helper is for drafters, which sample from their own filtered
    distribution, and for tests.

    Parameters
    ----------
    logits : Tensor [R, V], float
        Raw logits (before the temperature); R rows, each belonging to one request.
    top_k : Tensor [B] int, int or None
        Per request; ``<= 0`` or ``>= V`` = off. None = off for all.
    top_p : Tensor [B] float, float or None
        Per request; ``>= 1`` = off. None = off for all.
    min_p : Tensor [B] float, float or None
        Per request; ``<= 0`` = off. None = off for all.
    temperature : Tensor [B] float, float or None
        Per request. top-p and min-p measure probabilities of ``softmax(logits / T)``, so they
        depend on T; rows with ``T <= 0`` (or NaN) are greedy and left unfiltered.
        None = 1 for all.
    row_to_request : Tensor [R] int or None
        The request each row belongs to; None = row r is request r (then B = R).

    Returns
    -------
    Tensor [R, V]
        ``logits`` itself when no filter is given, else a copy (same dtype, unscaled values)
        with the filtered-out entries set to -inf. Float32 arithmetic, as in vLLM's sampler:
        the top-p cut can differ from exact arithmetic only where the mass before a token is
        within float32 rounding of ``p``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if top_k is None and top_p is None and min_p is None:
        return logits
    num_rows = logits.shape[0]
    device = logits.device
    if row_to_request is not None:
        row_to_request = row_to_request.to(device=device, dtype=torch.int64)
        if row_to_request.shape != (num_rows,):
            raise ValueError(f"row_to_request must have shape ({num_rows},), got {tuple(row_to_request.shape)}")
    k = _per_row(top_k, num_rows, row_to_request, torch.int64, device, "top_k")
    p = _per_row(top_p, num_rows, row_to_request, torch.float32, device, "top_p")
    mp = _per_row(min_p, num_rows, row_to_request, torch.float32, device, "min_p")
    temp = _per_row(temperature, num_rows, row_to_request, torch.float32, device, "temperature")
    if temp is None:
        temp = torch.ones(num_rows, dtype=torch.float32, device=device)
    greedy = ~(temp > 0)  # True for greedy rows and NaN temperatures
    k, p, mp = filter_params(greedy, k, p, mp)
    inv_temp = torch.where(greedy, 1.0, 1.0 / temp)
    # float32 holds fp32/bf16/fp16 logits exactly, so the comparisons are exact.
    values = _sanitize(logits.to(torch.float32))
    keep = filter_keep_mask(values, inv_temp, k, None if p is None else p.float(),
                            None if mp is None else mp.float())
    return torch.where(keep, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))


__all__ = ["apply_top_k_top_p", "filter_keep_mask", "filter_params"]
