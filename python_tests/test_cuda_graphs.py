"""GPU only: the fused kernels inside CUDA graphs, and the op's CUDA registration."""
import pytest
import torch

import specdec_kernels
from utils import HAS_CUDA, gpu_backends, random_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("backend", gpu_backends() if HAS_CUDA else [])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("method", ["token", "block"])
def test_graph_replay_matches_eager(backend, draft_probs, method):
    args = list(random_batch(24, 4, 32000, dtype=torch.bfloat16, draft_probs=draft_probs, seed=5, device="cuda"))
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    specdec_kernels.rejection_sample(*static, method=method, backend=backend)  # warm-up: compile, workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, num = specdec_kernels.rejection_sample(*static, method=method, backend=backend)
    for step in range(3):
        static[5].copy_(args[5] + step)  # new seeds each replay, as an engine would
        static[6].copy_(args[6] + step)
        graph.replay()
        args_step = list(args)
        args_step[5], args_step[6] = args[5] + step, args[6] + step
        ref_out, ref_num = specdec_kernels.rejection_sample(*args_step, method=method, backend=backend)
        torch.cuda.synchronize()
        assert torch.equal(out, ref_out) and torch.equal(num, ref_num)


@pytest.mark.parametrize("backend", gpu_backends() if HAS_CUDA else [])
def test_back_to_back_calls_keep_counters_clean(backend):
    """Many launches of varying shapes and methods in a row: the self-resetting counters never leak."""
    ref = []
    outs = []
    for i in range(40):
        args = random_batch(1 + (i * 7) % 50, 1 + i % 5, [7, 4097, 32000][i % 3], draft_probs=i % 2 == 0,
                            seed=i, device="cuda")
        method = "block" if i % 4 >= 2 else "token"
        outs.append(specdec_kernels.rejection_sample(*args, method=method, backend=backend))
        ref.append(specdec_kernels.rejection_sample(*args, method=method, backend="reference"))
    agree = sum(int(torch.equal(o[0], r[0])) for o, r in zip(outs, ref))
    assert agree >= 39


@pytest.mark.parametrize("backend", gpu_backends() if HAS_CUDA else [])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_consecutive_calls_match_reference_eager_and_in_a_graph(backend, draft_probs):
    """Calls issued back to back with nothing between them, as the benchmark's graphs hold them:
    with programmatic dependent launch (CUDA, sm_90+) a call's CTAs start while the previous call
    drains and share its workspace, so each must still wait for it (docs/DECISIONS.md, "cuda-pdl", "triton-pdl")."""
    batches = [random_batch(b, 4, 32000, dtype=torch.bfloat16, draft_probs=draft_probs, seed=40 + i, device="cuda",
                            uniform=i % 2 == 1)  # uniform batches take the kernel's guessed-row start
               for i, b in enumerate([1, 32, 1, 200, 8, 1])]
    refs = [specdec_kernels.rejection_sample(*args, backend="reference") for args in batches]
    torch.cuda.synchronize()
    eager = [specdec_kernels.rejection_sample(*args, backend=backend) for args in batches]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [specdec_kernels.rejection_sample(*args, backend=backend) for args in batches]
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for (out, num), (graph_out, graph_num), (ref_out, ref_num) in zip(eager, captured, refs):
        assert torch.equal(out, graph_out) and torch.equal(num, graph_num)
        assert (out == ref_out).all(dim=1).float().mean().item() >= 0.99
        assert torch.equal(num[(out == ref_out).all(dim=1)], ref_num[(out == ref_out).all(dim=1)])
