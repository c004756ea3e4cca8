// The float32/int32 fast path of qtensor::accum_matmul (group == 1), included by
// csrc/cpu/accum.cpp twice: inside namespace accum_avx512 under `#pragma GCC target("avx512...")`
// after accum_fast_avx512.h, and inside accum_avx2 under ("avx2") after accum_fast_avx2.h. Those
// define the vector operations (VF, VI, VM, FW lanes and the functions this file calls) and a few
// layout constants (EA: copies of a's int8 exponents, KU: k-loop unrolling); this file is the
// algorithm, one copy for both. accum_lanes.h comes first (its dot_lanes is the fallback).
// No #include here.
//
// Used only where accum.cpp's fast_path_ok holds for the operands: all finite, normal or zero,
// significands of at most 24 bits between a and b (fp8/fp6/fp4/bf16/fp16 values), so every
// product a*b is exact and normal (or zero) in float32, and a chunk's scaled terms sum exactly in
// int32 (or in two int32 halves, finished in doubles: fast_path_ok's split). Then the model's term round(a*b * 2^(frac_bits - emax)) is a float32 product scaled by
// an exact power of two (an int32 add to its exponent bits, or a float32 multiply), a
// float32-to-int32 conversion with the alignment rounding and an int32 add: 4 instructions per FW
// products on AVX-512 (a's broadcast folds into the multiply), 5 on AVX2 (6 for floor), against
// the double path's ~15 per 8. The per-chunk finish (p's
// own term, the normalization to the accumulator format, promotion) is integer/float32
// arithmetic on FW lanes, exact: the partials are float32 values.
//
// The scaled terms are exact only while 2^(frac_bits - emax) times the smallest product stays a
// normal float32, and the finish only while the sums stay in int32; emax can grow with the
// partial p (acc_in_alignment), so every chunk checks both, and a tile that fails a check is
// redone by the double path (dot_lanes).

constexpr int FR = 4;  // rows per exponent group (Exps8): 4 x FW int8 lanes
constexpr int TR = 8;  // rows per tile (two groups): each loaded b vector serves TR rows

// |T|'s bits below 2^d dropped: toward zero, or to nearest (ties to even: + (2^(d-1) - 1) + the
// kept bits' parity); d = 0 keeps |T|. Unsigned: up to 2^31.
inline VI round_magnitude(VI aT, VI d, bool nearest) {
  if (nearest) {
    const VI low = subi(sllv(i32(1), d), i32(1));
    const VI odd = andi(andi(srlv(aT, d), low), i32(1));
    aT = addi(addi(aT, srl1(low)), odd);
  }
  return sllv(srlv(aT, d), d);
}

// qtensor::acc_finish of FW lanes in int32/float32: the new partial from S (the products' sum,
// units of 2^(em - F)), em and the old partial p. The partials are float32 values (at most 24
// significant bits); the sum T of S and p's term is below 2^31 (fast_tile checks it). The result
// v = T * 2^(em - F) rounded to acc_man bits below its leading bit is R * 2^(em - F), R the
// integer T so rounded, and exact in float32. The model's clamp of e(v) at -126 never binds
// here: v is a multiple of 2^(lo - F) >= 2^-126 (lo: the smallest product exponent,
// fast_path_ok), and so is every partial; v < 2^31 * 2^(em - F) <= 2^127 (em <= F + 96).
// FIN: s's acc_in_alignment (bit 0) and accumulator rounding (fin_kind, bits 1-2) as template
// constants (kFinishVariants: the ISA's fast_tile instantiates each), or -1: read from s.
// A narrower accumulator (fast_path_ok's narrow: FP16) rounds T at least to its subnormal grid,
// 2^(acc_emin - acc_man), i.e. d >= acc_emin - acc_man + Fe in T's units (dmin; round_acc's
// kind 2 only); its overflow (|v| >= 2^(acc_emax + 1): inf) sets over, and the tile is redone.
template <int MODE, int FIN>
inline VF finish(VI T, VI em, VF p, const qtensor::AccumSpec& s, VM& over) {
  const bool in_alignment = FIN < 0 ? s.acc_in_alignment : (FIN & 1) != 0;
  const VI Fe = subi(i32(s.frac_bits), em);  // F - em
  if (in_alignment) T = addi(T, p_term<MODE>(p, Fe));  // below 2^(F + 1) in magnitude
  const bool narrow = s.acc_emin != qtensor::kAccExpMin || s.acc_emax != 127;
  const VI dmin = narrow ? maxi(addi(Fe, i32(s.acc_emin - s.acc_man)), izero()) : izero();
  const VF r = round_acc<FIN < 0 ? -1 : FIN / 2>(T, s, dmin);
  // on the subnormal grid a nonzero T can round to 0 (r = +-0): scale_back tests r itself, and
  // + 0 makes it +0 (the model's zero; the partials are never -0, see p_term)
  VF v = scale_back(r, narrow ? andi(asi(r), i32((int)qtensor::F32::ABS)) : T, Fe);
  if (narrow) {
    v = addf(v, fzero());
    over = mor(over, absge(v, std::ldexp(1.0f, s.acc_emax + 1)));
  }
  return in_alignment ? v : addf(p, v);
}
// finish for split sums (fast_path_ok's split): T = S + S2 + p's term in doubles (below 2^34,
// exact), rounded to acc_man bits toward zero (the doubles' low bits masked) or to nearest 24
// bits (the conversion), then scaled back exactly (the result is a normal float32, as finish's)
template <int MODE>
inline VF finish_wide(VI S, VI S2, VI em, VF p, const qtensor::AccumSpec& s) {
  const VI Fe = subi(i32(s.frac_bits), em);
  const VI pt = s.acc_in_alignment ? p_term<MODE>(p, Fe) : izero();
  const VF r = sum3_round(S, S2, pt, s.acc_round == 0 ? 52 - s.acc_man : 0);
  const VF v = scale_back(r, asi(r), Fe);  // r == +0 exactly where T == 0
  return s.acc_in_alignment ? v : addf(p, v);
}
inline int fin_kind(const qtensor::AccumSpec& s) {  // 0: toward zero, 1: nearest, 24 bits, 2: fewer
  return s.acc_round == 0 ? 0 : (s.acc_man == 23 ? 1 : 2);
}

// The chunk's new partials of R rows, acc += p where it promotes; over: sums past lim.sums.
// S2: the second halves' sums of split chunks (finish_wide), else nullptr.
template <int MODE, int R, int FIN>
inline void finish_rows(const VI* S, const VI* S2, const VI* E, VF* p, VF* acc, bool promote,
                        bool check_sums, VI smax, VM& over, const qtensor::AccumSpec& s) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (check_sums) over = mor(over, gti(absi(S[r]), smax));
    p[r] = S2 ? finish_wide<MODE>(S[r], S2[r], E[r], p[r], s)
              : finish<MODE, FIN>(S[r], E[r], p[r], s, over);
    if (promote) {
      acc[r] = addf(acc[r], p[r]);
      p[r] = fzero();
    }
  }
}

// The chunk's terms summed in int32: S[r] += round(a[r][k] * b[k] * 2^sh[r]) for k in [k0, k1).
// SHIFT: the scaling is an int32 add of sh << 23 to the product's bits (exact for a normal
// product and term; a zero product gives +-2^(sh - 127), which rounds to 0 toward zero or to
// nearest when 1 <= sh <= 126); else a float32 multiply by 2^sh.
template <int MODE, int R, bool SHIFT>
inline void chunk_terms(const float* a, int64_t K, const float* b, int64_t k0, int64_t k1,
                        const VI* sh, VI* S) {
  VI sc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    sc[r] = SHIFT ? shl23(sh[r]) : shl23(addi(sh[r], i32(127)));
    S[r] = izero();
  }
#pragma GCC unroll KU
  for (int64_t k = k0; k < k1; ++k) {
    const VF bk = loadf(b + k * FW);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const VF t = mulf(bk, bcastf(a[r * K + k]));
      const VF x = SHIFT ? asf(addi(asi(t), sc[r])) : mulf(t, asf(sc[r]));
      S[r] = addi(S[r], cvt_round<MODE>(x));
    }
  }
}

// The exponents of the fast path: int8, offset so that the largest nonzero one is 0, -128 for
// zeros (a sum with a zero saturates there); a's for FR rows interleaved, each EA times (the
// ISA's layout of E8), (K, FR * EA) per group, b's (K, FW) per panel. One saturating add and max
// per k covers the FR x FW lanes.
struct Exps8 {
  const int8_t* a;  // the tile's (K, FR * EA)
  const int8_t* b;  // the panel's (K, FW)
  int off;          // the sum of the two offsets: emax = max8 + off
};

// The glue's passes over the operands, vectorized here.

// The Range of x[0:n].
inline Range scan(const float* x, int64_t n) {
  ScanBits r = scan_lanes(x, n);
  for (int64_t i = r.done; i < n; ++i) {
    const uint32_t u = qtensor::f2u(x[i]) & qtensor::F32::ABS, be = u >> 23;
    if (u == 0) continue;
    r.ok &= be != 0 && be != 255;
    r.man |= u;
    r.lo = std::min(r.lo, be);
    r.hi = std::max(r.hi, be);
  }
  return Range{r.ok, r.man & qtensor::F32::MANMASK, r.lo == 255 ? INT_MAX : (int)r.lo - 127,
               r.hi == 0 ? INT_MIN : (int)r.hi - 127};
}

// Exps8 of normal-or-zero x whose largest (clamped) exponent is hi, each clamped at emin (the
// input format's minimum normal exponent): one value (exps8_16: 16)
inline int8_t exps8_1(float x, int hi, int emin) {
  const uint32_t u = qtensor::f2u(x) & qtensor::F32::ABS;
  return (int8_t)(u == 0 ? -128 : std::max((int)(u >> 23) - 127, emin) - hi);
}
// x[0:n] flat (b's panels)
inline void exps8_flat(const float* x, int64_t n, int hi, int emin, int8_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm_storeu_si128((__m128i*)(out + i), exps8_16(x + i, hi, emin));
  for (; i < n; ++i) out[i] = exps8_1(x[i], hi, emin);
}
// rows rows (<= FR) of x (row stride C) to (C, FR * EA), interleaved; missing rows as zeros
inline void exps8_rows(const float* x, int64_t rows, int64_t C, int hi, int emin, int8_t* out) {
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    __m128i r[FR];
    for (int i = 0; i < FR; ++i)
      r[i] = i < rows ? exps8_16(x + i * C + c, hi, emin) : _mm_set1_epi8(-128);
    static_assert(FR == 4, "a 4 x 16 byte transpose");
    const __m128i t0 = _mm_unpacklo_epi8(r[0], r[1]), t1 = _mm_unpackhi_epi8(r[0], r[1]);
    const __m128i t2 = _mm_unpacklo_epi8(r[2], r[3]), t3 = _mm_unpackhi_epi8(r[2], r[3]);
    store_a4x4(out + 4 * c * EA, _mm_unpacklo_epi16(t0, t2));
    store_a4x4(out + (4 * c + 16) * EA, _mm_unpackhi_epi16(t0, t2));
    store_a4x4(out + (4 * c + 32) * EA, _mm_unpacklo_epi16(t1, t3));
    store_a4x4(out + (4 * c + 48) * EA, _mm_unpackhi_epi16(t1, t3));
  }
  for (; c < C; ++c)
    for (int i = 0; i < FR; ++i)
      for (int j = 0; j < EA; ++j)
        out[(4 * c + i) * EA + j] = i < rows ? exps8_1(x[i * C + c], hi, emin) : -128;
}

// out[r][0:ncols] for R <= TR rows of a (row stride K) times one (K, FW) panel of b, exponents
// e. False (out untouched) where an emax passed lim.emax or a sum came near 2^31: the tile
// needs dot_lanes.
template <int MODE, int R>
bool fast_tile(const float* a, const float* b, const Exps8& e, int64_t K,
               const qtensor::AccumSpec& s, const FastLimits& lim, float* out, int64_t ldo,
               int ncols) {
  using namespace qtensor;
  VF p[R], acc[R];
  for (int r = 0; r < R; ++r) p[r] = acc[r] = fzero();
  const VI F = i32(s.frac_bits), limit = i32(lim.emax), smax = i32(lim.sums);
  const bool check_sums = lim.sums != INT32_MAX;
  int c = 0;
  for (int64_t k0 = 0; k0 < K; k0 += s.chunk) {
    const int64_t k1 = K - k0 < s.chunk ? K : k0 + s.chunk;
    // emax per lane: max_k ea[k] + eb[k], group r / FR, row r % FR of E8 for row r, and p's
    // exponent (if it takes part)
    constexpr int G = (R + FR - 1) / FR;  // exponent groups
    VI E8[G];
    for (int g = 0; g < G; ++g) E8[g] = e8_init();
#pragma GCC unroll KU
    for (int64_t k = k0; k < k1; ++k) {
      const VI ebk = e8_b(e.b + k * FW);
      for (int g = 0; g < G; ++g) E8[g] = e8_max(E8[g], e8_a(e.a + (g * K + k) * FR * EA), ebk);
    }
    VI E[R];
    VM low = mnone();  // lim.zcheck: a lane with nonzero terms, all below e_zero
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      E[r] = e8_row(E8[r / FR], r % FR, e.off);
      // pfix: p's exponent clamped at acc_emin, e_zero for p == 0 (the model's acc_chunk)
      if (s.acc_in_alignment)
        E[r] = maxi(E[r], lim.pfix ? partial_exp_fix(p[r], s.acc_emin, s.e_zero)
                                   : partial_exp(p[r]));
      if (lim.zcheck)
        low = mor(low, mand(gti(E[r], i32(qtensor::kAccZeroExp)), lti(E[r], i32(s.e_zero))));
    }
    // there a zero product or padding slot (at e_zero) would set emax: the double path
    if (lim.zcheck && many(low)) return false;
    // the scales 2^sh, sh = F - emax: at least -126 below the limit, and at most 126 where a
    // product is nonzero (fast_path_ok); clamped there for the others, whose scale multiplies
    // zeros (all-zero lanes: kAccZeroExp or partial_exp's zero, whose result is 0 at any scale)
    VI sh[R];
    ShCheck check = sh_check_init();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      sh[r] = mini(subi(F, E[r]), i32(126));
      sh_check(check, E[r], sh[r], limit);
    }
    if (sh_over(check, F, limit)) return false;  // an emax past lim.emax
    VM over = mnone();  // a sum past lim.sums, an overflow of a narrow accumulator
    VI S[R], S2[R];
    // split (lim.split): the chunk's first lim.half terms in S, the others in S2
    const int64_t km = lim.split ? std::min(k1, k0 + lim.half) : k1;
    if (MODE != 1 && !sh_small(check)) {  // every sh >= 1
      chunk_terms<MODE, R, true>(a, K, b, k0, km, sh, S);
      if (lim.split) chunk_terms<MODE, R, true>(a, K, b, km, k1, sh, S2);
    } else {
      chunk_terms<MODE, R, false>(a, K, b, k0, km, sh, S);
      if (lim.split) chunk_terms<MODE, R, false>(a, K, b, km, k1, sh, S2);
    }
    const VI* S2p = lim.split ? S2 : nullptr;
    const bool promote = s.promote > 0 && (++c == s.promote || k1 == K);
    if (!kFinishVariants || lim.split) {
      finish_rows<MODE, R, -1>(S, S2p, E, p, acc, promote, check_sums, smax, over, s);
    } else {  // the spec's branches out of the row loop
#define QT_FINISH_ROWS(FIN) \
  finish_rows<MODE, R, FIN>(S, nullptr, E, p, acc, promote, check_sums, smax, over, s)
      switch ((int)s.acc_in_alignment + 2 * fin_kind(s)) {
        case 0: QT_FINISH_ROWS(0); break;
        case 1: QT_FINISH_ROWS(1); break;
        case 2: QT_FINISH_ROWS(2); break;
        case 3: QT_FINISH_ROWS(3); break;
        case 4: QT_FINISH_ROWS(4); break;
        default: QT_FINISH_ROWS(5); break;
      }
#undef QT_FINISH_ROWS
    }
    if (many(over)) return false;
    if (promote) c = 0;
  }
  // + 0: a zero result is +0; inf + -inf in acc: one NaN encoding (store_row)
  for (int r = 0; r < R; ++r)
    store_row(out + r * ldo, addf(s.promote > 0 ? acc[r] : p[r], fzero()), ncols);
  return true;
}

// fast_tile for the datapath of every NVIDIA preset on a full tile of TR rows: alignment toward
// zero (MODE 0), the partial in the alignment, its result toward zero (fin_kind 0), a float32
// accumulator (no narrow format, no e_zero check, no split or checked sums: lean_ok). The same
// steps as fast_tile, bit for bit, without its run-time branches per row and chunk (which cost
// most at small chunks: 4 products per finish on Volta fp16 and Ampere tf32), the emax checks
// taken once per chunk on the rows' largest emax, and CH > 0 (the chunk as a constant) unrolls
// the chunk's k-loops (0: s.chunk at run time); a full chunk whose scales are exponent adds runs
// row by row, each row's terms then its finish (an int32 sum of the same terms: the same S).
// Measured (benchmarks/RESULTS.md): 1.2-1.5x fast_tile's speed at 4-product chunks.
inline bool lean_ok(const qtensor::AccumSpec& s, const FastLimits& lim) {
  return s.align_round == 0 && s.acc_in_alignment && fin_kind(s) == 0 && !lim.split &&
         !lim.zcheck && !lim.pfix && lim.sums == INT32_MAX &&
         s.acc_emin == qtensor::kAccExpMin && s.acc_emax == 127;
}
template <int CH>
bool lean_tile(const float* a, const float* b, const Exps8& e, int64_t K,
               const qtensor::AccumSpec& s, const FastLimits& lim, float* out, int64_t ldo,
               int ncols) {
  constexpr int R = TR, G = R / FR;
  VF p[R], acc[R];
  for (int r = 0; r < R; ++r) p[r] = acc[r] = fzero();
  const VI F = i32(s.frac_bits), limit = i32(lim.emax), Fm1 = i32(s.frac_bits - 1);
  const int64_t chunk = CH > 0 ? CH : s.chunk;
  const bool promoting = s.promote > 0;
  int c = 0;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = K - k0 < chunk ? K : k0 + chunk;
    // the chunk's emax per lane (fast_tile's E8 and E, with p's exponent)
    VI E8[G];
    for (int g = 0; g < G; ++g) E8[g] = e8_init();
    const auto emax_k = [&](int64_t k) {
      const VI ebk = e8_b(e.b + k * FW);
      for (int g = 0; g < G; ++g) E8[g] = e8_max(E8[g], e8_a(e.a + (g * K + k) * FR * EA), ebk);
    };
    if (CH > 0 && k1 - k0 == CH) {
#pragma GCC unroll 32
      for (int64_t k = k0; k < k0 + CH; ++k) emax_k(k);
    } else {
      for (int64_t k = k0; k < k1; ++k) emax_k(k);
    }
    VI E[R], sh[R];
    VI top = i32(INT_MIN);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      E[r] = maxi(e8_row(E8[r / FR], r % FR, e.off), partial_exp(p[r]));
      top = maxi(top, E[r]);
      sh[r] = mini(subi(F, E[r]), i32(126));
    }
    if (many(gti(top, limit))) return false;  // an emax past lim.emax: the double path
    // SHIFT where every sh >= 1 (every emax <= F - 1)
    const bool shift = !many(gti(top, Fm1));
    const bool promote = promoting && (++c == s.promote || k1 == K);
    // finish<0, 1> of row r from its sum Sr: T = Sr + p's term, toward zero, scaled back
    const auto finish_row = [&](int r, VI Sr) {
      const VI Fe = subi(F, E[r]);
      const VI T = addi(Sr, p_term<0>(p[r], Fe));
      p[r] = scale_back(round_acc<0>(T, s, izero()), T, Fe);
      if (promote) {
        acc[r] = addf(acc[r], p[r]);
        p[r] = fzero();
      }
    };
    if (CH > 0 && k1 - k0 == CH && shift) {
      // the common case row by row, each row's terms then its finish: few values live at a
      // time (no spills of the 8 rows' sums, scales and exponents between the two loops)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const VI sc = shl23(sh[r]);
        VI Sr = izero();
#pragma GCC unroll 32
        for (int k = 0; k < CH; ++k) {
          const VF t = mulf(loadf(b + (k0 + k) * FW), bcastf(a[r * K + k0 + k]));
          Sr = addi(Sr, cvt_round<0>(asf(addi(asi(t), sc))));
        }
        finish_row(r, Sr);
      }
    } else {
      VI S[R];
      if (shift) chunk_terms<0, R, true>(a, K, b, k0, k1, sh, S);
      else chunk_terms<0, R, false>(a, K, b, k0, k1, sh, S);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) finish_row(r, S[r]);
    }
    if (promote) c = 0;
  }
  for (int r = 0; r < R; ++r)
    store_row(out + r * ldo, addf(promoting ? acc[r] : p[r], fzero()), ncols);
  return true;
}

// Rows [i0, i1) (i0 a multiple of TR) of one batch: a (M, K); b in panels of FW columns, each
// (K, FW) contiguous; ea8, eb8 their exponents (Exps8), off their offset; eva, evb: per-element
// clamps in a's and b's layouts (nullptr: s.a_emin, s.b_emin), for the tiles redone.
template <int MODE>
void rows_fast(const float* a, const int8_t* ea8, const float* b, const int8_t* eb8, int off,
               int64_t K, int64_t N, int64_t i0, int64_t i1, const qtensor::AccumSpec& s,
               const FastLimits& lim, float* out, const int* eva, const int* evb) {
  const bool lean = lean_ok(s, lim);
  for (int64_t j = 0; j < N; j += FW) {
    const float* bj = b + j * K;  // the panel of columns j .. j + FW - 1
    const int nc = (int)std::min<int64_t>(FW, N - j);
    for (int64_t i = i0; i < i1; i += TR) {
      const int R = (int)std::min<int64_t>(TR, i1 - i);
      const float* ai = a + i * K;
      const Exps8 e{ea8 + i * K * EA, eb8 + j * K, off};
      float* oi = out + i * N + j;
      bool ok;
      if (MODE == 0 && R == TR && lean) {
        switch (s.chunk) {
          case 4: ok = lean_tile<4>(ai, bj, e, K, s, lim, oi, N, nc); break;
          case 8: ok = lean_tile<8>(ai, bj, e, K, s, lim, oi, N, nc); break;
          case 16: ok = lean_tile<16>(ai, bj, e, K, s, lim, oi, N, nc); break;
          case 32: ok = lean_tile<32>(ai, bj, e, K, s, lim, oi, N, nc); break;
          default: ok = lean_tile<0>(ai, bj, e, K, s, lim, oi, N, nc); break;
        }
      } else switch (R) {
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
      // rare: the double path, on the W-lane parts of the panel, with int32 exponents
      std::vector<int> eb(K * FW), ea(K);
      for (int64_t k = 0; k < K * FW; ++k)
        eb[k] = qtensor::acc_exp_f32(bj[k], evb ? evb[j * K + k] : s.b_emin);
      float tmp[FW];
      for (int r = 0; r < R; ++r) {
        for (int64_t k = 0; k < K; ++k)
          ea[k] = qtensor::acc_exp_f32(ai[r * K + k], eva ? eva[(i + r) * K + k] : s.a_emin);
        for (int h = 0; h < FW; h += W)
          dot_lanes<MODE>(ai + r * K, ea.data(), bj + h, eb.data() + h, FW, K, s, tmp + h);
        for (int w = 0; w < nc; ++w) oi[r * N + w] = tmp[w];
      }
    }
  }
}

// What accum.cpp's glue calls, for this ISA
constexpr FastKernels kFastKernels = {FW, EA, &scan, &exps8_flat, &exps8_rows,
                                      {&rows_fast<0>, &rows_fast<1>, &rows_fast<2>}};
