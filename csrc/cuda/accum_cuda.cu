// Torch glue of the CUDA qtensor::accum_matmul (the kernel: csrc/cuda/accum_kernels.cu). Built
// only by setup.py's CUDAExtension (which defines QTENSOR_WITH_TORCH); CI's torch-free
// `nvcc -c` compiles it to nothing.
#if defined(QTENSOR_WITH_TORCH)

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../cpu/accum.h"

namespace qtensor {
namespace cuda {
cudaError_t launch_accum(const float* a, const float* bt, int* ea, int* eb, const int* ga,
                         const int* gbt, const float* c, int64_t B, int64_t M, int64_t N,
                         int64_t K, const AccumSpec& s, float* out, cudaStream_t st);
}  // namespace cuda
}  // namespace qtensor

namespace {

at::Tensor accum_matmul_cuda(const at::Tensor& a, const at::Tensor& b, int64_t chunk,
                             int64_t frac_bits, int64_t group, int64_t align_rounding,
                             bool acc_in_alignment, int64_t acc_man, int64_t acc_rounding,
                             int64_t promote, int64_t e_zero, int64_t a_emin, int64_t b_emin,
                             int64_t acc_emin, int64_t acc_emax,
                             const c10::optional<at::Tensor>& a_gexp,
                             const c10::optional<at::Tensor>& b_gexp,
                             const c10::optional<at::Tensor>& c,
                             const c10::optional<at::Tensor>& a_emins,
                             const c10::optional<at::Tensor>& b_emins) {
  TORCH_CHECK(!a_emins && !b_emins, "qtensor::accum_matmul: per-element a_emins/b_emins are not "
              "implemented on CUDA (qtensor.accum runs the reference for them)");
  using namespace qtensor_accum;
  const qtensor::AccumSpec s =
      make_spec(chunk, frac_bits, group, align_rounding, acc_in_alignment, acc_man, acc_rounding,
                promote, e_zero, a_emin, b_emin, acc_emin, acc_emax);
  check_operands(a, b);
  TORCH_CHECK(!a_gexp == !b_gexp && (!a_gexp || group > 1), "qtensor::accum_matmul: a_gexp and "
              "b_gexp go together, with group > 1");
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t B = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  at::Tensor out = at::empty({B, M, N}, a.options());
  if (out.numel() == 0) return out;
  const at::Tensor ac = a.contiguous();
  const at::Tensor bt = b.transpose(1, 2).contiguous();
  at::Tensor ea = at::empty(ac.sizes(), ac.options().dtype(at::kInt));
  at::Tensor eb = at::empty(bt.sizes(), bt.options().dtype(at::kInt));
  const int64_t G = (K + group - 1) / group;
  at::Tensor ga, gbt, cc;
  if (a_gexp) {
    TORCH_CHECK(a_gexp->sizes() == at::IntArrayRef({B, M, G}) &&
                b_gexp->sizes() == at::IntArrayRef({B, G, N}),
                "qtensor::accum_matmul: a_gexp must be (", B, ", ", M, ", ", G, ") and b_gexp (",
                B, ", ", G, ", ", N, "), got ", a_gexp->sizes(), " and ", b_gexp->sizes());
    ga = a_gexp->to(a.device(), at::kInt).contiguous();
    gbt = b_gexp->to(a.device(), at::kInt).transpose(1, 2).contiguous();
  }
  if (c) {
    TORCH_CHECK(c->scalar_type() == at::kFloat, "qtensor::accum_matmul: c must be float32");
    cc = c->to(a.device()).expand({B, M, N}).contiguous();
  }
  C10_CUDA_CHECK(qtensor::cuda::launch_accum(
      ac.data_ptr<float>(), bt.data_ptr<float>(), ea.data_ptr<int>(), eb.data_ptr<int>(),
      a_gexp ? ga.data_ptr<int>() : nullptr, a_gexp ? gbt.data_ptr<int>() : nullptr,
      c ? cc.data_ptr<float>() : nullptr, B, M, N, K, s, out.data_ptr<float>(),
      at::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qtensor, CUDA, m) { m.impl("accum_matmul", &accum_matmul_cuda); }

#endif  // QTENSOR_WITH_TORCH
