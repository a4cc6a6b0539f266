"""Counter-based random streams shared by every backend (docs/ALGORITHM.md, "Random streams").

Philox4x32-10 (Salmon et al. 2011, the generator of Random123 and cuRAND). Every random
number the verify step uses is a pure function of (seed, offset, stream, node, lane), so
the CPU reference, the Triton kernel and the CUDA kernel draw identical numbers no matter
how they split the work. This module is the torch implementation (CPU or any device);
uint32 arithmetic is emulated in int64.
"""
from __future__ import annotations

import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
MASK32 = 0xFFFFFFFF

# Streams (bits 24..31 of counter word 1). Keep in sync with csrc/kernels/philox.cuh and
# specdec_kernels/triton/common.py.
STREAM_ACCEPT = 0
STREAM_SAMPLE = 1
NODE_BITS = 24

TWO_POW_M24 = 1.0 / (1 << 24)


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product m * x, m a 32-bit constant, x uint32 in int64."""
    x_lo = x & 0xFFFF
    x_hi = x >> 16
    p_lo = m * x_lo  # < 2^48
    p_hi = m * x_hi  # < 2^48
    mid = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49, exact in int64
    lo = mid & MASK32
    hi = ((p_hi >> 16) + (mid >> 32)) & MASK32
    return hi, lo


def philox4x32(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
    k0: torch.Tensor, k1: torch.Tensor, rounds: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 on int64 tensors holding uint32 values (broadcast together)."""
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(
        *(t.to(torch.int64) & MASK32 for t in (c0, c1, c2, c3, k0, k1))
    )
    for r in range(rounds):
        if r > 0:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_words(
    seeds: torch.Tensor, offsets: torch.Tensor, stream: int,
    node: torch.Tensor, lane: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four 32-bit words for counter (lane, stream<<24 | node, offset_lo, offset_hi), key = seed.

    seeds/offsets are int64 (reinterpreted as uint64); all arguments broadcast.
    """
    seeds = seeds.to(torch.int64)
    offsets = offsets.to(torch.int64)
    k0 = seeds & MASK32
    k1 = (seeds >> 32) & MASK32  # arithmetic shift, then mask = the uint64's high word
    c2 = offsets & MASK32
    c3 = (offsets >> 32) & MASK32
    c1 = (node.to(torch.int64) & ((1 << NODE_BITS) - 1)) | (stream << NODE_BITS)
    return philox4x32(lane.to(torch.int64), c1, c2, c3, k0, k1)


def uniform_from_word(word: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """u = (word >> 8) * 2^-24, exactly representable in float32: u in [0, 1)."""
    return (word >> 8).to(dtype) * TWO_POW_M24


def open_uniform_from_word(word: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """v = ((word >> 8) + 1) * 2^-24: v in (0, 1], for -log(v)."""
    return ((word >> 8) + 1).to(dtype) * TWO_POW_M24

# Sampling lanes: a row is sampled in chunks of SAMPLE_CHUNK vocabulary entries; chunk c uses
# the words of counter lane c (docs/ALGORITHM.md, "Sampling a row"). 256 = one warp's 16-byte
# loads of 16-bit logits; small chunks also keep float near-ties of the in-chunk inverse CDF rare.
SAMPLE_CHUNK = 256


def draw_seeds(batch: int, device: torch.device) -> torch.Tensor:
    """Per-request seeds from torch's generator on ``device`` (one small RNG launch)."""
    return torch.randint(-(2**63), 2**63 - 1, (batch,), dtype=torch.int64, device=device)
