"""Exact semantics of the chain op on every backend this machine can run: greedy outputs,
output layout invariants, masked tokens, determinism and seed sensitivity."""
import pytest
import torch

from utils import HAS_CUDA, TRITON_ON_CPU, check_invariants, gpu_backends, random_batch, sampler

BACKENDS = [("reference", "cpu"), ("cpu", "cpu")]
if HAS_CUDA:
    BACKENDS += [(b, "cuda") for b in gpu_backends()]
elif TRITON_ON_CPU and "triton" in gpu_backends():
    BACKENDS += [("triton", "cpu")]


def _greedy_case(device):
    vocab = 10
    # request 0: drafts 5, 2, 7 vs argmaxes 5, 2, 1 -> accepts 2, emits 1
    # request 1: no drafts, argmax 3
    # request 2: drafts 4, 8 both match, bonus argmax 0
    # request 3: tie between 2 and 6 -> argmax 2 (lowest index); draft 6 rejected, emits 2
    argmaxes = [[5, 2, 1, 9], [3], [4, 8, 0], [2, 0]]
    drafts = [[5, 2, 7], [], [4, 8], [6]]
    rows = []
    for req in argmaxes:
        for a in req:
            row = torch.linspace(-3, 1, vocab)
            row[a] = 5.0
            rows.append(row)
    rows[-2][6] = 5.0  # the tie of request 3
    logits = torch.stack(rows)  # each request's draft rows, then its bonus row
    cu = torch.tensor([0, 3, 3, 5, 6], dtype=torch.int32)
    ids = torch.tensor(sum(drafts, []))
    expected = torch.tensor([[5, 2, 1, -1], [3, -1, -1, -1], [4, 8, 0, -1], [2, -1, -1, -1]], dtype=torch.int32)
    return logits.to(device), ids.to(device), cu.to(device), expected, torch.tensor([2, 0, 2, 0], dtype=torch.int32)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_exact(backend, device, dtype):
    logits, ids, cu, expected, expected_num = _greedy_case(device)
    temperature = torch.zeros(4, device=device)
    out, num = sampler(backend)(logits.to(dtype), ids, cu, None, temperature,
                                torch.arange(4, device=device), None, 3)
    assert torch.equal(out.cpu(), expected) and torch.equal(num.cpu(), expected_num)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_greedy_requests_ignore_random_neighbours_and_draft_probs(backend, device):
    logits, ids, cu, expected, expected_num = _greedy_case(device)
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.7], device=device)
    probs = torch.softmax(torch.randn(ids.shape[0], logits.shape[1]), -1).to(device)
    out, num = sampler(backend)(logits, ids, cu, probs, temperature, torch.arange(4, device=device), None, 3)
    greedy = torch.tensor([0, 2])
    assert torch.equal(out.cpu()[greedy], expected[greedy]) and torch.equal(num.cpu()[greedy], expected_num[greedy])


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("vocab", [1, 7, 8193])
def test_invariants_and_masked_tokens(backend, device, draft_probs, vocab):
    args = random_batch(24, 4, vocab, draft_probs=draft_probs, seed=vocab + draft_probs, device=device)
    logits = args[0].clone()
    if vocab > 1:
        g = torch.Generator().manual_seed(0)
        masked = torch.rand(logits.shape, generator=g) < 0.4
        masked[:, 0] = False  # keep one valid token per row
        logits[masked.to(device)] = float("-inf")
    args = (logits,) + args[1:]
    out, num = sampler(backend)(*args)
    check_invariants(out, num, args)
    # Every emitted token (accepted drafts and the final one) has q > 0 in its row.
    cu = args[2].cpu().long()
    for b in range(cu.shape[0] - 1):
        k = int(num[b])
        for j in range(k + 1):
            row = int(cu[b]) + b + j
            assert logits[row, int(out[b, j])].item() > float("-inf")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("draft_probs", [False, True])
def test_same_seeds_same_tokens_other_seeds_other_tokens(backend, device, draft_probs):
    args = list(random_batch(32, 3, 50, draft_probs=draft_probs, seed=1, device=device, accept_boost=1.0))
    args[4] = torch.ones_like(args[4])  # all random requests
    out1, num1 = sampler(backend)(*args)
    out2, num2 = sampler(backend)(*args)
    assert torch.equal(out1, out2) and torch.equal(num1, num2)
    args[5] = args[5] + 1
    out3, _ = sampler(backend)(*args)
    assert (out1 != out3).any(dim=1).float().mean() > 0.5
    args[5] = args[5] - 1
    args[6] = args[6] + 1  # the next step's offset: fresh streams too
    out4, _ = sampler(backend)(*args)
    assert (out1 != out4).any(dim=1).float().mean() > 0.5


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_rows_without_a_valid_logit(backend, device):
    """An all -inf / NaN row rejects its draft and yields no final token (-1)."""
    logits = torch.randn(4, 9)
    logits[1] = float("-inf")
    logits[3] = float("nan")
    ids = torch.tensor([int(logits[0].argmax()), 2])
    cu = torch.tensor([0, 2, 2], dtype=torch.int32)
    out, num = sampler(backend)(logits.to(device), ids.to(device), cu.to(device), None,
                                torch.tensor([0.0, 1.0], device=device), torch.arange(2, device=device), None, 2)
    assert out.cpu().tolist() == [[int(ids[0]), -1, -1], [-1, -1, -1]]
    assert num.cpu().tolist() == [1, 0]


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_invalid_draft_id_ends_the_chain(backend, device):
    """-1 (or any id outside [0, V)) is never accepted and the final token comes from q of
    that row -- with draft probabilities too (nothing is subtracted)."""
    vocab = 5
    logits = torch.full((3, vocab), -20.0)
    logits[:, 3] = 0.0  # q = point mass on 3 at every row
    ids = torch.tensor([3, -1])
    cu = torch.tensor([0, 2], dtype=torch.int32)
    probs = torch.full((2, vocab), 0.2)
    for p in (None, probs):
        out, num = sampler(backend)(logits.to(device), ids.to(device), cu.to(device),
                                    None if p is None else p.to(device), None,
                                    torch.tensor([7], device=device), None, 2)
        assert out.cpu().tolist() == [[3, 3, -1]] and num.cpu().tolist() == [1]
