// Torch-free vector helpers of the CPU kernels: 8-float vectors (GCC/Clang vector extensions, so
// the compiler emits SSE, AVX or NEON code without intrinsics), loads of float32 / bfloat16 /
// float16 values as float32, sanitizing, and a polynomial exp2.
//
// The exp2 is float32 with a maximum error of ~2 ulp (Cephes' exp2f polynomial on [-0.5, 0.5]
// with the exponent added to the bits); results below 2^-126 are 0, so weights more than 126
// binades below their chunk's or row's maximum count as 0 (the float64 reference keeps them:
// a difference of probability < 2^-126 per token).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace specdec::cpu {

// 16-byte vectors: native on every x86-64 (SSE2) and on NEON, so comparisons and selects compile
// to vector instructions (32-byte vectors without AVX are lowered lane by lane, with branches).
constexpr int kLanes = 4;
typedef float vf __attribute__((vector_size(16)));
typedef float vf2 __attribute__((vector_size(8)));
typedef int32_t vi __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(8)));
typedef double vd __attribute__((vector_size(16)));

// 16-bit storage types (the raw bits of torch's bfloat16 / float16).
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

inline vf splat(float x) { return vf{} + x; }

// mask ? a : b lane by lane (mask: all ones or zeros, from a vector comparison), with bit
// operations: the vector ?: of GCC compiles to scalar branches on SSE2.
inline vf select(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float16 -> float32 by rescaling the shifted bits (exact for normals, subnormals, inf and NaN).
inline float half_bits_to_float(uint16_t h) {
  const uint32_t em = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  float mag;
  if ((h & 0x7c00u) == 0x7c00u) {
    mag = bits_to_float(0x7f800000u | em);
  } else {
    mag = bits_to_float(em) * 0x1p112f;
  }
  uint32_t u;
  std::memcpy(&u, &mag, 4);
  return bits_to_float(u | sign);
}

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return bits_to_float(static_cast<uint32_t>(x.bits) << 16); }
inline float to_float(f16_t x) { return half_bits_to_float(x.bits); }

// kLanes consecutive values as float32.
inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf loadv(const bf16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu) << 16;
  return (vf)(u);
}
inline vf loadv(const f16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu);
  const vu em = (u & 0x7fffu) << 13;
  const vu sign = (u & 0x8000u) << 16;
  const vf scaled = (vf)(em) * 0x1p112f;
  const vu infnan = (vu)((u & 0x7c00u) == 0x7c00u);  // all ones where the half is inf / NaN
  const vu mag = (infnan & (em | 0x7f800000u)) | (~infnan & (vu)(scaled));
  const vu bits = mag | sign;
  return (vf)(bits);
}

inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// NaN -> -inf, +inf -> FLT_MAX, below thr -> -inf (thr = -inf: no filter). NaN fails v >= thr.
inline vf sanitizev(vf v, float thr) {
  v = select(v >= splat(thr), v, splat(-INFINITY));
  return select(v > splat(FLT_MAX), splat(FLT_MAX), v);
}
inline float sanitize1(float v, float thr) {
  if (!(v >= thr)) return -INFINITY;
  return v > FLT_MAX ? FLT_MAX : v;
}

inline vf vmax(vf a, vf b) { return select(a > b, a, b); }
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// 2^x for x <= 0 (larger x are clamped to 127); 0 below -126 and for -inf.
inline vf exp2v(vf x) {
  vf xc = select(x < splat(-127.0f), splat(-127.0f), x);
  xc = select(xc > splat(127.0f), splat(127.0f), xc);
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vf n = (xc + magic) - magic;
  const vf f = xc - n;  // in [-0.5, 0.5]
  vf p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const vi bits = (vi)(p) + (__builtin_convertvector(n, vi) << 23);
  const vf r = (vf)(bits);
  return (vf)((vi)r & (x >= splat(-126.0f)));
}

// Float64 accumulation of float32 lanes: two 2-double halves.
struct DoubleAcc {
  vd lo = vd{}, hi = vd{};
  void add(vf v) {
    lo += __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1), vd);
    hi += __builtin_convertvector(__builtin_shufflevector(v, v, 2, 3), vd);
  }
  double sum() const { return (lo[0] + lo[1]) + (hi[0] + hi[1]); }
};

}  // namespace specdec::cpu
