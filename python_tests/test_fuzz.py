"""Property/fuzz suite (hypothesis): random ragged layouts, dtypes, vocabulary sizes,
parameters and hostile values. Invariants must hold on every backend, and every fused
backend must give the reference's tokens. In CI the fused backend is the Triton kernel in
the interpreter; with a GPU, Triton and CUDA on the device. Examples are derandomized so a
failure reproduces, and small so the interpreter stays fast.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec_kernels
from specdec_kernels import _ops as ops
from utils import HAS_CUDA, TRITON_ON_CPU, check_invariants, gpu_backends

if HAS_CUDA:
    FUSED = [(b, "cuda") for b in gpu_backends()]
    FUSED_TREE = [(b, "cuda") for b in gpu_backends(ops.TREE_REJECTION_SAMPLE)]
elif TRITON_ON_CPU and "triton" in gpu_backends():
    FUSED = FUSED_TREE = [("triton", "cpu")]
else:
    FUSED = FUSED_TREE = []
# The C++ CPU kernel (the ops' CPU dispatch), on every machine.
FUSED, FUSED_TREE = [("cpu", "cpu")] + FUSED, [("cpu", "cpu")] + FUSED_TREE

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VOCABS = [1, 2, 3, 7, 255, 256, 257, 4097]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SPECIAL_LOGITS = ["none", "nan", "posinf", "neginf", "row_all_neginf", "row_all_nan", "single_finite", "huge"]
DRAFT_PROBS = ["none", "normalized", "unnormalized", "zero_at_draft", "nan", "negative"]
TEMPERATURES = [None, 0.0, 1e-6, 0.5, 1.0, 1e6, "mixed"]


@st.composite
def chain_batches(draw):
    batch = draw(st.integers(0, 5))
    max_spec_len = draw(st.integers(0, 6))
    vocab = draw(st.sampled_from(VOCABS))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_spec_len + 1, (batch,), generator=g)
    if draw(st.booleans()):
        counts[:] = 0  # every request without drafts
    cu = torch.zeros(batch + 1, dtype=torch.int64)
    cu[1:] = counts.cumsum(0)
    n = int(cu[-1])
    logits = torch.randn(n + batch, vocab, generator=g) * draw(st.sampled_from([0.5, 3.0, 30.0]))
    ids = torch.randint(0, vocab, (n,), generator=g)
    bad_ids = draw(st.sampled_from(["valid", "minus_one", "too_large"]))
    if n and bad_ids != "valid":
        where = torch.rand(n, generator=g) < 0.3
        ids[where] = -1 if bad_ids == "minus_one" else vocab + 5
    special = draw(st.sampled_from(SPECIAL_LOGITS))
    rows = logits.shape[0]
    if rows:
        pick = torch.rand(logits.shape, generator=g) < 0.2
        row = int(torch.randint(0, rows, (1,), generator=g))
        if special == "nan":
            logits[pick] = float("nan")
        elif special == "posinf":
            logits[pick & (torch.rand(logits.shape, generator=g) < 0.1)] = float("inf")
        elif special == "neginf":
            logits[pick] = float("-inf")
        elif special == "row_all_neginf":
            logits[row] = float("-inf")
        elif special == "row_all_nan":
            logits[row] = float("nan")
        elif special == "single_finite":
            logits[row] = float("-inf")
            logits[row, int(torch.randint(0, vocab, (1,), generator=g))] = 1.0
        elif special == "huge":
            logits[pick] = 6.0e4  # overflows to inf in fp16
    probs_kind = draw(st.sampled_from(DRAFT_PROBS))
    probs = None
    if probs_kind != "none":
        probs = torch.softmax(torch.randn(n, vocab, generator=g), -1)
        if probs_kind == "unnormalized":
            probs = probs * 3.0
        elif probs_kind == "zero_at_draft" and n:
            probs[torch.arange(n), ids.clamp(0, vocab - 1)] = 0.0
        elif probs_kind == "nan" and n:
            probs[0, :] = float("nan")
        elif probs_kind == "negative" and n:
            probs[:, 0] = -0.5
    temp_kind = draw(st.sampled_from(TEMPERATURES))
    if temp_kind is None:
        temperature = None
    elif temp_kind == "mixed":
        temperature = torch.tensor([0.0, 1e-6, 0.7, 1e6, 1.0][:batch] + [1.0] * max(0, batch - 5))
    else:
        temperature = torch.full((batch,), float(temp_kind))
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 2**40, (batch,), generator=g) if draw(st.booleans()) else None
    ids = ids.to(draw(st.sampled_from([torch.int32, torch.int64])))
    if batch and draw(st.integers(0, 4)) == 0:
        # Malformed offsets (not starting at 0, decreasing, negative, past N): rows and drafts
        # outside the tensors read as masked; nothing is read out of bounds.
        cu = torch.randint(-3, n + 6, (batch + 1,), generator=g)
    cu = cu.to(draw(st.sampled_from([torch.int32, torch.int64])))
    return (logits.to(dtype), ids, cu, probs, temperature, seeds, offsets, max_spec_len)


def _to(args, device):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@FUZZ
@given(chain_batches())
def test_chain_fuzz_reference_invariants(args):
    out, num = specdec_kernels.rejection_sample(*args, backend="reference")
    _check_chain_outputs(out, num, args)


def _check_chain_outputs(out, num, args):
    """check_invariants, except that a row without a valid logit (or outside the tensor, with
    malformed offsets) yields -1 as its final token."""
    logits, ids, cu, _, _, _, _, max_spec_len = args
    out, num = out.cpu().long(), num.cpu().long()
    batch = cu.shape[0] - 1
    assert out.shape == (batch, max_spec_len + 1) and num.shape == (batch,)
    valid_rows = (~torch.isnan(logits.float()) & (logits.float() > float("-inf"))).any(-1)
    for b in range(batch):
        k = int(num[b])
        assert 0 <= k <= max(0, min(int(cu[b + 1] - cu[b]), max_spec_len))
        assert out[b, :k].tolist() == ids[int(cu[b]):int(cu[b]) + k].long().tolist()
        final_row = int(cu[b]) + b + k
        token = int(out[b, k])
        if 0 <= final_row < logits.shape[0] and valid_rows[final_row]:
            assert 0 <= token < logits.shape[1]
            value = logits[final_row, token].float()
            assert not torch.isnan(value) and value > float("-inf"), "emitted a token with q = 0"
        else:
            assert token == -1
        assert (out[b, k + 1:] == -1).all()


@pytest.mark.skipif(not FUSED, reason="no fused backend here (Triton needs a GPU or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("backend,device", FUSED)
@FUZZ
@given(args=chain_batches())
def test_chain_fuzz_fused_matches_reference(backend, device, args):
    ref_out, ref_num = specdec_kernels.rejection_sample(*args, backend="reference")
    out, num = specdec_kernels.rejection_sample(*_to(args, device), backend=backend)
    _check_chain_outputs(out, num, args)
    assert torch.equal(out.cpu(), ref_out) and torch.equal(num.cpu(), ref_num)


@st.composite
def tree_batches(draw):
    batch = draw(st.integers(0, 4))
    vocab = draw(st.sampled_from([1, 3, 7, 257, 4097]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (batch,), generator=g)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    n = int(cu[-1])
    parents = torch.zeros(n, dtype=torch.int32)
    for b in range(batch):
        for j in range(int(counts[b])):
            parents[int(cu[b]) + j] = -1 if j == 0 else int(torch.randint(0, j, (1,), generator=g))
    logits = torch.randn(n, vocab, generator=g) * 2
    tokens = torch.randint(0, vocab, (n,), generator=g)
    if n and draw(st.booleans()):  # malformed links and ids
        which = torch.rand(n, generator=g) < 0.25
        parents[which] = torch.randint(-3, 12, (int(which.sum()),), generator=g, dtype=torch.int32)
        tokens[torch.rand(n, generator=g) < 0.15] = -1
    if n and draw(st.booleans()):
        logits[torch.rand(logits.shape, generator=g) < 0.3] = float("-inf")
        logits[int(torch.randint(0, n, (1,), generator=g))] = float("nan")
    probs = torch.softmax(torch.randn(n, vocab, generator=g), -1) if draw(st.booleans()) else None
    temperature = torch.tensor([0.0, 0.6, 1.0, 1e-6][:batch]) if draw(st.booleans()) else None
    seeds = torch.randint(0, 2**40, (batch,), generator=g)
    max_depth = draw(st.integers(0, 4))
    dtype = draw(st.sampled_from(DTYPES))
    return (logits.to(dtype), tokens, parents, cu, probs, temperature, seeds, None, max_depth)


@pytest.mark.skipif(not FUSED_TREE, reason="no fused tree backend here (a GPU, or Triton with TRITON_INTERPRET=1)")
@pytest.mark.parametrize("backend,device", FUSED_TREE)
@FUZZ
@given(args=tree_batches())
def test_tree_fuzz_fused_matches_reference(backend, device, args):
    ref = specdec_kernels.tree_rejection_sample(*args, backend="reference")
    got = specdec_kernels.tree_rejection_sample(*_to(args, device), backend=backend)
    for r, o in zip(ref, got):
        assert torch.equal(r, o.cpu())
    out, nodes, num = ref
    vocab = args[0].shape[1]
    assert ((out == -1) | ((out >= 0) & (out < vocab))).all()
    assert (num >= 0).all() and (num <= args[8]).all()
