"""The fused C++ CPU kernels (csrc/cpu/, the ops' CPU dispatch) against the float64 reference.

Same seeds -> same tokens. The kernels compute float32 weights with float64 sums and decisions;
a token can differ from the reference only where two roundings of one quantity fall on either
side of a threshold (an accept test, a chunk race, a prefix sum of the inverse CDF). With
continuous random logits such near-ties have probability ~1e-6 per request, so every batch here
must agree exactly. The statistical fits (test_distribution.py, test_tree.py, test_filters.py),
the semantics (test_semantics.py), hostile logits (test_backends.py) and the fuzz tests run on the
kernel too (backend "cpu").
"""
import pytest
import torch

import specdec_kernels
from specdec_kernels import _ops as ops
from specdec_kernels.reference import rejection_sample_reference, tree_rejection_sample_reference
from utils import check_invariants, random_batch

VOCABS = [1, 7, 255, 257, 1000, 8193]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CHAIN = torch.ops.specdec.rejection_sample.default
TREE = torch.ops.specdec.tree_rejection_sample.default


def _same(ref, got):
    return all(torch.equal(r, g) for r, g in zip(ref, got))


def _chain_mismatches(args, method="token", filters=(None, None, None), check=True):
    ref = specdec_kernels.rejection_sample(*args, method, *filters, backend="reference")
    got = specdec_kernels.rejection_sample(*args, method, *filters, backend="cpu")
    if check:
        check_invariants(*got, args)
    same = (ref[0] == got[0]).all(1) & (ref[1] == got[1])
    return int((~same).sum()), same.numel()


def test_auto_on_cpu_tensors_is_the_cpu_kernel():
    """The CPU key of both ops belongs to the C++ kernel; "auto" and "cpu" run it."""
    for op in (ops.REJECTION_SAMPLE, ops.TREE_REJECTION_SAMPLE):
        assert ops.cpu_kernel_built(op)
        assert specdec_kernels.available_backends(op)["cpu"] == "available"
    args = random_batch(8, 3, 300, draft_probs=True, seed=0)
    assert _same(specdec_kernels.rejection_sample(*args), specdec_kernels.rejection_sample(*args, backend="cpu"))
    assert _same(CHAIN(*args), specdec_kernels.rejection_sample(*args, backend="cpu"))
    with pytest.raises(ValueError, match="backend 'cpu' needs CPU tensors"):
        specdec_kernels.backends.resolve_backend("cpu", torch.device("meta"))


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("method", ["token", "block"])
def test_chain_matches_reference(vocab, dtype, draft_probs, method):
    args = random_batch(48, 4, vocab, dtype=dtype, draft_probs=draft_probs, seed=vocab * 5 + draft_probs)
    bad, total = _chain_mismatches(args, method)
    assert bad == 0, f"{bad} of {total} requests differ"


@pytest.mark.parametrize("probs_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_chain_input_dtypes(probs_dtype, index_dtype):
    """16-bit draft probabilities, int32 / int64 ids and offsets, float64 / bf16 temperatures: the
    kernel reads them as the reference does."""
    args = list(random_batch(40, 4, 3000, dtype=torch.bfloat16, draft_probs=True, seed=3))
    args[3] = args[3].to(probs_dtype)
    args[1], args[2], args[6] = args[1].to(index_dtype), args[2].to(index_dtype), args[6].to(index_dtype) % 2**30
    args[5] = args[5].to(index_dtype) if index_dtype == torch.int64 else (args[5] % 2**31).to(torch.int32)
    for temp_dtype in (torch.float64, torch.bfloat16):
        args[4] = args[4].to(temp_dtype)
        bad, total = _chain_mismatches(tuple(args))
        assert bad == 0, f"{bad} of {total} requests differ"


def test_chain_non_contiguous_and_uniform_layouts():
    """Row strides of a wider tensor, a vocabulary stride != 1 (copied), strided 1-D inputs, and
    the padded layout (every request with K drafts)."""
    logits, ids, cu, probs, temp, seeds, offs, k = random_batch(32, 4, 777, draft_probs=True, seed=9, uniform=True)
    ref = specdec_kernels.rejection_sample(logits, ids, cu, probs, temp, seeds, offs, k, backend="reference")
    wide = torch.zeros(logits.shape[0], 1000)
    wide[:, 100:877] = logits
    pwide = torch.zeros(probs.shape[0], 900)
    pwide[:, 3:780] = probs
    strided = torch.stack([seeds, seeds], 1)[:, 1]
    for lg, pr in ((wide[:, 100:877], pwide[:, 3:780]), (logits.t().contiguous().t(), probs.t().contiguous().t())):
        got = specdec_kernels.rejection_sample(lg, torch.stack([ids, ids], 1)[:, 0], cu, pr, temp, strided, offs, k,
                                               backend="cpu")
        assert _same(ref, got)


def _filters(batch, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    top_k = torch.randint(0, 40, (batch,), generator=g)
    top_k[::4] = 0
    top_p = torch.rand(batch, generator=g) * 0.95 + 0.05
    top_p[1::3] = 1.0
    min_p = torch.rand(batch, generator=g) * 0.3
    min_p[::2] = 0.0
    return top_k, top_p, min_p


@pytest.mark.parametrize("vocab", [7, 700, 8193])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("method", ["token", "block"])
def test_chain_filters_match_reference(vocab, draft_probs, method):
    """top-k / top-p / min-p per request, mixed with unfiltered and greedy requests, with ties
    (bf16 logits rounded to steps of 1/4)."""
    args = list(random_batch(48, 3, vocab, draft_probs=draft_probs, seed=vocab + 2 * draft_probs))
    args[0] = (args[0] * 4).round() / 4
    bad, total = _chain_mismatches(tuple(args), method, _filters(48, vocab, seed=vocab))
    assert bad == 0, f"{bad} of {total} requests differ"


def test_hostile_rows_and_ids():
    """NaN / +inf / -inf logits, rows without a valid logit, greedy ties, ids outside [0, V) and
    a malformed cu (decreasing, beyond N): the reference's tokens."""
    batch, vocab = 40, 600
    args = list(random_batch(batch, 4, vocab, draft_probs=True, seed=21, accept_boost=6.0))
    logits, ids = args[0], args[1]
    g = torch.Generator().manual_seed(0)
    logits[torch.rand(logits.shape, generator=g) < 0.02] = float("nan")
    logits[torch.rand(logits.shape, generator=g) < 0.02] = float("inf")
    logits[torch.rand(logits.shape, generator=g) < 0.2] = float("-inf")
    logits[3] = float("-inf")
    logits[7] = float("nan")
    logits[11, :] = 2.0  # every token tied
    ids[torch.rand(ids.shape, generator=g) < 0.1] = -1
    ids[torch.rand(ids.shape, generator=g) < 0.05] = vocab + 3
    for method in ("token", "block"):
        bad, total = _chain_mismatches(tuple(args), method, check=False)
        assert bad == 0, (method, bad, total)
    cu = args[2].clone()
    cu[5], cu[-1] = cu[4] - 1, cu[-1]
    args[2] = cu
    ref = specdec_kernels.rejection_sample(*args, backend="reference")
    assert _same(ref, CHAIN(*args))


def _trees(batch, vocab, seed, dtype=torch.float32):
    """Random trees of 1-9 nodes (some children with the parent row's likely tokens)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 10, (batch,), generator=g)
    sizes[0] = 0 if batch > 3 else sizes[0]  # an empty request
    cu = torch.zeros(batch + 1, dtype=torch.int64)
    cu[1:] = sizes.cumsum(0)
    n = int(cu[-1])
    parents = torch.full((n,), -1, dtype=torch.int64)
    for b in range(batch):
        for j in range(1, int(sizes[b])):
            parents[int(cu[b]) + j] = int(torch.randint(0, j, (1,), generator=g))
    logits = torch.randn(n, vocab, generator=g) * 2
    tokens = torch.randint(0, vocab, (n,), generator=g)
    for v in range(n):  # a child often holds a likely token of its parent's row
        p = int(parents[v])
        if p >= 0 and torch.rand(1, generator=g) < 0.5:
            b = int(torch.searchsorted(cu[1:], torch.tensor(v), right=True))
            logits[int(cu[b]) + p, tokens[v]] += 3.0
    return logits.to(dtype), tokens, parents, cu


@pytest.mark.parametrize("vocab", [7, 300, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("filtered", [False, True])
def test_tree_matches_reference(vocab, dtype, draft_probs, filtered):
    batch = 24
    logits, tokens, parents, cu = _trees(batch, vocab, seed=vocab + draft_probs, dtype=dtype)
    g = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(logits.shape, generator=g), -1) if draft_probs else None
    temp = torch.rand(batch, generator=g) * 1.5 + 0.2
    temp[::5] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 2**40, (batch,), generator=g)
    filters = _filters(batch, vocab, seed=vocab + 1) if filtered else (None, None, None)
    args = (logits, tokens, parents, cu, probs, temp, seeds, offsets, 4, *filters)
    ref = specdec_kernels.tree_rejection_sample(*args, backend="reference")
    got = specdec_kernels.tree_rejection_sample(*args, backend="cpu")
    same = (ref[0] == got[0]).all(1) & (ref[1] == got[1]).all(1) & (ref[2] == got[2])
    assert bool(same.all()), f"{int((~same).sum())} of {batch} requests differ"


# --- lenience (docs/API.md; the spec of issue #39) -------------------------------------------

def _lenience(batch, seed):
    return torch.rand(batch, generator=torch.Generator().manual_seed(seed)) * 0.8 + 0.2


@pytest.mark.parametrize("draft_probs", [False, True])
def test_lenience_one_is_the_exact_op(draft_probs):
    args = random_batch(48, 4, 1000, draft_probs=draft_probs, seed=4)
    assert _same(CHAIN(*args), CHAIN(*args, lenience=torch.ones(48)))
    assert _same(CHAIN(*args), CHAIN(*args, lenience=torch.ones(48, dtype=torch.float64)))


@pytest.mark.parametrize("draft_probs", [False, True])
def test_lenient_chain_is_the_exact_rule_with_scaled_draft_probs(draft_probs):
    """Lenience l accepts iff u (l p(x)) < q(x) and samples max(0, q - l p) on rejection: the
    exact op's rule with draft probabilities l p. Deterministic drafts are point masses, so their
    lenient rule is the exact op's with draft probabilities l * onehot(x) (the residual at x is 0
    whenever x is rejected, as q(x) < l then)."""
    batch, vocab = 48, 2000
    args = list(random_batch(batch, 4, vocab, draft_probs=True, seed=6, accept_boost=9.0))  # q(x) ~ 0.5
    args[4] = torch.rand(batch, generator=torch.Generator().manual_seed(1)) + 0.3  # random requests
    lenience = _lenience(batch, 2)
    counts = (args[2][1:] - args[2][:-1]).long()
    row_l = torch.repeat_interleave(lenience.double(), counts)[:, None]
    if draft_probs:
        scaled = args[3].double() * row_l
    else:
        scaled = torch.nn.functional.one_hot(args[1], vocab).double() * row_l
        args[3] = None
    ref_args = list(args)
    ref_args[3] = scaled
    ref = rejection_sample_reference(*ref_args)  # float64 draft probabilities: the reference itself
    got = CHAIN(*args, lenience=lenience)
    assert _same(ref, got)
    exact = CHAIN(*args)
    assert int(got[1].sum()) > int(exact[1].sum())  # lenience accepts more drafts


def test_lenient_tree_with_draft_probs_is_the_exact_rule_with_scaled_probs():
    batch, vocab = 24, 500
    logits, tokens, parents, cu = _trees(batch, vocab, seed=8)
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(logits.shape, generator=g), -1)
    temp = torch.rand(batch, generator=g) + 0.3
    seeds = torch.arange(batch) + 100
    lenience = _lenience(batch, 5)
    owner = torch.repeat_interleave(torch.arange(batch), (cu[1:] - cu[:-1]))
    ref = tree_rejection_sample_reference(logits, tokens, parents, cu, probs.double() * lenience.double()[owner, None],
                                          temp, seeds, None, 4)
    got = TREE(logits, tokens, parents, cu, probs, temp, seeds, None, 4, lenience=lenience)
    assert _same(ref, got)


def test_lenient_chain_shaped_tree_equals_lenient_chain():
    """Deterministic tree children (a chain here) follow the chain op's lenient rule."""
    batch, k, vocab = 32, 3, 800
    logits, drafts, cu, _, temp, seeds, offsets, _ = random_batch(batch, k, vocab, draft_probs=False, seed=12,
                                                                   uniform=True)
    lenience = _lenience(batch, 7)
    chain = CHAIN(logits, drafts, cu, None, temp, seeds, offsets, k, lenience=lenience)
    tokens = torch.cat([torch.cat([torch.tensor([0]), drafts[b * k:(b + 1) * k]]) for b in range(batch)])
    parents = torch.arange(-1, k).repeat(batch)
    tree_cu = torch.arange(0, (batch + 1) * (k + 1), k + 1)
    out, _, num = TREE(logits, tokens, parents, tree_cu, None, temp, seeds, offsets, k, lenience=lenience)
    assert torch.equal(out, chain[0]) and torch.equal(num, chain[1])


def test_lenient_greedy_rule():
    """Greedy, l < 1: accept x iff x is the argmax or logit(x) - max >= ln(l); at the first other
    draft emit the argmax. l = 1: only the argmax (the lowest index among ties)."""
    vocab = 6
    row = torch.tensor([0.0, 2.0, 2.0, 1.5, -1.0, 1.0])
    logits = row.repeat(4, 1)
    drafts = torch.tensor([2, 3, 5])  # tied max (not the argmax 1), max - 0.5, max - 1
    cu = torch.tensor([0, 3])
    args = (logits, drafts, cu, None, torch.zeros(1), torch.tensor([0]), None, 3)
    expect = {1.0: ([[1, -1, -1, -1]], [0]), 0.7: ([[2, 1, -1, -1]], [1]), 0.5: ([[2, 3, 1, -1]], [2]),
              0.3: ([[2, 3, 5, 1]], [3])}
    for l, (out, num) in expect.items():
        got = CHAIN(*args, lenience=torch.tensor([l]))
        assert got[0].tolist() == out and got[1].tolist() == num, l
    # The tree: the first child in index order that passes.
    tokens = torch.tensor([0, 5, 3, 1])
    parents = torch.tensor([-1, 0, 0, 0])
    out, nodes, num = TREE(logits, tokens, parents, torch.tensor([0, 4]), None, torch.zeros(1), torch.tensor([0]),
                           None, 1, lenience=torch.tensor([0.5]))
    assert out.tolist() == [[3, 1]] and nodes.tolist() == [[0, 2]] and num.tolist() == [1]


def test_lenience_errors_name_the_argument():
    args = random_batch(3, 2, 11, draft_probs=True, seed=0)
    with pytest.raises(ValueError, match="lenience"):
        CHAIN(*args, "block", lenience=torch.ones(3))
    with pytest.raises(ValueError, match="lenience"):
        CHAIN(*args, lenience=torch.ones(4))
    with pytest.raises(TypeError, match="lenience"):
        CHAIN(*args, lenience=torch.ones(3, dtype=torch.int32))


def test_errors_name_the_argument():
    args = list(random_batch(3, 2, 11, draft_probs=True, seed=0))
    for index, value, exc, match in ((0, args[0].double(), TypeError, "target_logits"),
                                     (1, args[1].float(), TypeError, "draft_token_ids"),
                                     (3, args[3][:, :5], ValueError, "draft_probs"),
                                     (4, torch.ones(2), ValueError, "temperature"),
                                     (5, torch.ones(3), TypeError, "seeds")):
        bad = list(args)
        bad[index] = value
        with pytest.raises(exc, match=match):
            CHAIN(*bad)
    with pytest.raises(ValueError, match="method"):
        CHAIN(*args, "blocks")
    with pytest.raises(ValueError, match="top_k"):
        CHAIN(*args, "token", torch.ones(2, dtype=torch.int64))


def test_opcheck_with_filters_and_lenience():
    args = random_batch(5, 3, 37, draft_probs=True, seed=2)
    filters = _filters(5, 37, seed=1)
    torch.library.opcheck(CHAIN, args + ("token",) + filters)
    torch.library.opcheck(CHAIN, args + ("token", None, None, None, _lenience(5, 1)))
    logits, tokens, parents, cu = _trees(4, 11, seed=5)
    tree_args = (logits, tokens, parents, cu, None, torch.ones(4), torch.arange(4), None, 3)
    torch.library.opcheck(TREE, tree_args + _filters(4, 11, seed=2)[:1] + (None, None, _lenience(4, 2)))
    torch.library.opcheck(TREE, tree_args[:4] + (torch.softmax(logits, -1),) + tree_args[5:])


def test_seeds_drawn_when_absent():
    """Without seeds the kernel draws them from torch's CPU generator (as the Python wrappers do)."""
    args = list(random_batch(16, 3, 500, draft_probs=False, seed=1))
    args[5] = None
    torch.manual_seed(5)
    first = CHAIN(*args)
    torch.manual_seed(5)
    assert _same(first, CHAIN(*args))
