"""What vLLM V1 does to the target logits before verification, for the vLLM adapter.

``specdec_kernels.integrations.vllm`` hands the target logits to the op, which applies the
temperature, top-k and top-p itself. Everything vLLM applies *before* those is applied here,
in one pass over a float32 copy of the rows (vLLM also works in float32), in vLLM's order:

- the draft rows (vLLM's ``RejectionSampler.apply_logits_processors``): presence / frequency /
  repetition penalties, the allowed-token mask, bad words, then the non-argmax-invariant
  logits processors that have a speculative-decoding hook (``apply_with_spec_decode``:
  min_tokens, and any processor that opts in), then the thinking-token budget;
- the bonus rows (vLLM's ``Sampler`` called with ``predict_bonus_token=True``, which runs
  before the draft rows in vLLM): the allowed-token mask, bad words, the non-argmax-invariant
  processors (``apply``), penalties, then the thinking-token budget (``update_state`` and
  ``apply_to_logits``).

The history a row sees is the request's output so far plus its drafts before the row's
position (the bonus row: all drafts), for penalties and bad words alike. The repetition
penalty also covers the prompt tokens.

What vLLM applies that cannot be applied here is named by ``unsupported`` (and the adapter
raises): logprobs, argmax-invariant logits processors in a batch with random requests (vLLM
applies them after the temperature, inside what the op fuses), non-argmax-invariant
processors without a speculative-decoding hook, lossy or synthetic verification methods, and
any metadata field this module does not know. Nothing is ignored silently; the field tables
below say how each field is treated.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import torch

# How each field of vLLM's metadata objects is treated. "honoured": applied exactly as vLLM
# does (a behavioural test in python_tests/test_vllm_adapter.py); "reported": named by
# ``unsupported`` when set, and the adapter raises; "inert": does not change the sampled tokens
# (layout, bookkeeping, or a setting of another part of the engine), with the reason.
HONOURED, REPORTED, INERT = "honoured", "reported", "inert"

SAMPLING_METADATA_FIELDS: dict[str, tuple[str, str]] = {
    "temperature": (HONOURED, "per-request temperature, passed to the op (0 or -1 = greedy)"),
    "all_greedy": (HONOURED, "greedy batch: no seeds drawn, argmax-invariant processors skipped as in vLLM"),
    "all_random": (INERT, "a flag vLLM derives from temperature; the op reads the temperatures"),
    "top_p": (HONOURED, "passed to the op"),
    "top_k": (HONOURED, "passed to the op"),
    "generators": (HONOURED, "seeded requests draw their Philox seed from their generator"),
    "max_num_logprobs": (REPORTED, "logprobs are not computed"),
    "logprob_token_ids": (REPORTED, "logprobs are not computed"),
    "logprobs_mode_override": (INERT, "only changes logprobs, which are reported when asked for"),
    "no_penalties": (HONOURED, "penalties applied when False"),
    "prompt_token_ids": (HONOURED, "repetition penalty over the prompt"),
    "frequency_penalties": (HONOURED, "penalties"),
    "presence_penalties": (HONOURED, "penalties"),
    "repetition_penalties": (HONOURED, "penalties"),
    "output_token_ids": (HONOURED, "the history of penalties and bad words"),
    "allowed_token_ids_mask": (HONOURED, "masked tokens get -inf on every row"),
    "bad_words_token_ids": (HONOURED, "bad words on every row"),
    "logitsprocs": (HONOURED, "non-argmax-invariant processors with a speculative-decoding hook are "
                              "applied; other active processors are reported"),
    "spec_token_ids": (HONOURED, "passed to the thinking-budget holder as vLLM does; with validate, "
                                 "checked against draft_token_ids"),
    "thinking_budget_state_holder": (HONOURED, "applied to draft and bonus rows as vLLM does"),
}

SPEC_DECODE_METADATA_FIELDS: dict[str, tuple[str, str]] = {
    "draft_token_ids": (HONOURED, "the drafts"),
    "num_draft_tokens": (HONOURED, "drafts per request (host list)"),
    "cu_num_draft_tokens": (HONOURED, "inclusive offsets; the op gets them with a leading 0"),
    "max_spec_len": (HONOURED, "output width - 1"),
    "target_logits_indices": (HONOURED, "must describe the op's layout (checked with validate)"),
    "bonus_logits_indices": (HONOURED, "must describe the op's layout (checked with validate)"),
    "cu_num_sampled_tokens": (INERT, "the same layout as cu_num_draft_tokens + 1 per request"),
    "logits_indices": (INERT, "where the runner computed the logits; the adapter gets them computed"),
}

# The verification settings of vLLM's SpeculativeConfig (the other fields configure the drafter).
SPECULATIVE_CONFIG_FIELDS: dict[str, tuple[str, str]] = {
    "rejection_sample_method": (HONOURED, "'standard' -> the op's token method, 'block' -> its block "
                                          "method; 'fly' and 'synthetic' raise"),
    "synthetic_acceptance_rates": (REPORTED, "synthetic acceptance (a benchmarking mode) raises"),
    "synthetic_acceptance_length": (REPORTED, "synthetic acceptance (a benchmarking mode) raises"),
    "fly_window_size": (REPORTED, "FLy (lossy) raises"),
    "fly_entropy_threshold": (REPORTED, "FLy (lossy) raises"),
    "fly_entropy_top_k": (REPORTED, "FLy (lossy) raises"),
    "enable_fly_verify": (REPORTED, "FLy (lossy) raises"),
    "enable_adaptive_verification": (REPORTED, "device-side trimming of the drafts (model runner V2) raises"),
}

# rejection_sample_method -> the op's method. All of these keep the target's distribution
# exactly; "strict" / "probabilistic" are model runner V2's names of exact token-level methods.
EXACT_METHODS = {None: "token", "standard": "token", "strict": "token", "probabilistic": "token",
                 "block": "block"}
LOSSY_METHODS = {
    "fly": "FLy (a lossy method: a rejected draft is kept when the target's entropy there passes "
           "a threshold and the next window of drafts would be accepted)",
    "synthetic": "synthetic acceptance (a benchmarking mode that accepts drafts at fixed rates, not "
                 "by the target's distribution)",
}
_LENIENCE_HINT = ("specdec_kernels verifies exactly (the emitted tokens follow the target's "
                  "distribution: rejection_sample_method 'standard' or 'block'); a bounded, opt-in "
                  "relaxation is offered separately, per request, through the adapter's `lenience` "
                  "argument (docs/INTEGRATION.md)")

# vLLM's builtin processors and the attribute that says whether any request uses them.
_BUILTIN_STATE = {"MinTokensLogitsProcessor": "min_toks", "LogitBiasLogitsProcessor": "biases",
                  "MinPLogitsProcessor": "min_p_count"}
_MIN_TOKENS = "MinTokensLogitsProcessor"


def verification_method(spec_config: Any) -> str:
    """The op's ``method`` for vLLM's ``SpeculativeConfig`` (duck-typed; None = default).

    Raises
    ------
    ValueError
        For FLy, synthetic acceptance, adaptive verification, or an unknown method: named, and
        pointing at the exact methods and the per-request ``lenience`` option.
    """
    if spec_config is None:
        return "token"
    method = getattr(spec_config, "rejection_sample_method", None)
    if method in LOSSY_METHODS:
        raise ValueError(f"speculative_config.rejection_sample_method = {method!r}: "
                         f"{LOSSY_METHODS[method]} is not implemented by specdec_kernels' vLLM "
                         f"adapter. {_LENIENCE_HINT}.")
    fly = [name for name in ("fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k", "enable_fly_verify")
           if _is_set(getattr(spec_config, name, None))]
    if fly:
        raise ValueError(f"speculative_config sets {', '.join(fly)}: FLy verification (lossy) is not "
                         f"implemented by specdec_kernels' vLLM adapter. {_LENIENCE_HINT}.")
    synthetic = [name for name in ("synthetic_acceptance_rates", "synthetic_acceptance_length")
                 if _is_set(getattr(spec_config, name, None))]
    if synthetic:
        raise ValueError(f"speculative_config sets {', '.join(synthetic)}: {LOSSY_METHODS['synthetic']} is "
                         f"not implemented by specdec_kernels' vLLM adapter. {_LENIENCE_HINT}.")
    if _is_set(getattr(spec_config, "enable_adaptive_verification", None)):
        raise ValueError("speculative_config.enable_adaptive_verification is set: it trims the drafts on the "
                         "device after the metadata was built (model runner V2), which this adapter does not "
                         "support; set it to False")
    if method not in EXACT_METHODS:
        raise ValueError(f"speculative_config.rejection_sample_method = {method!r} is unknown to specdec_kernels' "
                         f"vLLM adapter (exact methods: 'standard', 'block'; lossy ones raise). {_LENIENCE_HINT}.")
    return EXACT_METHODS[method]


def _is_set(value: Any) -> bool:
    """A metadata value that asks for something: not None / False / 0 / empty."""
    if value is None or value is False:
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    if isinstance(value, (int, float)):
        return value != 0
    if hasattr(value, "__len__"):
        return len(value) > 0
    return True


def _field_names(obj: Any) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return list(vars(obj)) if hasattr(obj, "__dict__") else []


def _processors(sampling_metadata: Any, kind: str) -> list:
    procs = getattr(sampling_metadata, "logitsprocs", None)
    return list(getattr(procs, kind, None) or ()) if procs is not None else []


def processor_active(processor: Any) -> bool:
    """Whether a vLLM logits processor does anything this step. vLLM's builtins say so by their
    state (an empty one means no request uses them); any other processor counts as active."""
    state = _BUILTIN_STATE.get(type(processor).__name__)
    if state is not None and hasattr(processor, state):
        return bool(getattr(processor, state))
    return True


def has_spec_decode_hook(processor: Any) -> bool:
    """vLLM applies a non-argmax-invariant processor to the draft rows through
    ``apply_with_spec_decode``: min_tokens always, others when ``supports_spec_decode()``."""
    if not callable(getattr(processor, "apply_with_spec_decode", None)):
        return False
    if type(processor).__name__ == _MIN_TOKENS:
        return True
    supports = getattr(type(processor), "supports_spec_decode", None)
    return bool(supports()) if callable(supports) else False


def _thinking_holder(sampling_metadata: Any):
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    return holder if holder is not None and holder.has_tracked_requests() else None


def unsupported(sampling_metadata: Any) -> list[str]:
    """The features a batch asks for that the adapter cannot apply as vLLM does (one line each)."""
    missing = []
    if getattr(sampling_metadata, "max_num_logprobs", None) is not None:
        missing.append("logprobs (sampling_metadata.max_num_logprobs is set)")
    if _is_set(getattr(sampling_metadata, "logprob_token_ids", None)):
        missing.append("logprobs of given tokens (sampling_metadata.logprob_token_ids is set)")
    for proc in _processors(sampling_metadata, "non_argmax_invariant"):
        if processor_active(proc) and not has_spec_decode_hook(proc):
            missing.append(f"logits processor {type(proc).__name__} (non-argmax-invariant, active, and without "
                           "a speculative-decoding hook `apply_with_spec_decode` / `supports_spec_decode()`: "
                           "it cannot be applied to the draft rows)")
    if not getattr(sampling_metadata, "all_greedy", False):
        for proc in _processors(sampling_metadata, "argmax_invariant"):
            if processor_active(proc):
                missing.append(f"logits processor {type(proc).__name__} (argmax-invariant, active: vLLM applies "
                               "it after the temperature and before top-k / top-p, inside what the op fuses)")
    for name in _field_names(sampling_metadata):
        if name not in SAMPLING_METADATA_FIELDS and _is_set(getattr(sampling_metadata, name)):
            missing.append(f"sampling_metadata.{name} (a field this adapter does not know is set)")
    return missing


def needs_processing(sampling_metadata: Any) -> bool:
    """Whether anything applies to the target rows before the op (else the logits go as they are)."""
    procs = [p for p in _processors(sampling_metadata, "non_argmax_invariant") if processor_active(p)]
    return bool(not getattr(sampling_metadata, "no_penalties", True)
                or getattr(sampling_metadata, "allowed_token_ids_mask", None) is not None
                or getattr(sampling_metadata, "bad_words_token_ids", None)
                or procs or _thinking_holder(sampling_metadata) is not None)


@dataclasses.dataclass
class _Rows:
    """A set of rows of one request each: ``request[r]`` and the number of its drafts that come
    before the row (``position[r]``: the draft index, or all drafts for a bonus row)."""
    request: torch.Tensor
    position: torch.Tensor


class _History:
    """Each request's output so far and its drafts, as padded device tensors (pad = V)."""

    def __init__(self, sampling_metadata: Any, draft_token_ids: torch.Tensor, draft_request: torch.Tensor,
                 draft_position: torch.Tensor, batch: int, max_drafts: int, vocab: int, device: torch.device):
        outputs = getattr(sampling_metadata, "output_token_ids", None)
        if outputs is None or len(outputs) < batch:
            raise ValueError(f"sampling_metadata.output_token_ids must list the output tokens of all {batch} "
                             f"requests (penalties and bad words read them), got "
                             f"{None if outputs is None else len(outputs)} lists")
        self.vocab = vocab
        outputs = outputs[:batch]
        self.lengths = [len(o) for o in outputs]
        width = max(self.lengths, default=0)
        padded = torch.full((batch, max(width, 1)), vocab, dtype=torch.int64)
        if width:
            flat = torch.tensor([t for o in outputs for t in o], dtype=torch.int64)
            lengths = torch.tensor(self.lengths, dtype=torch.int64)
            rows = torch.repeat_interleave(torch.arange(batch), lengths)
            cols = torch.arange(flat.numel()) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
            bad = (flat < -1) | (flat >= vocab)
            if bool(bad.any()):
                raise ValueError(f"sampling_metadata.output_token_ids holds ids outside [0, {vocab}) "
                                 f"(-1 placeholders allowed): {flat[bad][:5].tolist()}")
            # -1: vLLM's placeholder under async scheduling, counted as nothing (as vLLM does).
            padded[rows, cols] = torch.where(flat == -1, vocab, flat)
        self.output = padded.to(device, non_blocking=True)            # [B, width]
        drafts = torch.full((batch, max(max_drafts, 1)), vocab, dtype=torch.int64, device=device)
        ids = draft_token_ids.to(torch.int64)
        # An id outside [0, V) never matches a token (the op never accepts it either).
        drafts[draft_request, draft_position] = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
        self.drafts = drafts                                           # [B, max(K, 1)]

    def tokens(self, rows: _Rows) -> torch.Tensor:
        """[R, width + K]: the output tokens of each row's request, then its drafts before the row."""
        drafts = self.drafts[rows.request]
        before = torch.arange(drafts.shape[1], device=drafts.device)[None, :] < rows.position[:, None]
        return torch.cat([self.output[rows.request], torch.where(before, drafts, self.vocab)], dim=1)


def _apply_penalties(logits: torch.Tensor, sampling_metadata: Any, history: _History, rows: _Rows,
                     validate: bool) -> None:
    """vLLM's penalties, in place: repetition (tokens of the prompt or the history), then
    frequency (times each token occurred in the history), then presence."""
    count, vocab = logits.shape
    device = logits.device
    prompt = getattr(sampling_metadata, "prompt_token_ids", None)
    if prompt is None:
        raise ValueError("sampling_metadata.prompt_token_ids is None but no_penalties is False: the repetition "
                         "penalty needs the prompts ([B, P], padded with the vocabulary size)")
    prompt = prompt.to(device=device, dtype=torch.int64)
    if validate and prompt.numel() and bool(((prompt < 0) | (prompt > vocab)).any()):
        raise ValueError(f"sampling_metadata.prompt_token_ids must hold ids in [0, {vocab}] ({vocab} = padding)")
    counts = torch.zeros((count, vocab + 1), dtype=torch.int32, device=device)
    tokens = history.tokens(rows)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.int32))
    counts = counts[:, :vocab]
    seen = counts > 0
    in_prompt = torch.zeros((count, vocab + 1), dtype=torch.bool, device=device)
    in_prompt.scatter_(1, prompt[rows.request], True)
    penalty_of = {}
    for name in ("repetition_penalties", "frequency_penalties", "presence_penalties"):
        value = getattr(sampling_metadata, name)
        penalty_of[name] = value.to(device=device, dtype=torch.float32)[rows.request][:, None]
    repetition = torch.where(in_prompt[:, :vocab] | seen, penalty_of["repetition_penalties"], 1.0)
    # Positive logits are divided by the penalty, the others multiplied (vLLM's definition).
    logits.mul_(torch.where(logits > 0, 1.0 / repetition, repetition))
    logits.sub_(penalty_of["frequency_penalties"] * counts)
    logits.sub_(penalty_of["presence_penalties"] * seen)


def _apply_allowed(logits: torch.Tensor, sampling_metadata: Any, rows: _Rows) -> None:
    mask = getattr(sampling_metadata, "allowed_token_ids_mask", None)
    if mask is not None:
        # vLLM's mask is [max batch, V], True = not allowed; it binds greedy requests too.
        logits.masked_fill_(mask.to(logits.device)[rows.request], float("-inf"))


def _apply_bad_words(logits: torch.Tensor, sampling_metadata: Any, history: _History, rows: _Rows,
                     rows_of_request: Sequence[Sequence[int]]) -> None:
    """vLLM's bad words, in place: a word's last token gets -inf on a row whose history ends with
    the rest of the word (a one-token word is banned everywhere)."""
    words_of = getattr(sampling_metadata, "bad_words_token_ids", None) or {}
    vocab = history.vocab
    device = logits.device
    # The (row, word) pairs to test, from the host lists (a few per request with bad words).
    pair_row, pair_word, lengths, last, prefixes = [], [], [], [], []
    for request in sorted(words_of):
        if not 0 <= request < len(rows_of_request):
            raise ValueError(f"sampling_metadata.bad_words_token_ids has request index {request}, outside "
                             f"[0, {len(rows_of_request)})")
        for word in words_of[request]:
            word = list(word)
            if not word or any(not 0 <= t < vocab for t in word):
                raise ValueError(f"sampling_metadata.bad_words_token_ids[{request}] has the word {word}: words "
                                 f"must be non-empty, with ids in [0, {vocab})")
            index = len(lengths)
            lengths.append(len(word))
            last.append(word[-1])
            prefixes.append(word[:-1])
            for row in rows_of_request[request]:
                pair_row.append(row)
                pair_word.append(index)
    if not pair_row:
        return
    width = max(lengths) - 1                  # the longest prefix: the history tail to compare
    table = torch.full((len(lengths), max(width, 1)), -1, dtype=torch.int64)   # right-aligned, -1 = any
    for index, prefix in enumerate(prefixes):
        if prefix:
            table[index, width - len(prefix):] = torch.tensor(prefix, dtype=torch.int64)
    pair_row_t = torch.tensor(pair_row, dtype=torch.int64).to(device, non_blocking=True)
    pair_word_t = torch.tensor(pair_word, dtype=torch.int64).to(device, non_blocking=True)
    table = table.to(device, non_blocking=True)
    word_len = torch.tensor(lengths, dtype=torch.int64).to(device, non_blocking=True)
    word_last = torch.tensor(last, dtype=torch.int64).to(device, non_blocking=True)
    request = rows.request[pair_row_t]
    position = rows.position[pair_row_t]
    output_len = torch.tensor(history.lengths, dtype=torch.int64).to(device, non_blocking=True)[request]
    match = output_len + position >= word_len[pair_word_t] - 1       # the history is long enough
    if width:
        # Slot i of the tail is history index len - width + i: a draft when that is past the
        # output (draft index position - width + i), else an output token (or nothing before 0).
        slot = torch.arange(width, device=device)[None, :]
        draft_index = position[:, None] - width + slot
        out_index = output_len[:, None] - width + position[:, None] + slot
        from_draft = history.drafts[request[:, None], draft_index.clamp(min=0)]
        from_output = history.output[request[:, None], out_index.clamp(min=0, max=history.output.shape[1] - 1)]
        tail = torch.where(draft_index >= 0, from_draft, torch.where(out_index >= 0, from_output, -2))
        expected = table[pair_word_t]
        match &= ((expected == -1) | (tail == expected)).all(dim=1)
    # A row may ban the same token through several words: count the bans, then mask once.
    banned = torch.zeros(logits.shape, dtype=torch.int32, device=device)
    banned.index_put_((pair_row_t, word_last[pair_word_t]), match.to(torch.int32), accumulate=True)
    logits.masked_fill_(banned > 0, float("-inf"))


def process_target_logits(logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int],
                          sampling_metadata: Any, *, bonus_rows: bool, validate: bool = False) -> torch.Tensor:
    """Apply what vLLM applies to the target rows before the temperature.

    Parameters
    ----------
    logits : Tensor [N + B, V] (``bonus_rows``: the op's layout) or [N, V] (draft rows only)
        Not modified.
    draft_token_ids : Tensor [N]
    num_draft_tokens : sequence of int, length B
    sampling_metadata : vLLM ``SamplingMetadata``
    bonus_rows : bool
        Whether ``logits`` holds each request's bonus row after its draft rows.
    validate : bool
        Also check values that need a synchronization (prompt ids, spec_token_ids).

    Returns
    -------
    Tensor
        ``logits`` itself when nothing applies, else a float32 tensor of the same shape.
    """
    if not needs_processing(sampling_metadata):
        return logits
    counts_list = [int(n) for n in num_draft_tokens]
    batch, num_drafts = len(counts_list), sum(counts_list)
    vocab = logits.shape[1]
    device = logits.device
    if logits.shape[0] != num_drafts + (batch if bonus_rows else 0):
        raise ValueError(f"logits has {logits.shape[0]} rows, expected {num_drafts + (batch if bonus_rows else 0)}")
    if validate:
        _check_spec_token_ids(sampling_metadata, draft_token_ids, counts_list)
    counts = torch.tensor(counts_list, dtype=torch.int64).to(device, non_blocking=True)
    requests = torch.arange(batch, device=device)
    draft_request = torch.repeat_interleave(requests, counts, output_size=num_drafts)
    starts = counts.cumsum(0) - counts
    draft_position = torch.arange(num_drafts, device=device) - starts[draft_request]
    draft_rows = _Rows(draft_request, draft_position)
    bonus = _Rows(requests, counts)

    penalties = not getattr(sampling_metadata, "no_penalties", True)
    bad_words = bool(getattr(sampling_metadata, "bad_words_token_ids", None))
    procs = [p for p in _processors(sampling_metadata, "non_argmax_invariant") if processor_active(p)]
    holder = _thinking_holder(sampling_metadata)
    spec_token_ids = getattr(sampling_metadata, "spec_token_ids", None)
    history = None
    if penalties or bad_words:
        history = _History(sampling_metadata, draft_token_ids, draft_request, draft_position, batch,
                           max(counts_list, default=0), vocab, device)
    if bad_words:
        # Rows of each request in the draft tensor and in the bonus tensor (host-side, for the pairs).
        first = list(itertools.accumulate(counts_list, initial=0))
        draft_rows_of = [range(first[b], first[b + 1]) for b in range(batch)]
        bonus_rows_of = [(b,) for b in range(batch)]

    if bonus_rows:
        layout_draft = torch.arange(num_drafts, device=device) + draft_request
        layout_bonus = counts.cumsum(0) + requests
        draft = logits[layout_draft].float()
        # vLLM's Sampler on the bonus rows (it runs before the draft rows' pass).
        final = logits[layout_bonus].float()
        _apply_allowed(final, sampling_metadata, bonus)
        if bad_words:
            _apply_bad_words(final, sampling_metadata, history, bonus, bonus_rows_of)
        for proc in procs:
            final = proc.apply(final)
        if penalties:
            _apply_penalties(final, sampling_metadata, history, bonus, validate)
        if holder is not None:
            holder.update_state(getattr(sampling_metadata, "output_token_ids", None), spec_token_ids,
                                repeat_indices=None)
            final = holder.apply_to_logits(final, predict_bonus_token=True, spec_token_ids=spec_token_ids)
    else:
        draft = logits.float() if logits.dtype != torch.float32 else logits.clone()

    # vLLM's RejectionSampler.apply_logits_processors on the draft rows.
    if num_drafts:
        if penalties:
            _apply_penalties(draft, sampling_metadata, history, draft_rows, validate)
        _apply_allowed(draft, sampling_metadata, draft_rows)
        if bad_words:
            _apply_bad_words(draft, sampling_metadata, history, draft_rows, draft_rows_of)
        for proc in procs:
            draft = proc.apply_with_spec_decode(draft, counts_list)
        if holder is not None:
            draft = holder.apply_to_logits(draft, predict_bonus_token=False, spec_token_ids=spec_token_ids)

    if not bonus_rows:
        return draft
    out = torch.empty((num_drafts + batch, vocab), dtype=torch.float32, device=device)
    out[layout_draft] = draft
    out[layout_bonus] = final
    return out


def _check_spec_token_ids(sampling_metadata: Any, draft_token_ids: torch.Tensor, counts: list[int]) -> None:
    spec = getattr(sampling_metadata, "spec_token_ids", None)
    if spec is None:
        return
    drafts = draft_token_ids.tolist()
    expected, start = [], 0
    for n in counts:
        expected.append(drafts[start:start + n])
        start += n
    got = [list(s) for s in spec[:len(counts)]]
    if len(spec) < len(counts) or got != expected:
        raise ValueError(f"sampling_metadata.spec_token_ids = {got} does not match the drafts of "
                         f"draft_token_ids per request: {expected}")
