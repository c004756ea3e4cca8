// The vectorized CPU paths of qtensor::accum_matmul in double lanes, included by
// csrc/cpu/accum.cpp inside a namespace, once for the baseline and under `#pragma GCC
// target("avx2")` and ("avx512...") with QT_ACCUM_AVX2 defined. No #include here: accum.cpp
// includes everything first.
//
// W output columns at once, one per SIMD lane: the same arithmetic as qtensor::acc_chunk and
// qtensor::acc_dot, lane by lane. Every step is exact, so the bits are the same as theirs; the
// lanes are independent outputs, so no sum is reordered across them. group == 1: dot_lanes (one
// row, W columns). Groups: rows_groups, whose tiles sum the groups of V rows by two vectors of
// columns in double (each output's products in k order, as acc_chunk), then the same per-chunk
// finish (Lanes) as dot_lanes.

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

// The running state of W outputs (acc_dot's partial p, FP32 accumulator, chunks since the last
// promotion) and its per-chunk steps, shared by dot_lanes and group_chunk.
struct Lanes {
  __m256d p0, p1;
  __m256 acc;
  int c = 0;

  // user-provided, so that it is compiled for this unit's target (an implicit one is not)
  Lanes() : p0(_mm256_setzero_pd()), p1(_mm256_setzero_pd()), acc(_mm256_setzero_ps()) {}

  // p's alignment exponents where p is a term of the alignment, else kAccZeroExp
  void p_exps(const qtensor::AccumSpec& s, __m128i* e0, __m128i* e1) const {
    *e0 = *e1 = _mm_set1_epi32(qtensor::kAccZeroExp);
    if (s.acc_in_alignment) { *e0 = p_exp(p0); *e1 = p_exp(p1); }
  }

  // The chunk's new partials from S (its terms' sum, p's excluded), emax e and the scales sc.
  // Lanes with a non-finite S or p take the IEEE result of the chunk's operands: a[0:n] and
  // b[0:n] (row stride ldb, lane w at column w). last: the chunk ends K.
  template <int MODE>
  void finish_chunk(__m256d S0, __m256d S1, __m128i e0, __m128i e1, __m256d sc0, __m256d sc1,
                    const float* a, const float* b, int64_t ldb, int64_t n, bool last,
                    const qtensor::AccumSpec& s) {
    const int bad = nonfinite_mask(S0) | nonfinite_mask(p0) | (nonfinite_mask(S1) << 4) |
                    (nonfinite_mask(p1) << 4);
    const __m256d n0 = finish4<MODE>(S0, e0, sc0, p0, s);
    const __m256d n1 = finish4<MODE>(S1, e1, sc1, p1, s);
    if (bad) {  // rare: the IEEE result of the lanes with a NaN or inf
      alignas(32) double pn[W], q[W];
      _mm256_store_pd(pn, p0);
      _mm256_store_pd(pn + 4, p1);
      _mm256_store_pd(q, n0);
      _mm256_store_pd(q + 4, n1);
      for (int w = 0; w < W; ++w)
        if (bad >> w & 1) q[w] = qtensor::acc_nonfinite(a, b + w, ldb, n, pn[w]);
      p0 = _mm256_load_pd(q);
      p1 = _mm256_load_pd(q + 4);
    } else {
      p0 = n0;
      p1 = n1;
    }
    if (s.promote > 0 && (++c == s.promote || last)) {
      acc = _mm256_add_ps(acc, _mm256_set_m128(_mm256_cvtpd_ps(p1), _mm256_cvtpd_ps(p0)));
      p0 = p1 = _mm256_setzero_pd();
      c = 0;
    }
  }

  void store(float* out, const qtensor::AccumSpec& s) const {
    const __m256 o = s.promote > 0 ? acc
                                   : _mm256_set_m128(_mm256_cvtpd_ps(p1), _mm256_cvtpd_ps(p0));
    const __m256 nan = _mm256_cmp_ps(o, o, _CMP_UNORD_Q);
    const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32((int)qtensor::F32::QNAN));
    _mm256_storeu_ps(out, _mm256_blendv_ps(o, qnan, nan));
  }
};

template <int MODE>
void dot_lanes(const float* a, const int* ea, const float* b, const int* eb, int64_t ldb,
               int64_t K, const qtensor::AccumSpec& s, float* out) {
  using namespace qtensor;
  Lanes L;
  alignas(32) int em[W];
  alignas(32) double sc[W], S[W];
  for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
    const int64_t n = K - k0 < s.chunk ? K - k0 : s.chunk;
    __m128i e0, e1;
    L.p_exps(s, &e0, &e1);
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
    L.finish_chunk<MODE>(_mm256_load_pd(S), _mm256_load_pd(S + 4), e0, e1, sc0, sc1, a + k0,
                         b + k0 * ldb, ldb, n, k0 + n == K, s);
  }
  L.store(out, s);
}

// One chunk of W outputs of a group datapath from its group sums g[j * ldg + w], j < ng: emax over
// the groups (floor(log2|g|), unclamped) and p, the rounded scaled terms' sum, finish_chunk.
template <int MODE>
inline void group_chunk(const double* g, int64_t ldg, int64_t ng, Lanes& L, const float* a,
                        const float* b, int64_t ldb, int64_t n, bool last,
                        const qtensor::AccumSpec& s) {
  const __m256d mag = _mm256_castsi256_pd(_mm256_set1_epi64x(INT64_MAX));
  __m256d m0 = _mm256_setzero_pd(), m1 = m0;  // the largest |g|: its exponent is the groups'
  for (int64_t j = 0; j < ng; ++j) {
    m0 = _mm256_max_pd(m0, _mm256_and_pd(_mm256_loadu_pd(g + j * ldg), mag));
    m1 = _mm256_max_pd(m1, _mm256_and_pd(_mm256_loadu_pd(g + j * ldg + 4), mag));
  }
  __m128i e0, e1;
  L.p_exps(s, &e0, &e1);
  // a zero's exponent reads -1023 (a nonzero sum of float32 products is above 2^-299): where
  // all terms are zero any scale will do; inf or NaN (1024, or dropped by max) make S non-finite
  const __m128i zero = _mm_set1_epi32(-1022);
  e0 = _mm_max_epi32(e0, exp_pd(m0));
  e1 = _mm_max_epi32(e1, exp_pd(m1));
  e0 = _mm_andnot_si128(_mm_cmpgt_epi32(zero, e0), e0);
  e1 = _mm_andnot_si128(_mm_cmpgt_epi32(zero, e1), e1);
  const __m128i F = _mm_set1_epi32(s.frac_bits);
  const __m256d sc0 = pow2_pd(_mm_sub_epi32(F, e0)), sc1 = pow2_pd(_mm_sub_epi32(F, e1));
  __m256d S0 = _mm256_setzero_pd(), S1 = S0;
  for (int64_t j = 0; j < ng; ++j) {
    S0 = _mm256_add_pd(S0, round_pd<MODE>(_mm256_mul_pd(_mm256_loadu_pd(g + j * ldg), sc0)));
    S1 = _mm256_add_pd(S1, round_pd<MODE>(_mm256_mul_pd(_mm256_loadu_pd(g + j * ldg + 4), sc1)));
  }
  L.finish_chunk<MODE>(S0, S1, e0, e1, sc0, sc1, a, b, ldb, n, last, s);
}
#else
// The running state of W outputs (acc_dot's partial p, FP32 accumulator, chunks since the last
// promotion) and its per-chunk steps, shared by dot_lanes and group_chunk.
struct Lanes {
  double p[W] = {};
  float acc[W] = {};
  int c = 0;

  // p's alignment exponents (clamped at -126) where p is a term of the alignment, else
  // kAccZeroExp
  void p_exps(const qtensor::AccumSpec& s, int* em) const {
    for (int w = 0; w < W; ++w) {
      const double pt = s.acc_in_alignment ? p[w] : 0.0;
      const int e = pt == 0.0 ? qtensor::kAccZeroExp : qtensor::acc_exp_f64(pt);
      em[w] = pt != 0.0 && e < qtensor::kAccExpMin ? qtensor::kAccExpMin : e;
    }
  }

  // The chunk's new partials from S (its terms' sum, p's excluded), emax em and the scales sc.
  // Lanes with a non-finite S or p take the IEEE result of the chunk's operands: a[0:n] and
  // b[0:n] (row stride ldb, lane w at column w). last: the chunk ends K.
  template <int MODE>
  void finish_chunk(const double* S, const int* em, const double* sc, const float* a,
                    const float* b, int64_t ldb, int64_t n, bool last,
                    const qtensor::AccumSpec& s) {
    using namespace qtensor;
    for (int w = 0; w < W; ++w) {
      // a NaN or inf operand makes its product (inf * 0 included) and so S non-finite
      if (!std::isfinite(p[w]) || !std::isfinite(S[w])) {
        p[w] = acc_nonfinite(a, b + w, ldb, n, p[w]);
        continue;
      }
      const double pt = s.acc_in_alignment ? p[w] : 0.0;
      p[w] = acc_finish(S[w] + acc_round_int(pt * sc[w], MODE), em[w], p[w], s);
    }
    if (s.promote > 0 && (++c == s.promote || last)) {
      for (int w = 0; w < W; ++w) { acc[w] = acc[w] + (float)p[w]; p[w] = 0.0; }
      c = 0;
    }
  }

  void store(float* out, const qtensor::AccumSpec& s) const {
    for (int w = 0; w < W; ++w) {
      const float o = s.promote > 0 ? acc[w] : (float)p[w];
      out[w] = std::isnan(o) ? qtensor::u2f(qtensor::F32::QNAN) : o;
    }
  }
};

template <int MODE>
void dot_lanes(const float* a, const int* ea, const float* b, const int* eb, int64_t ldb,
               int64_t K, const qtensor::AccumSpec& s, float* out) {
  using namespace qtensor;
  Lanes L;
  double sc[W], S[W];
  int em[W];
  for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
    const int64_t n = K - k0 < s.chunk ? K - k0 : s.chunk;
    L.p_exps(s, em);
    chunk_emax(ea, eb, ldb, k0, k0 + n, em);
    for (int w = 0; w < W; ++w) {  // all-zero and non-finite lanes: any scale will do
      em[w] = em[w] < kAccZeroExp / 2 || em[w] > kAccBadExp / 2 ? 0 : em[w];
      sc[w] = acc_pow2(s.frac_bits - em[w]);
    }
    chunk_sum<MODE>(a, b, ldb, k0, k0 + n, sc, S);
    L.finish_chunk<MODE>(S, em, sc, a + k0, b + k0 * ldb, ldb, n, k0 + n == K, s);
  }
  L.store(out, s);
}

// One chunk of W outputs of a group datapath from its group sums g[j * ldg + w], j < ng: emax over
// the groups (floor(log2|g|), unclamped) and p, the rounded scaled terms' sum, finish_chunk.
template <int MODE>
inline void group_chunk(const double* g, int64_t ldg, int64_t ng, Lanes& L, const float* a,
                        const float* b, int64_t ldb, int64_t n, bool last,
                        const qtensor::AccumSpec& s) {
  using namespace qtensor;
  int em[W];
  double sc[W], S[W];
  L.p_exps(s, em);
  for (int w = 0; w < W; ++w) {
    for (int64_t j = 0; j < ng; ++j) {  // inf or NaN (1024) make S non-finite
      const double t = g[j * ldg + w];
      if (t != 0.0) em[w] = std::max(em[w], acc_exp_f64(t));
    }
    em[w] = em[w] < kAccZeroExp / 2 ? 0 : em[w];  // all terms zero: any scale will do
    sc[w] = acc_pow2(s.frac_bits - em[w]);
    S[w] = 0.0;
    for (int64_t j = 0; j < ng; ++j) S[w] += acc_round_int(g[j * ldg + w] * sc[w], MODE);
  }
  L.finish_chunk<MODE>(S, em, sc, a, b, ldb, n, last, s);
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

// Groups: tiles of V rows by C columns (V doubles per vector: 8 AVX-512, 4 AVX2, 2 baseline;
// accum.cpp picks V per ISA and lays out the operands for these tiles).
constexpr int group_rows(int V) { return V; }
constexpr int group_cols(int V) { return 2 * V > W ? 2 * V : W; }  // whole Lanes, two vectors
template <int V>
struct GroupTile {
  static constexpr int R = group_rows(V), C = group_cols(V);
  static constexpr int NV = C / V;  // vectors per row
};
template <int V>
struct DoubleVec {
  typedef double type __attribute__((vector_size(V * sizeof(double))));
};

template <int V>
inline typename DoubleVec<V>::type splat(double x) {
#ifdef QT_ACCUM_AVX2
  if constexpr (V == 8) return _mm512_set1_pd(x); else return _mm256_set1_pd(x);
#else
  typename DoubleVec<V>::type v;
  for (int i = 0; i < V; ++i) v[i] = x;
  return v;
#endif
}

// t + x * y; x * y is exact (a product of float32 values), so the fused form gives the same bits
template <int V>
inline typename DoubleVec<V>::type mul_add(typename DoubleVec<V>::type t,
                                           typename DoubleVec<V>::type x,
                                           typename DoubleVec<V>::type y) {
#ifdef QT_ACCUM_AVX2
  if constexpr (V == 8) return _mm512_fmadd_pd(x, y, t); else return t + x * y;
#else
  return t + x * y;
#endif
}

// The group sums of one chunk (n K-elements, groups of `group`) for a tile: a (R rows, stride
// lda), b (n rows of C). G[(r * ng + j) * C + c] = the products of group j of row r and column c
// added in k order in double, as acc_chunk does.
template <int V>
inline void group_sums(const double* a, int64_t lda, const double* b, int64_t n, int64_t group,
                       double* G) {
  using T = GroupTile<V>;
  using vd = typename DoubleVec<V>::type;
  const int64_t ng = (n + group - 1) / group;
  for (int64_t j = 0; j < ng; ++j) {
    const int64_t k0 = j * group, k1 = std::min(k0 + group, n);
    vd t[T::R][T::NV], bv[T::NV];
    for (int v = 0; v < T::NV; ++v) std::memcpy(&bv[v], b + k0 * T::C + v * V, sizeof(vd));
    for (int r = 0; r < T::R; ++r) {
      const vd av = splat<V>(a[r * lda + k0]);
      for (int v = 0; v < T::NV; ++v) t[r][v] = av * bv[v];
    }
    for (int64_t k = k0 + 1; k < k1; ++k) {
      for (int v = 0; v < T::NV; ++v) std::memcpy(&bv[v], b + k * T::C + v * V, sizeof(vd));
      for (int r = 0; r < T::R; ++r) {
        const vd av = splat<V>(a[r * lda + k]);
        for (int v = 0; v < T::NV; ++v) t[r][v] = mul_add<V>(t[r][v], av, bv[v]);
      }
    }
    for (int r = 0; r < T::R; ++r)
      for (int v = 0; v < T::NV; ++v)
        std::memcpy(G + (r * ng + j) * T::C + v * V, &t[r][v], sizeof(vd));
  }
}

template <int V, int MODE>
void rows_groups_mode(const double* ad, const double* bd, const float* a, const float* b,
                      int64_t K, int64_t N, int64_t i0, int64_t i1, const qtensor::AccumSpec& s,
                      float* out) {
  using T = GroupTile<V>;
  std::vector<double> G((size_t)T::R * (s.chunk / s.group) * T::C);
  float tmp[T::C];
  for (int64_t j0 = 0; j0 < N; j0 += T::C) {
    const double* bdj = bd + j0 * K;  // the panel of columns j0 .. j0 + C - 1
    const float* bj = b + j0 * K;
    Lanes L[T::R][T::C / W];
    for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
      const int64_t n = K - k0 < s.chunk ? K - k0 : s.chunk, ng = (n + s.group - 1) / s.group;
      group_sums<V>(ad + i0 * K + k0, K, bdj + k0 * T::C, n, s.group, G.data());
      for (int64_t r = 0; r < i1 - i0; ++r)
        for (int h = 0; h < T::C / W; ++h)
          group_chunk<MODE>(G.data() + r * ng * T::C + h * W, T::C, ng, L[r][h],
                            a + (i0 + r) * K + k0, bj + k0 * T::C + h * W, T::C, n, k0 + n == K,
                            s);
    }
    for (int64_t r = 0; r < i1 - i0; ++r) {
      for (int h = 0; h < T::C / W; ++h) L[r][h].store(tmp + h * W, s);
      for (int64_t c = 0; c < T::C && j0 + c < N; ++c) out[(i0 + r) * N + j0 + c] = tmp[c];
    }
  }
}

// Rows [i0, i1) (at most R) of one batch through a group datapath. ad: a (M, K) in double, its
// rows padded to whole tiles; bd: b in double, panels of C columns, each (K, C) contiguous; a
// and b: the same in float32 (b's panels likewise), for the chunks with a non-finite operand.
template <int V>
void rows_groups(const double* ad, const double* bd, const float* a, const float* b, int64_t K,
                 int64_t N, int64_t i0, int64_t i1, const qtensor::AccumSpec& s, float* out) {
  switch (s.align_round) {
    case 0: rows_groups_mode<V, 0>(ad, bd, a, b, K, N, i0, i1, s, out); break;
    case 1: rows_groups_mode<V, 1>(ad, bd, a, b, K, N, i0, i1, s, out); break;
    default: rows_groups_mode<V, 2>(ad, bd, a, b, K, N, i0, i1, s, out); break;
  }
}
