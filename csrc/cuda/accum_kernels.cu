// CUDA kernel of qtensor::accum_matmul. Torch-free: compile-checked on its own with
//   nvcc -std=c++17 -c -I csrc/include csrc/cuda/accum_kernels.cu -o /dev/null
// One thread per output element runs qtensor::acc_dot (include/qtensor/accum.h), the function
// the CPU scalar path runs, so CPU and CUDA give the same bits. A simple, unoptimized kernel: the
// emulation's cost is in the per-product alignment, which no tensor core can do for us.
#include <cuda_runtime.h>
#include <stdint.h>

#include "qtensor/accum.h"

namespace qtensor {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__global__ void exponents_kernel(const float* x, int* e, int64_t n, int emin) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    e[i] = acc_exp_f32(x[i], emin);
}

// a (B, M, K) and bt (B, N, K) contiguous, out (B, M, N); optional (nullptr): the group
// exponents ga (B, M, G) and gbt (B, N, G), the initial accumulator c (B, M, N)
__global__ void accum_kernel(const float* a, const float* bt, const int* ea, const int* eb,
                             const int* ga, const int* gbt, const float* c, int64_t B, int64_t M,
                             int64_t N, int64_t K, int64_t G, AccumSpec s, float* out) {
  const int64_t total = B * M * N;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int64_t bi = t / (M * N), i = t / N % M, j = t % N;
    const int64_t ia = (bi * M + i) * K, jb = (bi * N + j) * K;
    out[t] = acc_dot(a + ia, bt + jb, ea + ia, eb + jb, K, s, c ? c[t] : 0.0f,
                     ga ? ga + (bi * M + i) * G : nullptr, gbt ? gbt + (bi * N + j) * G : nullptr);
  }
}

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return (int)(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

}  // namespace

// ea and eb: device scratch of a's and bt's sizes (ints); ga, gbt, c as accum_kernel's
cudaError_t launch_accum(const float* a, const float* bt, int* ea, int* eb, const int* ga,
                         const int* gbt, const float* c, int64_t B, int64_t M, int64_t N,
                         int64_t K, const AccumSpec& s, float* out, cudaStream_t st) {
  const int64_t G = (K + s.group - 1) / s.group;
  exponents_kernel<<<blocks_for(B * M * K), kThreads, 0, st>>>(a, ea, B * M * K, s.a_emin);
  exponents_kernel<<<blocks_for(B * N * K), kThreads, 0, st>>>(bt, eb, B * N * K, s.b_emin);
  accum_kernel<<<blocks_for(B * M * N), kThreads, 0, st>>>(a, bt, ea, eb, ga, gbt, c, B, M, N,
                                                           K, G, s, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace qtensor
