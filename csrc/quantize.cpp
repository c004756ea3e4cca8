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
using qtensor::TwoLevelArgs;
using qtensor::TwoLevelGeom;

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

// the largest finite |x| (float32 bits) of a contiguous tensor
#define QT_ISA_CALL_AMAX(xc)                                                           \
  [&]() -> uint32_t {                                                                \
    const qtensor::Layout L = qtensor_glue::make_layout(xc, xc);                     \
    uint32_t r = 0;                                                                  \
    QT_DTYPE_SWITCH(xc.scalar_type(), r = QT_ISA_CALL(finite_amax<T>, xc.const_data_ptr<T>(), L)); \
    return r;                                                                        \
  }()

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

// ---- two-level blocks (tensor_scale=True): Transformer Engine's rule -------------------------
// geom [rows, cols, tr, tc]: the blocks are the tr x tc tiles of x viewed as contiguous
// [numel / (rows * cols), rows, cols] (qtensor/ops.py _two_level_geom); tensor_scale: the decode
// tensor scale to round under (0-dim float32), else the one of x's largest finite magnitude.
// Returns the decode tensor scale (0-dim float32) and, with block_scales, each block's scale X
// (float32, in block order: groups, then tile rows, then tile columns; else empty).
std::tuple<at::Tensor, at::Tensor> quantize_two_level_out(
    const at::Tensor& x, at::IntArrayRef elem, double elem_max, int64_t scale_rule,
    at::IntArrayRef scale, double scale_max, at::IntArrayRef geom, double bound, bool settle,
    const c10::optional<at::Tensor>& tensor_scale, bool block_scales, int64_t rounding,
    int64_t seed, at::Tensor& out) {
  using namespace qtensor_glue;
  const char* op = "quantize_two_level";
  check_op(x, out, rounding, op);
  TORCH_CHECK(elem.size() == 6 && (elem[0] == 0 || elem[0] == 1) && scale.size() == 6,
              "qtensor::quantize_two_level: elem and scale as quantize_block's");
  TORCH_CHECK(geom.size() == 4 && geom[0] >= 1 && geom[1] >= 1 && geom[2] >= 1 && geom[3] >= 1,
              "qtensor::quantize_two_level: geom must be [rows, cols, tr, tc], each >= 1");
  TORCH_CHECK(x.numel() % (geom[0] * geom[1]) == 0, "qtensor::quantize_two_level: geom ", geom,
              " does not tile a tensor of shape ", x.sizes());
  const bool ceil_rule = scale_rule == kRuleCeil && scale[0] > 0;
  TORCH_CHECK(scale_rule == kRuleAmax || scale_rule == kRule4over6 || ceil_rule,
              "qtensor::quantize_two_level: scale_rule must be amax, 4over6, or ceil with a "
              "scale of mantissa bits");
  TORCH_CHECK(scale[0] >= 0 && scale[0] <= 23 && scale[1] >= -149 && scale[1] <= 127,
              "qtensor::quantize_two_level: scale format out of float32's range");
  TwoLevelArgs a;
  a.scale_rule = (int)scale_rule;
  const bool fixed = elem[0] == 1;
  a.ef = make_float_spec<uint32_t>(0, 0, true, 1.0, kSaturate, false);
  a.ex = make_fixed_spec<uint32_t>(8, 0, true, true, 0);
  if (fixed) {
    TORCH_CHECK(elem[1] >= 1 && elem[1] <= 24, "qtensor::quantize_two_level: fixed element wl "
                "must be 1..24");
    a.ex = make_fixed_spec<uint32_t>((int)elem[1], (int)elem[2], elem[3] != 0, elem[4] != 0, 0);
    a.elem_kind = qtensor::kTlFixed;
  } else {
    a.ef = float_spec(elem[1], elem[2], elem[3] != 0, elem_max, kSaturate, false);
    const bool e2m1 = elem[1] == 1 && elem[2] == 0 && elem[3] != 0 && elem_max == 6.0;
    a.elem_kind = e2m1 ? qtensor::kTlFp4 : qtensor::kTlFloat;
  }
  TORCH_CHECK(scale_rule != kRule4over6 || a.elem_kind == qtensor::kTlFp4,
              "qtensor::quantize_two_level: scale_rule 4over6 needs e2m1 elements");
  a.sf = make_float_spec<uint32_t>((int)scale[0], (int)scale[1], scale[3] != 0, scale_max,
                                   kSaturate, false);
  a.sfd = make_float_spec<uint64_t>((int)scale[0], (int)scale[1], scale[3] != 0, scale_max,
                                    kSaturate, false);
  a.sf_max = (float)scale_max;
  a.elem_max = (float)elem_max;
  a.ceil_k = (float)(1.0 - std::ldexp(1.0, -(int)(scale[0] + 2)));
  a.denom = (float)(elem_max * bound);
  a.settle = settle;
  a.sr_or = 0;
  const at::Tensor xc = x.contiguous();
  const bool direct = out.is_contiguous();
  at::Tensor yc = direct ? out : at::empty_like(x, at::MemoryFormat::Contiguous);
  if (tensor_scale.has_value()) {
    const at::Tensor& s = *tensor_scale;
    TORCH_CHECK(s.numel() == 1 && s.scalar_type() == at::kFloat,
                "qtensor::quantize_two_level: tensor_scale must be one float32");
    a.dec = s.item<float>();
    TORCH_CHECK(std::isfinite(a.dec) && a.dec > 0.0f, "qtensor::quantize_two_level: "
                "tensor_scale must be a positive finite float32, got ", a.dec);
    a.enc = 1.0f / a.dec;
    a.a32 = (float)(elem_max * bound / (double)a.enc);
  } else {
    const float am = x.numel() == 0 ? 0.0f : qtensor::u2f(QT_ISA_CALL_AMAX(xc));
    const float num = (float)(elem_max * bound);
    float enc = num / am;
    enc = enc < 3.40282346638528859812e+38f ? enc : 3.40282346638528859812e+38f;
    a.enc = (am == 0.0f || enc == 0.0f) ? 1.0f : enc;
    a.dec = 1.0f / a.enc;
    a.a32 = am;
  }
  a.c_amax = a.enc * (float)(1.0 / elem_max);
  TwoLevelGeom G;
  G.rows = geom[0]; G.cols = geom[1]; G.tr = geom[2]; G.tc = geom[3];
  G.groups = x.numel() / (G.rows * G.cols);
  const int64_t nblocks = G.groups * ((G.rows + G.tr - 1) / G.tr) * ((G.cols + G.tc - 1) / G.tc);
  at::Tensor X = at::empty({block_scales ? nblocks : 0}, x.options().dtype(at::kFloat));
  if (x.numel() > 0) {
    const uint32_t key = key_of(seed);
    float* Xs = block_scales ? X.mutable_data_ptr<float>() : nullptr;
    QT_DTYPE_SWITCH(x.scalar_type(),
                    QT_ISA_CALL(two_level_kernel<T>, xc.const_data_ptr<T>(),
                                yc.mutable_data_ptr<T>(), G, a, (int)rounding, key, Xs));
  }
  if (!direct) out.copy_(yc);
  return {at::full({}, a.dec, x.options().dtype(at::kFloat)), X};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_two_level(
    const at::Tensor& x, at::IntArrayRef elem, double elem_max, int64_t scale_rule,
    at::IntArrayRef scale, double scale_max, at::IntArrayRef geom, double bound, bool settle,
    const c10::optional<at::Tensor>& tensor_scale, bool block_scales, int64_t rounding,
    int64_t seed) {
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto r = quantize_two_level_out(x, elem, elem_max, scale_rule, scale, scale_max, geom, bound,
                                  settle, tensor_scale, block_scales, rounding, seed, out);
  return {out, std::get<0>(r), std::get<1>(r)};
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

#define QT_TWO_LEVEL_ARGS                                                                      \
  "int[] elem, float elem_max, int scale_rule, int[] scale, float scale_max, int[] geom, "  \
  "float bound, bool settle, Tensor? tensor_scale, bool block_scales, int rounding, int seed"

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
  m.def("quantize_two_level(Tensor x, " QT_TWO_LEVEL_ARGS ") -> (Tensor, Tensor, Tensor)");
  m.def("quantize_two_level.out(Tensor x, " QT_TWO_LEVEL_ARGS ", *, Tensor(a!) out) -> "
        "(Tensor, Tensor)");
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
  m.impl("quantize_two_level", &quantize_two_level);
  m.impl("quantize_two_level.out", &quantize_two_level_out);
}

// A Python module named qtensor._C, so that `import qtensor._C` loads the library (and with it
// the registrations above). It has no functions of its own: everything goes through torch.ops.
extern "C" {
static struct PyModuleDef qt_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&qt_module); }
}
