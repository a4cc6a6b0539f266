"""vLLM V1 rejection sampler on top of ``torch.ops.specdec.rejection_sample`` (chain mode).

Mirrors the API of ``vllm/v1/sample/rejection_sampler.py`` without importing vLLM: the
metadata objects are duck-typed, so vLLM's ``SpecDecodeMetadata`` and ``SamplingMetadata``
(or any objects with the same attributes) work. docs/INTEGRATION.md says how to swap it in.

Two entry points:

- ``RejectionSampler`` (an ``nn.Module``): ``forward(metadata, draft_probs, logits,
  sampling_metadata)`` takes vLLM's full ``[N + B, V]`` logits, whose layout (each request's
  draft rows, then its bonus row) is exactly the op's, and samples the bonus tokens in the
  same single launch. No copy of the logits unless allowed-token masks are set (top-k / top-p
  are passed to the op, which applies them inside its kernel).
- ``rejection_sample(...)``: vLLM's module-level function, for callers that have already
  sampled the bonus tokens. It builds an ``[N + B, V]`` tensor whose bonus rows are point
  masses at the given bonus tokens (logit 0 there, -inf elsewhere): exact, but a copy of the
  target logits that the module form avoids.

What is read from ``sampling_metadata``: ``temperature`` ([B], greedy requests 0 or -1 as
in any vLLM version; None when ``all_greedy``), ``all_greedy``, ``top_k`` and ``top_p``
([B] or None), ``generators`` ({request index: torch.Generator}); and, applied to the target
rows before the op in vLLM's order (``vllm_logits``): presence / frequency / repetition
penalties, ``allowed_token_ids_mask``, bad words, the non-argmax-invariant logits processors
with a speculative-decoding hook (min_tokens) and the thinking-token budget. From vLLM's
``SpeculativeConfig`` (``spec_config``): the verification method ("standard" or "block";
the lossy FLy and the synthetic-acceptance mode raise). What cannot be applied (logprobs,
other active logits processors, unknown metadata fields) is named by
``unsupported_features`` and both entry points raise ``NotImplementedError`` rather than
sample something else; ``vllm_logits.SAMPLING_METADATA_FIELDS`` says how each field is treated.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..chain import rejection_sample as _specdec_rejection_sample
from ..reference.philox import draw_seeds
from .vllm_logits import process_target_logits, unsupported, verification_method

# vLLM's value for the unused slots of the output, and its dtype (int32, as vLLM's
# SamplerOutput.sampled_token_ids); the op uses the same.
PLACEHOLDER_TOKEN_ID = -1
OUTPUT_DTYPE = torch.int32

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def unsupported_features(sampling_metadata: Any) -> list[str]:
    """The features requested in ``sampling_metadata`` that this adapter cannot apply as vLLM does.

    Parameters
    ----------
    sampling_metadata : vLLM ``SamplingMetadata`` or any object with its attributes

    Returns
    -------
    list of str
        Empty when the adapter handles the batch exactly; otherwise one short description per
        feature: logprobs, an active logits processor it cannot apply (argmax-invariant ones
        such as min-p in a batch with random requests; non-argmax-invariant ones without a
        speculative-decoding hook), a metadata field it does not know. Engines that want to
        route such batches to their own sampler can test this before calling; both entry
        points raise ``NotImplementedError`` on them.
    """
    return unsupported(sampling_metadata)


def _check_supported(sampling_metadata: Any) -> None:
    missing = unsupported_features(sampling_metadata)
    if missing:
        raise NotImplementedError(
            "specdec_kernels' vLLM rejection sampler does not implement: " + "; ".join(missing)
            + ". Use vLLM's own RejectionSampler for such batches (docs/INTEGRATION.md).")


def _exclusive_offsets(cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """vLLM's inclusive offsets [B] (no leading 0) -> the op's exclusive offsets [B + 1]."""
    if not isinstance(cu_num_draft_tokens, torch.Tensor) or cu_num_draft_tokens.dim() != 1:
        raise ValueError("cu_num_draft_tokens must be a 1-D tensor [B] of inclusive offsets "
                         "(vLLM's convention: no leading 0)")
    zero = torch.zeros(1, dtype=torch.int32, device=cu_num_draft_tokens.device)
    return torch.cat([zero, cu_num_draft_tokens.to(torch.int32)])


def request_temperature(sampling_metadata: Any, batch: int, device: torch.device) -> torch.Tensor:
    """Per-request temperature for the op from vLLM's sampling metadata.

    Parameters
    ----------
    sampling_metadata : vLLM ``SamplingMetadata``
        Greedy requests carry temperature 0 (-1 in older vLLM); ``temperature`` may be None
        when ``all_greedy``.
    batch : int
    device : torch.device

    Returns
    -------
    Tensor [B] float32
        The temperature of random requests, 0 (greedy) for the others.
    """
    if getattr(sampling_metadata, "all_greedy", False):
        return torch.zeros(batch, dtype=torch.float32, device=device)
    temperature = sampling_metadata.temperature
    if temperature is None or temperature.shape != (batch,):
        raise ValueError(f"sampling_metadata.temperature must be a tensor of shape ({batch},) unless "
                         f"all_greedy, got {None if temperature is None else tuple(temperature.shape)}")
    temperature = temperature.to(device=device, dtype=torch.float32)
    # Older vLLM marks greedy requests with -1; the op's value checks want 0.
    return torch.where(temperature > 0, temperature, 0.0)


def request_seeds(generators: dict[int, torch.Generator] | None, batch: int, device: torch.device,
                  skip: Sequence[int] = ()) -> torch.Tensor:
    """One Philox seed per request for this step: [B] int64 on ``device``.

    Seeded requests (vLLM's ``generators``: request index -> ``torch.Generator``) draw their
    seed from their own generator, which advances it by one draw per step, so a seeded request
    gives the same tokens run after run. The others get seeds from torch's default generator
    on ``device``. Fresh seeds every step mean the op's ``offsets`` can stay 0.

    Parameters
    ----------
    generators : dict[int, torch.Generator] or None
    batch : int
    device : torch.device
    skip : sequence of int
        Requests whose generator must not advance (they use no randomness this step).

    Returns
    -------
    Tensor [B] int64
    """
    seeds = draw_seeds(batch, device)
    for index, generator in (generators or {}).items():
        if not 0 <= index < batch:
            raise ValueError(f"sampling_metadata.generators has request index {index}, outside [0, {batch})")
        if index in skip:
            continue
        seed = torch.randint(_INT64_MIN, _INT64_MAX, (1,), dtype=torch.int64, generator=generator,
                             device=generator.device)
        seeds[index] = seed.to(device)[0]
    return seeds


def request_filters(sampling_metadata: Any, batch: int, device: torch.device) -> dict:
    """The op's ``top_k`` / ``top_p`` arguments from vLLM's sampling metadata.

    vLLM's ``top_k`` ([B] int, None when no request uses it; a disabled request holds 0, -1 or
    the vocabulary size) and ``top_p`` ([B] float, None when unused; 1 = disabled) go to the op,
    which applies them to every target row of a random request inside its kernel, after the
    temperature and in that order, as vLLM's sampler and rejection sampler do. Greedy requests
    ignore them. (vLLM's min-p, a logits processor applied before top-k / top-p, is not read:
    vLLM's rejection sampler does not apply it to the target either.)

    Returns
    -------
    dict
        ``{"top_k": Tensor [B] int32, "top_p": Tensor [B] float32}``, either key absent when
        unused; empty for all-greedy batches.
    """
    if getattr(sampling_metadata, "all_greedy", False):
        return {}  # greedy verification looks at the argmax, which every filter keeps
    filters = {}
    top_k = getattr(sampling_metadata, "top_k", None)
    if top_k is not None:
        top_k = top_k.to(device=device)
        if top_k.shape != (batch,):
            raise ValueError(f"sampling_metadata.top_k must have shape ({batch},), got {tuple(top_k.shape)}")
        filters["top_k"] = torch.where(top_k > 0, top_k, 0).to(torch.int32)  # -1 (disabled) -> 0
    top_p = getattr(sampling_metadata, "top_p", None)
    if top_p is not None:
        top_p = top_p.to(device=device)
        if top_p.shape != (batch,):
            raise ValueError(f"sampling_metadata.top_p must have shape ({batch},), got {tuple(top_p.shape)}")
        filters["top_p"] = top_p.to(torch.float32)
    return filters


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    sampling_metadata: Any,
    *,
    validate: bool | None = None,
    spec_config: Any = None,
    lenience: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's ``rejection_sample`` with the bonus tokens already sampled (one op launch).

    The bonus row of each request is a point mass at its bonus token, so the op emits exactly
    that token when every draft is accepted. Building the ``[N + B, V]`` input copies the target
    logits; ``RejectionSampler.forward`` takes vLLM's ``[N + B, V]`` logits as they are instead.

    Parameters
    ----------
    draft_token_ids : Tensor [N] int32 / int64
    num_draft_tokens : sequence of int, length B
        Drafts per request (a host-side list in vLLM); 0 allowed.
    max_spec_len : int
        Output width - 1 (vLLM: ``max(num_draft_tokens)``).
    cu_num_draft_tokens : Tensor [B] int
        Inclusive offsets without a leading 0 (vLLM's convention).
    draft_probs : Tensor [N, V] or None
        The draft distributions; None for drafters without probabilities (n-gram, EAGLE).
    target_logits : Tensor [N, V] fp32 / bf16 / fp16
        The target's raw logits at the draft positions only (before temperature, top-k,
        top-p). vLLM's own function takes probabilities it computed from these; here the op
        applies the temperature itself and top-k/top-p are applied from ``sampling_metadata``.
    bonus_token_ids : Tensor [B, 1] (or [B]) int
        The token emitted when all of a request's drafts are accepted. An id outside [0, V)
        gives that request no valid bonus, and then -1 in its place.
    sampling_metadata : vLLM ``SamplingMetadata``
        See the module docstring for the attributes read. Seeded requests (``generators``)
        advance their generator by one draw per call, except requests with no drafts, which
        use no randomness here (as in vLLM).
        What vLLM applies to the draft rows (penalties, allowed tokens, bad words, min_tokens,
        the thinking budget) is applied to ``target_logits``; the bonus tokens are vLLM's.
    validate : bool or None
        Passed to ``specdec_kernels.rejection_sample`` (value checks; synchronizes).
    spec_config : vLLM ``SpeculativeConfig`` or None
        Its ``rejection_sample_method`` picks the op's method ("standard" or "block"); FLy and
        synthetic acceptance raise ``ValueError`` (``vllm_logits.verification_method``).
    lenience : Tensor [B] or None
        Our extension (vLLM has no such field): per-request lenience in (0, 1], opt-in and NOT
        exact (docs/ALGORITHM.md §8, docs/INTEGRATION.md). None = exact for every request.

    Returns
    -------
    Tensor [B, max_spec_len + 1] int32
        Accepted drafts, then the recovered or bonus token, then ``PLACEHOLDER_TOKEN_ID`` (-1).
    """
    method = verification_method(spec_config)
    _check_supported(sampling_metadata)
    batch = len(num_draft_tokens)
    if target_logits.dim() != 2 or draft_token_ids.dim() != 1 or target_logits.shape[0] != draft_token_ids.shape[0]:
        raise ValueError(f"target_logits must be [N, V] with N = len(draft_token_ids) = {draft_token_ids.shape[0]}, "
                         f"got {tuple(target_logits.shape)}")
    bonus = bonus_token_ids.reshape(-1)
    if bonus.shape[0] != batch:
        raise ValueError(f"bonus_token_ids must have B = {batch} entries ([B, 1]), got {tuple(bonus_token_ids.shape)}")
    if cu_num_draft_tokens.shape != (batch,):
        raise ValueError(f"cu_num_draft_tokens must have shape ({batch},), got {tuple(cu_num_draft_tokens.shape)}")
    num_drafts, vocab = target_logits.shape
    device = target_logits.device
    cu = _exclusive_offsets(cu_num_draft_tokens)
    temperature = request_temperature(sampling_metadata, batch, device)

    requests = torch.arange(batch, device=device)
    request_of_draft = torch.repeat_interleave(requests, cu[1:] - cu[:-1], output_size=num_drafts)
    draft_logits = process_target_logits(target_logits, draft_token_ids, num_draft_tokens, sampling_metadata,
                                         bonus_rows=False, validate=bool(validate))

    # The op's layout: request b's draft rows at cu[b] + b + t, its bonus row at cu[b + 1] + b.
    logits = draft_logits.new_empty((num_drafts + batch, vocab))
    logits[torch.arange(num_drafts, device=device) + request_of_draft] = draft_logits
    point_mass = torch.arange(vocab, device=device)[None, :] == bonus.to(device)[:, None]
    logits[cu[1:] + requests] = torch.where(point_mass, 0.0, float("-inf")).to(logits.dtype)

    if getattr(sampling_metadata, "all_greedy", False):
        seeds = torch.zeros(batch, dtype=torch.int64, device=device)  # greedy draws no randomness
    else:
        seeds = request_seeds(getattr(sampling_metadata, "generators", None), batch, device,
                              skip=[b for b, n in enumerate(num_draft_tokens) if n == 0])
    output_token_ids, _ = _specdec_rejection_sample(
        logits, draft_token_ids, cu, draft_probs, temperature, seeds, None, int(max_spec_len), method,
        **request_filters(sampling_metadata, batch, device), validate=validate, lenience=lenience)
    return output_token_ids


class RejectionSampler(nn.Module):
    """vLLM V1's rejection sampler as one launch of ``torch.ops.specdec.rejection_sample``.

    Accepted drafts, recovered tokens and bonus tokens all come from the op, so the emitted
    tokens are exact samples of the target as vLLM processes it (penalties, allowed tokens, bad
    words, min_tokens, thinking budget; then temperature, top-k, top-p). Greedy and random
    requests mix; requests may have 0 drafts (they emit one token from their bonus row).

    Parameters
    ----------
    validate : bool or None
        Check the metadata against vLLM's layout and the op's inputs (synchronizes); None =
        $SPECDEC_VALIDATE == "1".
    spec_config : vLLM ``SpeculativeConfig`` or None
        Read once: ``rejection_sample_method`` "standard" (or None) verifies draft by draft,
        "block" jointly (both exact); FLy, synthetic acceptance and adaptive verification raise
        ``ValueError`` here (``vllm_logits.verification_method``).
    """

    def __init__(self, *, validate: bool | None = None, spec_config: Any = None):
        super().__init__()
        self.validate = validate
        self.method = verification_method(spec_config)

    def forward(self, metadata: Any, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                sampling_metadata: Any, *, lenience: torch.Tensor | None = None) -> torch.Tensor:
        """Verify every request's drafts and sample its final token.

        Parameters
        ----------
        metadata : vLLM ``SpecDecodeMetadata``
            Reads ``draft_token_ids`` [N], ``num_draft_tokens`` (list, length B),
            ``cu_num_draft_tokens`` [B] (inclusive) and ``max_spec_len``; with ``validate``
            also ``target_logits_indices`` and ``bonus_logits_indices``.
        draft_probs : Tensor [N, V] or None
        logits : Tensor [N + B, V] fp32 / bf16 / fp16
            vLLM's target logits at ``logits_indices``: request b's ``n_b`` draft rows, then its
            bonus row (``target_logits_indices`` / ``bonus_logits_indices`` describe exactly
            this layout, which is the op's). Raw logits; not modified (when vLLM's processing
            applies, a float32 copy is processed, as vLLM does).
        sampling_metadata : vLLM ``SamplingMetadata``
            Seeded requests advance their generator by one draw per call.
        lenience : Tensor [B] or None
            Our extension, not a vLLM argument: per-request lenience in (0, 1], opt-in and NOT
            exact (docs/ALGORITHM.md §8). None = exact.

        Returns
        -------
        Tensor [B, max_spec_len + 1] int32
            Accepted drafts, then the recovered or bonus token, then -1. In vLLM wrap it as
            ``SamplerOutput(sampled_token_ids=..., logprobs_tensors=None)``.
        """
        _check_supported(sampling_metadata)
        num_draft_tokens = metadata.num_draft_tokens
        batch = len(num_draft_tokens)
        draft_token_ids = metadata.draft_token_ids
        num_drafts = draft_token_ids.shape[0]
        if logits.dim() != 2 or logits.shape[0] != num_drafts + batch:
            raise ValueError(f"logits must be [N + B, V] = [{num_drafts + batch}, V] (draft rows and bonus "
                             f"rows), got {tuple(logits.shape)}")
        device = logits.device
        max_spec_len = getattr(metadata, "max_spec_len", None)
        if max_spec_len is None:
            max_spec_len = max(num_draft_tokens, default=0)
        cu = _exclusive_offsets(metadata.cu_num_draft_tokens)
        requests = torch.arange(batch, device=device)
        counts = cu[1:] - cu[:-1]
        if self.validate:
            self._check_layout(metadata, cu, requests, counts)
        temperature = request_temperature(sampling_metadata, batch, device)
        target_logits = process_target_logits(logits, draft_token_ids, num_draft_tokens, sampling_metadata,
                                              bonus_rows=True, validate=bool(self.validate))
        if getattr(sampling_metadata, "all_greedy", False):
            seeds = torch.zeros(batch, dtype=torch.int64, device=device)
        else:
            # Every request samples at least its final token here, so every seeded one advances.
            seeds = request_seeds(getattr(sampling_metadata, "generators", None), batch, device)
        output_token_ids, _ = _specdec_rejection_sample(
            target_logits, draft_token_ids, cu, draft_probs, temperature, seeds, None, int(max_spec_len),
            self.method, **request_filters(sampling_metadata, batch, device), validate=self.validate,
            lenience=lenience)
        return output_token_ids

    @staticmethod
    def _check_layout(metadata: Any, cu: torch.Tensor, requests: torch.Tensor, counts: torch.Tensor) -> None:
        """vLLM's indices must describe the op's layout (synchronizes)."""
        num_drafts = metadata.draft_token_ids.shape[0]
        if counts.tolist() != [int(n) for n in metadata.num_draft_tokens]:
            raise ValueError("metadata.cu_num_draft_tokens does not match metadata.num_draft_tokens")
        bonus_rows = cu[1:] + requests
        request_of_draft = torch.repeat_interleave(requests, counts, output_size=num_drafts)
        draft_rows = torch.arange(num_drafts, device=cu.device) + request_of_draft
        for name, expected in (("bonus_logits_indices", bonus_rows), ("target_logits_indices", draft_rows)):
            got = getattr(metadata, name, None)
            if got is not None and not torch.equal(got.to(expected.device, torch.int64), expected.to(torch.int64)):
                raise ValueError(f"metadata.{name} = {got.tolist()} does not follow the layout the op reads "
                                 f"(each request's draft rows, then its bonus row): expected {expected.tolist()}")
