"""GPU only: sizes the CPU suite cannot reach -- N*V above 2^31 (64-bit offsets), K up to
128, B up to 4096 -- and a soak of 10,000 random calls. Each checks the output invariants
and agreement with the reference on the requests it can afford to recompute."""
import pytest
import torch

import specdec_kernels
from utils import HAS_CUDA, check_invariants, gpu_backends, random_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
BACKENDS = gpu_backends() if HAS_CUDA else []


def _sub_batch(args, requests):
    """The same requests as a smaller ragged batch (their rows, drafts and seeds): a request's
    outputs depend only on its own rows and seeds, so the reference can check it alone."""
    logits, ids, cu, probs, temp, seeds, offs, k = args
    cu = cu.long()
    rows, drafts, counts = [], [], []
    for b in requests:
        rows.append(torch.arange(int(cu[b]) + b, int(cu[b + 1]) + b + 1, device=logits.device))
        drafts.append(torch.arange(int(cu[b]), int(cu[b + 1]), device=logits.device))
        counts.append(int(cu[b + 1] - cu[b]))
    rows, drafts = torch.cat(rows), torch.cat(drafts)
    new_cu = torch.zeros(len(requests) + 1, dtype=torch.int32, device=logits.device)
    new_cu[1:] = torch.tensor(counts, device=logits.device).cumsum(0)
    pick = torch.tensor(requests, device=logits.device)
    return (logits[rows], ids[drafts], new_cu, None if probs is None else probs[drafts],
            None if temp is None else temp[pick], seeds[pick], None if offs is None else offs[pick], k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_beyond_2_pow_31_elements(backend):
    """bf16 logits with N * V just above 2^31: the last requests' rows start past element 2^31."""
    vocab, k = 151936, 4
    batch = (2**31 // vocab) // (k + 1) + 2  # (N + B) * V > 2^31
    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.arange(0, (batch + 1) * k, k, dtype=torch.int32, device="cuda")
    logits = torch.randn(batch * (k + 1), vocab, device="cuda", dtype=torch.bfloat16, generator=g)
    assert logits.numel() > 2**31
    ids = logits.view(batch, k + 1, vocab)[:, :k].argmax(-1).reshape(-1).to(torch.int64)
    temp = torch.where(torch.arange(batch, device="cuda") % 3 == 0, 0.0, 1.0)
    seeds = torch.arange(batch, device="cuda", dtype=torch.int64)
    args = (logits, ids, cu, None, temp, seeds, None, k)
    out, num = specdec_kernels.rejection_sample(*args, backend=backend)
    last = list(range(batch - 6, batch))
    ref_out, ref_num = specdec_kernels.rejection_sample(*_sub_batch(args, last), backend="reference")
    assert torch.equal(out[last].cpu(), ref_out.cpu()) and torch.equal(num[last].cpu(), ref_num.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch,k,vocab", [(8, 128, 32000), (4096, 4, 4096), (512, 16, 128256)])
@pytest.mark.parametrize("method", ["token", "block"])
def test_large_k_and_large_batch(backend, batch, k, vocab, method):
    args = random_batch(batch, k, vocab, dtype=torch.bfloat16, draft_probs=batch <= 512, seed=batch + k,
                        device="cuda")
    out, num = specdec_kernels.rejection_sample(*args, method=method, backend=backend)
    check_invariants(out, num, args)
    some = list(range(0, batch, max(1, batch // 32)))
    ref_out, ref_num = specdec_kernels.rejection_sample(*_sub_batch(args, some), method=method, backend="reference")
    same = (out[some].cpu() == ref_out.cpu()).all(1) & (num[some].cpu() == ref_num.cpu())
    assert same.float().mean() >= 0.95  # near-ties only; the bar of 99.9% is test_backends'


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("methods", ["mixed", "block"])
def test_soak_10000_calls(backend, methods):
    """10,000 calls of random shapes back to back (counters, workspace growth, draft kinds,
    verification methods, greedy/random mixes): no CUDA error, invariants hold on a sample of
    calls. "mixed": every third call in block mode; "block": every call (issue #38)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(int(torch.randint(1, 64, (1,), generator=g)), int(torch.randint(0, 8, (1,), generator=g)),
               [7, 1000, 32000][int(torch.randint(0, 3, (1,), generator=g))]) for _ in range(64)]
    inputs = [random_batch(b, k, v, dtype=torch.bfloat16, draft_probs=i % 2 == 0, seed=i, device="cuda")
              for i, (b, k, v) in enumerate(shapes)]
    kept = []
    for call in range(10000):
        args = inputs[call % len(inputs)]
        method = "block" if methods == "block" or call % 3 == 0 else "token"
        out, num = specdec_kernels.rejection_sample(*args, method=method, backend=backend)
        if call % 997 == 0:
            kept.append((args, out, num))
    torch.cuda.synchronize()
    for args, out, num in kept:
        check_invariants(out, num, args)
