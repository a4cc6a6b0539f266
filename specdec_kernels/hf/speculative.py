"""Speculative generation with Hugging Face causal LMs, verified by ``specdec_kernels``.

A drafter proposes drafts per request -- a chain of up to K tokens (chain mode) or an
EAGLE-style top-k token tree (tree mode) --, the target scores every draft in one forward per
request, and one op call per step verifies every request of the batch at once
(``specdec_kernels.rejection_sample`` for chains, ``specdec_kernels.tree_rejection_sample`` for
trees). The emitted tokens are distributed exactly as the target's own sampling (temperature,
top-k, top-p), and equal its greedy decoding at temperature 0.

Design (the simplest that is exactly correct with transformers' cache API):

- **One KV cache per request and model, batch-1 forwards** (``CachedCausalLM``). Prompts
  of different lengths and different accepted lengths then need no padding or cache
  re-alignment. The verify step is batched over all requests (one op call per step).
- **The cache as a token tree.** Every cached token has a parent column: the previous column
  for committed tokens, the parent node for draft-tree nodes. A forward names the parent of
  each input; when the inputs are a chain the model runs plainly (position ids
  ``cached tokens + i``), otherwise it gets a 4D tree attention mask (each input sees the
  committed tokens, its ancestors and itself) and position ids ``root position + depth``
  (``specdec_kernels.tree_utils``).
- **Rollback / compaction.** After verification each cache keeps only a path of committed
  tokens (``CachedCausalLM.keep``): a prefix is cropped (``Cache.crop(-n)``), anything else
  -- an accepted path through a tree, whose nodes are not contiguous -- is gathered along the
  sequence axis in every layer. The target keeps exactly the committed tokens but the newest
  one (whose logits nobody has computed yet: it is the first input of the next forward); a
  model drafter keeps the same, or one token less when the last accepted draft was never fed
  to it (the end of a fully accepted chain, a tree leaf).
- **Seeds.** Each request owns a ``torch.Generator``: it draws the request's sampled drafts
  and one int64 per step that seeds the op's Philox streams for that request (offsets stay 0,
  as seeds are fresh every step). Same generator seeds => same tokens, whatever the batch.
- **top-k / top-p** are applied to the draft's logits before it samples or ranks (a chain
  drafter hands over those standardized probabilities; ``sampling_filters.apply_top_k_top_p``)
  and, for the target, passed to the op, which applies them inside its kernel (#6). The target
  distribution is then exactly HF's temperature -> top-k -> top-p (ties with the k-th token,
  or with the token crossing p, are kept).
- **Verification.** Chains are verified draft by draft (``method="token"``) or jointly
  (``method="block"``, Sun et al. 2024: the same output law, never fewer accepted drafts in
  expectation); trees by ``tree_rejection_sample``, which has no block variant.
- **Drafters** plug in through the small ``Drafter`` interface (``propose`` /
  ``propose_batch`` / ``commit`` / ``release``): ``ModelDrafter`` (a smaller HF model, chains),
  ``PromptLookupDrafter`` (n-gram matches in the request's own tokens, longest first; deterministic
  chains, or token tries of several matches' continuations)
  and ``TreeDrafter`` (a smaller HF model expanding EAGLE-2 top-k trees with
  ``tree_utils.build_eagle_tree``, deterministic drafts) are provided. The engine loop treats
  chains and trees alike: a proposal is a set of draft tokens with their parents.

transformers is an optional dependency (``pip install 'specdec_kernels[hf]'``); importing
this module without it raises an ImportError that says so.
"""
from __future__ import annotations

import abc
import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

try:
    from transformers import DynamicCache
except ImportError as e:  # transformers is an optional extra
    raise ImportError("specdec_kernels.hf needs transformers: pip install 'specdec_kernels[hf]' "
                      "(or pip install transformers)") from e

from ..chain import rejection_sample
from ..reference.sampling_filters import apply_top_k_top_p
from ..tree import tree_rejection_sample
from ..tree_utils import build_eagle_tree, tree_attention_mask, tree_position_ids

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

#: Chain verification methods of ``speculative_generate`` (``rejection_sample``'s ``method``).
VERIFY_METHODS = ("token", "block")
_BLOCK_NEEDS_CHAINS = ("method='block' verifies draft chains only (block verification of Sun et al. 2024); "
                       "tree mode has no block variant: use method='token' with trees")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature <= 0`` is greedy (top-k / top-p then ignored).

    ``top_k <= 0`` and ``top_p >= 1`` are off; semantics in ``specdec_kernels.sampling_filters``.
    """
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return not self.temperature > 0

    @property
    def filtered(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)


def standardized_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The distribution a random request samples from: softmax(top-k/top-p(logits) / T).

    Parameters
    ----------
    logits : Tensor [R, V]
    sampling : SamplingParams
        Must not be greedy.

    Returns
    -------
    Tensor [R, V] float32
    """
    if sampling.greedy:
        raise ValueError("standardized_probs needs a temperature > 0 (greedy requests take the argmax)")
    if sampling.filtered:
        logits = apply_top_k_top_p(logits, sampling.top_k, sampling.top_p, temperature=sampling.temperature)
    return torch.softmax(logits.float() / sampling.temperature, dim=-1)


class CachedCausalLM:
    """An HF causal LM with one KV cache per request (batch-1 forwards), tree inputs and rollback.

    Each request's cache is a tree of tokens: every cached column has a parent column (-1
    for column 0). Columns ``[0, chain_len)`` form a plain chain (each column's parent is the
    previous one: committed tokens); the columns after them, if any, hang off the chain's last
    column (the *root*) as a tree: draft nodes fed for verification or drafting. A forward
    names each input's parent; attention follows the parent links (an input sees every chain
    column before the root, its ancestors and itself). ``keep`` then reduces the cache to one
    path again.

    Parameters
    ----------
    model : transformers ``PreTrainedModel`` (a causal LM)
        Used as it is (eval mode, no gradients are taken). Its cache must be croppable
        (attention layers; not linear-attention / state-space layers). Tree inputs also need
        ``attn_implementation`` "sdpa" or "eager" (they take a 4D attention mask) and no
        sliding-window layers (a custom 4D mask replaces the window).
    """

    # Attention implementations that apply a 4D additive mask given to the model as it is.
    TREE_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")

    def __init__(self, model):
        self.model = model
        parameters = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values -> cache and num_logits_to_keep -> logits_to_keep.
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._logits_kwarg = next(
            (name for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), None)
        self._cache_takes_config = "config" in inspect.signature(DynamicCache.__init__).parameters
        probe = DynamicCache(config=model.config) if self._cache_takes_config else None
        sliding = getattr(probe, "is_sliding", None)
        self._has_sliding_layers = (any(sliding) if isinstance(sliding, (list, tuple))
                                    else bool(getattr(model.config, "sliding_window", None)))
        self._caches: dict[int, object] = {}
        self._num_cached: dict[int, int] = {}
        self._chain_len: dict[int, int] = {}
        # Parent column of every cached column from chain_len on (the tree part).
        self._tree_parents: dict[int, list[int]] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def num_cached(self, request: int) -> int:
        """How many tokens (columns) the cache of ``request`` holds; after ``keep`` / ``rollback``
        they are a prefix of its committed tokens."""
        return self._num_cached.get(request, 0)

    def cache(self, request: int):
        """The ``DynamicCache`` of ``request`` (None before its first forward)."""
        return self._caches.get(request)

    def parent_column(self, request: int, column: int) -> int:
        """The parent of cached ``column`` of ``request`` (-1 for column 0)."""
        if not 0 <= column < self.num_cached(request):
            raise IndexError(f"column {column} is not cached for request {request} "
                             f"({self.num_cached(request)} columns)")
        chain_len = self._chain_len.get(request, 0)
        return column - 1 if column < chain_len else self._tree_parents[request][column - chain_len]

    def _new_cache(self):
        if self._has_sliding_layers:
            # Sliding-window cache layers drop (or, in some transformers 5.x, mis-size after a crop)
            # what falls out of the window, which a rollback needs: keep every layer's full history
            # instead. The model still applies its window through the attention mask (checked to
            # give the same logits on transformers 5.17 and 5.24).
            return DynamicCache()
        cache = DynamicCache(config=self.model.config) if self._cache_takes_config else DynamicCache()
        if getattr(cache, "is_croppable", True) is False:
            raise ValueError(f"{type(self.model).__name__}'s cache cannot be cropped, so rejected drafts "
                             "cannot be rolled back: speculative decoding needs attention-only caches")
        return cache

    def _check_tree_inputs_supported(self, cache) -> None:
        implementation = getattr(self.model.config, "_attn_implementation", None)
        if implementation not in self.TREE_ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"tree inputs need a 4D attention mask, which {type(self.model).__name__}'s "
                             f"attn_implementation={implementation!r} does not apply as given: load the model "
                             "with attn_implementation='sdpa' or 'eager'")
        if self._has_sliding_layers:
            raise ValueError(f"{type(self.model).__name__} has sliding-window attention layers: a tree attention "
                             "mask would replace their window, so tree inputs are not supported (use chain mode)")

    @torch.no_grad()
    def forward(self, request: int, input_ids: torch.Tensor, num_logits: int,
                parents: Sequence[int] | None = None) -> torch.Tensor:
        """Feed ``input_ids`` [n] after the cached tokens; return the last ``num_logits`` logits rows.

        Parameters
        ----------
        request : int
        input_ids : Tensor [n] int64
            Input ``i`` is stored at column ``num_cached(request) + i``.
        num_logits : int
            Row ``j`` of the result is the model's next-token logits at input
            ``n - num_logits + j`` (given that input's ancestors).
        parents : sequence of int or None
            The parent column of each input (an earlier column: cached, or an earlier input;
            -1 only for column 0). None = a chain continuing the last column (a plain
            forward). Inputs that do not continue the chain make the forward a tree forward:
            the model gets the tree attention mask and depth-based position ids.

        Returns
        -------
        Tensor [num_logits, V]
        """
        cache = self._caches.get(request)
        if cache is None:
            cache = self._caches[request] = self._new_cache()
        start = self._num_cached.get(request, 0)
        num_new = input_ids.shape[0]
        end = start + num_new
        chain_len = self._chain_len.get(request, 0)
        tree_parents = list(self._tree_parents.get(request, ()))
        if parents is None:
            parents = range(start - 1, end - 1)
        parents = [int(p) for p in parents]
        if len(parents) != num_new:
            raise ValueError(f"parents has {len(parents)} entries for {num_new} inputs")
        for i, parent in enumerate(parents):
            if not (0 <= parent < start + i or parent == start + i - 1 == -1):
                raise ValueError(f"parents[{i}] = {parent}: input {i} is column {start + i}, its parent must be "
                                 f"an earlier column (0 .. {start + i - 1})")
        tree_parents += parents
        # Inputs that continue the chain before any branching extend it.
        extend = 0
        while extend < len(tree_parents) and tree_parents[extend] == chain_len + extend - 1:
            extend += 1
        chain_len += extend
        tree_parents = tree_parents[extend:]
        if tree_parents and min(tree_parents) < chain_len - 1:
            # A node hanging off an older chain column: the tree's root moves up to that column.
            lowest = min(tree_parents)
            tree_parents = list(range(lowest, chain_len - 1)) + tree_parents
            chain_len = lowest + 1

        kwargs = {self._cache_kwarg: cache, "use_cache": True}
        device = input_ids.device
        if not tree_parents:
            kwargs["position_ids"] = torch.arange(start, end, device=device)[None, :]
        else:
            self._check_tree_inputs_supported(cache)
            kwargs["attention_mask"], kwargs["position_ids"] = self._tree_mask_and_positions(
                start, end, chain_len - 1, tree_parents, device)
        if self._logits_kwarg is not None:
            kwargs[self._logits_kwarg] = num_logits
        logits = self.model(input_ids=input_ids[None, :], **kwargs).logits[0, -num_logits:]
        self._num_cached[request] = end
        self._chain_len[request] = chain_len
        self._tree_parents[request] = tree_parents
        if cache.get_seq_length() != end:
            raise RuntimeError(f"{type(self.model).__name__} did not extend the cache it was given "
                               f"({cache.get_seq_length()} tokens cached, expected {end})")
        return logits

    def _tree_mask_and_positions(self, start: int, end: int, root: int, tree_parents: list[int],
                                 device) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive mask [1, 1, end - start, end] and position ids [1, end - start] of the inputs
        at columns ``[start, end)``, the tree part being columns ``[root, end)``."""
        # The tree in tree_utils' conventions: local node j = column root + j, the prefix before it.
        local_parents = torch.tensor([-1] + [p - root for p in tree_parents], dtype=torch.int64, device=device)
        num_nodes = local_parents.shape[0]
        cu = torch.tensor([0, num_nodes], dtype=torch.int64, device=device)
        prefix_lens = torch.tensor([root], dtype=torch.int64, device=device)
        tree_allowed = tree_attention_mask(local_parents, cu, prefix_lens, n_max=num_nodes, kv_prefix_len=root).allowed
        tree_positions = tree_position_ids(local_parents, cu, prefix_lens, n_max=num_nodes)
        first_tree_input = max(start, root)
        # Inputs before the root continue the chain: causal rows.
        chain_columns = torch.arange(start, first_tree_input, device=device)
        chain_allowed = torch.arange(end, device=device)[None, :] <= chain_columns[:, None]
        allowed = torch.cat([chain_allowed, tree_allowed[0, 0, first_tree_input - root:]])
        positions = torch.cat([chain_columns, tree_positions[0, first_tree_input - root:]])
        dtype = self.model.dtype
        additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        return additive[None, None], positions[None, :]

    def keep(self, request: int, columns: Sequence[int]) -> None:
        """Reduce the cache of ``request`` to ``columns``, a path from column 0 (each column's parent
        is the one before it), which then become columns ``0 .. len(columns) - 1``.

        A prefix is cropped; anything else is gathered along the sequence axis of every layer.
        """
        cache = self._caches.get(request)
        if cache is None:
            if len(columns):
                raise ValueError(f"request {request} has no cache to keep columns of")
            return
        columns = [int(c) for c in columns]
        for i, column in enumerate(columns):
            expected_parent = columns[i - 1] if i else -1
            if not 0 <= column < self.num_cached(request) or self.parent_column(request, column) != expected_parent:
                raise ValueError(f"columns must be a path from column 0 through cached columns, but column "
                                 f"{column} (entry {i}) does not follow column {expected_parent}")
        if columns == list(range(len(columns))):
            removed = self.num_cached(request) - len(columns)
            # Negative = tokens to remove, in transformers 4.x and 5.x; crop(0) trims sliding-window
            # layers (transformers >= 5) back to their window.
            if removed or hasattr(cache, "activate_past_recording"):
                cache.crop(-removed)
        else:
            _gather_cache_columns(cache, torch.tensor(columns, dtype=torch.int64, device=self.device))
        self._num_cached[request] = len(columns)
        self._chain_len[request] = len(columns)
        self._tree_parents[request] = []

    def rollback(self, request: int, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` cached tokens of ``request`` (crop the others); they must
        form a chain."""
        self.keep(request, range(min(num_tokens, self.num_cached(request))))

    def release(self, request: int) -> None:
        """Free the cache of a finished request."""
        for state in (self._caches, self._num_cached, self._chain_len, self._tree_parents):
            state.pop(request, None)


def _gather_cache_columns(cache, columns: torch.Tensor) -> None:
    """Keep ``columns`` of every layer's keys and values (sequence axis -2), in that order."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # transformers < 4.56: lists of tensors
        for store in (cache.key_cache, cache.value_cache):
            for i, states in enumerate(store):
                if states.numel():
                    store[i] = states.index_select(-2, columns.to(states.device))
        return
    for layer in layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise ValueError(f"cannot compact a {type(layer).__name__} cache layer along its sequence axis")
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(-2, columns.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, columns.to(layer.values.device))


@dataclass
class DraftChain:
    """A chain proposal for one request.

    ``tokens`` [n] int64 on the target's device (n may be 0); ``probs`` [n, V] float32: row j
    is the standardized distribution ``tokens[j]`` was sampled from, or None for deterministic
    drafts (argmax, n-gram lookups: point masses).
    """
    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    @property
    def parents(self) -> list[int]:
        """Draft j's parent: j (0 = the root, the request's last committed token; i + 1 = draft i)."""
        return list(range(self.tokens.numel()))

    @property
    def depth(self) -> int:
        """Drafts on the longest root-to-leaf path: the most a step can accept."""
        return self.tokens.numel()


@dataclass
class DraftTokenTree:
    """A draft token tree proposed for one request (tree mode), verified with ``draft_probs=None``.

    The root, local node 0, is the request's last committed token; draft ``j`` is local node
    ``j + 1``, the op's node numbering.

    ``tokens`` [n] int64: the draft tokens (root excluded; n may be 0). ``parents``: n ints,
    ``parents[j]`` = local index of draft j's parent (0 = the root, i + 1 = draft i), at most
    ``j`` (parents come first). Drafts are deterministic given the committed tokens (top-k
    children, no sampling), so siblings must carry distinct tokens; the op tests siblings in
    order, so put the most likely first.
    """
    tokens: torch.Tensor
    parents: list[int]

    @property
    def depth(self) -> int:
        """Drafts on the longest root-to-leaf path: the most a step can accept."""
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent] + 1)
        return max(depth)


class Drafter(abc.ABC):
    """What the engine loop needs from a drafter.

    Each call concerns one request, identified by an index that stays the same for its whole
    generation. ``tokens`` are always the request's committed tokens (prompt + generated).
    A proposal is a ``DraftChain`` or a ``DraftTokenTree``. One op call verifies a step, so a
    step's proposals are all chains, or trees and deterministic chains (``probs=None``; they
    are verified as chain-shaped trees).
    """

    #: Drafts per path that ``speculative_generate`` asks for when ``num_draft_tokens`` is None.
    default_num_drafts: int = 4

    @abc.abstractmethod
    def propose(self, request: int, tokens: Sequence[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> DraftChain | DraftTokenTree:
        """Propose drafts that continue ``tokens``, at most ``num_drafts`` (>= 1) on any path.

        Random drafters sample at ``sampling`` with ``generator`` and return the standardized
        probabilities (``standardized_probs``) they sampled from. ``probs=None`` states that
        the drafts are a deterministic function of ``tokens`` (point masses: greedy requests,
        lookups, top-k trees); a drafter that samples but returns None breaks the exactness
        guarantee.
        """

    def propose_batch(self, requests: Sequence[int], tokens: Sequence[Sequence[int]], num_drafts: Sequence[int],
                      sampling: Sequence[SamplingParams],
                      generators: Sequence[torch.Generator]) -> list[DraftChain | DraftTokenTree]:
        """``propose`` for every request of a step (one entry per request, same order); override it
        to batch the drafting. ``num_drafts[i]`` may be 0: then request i must get no drafts.
        This default calls ``propose`` for each request with ``num_drafts >= 1``."""
        proposals = []
        for request, request_tokens, limit, params, generator in zip(requests, tokens, num_drafts, sampling,
                                                                     generators):
            proposal = self.propose(request, request_tokens, limit, params, generator) if limit > 0 else None
            if proposal is None:
                proposal = DraftChain(torch.zeros(0, dtype=torch.long, device=generator.device))
            proposals.append(proposal)
        return proposals

    def commit(self, request: int, tokens: Sequence[int], num_accepted: int) -> None:
        """After verification: ``tokens`` are the committed tokens, whose last ``num_accepted + 1``
        are new (the accepted path of the last proposal, then the target's token)."""

    def release(self, request: int) -> None:
        """The request has finished; drop its state."""


class ModelDrafter(Drafter):
    """A (smaller) HF causal LM sharing the target's tokenizer, with its own per-request caches
    (chain mode).

    Parameters
    ----------
    model : transformers ``PreTrainedModel``
        Must produce logits over the target's vocabulary (same size).
    """

    def __init__(self, model):
        self.lm = CachedCausalLM(model)

    @torch.no_grad()
    def propose(self, request, tokens, num_drafts, sampling, generator):
        device = self.lm.device
        pending = torch.tensor(list(tokens[self.lm.num_cached(request):]), dtype=torch.long, device=device)
        drafts, probs = [], []
        for j in range(num_drafts):
            # Token j-1 is still on the device: no host synchronization inside the chain.
            logits = self.lm.forward(request, pending if j == 0 else drafts[-1], 1)
            if sampling.greedy:
                drafts.append(logits.argmax(-1))
            else:
                row = standardized_probs(logits, sampling)
                drafts.append(torch.multinomial(row, 1, generator=generator)[0])
                probs.append(row)
        return DraftChain(torch.stack(drafts).reshape(-1), torch.cat(probs) if probs else None)

    def commit(self, request, tokens, num_accepted):
        # The cache holds the old committed tokens + the drafts it ran; the accepted drafts are
        # their prefix, so keeping at most len(tokens) - 1 tokens drops exactly the rejected ones.
        self.lm.rollback(request, len(tokens) - 1)

    def release(self, request):
        self.lm.release(request)


def lookahead_by_theory(alpha: float, draft_cost: float, max_drafts: int) -> int:
    """The number of drafts K in ``1 .. max_drafts`` that maximizes the expected speedup
    ``(1 - alpha^(K+1)) / ((1 - alpha)(1 + K draft_cost))`` (Leviathan et al. 2022, Thm 3.8).

    Parameters
    ----------
    alpha : float
        Per-draft acceptance probability, in [0, 1].
    draft_cost : float
        What one more draft costs (drafting it and verifying it), in target steps, >= 0.
    max_drafts : int
        The largest K allowed (>= 1).

    Returns
    -------
    int
        The best K (the smallest of equally good ones).
    """
    if not 0 <= alpha <= 1 or not draft_cost >= 0 or max_drafts < 1:
        raise ValueError(f"lookahead_by_theory needs 0 <= alpha <= 1, draft_cost >= 0 and max_drafts >= 1, got "
                         f"{alpha}, {draft_cost}, {max_drafts}")
    best_k, best = 1, -1.0
    for k in range(1, max_drafts + 1):
        tokens = float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        value = tokens / (1 + k * draft_cost)
        if value > best * (1 + 1e-9):
            best_k, best = k, value
    return best_k


class PromptLookupDrafter(Drafter):
    """Prompt lookup (n-gram) drafting: continuations of earlier occurrences of the request's
    latest tokens. Deterministic drafts (``probs=None``), no model; 0 drafts when nothing matches.

    Every earlier position whose token equals the request's last token is a *match site*; its
    match length is how many tokens, backwards from there, agree with the request's suffix
    (at most ``max_ngram``). Sites of length ``>= min_ngram`` are ranked longest first, then
    latest first (a long match predicts a copy best). The best site's continuation is the
    draft chain; with ``num_candidates > 1`` the continuations of the best sites that differ
    are merged into a token trie (shared prefixes once) and proposed as a ``DraftTokenTree``,
    verified at once by ``tree_rejection_sample`` (siblings: the better-ranked site first).

    Parameters
    ----------
    max_ngram : int
        The longest suffix matched (longer matches rank first).
    min_ngram : int
        The shortest match that proposes anything.
    num_candidates : int
        Continuations from different match sites per step (1 = chains; more = token trees,
        which need a target with tree attention: ``CachedCausalLM``'s "sdpa" / "eager").
    draft_cost : float or None
        The cost of one more draft token (its share of the verify forward), in target decoding
        steps. When given, each step drafts the K (per candidate) that maximizes the theory's
        speedup ``lookahead_by_theory(a, draft_cost, limit)``, where ``a`` is the acceptance
        measured so far in this request for matches of this length (a prior of
        ``prior_acceptance`` worth two tested drafts to start with). None = always the limit
        the engine gives (``num_draft_tokens``).
    prior_acceptance : float
        The acceptance assumed before a request has measured any (with ``draft_cost``).
    """

    #: Pseudo-counts of tested drafts behind ``prior_acceptance``.
    PRIOR_WEIGHT = 2.0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_candidates: int = 1,
                 draft_cost: float | None = None, prior_acceptance: float = 0.7):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        if draft_cost is not None and not draft_cost >= 0:
            raise ValueError(f"draft_cost must be >= 0 or None, got {draft_cost}")
        if not 0 <= prior_acceptance <= 1:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {prior_acceptance}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_candidates = num_candidates
        self.draft_cost, self.prior_acceptance = draft_cost, prior_acceptance
        # Per request: {match length: [accepted, tested]} and the last proposal (match length,
        # drafts on its deepest path), for the acceptance that picks K.
        self._counts: dict[int, dict[int, list[float]]] = {}
        self._last: dict[int, tuple[int, int]] = {}

    @property
    def is_tree(self) -> bool:
        """Whether proposals can be token trees (``num_candidates > 1``)."""
        return self.num_candidates > 1

    def match_sites(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """``(match length, index of the continuation's first token)`` of every match site of
        length ``>= min_ngram``, longest first, then latest first."""
        last = len(tokens) - 1
        sites = []
        for j in range(last - 1, -1, -1):
            if tokens[j] != tokens[last]:
                continue
            n = 1
            while n < self.max_ngram and j - n >= 0 and tokens[j - n] == tokens[last - n]:
                n += 1
            if n >= self.min_ngram:
                sites.append((n, j + 1))
        sites.sort(key=lambda site: -site[0])  # stable: latest first among equal lengths
        return sites

    def acceptance(self, request: int, match_length: int) -> float:
        """The acceptance estimate of ``request`` for matches of ``match_length`` tokens."""
        accepted, tested = self._counts.get(request, {}).get(match_length, (0.0, 0.0))
        return (accepted + self.prior_acceptance * self.PRIOR_WEIGHT) / (tested + self.PRIOR_WEIGHT)

    def propose(self, request, tokens, num_drafts, sampling, generator):
        tokens = list(tokens)
        device = generator.device
        sites = self.match_sites(tokens)
        if not sites:
            self._last.pop(request, None)
            return DraftChain(torch.zeros(0, dtype=torch.long, device=device))
        match_length = sites[0][0]
        k = num_drafts
        if self.draft_cost is not None:
            # Each candidate's drafts are priced alike: a tree of C candidates costs up to C K drafts.
            k = lookahead_by_theory(self.acceptance(request, match_length),
                                    self.draft_cost * self.num_candidates, num_drafts)
        candidates: list[list[int]] = []
        for _, start in sites:
            follow = tokens[start:start + k]
            # A continuation that is a prefix of a kept one adds no node.
            if follow and not any(kept[:len(follow)] == follow for kept in candidates):
                candidates = [kept for kept in candidates if follow[:len(kept)] != kept] + [follow]
                if len(candidates) == self.num_candidates:
                    break
        self._last[request] = (match_length, max(len(c) for c in candidates))
        if len(candidates) == 1:
            return DraftChain(torch.tensor(candidates[0], dtype=torch.long, device=device))
        # A token trie of the candidates, nodes in order of first appearance (parents first).
        node_of: dict[tuple[int, ...], int] = {}
        draft_tokens, parents = [], []
        for candidate in candidates:
            for depth in range(1, len(candidate) + 1):
                path = tuple(candidate[:depth])
                if path not in node_of:
                    node_of[path] = len(draft_tokens) + 1
                    draft_tokens.append(candidate[depth - 1])
                    parents.append(node_of[path[:-1]] if depth > 1 else 0)
        return DraftTokenTree(torch.tensor(draft_tokens, dtype=torch.long, device=device), parents)

    def commit(self, request, tokens, num_accepted):
        last = self._last.pop(request, None)
        if last is None:
            return
        match_length, depth = last
        counts = self._counts.setdefault(request, {}).setdefault(match_length, [0.0, 0.0])
        counts[0] += num_accepted
        counts[1] += num_accepted + (1 if num_accepted < depth else 0)

    def release(self, request):
        self._counts.pop(request, None)
        self._last.pop(request, None)


@dataclass(frozen=True)
class TreeSpec:
    """The shape of EAGLE-2 style draft trees (tree mode, ``tree_utils.build_eagle_tree``).

    Attributes
    ----------
    num_draft_nodes : int
        Draft nodes kept per request and step (root excluded): the best ``num_draft_nodes`` of
        the top-``top_k`` tree by cumulative draft log-probability. It is also the number of
        extra positions the target scores per request and step.
    top_k : int
        Children proposed per expanded node (distinct tokens).
    max_depth : int
        Deepest draft level: the most drafts one step can accept.
    beam_width : int or None
        Frontier nodes the draft expands per level: None = every node that can still make the
        top ``num_draft_nodes`` (the exact top of the full tree); ``top_k`` = EAGLE-2's setting
        (fewer draft rows, approximate).
    """
    num_draft_nodes: int = 8
    top_k: int = 4
    max_depth: int = 4
    beam_width: int | None = None

    def __post_init__(self):
        if self.num_draft_nodes < 0 or self.top_k < 1 or self.max_depth < 0:
            raise ValueError(f"TreeSpec needs num_draft_nodes >= 0, top_k >= 1 and max_depth >= 0, got "
                             f"{self.num_draft_nodes}, {self.top_k}, {self.max_depth}")
        if self.beam_width is not None and self.beam_width < 1:
            raise ValueError(f"TreeSpec.beam_width must be >= 1 or None, got {self.beam_width}")


class TreeDrafter(Drafter):
    """A (smaller) HF causal LM expanding EAGLE-2 style top-k draft trees (tree mode).

    Each step builds the trees of all requests with ``tree_utils.build_eagle_tree``, in one
    build per tree depth (the depth is capped near the end of a request's budget; one build
    per step otherwise, and a request's tree never depends on the rest of the batch): level by
    level, the draft scores every frontier node in one forward per request on top of
    its cache (the committed tokens, then the nodes fed at earlier levels, under a tree
    attention mask), and each node's ``top_k`` most likely tokens become its children. The
    ranking uses the request's sampling: raw log-probabilities for greedy requests, the
    temperature / top-k / top-p distribution otherwise (filtered tokens are never drafted).
    Children are deterministic given the committed tokens, so the op verifies them with
    ``draft_probs=None``. After verification the draft cache keeps the committed tokens and
    the accepted nodes it has fed (a gather), so nothing is recomputed.

    Parameters
    ----------
    model : transformers ``PreTrainedModel``
        Shares the target's tokenizer (logits over the same vocabulary); attn_implementation
        "sdpa" or "eager", no sliding-window layers.
    spec : TreeSpec
    """

    def __init__(self, model, spec: TreeSpec = TreeSpec()):
        self.lm = CachedCausalLM(model)
        self.spec = spec
        self.default_num_drafts = spec.max_depth
        # Per request, this step's fed nodes: root-to-node token path -> draft cache column.
        self._column_of_path: dict[int, dict[tuple[int, ...], int]] = {}

    def propose(self, request, tokens, num_drafts, sampling, generator):
        return self.propose_batch([request], [tokens], [num_drafts], [sampling], [generator])[0]

    @torch.no_grad()
    def propose_batch(self, requests, tokens, num_drafts, sampling, generators):
        device = self.lm.device
        depths = [min(limit, self.spec.max_depth) for limit in num_drafts]
        proposals = [DraftTokenTree(torch.zeros(0, dtype=torch.long, device=device), []) for _ in requests]
        if self.spec.num_draft_nodes == 0:
            return proposals
        # One build per tree depth (one build per step but near the end of the budgets): a request's
        # tree then depends on its own tokens only, not on the rest of the batch.
        for depth in sorted({d for d in depths if d > 0}):
            group = [i for i, d in enumerate(depths) if d == depth]
            trees = self._build_trees([requests[i] for i in group], [tokens[i] for i in group],
                                      [sampling[i] for i in group], depth)
            for i, tree in zip(group, trees):
                proposals[i] = tree
        return proposals

    def _build_trees(self, requests: list[int], tokens: list[Sequence[int]], sampling: list[SamplingParams],
                     max_depth: int) -> list[DraftTokenTree]:
        """``build_eagle_tree`` over ``requests``, feeding the draft level by level."""
        device = self.lm.device
        # Draft cache column of each row of the previous level (the parents of this level's rows).
        previous_columns: list[int] = []

        def draft_logits(level) -> torch.Tensor:
            rows_of_request = level.request.tolist()
            paths = level.paths.tolist()
            parent_rows = level.parent_row.tolist()
            columns, out = [], []
            for first, last in _runs(rows_of_request):
                i = rows_of_request[first]
                request = requests[i]
                if level.depth == 0:
                    # The committed tokens the cache lacks, ending with the root: a plain forward.
                    num_cached = self.lm.num_cached(request)
                    pending = torch.tensor(list(tokens[i][num_cached:]), dtype=torch.long, device=device)
                    logits = self.lm.forward(request, pending, 1)
                    root_column = len(tokens[i]) - 1
                    columns.append(root_column)
                    self._column_of_path[request] = {tuple(paths[first]): root_column}
                else:
                    start = self.lm.num_cached(request)
                    parents = [previous_columns[parent_rows[row]] for row in range(first, last)]
                    logits = self.lm.forward(request, level.paths[first:last, -1], last - first, parents)
                    for offset, row in enumerate(range(first, last)):
                        columns.append(start + offset)
                        self._column_of_path[request][tuple(paths[row])] = start + offset
                out.append(_ranking_logits(logits, sampling[i]))
            previous_columns[:] = columns
            return torch.cat(out)

        roots = torch.tensor([request_tokens[-1] for request_tokens in tokens], dtype=torch.long, device=device)
        tree = build_eagle_tree(roots, draft_logits, num_draft_nodes=self.spec.num_draft_nodes, top_k=self.spec.top_k,
                                max_depth=max_depth, beam_width=self.spec.beam_width)
        cu = tree.cu_num_nodes.tolist()
        parents = tree.parents.tolist()
        return [DraftTokenTree(tree.tokens[cu[j] + 1:cu[j + 1]], parents[cu[j] + 1:cu[j + 1]])
                for j in range(len(requests))]

    def commit(self, request, tokens, num_accepted):
        column_of_path = self._column_of_path.pop(request, None)
        if column_of_path is None:
            return  # nothing was fed this step: the cache still holds committed tokens only
        root_index = len(tokens) - num_accepted - 2
        path = tuple(tokens[root_index:len(tokens) - 1])  # the root and the accepted drafts
        keep = list(range(root_index + 1))
        # The accepted nodes the draft expanded were fed; a leaf (or unexpanded node) was not, nor
        # anything below it.
        for depth in range(2, len(path) + 1):
            column = column_of_path.get(path[:depth])
            if column is None:
                break
            keep.append(column)
        self.lm.keep(request, keep)

    def release(self, request):
        self.lm.release(request)
        self._column_of_path.pop(request, None)


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """[first, last) ranges of the runs of equal consecutive values."""
    runs, first = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[first]:
            runs.append((first, i))
            first = i
    return runs


def _ranking_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The logits a tree drafter ranks children by: raw for greedy requests, else those of the
    request's sampling distribution (temperature, top-k / top-p: filtered tokens at -inf)."""
    if sampling.greedy:
        return logits.float()
    if sampling.filtered:
        logits = apply_top_k_top_p(logits, sampling.top_k, sampling.top_p, temperature=sampling.temperature)
    return logits.float() / sampling.temperature


@dataclass
class GenerationStats:
    """Counters of one ``speculative_generate`` call.

    A *request step* is one request taking part in one verify call. The phase times are host
    wall-clock times; on a GPU the forwards run asynchronously and their work is mostly
    waited for when the op's result is read back (counted in ``verify_time_s``).
    """
    num_steps: int = 0             # verify calls (each batched over the active requests)
    num_request_steps: int = 0
    num_generated_tokens: int = 0  # committed new tokens (after EOS truncation)
    num_draft_tokens: int = 0      # drafts proposed (tree mode: tree nodes, roots excluded)
    num_accepted_tokens: int = 0   # drafts accepted
    wall_time_s: float = 0.0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    verify_time_s: float = 0.0     # filters, the op and reading its result back

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per request step (1 = no speedup from drafting)."""
        return self.num_generated_tokens / max(self.num_request_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (NaN when nothing was proposed). In tree mode at most
        one path per tree can be accepted, so compare trees by ``tokens_per_step``."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else float("nan")


@dataclass
class StepInfo:
    """What ``on_step`` receives after every verify step.

    ``tokens[b]``: request b's committed tokens (prompt + generated so far; do not modify);
    ``active``: the requests still generating after this step.
    """
    step: int
    num_new_tokens: int
    tokens: list[list[int]]
    active: list[int]


@dataclass
class GenerationResult:
    """``tokens[b]``: the new tokens of request b (no prompt; EOS included when it stopped there).
    ``steps[b]`` / ``accepted[b]``: its verify steps and accepted drafts."""
    tokens: list[list[int]]
    stats: GenerationStats
    steps: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


def _per_request(value, num_requests: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != num_requests:
            raise ValueError(f"{name} has {len(value)} entries for {num_requests} prompts")
        return list(value)
    return [value] * num_requests


def request_generators(num_requests: int, device: torch.device | str, seed: int | Sequence[int] | None = None,
                       generators: Sequence[torch.Generator] | None = None) -> list[torch.Generator]:
    """One ``torch.Generator`` per request on ``device``.

    Parameters
    ----------
    num_requests : int
    device : torch.device or str
    seed : int, sequence of int, or None
        An int seeds a generator that draws one seed per request (request b's stream depends
        on ``seed`` and b only); a sequence gives each request its own seed; None draws the
        seeds from torch's default generator (reproducible under ``torch.manual_seed``).
    generators : sequence of torch.Generator or None
        Used as they are (on ``device``), instead of ``seed``.

    Returns
    -------
    list of torch.Generator, one per request
    """
    if generators is not None:
        if seed is not None:
            raise ValueError("pass seed or generators, not both")
        generators = list(generators)
        if len(generators) != num_requests:
            raise ValueError(f"generators has {len(generators)} entries for {num_requests} prompts")
        return generators
    if seed is None:
        seeds = torch.randint(0, 2**62, (num_requests,)).tolist()
    elif isinstance(seed, int):
        seeds = torch.randint(0, 2**62, (num_requests,), generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        seeds = [int(s) for s in _per_request(list(seed), num_requests, "seed")]
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


def _eos_set(eos_token_id, target) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    *,
    max_new_tokens: int = 64,
    num_draft_tokens: int | None = None,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seed: int | Sequence[int] | None = None,
    generators: Sequence[torch.Generator] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    tree: TreeSpec | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    target_lm: CachedCausalLM | None = None,
    method: str = "token",
    lenience: float | Sequence[float] | None = None,
) -> GenerationResult:
    """Generate with speculative decoding, verifying all requests in one op call per step.

    Parameters
    ----------
    target : transformers causal LM
        The model whose distribution the output follows.
    draft : transformers causal LM or Drafter
        A model sharing the target's tokenizer (wrapped in ``ModelDrafter``, or in
        ``TreeDrafter`` when ``tree`` is given) or any ``Drafter`` (e.g. a ``TreeDrafter``).
    prompts : sequence of token-id sequences or 1-D tensors
        Different lengths welcome; no padding.
    max_new_tokens : int
        Per request. Drafts are capped so that a step never exceeds it.
    num_draft_tokens : int or None
        K, the most drafts per request and step on one path: the chain length, or a cap on the
        tree depth (0 = plain decoding through the op). None = the drafter's
        ``default_num_drafts``: 4 for chain drafters, ``max_depth`` for a tree drafter.
    temperature, top_k, top_p : number or sequence (one per request)
        ``temperature <= 0`` = greedy (equals the target's greedy decoding). Otherwise the
        output follows the target's temperature -> top-k -> top-p sampling exactly.
    seed, generators
        Per-request randomness, see ``request_generators``.
    eos_token_id : int, sequence of int or None
        A request stops after emitting one of these. None = the target's
        ``generation_config.eos_token_id``; ``[]`` = never stop early.
    tree : TreeSpec or None
        Tree mode: ``draft`` (a model) expands EAGLE-2 top-k trees of this shape
        (``TreeDrafter``), the target scores every node in one forward per request under the
        tree attention mask, and ``tree_rejection_sample`` verifies them. None = chain mode
        (unless ``draft`` is itself a tree drafter).
    on_step : callable or None
        Called with a ``StepInfo`` after every step (progress bars, inspection).
    target_lm : CachedCausalLM or None
        The target's cache holder; pass one to inspect the caches from ``on_step`` (tests).
        Requests are its indices 0 .. len(prompts) - 1; finished requests are released.
    method : {"token", "block"}
        How chains are verified (``rejection_sample``'s ``method``): "token" draft by draft,
        "block" jointly (Sun et al. 2024): the same output law, never fewer accepted drafts in
        expectation. Only random requests differ; greedy output is the same. Chain mode only:
        tree verification has no block variant, so "block" with trees raises a ValueError.
    lenience : float, sequence of float (one per request) or None
        Opt-in, NOT exact (docs/ALGORITHM.md §8): the op's per-request ``lenience`` in (0, 1].
        Random requests accept a draft x iff ``u l p(x) < q(x)`` (no token is emitted with
        probability above q(x) / l), greedy ones also a draft with ``p(x) >= l max p``. None or
        1 = exact. Token verification only (``method="block"`` raises a ValueError).

    Returns
    -------
    GenerationResult
    """
    start_time = time.perf_counter()
    if method not in VERIFY_METHODS:
        raise ValueError(f"method must be one of {VERIFY_METHODS}, got {method!r}")
    if lenience is not None and method == "block":
        raise ValueError("lenience is not defined for method='block': pass lenience=None, or method='token'")
    num_requests = len(prompts)
    committed = [list(p.tolist() if isinstance(p, torch.Tensor) else p) for p in prompts]
    if any(len(tokens) == 0 for tokens in committed):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 0 or (num_draft_tokens is not None and num_draft_tokens < 0):
        raise ValueError("max_new_tokens and num_draft_tokens must be >= 0")
    target_lm = target_lm if target_lm is not None else CachedCausalLM(target)
    if tree is not None:
        if isinstance(draft, Drafter):
            raise ValueError("tree= builds a TreeDrafter around a draft model; with a Drafter instance, leave "
                             "tree out (pass TreeDrafter(model, spec) as draft for tree mode)")
        drafter = TreeDrafter(draft, tree)
    else:
        drafter = draft if isinstance(draft, Drafter) else ModelDrafter(draft)
    if method == "block" and (isinstance(drafter, TreeDrafter) or getattr(drafter, "is_tree", False)):
        raise ValueError(_BLOCK_NEEDS_CHAINS)
    max_drafts = drafter.default_num_drafts if num_draft_tokens is None else num_draft_tokens
    device = target_lm.device
    sampling = [SamplingParams(float(t), int(k), float(p)) for t, k, p in zip(
        _per_request(temperature, num_requests, "temperature"), _per_request(top_k, num_requests, "top_k"),
        _per_request(top_p, num_requests, "top_p"))]
    gens = request_generators(num_requests, device, seed, generators)
    lenient = None if lenience is None else [float(v) for v in _per_request(lenience, num_requests, "lenience")]
    if lenient is not None and not all(0.0 < v <= 1.0 for v in lenient):
        raise ValueError(f"lenience must be in (0, 1] (1 = exact), got {lenient}")
    eos = _eos_set(eos_token_id, target)
    prompt_lengths = [len(tokens) for tokens in committed]
    stats = GenerationStats()
    steps, accepted = [0] * num_requests, [0] * num_requests
    active = [b for b in range(num_requests) if max_new_tokens > 0]

    while active:
        # A step emits at most (drafts on a path) + 1 tokens: keep it within the budget.
        limits = [min(max_drafts, max_new_tokens - (len(committed[b]) - prompt_lengths[b]) - 1) for b in active]
        t0 = time.perf_counter()
        proposals = drafter.propose_batch(active, [committed[b] for b in active], limits,
                                          [sampling[b] for b in active], [gens[b] for b in active])
        if len(proposals) != len(active):
            raise ValueError(f"the drafter returned {len(proposals)} proposals for {len(active)} requests")
        for b, limit, proposal in zip(active, limits, proposals):
            if not isinstance(proposal, (DraftChain, DraftTokenTree)):
                raise TypeError("a drafter must propose DraftChain or DraftTokenTree objects, got "
                                f"{type(proposal).__name__}")
            if proposal.depth > limit:
                raise ValueError(f"the drafter proposed {proposal.depth} drafts on one path for request {b}, "
                                 f"more than {limit}")
        t1 = time.perf_counter()
        rows, root_columns = [], []
        for b, proposal in zip(active, proposals):
            logits, root_column = _score_proposal(target_lm, b, committed[b], proposal, device)
            rows.append(logits)
            root_columns.append(root_column)
        t2 = time.perf_counter()
        emitted, accepted_nodes = _verify(rows, proposals, [committed[b][-1] for b in active],
                                          [sampling[b] for b in active], [gens[b] for b in active], method,
                                          None if lenient is None else [lenient[b] for b in active])
        t3 = time.perf_counter()

        still_active = []
        committed_this_step = 0
        for i, b in enumerate(active):
            new_tokens = emitted[i]
            num_accepted = len(new_tokens) - 1
            if new_tokens[-1] < 0:
                raise RuntimeError(f"request {b}: the target's logits row has no valid entry (all NaN or -inf)")
            stop = next((j for j, token in enumerate(new_tokens) if token in eos), None)
            if stop is not None:
                new_tokens = new_tokens[:stop + 1]
            committed[b].extend(new_tokens)
            committed_this_step += len(new_tokens)
            steps[b] += 1
            accepted[b] += num_accepted
            stats.num_draft_tokens += proposals[i].tokens.numel()
            stats.num_accepted_tokens += num_accepted
            if stop is not None or len(committed[b]) - prompt_lengths[b] >= max_new_tokens:
                target_lm.release(b)
                drafter.release(b)
            else:
                # The target fed every draft; it keeps the committed tokens but the newest: the
                # tokens through the root, then the accepted nodes (a gather when they are not a prefix).
                root = root_columns[i]
                target_lm.keep(b, list(range(root + 1)) + [root + node for node in accepted_nodes[i][1:]])
                drafter.commit(b, committed[b], num_accepted)
                still_active.append(b)
        stats.num_steps += 1
        stats.num_request_steps += len(active)
        stats.num_generated_tokens += committed_this_step
        stats.draft_time_s += t1 - t0
        stats.target_time_s += t2 - t1
        stats.verify_time_s += t3 - t2
        active = still_active
        if on_step is not None:
            on_step(StepInfo(stats.num_steps, committed_this_step, committed, list(active)))

    stats.wall_time_s = time.perf_counter() - start_time
    return GenerationResult([tokens[n:] for tokens, n in zip(committed, prompt_lengths)], stats, steps, accepted)


def _score_proposal(target_lm: CachedCausalLM, request: int, tokens: Sequence[int],
                    proposal: DraftChain | DraftTokenTree, device) -> tuple[torch.Tensor, int]:
    """One target forward over the committed tokens its cache lacks (ending with the root, the
    newest) and the drafts, under the proposal's parent links.

    Returns the logits of the root and of every draft [n + 1, V] (the op's rows of this request)
    and the root's cache column (draft j is at column root + 1 + j).
    """
    num_cached = target_lm.num_cached(request)
    pending = torch.tensor(list(tokens[num_cached:]), dtype=torch.long, device=device)
    root = len(tokens) - 1
    input_ids = torch.cat([pending, proposal.tokens.to(device=device, dtype=torch.long)])
    parents = list(range(num_cached - 1, root)) + [root + parent for parent in proposal.parents]
    return target_lm.forward(request, input_ids, proposal.tokens.numel() + 1, parents), root


def _verify(rows: list[torch.Tensor], proposals: list, roots: list[int], sampling: list[SamplingParams],
            generators: list[torch.Generator], method: str = "token", lenience: list[float] | None = None
            ) -> tuple[list[list[int]], list[list[int]]]:
    """One op call over every active request (chains verified with ``method``; ``lenience``: one
    per request, or None = exact).

    Returns, per request, the tokens of this step (the accepted drafts, then the target's token)
    and the accepted path's local nodes (0 = the root, then the accepted drafts' nodes).
    """
    if all(isinstance(p, DraftChain) for p in proposals):
        emitted = _verify_chains(rows, proposals, sampling, generators, method, lenience)
        return emitted, [list(range(len(tokens))) for tokens in emitted]
    if method == "block":
        raise ValueError(_BLOCK_NEEDS_CHAINS)
    # Trees in the step: chains join them as chain-shaped trees, which needs deterministic drafts
    # (one op call verifies the step, with draft_probs=None).
    for proposal in proposals:
        if isinstance(proposal, DraftChain) and proposal.probs is not None and proposal.tokens.numel():
            raise ValueError("a step mixes trees with sampled chains (draft probabilities): one op call verifies "
                             "the step, so a drafter proposing trees must propose deterministic chains only")
    trees = [p if isinstance(p, DraftTokenTree) else DraftTokenTree(p.tokens, p.parents) for p in proposals]
    return _verify_trees(rows, trees, roots, sampling, generators, lenience)


def _prepare_target_logits(rows: list[torch.Tensor], sampling: list[SamplingParams]
                           ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The op's target logits (every request's rows), temperatures [B] and its filter arguments
    (``top_k`` / ``top_p`` [B] when a request uses them: the op applies them in its kernel)."""
    device = rows[0].device
    logits = torch.cat(rows)
    temperature = torch.tensor([max(s.temperature, 0.0) for s in sampling], dtype=torch.float32, device=device)
    filters = {}
    if any(s.filtered for s in sampling):
        # The op's conventions: top_k 0 = off, top_p 1 = off.
        filters["top_k"] = torch.tensor([max(s.top_k, 0) for s in sampling], dtype=torch.int32, device=device)
        filters["top_p"] = torch.tensor([min(s.top_p, 1.0) for s in sampling], dtype=torch.float32, device=device)
    return logits, temperature, filters


def _step_seeds(generators: list[torch.Generator], device) -> torch.Tensor:
    """One fresh Philox seed per request, drawn from its own generator."""
    return torch.cat([torch.randint(_INT64_MIN, _INT64_MAX, (1,), dtype=torch.int64, generator=g, device=g.device)
                      .to(device) for g in generators])


def _lenience_tensor(lenience: list[float] | None, device) -> torch.Tensor | None:
    return None if lenience is None else torch.tensor(lenience, dtype=torch.float32, device=device)


def _cumulative_counts(counts: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
    return cu.to(device)


def _verify_chains(rows: list[torch.Tensor], chains: list[DraftChain], sampling: list[SamplingParams],
                   generators: list[torch.Generator], method: str = "token",
                   lenience: list[float] | None = None) -> list[list[int]]:
    """``rejection_sample`` (``method`` "token" or "block") over every request: its tokens for this step.

    ``rows[i]`` [n_i + 1, V]: the target's logits for request i's draft positions and bonus
    position (the op's layout once concatenated).
    """
    device = rows[0].device
    counts = [chain.tokens.numel() for chain in chains]
    logits, temperature, filters = _prepare_target_logits(rows, sampling)
    drafts = torch.cat([chain.tokens.to(device) for chain in chains])
    draft_probs = None
    if any(chain.probs is not None for chain in chains):
        # Mixed batches: deterministic drafts are point masses (greedy requests ignore the rows).
        vocab = logits.shape[1]
        draft_probs = torch.cat([
            chain.probs.to(device=device, dtype=torch.float32) if chain.probs is not None
            else torch.nn.functional.one_hot(chain.tokens.to(device), vocab).to(torch.float32)
            for chain in chains])
    out, num_accepted = rejection_sample(logits, drafts, _cumulative_counts(counts, device), draft_probs,
                                         temperature, _step_seeds(generators, device), None, max(counts), method,
                                         lenience=_lenience_tensor(lenience, device), **filters)
    num_accepted = num_accepted.tolist()
    out = out.tolist()
    return [out[i][:num_accepted[i] + 1] for i in range(len(chains))]


def _verify_trees(rows: list[torch.Tensor], trees: list[DraftTokenTree], roots: list[int],
                  sampling: list[SamplingParams], generators: list[torch.Generator],
                  lenience: list[float] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """``tree_rejection_sample`` over every request (deterministic drafts, ``draft_probs=None``).

    ``rows[i]`` [n_i + 1, V]: the target's logits after request i's root and each of its drafts.
    """
    device = rows[0].device
    logits, temperature, filters = _prepare_target_logits(rows, sampling)
    tokens = torch.cat([torch.cat([torch.tensor([root], dtype=torch.long, device=device),
                                   tree.tokens.to(device=device, dtype=torch.long)])
                        for root, tree in zip(roots, trees)])
    parents = torch.tensor([p for tree in trees for p in [-1] + list(tree.parents)], dtype=torch.int32, device=device)
    cu = _cumulative_counts([tree.tokens.numel() + 1 for tree in trees], device)
    out, accepted_nodes, num_accepted = tree_rejection_sample(
        logits, tokens, parents, cu, None, temperature, _step_seeds(generators, device), None,
        max(tree.depth for tree in trees), lenience=_lenience_tensor(lenience, device), **filters)
    num_accepted = num_accepted.tolist()
    out = out.tolist()
    accepted_nodes = accepted_nodes.tolist()
    return ([out[i][:num_accepted[i] + 1] for i in range(len(trees))],
            [accepted_nodes[i][:num_accepted[i] + 1] for i in range(len(trees))])
