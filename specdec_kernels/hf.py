"""Speculative generation with Hugging Face causal LMs, verified by ``specdec_kernels``.

Chain mode: a drafter proposes up to K tokens per request, the target scores them, and one
call of ``specdec_kernels.rejection_sample`` verifies every request of the batch at once.
The emitted tokens are distributed exactly as the target's own sampling (temperature, top-k,
top-p), and equal its greedy decoding at temperature 0.

Design (the simplest that is exactly correct with transformers' cache API):

- **One KV cache per request and model, batch-1 forwards** (``CachedCausalLM``). Prompts
  of different lengths and different accepted lengths then need no padding, attention masks
  or cache re-alignment; position ids are passed explicitly (``cached tokens + i``). The
  verify step is batched over all requests (one op call per step).
- **Rollback.** A forward feeds the committed tokens the cache does not hold yet, plus the
  drafts. After verification each cache is cropped (``Cache.crop(-n)``) back to a prefix of
  the committed tokens, so it never holds a rejected token. The target keeps exactly the
  committed tokens but the newest one (whose logits nobody has computed yet: it is the first
  input of the next forward); a model drafter keeps the same, or one token less after a fully
  accepted chain (it never ran its last draft).
- **Seeds.** Each request owns a ``torch.Generator``: it draws the request's draft tokens and
  one int64 per step that seeds the op's Philox streams for that request (offsets stay 0,
  as seeds are fresh every step). Same generator seeds => same tokens, whatever the batch.
- **top-k / top-p** are applied to the draft's logits before it samples (the draft hands
  over those standardized probabilities) and to the target's logits before the op
  (``specdec_kernels.sampling_filters.apply_top_k_top_p``: one sort per row until the op
  fuses it, #6). The target distribution is then exactly HF's temperature -> top-k -> top-p
  (ties with the k-th token, or with the token crossing p, are kept).
- **Drafters** plug in through the small ``Drafter`` interface (``propose`` / ``commit`` /
  ``release``): ``ModelDrafter`` (a smaller HF model) and ``PromptLookupDrafter`` (n-gram
  matches in the request's own tokens, deterministic drafts) are provided. The engine loop
  only sees ``DraftChain`` proposals; tree drafters will return trees verified by the tree
  op, next to ``_verify_chains``.

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

from .chain import rejection_sample
from .sampling_filters import apply_top_k_top_p

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


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
    """An HF causal LM with one KV cache per request (batch-1 forwards) and rollback.

    Parameters
    ----------
    model : transformers ``PreTrainedModel`` (a causal LM)
        Used as it is (eval mode, no gradients are taken). Its cache must be croppable
        (attention layers; not linear-attention / state-space layers).
    """

    def __init__(self, model):
        self.model = model
        parameters = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values -> cache and num_logits_to_keep -> logits_to_keep.
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._logits_kwarg = next(
            (name for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), None)
        self._cache_takes_config = "config" in inspect.signature(DynamicCache.__init__).parameters
        self._caches: dict[int, object] = {}
        self._num_cached: dict[int, int] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def num_cached(self, request: int) -> int:
        """How many tokens of ``request`` the cache holds (always a prefix of its committed tokens
        after ``rollback``)."""
        return self._num_cached.get(request, 0)

    def cache(self, request: int):
        """The ``DynamicCache`` of ``request`` (None before its first forward)."""
        return self._caches.get(request)

    def _new_cache(self):
        cache = DynamicCache(config=self.model.config) if self._cache_takes_config else DynamicCache()
        if getattr(cache, "is_croppable", True) is False:
            raise ValueError(f"{type(self.model).__name__}'s cache cannot be cropped, so rejected drafts "
                             "cannot be rolled back: speculative decoding needs attention-only caches")
        if hasattr(cache, "activate_past_recording"):
            # Sliding-window layers (transformers >= 5) keep the states needed to crop.
            cache.activate_past_recording()
        return cache

    @torch.no_grad()
    def forward(self, request: int, input_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Feed ``input_ids`` [n] after the cached tokens; return the last ``num_logits`` logits rows.

        Row i of the result predicts the token after input ``n - num_logits + i``.
        """
        cache = self._caches.get(request)
        if cache is None:
            cache = self._caches[request] = self._new_cache()
        start = self._num_cached.get(request, 0)
        num_new = input_ids.shape[0]
        positions = torch.arange(start, start + num_new, device=input_ids.device)[None, :]
        kwargs = {self._cache_kwarg: cache, "use_cache": True, "position_ids": positions}
        if self._logits_kwarg is not None:
            kwargs[self._logits_kwarg] = num_logits
        logits = self.model(input_ids=input_ids[None, :], **kwargs).logits[0, -num_logits:]
        self._num_cached[request] = start + num_new
        if cache.get_seq_length() != start + num_new:
            raise RuntimeError(f"{type(self.model).__name__} did not extend the cache it was given "
                               f"({cache.get_seq_length()} tokens cached, expected {start + num_new})")
        return logits

    def rollback(self, request: int, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` cached tokens of ``request`` (crop the others)."""
        cache = self._caches.get(request)
        cached = self._num_cached.get(request, 0)
        if cache is None:
            return
        if num_tokens < cached:
            cache.crop(-(cached - num_tokens))  # negative = tokens to remove, in transformers 4.x and 5.x
            self._num_cached[request] = num_tokens
        elif hasattr(cache, "activate_past_recording"):
            cache.crop(0)  # transformers >= 5: trims sliding-window layers back to their window

    def release(self, request: int) -> None:
        """Free the cache of a finished request."""
        self._caches.pop(request, None)
        self._num_cached.pop(request, None)


@dataclass
class DraftChain:
    """A chain proposal for one request.

    ``tokens`` [n] int64 on the target's device (n may be 0); ``probs`` [n, V] float32: row j
    is the standardized distribution ``tokens[j]`` was sampled from, or None for deterministic
    drafts (argmax, n-gram lookups: point masses).
    """
    tokens: torch.Tensor
    probs: torch.Tensor | None = None


class Drafter(abc.ABC):
    """What the engine loop needs from a drafter (chain mode).

    Each call concerns one request, identified by an index that stays the same for its whole
    generation. ``tokens`` are always the request's committed tokens (prompt + generated).
    """

    @abc.abstractmethod
    def propose(self, request: int, tokens: Sequence[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> DraftChain:
        """Propose at most ``num_drafts`` (>= 1) tokens that continue ``tokens``.

        Random drafters sample at ``sampling`` with ``generator`` and return the standardized
        probabilities (``standardized_probs``) they sampled from. ``probs=None`` states that
        the drafts are a deterministic function of ``tokens`` (point masses: greedy requests,
        lookups); a drafter that samples but returns None breaks the exactness guarantee.
        """

    def commit(self, request: int, tokens: Sequence[int], num_accepted: int) -> None:
        """After verification: ``tokens`` are the committed tokens, whose last ``num_accepted + 1``
        are new (the accepted prefix of the last proposal, then the target's token)."""

    def release(self, request: int) -> None:
        """The request has finished; drop its state."""


class ModelDrafter(Drafter):
    """A (smaller) HF causal LM sharing the target's tokenizer, with its own per-request caches.

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


class PromptLookupDrafter(Drafter):
    """Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence
    of the request's last n tokens (n from ``max_ngram`` down to ``min_ngram``). Deterministic
    drafts (``probs=None``), no model, no state; 0 drafts when nothing matches."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, request, tokens, num_drafts, sampling, generator):
        tokens = list(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + num_drafts]
                    return DraftChain(torch.tensor(follow, dtype=torch.long, device=generator.device))
        return DraftChain(torch.zeros(0, dtype=torch.long, device=generator.device))


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
    num_draft_tokens: int = 0      # drafts proposed
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
        """Accepted drafts / proposed drafts (NaN when nothing was proposed)."""
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
    num_draft_tokens: int = 4,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seed: int | Sequence[int] | None = None,
    generators: Sequence[torch.Generator] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    target_lm: CachedCausalLM | None = None,
) -> GenerationResult:
    """Generate with speculative decoding (chain mode), verifying all requests in one op call per step.

    Parameters
    ----------
    target : transformers causal LM
        The model whose distribution the output follows.
    draft : transformers causal LM or Drafter
        A model sharing the target's tokenizer (wrapped in ``ModelDrafter``) or any ``Drafter``.
    prompts : sequence of token-id sequences or 1-D tensors
        Different lengths welcome; no padding.
    max_new_tokens : int
        Per request. Drafts are capped so that a step never exceeds it.
    num_draft_tokens : int
        K, drafts proposed per request and step (0 = plain decoding through the op).
    temperature, top_k, top_p : number or sequence (one per request)
        ``temperature <= 0`` = greedy (equals the target's greedy decoding). Otherwise the
        output follows the target's temperature -> top-k -> top-p sampling exactly.
    seed, generators
        Per-request randomness, see ``request_generators``.
    eos_token_id : int, sequence of int or None
        A request stops after emitting one of these. None = the target's
        ``generation_config.eos_token_id``; ``[]`` = never stop early.
    on_step : callable or None
        Called with a ``StepInfo`` after every step (progress bars, inspection).
    target_lm : CachedCausalLM or None
        The target's cache holder; pass one to inspect the caches from ``on_step`` (tests).
        Requests are its indices 0 .. len(prompts) - 1; finished requests are released.

    Returns
    -------
    GenerationResult
    """
    start_time = time.perf_counter()
    num_requests = len(prompts)
    committed = [list(p.tolist() if isinstance(p, torch.Tensor) else p) for p in prompts]
    if any(len(tokens) == 0 for tokens in committed):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 0 or num_draft_tokens < 0:
        raise ValueError("max_new_tokens and num_draft_tokens must be >= 0")
    target_lm = target_lm if target_lm is not None else CachedCausalLM(target)
    drafter = draft if isinstance(draft, Drafter) else ModelDrafter(draft)
    device = target_lm.device
    sampling = [SamplingParams(float(t), int(k), float(p)) for t, k, p in zip(
        _per_request(temperature, num_requests, "temperature"), _per_request(top_k, num_requests, "top_k"),
        _per_request(top_p, num_requests, "top_p"))]
    gens = request_generators(num_requests, device, seed, generators)
    eos = _eos_set(eos_token_id, target)
    prompt_lengths = [len(tokens) for tokens in committed]
    stats = GenerationStats()
    steps, accepted = [0] * num_requests, [0] * num_requests
    active = [b for b in range(num_requests) if max_new_tokens > 0]

    while active:
        budgets = [max_new_tokens - (len(committed[b]) - prompt_lengths[b]) for b in active]
        t0 = time.perf_counter()
        chains = []
        for b, budget in zip(active, budgets):
            k = min(num_draft_tokens, budget - 1)
            chain = drafter.propose(b, committed[b], k, sampling[b], gens[b]) if k > 0 else None
            if chain is None or chain.tokens.numel() == 0:
                chain = DraftChain(torch.zeros(0, dtype=torch.long, device=device))
            if chain.tokens.numel() > k:
                raise ValueError(f"the drafter proposed {chain.tokens.numel()} tokens for request {b}, more than {k}")
            chains.append(chain)
        t1 = time.perf_counter()
        rows = [target_lm.forward(b, _target_input(committed[b], target_lm.num_cached(b), chain.tokens, device),
                                  chain.tokens.numel() + 1) for b, chain in zip(active, chains)]
        t2 = time.perf_counter()
        emitted, num_accepted = _verify_chains(rows, chains, [sampling[b] for b in active], [gens[b] for b in active])
        t3 = time.perf_counter()

        still_active = []
        committed_this_step = 0
        for i, b in enumerate(active):
            new_tokens = emitted[i]
            if new_tokens[-1] < 0:
                raise RuntimeError(f"request {b}: the target's logits row has no valid entry (all NaN or -inf)")
            stop = next((j for j, token in enumerate(new_tokens) if token in eos), None)
            if stop is not None:
                new_tokens = new_tokens[:stop + 1]
            committed[b].extend(new_tokens)
            committed_this_step += len(new_tokens)
            steps[b] += 1
            accepted[b] += num_accepted[i]
            stats.num_draft_tokens += chains[i].tokens.numel()
            stats.num_accepted_tokens += num_accepted[i]
            if stop is not None or len(committed[b]) - prompt_lengths[b] >= max_new_tokens:
                target_lm.release(b)
                drafter.release(b)
            else:
                # The target fed every draft; it keeps the committed tokens but the newest.
                target_lm.rollback(b, len(committed[b]) - 1)
                drafter.commit(b, committed[b], num_accepted[i])
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


def _target_input(tokens: Sequence[int], num_cached: int, drafts: torch.Tensor, device) -> torch.Tensor:
    """The committed tokens the target's cache lacks (at least the newest one), then the drafts."""
    pending = torch.tensor(list(tokens[num_cached:]), dtype=torch.long, device=device)
    return torch.cat([pending, drafts.to(device=device, dtype=torch.long)])


def _verify_chains(rows: list[torch.Tensor], chains: list[DraftChain], sampling: list[SamplingParams],
                   generators: list[torch.Generator]) -> tuple[list[list[int]], list[int]]:
    """One op call over every active request: its tokens for this step and its accepted drafts.

    ``rows[i]`` [n_i + 1, V]: the target's logits for request i's draft positions and bonus
    position (the op's layout once concatenated).
    """
    device = rows[0].device
    counts = [chain.tokens.numel() for chain in chains]
    logits = torch.cat(rows)
    drafts = torch.cat([chain.tokens.to(device) for chain in chains])
    cu = torch.zeros(len(chains) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
    temperature = torch.tensor([max(s.temperature, 0.0) for s in sampling], dtype=torch.float32, device=device)
    if any(s.filtered for s in sampling):
        row_to_request = torch.repeat_interleave(torch.arange(len(chains)), torch.tensor(counts) + 1).to(device)
        top_k = torch.tensor([s.top_k for s in sampling], device=device)
        top_p = torch.tensor([s.top_p for s in sampling], dtype=torch.float32, device=device)
        logits = apply_top_k_top_p(logits, top_k, top_p, temperature=temperature, row_to_request=row_to_request)
    draft_probs = None
    if any(chain.probs is not None for chain in chains):
        # Mixed batches: deterministic drafts are point masses (greedy requests ignore the rows).
        vocab = logits.shape[1]
        draft_probs = torch.cat([
            chain.probs.to(device=device, dtype=torch.float32) if chain.probs is not None
            else torch.nn.functional.one_hot(chain.tokens.to(device), vocab).to(torch.float32)
            for chain in chains])
    seeds = torch.cat([torch.randint(_INT64_MIN, _INT64_MAX, (1,), dtype=torch.int64, generator=g, device=g.device)
                       .to(device) for g in generators])
    out, num_accepted = rejection_sample(logits, drafts, cu.to(device), draft_probs, temperature, seeds, None,
                                         max(counts))
    num_accepted = num_accepted.tolist()
    out = out.tolist()
    return [out[i][:num_accepted[i] + 1] for i in range(len(chains))], num_accepted
