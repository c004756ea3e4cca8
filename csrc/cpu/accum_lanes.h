// The vectorized CPU paths of qtensor::accum_matmul in double lanes, included by
// csrc/cpu/accum.cpp inside a namespace, once for the baseline and under `#pragma GCC
// target("avx2,fma")` and ("avx512...") with QT_ACCUM_AVX2 defined. No #include here: accum.cpp
// includes everything first.
//
// W output columns at once, one per SIMD lane: the same arithmetic as qtensor::acc_chunk and
// qtensor::acc_dot, lane by lane. Every step is exact, so the bits are the same as theirs; the
// lanes are independent outputs, so no sum is reordered across them. group == 1: dot_lanes (one
// row, W columns). Groups: rows_groups, whose tiles sum the groups of V rows by two vectors of
// columns in double (each output's products in k order, as acc_chunk), then the same per-chunk
// finish (Lanes) as dot_lanes.
//
// dot_lanes is the path of operands the fast path refuses (full float32 significands: products
// exact in double only; wide exponent ranges; non-finite values). rows gives it 4 rows at once
// (AVX2/AVX-512): a row's chunks form one chain of dependent steps, latency-bound alone. The
// AVX-512 copy (accum.cpp defines QT_ACCUM_AVX512 for it) keeps the W lanes in one zmm (DV = 8)
// and sums a chunk's terms in int64 (cvt_roundpd_epi64, the alignment rounding embedded; an add
// of latency 1), the 4 rows' terms in one k-loop (chunk_sums: b converted once). On float32
// operands, one thread, Intel Xeon (AVX-512), 256x1024x256: hopper_bf16 0.37 -> ~0.175 ns/product, hopper_fp8
// 0.29 -> ~0.15-0.17 (the AVX2 copy unchanged: 0.38, 0.29); the emax loop and finish_chunk are
// still about half of it at chunk 16.

// With group exponents (ga, gb: Blackwell's block-scale exponents): lane w's emax over a chunk's
// ng groups, each at ga[j] + gb[j * ldg + w] unless its products are all zero (a zero group sum
// g[j * gs + w] is checked on the operands a[0:n], b (row stride ldb)), then at e_zero; pe: p's
// exponent (kAccZeroExp: none, or zero in the alignment).
inline int64_t group_emax_gexp(const double* g, int64_t gs, int64_t ng, int w, const int* ga,
                               const int* gb, int64_t ldg, const float* a, const float* b,
                               int64_t ldb, int64_t n, int64_t pe, const qtensor::AccumSpec& s) {
  int64_t em = pe;
  bool z = n < s.chunk || (s.acc_in_alignment && pe == qtensor::kAccZeroExp);
  for (int64_t j = 0; j < ng; ++j) {
    bool nonzero = g[j * gs + w] != 0.0;
    const int64_t k1 = std::min<int64_t>((j + 1) * s.group, n);
    for (int64_t k = j * s.group; k < k1 && !nonzero; ++k)
      nonzero = a[k] != 0.0f && b[k * ldb + w] != 0.0f;
    if (nonzero)
      em = std::max<int64_t>(em, (int64_t)ga[j] + gb[j * ldg + w]);
    else
      z = true;
  }
  return z && em < s.e_zero ? s.e_zero : em;
}

// MMA-Sim's e_zero in a chunk's emax em[0:W] (lanes of columns w, b with row stride ldb): where
// em is below e_zero (rare: every nonzero term tiny) and the lane has a zero term (a padding slot,
// a zero partial in the alignment: pz, a zero product), em = e_zero. Called where s.e_zero is set.
inline void zero_terms_emax(const int* ea, const int* eb, int64_t ldb, int64_t k0, int64_t n,
                            const bool* pz, const qtensor::AccumSpec& s, int* em) {
  for (int w = 0; w < W; ++w) {
    if (em[w] >= s.e_zero) continue;
    bool z = n < s.chunk || pz[w];
    for (int64_t k = k0; k < k0 + n && !z; ++k)
      z = ea[k] == qtensor::kAccZeroExp || eb[k * ldb + w] == qtensor::kAccZeroExp;
    if (z) em[w] = s.e_zero;
  }
}

// The two loops over a chunk's K-elements. em[w] = max(em[w], ea[k] + eb[k][w]);
// S[w] = sum_k round(a[k] * b[k][w] * sc[w]) (integers below 2^53: exact in any order).
#ifdef QT_ACCUM_AVX2
// The SSE/AVX rounding immediate of an alignment rounding MODE (0 toward zero, 1 floor, 2 nearest
// with ties to even), exceptions suppressed; accum_fast_avx512.h's cvt_round uses it too.
template <int MODE>
constexpr int kRoundImm = (MODE == 0 ? _MM_FROUND_TO_ZERO
                           : (MODE == 1 ? _MM_FROUND_TO_NEG_INF : _MM_FROUND_TO_NEAREST_INT)) |
                          _MM_FROUND_NO_EXC;

inline void chunk_emax(const int* ea, const int* eb, int64_t ldb, int64_t k0, int64_t k1,
                       int* em) {
  __m256i m = _mm256_loadu_si256((const __m256i*)em);
  for (int64_t k = k0; k < k1; ++k)
    m = _mm256_max_epi32(m, _mm256_add_epi32(_mm256_set1_epi32(ea[k]),
                                             _mm256_loadu_si256((const __m256i*)(eb + k * ldb))));
  _mm256_storeu_si256((__m256i*)em, m);
}

#ifndef QT_ACCUM_AVX512
template <int MODE>
inline void chunk_sum(const float* a, const float* b, int64_t ldb, int64_t k0, int64_t k1,
                      const double* sc, double* S) {
  constexpr int R = kRoundImm<MODE>;
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
template <int MODE, int R>  // R rows of a (row stride lda; sc and S: R x W)
inline void chunk_sums(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t k0,
                       int64_t k1, const double* sc, double* S) {
  for (int r = 0; r < R; ++r) chunk_sum<MODE>(a + r * lda, b, ldb, k0, k1, sc + r * W, S + r * W);
}
#else
// AVX-512: the W lanes in one vector of doubles, the terms converted to int64 with the alignment
// rounding (embedded) and summed in int64: exact (each below 2^53, make_spec), as the double sum,
// with an add of latency 1 instead of 4 (the chain over k). Lanes whose scale is NaN (a non-finite
// operand in the chunk: dot_lanes) come out NaN, as the double sum would. chunk_sums: R rows of a
// (row stride lda; sc and S: R x W), each b vector converted once for them.
template <int MODE, int R>
inline void chunk_sums(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t k0,
                       int64_t k1, const double* sc, double* S) {
  constexpr int RM = kRoundImm<MODE>;
  __m512d scv[R];
  __m512i s[R];
  for (int r = 0; r < R; ++r) {
    scv[r] = _mm512_loadu_pd(sc + r * W);
    s[r] = _mm512_setzero_si512();
  }
  for (int64_t k = k0; k < k1; ++k) {
    const __m512d bk = _mm512_cvtps_pd(_mm256_loadu_ps(b + k * ldb));
    for (int r = 0; r < R; ++r) {
      const __m512d t = _mm512_mul_pd(_mm512_mul_pd(_mm512_set1_pd((double)a[r * lda + k]), bk),
                                      scv[r]);
      s[r] = _mm512_add_epi64(s[r], _mm512_cvt_roundpd_epi64(t, RM));
    }
  }
  for (int r = 0; r < R; ++r)
    _mm512_storeu_pd(S + r * W,
                     _mm512_mask_mov_pd(_mm512_cvtepi64_pd(s[r]),
                                        _mm512_cmp_pd_mask(scv[r], scv[r], _CMP_UNORD_Q), scv[r]));
}
template <int MODE>
inline void chunk_sum(const float* a, const float* b, int64_t ldb, int64_t k0, int64_t k1,
                      const double* sc, double* S) {
  chunk_sums<MODE, 1>(a, 0, b, ldb, k0, k1, sc, S);
}
#endif  // QT_ACCUM_AVX512
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

// Double vectors of V lanes (2: baseline, 4: AVX2, 8: AVX-512; GCC vector extensions) and their
// int64 and float32 companions.
template <int V>
struct Vec {
  typedef double d __attribute__((vector_size(V * sizeof(double))));
  typedef int64_t i __attribute__((vector_size(V * sizeof(int64_t))));
  typedef float f __attribute__((vector_size(V * sizeof(float))));
};
template <int V>
using vd = typename Vec<V>::d;
template <int V>
using vi = typename Vec<V>::i;
template <int V>
using vf = typename Vec<V>::f;

// The groups' tiles: V rows by C columns (whole W-lane sets, two vectors at least).
constexpr int group_rows(int V) { return V; }
constexpr int group_cols(int V) { return 2 * V > W ? 2 * V : W; }

// out[0:W] = a[0:K] (a row, exponents ea) times W columns of b (row stride ldb, exponents eb)
#ifdef QT_ACCUM_AVX2
// The per-chunk bookkeeping in vectors of V double lanes with int64 exponents: 4 lanes (two
// vectors per W outputs) for dot_lanes, V of the ISA for the groups.
template <int V>
inline vd<V> pow2v(vi<V> e) { return (vd<V>)((e + 1023) << 52); }  // 2^e, e in [-1022, 1023]
template <int V>
inline vi<V> expv(vd<V> x) {  // floor(log2|x|) of normal x (zero: -1023, inf and NaN: 1024)
  typedef uint64_t vu __attribute__((vector_size(V * sizeof(uint64_t))));
  // a logical shift: AVX2 has no 64-bit arithmetic one (4 instructions for it)
  return (vi<V>)(((vu)x >> 52) & 0x7ff) - 1023;
}
template <int V>
inline vi<V> splat_i(int64_t x) { return vi<V>{} + x; }
template <int MODE, int V>
inline vd<V> round_v(vd<V> x) {
  constexpr int R = kRoundImm<MODE>;
  if constexpr (V == 8) return _mm512_roundscale_pd(x, R); else return _mm256_round_pd(x, R);
}
template <int V>
inline int nonfinite_mask(vd<V> x) {  // lanes that are inf or NaN
  const vi<V> inf = splat_i<V>(0x7ff0000000000000);
  const vi<V> m = ((vi<V>)x & inf) == inf;
  if constexpr (V == 8) return _mm512_movepi64_mask((__m512i)m);
  else return _mm256_movemask_pd((__m256d)m);
}
// the new partial from S (the terms' sum, p's excluded), emax em, the scales and p (acc_finish)
template <int MODE, int V>
inline vd<V> finish_v(vd<V> S, vi<V> em, vd<V> sc, vd<V> p, const qtensor::AccumSpec& s) {
  if (s.acc_in_alignment) S = S + round_v<MODE, V>(p * sc);
  const vd<V> v = S * pow2v<V>(em - s.frac_bits);
  vi<V> e = expv<V>(v);
  e = e < s.acc_emin ? splat_i<V>(s.acc_emin) : e;  // the accumulator's subnormal grid
  vd<V> y = v * pow2v<V>(s.acc_man - e);
  y = s.acc_round == 0 ? round_v<0, V>(y) : round_v<2, V>(y);
  const vd<V> r = y * pow2v<V>(e - s.acc_man) + 0.0;  // + 0: a zero result is +0
  const vi<V> mag = (vi<V>)r & INT64_MAX, inf = splat_i<V>(0x7ff0000000000000);
  const vd<V> out = (vd<V>)(mag >= splat_i<V>(int64_t{1024 + s.acc_emax} << 52)
                                ? ((vi<V>)r & INT64_MIN) | inf : (vi<V>)r);  // 2^(emax+1): inf
  if (s.acc_in_alignment) return out;
  return __builtin_convertvector(
      __builtin_convertvector(p, vf<V>) + __builtin_convertvector(out, vf<V>), vd<V>);
}

// The running state of NV * V outputs (acc_dot's partial p, FP32 accumulator, chunks since the
// last promotion) and its per-chunk steps, shared by dot_lanes and group_chunk.
template <int V, int NV>
struct Lanes {
  static constexpr int N = NV * V;
  vd<V> p[NV];
  vf<V> acc[NV];
  int c = 0;

  Lanes() {
    for (int v = 0; v < NV; ++v) { p[v] = vd<V>{}; acc[v] = vf<V>{}; }
  }

  // an initial accumulator: p starts at c[0:N] (the first instruction's accumulator input)
  void init(const float* c) {
    for (int v = 0; v < NV; ++v) {
      vf<V> x;
      std::memcpy(&x, c + v * V, sizeof x);
      p[v] = __builtin_convertvector(x, vd<V>);
    }
  }

  // p's alignment exponents (clamped at the accumulator's emin) where p is a nonzero term, else
  // kAccZeroExp
  void p_exps(const qtensor::AccumSpec& s, vi<V>* e) const {
    for (int v = 0; v < NV; ++v) {
      vi<V> ep = expv<V>(p[v]);
      ep = ep < s.acc_emin ? splat_i<V>(s.acc_emin) : ep;
      const vi<V> none = splat_i<V>(qtensor::kAccZeroExp);
      e[v] = s.acc_in_alignment ? (p[v] == 0.0 ? none : ep) : none;
    }
  }

  // The chunk's new partials from S (its terms' sum, p's excluded), emax e and the scales sc.
  // Lanes with a non-finite S or p take the IEEE result of the chunk's operands: a[0:n] and
  // b[0:n] (row stride ldb, lane w at column w). last: the chunk ends K.
  template <int MODE>
  void finish_chunk(const vd<V>* S, const vi<V>* e, const vd<V>* sc, const float* a,
                    const float* b, int64_t ldb, int64_t n, bool last,
                    const qtensor::AccumSpec& s) {
    int bad = 0;
    vd<V> q[NV];
    for (int v = 0; v < NV; ++v) {
      bad |= (nonfinite_mask<V>(S[v]) | nonfinite_mask<V>(p[v])) << (v * V);
      q[v] = finish_v<MODE, V>(S[v], e[v], sc[v], p[v], s);
    }
    if (bad) {  // rare: the IEEE result of the lanes with a NaN or inf
      double pn[N], qn[N];
      std::memcpy(pn, p, sizeof pn);
      std::memcpy(qn, q, sizeof qn);
      for (int w = 0; w < N; ++w)
        if (bad >> w & 1) qn[w] = qtensor::acc_nonfinite(a, b + w, ldb, n, pn[w]);
      std::memcpy(q, qn, sizeof qn);
    }
    for (int v = 0; v < NV; ++v) p[v] = q[v];
    if (s.promote > 0 && (++c == s.promote || last)) {
      for (int v = 0; v < NV; ++v) {
        acc[v] = acc[v] + __builtin_convertvector(p[v], vf<V>);
        p[v] = vd<V>{};
      }
      c = 0;
    }
  }

  void store(float* out, const qtensor::AccumSpec& s) const {
    float o[N];
    for (int v = 0; v < NV; ++v) {
      const vf<V> x = s.promote > 0 ? acc[v] : __builtin_convertvector(p[v], vf<V>);
      std::memcpy(o + v * V, &x, sizeof x);
    }
    for (int w = 0; w < N; ++w) out[w] = std::isnan(o[w]) ? qtensor::u2f(qtensor::F32::QNAN) : o[w];
  }
};

// dot_lanes' double lanes per vector: W in one zmm on AVX-512, two ymm on AVX2
#ifdef QT_ACCUM_AVX512
constexpr int DV = 8;
#else
constexpr int DV = 4;
#endif
// R rows at once (a and ea with row stride lda; out: R x W): their chunks are independent chains
// of dependent steps (p -> emax -> scale -> terms -> p), which one row alone leaves latency-bound.
template <int MODE, int R = 1>
void dot_lanes(const float* a, const int* ea, const float* b, const int* eb, int64_t ldb,
               int64_t K, const qtensor::AccumSpec& s, float* out, int64_t lda = 0,
               const float* c = nullptr) {
  using namespace qtensor;
  typedef int32_t vsi __attribute__((vector_size(DV * sizeof(int32_t))));
  constexpr int NV = W / DV;
  Lanes<DV, NV> L[R];
  if (c != nullptr)  // c: R x W initial accumulators
    for (int r = 0; r < R; ++r) L[r].init(c + r * W);
  alignas(64) int em[R][W];
  alignas(64) double sc[R][W], S[R][W];
  for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
    const int64_t n = K - k0 < s.chunk ? K - k0 : s.chunk;
    vi<DV> e[R][NV];
    vd<DV> scv[R][NV], Sv[NV];
    for (int r = 0; r < R; ++r) {
      L[r].p_exps(s, e[r]);
      for (int v = 0; v < NV; ++v) {
        const vsi e32 = __builtin_convertvector(e[r][v], vsi);
        std::memcpy(em[r] + DV * v, &e32, sizeof e32);
      }
      bool pz[W];  // p is a zero term
      for (int w = 0; w < W; ++w) pz[w] = s.acc_in_alignment && em[r][w] == kAccZeroExp;
      chunk_emax(ea + r * lda, eb, ldb, k0, k0 + n, em[r]);
      if (s.e_zero != kAccZeroExp) zero_terms_emax(ea + r * lda, eb, ldb, k0, n, pz, s, em[r]);
      for (int v = 0; v < NV; ++v) {
        vsi e32;
        std::memcpy(&e32, em[r] + DV * v, sizeof e32);
        vi<DV> x = __builtin_convertvector(e32, vi<DV>);
        // a non-finite operand: the scale NaN, so that S is (chunk_sums), and finish_chunk takes
        // the IEEE result; all-zero lanes: any scale will do
        const vi<DV> bad = x > kAccBadExp / 2;
        x = (x < kAccZeroExp / 2) | bad ? vi<DV>{} : x;
        e[r][v] = x;
        const vi<DV> scale = (vi<DV>)pow2v<DV>(s.frac_bits - x);
        scv[r][v] = (vd<DV>)(bad ? splat_i<DV>(0x7ff8000000000000) : scale);
      }
      std::memcpy(sc[r], scv[r], sizeof sc[r]);
    }
    chunk_sums<MODE, R>(a, lda, b, ldb, k0, k0 + n, sc[0], S[0]);
    for (int r = 0; r < R; ++r) {
      std::memcpy(Sv, S[r], sizeof Sv);
      L[r].template finish_chunk<MODE>(Sv, e[r], scv[r], a + r * lda + k0, b + k0 * ldb, ldb, n,
                                       k0 + n == K, s);
    }
  }
  for (int r = 0; r < R; ++r) L[r].store(out + r * W, s);
}

// The outputs of one row of a group tile: group_cols(V) lanes.
template <int V>
using RowLanes = Lanes<V, group_cols(V) / V>;

// One chunk of a row of a group tile from its group sums g[j * L.N + w], j < ng: emax over the
// groups (floor(log2|g|), unclamped) and p, the rounded scaled terms' sum, finish_chunk.
template <int MODE, int V>
inline void group_chunk(const double* g, int64_t ng, RowLanes<V>& L, const float* a,
                        const float* b, int64_t ldb, int64_t n, bool last,
                        const qtensor::AccumSpec& s, const int* ga = nullptr,
                        const int* gb = nullptr) {
  constexpr int NV = RowLanes<V>::N / V;
  vi<V> m[NV], e[NV];  // the largest |g| (as bits): its exponent is the groups'
  vd<V> sc[NV], S[NV];
  for (int v = 0; v < NV; ++v) m[v] = vi<V>{};
  for (int64_t j = 0; j < ng; ++j)
    for (int v = 0; v < NV; ++v) {
      vi<V> x;
      std::memcpy(&x, g + j * L.N + v * V, sizeof x);
      x &= INT64_MAX;
      m[v] = x > m[v] ? x : m[v];
    }
  L.p_exps(s, e);
  if (ga != nullptr) {  // the groups at their block-scale exponents (group_emax_gexp)
    for (int v = 0; v < NV; ++v) {
      int64_t ev[V];
      std::memcpy(ev, &e[v], sizeof ev);
      for (int w = 0; w < V; ++w)
        ev[w] = group_emax_gexp(g, L.N, ng, v * V + w, ga, gb, L.N, a, b, ldb, n, ev[w], s);
      std::memcpy(&e[v], ev, sizeof ev);
      e[v] = e[v] < -1022 ? vi<V>{} : e[v];  // all terms zero: any scale will do
      sc[v] = pow2v<V>(s.frac_bits - e[v]);
      S[v] = vd<V>{};
    }
  }
  for (int v = 0; v < NV && ga == nullptr; ++v) {
    // a zero's exponent reads -1023 (a nonzero sum of float32 products is at least 2^-298): where
    // all terms are zero any scale will do; inf or NaN (1024) make S non-finite
    const vi<V> eg = expv<V>((vd<V>)m[v]);
    const vi<V> pe = e[v];
    e[v] = eg > e[v] ? eg : e[v];
    if (s.e_zero != qtensor::kAccZeroExp) {  // zero terms at e_zero (rare: tiny groups)
      int64_t ev[V], pv[V];
      std::memcpy(ev, &e[v], sizeof ev);
      std::memcpy(pv, &pe, sizeof pv);
      for (int w = 0; w < V; ++w) {
        if (ev[w] >= s.e_zero) continue;
        bool z = n < s.chunk || (s.acc_in_alignment && pv[w] == qtensor::kAccZeroExp);
        for (int64_t j = 0; j < ng && !z; ++j) z = g[j * L.N + v * V + w] == 0.0;
        if (z) ev[w] = s.e_zero;
      }
      std::memcpy(&e[v], ev, sizeof ev);
    }
    e[v] = e[v] < -1022 ? vi<V>{} : e[v];
    sc[v] = pow2v<V>(s.frac_bits - e[v]);
    S[v] = vd<V>{};
  }
  for (int64_t j = 0; j < ng; ++j)
    for (int v = 0; v < NV; ++v) {
      vd<V> x;
      std::memcpy(&x, g + j * L.N + v * V, sizeof x);
      S[v] = S[v] + round_v<MODE, V>(x * sc[v]);
    }
  L.template finish_chunk<MODE>(S, e, sc, a, b, ldb, n, last, s);
}
#else
// The running state of W outputs (acc_dot's partial p, FP32 accumulator, chunks since the last
// promotion) and its per-chunk steps, shared by dot_lanes and group_chunk.
struct Lanes {
  double p[W] = {};
  float acc[W] = {};
  int c = 0;

  // an initial accumulator: p starts at c[0:W] (the first instruction's accumulator input)
  void init(const float* c0) {
    for (int w = 0; w < W; ++w) p[w] = c0[w];
  }

  // p's alignment exponents (clamped at -126) where p is a term of the alignment, else
  // kAccZeroExp
  void p_exps(const qtensor::AccumSpec& s, int* em) const {
    for (int w = 0; w < W; ++w) {
      const double pt = s.acc_in_alignment ? p[w] : 0.0;
      const int e = pt == 0.0 ? qtensor::kAccZeroExp : qtensor::acc_exp_f64(pt);
      em[w] = pt != 0.0 && e < s.acc_emin ? s.acc_emin : e;
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
               int64_t K, const qtensor::AccumSpec& s, float* out, int64_t = 0,
               const float* c = nullptr) {
  using namespace qtensor;
  Lanes L;
  if (c != nullptr) L.init(c);
  double sc[W], S[W];
  int em[W];
  for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
    const int64_t n = K - k0 < s.chunk ? K - k0 : s.chunk;
    L.p_exps(s, em);
    bool pz[W];  // p is a zero term
    for (int w = 0; w < W; ++w) pz[w] = s.acc_in_alignment && em[w] == kAccZeroExp;
    chunk_emax(ea, eb, ldb, k0, k0 + n, em);
    if (s.e_zero != kAccZeroExp) zero_terms_emax(ea, eb, ldb, k0, n, pz, s, em);
    for (int w = 0; w < W; ++w) {  // all-zero and non-finite lanes: any scale will do
      em[w] = em[w] < kAccZeroExp / 2 || em[w] > kAccBadExp / 2 ? 0 : em[w];
      sc[w] = acc_pow2(s.frac_bits - em[w]);
    }
    chunk_sum<MODE>(a, b, ldb, k0, k0 + n, sc, S);
    L.finish_chunk<MODE>(S, em, sc, a + k0, b + k0 * ldb, ldb, n, k0 + n == K, s);
  }
  L.store(out, s);
}

// The outputs of one row of a group tile: group_cols(V) == W lanes.
template <int V>
using RowLanes = Lanes;

// One chunk of a row of a group tile from its group sums g[j * W + w], j < ng: emax over the
// groups (floor(log2|g|), unclamped) and p, the rounded scaled terms' sum, finish_chunk.
template <int MODE, int V>
inline void group_chunk(const double* g, int64_t ng, Lanes& L, const float* a, const float* b,
                        int64_t ldb, int64_t n, bool last, const qtensor::AccumSpec& s,
                        const int* ga = nullptr, const int* gb = nullptr) {
  using namespace qtensor;
  static_assert(group_cols(V) == W, "one Lanes per row");
  int em[W];
  double sc[W], S[W];
  L.p_exps(s, em);
  for (int w = 0; w < W; ++w) {
    if (ga != nullptr) {  // the groups at their block-scale exponents
      em[w] = (int)group_emax_gexp(g, W, ng, w, ga, gb, W, a, b, ldb, n, em[w], s);
      em[w] = em[w] < kAccZeroExp / 2 ? 0 : em[w];
      sc[w] = acc_pow2(s.frac_bits - em[w]);
      S[w] = 0.0;
      for (int64_t j = 0; j < ng; ++j) S[w] += acc_round_int(g[j * W + w] * sc[w], MODE);
      continue;
    }
    bool z = n < s.chunk || (s.acc_in_alignment && em[w] == kAccZeroExp);
    for (int64_t j = 0; j < ng; ++j) {  // inf or NaN (1024) make S non-finite
      const double t = g[j * W + w];
      if (t != 0.0) em[w] = std::max(em[w], acc_exp_f64(t)); else z = true;
    }
    if (z && em[w] < s.e_zero) em[w] = s.e_zero;  // a zero term at e_zero
    em[w] = em[w] < kAccZeroExp / 2 ? 0 : em[w];  // all terms zero: any scale will do
    sc[w] = acc_pow2(s.frac_bits - em[w]);
    S[w] = 0.0;
    for (int64_t j = 0; j < ng; ++j) S[w] += acc_round_int(g[j * W + w] * sc[w], MODE);
  }
  L.finish_chunk<MODE>(S, em, sc, a, b, ldb, n, last, s);
}
#endif

// Rows [i0, i1) of one batch: a (M, K); b in panels of W columns, each (K, W) contiguous.
// c: the initial accumulators (M, N), or null.
template <int MODE>
void rows_mode(const float* a, const int* ea, const float* b, const int* eb, int64_t K, int64_t N,
               int64_t i0, int64_t i1, const qtensor::AccumSpec& s, float* out,
               const float* c) {
#ifdef QT_ACCUM_AVX2
  constexpr int DR = 4;  // rows per dot_lanes call
#else
  constexpr int DR = 1;
#endif
  float tmp[DR * W], cw[DR * W];
  for (int64_t j = 0; j < N; j += W) {
    const float* bj = b + j * K;  // the panel of columns j .. j + W - 1
    const int* ebj = eb + j * K;
    for (int64_t i = i0; i < i1;) {
      if (c != nullptr)  // the panel's initial accumulators (zero past N and i1)
        for (int64_t q = 0; q < DR; ++q)
          for (int64_t w = 0; w < W; ++w)
            cw[q * W + w] = i + q < i1 && j + w < N ? c[(i + q) * N + j + w] : 0.0f;
      const float* cp = c != nullptr ? cw : nullptr;
      int64_t r = 1;
#ifdef QT_ACCUM_AVX2
      if (i + DR <= i1) {
        dot_lanes<MODE, DR>(a + i * K, ea + i * K, bj, ebj, W, K, s, tmp, K, cp);
        r = DR;
      } else
#endif
        dot_lanes<MODE>(a + i * K, ea + i * K, bj, ebj, W, K, s, tmp, 0, cp);
      for (int64_t q = 0; q < r; ++q, ++i)
        for (int64_t w = 0; w < W && j + w < N; ++w) out[i * N + j + w] = tmp[q * W + w];
    }
  }
}
inline void rows(const float* a, const int* ea, const float* b, const int* eb, int64_t K,
                 int64_t N, int64_t i0, int64_t i1, const qtensor::AccumSpec& s, float* out,
                 const float* c = nullptr) {
  switch (s.align_round) {
    case 0: rows_mode<0>(a, ea, b, eb, K, N, i0, i1, s, out, c); break;
    case 1: rows_mode<1>(a, ea, b, eb, K, N, i0, i1, s, out, c); break;
    default: rows_mode<2>(a, ea, b, eb, K, N, i0, i1, s, out, c); break;
  }
}

// Groups: tiles of group_rows(V) rows by group_cols(V) columns (V doubles per vector: 8
// AVX-512, 4 AVX2, 2 baseline; accum.cpp picks V per ISA and lays out the operands for them).
template <int V>
inline vd<V> splat(double x) {
#ifdef QT_ACCUM_AVX2
  if constexpr (V == 8) return _mm512_set1_pd(x); else return _mm256_set1_pd(x);
#else
  vd<V> v;
  for (int i = 0; i < V; ++i) v[i] = x;
  return v;
#endif
}

// x[0:V] in double. AVX2: one vcvtps2pd from memory (GCC's generic conversion of the 4 floats
// goes in two halves through the stack)
template <int V>
inline vd<V> load_cvt(const float* x) {
#ifdef QT_ACCUM_AVX2
  if constexpr (V == 4) return _mm256_cvtps_pd(_mm_loadu_ps(x));
#endif
  vf<V> f;
  std::memcpy(&f, x, sizeof f);
  return __builtin_convertvector(f, vd<V>);
}

// p[0:V] = x. AVX2: from the registers (a memcpy went through a copy on the stack, in halves)
template <int V>
inline void store_v(double* p, vd<V> x) {
#ifdef QT_ACCUM_AVX2
  if constexpr (V == 4) return _mm256_storeu_pd(p, x);
#endif
  std::memcpy(p, &x, sizeof x);
}

// t + x * y; x * y is exact (a product of float32 values), so the fused form gives the same bits
template <int V>
inline vd<V> mul_add(vd<V> t, vd<V> x, vd<V> y) {
#ifdef QT_ACCUM_AVX2
  if constexpr (V == 8) return _mm512_fmadd_pd(x, y, t); else return _mm256_fmadd_pd(x, y, t);
#else
  return t + x * y;
#endif
}

// The group sums of one chunk (n K-elements, groups of `group`) for a tile: a (R rows in double,
// stride lda), b (n rows of C float32, converted as loaded). G[(r * ng + j) * C + c] = the
// products of group j of row r and column c added in k order in double, as acc_chunk does.
template <int V>
inline void group_sums(const double* a, int64_t lda, const float* b, int64_t n, int64_t group,
                       double* G) {
  constexpr int R = group_rows(V), C = group_cols(V), NV = C / V;
  const int64_t ng = (n + group - 1) / group;
  vd<V> t[R][NV], bv[NV];
  const auto load_b = [&](int64_t k) {
    for (int v = 0; v < NV; ++v) bv[v] = load_cvt<V>(b + k * C + v * V);
  };
  for (int64_t j = 0; j < ng; ++j) {
    const int64_t k0 = j * group, k1 = std::min(k0 + group, n);
    load_b(k0);
    for (int r = 0; r < R; ++r) {
      const vd<V> av = splat<V>(a[r * lda + k0]);
      for (int v = 0; v < NV; ++v) t[r][v] = av * bv[v];
    }
    for (int64_t k = k0 + 1; k < k1; ++k) {
      load_b(k);
      for (int r = 0; r < R; ++r) {
        const vd<V> av = splat<V>(a[r * lda + k]);
        for (int v = 0; v < NV; ++v) t[r][v] = mul_add<V>(t[r][v], av, bv[v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v)
        store_v<V>(G + (r * ng + j) * C + v * V, t[r][v]);
  }
}

template <int V, int MODE>
void rows_groups_mode(const float* a, const float* b, int64_t K, int64_t N, int64_t i0,
                      int64_t i1, const qtensor::AccumSpec& s, float* out, const int* ga,
                      const int* gb, const float* c) {
  constexpr int R = group_rows(V), C = group_cols(V);
  // the tile's rows of a in double (zero rows past i1), then the group sums of a chunk; kept
  // per thread: a fresh large allocation per task would fault its pages in every time
  thread_local std::vector<double> scratch;
  scratch.resize((size_t)(R * K + R * (s.chunk / s.group) * C));
  double* ad = scratch.data();
  double* G = ad + R * K;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k) ad[r * K + k] = i0 + r < i1 ? (double)a[(i0 + r) * K + k] : 0.0;
  float tmp[C];
  // the group exponents: ga (M, NG) rows, gb (panels, NG, C)
  const int64_t NG = (K + s.group - 1) / s.group;
  for (int64_t j0 = 0; j0 < N; j0 += C) {
    const float* bj = b + j0 * K;  // the panel of columns j0 .. j0 + C - 1
    RowLanes<V> L[R];
    if (c != nullptr)  // the initial accumulators (zero past N)
      for (int64_t r = 0; r < i1 - i0; ++r) {
        for (int64_t q = 0; q < C; ++q) tmp[q] = j0 + q < N ? c[(i0 + r) * N + j0 + q] : 0.0f;
        L[r].init(tmp);
      }
    for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
      const int64_t n = K - k0 < s.chunk ? K - k0 : s.chunk, ng = (n + s.group - 1) / s.group;
      group_sums<V>(ad + k0, K, bj + k0 * C, n, s.group, G);
      for (int64_t r = 0; r < i1 - i0; ++r)
        group_chunk<MODE, V>(G + r * ng * C, ng, L[r], a + (i0 + r) * K + k0, bj + k0 * C, C, n,
                             k0 + n == K, s, ga ? ga + (i0 + r) * NG + k0 / s.group : nullptr,
                             ga ? gb + (j0 / C * NG + k0 / s.group) * C : nullptr);
    }
    for (int64_t r = 0; r < i1 - i0; ++r) {
      L[r].store(tmp, s);
      for (int64_t c = 0; c < C && j0 + c < N; ++c) out[(i0 + r) * N + j0 + c] = tmp[c];
    }
  }
  if (scratch.size() > (1 << 20)) std::vector<double>().swap(scratch);  // keep at most 8 MiB
}

// Rows [i0, i1) (at most group_rows(V)) of one batch through a group datapath: a (M, K); b in
// panels of group_cols(V) columns, each (K, C) contiguous (zero columns pad the last one).
template <int V>
void rows_groups(const float* a, const float* b, int64_t K, int64_t N, int64_t i0, int64_t i1,
                 const qtensor::AccumSpec& s, float* out, const int* ga = nullptr,
                 const int* gb = nullptr, const float* c = nullptr) {
  switch (s.align_round) {
    case 0: rows_groups_mode<V, 0>(a, b, K, N, i0, i1, s, out, ga, gb, c); break;
    case 1: rows_groups_mode<V, 1>(a, b, K, N, i0, i1, s, out, ga, gb, c); break;
    default: rows_groups_mode<V, 2>(a, b, K, N, i0, i1, s, out, ga, gb, c); break;
  }
}
