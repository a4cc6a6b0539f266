"""Quality measures of lenient speculative generation (issue #39; docs/ALGORITHM.md §8).

- ``mean_log_likelihood``: the target's own log-probability (temperature 1, no filters) of each
  generated token given everything before it, averaged over the generated tokens: how likely
  the target finds the text, whatever sampled it.
- ``first_token_tv``: on a fixed context, the total-variation distance between the law of the
  first token a lenient step emits and the target's distribution there: measured (``draws``
  steps of the op on that context, seeded) and from the closed form of
  ``reference.lenience.first_token_law``. The measured value carries sampling noise of order
  sqrt(support / draws); its l = 1 value is that noise floor (the exact op's law is the target's).

Both are deterministic given the seeds.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..chain import rejection_sample
from ..reference.lenience import first_token_law, greedy_first_token_law, greedy_passes
from .speculative import Drafter, SamplingParams, standardized_probs

#: Requests per op call when measuring the first-token law (the CPU reference holds
#: [requests, 2, V] in float64).
TV_CHUNK = 250


@torch.no_grad()
def mean_log_likelihood(target, prompt_ids: Sequence[int], generated: Sequence[int]) -> float:
    """Mean over ``generated`` of log q_target(token | prompt + earlier generated tokens), T = 1."""
    if not generated:
        return float("nan")
    device = next(target.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(generated)], dtype=torch.long, device=device)
    logits = target(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt_ids):, None]).squeeze(1)
    return float(logp.mean())


@torch.no_grad()
def first_token_tv(target, drafter: Drafter, context: Sequence[int], sampling: SamplingParams, lenience: float,
                   draws: int, seed: int, request: int = 10**6) -> tuple[float, float, float]:
    """(measured, law) total-variation distance of a lenient step's first token from the target
    at ``context``, with one draft from ``drafter`` (its own distribution and sampling), and the
    probability that this first draft is accepted (closed form: sum_x min(p(x), q(x)/l); 0 when
    the drafter proposes nothing there).

    The drafter proposes once (request id ``request``, released after); its draft distribution
    p (or, for a deterministic drafter, its token) and the target's row at the context give the
    step's law. ``draws`` requests replay the step with seeds ``seed + i``: drafts x ~ p from a
    generator seeded with ``seed``, then ``rejection_sample`` with ``lenience``. A drafter that
    proposes nothing there leaves the step exact (both distances 0 up to noise).
    """
    device = next(target.parameters()).device
    logits = target(input_ids=torch.tensor([list(context)], dtype=torch.long, device=device)).logits[0, -1].float()
    vocab = logits.shape[0]
    gen = torch.Generator(device=device).manual_seed(seed)
    proposal = drafter.propose(request, list(context), 1, sampling, gen)
    drafter.release(request)
    if sampling.greedy:
        q = torch.nn.functional.one_hot(logits.argmax(), vocab).double()
    else:
        q = standardized_probs(logits[None], sampling)[0].double()
    probs = getattr(proposal, "probs", None)
    accept = 0.0
    if proposal.tokens.numel() == 0:
        p = None
        law = q
    else:
        if probs is not None:
            p = probs[0].to(device=device, dtype=torch.float32)
            draft_law = p.double()
        else:
            p = None
            draft_law = torch.nn.functional.one_hot(proposal.tokens[0].cpu(), vocab).double().to(device)
        if sampling.greedy:
            law = greedy_first_token_law(draft_law, logits, lenience)
            accept = float(torch.where(greedy_passes(logits, lenience), draft_law, 0.0).sum())
        else:
            law = first_token_law(draft_law, q, lenience)
            accept = float(torch.minimum(draft_law, q / float(lenience)).sum())
    counts = torch.zeros(vocab, dtype=torch.float64, device=device)
    temperature = max(sampling.temperature, 0.0)
    filters = {}
    if sampling.filtered:
        filters = dict(top_k=torch.tensor([max(sampling.top_k, 0)], dtype=torch.int32, device=device),
                       top_p=torch.tensor([min(sampling.top_p, 1.0)], dtype=torch.float32, device=device))
    draft_gen = torch.Generator(device=device).manual_seed(seed)
    for start in range(0, draws, TV_CHUNK):
        m = min(TV_CHUNK, draws - start)
        if proposal.tokens.numel() == 0:
            drafts = torch.zeros(0, dtype=torch.long, device=device)
            cu = torch.zeros(m + 1, dtype=torch.int32, device=device)
            rows = logits.expand(m, vocab)
        elif p is not None:
            drafts = torch.multinomial(p.expand(m, vocab), 1, replacement=True, generator=draft_gen).squeeze(1)
            cu = torch.arange(m + 1, dtype=torch.int32, device=device)
            rows = logits.expand(2 * m, vocab)
        else:
            drafts = proposal.tokens[:1].to(device).expand(m).contiguous()
            cu = torch.arange(m + 1, dtype=torch.int32, device=device)
            rows = logits.expand(2 * m, vocab)
        out, _ = rejection_sample(
            rows.contiguous(), drafts, cu, None if p is None else p.expand(m, vocab).contiguous(),
            torch.full((m,), temperature, device=device), torch.arange(start, start + m, device=device) + seed,
            None, int(drafts.numel() > 0), lenience=torch.full((m,), float(lenience), device=device),
            **{k: v.expand(m).contiguous() for k, v in filters.items()})
        counts += torch.bincount(out[:, 0].long(), minlength=vocab).double()
    measured = 0.5 * float((counts / counts.sum() - q).abs().sum())
    return measured, 0.5 * float((law - q).abs().sum()), accept
