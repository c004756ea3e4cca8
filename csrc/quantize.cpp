// qtensor custom ops: schemas (defined once, here) and the CPU implementations.
//
// Three families, each with a functional, an out= and an in-place variant:
//   quantize_float  FloatFormat      quantize_fixed  FixedFormat      quantize_block  BlockFormat
// qtensor/ops.py turns a format into these arguments (one helper) and registers the fake
// (meta) implementations. The rounding math is in include/qtensor/round.h, shared with CUDA.
#include <Python.h>  // first, as Python asks

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "op_common.h"

#include "cpu/kernels.h"

QT_DECLARE_CPU_KERNELS(isa_base)
#ifdef QT_HAVE_ISA_CLONES
QT_DECLARE_CPU_KERNELS(isa_avx2)
QT_DECLARE_CPU_KERNELS(isa_avx512)
#endif

namespace qtensor_cpu {
// 0: baseline, 1: AVX2, 2: AVX-512 (QTENSOR_CPU_ISA=base|avx2 caps it, for tests and timing)
int cpu_isa() {
#ifdef QT_HAVE_ISA_CLONES
  static const int isa = [] {
    int best = 0;
    if (__builtin_cpu_supports("avx2")) best = 1;
    if (best == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      best = 2;
    const char* cap = std::getenv("QTENSOR_CPU_ISA");
    if (cap != nullptr && std::strcmp(cap, "base") == 0) best = 0;
    if (cap != nullptr && std::strcmp(cap, "avx2") == 0 && best > 1) best = 1;
    return best;
  }();
  return isa;
#else
  return 0;
#endif
}
}  // namespace qtensor_cpu

namespace {

using qtensor_cpu::cpu_isa;
using qtensor::BlockArgs;
using qtensor::Layout;

// The loops (csrc/quantize_cpu.h) are compiled three times, in csrc/cpu/isa_*.cpp: for the
// baseline x86-64 of the build (no -march), AVX2 and AVX-512; the best one is picked at run time.

#ifdef QT_HAVE_ISA_CLONES
#define QT_ISA_CALL(fn, ...)                                                             \
  (cpu_isa() == 2 ? qtensor_cpu::isa_avx512::fn(__VA_ARGS__)                             \
                  : (cpu_isa() == 1 ? qtensor_cpu::isa_avx2::fn(__VA_ARGS__)             \
                                    : qtensor_cpu::isa_base::fn(__VA_ARGS__)))
#else
#define QT_ISA_CALL(fn, ...) qtensor_cpu::isa_base::fn(__VA_ARGS__)
#endif

#define QT_DTYPE_SWITCH(t, ...)                                                      \
  switch (t) {                                                                       \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }                         \
    case at::kHalf: { using T = c10::Half; __VA_ARGS__; break; }                      \
    case at::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__; break; }              \
    default: TORCH_CHECK(false, "qtensor: unsupported dtype ", t);                    \
  }

// ---- float -------------------------------------------------------------------------------------
at::Tensor& quantize_float_out(const at::Tensor& x, int64_t man, int64_t emin, bool subnormals,
                               double maxval, int64_t overflow, bool is_unsigned, int64_t rounding,
                               int64_t seed, at::Tensor& out) {
  using namespace qtensor_glue;
  check_op(x, out, rounding, "quantize_float");
  const auto spec = float_spec(man, emin, subnormals, maxval, overflow, is_unsigned);
  const Layout L = make_layout(x, out);
  const uint32_t key = key_of(seed);
  QT_DTYPE_SWITCH(x.scalar_type(),
                  QT_ISA_CALL(float_kernel<T>, x.const_data_ptr<T>(), out.mutable_data_ptr<T>(),
                              L, spec, (int)rounding, key));
  return out;
}

at::Tensor quantize_float(const at::Tensor& x, int64_t man, int64_t emin, bool subnormals,
                          double maxval, int64_t overflow, bool is_unsigned, int64_t rounding,
                          int64_t seed) {
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  return quantize_float_out(x, man, emin, subnormals, maxval, overflow, is_unsigned, rounding,
                            seed, out);
}

at::Tensor& quantize_float_(at::Tensor& x, int64_t man, int64_t emin, bool subnormals,
                            double maxval, int64_t overflow, bool is_unsigned, int64_t rounding,
                            int64_t seed) {
  return quantize_float_out(x, man, emin, subnormals, maxval, overflow, is_unsigned, rounding,
                            seed, x);
}

// ---- fixed -------------------------------------------------------------------------------------
at::Tensor& quantize_fixed_out(const at::Tensor& x, int64_t wl, int64_t fl, bool is_signed,
                               bool symmetric, bool saturate, int64_t rounding, int64_t seed,
                               at::Tensor& out) {
  using namespace qtensor_glue;
  check_op(x, out, rounding, "quantize_fixed");
  const auto spec = fixed_spec(wl, fl, is_signed, symmetric);
  const Layout L = make_layout(x, out);
  const uint32_t key = key_of(seed);
  QT_DTYPE_SWITCH(x.scalar_type(),
                  QT_ISA_CALL(fixed_kernel<T>, x.const_data_ptr<T>(), out.mutable_data_ptr<T>(),
                              L, spec, !saturate, (int)rounding, key));
  return out;
}

at::Tensor quantize_fixed(const at::Tensor& x, int64_t wl, int64_t fl, bool is_signed,
                          bool symmetric, bool saturate, int64_t rounding, int64_t seed) {
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  return quantize_fixed_out(x, wl, fl, is_signed, symmetric, saturate, rounding, seed, out);
}

at::Tensor& quantize_fixed_(at::Tensor& x, int64_t wl, int64_t fl, bool is_signed, bool symmetric,
                            bool saturate, int64_t rounding, int64_t seed) {
  return quantize_fixed_out(x, wl, fl, is_signed, symmetric, saturate, rounding, seed, x);
}

// ---- block -------------------------------------------------------------------------------------
at::Tensor quantize_block(const at::Tensor& x, at::IntArrayRef elem, double elem_max,
                          int64_t block_size, c10::optional<int64_t> axis, int64_t scale_rule,
                          at::IntArrayRef scale, double scale_max, bool tensor_scale,
                          int64_t rounding, int64_t seed);

at::Tensor& quantize_block_out(const at::Tensor& x, at::IntArrayRef elem, double elem_max,
                               int64_t block_size, c10::optional<int64_t> axis, int64_t scale_rule,
                               at::IntArrayRef scale, double scale_max, bool tensor_scale,
                               int64_t rounding, int64_t seed, at::Tensor& out) {
  using namespace qtensor_glue;
  check_op(x, out, rounding, "quantize_block");
  BlockArgs a = block_args(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max,
                           tensor_scale);
  if (a.whole_tensor && a.scale_rule == kRule4over6 && !(x.is_contiguous() && out.is_contiguous())) {
    // one 4over6 block over a strided tensor: rounded as its contiguous copy (the same logical
    // order, so the same random words)
    at::Tensor y = quantize_block(x.contiguous(), elem, elem_max, block_size, axis, scale_rule,
                                  scale, scale_max, tensor_scale, rounding, seed);
    out.copy_(y);
    return out;
  }
  Layout L = make_layout(x, out);
  if (a.whole_tensor && L.contiguous) L = flat_layout(x.numel());
  if (a.whole_tensor && L.contiguous) { a.whole_tensor = false; a.axis = 0; }
  const uint32_t key = key_of(seed);
  QT_DTYPE_SWITCH(x.scalar_type(), {
    const T* xp = x.const_data_ptr<T>();
    T* yp = out.mutable_data_ptr<T>();
    if (tensor_scale) {
      const uint32_t amax = QT_ISA_CALL(finite_amax<T>, xp, make_layout(x, out));
      a.ts = tensor_scale_from_amax(amax, a);
    }
    QT_ISA_CALL(block_kernel<T>, xp, yp, L, a, (int)rounding, key);
  });
  return out;
}

at::Tensor quantize_block(const at::Tensor& x, at::IntArrayRef elem, double elem_max,
                          int64_t block_size, c10::optional<int64_t> axis, int64_t scale_rule,
                          at::IntArrayRef scale, double scale_max, bool tensor_scale,
                          int64_t rounding, int64_t seed) {
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  return quantize_block_out(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max,
                            tensor_scale, rounding, seed, out);
}

at::Tensor& quantize_block_(at::Tensor& x, at::IntArrayRef elem, double elem_max,
                            int64_t block_size, c10::optional<int64_t> axis, int64_t scale_rule,
                            at::IntArrayRef scale, double scale_max, bool tensor_scale,
                            int64_t rounding, int64_t seed) {
  return quantize_block_out(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max,
                            tensor_scale, rounding, seed, x);
}

// The out= and in-place schemas return nothing (so that functionalization, and with it
// torch.compile, can handle them); these wrappers adapt the implementations above.
void quantize_float_out_void(const at::Tensor& x, int64_t man, int64_t emin, bool subnormals,
                             double maxval, int64_t overflow, bool is_unsigned, int64_t rounding,
                             int64_t seed, at::Tensor& out) {
  quantize_float_out(x, man, emin, subnormals, maxval, overflow, is_unsigned, rounding, seed, out);
}
void quantize_float_inplace(at::Tensor& x, int64_t man, int64_t emin, bool subnormals,
                            double maxval, int64_t overflow, bool is_unsigned, int64_t rounding,
                            int64_t seed) {
  quantize_float_(x, man, emin, subnormals, maxval, overflow, is_unsigned, rounding, seed);
}
void quantize_fixed_out_void(const at::Tensor& x, int64_t wl, int64_t fl, bool is_signed,
                             bool symmetric, bool saturate, int64_t rounding, int64_t seed,
                             at::Tensor& out) {
  quantize_fixed_out(x, wl, fl, is_signed, symmetric, saturate, rounding, seed, out);
}
void quantize_fixed_inplace(at::Tensor& x, int64_t wl, int64_t fl, bool is_signed, bool symmetric,
                            bool saturate, int64_t rounding, int64_t seed) {
  quantize_fixed_(x, wl, fl, is_signed, symmetric, saturate, rounding, seed);
}
void quantize_block_out_void(const at::Tensor& x, at::IntArrayRef elem, double elem_max,
                             int64_t block_size, c10::optional<int64_t> axis, int64_t scale_rule,
                             at::IntArrayRef scale, double scale_max, bool tensor_scale,
                             int64_t rounding, int64_t seed, at::Tensor& out) {
  quantize_block_out(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max,
                     tensor_scale, rounding, seed, out);
}
void quantize_block_inplace(at::Tensor& x, at::IntArrayRef elem, double elem_max,
                            int64_t block_size, c10::optional<int64_t> axis, int64_t scale_rule,
                            at::IntArrayRef scale, double scale_max, bool tensor_scale,
                            int64_t rounding, int64_t seed) {
  quantize_block_(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max, tensor_scale,
                  rounding, seed);
}

// qtensor::constant(name): the integer code of an op argument's value (see constant_code)
int64_t constant(c10::string_view name) {
  const int64_t code = qtensor_glue::constant_code(std::string(name));
  TORCH_CHECK(code >= 0, "qtensor::constant: unknown name '", name, "'");
  return code;
}

}  // namespace

#define QT_FLOAT_ARGS \
  "int man, int emin, bool subnormals, float max, int overflow, bool is_unsigned, " \
  "int rounding, int seed"
#define QT_FIXED_ARGS \
  "int wl, int fl, bool is_signed, bool symmetric, bool saturate, int rounding, int seed"
#define QT_BLOCK_ARGS                                                                     \
  "int[] elem, float elem_max, int block_size, int? axis, int scale_rule, int[] scale, " \
  "float scale_max, bool tensor_scale, int rounding, int seed"

TORCH_LIBRARY(qtensor, m) {
  m.def("quantize_float(Tensor x, " QT_FLOAT_ARGS ") -> Tensor");
  m.def("quantize_float.out(Tensor x, " QT_FLOAT_ARGS ", *, Tensor(a!) out) -> ()");
  m.def("quantize_float_(Tensor(a!) x, " QT_FLOAT_ARGS ") -> ()");
  m.def("quantize_fixed(Tensor x, " QT_FIXED_ARGS ") -> Tensor");
  m.def("quantize_fixed.out(Tensor x, " QT_FIXED_ARGS ", *, Tensor(a!) out) -> ()");
  m.def("quantize_fixed_(Tensor(a!) x, " QT_FIXED_ARGS ") -> ()");
  m.def("quantize_block(Tensor x, " QT_BLOCK_ARGS ") -> Tensor");
  m.def("quantize_block.out(Tensor x, " QT_BLOCK_ARGS ", *, Tensor(a!) out) -> ()");
  m.def("quantize_block_(Tensor(a!) x, " QT_BLOCK_ARGS ") -> ()");
  m.def("constant(str name) -> int", &constant);
}

TORCH_LIBRARY_IMPL(qtensor, CPU, m) {
  m.impl("quantize_float", &quantize_float);
  m.impl("quantize_float.out", &quantize_float_out_void);
  m.impl("quantize_float_", &quantize_float_inplace);
  m.impl("quantize_fixed", &quantize_fixed);
  m.impl("quantize_fixed.out", &quantize_fixed_out_void);
  m.impl("quantize_fixed_", &quantize_fixed_inplace);
  m.impl("quantize_block", &quantize_block);
  m.impl("quantize_block.out", &quantize_block_out_void);
  m.impl("quantize_block_", &quantize_block_inplace);
}

// A Python module named qtensor._C, so that `import qtensor._C` loads the library (and with it
// the registrations above). It has no functions of its own: everything goes through torch.ops.
extern "C" {
static struct PyModuleDef qt_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&qt_module); }
}
