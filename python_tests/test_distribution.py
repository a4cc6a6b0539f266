"""Exactness of the verify step, measured: goodness of fit of the emitted tokens.

Fixed seeds make every test deterministic; sample sizes make them sensitive (see the
negative controls at the end, which must fail the same fits by a wide margin).
On the CPU (CI) the statistical suite runs on the reference and the C++ CPU kernel; with a GPU
it also runs on every GPU backend. Backend agreement with the reference is tested in test_backends.py.
"""
import numpy as np
import pytest
import torch

from specdec_kernels.testing import MarkovPair, chain_batch_iid, first_two_tokens, iid_pair
from utils import HAS_CUDA, chi_square_pvalue, gpu_backends, sampler

VOCAB = 6
SAMPLES = 20000
P_MIN = 1e-4  # a correct sampler fails this with probability 1e-4 per fixed seed

BACKENDS = [("reference", "cpu"), ("cpu", "cpu")] + [(b, "cuda") for b in (gpu_backends() if HAS_CUDA else [])]


def _joint_counts(first, second, vocab):
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (first.numpy(), second.numpy()), 1)
    return counts


CASES = {
    # name: (deterministic drafts, temperature, draft counts, method)
    "probabilistic": (False, 1.0, "fixed", "token"),
    "deterministic": (True, 1.0, "fixed", "token"),
    "temperature_0.6": (False, 0.6, "fixed", "token"),
    "temperature_1.7_deterministic": (True, 1.7, "fixed", "token"),
    "ragged_with_zero_drafts": (False, 1.0, "ragged", "token"),
    "ragged_deterministic": (True, 0.8, "ragged", "token"),
    "block_probabilistic": (False, 1.0, "fixed", "block"),
    "block_deterministic": (True, 1.0, "fixed", "block"),
    "block_temperature_0.6": (False, 0.6, "ragged", "block"),
}


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_first_two_tokens_follow_the_target(backend, device, case):
    deterministic, temperature, layout, method = CASES[case]
    pair = MarkovPair.random(VOCAB, seed=11, mask_token=VOCAB - 1)
    g = torch.Generator().manual_seed(5)
    counts = torch.full((SAMPLES,), 3) if layout == "fixed" else torch.randint(0, 4, (SAMPLES,), generator=g)
    first, second = first_two_tokens(sampler(backend, method), pair, SAMPLES, counts, temperature,
                                     deterministic, seed=123, device=device)
    law = pair.joint_law(temperature).numpy()
    assert (first < VOCAB - 1).all() and (second < VOCAB - 1).all(), "a masked token was emitted"
    p_first = chi_square_pvalue(np.bincount(first.numpy(), minlength=VOCAB), law.sum(1))
    p_joint = chi_square_pvalue(_joint_counts(first, second, VOCAB), law)
    assert p_first > P_MIN, f"first token does not follow the target: p = {p_first:.2e}"
    assert p_joint > P_MIN, f"first two tokens do not follow the target: p = {p_joint:.2e}"


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("num_drafts", [0, 1])
@pytest.mark.parametrize("deterministic", [False, True])
def test_large_vocab_final_token_follows_the_target(backend, device, num_drafts, deterministic):
    """V spans several sampling chunks: the chunk race and the in-chunk inverse CDF, for the
    bonus token (0 drafts) and for the residual (1 draft, often rejected): max(0, q - p), or q
    without the draft for deterministic drafts (draft_probs=None: the first token follows q
    whatever the drafts' law). Without draft probabilities the fused kernels take their other
    instances (no residual pass; the draft left out of the stream's sample)."""
    vocab, batches, batch, groups = 9000, 6, 2000, 20
    g = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 1.2, -1)
    p = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 1.2, -1)
    group_of = np.arange(vocab) * groups // vocab
    observed = np.zeros(groups)
    for i in range(batches):  # in pieces: the reference holds [B, K+1, V] in float64
        logits, drafts, cu, probs = chain_batch_iid(q, p, batch, num_drafts, generator=g, device=device)
        seeds = torch.arange(batch, dtype=torch.int64, device=device) + 99 + i * batch
        out, _ = sampler(backend)(logits, drafts, cu, None if deterministic else probs, None, seeds, None,
                                  num_drafts)
        observed += np.bincount(group_of[out[:, 0].cpu().long().numpy()], minlength=groups)
    expected = np.bincount(group_of, weights=q.numpy(), minlength=groups)
    assert chi_square_pvalue(observed, expected) > P_MIN


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("acceptance,k", [(0.5, 2), (0.8, 4), (0.9, 8)])
def test_tokens_per_step_match_theory(backend, device, acceptance, k):
    g = torch.Generator().manual_seed(int(acceptance * 100) + k)
    q, p = iid_pair(64, acceptance, generator=g)
    logits, drafts, cu, probs = chain_batch_iid(q, p, SAMPLES, k, generator=g, device=device)
    seeds = torch.arange(SAMPLES, dtype=torch.int64, device=device)
    _, num_acc = sampler(backend)(logits, drafts, cu, probs, None, seeds, None, k)
    tokens = num_acc.cpu().double() + 1
    theory = (1 - acceptance ** (k + 1)) / (1 - acceptance)
    se = tokens.std().item() / SAMPLES ** 0.5
    assert abs(tokens.mean().item() - theory) < 3 * se, (tokens.mean().item(), theory, se)


# --- negative controls: the fits above must be able to fail -------------------------------

def test_control_residual_from_q_fails():
    """A classic bug: on rejection, resample from q instead of norm(max(0, q - p)). The joint
    fit must reject it. (Verifying sampled drafts as point masses would NOT be a bug: that rule
    is exact for any draft, however it was chosen -- the "deterministic" cases test it.)"""
    pair = MarkovPair.random(VOCAB, seed=11, mask_token=VOCAB - 1)
    base = sampler("reference")
    g = torch.Generator().manual_seed(0)

    def wrong(logits, drafts, cu, probs, temp, seeds, offs, k):
        out, num_acc = base(logits, drafts, cu, probs, temp, seeds, offs, k)
        batch = cu.shape[0] - 1
        rejected = num_acc.long() < (cu[1:] - cu[:-1]).long()
        rows = cu[:-1].long() + torch.arange(batch) + num_acc.long()
        q = torch.softmax(logits[rows].double() / temp[:, None].double(), -1)
        resampled = torch.multinomial(q, 1, generator=g).squeeze(1).to(out.dtype)
        out = out.clone()
        out[rejected, num_acc.long()[rejected]] = resampled[rejected]
        return out, num_acc

    first, second = first_two_tokens(wrong, pair, SAMPLES, torch.full((SAMPLES,), 3), 1.0,
                                     False, seed=123)
    law = pair.joint_law(1.0).numpy()
    assert chi_square_pvalue(_joint_counts(first, second, VOCAB), law) < 1e-8


def test_control_wrong_temperature_fails():
    pair = MarkovPair.random(VOCAB, seed=11, mask_token=VOCAB - 1)
    base = sampler("reference")

    def wrong(logits, drafts, cu, probs, temp, seeds, offs, k):
        return base(logits, drafts, cu, probs, temp * 1.25, seeds, offs, k)

    first, second = first_two_tokens(wrong, pair, SAMPLES, torch.full((SAMPLES,), 3), 0.8,
                                     False, seed=123)
    law = pair.joint_law(0.8).numpy()
    assert chi_square_pvalue(_joint_counts(first, second, VOCAB), law) < 1e-8


def test_control_theory_detects_a_biased_accept_rule():
    """Accepting with probability (q/p)^2 instead of q/p changes tokens per step by far more
    than 3 standard errors."""
    g = torch.Generator().manual_seed(1)
    q, p = iid_pair(64, 0.8, generator=g)
    logits, drafts, cu, probs = chain_batch_iid(q, p, SAMPLES, 4, generator=g)
    sharpened = torch.log_softmax(2 * logits.double(), -1).float()  # q^2 / sum q^2: fewer accepts
    _, num_acc = sampler("reference")(sharpened, drafts, cu, probs ** 2, None,
                                      torch.arange(SAMPLES), None, 4)
    tokens = num_acc.double() + 1
    theory = (1 - 0.8 ** 5) / 0.2
    assert abs(tokens.mean().item() - theory) > 10 * tokens.std().item() / SAMPLES ** 0.5


# --- block verification accepts more, never fewer -------------------------------------------

@pytest.mark.parametrize("backend,device", BACKENDS)
def test_block_verification_binary_example(backend, device):
    """Sun et al. 2024's example: vocabulary {a, b}, draft (2/3, 1/3), target (1/3, 2/3),
    K = 2. Expected accepted drafts per step: 10/9 token by token, 11/9 with block
    verification (also by hand from the formulas of docs/ALGORITHM.md §6)."""
    samples = 40000
    q = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    p = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    logits, drafts, cu, probs = chain_batch_iid(q, p, samples, 2, generator=torch.Generator().manual_seed(9),
                                                device=device)
    seeds = torch.arange(samples, dtype=torch.int64, device=device)
    for method, expected in (("token", 10 / 9), ("block", 11 / 9)):
        _, num = sampler(backend, method)(logits, drafts, cu, probs, None, seeds, None, 2)
        num = num.cpu().double()
        se = num.std().item() / samples ** 0.5
        assert abs(num.mean().item() - expected) < 3 * se, (method, num.mean().item(), expected, se)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_block_verification_never_accepts_fewer(backend, device, deterministic):
    """On the same random inputs (Markov pair, K = 4, many seeds), block verification's mean
    number of accepted drafts is at least token verification's."""
    pair = MarkovPair.random(VOCAB, seed=11)
    means = {}
    for method in ("token", "block"):
        accepted = []

        def counting(logits, drafts, cu, probs, temp, seeds, offs, k, method=method):
            out, num = sampler(backend, method)(logits, drafts, cu, probs, temp, seeds, offs, k)
            if int(offs[0]) == 0:
                accepted.append(num.double().cpu())
            return out, num

        first_two_tokens(counting, pair, SAMPLES, torch.full((SAMPLES,), 4), 1.0, deterministic, seed=321,
                         device=device)
        means[method] = torch.cat(accepted).mean().item()
    se = 4 / SAMPLES ** 0.5
    assert means["block"] > means["token"] - 2 * se, means
