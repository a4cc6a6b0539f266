"""The op as engines use it: registration (opcheck), torch.compile, errors, layouts."""
import pytest
import torch

import specdec_kernels
from utils import HAS_CUDA, TRITON_ON_CPU, gpu_backends, random_batch

OP = torch.ops.specdec.rejection_sample.default
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
BACKENDS = [("reference", "cpu"), ("cpu", "cpu")] + (
    [(b, "cuda") for b in gpu_backends()] if HAS_CUDA else [("triton", "cpu")] if TRITON_ON_CPU else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft_probs", [False, True])
def test_opcheck(device, draft_probs):
    args = random_batch(5, 3, 37, draft_probs=draft_probs, seed=2, device=device)
    torch.library.opcheck(OP, args)
    # Optional arguments absent (seeds and offsets must be given for a deterministic check).
    logits, ids, cu, probs, _, seeds, _, k = args
    torch.library.opcheck(OP, (logits, ids, cu, probs, None, seeds, None, k))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    args = random_batch(5, 3, 37, draft_probs=True, seed=3, device=device)

    def verify(logits, ids, cu, probs, temperature, seeds, offsets):
        out, num = specdec_kernels.rejection_sample(logits, ids, cu, probs, temperature, seeds, offsets, 3)
        return out, num + 1

    compiled = torch.compile(verify, fullgraph=True, dynamic=True)
    out, num = compiled(*args[:7])
    ref_out, ref_num = verify(*args[:7])
    assert torch.equal(out, ref_out) and torch.equal(num, ref_num)
    # A second batch size goes through the same dynamic graph.
    args2 = random_batch(9, 3, 37, draft_probs=True, seed=4, device=device)
    out2, _ = compiled(*args2[:7])
    assert out2.shape == (9, 4)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        logits = torch.empty(13, 100, dtype=torch.bfloat16)
        ids = torch.empty(10, dtype=torch.int64)
        cu = torch.empty(4, dtype=torch.int32)
        out, num = torch.ops.specdec.rejection_sample(logits, ids, cu, None, None, None, None, 6)
    assert out.shape == (3, 7) and out.dtype == torch.int32 and num.shape == (3,)


def test_padded_equals_ragged():
    g = torch.Generator().manual_seed(0)
    batch, k, vocab = 6, 3, 40
    logits = torch.randn(batch, k + 1, vocab, generator=g)
    ids = torch.randint(0, vocab, (batch, k), generator=g)
    probs = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)
    counts = torch.tensor([3, 0, 1, 3, 2, 0])
    seeds = torch.arange(batch) + 5
    for p in (None, probs):
        out_p, num_p = specdec_kernels.rejection_sample_padded(logits, ids, p, None, seeds, None, counts)
        # The same requests laid out ragged: each keeps counts[b] drafts and then row counts[b].
        rows = torch.cat([logits[b, : counts[b] + 1] for b in range(batch)])
        ragged_ids = torch.cat([ids[b, : counts[b]] for b in range(batch)])
        ragged_p = None if p is None else torch.cat([p[b, : counts[b]] for b in range(batch)])
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        cu[1:] = counts.cumsum(0)
        out_r, num_r = specdec_kernels.rejection_sample(rows, ragged_ids, cu, ragged_p, None, seeds, None, k)
        assert torch.equal(out_p, out_r) and torch.equal(num_p, num_r)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_non_contiguous_inputs(backend, device):
    logits, ids, cu, probs, temp, seeds, offs, k = random_batch(7, 3, 33, draft_probs=True, seed=8, device=device)
    ref = specdec_kernels.rejection_sample(logits, ids, cu, probs, temp, seeds, offs, k, backend="reference")
    wide = torch.zeros(logits.shape[0], 50, dtype=logits.dtype, device=device)
    wide[:, 5:38] = logits  # row stride 50
    col_major = logits.t().contiguous().t()  # vocabulary stride != 1
    strided_ids = torch.stack([ids, ids], 1)[:, 0]
    strided_seeds = torch.stack([seeds, seeds], 1)[:, 1]
    for lg in (wide[:, 5:38], col_major):
        out = specdec_kernels.rejection_sample(lg, strided_ids, cu, probs.t().contiguous().t(), temp,
                                               strided_seeds, offs, k, backend=backend)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_available_backends_reports_every_backend():
    status = specdec_kernels.available_backends()
    assert set(status) == {"reference", "cpu", "triton", "cuda"}
    assert status["cpu"] == "available"  # every build compiles the CPU kernel
    if not HAS_CUDA:
        with pytest.raises((ValueError, RuntimeError), match="cuda"):
            specdec_kernels.rejection_sample(*random_batch(2, 1, 5, draft_probs=False, seed=0), backend="cuda")


# --- errors name the argument ---------------------------------------------------------------

def _args():
    return list(random_batch(3, 2, 11, draft_probs=True, seed=0))


@pytest.mark.parametrize("index,value,exc,match", [
    (0, torch.randn(4, 5, 11), ValueError, "target_logits must be 2-D"),
    (0, torch.zeros(3, 11, dtype=torch.int32), TypeError, "target_logits must have dtype"),
    (0, torch.randn(2, 11), ValueError, "expected N \\+ B"),
    (1, torch.zeros(3, dtype=torch.float32), TypeError, "draft_token_ids must have dtype"),
    (2, torch.zeros(4, 1, dtype=torch.int32), ValueError, "cu_num_draft_tokens must be 1-D"),
    (3, torch.rand(3, 10), ValueError, "draft_probs must have shape"),
    (4, torch.rand(5), ValueError, "temperature must have shape"),
    (5, torch.rand(3), TypeError, "seeds must have dtype"),
    (6, torch.zeros(2, dtype=torch.int64), ValueError, "offsets must have shape"),
    (7, -1, ValueError, "max_spec_len must be >= 0"),
    (7, 2.0, TypeError, "max_spec_len must be an int"),
    (0, "logits", TypeError, "target_logits must be a torch.Tensor"),
])
def test_shape_dtype_errors(index, value, exc, match):
    args = _args()
    args[index] = value
    with pytest.raises(exc, match=match):
        specdec_kernels.rejection_sample(*args)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_device_mismatch_error():
    args = _args()
    args[0] = args[0].cuda()
    with pytest.raises(ValueError, match="draft_token_ids is on cpu"):
        specdec_kernels.rejection_sample(*args)


def _with(**changes):
    logits, ids, cu, probs, temp, seeds, offs, k = _args()
    d = dict(target_logits=logits, draft_token_ids=ids, cu_num_draft_tokens=cu, draft_probs=probs,
             temperature=temp, seeds=seeds, offsets=offs, max_spec_len=k)
    d.update(changes)
    return d


def test_content_errors_only_with_validate():
    base = _with()
    n = base["draft_token_ids"].shape[0]
    bad_ids = base["draft_token_ids"].clone()
    bad_ids[-1] = 11
    cases = [
        (dict(draft_token_ids=bad_ids), r"draft_token_ids\[\d+\] = 11 \(request \d\) is outside the vocabulary"),
        (dict(temperature=torch.tensor([1.0, -0.5, 0.0])), r"temperature\[1\] = -0.5"),
        (dict(max_spec_len=0), r"more than max_spec_len = 0"),
    ]
    probs = base["draft_probs"].clone()
    if n:
        probs[0, 3] = float("nan")
        cases.append((dict(draft_probs=probs), "draft_probs row 0 .* non-finite"))
        cases.append((dict(draft_probs=base["draft_probs"] * 2), r"draft_probs row 0 .* sums to 2.0000"))
    for change, match in cases:
        kwargs = _with(**change)
        specdec_kernels.rejection_sample(**kwargs)  # no content check: runs, stays in bounds
        with pytest.raises(ValueError, match=match):
            specdec_kernels.rejection_sample(**kwargs, validate=True)


def test_cu_content_errors():
    ids = torch.tensor([1, 2, 3])
    logits = torch.randn(5, 7)
    for cu, match in ((torch.tensor([1, 2, 3]), r"cu_num_draft_tokens\[0\] must be 0"),
                      (torch.tensor([0, 3, 2]), "non-decreasing: request 1"),
                      (torch.tensor([0, 1, 2]), r"cu_num_draft_tokens\[-1\] = 2 must equal")):
        specdec_kernels.rejection_sample(logits, ids, cu.int(), max_spec_len=3)  # in bounds, no error
        with pytest.raises(ValueError, match=match):
            specdec_kernels.rejection_sample(logits, ids, cu.int(), max_spec_len=3, validate=True)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        specdec_kernels.rejection_sample(*_args(), backend="fast")
