"""The vLLM adapter does what vLLM's rejection sampler does to the target rows (issue #38).

Each behaviour is checked on a small hand-made batch whose right answer is derived by hand
from vLLM's semantics (vllm/v1/sample/rejection_sampler.py, sampler.py, ops/penalties.py,
ops/bad_words.py, logits_processor/builtin.py): the processed rows exactly, and the tokens a
greedy request emits with and without the feature. vLLM is not imported: its metadata and its
processors are mimicked (the processors by test doubles that follow vLLM's documented rules).
The last tests enforce the rule that no field of vLLM's metadata is dropped silently.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdec_kernels.integrations import vllm as sv
from specdec_kernels.integrations import vllm_logits as vl
from specdec_kernels.reference.sampling_filters import apply_top_k_top_p
import test_vllm_adapter
from test_vllm_adapter import spec_metadata
from utils import chi_square_pvalue

INF = float("inf")


def full_metadata(temperature, *, output_token_ids, **extra) -> SimpleNamespace:
    """vLLM's current SamplingMetadata with every field, neutral unless given."""
    batch = temperature.shape[0]
    greedy = ~(temperature > 0)
    fields = dict(
        temperature=None if bool(greedy.all()) else torch.where(greedy, 0.0, temperature).float(),
        all_greedy=bool(greedy.all()), all_random=bool((~greedy).all()), top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=output_token_ids, allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=SimpleNamespace(non_argmax_invariant=[], argmax_invariant=[]),
        logprob_token_ids=None, spec_token_ids=None, thinking_budget_state_holder=None)
    fields.update(extra)
    return SimpleNamespace(**fields)


def run(logits, counts, drafts, sm, **kw):
    md = spec_metadata(counts, torch.tensor(drafts, dtype=torch.int64))
    return sv.RejectionSampler(validate=True, **kw)(md, None, logits, sm)


# --- penalties --------------------------------------------------------------------------------

# Request 0: no drafts, neutral penalties. Request 1 (greedy): output so far [1, 1], prompt [5],
# drafts [2, 3]; presence 0.5, frequency 0.25, repetition 2. Rows: 0 = bonus of request 0,
# 1-2 = drafts of request 1, 3 = its bonus.
PENALTY_RAW = [0.5, 4.0, 3.0, 2.0, 1.5, -1.0]
PENALTY_EXPECTED = {
    # history [1, 1]: token 1 (in history, twice) 4 / 2 - 2 * 0.25 - 0.5 = 1; token 5 (prompt) -1 * 2
    1: [0.5, 1.0, 3.0, 2.0, 1.5, -2.0],
    # history [1, 1, 2]: token 2 also 3 / 2 - 0.25 - 0.5 = 0.75
    2: [0.5, 1.0, 0.75, 2.0, 1.5, -2.0],
    # bonus row, history [1, 1, 2, 3]: token 3 also 2 / 2 - 0.25 - 0.5 = 0.25
    3: [0.5, 1.0, 0.75, 0.25, 1.5, -2.0],
}


def penalty_batch(greedy=True):
    logits = torch.tensor([PENALTY_RAW] * 4)
    temperature = torch.tensor([0.0, 0.0 if greedy else 0.8])
    sm = full_metadata(temperature, output_token_ids=[[3], [1, 1]], no_penalties=False,
                       prompt_token_ids=torch.tensor([[3, 6, 6], [5, 6, 6]]),     # padded with V = 6
                       presence_penalties=torch.tensor([0.0, 0.5]), frequency_penalties=torch.tensor([0.0, 0.25]),
                       repetition_penalties=torch.tensor([1.0, 2.0]))
    return logits, [0, 2], [2, 3], sm


def test_penalties_rows_hand_derived():
    logits, counts, drafts, sm = penalty_batch()
    out = vl.process_target_logits(logits, torch.tensor(drafts), counts, sm, bonus_rows=True, validate=True)
    assert out.dtype == torch.float32 and torch.equal(logits, torch.tensor([PENALTY_RAW] * 4))  # input untouched
    assert out[0].tolist() == PENALTY_RAW                                  # neutral request unchanged
    for row, expected in PENALTY_EXPECTED.items():
        assert out[row].tolist() == expected, row
    # The function form processes the draft rows the same way (its bonus tokens are given).
    rows = vl.process_target_logits(logits[1:3], torch.tensor(drafts), counts, sm, bonus_rows=False)
    assert rows.tolist() == [PENALTY_EXPECTED[1], PENALTY_EXPECTED[2]]


def test_penalties_change_greedy_verification():
    logits, counts, drafts, sm = penalty_batch()
    # Penalized argmaxes: 2, 3, then 4 at the bonus row; raw argmax 1 everywhere.
    assert run(logits, counts, drafts, sm)[1].tolist() == [2, 3, 4]
    sm.no_penalties = True
    assert run(logits, counts, drafts, sm)[1].tolist() == [1, -1, -1]
    func = sv.rejection_sample(torch.tensor(drafts), counts, 2, torch.tensor([0, 2]), None, logits[1:3],
                               torch.tensor([[0], [4]]), penalty_batch()[3])
    assert func[1].tolist() == [2, 3, 4]


def test_penalties_law_is_exact():
    """Random request, filtered and penalized: the first token follows softmax(top-k(penalized
    row) / T) exactly; the unpenalized law is told apart (negative control)."""
    torch.manual_seed(0)  # the unseeded requests' seeds
    vocab, batch, temperature = 12, 3000, 0.9
    g = torch.Generator().manual_seed(5)
    row = torch.randn(vocab, generator=g) * 1.5
    logits = row.repeat(2 * batch, 1)                        # one draft row and one bonus row each
    drafts = torch.full((batch,), 11)
    outputs = [[2, 2, 7]] * batch
    sm = full_metadata(torch.full((batch,), temperature), output_token_ids=outputs, no_penalties=False,
                       prompt_token_ids=torch.tensor([[4, 5]]).repeat(batch, 1), top_k=torch.full((batch,), 6),
                       presence_penalties=torch.full((batch,), 0.4), frequency_penalties=torch.full((batch,), 0.3),
                       repetition_penalties=torch.full((batch,), 1.7))
    out = sv.RejectionSampler()(spec_metadata([1] * batch, drafts), None, logits, sm)
    penalized = row.clone().double()
    for token in (2, 7, 4, 5):
        penalized[token] = penalized[token] / 1.7 if penalized[token] > 0 else penalized[token] * 1.7
    penalized[2] -= 2 * 0.3 + 0.4
    penalized[7] -= 0.3 + 0.4
    counts = np.bincount(out[:, 0].numpy(), minlength=vocab)
    law = torch.softmax(apply_top_k_top_p(penalized[None].float(), 6, None)[0].double() / temperature, -1)
    assert chi_square_pvalue(counts, law.numpy()) > 1e-4
    raw_law = torch.softmax(apply_top_k_top_p(row[None], 6, None)[0].double() / temperature, -1)
    assert chi_square_pvalue(counts, raw_law.numpy()) < 1e-4


def test_penalties_need_prompts_and_outputs():
    logits, counts, drafts, sm = penalty_batch()
    sm.prompt_token_ids = None
    with pytest.raises(ValueError, match="prompt_token_ids"):
        run(logits, counts, drafts, sm)
    logits, counts, drafts, sm = penalty_batch()
    sm.output_token_ids = [[3]]
    with pytest.raises(ValueError, match="output_token_ids"):
        run(logits, counts, drafts, sm)
    sm.output_token_ids = [[3], [1, 9]]
    with pytest.raises(ValueError, match="output_token_ids"):
        run(logits, counts, drafts, sm)
    sm.output_token_ids = [[3], [1, -1, 1]]  # -1: vLLM's async placeholder, counted as nothing
    assert run(logits, counts, drafts, sm)[1].tolist() == [2, 3, 4]


# --- bad words --------------------------------------------------------------------------------

def bad_words_batch():
    """Request 0 (greedy): output [5, 6], drafts [1, 2, 3]. Request 1: no drafts, output []."""
    vocab = 8
    rows = torch.zeros(5, vocab)
    rows[0, 1] = 5                       # draft row 0 (history [5, 6])
    rows[1, 2], rows[1, 7] = 5, 6        # draft row 1 (history [5, 6, 1]): 7 is banned everywhere
    rows[2, 0], rows[2, 3] = 6, 5        # draft row 2 (history [5, 6, 1, 2]): 0 banned by [1, 2, 0]
    rows[3, 5], rows[3, 6] = 6, 5        # bonus row (history [5, 6, 1, 2, 3]): 5 banned by [3, 5]
    rows[4, 3], rows[4, 4] = 6, 5        # request 1's bonus row: 3 banned by [3]
    words = {0: [[7], [6, 4], [1, 2, 0], [3, 5], [5, 6, 2], [5, 6, 1, 2, 3, 0, 0]], 1: [[0, 1], [3]]}
    sm = full_metadata(torch.zeros(2), output_token_ids=[[5, 6], []], bad_words_token_ids=words)
    return rows, [3, 0], [1, 2, 3], sm


def test_bad_words_rows_hand_derived():
    logits, counts, drafts, sm = bad_words_batch()
    out = vl.process_target_logits(logits, torch.tensor(drafts), counts, sm, bonus_rows=True)
    banned = [set(torch.nonzero(torch.isinf(row)).flatten().tolist()) for row in out]
    # [7] everywhere; [6, 4] after 6; [5, 6, 2] on the row whose whole history is its prefix; [1, 2, 0]
    # after 1, 2; [3, 5] after 3 (the bonus row: all drafts); the 7-token word is longer than any
    # history + 1; request 1: [3] banned, [0, 1] needs a history.
    assert banned == [{7, 4, 2}, {7}, {7, 0}, {7, 5}, {3}]
    assert torch.equal(out[~torch.isinf(out)], logits[~torch.isinf(out)])


def test_bad_words_change_greedy_verification():
    logits, counts, drafts, sm = bad_words_batch()
    assert run(logits, counts, drafts, sm).tolist() == [[1, 2, 3, 6], [4, -1, -1, -1]]
    sm.bad_words_token_ids = {}
    assert run(logits, counts, drafts, sm).tolist() == [[1, 7, -1, -1], [3, -1, -1, -1]]


def test_bad_words_errors():
    logits, counts, drafts, sm = bad_words_batch()
    for words, match in (({0: [[8]]}, r"\[8\]"), ({0: [[]]}, "non-empty"), ({5: [[1]]}, "request index 5")):
        sm.bad_words_token_ids = words
        with pytest.raises(ValueError, match=match):
            run(logits, counts, drafts, sm)


# --- logits processors ------------------------------------------------------------------------

class MinTokensLogitsProcessor:
    """vLLM's min_tokens rule (builtin.py): state {request: (min_tokens, output ids, stop ids)} for
    requests below their minimum. ``apply`` (the Sampler, bonus rows [B, V]) bans the stop ids of
    every such request; ``apply_with_spec_decode`` (draft rows [N, V], request after request)
    bans them on a request's first min_tokens - len(output) draft rows."""

    def __init__(self, min_toks):
        self.min_toks = min_toks

    def is_argmax_invariant(self):
        return False

    def apply(self, logits):
        for request, (_, _, stop) in self.min_toks.items():
            logits[request, sorted(stop)] = -INF
        return logits

    def apply_with_spec_decode(self, logits, num_draft_tokens):
        starts = np.concatenate([[0], np.cumsum(num_draft_tokens)])
        for request, (minimum, output, stop) in self.min_toks.items():
            masked = min(max(minimum - len(output), 0), num_draft_tokens[request])
            for row in range(starts[request], starts[request] + masked):
                logits[row, sorted(stop)] = -INF
        return logits


class LogitBiasLogitsProcessor:
    """vLLM's logit bias without a speculative-decoding hook."""

    def __init__(self, biases):
        self.biases = biases

    def apply(self, logits):
        for request, bias in self.biases.items():
            for token, value in bias.items():
                logits[request, token] += value
        return logits


class MinPLogitsProcessor:
    def __init__(self, count):
        self.min_p_count = count

    def apply(self, logits):
        return logits


class OptedInProcessor:
    """A custom processor that opts in to speculative decoding: +10 on token 2 of the draft rows
    (through the hook), +10 on token 3 of the bonus rows (``apply``)."""

    @classmethod
    def supports_spec_decode(cls):
        return True

    def apply(self, logits):
        logits[:, 3] += 10
        return logits

    def apply_with_spec_decode(self, logits, num_draft_tokens):
        assert logits.shape[0] == sum(num_draft_tokens)
        logits[:, 2] += 10
        return logits


def procs(non_argmax=(), argmax=()):
    return SimpleNamespace(non_argmax_invariant=list(non_argmax), argmax_invariant=list(argmax))


def min_tokens_batch():
    """EOS = 0. Request 0 (greedy): min_tokens 3, output [4] -> draft rows 0 and 1 (positions 1
    and 2 of the output) ban EOS, row 2 does not; its bonus row does (vLLM's Sampler bans EOS on
    the bonus row of any request still below its minimum). Request 1: min_tokens 2, output [4]
    -> only its first draft row. Request 2: not tracked."""
    vocab = 8
    logits = torch.zeros(9, vocab)
    logits[0, 5] = 5                        # r0 draft 0 -> 5 accepted
    logits[1, 0], logits[1, 6] = 6, 5       # r0 draft 1 = EOS: banned -> 6 emitted instead
    logits[2, 0] = 6                        # r0 draft 2 (not reached)
    logits[3, 0] = 6                        # r0 bonus
    logits[4, 0], logits[4, 7] = 6, 5       # r1 draft 0 = 7: accepted only when EOS is banned
    logits[5, 0] = 6                        # r1 draft 1 = EOS: allowed at position 2 -> accepted
    logits[6, 0], logits[6, 1] = 6, 5       # r1 bonus: 0 (request 1 is still below 2 tokens)
    logits[7, 0] = 6                        # r2 draft 0 = EOS, untracked: accepted
    logits[8, 2] = 6                        # r2 bonus
    proc = MinTokensLogitsProcessor({0: (3, [4], {0}), 1: (2, [4], {0})})
    sm = full_metadata(torch.zeros(3), output_token_ids=[[4], [4], []], logitsprocs=procs([proc]))
    return logits, [3, 2, 1], [5, 0, 0, 7, 0, 0], sm


def test_min_tokens_rows_hand_derived():
    logits, counts, drafts, sm = min_tokens_batch()
    out = vl.process_target_logits(logits, torch.tensor(drafts), counts, sm, bonus_rows=True)
    assert torch.isinf(out[:, 0]).tolist() == [True, True, False, True, True, False, True, False, False]


def test_min_tokens_change_greedy_verification():
    logits, counts, drafts, sm = min_tokens_batch()
    out = run(logits, counts, drafts, sm)
    assert out[0].tolist() == [5, 6, -1, -1]
    assert out[1].tolist() == [7, 0, 1, -1]
    assert out[2].tolist() == [0, 2, -1, -1]
    sm.logitsprocs = procs([MinTokensLogitsProcessor({})])          # nobody below the minimum
    out = run(logits, counts, drafts, sm)
    assert out[0].tolist() == [5, 0, 0, 0] and out[1].tolist() == [0, -1, -1, -1]


def test_opted_in_processor_draft_hook_and_bonus_apply():
    logits = torch.zeros(3, 6)
    logits[:, 1] = 5
    sm = full_metadata(torch.zeros(1), output_token_ids=[[]], logitsprocs=procs([OptedInProcessor()]))
    assert run(logits, [2], [2, 2], sm).tolist() == [[2, 2, 3]]


def test_thinking_budget_holder_calls_as_vllm():
    calls = []

    class Holder:
        def has_tracked_requests(self):
            return True

        def update_state(self, output_token_ids, spec_token_ids, repeat_indices=None):
            calls.append(("update", [list(o) for o in output_token_ids], spec_token_ids, repeat_indices))

        def apply_to_logits(self, logits, predict_bonus_token, spec_token_ids):
            calls.append(("apply", predict_bonus_token, tuple(logits.shape)))
            logits[0, 4 if predict_bonus_token else 3] = 1e9      # force a token
            return logits

    logits = torch.zeros(3, 6)
    logits[:, 1] = 5
    sm = full_metadata(torch.zeros(1), output_token_ids=[[2]], spec_token_ids=[[3, 1]],
                       thinking_budget_state_holder=Holder())
    assert run(logits, [2], [3, 1], sm).tolist() == [[3, 1, 4]]
    # The bonus rows first (vLLM's Sampler runs before the draft rows' pass), then the draft rows.
    assert calls == [("update", [[2]], [[3, 1]], None), ("apply", True, (1, 6)), ("apply", False, (2, 6))]
    calls.clear()
    sm.spec_token_ids = [[3, 2]]
    with pytest.raises(ValueError, match="spec_token_ids"):
        run(logits, [2], [3, 1], sm)


def test_processors_that_cannot_be_applied_are_reported_and_raise():
    logits, counts, drafts, sm = min_tokens_batch()
    cases = [
        (procs([LogitBiasLogitsProcessor({0: {1: 5.0}})]), "LogitBiasLogitsProcessor"),
        (procs([OptedInProcessor(), type("Custom", (), {"apply": lambda self, x: x})()]), "Custom"),
        (procs(argmax=[MinPLogitsProcessor(1)]), "MinPLogitsProcessor"),
        (procs(argmax=[type("CustomArgmaxInvariant", (), {})()]), "CustomArgmaxInvariant"),
    ]
    random = full_metadata(torch.full((3,), 0.7), output_token_ids=[[4], [4], []])
    for processors, name in cases:
        random.logitsprocs = processors
        assert any(name in reason for reason in sv.unsupported_features(random)), name
        with pytest.raises(NotImplementedError, match=name):
            run(logits, counts, drafts, random)
    # Inactive builtins are fine; argmax-invariant ones do not matter to an all-greedy batch (vLLM
    # skips them there too).
    sm.logitsprocs = procs([LogitBiasLogitsProcessor({}), MinTokensLogitsProcessor({})], [MinPLogitsProcessor(0)])
    assert sv.unsupported_features(sm) == []
    sm.logitsprocs = procs(argmax=[MinPLogitsProcessor(2)])
    assert sv.unsupported_features(sm) == [] and run(logits, counts, drafts, sm).shape == (3, 4)


# --- verification methods, logprobs, unknown fields ---------------------------------------------

@pytest.mark.parametrize("config, match", [
    (dict(rejection_sample_method="fly"), "FLy"),
    (dict(rejection_sample_method=None, fly_window_size=4, fly_entropy_threshold=0.5), "fly_window_size"),
    (dict(enable_fly_verify=True), "FLy"),
    (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.8, 0.6]), "synthetic"),
    (dict(rejection_sample_method="standard", synthetic_acceptance_length=3.5), "synthetic"),
    (dict(rejection_sample_method="standard", enable_adaptive_verification=True), "adaptive"),
    (dict(rejection_sample_method="typical"), "unknown"),
])
def test_other_verification_methods_raise_by_name(config, match):
    with pytest.raises(ValueError, match=match) as error:
        sv.RejectionSampler(spec_config=SimpleNamespace(**config))
    assert "exact" in str(error.value) or "adaptive" in match
    if match in ("FLy", "synthetic", "unknown"):
        assert "lenience" in str(error.value)
    with pytest.raises(ValueError, match=match):
        sv.rejection_sample(torch.zeros(0, dtype=torch.int64), [0], 0, torch.tensor([0]), None, torch.zeros(0, 4),
                            torch.tensor([[1]]), full_metadata(torch.zeros(1), output_token_ids=[[]]),
                            spec_config=SimpleNamespace(**config))


@pytest.mark.parametrize("method, op_method", [("standard", "token"), (None, "token"), ("block", "block")])
def test_exact_verification_methods(method, op_method, monkeypatch):
    seen = {}
    real = sv._specdec_rejection_sample

    def spy(*args, **kwargs):
        seen["method"] = args[8]
        return real(*args, **kwargs)

    monkeypatch.setattr(sv, "_specdec_rejection_sample", spy)
    sampler = sv.RejectionSampler(spec_config=SimpleNamespace(rejection_sample_method=method))
    logits, counts, drafts, sm = penalty_batch(greedy=False)
    sm.generators = {1: torch.Generator().manual_seed(3)}
    out = sampler(spec_metadata(counts, torch.tensor(drafts)), None, logits, sm)
    assert seen["method"] == op_method and sampler.method == op_method and out.shape == (2, 3)


def test_logprobs_and_unknown_fields_are_reported():
    logits, counts, drafts, sm = penalty_batch()
    for name, value in (("max_num_logprobs", 0), ("logprob_token_ids", {1: [3]}), ("dry_multiplier", 0.8)):
        reported = full_metadata(torch.zeros(2), output_token_ids=[[3], [1, 1]], **{name: value})
        assert any(name in reason for reason in sv.unsupported_features(reported))
        with pytest.raises(NotImplementedError, match=name):
            run(logits, counts, drafts, reported)
    unset = full_metadata(torch.zeros(2), output_token_ids=[[3], [1, 1]], dry_multiplier=None, logit_bias={})
    assert sv.unsupported_features(unset) == []


# --- no feature dropped silently --------------------------------------------------------------

# vLLM's SamplingMetadata (vllm/v1/sample/metadata.py, current main) and SpecDecodeMetadata
# (vllm/v1/spec_decode/metadata.py), field by field, and SpeculativeConfig's verification fields.
VLLM_SAMPLING_METADATA = [
    "temperature", "all_greedy", "all_random", "top_p", "top_k", "generators", "max_num_logprobs",
    "no_penalties", "prompt_token_ids", "frequency_penalties", "presence_penalties", "repetition_penalties",
    "output_token_ids", "allowed_token_ids_mask", "bad_words_token_ids", "logitsprocs", "logprob_token_ids",
    "spec_token_ids", "thinking_budget_state_holder", "logprobs_mode_override"]
VLLM_SPEC_DECODE_METADATA = [
    "draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens", "cu_num_sampled_tokens",
    "target_logits_indices", "bonus_logits_indices", "logits_indices", "max_spec_len"]
VLLM_SPECULATIVE_CONFIG = [
    "rejection_sample_method", "synthetic_acceptance_rates", "synthetic_acceptance_length",
    "enable_adaptive_verification", "fly_window_size", "fly_entropy_threshold"]

# The tests that show each honoured field at work ("module::test"); the module's own tests when
# no module is named.
BEHAVIOUR_TESTS = {
    "temperature": ["test_vllm_adapter::test_module_equals_op", "test_vllm_adapter::test_filtered_law_is_exact"],
    "all_greedy": ["test_vllm_adapter::test_module_equals_op",
                   "test_processors_that_cannot_be_applied_are_reported_and_raise"],
    "top_p": ["test_vllm_adapter::test_top_k_top_p_never_emit_filtered_tokens"],
    "top_k": ["test_vllm_adapter::test_filters_go_to_the_op_without_copying_logits", "test_penalties_law_is_exact"],
    "generators": ["test_vllm_adapter::test_seeded_requests_reproducible"],
    "no_penalties": ["test_penalties_change_greedy_verification"],
    "prompt_token_ids": ["test_penalties_rows_hand_derived"],
    "frequency_penalties": ["test_penalties_rows_hand_derived", "test_penalties_law_is_exact"],
    "presence_penalties": ["test_penalties_rows_hand_derived", "test_penalties_law_is_exact"],
    "repetition_penalties": ["test_penalties_rows_hand_derived", "test_penalties_law_is_exact"],
    "output_token_ids": ["test_penalties_rows_hand_derived", "test_bad_words_rows_hand_derived",
                         "test_penalties_need_prompts_and_outputs"],
    "allowed_token_ids_mask": ["test_vllm_adapter::test_allowed_token_ids_mask"],
    "bad_words_token_ids": ["test_bad_words_rows_hand_derived", "test_bad_words_change_greedy_verification"],
    "logitsprocs": ["test_min_tokens_rows_hand_derived", "test_min_tokens_change_greedy_verification",
                    "test_opted_in_processor_draft_hook_and_bonus_apply"],
    "spec_token_ids": ["test_thinking_budget_holder_calls_as_vllm"],
    "thinking_budget_state_holder": ["test_thinking_budget_holder_calls_as_vllm"],
    "draft_token_ids": ["test_vllm_adapter::test_module_equals_op"],
    "num_draft_tokens": ["test_vllm_adapter::test_zero_draft_requests"],
    "cu_num_draft_tokens": ["test_vllm_adapter::test_module_equals_op"],
    "max_spec_len": ["test_vllm_adapter::test_module_equals_op"],
    "target_logits_indices": ["test_vllm_adapter::test_metadata_errors"],
    "bonus_logits_indices": ["test_vllm_adapter::test_metadata_errors"],
    "rejection_sample_method": ["test_exact_verification_methods", "test_other_verification_methods_raise_by_name"],
}
# A value that asks for each reported field.
ACTIVE_VALUES = {"max_num_logprobs": 2, "logprob_token_ids": {0: [1]}}


def test_every_vllm_field_is_classified():
    for vllm_fields, table in ((VLLM_SAMPLING_METADATA, vl.SAMPLING_METADATA_FIELDS),
                               (VLLM_SPEC_DECODE_METADATA, vl.SPEC_DECODE_METADATA_FIELDS),
                               (VLLM_SPECULATIVE_CONFIG, vl.SPECULATIVE_CONFIG_FIELDS)):
        assert set(vllm_fields) <= set(table), set(vllm_fields) - set(table)
        for name, (treatment, why) in table.items():
            assert treatment in (vl.HONOURED, vl.REPORTED, vl.INERT) and why, name


def test_honoured_fields_have_behavioural_tests():
    modules = {"test_vllm_adapter": test_vllm_adapter, None: globals()}
    tables = {**vl.SAMPLING_METADATA_FIELDS, **vl.SPEC_DECODE_METADATA_FIELDS, **vl.SPECULATIVE_CONFIG_FIELDS}
    for name, (treatment, _) in tables.items():
        if treatment != vl.HONOURED:
            continue
        assert BEHAVIOUR_TESTS.get(name), f"{name} is marked honoured but no test shows it"
        for ref in BEHAVIOUR_TESTS[name]:
            module, _, test = ref.rpartition("::")
            namespace = modules[module or None]
            found = getattr(namespace, test, None) if module else namespace.get(test)
            assert callable(found), f"{name}: {ref} does not exist"


def test_reported_fields_are_reported_and_raise():
    logits, counts, drafts, _ = penalty_batch()
    for name, (treatment, _) in vl.SAMPLING_METADATA_FIELDS.items():
        if treatment == vl.REPORTED:
            sm = full_metadata(torch.zeros(2), output_token_ids=[[3], [1, 1]], **{name: ACTIVE_VALUES[name]})
            assert any(name in reason for reason in sv.unsupported_features(sm)), name
            with pytest.raises(NotImplementedError):
                run(logits, counts, drafts, sm)
    for name, (treatment, _) in vl.SPECULATIVE_CONFIG_FIELDS.items():
        if treatment == vl.REPORTED:
            with pytest.raises(ValueError, match="lenience|adaptive"):
                sv.RejectionSampler(spec_config=SimpleNamespace(**{name: [0.5] if "rates" in name else 1}))
    # The neutral metadata asks for nothing: nothing reported, the logits go to the op as they are.
    neutral = full_metadata(torch.zeros(2), output_token_ids=[[3], [1, 1]])
    assert sv.unsupported_features(neutral) == [] and not vl.needs_processing(neutral)
    assert vl.process_target_logits(logits, torch.tensor(drafts), counts, neutral, bonus_rows=True) is logits
