"""Input checks for the verify ops.

``check_rejection_sample_inputs`` looks only at metadata (shape, dtype, device): it never
synchronizes with the device and runs on every call of the Python API.
``check_rejection_sample_contents`` reads the values (ids, offsets, temperatures, draft
probabilities, the ranges of top_k / top_p / min_p and lenience) and therefore synchronizes; it runs only
when asked (``validate=True`` or SPECDEC_VALIDATE=1). Errors name the argument and, for
contents, the offending request.
"""
from __future__ import annotations

import torch

from .tree_utils import check_tree

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, ndim: int, dtypes, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_names(dtypes)}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but target_logits is on {device}")


METHODS = ("token", "block")


def check_rejection_sample_inputs(
    target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature,
    seeds, offsets, max_spec_len, method="token", top_k=None, top_p=None, min_p=None, lenience=None,
) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "block" and lenience is not None:
        raise ValueError("lenience is not defined for method='block' (block verification has no lenient form "
                         "here): pass lenience=None, or method='token'")
    check_tensor("target_logits", target_logits, ndim=2, dtypes=LOGIT_DTYPES)
    device = target_logits.device
    num_rows, vocab = target_logits.shape
    if vocab < 1:
        raise ValueError("target_logits has an empty vocabulary dimension")
    check_tensor("draft_token_ids", draft_token_ids, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if cu_num_draft_tokens.shape[0] < 1:
        raise ValueError("cu_num_draft_tokens must have B + 1 >= 1 entries (a leading 0)")
    batch = cu_num_draft_tokens.shape[0] - 1
    num_drafts = draft_token_ids.shape[0]
    if num_rows != num_drafts + batch:
        raise ValueError(
            f"target_logits has {num_rows} rows but draft_token_ids has N = {num_drafts} and "
            f"cu_num_draft_tokens has B = {batch} requests: expected N + B = {num_drafts + batch} "
            "rows (each request's draft rows, then its bonus row)")
    _check_draft_probs(draft_probs, num_drafts, vocab, device)
    check_request_params(temperature, seeds, offsets, batch, device)
    _check_filters(top_k, top_p, min_p, batch, device)
    check_lenience(lenience, batch, device)
    check_width("max_spec_len", max_spec_len)


def _check_draft_probs(draft_probs, num_rows: int, vocab: int, device) -> None:
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, ndim=2, dtypes=LOGIT_DTYPES, device=device)
        if tuple(draft_probs.shape) != (num_rows, vocab):
            raise ValueError(
                f"draft_probs must have shape (N, V) = ({num_rows}, {vocab}), got {tuple(draft_probs.shape)}")


def check_request_params(temperature, seeds, offsets, batch: int, device) -> None:
    for name, t, dtypes in (("temperature", temperature, (torch.float32, torch.float64, torch.bfloat16, torch.float16)),
                            ("seeds", seeds, INDEX_DTYPES), ("offsets", offsets, INDEX_DTYPES)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=dtypes, device=device)
            if t.shape[0] != batch:
                raise ValueError(f"{name} must have shape (B,) = ({batch},), got {tuple(t.shape)}")


FLOAT_PARAM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_filters(top_k, top_p, min_p, batch: int, device) -> None:
    """Shapes, dtypes and devices of the sampling filters (their values: ``_check_filter_values``)."""
    for name, t, dtypes in (("top_k", top_k, INDEX_DTYPES), ("top_p", top_p, FLOAT_PARAM_DTYPES),
                            ("min_p", min_p, FLOAT_PARAM_DTYPES)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=dtypes, device=device)
            if t.shape[0] != batch:
                raise ValueError(f"{name} must have shape (B,) = ({batch},), got {tuple(t.shape)}")


def _check_filter_values(top_k, top_p, min_p) -> None:
    """Value ranges of the filters (synchronizes): top_k >= 0 (0 = off), 0 < top_p <= 1
    (1 = off), 0 <= min_p <= 1 (0 = off)."""
    checks = (
        ("top_k", top_k, lambda v: v >= 0, ">= 0 (0 = off)"),
        ("top_p", top_p, lambda v: (v > 0) & (v <= 1), "in (0, 1] (1 = off)"),
        ("min_p", min_p, lambda v: (v >= 0) & (v <= 1), "in [0, 1] (0 = off)"),
    )
    for name, t, ok, what in checks:
        if t is None:
            continue
        values = t.detach().to("cpu", torch.int64 if name == "top_k" else torch.float64)
        bad = torch.nonzero(~ok(values))
        if bad.numel():
            b = int(bad[0])
            value = int(values[b]) if name == "top_k" else float(values[b])
            raise ValueError(f"{name}[{b}] = {value} must be {what}")


def check_lenience(lenience, batch: int, device) -> None:
    """Shape, dtype and device of ``lenience`` ([B], floating; None = exact for every request)."""
    if lenience is not None:
        check_tensor("lenience", lenience, ndim=1, dtypes=FLOAT_PARAM_DTYPES, device=device)
        if lenience.shape[0] != batch:
            raise ValueError(f"lenience must have shape (B,) = ({batch},), got {tuple(lenience.shape)}")


def check_lenience_values(lenience) -> None:
    """Each request's lenience in (0, 1] (synchronizes); 1 = exact."""
    if lenience is None:
        return
    values = lenience.detach().to("cpu", torch.float64)
    bad = torch.nonzero(~((values > 0) & (values <= 1)))
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"lenience[{b}] = {float(values[b])} must be in (0, 1] (1 = exact)")


def check_width(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if value >= 1 << 24:  # node indices of the random streams have 24 bits (docs/ALGORITHM.md)
        raise ValueError(f"{name} must be < 2^24, got {value}")


def check_tree_rejection_sample_inputs(
    target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature, seeds, offsets, max_depth,
    top_k=None, top_p=None, min_p=None, lenience=None,
) -> None:
    check_tensor("target_logits", target_logits, ndim=2, dtypes=LOGIT_DTYPES)
    device = target_logits.device
    num_nodes, vocab = target_logits.shape
    if vocab < 1:
        raise ValueError("target_logits has an empty vocabulary dimension")
    for name, t in (("tokens", tokens), ("parents", parents)):
        check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, device=device)
        if t.shape[0] != num_nodes:
            raise ValueError(f"{name} must have one entry per node (target_logits row): shape ({num_nodes},), "
                             f"got {tuple(t.shape)}")
    check_tensor("cu_num_nodes", cu_num_nodes, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if cu_num_nodes.shape[0] < 1:
        raise ValueError("cu_num_nodes must have B + 1 >= 1 entries (a leading 0)")
    batch = cu_num_nodes.shape[0] - 1
    _check_draft_probs(draft_probs, num_nodes, vocab, device)
    check_request_params(temperature, seeds, offsets, batch, device)
    _check_filters(top_k, top_p, min_p, batch, device)
    check_lenience(lenience, batch, device)
    check_width("max_depth", max_depth)


def check_rejection_sample_contents(
    target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature, max_spec_len,
    top_k=None, top_p=None, min_p=None, lenience=None,
) -> None:
    """Value checks (synchronizes). Call after ``check_rejection_sample_inputs``."""
    vocab = target_logits.shape[1]
    num_drafts = draft_token_ids.shape[0]
    cu = cu_num_draft_tokens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_num_draft_tokens[0] must be 0, got {int(cu[0])}")
    counts = cu[1:] - cu[:-1]
    bad = torch.nonzero(counts < 0)
    if bad.numel():
        b = int(bad[0])
        raise ValueError(
            f"cu_num_draft_tokens must be non-decreasing: request {b} has "
            f"cu[{b + 1}] = {int(cu[b + 1])} < cu[{b}] = {int(cu[b])}")
    if int(cu[-1]) != num_drafts:
        raise ValueError(
            f"cu_num_draft_tokens[-1] = {int(cu[-1])} must equal the number of drafts N = {num_drafts}")
    bad = torch.nonzero(counts > max_spec_len)
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"request {b} has {int(counts[b])} drafts, more than max_spec_len = {max_spec_len}")
    ids = draft_token_ids.detach().to("cpu", torch.int64)
    bad = torch.nonzero((ids < 0) | (ids >= vocab))
    if bad.numel():
        i = int(bad[0])
        b = int(torch.searchsorted(cu, torch.tensor(i), right=True)) - 1
        raise ValueError(
            f"draft_token_ids[{i}] = {int(ids[i])} (request {b}) is outside the vocabulary [0, {vocab})")
    _check_values(temperature, draft_probs, cu)
    _check_filter_values(top_k, top_p, min_p)
    check_lenience_values(lenience)


def check_tree_rejection_sample_contents(
    target_logits, tokens, parents, cu_num_nodes, draft_probs, temperature, max_depth,
    top_k=None, top_p=None, min_p=None, lenience=None,
) -> None:
    """Value checks of the tree op (synchronizes). Call after the metadata checks."""

    check_tree(parents, tokens, cu_num_nodes, vocab_size=target_logits.shape[1],
               deterministic=draft_probs is None, max_depth=max_depth)
    _check_values(temperature, draft_probs, cu_num_nodes.detach().to("cpu", torch.int64))
    _check_filter_values(top_k, top_p, min_p)
    check_lenience_values(lenience)


def _check_values(temperature, draft_probs, cu) -> None:
    if temperature is not None:
        temp = temperature.detach().to("cpu", torch.float64)
        bad = torch.nonzero(~torch.isfinite(temp) | (temp < 0))
        if bad.numel():
            b = int(bad[0])
            raise ValueError(f"temperature[{b}] = {float(temp[b])} must be finite and >= 0 (0 = greedy)")
    if draft_probs is not None and draft_probs.shape[0]:
        probs = draft_probs.detach()
        bad_rows = (~torch.isfinite(probs) | (probs < 0)).any(-1).nonzero()
        if bad_rows.numel():
            i = int(bad_rows[0])
            b = int(torch.searchsorted(cu, torch.tensor(i), right=True)) - 1
            raise ValueError(f"draft_probs row {i} (request {b}) has a negative or non-finite probability")
        # Exactness needs the draft's own distribution: rows must sum to 1 (bf16 rounding allowed).
        sums = probs.float().sum(-1)
        bad_rows = ((sums - 1).abs() > 1e-2).nonzero()
        if bad_rows.numel():
            i = int(bad_rows[0])
            b = int(torch.searchsorted(cu, torch.tensor(i), right=True)) - 1
            raise ValueError(f"draft_probs row {i} (request {b}) sums to {float(sums[i]):.4f}, not 1: pass the "
                             "normalized distribution the draft was sampled from")
