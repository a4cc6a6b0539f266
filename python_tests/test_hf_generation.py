"""Speculative generation with HF models (specdec_kernels.hf) and its command line.

Tiny random Llama models built in the test (no downloads): greedy output equals the target's
own greedy ``generate``, sampled output follows the target's exact sampling law (first two
tokens, chi-square, with a negative control), the KV caches hold exactly committed tokens
after every step, seeds make requests reproducible whatever the batch.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from specdec_kernels.hf import speculative as hf  # noqa: E402
from specdec_kernels.reference.sampling_filters import apply_top_k_top_p  # noqa: E402
from utils import chi_square_pvalue  # noqa: E402

VOCAB = 16
EOS = 15
PROMPTS = [[1, 5, 9, 3], [1], [1, 7, 7, 4, 12, 6, 3], [1, 14]]


@pytest.fixture(autouse=True)
def one_thread():
    # Hidden size 32: intra-op threads only add synchronization, which on a loaded 2-core
    # machine makes each forward 10-100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama(num_layers: int, seed: int) -> LlamaForCausalLM:
    """fp32, vocab 16, hidden 32; initializer_range 0.3 gives logits with a spread of ~2, so that
    temperatures and filters change the law visibly."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def models():
    """A 2-layer target (seed 1: greedy decoding does not collapse into a repeated token) and a
    1-layer draft made of the target's first layer plus a little noise (acceptance ~0.3
    greedy, ~0.45 at temperature 0.8: accepted chains and rejections are both frequent)."""
    target = tiny_llama(2, seed=1)
    draft = tiny_llama(1, seed=1)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in draft.state_dict()})
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return target, draft


def target_greedy(target, prompt, max_new_tokens, eos=EOS):
    out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("k,stop_at_eos", [(1, True), (3, True), (3, False)])
def test_greedy_equals_target_generate(models, k, stop_at_eos):
    target, draft = models
    # eos_token_id=None: the target's generation_config (EOS); [] = never stop early.
    result = hf.speculative_generate(target, draft, PROMPTS, max_new_tokens=16, num_draft_tokens=k,
                                     eos_token_id=None if stop_at_eos else [])
    for prompt, tokens in zip(PROMPTS, result.tokens):
        assert tokens == target_greedy(target, prompt, 16, EOS if stop_at_eos else None)
    stats = result.stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.tokens_per_step > 1
    assert stats.num_generated_tokens == sum(len(t) for t in result.tokens)


def test_greedy_sliding_window_model():
    """Sliding-window layers (a Mistral with a window of 4 tokens, shorter than the sequences)
    roll back too: transformers keeps their past states for crop() once asked to."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           initializer_range=0.3, sliding_window=4, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(1)
    target = MistralForCausalLM(config).eval()
    draft = MistralForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        draft.lm_head.weight.add_(0.05 * noise)
    result = hf.speculative_generate(target, draft, PROMPTS, max_new_tokens=14, num_draft_tokens=3, eos_token_id=[])
    for prompt, tokens in zip(PROMPTS, result.tokens):
        assert tokens == target_greedy(target, prompt, 14, None)
    assert 0 < result.stats.num_accepted_tokens < result.stats.num_draft_tokens


def test_greedy_requests_in_a_mixed_batch(models):
    """Greedy requests next to random ones (their draft rows become point masses) still
    decode exactly greedily; random ones follow their own temperature."""
    target, draft = models
    temperature = [0.0, 0.9, 0.0, 1.3]
    result = hf.speculative_generate(target, draft, PROMPTS, max_new_tokens=10, num_draft_tokens=3,
                                     temperature=temperature, seed=3)
    for prompt, tokens, temp in zip(PROMPTS, result.tokens, temperature):
        if temp == 0:
            assert tokens == target_greedy(target, prompt, 10)


def test_prompt_lookup_drafter_greedy(models):
    target, _ = models
    prompts = [[1, 3, 4, 5, 3, 4, 5, 3, 4], [1, 6, 6, 6, 6]]
    result = hf.speculative_generate(target, hf.PromptLookupDrafter(), prompts, max_new_tokens=12,
                                     num_draft_tokens=3)
    for prompt, tokens in zip(prompts, result.tokens):
        assert tokens == target_greedy(target, prompt, 12)
    assert result.stats.num_draft_tokens > 0


# Prompts with several earlier continuations of their last tokens, so that the lookup trees branch.
LOOKUP_PROMPTS = [[1, 3, 4, 5, 3, 4, 6, 3, 4, 7, 2, 3, 4], [1, 6, 6, 6, 6], [1, 9, 8, 9, 7, 9, 8, 9]]


@pytest.mark.parametrize("num_candidates,draft_cost", [(1, 0.1), (3, None), (3, 0.05)])
def test_prompt_lookup_trees_and_theory_k_greedy(models, num_candidates, draft_cost):
    target, _ = models
    drafter = hf.PromptLookupDrafter(max_ngram=4, min_ngram=1, num_candidates=num_candidates, draft_cost=draft_cost)
    result = hf.speculative_generate(target, drafter, LOOKUP_PROMPTS, max_new_tokens=12, num_draft_tokens=4,
                                     eos_token_id=[])
    for prompt, tokens in zip(LOOKUP_PROMPTS, result.tokens):
        assert tokens == target_greedy(target, prompt, 12, None)
    assert result.stats.num_draft_tokens > 0


def test_prompt_lookup_sites_trie_and_theory_k():
    drafter = hf.PromptLookupDrafter(max_ngram=3, min_ngram=1, num_candidates=3)
    tokens = [1, 3, 4, 5, 3, 4, 6, 3, 4, 7, 2, 3, 4]
    # Sites: "3 4" matched at 3 places (length 2: the 1 / 5 / 6 before them differ from the 2), latest
    # first; the last "4" alone is never a shorter site of its own (same positions).
    assert drafter.match_sites(tokens) == [(2, 9), (2, 6), (2, 3)]
    gen = torch.Generator()
    tree = drafter.propose(0, tokens, 2, hf.SamplingParams(), gen)
    assert isinstance(tree, hf.DraftTokenTree)
    assert tree.tokens.tolist() == [7, 2, 6, 3, 5, 3] and tree.parents == [0, 1, 0, 3, 0, 5]
    # A longer match ranks first, whatever its age.
    assert hf.PromptLookupDrafter(max_ngram=3).match_sites([5, 3, 4, 9, 3, 4, 8, 5, 3, 4])[0] == (3, 3)
    # One candidate: a chain; shared prefixes appear once in a trie.
    chain = hf.PromptLookupDrafter(max_ngram=3).propose(0, tokens, 4, hf.SamplingParams(), gen)
    assert isinstance(chain, hf.DraftChain) and chain.tokens.tolist() == [7, 2, 3, 4]
    shared = hf.PromptLookupDrafter(max_ngram=1, num_candidates=2).propose(0, [1, 2, 5, 1, 2, 6, 1], 2,
                                                                          hf.SamplingParams(), gen)
    assert shared.tokens.tolist() == [2, 6, 5] and shared.parents == [0, 1, 1]
    assert hf.PromptLookupDrafter().propose(0, [1, 2, 3], 4, hf.SamplingParams(), gen).tokens.numel() == 0
    # K by the theory: free drafts -> the most allowed; dear ones or low acceptance -> fewer.
    assert hf.lookahead_by_theory(0.8, 0.0, 8) == 8
    assert hf.lookahead_by_theory(0.8, 0.13, 8) == 5
    assert hf.lookahead_by_theory(0.3, 0.13, 8) == 1
    assert hf.lookahead_by_theory(1.0, 0.5, 3) == 3
    with pytest.raises(ValueError, match="draft_cost"):
        hf.lookahead_by_theory(0.5, -1.0, 3)
    with pytest.raises(ValueError, match="num_candidates"):
        hf.PromptLookupDrafter(num_candidates=0)
    # The acceptance estimate that picks K: the prior, then the request's own record.
    theory = hf.PromptLookupDrafter(max_ngram=3, draft_cost=0.13, prior_acceptance=0.5)
    assert theory.acceptance(0, 2) == pytest.approx(0.5)
    proposal = theory.propose(0, tokens, 8, hf.SamplingParams(), gen)
    assert proposal.tokens.tolist() == [7, 2] and hf.lookahead_by_theory(0.5, 0.13, 8) == 2
    theory.commit(0, tokens + [7, 9], 1)  # one accepted, the second rejected: 2 tested
    assert theory.acceptance(0, 2) == pytest.approx((1 + 1) / (2 + 2))
    theory.commit(0, tokens + [7, 9, 5], 0)  # nothing was proposed since: no change
    assert theory.acceptance(0, 2) == pytest.approx(0.5)


def exact_first_two(target, prompt, temperature, top_k=0, top_p=1.0) -> np.ndarray:
    """[V, V]: P(first = a, second = b) when the target samples at temperature -> top-k -> top-p."""
    with torch.no_grad():
        first_logits = target(torch.tensor([prompt])).logits[0, -1:]
        next_logits = target(torch.tensor([prompt + [a] for a in range(VOCAB)])).logits[:, -1]

    def law(logits):
        filtered = apply_top_k_top_p(logits, top_k, top_p, temperature=temperature)
        return torch.softmax(filtered.double() / temperature, -1)

    return (law(first_logits)[0][:, None] * law(next_logits)).numpy()


def first_two_counts(target, draft, num_requests, seed, **sampling) -> np.ndarray:
    prompt = PROMPTS[0]
    # 3 new tokens with K = 2: the first two cross every path (accept/accept, accept/reject,
    # reject at once, then a second step).
    result = hf.speculative_generate(target, draft, [prompt] * num_requests, max_new_tokens=3, num_draft_tokens=2,
                                     seed=seed, eos_token_id=[], **sampling)
    tokens = np.array([t[:2] for t in result.tokens])
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    return counts, result.stats


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 0.9)])
def test_sampling_follows_target_law(models, top_k, top_p):
    target, draft = models
    temperature = 0.8
    counts, stats = first_two_counts(target, draft, 2000, seed=11, temperature=temperature, top_k=top_k, top_p=top_p)
    assert 0.2 < stats.acceptance_rate < 0.9  # both paths exercised
    exact = exact_first_two(target, PROMPTS[0], temperature, top_k, top_p)
    # Filtered-out pairs have probability 0: a single sample there gives p = 0.
    assert chi_square_pvalue(counts, exact) > 1e-4


def test_sampling_negative_control_wrong_verify_temperature(models, monkeypatch):
    """Verifying at twice the draft's temperature samples the target at 1.6, not 0.8: the test
    must see it."""
    target, draft = models
    real = hf.rejection_sample

    def wrong_temperature(logits, drafts, cu, draft_probs, temperature, *args, **kwargs):
        return real(logits, drafts, cu, draft_probs, temperature * 2, *args, **kwargs)

    monkeypatch.setattr(hf, "rejection_sample", wrong_temperature)
    counts, _ = first_two_counts(target, draft, 600, seed=12, temperature=0.8)
    assert chi_square_pvalue(counts, exact_first_two(target, PROMPTS[0], 0.8)) < 1e-4


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def fresh_cache(model, tokens):
    """The cache of one forward over ``tokens`` from scratch."""
    cache = DynamicCache(config=model.config)
    # transformers 5.2x renamed past_key_values to cache; older versions ignore an unknown ``cache``.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]), use_cache=True, **{name: cache})
    return cache


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_hold_exactly_committed_tokens(models, temperature):
    target, draft = models
    target_lm = hf.CachedCausalLM(target)
    drafter = hf.ModelDrafter(draft)
    draft_lags = set()

    def check(info: hf.StepInfo):
        for b in info.active:
            tokens = info.tokens[b]
            # Target: every committed token but the newest (the next forward's first input).
            for lm, model, lags in ((target_lm, target, {1}), (drafter.lm, draft, {1, 2})):
                n = lm.num_cached(b)
                cache = lm.cache(b)
                assert cache.get_seq_length() == n
                assert len(tokens) - n in lags
                for (k, v), (k_ref, v_ref) in zip(cache_tensors(cache), cache_tensors(fresh_cache(model, tokens[:n]))):
                    assert k.shape == k_ref.shape
                    torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-5)
                    torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-5)
            draft_lags.add(len(tokens) - drafter.lm.num_cached(b))

    result = hf.speculative_generate(target, drafter, PROMPTS, max_new_tokens=16, num_draft_tokens=2,
                                     temperature=temperature, seed=5, eos_token_id=[], on_step=check,
                                     target_lm=target_lm)
    assert result.stats.num_steps > 3
    # Both rollback cases happened: after a rejection and after a fully accepted chain.
    assert draft_lags == {1, 2}
    assert result.stats.num_accepted_tokens < result.stats.num_draft_tokens
    # Finished requests release their caches.
    assert all(target_lm.cache(b) is None and drafter.lm.cache(b) is None for b in range(len(PROMPTS)))


def test_seeds_make_requests_reproducible(models):
    target, draft = models
    kwargs = dict(max_new_tokens=10, num_draft_tokens=3, temperature=1.0, top_p=0.95, eos_token_id=[])
    batch = hf.speculative_generate(target, draft, PROMPTS[:3], seed=[101, 202, 303], **kwargs)
    again = hf.speculative_generate(target, draft, PROMPTS[:3], seed=[101, 202, 303], **kwargs)
    alone = hf.speculative_generate(target, draft, [PROMPTS[1]], seed=[202], **kwargs)
    assert batch.tokens == again.tokens
    assert alone.tokens[0] == batch.tokens[1]  # independent of the other requests
    generators = [torch.Generator().manual_seed(s) for s in (101, 202, 303)]
    assert hf.speculative_generate(target, draft, PROMPTS[:3], generators=generators, **kwargs).tokens == batch.tokens
    other = hf.speculative_generate(target, draft, PROMPTS[:3], seed=[1, 2, 3], **kwargs)
    assert other.tokens != batch.tokens


def test_limits_and_eos(models):
    target, draft = models
    result = hf.speculative_generate(target, draft, PROMPTS, max_new_tokens=5, num_draft_tokens=4,
                                     temperature=1.0, seed=1, eos_token_id=[])
    assert all(len(t) == 5 for t in result.tokens)
    # Stopping at a token: everything up to its first occurrence, then nothing.
    stop = result.tokens[0][2]
    stopped = hf.speculative_generate(target, draft, PROMPTS, max_new_tokens=5, num_draft_tokens=4,
                                      temperature=1.0, seed=1, eos_token_id=stop)
    first = result.tokens[0].index(stop)
    assert stopped.tokens[0] == result.tokens[0][:first + 1]
    assert hf.speculative_generate(target, draft, PROMPTS, max_new_tokens=0).tokens == [[]] * len(PROMPTS)
    with pytest.raises(ValueError, match="at least one token"):
        hf.speculative_generate(target, draft, [[]], max_new_tokens=3)


def test_generate_cli(models, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from specdec_kernels.hf import cli as generate

    target, draft = models
    words = ["[PAD]", "<s>"] + [f"w{i}" for i in range(2, VOCAB - 1)] + ["</s>"]  # </s> = EOS = 15
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w3"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w3", pad_token="[PAD]",
                                        bos_token="<s>", eos_token="</s>")
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    capsys.readouterr()
    assert generate.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                          "--prompt", "w5 w9 w3", "--max-new-tokens", "8", "--k", "3"]) == 0
    out = capsys.readouterr().out
    for expected in ("tokens/step", "acceptance", "tokens/s", "speedup", "identical to target.generate: 1/1"):
        assert expected in out
    assert generate.main(["--target", str(tmp_path / "target"), "--prompt-lookup", "--prompt", "w5 w6 w5 w6",
                          "--max-new-tokens", "6", "--temperature", "0.8", "--top-k", "5", "--no-baseline"]) == 0
    assert "acceptance" in capsys.readouterr().out
    assert generate.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt",
                          "w5 w9 w3", "--max-new-tokens", "6", "--sample", "--method", "block", "--no-baseline"]) == 0
    assert "block verification" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        generate.parse_args(["--tree", "--method", "block"])  # trees have no block variant


# --- block verification (method="block") ---------------------------------------------------------

@pytest.mark.parametrize("drafter", ["model", "prompt-lookup"])
def test_block_greedy_equals_target_generate(models, drafter):
    """Block verification changes only random requests: greedy output is the target's greedy
    decoding, with sampled-model and deterministic (lookup) drafters alike."""
    target, draft = models
    draft = hf.PromptLookupDrafter() if drafter == "prompt-lookup" else draft
    prompts = PROMPTS + [[1, 3, 4, 5, 3, 4, 5, 3, 4]]
    result = hf.speculative_generate(target, draft, prompts, max_new_tokens=12, num_draft_tokens=3,
                                     eos_token_id=[], method="block")
    for prompt, tokens in zip(prompts, result.tokens):
        assert tokens == target_greedy(target, prompt, 12, None)
    assert result.stats.num_draft_tokens > 0


def test_block_sampling_follows_target_law_and_accepts_no_fewer(models):
    """Sampled with block verification, the first two tokens follow the target's law, and
    the same requests accept at least as many drafts as token verification (up to noise)."""
    target, draft = models
    counts, block = first_two_counts(target, draft, 2000, seed=13, temperature=0.8, method="block")
    assert chi_square_pvalue(counts, exact_first_two(target, PROMPTS[0], 0.8)) > 1e-4
    _, token = first_two_counts(target, draft, 2000, seed=13, temperature=0.8)
    # Accepted drafts per request step: each is in [0, 2], so the standard error of a mean over
    # ~2000 steps is below 2 / sqrt(2000) = 0.045.
    per_step = {name: s.num_accepted_tokens / s.num_request_steps for name, s in (("block", block), ("token", token))}
    assert per_step["block"] > per_step["token"] - 2 * 0.045, per_step


def test_block_rejects_trees(models):
    target, draft = models
    with pytest.raises(ValueError, match="chains only"):
        hf.speculative_generate(target, draft, PROMPTS[:1], max_new_tokens=4, tree=hf.TreeSpec(4, 2, 2),
                                method="block")
    with pytest.raises(ValueError, match="method must be one of"):
        hf.speculative_generate(target, draft, PROMPTS[:1], max_new_tokens=4, method="blocks")


def test_lenience_one_is_exact_and_low_lenience_accepts_more(models):
    """speculative_generate(lenience=...) (issue #39): 1 gives the exact run's tokens for the same
    seeds; 0.2 accepts more drafts on these seeds; block verification refuses it."""
    target, draft = models
    kwargs = dict(max_new_tokens=12, num_draft_tokens=3, temperature=1.0, eos_token_id=[], seed=[101, 202, 303])
    exact = hf.speculative_generate(target, draft, PROMPTS[:3], **kwargs)
    assert hf.speculative_generate(target, draft, PROMPTS[:3], lenience=1.0, **kwargs).tokens == exact.tokens
    lenient = hf.speculative_generate(target, draft, PROMPTS[:3], lenience=[0.2, 0.2, 0.2], **kwargs)
    assert lenient.stats.num_accepted_tokens > exact.stats.num_accepted_tokens
    with pytest.raises(ValueError, match="lenience"):
        hf.speculative_generate(target, draft, PROMPTS[:3], lenience=0.5, method="block", **kwargs)
    with pytest.raises(ValueError, match="lenience"):
        hf.speculative_generate(target, draft, PROMPTS[:3], lenience=0.0, **kwargs)
