"""Drafters for ``specdec_kernels.hf.speculative_generate`` beyond the two of ``speculative``.

- ``EarlyExitDrafter``: self-speculative drafting with the target's own first layers. The
  draft is the target truncated after ``exit_layer`` decoder layers, followed by the target's
  final norm and LM head (``early_exit_model``). It shares the target's weights (the same
  ``Parameter`` objects, no copy), keeps its own per-request KV caches (``ModelDrafter``'s),
  and samples its drafts, handing over their probabilities, so sampled output stays exact.
- ``PromptLookupDrafter`` and ``ModelDrafter`` (re-exported from ``hf``): n-gram lookup in the
  request's own tokens (deterministic drafts) and a separate, smaller draft model.
- ``TreeDrafter`` (re-exported from ``hf``): EAGLE-2 style top-k token trees from a model
  (tree mode); ``make_drafter`` builds it over the early-exit model or a separate draft model
  ("early-exit-tree", "draft-model-tree").
- ``RecordingDrafter``: wraps any drafter and logs how many tokens it proposed at each step,
  which the statistics of ``python -m specdec_kernels.generate`` need (per-draft acceptance).

``make_drafter`` builds one by its command-line name (``DRAFTER_NAMES``).
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch

from .speculative import (Drafter, DraftChain, DraftTokenTree, ModelDrafter, PromptLookupDrafter, SamplingParams, TreeDrafter,
                 TreeSpec)

__all__ = ["DRAFTER_NAMES", "EarlyExitDrafter", "ModelDrafter", "PromptLookupDrafter", "RecordingDrafter",
           "TreeDrafter", "TreeSpec", "default_exit_layer", "early_exit_model", "make_drafter"]

# Chain drafters, then tree mode: top-k expansion for the model-based ones, the continuations of
# several match sites merged into a token trie for prompt lookup.
DRAFTER_NAMES = ("prompt-lookup", "early-exit", "draft-model", "prompt-lookup-tree", "early-exit-tree",
                 "draft-model-tree")
#: Match sites whose continuations "prompt-lookup-tree" verifies at once.
LOOKUP_TREE_CANDIDATES = 4


def default_exit_layer(num_layers: int) -> int:
    """The exit layer used when none is given: three quarters of the depth (22 of SmolLM2's 30).

    Without early-exit training (LayerSkip) a model's intermediate layers predict its output
    poorly: for SmolLM2-135M the greedy agreement with the full model is ~5% after 15 layers,
    ~20% after 22 and ~50% after 29, and no exit layer makes early exit pay off on a CPU
    (0.28x-0.47x for 8..29 layers, docs/MAIN_JOB.md). Three quarters is a middle setting that
    keeps some acceptance at three quarters of the cost; models trained for early exit do better.
    """
    return max(1, (3 * num_layers) // 4)


def early_exit_model(target, exit_layer: int):
    """The target's first ``exit_layer`` decoder layers, its final norm and its LM head, as an HF model.

    Parameters
    ----------
    target : transformers ``PreTrainedModel`` (a causal LM)
        Its config must count its decoder layers in ``num_hidden_layers`` and its parameters
        must be named by layer index (Llama, Mistral, Qwen, Gemma, ... all are).
    exit_layer : int
        Decoder layers to keep, ``1 <= exit_layer < target.config.num_hidden_layers``.

    Returns
    -------
    transformers ``PreTrainedModel``
        Of the target's class, in eval mode. Its parameters and buffers are the target's own
        tensors (no copy, no extra memory; changing one changes the other); it has its own
        config (``num_hidden_layers = exit_layer``), so its KV caches have ``exit_layer``
        layers. Its logits are ``lm_head(norm(h_L))`` where ``h_L`` is the target's hidden
        state after layer ``exit_layer``.
    """
    num_layers = getattr(target.config, "num_hidden_layers", None)
    if num_layers is None:
        raise ValueError(f"{type(target).__name__}'s config has no num_hidden_layers: cannot truncate it")
    if not 1 <= exit_layer < num_layers:
        raise ValueError(f"exit_layer must be in [1, {num_layers - 1}] for a {num_layers}-layer target, "
                         f"got {exit_layer}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = exit_layer
    if getattr(config, "layer_types", None) is not None:  # per-layer attention kinds (sliding / full)
        config.layer_types = list(config.layer_types[:exit_layer])
    if hasattr(config, "quantization_config"):
        # The target's weights are already dequantized (GGUF) tensors; the draft only borrows them.
        del config.quantization_config
    with torch.device("meta"):  # no memory, no random initialization: every tensor is replaced below
        draft = type(target)(config)
    # assign=True installs the target's Parameter objects themselves; the target's deeper layers
    # are "unexpected" keys, the draft's keys must all be found.
    missing, _ = draft.load_state_dict(target.state_dict(keep_vars=True), strict=False, assign=True)
    if missing:
        raise RuntimeError(f"the truncated {type(target).__name__} has parameters the target lacks: {missing[:5]}")
    # Non-persistent buffers (rotary frequencies) are not in the state dict: share them by name.
    target_buffers = dict(target.named_buffers())
    for name, buffer in list(draft.named_buffers()):
        if buffer.is_meta:
            if name not in target_buffers:
                raise RuntimeError(f"the truncated {type(target).__name__} has a buffer the target lacks: {name}")
            owner_name, _, attribute = name.rpartition(".")
            owner = draft.get_submodule(owner_name)
            persistent = attribute not in owner._non_persistent_buffers_set
            owner.register_buffer(attribute, target_buffers[name], persistent=persistent)
    left_on_meta = [name for name, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if left_on_meta:
        raise RuntimeError(f"early_exit_model could not share these tensors of the target: {left_on_meta[:5]}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


class EarlyExitDrafter(ModelDrafter):
    """Self-speculative drafting: the target's first ``exit_layer`` layers + its final norm and LM head.

    The draft model is ``early_exit_model(target, exit_layer)``: it shares the target's
    weights and has its own per-request KV caches (of ``exit_layer`` layers), rolled back
    after each verification exactly as ``ModelDrafter``'s. Drafts are greedy for greedy
    requests and sampled (with their probabilities handed to the op) otherwise.

    Parameters
    ----------
    target : transformers ``PreTrainedModel``
        The target model itself (the one ``speculative_generate`` verifies with).
    exit_layer : int or None
        Decoder layers the draft runs; None = ``default_exit_layer``.

    Notes
    -----
    The draft's caches hold the same keys and values as the target's first ``exit_layer``
    layers for the same tokens, and drafting computes what the verify forward recomputes in
    those layers for the drafted tokens. Sharing them (LayerSkip's self-speculation) would let
    the verify forward start after layer ``exit_layer`` for the drafts and drop the draft's
    cache memory; that needs the engine to pass layer states and caches between drafter and
    target, which ``speculative`` does not do yet.
    """

    def __init__(self, target, exit_layer: int | None = None):
        num_layers = target.config.num_hidden_layers
        self.exit_layer = default_exit_layer(num_layers) if exit_layer is None else int(exit_layer)
        self.num_target_layers = num_layers
        super().__init__(early_exit_model(target, self.exit_layer))

    @property
    def model(self):
        """The truncated model (shares the target's weights)."""
        return self.lm.model


class RecordingDrafter(Drafter):
    """Wraps a drafter and logs the number of tokens it proposed at each verify step.

    ``speculative_generate`` calls ``propose`` at most once per request and step (not at
    all when the token budget leaves no room for drafts), so with one request per call,
    ``take_step_proposal()`` read in ``on_step`` gives that step's proposal length.

    Parameters
    ----------
    drafter : Drafter
    """

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self._proposed_this_step = 0

    @property
    def default_num_drafts(self) -> int:
        return self.drafter.default_num_drafts

    @property
    def is_tree(self) -> bool:
        """Whether the wrapped drafter proposes token trees (tree mode)."""
        return isinstance(self.drafter, TreeDrafter) or bool(getattr(self.drafter, "is_tree", False))

    def propose(self, request: int, tokens: Sequence[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> DraftChain | DraftTokenTree:
        return self.propose_batch([request], [tokens], [num_drafts], [sampling], [generator])[0]

    def propose_batch(self, requests, tokens, num_drafts, sampling, generators):
        # Forwarded whole, so that a drafter batching its drafting (TreeDrafter) keeps doing so.
        proposals = self.drafter.propose_batch(requests, tokens, num_drafts, sampling, generators)
        self._proposed_this_step += sum(int(p.tokens.numel()) for p in proposals if p is not None)
        return proposals

    def commit(self, request: int, tokens: Sequence[int], num_accepted: int) -> None:
        self.drafter.commit(request, tokens, num_accepted)

    def release(self, request: int) -> None:
        self.drafter.release(request)

    def take_step_proposal(self) -> int:
        """Tokens proposed since the last call (this step's, for one request), and reset."""
        proposed, self._proposed_this_step = self._proposed_this_step, 0
        return proposed


def make_drafter(name: str, target, *, draft_model=None, exit_layer: int | None = None,
                 max_ngram: int = 3, min_ngram: int = 1, tree_spec: TreeSpec = TreeSpec(),
                 draft_cost: float | None = None, num_candidates: int = LOOKUP_TREE_CANDIDATES) -> Drafter:
    """Build a drafter by its command-line name.

    Parameters
    ----------
    name : {"prompt-lookup", "early-exit", "draft-model", "prompt-lookup-tree", "early-exit-tree", "draft-model-tree"}
    target : transformers ``PreTrainedModel``
        The target (early exit truncates it).
    draft_model : transformers ``PreTrainedModel`` or None
        Needed for "draft-model": a smaller model with the target's tokenizer.
    exit_layer : int or None
        For "early-exit" (None = ``default_exit_layer``).
    max_ngram, min_ngram : int
        For the prompt-lookup drafters: the longest and shortest n-grams matched.
    tree_spec : TreeSpec
        For the model-based tree drafters: nodes per step, children per node, depth.
    draft_cost : float or None
        For the prompt-lookup drafters: the cost of one more draft token in target steps, which
        picks K by the theory each step (``PromptLookupDrafter``); None = always the most allowed.
    num_candidates : int
        For "prompt-lookup-tree": the match sites whose continuations are verified at once.

    Returns
    -------
    Drafter
    """
    if name in ("prompt-lookup", "prompt-lookup-tree"):
        return PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram, draft_cost=draft_cost,
                                   num_candidates=num_candidates if name == "prompt-lookup-tree" else 1)
    if name == "early-exit":
        return EarlyExitDrafter(target, exit_layer)
    if name == "early-exit-tree":
        return TreeDrafter(early_exit_model(target, default_exit_layer(target.config.num_hidden_layers)
                                            if exit_layer is None else exit_layer), tree_spec)
    if name in ("draft-model", "draft-model-tree"):
        if draft_model is None:
            raise ValueError(f"the {name} drafter needs a draft model (--draft PATH)")
        return ModelDrafter(draft_model) if name == "draft-model" else TreeDrafter(draft_model, tree_spec)
    raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTER_NAMES)}")
