// qtensor::accum_matmul: a batched matrix product summed by an emulated MMA datapath (CPU).
//
// The schema is defined here (a fragment of the qtensor library); qtensor/accum.py turns an
// AccumFormat into the integer arguments and registers the fake implementation. The math for one
// output element is include/qtensor/accum.h (shared with a CUDA kernel); this file checks the
// arguments, lays the operands out (a rows and b columns contiguous along K, with their alignment
// exponents precomputed once), picks the path and runs the output tiles in parallel.
//
// Paths (group == 1): the float32/int32 fast path (cpu/accum_fast.h over the vector operations of
// cpu/accum_fast_avx512.h or cpu/accum_fast_avx2.h) where the operands allow it (fast_path_ok),
// else the double lanes (cpu/accum_lanes.h's dot_lanes, baseline, AVX2 or AVX-512: full float32
// operands take them); groups: tiles of group sums in double, then the double lanes' per-chunk
// steps (accum_lanes.h's rows_groups; baseline, AVX2 or AVX-512). All give the bits of
// qtensor/accum.py's reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu/accum.h"
#include "cpu/kernels.h"

namespace {

using namespace qtensor_accum;

// What the fast path needs to know of an operand's values.
struct Range {
  bool normal = true;  // every value finite and normal or zero
  uint32_t man = 0;    // the OR of the mantissa fields: its lowest set bit bounds the significands
  int lo = INT_MAX;    // the smallest and largest exponent of the nonzero values
  int hi = INT_MIN;
  int bits() const { return man == 0 ? 1 : 24 - __builtin_ctz(man); }  // significand width
  bool any() const { return lo <= hi; }
  int top() const { return any() ? hi : 0; }  // the int8 exponents' offset (Exps8)
  Range operator|(const Range& o) const {
    return {normal && o.normal, man | o.man, std::min(lo, o.lo), std::max(hi, o.hi)};
  }
};

// What the fast path checks per chunk (fast_path_ok sets them): emax at most emax, and |S| at
// most sums (INT32_MAX: the bound on the terms already keeps the sum with p's term in int32).
// split: a chunk's terms summed in two int32 halves (of `half` terms), the finish in doubles
// (finish_wide: chunks whose whole sum can pass 2^31, as 32 products at 25 bits); zcheck: e_zero
// can move emax (a tile where a lane's terms are all below e_zero is redone); pfix: p's
// alignment exponent clamped at acc_emin (an FP16 accumulator), e_zero for a zero p.
struct FastLimits {
  int emax;
  int sums;
  bool split = false, zcheck = false, pfix = false;
  int half = 0;
};

// scan's vector part: the OR of |x|'s bits, the smallest (nonzero x) and largest biased exponent,
// whether all are normal or zero, and how many values it took.
struct ScanBits {
  bool ok;
  uint32_t man, lo, hi;
  int64_t done;
};

// The fast path of one ISA (accum_fast.h's kFastKernels): FW output columns per tile, the passes
// over the operands and rows_fast per alignment rounding.
struct FastKernels {
  int FW, EA;  // EA: the copies of each of a's int8 exponents (accum_fast.h's Exps8)
  Range (*scan)(const float* x, int64_t n);
  void (*exps8_flat)(const float* x, int64_t n, int hi, int emin, int8_t* out);
  void (*exps8_rows)(const float* x, int64_t rows, int64_t C, int hi, int emin, int8_t* out);
  void (*rows_fast[3])(const float* a, const int8_t* ea8, const float* b, const int8_t* eb8,
                       int off, int64_t K, int64_t N, int64_t i0, int64_t i1,
                       const qtensor::AccumSpec& s, const FastLimits& lim, float* out,
                       const int* eva, const int* evb);
};

// The vectorized paths (group == 1): the double lanes compiled for the baseline, AVX2 and
// AVX-512, the fast path for AVX2 and AVX-512 (one algorithm, accum_fast.h, over each ISA's
// vector operations).
constexpr int W = 8;  // output columns per dot_lanes call: the SIMD lanes
namespace accum_base {
#include "cpu/accum_lanes.h"
}  // namespace accum_base
#if defined(__x86_64__) && defined(__GNUC__)
#define QT_ACCUM_AVX2 1
#pragma GCC push_options
// fma: accum_lanes.h's group sums (exact products: the same bits); -ffp-contract=off (setup.py)
// keeps every other double and float operation rounded as written
#pragma GCC target("avx2,fma")
namespace accum_avx2 {
#include "cpu/accum_lanes.h"
#include "cpu/accum_fast_avx2.h"
#include "cpu/accum_fast.h"
}  // namespace accum_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd")
// gcc 12 flags the AVX-512 intrinsics' own _mm512_undefined_*() operands, once per inlining
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace accum_avx512 {
#define QT_ACCUM_AVX512 1  // accum_lanes.h's dot_lanes in zmm, int64 sums (DQ)
#include "cpu/accum_lanes.h"
#undef QT_ACCUM_AVX512
#include "cpu/accum_fast_avx512.h"
#include "cpu/accum_fast.h"
}  // namespace accum_avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

// 0: baseline, 1: AVX2 with FMA, 2: AVX-512 with CD (QTENSOR_CPU_ISA=base|avx2 caps it, as in
// quantize.cpp)
int accum_isa() {
#if defined(QT_ACCUM_AVX2)
  static const int isa = [] {
    const int best = qtensor_cpu::cpu_isa();
    if (best == 2 && __builtin_cpu_supports("avx512cd")) return 2;
    return best >= 1 && __builtin_cpu_supports("fma") ? 1 : 0;
  }();
  return isa;
#else
  return 0;
#endif
}

// x float32 contiguous; ev: per-element clamps (int32, x's layout; undefined: emin for all)
at::Tensor exponents(const at::Tensor& x, int emin, const at::Tensor& ev = at::Tensor()) {
  at::Tensor e = at::empty(x.sizes(), x.options().dtype(at::kInt));
  const float* px = x.data_ptr<float>();
  const int* pv = ev.defined() ? ev.data_ptr<int>() : nullptr;
  int* pe = e.data_ptr<int>();
  at::parallel_for(0, x.numel(), 1 << 14, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) pe[i] = qtensor::acc_exp_f32(px[i], pv ? pv[i] : emin);
  });
  return e;
}

// Per-element clamps of an operand's exponents (block formats: the element format's minimum
// normal exponent plus the block's scale exponent), int32 in x's (B, R, C) shape, or undefined.
at::Tensor elem_emins(const c10::optional<at::Tensor>& v, const at::Tensor& x, const char* name) {
  if (!v) return at::Tensor();
  TORCH_CHECK(v->sizes() == x.sizes() && !at::isFloatingType(v->scalar_type()),
              "qtensor::accum_matmul: ", name, " must be an integer tensor of shape ", x.sizes(),
              ", got ", v->sizes());
  return v->to(at::kInt).contiguous();
}

// The scalar path (include/qtensor/accum.h's acc_dot per output), with an initial accumulator c
// (B, M, N) or group exponents ga (B, M, G), gb (B, G, N); a (B, M, K), b (B, K, N): where the
// vector paths do not apply (an empty K with c, group exponents without groups).
at::Tensor scalar_path(const at::Tensor& a, const at::Tensor& b, const qtensor::AccumSpec& s,
                       const c10::optional<at::Tensor>& ga, const c10::optional<at::Tensor>& gb,
                       const c10::optional<at::Tensor>& c, const at::Tensor& eav,
                       const at::Tensor& ebv) {
  const int64_t B = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  const int64_t G = (K + s.group - 1) / s.group;
  const at::Tensor ac = a.contiguous(), bt = b.transpose(1, 2).contiguous();
  const at::Tensor ea = exponents(ac, s.a_emin, eav);
  const at::Tensor eb = exponents(bt, s.b_emin,
                                  ebv.defined() ? ebv.transpose(1, 2).contiguous() : ebv);
  at::Tensor gac, gbt, cc;
  if (ga) {
    TORCH_CHECK(gb && s.group > 1, "qtensor::accum_matmul: a_gexp and b_gexp go together, with "
                "group > 1");
    TORCH_CHECK(ga->dim() == 3 && ga->size(0) == B && ga->size(1) == M && ga->size(2) == G &&
                gb->dim() == 3 && gb->size(0) == B && gb->size(1) == G && gb->size(2) == N,
                "qtensor::accum_matmul: a_gexp must be (", B, ", ", M, ", ", G, ") and b_gexp (",
                B, ", ", G, ", ", N, "), got ", ga->sizes(), " and ", gb->sizes());
    gac = ga->to(at::kInt).contiguous();
    gbt = gb->to(at::kInt).transpose(1, 2).contiguous();
  } else {
    TORCH_CHECK(!gb, "qtensor::accum_matmul: b_gexp without a_gexp");
  }
  if (c) {
    TORCH_CHECK(c->scalar_type() == at::kFloat, "qtensor::accum_matmul: c must be float32, got ",
                c->scalar_type());
    cc = c->expand({B, M, N}).contiguous();
  }
  at::Tensor out = at::empty({B, M, N}, a.options());
  const float* pa = ac.data_ptr<float>();
  const float* pb = bt.data_ptr<float>();
  const int* pea = ea.data_ptr<int>();
  const int* peb = eb.data_ptr<int>();
  const int* pga = ga ? gac.data_ptr<int>() : nullptr;
  const int* pgb = ga ? gbt.data_ptr<int>() : nullptr;
  const float* pc = c ? cc.data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K));
  at::parallel_for(0, B * M * N, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t bi = t / (M * N), i = t / N % M, j = t % N;
      const int64_t ia = (bi * M + i) * K, jb = (bi * N + j) * K;
      po[t] = qtensor::acc_dot(pa + ia, pb + jb, pea + ia, peb + jb, K, s, pc ? pc[t] : 0.0f,
                               pga ? pga + (bi * M + i) * G : nullptr,
                               pgb ? pgb + (bi * N + j) * G : nullptr);
    }
  });
  return out;
}

#if defined(QT_ACCUM_AVX2)
// Whether the fast path is exact for operands in ranges ra, rb, and the largest emax it takes
// (lim: a tile whose emax or sums go above is redone by the double path). With every product
// exact and normal in float32 (operand significands of at most 24 bits together, no overflow or
// underflow), each term is p * 2^(F - emax), exact while it is normal: F - emax >= -126 for the
// smallest product (the limit), F - emax <= 126 where a product is nonzero (emax >= lo). A term
// is below 4 * 2^F, and at most (4 - 2^(2 - m)) * 2^F with m-bit significands: a chunk of them
// must sum in int32, or each half of it (split). emax <= F + 96 keeps the chunk's result (below 2^31 * 2^(emax - F)) finite.
// The products' exponents must span at most 127 (int8 exponents, accum_fast.h's Exps8).
// aclamp, bclamp: the largest clamp of each operand's exponents (s.a_emin/b_emin, or the largest
// per-element clamp)
bool fast_path_ok(const qtensor::AccumSpec& s, int aclamp, int bclamp, const Range& ra,
                  const Range& rb, FastLimits* lim) {
  if (s.group != 1 || !ra.normal || !rb.normal || ra.bits() + rb.bits() > 24) return false;
  // a narrower accumulator (FP16: hopper_fp8_f16): its subnormal grid and the clamp of p's
  // exponent in the finish (rounding to nearest with fewer than 24 bits, round_acc's kind 2),
  // its overflow to inf redone by the double path; the grid must stay normal in float32
  const bool narrow = s.acc_emin != qtensor::kAccExpMin || s.acc_emax != 127;
  if (narrow && (s.acc_round != 2 || s.acc_man == 23 || s.acc_emin - s.acc_man < -126))
    return false;
  const int F = s.frac_bits;
  lim->emax = F + 96;
  lim->sums = INT32_MAX;
  lim->pfix = narrow;
  if (!ra.any() || !rb.any()) return true;  // every product is zero
  const int lo = ra.lo + rb.lo, hi = ra.hi + rb.hi;  // the products' exponents
  if (lo < -126 || hi > 126 || F - lo > 126 || F > 28 || hi - lo > 127) return false;
  // every nonzero term (products, partials) is at least 2^(lo - F): a zero term's e_zero below
  // that never moves emax, and where all terms are zero the result is 0 at any scale; else
  // fast_tile checks each chunk (zcheck: a lane whose terms are all below e_zero is redone)
  if (s.e_zero != qtensor::kAccZeroExp && s.e_zero >= lo - F) lim->zcheck = lim->pfix = true;
  // the operands' clamped exponents (format minimum normal ones) must keep the int8 span
  if (std::max(ra.hi, aclamp) + std::max(rb.hi, bclamp) - lo > 127) return false;
  lim->emax = F + std::min(126 + std::min(lo, 0), 96);
  const int m = std::max(ra.bits(), rb.bits());
  const int64_t term = (int64_t{4} << F) - (F + 2 >= m ? int64_t{1} << (F + 2 - m) : 0);
  if (s.chunk * term > INT32_MAX) {
    // two int32 halves, summed with p's term in doubles (finish_wide: to 24 bits toward zero or
    // to nearest); their sum is below 2^33, so emax <= F + 94 keeps the result finite
    const int half = (s.chunk + 1) / 2;
    if (narrow || half * term > INT32_MAX || (s.acc_round == 2 && s.acc_man != 23)) return false;
    lim->split = true;
    lim->half = half;
    lim->emax = F + std::min(126 + std::min(lo, 0), 94);
    return true;
  }
  // p's term (below 2^(F + 1)) too: else fast_tile checks the sums
  const int64_t pterm = s.acc_in_alignment ? int64_t{1} << (F + 1) : 0;
  if (s.chunk * term + pterm > INT32_MAX) lim->sums = (int)(INT32_MAX - pterm);
  return true;
}

constexpr int FR = accum_avx512::FR;  // rows per group of the int8 exponents of a
static_assert(FR == accum_avx2::FR && accum_avx512::TR == accum_avx2::TR, "one layout of a");
// The fast path's int8 exponents (accum_fast.h's Exps8) of x (batch, rows, cols) float32, finite,
// normal or zero, whose largest exponent is hi: rows interleaved in groups of g (1 or FR),
// each fk.EA times in groups, (batch, ceil(rows / g), cols, g * ea), padding rows as zeros.
// ev: per-element clamps (int32, x's layout) or undefined (emin for all; then vectorized)
at::Tensor exps8(const FastKernels& fk, const at::Tensor& x, int hi, int emin, int64_t g,
                 const at::Tensor& ev = at::Tensor()) {
  const int64_t B = x.size(0), R = x.size(1), C = x.numel() / (B * R), Rg = (R + g - 1) / g;
  const int64_t ea = g == 1 ? 1 : fk.EA;
  at::Tensor out = at::empty({B, Rg, C, g * ea}, x.options().dtype(at::kChar));
  const float* px = x.data_ptr<float>();
  int8_t* po = out.data_ptr<int8_t>();
  const int* pv = ev.defined() ? ev.data_ptr<int>() : nullptr;
  const auto e8 = [hi](float x, int clamp) {  // accum_fast.h's exps8_1 with its own clamp
    const uint32_t u = qtensor::f2u(x) & qtensor::F32::ABS;
    return (int8_t)(u == 0 ? -128 : std::max((int)(u >> 23) - 127, clamp) - hi);
  };
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, C * g));
  at::parallel_for(0, B * Rg, grain, [&](int64_t lo, int64_t hi_) {
    for (int64_t t = lo; t < hi_; ++t) {
      const int64_t bi = t / Rg, r0 = t % Rg * g;
      const float* xr = px + (bi * R + r0) * C;
      if (pv) {  // per-element clamps (MX operands with subnormal elements): scalar
        const int* vr = pv + (bi * R + r0) * C;
        int8_t* o = po + t * C * g * ea;
        const int64_t rows = std::min(g, R - r0);
        for (int64_t c = 0; c < C; ++c)
          for (int64_t i = 0; i < g; ++i)
            for (int64_t j = 0; j < ea; ++j)
              o[(g * c + i) * ea + j] = i < rows ? e8(xr[i * C + c], vr[i * C + c]) : -128;
      } else if (g == 1)
        fk.exps8_flat(xr, C, hi, emin, po + t * C);
      else
        fk.exps8_rows(xr, std::min(g, R - r0), C, hi, emin, po + t * C * g * ea);
    }
  });
  return out;
}

Range scan(const FastKernels& fk, const at::Tensor& x) {  // x float32 contiguous
  const float* px = x.data_ptr<float>();
  return at::parallel_reduce(
      0, x.numel(), 1 << 16, Range(),
      [&](int64_t i0, int64_t i1, Range r) { return r | fk.scan(px + i0, i1 - i0); },
      [](const Range& x, const Range& y) { return x | y; });
}
#endif

at::Tensor accum_matmul(const at::Tensor& a, const at::Tensor& b, int64_t chunk, int64_t frac_bits,
                        int64_t group, int64_t align_rounding, bool acc_in_alignment,
                        int64_t acc_man, int64_t acc_rounding, int64_t promote, int64_t e_zero,
                        int64_t a_emin, int64_t b_emin, int64_t acc_emin, int64_t acc_emax,
                        const c10::optional<at::Tensor>& a_gexp,
                        const c10::optional<at::Tensor>& b_gexp,
                        const c10::optional<at::Tensor>& c,
                        const c10::optional<at::Tensor>& a_emins,
                        const c10::optional<at::Tensor>& b_emins) {
  const qtensor::AccumSpec s =
      make_spec(chunk, frac_bits, group, align_rounding, acc_in_alignment, acc_man, acc_rounding,
                promote, e_zero, a_emin, b_emin, acc_emin, acc_emax);
  check_operands(a, b);
  const int64_t B = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  const at::Tensor eav = elem_emins(a_emins, a, "a_emins"), ebv = elem_emins(b_emins, b, "b_emins");
  // group exponents: the group tiles; an initial accumulator c: the double lanes or the group
  // tiles (the fast path takes none)
  if ((a_gexp && s.group == 1) || !a_gexp != !b_gexp || (c && K == 0))
    return scalar_path(a, b, s, a_gexp, b_gexp, c, eav, ebv);
  at::Tensor cc;
  if (c) {
    TORCH_CHECK(c->scalar_type() == at::kFloat, "qtensor::accum_matmul: c must be float32, got ",
                c->scalar_type());
    cc = c->expand({B, M, N}).contiguous();
  }
  const float* pc = c ? cc.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({B, M, N}, a.options());
  if (out.numel() == 0) return out;
  const at::Tensor ac = a.contiguous();
  const float* pa = ac.data_ptr<float>();
  float* po = out.data_ptr<float>();
  if (s.group == 1) {
    const int isa = accum_isa();
    const at::Tensor bc = isa > 0 ? b.contiguous() : b;
    Range ra, rb;
    FastLimits lim{};
    bool fast = false;
    int64_t P = W;  // b in panels of P columns: the lanes of the path
#if defined(QT_ACCUM_AVX2)
    const FastKernels& fk =
        isa == 2 ? accum_avx512::kFastKernels : accum_avx2::kFastKernels;
    // the largest clamps (per-element ones: MX operands with subnormal elements)
    const int aclamp = eav.defined() && eav.numel() ? eav.max().item<int>() : s.a_emin;
    const int bclamp = ebv.defined() && ebv.numel() ? ebv.max().item<int>() : s.b_emin;
    fast = isa > 0 && !c && fast_path_ok(s, aclamp, bclamp, ra = scan(fk, ac),
                                         rb = scan(fk, bc), &lim);
    // the int8 exponents' offsets: the largest clamped exponent of each operand
    const int atop = std::max(ra.top(), aclamp), btop = std::max(rb.top(), bclamp);
    if (fast) P = fk.FW;
#endif
    // each panel (K, P) contiguous (zero columns pad the last one): the lanes read it
    // sequentially along K
    const int64_t ldb = (N + P - 1) / P * P;
    at::Tensor bp = at::zeros({B, K, ldb}, b.options());
    bp.narrow(2, 0, N).copy_(bc);
    bp = bp.view({B, K, ldb / P, P}).permute({0, 2, 1, 3}).contiguous();  // (B, ldb/P, K, P)
    const float* pb = bp.data_ptr<float>();
    at::Tensor ebp;  // b's per-element clamps in b's panels
    if (ebv.defined()) {
      ebp = at::full({B, K, ldb}, s.b_emin, ebv.options());
      ebp.narrow(2, 0, N).copy_(ebv);
      ebp = ebp.view({B, K, ldb / P, P}).permute({0, 2, 1, 3}).contiguous();
    }
    at::Tensor ea, eb, ea8, eb8;  // the exponents: int8 for the fast path, else int32
#if defined(QT_ACCUM_AVX2)
    if (fast) {
      ea8 = exps8(fk, ac, atop, s.a_emin, FR, eav);
      eb8 = exps8(fk, bp.view({B, ldb / P, K * P}), btop, s.b_emin, 1,
                  ebp.defined() ? ebp.view({B, ldb / P, K * P}) : ebp);
    }
#endif
    if (!fast) {
      ea = exponents(ac, s.a_emin, eav);
      eb = exponents(bp, s.b_emin, ebp);
    }
    constexpr int64_t TM = 8;  // rows per task (a fast tile): their operands stay in cache
#if defined(QT_ACCUM_AVX2)
    static_assert(TM % accum_avx512::TR == 0, "the fast tiles start at multiples of TR");
#endif
    const int64_t tm = (M + TM - 1) / TM;
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, TM * ldb * K));
    at::parallel_for(0, B * tm, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t bi = t / tm, i0 = t % tm * TM, i1 = std::min(M, i0 + TM);
        const float* a3 = pa + bi * M * K;
        const float* b3 = pb + bi * K * ldb;
        float* o3 = po + bi * M * N;
#if defined(QT_ACCUM_AVX2)
        if (fast) {
          const int8_t* ea83 = ea8.data_ptr<int8_t>() + bi * ea8.stride(0);
          const int8_t* eb83 = eb8.data_ptr<int8_t>() + bi * K * ldb;
          fk.rows_fast[s.align_round](
              a3, ea83, b3, eb83, atop + btop, K, N, i0, i1, s, lim, o3,
              eav.defined() ? eav.data_ptr<int>() + bi * M * K : nullptr,
              ebp.defined() ? ebp.data_ptr<int>() + bi * K * ldb : nullptr);
          continue;
        }
#endif
        const int* ea3 = ea.data_ptr<int>() + bi * M * K;
        const int* eb3 = eb.data_ptr<int>() + bi * K * ldb;
        const float* c3 = pc ? pc + bi * M * N : nullptr;
#if defined(QT_ACCUM_AVX2)
        if (isa == 2) { accum_avx512::rows(a3, ea3, b3, eb3, K, N, i0, i1, s, o3, c3); continue; }
        if (isa == 1) { accum_avx2::rows(a3, ea3, b3, eb3, K, N, i0, i1, s, o3, c3); continue; }
#endif
        accum_base::rows(a3, ea3, b3, eb3, K, N, i0, i1, s, o3, c3);
      }
    });
    return out;
  }
  // groups: tiles of group sums in double (cpu/accum_lanes.h's rows_groups<V>, V doubles per
  // vector of the ISA) on b in panels of C columns (zero columns pad the last one)
  const int isa = accum_isa();
  const int V = isa == 2 ? 8 : (isa == 1 ? 4 : 2);
  const int R = accum_base::group_rows(V), C = accum_base::group_cols(V);
  const int64_t ldb = (N + C - 1) / C * C, tm = (M + R - 1) / R;
  const at::Tensor bp = at::constant_pad_nd(b, {0, ldb - N})
                            .reshape({B, K, ldb / C, C})
                            .permute({0, 2, 1, 3})
                            .contiguous();  // (B, ldb / C, K, C)
  const float* pb = bp.data_ptr<float>();
  // the group exponents: a's (B, M, NG), b's in panels like b, (B, ldb / C, NG, C)
  const int64_t NG = (K + s.group - 1) / s.group;
  at::Tensor gac, gbp;
  if (a_gexp) {
    TORCH_CHECK(a_gexp->sizes() == at::IntArrayRef({B, M, NG}) &&
                b_gexp->sizes() == at::IntArrayRef({B, NG, N}),
                "qtensor::accum_matmul: a_gexp must be (", B, ", ", M, ", ", NG, ") and b_gexp (",
                B, ", ", NG, ", ", N, "), got ", a_gexp->sizes(), " and ", b_gexp->sizes());
    gac = a_gexp->to(at::kInt).contiguous();
    gbp = at::constant_pad_nd(b_gexp->to(at::kInt), {0, ldb - N})
              .reshape({B, NG, ldb / C, C})
              .permute({0, 2, 1, 3})
              .contiguous();
  }
  const int* pga = a_gexp ? gac.data_ptr<int>() : nullptr;
  const int* pgb = a_gexp ? gbp.data_ptr<int>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, R * ldb * K));
  at::parallel_for(0, B * tm, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t bi = t / tm, i0 = t % tm * R, i1 = std::min(M, i0 + R);
      const float* a3 = pa + bi * M * K;
      const float* b3 = pb + bi * K * ldb;
      float* o3 = po + bi * M * N;
      const int* ga3 = pga ? pga + bi * M * NG : nullptr;
      const int* gb3 = pgb ? pgb + bi * NG * ldb : nullptr;
      const float* c3 = pc ? pc + bi * M * N : nullptr;
#if defined(QT_ACCUM_AVX2)
      if (isa == 2)
        accum_avx512::rows_groups<8>(a3, b3, K, N, i0, i1, s, o3, ga3, gb3, c3);
      else if (isa == 1)
        accum_avx2::rows_groups<4>(a3, b3, K, N, i0, i1, s, o3, ga3, gb3, c3);
      else
#endif
        accum_base::rows_groups<2>(a3, b3, K, N, i0, i1, s, o3, ga3, gb3, c3);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qtensor, m) {
  m.def("accum_matmul(Tensor a, Tensor b, int chunk, int frac_bits, int group, "
        "int align_rounding, bool acc_in_alignment, int acc_man, int acc_rounding, int promote, "
        "int e_zero, int a_emin, int b_emin, int acc_emin, int acc_emax, Tensor? a_gexp, "
        "Tensor? b_gexp, Tensor? c, Tensor? a_emins=None, Tensor? b_emins=None) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(qtensor, CPU, m) { m.impl("accum_matmul", &accum_matmul); }
