// qtensor::accum_matmul: a batched matrix product summed by an emulated MMA datapath (CPU).
//
// The schema is defined here (a fragment of the qtensor library); qtensor/accum.py turns an
// AccumFormat into the integer arguments and registers the fake implementation. The math for one
// output element is include/qtensor/accum.h (shared with a CUDA kernel); this file checks the
// arguments, lays the operands out (a rows and b columns contiguous along K, with their alignment
// exponents precomputed once) and runs the output tiles in parallel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cpu/accum.h"

namespace {

using namespace qtensor_accum;

// The vectorized path (group == 1), compiled twice: for the baseline and for AVX2.
constexpr int W = 8;  // output columns per call: the SIMD lanes
namespace accum_base {
#include "cpu/accum_lanes.h"
}  // namespace accum_base
#if defined(__x86_64__) && defined(__GNUC__)
#define QT_ACCUM_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2")
namespace accum_avx2 {
#include "cpu/accum_lanes.h"
}  // namespace accum_avx2
#pragma GCC pop_options
#endif

bool has_avx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx2") &&
                          !(std::getenv("QTENSOR_CPU_ISA") &&
                            std::strcmp(std::getenv("QTENSOR_CPU_ISA"), "base") == 0);
  return yes;
#else
  return false;
#endif
}

at::Tensor exponents(const at::Tensor& x) {  // x float32 contiguous
  at::Tensor e = at::empty(x.sizes(), x.options().dtype(at::kInt));
  const float* px = x.data_ptr<float>();
  int* pe = e.data_ptr<int>();
  at::parallel_for(0, x.numel(), 1 << 14, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) pe[i] = qtensor::acc_exp_f32(px[i]);
  });
  return e;
}

at::Tensor accum_matmul(const at::Tensor& a, const at::Tensor& b, int64_t chunk, int64_t frac_bits,
                        int64_t group, int64_t align_rounding, bool acc_in_alignment,
                        int64_t acc_man, int64_t acc_rounding, int64_t promote) {
  const qtensor::AccumSpec s = make_spec(chunk, frac_bits, group, align_rounding,
                                         acc_in_alignment, acc_man, acc_rounding, promote);
  check_operands(a, b);
  const int64_t B = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  at::Tensor out = at::empty({B, M, N}, a.options());
  if (out.numel() == 0) return out;
  const at::Tensor ac = a.contiguous();
  const at::Tensor ea = exponents(ac);
  const float* pa = ac.data_ptr<float>();
  const int* pea = ea.data_ptr<int>();
  float* po = out.data_ptr<float>();
  if (s.group == 1) {
    // b in panels of W columns, each (K, W) contiguous (zero columns pad the last one): the
    // lanes read it sequentially along K
    const int64_t ldb = (N + W - 1) / W * W;
    at::Tensor bp = at::zeros({B, K, ldb}, b.options());
    bp.narrow(2, 0, N).copy_(b);
    bp = bp.view({B, K, ldb / W, W}).permute({0, 2, 1, 3}).contiguous();  // (B, ldb/W, K, W)
    const at::Tensor eb = exponents(bp);
    const float* pb = bp.data_ptr<float>();
    const int* peb = eb.data_ptr<int>();
    const bool avx2 = has_avx2();
    constexpr int64_t TM = 4;  // rows per task: their operands stay in cache
    const int64_t tm = (M + TM - 1) / TM;
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, TM * ldb * K));
    at::parallel_for(0, B * tm, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t bi = t / tm, i0 = t % tm * TM, i1 = std::min(M, i0 + TM);
        const float* a3 = pa + bi * M * K;
        const int* ea3 = pea + bi * M * K;
        const float* b3 = pb + bi * K * ldb;
        const int* eb3 = peb + bi * K * ldb;
        float* o3 = po + bi * M * N;
#if defined(__x86_64__) && defined(__GNUC__)
        if (avx2) { accum_avx2::rows(a3, ea3, b3, eb3, K, N, i0, i1, s, o3); continue; }
#endif
        accum_base::rows(a3, ea3, b3, eb3, K, N, i0, i1, s, o3);
      }
    });
    return out;
  }
  // groups: the scalar qtensor::acc_dot on rows of a and columns of b (b transposed)
  const at::Tensor bt = b.transpose(1, 2).contiguous();  // (B, N, K)
  const at::Tensor eb = exponents(bt);
  const float* pb = bt.data_ptr<float>();
  const int* peb = eb.data_ptr<int>();
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K));
  at::parallel_for(0, B * M * N, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t bi = t / (M * N), i = t / N % M, j = t % N;
      const int64_t ia = (bi * M + i) * K, jb = (bi * N + j) * K;
      po[t] = qtensor::acc_dot(pa + ia, pb + jb, pea + ia, peb + jb, K, s);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qtensor, m) {
  m.def("accum_matmul(Tensor a, Tensor b, int chunk, int frac_bits, int group, "
        "int align_rounding, bool acc_in_alignment, int acc_man, int acc_rounding, int promote) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(qtensor, CPU, m) { m.impl("accum_matmul", &accum_matmul); }
