// Scalar rounding math shared by the CPU and CUDA kernels: one source of truth, torch-free.
//
// Every function works on the bit pattern of a float32 (U = uint32_t) or float64 (U = uint64_t)
// carrier with integer operations, so the result is exact and identical on host and device, and
// the CPU loops that call it are branch-free (selects only) and vectorize.
//
// The numerical contract is qtensor/reference.py; the names below follow it:
//   rounding a magnitude a to a grid of spacing 2^qexp: y = a / 2^qexp, lo = floor(y),
//   frac = y - lo, and the result is (lo + up) * 2^qexp where, with thr = floor(frac * 2^32),
//   up = (w < thr) for a 32-bit word w chosen by the rounding mode:
//     nearest (ties to even)   w = 2^31 - (lo & 1)
//     nearest_away             w = 2^31 - 1
//     toward_zero              w = 2^32 - 1           (never up)
//     stochastic               w = the element's random word (the reference's contract)
//   This is exact for the deterministic modes because frac has at most 32 fractional bits
//   whenever it can be >= 1/2.
// Overflow (a float format's rounded magnitude beyond max) gives the format's overflow value,
// except that toward_zero gives max for a finite input (IEEE 754 roundTowardZero). Fixed point
// (and integer block elements) have no negative zero: a value that rounds to zero is +0.0.
#pragma once

#include <stdint.h>

#include <string.h>

#if defined(__CUDACC__)
#define QT_HD __host__ __device__ __forceinline__
#else
#define QT_HD inline __attribute__((always_inline))
#endif

namespace qtensor {

enum Rounding : int { kNearest = 0, kNearestAway = 1, kTowardZero = 2, kStochastic = 3 };
// Runs the statement(s) with M, a constexpr int, bound to the runtime rounding mode (anything
// else is stochastic), so kernels take the mode as a template argument. A macro rather than a
// generic lambda: it works unchanged in host code, device code and nvcc host-side launchers.
#define QT_MODE_SWITCH(mode, ...)                                                     \
  switch (mode) {                                                                     \
    case ::qtensor::kNearest: {                                                       \
      constexpr int M = ::qtensor::kNearest; __VA_ARGS__; break; }                    \
    case ::qtensor::kNearestAway: {                                                   \
      constexpr int M = ::qtensor::kNearestAway; __VA_ARGS__; break; }                \
    case ::qtensor::kTowardZero: {                                                    \
      constexpr int M = ::qtensor::kTowardZero; __VA_ARGS__; break; }                 \
    default: {                                                                        \
      constexpr int M = ::qtensor::kStochastic; __VA_ARGS__; break; }                 \
  }

// A rounding mode argument carries, above its low byte, the random bits a stochastic rounding
// drops (32 - N for "stochasticN", 0 for "stochastic"): the element's word is OR-ed with that
// many low one bits, so that up = (w | low) < thr, thr = floor(frac * 2^32), is exactly
// (w >> (32 - N)) < floor(frac * 2^N): N random bits against the top N bits of the fraction.
QT_HD int mode_base(int mode) { return mode & 0xFF; }
QT_HD uint32_t sr_or_mask(int mode) {
  const int drop = (mode >> 8) & 31;
  return drop ? (((uint32_t)1 << drop) - 1u) : 0u;
}

// What a float format gives on overflow: its max, Inf, or NaN.
enum Overflow : int { kSaturate = 0, kInf = 1, kNaN = 2 };

// ---- bit casts ---------------------------------------------------------------------------------
QT_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u; memcpy(&u, &f, 4); return u;
#endif
}
QT_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f; memcpy(&f, &u, 4); return f;
#endif
}
QT_HD uint64_t d2u(double f) {
#if defined(__CUDA_ARCH__)
  return (uint64_t)__double_as_longlong(f);
#else
  uint64_t u; memcpy(&u, &f, 8); return u;
#endif
}
QT_HD double u2d(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double((long long)u);
#else
  double f; memcpy(&f, &u, 8); return f;
#endif
}

// ---- the random-bits contract (docs/formats.md) ------------------------------------------------
QT_HD uint32_t lowbias32(uint32_t v) {
  v ^= v >> 16; v *= 0x7feb352du; v ^= v >> 15; v *= 0x846ca68bu; v ^= v >> 16;
  return v;
}
QT_HD uint32_t seed_key(uint64_t seed) {
  return lowbias32((uint32_t)seed ^ lowbias32((uint32_t)(seed >> 32) ^ 0x9E3779B9u));
}
// key ^ lowbias32(hi32(i)): constant over each run of 2^32 indices.
QT_HD uint32_t index_key(uint32_t key, uint64_t index) {
  return key ^ lowbias32((uint32_t)(index >> 32));
}
QT_HD uint32_t random_word(uint32_t ikey, uint32_t index_lo) { return lowbias32(index_lo ^ ikey); }

// ---- carrier traits ----------------------------------------------------------------------------
template <typename U> struct Carrier;
template <> struct Carrier<uint32_t> {
  using Float = float;
  static constexpr int BITS = 32, MAN = 23, BIAS = 127;
  static constexpr uint32_t SIGN = 0x80000000u, ABS = 0x7FFFFFFFu, INF = 0x7F800000u,
                            QNAN = 0x7FC00000u, MANMASK = 0x007FFFFFu;
  static QT_HD float to_float(uint32_t u) { return u2f(u); }
  static QT_HD uint32_t to_bits(float f) { return f2u(f); }
};
template <> struct Carrier<uint64_t> {
  using Float = double;
  static constexpr int BITS = 64, MAN = 52, BIAS = 1023;
  static constexpr uint64_t SIGN = 0x8000000000000000ull, ABS = 0x7FFFFFFFFFFFFFFFull,
                            INF = 0x7FF0000000000000ull, QNAN = 0x7FF8000000000000ull,
                            MANMASK = 0x000FFFFFFFFFFFFFull;
  static QT_HD double to_float(uint64_t u) { return u2d(u); }
  static QT_HD uint64_t to_bits(double f) { return d2u(f); }
};
// float32's named bits (sign, magnitude mask, +Inf, the canonical quiet NaN, mantissa mask).
using F32 = Carrier<uint32_t>;

// 2^e as carrier bits; e must lie in the carrier's range (subnormals included).
template <typename U> QT_HD U pow2_bits(int e) {
  using C = Carrier<U>;
  int sh = e + C::BIAS + C::MAN - 1;                 // bit position of a subnormal 2^e
  sh = sh < 0 ? 0 : (sh > C::BITS - 1 ? C::BITS - 1 : sh);
  U normal = (U)(U)(e + C::BIAS) << C::MAN;
  return e >= 1 - C::BIAS ? normal : ((U)1 << sh);
}

// Binade (floor(log2 a)) of a positive finite magnitude given by its bits; a subnormal's binade
// is found by converting its integer significand to float, which is exact.
template <typename U> QT_HD int binade_of(U A) {
  using C = Carrier<U>;
  int E = (int)(A >> C::MAN);
  int sub;
  if (C::BITS == 32) {
    sub = (int)(f2u((float)(int32_t)A) >> 23) - 127 - (C::BIAS + C::MAN - 1);
  } else {
    // A < 2^52 here: convert its two halves from int32 (vectorizable), the sum is exact
    const int32_t hi = (int32_t)(uint32_t)((uint64_t)A >> 32);
    const uint32_t lo = (uint32_t)A;
    const double v = (double)hi * 4294967296.0 + ((double)(int32_t)(lo ^ 0x80000000u) + 2147483648.0);
    sub = (int)(d2u(v) >> 52) - 1023 - (C::BIAS + C::MAN - 1);
  }
  return E != 0 ? E - C::BIAS : sub;
}

template <int MODE> QT_HD uint32_t mode_word(uint32_t lo_odd, uint32_t rbits) {
  return MODE == kNearest ? 0x80000000u - lo_odd
       : MODE == kNearestAway ? 0x7FFFFFFFu
       : MODE == kTowardZero ? 0xFFFFFFFFu : rbits;
}

// Round a finite magnitude (bits A, sign clear) to the grid whose spacing is 2^(binade - man)
// when binade >= emin and 2^qlow below (qlow = emin - man with subnormals, emin without; a fixed
// point grid is emin = +large, qlow = -fl). Returns the magnitude bits, possibly one quantum past
// the format's range (the caller handles overflow).
template <int MODE, typename U>
QT_HD U round_magnitude(U A, int emin, int man, int qlow, uint32_t rbits) {
  using C = Carrier<U>;
  const int E = (int)(A >> C::MAN);
  const int binade = binade_of<U>(A);
  const int qexp = binade >= emin ? binade - man : qlow;
  const int ulp = (E > 1 ? E : 1) - (C::BIAS + C::MAN);   // exponent of A's last bit
  const int d = qexp - ulp;                               // bits to round away
  const bool tiny = d > C::MAN;                           // a < 2^qexp: result 0 or 2^qexp
  const int dn = d < 0 ? 0 : (tiny ? C::MAN : d);
  const U mask = ((U)1 << dn) - 1;
  const U fb = A & mask;
  // thr = floor(frac * 2^32) with frac = fb / 2^dn
  uint32_t thr_n;
  if (C::MAN > 31) {
    int sl = dn < 31 ? 31 - dn : 0, sr = dn > 32 ? dn - 32 : 0;
    thr_n = (uint32_t)(dn <= 31 ? ((fb << sl) << 1) : (fb >> sr));
  } else {
    thr_n = (uint32_t)((fb << (31 - dn)) << 1);
  }
  // tiny: frac = M / 2^d with M the integer significand
  const U M = E != 0 ? ((A & C::MANMASK) | ((U)1 << C::MAN)) : A;
  int ls = 32 - d, rs = d - 32;
  ls = ls < 0 ? 0 : (ls > 31 ? 31 : ls);
  rs = rs < 0 ? 0 : (rs > C::BITS - 1 ? C::BITS - 1 : rs);
  const uint32_t thr_t = (uint32_t)(d <= 32 ? (M << ls) : (M >> rs));
  const uint32_t thr = tiny ? thr_t : thr_n;
  // parity of lo = M >> dn (from M, not A: at dn = MAN the bit is the implicit one)
  const uint32_t lo_odd = tiny ? 0u : (uint32_t)((M >> dn) & 1);
  const bool up = mode_word<MODE>(lo_odd, rbits) < thr;
  const U res_n = (A & ~mask) + ((U)up << dn);   // a carry into the exponent is the next binade
  const U res_t = up ? pow2_bits<U>(qexp) : (U)0;
  return tiny ? res_t : res_n;
}

// ---- the fast path (float32 carrier) -------------------------------------------------------
// The same rounding as round_magnitude, cheaper: above the format's smallest normal (A >= normal_min)
// the grid is relative, so the bits to drop are a constant d = 23 - man; below it the grid is the
// fixed spacing q = 2^qlow, and float arithmetic does it exactly: (a + C) - C with C = 2^(qlow+23)
// is a rounded to nearest-even multiple of q (a < C), lo and frac = a - lo are exact, and
// frac * 2^(32-qlow) < 2^32 is exact too. Usable when the format's normals lie in float32's
// normal range (emin >= -126) and, for stochastic rounding below the normals, qlow >= -95.
struct FastGrid {
  int d;
  uint32_t mask, normal_min;
  float C, q, h, sto;
};

QT_HD float pow2f(int e) { return u2f(pow2_bits<uint32_t>(e)); }

// all_normal: float32 subnormals lie on the relative grid too (emin = -126 with subnormals).
QT_HD bool make_fast_grid(FastGrid& g, int man, int emin, int qlow, bool all_normal,
                          bool fixed_point, bool stochastic) {
  if (!fixed_point && emin < -126) return false;
  if (qlow + 23 > 127) return false;
  const bool uses_low = fixed_point || !all_normal;
  if (stochastic && uses_low && qlow < -95) return false;
  if (uses_low && qlow < -149) return false;
  g.d = fixed_point ? 0 : 23 - man;
  g.mask = ((uint32_t)1 << g.d) - 1;
  g.normal_min = fixed_point ? 0xFFFFFFFFu : (all_normal ? 0u : (uint32_t)(emin + 127) << 23);
  g.C = pow2f(qlow + 23);
  g.q = pow2f(qlow);
  g.h = pow2f(qlow - 1 < -149 ? -149 : qlow - 1);
  g.sto = (stochastic && uses_low) ? pow2f(32 - qlow) : 0.0f;
  return true;
}

// The fixed grid q alone (round_magnitude_fast below normal_min; all of a fixed-point grid).
template <int MODE>
QT_HD uint32_t round_low_fast(uint32_t A, const FastGrid& g, uint32_t rbits) {
  const float a = u2f(A);
  const float t = (a + g.C) - g.C;
  const float lo = t > a ? t - g.q : t;
  float low;
  if (MODE == kNearest) {
    low = t;
  } else if (MODE == kNearestAway) {
    low = (a - lo) >= g.h ? lo + g.q : lo;
  } else if (MODE == kTowardZero) {
    low = lo;
  } else {
    const float F = (a - lo) * g.sto;  // floor(F) = floor(frac / q * 2^32) < 2^32
    const bool big = F >= 2147483648.0f;
    const uint32_t thr2 = big ? ((uint32_t)(int32_t)(F - 2147483648.0f) | 0x80000000u)
                              : (uint32_t)(int32_t)F;
    low = rbits < thr2 ? lo + g.q : lo;
  }
  return a >= g.C ? A : f2u(low);  // a >= C: already on the grid
}

template <int MODE>
QT_HD uint32_t round_magnitude_fast(uint32_t A, const FastGrid& g, uint32_t rbits) {
  // relative grid: drop d bits of A (a carry into the exponent is the next binade)
  const uint32_t fb = A & g.mask;
  // parity of the kept part from the significand (at d = 23 the kept bit is the implicit one)
  const uint32_t M = (A & F32::MANMASK) | (A > F32::MANMASK ? F32::MANMASK + 1u : 0u);
  const uint32_t lo_odd = (M >> g.d) & 1u;
  const uint32_t thr = (fb << (31 - g.d)) << 1;
  const bool up = mode_word<MODE>(lo_odd, rbits) < thr;
  const uint32_t rn = (A & ~g.mask) + ((uint32_t)up << g.d);
  // fixed grid q below the normals
  const uint32_t rl = round_low_fast<MODE>(A, g, rbits);
  return A >= g.normal_min ? rn : rl;
}

// round_magnitude_fast (deterministic modes) on the grid of a float format WITH subnormals whose
// smallest normal is 2^ek (ek >= -126) and man <= 22 (d = 23 - man >= 1), in a few float
// operations (the CPU's power-of-two block runs): nmin_c = 2^ek's bits, dsh = d << 23.
// With E = max(binade(a), ek) the grid's spacing at a is s = 2^(E - man) (the normals' relative
// grid; below 2^ek the subnormals' fixed one, the same s), and c = 2^(E + d) (bits
// max(A & exponent, nmin_c) + dsh; the caller keeps E + d <= 127). a < 2^(E+1) <= c, so a + c lies
// in [c, 2c], where the floats are the multiples of ulp(c) = s: the sum rounds (ties to even,
// the float32 default) to the multiple of s nearest a, ties to the even multiple (c / s = 2^23
// is even, so the parity is a's), and r = (a + c) - c is exact: the nearest-even rounding of a
// to the grid, which is what round_magnitude_fast gives (above 2^ek it drops d bits, ties to the
// even kept part; below it (a + C) - C with C = 2^(qlow + 23) = c; a float32 subnormal a on an
// all-normal grid (ek = -126, normal_min 0) drops d bits of its pattern: spacing 2^(d - 149) = s).
// nearest_away differs only at a tie rounded down (a - r = s/2, exact: both are multiples of
// a's ulp, |a - r| <= s/2): one s up. toward_zero: r - s where r > a. s = c 2^-23 and
// s/2 = c 2^-24 are powers of two >= 2^(-126 - man - 1) >= 2^-149: exact products.
// (the float32 default environment: no flush-to-zero, as the fixed grid q above)
template <int MODE>
QT_HD uint32_t round_magnitude_add(uint32_t A, uint32_t nmin_c, uint32_t dsh) {
  const uint32_t E = A & F32::INF;
  const float a = u2f(A), c = u2f((E > nmin_c ? E : nmin_c) + dsh);
  const float r = (a + c) - c;
  if (MODE == kNearestAway) {
    const float s = c * 1.1920928955078125e-07f, h = c * 5.9604644775390625e-08f;
    return f2u((a - r) == h ? r + s : r);
  }
  if (MODE == kTowardZero) {
    const float s = c * 1.1920928955078125e-07f;
    return f2u(r > a ? r - s : r);
  }
  return f2u(r);
}

// What a finite value that rounds beyond max gives: toward_zero never rounds up past max.
template <int MODE, typename U> QT_HD U finite_overflow(U max_bits, U ovf_bits) {
  return MODE == kTowardZero ? max_bits : ovf_bits;
}

template <int MODE>
QT_HD uint32_t round_float_fast(uint32_t u, const FastGrid& g, uint32_t max_bits, uint32_t ovf_bits,
                                uint32_t rbits) {
  const uint32_t sign = u & F32::SIGN, A = u & F32::ABS;
  const bool nonfinite = A >= F32::INF, nan = A > F32::INF;
  uint32_t r = round_magnitude_fast<MODE>(nonfinite ? 0u : A, g, rbits);
  r = r > max_bits ? finite_overflow<MODE>(max_bits, ovf_bits) : r;
  r = nonfinite ? ovf_bits : r;
  return nan ? u : (r | sign);
}

// ---- float formats -----------------------------------------------------------------------------
template <typename U> struct FloatSpec {
  int man, emin, qlow;
  U max_bits;        // the largest finite value
  U ovf_bits;        // what overflow gives: max, Inf or NaN
  U min_normal_bits; // unsigned (E8M0-like) formats: what zero becomes
  bool is_unsigned;
};

template <typename U>
QT_HD FloatSpec<U> make_float_spec(int man, int emin, bool subnormals, double maxval,
                                   int overflow, bool is_unsigned) {
  using C = Carrier<U>;
  FloatSpec<U> s;
  s.man = man; s.emin = emin; s.qlow = subnormals ? emin - man : emin;
  s.max_bits = C::to_bits((typename C::Float)maxval);
  s.ovf_bits = overflow == kSaturate ? s.max_bits : (overflow == kInf ? C::INF : C::QNAN);
  s.min_normal_bits = pow2_bits<U>(emin);
  s.is_unsigned = is_unsigned;
  return s;
}

// MAYBE_UNSIGNED=false drops the (loop-invariant) branch for exponent-only formats, so that
// element loops stay branch-free.
template <int MODE, typename U, bool MAYBE_UNSIGNED = true>
QT_HD U round_float(U u, const FloatSpec<U>& s, uint32_t rbits) {
  using C = Carrier<U>;
  const U sign = u & C::SIGN, A = u & C::ABS;
  const bool nonfinite = A >= C::INF, nan = A > C::INF;
  U r = round_magnitude<MODE, U>(nonfinite ? (U)0 : A, s.emin, s.man, s.qlow, rbits);
  r = r > s.max_bits ? finite_overflow<MODE>(s.max_bits, s.ovf_bits) : r;
  r = nonfinite ? s.ovf_bits : r;
  if (MAYBE_UNSIGNED && s.is_unsigned) {  // no zero and no sign: zero becomes the smallest value, <= 0 is NaN
    r = r == 0 ? s.min_normal_bits : r;
    return (sign == 0 && A != 0 && !nan) ? r : C::QNAN;
  }
  return nan ? u : (r | sign);
}

// ---- fixed point -------------------------------------------------------------------------------
template <typename U> struct FixedSpec {
  int wl, fl, qexp;  // grid spacing 2^qexp (= 2^-fl, times the block scale inside blocks)
  U pos_bits;        // kmax * 2^qexp
  U neg_bits;        // |kmin| * 2^qexp (0 for unsigned formats)
  U neg_sat_bits;    // what negative overflow clamps to: -|kmin| * 2^qexp, or +0 when unsigned
  int64_t kmin, kmax;
  bool is_signed;
};

template <typename U>
QT_HD FixedSpec<U> make_fixed_spec(int wl, int fl, bool is_signed, bool symmetric, int shift) {
  using C = Carrier<U>;
  FixedSpec<U> s;
  s.wl = wl; s.fl = fl; s.qexp = shift - fl; s.is_signed = is_signed;
  s.kmax = is_signed ? ((int64_t)1 << (wl - 1)) - 1 : ((int64_t)1 << wl) - 1;
  s.kmin = is_signed ? -((int64_t)1 << (wl - 1)) + (symmetric ? 1 : 0) : 0;
  typedef typename C::Float F;
  const F q = C::to_float(pow2_bits<U>(s.qexp));
  s.pos_bits = C::to_bits((F)s.kmax * q);  // exact: at most 24 bits times a power of two
  s.neg_bits = C::to_bits((F)(-s.kmin) * q);
  s.neg_sat_bits = s.neg_bits != 0 ? (s.neg_bits | C::SIGN) : (U)0;
  return s;
}

// Two's-complement wrap of an out-of-range rounded value (magnitude bits r, sign) into the
// format's range; the dropped code of a symmetric format clamps.
template <typename U>
QT_HD U wrap_fixed(U r, bool negative, const FixedSpec<U>& s) {
  using C = Carrier<U>;
  const int E = (int)(r >> C::MAN);
  const uint64_t M = (uint64_t)(E != 0 ? ((r & C::MANMASK) | ((U)1 << C::MAN)) : r);
  const int t = (E > 1 ? E : 1) - (C::BIAS + C::MAN) - s.qexp;  // k = M * 2^t, an integer
  const uint64_t span_mask = ((uint64_t)1 << s.wl) - 1;
  uint64_t kmod = t >= s.wl ? 0 : (t >= 0 ? (M << t) : (M >> (-t > 63 ? 63 : -t)));
  kmod &= span_mask;
  if (negative) kmod = ((uint64_t)0 - kmod) & span_mask;
  int64_t k = (int64_t)kmod;
  if (s.is_signed && k >= ((int64_t)1 << (s.wl - 1))) k -= (int64_t)1 << s.wl;
  k = k < s.kmin ? s.kmin : (k > s.kmax ? s.kmax : k);
  typedef typename C::Float F;
  return C::to_bits((F)k * C::to_float(pow2_bits<U>(s.qexp)));
}

template <int MODE, bool WRAP, typename U>
QT_HD U round_fixed(U u, const FixedSpec<U>& s, uint32_t rbits) {
  using C = Carrier<U>;
  const U sign = u & C::SIGN, A = u & C::ABS;
  const bool nonfinite = A >= C::INF, nan = A > C::INF;
  const U r = round_magnitude<MODE, U>(nonfinite ? (U)0 : A, 100000, 0, s.qexp, rbits);
  const U lim = sign ? s.neg_bits : s.pos_bits;
  const bool over = nonfinite || r > lim;
  // clamping: -|kmin| keeps the sign; an unsigned format clamps negatives to +0
  const U sat = sign ? s.neg_sat_bits : s.pos_bits;
  U out = over ? sat : (r | (r != 0 ? sign : (U)0));  // no negative zero
  if (WRAP && over && !nonfinite) out = wrap_fixed<U>(r, sign != 0, s);
  return nan ? u : out;
}

// (the limits are passed as scalars: gcc vectorizes the loops better than with the struct)
template <int MODE>
QT_HD uint32_t round_fixed_fast(uint32_t u, const FastGrid& g, uint32_t pos_bits, uint32_t neg_bits,
                                uint32_t neg_sat_bits, uint32_t rbits) {
  const uint32_t sign = u & F32::SIGN, A = u & F32::ABS;
  const bool nonfinite = A >= F32::INF, nan = A > F32::INF;
  const uint32_t r = round_magnitude_fast<MODE>(nonfinite ? 0u : A, g, rbits);
  // selects written as masks: two ternaries on one condition stop gcc's vectorizer
  const uint32_t neg = (uint32_t)((int32_t)u >> 31);
  const uint32_t lim = (neg_bits & neg) | (pos_bits & ~neg);
  const uint32_t sat = (neg_sat_bits & neg) | (pos_bits & ~neg);
  const bool over = nonfinite | (r > lim);
  const uint32_t nonzero = (uint32_t)0 - (uint32_t)(r != 0);  // no negative zero
  const uint32_t out = over ? sat : (r | (sign & nonzero));
  return nan ? u : out;
}

// round_fixed_fast for a finite u (the power-of-two block runs write NaN/Inf blocks apart) on a
// fixed-point FastGrid (normal_min above every magnitude): the same bits, fewer selects.
template <int MODE>
QT_HD uint32_t round_fixed_fast_finite(uint32_t u, const FastGrid& g, uint32_t pos_bits,
                                       uint32_t neg_bits, uint32_t neg_sat_bits) {
  const uint32_t sign = u & F32::SIGN, A = u & F32::ABS;
  const uint32_t r = round_low_fast<MODE>(A, g, 0u);
  const uint32_t neg = (uint32_t)((int32_t)u >> 31);
  const uint32_t lim = (neg_bits & neg) | (pos_bits & ~neg);
  const uint32_t sat = (neg_sat_bits & neg) | (pos_bits & ~neg);
  const uint32_t nonzero = (uint32_t)0 - (uint32_t)(r != 0);  // no negative zero
  return r > lim ? sat : (r | (sign & nonzero));
}

// ---- blocks ------------------------------------------------------------------------------------
// Power-of-two scale 2^k of a block from its amax (float32 bits, finite): floor or ceil rule,
// or even (even_mbits >= 0: the element's significant bits after the leading one), clamped to
// the scale format's exponent range.
QT_HD int block_scale_exp(uint32_t amax_bits, int rule_ceil, int elem_emax, double elem_max,
                          int scale_emin, int scale_emax, int even_mbits = -1) {
  // binade of amax; frexp(0) gives exponent 0, i.e. binade -1 (as the reference)
  int b = amax_bits == 0 ? -1 : binade_of<uint32_t>(amax_bits);
  if (even_mbits >= 0) {
    // amax rounded half away from zero to even_mbits + 1 significant bits reaches the next
    // binade: amax >= 2^(b+1) - 2^(b - even_mbits - 1) (exact in double)
    const double thr = u2d(pow2_bits<uint64_t>(b + 1)) -
                       u2d(pow2_bits<uint64_t>(b - even_mbits - 1));
    b += (double)u2f(amax_bits) >= thr ? 1 : 0;
  }
  int k = b - elem_emax;
  if (rule_ceil) {
    // amax / 2^k > max_elem, exactly (2^k*max_elem is a double product without rounding)
    double p = u2d(pow2_bits<uint64_t>(k)) * elem_max;
    k += (double)u2f(amax_bits) > p ? 1 : 0;
  }
  return k < scale_emin ? scale_emin : (k > scale_emax ? scale_emax : k);
}

// Element of a block with a power-of-two scale 2^k: the element format shifted by k, so no
// division is needed and the result is X * Q(x / X) exactly.
struct BlockElemSpec {
  bool is_fixed;
  FloatSpec<uint32_t> f;   // float element, shifted
  FixedSpec<uint32_t> x;   // fixed element, shifted
};

QT_HD BlockElemSpec shift_elem(bool is_fixed, int man, int emin, int qlow, double elem_max, int wl,
                               int fl, bool is_signed, bool symmetric, int k) {
  BlockElemSpec s;
  s.is_fixed = is_fixed;
  if (is_fixed) {
    s.x = make_fixed_spec<uint32_t>(wl, fl, is_signed, symmetric, k);
    s.f = make_float_spec<uint32_t>(0, 0, true, 0.0, kSaturate, false);
  } else {
    s.f.man = man; s.f.emin = emin + k; s.f.qlow = qlow + k;
    // max * 2^k in double, then to float32 (Inf when beyond float32: then nothing saturates,
    // as in the reference where the product overflows only when cast to float32)
    double m = elem_max * u2d(pow2_bits<uint64_t>(k));
    s.f.max_bits = f2u((float)m);
    s.f.ovf_bits = s.f.max_bits; s.f.min_normal_bits = 0; s.f.is_unsigned = false;
    s.x = make_fixed_spec<uint32_t>(8, 0, true, false, 0);
  }
  return s;
}

template <int MODE>
QT_HD uint32_t round_block_elem(uint32_t u, const BlockElemSpec& s, uint32_t rbits) {
  if (s.is_fixed) return round_fixed<MODE, false, uint32_t>(u, s.x, rbits);
  const uint32_t sign = u & F32::SIGN, A = u & F32::ABS;
  uint32_t r = round_magnitude<MODE, uint32_t>(A, s.f.emin, s.f.man, s.f.qlow, rbits);
  r = r > s.f.max_bits ? s.f.max_bits : r;
  return r | sign;
}

// Blocks whose scale is not a power of two (scale_rule "amax", NVFP4): everything in double as
// the reference: z = x / X, q = X * Q(z).
struct AmaxBlockSpec {
  FloatSpec<uint64_t> scale;   // the scale format, nearest
  bool elem_fixed;
  FloatSpec<uint64_t> ef;      // elements as doubles (saturating)
  FixedSpec<uint64_t> ex;
  double elem_max;  // the element value a block's amax maps to (4over6: also 4)
  bool up;          // the scale rounds amax / elem_max up (scale_rule ceil), else to nearest
};

// Non-negative finite r rounded up to a value of the (signed) scale format s: toward zero, and
// if that is below r the next value (past max: the overflow value). reference._round_float_up
QT_HD double round_float_up(double r, const FloatSpec<uint64_t>& s) {
  const uint64_t tb = round_float<kTowardZero, uint64_t>(d2u(r), s, 0);
  const double t = u2d(tb);
  if (!(t < r)) return t;
  int qexp = s.qlow;
  if (t > 0) {
    const int b = binade_of<uint64_t>(tb);
    qexp = (b > s.emin ? b : s.emin) - s.man;
  }
  const double nxt = t + u2d(pow2_bits<uint64_t>(qexp));
  return nxt > u2d(s.max_bits) ? u2d(s.ovf_bits) : nxt;
}

// The block scale (0 or negative/NaN means "no scale": the block becomes zeros, signed for float
// elements).
QT_HD double amax_block_scale(uint32_t amax_bits, const AmaxBlockSpec& s) {
  const double ratio = (double)u2f(amax_bits) / s.elem_max;
  return s.up ? round_float_up(ratio, s.scale)
              : u2d(round_float<kNearest, uint64_t>(d2u(ratio), s.scale, 0));
}

template <int MODE, bool ELEM_FIXED>
QT_HD float round_amax_elem_t(float x, double scale, const AmaxBlockSpec& s, uint32_t rbits) {
  const bool ok = scale > 0;
  const double safe = ok ? scale : 1.0;
  const double z = (double)x / safe;
  const uint64_t zb = d2u(z);
  uint64_t qzb;
  if (ELEM_FIXED) qzb = round_fixed<MODE, false, uint64_t>(zb, s.ex, rbits);
  else qzb = round_float<MODE, uint64_t, false>(zb, s.ef, rbits);
  const double q = u2d(qzb) * safe;
  // no scale: signed zeros (integer elements have no -0.0)
  const float zero = ELEM_FIXED ? 0.0f : u2f(f2u(x) & F32::SIGN);
  return ok ? (float)q : zero;
}

template <int MODE>
QT_HD float round_amax_elem(float x, double scale, const AmaxBlockSpec& s, uint32_t rbits) {
  return s.elem_fixed ? round_amax_elem_t<MODE, true>(x, scale, s, rbits)
                      : round_amax_elem_t<MODE, false>(x, scale, s, rbits);
}

// The amax rule's idempotence (docs/formats.md): the scale derived again from the rounded
// block's amax must be the block's scale; while it is lower, the block is rounded with it.
// rounded_amax(sc) gives the bits of max |q| of the block rounded with the scale sc. Each step
// lowers the scale (the rounded amax is at most max_elem * sc), so the loop ends.
template <typename RoundedAmax>
QT_HD double settle_amax_scale(double sc, const AmaxBlockSpec& s,
                               const RoundedAmax& rounded_amax) {
  while (sc > 0) {
    const double again = amax_block_scale(rounded_amax(sc), s);
    if (!(again < sc)) break;
    sc = again;
  }
  return sc;
}

// The rounded amax of a block from its amax alone: deterministic rounding is monotone in |x|
// (float or symmetric fixed-point elements; an unsigned element clamps negatives, and stochastic
// rounding is not monotone across elements: those need every element).
template <int MODE>
QT_HD bool rounded_amax_from_amax(const AmaxBlockSpec& s) {
  return MODE != kStochastic && !(s.elem_fixed && !s.ex.is_signed);
}

// ---- FP4 E2M1 elements of a block, by comparison (NVFP4's deterministic fast path) ----------
// Q(|x| / X) * X on the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (saturating) without a division:
// |x| is compared with the rounding boundaries times X. A boundary (a midpoint, or for toward_zero
// a grid point) has at most 3 significant bits and X (an E4M3 scale) at most 4, so b * X is exact
// in float32 (X >= 2^-9: no underflow), and each comparison decides as the exact quotient x / X
// would (so as the reference's double one, which rounds to a boundary only when it is exact).
struct Fp4Bounds {
  float t[7];  // boundary k (between codes k and k+1) times X
};

template <int MODE> QT_HD Fp4Bounds fp4_bounds(float X) {
  const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const float grid[7] = {0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  Fp4Bounds b;
  for (int k = 0; k < 7; ++k) b.t[k] = (MODE == kTowardZero ? grid[k] : mid[k]) * X;
  return b;
}

// |x| (a, finite) -> Q(a / X) * X; the sum of the steps taken is a grid value v, and v * X is
// exact. Nearest (ties to even): a tie at boundary k goes up when code k + 1 is even (k odd).
template <int MODE> QT_HD float fp4_round_scaled(float a, const Fp4Bounds& b, float X) {
  const float step[7] = {0.5f, 0.5f, 0.5f, 0.5f, 1.0f, 1.0f, 2.0f};
  float v = 0.0f;
  for (int k = 0; k < 7; ++k) {
    const bool up = (MODE == kNearest && (k & 1) == 0) ? a > b.t[k] : a >= b.t[k];
    v += up ? step[k] : 0.0f;
  }
  return v * X;
}

}  // namespace qtensor
