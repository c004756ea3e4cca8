// The AVX2 vector operations of the fast path (accum_fast.h): 8 float32/int32 lanes, included by
// csrc/cpu/accum.cpp inside namespace accum_avx2 under `#pragma GCC target("avx2")`, before
// accum_fast.h; the same names as accum_fast_avx512.h.
//
// Without AVX-512's embedded rounding, getexp/scalef, lzcnt and masks:
// - the alignment roundings are cvttps (toward zero), round_ps + cvtt (floor) and cvtps (nearest:
//   the MXCSR default, which the int-to-float conversions here and the float32 adds of every path
//   and of torch assume as well);
// - exponents and powers of two are exponent-field arithmetic, exact because every value it
//   touches is a normal float32 (the products, the partials and the chunk results: accum_fast.h);
//   p's term, which can fall below 2^-126, is set apart there (its rounding is 0, or -1 for
//   floor of a negative p), so it never depends on FTZ/DAZ;
// - the accumulator rounding: toward zero, float(T) moved an ulp toward zero where the
//   conversion rounded away, then masked; to nearest with fewer than 24 bits, integer arithmetic
//   on |T| (accum_fast.h's round_magnitude), its leading bit from the exponent of float(|T|);
// - lane masks are compare results (all-ones lanes);
// - a's exponents are stored spread (EA) and the k-loops unrolled (KU): at 8 lanes the
//   instruction count per product is what limits the speed.
// This file uses AVX2 only: no FMA, the products and scalings are plain multiplies (accum.cpp's
// accum_isa() requires FMA too for its AVX2 level, which the group tiles of accum_lanes.h use).

constexpr int FW = 8;  // output columns per tile: the float32 lanes of a ymm register
constexpr int KU = 4;  // k-loops unrolled 4 times: their loop overhead counts at 8 lanes
using VF = __m256;
using VI = __m256i;
using VM = __m256i;  // all-ones lanes

inline VI i32(int x) { return _mm256_set1_epi32(x); }
inline VI izero() { return _mm256_setzero_si256(); }
inline VI addi(VI x, VI y) { return _mm256_add_epi32(x, y); }
inline VI subi(VI x, VI y) { return _mm256_sub_epi32(x, y); }
inline VI mini(VI x, VI y) { return _mm256_min_epi32(x, y); }
inline VI maxi(VI x, VI y) { return _mm256_max_epi32(x, y); }
inline VI andi(VI x, VI y) { return _mm256_and_si256(x, y); }
inline VI absi(VI x) { return _mm256_abs_epi32(x); }
inline VI shl23(VI x) { return _mm256_slli_epi32(x, 23); }
inline VI srl1(VI x) { return _mm256_srli_epi32(x, 1); }
inline VI srlv(VI x, VI n) { return _mm256_srlv_epi32(x, n); }
inline VI sllv(VI x, VI n) { return _mm256_sllv_epi32(x, n); }
inline VF fzero() { return _mm256_setzero_ps(); }
inline VF loadf(const float* x) { return _mm256_loadu_ps(x); }
inline VF bcastf(float x) { return _mm256_set1_ps(x); }
inline VF mulf(VF x, VF y) { return _mm256_mul_ps(x, y); }
inline VF addf(VF x, VF y) { return _mm256_add_ps(x, y); }
inline VI asi(VF x) { return _mm256_castps_si256(x); }
inline VF asf(VI x) { return _mm256_castsi256_ps(x); }
inline VM gti(VI x, VI y) { return _mm256_cmpgt_epi32(x, y); }
inline VM lti(VI x, VI y) { return _mm256_cmpgt_epi32(y, x); }
inline VM mnone() { return _mm256_setzero_si256(); }
inline VM mor(VM x, VM y) { return _mm256_or_si256(x, y); }
inline VM mand(VM x, VM y) { return _mm256_and_si256(x, y); }
inline VM absge(VF x, float y) {  // |x| >= y
  const __m256 ax = _mm256_and_ps(x, _mm256_castsi256_ps(i32((int)qtensor::F32::ABS)));
  return _mm256_castps_si256(_mm256_cmp_ps(ax, _mm256_set1_ps(y), _CMP_GE_OQ));
}
inline bool many(VM m) { return !_mm256_testz_si256(m, m); }

// fast_tile's checks of the rows' emax E and scale exponents sh = min(F - E, 126): the smallest
// sh of the rows, one min per row; E > limit is sh < F - limit (<= 0, so the clamp keeps it)
struct ShCheck {
  VI min_sh;
};
inline ShCheck sh_check_init() { return {i32(126)}; }
inline void sh_check(ShCheck& c, VI, VI sh, VI) { c.min_sh = mini(c.min_sh, sh); }
inline bool sh_over(const ShCheck& c, VI F, VI limit) { return many(gti(subi(F, limit), c.min_sh)); }
inline bool sh_small(const ShCheck& c) { return many(gti(i32(1), c.min_sh)); }

template <int MODE>
inline VI cvt_round(VF x) {  // float32 to int32 with the alignment rounding
  if (MODE == 0) return _mm256_cvttps_epi32(x);
  if (MODE == 1) return _mm256_cvttps_epi32(_mm256_round_ps(x, _MM_FROUND_TO_NEG_INF |
                                                                   _MM_FROUND_NO_EXC));
  return _mm256_cvtps_epi32(x);
}

inline VI biased_exp(VF x) {  // the exponent field
  return _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 23), i32(255));
}
// p's alignment exponent floor(log2|p|) (never subnormal: see accum_fast_avx512.h); p == 0
// gives -127, below every exponent the fast path meets (products and partials are >= 2^-126)
inline VI partial_exp(VF p) { return _mm256_sub_epi32(biased_exp(p), i32(127)); }
// the same clamped at emin (a narrower accumulator's: FP16 -14), ezero where p == 0
inline VI partial_exp_fix(VF p, int emin, int ezero) {
  return _mm256_blendv_epi8(_mm256_max_epi32(partial_exp(p), i32(emin)), i32(ezero),
                            _mm256_castps_si256(_mm256_cmp_ps(p, _mm256_setzero_ps(),
                                                              _CMP_EQ_OQ)));
}

// p's term round(p * 2^Fe) (acc_finish with acc_in_alignment): below 2^(F + 1) in magnitude.
// p * 2^Fe is p's bits + Fe << 23 where that is normal; where it would be below 2^-126, or p = 0,
// the term is 0 (|p * 2^Fe| < 1/2: every mode rounds it to 0, floor a negative one to -1). The
// partials are never -0 (accum_fast.h's finish makes +0).
template <int MODE>
inline VI p_term(VF p, VI Fe) {
  const __m256i pb = _mm256_castps_si256(p), be = biased_exp(p);
  const __m256i tiny = _mm256_cmpgt_epi32(  // be == 0 or be + Fe < 1
      i32(1), _mm256_min_epi32(be, _mm256_add_epi32(be, Fe)));
  const __m256i x = _mm256_add_epi32(pb, _mm256_slli_epi32(Fe, 23));
  const __m256i pt = _mm256_andnot_si256(tiny, cvt_round<MODE>(_mm256_castsi256_ps(x)));
  if (MODE != 1) return pt;
  return _mm256_add_epi32(pt, _mm256_and_si256(tiny, _mm256_srai_epi32(pb, 31)));  // floor: -1
}

inline VI round_magnitude(VI aT, VI d, bool nearest);  // accum_fast.h
inline int fin_kind(const qtensor::AccumSpec& s);          // accum_fast.h

// sign(T) * R: T rounded to acc_man bits below its leading bit (accum_fast.h's finish). KIND:
// fin_kind(s) as a constant (kFinishVariants: fast_tile instantiates each), -1: from s.
constexpr bool kFinishVariants = true;  // at 8 lanes the spec's branches per row cost ~15%
// dmin: the least number of dropped bits (a narrower accumulator's subnormal grid; kind 2 only)
template <int KIND>
inline VF round_acc(VI T, const qtensor::AccumSpec& s, VI dmin) {
  const int kind = KIND < 0 ? fin_kind(s) : KIND;
  const __m256i man_mask = i32(-(1 << (23 - s.acc_man)));  // outside the branch: one per tile
  if (kind == 0) {  // toward zero: float(T) (to nearest), one ulp toward zero where that
    // went away from zero (int(f) - T of T's sign > 0; exact in wrapping int32, f = +-2^31
    // included), then accum_fast_avx512.h's mask
    const __m256 f = _mm256_cvtepi32_ps(T);
    const __m256i away = _mm256_cmpgt_epi32(
        _mm256_sign_epi32(_mm256_sub_epi32(_mm256_cvttps_epi32(f), T), T), _mm256_setzero_si256());
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_add_epi32(_mm256_castps_si256(f), away), man_mask));
  }
  if (kind == 1) return _mm256_cvtepi32_ps(T);  // nearest to 24 bits: the conversion
  // nearest to fewer bits, on |T| (< 2^31) in integers: d = max(floor(log2|T|) - acc_man, 0),
  // floor(log2|T|) the exponent of float(|T|), less one where the conversion rounded up to the
  // next power of two (|T| >> e == 0); |T| = 0 gives d = 0
  const __m256i aT = _mm256_abs_epi32(T);
  __m256i e = _mm256_sub_epi32(biased_exp(_mm256_cvtepi32_ps(aT)), i32(127));
  e = _mm256_add_epi32(e, _mm256_cmpeq_epi32(_mm256_srlv_epi32(aT, e), _mm256_setzero_si256()));
  const __m256i d = _mm256_max_epi32(_mm256_sub_epi32(e, i32(s.acc_man)), dmin);
  const __m256i R = round_magnitude(aT, d, true);  // unsigned: up to 2^31 (-2^31 as int32)
  return _mm256_castsi256_ps(  // (T & SIGN) | |float(R)|
      _mm256_or_si256(_mm256_and_si256(T, i32((int)qtensor::F32::SIGN)),
                      _mm256_and_si256(_mm256_castps_si256(_mm256_cvtepi32_ps(R)),
                                       i32((int)qtensor::F32::ABS))));
}
// r * 2^-Fe: r's bits - Fe << 23 (r and the result are normal: accum_fast.h's finish) where
// T != 0, else r = +0
inline VF scale_back(VF r, VI T, VI Fe) {
  const __m256i e = _mm256_andnot_si256(_mm256_cmpeq_epi32(T, _mm256_setzero_si256()),
                                        _mm256_slli_epi32(Fe, 23));
  return _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_castps_si256(r), e));
}

// accum_fast.h's finish_wide: float32 of S + S2 + pt (each int32) summed in doubles (exact),
// the low mbits bits of each double dropped (toward zero; 0: none) and converted to nearest
// (the MXCSR default)
inline VF sum3_round(VI S, VI S2, VI pt, int mbits) {
  __m128 h[2];
  const __m256i mask = _mm256_set1_epi64x(mbits ? -(int64_t{1} << mbits) : -1);
  for (int i = 0; i < 2; ++i) {
    const auto half = [i](VI x) {
      return _mm256_cvtepi32_pd(i ? _mm256_extracti128_si256(x, 1) : _mm256_castsi256_si128(x));
    };
    const __m256d t = _mm256_add_pd(_mm256_add_pd(half(S), half(S2)), half(pt));
    h[i] = _mm256_cvtpd_ps(_mm256_castsi256_pd(_mm256_and_si256(_mm256_castpd_si256(t), mask)));
  }
  return _mm256_set_m128(h[1], h[0]);
}

// The tile's exponent maxima (accum_fast.h's fast_tile): int8 lanes, FR = 4 rows x 8 columns,
// row q of a group in bytes 8q .. 8q + 7. a's exponents are stored spread that way (EA = 8
// copies, 32 bytes per k and group; exps8_rows), so that the add takes them from memory: 2
// instructions per k and group instead of 4.
constexpr int EA = 8;
// 4 columns x 4 rows of a's exponents (x, interleaved) as 4 x 32 bytes: byte q of column j to
// bytes 8q .. 8q + 7 of 32-byte block j
inline void store_a4x4(int8_t* out, __m128i x) {
  const __m256i v = _mm256_broadcastsi128_si256(x);
  for (int j = 0; j < 4; ++j) {
    const __m256i spread = _mm256_add_epi8(
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303),
        _mm256_set1_epi8((char)(4 * j)));
    _mm256_storeu_si256((__m256i*)(out + 32 * j), _mm256_shuffle_epi8(v, spread));
  }
}
inline VI e8_init() { return _mm256_set1_epi8(-128); }
inline VI e8_b(const int8_t* eb) {  // b's 8 exponents at k, in every 64-bit lane
  int64_t b8;
  std::memcpy(&b8, eb, 8);
  return _mm256_set1_epi64x(b8);
}
inline VI e8_a(const int8_t* ea) { return _mm256_loadu_si256((const __m256i*)ea); }
inline VI e8_max(VI m, VI a, VI b) { return _mm256_max_epi8(m, _mm256_adds_epi8(a, b)); }
// row q's emax, int32: e8 + off, kAccZeroExp where every product was zero (-128)
inline VI e8_row(VI E8, int q, int off) {
  __m128i h = q < 2 ? _mm256_castsi256_si128(E8) : _mm256_extracti128_si256(E8, 1);
  if (q % 2) h = _mm_srli_si128(h, 8);
  const __m256i e8 = _mm256_cvtepi8_epi32(h);
  return _mm256_blendv_epi8(_mm256_add_epi32(e8, i32(off)), i32(qtensor::kAccZeroExp),
                            _mm256_cmpeq_epi32(e8, i32(-128)));
}

// out[0:ncols] = o, NaN as the one encoding
inline void store_row(float* out, VF o, int ncols) {
  o = _mm256_blendv_ps(o, _mm256_castsi256_ps(i32((int)qtensor::F32::QNAN)),
                       _mm256_cmp_ps(o, o, _CMP_UNORD_Q));
  if (ncols == FW)
    _mm256_storeu_ps(out, o);
  else
    _mm256_maskstore_ps(
        out, _mm256_cmpgt_epi32(i32(ncols), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), o);
}

// The operand passes of the glue (accum_fast.h's scan and exps8_*).

// scan's vector part: x[0:done], done a multiple of 8
inline ScanBits scan_lanes(const float* x, int64_t n) {
  __m256i man = _mm256_setzero_si256(), lo = i32(255), hi = _mm256_setzero_si256();
  __m256i bad = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + i)),
                                       i32((int)qtensor::F32::ABS));
    const __m256i be = _mm256_srli_epi32(u, 23);
    const __m256i zero = _mm256_cmpeq_epi32(u, _mm256_setzero_si256());
    bad = _mm256_or_si256(
        bad, _mm256_andnot_si256(zero, _mm256_or_si256(
                                           _mm256_cmpeq_epi32(be, _mm256_setzero_si256()),
                                           _mm256_cmpeq_epi32(be, i32(255)))));
    man = _mm256_or_si256(man, u);
    lo = _mm256_min_epu32(lo, _mm256_or_si256(be, _mm256_and_si256(zero, i32(255))));
    hi = _mm256_max_epu32(hi, be);
  }
  alignas(32) uint32_t m8[8], l8[8], h8[8];
  _mm256_store_si256((__m256i*)m8, man);
  _mm256_store_si256((__m256i*)l8, lo);
  _mm256_store_si256((__m256i*)h8, hi);
  ScanBits r{(bool)_mm256_testz_si256(bad, bad), 0, 255, 0, i};
  for (int w = 0; w < 8; ++w) {
    r.man |= m8[w];
    r.lo = std::min(r.lo, l8[w]);
    r.hi = std::max(r.hi, h8[w]);
  }
  return r;
}

// Exps8 of 16 normal-or-zero values whose largest exponent is hi (int8 by saturation: they are
// in [-128, 0])
inline __m128i exps8_16(const float* x, int hi, int emin) {
  __m256i e[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i u = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + 8 * h)),
                                       i32((int)qtensor::F32::ABS));
    const __m256i eb = _mm256_max_epi32(_mm256_srli_epi32(u, 23), i32(emin + 127));
    e[h] = _mm256_blendv_epi8(_mm256_sub_epi32(eb, i32(127 + hi)), i32(-128),
                              _mm256_cmpeq_epi32(u, _mm256_setzero_si256()));
  }
  // packs works within 128-bit lanes: x0..3 x8..11 | x4..7 x12..15, reordered to x0..15
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(e[0], e[1]), 0xD8);
  return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
