"""Tree verification, the float64 oracle of ``torch.ops.specdec.tree_rejection_sample``
(docs/ALGORITHM.md §5)."""
from __future__ import annotations

import torch

from .common import apply_filters, chunked_categorical, first_argmax, gather_rows, sanitize_logits
from .philox import STREAM_ACCEPT, philox_words, uniform_from_word


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
    lenience: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree verification over a ragged batch (docs/ALGORITHM.md §5); arguments as
    ``torch.ops.specdec.tree_rejection_sample``. The filters act on every node's row as in
    ``rejection_sample_reference``; ``lenience`` ([B] or None) relaxes the walk's accept tests
    (docs/ALGORITHM.md §8): u l p(c) mass < (q - a p)+(c) with a growing by l * mass per
    rejection, u l (1 - q(E)) < q(c) for deterministic drafts, and the greedy near-max rule.

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
    # The kernels read lenience as float32: the reference rounds it there too.
    lam = None if lenience is None else lenience.to(device=device, dtype=torch.float32).to(compute_dtype)
    b_idx = torch.arange(B, device=device)
    lane = torch.arange(V, device=device)

    def targetgather_rows(nodes: torch.Tensor):
        """(q [B, V], argmax [B], logits [B, V]) of the given global nodes (-1: a row with no
        valid logit); the logits are sanitized and filtered (greedy rows: unfiltered)."""
        lg = sanitize_logits(gather_rows(target_logits, nodes).to(compute_dtype))
        lg.masked_fill_((nodes < 0)[:, None], float("-inf"))
        lg = apply_filters(lg, greedy, inv_temp, top_k, top_p, min_p)
        row_max = lg.max(-1, keepdim=True).values
        shift = torch.where(row_max > float("-inf"), row_max, 0.0)
        q = (lg - shift).mul_(inv_temp[:, None]).exp_()
        q.div_(q.sum(-1, keepdim=True).clamp(min=torch.finfo(compute_dtype).tiny))
        return q, first_argmax(lg), lg

    # Walk state per request.
    has_root = n_nodes > 0
    node = torch.where(has_root, cu[:-1], -1)          # current node (global)
    cand = torch.where(has_root, gather_rows(first_child, node), -1)  # next child to test
    depth = torch.zeros(B, dtype=torch.int64, device=device)
    cand = torch.where(depth >= D, -1, cand)
    a = torch.zeros(B, dtype=compute_dtype, device=device)       # residual (q - a p)+
    excluded = torch.zeros(B, V, dtype=torch.bool, device=device)  # residual q without these
    path = torch.full((B, D + 1), -1, dtype=torch.int64, device=device)
    out = torch.full((B, D + 1), -1, dtype=torch.int64, device=device)
    path[:, 0] = torch.where(has_root, 0, -1)
    q, argmax, lg = targetgather_rows(node)
    p = gather_rows(draft_probs, node).to(compute_dtype) if draft_probs is not None else None

    while bool((cand >= 0).any()):
        testing = cand >= 0
        x = torch.where(testing, gather_rows(tokens, cand).to(torch.int64), -1)
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
            lp_x = p_x if lam is None else lam * p_x
            accept_random = u * lp_x * mass < r_x
        else:
            # r = q / (1 - q(E)) outside the rejected children E.
            free = 1.0 - torch.where(excluded, q, 0.0).sum(-1)
            ul = u if lam is None else u * lam
            accept_random = (ul * free < q_x) & ~excluded.gather(1, xc[:, None]).squeeze(1)
        accept_greedy = x == argmax
        if lam is not None:
            # Lenient greedy (l < 1): also a child whose logit is within ln(l) of the row max.
            near = (lg.gather(1, xc[:, None]).squeeze(1) - lg.max(-1).values) >= torch.log(lam)
            accept_greedy = accept_greedy | ((lam < 1) & near)
        accept = x_ok & torch.where(greedy, accept_greedy, accept_random)
        rejected = testing & ~accept
        # Rejection: shrink the residual (invalid ids subtract nothing), move to the next sibling.
        if p is not None:
            a = torch.where(rejected & x_ok & ~greedy, a + (mass if lam is None else lam * mass), a)
        else:
            excluded[b_idx[rejected & x_ok], xc[rejected & x_ok]] = True
        cand = torch.where(rejected, gather_rows(next_sibling, cand), cand)
        # Acceptance: emit the token, descend, start a fresh residual at the child.
        if bool(accept.any()):
            out[b_idx[accept], depth[accept]] = x[accept]
            depth = depth + accept.to(torch.int64)
            path[b_idx[accept], depth[accept]] = local_cand[accept]
            node = torch.where(accept, cand, node)
            nxt = gather_rows(first_child, cand)
            cand = torch.where(accept, torch.where(depth >= D, -1, nxt), cand)
            a = torch.where(accept, 0.0, a)
            excluded[accept] = False
            q_new, argmax_new, lg_new = targetgather_rows(torch.where(accept, node, -1))
            q = torch.where(accept[:, None], q_new, q)
            lg = torch.where(accept[:, None], lg_new, lg)
            argmax = torch.where(accept, argmax_new, argmax)
            if p is not None:
                p = torch.where(accept[:, None], gather_rows(draft_probs, node).to(compute_dtype), p)

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

