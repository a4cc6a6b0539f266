"""The counter-based random streams: Random123 known answers and backend agreement."""
import pytest
import torch

from specdec_kernels.reference.philox import philox4x32, philox_words, STREAM_SAMPLE
from utils import HAS_CUDA, TRITON_ON_CPU

# Known-answer vectors of Philox4x32-10 from Random123 (kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    words = philox4x32(*(torch.tensor(c) for c in counter), *(torch.tensor(k) for k in key))
    assert tuple(int(w) for w in words) == expected


def test_philox_words_key_and_counter_layout():
    # Negative seeds/offsets are reinterpreted as uint64: key = (lo, hi) words of the seed.
    seed, offset = torch.tensor(-2), torch.tensor(2**33 + 5)
    got = philox_words(seed, offset, STREAM_SAMPLE, torch.tensor(3), torch.tensor(7))
    ref = philox4x32(torch.tensor(7), torch.tensor((STREAM_SAMPLE << 24) | 3), torch.tensor(5),
                     torch.tensor(2), torch.tensor(0xFFFFFFFE), torch.tensor(0xFFFFFFFF))
    assert [int(a) for a in got] == [int(b) for b in ref]


try:
    import triton
    import triton.language as tl
    from specdec_kernels.triton.common import philox_words as _philox_words

    @triton.jit
    def _philox_test_kernel(seed_ptr, off_ptr, node_ptr, lane_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        w0, w1 = _philox_words(tl.load(seed_ptr + i), tl.load(off_ptr + i), 1, tl.load(node_ptr + i),
                               tl.load(lane_ptr + i))
        tl.store(out_ptr + 2 * i, w0.to(tl.int64))
        tl.store(out_ptr + 2 * i + 1, w1.to(tl.int64))
except ImportError:
    triton = None


@pytest.mark.skipif(triton is None or not (HAS_CUDA or TRITON_ON_CPU), reason="needs triton and a GPU or TRITON_INTERPRET=1")
def test_triton_philox_matches_torch():
    device = "cuda" if HAS_CUDA else "cpu"
    g = torch.Generator().manual_seed(0)
    n = 64
    seeds = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
    offs = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
    nodes = torch.randint(0, 2**24, (n,), generator=g, dtype=torch.int32)
    lanes = torch.randint(0, 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    out = torch.zeros(2 * n, dtype=torch.int64, device=device)
    _philox_test_kernel[(1,)](seeds.to(device), offs.to(device), nodes.to(device), lanes.to(device), out, BLOCK=n)
    w0, w1, _, _ = philox_words(seeds, offs, 1, nodes, lanes)
    got = out.cpu().view(n, 2) & 0xFFFFFFFF
    assert torch.equal(got[:, 0], w0) and torch.equal(got[:, 1], w1)
