// The accumulator model of qtensor/accum.py for one output element: torch-free, host and device.
//
// Per chunk of K-elements (one MMA instruction): the exact products (or exact sums of `group`
// products) and, if acc_in_alignment, the running partial p are aligned to the largest alignment
// exponent emax, each scaled to 2^(frac_bits - emax) and rounded to an integer, summed exactly,
// and the sum is normalized to the accumulator format (acc_man fractional bits, float32 exponent
// range). Every `promote` chunks p goes into an FP32 accumulator by a float32 add. All of it is
// exact in double (the scaled terms are integers below 2^53; AccumFormat checks the widths), so
// the result is the reference's bit for bit. See qtensor/accum.py for the model and its sources.
#pragma once

#include <math.h>
#include <stdint.h>

#include "qtensor/round.h"

namespace qtensor {

struct AccumSpec {
  int chunk;             // K-elements per instruction
  int frac_bits;         // fractional bits kept by each aligned term
  int group;             // products summed exactly before alignment (1: none)
  int align_round;       // 0 toward_zero, 1 floor, 2 nearest (ties to even)
  bool acc_in_alignment; // p is a term of the alignment
  int acc_man;           // fractional bits of the accumulator format
  int acc_round;         // 0 toward_zero, 2 nearest
  int promote;           // chunks per promotion into FP32; 0: never
  int e_zero;            // the alignment exponent of a zero term (kAccZeroExp: none take part)
  int a_emin, b_emin;    // the operands' input formats' minimum normal exponents (the clamp)
  int acc_emin, acc_emax;  // the accumulator format's exponent range (float32: -126, 127)
};

constexpr int kAccExpMin = -126;       // float32's minimum normal exponent
constexpr int kAccZeroExp = -100000;   // the exponent of a zero term: below every real one
constexpr int kAccBadExp = 1 << 20;    // the exponent of inf/NaN: any product with it is huge

QT_HD double acc_pow2(int e) { return u2d((uint64_t)(int64_t)(e + 1023) << 52); }

// The alignment exponent of a float32 operand: floor(log2|x|) clamped at emin (the minimum
// normal exponent of its input format: MMA-Sim aligns a subnormal there); kAccZeroExp for zero,
// kAccBadExp for inf and NaN.
QT_HD int acc_exp_f32(float x, int emin = kAccExpMin) {
  const uint32_t u = f2u(x) & F32::ABS;
  const int be = (int)(u >> 23);
  if (u == 0) return kAccZeroExp;
  if (be == 255) return kAccBadExp;
  int e = be - 127;
  if (be == 0) {  // a float32 subnormal: its own exponent, below -126
    e = -127;
    for (uint32_t m = u << 9; !(m & 0x80000000u); m <<= 1) --e;
  }
  return e < emin ? emin : e;
}

// floor(log2|x|) of a finite nonzero double, subnormals included.
QT_HD int acc_exp_f64(double x) {
  const uint64_t u = d2u(x) & Carrier<uint64_t>::ABS;
  const int be = (int)(u >> 52);
  if (be != 0) return be - 1023;
  int e;
  frexp(x, &e);
  return e - 1;
}

QT_HD double acc_round_int(double x, int mode) {
  return mode == 0 ? trunc(x) : (mode == 1 ? floor(x) : rint(x));
}

// The exact value v (nonzero or zero, finite) rounded to the accumulator format (acc_man
// fractional bits, exponents in [emin, emax]: subnormals below, inf from 2^(emax + 1)).
QT_HD double acc_normalize(double v, int acc_man, int mode, int emin = kAccExpMin,
                           int emax = 127) {
  if (v == 0.0) return 0.0;
  int e = acc_exp_f64(v);
  e = e < emin ? emin : e;
  const double r = acc_round_int(v * acc_pow2(acc_man - e), mode) * acc_pow2(e - acc_man) + 0.0;
  return fabs(r) >= acc_pow2(emax + 1) ? (r > 0 ? (double)INFINITY : -(double)INFINITY) : r;
}

// The IEEE result of a chunk with a non-finite product or partial (b with stride ldb).
QT_HD double acc_nonfinite(const float* a, const float* b, int64_t ldb, int64_t n, double p) {
  bool nan = isnan(p), pos = p == (double)INFINITY, neg = p == -(double)INFINITY;
  for (int64_t k = 0; k < n; ++k) {
    const double t = (double)a[k] * (double)b[k * ldb];
    nan |= isnan(t);
    pos |= t == (double)INFINITY;
    neg |= t == -(double)INFINITY;
  }
  return (nan || (pos && neg)) ? (double)NAN : (pos ? (double)INFINITY : -(double)INFINITY);
}

// The new partial from a chunk's exact sum S of scaled terms (units of 2^(emax - frac_bits)).
QT_HD double acc_finish(double S, int emax, double p, const AccumSpec& s) {
  const double v = acc_normalize(S * acc_pow2(emax - s.frac_bits), s.acc_man, s.acc_round,
                                 s.acc_emin, s.acc_emax);
  return s.acc_in_alignment ? v : (double)((float)p + (float)v);
}

// Whether a chunk has a zero term (MMA-Sim's e_zero): a padding slot (n < chunk), a zero partial
// that takes part in the alignment, or a zero product (ea, eb: acc_exp_f32's exponents).
QT_HD bool acc_has_zero(const int* ea, const int* eb, int64_t n, double p, const AccumSpec& s) {
  if (n < s.chunk || (s.acc_in_alignment && p == 0.0)) return true;
  for (int64_t k = 0; k < n; ++k)
    if (ea[k] == kAccZeroExp || eb[k] == kAccZeroExp) return true;
  return false;
}

// One chunk's aligned, rounded, summed and normalized result (the new p). a, b: the chunk's
// operands (n <= chunk), ea, eb their exponents (acc_exp_f32). ga, gb: with groups, each group's
// exponents (its alignment exponent is ga[j] + gb[j], e_zero where its products are all zero;
// nullptr: the group sum's own exponent).
QT_HD double acc_chunk(const float* a, const float* b, const int* ea, const int* eb, int64_t n,
                       double p, const AccumSpec& s, const int* ga = nullptr,
                       const int* gb = nullptr) {
  const bool p_ok = isfinite(p);
  const double pt = s.acc_in_alignment ? p : 0.0;
  int emax = kAccZeroExp;  // p's alignment exponent (clamped at the accumulator's emin)
  if (pt != 0.0) emax = acc_exp_f64(pt) < s.acc_emin ? s.acc_emin : acc_exp_f64(pt);
  double S = 0.0;
  if (s.group == 1) {
    int em = kAccZeroExp;
    for (int64_t k = 0; k < n; ++k) {
      const int e = ea[k] + eb[k];
      em = e > em ? e : em;
    }
    if (em > kAccBadExp / 2 || !p_ok) return acc_nonfinite(a, b, 1, n, p);
    emax = em > emax ? em : emax;
    // a zero term at e_zero: it moves emax only where every other term is below it
    if (emax < s.e_zero && acc_has_zero(ea, eb, n, p, s)) emax = s.e_zero;
    if (emax < kAccZeroExp / 2) emax = 0;
    const double sc = acc_pow2(s.frac_bits - emax);
    // the terms are integers below 2^53 and so is every partial sum: any order gives the same
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
      s0 += acc_round_int((double)a[k] * (double)b[k] * sc, s.align_round);
      s1 += acc_round_int((double)a[k + 1] * (double)b[k + 1] * sc, s.align_round);
      s2 += acc_round_int((double)a[k + 2] * (double)b[k + 2] * sc, s.align_round);
      s3 += acc_round_int((double)a[k + 3] * (double)b[k + 3] * sc, s.align_round);
    }
    for (; k < n; ++k) s0 += acc_round_int((double)a[k] * (double)b[k] * sc, s.align_round);
    S = (s0 + s1) + (s2 + s3);
    S += acc_round_int(pt * sc, s.align_round);
  } else {
    // exact group sums (sequential double adds, as the reference), at most chunk/group of them
    double g[256];
    int eg[256];
    const int ng = (int)((n + s.group - 1) / s.group);
    bool ok = p_ok, zero = n < s.chunk || (s.acc_in_alignment && p == 0.0);
    for (int j = 0; j < ng; ++j) {
      const int64_t k0 = (int64_t)j * s.group;
      const int64_t k1 = k0 + s.group < n ? k0 + s.group : n;
      double t = (double)a[k0] * (double)b[k0];
      bool nonzero = t != 0.0;
      for (int64_t k = k0 + 1; k < k1; ++k) {
        const double q = (double)a[k] * (double)b[k];
        nonzero |= q != 0.0;
        t = t + q;
      }
      ok &= (bool)isfinite(t);
      g[j] = t;
      if (ga != nullptr)
        eg[j] = nonzero ? ga[j] + gb[j] : kAccZeroExp;
      else
        eg[j] = t == 0.0 ? kAccZeroExp : acc_exp_f64(t);
      zero |= eg[j] == kAccZeroExp;
    }
    if (!ok) return acc_nonfinite(a, b, 1, n, p);
    for (int j = 0; j < ng; ++j) emax = eg[j] > emax ? eg[j] : emax;
    if (emax < s.e_zero && zero) emax = s.e_zero;
    if (emax < kAccZeroExp / 2) emax = 0;
    const double sc = acc_pow2(s.frac_bits - emax);
    for (int j = 0; j < ng; ++j) S += acc_round_int(g[j] * sc, s.align_round);
    S += acc_round_int(pt * sc, s.align_round);
  }
  return acc_finish(S, emax, p, s);
}

// One output element: the dot product of a[0:K] and b[0:K] through the datapath s, from the
// initial accumulator c0. ga, gb: the groups' exponents (acc_chunk), K / group of each, or nullptr.
QT_HD float acc_dot(const float* a, const float* b, const int* ea, const int* eb, int64_t K,
                    const AccumSpec& s, float c0 = 0.0f, const int* ga = nullptr,
                    const int* gb = nullptr) {
  float acc = 0.0f;
  double p = (double)c0;
  int c = 0;
  for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
    const int64_t n = K - k0 < s.chunk ? K - k0 : s.chunk;
    const int64_t j0 = k0 / s.group;
    p = acc_chunk(a + k0, b + k0, ea + k0, eb + k0, n, p, s, ga ? ga + j0 : nullptr,
                  gb ? gb + j0 : nullptr);
    if (s.promote > 0 && (++c == s.promote || k0 + n == K)) {
      acc = acc + (float)p;
      p = 0.0;
      c = 0;
    }
  }
  const float out = s.promote > 0 && K > 0 ? acc : (float)p;
  return isnan(out) ? u2f(F32::QNAN) : out;
}

}  // namespace qtensor
