// Philox4x32-10 and the counter layout of docs/ALGORITHM.md §2 ("Random streams").
//
// Torch-free and __host__ __device__, so the same code is checked on the host against the
// Random123 known-answer vectors. Keep in sync with specdec_kernels/reference/philox.py (the torch
// implementation the CPU reference uses) and specdec_kernels/triton/common.py.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SPECDEC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SPECDEC_HOST_DEVICE inline
#endif

namespace specdec {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

// Streams live in bits 24..31 of counter word 1, the node in bits 0..23.
constexpr uint32_t kStreamAccept = 0;
constexpr uint32_t kStreamSample = 1;
constexpr int kNodeBits = 24;
constexpr uint32_t kNodeMask = (1u << kNodeBits) - 1u;

struct PhiloxBlock {
  uint32_t x, y, z, w;
};

SPECDEC_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const uint64_t product = static_cast<uint64_t>(a) * b;
  lo = static_cast<uint32_t>(product);
  hi = static_cast<uint32_t>(product >> 32);
#endif
}

// Philox4x32 with 10 rounds: the key schedule and round function of Random123.
SPECDEC_HOST_DEVICE PhiloxBlock philox4x32_10(PhiloxBlock ctr, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kPhiloxM0, ctr.x, hi0, lo0);
    philox_mulhilo(kPhiloxM1, ctr.z, hi1, lo1);
    ctr = PhiloxBlock{hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0};
  }
  return ctr;
}

// The four words of counter (lane, stream << 24 | node, offset lo, offset hi) under key
// (seed lo, seed hi); seed and offset are int64 values reinterpreted as uint64.
SPECDEC_HOST_DEVICE PhiloxBlock philox_words(uint64_t seed, uint64_t offset, uint32_t stream,
                                             uint32_t node, uint32_t lane) {
  const PhiloxBlock ctr{lane, (stream << kNodeBits) | (node & kNodeMask),
                        static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// u = (word >> 8) * 2^-24: exact in float32, in [0, 1).
SPECDEC_HOST_DEVICE float uniform_from_word(uint32_t word) {
  return static_cast<float>(word >> 8) * 5.9604644775390625e-8f;
}

// v = ((word >> 8) + 1) * 2^-24: in (0, 1], so -log(v) is finite or 0.
SPECDEC_HOST_DEVICE float open_uniform_from_word(uint32_t word) {
  return static_cast<float>((word >> 8) + 1u) * 5.9604644775390625e-8f;
}

}  // namespace specdec
