"""Lenience (issue #39, docs/ALGORITHM.md §8): the emitted law of a lenient step, measured.

The laws are exact (float64, ``specdec_kernels.reference.lenience`` for chains, an enumeration
of the walk here for trees); the fits use fixed seeds and have negative controls (the exact law,
and the law of a lenience off by a factor) that must be rejected by a wide margin. l = 1 must
give the exact op's tokens bit for bit, on every backend. The statistical fits run on the
reference on CPU, and on the Triton and CUDA kernels with a GPU (test_gpu_*); the Triton
interpreter is checked token for token against the reference on small batches.
"""
import inspect
import itertools

import numpy as np
import pytest
import torch
from scipy import stats

import specdec_kernels
from specdec_kernels.distributed import rejection_sample_vocab_parallel, tree_rejection_sample_vocab_parallel
from specdec_kernels.reference.lenience import first_token_law, greedy_first_token_law, greedy_passes
from specdec_kernels.testing import MarkovPair, chain_batch_iid, first_tokens_tree, first_two_tokens
from utils import HAS_CUDA, TRITON_ON_CPU, chi_square_pvalue, gpu_backends, random_batch

VOCAB = 6
SAMPLES = 20000
P_MIN = 1e-4      # a correct sampler fails a fit with probability 1e-4 per fixed seed
P_REJECT = 1e-8   # a negative control must fail by at least this much
TREE_PARENTS = [-1, 0, 0, 1]  # the root has two children (1, 2); node 1 has one (3)
TREE_OP = "specdec::tree_rejection_sample"


def chain_sampler(backend, lenience):
    def run(target_logits, drafts, cu, draft_probs, temperature, seeds, offsets, max_spec_len):
        lam = None if lenience is None else torch.full((cu.shape[0] - 1,), float(lenience), device=cu.device)
        return specdec_kernels.rejection_sample(target_logits, drafts, cu, draft_probs, temperature, seeds, offsets,
                                                max_spec_len, lenience=lam, backend=backend)
    return run


def tree_sampler(backend, lenience):
    def run(target_logits, tokens, parents, cu, draft_probs, temperature, seeds, offsets, max_depth):
        lam = None if lenience is None else torch.full((cu.shape[0] - 1,), float(lenience), device=cu.device)
        return specdec_kernels.tree_rejection_sample(target_logits, tokens, parents, cu, draft_probs, temperature,
                                                     seeds, offsets, max_depth, lenience=lam, backend=backend)
    return run


# ----------------------------------------------------------------------------- the laws


def lenient_pair(seed: int) -> MarkovPair:
    """A first-order target (MarkovPair.random, the last token masked: q = 0) with a draft drawn
    independently of it, so that lenience changes the law a lot (a draft close to the target,
    as MarkovPair.random's, is accepted whatever l)."""
    base = MarkovPair.random(VOCAB, seed=seed, mask_token=VOCAB - 1)
    g = torch.Generator().manual_seed(1000 + seed)
    p0 = torch.softmax(torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5, -1)
    P = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64) * 1.5, -1)
    return MarkovPair(base.q0, base.Q, p0, P)


def _rows(pair: MarkovPair, temperature: float, deterministic: bool):
    """(p0, q0, P, Q, logits0, logitsQ): the draft rows (one-hot for point-mass drafts, the
    drafter's argmax) and the target rows at ``temperature`` (greedy: the T = 1 logits)."""
    p0, P = pair.p0, pair.P
    if deterministic:
        p0 = torch.nn.functional.one_hot(p0.argmax(), VOCAB).double()
        P = torch.nn.functional.one_hot(P.argmax(-1), VOCAB).double()
    t = temperature if temperature > 0 else 1.0
    return p0, torch.softmax(pair.q0 / t, -1), P, torch.softmax(pair.Q / t, -1)


def chain_joint_law(pair: MarkovPair, temperature: float, lenience: float, k: int, deterministic: bool):
    """[V, V]: the law of the first two tokens emitted by lenient steps with k drafts each.

    First token: L0 = first_token_law(p0, q0) (greedy: x1 if it passes the greedy rule, else
    argmax). Given it is a: with k >= 2 the second token is the next position's first-token law
    L_a (an accepted x1 hands over to a lenient test of x2 ~ P[a] against Q[a]; a rejected one
    ends the step and the next step starts from a); with k = 1 an accepted x1 is followed by
    the bonus token ~ Q[a] (greedy: argmax Q[a]) and a rejected one by L_a.
    """
    p0, q0, P, Q = _rows(pair, temperature, deterministic)
    if temperature > 0:
        first = first_token_law(p0, q0, lenience)
        accepted = torch.minimum(p0, q0 / lenience)
        nxt = first_token_law(P, Q, lenience)  # row a: L_a
        bonus = Q
    else:
        first = greedy_first_token_law(p0, pair.q0, lenience)
        accepted = torch.where(greedy_passes(pair.q0, lenience), p0, 0.0)
        nxt = greedy_first_token_law(P, pair.Q, lenience)
        bonus = torch.nn.functional.one_hot(pair.Q.argmax(-1), VOCAB).double()
    if k >= 2:
        return first[:, None] * nxt
    return accepted[:, None] * bonus + (first - accepted)[:, None] * nxt


def tree_first_token_law(pair: MarkovPair, temperature: float, lenience: float, deterministic: bool):
    """[V]: the law of the first token emitted by a lenient tree step of shape TREE_PARENTS,
    by enumerating the walk over the root's children in float64 (docs/ALGORITHM.md §8):
    probabilistic children c ~ p0 i.i.d. are accepted with min(1, r(c) / (l p0(c))) and a
    rejection takes r to norm(max(0, r - l p0)); deterministic children (the top tokens of p0,
    in order) with min(1, r(c) / l), a rejection removing c from r; greedy requests take the
    first child passing the greedy rule, else the argmax. Node 3 does not affect the first token.
    """
    lam = float(lenience)
    m = sum(1 for par in TREE_PARENTS if par == 0)
    p0 = pair.p0.double()
    q0 = torch.softmax(pair.q0 / (temperature if temperature > 0 else 1.0), -1).double()
    law = torch.zeros(VOCAB, dtype=torch.float64)
    if deterministic:
        tuples = [(tuple(p0.topk(m).indices.tolist()), 1.0)]
    else:
        tuples = [(xs, float(np.prod([p0[x] for x in xs]))) for xs in itertools.product(range(VOCAB), repeat=m)]
    for xs, weight in tuples:
        if temperature <= 0:
            passes = greedy_passes(pair.q0, lam)
            pick = next((x for x in xs if passes[x]), int(pair.q0.argmax()))
            law[pick] += weight
            continue
        r = q0.clone()
        left = weight  # probability that every child so far was rejected
        for x in xs:
            if deterministic:
                alpha = min(1.0, float(r[x]) / lam)
            else:
                alpha = min(1.0, float(r[x]) / (lam * float(p0[x])))
            law[x] += left * alpha
            left *= 1.0 - alpha
            if deterministic:
                r[x] = 0.0
            else:
                r = (r - lam * p0).clamp(min=0.0)
            r = r / r.sum()
        law += left * r
    return law


def _pvalue(observed, law) -> float:
    """chi_square_pvalue, and for a point-mass law (one cell: no chi-square) 1 if every sample
    is in its cell, else 0."""
    law = np.asarray(law).ravel()
    if int((law > 0).sum()) == 1:
        return 1.0 if np.asarray(observed).ravel()[law <= 0].sum() == 0 else 0.0
    return chi_square_pvalue(observed, law)


def _joint_counts(first, second):
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (first.numpy(), second.numpy()), 1)
    return counts


# ----------------------------------------------------------------------------- the law, closed form


def test_law_sums_to_one_respects_the_bound_and_reduces_to_the_target():
    """first_token_law: a distribution, <= q / l everywhere, = q at l = 1; S = 1 - l + l P_rej."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        p = torch.softmax(torch.randn(7, generator=g, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(7, generator=g, dtype=torch.float64) * 2, -1)
        for lam in (1.0, 0.9, 0.5, 0.1):
            law = first_token_law(p, q, lam)
            assert abs(float(law.sum()) - 1) < 1e-12
            assert bool((law <= q / lam + 1e-12).all())
            p_rej = 1 - float(torch.minimum(p, q / lam).sum())
            assert abs(float((q - lam * p).clamp(min=0).sum()) - (1 - lam + lam * p_rej)) < 1e-12
        assert torch.allclose(first_token_law(p, q, 1.0), q, atol=1e-12)
    with pytest.raises(ValueError, match="lenience"):
        first_token_law(p, q, 0.0)


# ----------------------------------------------------------------------------- chains, measured

CASES = {
    # name: (deterministic drafts, temperature, lenience, drafts per step, the negative control's
    # lenience: off by a factor, chosen where the law moves by a total variation of >= 0.05)
    "probabilistic_l0.5": (False, 1.0, 0.5, 3, 0.75),
    "probabilistic_l0.3_k1": (False, 1.0, 0.3, 1, 0.45),
    "probabilistic_l0.7_temperature_0.6": (False, 0.6, 0.7, 3, 0.35),
    "deterministic_l0.5": (True, 1.0, 0.5, 3, 0.75),
    "deterministic_l0.3_k1": (True, 0.8, 0.3, 1, 0.45),
    "greedy_sampled_drafts_l0.5": (False, 0.0, 0.5, 3, 0.75),
    "greedy_sampled_drafts_l0.7_k1": (False, 0.0, 0.7, 1, 0.35),
}


def _chain_fit(backend, device, case, law_lenience=None):
    deterministic, temperature, lam, k, off = CASES[case]
    pair = lenient_pair(11)
    counts = torch.full((SAMPLES,), k)
    first, second = first_two_tokens(chain_sampler(backend, lam), pair, SAMPLES, counts, temperature,
                                     deterministic, seed=123, device=device)
    assert (first < VOCAB - 1).all() and (second < VOCAB - 1).all(), "a masked token (q = 0) was emitted"
    fits = {}
    law_of = {name: chain_joint_law(pair, temperature, l_law, k, deterministic).numpy()
              for name, l_law in (("law", lam), ("exact", 1.0), ("off", off))}
    for name in ("exact", "off"):  # the controls are informative: their laws differ
        assert 0.5 * np.abs(law_of[name] - law_of["law"]).sum() >= 0.05, name
    for name, law in law_of.items():
        fits[name] = (_pvalue(np.bincount(first.numpy(), minlength=VOCAB), law.sum(1)),
                      _pvalue(_joint_counts(first, second), law))
    return fits


@pytest.mark.parametrize("case", list(CASES))
def test_first_two_tokens_follow_the_lenient_law(case):
    fits = _chain_fit("reference", "cpu", case)
    p_first, p_joint = fits["law"]
    assert p_first > P_MIN, f"first token does not follow the lenient law: p = {p_first:.2e}"
    assert p_joint > P_MIN, f"first two tokens do not follow the lenient law: p = {p_joint:.2e}"
    # Negative controls: the target's own law (lenience ignored), and lenience off by a factor.
    assert min(fits["exact"]) < P_REJECT, f"the exact law was not rejected: p = {fits['exact']}"
    assert min(fits["off"]) < P_REJECT, f"the law of a lenience off by a factor was not rejected: p = {fits['off']}"


def test_greedy_point_mass_drafts_follow_the_rule():
    """Greedy requests are deterministic: draft x is accepted iff it is the (first) argmax or,
    with l < 1, its logit is within ln(l) of the max; l = 1 is the exact rule, under which a
    tie with an earlier argmax fails."""
    cases = [  # (row logits, draft, lenience, accepted?)
        ([2.0, 1.5, 2.0], 2, 1.0, False), ([2.0, 1.5, 2.0], 2, 0.9, True),
        ([1.0, 3.0, 0.0], 0, 0.1, True), ([1.0, 3.0, 0.0], 0, 0.2, False),  # exp(-2) = 0.135
        ([1.0, 3.0, 0.0], 1, 1.0, True), ([1.0, float("-inf"), 0.0], 1, 0.01, False),
    ]
    for row, draft, lam, accepted in cases:
        logits = torch.tensor([row, row])
        out, acc = specdec_kernels.rejection_sample(
            logits, torch.tensor([draft]), torch.tensor([0, 1], dtype=torch.int32), None, torch.zeros(1),
            torch.tensor([3]), None, 1, lenience=torch.full((1,), lam), backend="reference")
        argmax = int(torch.tensor(row).argmax())
        assert int(acc[0]) == int(accepted), (row, draft, lam)
        assert int(out[0, 0]) == (draft if accepted else argmax), (row, draft, lam)


def test_rare_token_frequency_reaches_but_does_not_pass_q_over_l():
    """The guarantee: no token is emitted with probability above q(x) / l. A draft that
    proposes a rare token most of the time makes the bound tight: P(x*) = q(x*) / l exactly
    (accepted with q / (l p), never in the residual). The negative control: that frequency is
    far above q(x*), the exact op's."""
    q = torch.tensor([0.01, 0.49, 0.3, 0.2], dtype=torch.float64)
    p = torch.tensor([0.6, 0.1, 0.15, 0.15], dtype=torch.float64)
    lam = 0.5
    law = first_token_law(p, q, lam)
    assert abs(float(law[0]) - float(q[0]) / lam) < 1e-15
    g = torch.Generator().manual_seed(4)
    logits, drafts, cu, probs = chain_batch_iid(q, p, SAMPLES, 1, generator=g)
    out, _ = specdec_kernels.rejection_sample(logits, drafts, cu, probs, None, torch.arange(SAMPLES) + 7, None, 1,
                                              lenience=torch.full((SAMPLES,), lam), backend="reference")
    first = out[:, 0].long().numpy()
    assert chi_square_pvalue(np.bincount(first, minlength=4), law.numpy()) > P_MIN
    hits = int((first == 0).sum())
    assert stats.binomtest(hits, SAMPLES, float(q[0]) / lam, alternative="greater").pvalue > P_MIN
    assert stats.binomtest(hits, SAMPLES, float(q[0]), alternative="greater").pvalue < P_REJECT


# ----------------------------------------------------------------------------- trees, measured

TREE_CASES = {
    # name: (deterministic drafts, temperature, lenience, the negative control's lenience)
    "probabilistic_l0.5": (False, 1.0, 0.5, 0.75),
    "probabilistic_l0.3_temperature_0.7": (False, 0.7, 0.3, 0.45),
    "deterministic_l0.5": (True, 1.0, 0.5, 0.75),
    "greedy_l0.15": (False, 0.0, 0.15, 0.3),
}


def _tree_fit(backend, device, case, samples=SAMPLES):
    deterministic, temperature, lam, off = TREE_CASES[case]
    pair = lenient_pair(11)
    tokens = first_tokens_tree(tree_sampler(backend, lam), pair, samples, TREE_PARENTS, temperature,
                               deterministic, seed=77, num_tokens=1, device=device)[:, 0]
    assert (tokens >= 0).all() and (tokens < VOCAB - 1).all(), "a masked token (q = 0) was emitted"
    observed = np.bincount(tokens.numpy(), minlength=VOCAB)
    law_of = {name: tree_first_token_law(pair, temperature, l_law, deterministic).numpy()
              for name, l_law in (("law", lam), ("exact", 1.0), ("off", off))}
    for name in ("exact", "off"):  # the controls are informative: their laws differ
        assert 0.5 * np.abs(law_of[name] - law_of["law"]).sum() >= 0.05, name
    return {name: _pvalue(observed, law) for name, law in law_of.items()}


@pytest.mark.parametrize("case", list(TREE_CASES))
def test_tree_first_token_follows_the_enumerated_law(case):
    fits = _tree_fit("reference", "cpu", case)
    assert fits["law"] > P_MIN, f"the tree's first token does not follow the lenient law: p = {fits['law']:.2e}"
    assert fits["exact"] < P_REJECT, f"the exact law was not rejected: p = {fits['exact']:.2e}"
    assert fits["off"] < P_REJECT, f"the law of a lenience off by a factor was not rejected: p = {fits['off']:.2e}"


def test_tree_law_of_a_chain_is_the_chain_law():
    """The enumeration agrees with the closed form where they overlap: at l = 1 it is q."""
    pair = MarkovPair.random(VOCAB, seed=5)
    for deterministic in (False, True):
        law = tree_first_token_law(pair, 1.0, 1.0, deterministic)
        assert torch.allclose(law, torch.softmax(pair.q0, -1), atol=1e-12)


# ----------------------------------------------------------------------------- identity and agreement

LENIENCE_MIX = [1.0, 0.7, 0.5, 0.3, 1.0, 0.9, 0.2, 0.6]


def _chain_case(draft_probs: bool, seed: int, batch: int = 8, vocab: int = 300, device="cpu"):
    return random_batch(batch, 3, vocab, draft_probs=draft_probs, seed=seed, device=device, accept_boost=1.5)


def _tree_case(draft_probs: bool, seed: int, batch: int = 6, vocab: int = 300, device="cpu"):
    """A batch of random trees (shape TREE_PARENTS + a third root child), mixed greedy/random."""
    g = torch.Generator().manual_seed(seed)
    parents_one = [-1, 0, 0, 1, 0, 3]
    n = len(parents_one)
    logits = torch.randn(batch * n, vocab, generator=g)
    tokens = torch.randint(0, vocab, (batch * n,), generator=g)
    parents = torch.tensor(parents_one * batch, dtype=torch.int32)
    probs = torch.softmax(torch.randn(batch * n, vocab, generator=g) * 2, -1)
    for i in range(batch * n):
        # Children likely under both rows (q ~ 0.1-0.3, p ~ 0.3), so that lenience matters.
        par = parents_one[i % n]
        if par >= 0:
            logits[(i // n) * n + par, tokens[i]] += 4.0 + float(torch.rand(1, generator=g))
            probs[(i // n) * n + par, tokens[i]] += 0.5
    probs = probs / probs.sum(-1, keepdim=True) if draft_probs else None
    cu = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32)
    temp = torch.rand(batch, generator=g) + 0.3
    temp[::3] = 0.0
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 2**30, (batch,), generator=g)
    args = (logits, tokens, parents, cu, probs, temp, seeds, offsets, 3)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _chain_backends(device):
    return ["reference"] + (gpu_backends() if device == "cuda" else (["triton"] if TRITON_ON_CPU else []))


@pytest.mark.parametrize("draft_probs", [False, True])
def test_lenience_one_is_bit_identical_chain(draft_probs):
    backends = ["reference"] + (["triton"] if TRITON_ON_CPU else [])
    for backend in backends:
        args = _chain_case(draft_probs, seed=1)
        batch = args[2].shape[0] - 1
        exact = specdec_kernels.rejection_sample(*args, backend=backend)
        ones = specdec_kernels.rejection_sample(*args, lenience=torch.ones(batch), backend=backend)
        assert torch.equal(exact[0], ones[0]) and torch.equal(exact[1], ones[1]), backend


@pytest.mark.parametrize("draft_probs", [False, True])
def test_lenience_one_is_bit_identical_tree(draft_probs):
    backends = ["reference"] + (["triton"] if TRITON_ON_CPU else [])
    for backend in backends:
        args = _tree_case(draft_probs, seed=2)
        batch = args[3].shape[0] - 1
        exact = specdec_kernels.tree_rejection_sample(*args, backend=backend)
        ones = specdec_kernels.tree_rejection_sample(*args, lenience=torch.ones(batch, dtype=torch.float64),
                                                     backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(exact, ones)), backend


@pytest.mark.parametrize("draft_probs", [False, True])
def test_exact_rows_of_a_lenient_batch_match_the_exact_call(draft_probs):
    """Lenient, exact (l = 1), greedy and filtered rows share one batch; each row's tokens are
    those of a call with its own lenience (the random streams are per request)."""
    args = _chain_case(draft_probs, seed=3)
    batch = args[2].shape[0] - 1
    lam = torch.tensor(LENIENCE_MIX[:batch])
    top_k = torch.tensor([0, 5, 0, 3, 0, 0, 2, 0][:batch])
    exact = specdec_kernels.rejection_sample(*args, top_k=top_k, backend="reference")
    mixed = specdec_kernels.rejection_sample(*args, top_k=top_k, lenience=lam, backend="reference")
    ones = lam == 1
    assert torch.equal(exact[0][ones], mixed[0][ones])
    assert int(mixed[1].sum()) >= int(exact[1].sum())  # these seeds: lenience accepts more, never fewer


def _skip_without_interpreter():
    if not TRITON_ON_CPU:
        pytest.skip("TRITON_INTERPRET=1 runs the Triton kernels on the CPU")


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_triton_interpreter_matches_reference_chain(draft_probs, filtered):
    _skip_without_interpreter()
    for seed in (4, 5):
        args = _chain_case(draft_probs, seed=seed)
        batch = args[2].shape[0] - 1
        kw = {"lenience": torch.tensor(LENIENCE_MIX[:batch])}
        if filtered:
            kw["top_k"] = torch.tensor([0, 5, 0, 3, 0, 0, 2, 0][:batch])
        ref = specdec_kernels.rejection_sample(*args, backend="reference", **kw)
        tri = specdec_kernels.rejection_sample(*args, backend="triton", **kw)
        assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1]), seed


@pytest.mark.parametrize("draft_probs", [False, True])
def test_triton_interpreter_matches_reference_tree(draft_probs):
    _skip_without_interpreter()
    args = _tree_case(draft_probs, seed=6)
    batch = args[3].shape[0] - 1
    lam = torch.tensor(LENIENCE_MIX[:batch])
    ref = specdec_kernels.tree_rejection_sample(*args, lenience=lam, backend="reference")
    tri = specdec_kernels.tree_rejection_sample(*args, lenience=lam, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(ref, tri))
    exact = specdec_kernels.tree_rejection_sample(*args, backend="reference")
    assert int(ref[2].sum()) > int(exact[2].sum()), "lenience changed nothing: the case does not test it"


@pytest.mark.parametrize("draft_probs", [False, True])
def test_cpu_kernel_matches_reference(draft_probs):
    """The fused C++ CPU kernel (backend "cpu", issue #37) implements the same lenience spec:
    token for token the reference's on mixed lenient / exact / greedy / filtered rows."""
    args = _chain_case(draft_probs, seed=15)
    batch = args[2].shape[0] - 1
    kw = dict(lenience=torch.tensor(LENIENCE_MIX[:batch]), top_k=torch.tensor([0, 5, 0, 3, 0, 0, 2, 0][:batch]))
    ref = specdec_kernels.rejection_sample(*args, backend="reference", **kw)
    cpu = specdec_kernels.rejection_sample(*args, backend="cpu", **kw)
    assert torch.equal(ref[0], cpu[0]) and torch.equal(ref[1], cpu[1])
    tree = _tree_case(draft_probs, seed=16)
    lam = torch.tensor(LENIENCE_MIX[:tree[3].shape[0] - 1])
    ref = specdec_kernels.tree_rejection_sample(*tree, lenience=lam, backend="reference")
    cpu = specdec_kernels.tree_rejection_sample(*tree, lenience=lam, backend="cpu")
    assert all(torch.equal(a, b) for a, b in zip(ref, cpu))


# ----------------------------------------------------------------------------- errors and surface


def test_lenience_errors_name_the_argument():
    args = _chain_case(False, seed=7, batch=4, vocab=16)
    with pytest.raises(ValueError, match="lenience"):
        specdec_kernels.rejection_sample(*args, method="block", lenience=torch.full((4,), 0.5))
    with pytest.raises(ValueError, match="lenience"):
        specdec_kernels.rejection_sample(*args, lenience=torch.full((3,), 0.5))
    with pytest.raises(TypeError, match="lenience"):
        specdec_kernels.rejection_sample(*args, lenience=torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="lenience"):
        specdec_kernels.rejection_sample(*args, lenience=0.5)
    for bad in (0.0, 1.5, float("nan"), -0.1):
        with pytest.raises(ValueError, match=r"lenience\[2\]"):
            specdec_kernels.rejection_sample(*args, lenience=torch.tensor([1.0, 0.5, bad, 1.0]), validate=True)
    tree = _tree_case(True, seed=8, batch=3, vocab=16)
    with pytest.raises(ValueError, match="lenience"):
        specdec_kernels.tree_rejection_sample(*tree, lenience=torch.ones(2))
    with pytest.raises(ValueError, match=r"lenience\[0\]"):
        specdec_kernels.tree_rejection_sample(*tree, lenience=torch.tensor([0.0, 1.0, 1.0]), validate=True)
    # The op itself (the fallback checks on CPU): block + lenience.
    with pytest.raises(ValueError, match="lenience"):
        torch.ops.specdec.rejection_sample(*args[:7], args[7], "block", None, None, None, torch.ones(4))


def test_padded_wrapper_passes_lenience():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 3, 20, generator=g)
    drafts = logits[:, :2].argmax(-1)  # greedy-accepted drafts: lenience must not change them
    lam = torch.tensor([0.5, 1.0, 0.2])
    out, acc = specdec_kernels.rejection_sample_padded(logits, drafts, temperature=torch.zeros(3),
                                                       seeds=torch.arange(3), lenience=lam, backend="reference")
    assert acc.tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="lenience"):
        specdec_kernels.rejection_sample_padded(logits, drafts, lenience=torch.ones(2), backend="reference")


def test_fake_kernels_take_lenience():
    """Meta tensors (torch.compile's tracing) go through the fakes with the new argument."""
    logits = torch.empty(6, 50, device="meta")
    out, acc = torch.ops.specdec.rejection_sample(
        logits, torch.empty(4, dtype=torch.int64, device="meta"), torch.empty(3, dtype=torch.int32, device="meta"),
        None, None, torch.empty(2, dtype=torch.int64, device="meta"), None, 2, "token", None, None, None,
        torch.empty(2, device="meta"))
    assert out.shape == (2, 3) and acc.shape == (2,)
    out, nodes, acc = torch.ops.specdec.tree_rejection_sample(
        logits, torch.empty(6, dtype=torch.int64, device="meta"), torch.empty(6, dtype=torch.int32, device="meta"),
        torch.empty(3, dtype=torch.int32, device="meta"), None, None, torch.empty(2, dtype=torch.int64, device="meta"),
        None, 4, None, None, None, torch.empty(2, device="meta"))
    assert out.shape == (2, 5) and nodes.shape == (2, 5)


def test_vocab_parallel_ops_do_not_take_lenience():
    """The vocabulary-parallel ops have no lenient form: the argument cannot be passed."""
    for fn in (rejection_sample_vocab_parallel, tree_rejection_sample_vocab_parallel):
        assert "lenience" not in inspect.signature(fn).parameters
        with pytest.raises(TypeError, match="lenience"):
            fn(torch.zeros(1, 4), torch.zeros(0, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
               lenience=torch.ones(1), vocab_start=0, vocab_size=4)


# ----------------------------------------------------------------------------- GPU


def _skip_without_gpu():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")


def test_gpu_lenience_one_is_bit_identical():
    _skip_without_gpu()
    for backend in gpu_backends():
        for draft_probs in (False, True):
            args = _chain_case(draft_probs, seed=11, batch=64, vocab=32000, device="cuda")
            batch = args[2].shape[0] - 1
            exact = specdec_kernels.rejection_sample(*args, backend=backend)
            ones = specdec_kernels.rejection_sample(*args, lenience=torch.ones(batch, device="cuda"), backend=backend)
            assert torch.equal(exact[0], ones[0]) and torch.equal(exact[1], ones[1]), (backend, draft_probs)
        for draft_probs in (False, True):
            args = _tree_case(draft_probs, seed=12, batch=32, vocab=32000, device="cuda")
            batch = args[3].shape[0] - 1
            exact = specdec_kernels.tree_rejection_sample(*args, backend=backend)
            ones = specdec_kernels.tree_rejection_sample(*args, lenience=torch.ones(batch, device="cuda"),
                                                         backend=backend)
            assert all(torch.equal(a, b) for a, b in zip(exact, ones)), (backend, draft_probs)


def test_gpu_kernels_match_reference():
    """Same seeds -> same tokens as the reference (mixed lenience, greedy and random rows, with
    and without draft probabilities, filtered or not), chain and tree, every GPU backend. A
    float near-tie may flip a token: at most 1 request in 200 may differ."""
    _skip_without_gpu()
    for backend in gpu_backends():
        for draft_probs, filtered in itertools.product((False, True), (False, True)):
            args = _chain_case(draft_probs, seed=13, batch=200, vocab=4099, device="cuda")
            batch = args[2].shape[0] - 1
            kw = {"lenience": torch.tensor(LENIENCE_MIX * (batch // 8), device="cuda")}
            if filtered:
                kw["top_k"] = torch.randint(0, 20, (batch,), device="cuda")
            ref = specdec_kernels.rejection_sample(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args),
                                                   backend="reference", **{k: v.cpu() for k, v in kw.items()})
            got = specdec_kernels.rejection_sample(*args, backend=backend, **kw)
            differ = int((ref[0] != got[0].cpu()).any(-1).sum())
            assert differ <= 1, (backend, draft_probs, filtered, differ)
        for draft_probs in (False, True):
            args = _tree_case(draft_probs, seed=14, batch=96, vocab=4099, device="cuda")
            batch = args[3].shape[0] - 1
            lam = torch.tensor(LENIENCE_MIX * (batch // 8), device="cuda")
            ref = specdec_kernels.tree_rejection_sample(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args),
                                                        lenience=lam.cpu(), backend="reference")
            got = specdec_kernels.tree_rejection_sample(*args, lenience=lam, backend=backend)
            differ = int((ref[0] != got[0].cpu()).any(-1).sum())
            assert differ <= 1, (backend, "tree", draft_probs, differ)


@pytest.mark.parametrize("case", ["probabilistic_l0.5", "deterministic_l0.3_k1", "greedy_sampled_drafts_l0.5"])
def test_gpu_first_two_tokens_follow_the_lenient_law(case):
    _skip_without_gpu()
    for backend in gpu_backends():
        fits = _chain_fit(backend, "cuda", case)
        assert min(fits["law"]) > P_MIN, (backend, fits["law"])
        assert min(fits["exact"]) < P_REJECT and min(fits["off"]) < P_REJECT, (backend, fits)


def test_gpu_tree_first_token_follows_the_enumerated_law():
    _skip_without_gpu()
    for backend in gpu_backends(TREE_OP):
        for case in ("probabilistic_l0.5", "deterministic_l0.5"):
            fits = _tree_fit(backend, "cuda", case)
            assert fits["law"] > P_MIN, (backend, case, fits)
            assert fits["exact"] < P_REJECT and fits["off"] < P_REJECT, (backend, case, fits)


def test_vllm_adapter_passes_lenience_per_request():
    """Our extension of the vLLM adapter: ``lenience=`` reaches the op (module and function form)."""
    from specdec_kernels.integrations import vllm as sv
    from test_vllm_adapter import expected_seeds, sampling_metadata, seeded_generators, spec_metadata, vllm_batch
    args, counts = vllm_batch(16, 4, 40, draft_probs=True, seed=7)
    logits, drafts, cu, probs, temperature, _, _, max_spec_len = args
    lam = torch.full((16,), 0.1)
    lam[::4] = 1.0
    md = spec_metadata(counts, drafts)
    sm = sampling_metadata(temperature, generators=seeded_generators(temperature, 100))
    out = sv.RejectionSampler(validate=True)(md, probs, logits, sm, lenience=lam)
    expected, _ = specdec_kernels.rejection_sample(logits, drafts, cu, probs, temperature,
                                                   expected_seeds(temperature, 100), None, max_spec_len, lenience=lam)
    exact, _ = specdec_kernels.rejection_sample(logits, drafts, cu, probs, temperature,
                                                expected_seeds(temperature, 100), None, max_spec_len)
    assert torch.equal(out, expected) and not torch.equal(out, exact)
    with pytest.raises(ValueError, match="lenience"):
        sv.RejectionSampler()(md, probs, logits, sampling_metadata(temperature), lenience=torch.ones(3))


def test_cli_lenience_arguments():
    """--lenience takes values in (0, 1], not with --method block; --csv needs --lenience."""
    from specdec_kernels.hf import cli
    args = cli.parse_args(["--sample", "--lenience", "1", "0.7", "0.5", "0.3", "--csv", "x.csv"])
    assert args.lenience == [1.0, 0.7, 0.5, 0.3] and args.csv == "x.csv"
    for bad in (["--lenience", "0"], ["--lenience", "1.5"], ["--lenience", "0.5", "--method", "block"],
                ["--csv", "x.csv"], ["--lenience", "0.5", "--tv-draws", "0"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)
