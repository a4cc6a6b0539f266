"""Pieces the chain and tree references share: sanitizing, gathering rows, the chunked sampler.

Vectorized PyTorch (no Python loop over requests), any compute dtype. The random numbers
come from the same Philox streams as the kernels (``philox``), so for the same seeds the
kernels must emit the same tokens except where two float computations of one quantity fall
on either side of a threshold (docs/ALGORITHM.md).
"""
from __future__ import annotations

import torch

from .philox import SAMPLE_CHUNK, STREAM_SAMPLE, open_uniform_from_word, philox_words, uniform_from_word
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


def gather_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t[idx] with idx clamped into range; zeros when t has no rows (callers mask the result)."""
    if t.shape[0] == 0:
        return torch.zeros(*idx.shape, *t.shape[1:], dtype=t.dtype, device=t.device)
    return t[idx.clamp(0, t.shape[0] - 1)]


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Lowest index of the maximum along the last dim; -1 where the row has no value > -inf."""
    row_max = logits.max(-1).values
    idx = torch.argmax(logits, -1)  # torch returns the first maximal index
    return torch.where(row_max > float("-inf"), idx, -1)



def apply_filters(logits, greedy, inv_temp, top_k, top_p, min_p):
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

