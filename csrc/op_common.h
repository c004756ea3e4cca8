// Torch glue shared by the CPU (quantize.cpp) and CUDA (cuda/quantize_cuda.cu) op implementations:
// argument checks and unpacking of the op arguments into the plain-data kernel arguments.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <algorithm>
#include <cmath>

#include <string>
#include <utility>

#include "qtensor/args.h"

namespace qtensor_glue {

using namespace qtensor;

// A tensor whose data the kernels can address: not a wrapper without storage (a torch.func
// transform's TensorWrapper or BatchedTensor reaching a kernel from below the transform), whose
// storage the overlap checks would dereference (a segfault) and whose data pointer is refused.
inline void check_storage(const at::Tensor& t, const char* what, const char* op) {
  TORCH_CHECK(t.has_storage(), "qtensor::", op, ": ", what,
              " has no storage (a torch.func transform's wrapper, or another tensor whose data "
              "cannot be addressed): the kernels read and write memory; QTensor code does not "
              "support torch.func transforms (grad, vmap, jacrev); qt.quantize does");
}

inline void check_input(const at::Tensor& x, const char* op) {
  check_storage(x, "x", op);
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, "qtensor::", op,
              ": unsupported dtype ", t,
              "; the kernels take float32, float16 and bfloat16 (qtensor.quantize sends float64 "
              "to the reference implementation)");
  TORCH_CHECK(x.dim() <= kMaxDims, "qtensor::", op, ": at most ", kMaxDims, " dims, got ",
              x.dim());
}

inline void check_out(const at::Tensor& x, const at::Tensor& out, const char* op) {
  TORCH_CHECK(out.device() == x.device(), "qtensor::", op, ": out is on ", out.device(),
              " but x is on ", x.device());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "qtensor::", op, ": out has dtype ",
              out.scalar_type(), " but x has dtype ", x.scalar_type());
  TORCH_CHECK(out.sizes() == x.sizes(), "qtensor::", op, ": out has shape ", out.sizes(),
              " but x has shape ", x.sizes());
  check_storage(out, "out", op);
  if (out.numel() > 0) {
    at::assert_no_internal_overlap(out);
    at::assert_no_partial_overlap(out, x);
  }
}

inline void check_rounding(int64_t rounding, const char* op) {
  // (stochasticN: kStochastic + 256 * (32 - N), N = 1..31; round.h, sr_or_mask)
  const int64_t base = rounding & 0xFF, drop = rounding >> 8;
  TORCH_CHECK(rounding >= 0 && base >= kNearest && base <= kStochastic && drop <= 31 &&
                  (drop == 0 || base == kStochastic),
              "qtensor::", op, ": rounding must be ", (int)kNearest, " (nearest), ",
              (int)kNearestAway, " (nearest_away), ", (int)kTowardZero, " (toward_zero), ",
              (int)kStochastic, " (stochastic) or ", (int)kStochastic,
              " + 256 * (32 - N) (stochastic with N = 1..31 random bits), got ", rounding);
}

// The checks of every quantize op, on every device: x, out (x itself for the in-place variants)
// and the rounding mode.
inline void check_op(const at::Tensor& x, const at::Tensor& out, int64_t rounding,
                     const char* op) {
  check_input(x, op);
  check_out(x, out, op);
  check_rounding(rounding, op);
}

// The stochastic-rounding key of an op's seed argument.
inline uint32_t key_of(int64_t seed) { return seed_key((uint64_t)seed); }

// The integer codes of the op arguments, by name ("rounding.stochastic", "scale_rule.amax",
// "overflow.nan"): the qtensor::constant op exports them so that a test compares them with
// qtensor/ops.py's. -1 for an unknown name.
inline int64_t constant_code(const std::string& name) {
  static const std::pair<const char*, int> table[] = {
      {"rounding.nearest", kNearest},     {"rounding.nearest_away", kNearestAway},
      {"rounding.toward_zero", kTowardZero}, {"rounding.stochastic", kStochastic},
      {"scale_rule.floor", kRuleFloor},   {"scale_rule.ceil", kRuleCeil},
      {"scale_rule.amax", kRuleAmax},     {"scale_rule.even", kRuleEven},
      {"scale_rule.4over6", kRule4over6}, {"overflow.saturate", kSaturate},
      {"overflow.inf", kInf},             {"overflow.nan", kNaN}};
  for (const auto& e : table)
    if (name == e.first) return e.second;
  return -1;
}

inline Layout make_layout(const at::Tensor& x, const at::Tensor& y) {
  Layout L;
  L.ndim = (int)x.dim();
  L.numel = x.numel();
  L.contiguous = x.is_contiguous() && y.is_contiguous();
  int64_t acc = 1;
  for (int d = L.ndim - 1; d >= 0; --d) {
    L.sizes[d] = x.size(d);
    L.xs[d] = x.stride(d);
    L.ys[d] = y.stride(d);
    L.ls[d] = acc;
    acc *= x.size(d);
  }
  return L;
}

// The 1-D view of a layout (axis=None blocks of contiguous tensors).
inline Layout flat_layout(int64_t n) {
  Layout L;
  L.ndim = 1; L.numel = n; L.contiguous = true;
  L.sizes[0] = n; L.xs[0] = L.ys[0] = L.ls[0] = 1;
  return L;
}

inline FloatSpec<uint32_t> float_spec(int64_t man, int64_t emin, bool subnormals, double maxval,
                                      int64_t overflow, bool is_unsigned) {
  TORCH_CHECK(man >= 0 && man <= 23 && emin >= -149 && emin <= 127 && overflow >= kSaturate &&
                  overflow <= kNaN,
              "qtensor::quantize_float: format out of the float32 carrier's range (man=", man,
              ", emin=", emin, ")");
  return make_float_spec<uint32_t>((int)man, (int)emin, subnormals, maxval, (int)overflow,
                                   is_unsigned);
}

inline FixedSpec<uint32_t> fixed_spec(int64_t wl, int64_t fl, bool is_signed, bool symmetric) {
  TORCH_CHECK(wl >= 1 && wl <= 24 && -fl >= -149 && wl - fl <= 127,
              "qtensor::quantize_fixed: fixed", wl, ".", fl,
              " is out of the float32 carrier's range");
  return make_fixed_spec<uint32_t>((int)wl, (int)fl, is_signed, symmetric, 0);
}

// elem: float [0, man, emin, subnormals, 0, emax] or fixed [1, wl, fl, signed, symmetric, emax];
// scale: [man, emin, emax, subnormals, overflow, unsigned].
inline BlockArgs block_args(const at::Tensor& x, at::IntArrayRef elem, double elem_max,
                            int64_t block_size, c10::optional<int64_t> axis, int64_t scale_rule,
                            at::IntArrayRef scale, double scale_max, bool tensor_scale) {
  // (the op keeps the argument in its schema; qtensor/kernels/checks.py refuses it alike)
  TORCH_CHECK(!tensor_scale, "qtensor::quantize_block: tensor_scale=True is not a rule of this "
              "op; two-level formats (nvfp4) round with qtensor::quantize_two_level "
              "(Transformer Engine's rule)");
  TORCH_CHECK(elem.size() == 6 && (elem[0] == 0 || elem[0] == 1),
              "qtensor::quantize_block: elem must be [0, man, emin, subnormals, 0, emax] or "
              "[1, wl, fl, signed, symmetric, emax]");
  TORCH_CHECK(scale.size() == 6, "qtensor::quantize_block: scale must be [man, emin, emax, "
              "subnormals, overflow, unsigned]");
  TORCH_CHECK(scale_rule >= kRuleFloor && scale_rule <= kRule4over6, "qtensor::quantize_block: "
              "scale_rule must be ", (int)kRuleFloor, " (floor), ", (int)kRuleCeil, " (ceil), ",
              (int)kRuleAmax, " (amax), ", (int)kRuleEven, " (even) or ", (int)kRule4over6,
              " (4over6), got ", scale_rule);
  // ceil with a scale of mantissa bits (fp8_e4m3): the amax rule, the scale rounded up
  const bool amax_up = scale_rule == kRuleCeil && scale[0] > 0;
  if (amax_up) scale_rule = kRuleAmax;
  TORCH_CHECK(!(scale_rule == kRuleFloor || scale_rule == kRuleEven) || scale[0] == 0,
              "qtensor::quantize_block: scale_rule floor and even need an exponent-only scale");
  TORCH_CHECK(scale_rule != kRule4over6 ||
                  (elem[0] == 0 && elem[1] == 1 && elem[2] == 0 && elem[3] != 0 &&
                   elem_max == 6.0 && scale[0] > 0),
              "qtensor::quantize_block: scale_rule 4over6 needs e2m1 elements and a scale with "
              "mantissa bits");
  BlockArgs a;
  a.whole_tensor = !axis.has_value() || x.dim() == 0;
  a.axis = 0;
  if (!a.whole_tensor) {
    int64_t ax = *axis;
    TORCH_CHECK_INDEX(ax >= -x.dim() && ax < x.dim(), "qtensor::quantize_block: axis ", ax,
                      " is out of range for a tensor of shape ", x.sizes());
    a.axis = (int)(ax < 0 ? ax + x.dim() : ax);
  }
  const int64_t len = a.whole_tensor ? x.numel() : x.size(a.axis);
  a.block_size = (block_size > 0 && !a.whole_tensor) ? block_size : std::max<int64_t>(len, 1);
  a.scale_rule = (int)scale_rule;
  a.elem_fixed = elem[0] == 1;
  a.man = a.emin = a.qlow = a.elem_emax = 0;
  a.wl = 8; a.fl = 0; a.is_signed = true; a.symmetric = false;
  if (a.elem_fixed) {
    a.wl = (int)elem[1]; a.fl = (int)elem[2]; a.is_signed = elem[3] != 0;
    a.symmetric = elem[4] != 0;
    TORCH_CHECK(a.wl >= 1 && a.wl <= 24, "qtensor::quantize_block: fixed element wl must be 1..24");
  } else {
    a.man = (int)elem[1]; a.emin = (int)elem[2];
    a.qlow = elem[3] ? a.emin - a.man : a.emin;
    TORCH_CHECK(a.man >= 0 && a.man <= 23, "qtensor::quantize_block: element man must be 0..23");
  }
  a.elem_max = elem_max;
  a.scale_emin = (int)scale[1];
  a.scale_emax = (int)scale[2];
  a.elem_emax = (int)elem[5];  // the format's emax (floor(log2(max)), or -fl when max is 0)
  // the amax rule works in double
  a.amax_spec.scale = make_float_spec<uint64_t>((int)scale[0], (int)scale[1], scale[3] != 0,
                                                scale_max, (int)scale[4], scale[5] != 0);
  a.amax_spec.elem_fixed = a.elem_fixed;
  a.amax_spec.ef = make_float_spec<uint64_t>(a.man, a.emin, a.qlow != a.emin || a.man == 0,
                                             elem_max, kSaturate, false);
  a.amax_spec.ef.qlow = a.qlow;
  a.amax_spec.ex = make_fixed_spec<uint64_t>(a.wl, a.fl, a.is_signed, a.symmetric, 0);
  a.amax_spec.elem_max = elem_max;
  a.amax_spec.up = amax_up;
  // even: the element's significant bits after the leading one (formats._significant_bits - 1)
  a.even_mbits = scale_rule != kRuleEven ? -1
               : (a.elem_fixed ? (a.is_signed ? a.wl - 2 : a.wl - 1) : a.man);
  a.sr_or = 0;
  return a;
}

}  // namespace qtensor_glue
