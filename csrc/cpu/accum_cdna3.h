// The loops of qtensor::accum_matmul_cdna3 (csrc/cpu/accum_cdna3.cpp includes this file once per
// instruction set, inside a namespace): AMD CDNA3's two-stage MFMA step, qtensor/accum.py's
// _cdna3_chunk, for one row of a against a panel of P columns of b.
//
// Every step is exact in double (frac_bits <= 24: each truncated term is an integer below 2^26,
// the partial's second alignment and the 31-bit floor stay within 53 bits), and each is the
// reference's double operation in the reference's order, so the bits are the reference's. The
// P lanes of a panel run side by side (the compiler vectorizes them); a lane whose chunk has an
// inf/NaN operand, a nonfinite partial or (stages "cdna3") a product that may reach 2^128 is
// redone by step_general, the reference's every case, scalar.

constexpr int kAllZero = -999;  // _trunc_fuse's exponent of a fused set without nonzero terms
constexpr int kF2 = 31;         // the bits the second stage's sum is floored to

QT_HD int dexp(double x) {  // floor(log2|x|) of a finite nonzero double, clamped at -126
  const int e = (int)((qtensor::d2u(x) >> 52) & 0x7ff) - 1023;
  return e < -126 ? -126 : e;  // (a subnormal double is far below -126: the clamp holds)
}

// The second stage from the products' truncated sum D (units of 2^(ed - F)) and a finite
// partial p: the partial aligned with floor at F bits of em = max(ed, e(p)), the products
// floored at 2^(em - 32) (fp8: a partial 25 or more binades below is dropped), the sum floored
// to 31 bits and rounded to nearest FP32.
QT_HD double second_stage(double D, int ed, double p, int F, bool fp8) {
  const int ec = p == 0.0 ? -126 : dexp(p);
  const int em = ed > ec ? ed : ec;
  const double pow_d = qtensor::acc_pow2(ed - F) , pow_e = qtensor::acc_pow2(kF2 + 1 - em);
  const double sd = floor(D * pow_d * pow_e);
  double sc = floor(p * qtensor::acc_pow2(F - em));
  if (fp8 && ec < em - F - 1) sc = 0.0;
  const double v = sd * qtensor::acc_pow2(em - kF2 - 1) + sc * qtensor::acc_pow2(em - F);
  const int ev = v == 0.0 ? 0 : dexp(v);
  const double r = floor(v * qtensor::acc_pow2(kF2 - ev)) * qtensor::acc_pow2(ev - kF2);
  // to nearest FP32 (inf from 2^128); a negative below float32's grid is -0, as the MFMA
  return (double)(float)r;
}

// One chunk of n products for one output, every case of the reference: a (n), b (stride sb),
// their exponents ea, eb (accum.h's acc_exp_f32: kAccZeroExp for 0, kAccBadExp for inf/NaN).
// T: double (the double lanes' operands) or float (chain_fast's).
template <class T>
inline double step_general(const T* a, const T* b, int64_t sb, const int* ea, const int* eb,
                           int64_t n, double p, int F, bool fp8) {
  bool nan = false, pos = false, neg = false;
  const auto prod = [&](int64_t k, int* et) {
    double t = (double)a[k] * (double)b[k * sb];
    *et = ea[k] + eb[k * sb];
    // cdna3: a product of 2^128 or more (its significand in [1, 4)) is inf
    if (!fp8 && isfinite(t) && t != 0.0 &&
        *et + (fabs(t) >= qtensor::acc_pow2(*et + 1) ? 1 : 0) >= 128)
      t = t > 0 ? (double)INFINITY : -(double)INFINITY;
    return t;
  };
  int emh[2] = {kAllZero, kAllZero};  // each fused set's largest exponent of a nonzero term
  for (int64_t k = 0; k < n; ++k) {
    int et;
    const double t = prod(k, &et);
    if (!isfinite(t)) {
      nan |= isnan(t);
      pos |= t > 0;
      neg |= t < 0;
    } else if (t != 0.0) {
      const int h = fp8 ? (int)(k & 1) : 0;
      emh[h] = et > emh[h] ? et : emh[h];
    }
  }
  double Dh[2] = {0.0, 0.0};  // the truncated sums (a nonfinite term counts as 0)
  for (int64_t k = 0; k < n; ++k) {
    int et;
    double t = prod(k, &et);
    if (!isfinite(t)) t = 0.0;
    const int h = fp8 ? (int)(k & 1) : 0;
    Dh[h] += trunc(t * qtensor::acc_pow2(F - emh[h]));
  }
  int ed = emh[0];
  double D = Dh[0];
  if (fp8) {  // the two halves added at F bits of the larger exponent, each floored
    ed = emh[0] > emh[1] ? emh[0] : emh[1];
    // (an all-zero half, kAllZero: its 0 scaled by 2^-1022 at least, as the reference)
    D = floor(Dh[0] * qtensor::acc_pow2(std::max(emh[0] - ed, -1022))) +
        floor(Dh[1] * qtensor::acc_pow2(std::max(emh[1] - ed, -1022)));
  }
  bool pbad = !isfinite(p);
  if (pbad && fp8) {  // an inf/NaN partial (aligned at -1) 25 or more binades below is dropped
    const int em = ed > -1 ? ed : -1;
    pbad = !(-1 < em - F - 1);
  }
  if (nan || pos || neg || pbad) {  // the IEEE result of the terms that count
    const double q = pbad ? p : 0.0;
    nan |= isnan(q);
    pos |= q == (double)INFINITY;
    neg |= q == -(double)INFINITY;
    return (nan || (pos && neg)) ? (double)NAN : (pos ? (double)INFINITY : -(double)INFINITY);
  }
  return second_stage(D, ed, isfinite(p) ? p : 0.0, F, fp8);
}

// Lane-wise helpers of the vector loops (bit casts the vectorizer takes).
QT_HD double pow2v(int64_t e) { return __builtin_bit_cast(double, (e + 1023) << 52); }
QT_HD int64_t dexpv(double x) {  // dexp of a finite nonzero double
  const int64_t e = (int64_t)((__builtin_bit_cast(uint64_t, x) >> 52) & 0x7ff) - 1023;
  return e < -126 ? -126 : e;
}
QT_HD bool finitev(double x) {
  return (__builtin_bit_cast(uint64_t, x) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

// The largest exponent ea[r][k] + eb[k][j] of each fused set of one chunk of n products, for
// R rows of a (exponents ea from the chunk's first k, rows lda apart) and a panel of P columns
// (ebk: (n, P)), in lane r * P + j: em0 (FP8: the even k; em1 the odd k, else it stays at the
// start value 2 * kAccZeroExp). A zero product's exponent is about kAccZeroExp: an all-zero set
// stays below kAccZeroExp / 2. The first step of both chains (chain_lanes, chain_fast).
template <int R, int P, bool FP8>
inline void fused_set_emax(const int* ea, int64_t lda, const int* ebk, int64_t n, int* em0,
                           int* em1) {
  for (int j = 0; j < R * P; ++j) em0[j] = em1[j] = 2 * qtensor::kAccZeroExp;
  for (int64_t k = 0; k < n; ++k) {
    const int* f = ebk + k * P;
    int* em = FP8 && (k & 1) ? em1 : em0;
    for (int r = 0; r < R; ++r) {
      const int e = ea[r * lda + k];
#pragma omp simd
      for (int j = 0; j < P; ++j)
        em[r * P + j] = e + f[j] > em[r * P + j] ? e + f[j] : em[r * P + j];
    }
  }
}

// The chains of R rows of a (each K doubles, exponents ea, rows lda apart) against a panel of
// P columns (b: (K, P), exponents eb), from the partials p (R * P of them, row-major: c's or
// 0) to the outputs out (R * P floats). The R * P lanes are independent chains: their second
// stages (a long dependent sequence per chunk) overlap. The lanes' loops are second_stage and
// step_general's finite case written lane-wise.
// A promotion: the last instruction's output (the double lanes' p, or the float32 chains') added
// into the FP32 accumulator by a float32 add, and the chain restarted from zero.
template <int L, typename PT>
inline void promote_chain(float* acc, PT* p) {
  for (int j = 0; j < L; ++j) {
    acc[j] = acc[j] + (float)p[j];
    p[j] = PT(0);
  }
}

// A chain's outputs: the FP32 accumulator where it promoted, else the last instruction's output
// (the double lanes' p, or the float32 chains'), NaN as the canonical quiet NaN.
template <int L, typename PT>
inline void store_chain_out(const float* acc, const PT* p, bool promoted, float* out) {
  for (int j = 0; j < L; ++j) {
    const float o = promoted ? acc[j] : (float)p[j];
    out[j] = isnan(o) ? qtensor::u2f(qtensor::F32::QNAN) : o;
  }
}

template <int R, int P, bool FP8>
void chain_lanes(const double* a, const int* ea, int64_t lda, const double* b, const int* eb,
                 int64_t K, int chunk, int F, int promote, double* p, float* out) {
  constexpr int L = R * P;
  float acc[L];
  for (int j = 0; j < L; ++j) acc[j] = 0.0f;
  // a lane's chunk takes step_general from this exponent on: an inf/NaN operand (kAccBadExp)
  // in a product; cdna3 also a product exponent of 127 or more (the product may reach 2^128)
  const int lim = FP8 ? qtensor::kAccBadExp / 2 : 127;
  int c = 0;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t n = K - k0 < chunk ? K - k0 : chunk;
    const double* bk = b + k0 * P;
    const int* ebk = eb + k0 * P;
    // each fused set's largest exponent (zero products at about kAccZeroExp: below -50000)
    int em0[L], em1[L];
    fused_set_emax<R, P, FP8>(ea + k0, lda, ebk, n, em0, em1);
    double sc0[L], sc1[L], D0[L], D1[L];
    int64_t ed0[L], ed1[L];
    int slow = 0;
#pragma omp simd reduction(| : slow)
    for (int j = 0; j < L; ++j) {
      const int em = em0[j] > em1[j] ? em0[j] : em1[j];
      slow |= em >= lim || !finitev(p[j]);
      ed0[j] = em0[j] < qtensor::kAccZeroExp / 2 ? kAllZero : em0[j];
      ed1[j] = em1[j] < qtensor::kAccZeroExp / 2 ? kAllZero : em1[j];
      sc0[j] = pow2v(F - ed0[j]);
      sc1[j] = pow2v(F - ed1[j]);
      D0[j] = D1[j] = 0.0;
    }
    // the truncated sums: (a * b) * 2^(F - e), to an integer toward zero (zero products add 0)
    for (int64_t k = 0; k < n; ++k) {
      const double* y = bk + k * P;
      double* D = FP8 && (k & 1) ? D1 : D0;
      const double* sc = FP8 && (k & 1) ? sc1 : sc0;
      for (int r = 0; r < R; ++r) {
        const double x = a[r * lda + k0 + k];
#pragma omp simd
        for (int j = 0; j < P; ++j) D[r * P + j] += trunc(x * y[j] * sc[r * P + j]);
      }
    }
    double np[L];
#pragma omp simd
    for (int j = 0; j < L; ++j) {  // second_stage, lane-wise
      int64_t ed = ed0[j];
      double D = D0[j];
      if (FP8) {  // the two halves added at F bits of the larger exponent, each floored
        ed = ed0[j] > ed1[j] ? ed0[j] : ed1[j];
        const int64_t s0 = ed0[j] - ed < -1022 ? -1022 : ed0[j] - ed;  // an all-zero half: 0
        const int64_t s1 = ed1[j] - ed < -1022 ? -1022 : ed1[j] - ed;
        D = floor(D0[j] * pow2v(s0)) + floor(D1[j] * pow2v(s1));
      }
      const double pj = finitev(p[j]) ? p[j] : 0.0;
      const int64_t ec = pj == 0.0 ? -126 : dexpv(pj);
      const int64_t em = ed > ec ? ed : ec;
      const double sd = floor(D * pow2v(ed - F) * pow2v(kF2 + 1 - em));
      double sc = floor(pj * pow2v(F - em));
      if (FP8) sc = ec < em - F - 1 ? 0.0 : sc;
      const double v = sd * pow2v(em - kF2 - 1) + sc * pow2v(em - F);
      const int64_t ev = v == 0.0 ? 0 : dexpv(v);
      const double r = floor(v * pow2v(kF2 - ev)) * pow2v(ev - kF2);
      np[j] = (double)(float)r;  // to nearest FP32 (inf from 2^128; a negative underflow: -0)
    }
    if (slow)
      for (int j = 0; j < L; ++j)
        if ((em0[j] > em1[j] ? em0[j] : em1[j]) >= lim || !isfinite(p[j])) {
          const int64_t row = j / P * lda + k0, col = j % P;
          np[j] = step_general(a + row, bk + col, P, ea + row, ebk + col, n, p[j], F, FP8);
        }
    for (int j = 0; j < L; ++j) p[j] = np[j];
    if (promote > 0 && (++c == promote || k0 + n == K)) {  // a float32 add into the accumulator
      promote_chain<L>(acc, p);
      c = 0;
    }
  }
  store_chain_out<L>(acc, p, promote > 0 && K > 0, out);
}

template <int R, int P>
void chain_panel(const double* a, const int* ea, int64_t lda, const double* b, const int* eb,
                 int64_t K, int chunk, int F, bool fp8, int promote, double* p, float* out) {
  (fp8 ? chain_lanes<R, P, true> : chain_lanes<R, P, false>)(a, ea, lda, b, eb, K, chunk, F,
                                                               promote, p, out);
}

// The float32/int32 chains, where accum_cdna3.cpp's fast_decode accepts every operand (zero, or
// finite and normal with at most 12 significant bits, exponent and clamp in [-kFastExp,
// kFastExp]), c is finite and chunk * 2^(F + 2) < 2^31: every product a * b is exact and normal
// in float32 and its truncated term trunc(a * b * 2^(F - emax)) (below 2^(F + 2): the product is
// below 2^(et + 2)) is a float32 multiply by an exact power of two and a float32-to-int32
// conversion (toward zero), summed in int32, on float32/int32 lanes (P = 16 columns: one
// AVX-512 vector), as qtensor::accum_matmul's fast path. The second stage is second_stage's,
// regrouped, each step exact: the exponents (ec, em, the scales' powers of two) in int32 lanes,
// the two floored terms in doubles; their sum V = sd + sc * 2^(32 - F) (v in units of
// 2^(em - 32)) is an integer below 2^39, its floor to 32 bits is the double's 21 low bits
// cleared (a negative V's magnitude rounded up first), then scaled by 2^(em - 32) and rounded
// to FP32. The partials are float32 values. The model's clamp of e(v) at -126 binds only where
// em < -94 (v >= 2^(em - 32) where V != 0); such a lane, like one with an inf/NaN partial, is
// redone by step_general.
constexpr int kFastExp = 40;

QT_HD double fpow2(int e) {  // 2^e for e in float32's normal range, through a float32
  return (double)__builtin_bit_cast(float, (e + 127) << 23);
}

template <int R, int P, bool FP8>
void chain_fast(const float* a, const int* ea, int64_t lda, const float* b, const int* eb,
                int64_t K, int chunk, int F, int promote, float* p, float* out) {
  constexpr int L = R * P;
  float acc[L];
  for (int j = 0; j < L; ++j) acc[j] = 0.0f;
  const double k1 = qtensor::acc_pow2(kF2 + 1 - F);
  constexpr uint64_t kLow21 = (1ull << 21) - 1;
  int c = 0;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t n = K - k0 < chunk ? K - k0 : chunk;
    const float* bk = b + k0 * P;
    const int* ebk = eb + k0 * P;
    int em0[L], em1[L];  // each fused set's largest exponent (zero products: below -50000)
    fused_set_emax<R, P, FP8>(ea + k0, lda, ebk, n, em0, em1);
    float sc0[L], sc1[L];
    int D0[L], D1[L];
#pragma omp simd
    for (int j = 0; j < L; ++j) {  // 2^(F - e) (an all-zero set: 2^127, its terms are 0)
      em0[j] = em0[j] < qtensor::kAccZeroExp / 2 ? kAllZero : em0[j];
      em1[j] = em1[j] < qtensor::kAccZeroExp / 2 ? kAllZero : em1[j];
      const int s0 = F - em0[j] > 127 ? 127 : F - em0[j], s1 = F - em1[j] > 127 ? 127 : F - em1[j];
      sc0[j] = __builtin_bit_cast(float, (s0 + 127) << 23);
      sc1[j] = __builtin_bit_cast(float, (s1 + 127) << 23);
      D0[j] = D1[j] = 0;
    }
    for (int64_t k = 0; k < n; ++k) {  // the truncated terms (exact products, exact scaling)
      const float* y = bk + k * P;
      int* D = FP8 && (k & 1) ? D1 : D0;
      const float* sc = FP8 && (k & 1) ? sc1 : sc0;
      for (int r = 0; r < R; ++r) {
        const float x = a[r * lda + k0 + k];
#pragma omp simd
        for (int j = 0; j < P; ++j) D[r * P + j] += (int)(x * y[j] * sc[r * P + j]);
      }
    }
    float np[L];
    int slow = 0;
#pragma omp simd reduction(| : slow)
    for (int j = 0; j < L; ++j) {
      int ed = em0[j], Di = D0[j];
      if (FP8) {  // the two halves added at F bits of the larger exponent, each floored
        ed = em0[j] > em1[j] ? em0[j] : em1[j];
        const int d0 = ed - em0[j] > 31 ? 31 : ed - em0[j], d1 = ed - em1[j] > 31 ? 31 : ed - em1[j];
        Di = (D0[j] >> d0) + (D1[j] >> d1);
      }
      // the exponents in int32 lanes: ec (a zero or subnormal partial: -126), em, the scales
      const int pb = (int)(__builtin_bit_cast(uint32_t, p[j]) >> 23) & 0xff;
      const int ec = (pb > 1 ? pb : 1) - 127, em = ed > ec ? ed : ec;
      slow |= (pb == 255) | (em < -94);  // an inf/NaN partial; the -126 clamp of e(v)
      const int x = ed - em + kF2 + 1 - F;  // D's scale: 2^x (x <= -31: 0 or -1 either way)
      const double sdx = fpow2(x < -100 ? -100 : x), scx = fpow2(F - em), vx = fpow2(em - kF2 - 1);
      const double sd = floor((double)Di * sdx);    // at 2^(em - 32)
      double sc = floor((double)p[j] * scx);        // at 2^(em - F)
      if (FP8) sc = ec < em - F - 1 ? 0.0 : sc;
      const double V = sd + sc * k1;  // v in units of 2^(em - 32): an integer below 2^39
      // its floor to 32 bits: the double's 21 low bits cleared (a negative V: its magnitude
      // rounded up first)
      const uint64_t vb = __builtin_bit_cast(uint64_t, V);
      const uint64_t fb = (vb + (V < 0.0 ? kLow21 : 0)) & ~kLow21;
      np[j] = (float)(__builtin_bit_cast(double, fb) * vx);  // to nearest FP32 (inf from 2^128)
    }
    if (slow)
      for (int j = 0; j < L; ++j) {
        const int ed = FP8 && em1[j] > em0[j] ? em1[j] : em0[j];
        const int pb = (int)(__builtin_bit_cast(uint32_t, p[j]) >> 23) & 0xff;
        const int ec = (pb > 1 ? pb : 1) - 127;
        if (pb == 255 || (ed > ec ? ed : ec) < -94) {
          const int64_t row = j / P * lda + k0, col = j % P;
          np[j] = (float)step_general(a + row, bk + col, P, ea + row, ebk + col, n, p[j], F, FP8);
        }
      }
    for (int j = 0; j < L; ++j) p[j] = np[j];
    if (promote > 0 && (++c == promote || k0 + n == K)) {  // a float32 add into the accumulator
      promote_chain<L>(acc, p);
      c = 0;
    }
  }
  store_chain_out<L>(acc, p, promote > 0 && K > 0, out);
}

template <int R, int P>
void chain_fast_panel(const float* a, const int* ea, int64_t lda, const float* b, const int* eb,
                      int64_t K, int chunk, int F, bool fp8, int promote, float* p, float* out) {
  (fp8 ? chain_fast<R, P, true> : chain_fast<R, P, false>)(a, ea, lda, b, eb, K, chunk, F,
                                                           promote, p, out);
}
