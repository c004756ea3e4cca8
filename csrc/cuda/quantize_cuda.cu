// Torch glue of the CUDA kernels: TORCH_LIBRARY_IMPL(qtensor, CUDA) for the ops whose schemas
// csrc/quantize.cpp defines. Built only by setup.py's CUDAExtension (which defines
// QTENSOR_WITH_TORCH); a plain `nvcc -c` of this file (CI's torch-free compile check) compiles it
// to nothing, the kernels themselves being in quantize_kernels.cu.
#if defined(QTENSOR_WITH_TORCH)

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../op_common.h"
#include "launch.h"

namespace {

using namespace qtensor_glue;
namespace qc = qtensor::cuda;

qc::DType dtype_of(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return qc::kF32;
    case at::kHalf: return qc::kF16;
    default: return qc::kBF16;
  }
}

void check_cuda(const at::Tensor& x, const at::Tensor& out, int64_t rounding, const char* op) {
  check_op(x, out, rounding, op);
  TORCH_CHECK((rounding >> 8) == 0, "qtensor::", op, ": stochastic rounding with fewer than 32 "
              "random bits has no CUDA kernel (qtensor.ops sends it to the reference)");
  TORCH_CHECK(x.is_cuda(), "qtensor::", op, ": expected a CUDA tensor");
}

void float_out(const at::Tensor& x, int64_t man, int64_t emin, bool subnormals, double maxval,
               int64_t overflow, bool is_unsigned, int64_t rounding, int64_t seed,
               at::Tensor& out) {
  check_cuda(x, out, rounding, "quantize_float");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto spec = float_spec(man, emin, subnormals, maxval, overflow, is_unsigned);
  C10_CUDA_CHECK(qc::launch_float(x.const_data_ptr(), out.mutable_data_ptr(), dtype_of(x),
                                  make_layout(x, out), spec, (int)rounding,
                                  key_of(seed),
                                  at::cuda::getCurrentCUDAStream()));
}

at::Tensor float_fn(const at::Tensor& x, int64_t man, int64_t emin, bool subnormals, double maxval,
                    int64_t overflow, bool is_unsigned, int64_t rounding, int64_t seed) {
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  float_out(x, man, emin, subnormals, maxval, overflow, is_unsigned, rounding, seed, out);
  return out;
}

void float_inplace(at::Tensor& x, int64_t man, int64_t emin, bool subnormals, double maxval,
                   int64_t overflow, bool is_unsigned, int64_t rounding, int64_t seed) {
  float_out(x, man, emin, subnormals, maxval, overflow, is_unsigned, rounding, seed, x);
}

void fixed_out(const at::Tensor& x, int64_t wl, int64_t fl, bool is_signed, bool symmetric,
               bool saturate, int64_t rounding, int64_t seed, at::Tensor& out) {
  check_cuda(x, out, rounding, "quantize_fixed");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto spec = fixed_spec(wl, fl, is_signed, symmetric);
  C10_CUDA_CHECK(qc::launch_fixed(x.const_data_ptr(), out.mutable_data_ptr(), dtype_of(x),
                                  make_layout(x, out), spec, !saturate, (int)rounding,
                                  key_of(seed),
                                  at::cuda::getCurrentCUDAStream()));
}

at::Tensor fixed_fn(const at::Tensor& x, int64_t wl, int64_t fl, bool is_signed, bool symmetric,
                    bool saturate, int64_t rounding, int64_t seed) {
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  fixed_out(x, wl, fl, is_signed, symmetric, saturate, rounding, seed, out);
  return out;
}

void fixed_inplace(at::Tensor& x, int64_t wl, int64_t fl, bool is_signed, bool symmetric,
                   bool saturate, int64_t rounding, int64_t seed) {
  fixed_out(x, wl, fl, is_signed, symmetric, saturate, rounding, seed, x);
}

void block_out(const at::Tensor& x, at::IntArrayRef elem, double elem_max, int64_t block_size,
               c10::optional<int64_t> axis, int64_t scale_rule, at::IntArrayRef scale,
               double scale_max, bool tensor_scale, int64_t rounding, int64_t seed,
               at::Tensor& out) {
  check_cuda(x, out, rounding, "quantize_block");
  const c10::cuda::CUDAGuard guard(x.device());
  BlockArgs a = block_args(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max,
                           tensor_scale);
  // (qtensor.ops sends these to the reference: the CUDA kernels have neither the 4over6 choice
  // nor the even rule's settling, which only toward_zero, stochastic rounding and unsigned
  // fixed-point elements need)
  TORCH_CHECK(a.scale_rule != kRule4over6 &&
                  !(a.scale_rule == kRuleEven &&
                    (rounding == kTowardZero || rounding == kStochastic ||
                     (a.elem_fixed && !a.is_signed))),
              "qtensor::quantize_block: no CUDA kernel for this scale rule and rounding");
  const Layout L = make_layout(x, out);
  if (x.numel() == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto dt = dtype_of(x);
  // one scratch word per amax (a tiny allocation, not a full-size temporary)
  // (and two for the settled scale of a whole-tensor amax-rule block, a double)
  at::Tensor scratch = at::zeros({4}, x.options().dtype(at::kInt));
  uint32_t* amax_dev = reinterpret_cast<uint32_t*>(scratch.mutable_data_ptr<int32_t>());
  if (tensor_scale) {
    C10_CUDA_CHECK(qc::launch_amax(x.const_data_ptr(), dt, make_layout(x, out), true, amax_dev + 1,
                                   stream));
    const uint32_t bits = (uint32_t)scratch[1].item<int32_t>();  // a host sync, NVFP4 two-level only
    a.ts = tensor_scale_from_amax(bits, a);
  }
  if (a.whole_tensor)
    C10_CUDA_CHECK(qc::launch_amax(x.const_data_ptr(), dt, L, false, amax_dev, stream));
  C10_CUDA_CHECK(qc::launch_block(x.const_data_ptr(), out.mutable_data_ptr(), dt, L, a,
                                  (int)rounding, key_of(seed), amax_dev,
                                  stream));
}

at::Tensor block_fn(const at::Tensor& x, at::IntArrayRef elem, double elem_max, int64_t block_size,
                    c10::optional<int64_t> axis, int64_t scale_rule, at::IntArrayRef scale,
                    double scale_max, bool tensor_scale, int64_t rounding, int64_t seed) {
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  block_out(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max, tensor_scale,
            rounding, seed, out);
  return out;
}

void block_inplace(at::Tensor& x, at::IntArrayRef elem, double elem_max, int64_t block_size,
                   c10::optional<int64_t> axis, int64_t scale_rule, at::IntArrayRef scale,
                   double scale_max, bool tensor_scale, int64_t rounding, int64_t seed) {
  block_out(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max, tensor_scale,
            rounding, seed, x);
}

}  // namespace

TORCH_LIBRARY_IMPL(qtensor, CUDA, m) {
  m.impl("quantize_float", &float_fn);
  m.impl("quantize_float.out", &float_out);
  m.impl("quantize_float_", &float_inplace);
  m.impl("quantize_fixed", &fixed_fn);
  m.impl("quantize_fixed.out", &fixed_out);
  m.impl("quantize_fixed_", &fixed_inplace);
  m.impl("quantize_block", &block_fn);
  m.impl("quantize_block.out", &block_out);
  m.impl("quantize_block_", &block_inplace);
}

#endif  // QTENSOR_WITH_TORCH
