"""Tree verification: the Python API of ``torch.ops.specdec.tree_rejection_sample``."""
from __future__ import annotations

import os

import torch

from . import _ops
from .backends import resolve_backend
from .checks import check_tree_rejection_sample_contents, check_tree_rejection_sample_inputs
from .reference import tree_rejection_sample_reference
from .reference.philox import draw_seeds


def tree_rejection_sample(
    target_logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    cu_num_nodes: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    max_depth: int | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    lenience: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a ragged batch of draft token trees and sample the final tokens.

    Multi-step speculative sampling (SpecInfer; EAGLE / Medusa trees): from the root, the
    children of the current node are tested in index order against the residual, the first
    accepted child is descended into, and the final token comes from the residual where the
    walk stops (docs/ALGORITHM.md §5). The emitted tokens follow the target exactly. A chain
    (every node with one child) gives the same tokens as ``rejection_sample``.

    Parameters
    ----------
    target_logits : Tensor [N, V], float32 / bfloat16 / float16
        Row v = the target's logits for the token after node v.
    tokens : Tensor [N], int32 / int64
        Each node's token (the root's, the last verified token, is not tested).
    parents : Tensor [N], int32 / int64
        Local parent index of each node (parent < child), -1 for the root (local node 0).
    cu_num_nodes : Tensor [B + 1], int32 / int64
        Exclusive offsets: request b owns rows ``cu[b] .. cu[b+1] - 1``.
    draft_probs : Tensor [N, V] or None
        Row v = the distribution v's children were sampled from (i.i.d.). None means
        deterministic drafts: distinct children chosen without sampling (top-k trees).
    temperature, seeds, offsets
        As in ``rejection_sample`` (per request; 0 = greedy).
    max_depth : int or None
        Output width - 1; the walk never descends deeper. None = the largest node count - 1,
        which synchronizes: pass it on the hot path.
    top_k, top_p, min_p : Tensor [B] or None
        Per-request sampling filters, as in ``rejection_sample``: they apply to every node's
        target row of a random request (temperature -> top-k -> top-p -> min-p; a threshold
        pass before the kernel, docs/ALGORITHM.md §7); the walk and the final token use the
        filtered target. Greedy requests ignore them.
    lenience : Tensor [B] or None
        Per request, in (0, 1]: opt-in, NOT exact (docs/ALGORITHM.md §8), as in
        ``rejection_sample``: children are accepted iff ``u * l * p_v(c) * mass < (q - a p_v)+(c)``
        (the residual shrinks by ``l p_v`` per rejection), deterministic children iff
        ``u * l < r(c)``, greedy children also when ``p(c) >= l * max p`` (T = 1). No token is
        emitted with probability above ``q(x) / l`` at any node. 1 = exact, bit-identical to None.
    backend : {"auto", "cpu", "cuda", "triton", "reference"} or None
        None = $SPECDEC_BACKEND or "auto" (on CPU tensors: the fused C++ CPU kernel, "cpu"; on
        CUDA tensors: the CUDA C++ kernel when it was built, else the Triton kernel; with filters
        the CUDA kernel runs its threshold pass first on sm_90 and newer, and "auto" uses the
        Triton kernel on older GPUs).
    validate : bool or None
        Also check the values (``tree_utils.check_tree``: offsets, root and parent links, ids,
        distinct siblings for deterministic drafts, depth <= max_depth; temperatures,
        probabilities and filter ranges); synchronizes. None = $SPECDEC_VALIDATE == "1".

    Returns
    -------
    output_token_ids : Tensor [B, max_depth + 1], int32
        The accepted path's tokens, then the final token, then -1.
    accepted_nodes : Tensor [B, max_depth + 1], int32
        Local indices of the root (0) and the accepted path's nodes, then -1: the KV entries
        to keep; ``accepted_nodes[b, j]`` is the node whose row scored ``output_token_ids[b, j]``.
    num_accepted : Tensor [B], int32
        Accepted nodes per request (the root and the final token not counted).
    """
    if max_depth is None:
        counts = (cu_num_nodes[1:] - cu_num_nodes[:-1]) if cu_num_nodes.numel() > 1 else None
        max_depth = max(int(counts.max()) - 1, 0) if counts is not None and counts.numel() else 0
    check_tree_rejection_sample_inputs(target_logits, tokens, parents, cu_num_nodes, draft_probs,
                                       temperature, seeds, offsets, max_depth, top_k, top_p, min_p, lenience)
    if validate if validate is not None else os.environ.get("SPECDEC_VALIDATE") == "1":
        check_tree_rejection_sample_contents(target_logits, tokens, parents, cu_num_nodes, draft_probs,
                                             temperature, max_depth, top_k, top_p, min_p, lenience)
    device = target_logits.device
    backend = resolve_backend(backend, device, _ops.TREE_REJECTION_SAMPLE)
    filtered = top_k is not None or top_p is not None or min_p is not None
    if seeds is None:
        seeds = draw_seeds(cu_num_nodes.shape[0] - 1, device)
    args = (target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature, seeds, offsets, max_depth)
    if backend == "reference":
        return tree_rejection_sample_reference(*args, top_k=top_k, top_p=top_p, min_p=min_p, lenience=lenience)
    if backend == "triton":
        return _ops.tree_triton_call(*args, top_k, top_p, min_p, lenience)
    if (filtered and backend == "auto" and device.type == "cuda" and _ops.cuda_kernel_built(_ops.TREE_REJECTION_SAMPLE)
            and not _ops.cuda_filters_supported(device.index)):
        # The CUDA kernel's threshold pass needs sm_90: the Triton kernel has the filters here.
        return torch.ops.specdec._tree_rejection_sample_triton(*args, top_k, top_p, min_p, lenience)
    return torch.ops.specdec.tree_rejection_sample(*args, top_k, top_p, min_p, lenience)
