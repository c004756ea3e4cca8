// The AVX-512 vector operations of the fast path (accum_fast.h): 16 float32/int32 lanes, included
// by csrc/cpu/accum.cpp inside namespace accum_avx512 under `#pragma GCC target("avx512...")`,
// before accum_fast.h. accum_fast_avx2.h defines the same names for 8 lanes; accum_fast.h's
// algorithm uses only these. Thin wrappers of single intrinsics, so that the algorithm compiles
// to the instructions it had before the AVX2 port; the ISA's own tricks (embedded rounding,
// getexp/scalef, lzcnt, masks) stay in the few functions that differ.

constexpr int FW = 16;  // output columns per tile: the float32 lanes of a zmm register
constexpr int KU = 1;  // k-loops unrolled KU times (accum_fast.h)
using VF = __m512;
using VI = __m512i;
using VM = __mmask16;  // one bit per lane

inline VI i32(int x) { return _mm512_set1_epi32(x); }
inline VI izero() { return _mm512_setzero_si512(); }
inline VI addi(VI x, VI y) { return _mm512_add_epi32(x, y); }
inline VI subi(VI x, VI y) { return _mm512_sub_epi32(x, y); }
inline VI mini(VI x, VI y) { return _mm512_min_epi32(x, y); }
inline VI maxi(VI x, VI y) { return _mm512_max_epi32(x, y); }
inline VI andi(VI x, VI y) { return _mm512_and_si512(x, y); }
inline VI absi(VI x) { return _mm512_abs_epi32(x); }
inline VI shl23(VI x) { return _mm512_slli_epi32(x, 23); }
inline VI srl1(VI x) { return _mm512_srli_epi32(x, 1); }
inline VI srlv(VI x, VI n) { return _mm512_srlv_epi32(x, n); }
inline VI sllv(VI x, VI n) { return _mm512_sllv_epi32(x, n); }
inline VF fzero() { return _mm512_setzero_ps(); }
inline VF loadf(const float* x) { return _mm512_loadu_ps(x); }
inline VF bcastf(float x) { return _mm512_set1_ps(x); }
inline VF mulf(VF x, VF y) { return _mm512_mul_ps(x, y); }
inline VF addf(VF x, VF y) { return _mm512_add_ps(x, y); }
inline VI asi(VF x) { return _mm512_castps_si512(x); }
inline VF asf(VI x) { return _mm512_castsi512_ps(x); }
inline VM gti(VI x, VI y) { return _mm512_cmpgt_epi32_mask(x, y); }
inline VM lti(VI x, VI y) { return _mm512_cmplt_epi32_mask(x, y); }
inline VM mnone() { return 0; }
inline VM mor(VM x, VM y) { return x | y; }
inline VM mand(VM x, VM y) { return x & y; }
inline VM absge(VF x, float y) {  // |x| >= y
  return _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(y), _CMP_GE_OQ);
}
inline bool many(VM m) { return m != 0; }

// fast_tile's checks of the rows' emax E and scale exponents sh: E > limit, sh < 1 (masks)
struct ShCheck {
  VM over, small;
};
inline ShCheck sh_check_init() { return {0, 0}; }
inline void sh_check(ShCheck& c, VI E, VI sh, VI limit) {
  c.over = mor(c.over, gti(E, limit));
  c.small = mor(c.small, lti(sh, i32(1)));
}
inline bool sh_over(const ShCheck& c, VI, VI) { return many(c.over); }
inline bool sh_small(const ShCheck& c) { return many(c.small); }

template <int MODE>
inline VI cvt_round(VF x) {  // float32 to int32 with the alignment rounding
  return _mm512_cvt_roundps_epi32(x, kRoundImm<MODE>);  // accum_lanes.h
}

// p's alignment exponent floor(log2|p|): no clamp at -126 is needed, since the fast path's
// partials are multiples of 2^(lo - F) >= 2^-126 (lo: the smallest product exponent,
// fast_path_ok), so never subnormal; p == 0 gives INT_MIN (getexp: -inf), below every exponent,
// as the model's kAccZeroExp
inline VI partial_exp(VF p) { return _mm512_cvtps_epi32(_mm512_getexp_ps(p)); }
// the same clamped at emin (a narrower accumulator's: FP16 -14), ezero where p == 0
inline VI partial_exp_fix(VF p, int emin, int ezero) {
  return _mm512_mask_mov_epi32(_mm512_max_epi32(partial_exp(p), i32(emin)),
                               _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_EQ_OQ),
                               i32(ezero));
}

// p's term round(p * 2^Fe) (acc_finish with acc_in_alignment): below 2^(F + 1) in magnitude
template <int MODE>
inline VI p_term(VF p, VI Fe) {
  const VF x = _mm512_scalef_ps(p, _mm512_cvtepi32_ps(Fe));  // F - em, exact: |em| <= 100000
  VI pt = cvt_round<MODE>(x);
  if (MODE == 1)  // floor of a negative p whose subnormal term was flushed to -0 (FTZ): -1
    pt = _mm512_mask_sub_epi32(pt, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ) &
                                       _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_LT_OQ),
                               pt, i32(1));
  return pt;
}

inline VI round_magnitude(VI aT, VI d, bool nearest);  // accum_fast.h

// sign(T) * R: T rounded to acc_man bits below its leading bit (accum_fast.h's finish; KIND:
// fin_kind, or -1: from s; kFinishVariants is false, fast_tile's branches stay in the row loop,
// lean_tile passes 0)
constexpr bool kFinishVariants = false;
// dmin: the least number of dropped bits (a narrower accumulator's subnormal grid; kind 2 only)
template <int KIND>
inline VF round_acc(VI T, const qtensor::AccumSpec& s, VI dmin) {
  // toward zero: the conversion truncates to 24 bits, the mask to fewer
  if (KIND == 0 || (KIND < 0 && s.acc_round == 0)) {
    const VF r = _mm512_cvt_roundepi32_ps(T, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(r), i32(-(1 << (23 - s.acc_man)))));
  }
  if (s.acc_man == 23)  // nearest to 24 bits: the conversion itself
    return _mm512_cvt_roundepi32_ps(T, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // nearest to fewer bits, on |T| (no double rounding): the bits below 2^d go,
  // d = floor(log2|T|) - acc_man (at least 0)
  const __m512i aT = _mm512_abs_epi32(T);
  const __m512i d = _mm512_max_epi32(
      _mm512_sub_epi32(i32(31 - s.acc_man), _mm512_lzcnt_epi32(aT)), dmin);
  const __m512i R = round_magnitude(aT, d, true);  // unsigned: up to 2^31
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(  // (T & SIGN) | R as float
      T, i32((int)qtensor::F32::SIGN), _mm512_castps_si512(_mm512_cvtepu32_ps(R)), 0xEA));
}
// r * 2^-Fe (exact: accum_fast.h's finish); T: r's integer (unused here)
inline VF scale_back(VF r, VI, VI Fe) {
  return _mm512_scalef_ps(r, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtepi32_ps(Fe)));
}

// accum_fast.h's finish_wide: float32 of S + S2 + pt (each int32) summed in doubles (exact),
// the low mbits bits of each double dropped (toward zero; 0: none) and converted to nearest
inline VF sum3_round(VI S, VI S2, VI pt, int mbits) {
  __m256 h[2];
  const __m512i mask = _mm512_set1_epi64(mbits ? -(int64_t{1} << mbits) : -1);
  for (int i = 0; i < 2; ++i) {
    const auto half = [i](VI x) {
      return _mm512_cvtepi32_pd(i ? _mm512_extracti64x4_epi64(x, 1) : _mm512_castsi512_si256(x));
    };
    const __m512d t = _mm512_add_pd(_mm512_add_pd(half(S), half(S2)), half(pt));
    h[i] = _mm512_cvtpd_ps(_mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(t), mask)));
  }
  return _mm512_insertf32x8(_mm512_castps256_ps512(h[0]), h[1], 1);
}

// The tile's exponent maxima (accum_fast.h's fast_tile): int8 lanes, FR = 4 rows x 16 columns,
// row q of a group in 128-bit lane q; a's exponents stored once (EA), spread by a shuffle.
constexpr int EA = 1;
inline void store_a4x4(int8_t* out, __m128i x) { _mm_storeu_si128((__m128i*)out, x); }
inline VI e8_init() { return _mm512_set1_epi8(-128); }
inline VI e8_b(const int8_t* eb) {  // b's 16 exponents at k, in every 128-bit lane
  return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)eb));
}
inline VI e8_a(const int8_t* ea) {  // a's 4 exponents at k: byte q to all 16 bytes of lane q
  int32_t a4;
  std::memcpy(&a4, ea, 4);
  const __m512i spread = _mm512_set_epi32(0x03030303, 0x03030303, 0x03030303, 0x03030303,
                                          0x02020202, 0x02020202, 0x02020202, 0x02020202,
                                          0x01010101, 0x01010101, 0x01010101, 0x01010101, 0, 0,
                                          0, 0);
  return _mm512_shuffle_epi8(_mm512_set1_epi32(a4), spread);
}
inline VI e8_max(VI m, VI a, VI b) { return _mm512_max_epi8(m, _mm512_adds_epi8(a, b)); }
// row q's emax, int32: e8 + off, kAccZeroExp where every product was zero (-128)
inline VI e8_row(VI E8, int q, int off) {
  const __m512i e8 = _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(E8, q));
  return _mm512_mask_add_epi32(i32(qtensor::kAccZeroExp), _mm512_cmpneq_epi32_mask(e8, i32(-128)),
                               e8, i32(off));
}

// out[0:ncols] = o, NaN as the one encoding
inline void store_row(float* out, VF o, int ncols) {
  _mm512_mask_storeu_ps(out, (__mmask16)((1u << ncols) - 1),
                        _mm512_mask_mov_ps(o, _mm512_cmp_ps_mask(o, o, _CMP_UNORD_Q),
                                           _mm512_castsi512_ps(i32((int)qtensor::F32::QNAN))));
}

// The operand passes of the glue (accum_fast.h's scan and exps8_*).

// scan's vector part: x[0:done], done a multiple of 16
inline ScanBits scan_lanes(const float* x, int64_t n) {
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
  return {bad == 0, (uint32_t)_mm512_reduce_or_epi32(man),
          (uint32_t)_mm512_reduce_min_epu32(lo), (uint32_t)_mm512_reduce_max_epu32(hi), i};
}

// Exps8 of 16 normal-or-zero values whose largest exponent is hi
inline __m128i exps8_16(const float* x, int hi, int emin) {
  const __m512i u = _mm512_and_si512(_mm512_loadu_si512(x), i32((int)qtensor::F32::ABS));
  const __m512i e = _mm512_sub_epi32(_mm512_max_epi32(_mm512_srli_epi32(u, 23), i32(emin + 127)),
                                     i32(127 + hi));
  return _mm512_cvtepi32_epi8(
      _mm512_mask_mov_epi32(e, _mm512_testn_epi32_mask(u, u), i32(-128)));
}
