// The vectorized CPU path of qtensor::accum_matmul (group == 1), included by csrc/cpu/accum.cpp
// inside a namespace, once for the baseline and once under `#pragma GCC target("avx2")` with
// QT_ACCUM_AVX2 defined. No #include here: accum.cpp includes everything first.
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
    out[w] = std::isnan(o) ? qtensor::u2f(0x7fc00000u) : o;
  }
}

// Rows [i0, i1) of one batch: a (M, K), b (K, ldb) padded to a multiple of W columns, out (M, N).
inline void rows(const float* a, const int* ea, const float* b, const int* eb, int64_t ldb,
                 int64_t K, int64_t N, int64_t i0, int64_t i1, const qtensor::AccumSpec& s,
                 float* out) {
  float tmp[W];
  for (int64_t j = 0; j < N; j += W)
    for (int64_t i = i0; i < i1; ++i) {
      const float* ai = a + i * K;
      const int* eai = ea + i * K;
      switch (s.align_round) {
        case 0: dot_lanes<0>(ai, eai, b + j, eb + j, ldb, K, s, tmp); break;
        case 1: dot_lanes<1>(ai, eai, b + j, eb + j, ldb, K, s, tmp); break;
        default: dot_lanes<2>(ai, eai, b + j, eb + j, ldb, K, s, tmp); break;
      }
      for (int64_t w = 0; w < W && j + w < N; ++w) out[i * N + j + w] = tmp[w];
    }
}
