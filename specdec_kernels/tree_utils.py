"""Python helpers around the tree verify op (``torch.ops.specdec.tree_rejection_sample``).

Everything here uses the op's tree conventions (docs/TREE.md):

- a ragged batch of trees: request ``b`` owns rows ``cu_num_nodes[b] .. cu_num_nodes[b+1]-1``
  (exclusive offsets with a leading 0); a request may have no node;
- local node 0 is the root, the last verified token (its KV is computed in the verify pass);
- ``parents`` [N] holds *local* parent indices, ``parent < child``, ``-1`` for the root;
- ``tokens`` [N]: the node tokens (the root's is the last verified token).

The helpers are:

- ``tree_attention_mask``, ``tree_position_ids``, ``pad_nodes``, ``unpad_nodes``: feed a padded
  batch of trees to a target model (``scaled_dot_product_attention`` or HF transformers'
  4D masks) on top of a KV cache that already holds each request's prefix;
- ``accepted_kv_indices``: after the op, the KV-cache positions to keep (one gather);
- ``build_eagle_tree``: an EAGLE-2 style draft tree built level by level from a draft function;
- ``check_tree``: content validation (synchronizes), the op's optional validation mode.

KV layout of the padded batch (HF caches concatenate along the sequence axis, so this is
what a forward over a cache of width ``kv_prefix_len`` produces)::

    columns [0, kv_prefix_len)                      request b's prefix, P_b = prefix_lens[b]
                                                     tokens: right-padded [0, P_b) or
                                                     left-padded [kv_prefix_len - P_b, kv_prefix_len)
    columns [kv_prefix_len, kv_prefix_len + n_max)  tree node i of request b at column kv_prefix_len + i

This module imports only torch.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = [
    "DraftLevel",
    "DraftTree",
    "TreeAttentionMask",
    "accepted_kv_indices",
    "build_eagle_tree",
    "check_tree",
    "pad_nodes",
    "tree_attention_mask",
    "tree_depths",
    "tree_position_ids",
    "unpad_nodes",
]

_PADDING_SIDES = ("right", "left")


# --------------------------------------------------------------------------------------------
# Shared plumbing
# --------------------------------------------------------------------------------------------

def _offsets(cu_num_nodes: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu, counts) as int64, made safe to index with: clamped to [0, N] and non-decreasing.

    Malformed offsets read as empty or truncated requests (never an out-of-bounds read), as in
    the reference; ``check_tree`` reports them.
    """
    cu = cu_num_nodes.to(torch.int64).clamp(0, num_nodes)
    cu = torch.cummax(cu, 0).values
    return cu, cu[1:] - cu[:-1]


def _max_nodes(counts: torch.Tensor, n_max: int | None) -> int:
    if n_max is not None:
        return int(n_max)
    return int(counts.max()) if counts.numel() else 0  # synchronizes


def _pointer_jump_rounds(longest_chain: int) -> int:
    """Rounds of pointer jumping that cover a parent chain of ``longest_chain`` steps."""
    # The first hop is free (the parent link itself); each round doubles the reach.
    return (longest_chain - 1).bit_length() if longest_chain > 1 else 0


def _padded_parents(parents: torch.Tensor, cu: torch.Tensor, counts: torch.Tensor, n_max: int):
    """Local parent table [B, n_max] where unlinked nodes (root, padding, malformed links)
    point to themselves, and the validity mask [B, n_max] of real nodes."""
    device = parents.device
    local = torch.arange(n_max, device=device)
    valid = local[None, :] < counts[:, None]
    if parents.numel():
        rows = (cu[:-1, None] + local[None, :]).clamp(max=parents.numel() - 1)
        par = torch.where(valid, parents.to(torch.int64)[rows], -1)
    else:
        par = torch.full(valid.shape, -1, dtype=torch.int64, device=device)
    linked = valid & (local[None, :] > 0) & (par >= 0) & (par < local[None, :])
    return torch.where(linked, par, local[None, :]), valid


def _ancestor_or_self(up: torch.Tensor) -> torch.Tensor:
    """[B, n, n] bool: entry (b, i, j) is True iff j is i or an ancestor of i.

    Pointer jumping: after r rounds ``reach`` covers ancestors up to 2^r steps away, so
    ceil(log2(n - 1)) rounds cover any chain inside an n-node tree (no sync, fixed launches).
    """
    B, n = up.shape
    local = torch.arange(n, device=up.device)
    reach = (local[None, :, None] == local[None, None, :]) | (up[:, :, None] == local[None, None, :])
    jump = up
    for _ in range(_pointer_jump_rounds(n - 1)):
        reach = reach | reach.gather(1, jump[:, :, None].expand(B, n, n))
        jump = jump.gather(1, jump)
    return reach


def _check_padding_side(padding_side: str) -> None:
    if padding_side not in _PADDING_SIDES:
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")


# --------------------------------------------------------------------------------------------
# Padding between the ragged node layout and a [B, n_max] batch
# --------------------------------------------------------------------------------------------

def pad_nodes(values: torch.Tensor, cu_num_nodes: torch.Tensor, n_max: int | None = None,
              fill: float | int = 0) -> torch.Tensor:
    """Scatter per-node values of a ragged batch into a padded batch.

    Parameters
    ----------
    values : torch.Tensor
        ``[N, ...]`` one entry per node (e.g. ``tokens``), request after request.
    cu_num_nodes : torch.Tensor
        ``[B + 1]`` int32/int64 exclusive offsets with a leading 0.
    n_max : int, optional
        Width of the padded batch, at least the largest request. Default: the largest request
        (computing it synchronizes with the device).
    fill : float or int, default 0
        Value of the padding entries.

    Returns
    -------
    torch.Tensor
        ``[B, n_max, ...]``, same dtype as ``values``: row ``b``, column ``i`` holds node ``i``
        of request ``b``.
    """
    cu, counts = _offsets(cu_num_nodes.to(values.device), values.shape[0])
    n_max = _max_nodes(counts, n_max)
    local = torch.arange(n_max, device=values.device)
    valid = local[None, :] < counts[:, None]
    out = values.new_full((counts.shape[0], n_max, *values.shape[1:]), fill)
    if values.shape[0]:
        rows = (cu[:-1, None] + local[None, :]).clamp(max=values.shape[0] - 1)
        out[valid] = values[rows[valid]]
    return out


def unpad_nodes(padded: torch.Tensor, cu_num_nodes: torch.Tensor) -> torch.Tensor:
    """Gather a padded batch ``[B, n_max, ...]`` back into the ragged ``[N, ...]`` node layout.

    Parameters
    ----------
    padded : torch.Tensor
        ``[B, n_max, ...]``, e.g. the target's logits over a padded tree batch.
    cu_num_nodes : torch.Tensor
        ``[B + 1]`` exclusive offsets; every request must fit in ``n_max``.

    Returns
    -------
    torch.Tensor
        ``[N, ...]`` with ``N = cu_num_nodes[-1]`` (e.g. the op's ``target_logits``).
    """
    n_max = padded.shape[1]
    counts = (cu_num_nodes[1:] - cu_num_nodes[:-1]).to(device=padded.device, dtype=torch.int64)
    valid = torch.arange(n_max, device=padded.device)[None, :] < counts[:, None]
    return padded[valid]  # boolean indexing keeps row-major order: request after request


# --------------------------------------------------------------------------------------------
# Depth, positions, attention mask
# --------------------------------------------------------------------------------------------

def tree_depths(parents: torch.Tensor, cu_num_nodes: torch.Tensor) -> torch.Tensor:
    """Depth of every node (root = 0) of a ragged batch of trees, without synchronizing.

    Parameters
    ----------
    parents : torch.Tensor
        ``[N]`` int32/int64 local parent indices (``-1`` for the root, ``parent < child``).
    cu_num_nodes : torch.Tensor
        ``[B + 1]`` int32/int64 exclusive offsets with a leading 0.

    Returns
    -------
    torch.Tensor
        ``[N]`` int64 depths. A malformed link (parent out of range or ``>= child``) is
        treated as absent: that node gets depth 0 (``check_tree`` reports it).
    """
    num_nodes = parents.shape[0]
    device = parents.device
    cu, _ = _offsets(cu_num_nodes.to(device), num_nodes)
    node = torch.arange(num_nodes, device=device)
    owner = torch.searchsorted(cu[1:], node, right=True).clamp(max=max(cu.shape[0] - 2, 0))
    local = node - cu[owner]
    par = parents.to(torch.int64)
    linked = (local > 0) & (par >= 0) & (par < local)
    up = torch.where(linked, cu[owner] + par, node)
    # List ranking: dist[i] = steps from i to up[i]; doubling the jumps sums the distances.
    dist = linked.to(torch.int64)
    for _ in range(_pointer_jump_rounds(num_nodes - 1)):
        dist = dist + dist[up]
        up = up[up]
    return dist


def tree_position_ids(parents: torch.Tensor, cu_num_nodes: torch.Tensor,
                      prefix_lens: torch.Tensor | None = None, *, n_max: int | None = None) -> torch.Tensor:
    """Position ids of the tree nodes of a padded batch: prefix length + depth.

    Parameters
    ----------
    parents : torch.Tensor
        ``[N]`` local parent indices (``-1`` for the root).
    cu_num_nodes : torch.Tensor
        ``[B + 1]`` exclusive offsets.
    prefix_lens : torch.Tensor, optional
        ``[B]`` number of tokens of each request already in the KV cache (before the root).
        Default: 0 (the root is position 0).
    n_max : int, optional
        Padded width; default the largest request (synchronizes).

    Returns
    -------
    torch.Tensor
        ``[B, n_max]`` int64. Node ``i`` of request ``b`` gets ``prefix_lens[b] + depth``;
        padding entries get ``prefix_lens[b]`` (any valid position: their outputs are ignored).
        Pass as ``position_ids`` (RoPE) to the target model.
    """
    device = parents.device
    cu, counts = _offsets(cu_num_nodes.to(device), parents.shape[0])
    n_max = _max_nodes(counts, n_max)
    depth = pad_nodes(tree_depths(parents, cu), cu, n_max, fill=0)
    if prefix_lens is None:
        return depth
    return depth + prefix_lens.to(device=device, dtype=torch.int64)[:, None]


class TreeAttentionMask(NamedTuple):
    """The tree attention mask of a padded batch in its two usual forms.

    Attributes
    ----------
    allowed : torch.Tensor
        ``[B, 1, n_max, kv_len]`` bool, True = the query may attend to the key. For
        ``torch.nn.functional.scaled_dot_product_attention`` (``attn_mask``) and HF
        transformers' sdpa attention.
    additive : torch.Tensor
        ``[B, 1, n_max, kv_len]`` float: 0 where allowed, ``masked_value`` elsewhere. Added to the
        attention scores; for HF transformers' eager attention (which adds the mask to the
        scores), sdpa, and any ``scores + mask`` implementation.
    """

    allowed: torch.Tensor
    additive: torch.Tensor


def tree_attention_mask(parents: torch.Tensor, cu_num_nodes: torch.Tensor,
                        prefix_lens: torch.Tensor | None = None, *, n_max: int | None = None,
                        kv_prefix_len: int | None = None, kv_len: int | None = None,
                        padding_side: str = "right", dtype: torch.dtype = torch.float32,
                        masked_value: float | None = None) -> TreeAttentionMask:
    """Attention mask for one verify forward over a padded batch of draft trees.

    Query row ``i`` of request ``b`` is tree node ``i``. It may attend to the whole prefix of
    its own request and to tree node ``j`` iff ``j`` is ``i`` or an ancestor of ``i``, so every
    node sees exactly the causal context of its root-to-node path.

    Parameters
    ----------
    parents : torch.Tensor
        ``[N]`` int32/int64 local parent indices (``-1`` for the root, ``parent < child``).
        Malformed links are treated as absent (the node then sees only the prefix and itself);
        validate with ``check_tree``.
    cu_num_nodes : torch.Tensor
        ``[B + 1]`` exclusive offsets with a leading 0.
    prefix_lens : torch.Tensor, optional
        ``[B]`` tokens of each request already in the KV cache (before the root); may differ
        between requests. Default: no prefix (``kv_prefix_len = 0``).
    n_max : int, optional
        Number of query rows (tree nodes) per request in the padded batch; default the largest
        request (synchronizes).
    kv_prefix_len : int, optional
        Width of the cache's prefix block (the tree block starts at this column); default
        ``prefix_lens.max()`` (synchronizes). Prefix lengths above it are clamped.
    kv_len : int, optional
        Total number of key columns, at least ``kv_prefix_len + n_max``; the extra columns on
        the right are masked (e.g. a static cache). Default ``kv_prefix_len + n_max``.
    padding_side : {"right", "left"}
        Where each prefix sits inside the prefix block: ``"right"``: columns ``[0, P_b)``;
        ``"left"`` (HF ``generate``'s layout): ``[kv_prefix_len - P_b, kv_prefix_len)``.
    dtype : torch.dtype, default torch.float32
        dtype of the additive mask (use the model's dtype).
    masked_value : float, optional
        Value of the masked entries of the additive mask; default ``torch.finfo(dtype).min``
        (HF's convention). ``float("-inf")`` also works: no row is fully masked.

    Returns
    -------
    TreeAttentionMask
        ``allowed`` (bool) and ``additive`` (float), both ``[B, 1, n_max, kv_len]``: pass
        either one as the 4D ``attention_mask`` of an HF transformers model together with the
        cache and ``tree_position_ids``; with eager attention pass ``additive``.

    Notes
    -----
    Padding query rows (``i >= n_b``) attend only to their own tree column, never to a real
    token: no row is fully masked, so neither form yields NaN, and no real node ever attends
    to a padding column. Their outputs are meaningless; drop them with ``unpad_nodes``.
    """
    _check_padding_side(padding_side)
    device = parents.device
    cu, counts = _offsets(cu_num_nodes.to(device), parents.shape[0])
    B = counts.shape[0]
    n_max = _max_nodes(counts, n_max)
    if prefix_lens is None:
        prefix = torch.zeros(B, dtype=torch.int64, device=device)
        kv_prefix_len = 0 if kv_prefix_len is None else int(kv_prefix_len)
    else:
        prefix = prefix_lens.to(device=device, dtype=torch.int64)
        if kv_prefix_len is None:
            kv_prefix_len = int(prefix.max()) if B else 0  # synchronizes
    prefix = prefix.clamp(0, kv_prefix_len)
    total = kv_prefix_len + n_max
    kv_len = total if kv_len is None else int(kv_len)
    if kv_len < total:
        raise ValueError(f"kv_len = {kv_len} is smaller than kv_prefix_len + n_max = {total}")

    up, valid = _padded_parents(parents, cu, counts, n_max)
    tree_block = _ancestor_or_self(up)  # padding rows reach only themselves
    col = torch.arange(kv_prefix_len, device=device)
    if padding_side == "right":
        in_prefix = col[None, :] < prefix[:, None]
    else:
        in_prefix = col[None, :] >= kv_prefix_len - prefix[:, None]
    prefix_block = valid[:, :, None] & in_prefix[:, None, :]
    allowed = torch.cat([prefix_block, tree_block], dim=-1)
    if kv_len > total:
        allowed = torch.nn.functional.pad(allowed, (0, kv_len - total), value=False)
    allowed = allowed[:, None]
    if masked_value is None:
        masked_value = torch.finfo(dtype).min
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, masked_value)
    return TreeAttentionMask(allowed, additive)


# --------------------------------------------------------------------------------------------
# KV-cache compaction after verification
# --------------------------------------------------------------------------------------------

def accepted_kv_indices(accepted_nodes: torch.Tensor, num_accepted: torch.Tensor,
                        prefix_lens: torch.Tensor, *, kv_prefix_len: int | None = None,
                        padding_side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """KV-cache positions to keep after a tree verify step: the prefix, the root, the accepted path.

    The cache is laid out as in ``tree_attention_mask`` (prefix block of width
    ``kv_prefix_len``, then tree node ``i`` at column ``kv_prefix_len + i``). Gathering the
    cache's sequence axis with the returned indices gives, per request, the cache of a plain
    forward over ``prefix + root + accepted path``, padded on the same side as the input.

    Parameters
    ----------
    accepted_nodes : torch.Tensor
        ``[B, max_depth + 1]`` int32/int64 from the op: local index of the root (0), then the
        accepted nodes in order, ``-1`` padded (a request without nodes has ``-1`` at 0).
    num_accepted : torch.Tensor
        ``[B]`` accepted nodes, root not counted.
    prefix_lens : torch.Tensor
        ``[B]`` tokens of each request in the cache before the root.
    kv_prefix_len : int, optional
        Width of the cache's prefix block; default ``prefix_lens.max()`` (synchronizes).
    padding_side : {"right", "left"}
        Prefix padding of the input cache, also used for the output.

    Returns
    -------
    kv_indices : torch.Tensor
        ``[B, kv_prefix_len + max_depth + 1]`` int64 column indices into the verify-pass cache.
        ``torch.gather`` (or ``index_select`` per request) along the sequence axis compacts the
        cache in one call; padding entries repeat column 0 (in bounds, to be masked).
    kv_lens : torch.Tensor
        ``[B]`` int64 new cache lengths ``prefix_lens + 1 + num_accepted`` (``prefix_lens`` for a
        request without nodes): the valid entries are ``[0, kv_lens)`` (``"right"``) or the
        last ``kv_lens`` (``"left"``). They are the next step's ``prefix_lens``; the token the
        op emitted becomes the next root.

    Examples
    --------
    >>> idx, lens = accepted_kv_indices(accepted_nodes, num_accepted, prefix_lens)
    >>> keys = keys.gather(2, idx[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3]))
    """
    _check_padding_side(padding_side)
    device = accepted_nodes.device
    nodes = accepted_nodes.to(torch.int64)
    B, width = nodes.shape
    prefix = prefix_lens.to(device=device, dtype=torch.int64)
    if kv_prefix_len is None:
        kv_prefix_len = int(prefix.max()) if B else 0  # synchronizes
    prefix = prefix.clamp(0, kv_prefix_len)
    kept_nodes = torch.where(nodes[:, 0] >= 0, num_accepted.to(device=device, dtype=torch.int64) + 1, 0)
    kept_nodes = kept_nodes.clamp(0, width)
    kv_lens = prefix + kept_nodes
    out_len = kv_prefix_len + width
    slot = torch.arange(out_len, device=device)[None, :]
    # t = position of the slot inside the request's compacted sequence.
    t = slot if padding_side == "right" else slot - (out_len - kv_lens[:, None])
    is_prefix = (t >= 0) & (t < prefix[:, None])
    path_pos = t - prefix[:, None]
    is_node = (path_pos >= 0) & (path_pos < kept_nodes[:, None])
    prefix_col = t if padding_side == "right" else t + (kv_prefix_len - prefix[:, None])
    node_col = kv_prefix_len + nodes.gather(1, path_pos.clamp(0, width - 1))
    kv_indices = torch.where(is_prefix, prefix_col, torch.where(is_node, node_col, 0))
    return kv_indices, kv_lens


# --------------------------------------------------------------------------------------------
# EAGLE-2 style tree builder
# --------------------------------------------------------------------------------------------

class DraftLevel(NamedTuple):
    """One call of the draft function: the frontier nodes whose children are wanted.

    Every frontier node of a call has the same depth, so the paths are rectangular.

    Attributes
    ----------
    request : torch.Tensor
        ``[F]`` int64 request of each frontier node (rows are grouped by request, ascending).
    paths : torch.Tensor
        ``[F, depth + 1]`` tokens from the root to the frontier node (root token first). A
        stateless draft computes its logits on ``prefix[request] + paths``.
    parent_row : torch.Tensor
        ``[F]`` int64 row, in the previous call, of each node's parent (``-1`` at depth 0). A
        stateful draft (EAGLE head with a KV cache) gathers its previous outputs with it.
    scores : torch.Tensor
        ``[F]`` float32 cumulative draft log-probability of each frontier node (root = 0).
    depth : int
        Depth of the frontier nodes (0 = the roots).
    """

    request: torch.Tensor
    paths: torch.Tensor
    parent_row: torch.Tensor
    scores: torch.Tensor
    depth: int


class DraftTree(NamedTuple):
    """A ragged batch of draft trees in the op's conventions.

    Attributes
    ----------
    tokens : torch.Tensor
        ``[M]`` node tokens (dtype of ``root_tokens``); local node 0 of each request is its root.
    parents : torch.Tensor
        ``[M]`` int32 local parent indices, ``-1`` for the root, ``parent < child``.
    depth : torch.Tensor
        ``[M]`` int32 node depths (root = 0).
    scores : torch.Tensor
        ``[M]`` float32 cumulative draft log-probabilities (root = 0).
    cu_num_nodes : torch.Tensor
        ``[B + 1]`` int32 exclusive offsets; request ``b`` has ``1 + min(num_draft_nodes, available)``
        nodes.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    scores: torch.Tensor
    cu_num_nodes: torch.Tensor


def _rank_desc(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each entry along the last axis by (score descending, index ascending)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return rank


@torch.no_grad()
def build_eagle_tree(root_tokens: torch.Tensor, draft_logits_fn: Callable[[DraftLevel], torch.Tensor], *,
                     num_draft_nodes: int, top_k: int, max_depth: int,
                     beam_width: int | None = None) -> DraftTree:
    """Build EAGLE-2 style draft trees for a batch of requests.

    Level by level, the draft gives the next-token distribution of every frontier node; each
    frontier node gets its ``top_k`` most likely tokens as children, scored by cumulative draft
    log-probability (the sum of the log-probabilities along the path). At the end the best
    ``num_draft_nodes`` nodes overall (root excluded) are kept (EAGLE-2's re-ranking).

    Parameters
    ----------
    root_tokens : torch.Tensor
        ``[B]`` integer tokens, the last verified token of each request (the roots).
    draft_logits_fn : callable
        ``draft_logits_fn(level: DraftLevel) -> Tensor [F, V]``: logits (or log-probabilities)
        of the token following each frontier node, one row per row of ``level.paths``. Called
        at most ``max_depth`` times, first with the roots. Apply the draft's temperature /
        filtering inside it; ``-inf`` logits are never drafted.
    num_draft_nodes : int
        Nodes to keep per request, root not counted (fewer if the depth/top-k tree or the
        draft's support is smaller).
    top_k : int
        Children proposed per expanded node (distinct tokens, so siblings are always distinct:
        the op's deterministic-draft semantics, ``draft_probs=None``).
    max_depth : int
        Deepest level (root = 0); pass it (or more) as the op's ``max_depth``.
    beam_width : int, optional
        Frontier nodes expanded per level and request. ``None`` (default): expand exactly the
        nodes of the newest level that rank in the running top ``num_draft_nodes``, which makes
        the result the exact top ``num_draft_nodes`` of the full top-``k`` tree of depth
        ``max_depth``. An int: expand the ``beam_width`` best nodes of the newest level
        (EAGLE-2 uses ``beam_width = top_k``: fewer draft rows, approximate).

    Returns
    -------
    DraftTree
        Ragged ``tokens``, ``parents``, ``depth``, ``scores``, ``cu_num_nodes``. Within a
        request, nodes are ordered by depth, then by score (descending), then by generation
        order; so ``parent < child`` and siblings come most likely first, the order in which
        the op tests them.

    Notes
    -----
    Ranking ties are broken by generation order. Since a child never scores above its parent
    and is generated after it, every kept node's ancestors are kept. The builder
    synchronizes once per level (to hand only the live frontier rows to the draft).
    """
    if num_draft_nodes < 0 or top_k < 1 or max_depth < 0:
        raise ValueError(f"need num_draft_nodes >= 0, top_k >= 1, max_depth >= 0; got "
                         f"{num_draft_nodes}, {top_k}, {max_depth}")
    if beam_width is not None and beam_width < 1:
        raise ValueError(f"beam_width must be >= 1 or None, got {beam_width}")
    device = root_tokens.device
    B = root_tokens.shape[0]
    frontier_cap = num_draft_nodes if beam_width is None else beam_width
    neg_inf = float("-inf")

    # The pool of generated nodes, padded per request, level after level (pool index = order of
    # generation, the tie-breaker).
    pool_tokens = [root_tokens.to(torch.int64)[:, None]]
    pool_parents = [torch.full((B, 1), -1, dtype=torch.int64, device=device)]
    pool_scores = [torch.zeros(B, 1, dtype=torch.float32, device=device)]
    pool_depth = [torch.zeros(B, 1, dtype=torch.int64, device=device)]
    pool_size = 1

    front_pool = torch.zeros(B, 1, dtype=torch.int64, device=device)      # pool index
    front_live = torch.ones(B, 1, dtype=torch.bool, device=device)
    front_paths = root_tokens.to(torch.int64)[:, None, None]                # [B, Fw, depth+1]
    front_scores = torch.zeros(B, 1, dtype=torch.float32, device=device)
    front_prev_row = torch.full((B, 1), -1, dtype=torch.int64, device=device)

    for depth in range(max_depth if num_draft_nodes > 0 else 0):
        rows_b, rows_f = front_live.nonzero(as_tuple=True)
        num_rows = rows_b.numel()
        if num_rows == 0:
            break
        level = DraftLevel(request=rows_b, paths=front_paths[rows_b, rows_f],
                           parent_row=front_prev_row[rows_b, rows_f],
                           scores=front_scores[rows_b, rows_f], depth=depth)
        logits = draft_logits_fn(level)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(f"draft_logits_fn must return [F, V] = [{num_rows}, V] logits at depth "
                             f"{depth}, got shape {tuple(logits.shape)}")
        logp = torch.log_softmax(logits.to(device=device, dtype=torch.float32), dim=-1)
        # NaN never drafted; clamp keeps a child from outscoring its parent through rounding.
        logp = logp.masked_fill(logp.isnan(), neg_inf).clamp(max=0.0)
        k = min(top_k, logp.shape[-1])
        child_logp, child_tok = logp.topk(k, dim=-1)

        Fw = front_pool.shape[1]
        width = Fw * k
        level_scores = torch.full((B, Fw, k), neg_inf, dtype=torch.float32, device=device)
        level_scores[rows_b, rows_f] = level.scores[:, None] + child_logp
        level_tokens = torch.zeros(B, Fw, k, dtype=torch.int64, device=device)
        level_tokens[rows_b, rows_f] = child_tok
        row_of = torch.full((B, Fw), -1, dtype=torch.int64, device=device)
        row_of[rows_b, rows_f] = torch.arange(num_rows, device=device)
        level_scores, level_tokens = level_scores.reshape(B, width), level_tokens.reshape(B, width)
        parent_pool = front_pool[:, :, None].expand(B, Fw, k).reshape(B, width)
        parent_row = row_of[:, :, None].expand(B, Fw, k).reshape(B, width)
        paths = torch.cat([front_paths[:, :, None, :].expand(B, Fw, k, depth + 1).reshape(B, width, depth + 1),
                           level_tokens[:, :, None]], dim=-1)
        child_pool = pool_size + torch.arange(width, device=device).expand(B, width)

        pool_tokens.append(level_tokens)
        pool_parents.append(parent_pool)
        pool_scores.append(level_scores)
        pool_depth.append(torch.full((B, width), depth + 1, dtype=torch.int64, device=device))
        pool_size += width

        # Next frontier: the best children of this level (by score, then generation order).
        next_width = min(frontier_cap, width)
        order = torch.sort(level_scores, dim=-1, descending=True, stable=True).indices[:, :next_width]
        live = level_scores.gather(1, order) > neg_inf
        if beam_width is None:
            # Exact mode: only nodes in the running top num_draft_nodes can be (or lead to) kept
            # nodes; ranks only worsen as the pool grows.
            rank = _rank_desc(torch.cat(pool_scores, dim=1)[:, 1:])  # root excluded
            child_rank = rank[:, pool_size - width - 1:].gather(1, order)
            live &= child_rank < num_draft_nodes
        front_pool = child_pool.gather(1, order)
        front_live = live
        front_scores = level_scores.gather(1, order)
        front_prev_row = parent_row.gather(1, order)
        front_paths = paths.gather(1, order[:, :, None].expand(B, next_width, depth + 2))

    tokens = torch.cat(pool_tokens, dim=1)
    parents = torch.cat(pool_parents, dim=1)
    scores = torch.cat(pool_scores, dim=1)
    node_depth = torch.cat(pool_depth, dim=1)

    # Keep the root and the best num_draft_nodes others.
    keep = torch.zeros(B, pool_size, dtype=torch.bool, device=device)
    keep[:, 0] = True
    if pool_size > 1:
        rank = _rank_desc(scores[:, 1:])
        keep[:, 1:] = (rank < num_draft_nodes) & (scores[:, 1:] > neg_inf)
    # Local order: depth, then score descending, then generation order (stable sorts, last key
    # first); kept nodes first.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    order = order.gather(1, torch.sort(node_depth.gather(1, order), dim=-1, stable=True).indices)
    order = order.gather(1, torch.sort((~keep).gather(1, order).to(torch.int8), dim=-1, stable=True).indices)
    kept_sorted = keep.gather(1, order)
    local_of_pool = torch.full((B, pool_size), -1, dtype=torch.int64, device=device)
    local_of_pool.scatter_(1, order, torch.arange(pool_size, device=device).expand(B, pool_size))
    parent_pool = parents.gather(1, order)
    parent_local = torch.where(parent_pool >= 0, local_of_pool.gather(1, parent_pool.clamp(min=0)), -1)

    counts = kept_sorted.sum(dim=1)
    cu_num_nodes = torch.zeros(B + 1, dtype=torch.int32, device=device)
    cu_num_nodes[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return DraftTree(
        tokens=tokens.gather(1, order)[kept_sorted].to(root_tokens.dtype),
        parents=parent_local[kept_sorted].to(torch.int32),
        depth=node_depth.gather(1, order)[kept_sorted].to(torch.int32),
        scores=scores.gather(1, order)[kept_sorted],
        cu_num_nodes=cu_num_nodes,
    )


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

def _check_index_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64, got {t.dtype}")


def check_tree(parents: torch.Tensor, tokens: torch.Tensor, cu_num_nodes: torch.Tensor,
               vocab_size: int | None = None, deterministic: bool = True,
               max_depth: int | None = None) -> None:
    """Validate a ragged batch of draft trees; raise a ``ValueError`` naming the first problem.

    This reads the values and therefore synchronizes with the device: it is the tree op's
    optional validation mode (``validate=True`` / ``SPECDEC_VALIDATE=1``), not a hot-path check.

    Parameters
    ----------
    parents : torch.Tensor
        ``[N]`` int32/int64 local parent indices.
    tokens : torch.Tensor
        ``[N]`` int32/int64 node tokens.
    cu_num_nodes : torch.Tensor
        ``[B + 1]`` int32/int64 exclusive offsets.
    vocab_size : int, optional
        When given, every non-root token must lie in ``[0, vocab_size)`` (the root's token is
        the last verified token, which the op does not read).
    deterministic : bool, default True
        Drafts chosen without sampling (``draft_probs=None``): siblings must carry distinct
        tokens. Sampled drafts may repeat a token among siblings.
    max_depth : int, optional
        When given, no node may be deeper than ``max_depth`` (the op would never reach it).

    Raises
    ------
    TypeError
        An argument is not a 1-D integer tensor.
    ValueError
        ``cu_num_nodes`` does not start at 0, decreases or does not end at ``N``;
        ``tokens`` and ``parents`` differ in length; a root's parent is not ``-1``; a parent is
        out of range or not smaller than its child; a token is outside ``[0, vocab_size)``;
        two siblings share a token under deterministic drafts; a node is deeper than
        ``max_depth``. The message names the argument, the flat index, the request and the
        local node.
    """
    for name, t in (("parents", parents), ("tokens", tokens), ("cu_num_nodes", cu_num_nodes)):
        _check_index_tensor(name, t)
    num_nodes = parents.shape[0]
    if tokens.shape[0] != num_nodes:
        raise ValueError(f"tokens has {tokens.shape[0]} entries but parents has {num_nodes}: one per node")
    cu = cu_num_nodes.detach().to("cpu", torch.int64)
    if cu.shape[0] < 1:
        raise ValueError("cu_num_nodes must have B + 1 >= 1 entries (a leading 0)")
    if int(cu[0]) != 0:
        raise ValueError(f"cu_num_nodes[0] must be 0, got {int(cu[0])}")
    counts = cu[1:] - cu[:-1]
    bad = torch.nonzero(counts < 0)
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"cu_num_nodes must be non-decreasing: request {b} has "
                         f"cu_num_nodes[{b + 1}] = {int(cu[b + 1])} < cu_num_nodes[{b}] = {int(cu[b])}")
    if int(cu[-1]) != num_nodes:
        raise ValueError(f"cu_num_nodes[-1] = {int(cu[-1])} must equal the number of nodes N = {num_nodes}")
    if num_nodes == 0:
        return

    par = parents.detach().to("cpu", torch.int64)
    tok = tokens.detach().to("cpu", torch.int64)
    node = torch.arange(num_nodes)
    owner = torch.searchsorted(cu[1:], node, right=True)
    local = node - cu[owner]
    size = counts[owner]
    is_root = local == 0

    def where(g: int) -> str:
        return f"(request {int(owner[g])}, node {int(local[g])})"

    bad_root = is_root & (par != -1)
    out_of_range = ~is_root & ((par < 0) | (par >= size))
    not_before = ~is_root & ~out_of_range & (par >= local)
    bad = torch.nonzero(bad_root | out_of_range | not_before)
    if bad.numel():
        g = int(bad[0])
        p = int(par[g])
        if bad_root[g]:
            raise ValueError(f"parents[{g}] = {p} {where(g)}: a root (local node 0) must have parent -1")
        if out_of_range[g]:
            raise ValueError(f"parents[{g}] = {p} {where(g)} is out of range: a non-root node's parent must "
                             f"be a local index in [0, {int(size[g])}) of its request")
        raise ValueError(f"parents[{g}] = {p} {where(g)} is not smaller than the node's local index "
                         f"{int(local[g])}: parents must come before their children (parent < child)")

    if vocab_size is not None:
        bad = torch.nonzero(~is_root & ((tok < 0) | (tok >= vocab_size)))
        if bad.numel():
            g = int(bad[0])
            raise ValueError(f"tokens[{g}] = {int(tok[g])} {where(g)} is outside the vocabulary "
                             f"[0, {vocab_size})")

    if deterministic:
        child = node[~is_root]
        if child.numel() > 1:
            parent_global = cu[owner[child]] + par[child]
            # Sort children by (parent, token, index): duplicates become neighbours.
            order = torch.argsort(child, stable=True)
            for key in (tok[child], parent_global):
                order = order[torch.argsort(key[order], stable=True)]
            c, pg, tk = child[order], parent_global[order], tok[child][order]
            dup = (pg[1:] == pg[:-1]) & (tk[1:] == tk[:-1])
            if dup.any():
                later = c[1:][dup]
                first_dup = int(torch.argmin(later))
                g2 = int(later[first_dup])
                g1 = int(c[:-1][dup][first_dup])
                raise ValueError(
                    f"tokens: request {int(owner[g2])} has duplicate sibling tokens {int(tok[g2])} at "
                    f"nodes {int(local[g1])} and {int(local[g2])} (tokens[{g1}], tokens[{g2}]), "
                    f"children of node {int(par[g2])}; deterministic drafts (draft_probs=None) must "
                    "have distinct siblings")

    if max_depth is not None:
        depth = tree_depths(par, cu)
        bad = torch.nonzero(depth > max_depth)
        if bad.numel():
            g = int(bad[0])
            raise ValueError(f"node {where(g)} (parents[{g}]) is at depth {int(depth[g])} > "
                             f"max_depth = {max_depth}: the op would never reach it")
