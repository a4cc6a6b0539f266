// The chain kernel's timeline trace, compiled in a profiling build only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace specdec {

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

}  // namespace specdec
