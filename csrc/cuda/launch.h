// Host entry points of the CUDA kernels (csrc/cuda/quantize_kernels.cu), torch-free: raw device
// pointers, the plain-data arguments of qtensor/args.h, a stream. Each returns the launch error.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "qtensor/args.h"

namespace qtensor {
namespace cuda {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

cudaError_t launch_float(const void* x, void* y, DType dt, const Layout& L,
                         const FloatSpec<uint32_t>& s, int mode, uint32_t key, cudaStream_t st);
cudaError_t launch_fixed(const void* x, void* y, DType dt, const Layout& L,
                         const FixedSpec<uint32_t>& s, bool wrap, int mode, uint32_t key,
                         cudaStream_t st);
// amax: a device scratch word (uint32) receiving max |x| as float32 bits (finite elements only
// when `finite`); the caller zeroes it first.
cudaError_t launch_amax(const void* x, DType dt, const Layout& L, bool finite, uint32_t* amax,
                        cudaStream_t st);
// blocks; for whole-tensor blocks (a.whole_tensor), amax_dev[0] holds the tensor's amax bits and
// amax_dev[2..3] is scratch for the settled amax-rule scale (a double).
cudaError_t launch_block(const void* x, void* y, DType dt, const Layout& L, const BlockArgs& a,
                         int mode, uint32_t key, const uint32_t* amax_dev, cudaStream_t st);

}  // namespace cuda
}  // namespace qtensor
