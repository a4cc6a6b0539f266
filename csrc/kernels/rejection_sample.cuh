// Fused chain verification (docs/ALGORITHM.md): one launch per call, torch-free.
//
// Work units, numbered like the Triton kernel (specdec_kernels/triton_rejection_sample.py):
//   phase 1: unit (request b, row t, split s), t = 0..max_spec_len; units with t > n_b exit.
//            Streams tiles [s * tiles_per_split, ...) of target row cu[b] + b + t once and
//            writes an RsSplitRecord: max, sum of exp2((l - max) k), greedy argmax, and for
//            random requests the split's winner of the chunk race with its in-chunk
//            inverse-CDF sample; split 0 also the draft x_t, l(x_t) and p(x_t), so the
//            decision needs no dependent loads. For deterministic drafts row t < n_b leaves
//            x_t out of its sample (that is the residual).
//   phase 2: only with draft probabilities: unit (request b, residual split s). Waits for the
//            request's phase 1, recomputes the (cheap) decision and samples its split of the
//            one rejected row from max(0, q - p) the same way (RsResidualRecord).
// The unit that finishes a request last (an atomic counter per request) combines the records,
// runs the accept tests, writes the outputs and resets the counter, so the cached workspace
// is zero between calls (CUDA graphs); it reads nothing but records. With draft
// probabilities units are handed out by an atomic ticket in the order CTAs start, so a
// phase-2 unit only waits for phase-1 units that already run: no deadlock.
//
// Block verification (docs/ALGORITHM.md §6; the kernel is a template on RsMethod, so token
// verification compiles as before) changes only the decision and phase 2. Deterministic
// drafts: the finalizer's decide_block computes tau from the same records (R_i is a scalar),
// and row tau's recorded sample is the residual. Draft probabilities: phase-2 units are
// (request b, draft row r, split s); each computes P_r (decide_block over rows 0..r), streams
// its split of max(0, P_r q_r - p_r) and records its race winner and its mass; the last one
// sums each row's masses into R_r, picks tau and takes row tau's residual winner.
//
// The chunk race (docs/ALGORITHM.md §3) runs in the stream rather than over a table of row
// t* afterwards: the same scores and winner (up to float rounding), no table traffic, and the
// request's last unit reads nothing but records. Each lane group races the chunks it streams,
// in increasing order, relative to its running max (branch-free: score and chunk); at the end
// the unit combines the groups and one warp locates the inverse-CDF sample inside the unit's
// winning chunk, from the staging buffers while its tile is still there, else from global
// memory (L2). The noise (u_c, log2(-log2(v_c))) of a unit's chunks is precomputed into
// shared memory.
//
// One CTA of 256 threads per unit. A tile is 32 chunks of 256 logits; lane group g (a
// quarter-warp, threads 8g .. 8g + 7) holds chunk g, 32 logits per lane as 4 segments of 8
// consecutive logits (one 16-byte load of bf16 / fp16, two of fp32; a group's load covers 128
// contiguous bytes). So a chunk's max and sum are 3-step shuffle reductions that one warp
// instruction does for 4 chunks, the per-chunk race costs a few instructions per 32 logits,
// and the streaming loop has no CTA barrier: about 8 instructions per logit in all (4 of
// them the conversion, the exp2 as one FMA + MUFU, and the sum). Tiles are staged through
// shared memory with cp.async (sm_80+), each thread copying and reading back only its own
// segments (no barrier either), so no registers hold data in flight: with 16-bit logits two
// tiles (32 KB) are in flight per CTA while one is processed, and 4 CTAs per SM (64
// registers) keep up to 128 KB in flight per SM. Rare paths (NaN / +inf logits, the excluded
// draft) recompute weights from the staged tile instead of keeping them in registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/philox.cuh"

// Tiles of 16-bit logits staged per CTA without draft probabilities (tuning macro:
// SPECDEC_NVCC_FLAGS=-D...; 3 keeps 4 CTAs per SM).
#ifndef SPECDEC_CHAIN_STREAM_STAGES_16BIT
#define SPECDEC_CHAIN_STREAM_STAGES_16BIT 3
#endif

namespace specdec {

// Programmatic dependent launch (sm_90+, docs/PERF.md "Launch overlap and warp reductions"). A
// kernel launched with launch_with_pdl(..., true) may have its CTAs scheduled before the
// previous kernel in the stream has finished; its first statement is wait_for_prior_kernels(),
// which returns once that kernel has completed and its writes are visible, so nothing is read
// or written early. Once a CTA is past the wait it allows the next kernel to be scheduled the
// same way: at most two grids overlap, and the next one only in slots the current one does not
// need. No-ops before sm_90.
__device__ __forceinline__ void wait_for_prior_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_kernel_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

template <typename Params>
cudaError_t launch_with_pdl(void (*kernel)(Params), unsigned int grid, unsigned int block, size_t smem,
                            cudaStream_t stream, bool pdl, const Params& params) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, params);
}

// Timeline trace (a profiling build only: SPECDEC_NVCC_FLAGS=-DSPECDEC_TRACE; read by
// torch.ops.specdec._rejection_sample_trace, benchmarks/trace_chain_timeline.py). Thread 0 of
// CTA i writes %globaltimer (ns) at the marks below into rs_trace[i][mark]; `dep` makes the mark
// wait for the value it depends on (a load's result, a decision), so a mark is not taken before
// the step it closes has finished. Slot 7 holds the unit's %smid.
constexpr int kRsTraceCtas = 8192;
constexpr int kRsTraceSlots = 10;
enum RsTraceMark : int {
  kRsTraceEntry = 0,     // first instruction of the CTA
  kRsTraceRequest = 1,   // the request's fields loaded
  kRsTraceWaited = 2,    // phase 2: the request's phase 1 is complete; phase 1: every thread streamed
  kRsTraceStreamed = 3,  // thread 0's share of the stream processed
  kRsTraceCombined = 4,  // the unit's record values known (combine + in-chunk sample)
  kRsTraceCounted = 5,   // record released and counted: the unit knows whether it finalizes
  kRsTraceFinalized = 6, // the finalizer wrote the outputs
  kRsTraceSm = 7,
  kRsTraceRecords = 8,  // decide_request: thread 0's rows combined and tested (finalizers; phase-2 units too)
  kRsTraceDecided = 9,  // finalizer: t* and row t*'s values in shared memory
};
#ifdef SPECDEC_TRACE
__device__ unsigned long long rs_trace[kRsTraceCtas * kRsTraceSlots];
__device__ __forceinline__ void rs_trace_mark(int mark, uint32_t dep) {
  // dep == 0x7fc0dead never happens in practice; the test keeps the timer read after dep.
  if (threadIdx.x == 0 && blockIdx.x < kRsTraceCtas && dep != 0x7fc0deadu) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    rs_trace[blockIdx.x * kRsTraceSlots + mark] = t;
    if (mark == kRsTraceEntry) {
      unsigned smid;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      rs_trace[blockIdx.x * kRsTraceSlots + kRsTraceSm] = smid;
    }
  }
}
// The unit a CTA runs (with draft probabilities a ticket, not blockIdx.x) in slot 7's high
// word, and bit 31 set for a phase-2 unit.
__device__ __forceinline__ void rs_trace_unit(int unit, bool phase2) {
  if (threadIdx.x == 0 && blockIdx.x < kRsTraceCtas) {
    rs_trace[blockIdx.x * kRsTraceSlots + kRsTraceSm] |=
        (static_cast<unsigned long long>(unit) << 32) | (phase2 ? 0x80000000ull : 0ull);
  }
}
#define RS_TRACE(mark, dep) ::specdec::rs_trace_mark(::specdec::mark, static_cast<uint32_t>(dep))
#define RS_TRACE_UNIT(unit, phase2) ::specdec::rs_trace_unit(unit, phase2)
#else
#define RS_TRACE(mark, dep) ((void)0)
#define RS_TRACE_UNIT(unit, phase2) ((void)0)
#endif

constexpr int kSampleChunk = 256;  // docs/ALGORITHM.md §3; sampling lanes are chunk indices
constexpr int kRsThreads = 256;
constexpr int kRsWarps = kRsThreads / 32;
constexpr int kRsChunkLanes = 8;  // a lane group (quarter-warp) holds a chunk: 32 logits per lane
constexpr int kRsGroups = kRsThreads / kRsChunkLanes;  // 32 chunks per tile
constexpr int kRsLaneEntries = 8;                      // a segment: 16 bytes of bf16 / fp16, 32 of fp32
constexpr int kRsLaneSegments = kSampleChunk / (kRsChunkLanes * kRsLaneEntries);  // 4: entries 64 s + 8 l
constexpr int kRsTileChunks = kRsGroups;
constexpr int kRsTileEntries = kRsTileChunks * kSampleChunk;  // 8192
constexpr int kRsMaxSplits = 64;     // a row's records are combined by one warp, two per lane
constexpr int kRsMaxUnitTiles = 16;  // a unit's race noise lives in shared memory (4 KB)
constexpr int kRsMaxUnitChunks = kRsMaxUnitTiles * kRsTileChunks;
constexpr int64_t kRsMaxVocab = int64_t{kRsMaxSplits} * kRsMaxUnitTiles * kRsTileEntries;
// Units per resident CTA the plan aims for: small units keep the last wave short.
constexpr int kRsUnitsPerSlot = 2;
// Batches whose rows alone fill a wave of resident CTAs aim at this many units per CTA instead
// (plan_rejection_sample's shipped rules).
constexpr int kRsUnitsPerSlotLarge = 4;
// The longest units the one-wave rule makes (tiles; H100, bf16: with 3 it won at B = 8-16, tied at
// 24 and lost at 20 and 32-48 with longer units).
constexpr int kRsOneWaveMaxTiles = 3;

constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullMask = 0xffffffffu;

// Dtype of the optional temperature tensor, read as float32 in the kernel.
enum RsTemperatureDtype : int32_t {
  kRsTemperatureNone = 0,  // every request has temperature 1
  kRsTemperatureFloat32 = 1,
  kRsTemperatureFloat64 = 2,
  kRsTemperatureBFloat16 = 3,
  kRsTemperatureFloat16 = 4,
};

// Template tag for draft_probs=None (deterministic drafts).
struct NoDraftProbs {};

// One phase-1 unit's statistics of its split of a row: two 16-byte accesses.
struct __align__(16) RsSplitRecord {
  float row_max;     // max of the sanitized logits of the split (-inf: no valid logit)
  float exp_sum;     // sum of exp2((l - row_max) * k) (random requests only)
  int32_t argmax;    // lowest index of row_max, greedy requests only (else -1)
  float race_score;  // best chunk race score relative to row_max (-inf: no mass / greedy)
  int32_t draft;     // split 0 of a row t < n: the draft x_t if it is in [0, V), else -1
  float draft_logit;  // split 0: sanitized l_t(x_t) (-inf when x_t or the row is invalid)
  float draft_prob;   // split 0: p_t(x_t) (1 for deterministic drafts, 0 when x_t is invalid)
  int32_t candidate;  // the race winner's in-chunk sample (-1: none)
};

// One phase-2 unit's race winner on the residual (absolute scale).
struct __align__(8) RsResidualRecord {
  float race_score;
  int32_t candidate;
};

// Verification methods (docs/ALGORITHM.md §1 and §6); the kernel is a template on them.
enum RsMethod : int32_t {
  kRsMethodToken = 0,  // draft by draft
  kRsMethodBlock = 1,  // block verification (Sun et al. 2024)
};

// The work decomposition, computed on the host (make_rejection_sample_plan).
struct RejectionSamplePlan {
  int32_t num_chunks;
  int32_t num_tiles;
  int32_t num_splits;
  int32_t tiles_per_split;
  int32_t residual_splits;
  int32_t residual_tiles_per_split;
  // Rows whose residual phase 2 streams per request: 1 (token: the rejected row), or
  // max(max_spec_len, 1) (block verification with draft probabilities: every draft row).
  int32_t residual_rows;
  // 1: every unit is resident at once (small batches with draft probabilities), so phase-2 units
  // wait for most of phase 1; they prefetch the draft-probability tiles they may read into L2.
  int32_t prefetch_residual;
  int64_t units_phase1;
  int64_t units_total;
  int64_t num_counters;
  int64_t num_split_records;
  int64_t num_residual_records;  // num_requests * residual_rows * residual_splits, or 0
  int64_t num_residual_masses;   // the same count for block verification, else 0
};

struct RejectionSampleParams {
  const void* target_logits;  // [num_rows, vocab] T, unit stride along the vocabulary
  int64_t logits_row_stride;  // in elements
  bool logits_vectorized;     // base and row stride 16-byte aligned: segments are cp.async
  const void* draft_token_ids;  // [num_drafts] int32 / int64
  bool draft_ids_int64;
  const void* cu_num_draft_tokens;  // [num_requests + 1] int32 / int64
  bool cu_int64;
  const void* draft_probs;  // [num_drafts, vocab] P, or nullptr
  int64_t draft_probs_row_stride;
  bool probs_vectorized;
  const void* temperature;  // [num_requests], dtype temperature_dtype
  int32_t temperature_dtype;
  const void* seeds;  // [num_requests] int32 / int64
  bool seeds_int64;
  const void* offsets;  // [num_requests] int32 / int64, or nullptr (offset 0)
  bool offsets_int64;
  int32_t* output_token_ids;  // [num_requests, max_spec_len + 1]
  int32_t* num_accepted;      // [num_requests]
  // Workspace. counters [2 * num_requests + 2], zero between calls: per-request phase-1 and
  // phase-2 completion counts, then the ticket and the finished count.
  int32_t* counters;
  // Sampling filters (docs/ALGORITHM.md §7): the threshold logit of each (request b, row t) at
  // b * (max_spec_len + 1) + t from the threshold pass; logits below it count as -inf (-inf:
  // unfiltered). nullptr: no filters.
  const float* row_thresholds;
  // Rows verified from their kept set (docs/ALGORITHM.md §7): for a filtered row whose whole kept
  // set the threshold pass's search held, the pass wrote its kept sum Z_t (kept_sum > 0 marks such
  // a row; 0 for every other row), its max, and per chunk c (at (b * (max_spec_len + 1) + t) *
  // num_chunks + c) the chunk max m_c and the kept mass sum exp2((l - m_c) k) of the chunk, the
  // excluded draft left out as the stream leaves it out. Such a row's units stream nothing.
  // nullptr: every filtered row is streamed.
  const float* kept_sum;
  const float* kept_max;
  const float* chunk_max;
  const float* kept_chunk_mass;
  RsSplitRecord* split_records;        // [units_phase1]
  RsResidualRecord* residual_records;  // [num_requests * residual_rows * residual_splits]
  // Block verification with draft probabilities: each phase-2 unit's residual mass
  // sum_x max(P q(x) - p(x), 0) over its split, [num_requests * residual_rows * residual_splits].
  float* residual_masses;
  int64_t num_rows;
  int64_t num_drafts;
  int32_t vocab_size;
  int32_t num_requests;
  int32_t max_spec_len;
  RejectionSamplePlan plan;
};

// ------------------------------------------------------------------------------ host plan


inline int64_t rs_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Splits a row of num_tiles tiles into about `wanted` equal ranges of at most
// kRsMaxUnitTiles tiles, and at most kRsMaxSplits of them.
inline void rs_split_row(int64_t num_tiles, int64_t wanted, int32_t& splits, int32_t& per_split) {
  const int64_t cap = num_tiles < kRsMaxSplits ? num_tiles : kRsMaxSplits;
  const int64_t s = wanted < 1 ? 1 : (wanted > cap ? cap : wanted);
  int64_t per = rs_ceil_div(num_tiles, s);
  if (per > kRsMaxUnitTiles) per = kRsMaxUnitTiles;  // vocab <= kRsMaxVocab keeps splits <= 64
  per_split = static_cast<int32_t>(per);
  splits = static_cast<int32_t>(rs_ceil_div(num_tiles, per));
}

// concurrent_ctas: CTAs the GPU runs at once (SMs x resident CTAs per SM). Rows are split so
// that there are about kRsUnitsPerSlot units per resident CTA (at least one row per unit).
// units_per_slot_override > 0 (benchmarks: SPECDEC_CUDA_UNITS_PER_SLOT) aims at that many
// instead and turns off the shipped rules; 0, the shipped plan:
// - Large batches (num_rows >= concurrent_ctas) aim at kRsUnitsPerSlotLarge units per resident
//   CTA: the last wave's tail is one unit long, and since units combine their parts with a warp
//   (not thread 0) smaller units cost less than that tail. H100, bf16, no draft, units per slot
//   2 -> 4 (tune_cuda_plan.py): B = 128 68.5 -> 66.7 us, B = 256 127.0 -> 122.8, fp32 + fp32
//   draft B = 128 170.5 -> 169.0; B = 64 (320 rows, the rule off) would lose 39.9 -> 40.5.
// - Small batches, one wave: without draft
// probabilities, when those units overflow the resident CTAs but rows split at most twice as
// coarsely, into units of at most kRsOneWaveMaxTiles tiles, fit in one wave, take that -- a
// short second wave costs a whole unit's time, and each unit its fixed costs. E.g. B = 8,
// K = 4, V = 128256 on 132 SMs: 640 one-tile units in two waves -> 320 two-tile units in one.
// Longer units lose since units start by issuing their tiles (docs/PERF.md, "Rows before
// offsets"): B = 32 480 six-tile units 25.1 us against 960 three-tile ones 23.6. With draft
// probabilities the same rule (phase-1 units only) was faster at B = 8-16 and slower at
// B = 24-32 on an H100, so it is off there (docs/PERF.md, "One wave").
inline RejectionSamplePlan plan_rejection_sample(int64_t num_rows, int64_t num_requests, int64_t vocab,
                                                 int64_t max_spec_len, bool has_draft_probs,
                                                 int64_t concurrent_ctas, RsMethod method = kRsMethodToken,
                                                 int64_t units_per_slot_override = 0) {
  const bool shipped_rules = units_per_slot_override <= 0;
  const int64_t units_per_slot = !shipped_rules ? units_per_slot_override
                                 : num_rows >= concurrent_ctas ? kRsUnitsPerSlotLarge : kRsUnitsPerSlot;
  RejectionSamplePlan plan{};
  const int64_t num_chunks = rs_ceil_div(vocab < 1 ? 1 : vocab, kSampleChunk);
  const int64_t num_tiles = rs_ceil_div(num_chunks, kRsTileChunks);
  const int64_t target_units = units_per_slot * concurrent_ctas;
  plan.num_chunks = static_cast<int32_t>(num_chunks);
  plan.num_tiles = static_cast<int32_t>(num_tiles);
  rs_split_row(num_tiles, rs_ceil_div(target_units, num_rows < 1 ? 1 : num_rows), plan.num_splits,
               plan.tiles_per_split);
  const int64_t row_slots = num_requests * (max_spec_len + 1);  // phase-1 units per split
  if (shipped_rules && !has_draft_probs && row_slots > 0 && row_slots * plan.num_splits > concurrent_ctas &&
      concurrent_ctas >= row_slots) {
    int32_t splits = 0, per_split = 0;
    rs_split_row(num_tiles, concurrent_ctas / row_slots, splits, per_split);
    if (row_slots * splits <= concurrent_ctas && per_split <= 2 * plan.tiles_per_split &&
        per_split <= kRsOneWaveMaxTiles) {
      plan.num_splits = splits;
      plan.tiles_per_split = per_split;
    }
  }
  plan.units_phase1 = row_slots * plan.num_splits;
  plan.units_total = plan.units_phase1;
  plan.residual_rows = 1;
  const bool block_residuals = has_draft_probs && method == kRsMethodBlock;
  if (has_draft_probs) {
    // Token verification reads the rejected row of each request again with its draft row;
    // block verification needs the residual mass of every draft row (docs/ALGORITHM.md §6).
    // Split those rows too.
    if (block_residuals) plan.residual_rows = static_cast<int32_t>(max_spec_len < 1 ? 1 : max_spec_len);
    const int64_t residual_rows = num_requests * plan.residual_rows;
    rs_split_row(num_tiles, rs_ceil_div(target_units, residual_rows < 1 ? 1 : residual_rows), plan.residual_splits,
                 plan.residual_tiles_per_split);
    plan.units_total += residual_rows * plan.residual_splits;
    plan.prefetch_residual = plan.units_total <= concurrent_ctas ? 1 : 0;
  }
  plan.num_counters = 2 * num_requests + 2;
  plan.num_split_records = plan.units_phase1;
  plan.num_residual_records = has_draft_probs ? num_requests * plan.residual_rows * plan.residual_splits : 0;
  plan.num_residual_masses = block_residuals ? plan.num_residual_records : 0;
  return plan;
}

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

// The residual weight r = max(0, q - p) with q = exp2((l - row_max) k) / row_sum where q > 0,
// else 0: a NaN logit (or one below the filter threshold thr) reads as -inf (q = 0), a NaN p
// gives 0 (fmaxf drops the NaN).
__device__ __forceinline__ float residual_weight(float logit, float prob, float row_max, float k, float inv_sum,
                                                 float thr) {
  const float q = exp2f((sanitize_below(logit, thr) - row_max) * k) * inv_sum;
  return q > 0.0f ? fmaxf(q - prob, 0.0f) : 0.0f;
}

// ---------------------------------------------------------------------------- warp helpers

// Order-preserving map of floats onto uint32 keys (a NaN ranks lowest, as fmaxf drops it) and
// back, for max reductions on the integer reduce unit.
__device__ __forceinline__ uint32_t ordered_key(float v) {
  const uint32_t b = __float_as_uint(v);
  const uint32_t key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return is_nan(v) ? 0u : key;
}

__device__ __forceinline__ float from_ordered_key(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// Warp reductions; every lane ends with the same value. Max and min are one redux.sync each
// (sm_80+) instead of five dependent shuffles: the ends of units and the finalizers chain a
// dozen of them (docs/PERF.md "Launch overlap and warp reductions"). The max of floats is
// exact either way (one of the inputs; NaNs dropped unless all are NaN); sums add in butterfly
// order.
__device__ __forceinline__ float warp_max(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return from_ordered_key(__reduce_max_sync(kFullMask, ordered_key(v)));
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ int warp_min(int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_min_sync(kFullMask, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
#endif
}

__device__ __forceinline__ float warp_inclusive_scan(float v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float up = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += up;
  }
  return v;
}

// Lane-group reductions (the 8 lanes that hold a chunk, each group separately; every lane
// gets its group's value); `mask` names whole groups.
__device__ __forceinline__ float group_max(float v, unsigned mask = kFullMask) {
#pragma unroll
  for (int o = kRsChunkLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, o));
  return v;
}

__device__ __forceinline__ float group_sum(float v, unsigned mask = kFullMask) {
#pragma unroll
  for (int o = kRsChunkLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
  return v;
}

__device__ __forceinline__ int group_min(int v, unsigned mask = kFullMask) {
#pragma unroll
  for (int o = kRsChunkLanes / 2; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(mask, v, o));
  return v;
}

__device__ __forceinline__ float group_inclusive_scan(float v, int gl, unsigned mask) {
#pragma unroll
  for (int o = 1; o < kRsChunkLanes; o <<= 1) {
    const float up = __shfl_up_sync(mask, v, o, kRsChunkLanes);
    if (gl >= o) v += up;
  }
  return v;
}

// Race winner over lanes: highest score, lowest chunk on ties, and that lane's candidate (the
// lowest such lane's if several hold the same score and chunk); every lane gets the result.
__device__ __forceinline__ void warp_race_winner(float& score, int& chunk, int& candidate) {
  const float best = warp_max(score);
  const bool at_best = ordered_key(score) == ordered_key(best);
  const int best_chunk = warp_min(at_best ? chunk : INT_MAX);
  const unsigned holders = __ballot_sync(kFullMask, at_best && chunk == best_chunk);
  candidate = __shfl_sync(kFullMask, candidate, holders != 0u ? __ffs(holders) - 1 : 0);
  score = best;
  chunk = best_chunk;
}

// ---------------------------------------------------------------------------- shared state

struct RequestContext {
  int64_t cu_lo;
  int n;  // drafts used: clamp(cu[b+1] - cu[b], 0, max_spec_len)
  bool greedy;
  float k;  // log2(e) / T (log2(e) for greedy requests)
  uint64_t seed;
  uint64_t offset;
};

// One row of block verification's scan (decide_block), written by the warp that combined it.
struct RsBlockRow {
  float q_x;      // q_r(x_r) (0 when x_r is invalid)
  float p_x;      // p_r(x_r) (1 for deterministic drafts)
  float eta;      // the accept uniform of position r (draft r - 1), final scans only
  float mass;     // R_r with draft probabilities: the residual units' masses of row r, final scans only
  float row_max;
  float row_sum;
  int32_t sample;  // the row's sample of q (-1: none)
  int32_t draft;   // x_r if r < n and it is a valid id, else -1
};

struct RsShared {
  float2 noise[kRsMaxUnitChunks];  // per chunk of the unit: (u_c, log2(-log2(v_c)))
  // Per lane group (or per warp) partial results of a unit, combined by thread 0.
  float reduce_max[kRsGroups];
  float reduce_sum[kRsGroups];
  float reduce_score[kRsGroups];
  int reduce_index[kRsGroups];
  int reduce_chunk[kRsGroups];
  int unit;
  int is_last;
  // Block-wide results, one field per producer so that a result is never overwritten
  // before every thread read it (a barrier separates each read from the next write).
  int token;
  int argmax;
  // The request's decision (decide_request).
  int t_star;
  int x_star;  // draft at t_star when it is a valid id and t_star < n, else -1
  int argmax_star;
  int sample_star;
  float max_star;
  float sum_star;
  // Block verification (decide_block): a batch of rows, then P_tau (or P of the unit's row)
  // and n' (INT_MAX while a partial scan has not seen it).
  RsBlockRow block_rows[kRsWarps];
  float block_scale;
  int block_end;
  // Phase 1: the unit's request (for its finalizer) and split 0's accept-test operands, kept
  // here rather than in registers across the stream.
  RequestContext rq;
  float draft_logit;
  float draft_prob;
};

// A request's fields as loaded: 32-bit words, each load issued without a branch (predicated
// on the dtypes), so that a caller can issue them, then its first tiles, and only then
// decode_request, whose arithmetic waits for the loads.
struct RequestWords {
  uint32_t cu_lo[2], cu_hi[2];  // cu[b], cu[b + 1] (high words of int64 offsets)
  uint32_t temperature[2];      // fp32 bits, fp64 words, or a bf16 / fp16 in the low half
  uint32_t seed[2];
  uint32_t offset[2];
};

__device__ __forceinline__ uint32_t load_word(const void* base, int64_t i) {
  return __ldg(static_cast<const unsigned int*>(base) + i);
}

// Entry i of an int32 / int64 tensor as its words (the high word only for int64).
__device__ __forceinline__ void load_index_words(const void* base, bool is_int64, int64_t i, uint32_t (&w)[2]) {
  w[0] = load_word(base, is_int64 ? 2 * i : i);
  w[1] = is_int64 ? load_word(base, 2 * i + 1) : 0u;
}

__device__ __forceinline__ int64_t index_from_words(const uint32_t (&w)[2], bool is_int64) {
  return is_int64 ? static_cast<int64_t>((static_cast<uint64_t>(w[1]) << 32) | w[0])
                  : static_cast<int64_t>(static_cast<int32_t>(w[0]));
}

__device__ __forceinline__ RequestWords load_request_words(const RejectionSampleParams& p, int b) {
  RequestWords w;
  load_index_words(p.cu_num_draft_tokens, p.cu_int64, b, w.cu_lo);
  load_index_words(p.cu_num_draft_tokens, p.cu_int64, b + 1, w.cu_hi);
  const int dt = p.temperature_dtype;
  const bool words = dt == kRsTemperatureFloat32 || dt == kRsTemperatureFloat64;
  const bool halves = dt == kRsTemperatureBFloat16 || dt == kRsTemperatureFloat16;
  w.temperature[0] = words ? load_word(p.temperature, dt == kRsTemperatureFloat64 ? 2 * b : b)
                     : halves ? static_cast<uint32_t>(__ldg(static_cast<const unsigned short*>(p.temperature) + b))
                              : 0u;
  w.temperature[1] = dt == kRsTemperatureFloat64 ? load_word(p.temperature, 2 * b + 1) : 0u;
  load_index_words(p.seeds, p.seeds_int64, b, w.seed);
  w.offset[0] = w.offset[1] = 0u;
  if (p.offsets != nullptr) load_index_words(p.offsets, p.offsets_int64, b, w.offset);
  return w;
}

__device__ __forceinline__ float temperature_from_words(const RejectionSampleParams& p, const uint32_t (&w)[2]) {
  switch (p.temperature_dtype) {
    case kRsTemperatureFloat32:
      return __uint_as_float(w[0]);
    case kRsTemperatureFloat64:
      return __double2float_rn(__hiloint2double(static_cast<int>(w[1]), static_cast<int>(w[0])));
    case kRsTemperatureBFloat16:
      return __uint_as_float(w[0] << 16);
    case kRsTemperatureFloat16:
      return __half2float(__ushort_as_half(static_cast<unsigned short>(w[0])));
    default:
      return 1.0f;  // every request has temperature 1
  }
}

__device__ __forceinline__ RequestContext decode_request(const RejectionSampleParams& p, const RequestWords& w) {
  RequestContext rq;
  rq.cu_lo = index_from_words(w.cu_lo, p.cu_int64);
  const int64_t count = index_from_words(w.cu_hi, p.cu_int64) - rq.cu_lo;
  rq.n = static_cast<int>(count < 0 ? 0 : (count > p.max_spec_len ? p.max_spec_len : count));
  const float temperature = temperature_from_words(p, w.temperature);
  rq.greedy = !(temperature > 0.0f) || is_nan(temperature);  // 0, negative and NaN are greedy
  rq.k = rq.greedy ? kLog2e : __fdiv_rn(kLog2e, temperature);
  rq.seed = static_cast<uint64_t>(index_from_words(w.seed, p.seeds_int64));
  rq.offset = static_cast<uint64_t>(index_from_words(w.offset, p.offsets_int64));
  return rq;
}

__device__ __forceinline__ RequestContext load_request(const RejectionSampleParams& p, int b) {
  return decode_request(p, load_request_words(p, b));
}

// ------------------------------------------------------------------------ tile streaming

// Tile staging buffers: dynamic shared memory of rejection_sample_smem_bytes<T, P>().
extern __shared__ uint4 rs_stage_smem[];

// Stages a row's tiles through shared memory at byte offset kOffset of rs_stage_smem. Lane
// group g (threads 8g .. 8g + 7) holds chunk g of a tile; its lane l owns the slots of
// segments s = 0..3: entries 64 s + 8 l .. + 7 of the chunk (so each 16-byte load of a lane
// group covers 128 contiguous bytes).
template <typename T, int kStages, int kOffset>
struct TileStream {
  using Seg = Segment<T, kRsLaneEntries>;
  static constexpr int kBytes = kStages * kRsLaneSegments * kRsThreads * static_cast<int>(sizeof(Seg));
  const T* row;
  int limit;
  bool vectorized;
  uint32_t fill;

  __device__ __forceinline__ static Seg* slot(int stage, int h, int thread = threadIdx.x) {
    return reinterpret_cast<Seg*>(reinterpret_cast<unsigned char*>(rs_stage_smem) + kOffset) +
           (stage * kRsLaneSegments + h) * kRsThreads + thread;
  }

  // After the stream of tiles [lo, hi): the 8 entries 8 l .. 8 l + 7 of `chunk` for lane l of a
  // warp, from the staging slots while its tile is still there (the last kStages tiles), else
  // from global memory (usually L2).
  __device__ __forceinline__ Seg chunk_segment(int chunk, int lo, int hi) const {
    const int tile = chunk / kRsTileChunks, lane = threadIdx.x & 31;
    if (tile >= hi - kStages && tile >= lo) {
      const int owner = (chunk % kRsTileChunks) * kRsChunkLanes + lane % kRsChunkLanes;
      return *slot((tile - lo) % kStages, lane / kRsChunkLanes, owner);
    }
    return load_segment<T, kRsLaneEntries>(row, chunk * kSampleChunk + lane * kRsLaneEntries, limit, vectorized, fill);
  }

  __device__ __forceinline__ void issue(int tile, int stage) const {
    const int base = (tile * kRsTileChunks + static_cast<int>(threadIdx.x) / kRsChunkLanes) * kSampleChunk +
                     (threadIdx.x % kRsChunkLanes) * kRsLaneEntries;
#pragma unroll
    for (int h = 0; h < kRsLaneSegments; ++h) {
      issue_segment(slot(stage, h), row, base + h * kRsChunkLanes * kRsLaneEntries, limit, vectorized, fill);
    }
  }

  __device__ __forceinline__ Seg segment(int stage, int h) const { return *slot(stage, h); }
};

// Index of entry (segment h, j) of this thread's chunk `chunk`.
__device__ __forceinline__ int entry_index(int chunk, int h, int j) {
  return chunk * kSampleChunk + h * kRsChunkLanes * kRsLaneEntries + (threadIdx.x % kRsChunkLanes) * kRsLaneEntries +
         j;
}

// Per instance: pipeline depths, shared memory and CTAs per SM.
//  - deterministic drafts, 16-bit logits: 3 stages of 16 KB tiles (two in flight while one
//    is processed), 4 CTAs per SM (64 registers); fp32 logits: 2 stages of 32 KB, 3 CTAs;
//  - draft probabilities: phase 2 stages one tile of each of its two rows at a time (a tile
//    of logits + one of probabilities, 32-64 KB); phase 1 uses the same staging memory for as
//    many tiles as fit; 3 CTAs per SM (80 registers).
template <typename T, typename P>
struct RsConfig {
  static constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  static constexpr int kTileBytes = kRsTileEntries * static_cast<int>(sizeof(T));
  static constexpr int kResidualStages = 1;
  static constexpr int kResidualBytes =
      kHasDraftProbs ? kResidualStages * kRsTileEntries * static_cast<int>(sizeof(T) + sizeof(P)) : 0;
  static constexpr int kStages =
      kHasDraftProbs ? (kResidualBytes / kTileBytes > 2 ? kResidualBytes / kTileBytes : 2)
                     : (sizeof(T) == 2 ? SPECDEC_CHAIN_STREAM_STAGES_16BIT : 2);
  static constexpr int kSmemBytes = kStages * kTileBytes > kResidualBytes ? kStages * kTileBytes : kResidualBytes;
  static constexpr int kMinBlocksPerSM = (!kHasDraftProbs && sizeof(T) == 2 && kStages <= 3) ? 4 : 3;
};

// Runs process(tile, stage) over tiles [lo, hi) with kStages - 1 tiles in flight (kStages = 1:
// each tile is copied, then processed); issue(tile, stage) starts a tile's copies. A slot is
// refilled one iteration after it was read, when its values have been consumed.
template <int kStages, typename Issue>
__device__ __forceinline__ void issue_first_tiles(int lo, int hi, Issue&& issue) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (lo + s < hi) issue(lo + s, s);
    cp_async_commit();
  }
}

// The loop after issue_first_tiles<kStages>(lo, hi, issue).
template <int kStages, typename Issue, typename Process>
__device__ __forceinline__ void pipeline_tiles(int lo, int hi, Issue&& issue, Process&& process) {
  int stage = 0;
  for (int tile = lo; tile < hi; ++tile) {
    if constexpr (kStages == 1) {
      issue(tile, 0);
      cp_async_commit();
      cp_async_wait<0>();
    } else {
      cp_async_wait<kStages - 2>();
      if (tile + kStages - 1 < hi) issue(tile + kStages - 1, stage == 0 ? kStages - 1 : stage - 1);
      cp_async_commit();
    }
    process(tile, stage);
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
  cp_async_wait<0>();
}

// Race noise of chunks [chunk_lo, chunk_lo + count) of row `node` into sm.noise (count <=
// kRsMaxUnitChunks); read after a barrier.
__device__ __forceinline__ void fill_race_noise(RsShared& sm, const RequestContext& rq, int node, int chunk_lo,
                                                int count) {
  for (int j = threadIdx.x; j < count; j += kRsThreads) {
    const PhiloxBlock w = philox_words(rq.seed, rq.offset, kStreamSample, static_cast<uint32_t>(node),
                                       static_cast<uint32_t>(chunk_lo + j));
    sm.noise[j] = make_float2(uniform_from_word(w.x), log2f(-log2f(open_uniform_from_word(w.y))));
  }
}

// The max of a lane group's chunk in a tile with logits below thr read as -inf (the per-entry
// path of filtered rows; group-uniform).
template <typename T>
__device__ __forceinline__ float masked_chunk_max(const Segment<T, kRsLaneEntries> (&seg)[kRsLaneSegments],
                                                  float thr) {
  float lane_max = -INFINITY;
#pragma unroll
  for (int h = 0; h < kRsLaneSegments; ++h) {
#pragma unroll
    for (int j = 0; j < kRsLaneEntries; ++j) lane_max = fmaxf(lane_max, sanitize_below(segment_value(seg[h], j), thr));
  }
  return group_max(lane_max);
}

// A lane's share of its group's chunk mass over the lane's segments, sum of exp2((l - m) k):
// as one FMA, exp2(l k - m k) with mk = m k, when fma_exact (|m k| small, see the callers), else
// in the exact form. Two accumulators: two independent add chains. The unfiltered hot loop of
// the chain and the tree kernels.
template <typename T>
__device__ __forceinline__ float lane_chunk_mass(const Segment<T, kRsLaneEntries> (&seg)[kRsLaneSegments], float m,
                                                 float k, float mk, bool fma_exact) {
  float mass0 = 0.0f, mass1 = 0.0f;
  if (fma_exact) {
#pragma unroll
    for (int h = 0; h < kRsLaneSegments; ++h) {
#pragma unroll
      for (int j = 0; j < kRsLaneEntries; j += 2) {
        mass0 += exp2f(fmaf(segment_value(seg[h], j), k, -mk));
        mass1 += exp2f(fmaf(segment_value(seg[h], j + 1), k, -mk));
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < kRsLaneSegments; ++h) {
#pragma unroll
      for (int j = 0; j < kRsLaneEntries; j += 2) {
        mass0 += exp2f((segment_value(seg[h], j) - m) * k);
        mass1 += exp2f((segment_value(seg[h], j + 1) - m) * k);
      }
    }
  }
  return mass0 + mass1;
}

// ------------------------------------------------------------------------- chunk sampling

// Inverse CDF inside one chunk, held by a warp (lane l: entries lane_base = 256 c + 8 l .. + 7
// with weights w): the smallest entry with w > 0 whose prefix sum reaches u * W, W the largest
// prefix sum at an entry with w > 0 (so a crossing exists whenever the chunk has mass); -1 if
// it has none. Warp-uniform.
__device__ __forceinline__ int warp_inverse_cdf(const float (&w)[kRsLaneEntries], float u, int lane_base) {
  const int lane = threadIdx.x & 31;
  float lane_sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) lane_sum += w[j];
  const float incl = warp_inclusive_scan(lane_sum, lane);
  const float before = __shfl_up_sync(kFullMask, incl, 1);
  const float excl = lane == 0 ? 0.0f : before;
  float prefix = excl, pmax = -INFINITY;
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    prefix += w[j];
    if (w[j] > 0.0f) pmax = fmaxf(pmax, prefix);
  }
  const float threshold = u * warp_max(pmax);
  int first = INT_MAX;
  prefix = excl;
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    prefix += w[j];
    if (first == INT_MAX && w[j] > 0.0f && prefix >= threshold) first = lane_base + j;
  }
  first = warp_min(first);
  return first == INT_MAX ? -1 : first;
}

// The sample of q inside chunk `chunk` (one warp; lane l holds its entries 8 l .. 8 l + 7 in
// seg): weights exp2((l - m) k) relative to the chunk max m, `excluded` and logits below the
// filter threshold thr left out.
template <typename T>
__device__ __forceinline__ int warp_sample_chunk(const Segment<T, kRsLaneEntries>& seg, int chunk, float k,
                                                 int excluded, float u, float thr) {
  const int lane_base = chunk * kSampleChunk + (threadIdx.x & 31) * kRsLaneEntries;
  float w[kRsLaneEntries];
  float lane_max = -INFINITY;
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    w[j] = sanitize_below(segment_value(seg, j), thr);
    lane_max = fmaxf(lane_max, w[j]);
  }
  const float m = warp_max(lane_max);
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    w[j] = (w[j] > -INFINITY && lane_base + j != excluded) ? exp2f((w[j] - m) * k) : 0.0f;
  }
  return warp_inverse_cdf(w, u, lane_base);
}

// The sample of the residual max(0, q - p) inside chunk `chunk` (one warp, as above).
template <typename T, typename P>
__device__ __forceinline__ int warp_sample_residual_chunk(const Segment<T, kRsLaneEntries>& lseg,
                                                          const Segment<P, kRsLaneEntries>& pseg, int chunk,
                                                          float row_max, float k, float inv_sum, float u,
                                                          float thr) {
  const int lane_base = chunk * kSampleChunk + (threadIdx.x & 31) * kRsLaneEntries;
  float w[kRsLaneEntries];
#pragma unroll
  for (int j = 0; j < kRsLaneEntries; ++j) {
    w[j] = residual_weight(segment_value(lseg, j), segment_value(pseg, j), row_max, k, inv_sum, thr);
  }
  return warp_inverse_cdf(w, u, lane_base);
}

// The end of a unit: combining its parts (kRsGroups lane groups, or kRsWarps warps for greedy
// rows) left in shared memory. One warp, lane c reading part c, every lane gets the result: a
// thread-0 loop over 32 parts with dependent shared loads took ~3 us of a B = 1 call's ~9 (H100,
// benchmarks/trace_chain_timeline.py). Sums are added in a butterfly order, so they may differ
// from a serial sum in the last bit (the backends agree up to near-ties, as before).

// The parts' max m and their sums rescaled to it: sum_c s_c exp2((m_c - m) k).
__device__ __forceinline__ void warp_combine_max_sum(const float* part_max, const float* part_sum, int parts, float k,
                                                     float& m, float& s) {
  const int lane = threadIdx.x & 31;
  const float mc = lane < parts ? part_max[lane] : -INFINITY;
  m = warp_max(mc);
  s = warp_sum(mc > -INFINITY ? part_sum[lane] * exp2f((mc - m) * k) : 0.0f);
}

// The parts' max m and the lowest index among the parts at m (INT_MAX: none).
__device__ __forceinline__ void warp_combine_max_index(const float* part_max, const int* part_index, int parts,
                                                       float& m, int& index) {
  const int lane = threadIdx.x & 31;
  const float mc = lane < parts ? part_max[lane] : -INFINITY;
  m = warp_max(mc);
  index = warp_min(mc > -INFINITY && mc == m ? part_index[lane] : INT_MAX);
}

// The lane groups' race leads in sm.reduce_*: the highest score after shifting each by (its
// running max - m) k (kScaled), lowest chunk on ties; chunk -1: none.
template <bool kScaled>
__device__ __forceinline__ void warp_combine_chunk_races(const RsShared& sm, float m, float k, float& score,
                                                         int& chunk) {
  static_assert(kRsGroups == 32, "one lane per lane group");
  const int lane = threadIdx.x & 31;
  score = sm.reduce_score[lane];
  if (score > -INFINITY) {
    if (kScaled) score += (sm.reduce_max[lane] - m) * k;
    chunk = sm.reduce_chunk[lane];
  } else {
    score = -INFINITY;
    chunk = INT_MAX;
  }
  int unused = 0;
  warp_race_winner(score, chunk, unused);
  if (score == -INFINITY) chunk = -1;
}

// ------------------------------------------------------------------------ record combining

struct RowStats {
  float row_max;
  float row_sum;
  int argmax;  // -1: no valid logit, or a random request
  int sample;  // the race winner's sample of q (-1: no mass, or a greedy request)
};

struct NoWork {
  __device__ void operator()() const {}
};

// Combines the num_splits records of one row (one warp, two per lane), as the Triton kernel
// combines its per-split statistics. Lane 0 also gets split 0's draft fields in `first`.
// while_loading() runs between the record loads and their first use.
template <typename Work = NoWork>
__device__ __forceinline__ RowStats combine_row_records(const RsSplitRecord* records, int num_splits, float k,
                                                        int lane, float4& first, Work&& while_loading = Work{}) {
  float m[2], s[2], g[2];
  int am[2], cand[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int split = lane + 32 * r;
    if (split < num_splits) {
      const float4* rec = reinterpret_cast<const float4*>(records + split);
      const float4 a = __ldcg(rec);
      const float4 c = __ldcg(rec + 1);
      if (r == 0) first = c;
      m[r] = a.x;
      s[r] = a.y;
      am[r] = __float_as_int(a.z);
      g[r] = a.w;
      cand[r] = __float_as_int(c.w);
    } else {
      m[r] = -INFINITY;
      s[r] = 0.0f;
      am[r] = -1;
      g[r] = -INFINITY;
      cand[r] = -1;
    }
  }
  while_loading();
  const float row_max = warp_max(fmaxf(m[0], m[1]));
  float sum = 0.0f, best = -INFINITY;
  int argmax = INT_MAX, best_split = INT_MAX, best_cand = -1;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (m[r] > -INFINITY) {
      const float shift = (m[r] - row_max) * k;
      sum += s[r] * exp2f(shift);
      if (m[r] == row_max && am[r] >= 0) argmax = min(argmax, am[r]);
      if (g[r] > -INFINITY && g[r] + shift > best) {  // splits increase with r: lowest wins ties
        best = g[r] + shift;
        best_split = lane + 32 * r;
        best_cand = cand[r];
      }
    }
  }
  sum = warp_sum(sum);
  argmax = warp_min(argmax);
  warp_race_winner(best, best_split, best_cand);
  return RowStats{row_max, sum, (row_max > -INFINITY && argmax != INT_MAX) ? argmax : -1,
                  best > -INFINITY ? best_cand : -1};
}

// t* and the statistics of row t* into shared memory (sm.t_star .. sm.sample_star) for the
// request in sm.rq (written before a barrier). Every warp takes rows t = warp, warp + 8, ...,
// combines their records and runs their accept tests with the draft fields of split 0; it
// stops at its first rejection, and t* is the least such row over warps.
__device__ inline void decide_request(const RejectionSampleParams& p, int b, RsShared& sm) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) sm.t_star = INT_MAX;
  __syncthreads();
  const RequestContext rq = sm.rq;
  int stop_row = INT_MAX, stop_x = -1, stop_argmax = -1, stop_sample = -1;
  float stop_max = -INFINITY, stop_sum = 0.0f;
  for (int t = warp; t <= rq.n; t += kRsWarps) {
    const RsSplitRecord* records =
        p.split_records + (static_cast<int64_t>(b) * (p.max_spec_len + 1) + t) * p.plan.num_splits;
    float4 first = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const bool is_draft = t < rq.n;
    float u = 0.0f;  // the accept uniform, drawn while the records load
    const RowStats rs = combine_row_records(records, p.plan.num_splits, rq.k, lane, first, [&] {
      if (is_draft && !rq.greedy) {
        u = uniform_from_word(philox_words(rq.seed, rq.offset, kStreamAccept, static_cast<uint32_t>(t + 1), 0u).x);
      }
    });
    const int x = __float_as_int(first.x);  // lane 0: split 0's draft (-1 unless a valid id)
    bool stop = true;
    if (lane == 0 && is_draft) {
      bool accept;
      if (rq.greedy) {
        accept = x >= 0 && x == rs.argmax;
      } else {
        const float lx = first.y, px = first.z;
        const float q = (x >= 0 && lx > -INFINITY && rs.row_max > -INFINITY)
                            ? __fdiv_rn(exp2f((lx - rs.row_max) * rq.k), rs.row_sum)
                            : 0.0f;
        accept = x >= 0 && u * px < q;
      }
      stop = !accept;
    }
    if (__shfl_sync(kFullMask, stop ? 1 : 0, 0) != 0) {
      stop_row = t;
      stop_x = is_draft ? x : -1;
      stop_max = rs.row_max;
      stop_sum = rs.row_sum;
      stop_argmax = rs.argmax;
      stop_sample = rs.sample;
      break;
    }
  }
  RS_TRACE(kRsTraceRecords, stop_row);
  if (lane == 0 && stop_row != INT_MAX) atomicMin(&sm.t_star, stop_row);
  __syncthreads();
  if (lane == 0 && stop_row == sm.t_star) {
    sm.x_star = stop_x;
    sm.max_star = stop_max;
    sm.sum_star = stop_sum;
    sm.argmax_star = stop_argmax;
    sm.sample_star = stop_sample;
  }
  __syncthreads();
}

// Block verification's decision (docs/ALGORITHM.md §6) for the random request in sm.rq,
// block-wide, the same arithmetic as the Triton kernel's _block_ratios / _block_tau. Rows are
// scanned in batches of kRsWarps: warp w combines row base + w's records (as decide_request)
// into sm.block_rows[w], then thread 0 walks the batch in order carrying the running joint
// ratio P (before row r: P_r of the 1-based notation, the scale of row r's residual).
//  - kFinal (the request's finalizer): rows 0 .. n' (n' = the first row without a valid draft,
//    at most n). h_r = R_r / (R_r + 1 - P_r) (1 when the denominator is 0) for 1 <= r < n',
//    with R_r = the residual units' masses of row r (draft probabilities) or P_r (1 - q_r(x_r))
//    (point masses); h_n' = P_n'; tau = the largest r with eta_r < h_r, else 0. Writes
//    sm.t_star = tau, sm.block_scale = P_tau, sm.block_end = n' and row tau's max, sum and
//    sample (sm.max_star, sm.sum_star, sm.sample_star).
//  - otherwise (a residual unit of row stop_row < n): rows 0 .. stop_row. Writes
//    sm.block_scale = P_stop_row, that row's max and sum, and sm.block_end = n' if n' <=
//    stop_row (the row is then past the chain and has no residual to stream), else INT_MAX.
// Results are read after it returns; callers pass a barrier before the next decision.
template <bool kHasDraftProbs, bool kFinal>
__device__ void decide_block(const RejectionSampleParams& p, int b, RsShared& sm, int stop_row) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const RequestContext rq = sm.rq;
  const int last_row = min(stop_row, rq.n);
  if (threadIdx.x == 0) {
    sm.t_star = 0;
    sm.block_scale = 1.0f;
    sm.block_end = INT_MAX;
  }
  float ratio = 1.0f;  // thread 0: P before row `base`
  for (int base = 0;; base += kRsWarps) {
    const int r = base + warp;
    if (r <= last_row) {
      const RsSplitRecord* records =
          p.split_records + (static_cast<int64_t>(b) * (p.max_spec_len + 1) + r) * p.plan.num_splits;
      float4 first = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      const RowStats rs = combine_row_records(records, p.plan.num_splits, rq.k, lane, first);
      float mass = 0.0f;
      if constexpr (kFinal && kHasDraftProbs) {
        if (r >= 1 && r < rq.n) {  // rows < n <= residual_rows, all written by this call's units
          const float* masses = p.residual_masses +
                                (static_cast<int64_t>(b) * p.plan.residual_rows + r) * p.plan.residual_splits;
          for (int s = lane; s < p.plan.residual_splits; s += 32) mass += __ldcg(masses + s);
          mass = warp_sum(mass);
        }
      }
      if (lane == 0) {
        const int x = r < rq.n ? __float_as_int(first.x) : -1;  // split 0's draft: -1 unless valid
        const float lx = first.y;
        RsBlockRow row;
        row.draft = x;
        row.q_x = (x >= 0 && lx > -INFINITY && rs.row_max > -INFINITY)
                      ? __fdiv_rn(exp2f((lx - rs.row_max) * rq.k), rs.row_sum)
                      : 0.0f;
        row.p_x = first.z;
        row.eta = (kFinal && r >= 1)
                      ? uniform_from_word(
                            philox_words(rq.seed, rq.offset, kStreamAccept, static_cast<uint32_t>(r), 0u).x)
                      : 0.0f;
        row.mass = mass;
        row.row_max = rs.row_max;
        row.row_sum = rs.row_sum;
        row.sample = rs.sample;
        sm.block_rows[warp] = row;
      }
    }
    __syncthreads();
    bool done = false;
    if (threadIdx.x == 0) {
      const int count = min(kRsWarps, last_row + 1 - base);
      for (int j = 0; j < count && !done; ++j) {
        const RsBlockRow& row = sm.block_rows[j];
        const int rr = base + j;
        const bool chain_end = rr == rq.n || row.draft < 0;  // rr = n'
        bool keep = false;  // row rr's statistics are the result's
        if constexpr (kFinal) {
          keep = rr == 0;  // tau = 0 unless a later position passes its test
          if (rr >= 1) {
            float h = ratio;  // h_n' = P_n'
            if (!chain_end) {
              const float residual = kHasDraftProbs ? row.mass : ratio * (1.0f - row.q_x);
              const float den = residual + 1.0f - ratio;
              h = den > 0.0f ? __fdiv_rn(residual, den) : 1.0f;
            }
            keep = row.eta < h;
          }
          if (keep) sm.t_star = rr;
        } else {
          keep = rr == stop_row;
        }
        if (keep) {
          sm.block_scale = ratio;
          sm.max_star = row.row_max;
          sm.sum_star = row.row_sum;
          sm.sample_star = row.sample;
        }
        if (chain_end) sm.block_end = rr;
        done = chain_end || rr == stop_row;
        if (!done) {
          // P after draft rr: min(1, P q(x) / p(x)), division-free where p(x) = 0.
          const float num = ratio * row.q_x;
          ratio = num >= row.p_x ? (num > 0.0f ? 1.0f : 0.0f) : __fdiv_rn(num, row.p_x);
        }
      }
    }
    // Also the barrier after which the batch's slots may be rewritten.
    if (__syncthreads_or(done)) break;
  }
}

// Draft threadIdx.x of the request (-1 from n on, or outside the tensor), loaded by a finalizer
// before its decision so that the load overlaps it; write_outputs takes it.
__device__ __forceinline__ int32_t preload_output_draft(const RejectionSampleParams& p, const RequestContext& rq) {
  const int64_t d = rq.cu_lo + threadIdx.x;
  return (static_cast<int>(threadIdx.x) < rq.n && d >= 0 && d < p.num_drafts)
             ? static_cast<int32_t>(load_index(p.draft_token_ids, p.draft_ids_int64, d))
             : -1;
}

// preloaded: preload_output_draft's value (positions past the first kRsThreads load theirs).
__device__ __forceinline__ void write_outputs(const RejectionSampleParams& p, const RequestContext& rq, int b,
                                              int t_star, int token, int32_t preloaded) {
  const int width = p.max_spec_len + 1;
  int32_t* out = p.output_token_ids + static_cast<int64_t>(b) * width;
  for (int pos = threadIdx.x; pos < width; pos += kRsThreads) {
    // Accepted drafts were checked in range by their accept tests.
    int32_t value = pos == t_star ? token : -1;
    if (pos < t_star) {
      value = pos == static_cast<int>(threadIdx.x)
                  ? preloaded
                  : static_cast<int32_t>(load_index(p.draft_token_ids, p.draft_ids_int64, rq.cu_lo + pos));
    }
    out[pos] = value;
  }
  if (threadIdx.x == 0) p.num_accepted[b] = t_star;
}

// Lowest index of the row maximum, -1 without a valid logit (block-wide). A slow path: the
// stream keeps argmaxes for greedy requests only, and random ones need one only when q
// minus the rejected draft has no mass (q a point mass).
template <typename T>
__device__ int row_argmax(const T* row, int limit, RsShared& sm) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float best = -INFINITY;
  int index = INT_MAX;
  for (int i = threadIdx.x; i < limit; i += kRsThreads) {
    const float v = sanitize(load_value(row + i));
    if (v > best) {
      best = v;
      index = i;
    }
  }
  const float m = warp_max(best);
  index = warp_min(best == m ? index : INT_MAX);
  if (lane == 0) {
    sm.reduce_max[warp] = m;
    sm.reduce_index[warp] = index;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float mm = -INFINITY;
    int a = INT_MAX;
#pragma unroll
    for (int w = 0; w < kRsWarps; ++w) {
      if (sm.reduce_max[w] > mm) {
        mm = sm.reduce_max[w];
        a = sm.reduce_index[w];
      } else if (sm.reduce_max[w] == mm) {
        a = min(a, sm.reduce_index[w]);
      }
    }
    sm.argmax = mm > -INFINITY ? a : -1;
  }
  __syncthreads();
  return sm.argmax;
}

// ------------------------------------------------------------------------- kept-set rows

// Split 0 of a row verified from its kept set: the chunk race over the threshold pass's table
// (score log2(W_c) - log2(-log2 v_c) + (m_c - M) k relative to the row max M, lowest chunk on
// ties, the stream's noise), then warp 0 samples inside the winner, reading those 256 logits.
// Every thread gets the score; warp 0 the candidate (-1: none).
template <typename T>
__device__ __forceinline__ void kept_set_race(const RejectionSampleParams& p, RsShared& sm, const RequestContext& rq,
                                              int64_t slot, int t, const T* row_ptr, int limit, float row_max,
                                              int excluded, float thr, float& score, int& candidate) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_chunks = p.plan.num_chunks;
  const float* mass_row = p.kept_chunk_mass + slot * num_chunks;
  const float* max_row = p.chunk_max + slot * num_chunks;
  float best = -INFINITY;
  int best_chunk = INT_MAX, unused = -1;
  for (int c = threadIdx.x; c < num_chunks; c += kRsThreads) {  // c increases: the first wins ties
    const float w = __ldcg(mass_row + c);
    if (w > 0.0f) {
      const PhiloxBlock r = philox_words(rq.seed, rq.offset, kStreamSample, static_cast<uint32_t>(t),
                                         static_cast<uint32_t>(c));
      const float s = (log2f(w) - log2f(-log2f(open_uniform_from_word(r.y)))) + (__ldcg(max_row + c) - row_max) * rq.k;
      if (s > best) {
        best = s;
        best_chunk = c;
      }
    }
  }
  warp_race_winner(best, best_chunk, unused);
  if (lane == 0) {
    sm.reduce_score[warp] = best;
    sm.reduce_chunk[warp] = best_chunk;
  }
  __syncthreads();
  score = -INFINITY;
  int chunk = INT_MAX;
#pragma unroll
  for (int w = 0; w < kRsWarps; ++w) {
    if (sm.reduce_score[w] > score || (sm.reduce_score[w] == score && sm.reduce_chunk[w] < chunk)) {
      score = sm.reduce_score[w];
      chunk = sm.reduce_chunk[w];
    }
  }
  candidate = -1;
  if (warp == 0 && score > -INFINITY) {
    const Segment<T, kRsLaneEntries> seg = load_segment<T, kRsLaneEntries>(
        row_ptr, chunk * kSampleChunk + lane * kRsLaneEntries, limit, p.logits_vectorized, ElemBits<T>::kNegInf);
    const float u = uniform_from_word(philox_words(rq.seed, rq.offset, kStreamSample, static_cast<uint32_t>(t),
                                                   static_cast<uint32_t>(chunk)).x);
    candidate = warp_sample_chunk(seg, chunk, rq.k, excluded, u, thr);
  }
}

// The end of a phase-1 unit: its record, its count, and the request's finalization by the last
// unit (deterministic drafts and greedy requests; phase 2 finalizes the others).
template <typename T, typename P, RsMethod kMethod>
__device__ __forceinline__ void finish_phase1_unit(const RejectionSampleParams& p, RsShared& sm, int unit, int b,
                                                   const RequestContext& rq, float m, float s, int argmax,
                                                   float score, int draft, int candidate) {
  constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  RS_TRACE(kRsTraceCombined, candidate + __float_as_uint(s) + __float_as_uint(score));
  if (threadIdx.x == 0) {
    float4* rec = reinterpret_cast<float4*>(p.split_records + static_cast<int64_t>(unit));
    __stcg(rec, make_float4(m, s, __int_as_float(argmax), score));
    __stcg(rec + 1, make_float4(__int_as_float(draft), sm.draft_logit, sm.draft_prob, __int_as_float(candidate)));
    // Release the record and count it; the last unit of the request finalizes it.
    const int done = count_unit(p.counters + b);
    RS_TRACE(kRsTraceCounted, done);
    sm.is_last = done == (rq.n + 1) * p.plan.num_splits - 1;
  }
  __syncthreads();
  // With draft probabilities random requests are finalized by their phase-2 units.
  if (sm.is_last && (!kHasDraftProbs || rq.greedy)) {
    const int32_t out_draft = preload_output_draft(p, rq);
    if constexpr (kMethod == kRsMethodBlock && !kHasDraftProbs) {
      // Point-mass drafts: R_i comes from the accept-test operands, and the sample of row tau
      // (its draft left out when tau < n') is already in its records.
      if (rq.greedy) {
        decide_request(p, b, sm);
      } else {
        decide_block<false, true>(p, b, sm, rq.n);
      }
    } else {
      decide_request(p, b, sm);
    }
    const RequestContext rq = sm.rq;
    const int t_star = sm.t_star;
    int token = rq.greedy ? sm.argmax_star : sm.sample_star;
    RS_TRACE(kRsTraceDecided, t_star + token);
    if (!rq.greedy && token < 0) {
      // Deterministic drafts: q minus the rejected draft is empty only if q is a point mass,
      // which is then the argmax (-1 for a row without a valid logit).
      const int64_t row_star = rq.cu_lo + b + t_star;
      const bool star_ok = row_star >= 0 && row_star < p.num_rows;
      token = row_argmax(static_cast<const T*>(p.target_logits) + (star_ok ? row_star : 0) * p.logits_row_stride,
                         star_ok ? p.vocab_size : 0, sm);
    }
    write_outputs(p, rq, b, t_star, token, out_draft);
    RS_TRACE(kRsTraceFinalized, token);
    if (threadIdx.x == 0) p.counters[b] = 0;
  }
}

// -------------------------------------------------------------------------------- phase 1

// kFiltered: the instance for calls with sampling filters (p.row_thresholds set); the
// unfiltered instance compiles none of the filter paths.
template <typename T, typename P, RsMethod kMethod, bool kFiltered>
__device__ void phase1_unit(const RejectionSampleParams& p, RsShared& sm, int unit) {
  constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  constexpr int kStages = RsConfig<T, P>::kStages;
  constexpr int kE = kRsLaneEntries;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int width = p.max_spec_len + 1;
  const int split = unit % p.plan.num_splits;
  const int row_unit = unit / p.plan.num_splits;
  const int b = row_unit / width;
  const int t = row_unit % width;
  // Sampling filters: the row's threshold and kept-set mark, loaded before and alongside the
  // request's fields (neither depends on them; slot < B (K + 1) for every unit).
  const int64_t slot = static_cast<int64_t>(b) * width + t;
  float row_thr = -INFINITY, row_kept = 0.0f;
  if constexpr (kFiltered) {
    row_thr = p.row_thresholds[slot];
    if (p.kept_sum != nullptr) row_kept = p.kept_sum[slot];
  }
  const int tile_lo = split * p.plan.tiles_per_split;
  const int tile_hi = min(tile_lo + p.plan.tiles_per_split, p.plan.num_tiles);
  // The request's fields (and the guessed draft id below) go out before the first tiles: behind
  // them, they would wait for them. They are decoded after the tiles are issued.
  const RequestWords rq_words = load_request_words(p, b);
  // Uniform batches (every request has max_spec_len drafts: num_drafts == B * max_spec_len,
  // which well-formed offsets imply) hold row (b, t) at b (K + 1) + t and its draft at b K + t.
  // The first tiles and the draft id then go out with the request's fields rather than after
  // them (a global round trip, 1-1.8 us); the fields confirm the guess, and a miss (malformed
  // offsets only) waits for the guessed copies and issues the row's own.
  const bool uniform = !kFiltered && p.num_drafts == static_cast<int64_t>(p.num_requests) * p.max_spec_len;
  const int64_t guess_row = uniform && slot < p.num_rows ? slot : -1;
  const int64_t guess_draft = static_cast<int64_t>(b) * p.max_spec_len + t;
  TileStream<T, kStages, 0> stream{static_cast<const T*>(p.target_logits) + (guess_row >= 0 ? guess_row : 0) *
                                                                                   p.logits_row_stride,
                                   guess_row >= 0 ? p.vocab_size : 0, p.logits_vectorized, ElemBits<T>::kNegInf};
  int64_t guess_x = -1;
  if (uniform && t < p.max_spec_len && guess_draft < p.num_drafts) {
    guess_x = load_index(p.draft_token_ids, p.draft_ids_int64, guess_draft);
  }
  const auto issue = [&](int tile, int stage) { stream.issue(tile, stage); };
  if (guess_row >= 0) issue_first_tiles<kStages>(tile_lo, tile_hi, issue);

  const RequestContext rq = decode_request(p, rq_words);
  RS_TRACE(kRsTraceRequest, rq.n + static_cast<uint32_t>(rq.seed) + __float_as_uint(rq.k));
  if (t > rq.n) {
    cp_async_wait<0>();  // a guessed stream's copies land before the CTA leaves
    return;
  }

  const int64_t row = rq.cu_lo + b + t;
  const bool row_ok = row >= 0 && row < p.num_rows;
  const int limit = row_ok ? p.vocab_size : 0;
  const T* row_ptr = static_cast<const T*>(p.target_logits) + (row_ok ? row : 0) * p.logits_row_stride;
  const float k = rq.k;
  // The threshold (-inf: unfiltered; greedy rows ignore the filters), and whether the pass held
  // the row's whole kept set (then no stream; CTA-uniform).
  const float thr = rq.greedy ? -INFINITY : row_thr;
  const bool kept_row = thr > -INFINITY && row_kept > 0.0f;
  if (!kept_row && !(guess_row >= 0 && row == guess_row)) {
    cp_async_wait<0>();
    stream.row = row_ptr;
    stream.limit = limit;
    issue_first_tiles<kStages>(tile_lo, tile_hi, issue);
  }

  // While the first tiles arrive: the draft of this row. Split 0 records it with l(x) and
  // p(x) for the accept test (thread 0 loads them; they hit lines the stream reads anyway),
  // and deterministic drafts leave it out of the row's sample.
  int draft = -1;
  if (t < rq.n && (split == 0 || (!kHasDraftProbs && !rq.greedy))) {
    const int64_t d = rq.cu_lo + t;
    if (d >= 0 && d < p.num_drafts) {
      const int64_t x = uniform && d == guess_draft ? guess_x : load_index(p.draft_token_ids, p.draft_ids_int64, d);
      if (x >= 0 && x < p.vocab_size) draft = static_cast<int>(x);
    }
  }
  // Thread 0 stores them to shared memory only after the next barrier (random rows) or before
  // its stream (greedy rows), so that no barrier waits for these loads.
  float draft_logit = -INFINITY, draft_prob = 1.0f;
  if (threadIdx.x == 0) {
    sm.rq = rq;
    if (split == 0 && t < rq.n) {
      // (-inf below the filter threshold: q(x) = 0, the draft is rejected)
      if (draft >= 0 && row_ok) draft_logit = sanitize_below(load_value(row_ptr + draft), thr);
      if constexpr (kHasDraftProbs) {
        draft_prob = draft >= 0 ? load_value(static_cast<const P*>(p.draft_probs) +
                                             (rq.cu_lo + t) * p.draft_probs_row_stride + draft)
                                : 0.0f;
      }
    }
  }
  const auto store_draft_operands = [&] {
    if (threadIdx.x == 0) {
      sm.draft_logit = draft_logit;
      sm.draft_prob = draft_prob;
    }
  };

  if (kept_row) {
    // The row's record from the pass's: split 0 gets M, Z_t and the race; the others are empty.
    store_draft_operands();
    float score = -INFINITY;
    int candidate = -1;
    const float kept_max = split == 0 ? p.kept_max[slot] : -INFINITY;  // one load; kept_sum is row_kept
    if (split == 0) {
      kept_set_race(p, sm, rq, slot, t, row_ptr, limit, kept_max, kHasDraftProbs ? -1 : draft, thr, score, candidate);
    }
    finish_phase1_unit<T, P, kMethod>(p, sm, unit, b, rq, kept_max, split == 0 ? row_kept : 0.0f, -1, score, draft,
                                      candidate);
    return;
  }

  const int group = threadIdx.x / kRsChunkLanes;  // this thread's chunk of a tile
  const int gl = threadIdx.x % kRsChunkLanes;
  using Seg = Segment<T, kE>;
  if (rq.greedy) {
    store_draft_operands();
    // Per-lane running max and its first index; a lane's entries come in increasing order.
    float run_max = -INFINITY;
    int run_arg = INT_MAX;
    pipeline_tiles<kStages>(tile_lo, tile_hi, issue, [&](int tile, int stage) {
      float lane_max = -INFINITY;
#pragma unroll
      for (int h = 0; h < kRsLaneSegments; ++h) lane_max = fmaxf(lane_max, segment_max(stream.segment(stage, h)));
      const float m = fminf(lane_max, FLT_MAX);
      if (m > run_max) {  // rare after the first tiles: find its first entry
        int first = INT_MAX;
#pragma unroll 1
        for (int h = kRsLaneSegments - 1; h >= 0; --h) {
          const Seg seg = stream.segment(stage, h);
#pragma unroll
          for (int j = kE - 1; j >= 0; --j) {
            if (sanitize(segment_value(seg, j)) == m) first = entry_index(tile * kRsTileChunks + group, h, j);
          }
        }
        run_max = m;
        run_arg = first;
      }
    });
    RS_TRACE(kRsTraceStreamed, __float_as_uint(run_max));
    const float wm = warp_max(run_max);
    const int arg = warp_min(run_max == wm ? run_arg : INT_MAX);
    if (lane == 0) {
      sm.reduce_max[warp] = wm;
      sm.reduce_index[warp] = arg;
    }
  } else {
    // Per lane group running max, sum and race lead over its chunks (uniform over the group).
    const int excluded = kHasDraftProbs ? -1 : draft;
    const int excluded_chunk = excluded >= 0 ? excluded / kSampleChunk : -1;
    const int excluded_tile = excluded >= 0 ? excluded_chunk / kRsTileChunks : -1;
    const int chunk_lo = tile_lo * kRsTileChunks;
    fill_race_noise(sm, rq, t, chunk_lo, min(tile_hi * kRsTileChunks, p.plan.num_chunks) - chunk_lo);
    __syncthreads();
    store_draft_operands();
    float run_max = -INFINITY, run_sum = 0.0f, race = -INFINITY;
    int race_chunk = INT_MAX;
    // A filtered row (CTA-uniform) takes a plain per-entry path: logits below thr count as -inf.
    const bool filtered = kFiltered && thr > -INFINITY;
    pipeline_tiles<kStages>(tile_lo, tile_hi, issue, [&](int tile, int stage) {
      const int chunk = tile * kRsTileChunks + group;
      Seg seg[kRsLaneSegments];
#pragma unroll
      for (int h = 0; h < kRsLaneSegments; ++h) seg[h] = stream.segment(stage, h);
      // The chunk max (sanitized, filtered), its mass without the excluded draft, and with it.
      float m, mass, full;
      if (filtered) {
        m = masked_chunk_max(seg, thr);
        const float m_safe = m > -INFINITY ? m : 0.0f;
        float lane_mass = 0.0f, lane_excluded = 0.0f;
#pragma unroll
        for (int h = 0; h < kRsLaneSegments; ++h) {
#pragma unroll
          for (int j = 0; j < kE; ++j) {
            const float x = sanitize_below(segment_value(seg[h], j), thr);
            const float w = x > -INFINITY ? exp2f((x - m_safe) * k) : 0.0f;
            if (entry_index(chunk, h, j) == excluded) {
              lane_excluded += w;
            } else {
              lane_mass += w;
            }
          }
        }
        mass = group_sum(lane_mass);
        full = mass + group_sum(lane_excluded);
      } else {
        float lane_max = -INFINITY;
#pragma unroll
        for (int h = 0; h < kRsLaneSegments; ++h) lane_max = fmaxf(lane_max, segment_max(seg[h]));
        m = group_max(fminf(lane_max, FLT_MAX));  // the chunk max (sanitized)
        // exp2((l - m) k) as one FMA, exp2(l k - m k), while m k is small: its float rounding
        // (|m k| 2^-24, one factor for the whole chunk, but a different one per chunk) stays
        // below 2^-16, as accurate as (l - m) k. Larger |m k| (tiny temperatures: T = 1e-6 makes
        // m k ~ 1e7, rounded by up to 0.5, a factor of up to 1.41 between chunks) use the exact
        // form. A chunk without a valid logit gets weights 0 from m = 0 (-inf entries; NaNs are
        // fixed below).
        const float mk = (m > -INFINITY ? m : 0.0f) * k;
        const bool fma_exact = fabsf(mk) <= 256.0f;  // uniform over the lane group
        const auto weight = [=](float v) { return exp2f(fma_exact ? fmaf(v, k, -mk) : (v - m) * k); };
        mass = lane_chunk_mass(seg, m, k, mk, fma_exact);
        // This lane's weights of segment h as the sample uses them, recomputed from the tile:
        // NaN logits (weight NaN) -> 0, +inf logits (weight inf) -> 1, the excluded draft -> 0.
        const auto segment_weights = [=](int h, float(&w)[kE]) {
          const Seg sg = *TileStream<T, kStages, 0>::slot(stage, h);
#pragma unroll
          for (int j = 0; j < kE; ++j) {
            const float x = weight(segment_value(sg, j));
            w[j] = (is_nan(x) || entry_index(chunk, h, j) == excluded) ? 0.0f : fminf(x, 1.0f);
          }
        };
        // Each weight is about <= 1: a larger sum means a NaN or +inf logit in this lane. Rare,
        // like the chunk holding a deterministic draft (its weight leaves the sample, not the
        // softmax sum): recompute the lane's mass from the sanitized weights.
        float excluded_w = 0.0f;
        if (!(__float_as_uint(mass) <= __float_as_uint(2.0f * kRsLaneSegments * kE)) || chunk == excluded_chunk) {
          mass = 0.0f;
#pragma unroll 1
          for (int h = 0; h < kRsLaneSegments; ++h) {
            float w[kE];
            segment_weights(h, w);
#pragma unroll
            for (int j = 0; j < kE; ++j) mass += w[j];
          }
          const int jx = excluded - entry_index(chunk, 0, 0);
          if (chunk == excluded_chunk && jx >= 0 && jx % (kRsChunkLanes * kE) < kE) {
            // One element at a run-time position: a scalar shared-memory load.
            const T* e = reinterpret_cast<const T*>(TileStream<T, kStages, 0>::slot(stage, jx / (kRsChunkLanes * kE)));
            const float x = weight(shared_value(e + jx % kE));
            excluded_w = is_nan(x) ? 0.0f : fminf(x, 1.0f);
          }
        }
        mass = group_sum(mass);
        full = tile == excluded_tile ? mass + group_sum(excluded_w) : mass;
      }
      // The race relative to the running max (docs/ALGORITHM.md §3: shift by (m_c - M) k).
      const float new_max = fmaxf(run_max, m);
      const float old_score = run_max > -INFINITY ? race + (run_max - new_max) * k : -INFINITY;
      const float2 noise = sm.noise[chunk - chunk_lo];
      const float new_score = mass > 0.0f ? (log2f(mass) - noise.y) + (m - new_max) * k : -INFINITY;
      // The group's lead (chunks increase: the first one wins ties); the unit samples inside
      // its winning chunk once, at the end.
      const bool take = new_score > old_score;
      race = take ? new_score : old_score;
      race_chunk = take ? chunk : race_chunk;
      if (m > run_max) {
        run_sum = run_sum * exp2f((run_max - m) * k) + full;  // 0 while run_max = -inf
      } else if (m > -INFINITY) {
        run_sum += full * exp2f((m - run_max) * k);
      }
      run_max = new_max;
    });
    RS_TRACE(kRsTraceStreamed, __float_as_uint(run_sum));
    if (gl == 0) {
      sm.reduce_max[group] = run_max;
      sm.reduce_sum[group] = run_sum;
      sm.reduce_score[group] = race;
      sm.reduce_chunk[group] = race_chunk;
    }
  }

  __syncthreads();
  RS_TRACE(kRsTraceWaited, 0);
  // Combine the parts (warps for greedy rows, lane groups for random ones), warp 0; it samples
  // in a random row's winning chunk, reading it again.
  float m = -INFINITY, s = 0.0f, score = -INFINITY;
  int a = INT_MAX, candidate = -1;
  if (warp == 0) {
    if (rq.greedy) {
      warp_combine_max_index(sm.reduce_max, sm.reduce_index, kRsWarps, m, a);
    } else {
      int chunk = -1;
      warp_combine_max_sum(sm.reduce_max, sm.reduce_sum, kRsGroups, k, m, s);
      warp_combine_chunk_races<true>(sm, m, k, score, chunk);
      if (chunk >= 0) {
        const int excluded = kHasDraftProbs ? -1 : draft;
        candidate = warp_sample_chunk(stream.chunk_segment(chunk, tile_lo, tile_hi), chunk, k, excluded,
                                      sm.noise[chunk - tile_lo * kRsTileChunks].x, thr);
      }
    }
  }
  finish_phase1_unit<T, P, kMethod>(p, sm, unit, b, rq, m, s, (rq.greedy && m > -INFINITY) ? a : -1, score, draft,
                                    candidate);
}

// -------------------------------------------------------------------------------- phase 2

template <typename T, typename P, RsMethod kMethod, bool kFiltered>
__device__ void phase2_unit(const RejectionSampleParams& p, RsShared& sm, int unit) {
  constexpr bool kBlock = kMethod == kRsMethodBlock;
  constexpr int kE = kRsLaneEntries;
  constexpr int kStages = RsConfig<T, P>::kResidualStages;
  using LogitStream = TileStream<T, kStages, 0>;
  using ProbStream = TileStream<P, kStages, LogitStream::kBytes>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int r = unit - p.plan.units_phase1;
  // Unit (request b, residual row, split): token verification has one residual row per request
  // (the rejected one, known after the decision), block verification one per draft row.
  const int units_per_request = kBlock ? p.plan.residual_rows * p.plan.residual_splits : p.plan.residual_splits;
  const int b = r / units_per_request;
  const int residual_row = kBlock ? (r % units_per_request) / p.plan.residual_splits : 0;
  const int split = r % p.plan.residual_splits;
  {
    const RequestContext rq = load_request(p, b);
    RS_TRACE(kRsTraceRequest, rq.n + static_cast<uint32_t>(rq.seed) + __float_as_uint(rq.k));
    if (rq.greedy) return;  // finalized by its last phase-1 unit
    if (threadIdx.x == 0) sm.rq = rq;  // for the decision, rather than registers across it
    if (p.plan.prefetch_residual) {
      // While phase 1 runs: this unit's tiles of the draft-probability rows its residual may read
      // (token verification: any draft row, the rejected one is not known yet; block
      // verification: its own row) into L2. The target rows are there from phase 1's stream.
      const int tile_lo = split * p.plan.residual_tiles_per_split;
      const int tile_hi = min(tile_lo + p.plan.residual_tiles_per_split, p.plan.num_tiles);
      const int t_lo = kBlock ? residual_row : 0;
      const int t_hi = kBlock ? min(residual_row + 1, rq.n) : rq.n;
      for (int t = t_lo; t < t_hi; ++t) {
        const int64_t d = rq.cu_lo + t;
        if (d >= 0 && d < p.num_drafts) {
          prefetch_tiles_l2(static_cast<const P*>(p.draft_probs) + d * p.draft_probs_row_stride, p.vocab_size, tile_lo,
                            tile_hi);
        }
      }
    }
  }

  // Wait for the request's phase 1 (those units hold lower tickets: they already run). Block
  // verification's units past the chain wait too: any unit may be the one that finalizes.
  if (threadIdx.x == 0) {
    const int need = (sm.rq.n + 1) * p.plan.num_splits;
    unsigned sleep_ns = 32;
    while (load_acquire(p.counters + b) < need) {  // acquires the phase-1 records
      __nanosleep(sleep_ns);
      if (sleep_ns < 1024) sleep_ns *= 2;
    }
    RS_TRACE(kRsTraceWaited, need);
  }
  __syncthreads();
  int t_star;             // the row this unit streams
  float max_star, sum_star;  // its statistics
  float residual_scale;    // P of block verification (1 for token verification)
  bool in_chain;           // the row's residual is part of the decision (records must be written)
  if constexpr (kBlock) {
    // Row residual_row's residual max(0, P q - p), P = the joint ratio of the drafts before it;
    // rows from n' on (past an invalid draft, or past n) have none.
    t_star = residual_row;
    in_chain = false;
    residual_scale = 1.0f;
    max_star = -INFINITY;
    sum_star = 0.0f;
    if (residual_row < sm.rq.n) {
      decide_block<true, false>(p, b, sm, residual_row);
      in_chain = residual_row < sm.block_end;
      residual_scale = sm.block_scale;
      max_star = sm.max_star;
      sum_star = sm.sum_star;
    }
  } else {
    decide_request(p, b, sm);
    t_star = sm.t_star;
    max_star = sm.max_star;
    sum_star = sm.sum_star;
    residual_scale = 1.0f;
    // An invalid draft id at t* ends the chain with nothing to subtract: q's sample is final.
    in_chain = t_star < sm.rq.n && sm.x_star >= 0;
  }
  const RequestContext rq = sm.rq;
  const int64_t row = rq.cu_lo + b + t_star;
  const bool row_ok = row >= 0 && row < p.num_rows && max_star > -INFINITY;
  const bool needs_residual = in_chain && row_ok;
  // This unit's record slot: (request, residual row, split).
  const int64_t request_slot = kBlock ? static_cast<int64_t>(b) * p.plan.residual_rows + residual_row : b;
  const int64_t slot = request_slot * p.plan.residual_splits + split;
  if (needs_residual) {
    const float k = rq.k;
    // Sampling filters: q is 0 below the row's threshold (-inf: unfiltered).
    const float thr = kFiltered
                          ? p.row_thresholds[static_cast<int64_t>(b) * (p.max_spec_len + 1) + t_star] : -INFINITY;
    // q * P as exp2((l - M) k) * (P / S): P folds into the normalizer (P = 1 for token mode).
    const float inv_sum = kBlock ? residual_scale * __frcp_rn(sum_star) : __frcp_rn(sum_star);
    const int limit = p.vocab_size;
    const int tile_lo = split * p.plan.residual_tiles_per_split;
    const int tile_hi = min(tile_lo + p.plan.residual_tiles_per_split, p.plan.num_tiles);
    const LogitStream logits{static_cast<const T*>(p.target_logits) + row * p.logits_row_stride, limit,
                             p.logits_vectorized, ElemBits<T>::kNegInf};
    const ProbStream probs{static_cast<const P*>(p.draft_probs) + (rq.cu_lo + t_star) * p.draft_probs_row_stride,
                           limit, p.probs_vectorized, 0u};
    const auto issue = [&](int tile, int stage) {
      logits.issue(tile, stage);
      probs.issue(tile, stage);
    };
    issue_first_tiles<kStages>(tile_lo, tile_hi, issue);
    const int chunk_lo = tile_lo * kRsTileChunks;
    fill_race_noise(sm, rq, t_star, chunk_lo, min(tile_hi * kRsTileChunks, p.plan.num_chunks) - chunk_lo);
    __syncthreads();
    const int group = threadIdx.x / kRsChunkLanes;
    const int gl = threadIdx.x % kRsChunkLanes;
    float race = -INFINITY;
    int race_chunk = INT_MAX;
    float unit_mass = 0.0f;  // block verification: the group's residual mass (uniform over the group)
    pipeline_tiles<kStages>(tile_lo, tile_hi, issue, [&](int tile, int stage) {
      const int chunk = tile * kRsTileChunks + group;
      float mass = 0.0f;
#pragma unroll
      for (int h = 0; h < kRsLaneSegments; ++h) {
        const auto lseg = logits.segment(stage, h);
        const auto pseg = probs.segment(stage, h);
#pragma unroll
        for (int j = 0; j < kE; ++j) {
          mass += residual_weight(segment_value(lseg, j), segment_value(pseg, j), max_star, k, inv_sum, thr);
        }
      }
      mass = group_sum(mass);
      if constexpr (kBlock) unit_mass += mass;
      const float2 noise = sm.noise[chunk - chunk_lo];
      const float score = mass > 0.0f ? log2f(mass) - noise.y : -INFINITY;
      const bool take = score > race;
      race = take ? score : race;
      race_chunk = take ? chunk : race_chunk;
    });
    RS_TRACE(kRsTraceStreamed, __float_as_uint(race));
    if (gl == 0) {
      sm.reduce_score[group] = race;
      sm.reduce_chunk[group] = race_chunk;
      if constexpr (kBlock) sm.reduce_sum[group] = unit_mass;
    }
    __syncthreads();
    if (warp == 0) {
      float score = -INFINITY;
      int chunk = -1;
      warp_combine_chunk_races<false>(sm, 0.0f, k, score, chunk);
      int candidate = -1;
      if (chunk >= 0) {
        candidate = warp_sample_residual_chunk(logits.chunk_segment(chunk, tile_lo, tile_hi),
                                               probs.chunk_segment(chunk, tile_lo, tile_hi), chunk, max_star, k,
                                               inv_sum, sm.noise[chunk - chunk_lo].x, thr);
      }
      if (threadIdx.x == 0) {
        __stcg(reinterpret_cast<float2*>(p.residual_records + slot), make_float2(score, __int_as_float(candidate)));
      }
      if constexpr (kBlock) {
        const float split_mass = warp_sum(sm.reduce_sum[lane]);  // lane g: group g
        if (threadIdx.x == 0) __stcg(p.residual_masses + slot, split_mass);
      }
    }
  } else if (kBlock && residual_row < rq.n && threadIdx.x == 0) {
    // No residual to stream (a row past the chain, n' <= row < n, or one without a valid
    // logit): the finalizer reads the masses of every row below n, and the records of row tau.
    __stcg(reinterpret_cast<float2*>(p.residual_records + slot), make_float2(-INFINITY, __int_as_float(-1)));
    __stcg(p.residual_masses + slot, 0.0f);
  }

  if (threadIdx.x == 0) {
    const int done = count_unit(p.counters + p.num_requests + b);
    RS_TRACE(kRsTraceCounted, done);
    sm.is_last = done == units_per_request - 1;
  }
  __syncthreads();
  if (sm.is_last) {
    const int32_t out_draft = preload_output_draft(p, rq);
    bool final_residual = needs_residual;
    if constexpr (kBlock) {
      // Every row's residual mass is in: tau, and the residual of row tau if tau < n'.
      decide_block<true, true>(p, b, sm, rq.n);
      t_star = sm.t_star;
      final_residual = sm.t_star < sm.block_end;
    }
    const int64_t final_slot = kBlock ? static_cast<int64_t>(b) * p.plan.residual_rows + t_star : b;
    const RsResidualRecord* records = p.residual_records + final_slot * p.plan.residual_splits;
    if (threadIdx.x < 32) {
      // q's own sample of row t*: the bonus, an invalid draft's row, or a residual without
      // mass (q == p up to rounding), with the same noise.
      int token = sm.sample_star;
      if (final_residual) {
        float best = -INFINITY;
        int best_split = INT_MAX, best_cand = -1;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int s = lane + 32 * rr;
          if (s < p.plan.residual_splits) {
            const float2 rec = __ldcg(reinterpret_cast<const float2*>(records + s));
            if (rec.x > best) {
              best = rec.x;
              best_split = s;
              best_cand = __float_as_int(rec.y);
            }
          }
        }
        warp_race_winner(best, best_split, best_cand);
        if (best > -INFINITY && best_cand >= 0) token = best_cand;
      }
      if (lane == 0) sm.token = token;
    }
    __syncthreads();
    write_outputs(p, rq, b, t_star, sm.token, out_draft);
    RS_TRACE(kRsTraceFinalized, sm.token);
    if (threadIdx.x == 0) {
      p.counters[b] = 0;
      p.counters[p.num_requests + b] = 0;
    }
  }
}

}  // namespace rs_detail

// ---------------------------------------------------------------------------------- kernel

template <typename T, typename P>
constexpr int rejection_sample_smem_bytes() {
  return rs_detail::RsConfig<T, P>::kSmemBytes;
}

template <typename T, typename P, RsMethod kMethod, bool kFiltered>
__global__ void __launch_bounds__(kRsThreads, rs_detail::RsConfig<T, P>::kMinBlocksPerSM)
    rejection_sample_kernel(const RejectionSampleParams p) {
  constexpr bool kHasDraftProbs = !std::is_same<P, NoDraftProbs>::value;
  __shared__ rs_detail::RsShared sm;
  wait_for_prior_kernels();
  allow_next_kernel_launch();
  RS_TRACE(kRsTraceEntry, 0);
  int unit = static_cast<int>(blockIdx.x);
  if constexpr (kHasDraftProbs) {
    // Tickets in start order: phase-2 units only wait for units that already run.
    if (threadIdx.x == 0) sm.unit = atomicAdd(p.counters + 2 * p.num_requests, 1);
    __syncthreads();
    unit = sm.unit;
  }
  RS_TRACE_UNIT(unit, unit >= p.plan.units_phase1);
  if (unit < p.plan.units_phase1) {
    rs_detail::phase1_unit<T, P, kMethod, kFiltered>(p, sm, unit);
  } else {
    if constexpr (kHasDraftProbs) rs_detail::phase2_unit<T, P, kMethod, kFiltered>(p, sm, unit);
  }
  if constexpr (kHasDraftProbs) {
    if (threadIdx.x == 0) {
      // Every unit has its ticket once the last one finishes: reset ticket and count.
      const int finished = atomicAdd(p.counters + 2 * p.num_requests + 1, 1);
      if (finished == p.plan.units_total - 1) {
        p.counters[2 * p.num_requests] = 0;
        p.counters[2 * p.num_requests + 1] = 0;
      }
    }
  }
}

// Prepares an instance for launches on the current device (its shared-memory limit) and
// returns how many of its CTAs an SM runs at once, for the plan's target grid size.
template <typename T, typename P, RsMethod kMethod = kRsMethodToken, bool kFiltered = false>
cudaError_t rejection_sample_prepare(int* blocks_per_sm) {
  constexpr int kSmem = rejection_sample_smem_bytes<T, P>();
  cudaError_t err = cudaFuncSetAttribute(rejection_sample_kernel<T, P, kMethod, kFiltered>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, rejection_sample_kernel<T, P, kMethod, kFiltered>,
                                                       kRsThreads, kSmem);
}

// params.plan must come from plan_rejection_sample(..., kMethod); kFiltered iff
// params.row_thresholds is set. pdl: programmatic dependent launch (sm_90+ only).
template <typename T, typename P, RsMethod kMethod = kRsMethodToken, bool kFiltered = false>
cudaError_t launch_rejection_sample(const RejectionSampleParams& params, cudaStream_t stream, bool pdl = false) {
  return launch_with_pdl(rejection_sample_kernel<T, P, kMethod, kFiltered>,
                         static_cast<unsigned int>(params.plan.units_total), kRsThreads,
                         rejection_sample_smem_bytes<T, P>(), stream, pdl, params);
}

}  // namespace specdec
