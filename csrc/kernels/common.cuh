// What both kernels share before any code: the CTA layout of the stream (docs/ALGORITHM.md §3:
// chunks of 256 logits; a tile of 32 chunks; a lane group of 8 threads per chunk), a few
// numeric constants, the temperature dtype codes and the deterministic-drafts tag.
//
// One CTA of kRsThreads = 256 threads per work unit. Lane group g (threads 8g .. 8g + 7, a
// quarter-warp) holds chunk g of a tile, 32 logits per lane as kRsLaneSegments = 4 segments of
// kRsLaneEntries = 8 consecutive logits (entries 64 s + 8 l of the chunk for lane l). The kRs
// prefix is historical: the tree kernel (kRt*) uses the same layout.
#pragma once

#include <cstdint>

namespace specdec {

constexpr int kSampleChunk = 256;  // docs/ALGORITHM.md §3; sampling lanes are chunk indices
constexpr int kRsThreads = 256;
constexpr int kRsWarps = kRsThreads / 32;
constexpr int kRsChunkLanes = 8;  // a lane group (quarter-warp) holds a chunk: 32 logits per lane
constexpr int kRsGroups = kRsThreads / kRsChunkLanes;  // 32 chunks per tile
constexpr int kRsLaneEntries = 8;                      // a segment: 16 bytes of bf16 / fp16, 32 of fp32
constexpr int kRsLaneSegments = kSampleChunk / (kRsChunkLanes * kRsLaneEntries);  // 4: entries 64 s + 8 l
constexpr int kRsTileChunks = kRsGroups;
constexpr int kRsTileEntries = kRsTileChunks * kSampleChunk;  // 8192

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

// Ceiling division of the host plans.
inline int64_t rs_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace specdec
