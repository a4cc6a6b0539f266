"""Chain verification: the Python API of ``torch.ops.specdec.rejection_sample``."""
from __future__ import annotations

import os

import torch

from . import _ops
from .backends import resolve_backend
from .checks import check_rejection_sample_contents, check_rejection_sample_inputs
from .reference import rejection_sample_reference
from .reference.philox import draw_seeds


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    max_spec_len: int | None = None,
    method: str = "token",
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    lenience: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a ragged batch of draft chains against the target and sample the final tokens.

    Modified rejection sampling (Leviathan et al. 2022, Chen et al. 2023): the emitted tokens
    are distributed exactly as autoregressive samples from the target. One fused kernel
    launch on CUDA, no host-device synchronization, CUDA-graph capturable.

    Parameters
    ----------
    target_logits : Tensor [N + B, V], float32 / bfloat16 / float16
        Request b owns rows ``cu[b] + b .. cu[b+1] + b``: one row per draft position, then
        its bonus row. Read in their own dtype; any row stride.
    draft_token_ids : Tensor [N], int32 / int64
        The drafts, request after request. An id outside [0, V) (e.g. -1) ends the chain: it
        is never accepted and the final token is sampled from that row's target distribution.
    cu_num_draft_tokens : Tensor [B + 1], int32 / int64
        Exclusive offsets of each request's drafts, ``cu[0] = 0``; a request may have 0 drafts.
    draft_probs : Tensor [N, V] or None
        Row i = the distribution draft i was sampled from (already standardized). None means
        deterministic drafts (n-gram, argmax/top-k heads): each draft is a point mass.
    temperature : Tensor [B] or None
        Per request; 0 = greedy, None = 1 for every request. Greedy and random requests mix.
    seeds, offsets : Tensor [B] int64 or None
        Counter-based random streams (docs/ALGORITHM.md): same seeds and offsets give the
        same tokens on every backend. Advance ``offsets`` by one per step. Without seeds, they
        are drawn from torch's generator on the device (one extra small launch).
    max_spec_len : int or None
        Output width - 1; requests with more drafts use only the first ``max_spec_len``.
        None computes the largest draft count, which synchronizes: pass it on the hot path.
    method : {"token", "block"}
        "token": draft by draft (Leviathan et al. 2022). "block": the block verification of
        Sun et al. 2024, which keeps the target distribution, never accepts fewer drafts in
        expectation and is optimal (docs/ALGORITHM.md §6). With draft probabilities it reads
        every draft row, not one per request. Greedy requests are the same in both.
    top_k : Tensor [B], int32 / int64, or None
        Per request: keep the tokens whose logit is >= the k-th largest of the row (ties kept).
        0 (or >= V) = off; None = off for every request.
    top_p : Tensor [B], float32 (float64 / bfloat16 / float16 accepted), or None
        Per request, in (0, 1]: after top-k, keep the smallest top set whose probability
        (at the request's temperature, renormalized over what top-k kept) reaches p, the token
        crossing p and its ties included. 1 = off; None = off for every request.
    min_p : Tensor [B], float, or None
        Per request, in [0, 1]: keep the tokens with probability >= min_p * the largest one.
        0 = off; None = off for every request.

        The filters apply to every target row of a random request (its draft rows and its
        bonus row), in the order temperature -> top-k -> top-p -> min-p (a threshold pass
        before the verification kernel, no sort; docs/ALGORITHM.md §7):
        verification and the final token use the filtered target, so the emitted tokens
        follow it exactly. ``draft_probs`` must be what the drafter sampled from (filtered or
        not is the drafter's business). Greedy requests ignore them.
    lenience : Tensor [B], float32 (float64 / bfloat16 / float16 accepted and cast), or None
        Per request, in (0, 1]: opt-in, NOT exact (docs/ALGORITHM.md §8). Random requests
        accept draft x iff ``u * l * p(x) < q(x)`` (deterministic drafts: ``u * l < q(x)``) and
        sample a rejection from ``norm(max(0, q - l p))``: no token is emitted with probability
        above ``q(x) / l``. Greedy requests also accept a draft with ``p(x) >= l * max p``
        (softmax at T = 1). 1 = exact, bit-identical to None for the same seeds; None = exact
        for every request. Not with ``method="block"`` (ValueError).
    backend : {"auto", "cpu", "cuda", "triton", "reference"} or None
        None = $SPECDEC_BACKEND or "auto" (see ``specdec_kernels.available_backends()``).
        "auto" on CPU tensors runs the fused C++ CPU kernel ("cpu", the op's CPU dispatch; it
        has the filters); on CUDA tensors the CUDA kernel, which runs its threshold pass first
        when given any of ``top_k`` / ``top_p`` / ``min_p`` (sm_90 and newer; on older GPUs
        "auto" uses the Triton kernel for filtered calls).
    validate : bool or None
        Also check the values (offsets, ids, temperatures, probabilities, filter ranges);
        synchronizes. None = $SPECDEC_VALIDATE == "1".

    Returns
    -------
    output_token_ids : Tensor [B, max_spec_len + 1], int32
        The accepted drafts, then the recovered or bonus token, then -1. The final token is
        -1 only if its target row has no valid logit (all NaN / -inf).
    num_accepted : Tensor [B], int32
        Accepted drafts per request (the final token not counted).
    """
    if max_spec_len is None and isinstance(cu_num_draft_tokens, torch.Tensor) and cu_num_draft_tokens.numel() > 1:
        max_spec_len = int((cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]).max())
    elif max_spec_len is None:
        max_spec_len = 0
    check_rejection_sample_inputs(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs,
                                  temperature, seeds, offsets, max_spec_len, method, top_k, top_p, min_p,
                                  lenience)
    if validate if validate is not None else os.environ.get("SPECDEC_VALIDATE") == "1":
        check_rejection_sample_contents(target_logits, draft_token_ids, cu_num_draft_tokens,
                                        draft_probs, temperature, max_spec_len, top_k, top_p, min_p, lenience)
    device = target_logits.device
    backend = resolve_backend(backend, device)
    filtered = top_k is not None or top_p is not None or min_p is not None
    if seeds is None:
        seeds = draw_seeds(cu_num_draft_tokens.shape[0] - 1, device)
    args = (target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature, seeds,
            offsets, max_spec_len)
    if backend == "reference":
        return rejection_sample_reference(*args, method=method, top_k=top_k, top_p=top_p, min_p=min_p,
                                          lenience=lenience)
    if backend == "triton":
        return _ops.triton_call(*args, method, top_k, top_p, min_p, lenience)
    if (filtered and backend == "auto" and device.type == "cuda" and _ops.cuda_kernel_built()
            and not _ops.cuda_filters_supported(device.index)):
        # The CUDA kernel's threshold pass needs sm_90: the Triton kernel has the filters here.
        return torch.ops.specdec._rejection_sample_triton(*args, method, top_k, top_p, min_p, lenience)
    return torch.ops.specdec.rejection_sample(*args, method, top_k, top_p, min_p, lenience)


def rejection_sample_padded(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    validate: bool | None = None,
    method: str = "token",
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    lenience: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` for padded batches: every request has K draft slots.

    Parameters
    ----------
    target_logits : Tensor [B, K + 1, V]
        Row k of request b scores the token after draft k - 1; row K is the bonus row.
    draft_token_ids : Tensor [B, K]
    draft_probs : Tensor [B, K, V] or None
    num_draft_tokens : Tensor [B] or None
        Drafts actually proposed per request (<= K); slots past it are ignored and the final
        token of such a request comes from its row ``num_draft_tokens[b]``. None = K for all.
    temperature, seeds, offsets, method, top_k, top_p, min_p, lenience, backend, validate
        As in ``rejection_sample``.

    Returns
    -------
    output_token_ids : Tensor [B, K + 1] int32, num_accepted : Tensor [B] int32
    """
    for name, t, ndim in (("target_logits", target_logits, 3), ("draft_token_ids", draft_token_ids, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != ndim:
            raise ValueError(f"{name} must be a {ndim}-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    batch, k = draft_token_ids.shape
    if tuple(target_logits.shape[:2]) != (batch, k + 1):
        raise ValueError(f"target_logits must have shape (B, K + 1, V) = ({batch}, {k + 1}, V), "
                         f"got {tuple(target_logits.shape)}")
    if draft_probs is not None and (draft_probs.dim() != 3 or tuple(draft_probs.shape[:2]) != (batch, k)):
        raise ValueError(f"draft_probs must have shape (B, K, V) = ({batch}, {k}, V), got {tuple(draft_probs.shape)}")
    drafts = draft_token_ids
    if num_draft_tokens is not None:
        if num_draft_tokens.shape != (batch,):
            raise ValueError(f"num_draft_tokens must have shape (B,) = ({batch},), got {tuple(num_draft_tokens.shape)}")
        # Slots past a request's count become -1, which ends its chain at that row.
        slot = torch.arange(k, device=drafts.device)
        drafts = torch.where(slot[None, :] < num_draft_tokens[:, None].to(drafts.device), drafts, -1)
    cu = torch.arange(0, (batch + 1) * k, k, dtype=torch.int32, device=target_logits.device) if k else \
        torch.zeros(batch + 1, dtype=torch.int32, device=target_logits.device)
    return rejection_sample(
        target_logits.reshape(batch * (k + 1), target_logits.shape[-1]),
        drafts.reshape(batch * k), cu,
        None if draft_probs is None else draft_probs.reshape(batch * k, draft_probs.shape[-1]),
        temperature, seeds, offsets, k, method, top_k, top_p, min_p, lenience, backend=backend, validate=validate)
