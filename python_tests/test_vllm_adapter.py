"""The vLLM adapter (specdec_kernels.integrations.vllm) and the top-k/top-p helper.

vLLM is not imported: its metadata objects are mimicked with SimpleNamespace, built the way
vLLM's model runner builds them (inclusive cu_num_draft_tokens, target/bonus logits indices).
"""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specdec_kernels
from specdec_kernels.integrations import vllm as sv
from specdec_kernels.reference.sampling_filters import apply_top_k_top_p
from utils import check_invariants, chi_square_pvalue, random_batch

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def spec_metadata(num_draft_tokens: list[int], draft_token_ids: torch.Tensor) -> SimpleNamespace:
    """vLLM's SpecDecodeMetadata fields for the logits layout [draft rows of r, bonus row of r]*."""
    counts = np.array(num_draft_tokens, dtype=np.int64)
    cu_draft = np.cumsum(counts)
    cu_sampled = np.cumsum(counts + 1)
    within = np.arange(counts.sum()) - np.repeat(cu_draft - counts, counts)
    target_indices = np.repeat(cu_sampled - counts - 1, counts) + within
    return SimpleNamespace(
        draft_token_ids=draft_token_ids, num_draft_tokens=list(num_draft_tokens),
        cu_num_draft_tokens=torch.tensor(cu_draft, dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(cu_sampled, dtype=torch.int32),
        target_logits_indices=torch.tensor(target_indices, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(cu_sampled - 1, dtype=torch.int32),
        max_spec_len=int(counts.max(initial=0)))


def sampling_metadata(temperature: torch.Tensor, *, generators=None, top_k=None, top_p=None,
                      greedy_value: float = 0.0, **extra) -> SimpleNamespace:
    """vLLM's SamplingMetadata fields; greedy requests carry ``greedy_value`` (0, or -1 in
    older vLLM) and ``temperature`` is None when every request is greedy."""
    greedy = ~(temperature > 0)
    all_greedy, all_random = bool(greedy.all()), bool((~greedy).all())
    fields = dict(
        temperature=None if all_greedy else torch.where(greedy, greedy_value, temperature).float(),
        all_greedy=all_greedy, all_random=all_random, top_k=top_k, top_p=top_p, generators=generators or {},
        max_num_logprobs=None, no_penalties=True, bad_words_token_ids={}, allowed_token_ids_mask=None)
    fields.update(extra)
    return SimpleNamespace(**fields)


def vllm_batch(batch, max_drafts, vocab, *, draft_probs, seed, kind="mixed", zero_draft_share=0.25):
    """A random ragged batch (utils.random_batch) as the op's arguments plus vLLM's counts."""
    args = list(random_batch(batch, max_drafts, vocab, draft_probs=draft_probs, seed=seed,
                             zero_draft_share=zero_draft_share))
    temperature = args[4]
    if kind == "greedy":
        args[4] = torch.zeros_like(temperature)
    elif kind == "random":
        args[4] = torch.where(temperature > 0, temperature, 0.7)
    counts = (args[2][1:] - args[2][:-1]).tolist()
    return args, counts


def seeded_generators(temperature: torch.Tensor, base: int) -> dict[int, torch.Generator]:
    """vLLM creates generators for seeded random requests only."""
    return {b: torch.Generator().manual_seed(base + b) for b in range(temperature.shape[0]) if temperature[b] > 0}


def expected_seeds(temperature: torch.Tensor, base: int) -> torch.Tensor:
    """The seeds the adapter draws from ``seeded_generators(temperature, base)`` (0 for greedy)."""
    seeds = torch.zeros(temperature.shape[0], dtype=torch.int64)
    for b, g in seeded_generators(temperature, base).items():
        seeds[b] = torch.randint(INT64_MIN, INT64_MAX, (1,), dtype=torch.int64, generator=g)[0]
    return seeds


@pytest.mark.parametrize("kind", ["mixed", "greedy", "random"])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("greedy_value", [0.0, -1.0])
def test_module_equals_op(kind, draft_probs, greedy_value):
    args, counts = vllm_batch(24, 4, 40, draft_probs=draft_probs, seed=7, kind=kind)
    logits, drafts, cu, probs, temperature, _, _, max_spec_len = args
    md = spec_metadata(counts, drafts)
    sm = sampling_metadata(temperature, generators=seeded_generators(temperature, 100), greedy_value=greedy_value)
    out = sv.RejectionSampler(validate=True)(md, probs, logits, sm)
    expected, num_accepted = specdec_kernels.rejection_sample(logits, drafts, cu, probs, temperature,
                                                              expected_seeds(temperature, 100), None, max_spec_len)
    assert out.dtype == sv.OUTPUT_DTYPE == torch.int32 and sv.PLACEHOLDER_TOKEN_ID == -1
    assert torch.equal(out, expected)
    check_invariants(out, num_accepted, args)


@pytest.mark.parametrize("kind", ["mixed", "greedy", "random"])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_function_form_matches_module(kind, draft_probs):
    """Same seeds: the function form makes the module's decisions; where every draft is
    accepted (and for 0-draft requests) it emits the given bonus token."""
    args, counts = vllm_batch(24, 4, 40, draft_probs=draft_probs, seed=8, kind=kind)
    logits, drafts, cu, probs, temperature, _, _, max_spec_len = args
    md = spec_metadata(counts, drafts)
    module_out = sv.RejectionSampler()(md, probs, logits,
                                       sampling_metadata(temperature, generators=seeded_generators(temperature, 5)))
    bonus = torch.randint(0, 40, (len(counts), 1), generator=torch.Generator().manual_seed(1))
    greedy = ~(temperature > 0)
    bonus_rows = logits[md.bonus_logits_indices.long()]
    bonus[greedy, 0] = bonus_rows[greedy].argmax(-1)  # vLLM's sampler: greedy bonus = argmax
    out = sv.rejection_sample(drafts, counts, max_spec_len, md.cu_num_draft_tokens, probs,
                              logits[md.target_logits_indices.long()], bonus,
                              sampling_metadata(temperature, generators=seeded_generators(temperature, 5)))
    assert out.dtype == torch.int32 and out.shape == module_out.shape
    cases = set()
    for b, n in enumerate(counts):
        accepted = int((module_out[b, :n] == drafts[cu[b]:cu[b] + n]).cumprod(0).sum()) if n else 0
        cases.add(accepted < n)
        if accepted < n:
            assert torch.equal(out[b], module_out[b])
        else:
            assert out[b, :n].tolist() == drafts[cu[b]:cu[b] + n].tolist()
            assert int(out[b, n]) == int(bonus[b, 0])
            assert bool((out[b, n + 1:] == -1).all())
    assert cases == {True, False}  # rejections and fully accepted chains both checked


def test_seeded_requests_reproducible():
    args, counts = vllm_batch(16, 3, 32, draft_probs=True, seed=9, kind="random")
    logits, drafts, _, probs, temperature, _, _, _ = args
    md = spec_metadata(counts, drafts)
    sampler = sv.RejectionSampler()
    seeded = [0, 3, 7]

    def run(default_seed, generators):
        torch.manual_seed(default_seed)  # the unseeded requests' seeds come from here
        return sampler(md, probs, logits, sampling_metadata(temperature, generators=generators))

    gens = {b: torch.Generator().manual_seed(42 + b) for b in seeded}
    first = run(1, gens)
    second = run(2, {b: torch.Generator().manual_seed(42 + b) for b in seeded})
    assert torch.equal(first[seeded], second[seeded])
    assert not torch.equal(first, second)  # the unseeded requests follow the default generator
    # The generators advanced by one draw: the next step uses new seeds.
    state = {b: g.get_state() for b, g in gens.items()}
    run(1, gens)
    assert all(not torch.equal(state[b], g.get_state()) for b, g in gens.items())
    # Over many steps a seeded request's tokens are a reproducible sequence.
    replay = {b: torch.Generator().manual_seed(42 + b) for b in seeded}
    assert torch.equal(run(5, replay)[seeded], first[seeded])


def test_zero_draft_requests():
    """Requests without drafts emit one token from their bonus row (module) or the given
    bonus token (function form, which then leaves their generators alone, as vLLM does)."""
    batch, vocab = 6, 24
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
    temperature = torch.tensor([0.0, 0.8, 1.0, 0.0, 1.3, 0.5])
    md = spec_metadata([0] * batch, torch.zeros(0, dtype=torch.int64))
    gens = seeded_generators(temperature, 3)
    out = sv.RejectionSampler(validate=True)(md, None, logits, sampling_metadata(temperature, generators=gens))
    assert out.shape == (batch, 1) and out.dtype == torch.int32
    greedy = temperature == 0
    assert torch.equal(out[greedy, 0].long(), logits[greedy].argmax(-1))
    expected, _ = specdec_kernels.rejection_sample(logits, md.draft_token_ids,
                                                   torch.zeros(batch + 1, dtype=torch.int32), None, temperature,
                                                   expected_seeds(temperature, 3), None, 0)
    assert torch.equal(out, expected)

    bonus = torch.arange(batch)[:, None] + 10
    state = {b: g.get_state() for b, g in gens.items()}
    out = sv.rejection_sample(md.draft_token_ids, [0] * batch, 0, md.cu_num_draft_tokens, None,
                              torch.zeros(0, vocab), bonus, sampling_metadata(temperature, generators=gens))
    assert out[:, 0].tolist() == bonus[:, 0].tolist()
    assert all(torch.equal(state[b], g.get_state()) for b, g in gens.items())
    bonus[2, 0] = -1  # no valid bonus: -1 in its place, no out-of-range read
    out = sv.rejection_sample(md.draft_token_ids, [0] * batch, 0, md.cu_num_draft_tokens, None,
                              torch.zeros(0, vocab), bonus, sampling_metadata(temperature, generators=gens))
    assert out[:, 0].tolist() == bonus[:, 0].tolist()

    # Some requests with drafts, some without, in one batch.
    args, counts = vllm_batch(12, 3, 24, draft_probs=False, seed=4, zero_draft_share=0.5)
    assert 0 in counts and max(counts) > 0
    logits, drafts, cu, _, temperature, _, _, max_spec_len = args
    sm = sampling_metadata(temperature, generators=seeded_generators(temperature, 0))
    out = sv.RejectionSampler(validate=True)(spec_metadata(counts, drafts), None, logits, sm)
    expected, _ = specdec_kernels.rejection_sample(logits, drafts, cu, None, temperature,
                                                   expected_seeds(temperature, 0), None, max_spec_len)
    assert torch.equal(out, expected)


def brute_force_keep(row: np.ndarray, top_k: int, top_p: float, temperature: float) -> np.ndarray:
    """The definition of sampling_filters, one row at a time in float64 (boolean keep mask)."""
    vocab = row.shape[0]
    keep = np.ones(vocab, dtype=bool)
    if temperature <= 0:
        return keep
    if 0 < top_k < vocab:
        kth = np.sort(row)[::-1][top_k - 1]
        keep &= row >= kth
    if top_p < 1:
        kept = np.where(keep, row, -np.inf)
        probs = np.exp((kept - kept.max()) / temperature)
        probs /= probs.sum()
        order = np.argsort(-kept, kind="stable")
        mass, last = 0.0, None
        for token in order:
            last = kept[token]
            if mass + probs[token] >= top_p:
                break
            mass += probs[token]
        keep &= row >= last
    return keep


def test_apply_top_k_top_p_semantics():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0],    # top-k 2: ties with the 2nd kept
                           [0.0, 0.0, 0.0, 0.0, 0.0],    # all tied: everything kept
                           [5.0, 4.0, 3.0, 2.0, 1.0],
                           [1.0, float("-inf"), 2.0, float("nan"), 0.5]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 3, 0, 1]), None)
    assert torch.equal(torch.isfinite(out), torch.tensor([[1, 0, 1, 1, 0], [1] * 5, [1] * 5, [0, 0, 1, 0, 0]]).bool())
    # top-p: the token crossing p is kept; greedy rows are untouched.
    out = apply_top_k_top_p(logits, None, torch.tensor([0.5, 0.5, 0.9, 0.5]),
                            temperature=torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False, False]  # q(0) = 0.52 >= 0.5
    assert torch.isfinite(out[1]).all() and torch.equal(out[2], logits[2])
    # Row request mapping; nothing set = the same tensor back.
    assert apply_top_k_top_p(logits, None, None) is logits
    rows = apply_top_k_top_p(logits[[2, 2, 0]], torch.tensor([1, 3]), None, row_to_request=torch.tensor([0, 0, 1]))
    assert torch.isfinite(rows).sum(1).tolist() == [1, 1, 3]

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 50, generator=g) * 2
    logits[:, 10] = logits[:, 11]  # ties
    top_k = torch.randint(0, 60, (300,), generator=g)
    top_p = torch.where(torch.rand(300, generator=g) < 0.3, 1.0, torch.rand(300, generator=g))
    temperature = torch.rand(300, generator=g) * 2
    out = apply_top_k_top_p(logits, top_k, top_p, temperature=temperature)
    for r in range(300):
        expected = brute_force_keep(logits[r].double().numpy(), int(top_k[r]), float(top_p[r]), float(temperature[r]))
        assert np.array_equal(torch.isfinite(out[r]).numpy(), expected), r
        assert torch.equal(out[r][torch.isfinite(out[r])], logits[r][torch.from_numpy(expected)])


@pytest.mark.parametrize("draft_probs", [False, True])
def test_top_k_top_p_never_emit_filtered_tokens(draft_probs):
    vocab, batch = 48, 40
    g = torch.Generator().manual_seed(3)
    top_k = torch.tensor([0, 1, 3, 10] * (batch // 4), dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.3, 0.7, 0.9, 1.0] * (batch // 5), dtype=torch.float32)
    filtered_drafts = 0
    for step in range(12):
        args, counts = vllm_batch(batch, 4, vocab, draft_probs=draft_probs, seed=100 + step)
        logits, drafts, cu, probs, temperature, _, _, max_spec_len = args
        md = spec_metadata(counts, drafts)
        seeds = torch.randint(0, 2**31, (batch,), generator=g).tolist()
        sm = sampling_metadata(temperature, top_k=top_k, top_p=top_p,
                               generators={b: torch.Generator().manual_seed(s) for b, s in enumerate(seeds)})
        out = sv.RejectionSampler(validate=True)(md, probs, logits, sm)
        bonus = torch.randint(0, vocab, (batch, 1), generator=g)
        func = sv.rejection_sample(drafts, counts, max_spec_len, md.cu_num_draft_tokens, probs,
                                   logits[md.target_logits_indices.long()], bonus, sm)
        for b in range(batch):
            temp = float(temperature[b])
            keep = [brute_force_keep(logits[int(cu[b]) + b + t].double().numpy(), int(top_k[b]), float(top_p[b]), temp)
                    for t in range(counts[b] + 1)]
            filtered_drafts += sum(not keep[t][int(drafts[int(cu[b]) + t])] for t in range(counts[b]))
            for result, last_is_bonus in ((out, False), (func, True)):
                tokens = [t for t in result[b].tolist() if t >= 0]
                for t, token in enumerate(tokens):
                    if last_is_bonus and t == counts[b]:
                        assert token == int(bonus[b, 0])  # the function form's given bonus
                    else:
                        assert keep[t][token], (step, b, t, token)
    assert filtered_drafts > 50  # drafts outside the kept set were proposed (and never accepted)


def test_filtered_law_is_exact():
    """First token of requests with two deterministic drafts each: its law is the filtered
    target row at the request's temperature (the adapter maps rows to requests right)."""
    vocab, batch = 16, 4000
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, vocab, generator=g) * 2
    logits = rows.repeat(batch, 1)                       # [3B, V]: 2 draft rows + bonus row each
    drafts = torch.tensor([int(rows[0].argmax()), 5]).repeat(batch)
    temperature = torch.full((batch,), 0.7)
    top_k, top_p = torch.full((batch,), 6), torch.full((batch,), 0.8)
    md = spec_metadata([2] * batch, drafts)
    out = sv.RejectionSampler()(md, None, logits, sampling_metadata(temperature, top_k=top_k, top_p=top_p))
    counts = np.bincount(out[:, 0].numpy(), minlength=vocab)
    law = torch.softmax(apply_top_k_top_p(rows[:1], 6, 0.8, temperature=0.7).double() / 0.7, -1)[0].numpy()
    assert chi_square_pvalue(counts, law) > 1e-4
    wrong = torch.softmax(rows[0].double() / 0.7, -1).numpy()  # unfiltered: must be told apart
    assert chi_square_pvalue(counts, wrong) < 1e-4


def test_filters_go_to_the_op_without_copying_logits(monkeypatch):
    """top_k / top_p reach the op as its arguments (vLLM's disabled values -1 and V as off); the
    logits are handed over as they are (no filtering pre-pass, no copy)."""
    vocab, batch = 40, 6
    args, counts = vllm_batch(batch, 3, vocab, draft_probs=False, seed=9, kind="random")
    logits, drafts, cu, _, temperature, _, _, _ = args
    top_k = torch.tensor([0, -1, vocab, 5, 1, 3], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.5, 0.9, 1.0, 0.3, 0.8])
    seen = {}
    real = sv._specdec_rejection_sample

    def spy(target_logits, *a, **kw):
        seen.update(kw, logits=target_logits)
        return real(target_logits, *a, **kw)

    monkeypatch.setattr(sv, "_specdec_rejection_sample", spy)
    sm = sampling_metadata(temperature, top_k=top_k, top_p=top_p, generators=seeded_generators(temperature, 5))
    out = sv.RejectionSampler()(spec_metadata(counts, drafts), None, logits, sm)
    assert seen["logits"] is logits
    assert seen["top_k"].tolist() == [0, 0, vocab, 5, 1, 3] and torch.equal(seen["top_p"], top_p)
    expected, _ = specdec_kernels.rejection_sample(logits, drafts, cu, None, temperature,
                                                   expected_seeds(temperature, 5), None, max(counts), "token",
                                                   torch.where(top_k > 0, top_k, 0), top_p)
    assert torch.equal(out, expected)
    seen.clear()
    greedy = sampling_metadata(torch.zeros(batch), top_k=top_k, top_p=top_p)
    sv.RejectionSampler()(spec_metadata(counts, drafts), None, logits, greedy)
    assert "top_k" not in seen and "top_p" not in seen  # all greedy: nothing to filter


@pytest.mark.parametrize("kind", ["random", "greedy"])
def test_allowed_token_ids_mask(kind):
    args, counts = vllm_batch(16, 3, 32, draft_probs=True, seed=12, kind=kind)
    logits, drafts, _, probs, temperature, _, _, _ = args
    mask = torch.zeros(20, 32, dtype=torch.bool)  # vLLM: [max batch, V], True = not allowed
    mask[:, ::2] = True
    out = sv.RejectionSampler(validate=True)(spec_metadata(counts, drafts), probs, logits,
                                             sampling_metadata(temperature, allowed_token_ids_mask=mask))
    tokens = out[out >= 0]
    assert tokens.numel() > 0 and bool((tokens % 2 == 1).all())


def test_metadata_errors():
    args, counts = vllm_batch(8, 3, 16, draft_probs=False, seed=2)
    logits, drafts, _, _, temperature, _, _, _ = args
    md = spec_metadata(counts, drafts)
    sampler = sv.RejectionSampler(validate=True)
    md.bonus_logits_indices = md.bonus_logits_indices.flip(0)
    with pytest.raises(ValueError, match="bonus_logits_indices"):
        sampler(md, None, logits, sampling_metadata(temperature))
    md = spec_metadata(counts, drafts)
    with pytest.raises(ValueError, match=r"\[N \+ B, V\]"):
        sampler(md, None, logits[1:], sampling_metadata(temperature))
    # Penalties and bad words are honoured (test_vllm_fidelity.py); logprobs are reported.
    for extra, feature in ((dict(max_num_logprobs=5), "logprobs"),):
        sm = sampling_metadata(temperature, **extra)
        assert any(feature in reason for reason in sv.unsupported_features(sm))
        with pytest.raises(NotImplementedError, match=feature):
            sampler(md, None, logits, sm)
    assert sv.unsupported_features(sampling_metadata(temperature)) == []


def test_core_imports_without_transformers():
    """transformers is an optional extra: the core, the filters and the vLLM adapter import
    without it, and specdec_kernels.hf says what to install."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import specdec_kernels, specdec_kernels.reference.sampling_filters, specdec_kernels.integrations.vllm\n"
        "try:\n    import specdec_kernels.hf\nexcept ImportError as e:\n    print('hf:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "specdec_kernels[hf]" in result.stdout
