// The float32/int32 fast path of qtensor::accum_matmul (group == 1), included by
// csrc/cpu/accum.cpp inside namespace accum_avx512 under `#pragma GCC target("avx512...")`, after
// accum_lanes.h (its dot_lanes is the fallback). No #include here.
//
// Used only where accum.cpp's fast_path_ok holds for the operands: all finite, normal or zero,
// significands of at most 24 bits between a and b (fp8/fp6/fp4/bf16/fp16 values), so every
// product a*b is exact and normal (or zero) in float32, and a chunk's scaled terms sum exactly in
// int32. Then the model's term round(a*b * 2^(frac_bits - emax)) is a float32 product scaled by
// an exact power of two (an int32 add to its exponent bits, or a float32 multiply), a
// float32-to-int32 conversion with the alignment rounding and an int32 add: 4 instructions per 16
// products, against the double path's ~15 per 8. The per-chunk finish (p's own term, the
// normalization to the accumulator format, promotion) is integer/float32 arithmetic on 16 lanes,
// exact: the partials are float32 values.
//
// The scaled terms are exact only while 2^(frac_bits - emax) times the smallest product stays a
// normal float32, and the finish only while the sums stay in int32; emax can grow with the
// partial p (acc_in_alignment), so every chunk checks both, and a tile that fails a check is
// redone by the double path (dot_lanes).

constexpr int FW = 16;  // output columns per tile: the float32 lanes of a zmm register
constexpr int FR = 4;   // rows per exponent group (Exps8): 4 x 16 int8 lanes
constexpr int TR = 8;   // rows per tile (two groups): each loaded b vector serves TR rows

template <int MODE>
inline __m512i cvt_round(__m512 x) {  // float32 to int32 with the alignment rounding
  return _mm512_cvt_roundps_epi32(
      x, (MODE == 0 ? _MM_FROUND_TO_ZERO
                    : (MODE == 1 ? _MM_FROUND_TO_NEG_INF : _MM_FROUND_TO_NEAREST_INT)) |
             _MM_FROUND_NO_EXC);
}
inline __m512i i32(int x) { return _mm512_set1_epi32(x); }

// p's alignment exponent floor(log2|p|): no clamp at -126 is needed, since the fast path's
// partials are multiples of 2^(lo - F) >= 2^-126 (lo: the smallest product exponent,
// fast_path_ok), so never subnormal; p == 0 gives INT_MIN (getexp: -inf), below every exponent,
// as the model's kAccZeroExp
inline __m512i p_exp16(__m512 p) { return _mm512_cvtps_epi32(_mm512_getexp_ps(p)); }

// qtensor::acc_finish of 16 lanes in int32/float32: the new partial from S (the products' sum,
// units of 2^(em - F)), em and the old partial p. The partials are float32 values (at most 24
// significant bits); the sum T of S and p's term is below 2^31 (fast_tile checks it). The result
// v = T * 2^(em - F) rounded to acc_man bits below its leading bit is R * 2^(em - F), R the
// integer T so rounded, and exact in float32 (vscalefps). The model's clamp of e(v) at -126
// never binds here: v is a multiple of 2^(lo - F) >= 2^-126 (lo: the smallest product exponent,
// fast_path_ok), and so is every partial.
template <int MODE>
inline __m512 finish16(__m512i T, __m512i em, __m512 p, const qtensor::AccumSpec& s) {
  const __m512i Fe = _mm512_sub_epi32(i32(s.frac_bits), em);
  const __m512 fe = _mm512_cvtepi32_ps(Fe);  // F - em, exact: |em| <= 100000
  if (s.acc_in_alignment) {  // T += round(p * 2^(F - em)), below 2^(F + 1) in magnitude
    const __m512 x = _mm512_scalef_ps(p, fe);
    __m512i pt = cvt_round<MODE>(x);
    if (MODE == 1)  // floor of a negative p whose subnormal term was flushed to -0 (FTZ): -1
      pt = _mm512_mask_sub_epi32(pt, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ) &
                                         _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_LT_OQ),
                                 pt, i32(1));
    T = _mm512_add_epi32(T, pt);
  }
  __m512 r;  // sign(T) * R
  if (s.acc_round == 0) {  // toward zero: the conversion truncates to 24 bits, the mask to fewer
    r = _mm512_cvt_roundepi32_ps(T, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    r = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(r), i32(-(1 << (23 - s.acc_man)))));
  } else if (s.acc_man == 23) {  // nearest to 24 bits: the conversion itself
    r = _mm512_cvt_roundepi32_ps(T, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {  // nearest to fewer bits, on |T| (no double rounding): the bits below 2^d go,
            // d = floor(log2|T|) - acc_man (at least 0); + (2^(d-1) - 1) + the kept bits' parity
    const __m512i aT = _mm512_abs_epi32(T);
    const __m512i d = _mm512_max_epi32(
        _mm512_sub_epi32(i32(31 - s.acc_man), _mm512_lzcnt_epi32(aT)), _mm512_setzero_si512());
    const __m512i low = _mm512_sub_epi32(_mm512_sllv_epi32(i32(1), d), i32(1));
    const __m512i odd = _mm512_and_si512(_mm512_and_si512(_mm512_srlv_epi32(aT, d), low), i32(1));
    const __m512i t = _mm512_add_epi32(_mm512_add_epi32(aT, _mm512_srli_epi32(low, 1)), odd);
    const __m512i R = _mm512_sllv_epi32(_mm512_srlv_epi32(t, d), d);  // unsigned: up to 2^31
    r = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(  // (T & SIGN) | R as float
        T, i32((int)qtensor::F32::SIGN), _mm512_castps_si512(_mm512_cvtepu32_ps(R)), 0xEA));
  }
  const __m512 v = _mm512_scalef_ps(r, _mm512_sub_ps(_mm512_setzero_ps(), fe));
  return s.acc_in_alignment ? v : _mm512_add_ps(p, v);
}

// The chunk's terms summed in int32: S[r] += round(a[r][k] * b[k] * 2^sh[r]) for k in [k0, k1).
// SHIFT: the scaling is an int32 add of sh << 23 to the product's bits (exact for a normal
// product and term; a zero product gives +-2^(sh - 127), which rounds to 0 toward zero or to
// nearest when 1 <= sh <= 126); else a float32 multiply by 2^sh.
template <int MODE, int R, bool SHIFT>
inline void chunk_terms(const float* a, int64_t K, const float* b, int64_t k0, int64_t k1,
                        const __m512i* sh, __m512i* S) {
  __m512i sc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    sc[r] = SHIFT ? _mm512_slli_epi32(sh[r], 23)
                  : _mm512_slli_epi32(_mm512_add_epi32(sh[r], i32(127)), 23);
    S[r] = _mm512_setzero_si512();
  }
  for (int64_t k = k0; k < k1; ++k) {
    const __m512 bk = _mm512_loadu_ps(b + k * FW);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 t = _mm512_mul_ps(bk, _mm512_set1_ps(a[r * K + k]));
      const __m512 x =
          SHIFT ? _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(t), sc[r]))
                : _mm512_mul_ps(t, _mm512_castsi512_ps(sc[r]));
      S[r] = _mm512_add_epi32(S[r], cvt_round<MODE>(x));
    }
  }
}

// The exponents of the fast path: int8, offset so that the largest nonzero one is 0, -128 for
// zeros (a sum with a zero saturates there); a's for FR rows interleaved, (K, FR) per group,
// b's (K, FW) per panel. One saturating add and max per k covers the 4 x 16 lanes.
struct Exps8 {
  const int8_t* a;  // the tile's (K, 4)
  const int8_t* b;  // the panel's (K, FW)
  int off;          // the sum of the two offsets: emax = max8 + off
};

// The glue's passes over the operands, vectorized here.

// The Range of x[0:n].
inline Range scan(const float* x, int64_t n) {
  __m512i man = _mm512_setzero_si512(), lo = i32(255), hi = _mm512_setzero_si512();
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_and_si512(_mm512_loadu_si512(x + i), i32((int)qtensor::F32::ABS));
    const __m512i be = _mm512_srli_epi32(u, 23);
    const __mmask16 nz = _mm512_test_epi32_mask(u, u);
    bad |= _mm512_mask_cmpeq_epi32_mask(nz, be, _mm512_setzero_si512()) |
           _mm512_mask_cmpeq_epi32_mask(nz, be, i32(255));
    man = _mm512_or_si512(man, u);
    lo = _mm512_mask_min_epu32(lo, nz, lo, be);
    hi = _mm512_max_epu32(hi, be);
  }
  uint32_t m = (uint32_t)_mm512_reduce_or_epi32(man), l = (uint32_t)_mm512_reduce_min_epu32(lo),
           h = (uint32_t)_mm512_reduce_max_epu32(hi);
  bool ok = bad == 0;
  for (; i < n; ++i) {
    const uint32_t u = qtensor::f2u(x[i]) & qtensor::F32::ABS, be = u >> 23;
    if (u == 0) continue;
    ok &= be != 0 && be != 255;
    m |= u;
    l = std::min(l, be);
    h = std::max(h, be);
  }
  return Range{ok, m & qtensor::F32::MANMASK, l == 255 ? INT_MAX : (int)l - 127,
               h == 0 ? INT_MIN : (int)h - 127};
}

// Exps8 of normal-or-zero x whose largest exponent is hi: 16 values, and one value
inline __m128i exps8_16(const float* x, int hi) {
  const __m512i u = _mm512_and_si512(_mm512_loadu_si512(x), i32((int)qtensor::F32::ABS));
  const __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(u, 23), i32(127 + hi));
  return _mm512_cvtepi32_epi8(
      _mm512_mask_mov_epi32(e, _mm512_testn_epi32_mask(u, u), i32(-128)));
}
inline int8_t exps8_1(float x, int hi) {
  const uint32_t u = qtensor::f2u(x) & qtensor::F32::ABS;
  return (int8_t)(u == 0 ? -128 : (int)(u >> 23) - 127 - hi);
}
// x[0:n] flat (b's panels)
inline void exps8_flat(const float* x, int64_t n, int hi, int8_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm_storeu_si128((__m128i*)(out + i), exps8_16(x + i, hi));
  for (; i < n; ++i) out[i] = exps8_1(x[i], hi);
}
// rows rows (<= FR) of x (row stride C) to (C, FR), interleaved; missing rows as zeros
inline void exps8_rows(const float* x, int64_t rows, int64_t C, int hi, int8_t* out) {
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    __m128i r[FR];
    for (int i = 0; i < FR; ++i)
      r[i] = i < rows ? exps8_16(x + i * C + c, hi) : _mm_set1_epi8(-128);
    static_assert(FR == 4, "a 4 x 16 byte transpose");
    const __m128i t0 = _mm_unpacklo_epi8(r[0], r[1]), t1 = _mm_unpackhi_epi8(r[0], r[1]);
    const __m128i t2 = _mm_unpacklo_epi8(r[2], r[3]), t3 = _mm_unpackhi_epi8(r[2], r[3]);
    _mm_storeu_si128((__m128i*)(out + 4 * c), _mm_unpacklo_epi16(t0, t2));
    _mm_storeu_si128((__m128i*)(out + 4 * c + 16), _mm_unpackhi_epi16(t0, t2));
    _mm_storeu_si128((__m128i*)(out + 4 * c + 32), _mm_unpacklo_epi16(t1, t3));
    _mm_storeu_si128((__m128i*)(out + 4 * c + 48), _mm_unpackhi_epi16(t1, t3));
  }
  for (; c < C; ++c)
    for (int i = 0; i < FR; ++i) out[4 * c + i] = i < rows ? exps8_1(x[i * C + c], hi) : -128;
}

// out[r][0:ncols] for R <= TR rows of a (row stride K) times one (K, FW) panel of b, exponents
// e. False (out untouched) where an emax passed lim.emax or a sum came near 2^31: the tile
// needs dot_lanes.
template <int MODE, int R>
bool fast_tile(const float* a, const float* b, const Exps8& e, int64_t K,
               const qtensor::AccumSpec& s, const FastLimits& lim, float* out, int64_t ldo,
               int ncols) {
  using namespace qtensor;
  __m512 p[R], acc[R];
  for (int r = 0; r < R; ++r) p[r] = acc[r] = _mm512_setzero_ps();
  const __m512i F = i32(s.frac_bits), limit = i32(lim.emax), smax = i32(lim.sums);
  const bool check_sums = lim.sums != INT32_MAX;
  // byte r of a 32-bit broadcast to all 16 bytes of 128-bit lane r
  const __m512i spread = _mm512_set_epi32(0x03030303, 0x03030303, 0x03030303, 0x03030303,
                                          0x02020202, 0x02020202, 0x02020202, 0x02020202,
                                          0x01010101, 0x01010101, 0x01010101, 0x01010101, 0, 0,
                                          0, 0);
  int c = 0;
  for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
    const int64_t k1 = K - k0 < s.chunk ? K : k0 + s.chunk;
    // emax per lane: max_k ea[k] + eb[k], 128-bit lane r % FR of E8[r / FR] for row r, and p's
    // exponent (if it takes part)
    constexpr int G = (R + FR - 1) / FR;  // exponent groups
    __m512i E8[G];
    for (int g = 0; g < G; ++g) E8[g] = _mm512_set1_epi8(-128);
    for (int64_t k = k0; k < k1; ++k) {
      const __m512i ebk = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(e.b + k * FW)));
      for (int g = 0; g < G; ++g) {
        int32_t a4;
        std::memcpy(&a4, e.a + (g * K + k) * FR, 4);
        E8[g] = _mm512_max_epi8(
            E8[g], _mm512_adds_epi8(_mm512_shuffle_epi8(_mm512_set1_epi32(a4), spread), ebk));
      }
    }
    __m512i E[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i e8 =
          _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(E8[r / FR], r % FR));
      E[r] = _mm512_mask_add_epi32(i32(kAccZeroExp), _mm512_cmpneq_epi32_mask(e8, i32(-128)), e8,
                                   i32(e.off));
      if (s.acc_in_alignment) E[r] = _mm512_max_epi32(E[r], p_exp16(p[r]));
    }
    // the scales 2^sh, sh = F - emax: at least -126 below the limit, and at most 126 where a
    // product is nonzero (fast_path_ok); clamped there for the others, whose scale multiplies
    // zeros (all-zero lanes: kAccZeroExp, whose result is 0 at any scale)
    __m512i sh[R];
    __mmask16 over = 0, small = 0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      over |= _mm512_cmpgt_epi32_mask(E[r], limit);
      sh[r] = _mm512_min_epi32(_mm512_sub_epi32(F, E[r]), i32(126));
      small |= _mm512_cmplt_epi32_mask(sh[r], i32(1));
    }
    if (over) return false;
    __m512i S[R];
    if (MODE != 1 && !small)
      chunk_terms<MODE, R, true>(a, K, b, k0, k1, sh, S);
    else
      chunk_terms<MODE, R, false>(a, K, b, k0, k1, sh, S);
    const bool promote = s.promote > 0 && (++c == s.promote || k1 == K);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (check_sums) over |= _mm512_cmpgt_epi32_mask(_mm512_abs_epi32(S[r]), smax);
      p[r] = finish16<MODE>(S[r], E[r], p[r], s);
      if (promote) {
        acc[r] = _mm512_add_ps(acc[r], p[r]);
        p[r] = _mm512_setzero_ps();
      }
    }
    if (over) return false;
    if (promote) c = 0;
  }
  const __mmask16 cols = (__mmask16)((1u << ncols) - 1);
  for (int r = 0; r < R; ++r) {
    // + 0: a zero result is +0; inf + -inf in acc: one NaN encoding
    const __m512 o = _mm512_add_ps(s.promote > 0 ? acc[r] : p[r], _mm512_setzero_ps());
    _mm512_mask_storeu_ps(out + r * ldo, cols,
                          _mm512_mask_mov_ps(o, _mm512_cmp_ps_mask(o, o, _CMP_UNORD_Q),
                                             _mm512_castsi512_ps(i32((int)F32::QNAN))));
  }
  return true;
}

// Rows [i0, i1) (i0 a multiple of TR) of one batch: a (M, K); b in panels of FW columns, each
// (K, FW) contiguous; ea8, eb8 their exponents (Exps8), off their offset.
template <int MODE>
void rows_fast(const float* a, const int8_t* ea8, const float* b, const int8_t* eb8, int off,
               int64_t K, int64_t N, int64_t i0, int64_t i1, const qtensor::AccumSpec& s,
               const FastLimits& lim, float* out) {
  for (int64_t j = 0; j < N; j += FW) {
    const float* bj = b + j * K;  // the panel of columns j .. j + FW - 1
    const int nc = (int)std::min<int64_t>(FW, N - j);
    for (int64_t i = i0; i < i1; i += TR) {
      const int R = (int)std::min<int64_t>(TR, i1 - i);
      const float* ai = a + i * K;
      const Exps8 e{ea8 + i * K, eb8 + j * K, off};
      float* oi = out + i * N + j;
      bool ok;
      switch (R) {
        case 8: ok = fast_tile<MODE, 8>(ai, bj, e, K, s, lim, oi, N, nc); break;
        case 7: ok = fast_tile<MODE, 7>(ai, bj, e, K, s, lim, oi, N, nc); break;
        case 6: ok = fast_tile<MODE, 6>(ai, bj, e, K, s, lim, oi, N, nc); break;
        case 5: ok = fast_tile<MODE, 5>(ai, bj, e, K, s, lim, oi, N, nc); break;
        case 4: ok = fast_tile<MODE, 4>(ai, bj, e, K, s, lim, oi, N, nc); break;
        case 3: ok = fast_tile<MODE, 3>(ai, bj, e, K, s, lim, oi, N, nc); break;
        case 2: ok = fast_tile<MODE, 2>(ai, bj, e, K, s, lim, oi, N, nc); break;
        default: ok = fast_tile<MODE, 1>(ai, bj, e, K, s, lim, oi, N, nc); break;
      }
      if (ok) continue;
      // rare: the double path, on the 8-lane halves of the panel, with int32 exponents
      std::vector<int> eb(K * FW), ea(K);
      for (int64_t k = 0; k < K * FW; ++k) eb[k] = qtensor::acc_exp_f32(bj[k]);
      float tmp[FW];
      for (int r = 0; r < R; ++r) {
        for (int64_t k = 0; k < K; ++k) ea[k] = qtensor::acc_exp_f32(ai[r * K + k]);
        for (int h = 0; h < FW; h += W)
          dot_lanes<MODE>(ai + r * K, ea.data(), bj + h, eb.data() + h, FW, K, s, tmp + h);
        for (int w = 0; w < nc; ++w) oi[r * N + w] = tmp[w];
      }
    }
  }
}
