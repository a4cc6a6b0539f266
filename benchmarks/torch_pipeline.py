"""Baselines for the verify step that the benchmark times beside our kernels.

``torch_pipeline``: the straightforward PyTorch implementation an engine would write first
(fp32 cast, temperature, softmax over every row, gathers, accept test, residual, multinomial
for the recovered and bonus tokens). Padded layout [B, K+1, V], every request with K drafts.

``flashinfer_pipeline``: FlashInfer's softmax + chain_speculative_sampling, only when the
``flashinfer`` package is importable (see benchmarks/README.md).
"""
from __future__ import annotations

import torch


def torch_pipeline(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                   temperature: torch.Tensor, generator: torch.Generator | None = None):
    """logits [B, K+1, V], drafts [B, K], draft_probs [B, K, V] or None, temperature [B] (> 0)."""
    batch, k1, _ = logits.shape
    k = k1 - 1
    q = torch.softmax(logits.float() / temperature[:, None, None], -1)
    q_x = q[:, :k].gather(2, drafts[..., None]).squeeze(-1)
    p_x = draft_probs.gather(2, drafts[..., None]).squeeze(-1).float() if draft_probs is not None else torch.ones_like(q_x)
    u = torch.rand(batch, k, device=logits.device, generator=generator)
    accepted = (u * p_x < q_x).int().cumprod(-1)
    num_accepted = accepted.sum(-1)
    rows = torch.arange(batch, device=logits.device)
    q_final = q[rows, num_accepted]
    rejected = num_accepted < k
    if draft_probs is not None:
        p_final = draft_probs[rows, num_accepted.clamp(max=k - 1)].float()
        residual = (q_final - p_final).clamp(min=0)
    else:
        residual = q_final.scatter(1, drafts[rows, num_accepted.clamp(max=k - 1)][:, None], 0.0)
    weights = torch.where(rejected[:, None], residual, q_final)
    weights = weights + (weights.sum(-1, keepdim=True) == 0) * q_final  # empty residual -> q
    token = torch.multinomial(weights, 1, generator=generator).squeeze(1)
    out = torch.where(torch.arange(k1, device=logits.device)[None, :] < num_accepted[:, None],
                      torch.nn.functional.pad(drafts, (0, 1)), -1)
    out.scatter_(1, num_accepted[:, None], token[:, None])
    return out.int(), num_accepted.int()


def flashinfer_pipeline():
    """(callable, version) for FlashInfer's softmax + chain_speculative_sampling, or None."""
    try:
        import flashinfer
        from flashinfer.sampling import chain_speculative_sampling, softmax
    except Exception:  # not installed, or its JIT toolchain is missing
        return None

    def run(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor, temperature: torch.Tensor):
        batch, k1, vocab = logits.shape
        target_probs = softmax(logits.reshape(batch * k1, vocab).float(),
                               temperature=temperature.repeat_interleave(k1)).view(batch, k1, vocab)
        return chain_speculative_sampling(draft_probs, drafts.int(), target_probs)

    return run, flashinfer.__version__
