"""Top-k / top-p filtering of logits, applied before the verify op until the op fuses it (#6).

The op samples ``softmax(logits / T)`` of whatever logits it is given, so filtering is exact
when done up front: the filtered tokens get logit -inf, which the op never emits and which
the temperature cannot bring back. The cost, until #6: one sort per row (every row of the
call as soon as ``top_k`` or ``top_p`` is given, so that nothing synchronizes with the
device) and a copy of the logits. Rows whose filters are off come back unchanged.

Semantics (the ones of HF transformers' and vLLM's samplers, made precise at ties):

- **top-k** keeps every token whose logit is >= the k-th largest logit of its row (tokens tied
  with the k-th are kept, so a row may keep more than k). ``k <= 0`` or ``k >= V``: off.
- **top-p** is applied after top-k, on the distribution that top-k leaves, at the request's
  temperature: ``softmax(logits / T)`` over the kept tokens. It keeps the smallest set of
  most likely tokens whose probability mass reaches ``p`` -- every token whose strictly more
  likely tokens hold mass < p; the token that crosses ``p`` and its ties are kept. ``p >= 1``:
  off. ``p <= 0`` keeps the most likely token(s) only.
- Greedy rows (temperature <= 0) are never filtered: top-k and top-p always keep the argmax.
- NaN logits count as -inf and +inf as the largest float, as in the op.
"""
from __future__ import annotations

import torch

from .reference import sanitize_logits


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
    temperature: torch.Tensor | float | None = None,
    row_to_request: torch.Tensor | None = None,
) -> torch.Tensor:
    """Set the logits that top-k / top-p filter out to -inf (one sort per filtered row).

    Parameters
    ----------
    logits : Tensor [R, V], float
        Raw logits (before the temperature); R rows, each belonging to one request.
    top_k : Tensor [B] int, int or None
        Per request; ``<= 0`` or ``>= V`` = off. None = off for all.
    top_p : Tensor [B] float, float or None
        Per request; ``>= 1`` = off. None = off for all.
    temperature : Tensor [B] float, float or None
        Per request. top-p measures the mass of ``softmax(logits / T)``, so it depends on T;
        rows with ``T <= 0`` (or NaN) are greedy and left unfiltered. None = 1 for all.
    row_to_request : Tensor [R] int or None
        The request each row belongs to; None = row r is request r (then B = R).

    Returns
    -------
    Tensor [R, V]
        ``logits`` itself when ``top_k`` and ``top_p`` are both None, else a copy (same dtype,
        unscaled values) with the filtered-out entries set to -inf. Float32 arithmetic, as in
        vLLM's sampler: the top-p cut can differ from exact arithmetic only where the mass
        before a token is within float32 rounding of ``p``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if top_k is None and top_p is None:
        return logits
    num_rows, vocab = logits.shape
    device = logits.device
    if row_to_request is not None:
        row_to_request = row_to_request.to(device=device, dtype=torch.int64)
        if row_to_request.shape != (num_rows,):
            raise ValueError(f"row_to_request must have shape ({num_rows},), got {tuple(row_to_request.shape)}")
    k = _per_row(top_k, num_rows, row_to_request, torch.int64, device, "top_k")
    p = _per_row(top_p, num_rows, row_to_request, torch.float32, device, "top_p")
    temp = _per_row(temperature, num_rows, row_to_request, torch.float32, device, "temperature")
    if temp is None:
        temp = torch.ones(num_rows, dtype=torch.float32, device=device)
    random_row = temp > 0  # False for greedy rows and NaN temperatures

    # Every row is sorted (no data-dependent row selection: that would synchronize with the
    # device); rows whose filters are off get threshold -inf and come back unchanged.
    # float32 holds fp32/bf16/fp16 logits exactly, so the comparisons below are exact.
    values = sanitize_logits(logits.to(torch.float32))
    sorted_desc = values.sort(dim=-1, descending=True).values
    threshold = torch.full((num_rows, 1), float("-inf"), dtype=torch.float32, device=device)

    if k is not None:
        # top-k: the k-th largest logit is the threshold (ties with it kept).
        k_on = random_row & (k > 0) & (k < vocab)
        kth = sorted_desc.gather(1, (k.clamp(1, vocab) - 1)[:, None])
        threshold = torch.where(k_on[:, None], kth, threshold)

    if p is not None:
        # top-p on what top-k left, at the request's temperature. A row whose logits are all
        # -inf has NaN probabilities; it keeps num_kept = 1 and comes back as it was.
        p_on = random_row & (p < 1)
        kept_sorted = torch.where(sorted_desc >= threshold, sorted_desc, float("-inf"))
        scale = torch.where(random_row, temp, 1.0)[:, None]
        probs = torch.softmax(kept_sorted / scale, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # mass of the strictly more likely sorted entries
        num_kept = (mass_before < p[:, None]).sum(-1).clamp(min=1)
        last_kept = sorted_desc.gather(1, (num_kept - 1)[:, None])
        threshold = torch.where(p_on[:, None], torch.maximum(threshold, last_kept), threshold)

    # Compare values, not sorted positions, so that ties with a threshold are kept.
    return torch.where(values >= threshold, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))
