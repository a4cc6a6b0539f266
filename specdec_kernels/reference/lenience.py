"""The emitted law of a lenient verify step in closed form (docs/ALGORITHM.md §8), float64.

With lenience l in (0, 1], a draft x ~ p is accepted with probability min(1, q(x) / (l p(x)))
and a rejection is followed by a sample of norm(max(0, q - l p)). The first emitted token of a
chain step with at least one draft then has the law

    P(x) = min(p(x), q(x) / l) + P_rej * max(0, q(x) - l p(x)) / S,
    P_rej = 1 - sum_y min(p(y), q(y) / l),   S = sum_y max(0, q(y) - l p(y)) = 1 - l + l P_rej,

and P(x) <= q(x) / l for every x. l = 1 gives P = q (the exact op). The tests fit the kernels'
tokens to these laws; the CLI computes the exact total-variation distance from them.
"""
from __future__ import annotations

import math

import torch


def first_token_law(p: torch.Tensor, q: torch.Tensor, lenience: float) -> torch.Tensor:
    """Law of the first emitted token of a lenient chain step with draft row(s) ``p`` and target
    row(s) ``q`` ([..., V], each row a distribution), draft x ~ p. Point-mass drafts: p one-hot."""
    lam = float(lenience)
    if not 0.0 < lam <= 1.0:
        raise ValueError(f"lenience must be in (0, 1], got {lenience}")
    p = p.to(torch.float64)
    q = q.to(torch.float64)
    accepted = torch.minimum(p, q / lam)
    p_rej = (1.0 - accepted.sum(-1, keepdim=True)).clamp(min=0.0)
    residual = (q - lam * p).clamp(min=0.0)
    mass = residual.sum(-1, keepdim=True)
    # An empty residual (q == p, only possible at l = 1) is never reached: P_rej = 0 there.
    return accepted + torch.where(mass > 0, p_rej * residual / mass.clamp(min=torch.finfo(torch.float64).tiny), 0.0)


def accept_probability(p: torch.Tensor, q: torch.Tensor, lenience: float) -> torch.Tensor:
    """Probability that a draft x ~ p is accepted: sum_x min(p(x), q(x) / l)."""
    return torch.minimum(p.to(torch.float64), q.to(torch.float64) / float(lenience)).sum(-1)


def greedy_passes(logits: torch.Tensor, lenience: float) -> torch.Tensor:
    """Tokens a greedy (T = 0) request accepts as drafts: the first argmax, and with l < 1 every
    token whose logit is within ln(l) of the max (softmax at T = 1: p(x) >= l max p)."""
    logits = logits.to(torch.float64)
    passes = torch.zeros_like(logits, dtype=torch.bool)
    passes.scatter_(-1, logits.argmax(-1, keepdim=True), True)
    if float(lenience) < 1.0:
        passes |= (logits - logits.max(-1, keepdim=True).values) >= math.log(float(lenience))
    return passes


def greedy_first_token_law(p: torch.Tensor, logits: torch.Tensor, lenience: float) -> torch.Tensor:
    """Law of the first emitted token of a greedy request with drafts x ~ p: x if it passes the
    lenient greedy rule, else the argmax of the target row."""
    p = p.to(torch.float64)
    passes = greedy_passes(logits, lenience)
    law = torch.where(passes, p, 0.0)
    argmax = torch.zeros_like(law).scatter_(-1, logits.to(torch.float64).argmax(-1, keepdim=True), 1.0)
    return law + (1.0 - law.sum(-1, keepdim=True)) * argmax
