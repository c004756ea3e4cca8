// Plain-data arguments of the kernels, shared by the CPU loops and the CUDA kernels (torch-free).
#pragma once

#include <stdint.h>

#include "qtensor/round.h"

namespace qtensor {

constexpr int kMaxDims = 16;
// (ceil with a scale of mantissa bits runs as kRuleAmax with amax_spec.up: op_common.h)
enum ScaleRule : int { kRuleFloor = 0, kRuleCeil = 1, kRuleAmax = 2, kRuleEven = 3, kRule4over6 = 4 };

// A tensor's logical shape with the strides (in elements) of the input x, of the output y and of
// the logical row-major order (ls, which numbers elements for stochastic rounding).
struct Layout {
  int ndim;
  int64_t numel;
  bool contiguous;  // x and y both contiguous
  int64_t sizes[kMaxDims], xs[kMaxDims], ys[kMaxDims], ls[kMaxDims];
};

// Everything a block kernel needs, with the element and scale formats unpacked.
struct BlockArgs {
  bool whole_tensor;   // axis=None: one block
  int axis;            // normalized, when !whole_tensor
  int64_t block_size;  // >= 1 (the whole axis for block_size=None)
  int scale_rule;
  // element: float (man, emin, qlow) or fixed (wl, fl, signed, symmetric)
  bool elem_fixed;
  int man, emin, qlow, elem_emax;
  int wl, fl;
  bool is_signed, symmetric;
  double elem_max;
  // power-of-two scales: exponent range
  int scale_emin, scale_emax;
  int even_mbits;      // scale_rule even: the element's significant bits after the leading one
  // scale_rule == amax
  AmaxBlockSpec amax_spec;
  uint32_t sr_or;        // limited-bit stochastic rounding: OR-ed into each random word
};

// Two-level block formats (tensor_scale=True): Transformer Engine's rule in float32 steps
// (reference.quantize_two_level). Blocks are r x c tiles of a contiguous [G, R, C] view (a 1D
// block along the last dim is 1 x bs, along another dim bs x 1 with C its inner size).
struct TwoLevelGeom {
  int64_t groups, rows, cols, tr, tc;
};

enum TwoLevelElem : int { kTlFloat = 0, kTlFixed = 1, kTlFp4 = 2 };

struct TwoLevelArgs {
  int scale_rule;            // kRuleAmax, kRule4over6, or kRuleCeil (a scale of mantissa bits)
  int elem_kind;             // TwoLevelElem
  FloatSpec<uint32_t> ef;    // float elements (saturating)
  FixedSpec<uint32_t> ex;    // fixed-point elements (saturating)
  FloatSpec<uint32_t> sf;    // the scale format, saturating (nearest; toward_zero for ceil)
  FloatSpec<uint64_t> sfd;   // the same on a double carrier (ceil's upward rounding)
  float sf_max;
  float elem_max;            // fl32(elem.max)
  float ceil_k;              // fl32(1 - 2^-(scale man + 2)) (ceil)
  float denom;               // fl32(elem.max * bound) (4over6's error terms)
  bool settle;
  uint32_t sr_or;            // limited-bit stochastic rounding: OR-ed into each random word
  // the tensor scale: encode, decode, fl32(enc * fl32(1 / elem.max)), the tensor's amax
  float enc, dec, c_amax, a32;
};

}  // namespace qtensor
