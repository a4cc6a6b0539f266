"""Synthetic target/draft pairs with known laws, for the demo, the tests and the benchmarks.

- ``iid_pair``: one target distribution q and one draft distribution p over V tokens with
  acceptance rate sum_x min(p(x), q(x)) = a exactly, used at every position (contexts do not
  matter), so tokens per step follow (1 - a^(K+1)) / (1 - a).
- ``MarkovPair``: a first-order target and draft (the next-token law depends on the previous
  token), so the joint law of the first two emitted tokens tests the residual, the bonus and
  the hand-over between positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def iid_pair(vocab: int, acceptance: float, generator: torch.Generator | None = None,
             dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, p) with sum_x min(p, q) = ``acceptance``.

    p = a*s + (1-a)*e1 and q = a*s + (1-a)*e2 with e1, e2 of disjoint supports, so
    min(p, q) = a*s + (1-a)*min(e1, e2) = a*s. Needs vocab >= 3.
    """
    if vocab < 3:
        raise ValueError("iid_pair needs vocab >= 3")
    a = float(acceptance)
    half = vocab // 2
    s = torch.rand(vocab, generator=generator, dtype=dtype) + 0.1
    e1 = torch.zeros(vocab, dtype=dtype)
    e2 = torch.zeros(vocab, dtype=dtype)
    e1[:half] = torch.rand(half, generator=generator, dtype=dtype) + 0.1
    e2[half:] = torch.rand(vocab - half, generator=generator, dtype=dtype) + 0.1
    s, e1, e2 = s / s.sum(), e1 / e1.sum(), e2 / e2.sum()
    return a * s + (1 - a) * e2, a * s + (1 - a) * e1


def chain_batch_iid(q: torch.Tensor, p: torch.Tensor, batch: int, k: int,
                    generator: torch.Generator | None = None, logits_dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu"):
    """A ragged batch where every request has k drafts sampled i.i.d. from p and every target
    row is log q. Returns (target_logits [B(k+1), V], drafts [Bk], cu [B+1], draft_probs [Bk, V])."""
    vocab = q.shape[0]
    drafts = torch.multinomial(p.float().expand(batch * k, vocab), 1, replacement=True,
                               generator=generator).squeeze(1) if k else torch.zeros(0, dtype=torch.int64)
    logits = torch.log(q).to(logits_dtype).expand(batch * (k + 1), vocab)
    probs = p.float().expand(batch * k, vocab)
    cu = torch.arange(0, batch * k + 1, max(k, 1), dtype=torch.int32)[: batch + 1] if k else \
        torch.zeros(batch + 1, dtype=torch.int32)
    return (logits.contiguous().to(device), drafts.to(device), cu.to(device), probs.contiguous().to(device))


@dataclass
class MarkovPair:
    """Target: first token ~ softmax(q0 / T), next ~ softmax(Q[prev] / T). Draft: p0, P[prev]."""
    q0: torch.Tensor  # [V] target logits of the first token
    Q: torch.Tensor   # [V, V] target logits of the next token given the previous one
    p0: torch.Tensor  # [V] draft probabilities of the first token
    P: torch.Tensor   # [V, V] draft probabilities of the next token given the previous one

    @staticmethod
    def random(vocab: int, seed: int = 0, spread: float = 1.5, mask_token: int | None = None) -> "MarkovPair":
        """Random pair; the draft is a perturbed copy of the target (acceptance ~0.6-0.8).
        ``mask_token`` gets target logit -inf everywhere (it must never be emitted)."""
        g = torch.Generator().manual_seed(seed)
        q0 = torch.randn(vocab, generator=g, dtype=torch.float64) * spread
        Q = torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * spread
        p0 = torch.softmax(q0 + torch.randn(vocab, generator=g, dtype=torch.float64), -1)
        P = torch.softmax(Q + torch.randn(vocab, vocab, generator=g, dtype=torch.float64), -1)
        if mask_token is not None:
            q0[mask_token] = float("-inf")
            Q[:, mask_token] = float("-inf")
        return MarkovPair(q0, Q, p0, P)

    def joint_law(self, temperature: float = 1.0) -> torch.Tensor:
        """[V, V]: P(first = a, second = b) under the target at ``temperature``."""
        first = torch.softmax(self.q0 / temperature, -1)
        nxt = torch.softmax(self.Q / temperature, -1)
        return first[:, None] * nxt


def first_two_tokens(sampler, pair: MarkovPair, num_requests: int, num_drafts: torch.Tensor,
                     temperature: float, deterministic: bool, seed: int,
                     logits_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Generate two tokens per request with speculative steps of ``sampler`` and return them.

    ``sampler(target_logits, drafts, cu, draft_probs, temperature, seeds, offsets, max_spec_len)``
    is any backend. Request r proposes ``num_drafts[r]`` drafts (0 allowed) from the draft
    model (sampled, or argmax chains when ``deterministic``); if a step emits a single token a
    second step (offset 1) continues from it. Returns (first [M], second [M]) int64 on CPU.
    """
    g = torch.Generator().manual_seed(seed)
    vocab = pair.q0.shape[0]

    def step(prev: torch.Tensor | None, counts: torch.Tensor, offset: int):
        m = counts.shape[0]
        k = int(counts.max()) if m else 0
        drafts = torch.zeros(m, k, dtype=torch.int64)
        rows_logits = torch.zeros(m, k + 1, vocab, dtype=torch.float64)
        rows_probs = torch.zeros(m, k, vocab, dtype=torch.float64)
        cur_logits = pair.q0.expand(m, vocab) if prev is None else pair.Q[prev]
        cur_probs = pair.p0.expand(m, vocab) if prev is None else pair.P[prev]
        for j in range(k + 1):
            rows_logits[:, j] = cur_logits
            if j == k:
                break
            rows_probs[:, j] = cur_probs
            if deterministic:
                x = cur_probs.argmax(-1)
            else:
                x = torch.multinomial(cur_probs, 1, generator=g).squeeze(1)
            drafts[:, j] = x
            cur_logits, cur_probs = pair.Q[x], pair.P[x]
        # Ragged layout: request r keeps its first counts[r] drafts and then its bonus row,
        # which is the row after its last kept draft.
        keep = torch.arange(k)[None, :] < counts[:, None]
        keep_rows = torch.cat([keep, torch.zeros(m, 1, dtype=torch.bool)], 1)
        keep_rows[torch.arange(m), counts] = True
        logits = rows_logits[keep_rows].to(logits_dtype)
        probs = rows_probs[keep].float()
        cu = torch.zeros(m + 1, dtype=torch.int32)
        cu[1:] = counts.cumsum(0)
        seeds = torch.arange(m, dtype=torch.int64) * 7919 + seed
        offsets = torch.full((m,), offset, dtype=torch.int64)
        temp = torch.full((m,), float(temperature), dtype=torch.float32)
        out, _ = sampler(logits.to(device), drafts[keep].to(device), cu.to(device),
                         None if deterministic else probs.to(device), temp.to(device),
                         seeds.to(device), offsets.to(device), k)
        return out.cpu().long()

    out = step(None, num_drafts, 0)
    first, second = out[:, 0], out[:, 1]
    short = second < 0
    if short.any():
        # Second step for requests whose first step emitted one token.
        second = second.clone()
        second[short] = step(first[short], num_drafts[short], 1)[:, 0]
    return first, second


def first_tokens_tree(tree_sampler, pair: MarkovPair, num_requests: int, tree_parents: list[int],
                      temperature: float, deterministic: bool, seed: int, num_tokens: int = 2,
                      logits_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Generate ``num_tokens`` tokens per request with tree steps of ``tree_sampler`` and return
    them ([M, num_tokens] int64 on CPU).

    ``tree_sampler(target_logits, tokens, parents, cu, draft_probs, temperature, seeds, offsets,
    max_depth)`` is any backend of the tree op. Every step uses a tree of the shape
    ``tree_parents`` (local parent indices, -1 for the root) whose root is the last token so
    far: children drawn i.i.d. from the draft row of their parent, or (``deterministic``) the
    parent row's most likely draft tokens, distinct, in order. A step that emits fewer tokens
    than needed is followed by another (the next offset) from its last token.
    """
    g = torch.Generator().manual_seed(seed)
    vocab = pair.q0.shape[0]
    n = len(tree_parents)
    par = torch.tensor(tree_parents)
    depth = [0] * n
    for j in range(1, n):
        depth[j] = depth[tree_parents[j]] + 1
    max_depth = max(depth)
    rank = [sum(1 for i in range(1, j) if tree_parents[i] == tree_parents[j]) for j in range(n)]

    def step(prev: torch.Tensor | None, m: int, offset: int, seeds: torch.Tensor) -> torch.Tensor:
        node_tok = torch.zeros(m, n, dtype=torch.int64)
        rows = torch.zeros(m, n, vocab, dtype=torch.float64)
        draft = torch.zeros(m, n, vocab, dtype=torch.float64)
        rows[:, 0] = pair.q0.expand(m, vocab) if prev is None else pair.Q[prev]
        draft[:, 0] = pair.p0.expand(m, vocab) if prev is None else pair.P[prev]
        for j in range(1, n):
            parent_draft = draft[:, tree_parents[j]]
            if deterministic:
                x = parent_draft.topk(rank[j] + 1, -1).indices[:, rank[j]]
            else:
                x = torch.multinomial(parent_draft, 1, generator=g).squeeze(1)
            node_tok[:, j] = x
            rows[:, j] = pair.Q[x]
            draft[:, j] = pair.P[x]
        cu = torch.arange(0, (m + 1) * n, n, dtype=torch.int32)
        parents = par.repeat(m).to(torch.int32)
        temp = torch.full((m,), float(temperature), dtype=torch.float32)
        out, _, _ = tree_sampler(rows.reshape(m * n, vocab).to(logits_dtype).to(device),
                                 node_tok.reshape(-1).to(device), parents.to(device), cu.to(device),
                                 None if deterministic else draft.reshape(m * n, vocab).float().to(device),
                                 temp.to(device), seeds.to(device),
                                 torch.full((m,), offset, dtype=torch.int64).to(device), max_depth)
        return out.cpu().long()

    seeds = torch.arange(num_requests, dtype=torch.int64) * 7919 + seed
    tokens = torch.full((num_requests, num_tokens), -1, dtype=torch.int64)
    have = torch.zeros(num_requests, dtype=torch.int64)
    prev = None
    todo = torch.arange(num_requests)
    offset = 0
    while todo.numel():
        out = step(None if prev is None else prev[todo], todo.numel(), offset, seeds[todo])
        for j in range(out.shape[1]):
            emit = (out[:, j] >= 0) & (have[todo] < num_tokens)
            tokens[todo[emit], have[todo[emit]]] = out[emit, j]
            have[todo[emit]] += 1
        prev = tokens.gather(1, (have - 1).clamp(min=0)[:, None]).squeeze(1)
        todo = todo[have[todo] < num_tokens]
        offset += 1
    return tokens
