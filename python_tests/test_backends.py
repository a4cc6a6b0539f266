"""Every fused backend against the CPU reference: same seeds -> same tokens.

In CI (no GPU) the Triton kernel runs under TRITON_INTERPRET=1 on small shapes; on a GPU the
Triton and CUDA kernels run at real vocabulary sizes. Tokens may differ only where two float
computations of one quantity fall on either side of a threshold (near-ties): the bar is
>= 99.9% of requests identical, and on the small interpreter batches all of them.
"""
import math

import pytest
import torch

import specdec_kernels
from utils import HAS_CUDA, TRITON_ON_CPU, check_invariants, gpu_backends, random_batch

VOCABS_CPU = [1, 7, 8193]
VOCABS_GPU = [7, 32000, 128256, 151936]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _agreement(backend, args, check=True, **kw):
    ref_out, ref_num = specdec_kernels.rejection_sample(*args, backend="reference", method=kw.get("method", "token"))
    out, num = specdec_kernels.rejection_sample(*args, backend=backend, **kw)
    if check:
        check_invariants(out, num, args)
    same = (out.cpu() == ref_out.cpu()).all(1) & (num.cpu() == ref_num.cpu())
    return same.float().mean().item(), same.numel()


def _pooled_agreement(backend, batches, **kw):
    """_agreement over several batches: the share of all their requests that agree, and how many."""
    total, agree = 0, 0.0
    for args in batches:
        rate, n = _agreement(backend, args, **kw)
        agree += rate * n
        total += n
    return agree / total, total


@pytest.mark.skipif(HAS_CUDA or not TRITON_ON_CPU or "triton" not in gpu_backends(),
                    reason="interpreter test: CPU machines with TRITON_INTERPRET=1")
@pytest.mark.parametrize("vocab", VOCABS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("method", ["token", "block"])
def test_triton_interpreter_matches_reference(vocab, dtype, draft_probs, method):
    args = random_batch(6, 4, vocab, dtype=dtype, draft_probs=draft_probs, seed=vocab * 7 + draft_probs)
    rate, _ = _agreement("triton", args, method=method)
    assert rate == 1.0


@pytest.mark.skipif("triton" not in gpu_backends(), reason="needs triton")
def test_triton_programs_per_sm_rule():
    """The Triton chain kernel aims at 8 programs per SM (instead of 4) only for 4-byte logits with
    draft probabilities from 640 rows on, unfiltered, and a config's programs_per_sm replaces the
    rule (DECISIONS.md, "triton-programs-per-sm": measured level or faster there on an H100, slower for B = 32 at K = 4 and
    for bf16)."""
    from specdec_kernels.triton import chain as trs
    from specdec_kernels.triton.config import VerifyConfig
    assert trs.wide_logit_rows(torch.float32, True, 640, False)
    assert not trs.wide_logit_rows(torch.float32, True, 639, False)  # B = 32 at K = 4 is 160 rows
    assert not trs.wide_logit_rows(torch.bfloat16, True, 640, False)
    assert not trs.wide_logit_rows(torch.float16, True, 640, False)
    assert not trs.wide_logit_rows(torch.float32, False, 640, False)
    assert not trs.wide_logit_rows(torch.float32, True, 640, True)  # filtered calls split as the threshold pass
    assert trs.programs_per_sm(VerifyConfig(), torch.float32, True, 640, False) == trs.PROGRAMS_PER_SM_WIDE
    assert trs.programs_per_sm(VerifyConfig(), torch.bfloat16, True, 640, False) == trs.PROGRAMS_PER_SM
    assert trs.programs_per_sm(VerifyConfig(programs_per_sm=3), torch.float32, True, 640, False) == 3


@pytest.mark.skipif("triton" not in gpu_backends(), reason="needs triton")
def test_triton_l2_prefetch_rule():
    """The whole-tile loop's L2 prefetch (inline PTX, sm_90) is asked for only on CUDA devices and
    only for 16-bit logits (DECISIONS.md, "triton-l2-prefetch": level with 4-byte logits); the interpreter never gets it."""
    from specdec_kernels.triton.common import prefetch_tiles
    cpu = torch.device("cpu")
    assert prefetch_tiles(cpu, torch.bfloat16, 2) == 0
    assert prefetch_tiles(cpu, torch.float32, 2) == 0
    if HAS_CUDA and torch.cuda.get_device_capability()[0] >= 9:
        gpu = torch.device("cuda")
        assert prefetch_tiles(gpu, torch.bfloat16, 2) == 2
        assert prefetch_tiles(gpu, torch.float16, 2) == 2
        assert prefetch_tiles(gpu, torch.float32, 2) == 0
        assert prefetch_tiles(gpu, torch.bfloat16, 0) == 0


def test_triton_config_from_env():
    """Benchmarks build configs from SPECDEC_TRITON_* variables; a mistyped knob raises instead of
    being ignored, and bad values name the field."""
    pytest.importorskip("triton")
    from specdec_kernels.triton import config
    verify, filters = config.from_env({"SPECDEC_TRITON_MAXNREG": "0", "SPECDEC_TRITON_FILTER_CAP": "16",
                                       "SPECDEC_TRITON_FILTER_KEPT_SET": "0", "PATH": "/bin"})
    assert verify == config.VerifyConfig(maxnreg=0)
    assert filters == config.FilterConfig(cap=16, kept_set=False)
    with pytest.raises(ValueError, match="SPECDEC_TRITON_HALVES"):
        config.from_env({"SPECDEC_TRITON_HALVES": "0"})
    with pytest.raises(ValueError, match="group"):
        config.VerifyConfig(group=6)
    with pytest.raises(ValueError, match="cap"):
        config.FilterConfig(cap=0)
    with config.use(config.VerifyConfig(maxnreg=0)):
        assert config.active() == (config.VerifyConfig(maxnreg=0), config.FilterConfig())
    assert config.active() == (config.VerifyConfig(), config.FilterConfig())


@pytest.mark.skipif(HAS_CUDA or not TRITON_ON_CPU or "triton" not in gpu_backends(),
                    reason="interpreter test: CPU machines with TRITON_INTERPRET=1")
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_triton_interpreter_splits_agree(num_splits):
    """Rows split over several programs combine to the same tokens (V = 3 sampling chunks)."""
    from specdec_kernels.triton.chain import rejection_sample_triton
    for draft_probs in (False, True):
        args = random_batch(4, 3, 9000, draft_probs=draft_probs, seed=num_splits)
        ref_out, ref_num = specdec_kernels.rejection_sample(*args, backend="reference")
        out, num = rejection_sample_triton(*args, num_splits=num_splits)
        assert torch.equal(out, ref_out) and torch.equal(num, ref_num)


@pytest.mark.skipif(HAS_CUDA or not TRITON_ON_CPU or "triton" not in gpu_backends(),
                    reason="interpreter test: CPU machines with TRITON_INTERPRET=1")
@pytest.mark.parametrize("programs", [2, 4, 16])
def test_triton_interpreter_block_sums_every_residual_split(monkeypatch, programs):
    """Block verification with draft probabilities sums R_i over the residual units' splits.
    Their count (from the GPU size and B) can exceed the phase-1 split count, which once set
    the padding of that sum, so splits were dropped: on an H200, request 41 of the V = 32000
    test batch (seed 1) kept 0 drafts instead of 1. Here the GPU's split counts are imposed
    on that request alone (1 phase-1 split and 2-16 residual splits)."""
    import triton

    from specdec_kernels.triton import chain as trs
    from specdec_kernels.triton.common import row_split
    vocab = 32000
    logits, drafts, cu, probs, temp, seeds, offsets, max_len = random_batch(
        256, 4, vocab, draft_probs=True, seed=1000 + vocab % 997)
    b = 41
    lo, hi = int(cu[b]), int(cu[b + 1])
    args = (logits[lo + b:hi + b + 1].contiguous(), drafts[lo:hi].contiguous(),
            torch.tensor([0, hi - lo], dtype=torch.int32), probs[lo:hi].contiguous(), temp[b:b + 1],
            seeds[b:b + 1], offsets[b:b + 1], max_len)
    ref_out, ref_num = specdec_kernels.rejection_sample(*args, backend="reference", method="block")
    assert int(ref_num[0]) == 1  # the case: one draft kept
    monkeypatch.setattr(trs, "row_split", lambda device, rows, num_groups, num_splits, per_sm: row_split(
        device, rows, num_groups, num_splits if num_splits is not None else triton.cdiv(programs, max(rows, 1)), per_sm))
    out, num = trs.rejection_sample_triton(*args, method="block")
    assert torch.equal(out, ref_out) and torch.equal(num, ref_num)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", gpu_backends() if HAS_CUDA else [])
@pytest.mark.parametrize("vocab", VOCABS_GPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("method", ["token", "block"])
def test_gpu_backend_matches_reference(backend, vocab, dtype, draft_probs, method):
    batch = 256 if vocab < 100000 else 96
    batches = (random_batch(batch, 4, vocab, dtype=dtype, draft_probs=draft_probs, seed=1000 * seed + vocab % 997,
                            device="cuda") for seed in range(3))
    rate, total = _pooled_agreement(backend, batches, method=method)
    assert rate >= 0.999, f"{backend}: {rate:.4%} of {total} requests agree"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or "triton" not in gpu_backends(), reason="needs Triton on a CUDA GPU")
@pytest.mark.parametrize("vocab", [32000, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_triton_gpu_tile_and_table_variants_agree(vocab, dtype, draft_probs):
    """The Triton chain kernel's variants on one batch: chunk tables stored from registers by
    inline PTX (default) or by tl.store write the same values, and the L2 prefetch (default for
    16-bit logits) changes no value, so the tokens are identical."""
    from specdec_kernels.triton import config
    outputs = {}
    for asm, prefetch in ((True, config.VerifyConfig().prefetch), (False, 0)):
        with config.use(config.VerifyConfig(asm_table=asm, prefetch=prefetch)):
            for method in ("token", "block"):
                args = random_batch(96, 4, vocab, dtype=dtype, draft_probs=draft_probs, uniform=method == "token",
                                    seed=vocab % 89 + draft_probs, device="cuda")
                outputs[asm, method] = specdec_kernels.rejection_sample(*args, backend="triton", method=method)
    for method in ("token", "block"):
        out, num = outputs[True, method]
        assert torch.equal(out, outputs[False, method][0]) and torch.equal(num, outputs[False, method][1])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", gpu_backends() if HAS_CUDA else [])
@pytest.mark.parametrize("vocab", [7, 32000, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("method", ["token", "block"])
def test_gpu_uniform_batches_match_reference(backend, vocab, dtype, draft_probs, method):
    """Every request with max_spec_len drafts (num_drafts == B * max_spec_len): the CUDA kernel
    then issues a row's first tiles before it reads the request's offsets (the row is b (K + 1)
    + t), so this layout takes a path of its own; B = 1 and B = 40 (one wave of units)."""
    batches = (random_batch(batch, 4, vocab, dtype=dtype, draft_probs=draft_probs, uniform=True,
                            seed=77 * seed + vocab % 991, device="cuda") for seed, batch in enumerate([1, 40, 96]))
    rate, total = _pooled_agreement(backend, batches, method=method)
    assert rate >= 0.99, f"{backend}: {rate:.4%} of {total} requests agree"


# The fused backends on their devices: the C++ CPU kernel, and the GPU's or Triton under the interpreter in CI.
FUSED_ON_DEVICES = [("cpu", "cpu")] + ([(b, "cuda") for b in gpu_backends()] if HAS_CUDA
                                       else [("triton", "cpu")] if TRITON_ON_CPU and "triton" in gpu_backends() else [])


@pytest.mark.parametrize("backend,device", FUSED_ON_DEVICES)
@pytest.mark.parametrize("draft_probs", [False, True])
def test_uniform_shape_with_malformed_offsets_matches_reference(backend, device, draft_probs):
    """num_drafts == B * max_spec_len while the offsets are not b * max_spec_len (a request
    with more drafts than max_spec_len, one with none, a decreasing pair): the kernels' guessed
    rows miss, and they must stream the rows the offsets name instead (the CUDA kernel waits for
    the guessed copies; a Triton program streams its own row again into its own slot's chunk
    table); every token equals the reference's (six requests, three fixed seeds, with and without
    accepted chains: one seed's tokens can match a wrong row's by chance; a near-tie is
    improbable)."""
    batch, k, vocab = 6, 3, 5000
    cu = [0, 0, 6, 9, 8, 15, 18]
    for seed, boost in ((5, 12.0), (6, 12.0), (0, 0.0)):
        args = list(random_batch(batch, k, vocab, draft_probs=draft_probs, uniform=True, seed=seed))
        logits, drafts = args[0], args[1]
        for b in range(batch):  # drafts likely under the rows these offsets name, so chains get accepted
            for t in range(max(0, min(cu[b + 1] - cu[b], k))):
                logits[cu[b] + b + t, drafts[cu[b] + t]] += boost
        # Rows shifted apart (q is not): a wrong row's max and sum would scale q by e^8 or more
        # (with draft probabilities the residual pass reads the right row again, so only the
        # statistics would be wrong).
        logits += 8.0 * (torch.arange(logits.shape[0]) % 4)[:, None]
        args[2] = torch.tensor(cu, dtype=torch.int32)
        args[4] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.7, 1.0])  # a greedy and a random request miss
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        ref_out, ref_num = specdec_kernels.rejection_sample(*args, backend="reference")
        out, num = specdec_kernels.rejection_sample(*args, backend=backend)
        assert torch.equal(out.cpu(), ref_out.cpu()) and torch.equal(num.cpu(), ref_num.cpu()), seed


@pytest.mark.parametrize("backend,device", FUSED_ON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("uniform", [True, False])
def test_hostile_logits_match_reference(backend, device, dtype, uniform):
    """Rows the Triton stream's FMA form cannot take (NaN, +inf, logits whose max times k
    overflows either way, a chunk of only NaN and -inf): its splits are streamed again in the
    exact form (``stream.stream_split``), and every token equals the reference's. Three seeds, so a
    token that matched by chance does not hide a wrong row."""
    batch, k, vocab = 7, 2, 1000  # four sampling chunks a row
    for seed in range(3):
        args = list(random_batch(batch, k, vocab, dtype=torch.float32, draft_probs=False, uniform=uniform,
                                 seed=40 + seed))
        logits, cu = args[0], args[2]
        g = torch.Generator().manual_seed(seed)
        rows = [(b, int(cu[b]) + b + t) for b in range(batch) for t in range(int(cu[b + 1] - cu[b]) + 1)]
        for b, row in rows:
            if b == 1:
                logits[row, int(torch.randint(0, vocab, (1,), generator=g))] = float("nan")
            elif b == 2:
                logits[row, torch.randint(0, vocab, (2,), generator=g)] = float("inf")
            elif b == 3:  # max * k overflows: 3e38 k = inf at k >= 1.2
                logits[row] = 2.0e38 + 1.0e38 * torch.rand(vocab, generator=g)
            elif b == 4:
                logits[row, 256:512] = float("nan")
                logits[row, 512:768] = float("-inf")
                logits[row, 300:400:7] = float("-inf")
            elif b == 5:  # max * k = -inf: every logit -3e38 (a uniform q)
                logits[row] = -3.0e38
            elif b == 6:
                logits[row, 10] = float("nan")
                logits[row, 700] = float("inf")
        args[0] = logits.to(dtype)
        args[4] = torch.tensor([1.0, 0.7, 1.0, 1.0, 0.5, 1.0, 0.0])
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        ref_out, ref_num = specdec_kernels.rejection_sample(*args, backend="reference")
        out, num = specdec_kernels.rejection_sample(*args, backend=backend)
        assert torch.equal(out.cpu(), ref_out.cpu()) and torch.equal(num.cpu(), ref_num.cpu()), (seed, out, ref_out)


@pytest.mark.parametrize("backend,device", FUSED_ON_DEVICES)
@pytest.mark.parametrize("draft_probs", [False, True])
def test_large_max_times_k_matches_reference(backend, device, draft_probs):
    """Logits near 10^4 at T = 1e-3 (m k ~ 1.4e7, where float32 has steps of 1): on a GPU the
    Triton stream's exponent fma(l, k, -mk) is off by mk's rounding (up to 2^0.5, a different
    factor in every chunk) until each chunk's sum is scaled back by that residual; the weights
    spread over three chunks, so chunk races and accept tests would see such an error. Every
    token equals the reference's. (The interpreter streams in the exact form: there this checks
    only the control flow at large m k.)"""
    batch, k, vocab = 96, 2, 768
    g = torch.Generator().manual_seed(11)
    args = list(random_batch(batch, k, vocab, draft_probs=draft_probs, uniform=True, seed=12))
    args[0] = 1.0e4 + 0.002 * torch.randn(args[0].shape, generator=g)  # (l - m) k spans ~-15..0
    args[4] = torch.full((batch,), 1e-3)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    ref_out, ref_num = specdec_kernels.rejection_sample(*args, backend="reference")
    out, num = specdec_kernels.rejection_sample(*args, backend=backend)
    same = (out.cpu() == ref_out.cpu()).all(1) & (num.cpu() == ref_num.cpu())
    assert bool(same.all()), f"{int((~same).sum())} of {batch} requests differ"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", gpu_backends() if HAS_CUDA else [])
@pytest.mark.parametrize("uniform", [False, True])
def test_gpu_request_field_dtypes_give_the_same_tokens(backend, uniform):
    """Temperatures in fp32 / fp64 / bf16 / fp16 and offsets, seeds and stream offsets in int32 /
    int64, with values every one of them holds exactly: the same tokens as the reference (the
    CUDA kernel reads these fields as raw words and decodes them per dtype)."""
    batch, k, vocab = 24, 3, 3000
    args = list(random_batch(batch, k, vocab, draft_probs=False, uniform=uniform, seed=11, accept_boost=10.0,
                             device="cuda"))
    args[4] = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.75, 1.5] * 4, device="cuda")
    args[5] = torch.arange(batch, device="cuda") * 7919 - 50000  # seeds (negative ones too)
    args[6] = torch.arange(batch, device="cuda") * 13
    ref_out, ref_num = specdec_kernels.rejection_sample(*args, backend="reference")
    for temp_dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for index_dtype in (torch.int32, torch.int64):
            call = list(args)
            call[2] = args[2].to(index_dtype)
            call[4] = args[4].to(temp_dtype)
            call[5], call[6] = args[5].to(index_dtype), args[6].to(index_dtype)
            out, num = specdec_kernels.rejection_sample(*call, backend=backend)
            assert torch.equal(out.cpu(), ref_out.cpu()) and torch.equal(num.cpu(), ref_num.cpu()), \
                (temp_dtype, index_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or "cuda" not in gpu_backends(), reason="needs the CUDA kernel on a GPU")
def test_cuda_kernel_takes_block_through_torch_ops():
    """torch.ops.specdec.rejection_sample(..., "block") runs the CUDA kernel (the CUDA key's
    owner) and agrees with the reference; an unknown method is an error."""
    args = random_batch(64, 3, 1000, draft_probs=True, seed=0, device="cuda")
    out, num = torch.ops.specdec.rejection_sample(*args, "block")
    ref_out, ref_num = specdec_kernels.rejection_sample(*args, method="block", backend="reference")
    same = (out.cpu() == ref_out.cpu()).all(1) & (num.cpu() == ref_num.cpu())
    assert same.float().mean().item() >= 0.98  # near-ties only (64 requests)
    with pytest.raises(RuntimeError, match="method must be 'token' or 'block'"):
        torch.ops.specdec.rejection_sample(*args, "blocks")


def _block_edge_batch(batch, k, vocab, draft_probs, seed):
    """random_batch with the paths block verification adds: invalid ids in the middle of chains
    (n' < n), rows without a valid logit (their final token may be -1), and chains longer than
    the CUDA kernel's scan batch of 8 rows, often accepted deep (q(draft) ~ 0.7 at T = 1)."""
    boost = math.log(vocab) + 3.0
    args = list(random_batch(batch, k, vocab, draft_probs=draft_probs, seed=seed, accept_boost=boost))
    logits, drafts, cu = args[0], args[1], args[2]
    g = torch.Generator().manual_seed(seed + 1)
    drafts[torch.rand(drafts.shape, generator=g) < 0.05] = -1
    dead_rows = torch.rand(logits.shape[0], generator=g) < 0.02
    logits[dead_rows] = float("-inf")
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", gpu_backends() if HAS_CUDA else [])
@pytest.mark.parametrize("k", [1, 8, 20])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_gpu_block_edge_cases_match_reference(backend, k, draft_probs):
    batches = (_block_edge_batch(batch, k, vocab, draft_probs, seed=100 * k + seed)
               for seed, (batch, vocab) in enumerate([(3, 40000), (64, 4097), (300, 1000)]))
    rate, total = _pooled_agreement(backend, batches, check=False, method="block")
    assert rate >= 0.99, f"{backend}: {rate:.4%} of {total} requests agree"
