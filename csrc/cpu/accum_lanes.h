// The vectorized CPU path of qtensor::accum_matmul (group == 1), included by csrc/cpu/accum.cpp
// inside a namespace, once for the baseline and under `#pragma GCC target("avx2")` and
// ("avx512...") with QT_ACCUM_AVX2 defined. No #include here: accum.cpp includes everything first.
//
// W output columns at once, one per SIMD lane: the same arithmetic as qtensor::acc_chunk and
// qtensor::acc_dot, lane by lane. Every step is exact, so the bits are the same as theirs; the
// lanes are independent outputs, so no sum is reordered across them.

// The two loops over a chunk's K-elements. em[w] = max(em[w], ea[k] + eb[k][w]);
// S[w] = sum_k round(a[k] * b[k][w] * sc[w]) (integers below 2^53: exact in any order).
#ifdef QT_ACCUM_AVX2
inline void chunk_emax(const int* ea, const int* eb, int64_t ldb, int64_t k0, int64_t k1,
                       int* em) {
  __m256i m = _mm256_loadu_si256((const __m256i*)em);
  for (int64_t k = k0; k < k1; ++k)
    m = _mm256_max_epi32(m, _mm256_add_epi32(_mm256_set1_epi32(ea[k]),
                                             _mm256_loadu_si256((const __m256i*)(eb + k * ldb))));
  _mm256_storeu_si256((__m256i*)em, m);
}

template <int MODE>
inline void chunk_sum(const float* a, const float* b, int64_t ldb, int64_t k0, int64_t k1,
                      const double* sc, double* S) {
  constexpr int R = (MODE == 0 ? _MM_FROUND_TO_ZERO
                     : (MODE == 1 ? _MM_FROUND_TO_NEG_INF : _MM_FROUND_TO_NEAREST_INT)) |
                    _MM_FROUND_NO_EXC;
  const __m256d sc0 = _mm256_loadu_pd(sc), sc1 = _mm256_loadu_pd(sc + 4);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (int64_t k = k0; k < k1; ++k) {
    const __m256d av = _mm256_set1_pd((double)a[k]);
    const __m256 bv = _mm256_loadu_ps(b + k * ldb);
    const __m256d b0 = _mm256_cvtps_pd(_mm256_castps256_ps128(bv));
    const __m256d b1 = _mm256_cvtps_pd(_mm256_extractf128_ps(bv, 1));
    s0 = _mm256_add_pd(s0, _mm256_round_pd(_mm256_mul_pd(_mm256_mul_pd(av, b0), sc0), R));
    s1 = _mm256_add_pd(s1, _mm256_round_pd(_mm256_mul_pd(_mm256_mul_pd(av, b1), sc1), R));
  }
  _mm256_storeu_pd(S, s0);
  _mm256_storeu_pd(S + 4, s1);
}
#else
inline void chunk_emax(const int* ea, const int* eb, int64_t ldb, int64_t k0, int64_t k1,
                       int* em) {
  for (int64_t k = k0; k < k1; ++k)
    for (int w = 0; w < W; ++w) em[w] = std::max(em[w], ea[k] + eb[k * ldb + w]);
}

template <int MODE>
inline void chunk_sum(const float* a, const float* b, int64_t ldb, int64_t k0, int64_t k1,
                      const double* sc, double* S) {
  for (int w = 0; w < W; ++w) S[w] = 0.0;
  for (int64_t k = k0; k < k1; ++k)
    for (int w = 0; w < W; ++w)
      S[w] += qtensor::acc_round_int((double)a[k] * (double)b[k * ldb + w] * sc[w], MODE);
}
#endif

// out[0:W] = a[0:K] (a row, exponents ea) times W columns of b (row stride ldb, exponents eb)
#ifdef QT_ACCUM_AVX2
// All per-chunk bookkeeping in registers: 2 x 4 double lanes (p, S, scales), 8 int32 exponents.
inline __m256i pow2_bits(__m128i e) {  // 2^e for 4 int32 exponents (as double bit patterns)
  return _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(e), _mm256_set1_epi64x(1023)),
                           52);
}
inline __m256d pow2_pd(__m128i e) { return _mm256_castsi256_pd(pow2_bits(e)); }
inline __m128i low32(__m256i x) {  // the low 32 bits of 4 int64 lanes
  return _mm256_castsi256_si128(
      _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)));
}
inline __m128i exp_pd(__m256d v) {  // floor(log2|v|) of normal doubles (zero: -1023)
  const __m256i b = _mm256_and_si256(_mm256_srli_epi64(_mm256_castpd_si256(v), 52),
                                     _mm256_set1_epi64x(0x7ff));
  return _mm_sub_epi32(low32(b), _mm_set1_epi32(1023));
}
template <int MODE>
inline __m256d round_pd(__m256d x) {
  return _mm256_round_pd(x, (MODE == 0 ? _MM_FROUND_TO_ZERO
                             : (MODE == 1 ? _MM_FROUND_TO_NEG_INF : _MM_FROUND_TO_NEAREST_INT)) |
                                _MM_FROUND_NO_EXC);
}
// p's alignment exponent: max(e(p), -126), or kAccZeroExp for p == 0
inline __m128i p_exp(__m256d p) {
  const __m128i zero =
      low32(_mm256_castpd_si256(_mm256_cmp_pd(p, _mm256_setzero_pd(), _CMP_EQ_OQ)));
  const __m128i e = _mm_max_epi32(exp_pd(p), _mm_set1_epi32(qtensor::kAccExpMin));
  return _mm_blendv_epi8(e, _mm_set1_epi32(qtensor::kAccZeroExp), zero);
}
// the new partial of 4 lanes from S (the products' sum), em, the scales and p (acc_finish)
template <int MODE>
inline __m256d finish4(__m256d S, __m128i em, __m256d sc, __m256d p,
                       const qtensor::AccumSpec& s) {
  if (s.acc_in_alignment) S = _mm256_add_pd(S, round_pd<MODE>(_mm256_mul_pd(p, sc)));
  const __m256d v = _mm256_mul_pd(S, pow2_pd(_mm_sub_epi32(em, _mm_set1_epi32(s.frac_bits))));
  const __m128i e = _mm_max_epi32(exp_pd(v), _mm_set1_epi32(qtensor::kAccExpMin));
  const __m128i man = _mm_set1_epi32(s.acc_man);
  __m256d y = _mm256_mul_pd(v, pow2_pd(_mm_sub_epi32(man, e)));
  y = s.acc_round == 0 ? round_pd<0>(y) : round_pd<2>(y);
  __m256d r = _mm256_add_pd(_mm256_mul_pd(y, pow2_pd(_mm_sub_epi32(e, man))),
                            _mm256_setzero_pd());  // + 0: a zero result is +0
  const __m256d sign = _mm256_and_pd(r, _mm256_set1_pd(-0.0));
  const __m256d big = _mm256_cmp_pd(_mm256_andnot_pd(_mm256_set1_pd(-0.0), r),
                                    _mm256_set1_pd(0x1p128), _CMP_GE_OQ);
  r = _mm256_blendv_pd(r, _mm256_or_pd(sign, _mm256_set1_pd(INFINITY)), big);
  if (!s.acc_in_alignment)
    r = _mm256_cvtps_pd(_mm_add_ps(_mm256_cvtpd_ps(p), _mm256_cvtpd_ps(r)));
  return r;
}
inline int nonfinite_mask(__m256d x) {  // lanes that are inf or NaN
  const __m256d ax = _mm256_andnot_pd(_mm256_set1_pd(-0.0), x);
  return _mm256_movemask_pd(_mm256_cmp_pd(ax, _mm256_set1_pd(INFINITY), _CMP_NLT_UQ));
}

template <int MODE>
void dot_lanes(const float* a, const int* ea, const float* b, const int* eb, int64_t ldb,
               int64_t K, const qtensor::AccumSpec& s, float* out) {
  using namespace qtensor;
  __m256d p0 = _mm256_setzero_pd(), p1 = _mm256_setzero_pd();
  __m256 acc = _mm256_setzero_ps();
  alignas(32) int em[W];
  alignas(32) double sc[W], S[W], pn[W];
  int c = 0;
  for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
    const int64_t n = K - k0 < s.chunk ? K - k0 : s.chunk;
    __m128i e0 = _mm_set1_epi32(kAccZeroExp), e1 = e0;
    if (s.acc_in_alignment) { e0 = p_exp(p0); e1 = p_exp(p1); }
    _mm_store_si128((__m128i*)em, e0);
    _mm_store_si128((__m128i*)(em + 4), e1);
    chunk_emax(ea, eb, ldb, k0, k0 + n, em);
    // all-zero and non-finite lanes: any scale will do (they are handled apart)
    __m256i m = _mm256_load_si256((const __m256i*)em);
    const __m256i out_of_range = _mm256_or_si256(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(kAccZeroExp / 2), m),
        _mm256_cmpgt_epi32(m, _mm256_set1_epi32(kAccBadExp / 2)));
    m = _mm256_andnot_si256(out_of_range, m);
    e0 = _mm256_castsi256_si128(m);
    e1 = _mm256_extracti128_si256(m, 1);
    const __m128i F = _mm_set1_epi32(s.frac_bits);
    const __m256d sc0 = pow2_pd(_mm_sub_epi32(F, e0)), sc1 = pow2_pd(_mm_sub_epi32(F, e1));
    _mm256_store_pd(sc, sc0);
    _mm256_store_pd(sc + 4, sc1);
    chunk_sum<MODE>(a, b, ldb, k0, k0 + n, sc, S);
    const __m256d S0 = _mm256_load_pd(S), S1 = _mm256_load_pd(S + 4);
    const int bad = nonfinite_mask(S0) | nonfinite_mask(p0) | (nonfinite_mask(S1) << 4) |
                    (nonfinite_mask(p1) << 4);
    const __m256d n0 = finish4<MODE>(S0, e0, sc0, p0, s);
    const __m256d n1 = finish4<MODE>(S1, e1, sc1, p1, s);
    if (bad) {  // rare: the IEEE result of the lanes with a NaN or inf
      _mm256_store_pd(pn, p0);
      _mm256_store_pd(pn + 4, p1);
      alignas(32) double q[W];
      _mm256_store_pd(q, n0);
      _mm256_store_pd(q + 4, n1);
      for (int w = 0; w < W; ++w)
        if (bad >> w & 1) q[w] = acc_nonfinite(a + k0, b + k0 * ldb + w, ldb, n, pn[w]);
      p0 = _mm256_load_pd(q);
      p1 = _mm256_load_pd(q + 4);
    } else {
      p0 = n0;
      p1 = n1;
    }
    if (s.promote > 0 && (++c == s.promote || k0 + n == K)) {
      acc = _mm256_add_ps(acc, _mm256_set_m128(_mm256_cvtpd_ps(p1), _mm256_cvtpd_ps(p0)));
      p0 = p1 = _mm256_setzero_pd();
      c = 0;
    }
  }
  const __m256 o = s.promote > 0 ? acc
                                 : _mm256_set_m128(_mm256_cvtpd_ps(p1), _mm256_cvtpd_ps(p0));
  const __m256 nan = _mm256_cmp_ps(o, o, _CMP_UNORD_Q);
  const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32((int)qtensor::F32::QNAN));
  _mm256_storeu_ps(out, _mm256_blendv_ps(o, qnan, nan));
}
#else
template <int MODE>
void dot_lanes(const float* a, const int* ea, const float* b, const int* eb, int64_t ldb,
               int64_t K, const qtensor::AccumSpec& s, float* out) {
  using namespace qtensor;
  double p[W], sc[W], S[W];
  float acc[W];
  int em[W];
  for (int w = 0; w < W; ++w) { p[w] = 0.0; acc[w] = 0.0f; }
  int c = 0;
  for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
    const int64_t n = K - k0 < s.chunk ? K - k0 : s.chunk;
    for (int w = 0; w < W; ++w) {  // p's alignment exponent (clamped at -126), or none
      const double pt = s.acc_in_alignment ? p[w] : 0.0;
      const int e = pt == 0.0 ? kAccZeroExp : acc_exp_f64(pt);
      em[w] = pt != 0.0 && e < kAccExpMin ? kAccExpMin : e;
    }
    chunk_emax(ea, eb, ldb, k0, k0 + n, em);
    for (int w = 0; w < W; ++w) {  // all-zero and non-finite lanes: any scale will do
      em[w] = em[w] < kAccZeroExp / 2 || em[w] > kAccBadExp / 2 ? 0 : em[w];
      sc[w] = acc_pow2(s.frac_bits - em[w]);
    }
    chunk_sum<MODE>(a, b, ldb, k0, k0 + n, sc, S);
    for (int w = 0; w < W; ++w) {
      // a NaN or inf operand makes its product (inf * 0 included) and so S non-finite
      if (!std::isfinite(p[w]) || !std::isfinite(S[w])) {
        p[w] = acc_nonfinite(a + k0, b + k0 * ldb + w, ldb, n, p[w]);
        continue;
      }
      const double pt = s.acc_in_alignment ? p[w] : 0.0;
      p[w] = acc_finish(S[w] + acc_round_int(pt * sc[w], MODE), em[w], p[w], s);
    }
    if (s.promote > 0 && (++c == s.promote || k0 + n == K)) {
      for (int w = 0; w < W; ++w) { acc[w] = acc[w] + (float)p[w]; p[w] = 0.0; }
      c = 0;
    }
  }
  for (int w = 0; w < W; ++w) {
    const float o = s.promote > 0 ? acc[w] : (float)p[w];
    out[w] = std::isnan(o) ? qtensor::u2f(qtensor::F32::QNAN) : o;
  }
}

#endif

// Rows [i0, i1) of one batch: a (M, K); b in panels of W columns, each (K, W) contiguous.
inline void rows(const float* a, const int* ea, const float* b, const int* eb, int64_t K,
                 int64_t N, int64_t i0, int64_t i1, const qtensor::AccumSpec& s, float* out) {
  float tmp[W];
  for (int64_t j = 0; j < N; j += W) {
    const float* bj = b + j * K;  // the panel of columns j .. j + W - 1
    const int* ebj = eb + j * K;
    for (int64_t i = i0; i < i1; ++i) {
      const float* ai = a + i * K;
      const int* eai = ea + i * K;
      switch (s.align_round) {
        case 0: dot_lanes<0>(ai, eai, bj, ebj, W, K, s, tmp); break;
        case 1: dot_lanes<1>(ai, eai, bj, ebj, W, K, s, tmp); break;
        default: dot_lanes<2>(ai, eai, bj, ebj, W, K, s, tmp); break;
      }
      for (int64_t w = 0; w < W && j + w < N; ++w) out[i * N + j + w] = tmp[w];
    }
  }
}
