"""Tree verification: exactness (goodness of fit against the autoregressive law), agreement
with the chain op on chain-shaped trees, exact greedy walks, layout invariants on random and
malformed trees, backends against the reference, and the op's registration."""
import numpy as np
import pytest
import torch

import specdec_kernels
from specdec_kernels import _ops as ops
from specdec_kernels.testing import MarkovPair, first_tokens_tree
from utils import HAS_CUDA, TRITON_ON_CPU, chi_square_pvalue, gpu_backends

VOCAB = 4
SAMPLES = 20000
P_MIN = 1e-4
SHAPES = {
    "binary_depth2": [-1, 0, 0, 1, 1, 2, 2],
    "ternary_root": [-1, 0, 0, 0, 1, 2, 4],
}
TREE_GPU_BACKENDS = gpu_backends(ops.TREE_REJECTION_SAMPLE)  # "cuda" where the CUDA tree kernel was built
DIST_BACKENDS = [("reference", "cpu"), ("cpu", "cpu")] + ([(b, "cuda") for b in TREE_GPU_BACKENDS] if HAS_CUDA else [])
BACKENDS = DIST_BACKENDS + ([("triton", "cpu")] if (TRITON_ON_CPU and not HAS_CUDA and "triton" in TREE_GPU_BACKENDS)
                            else [])


def tree_sampler(backend):
    def run(*args):
        return specdec_kernels.tree_rejection_sample(*args, backend=backend)
    return run


def _counts(tokens: torch.Tensor, k: int) -> np.ndarray:
    counts = np.zeros((VOCAB,) * k)
    np.add.at(counts, tuple(tokens[:, i].numpy() for i in range(k)), 1)
    return counts


def _law(pair: MarkovPair, temperature: float, k: int) -> np.ndarray:
    """The target's law of its first k tokens (k <= 3), [V] * k."""
    first = torch.softmax(pair.q0 / temperature, -1)
    nxt = torch.softmax(pair.Q / temperature, -1)  # nxt[a, b] = P(b | a)
    law = first
    if k >= 2:
        law = first[:, None] * nxt
    if k >= 3:
        law = law[:, :, None] * nxt[None, :, :]
    return law.numpy()


@pytest.mark.parametrize("backend,device", DIST_BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("deterministic,temperature", [(False, 1.0), (True, 1.0), (False, 0.7), (True, 1.6)])
def test_tree_tokens_follow_the_target(backend, device, shape, deterministic, temperature):
    pair = MarkovPair.random(VOCAB, seed=21, spread=1.2)
    tokens = first_tokens_tree(tree_sampler(backend), pair, SAMPLES, SHAPES[shape], temperature,
                               deterministic, seed=7, num_tokens=3, device=device)
    law3 = _law(pair, temperature, 3)
    for k in (1, 2, 3):
        observed = _counts(tokens, k)
        expected = law3.sum(axis=tuple(range(k, 3)))
        p = chi_square_pvalue(observed, expected)
        assert p > P_MIN, f"the first {k} tokens do not follow the target: p = {p:.2e}"


def test_control_accepting_every_child_fails():
    """A verifier that accepts every child with q(x) > 0 (draft probabilities zeroed, so
    u * p(x) < r(x) always holds) emits the draft tree's tokens: the fit must reject it."""
    pair = MarkovPair.random(VOCAB, seed=21, spread=1.2)

    def wrong(logits, tokens, parents, cu, probs, temp, seeds, offs, depth):
        return specdec_kernels.tree_rejection_sample(logits, tokens, parents, cu, probs * 0, temp, seeds,
                                                     offs, depth, backend="reference")

    tokens = first_tokens_tree(wrong, pair, SAMPLES, SHAPES["binary_depth2"], 1.0, False, seed=7, num_tokens=2)
    assert chi_square_pvalue(_counts(tokens, 2), _law(pair, 1.0, 2)) < 1e-8


# --- chain-shaped trees are chains --------------------------------------------------------

def _chain_as_tree(logits, drafts, cu, probs):
    """The chain batch as a tree batch: node t = draft t (node 0 the root), row t = chain row t."""
    counts = (cu[1:] - cu[:-1]).long()
    batch, vocab = counts.shape[0], logits.shape[1]
    cu_tree = torch.zeros(batch + 1, dtype=torch.int32)
    cu_tree[1:] = (counts + 1).cumsum(0)
    total = int(cu_tree[-1])
    tokens = torch.zeros(total, dtype=torch.int64)
    parents = torch.zeros(total, dtype=torch.int32)
    tree_probs = torch.zeros(total, vocab) if probs is not None else None
    for b in range(batch):
        s, c, n = int(cu_tree[b]), int(cu[b]), int(counts[b])
        parents[s] = -1
        parents[s + 1:s + n + 1] = torch.arange(n)
        tokens[s + 1:s + n + 1] = drafts[c:c + n]
        if probs is not None:
            tree_probs[s:s + n] = probs[c:c + n]
    return tokens, parents, cu_tree, tree_probs


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("vocab", [7, 600])
def test_chain_shaped_tree_equals_chain_op(backend, device, draft_probs, vocab):
    from utils import random_batch
    logits, drafts, cu, probs, temp, seeds, offs, k = random_batch(8, 4, vocab, draft_probs=draft_probs,
                                                                   seed=vocab + draft_probs)
    out_c, num_c = specdec_kernels.rejection_sample(logits, drafts, cu, probs, temp, seeds, offs, k,
                                                    backend="reference")
    tokens, parents, cu_tree, tree_probs = _chain_as_tree(logits, drafts, cu, probs)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    out_t, nodes, num_t = specdec_kernels.tree_rejection_sample(
        to(logits), to(tokens), to(parents), to(cu_tree), to(tree_probs), to(temp), to(seeds), to(offs), k,
        backend=backend)
    assert torch.equal(out_t.cpu(), out_c) and torch.equal(num_t.cpu(), num_c)
    path = torch.where(torch.arange(k + 1)[None, :] <= num_c[:, None], torch.arange(k + 1)[None, :], -1)
    assert torch.equal(nodes.cpu(), path.to(torch.int32))


# --- exact walks and invariants -------------------------------------------------------------

@pytest.mark.parametrize("backend,device", BACKENDS)
def test_greedy_walk_exact(backend, device):
    vocab = 8
    # Children are tested in index order. Root (argmax 3): node 1 (token 5) rejected, node 2
    # (token 3) accepted. Node 2 (argmax 1): node 4 (token 6) rejected, node 5 (token 1)
    # accepted. Node 5 (argmax 4): node 6 (token 4) accepted; depth 3 = max_depth, so node 6's
    # argmax 0 is the bonus.
    parents = torch.tensor([-1, 0, 0, 1, 2, 2, 5], dtype=torch.int32)
    tokens = torch.tensor([0, 5, 3, 2, 6, 1, 4])
    argmax = [3, 0, 1, 2, 7, 4, 0]
    logits = torch.zeros(7, vocab)
    logits[torch.arange(7), torch.tensor(argmax)] = 4.0
    cu = torch.tensor([0, 7], dtype=torch.int32)
    args = [t.to(device) for t in (logits, tokens, parents, cu)]
    out, nodes, num = specdec_kernels.tree_rejection_sample(*args, None, torch.zeros(1, device=device),
                                                           torch.tensor([3], device=device), None, 3,
                                                           backend=backend)
    assert out.cpu().tolist() == [[3, 1, 4, 0]]
    assert nodes.cpu().tolist() == [[0, 2, 5, 6]]
    assert num.cpu().tolist() == [3]


def _random_trees(batch, vocab, seed, malformed=False):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (batch,), generator=g)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    n = int(cu[-1])
    parents = torch.zeros(n, dtype=torch.int32)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    for b in range(batch):
        s = int(cu[b])
        for j in range(int(counts[b])):
            parents[s + j] = -1 if j == 0 else int(torch.randint(0, j, (1,), generator=g))
    if malformed and n > 3:
        parents[2] = 7       # parent >= child
        parents[3] = -5      # out of range
        tokens[1] = vocab + 3  # invalid id
    logits = torch.randn(n, vocab, generator=g) * 2
    logits[torch.rand(n, vocab, generator=g) < 0.3] = float("-inf")
    logits[:, 0] = 0.0
    return logits, tokens, parents, cu


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("malformed", [False, True])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_tree_invariants(backend, device, malformed, draft_probs):
    vocab = 9
    logits, tokens, parents, cu = _random_trees(12, vocab, seed=3 + malformed, malformed=malformed)
    probs = torch.softmax(torch.randn(logits.shape), -1) if draft_probs else None
    temp = torch.tensor([0.0, 1.0, 0.5] * 4)
    max_depth = 3
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    out, nodes, num = specdec_kernels.tree_rejection_sample(
        to(logits), to(tokens), to(parents), to(cu), to(probs), to(temp), torch.arange(12, device=device),
        None, max_depth, backend=backend)
    out, nodes, num = out.cpu().long(), nodes.cpu().long(), num.cpu().long()
    for b in range(12):
        s, n, d = int(cu[b]), int(cu[b + 1] - cu[b]), int(num[b])
        if n == 0:
            assert (out[b] == -1).all() and (nodes[b] == -1).all() and d == 0
            continue
        assert 0 <= d <= max_depth and nodes[b, 0] == 0
        for j in range(1, d + 1):
            child, parent = int(nodes[b, j]), int(nodes[b, j - 1])
            assert int(parents[s + child]) == parent and parent < child < n
            assert int(out[b, j - 1]) == int(tokens[s + child])
        final_row = s + int(nodes[b, d])
        assert 0 <= int(out[b, d]) < vocab and logits[final_row, int(out[b, d])] > float("-inf")
        assert (out[b, d + 1:] == -1).all() and (nodes[b, d + 1:] == -1).all()


@pytest.mark.parametrize("backend,device", [b for b in BACKENDS if b[0] != "reference"])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("vocab", [7, 9000])
def test_tree_backend_matches_reference(backend, device, draft_probs, vocab):
    logits, tokens, parents, cu = _random_trees(10, vocab, seed=vocab + draft_probs)
    probs = torch.softmax(torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)), -1) \
        if draft_probs else None
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 1.0, 2.0, 0.9, 1.0, 0.5])
    seeds = torch.arange(10) * 1000 + 17
    ref = specdec_kernels.tree_rejection_sample(logits, tokens, parents, cu, probs, temp, seeds, None, 4,
                                                backend="reference")
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = specdec_kernels.tree_rejection_sample(to(logits), to(tokens), to(parents), to(cu), to(probs), to(temp),
                                                to(seeds), None, 4, backend=backend)
    for r, o in zip(ref, got):
        assert torch.equal(r, o.cpu())


# --- registration ---------------------------------------------------------------------------

TREE_OP = torch.ops.specdec.tree_rejection_sample.default


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_tree_opcheck_and_compile(device):
    logits, tokens, parents, cu = _random_trees(4, 11, seed=5)
    args = tuple(t.to(device) for t in (logits, tokens, parents, cu)) + (
        None, None, torch.arange(4, device=device), None, 3)
    torch.library.opcheck(TREE_OP, args)

    @torch.compile(fullgraph=True)
    def verify(*a):
        out, nodes, num = specdec_kernels.tree_rejection_sample(*a)
        return out, nodes, num + 1

    out, nodes, num = verify(*args)
    ref = specdec_kernels.tree_rejection_sample(*args)
    assert torch.equal(out, ref[0]) and torch.equal(nodes, ref[1]) and torch.equal(num, ref[2] + 1)


def test_tree_shape_errors():
    logits, tokens, parents, cu = _random_trees(3, 11, seed=0)
    with pytest.raises(ValueError, match="parents must have one entry per node"):
        specdec_kernels.tree_rejection_sample(logits, tokens, parents[:-1], cu, max_depth=2)
    with pytest.raises(TypeError, match="tokens must have dtype"):
        specdec_kernels.tree_rejection_sample(logits, tokens.float(), parents, cu, max_depth=2)
    with pytest.raises(ValueError, match="max_depth must be >= 0"):
        specdec_kernels.tree_rejection_sample(logits, tokens, parents, cu, max_depth=-1)


def test_tree_validate_mode_names_the_problem():
    logits = torch.randn(4, 11)
    parents = torch.tensor([-1, 0, 0, 1], dtype=torch.int32)
    tokens = torch.tensor([0, 5, 6, 1])
    cu = torch.tensor([0, 4], dtype=torch.int32)
    cases = [
        (dict(parents=torch.tensor([-1, 0, 3, 1], dtype=torch.int32)), r"parents\[2\] = 3 .* not smaller"),
        (dict(tokens=torch.tensor([0, 5, 5, 1])), r"tokens"),  # equal siblings, deterministic drafts
        (dict(tokens=torch.tensor([0, 5, 11, 1])), r"tokens\[2\] = 11 .* outside the vocabulary"),
        (dict(max_depth=1), r"depth 2 > "),
        (dict(cu_num_nodes=torch.tensor([0, 3], dtype=torch.int32)), r"cu_num_nodes\[-1\] = 3"),
    ]
    for change, match in cases:
        kwargs = dict(target_logits=logits, tokens=tokens, parents=parents, cu_num_nodes=cu, max_depth=3)
        kwargs.update(change)
        specdec_kernels.tree_rejection_sample(**kwargs)  # no content check: runs, stays in bounds
        with pytest.raises(ValueError, match=match):
            specdec_kernels.tree_rejection_sample(**kwargs, validate=True)
