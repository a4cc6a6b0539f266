// Element access: raw-bit segments of logits / probabilities (8 entries of T), their loads
// (element by element, 16-byte __ldcg, cp.async into shared memory), the values they hold,
// scalar loads, the acquire / release primitives of the per-request counters, and the
// sanitizing of logits (NaN -> -inf, +inf -> FLT_MAX, filter thresholds).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"

namespace specdec {
namespace rs_detail {

// ------------------------------------------------------------------------- element access

template <typename T>
struct ElemBits;
template <>
struct ElemBits<float> {
  static constexpr uint32_t kNegInf = 0xFF800000u;
};
template <>
struct ElemBits<__nv_bfloat16> {
  static constexpr uint32_t kNegInf = 0xFF80u;
};
template <>
struct ElemBits<__half> {
  static constexpr uint32_t kNegInf = 0xFC00u;
};

// kN consecutive elements of type T as raw bits: 8, 16 or 32 bytes (one or two cp.async).
template <typename T, int kN>
struct alignas(kN * sizeof(T) < 16 ? kN * sizeof(T) : 16) Segment {
  static constexpr int kWords = kN * static_cast<int>(sizeof(T)) / 4;
  static_assert(kWords == 2 || kWords == 4 || kWords == 8, "segments are 8, 16 or 32 bytes");
  uint32_t w[kWords];
};

template <typename T>
__device__ __forceinline__ uint32_t load_bits(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return __ldg(reinterpret_cast<const unsigned int*>(p));
  } else {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
  }
}

template <int kBytes>
__device__ __forceinline__ void cp_async(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
  } else {
    static_assert(kBytes == 8, "cp.async of 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(gmem_src) : "memory");
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Tiles [tile_lo, tile_hi) of a row (entries below limit) into L2, one 128-byte line per thread
// and step.
template <typename P>
__device__ __forceinline__ void prefetch_tiles_l2(const P* row, int limit, int tile_lo, int tile_hi) {
  constexpr int kLineEntries = 128 / static_cast<int>(sizeof(P));
  const int hi = min(tile_hi * kRsTileEntries, limit);
  for (int i = tile_lo * kRsTileEntries + static_cast<int>(threadIdx.x) * kLineEntries; i < hi;
       i += kRsThreads * kLineEntries) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + i));
  }
}

// A request's unit count: one atomic that releases this thread's earlier writes (the unit's
// records; every record is written by thread 0, the counting thread) and, for the unit that
// counts last, acquires the records of those counted before it. It replaces a
// __threadfence() (fence.sc.gpu) on either side of a relaxed atomicAdd.
__device__ __forceinline__ int count_unit(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Entries [idx0, idx0 + kN) of a row, element by element: entries at or past `limit` read
// as `fill` (limit 0 masks the whole row, whose pointer is then never dereferenced).
template <typename T, int kN>
__device__ __forceinline__ Segment<T, kN> load_segment_scalar(const T* row, int idx0, int limit, uint32_t fill) {
  Segment<T, kN> seg;
#pragma unroll
  for (int i = 0; i < Segment<T, kN>::kWords; ++i) seg.w[i] = 0u;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const uint32_t bits = idx0 + j < limit ? load_bits(row + idx0 + j) : fill;
    if constexpr (sizeof(T) == 4) {
      seg.w[j] = bits;
    } else {
      seg.w[j / 2] |= (bits & 0xFFFFu) << (16 * (j % 2));
    }
  }
  return seg;
}

// The same entries with 16-byte loads where the row allows it (`vectorized`: 16-byte
// aligned rows), for the one chunk a unit samples in.
template <typename T, int kN>
__device__ __forceinline__ Segment<T, kN> load_segment(const T* row, int idx0, int limit, bool vectorized,
                                                       uint32_t fill) {
  if (vectorized && idx0 + kN <= limit) {
    Segment<T, kN> seg;
    const uint4* src = reinterpret_cast<const uint4*>(row + idx0);
#pragma unroll
    for (int i = 0; i < Segment<T, kN>::kWords / 4; ++i) {
      const uint4 v = __ldcg(src + i);
      seg.w[4 * i] = v.x;
      seg.w[4 * i + 1] = v.y;
      seg.w[4 * i + 2] = v.z;
      seg.w[4 * i + 3] = v.w;
    }
    return seg;
  }
  return load_segment_scalar<T, kN>(row, idx0, limit, fill);
}

// Starts copying entries [idx0, idx0 + kN) of a row into this thread's slot `dst`, as one
// or two cp.async when the row is 16-byte aligned and the segment is inside it, else
// (row tail, unaligned rows) element by element. Only the thread that issued a slot reads
// it back (after cp_async_wait), so no barrier is needed.
template <typename T, int kN>
__device__ __forceinline__ void issue_segment(Segment<T, kN>* dst, const T* row, int idx0, int limit,
                                              bool vectorized, uint32_t fill) {
  if (vectorized && idx0 + kN <= limit) {
    if constexpr (sizeof(Segment<T, kN>) == 32) {
      cp_async<16>(dst, row + idx0);
      cp_async<16>(reinterpret_cast<unsigned char*>(dst) + 16, row + idx0 + kN / 2);
    } else {
      cp_async<sizeof(Segment<T, kN>)>(dst, row + idx0);
    }
  } else {
    *dst = load_segment_scalar<T, kN>(row, idx0, limit, fill);
  }
}

template <typename T, int kN>
__device__ __forceinline__ float segment_value(const Segment<T, kN>& seg, int j) {
  if constexpr (std::is_same<T, float>::value) {
    return __uint_as_float(seg.w[j]);
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const uint32_t word = seg.w[j / 2];
    return __uint_as_float((j % 2) ? (word & 0xFFFF0000u) : (word << 16));
  } else {
    uint32_t word = seg.w[j / 2];
    const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&word));
    return (j % 2) ? pair.y : pair.x;
  }
}

// Max of a segment's raw values, NaNs dropped (NaN only if all are NaN): 16-bit pairs at a
// time (__hmax2 drops NaNs like fmaxf); the max of 16-bit values is exact.
template <typename T, int kN>
__device__ __forceinline__ float segment_max(const Segment<T, kN>& seg) {
  if constexpr (std::is_same<T, float>::value) {
    float m[2] = {__uint_as_float(seg.w[0]), __uint_as_float(seg.w[1])};
#pragma unroll
    for (int j = 2; j < kN; ++j) m[j % 2] = fmaxf(m[j % 2], __uint_as_float(seg.w[j]));
    return fmaxf(m[0], m[1]);
  } else {
    using T2 = std::conditional_t<std::is_same<T, __nv_bfloat16>::value, __nv_bfloat162, __half2>;
    uint32_t word = seg.w[0];
    T2 m = *reinterpret_cast<const T2*>(&word);
#pragma unroll
    for (int i = 1; i < Segment<T, kN>::kWords; ++i) {
      word = seg.w[i];
      m = __hmax2(m, *reinterpret_cast<const T2*>(&word));
    }
    float2 pair;
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      pair = __bfloat1622float2(m);
    } else {
      pair = __half22float2(m);
    }
    return fmaxf(pair.x, pair.y);
  }
}

// One element of a staged segment in shared memory.
template <typename T>
__device__ __forceinline__ float shared_value(const T* p) {
  if constexpr (std::is_same<T, float>::value) {
    return *p;
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(p)) << 16);
  } else {
    return __half2float(*p);
  }
}

template <typename T>
__device__ __forceinline__ float load_value(const T* p) {
  if constexpr (std::is_same<T, float>::value) {
    return __ldg(p);
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __uint_as_float(static_cast<uint32_t>(load_bits(p)) << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(load_bits(p))));
  }
}

__device__ __forceinline__ int64_t load_index(const void* p, bool is_int64, int64_t i) {
  return is_int64 ? static_cast<int64_t>(__ldg(static_cast<const long long*>(p) + i))
                  : static_cast<int64_t>(__ldg(static_cast<const int*>(p) + i));
}

// NaN tests on the bits: immune to any fast-math assumption about NaNs.
__device__ __forceinline__ bool is_nan(float x) { return (__float_as_uint(x) & 0x7FFFFFFFu) > 0x7F800000u; }

// NaN -> -inf (never sampled), +inf -> FLT_MAX.
__device__ __forceinline__ float sanitize(float x) { return is_nan(x) ? -INFINITY : fminf(x, FLT_MAX); }

// Sampling filters: a logit below the row's threshold thr (the threshold pass's, docs/ALGORITHM.md
// §7) counts as -inf; with thr = -inf this is sanitize (only NaN fails x >= -inf).
__device__ __forceinline__ float sanitize_below(float x, float thr) {
  return x >= thr ? fminf(x, FLT_MAX) : -INFINITY;
}

}  // namespace rs_detail
}  // namespace specdec
