// Programmatic dependent launch: the device side (the first statements of every kernel) and
// the host-side launch helper both kernels' launchers use.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace specdec {

// Programmatic dependent launch (sm_90+; docs/DECISIONS.md#cuda-pdl). A kernel launched with
// launch_with_pdl(..., true) may have its CTAs scheduled before the previous kernel in the stream
// has finished; its first statement is wait_for_prior_kernels(), which returns once that kernel has
// completed and its writes are visible, so nothing is read or written early. Once a CTA is past the
// wait it allows the next kernel to be scheduled the same way: at most two grids overlap, and the
// next one only in slots the current one does not need. No-ops before sm_90.
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

}  // namespace specdec
