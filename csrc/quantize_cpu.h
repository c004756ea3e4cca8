// CPU loops of the quantization kernels. Compiled once per instruction set by csrc/cpu/isa_*.cpp
// (baseline, AVX2, AVX-512), each in its own namespace; quantize.cpp picks one at run time (no
// -march flag: the build must run on any x86-64).
// The per-element math comes from qtensor/round.h; the loops below only move data.
// (no include guard on purpose)

using qtensor::index_key;
using qtensor::random_word;

// float32 bit patterns: the sign, |x|'s mask, +Inf, the NaN the kernels write
constexpr uint32_t kSignBit = qtensor::Carrier<uint32_t>::SIGN;
constexpr uint32_t kAbsMask = qtensor::Carrier<uint32_t>::ABS;
constexpr uint32_t kInfBits = qtensor::Carrier<uint32_t>::INF;
constexpr uint32_t kNaNBits = qtensor::Carrier<uint32_t>::QNAN;

// for the per-block functions of blocks(): blocks are short (MX: 32 elements), so a call per
// block, with its arguments through memory, costs (about 6% on an MX row, 4096x4096, 1 thread)
#define QT_BLOCK_FN inline __attribute__((always_inline))

template <typename T> inline uint32_t load_bits(const T* p) { return f2u((float)*p); }
// float data moves as float loads/stores (a memcpy into the output would be a may-alias-anything
// store, which keeps gcc from hoisting the kernel parameters and vectorizing)
template <> inline uint32_t load_bits<float>(const float* p) { return f2u(*p); }
template <typename T> inline void store_bits(T* p, uint32_t b) { *p = T(u2f(b)); }
template <> inline void store_bits<float>(float* p, uint32_t b) { *p = u2f(b); }

// A multi-index over some dims of a strided tensor that tracks the offsets of x, of the output
// and of the logical (row-major) position while it is incremented.
struct Counter {
  int nd = 0;
  int64_t size[kMaxDims], sx[kMaxDims], sy[kMaxDims], sl[kMaxDims], idx[kMaxDims];
  int64_t ox = 0, oy = 0, ol = 0;
  void set(int64_t linear) {
    ox = oy = ol = 0;
    for (int d = nd - 1; d >= 0; --d) {
      idx[d] = linear % size[d];
      linear /= size[d];
      ox += idx[d] * sx[d]; oy += idx[d] * sy[d]; ol += idx[d] * sl[d];
    }
  }
  void next() {
    for (int d = nd - 1; d >= 0; --d) {
      ++idx[d]; ox += sx[d]; oy += sy[d]; ol += sl[d];
      if (idx[d] < size[d]) return;
      ox -= sx[d] * size[d]; oy -= sy[d] * size[d]; ol -= sl[d] * size[d];
      idx[d] = 0;
    }
  }
};

// One run of elements: x[j*xs] -> y[j*ys], logical indices idx0 + j. UNIT lets the compiler
// vectorize the common contiguous case.
template <bool STOCH, bool UNIT, typename T, typename Fn>
inline void run_segment(const T* __restrict__ xp, int64_t xs, T* __restrict__ yp, int64_t ys,
                        int64_t cnt, uint64_t idx0, uint32_t key, const Fn& fn) {
  while (cnt > 0) {
    // the random word's high half is constant over runs of 2^32 indices
    const uint64_t room = ((uint64_t)1 << 32) - (idx0 & 0xFFFFFFFFu);
    const int64_t c = (uint64_t)cnt < room ? cnt : (int64_t)room;
    const uint32_t ikey = index_key(key, idx0);
    const uint32_t lo = (uint32_t)idx0;
    if (UNIT) {
      for (int64_t j = 0; j < c; ++j) {
        const uint32_t r = STOCH ? random_word(ikey, lo + (uint32_t)j) : 0u;
        store_bits<T>(yp + j, fn(load_bits<T>(xp + j), r));
      }
    } else {
      for (int64_t j = 0; j < c; ++j) {
        const uint32_t r = STOCH ? random_word(ikey, lo + (uint32_t)j) : 0u;
        store_bits<T>(yp + j * ys, fn(load_bits<T>(xp + j * xs), r));
      }
    }
    xp += c * xs; yp += c * ys; idx0 += c; cnt -= c;
  }
}

// Elementwise map over a strided tensor (any layout) in logical order chunks.
template <bool STOCH, typename T, typename Fn>
void elementwise(const T* x, T* y, const Layout& L, uint32_t key, const Fn& fn) {
  const int64_t n = L.numel;
  if (n == 0) return;
  if (L.contiguous) {
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      run_segment<STOCH, true, T>(x + b, 1, y + b, 1, e - b, (uint64_t)b, key, fn);
    });
    return;
  }
  const int last = L.ndim - 1;
  const int64_t w = L.sizes[last], xs = L.xs[last], ys = L.ys[last];
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    Counter rows;  // the dims before the last
    rows.nd = last;
    for (int d = 0; d < last; ++d) {
      rows.size[d] = L.sizes[d]; rows.sx[d] = L.xs[d]; rows.sy[d] = L.ys[d]; rows.sl[d] = 0;
    }
    int64_t pos = b;
    rows.set(b / w);
    int64_t col = b % w;
    while (pos < e) {
      const int64_t cnt = std::min(w - col, e - pos);
      const T* xp = x + rows.ox + col * xs;
      T* yp = y + rows.oy + col * ys;
      if (xs == 1 && ys == 1)
        run_segment<STOCH, true, T>(xp, 1, yp, 1, cnt, (uint64_t)pos, key, fn);
      else
        run_segment<STOCH, false, T>(xp, xs, yp, ys, cnt, (uint64_t)pos, key, fn);
      pos += cnt; col = 0;
      rows.next();
    }
  });
}

// The floor rule with signed two's-complement fixed-point elements (reference.py,
// negative_power_lowers): whether a negative power of two counts one binade lower.
inline bool negative_power_lowers(const BlockArgs& a) {
  return a.scale_rule == qtensor::kRuleFloor && a.elem_fixed && a.is_signed && !a.symmetric;
}

// |x|'s bits as the scale sees them there (reference.py, scale_amax): a negative power of two
// -2^c (above 2^-149; not Inf) as the largest float32 below 2^c, whose binade is c - 1
QT_BLOCK_FN uint32_t lowered_abs_bits(uint32_t u) {
  const uint32_t a = u & kAbsMask;
  const bool pow2 = a < 0x00800000u ? (a & (a - 1u)) == 0 : (a & 0x007FFFFFu) == 0;
  return a - (((u >> 31) != 0 && pow2 && a > 1u && a < kInfBits) ? 1u : 0u);
}

// max |x| as float32 bits over the finite elements (FINITE, for NVFP4's tensor scale) or over all
// elements (NaN and Inf sort above every finite value); `lowered`: of lowered_abs_bits
template <bool FINITE, typename T>
uint32_t amax_bits(const T* x, const Layout& L, bool lowered = false) {
  const int64_t n = L.numel;
  const uint32_t r = at::parallel_reduce(
      0, n, kGrain, (uint32_t)0,
      [&](int64_t b, int64_t e, uint32_t acc) {
        Counter c; c.nd = L.ndim;
        for (int d = 0; d < L.ndim; ++d) {
          c.size[d] = L.sizes[d]; c.sx[d] = L.xs[d]; c.sy[d] = 0; c.sl[d] = 0;
        }
        if (lowered) {  // (a rare format: the plain loop below)
          c.set(b);
          for (int64_t i = b; i < e; ++i) {
            const uint32_t a = lowered_abs_bits(load_bits<T>(x + c.ox));
            acc = ((!FINITE || a < kInfBits) && a > acc) ? a : acc;
            c.next();
          }
          return acc;
        }
        if (L.contiguous) {
          // |x|'s bits as int32 (non-negative, ordered like the values): gcc vectorizes a signed
          // max reduction (vpmaxsd), not the unsigned one (NVFP4's tensor scale pass)
          int32_t m = (int32_t)acc;
          for (int64_t i = b; i < e; ++i) {
            int32_t a = (int32_t)(load_bits<T>(x + i) & kAbsMask);
            a = (!FINITE || a < (int32_t)kInfBits) ? a : 0;
            m = a > m ? a : m;
          }
          return (uint32_t)m;
        }
        c.set(b);
        for (int64_t i = b; i < e; ++i) {
          uint32_t a = load_bits<T>(x + c.ox) & kAbsMask;
          acc = ((!FINITE || a < kInfBits) && a > acc) ? a : acc;
          c.next();
        }
        return acc;
      },
      [](uint32_t a, uint32_t b) { return a > b ? a : b; });
  return r;
}

// the longest block the vector paths of NVFP4 blocks take (in local arrays)
constexpr int64_t kFp4StoMax = 64;

// 8-lane vectors (GCC vector extensions: each ISA's copy splits or widens them as it can) for
// the loops gcc does not vectorize in scalar form (the run paths below, amax_8x)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // (always inlined: no call passes a vector)
typedef uint32_t qt_v8u __attribute__((vector_size(32)));
typedef int32_t qt_v8i __attribute__((vector_size(32)));
typedef float qt_v8f __attribute__((vector_size(32)));
typedef double qt_v8d __attribute__((vector_size(64)));
QT_BLOCK_FN qt_v8d v8d_of(double c) { return qt_v8d{} + c; }
QT_BLOCK_FN qt_v8f v8f_of(float c) { return qt_v8f{} + c; }
// N lanes of float32, int32 and uint32 (N = 16: one AVX-512 register, a block of NVFP4)
template <int N> struct Lanes {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef int32_t I __attribute__((vector_size(4 * N)));
  typedef uint32_t U __attribute__((vector_size(4 * N)));
};

// fp4_round_scaled (round.h) on the lanes of a (8 or 16): the same comparisons and sums
template <int MODE, typename V>
QT_BLOCK_FN V fp4_round_scaled8(V a, const qtensor::Fp4Bounds& b, float X) {
  const float step[7] = {0.5f, 0.5f, 0.5f, 0.5f, 1.0f, 1.0f, 2.0f};
  V v = V{};
  for (int k = 0; k < 7; ++k) {
    const V t = V{} + b.t[k];
    const auto up = (MODE == kNearest && (k & 1) == 0) ? (a > t) : (a >= t);
    v += up ? V{} + step[k] : V{};
  }
  return v * X;
}

// Whether a 4over6 block's error sums are exact in double in any order: each term |q - |x||
// (a difference of floats) is a multiple of 2^(lo - 150) and below 2^(top - 126), lo = the
// lowest exponent field of the nonzero |x| (mn: the smallest one's bits) and of the grids v X
// (v a multiple of 1/2: one below X's), top = the highest of the amax's and of 8 X's (q <= 6 X);
// at most kFp4StoMax = 2^6 terms sum below 2^(top - 120): exact where that is 53 bits above.
QT_BLOCK_FN bool fp4_sums_exact(uint32_t am, uint32_t mn, float X6, float X4) {
  auto fld = [](uint32_t u) { const int e = (int)(u >> 23); return e > 1 ? e : 1; };
  const int e6 = fld(f2u(X6)), e4 = fld(f2u(X4));
  const int lo = std::min(fld(mn), std::min(e6, e4) - 1);
  const int top = std::max((int)(am >> 23), std::max(e6, e4) + 3);
  return top - lo <= 23;
}

// NVFP4-like blocks (e2m1 elements, a scale of <= 4 significant bits, amax rule, deterministic
// rounding) along a contiguous row: `nblk` consecutive blocks of bs elements starting at x, of
// which the last may be cut short by the row's end (`avail` elements left in the row). Three
// passes over the run, each a branch-free loop: the blocks' amaxes, their scales (vectorized
// across blocks), then the elements by comparison with the scaled boundaries (qtensor/round.h,
// fp4_round_scaled: no division). BS > 0 fixes the block size at compile time (one vector).
constexpr int64_t kFp4Run = 64;  // blocks per run: the run's amaxes and scales stay in registers/L1

// A block's scale (0: no scale) from its amax, as float32 (see fp4_block_run), before the
// idempotence check (fp4_settled)
QT_BLOCK_FN float fp4_scale(uint32_t amax, const qtensor::FastGrid& g, uint32_t smax,
                            uint32_t sovf, float div) {
  const float s = u2f(qtensor::round_float_fast<kNearest>(f2u(u2f(amax) / div), g, smax, sovf,
                                                           0u));
  return s == s ? s : 0.0f;
}

// Idempotence: a block whose amax does not round to 6 X (a scale in E4M3's subnormal range,
// toward_zero) takes the scale of its rounded amax (round.h, settle_amax_scale): rare. The
// amax rounds to 6 iff it is past the boundary 5 X (toward_zero: 6 X), exact in float32.
template <int MODE>
QT_BLOCK_FN float fp4_settled(uint32_t amax, float Xb, const BlockArgs& a) {
  const float am = u2f(amax);
  const float top = (MODE == kTowardZero ? 6.0f : 5.0f) * Xb;
  const bool settled = amax >= kInfBits || !(Xb > 0.0f) ||
                       (MODE == kNearest ? am > top : am >= top);
  if (__builtin_expect(settled, 1)) return Xb;
  const qtensor::AmaxBlockSpec& sp = a.amax_spec;
  return (float)qtensor::settle_amax_scale((double)Xb, sp, [&](double sc) {
    return f2u(qtensor::round_amax_elem_t<MODE, false>(am, sc, sp, 0u));
  });
}

// F46: the 4over6 rule (block_4over6's choice, here in float32 where it is exact: both
// candidates' scales as the amax rule's below, X4 from the divisor 4,
// then per block the error sums of both in double, in element order: |q - |x|| of two float32s
// within a factor of two, or |x| where q = 0, is exact).
template <int MODE, int BS, typename T, bool F46 = false>
void fp4_block_run(const T* x, T* y, int64_t nblk, int64_t bs_rt, int64_t avail,
                   const qtensor::FastGrid& sg, uint32_t smax, uint32_t sovf, float elem_max,
                   const BlockArgs& a) {
  const int64_t bs = BS > 0 ? BS : bs_rt;
  uint32_t amax[kFp4Run];
  float X[kFp4Run], X4[F46 ? kFp4Run : 1];
  const int64_t nfull = std::min(nblk, avail / bs);
  // amax from the bits: |x| as integers orders like the values, NaN and Inf on top
  auto block_amax = [&](const T* xp, int64_t m) {
    uint32_t am = 0;
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t v = load_bits<T>(xp + j) & kAbsMask;
      am = v > am ? v : am;
    }
    return am;
  };
  for (int64_t b = 0; b < nfull; ++b) amax[b] = block_amax(x + b * bs, bs);
  if (nfull < nblk) amax[nfull] = block_amax(x + nfull * bs, avail - nfull * bs);
  uint32_t amin[F46 ? kFp4Run : 1];  // 4over6: the smallest nonzero |x| (fp4_sums_exact)
  for (int64_t b = 0; F46 && b < nblk; ++b) {
    const T* xp = x + b * bs;
    uint32_t mn = 0xFFFFFFFFu;
    for (int64_t j = 0; j < std::min(bs, avail - b * bs); ++j) {
      const uint32_t v = (load_bits<T>(xp + j) & kAbsMask) - 1u;  // (0 wraps to the top)
      mn = v < mn ? v : mn;
    }
    amin[F46 ? b : 0] = mn + 1u;
  }
  // the scale: float32 amax / max_elem rounds (nearest) to the same scale as the reference's
  // double quotient (see block_amax_fast32 below); a NaN scale (a NaN-on-overflow scale format)
  // means "no scale" (signed zeros), which X = 0 gives.
  const qtensor::FastGrid g = sg;
  for (int64_t b = 0; b < nblk; ++b) X[b] = fp4_scale(amax[b], g, smax, sovf, elem_max);
  if (F46) {
    qtensor::AmaxBlockSpec s4 = a.amax_spec;
    s4.elem_max = 4.0;
    for (int64_t b = 0; b < nblk; ++b) {
      const float Xb = fp4_scale(amax[b], g, smax, sovf, 4.0f);
      // settled at once where the amax rounds to 4 X (usual): exact float32 comparisons
      const bool settled = amax[b] >= kInfBits || !(Xb > 0.0f) ||
          qtensor::fp4_round_scaled<MODE>(u2f(amax[b]), qtensor::fp4_bounds<MODE>(Xb), Xb) ==
              4.0f * Xb;
      X4[F46 ? b : 0] = settled ? Xb
          : (float)qtensor::settle_amax_scale((double)Xb, s4, [&](double sc) {
              return f2u(qtensor::round_amax_elem_t<MODE, false>(u2f(amax[b]), sc, s4, 0u));
            });
    }
  }
  // idempotence (fp4_settled)
  for (int64_t b = 0; b < nblk; ++b) X[b] = fp4_settled<MODE>(amax[b], X[b], a);
  auto block_elems = [&](const T* xp, T* yp, int64_t m, uint32_t am, float Xb, int64_t b) {
    if (am >= kInfBits) {  // NaN or Inf in the block: all NaN
      for (int64_t j = 0; j < m; ++j) store_bits<T>(yp + j, kNaNBits);
      return;
    }
    if (F46) {  // 4over6: the candidate with the lower error sum (6 on a tie)
      const float X4b = X4[F46 ? b : 0];
      const qtensor::Fp4Bounds b6 = qtensor::fp4_bounds<MODE>(Xb), b4 =
          qtensor::fp4_bounds<MODE>(X4b);
      if constexpr (std::is_same<T, float>::value) {
        // 8 lanes at a time where the sums are exact (so their order does not matter): both
        // candidates kept, then the chosen one stored
        if (m % 8 == 0 && m <= kFp4StoMax && fp4_sums_exact(am, amin[F46 ? b : 0], Xb, X4b)) {
          qt_v8f q6[kFp4StoMax / 8], q4[kFp4StoMax / 8];
          qt_v8d e6v = v8d_of(0.0), e4v = v8d_of(0.0);
          for (int64_t k = 0; k < m / 8; ++k) {
            qt_v8u ub;
            std::memcpy(&ub, xp + 8 * k, 32);
            const qt_v8f ax = (qt_v8f)(ub & kAbsMask);
            q6[k] = fp4_round_scaled8<MODE>(ax, b6, Xb);
            q4[k] = fp4_round_scaled8<MODE>(ax, b4, X4b);
            const qt_v8d ad = __builtin_convertvector(ax, qt_v8d);
            const qt_v8d d6 = __builtin_convertvector(q6[k], qt_v8d) - ad;
            const qt_v8d d4 = __builtin_convertvector(q4[k], qt_v8d) - ad;
            e6v += d6 < v8d_of(0.0) ? -d6 : d6;
            e4v += d4 < v8d_of(0.0) ? -d4 : d4;
          }
          double e6 = 0.0, e4 = 0.0;
          for (int l = 0; l < 8; ++l) { e6 += e6v[l]; e4 += e4v[l]; }
          const bool use4 = e4 < e6;
          for (int64_t k = 0; k < m / 8; ++k) {
            qt_v8u ub;
            std::memcpy(&ub, xp + 8 * k, 32);
            const qt_v8u out = (qt_v8u)(use4 ? q4[k] : q6[k]) | (ub & kSignBit);
            std::memcpy(yp + 8 * k, &out, 32);
          }
          return;
        }
      }
      double e6 = 0.0, e4 = 0.0;
      for (int64_t j = 0; j < m; ++j) {
        const float ax = u2f(load_bits<T>(xp + j) & kAbsMask);
        e6 += std::fabs((double)qtensor::fp4_round_scaled<MODE>(ax, b6, Xb) - (double)ax);
        e4 += std::fabs((double)qtensor::fp4_round_scaled<MODE>(ax, b4, X4b) - (double)ax);
      }
      if (e4 < e6) Xb = X4b;
    }
    const qtensor::Fp4Bounds bd = qtensor::fp4_bounds<MODE>(Xb);
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t u = load_bits<T>(xp + j);
      const float q = qtensor::fp4_round_scaled<MODE>(u2f(u & kAbsMask), bd, Xb);
      store_bits<T>(yp + j, f2u(q) | (u & kSignBit));
    }
  };
  for (int64_t b = 0; b < nfull; ++b)
    block_elems(x + b * bs, y + b * bs, bs, amax[b], X[b], b);
  if (nfull < nblk)
    block_elems(x + nfull * bs, y + nfull * bs, avail - nfull * bs, amax[nfull], X[nfull],
                nfull);
}

// ---- stochastic NVFP4: e2m1 elements, the amax rule's scale (rounded to nearest, as
// fp4_scale), elements rounded stochastically as round_amax_elem_t<kStochastic> does. GCC vector
// extensions of 8 lanes (each ISA's copy splits or widens them as it can): gcc does not vectorize
// the scalar form (its selects became unpredictable branches).


// The e2m1 grid values (saturating at 6) of |x| / X (a: |x|) under stochastic rounding with the
// words r: round_amax_elem_t's double quotient z, the grid spacing sp of its binade (0.5 below 2,
// 1 below 4, else 2), fl = floor(z / sp), frac = z / sp - fl: up iff r < floor(frac * 2^32), i.e.
// iff r + 1 <= frac * 2^32. Every step is exact in double, so the value is round_float's.
QT_BLOCK_FN qt_v8d fp4_sto_grid8(qt_v8f a, qt_v8d X, qt_v8u r) {
  qt_v8d z = __builtin_convertvector(a, qt_v8d) / X;
  z = z < v8d_of(8.0) ? z : v8d_of(8.0);  // (beyond 6: 6) keeps fl in int32's range
  const auto lo2 = z < v8d_of(2.0), lo4 = z < v8d_of(4.0);
  const qt_v8d sp = lo2 ? v8d_of(0.5) : (lo4 ? v8d_of(1.0) : v8d_of(2.0));
  const qt_v8d y = z * (lo2 ? v8d_of(2.0) : (lo4 ? v8d_of(1.0) : v8d_of(0.5)));
  const qt_v8d fl = __builtin_convertvector(__builtin_convertvector(y, qt_v8i), qt_v8d);
  const qt_v8d F = (y - fl) * v8d_of(4294967296.0);
  const qt_v8d r1 = __builtin_convertvector((qt_v8i)(r ^ 0x80000000u), qt_v8d) +
                    v8d_of(2147483649.0);  // r + 1
  const qt_v8d v = (fl + (r1 <= F ? v8d_of(1.0) : v8d_of(0.0))) * sp;
  return v < v8d_of(6.0) ? v : v8d_of(6.0);
}

// lowbias32 (round.h, random_word) on each lane (uint32 lanes); _rest_v: after its first step
template <typename V>
QT_BLOCK_FN V lowbias32_rest_v(V v) {
  v *= 0x7feb352du; v ^= v >> 15; v *= 0x846ca68bu; v ^= v >> 16;
  return v;
}
template <typename V>
QT_BLOCK_FN V lowbias32_v(V v) { return lowbias32_rest_v(v ^ (v >> 16)); }

// What fp4_sto_block needs besides the block: the scale grid.
struct Fp4Sto {
  qtensor::FastGrid g;
  uint32_t smax, sovf;
  float div;      // elem_max as float32 (fp4_scale)
};

// One block of m <= kFp4StoMax finite elements x[j*sx] -> y[j*sy], the words in r (nv vectors
// of 8, sr_or included), the scale value s of its amax: each element's grid value, then the
// idempotence (round.h, settle_amax_scale): while the scale of the rounded block's max
// (float)(max v * X) is lower, the block takes it. Stores after that (x may be y).
template <typename T>
QT_BLOCK_FN void fp4_sto_block(const T* xp, int64_t sx, T* yp, int64_t sy, int64_t m,
                               const qt_v8u* r, float s, const Fp4Sto& c) {
  const int64_t nv = (m + 7) / 8;
  qt_v8f xa[kFp4StoMax / 8];
  float* xf = (float*)xa;
  if (sx == 1)
    for (int64_t j = 0; j < m; ++j) xf[j] = u2f(load_bits<T>(xp + j) & kAbsMask);
  else
    for (int64_t j = 0; j < m; ++j) xf[j] = u2f(load_bits<T>(xp + j * sx) & kAbsMask);
  for (int64_t j = m; j < nv * 8; ++j) xf[j] = 0.0f;
  qt_v8d v[kFp4StoMax / 8];
  double X = (double)s;  // round_amax_elem_t's scale, in double
  while (s > 0.0f) {
    const qt_v8d Xv = v8d_of(X);
    qt_v8d vm = v8d_of(0.0);
    for (int64_t k = 0; k < nv; ++k) {
      v[k] = fp4_sto_grid8(xa[k], Xv, r[k]);
      vm = v[k] > vm ? v[k] : vm;
    }
    double vmax = 0.0;
    for (int l = 0; l < 8; ++l) vmax = vm[l] > vmax ? vm[l] : vmax;
    const float s2 = fp4_scale(f2u((float)(vmax * X)), c.g, c.smax, c.sovf, c.div);
    if (__builtin_expect(!(s2 < s), 1)) break;
    s = s2;
    X = (double)s;
  }
  const double* vd = (const double*)v;
  if (s > 0.0f) {
    for (int64_t k = 0; k < nv; ++k) v[k] = v[k] * v8d_of(X);
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t u = load_bits<T>(xp + j * sx);
      store_bits<T>(yp + j * sy, f2u((float)vd[j]) | (u & kSignBit));
    }
  } else {  // no scale: signed zeros
    for (int64_t j = 0; j < m; ++j) store_bits<T>(yp + j * sy, load_bits<T>(xp + j * sx) & kSignBit);
  }
}
#pragma GCC diagnostic pop

// ---- blocks along an axis: a plan (which path applies, with its parameters), then one function
// per path. Units are (outer index, block, inner index), inner fastest so that neighbouring units
// touch neighbouring memory when the axis is not the last dim. Each unit reads its block once
// into cache (amax), then rounds it.

// What blocks() fixes once for all blocks.
struct BlockPlan {
  int ax;                        // normalized; the layout was reshaped to 1-D for axis=None
  int64_t len, bs, nb;           // the axis' length, the block size, blocks per row
  int64_t sax, say, sal;         // the axis' strides in x, in y and in the logical order
  int64_t inner, units, grain;
  bool unit_stride;              // the axis is contiguous in x and in y
  // amax rule in float32 arithmetic (block_amax_fast32): the scales' grid sg, the elements' eg
  bool amax_fast32;
  qtensor::FastGrid sg, eg;
  uint32_t smax, sovf;           // the scale format's max and overflow value, float32 bits
  // NVFP4 (e2m1 elements, scales of <= 4 significant bits whose products with the boundaries
  // 2^-2..5 stay exact in float32), blocks along contiguous rows: fp4_block_run
  bool fp4_rows;
  bool fp4_fmt;                  // the format of fp4_rows, any layout (blocks_tiled)
  bool fp4_sto;                  // the same blocks, stochastic rounding (fp4_sto_block)
  float elem_max_f;
  float kmax_f, kmin_abs_f;      // fixed-point elements: the limits' integers (times 2^(k - fl))
  uint32_t sr_or;                // limited-bit stochastic rounding (round.h, sr_or_mask)
  // power-of-two scales a run of blocks at a time (pow2_grids): deterministic rounding, floor,
  // ceil, or even without settling; float elements with subnormals and man <= 22
  // (round_magnitude_add), or fixed-point ones of wl <= 23. pow2_rows: blocks along contiguous
  // rows (pow2_block_run); else the tiles (round_tile) use it.
  bool pow2_run, pow2_rows;
  uint32_t p2_bump;              // pow2_scale_exp: the significand field from which b steps up
  bool lowered;                  // the amaxes of lowered_abs_bits (negative_power_lowers)
};

template <int MODE>
BlockPlan block_plan(const Layout& L, const BlockArgs& a) {
  BlockPlan p;
  p.ax = a.axis;
  p.len = L.sizes[p.ax];
  p.bs = a.block_size;
  p.nb = (p.len + p.bs - 1) / p.bs;
  p.sax = L.xs[p.ax]; p.say = L.ys[p.ax]; p.sal = L.ls[p.ax];
  int64_t outer = 1;
  p.inner = 1;
  for (int d = 0; d < p.ax; ++d) outer *= L.sizes[d];
  for (int d = p.ax + 1; d < L.ndim; ++d) p.inner *= L.sizes[d];
  p.units = outer * p.nb * p.inner;
  p.grain = std::max<int64_t>(1, kGrain / p.bs);
  p.unit_stride = p.sax == 1 && p.say == 1;
  const auto& ssp = a.amax_spec.scale;
  // qlow >= -124 (scale and elements): the float32 quotients amax / max_elem and x / X decide as
  // the exact ones only where the grids' rounding thresholds (midpoints, or for toward_zero grid
  // points, >= 2^(qlow-1)) are float32 normals: below 2^-126 the division's error is absolute
  // (2^-150), not relative, and a quotient can round onto a threshold (a bf16 scale's tie).
  // (the scales round to nearest in every mode: stochastic rounding shares the grid, for
  // fp4_sto_run, but not the deterministic element paths below)
  const bool scale_grid_any =
      ((a.scale_rule == kRuleAmax && !a.amax_spec.up) || a.scale_rule == kRule4over6) &&
      !a.elem_fixed &&
      a.man + ssp.man <= 21 && !ssp.is_unsigned && ssp.qlow >= -124 && a.qlow >= -124 &&
      qtensor::make_fast_grid(p.sg, ssp.man, ssp.emin, ssp.qlow,
                              ssp.emin == -126 && ssp.qlow == ssp.emin - ssp.man, false, false);
  const bool scale_grid = scale_grid_any && MODE != kStochastic;
  p.amax_fast32 = scale_grid &&  // the elements' grid (amax rule: unshifted)
      qtensor::make_fast_grid(p.eg, a.man, a.emin, a.qlow,
                              a.emin == -126 && a.qlow == a.emin - a.man, false, false);
  p.smax = f2u((float)qtensor::u2d(ssp.max_bits));
  p.fp4_fmt = p.amax_fast32 && a.man == 1 && a.emin == 0 && a.qlow == -1 && a.elem_max == 6.0 &&
              ssp.man <= 3 && qtensor::u2d(ssp.max_bits) * 8.0 < 3.0e38;
  // stochastic NVFP4 (fp4_sto_block): the same scales, the amax rule, blocks of <= kFp4StoMax
  p.fp4_sto = MODE == kStochastic && scale_grid_any && a.scale_rule == kRuleAmax &&
              a.man == 1 && a.emin == 0 && a.qlow == -1 && a.elem_max == 6.0 && ssp.man <= 3 &&
              qtensor::u2d(ssp.max_bits) * 8.0 < 3.0e38 && p.bs <= kFp4StoMax;
  p.fp4_rows = (p.fp4_fmt || p.fp4_sto) && p.inner == 1 && p.unit_stride;
  p.sovf = ssp.ovf_bits == ssp.max_bits ? p.smax
         : (ssp.ovf_bits == qtensor::Carrier<uint64_t>::INF ? kInfBits : kNaNBits);
  p.elem_max_f = (float)a.elem_max;
  p.kmax_f = a.is_signed ? (float)((1 << (a.wl - 1)) - 1) : (float)((1 << a.wl) - 1);
  p.kmin_abs_f = a.is_signed ? (float)((1 << (a.wl - 1)) - (a.symmetric ? 1 : 0)) : 0.0f;
  p.sr_or = a.sr_or;
  // pow2_scale_exp's step: ceil where amax / 2^(b - emax) > max, i.e. (max's binade being emax)
  // where amax's significand field exceeds max's; even where amax rounded to even_mbits + 1 bits
  // reaches the next binade (block_scale_exp's double comparisons, on the significand field)
  const float emf = (float)a.elem_max;
  const bool max_ok = a.elem_max > 0 && (double)emf == a.elem_max && std::isfinite(emf) &&
                      (int)(f2u(emf) >> 23) - 127 == a.elem_emax;
  const bool even_settles = MODE == kTowardZero || MODE == kStochastic ||
                            (a.elem_fixed && !a.is_signed);
  p.p2_bump = 0x01000000u;  // floor: never
  if (a.scale_rule == kRuleCeil) p.p2_bump = (f2u(emf) & 0x007FFFFFu) + 1u;
  if (a.scale_rule == kRuleEven && a.even_mbits <= 22)
    p.p2_bump = 0x00800000u - ((uint32_t)1 << (22 - a.even_mbits));
  const bool rule_ok = a.scale_rule == qtensor::kRuleFloor || (a.scale_rule == kRuleCeil && max_ok) ||
                       (a.scale_rule == kRuleEven && a.even_mbits >= 0 && !even_settles);
  const bool elem_ok = a.elem_fixed ? a.wl <= 23
                                    : (a.man >= 1 && a.man <= 22 && a.qlow == a.emin - a.man);
  p.pow2_run = MODE != kStochastic && rule_ok && elem_ok && !a.whole_tensor;
  p.pow2_rows = p.pow2_run && p.inner == 1 && p.unit_stride;
  p.lowered = negative_power_lowers(a);
  return p;
}

// One block: x[j*sax] -> y[j*say] for j < m, logical indices l0 + j*sal.
template <typename T>
struct Block {
  const T* xp;
  T* yp;
  int64_t m;
  uint64_t l0;
  uint32_t key, ikey0;  // the seed's key, the index key of l0
  uint32_t sr_or;       // OR-ed into each random word (limited-bit stochastic rounding)
  bool one_key;         // the block's logical indices share their high half (and so ikey0)
  bool unit;            // unit strides, and for stochastic rounding consecutive logical indices
};

template <int MODE, typename T>
QT_BLOCK_FN Block<T> make_block(const T* xp, T* yp, int64_t m, uint64_t l0, const BlockPlan& P,
                    uint32_t key) {
  Block<T> b;
  b.xp = xp; b.yp = yp; b.m = m; b.l0 = l0; b.key = key; b.sr_or = P.sr_or;
  const uint64_t llast = l0 + (uint64_t)((m - 1) * P.sal);
  b.one_key = (l0 >> 32) == (llast >> 32);
  b.ikey0 = index_key(key, l0);
  b.unit = P.unit_stride && (MODE != kStochastic || (P.sal == 1 && b.one_key));
  return b;
}

// The random word of the block's element j (0 for deterministic rounding).
template <int MODE, typename T>
QT_BLOCK_FN uint32_t block_word(const Block<T>& b, int64_t sal, int64_t j) {
  if (MODE != kStochastic) return 0u;
  const uint64_t li = b.l0 + (uint64_t)(j * sal);
  return random_word(b.one_key ? b.ikey0 : index_key(b.key, li), (uint32_t)li) | b.sr_or;
}

// amax of a block from the bits: |x| as integers orders like the values, NaN on top
// (`lowered`: of lowered_abs_bits)
template <typename T>
QT_BLOCK_FN uint32_t block_amax(const T* xp, int64_t m, int64_t sax, bool unit_stride,
                                bool lowered = false) {
  uint32_t amax = 0;
  if (lowered) {
    for (int64_t j = 0; j < m; ++j) {
      uint32_t v = lowered_abs_bits(load_bits<T>(xp + j * sax)); amax = v > amax ? v : amax;
    }
  } else if (unit_stride) {
    for (int64_t j = 0; j < m; ++j) {
      uint32_t v = load_bits<T>(xp + j) & kAbsMask; amax = v > amax ? v : amax;
    }
  } else {
    for (int64_t j = 0; j < m; ++j) {
      uint32_t v = load_bits<T>(xp + j * sax) & kAbsMask; amax = v > amax ? v : amax;
    }
  }
  return amax;
}

QT_BLOCK_FN Fp4Sto fp4_sto_consts(const BlockPlan& P) {
  Fp4Sto c;
  c.g = P.sg; c.smax = P.smax; c.sovf = P.sovf;
  c.div = P.elem_max_f;
  return c;
}

// Stochastic NVFP4 blocks along a contiguous row (fp4_block_run's run; l0: the logical index of
// x[0], key: the seed's), in passes that each vectorize (across blocks or 8 lanes): the blocks'
// amaxes and scales; per block its words, its elements' values q (into qf) and its rounded max;
// the scales of those maxes; then the stores, and fp4_sto_block's settling loop for the blocks
// whose scale is lower (rare), the NaN and no-scale blocks.
template <int BS, typename T>
void fp4_sto_run(const T* x, T* y, int64_t nblk, int64_t bs_rt, int64_t avail,
                 const BlockPlan& P, uint64_t l0, uint32_t key) {
  constexpr int64_t kBuf = kFp4Run * (BS > 0 ? BS : kFp4StoMax) + 8;
  const int64_t bs = BS > 0 ? BS : bs_rt;
  uint32_t amax[kFp4Run], ra[kFp4Run];
  float S[kFp4Run], S2[kFp4Run];
  qt_v8f qv[kBuf / 8];
  float* qf = (float*)qv;
  const int64_t nfull = std::min(nblk, avail / bs);
  const int64_t tail = avail - nfull * bs;  // the last block's length when nfull < nblk
  for (int64_t b = 0; b < nfull; ++b) amax[b] = block_amax<T>(x + b * bs, bs, 1, true);
  if (nfull < nblk) amax[nfull] = block_amax<T>(x + nfull * bs, tail, 1, true);
  const Fp4Sto c = fp4_sto_consts(P);
  for (int64_t b = 0; b < nblk; ++b) S[b] = fp4_scale(amax[b], c.g, c.smax, c.sovf, c.div);
  const uint32_t sr_or = P.sr_or;
  const uint64_t lend = l0 + (uint64_t)(nblk * bs) - 1;
  const bool one_key = (l0 >> 32) == (lend >> 32);  // else per element (a multiple of 2^32 inside)
  const uint32_t ik = index_key(key, l0);
  const qt_v8u iota = {0, 1, 2, 3, 4, 5, 6, 7};
  // block b's words, 8 lanes at a time (the lanes past m: words of the next indices, unused)
  auto words = [&](int64_t b, int64_t m, qt_v8u* r) {
    const uint64_t lb = l0 + (uint64_t)(b * bs);
    if (__builtin_expect(one_key, 1)) {
      for (int64_t k = 0; k < (m + 7) / 8; ++k)
        r[k] = lowbias32_v((iota + ((uint32_t)lb + (uint32_t)(8 * k))) ^ ik) | sr_or;
    } else {
      uint32_t* rw = (uint32_t*)r;
      for (int64_t j = 0; j < (m + 7) / 8 * 8; ++j)
        rw[j] = random_word(index_key(key, lb + (uint64_t)j), (uint32_t)(lb + (uint64_t)j)) | sr_or;
    }
  };
  auto values = [&](int64_t b, int64_t m, qt_v8f* qd) {
    ra[b] = 0;
    if (amax[b] >= kInfBits || !(S[b] > 0.0f)) return;
    qt_v8u r[kFp4StoMax / 8];
    words(b, m, r);
    const T* xp = x + b * bs;
    const double X = (double)S[b];
    const qt_v8d Xv = v8d_of(X);
    qt_v8d vm = v8d_of(0.0);
    for (int64_t k = 0; k < (m + 7) / 8; ++k) {
      qt_v8u ub;
      if (std::is_same<T, float>::value && 8 * k + 8 <= m) {
        std::memcpy(&ub, xp + 8 * k, 32);
      } else {
        uint32_t* u = (uint32_t*)&ub;
        for (int l = 0; l < 8; ++l) u[l] = 8 * k + l < m ? load_bits<T>(xp + 8 * k + l) : 0u;
      }
      const qt_v8d v = fp4_sto_grid8((qt_v8f)(ub & kAbsMask), Xv, r[k]);
      vm = v > vm ? v : vm;
      qd[k] = __builtin_convertvector(v * Xv, qt_v8f);
    }
    double vmax = 0.0;
    for (int l = 0; l < 8; ++l) vmax = vm[l] > vmax ? vm[l] : vmax;
    ra[b] = f2u((float)(vmax * X));
  };
  // (BS a multiple of 8: each block's values start on a vector; else one block at a time)
  if (BS > 0 && BS % 8 == 0) {
    for (int64_t b = 0; b < nfull; ++b) values(b, bs, qv + b * bs / 8);
    if (nfull < nblk) values(nfull, tail, qv + nfull * bs / 8);
    for (int64_t b = 0; b < nblk; ++b)
      S2[b] = fp4_scale(ra[b], c.g, c.smax, c.sovf, c.div);
  }
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t m = b < nfull ? bs : tail;
    const T* xp = x + b * bs;
    T* yp = y + b * bs;
    if (!(BS > 0 && BS % 8 == 0)) {
      values(b, m, qv);  // into the buffer's start (a block of up to kFp4StoMax)
      S2[b] = fp4_scale(ra[b], c.g, c.smax, c.sovf, c.div);
    }
    const float* qb = qf + (BS > 0 && BS % 8 == 0 ? b * bs : 0);
    if (__builtin_expect(amax[b] < kInfBits && S[b] > 0.0f && !(S2[b] < S[b]), 1)) {
      for (int64_t j = 0; j < m; ++j)
        store_bits<T>(yp + j, f2u(qb[j]) | (load_bits<T>(xp + j) & kSignBit));
    } else if (amax[b] >= kInfBits) {  // NaN or Inf in the block: all NaN
      for (int64_t j = 0; j < m; ++j) store_bits<T>(yp + j, kNaNBits);
    } else {  // no scale (signed zeros), or the settling loop from the lower scale S2
      qt_v8u r[kFp4StoMax / 8];
      words(b, m, r);
      fp4_sto_block<T>(xp, 1, yp, 1, m, r, S[b] > 0.0f ? S2[b] : 0.0f, c);
    }
  }
}

// The block's amax-rule scale made idempotent (round.h, settle_amax_scale): the rounded amax
// from the amax alone where that is exact, else from a read-only pass over the block (before any
// store, so that in-place rounding still reads x).
template <int MODE, typename T>
QT_BLOCK_FN double settled_scale(const Block<T>& b, uint32_t amax, double sc, const BlockPlan& P,
                                 const qtensor::AmaxBlockSpec& sp) {
  if (amax >= kInfBits) return sc;
  if (qtensor::rounded_amax_from_amax<MODE>(sp)) {
    return qtensor::settle_amax_scale(sc, sp, [&](double s) {
      return f2u(qtensor::round_amax_elem<MODE>(u2f(amax), s, sp, 0u)) & kAbsMask;
    });
  }
  return qtensor::settle_amax_scale(sc, sp, [&](double s) {
    uint32_t m = 0;
    for (int64_t j = 0; j < b.m; ++j) {
      const float q = qtensor::round_amax_elem<MODE>(u2f(load_bits<T>(b.xp + j * P.sax)), s, sp,
                                                     block_word<MODE>(b, P.sal, j));
      const uint32_t v = f2u(q) & kAbsMask;
      m = v > m ? v : m;
    }
    return m;
  });
}

// stochastic NVFP4, any block (plan.fp4_sto): fp4_sto_run's scale and elements
template <int MODE, typename T>
QT_BLOCK_FN void block_fp4_sto(const Block<T>& b, uint32_t amax, const BlockPlan& P) {
  if constexpr (MODE == kStochastic) {  // (the plan takes it for stochastic rounding only)
    const Fp4Sto c = fp4_sto_consts(P);
    qt_v8u r[kFp4StoMax / 8];
    uint32_t* rw = (uint32_t*)r;
    for (int64_t j = 0; j < (b.m + 7) / 8 * 8; ++j)
      rw[j] = j < b.m ? block_word<MODE>(b, P.sal, j) : 0u;
    fp4_sto_block<T>(b.xp, P.sax, b.yp, P.say, b.m, r,
                     fp4_scale(amax, c.g, c.smax, c.sovf, c.div), c);
  }
}

// amax rule, float32 arithmetic, contiguous block (plan.amax_fast32)
template <int MODE, typename T>
QT_BLOCK_FN void block_amax_fast32(const Block<T>& b, uint32_t amax, const BlockPlan& P,
                                   const BlockArgs& a) {
  const T* xp = b.xp;
  T* yp = b.yp;
  const int64_t m = b.m;
  // the scale: float32 amax / max_elem rounds (nearest) to the same scale value as the
  // reference's double quotient, by the argument below (a midpoint of the scale format
  // times max_elem has at most 24 significant bits)
  const double sc = settled_scale<MODE, T>(b, amax, (double)u2f(qtensor::round_float_fast<kNearest>(
      f2u(u2f(amax) / P.elem_max_f), P.sg, P.smax, P.sovf, 0u)), P, a.amax_spec);
  // Deterministic rounding with a scale of few significant bits (NVFP4): the float32
  // quotient z = x / X rounds to the same grid point as the exact one (and so as the
  // reference's double quotient): a grid point or midpoint m times X has at most 24
  // significant bits, so |x - m X| >= ulp(x) and |z - m| > 2^-24 |z|, more than the
  // float32 division's error. Q(z) * X is exact in float32.
  const qtensor::FastGrid g = P.eg;  // a local copy: the stores below cannot alias it
  const float X = (float)sc;
  const bool ok = sc > 0;
  const float Xs = ok ? X : 1.0f;
  const uint32_t mx = f2u(P.elem_max_f);
  for (int64_t j = 0; j < m; ++j) {
    const uint32_t u = load_bits<T>(xp + j);
    const uint32_t zb = f2u(u2f(u) / Xs);
    uint32_t rr = qtensor::round_magnitude_fast<MODE>(zb & kAbsMask, g, 0u);
    rr = rr > mx ? mx : rr;
    const float q = u2f(rr | (u & kSignBit)) * Xs;
    store_bits<T>(yp + j, ok ? f2u(q) : (u & kSignBit));
  }
}

// amax rule, float elements, block.unit: the common case (NVFP4), as a branch-free loop
template <int MODE, typename T>
QT_BLOCK_FN void block_amax_unit(const Block<T>& b, uint32_t amax, const BlockPlan& P,
                                 const BlockArgs& a) {
  constexpr bool stoch = MODE == kStochastic;
  const T* xp = b.xp;
  T* yp = b.yp;
  const int64_t m = b.m;
  const double sc = settled_scale<MODE, T>(
      b, amax, qtensor::amax_block_scale(amax, a.amax_spec), P, a.amax_spec);
  const qtensor::AmaxBlockSpec sp = a.amax_spec;
  const uint32_t ikey0 = b.ikey0;
  const uint32_t lo = (uint32_t)b.l0;
  for (int64_t j = 0; j < m; ++j) {
    const uint32_t r = stoch ? random_word(ikey0, lo + (uint32_t)j) | b.sr_or : 0u;
    const float q = qtensor::round_amax_elem_t<MODE, false>(u2f(load_bits<T>(xp + j)), sc,
                                                            sp, r);
    store_bits<T>(yp + j, f2u(q));
  }
}

// amax rule, any block
template <int MODE, typename T>
QT_BLOCK_FN void block_amax_general(const Block<T>& b, uint32_t amax, const BlockPlan& P,
                        const BlockArgs& a) {
  const double sc = settled_scale<MODE, T>(
      b, amax, qtensor::amax_block_scale(amax, a.amax_spec), P, a.amax_spec);
  for (int64_t j = 0; j < b.m; ++j) {
    float xv = u2f(load_bits<T>(b.xp + j * P.sax));
    float q = qtensor::round_amax_elem<MODE>(xv, sc, a.amax_spec, block_word<MODE>(b, P.sal, j));
    store_bits<T>(b.yp + j * P.say, f2u(q));
  }
}

// 4over6 (NVFP4, Transformer Engine): the amax-rule scales mapping the block's max to 6 and to 4,
// each settled (idempotence), then the one whose sum of |q - x| (double, in element order, as
// the reference) is lower; 6 on a tie. Two read-only passes, then the stores.
template <int MODE, typename T>
QT_BLOCK_FN void block_4over6(const Block<T>& b, uint32_t amax, const BlockPlan& P,
                              const BlockArgs& a) {
  const qtensor::AmaxBlockSpec& s6 = a.amax_spec;
  qtensor::AmaxBlockSpec s4 = s6;
  s4.elem_max = 4.0;
  const double sc6 = settled_scale<MODE, T>(b, amax, qtensor::amax_block_scale(amax, s6), P, s6);
  const double sc4 = settled_scale<MODE, T>(b, amax, qtensor::amax_block_scale(amax, s4), P, s4);
  double e6 = 0.0, e4 = 0.0;
  for (int64_t j = 0; j < b.m; ++j) {
    const float xv = u2f(load_bits<T>(b.xp + j * P.sax));
    const uint32_t r = block_word<MODE>(b, P.sal, j);
    e6 += std::fabs((double)qtensor::round_amax_elem<MODE>(xv, sc6, s6, r) - (double)xv);
    e4 += std::fabs((double)qtensor::round_amax_elem<MODE>(xv, sc4, s6, r) - (double)xv);
  }
  const double sc = e4 < e6 ? sc4 : sc6;
  for (int64_t j = 0; j < b.m; ++j) {
    const float xv = u2f(load_bits<T>(b.xp + j * P.sax));
    store_bits<T>(b.yp + j * P.say, f2u(qtensor::round_amax_elem<MODE>(
                                        xv, sc, s6, block_word<MODE>(b, P.sal, j))));
  }
}

// power-of-two scale 2^k, block.unit, the element grid shifted by the scale as a FastGrid gk
template <int MODE, typename T>
QT_BLOCK_FN void block_pow2_fast(const Block<T>& b, const qtensor::FastGrid& gk, int k, int qk,
                     const BlockPlan& P, bool elem_fixed) {
  constexpr bool stoch = MODE == kStochastic;
  const T* xp = b.xp;
  T* yp = b.yp;
  const int64_t m = b.m;
  const qtensor::FastGrid g = gk;  // a local copy: the stores below cannot alias it
  const uint32_t ikey0 = b.ikey0;
  const uint32_t lo = (uint32_t)b.l0;
  const uint32_t mx = elem_fixed ? 0u : f2u(P.elem_max_f * qtensor::pow2f(k));
  if (elem_fixed) {
    const float qf = qtensor::pow2f(qk);
    const uint32_t pos = f2u(P.kmax_f * qf), neg = f2u(P.kmin_abs_f * qf);
    const uint32_t neg_sat = neg != 0 ? (neg | kSignBit) : 0u;
    for (int64_t j = 0; j < m; ++j) {
      uint32_t r = stoch ? random_word(ikey0, lo + (uint32_t)j) | b.sr_or : 0u;
      store_bits<T>(yp + j, qtensor::round_fixed_fast<MODE>(load_bits<T>(xp + j), g, pos,
                                                            neg, neg_sat, r));
    }
  } else {
    for (int64_t j = 0; j < m; ++j) {
      uint32_t r = stoch ? random_word(ikey0, lo + (uint32_t)j) | b.sr_or : 0u;
      uint32_t u = load_bits<T>(xp + j);
      uint32_t rr = qtensor::round_magnitude_fast<MODE>(u & kAbsMask, g, r);
      rr = rr > mx ? mx : rr;
      store_bits<T>(yp + j, rr | (u & kSignBit));
    }
  }
}

// power-of-two scale, block.unit, an element grid the FastGrid cannot do
template <int MODE, typename T>
QT_BLOCK_FN void block_pow2_unit(const Block<T>& b, const qtensor::BlockElemSpec& s) {
  constexpr bool stoch = MODE == kStochastic;
  const T* xp = b.xp;
  T* yp = b.yp;
  const int64_t m = b.m;
  const uint32_t ikey0 = b.ikey0;
  const uint32_t lo = (uint32_t)b.l0;
  if (s.is_fixed) {
    const auto sx = s.x;
    for (int64_t j = 0; j < m; ++j) {
      uint32_t r = stoch ? random_word(ikey0, lo + (uint32_t)j) | b.sr_or : 0u;
      store_bits<T>(yp + j, qtensor::round_fixed<MODE, false, uint32_t>(
                                load_bits<T>(xp + j), sx, r));
    }
  } else {
    const int emin = s.f.emin, man = s.f.man, qlow = s.f.qlow;
    const uint32_t mx = s.f.max_bits;
    for (int64_t j = 0; j < m; ++j) {
      uint32_t r = stoch ? random_word(ikey0, lo + (uint32_t)j) | b.sr_or : 0u;
      uint32_t u = load_bits<T>(xp + j);
      uint32_t rr = qtensor::round_magnitude<MODE, uint32_t>(u & kAbsMask, emin, man,
                                                              qlow, r);
      rr = rr > mx ? mx : rr;
      store_bits<T>(yp + j, rr | (u & kSignBit));
    }
  }
}

// power-of-two scale, any block
template <int MODE, typename T>
QT_BLOCK_FN void block_pow2_general(const Block<T>& b, const qtensor::BlockElemSpec& s,
                                    const BlockPlan& P) {
  for (int64_t j = 0; j < b.m; ++j) {
    store_bits<T>(b.yp + j * P.say,
                  qtensor::round_block_elem<MODE>(load_bits<T>(b.xp + j * P.sax), s,
                                                   block_word<MODE>(b, P.sal, j)));
  }
}

// the element format shifted by the block's scale 2^k
inline qtensor::BlockElemSpec shifted_elem(const BlockArgs& a, int k) {
  return qtensor::shift_elem(a.elem_fixed, a.man, a.emin, a.qlow, a.elem_max, a.wl, a.fl,
                             a.is_signed, a.symmetric, k);
}

// power-of-two scales (floor and ceil rules): the scale, then the fastest path that applies
// The even rule's idempotence (reference.py, settled): while the exponent derived again from the
// rounded block's max is lower, the block takes it. The rounded max from the amax alone where
// rounding is monotone (deterministic, no unsigned fixed-point element), else from a read-only
// pass over the block.
template <int MODE, typename T>
QT_BLOCK_FN int settle_even_exp(const Block<T>& b, uint32_t amax, int k, const BlockPlan& P,
                                const BlockArgs& a) {
  const bool from_amax = MODE != kStochastic && !(a.elem_fixed && !a.is_signed);
  while (true) {
    const qtensor::BlockElemSpec s = shifted_elem(a, k);
    uint32_t m = 0;
    if (from_amax) {
      m = qtensor::round_block_elem<MODE>(amax, s, 0u) & kAbsMask;
    } else {
      for (int64_t j = 0; j < b.m; ++j) {
        const uint32_t v = qtensor::round_block_elem<MODE>(load_bits<T>(b.xp + j * P.sax), s,
                                                            block_word<MODE>(b, P.sal, j)) &
                           kAbsMask;
        m = v > m ? v : m;
      }
    }
    const int k2 = qtensor::block_scale_exp(m, 0, a.elem_emax, a.elem_max, a.scale_emin,
                                            a.scale_emax, a.even_mbits);
    if (k2 >= k) return k;
    k = k2;
  }
}

template <int MODE, typename T>
QT_BLOCK_FN void block_pow2(const Block<T>& b, uint32_t amax, const BlockPlan& P,
                            const BlockArgs& a) {
  int k = qtensor::block_scale_exp(amax, a.scale_rule == kRuleCeil, a.elem_emax,
                                   a.elem_max, a.scale_emin, a.scale_emax, a.even_mbits);
  // (under nearest and nearest_away a float or signed element's rounded max keeps the exponent:
  // docs/formats.md, Idempotence)
  if (a.scale_rule == kRuleEven &&
      (MODE == kTowardZero || MODE == kStochastic || (a.elem_fixed && !a.is_signed)))
    k = settle_even_exp<MODE, T>(b, amax, k, P, a);
  // the element grid shifted by the scale 2^k (built directly: this runs once per block)
  qtensor::FastGrid g;
  const int ek = a.emin + k, qk = a.elem_fixed ? k - a.fl : a.qlow + k;
  const bool stoch = MODE == kStochastic;
  const bool fast =
      b.unit &&
      (a.elem_fixed ? qtensor::make_fast_grid(g, 0, 0, qk, false, true, stoch)
                    : qtensor::make_fast_grid(g, a.man, ek, qk,
                                              ek == -126 && a.qlow == a.emin - a.man, false,
                                              stoch));
  if (fast)
    block_pow2_fast<MODE, T>(b, g, k, qk, P, a.elem_fixed);
  else if (b.unit)
    block_pow2_unit<MODE, T>(b, shifted_elem(a, k));
  else
    block_pow2_general<MODE, T>(b, shifted_elem(a, k), P);
}

// One block: its amax, then the path that applies.
template <int MODE, typename T>
QT_BLOCK_FN void round_block(const Block<T>& b, const BlockPlan& P, const BlockArgs& a) {
  const uint32_t amax = block_amax<T>(b.xp, b.m, P.sax, P.unit_stride, P.lowered);
  if (amax >= kInfBits) {  // NaN or Inf in the block: all NaN
    for (int64_t j = 0; j < b.m; ++j) store_bits<T>(b.yp + j * P.say, kNaNBits);
  } else if (MODE == kStochastic && P.fp4_sto) {
    block_fp4_sto<MODE, T>(b, amax, P);
  } else if (a.scale_rule == kRule4over6) {
    block_4over6<MODE, T>(b, amax, P, a);
  } else if (a.scale_rule == kRuleAmax) {
    if (P.amax_fast32 && P.unit_stride)
      block_amax_fast32<MODE, T>(b, amax, P, a);
    else if (b.unit && !a.amax_spec.elem_fixed)
      block_amax_unit<MODE, T>(b, amax, P, a);
    else
      block_amax_general<MODE, T>(b, amax, P, a);
  } else {
    block_pow2<MODE, T>(b, amax, P, a);
  }
}

// round_block out of line, for the per-block loop of blocks() and the run and tile paths' rare
// fallbacks (a NaN, scales near float32's limits): inlined at each of these sites, its ten loops
// were compiled once per site, mode, dtype and ISA (the build time tripled with the run paths)
template <int MODE, typename T>
__attribute__((noinline)) void round_block_out(const Block<T>& b, const BlockPlan& P,
                                               const BlockArgs& a) {
  round_block<MODE, T>(b, P, a);
}

// A counter over dims [d0, d1) of a layout, with the strides of x, y and the logical order.
inline Counter dims_counter(const Layout& L, int d0, int d1) {
  Counter c;
  c.nd = d1 - d0;
  for (int d = d0; d < d1; ++d) {
    const int k = d - d0;
    c.size[k] = L.sizes[d]; c.sx[k] = L.xs[d]; c.sy[k] = L.ys[d]; c.sl[k] = L.ls[d];
  }
  return c;
}

// ---- power-of-two scales for runs of blocks ----------------------------------------
// As fp4_block_run: the blocks' amaxes, then their scale exponents and element grids in one
// branch-free loop across the blocks (pow2_grids), then the elements with fixed trip counts
// (round_magnitude_add, round_fixed_fast_finite). The bits are block_pow2_fast's: the same k,
// the same shifted grid (each block's FastGrid numbers, or for float elements the equivalent
// float additions of round.h), the same clamp; a block whose grid block_pow2_fast could not
// build (scales near float32's limits) goes to round_block.
constexpr int64_t kPow2Run = 64;  // blocks (tiles: lanes) per run

// block_scale_exp (round.h) of a finite amax, in integer operations that vectorize: the binade
// b from the bits (a subnormal's from its integer significand converted to float, exact; -1 for
// 0), one step up where the significand field of amax (or of that conversion, the same value
// times 2^149) reaches `bump` (BlockPlan.p2_bump: ceil's and even's double comparisons are
// comparisons of significands at equal binades), minus emax, clamped to the scale's range.
QT_BLOCK_FN int pow2_scale_exp(uint32_t A, uint32_t bump, int koff, int kmin, int kmax) {
  const bool sub = A < 0x00800000u;
  const uint32_t S = sub ? f2u((float)(int32_t)A) : A;
  int b = (int)(S >> 23) - (sub ? 276 : 127);
  b = A == 0 ? -1 : b;
  b += (S & 0x007FFFFFu) >= bump ? 1 : 0;
  const int k = b + koff;
  return k < kmin ? kmin : (k > kmax ? kmax : k);
}

// A run's blocks (or a tile's lanes): amax in, per block `bad` (0: the grid below, 1: NaN or Inf
// in the block, 2: round_block) and the element grid of its scale 2^k: float elements nmin_c =
// 2^(emin + k) and the clamp lim0 = max * 2^k; fixed-point ones the FastGrid numbers C, q, h and
// the limits lim0..2 (block_pow2_fast's pos, neg, neg_sat).
struct Pow2Grids {
  uint32_t amax[kPow2Run], bad[kPow2Run], nmin[kPow2Run];
  uint32_t lim0[kPow2Run], lim1[kPow2Run], lim2[kPow2Run];
  float C[kPow2Run], q[kPow2Run], h[kPow2Run];
};

template <bool FIXED>
QT_BLOCK_FN void pow2_grids(Pow2Grids& G, int64_t n, const BlockPlan& P, const BlockArgs& a) {
  const uint32_t bump = P.p2_bump;
  const int koff = -a.elem_emax, kmin = a.scale_emin, kmax = a.scale_emax;
  const int emin = a.emin, fl = a.fl;
  const uint32_t dsh = FIXED ? 0u : (uint32_t)(23 - a.man) << 23;
  const float emf = P.elem_max_f, kmf = P.kmax_f, kaf = P.kmin_abs_f;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t A = G.amax[i];
    const int k = pow2_scale_exp(A, bump, koff, kmin, kmax);
    bool fast;
    if (FIXED) {
      // make_fast_grid(g, 0, 0, k - fl, false, true, false)
      const int qk = k - fl;
      fast = qk + 23 <= 127 && qk >= -149;
      const float qf = qtensor::pow2f(qk);
      G.C[i] = qtensor::pow2f(qk + 23);
      G.q[i] = qf;
      G.h[i] = qtensor::pow2f(qk - 1 < -149 ? -149 : qk - 1);
      const uint32_t l1 = f2u(kaf * qf);
      G.lim0[i] = f2u(kmf * qf);
      G.lim1[i] = l1;
      G.lim2[i] = l1 != 0 ? (l1 | kSignBit) : 0u;
    } else {
      // make_fast_grid(g, man, ek, ek - man, ...) holds for ek >= -126 (qlow + k + 23 =
      // ek + d <= 127 is implied below, qlow + k >= -148): and round_magnitude_add's c =
      // 2^(max(binade, ek) + d) must stay finite up to the amax
      const int ek = emin + k;
      const uint32_t nm = (uint32_t)(ek + 127) << 23;
      const uint32_t E = A & kInfBits;
      fast = ek >= -126 && (E > nm ? E : nm) + dsh <= 0x7F000000u;
      G.nmin[i] = nm;
      G.lim0[i] = f2u(emf * qtensor::pow2f(k));  // block_pow2_fast's mx
    }
    G.bad[i] = A >= kInfBits ? 1u : (fast ? 0u : 2u);
  }
}

// One block's (m) or lane's elements on the grid of pow2_grids' entry i.
template <int MODE, bool FIXED, typename T>
QT_BLOCK_FN void pow2_elems(const T* __restrict__ xp, T* __restrict__ yp, int64_t m,
                            const Pow2Grids& G, int64_t i, uint32_t dsh) {
  const uint32_t l0 = G.lim0[i];
  if (FIXED) {
    qtensor::FastGrid g;
    g.d = 0; g.mask = 0; g.normal_min = 0xFFFFFFFFu; g.C = G.C[i]; g.q = G.q[i]; g.h = G.h[i];
    g.sto = 0.0f;
    const uint32_t l1 = G.lim1[i], l2 = G.lim2[i];
    for (int64_t j = 0; j < m; ++j)
      store_bits<T>(yp + j, qtensor::round_fixed_fast_finite<MODE>(load_bits<T>(xp + j), g, l0,
                                                                   l1, l2));
  } else {
    const uint32_t nm = G.nmin[i];
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t u = load_bits<T>(xp + j);
      uint32_t rr = qtensor::round_magnitude_add<MODE>(u & kAbsMask, nm, dsh);
      rr = rr > l0 ? l0 : rr;
      store_bits<T>(yp + j, rr | (u & kSignBit));
    }
  }
}

// max |x| bits of 8 consecutive float32 blocks of BS (a multiple of 8) at x: per block the
// lanewise max of its vectors of 8, then the 8 vectors reduced together by 3 levels of shuffles and maxes (a
// transpose; a vector reduction per block costs about twice as much with 16 lanes). GCC vector
// extensions: each ISA's copy splits or widens them as it can.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // (always inlined: no call passes a vector)
QT_BLOCK_FN qt_v8u v8_max(qt_v8u a, qt_v8u b) { return a > b ? a : b; }
QT_BLOCK_FN qt_v8u v8_abs_bits(const float* p) {
  qt_v8u v;
  std::memcpy(&v, p, 32);
  return v & kAbsMask;
}
template <int BS>
QT_BLOCK_FN void amax_8x(const float* x, uint32_t* am) {
  qt_v8u p[8], q[4], r[2];
  for (int b = 0; b < 8; ++b) {
    const float* xp = x + b * BS;
    p[b] = v8_abs_bits(xp);
    for (int i = 8; i < BS; i += 8) p[b] = v8_max(p[b], v8_abs_bits(xp + i));
  }
  for (int i = 0; i < 4; ++i)  // lanes: p[2i] 0-3 | p[2i+1] 0-3, max with the 4-7s
    q[i] = v8_max(__builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11),
                  __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15));
  for (int i = 0; i < 2; ++i)
    r[i] = v8_max(__builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13),
                  __builtin_shufflevector(q[2 * i], q[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15));
  const qt_v8u t = v8_max(__builtin_shufflevector(r[0], r[1], 0, 8, 2, 10, 4, 12, 6, 14),
                          __builtin_shufflevector(r[0], r[1], 1, 9, 3, 11, 5, 13, 7, 15));
  // lane i of t is block {0, 4, 2, 6, 1, 5, 3, 7}[i]
  am[0] = t[0]; am[4] = t[1]; am[2] = t[2]; am[6] = t[3];
  am[1] = t[4]; am[5] = t[5]; am[3] = t[6]; am[7] = t[7];
}
#pragma GCC diagnostic pop

// nblk consecutive blocks of bs (BS > 0: fixed at compile time) along a contiguous row from x,
// the last possibly cut short by the row's end (avail elements left in the row).
template <int MODE, int BS, bool FIXED, typename T>
void pow2_block_run(const T* x, T* y, int64_t nblk, int64_t bs_rt, int64_t avail,
                    const BlockPlan& P, const BlockArgs& a) {
  const int64_t bs = BS > 0 ? BS : bs_rt;
  Pow2Grids G;
  const int64_t nfull = std::min(nblk, avail / bs);
  int64_t b0 = 0;
  if constexpr (std::is_same<T, float>::value && BS == 32)
    if (!P.lowered)
      for (; b0 + 8 <= nfull; b0 += 8) amax_8x<32>(x + b0 * 32, G.amax + b0);
  for (int64_t b = b0; b < nfull; ++b)
    G.amax[b] = block_amax<T>(x + b * bs, bs, 1, true, P.lowered);
  if (nfull < nblk)
    G.amax[nfull] = block_amax<T>(x + nfull * bs, avail - nfull * bs, 1, true, P.lowered);
  pow2_grids<FIXED>(G, nblk, P, a);
  const uint32_t dsh = FIXED ? 0u : (uint32_t)(23 - a.man) << 23;
  // the rare blocks out of line: round_block inlined here would keep gcc from inlining the
  // element loops (a call per block, with a run-time trip count)
  auto other = [&](int64_t b, int64_t m) __attribute__((noinline)) {
    const T* xp = x + b * bs;
    T* yp = y + b * bs;
    if (G.bad[b] == 1) {  // NaN or Inf in the block: all NaN
      for (int64_t j = 0; j < m; ++j) store_bits<T>(yp + j, kNaNBits);
    } else {
      round_block_out<MODE, T>(make_block<MODE, T>(xp, yp, m, 0, P, 0u), P, a);
    }
  };
  for (int64_t b = 0; b < nfull; ++b) {
    if (__builtin_expect(G.bad[b] == 0, 1))
      pow2_elems<MODE, FIXED, T>(x + b * bs, y + b * bs, bs, G, b, dsh);
    else
      other(b, bs);
  }
  if (nfull < nblk) {
    const int64_t m = avail - nfull * bs;
    if (G.bad[nfull] == 0)
      pow2_elems<MODE, FIXED, T>(x + nfull * bs, y + nfull * bs, m, G, nfull, dsh);
    else
      other(nfull, m);
  }
}

// ---- blocks along a strided axis, a tile at a time --------------------------------
// Where the block axis is not contiguous but another dim (the lanes) is, in x and in y (e.g. a
// contiguous matrix with blocks along its rows' dim, or a transposed view with blocks along its
// last dim), a tile of one block (up to bs steps along the axis) times kTileW neighbouring lanes is
// rounded at once: the lanes' amaxes (a vector max per step), each lane's scale (the functions of
// the contiguous path), then the elements (vectorized across lanes). The bits are those of the
// per-block paths; a tile whose scales need a grid the FastGrid cannot do is rounded block by
// block (round_block on strided blocks). Deterministic rounding only (stochastic rounding's
// words follow the element order) and not 4over6: those keep the per-block loop.
constexpr int64_t kTileW = 64;

// L with its lane dim (the last one that is contiguous in x and in y, not the axis) moved last;
// false where there is none or the axis is contiguous.
inline bool tile_layout(const Layout& L, int ax, Layout& Lt, int& axt) {
  if (L.ndim < 2 || (L.xs[ax] == 1 && L.ys[ax] == 1)) return false;
  int lane = -1;
  for (int d = L.ndim - 1; d >= 0 && lane < 0; --d)
    if (d != ax && L.xs[d] == 1 && L.ys[d] == 1 && L.sizes[d] > 1) lane = d;
  if (lane < 0) return false;
  Lt = L;
  Lt.contiguous = false;
  int k = 0;
  for (int d = 0; d < L.ndim; ++d) {
    if (d == lane) continue;
    Lt.sizes[k] = L.sizes[d]; Lt.xs[k] = L.xs[d]; Lt.ys[k] = L.ys[d]; Lt.ls[k] = L.ls[d];
    if (d == ax) axt = k;
    ++k;
  }
  Lt.sizes[k] = L.sizes[lane]; Lt.xs[k] = 1; Lt.ys[k] = 1; Lt.ls[k] = L.ls[lane];
  return true;
}

// y[j*say + c] = fn(x[j*sax + c], c) for j < m, c < w; NaN where nan[c] (the lane's block holds a
// NaN or an Inf). (x may be y: each element is read before it is written.)
template <typename T, typename Fn>
QT_BLOCK_FN void tile_elems(const T* __restrict__ xt, int64_t sax, T* __restrict__ yt, int64_t say,
                            int64_t m, int64_t w, const uint32_t* nan, const Fn& fn) {
  for (int64_t j = 0; j < m; ++j) {
    const T* __restrict__ xr = xt + j * sax;
    T* __restrict__ yr = yt + j * say;
    for (int64_t c = 0; c < w; ++c) {
      const uint32_t q = fn(load_bits<T>(xr + c), c);
      store_bits<T>(yr + c, nan[c] != 0 ? kNaNBits : q);
    }
  }
}

// One tile: m steps along the axis from xt/yt, w lanes.
template <int MODE, typename T>
void round_tile(const T* xt, T* yt, int64_t m, int64_t w, const BlockPlan& P,
                const BlockArgs& a, uint32_t key) {
  uint32_t amax[kTileW], nan[kTileW];
  for (int64_t c = 0; c < w; ++c) amax[c] = 0;
  for (int64_t j = 0; j < m; ++j) {
    const T* xr = xt + j * P.sax;
    if (P.lowered) {
      for (int64_t c = 0; c < w; ++c) {
        const uint32_t v = lowered_abs_bits(load_bits<T>(xr + c));
        amax[c] = v > amax[c] ? v : amax[c];
      }
      continue;
    }
    for (int64_t c = 0; c < w; ++c) {
      const uint32_t v = load_bits<T>(xr + c) & kAbsMask;
      amax[c] = v > amax[c] ? v : amax[c];
    }
  }
  for (int64_t c = 0; c < w; ++c) nan[c] = amax[c] >= kInfBits ? 1u : 0u;
  // lane c's block as the per-block paths see it (strided, read-only here)
  auto lane_block = [&](int64_t c) {
    return make_block<MODE, T>(xt + c, yt + c, m, 0, P, key);
  };
  if (a.scale_rule == kRuleAmax) {
    if (P.fp4_fmt) {  // NVFP4: fp4_block_run's scales and elements
      float X[kTileW];
      const qtensor::FastGrid g = P.sg;
      for (int64_t c = 0; c < w; ++c) X[c] = fp4_scale(amax[c], g, P.smax, P.sovf, P.elem_max_f);
      for (int64_t c = 0; c < w; ++c) X[c] = fp4_settled<MODE>(amax[c], X[c], a);
      tile_elems<T>(xt, P.sax, yt, P.say, m, w, nan, [&](uint32_t u, int64_t c) {
        const float Xc = X[c];
        const qtensor::Fp4Bounds bd = qtensor::fp4_bounds<MODE>(Xc);
        return f2u(qtensor::fp4_round_scaled<MODE>(u2f(u & kAbsMask), bd, Xc)) | (u & kSignBit);
      });
    } else if (P.amax_fast32) {  // block_amax_fast32's scales and elements
      float Xs[kTileW];
      uint32_t ok[kTileW];
      for (int64_t c = 0; c < w; ++c) {
        double sc = 1.0;
        if (!nan[c])
          sc = settled_scale<MODE, T>(lane_block(c), amax[c], (double)u2f(
              qtensor::round_float_fast<kNearest>(f2u(u2f(amax[c]) / P.elem_max_f), P.sg,
                                                  P.smax, P.sovf, 0u)), P, a.amax_spec);
        ok[c] = sc > 0 ? 1u : 0u;
        Xs[c] = sc > 0 ? (float)sc : 1.0f;
      }
      const qtensor::FastGrid g = P.eg;
      const uint32_t mx = f2u(P.elem_max_f);
      tile_elems<T>(xt, P.sax, yt, P.say, m, w, nan, [&](uint32_t u, int64_t c) {
        const float X = Xs[c];
        const uint32_t zb = f2u(u2f(u) / X);
        uint32_t rr = qtensor::round_magnitude_fast<MODE>(zb & kAbsMask, g, 0u);
        rr = rr > mx ? mx : rr;
        const float q = u2f(rr | (u & kSignBit)) * X;
        return ok[c] != 0 ? f2u(q) : (u & kSignBit);
      });
    } else {  // block_amax_unit / block_amax_general: in double
      double S[kTileW];
      for (int64_t c = 0; c < w; ++c)
        S[c] = nan[c] ? 1.0 : settled_scale<MODE, T>(
            lane_block(c), amax[c], qtensor::amax_block_scale(amax[c], a.amax_spec), P,
            a.amax_spec);
      const qtensor::AmaxBlockSpec sp = a.amax_spec;
      tile_elems<T>(xt, P.sax, yt, P.say, m, w, nan, [&](uint32_t u, int64_t c) {
        return f2u(qtensor::round_amax_elem<MODE>(u2f(u), S[c], sp, 0u));
      });
    }
    return;
  }
  if (P.pow2_run) {  // the lanes' grids in one loop (pow2_grids), then the elements
    static_assert(kTileW <= kPow2Run, "a tile's lanes are one run");
    Pow2Grids G;
    bool all_fast = true;
    for (int64_t c = 0; c < w; ++c) G.amax[c] = amax[c];
    if (a.elem_fixed) pow2_grids<true>(G, w, P, a);
    else pow2_grids<false>(G, w, P, a);
    for (int64_t c = 0; c < w; ++c) all_fast = all_fast && G.bad[c] != 2;
    if (!all_fast) {  // rare (scales near float32's limits): block by block
      for (int64_t c = 0; c < w; ++c) round_block_out<MODE, T>(lane_block(c), P, a);
      return;
    }
    if (a.elem_fixed) {
      tile_elems<T>(xt, P.sax, yt, P.say, m, w, nan, [&](uint32_t u, int64_t c) {
        qtensor::FastGrid g;
        g.d = 0; g.mask = 0; g.normal_min = 0xFFFFFFFFu; g.C = G.C[c]; g.q = G.q[c];
        g.h = G.h[c]; g.sto = 0.0f;
        return qtensor::round_fixed_fast_finite<MODE>(u, g, G.lim0[c], G.lim1[c], G.lim2[c]);
      });
    } else {
      const uint32_t dsh = (uint32_t)(23 - a.man) << 23;
      tile_elems<T>(xt, P.sax, yt, P.say, m, w, nan, [&](uint32_t u, int64_t c) {
        // (a NaN lane's values are overwritten)
        uint32_t rr = qtensor::round_magnitude_add<MODE>(u & kAbsMask, G.nmin[c], dsh);
        rr = rr > G.lim0[c] ? G.lim0[c] : rr;
        return rr | (u & kSignBit);
      });
    }
    return;
  }
  // power-of-two scales 2^k (block_pow2): each lane's k, then its element grid as a FastGrid
  // (block_pow2_fast), kept as arrays (the loop below builds each lane's grid from them)
  uint32_t nmin[kTileW], lim0[kTileW], lim1[kTileW], lim2[kTileW];
  float gC[kTileW], gq[kTileW], gh[kTileW];
  bool all_fast = true;
  for (int64_t c = 0; c < w; ++c) {
    qtensor::FastGrid g;
    int k = 0;
    bool fast = true;
    if (!nan[c]) {
      k = qtensor::block_scale_exp(amax[c], a.scale_rule == kRuleCeil, a.elem_emax, a.elem_max,
                                   a.scale_emin, a.scale_emax, a.even_mbits);
      if (a.scale_rule == kRuleEven && (MODE == kTowardZero || (a.elem_fixed && !a.is_signed)))
        k = settle_even_exp<MODE, T>(lane_block(c), amax[c], k, P, a);
      const int ek = a.emin + k, qk = a.elem_fixed ? k - a.fl : a.qlow + k;
      fast = a.elem_fixed ? qtensor::make_fast_grid(g, 0, 0, qk, false, true, false)
                          : qtensor::make_fast_grid(g, a.man, ek, qk,
                                                    ek == -126 && a.qlow == a.emin - a.man,
                                                    false, false);
      if (fast && a.elem_fixed) {
        const float qf = qtensor::pow2f(qk);
        lim0[c] = f2u(P.kmax_f * qf);
        lim1[c] = f2u(P.kmin_abs_f * qf);
        lim2[c] = lim1[c] != 0 ? (lim1[c] | kSignBit) : 0u;
      } else if (fast) {
        lim0[c] = f2u(P.elem_max_f * qtensor::pow2f(k));
        lim1[c] = lim2[c] = 0;
      }
    }
    if (nan[c] || !fast) {  // (a NaN lane's values are overwritten)
      g.normal_min = 0; g.C = 1.0f; g.q = 1.0f; g.h = 0.5f;
      lim0[c] = lim1[c] = lim2[c] = 0;
    }
    all_fast = all_fast && fast;
    nmin[c] = g.normal_min; gC[c] = g.C; gq[c] = g.q; gh[c] = g.h;
  }
  if (!all_fast) {  // rare (scales near float32's limits): block by block
    for (int64_t c = 0; c < w; ++c) round_block_out<MODE, T>(lane_block(c), P, a);
    return;
  }
  const int d = a.elem_fixed ? 0 : 23 - a.man;
  auto lane_grid = [&](int64_t c) {
    qtensor::FastGrid g;
    g.d = d; g.mask = ((uint32_t)1 << d) - 1;
    g.normal_min = nmin[c]; g.C = gC[c]; g.q = gq[c]; g.h = gh[c]; g.sto = 0.0f;
    return g;
  };
  if (a.elem_fixed) {
    tile_elems<T>(xt, P.sax, yt, P.say, m, w, nan, [&](uint32_t u, int64_t c) {
      return qtensor::round_fixed_fast<MODE>(u, lane_grid(c), lim0[c], lim1[c], lim2[c], 0u);
    });
  } else {
    tile_elems<T>(xt, P.sax, yt, P.say, m, w, nan, [&](uint32_t u, int64_t c) {
      uint32_t rr = qtensor::round_magnitude_fast<MODE>(u & kAbsMask, lane_grid(c), 0u);
      rr = rr > lim0[c] ? lim0[c] : rr;
      return rr | (u & kSignBit);
    });
  }
}

// All blocks of a layout from tile_layout (lanes last): units (outer index, block, lane chunk),
// lane chunks fastest (neighbouring units touch neighbouring memory).
template <int MODE, typename T>
void blocks_tiled(const T* x, T* y, const Layout& L, const BlockArgs& a, uint32_t key) {
  const BlockPlan P = block_plan<MODE>(L, a);
  const int lane = L.ndim - 1;
  const int64_t W = L.sizes[lane], nch = (W + kTileW - 1) / kTileW;
  const int64_t bs = P.bs, len = P.len, nb = P.nb;
  const int64_t outer = L.numel / (len * W);
  const int64_t units = outer * nb * nch;
  const int64_t grain = std::max<int64_t>(1, kGrain / (bs * kTileW));
  at::parallel_for(0, units, grain, [&](int64_t ub, int64_t ue) {
    Counter oc;  // the dims but the axis and the lanes
    oc.nd = 0;
    for (int d = 0; d < lane; ++d) {
      if (d == P.ax) continue;
      oc.size[oc.nd] = L.sizes[d]; oc.sx[oc.nd] = L.xs[d]; oc.sy[oc.nd] = L.ys[d];
      oc.sl[oc.nd] = 0;
      ++oc.nd;
    }
    for (int64_t u = ub; u < ue; ++u) {
      const int64_t ch = u % nch, r = u / nch;
      const int64_t b = r % nb, o = r / nb;
      if (u == ub || ch == 0) oc.set(o);
      const int64_t j0 = b * bs, c0 = ch * kTileW;
      round_tile<MODE, T>(x + oc.ox + j0 * P.sax + c0, y + oc.oy + j0 * P.say + c0,
                          std::min(bs, len - j0), std::min(kTileW, W - c0), P, a, key);
    }
  });
}

template <int MODE, typename T>
void blocks(const T* x, T* y, const Layout& L, const BlockArgs& a, uint32_t key) {
  if (L.numel == 0) return;
  if constexpr (MODE != kStochastic) {  // (the tiles are not compiled for stochastic rounding)
    if (a.scale_rule != kRule4over6) {
      Layout Lt;
      int axt = 0;
      if (tile_layout(L, a.axis, Lt, axt)) {
        BlockArgs at = a;
        at.axis = axt;
        blocks_tiled<MODE, T>(x, y, Lt, at, key);
        return;
      }
    }
  }
  const BlockPlan P = block_plan<MODE>(L, a);
  const int64_t inner = P.inner, nb = P.nb, bs = P.bs, len = P.len;
  at::parallel_for(0, P.units, P.grain, [&](int64_t ub, int64_t ue) {
    Counter oc = dims_counter(L, 0, P.ax), ic = dims_counter(L, P.ax + 1, L.ndim);
    int64_t i = ub % inner, rest = ub / inner;
    int64_t bidx = rest % nb, o = rest / nb;
    oc.set(o); ic.set(i);
    for (int64_t u = ub; u < ue; ++u) {
      if (P.fp4_rows) {  // the rest of this row's blocks (inner == 1), a run at a time
        const int64_t run = std::min(std::min(ue - u, nb - bidx), kFp4Run);
        const int64_t j0 = bidx * bs;
        const T* xp = x + oc.ox + j0;
        T* yp = y + oc.oy + j0;
        if constexpr (MODE == kStochastic) {  // (the axis' logical stride is 1: inner == 1)
          if (bs == 16)
            fp4_sto_run<16, T>(xp, yp, run, bs, len - j0, P, (uint64_t)(oc.ol + j0), key);
          else
            fp4_sto_run<0, T>(xp, yp, run, bs, len - j0, P, (uint64_t)(oc.ol + j0), key);
        } else if (a.scale_rule == kRule4over6)
          fp4_block_run<MODE, 0, T, true>(xp, yp, run, bs, len - j0, P.sg, P.smax, P.sovf,
                                          P.elem_max_f, a);
        else if (bs == 16)
          fp4_block_run<MODE, 16, T>(xp, yp, run, bs, len - j0, P.sg, P.smax, P.sovf,
                                     P.elem_max_f, a);
        else
          fp4_block_run<MODE, 0, T>(xp, yp, run, bs, len - j0, P.sg, P.smax, P.sovf,
                                    P.elem_max_f, a);
        u += run - 1;  // and the loop's ++u
        bidx += run;
        if (bidx == nb) { bidx = 0; oc.next(); }
        continue;
      }
      if (P.pow2_rows) {  // the same, power-of-two scales
        const int64_t run = std::min(std::min(ue - u, nb - bidx), kPow2Run);
        const int64_t j0 = bidx * bs;
        const T* xp = x + oc.ox + j0;
        T* yp = y + oc.oy + j0;
        // (compiled only where the plan can take it: deterministic modes, and the fixed block
        // size 32 for float32 payloads only: each instantiation is a large inlined loop nest per
        // ISA, and the build time grows with them)
        if constexpr (MODE != kStochastic) {
          constexpr bool f32 = std::is_same<T, float>::value;
          if (a.elem_fixed) {
            if (f32 && bs == 32) pow2_block_run<MODE, f32 ? 32 : 0, true, T>(xp, yp, run, bs, len - j0, P, a);
            else pow2_block_run<MODE, 0, true, T>(xp, yp, run, bs, len - j0, P, a);
          } else {
            if (f32 && bs == 32) pow2_block_run<MODE, f32 ? 32 : 0, false, T>(xp, yp, run, bs, len - j0, P, a);
            else pow2_block_run<MODE, 0, false, T>(xp, yp, run, bs, len - j0, P, a);
          }
        }
        u += run - 1;
        bidx += run;
        if (bidx == nb) { bidx = 0; oc.next(); }
        continue;
      }
      const int64_t j0 = bidx * bs;
      const uint64_t l0 = (uint64_t)(oc.ol + ic.ol + j0 * P.sal);
      round_block_out<MODE, T>(make_block<MODE, T>(x + oc.ox + ic.ox + j0 * P.sax,
                                               y + oc.oy + ic.oy + j0 * P.say,
                                               std::min(bs, len - j0), l0, P, key),
                           P, a);
      // next unit
      if (++i == inner) {
        i = 0; ic.set(0);
        if (++bidx == nb) { bidx = 0; oc.next(); }
      } else {
        ic.next();
      }
    }
  });
}

// max of fn(x_i, r_i) over a strided tensor in logical order, storing nothing (one thread: only
// the rare re-rounding of a whole-tensor amax-rule block, stochastic or unsigned elements)
template <bool STOCH, typename T, typename Fn>
uint32_t max_of_elementwise(const T* x, const Layout& L, uint32_t key, uint32_t sr_or,
                            const Fn& fn) {
  Counter c;
  c.nd = L.ndim;
  for (int d = 0; d < L.ndim; ++d) {
    c.size[d] = L.sizes[d]; c.sx[d] = L.xs[d]; c.sy[d] = 0; c.sl[d] = 0;
  }
  c.set(0);
  uint32_t m = 0;
  for (int64_t i = 0; i < L.numel; ++i) {
    const uint32_t r =
        STOCH ? random_word(index_key(key, (uint64_t)i), (uint32_t)(uint64_t)i) | sr_or : 0u;
    const uint32_t v = fn(load_bits<T>(x + c.ox), r);
    m = v > m ? v : m;
    c.next();
  }
  return m;
}

// axis=None: the whole tensor is one block (two passes: the amax, then the rounding).
template <int MODE, typename T>
void whole_tensor_block(const T* x, T* y, const Layout& L, const BlockArgs& a, uint32_t key) {
  if (L.numel == 0) return;
  constexpr bool STOCH = MODE == kStochastic;
  const uint32_t amax = amax_bits<false, T>(x, L, negative_power_lowers(a));
  if (amax >= kInfBits) {
    elementwise<false, T>(x, y, L, key, [](uint32_t, uint32_t) { return kNaNBits; });
  } else if (a.scale_rule == kRuleAmax) {
    const qtensor::AmaxBlockSpec spec = a.amax_spec;
    double sc = qtensor::amax_block_scale(amax, spec);
    // idempotence (round.h, settle_amax_scale), before any store (x may be y)
    if (qtensor::rounded_amax_from_amax<MODE>(spec)) {
      sc = qtensor::settle_amax_scale(sc, spec, [&](double s) {
        return f2u(qtensor::round_amax_elem<MODE>(u2f(amax), s, spec, 0u)) & kAbsMask;
      });
    } else {
      sc = qtensor::settle_amax_scale(sc, spec, [&](double s) {
        return max_of_elementwise<STOCH, T>(x, L, key, a.sr_or, [=](uint32_t u, uint32_t r) {
          return f2u(qtensor::round_amax_elem<MODE>(u2f(u), s, spec, r)) & kAbsMask;
        });
      });
    }
    const uint32_t om = a.sr_or;
    elementwise<STOCH, T>(x, y, L, key, [=](uint32_t u, uint32_t r) {
      return f2u(qtensor::round_amax_elem<MODE>(u2f(u), sc, spec, r | om));
    });
  } else {
    int k = qtensor::block_scale_exp(amax, a.scale_rule == kRuleCeil, a.elem_emax,
                                     a.elem_max, a.scale_emin, a.scale_emax, a.even_mbits);
    while (a.scale_rule == kRuleEven) {  // idempotence (settle_even_exp), before any store
      const qtensor::BlockElemSpec sk = shifted_elem(a, k);
      const uint32_t m = max_of_elementwise<STOCH, T>(x, L, key, a.sr_or,
                                                      [=](uint32_t u, uint32_t r) {
        return qtensor::round_block_elem<MODE>(u, sk, r) & kAbsMask;
      });
      const int k2 = qtensor::block_scale_exp(m, 0, a.elem_emax, a.elem_max, a.scale_emin,
                                              a.scale_emax, a.even_mbits);
      if (k2 >= k) break;
      k = k2;
    }
    const qtensor::BlockElemSpec s = shifted_elem(a, k);
    const uint32_t om = a.sr_or;
    elementwise<STOCH, T>(x, y, L, key, [=](uint32_t u, uint32_t r) {
      return qtensor::round_block_elem<MODE>(u, s, r | om);
    });
  }
}

// ---- entry points, one per family, dispatching the rounding mode (QT_MODE_SWITCH, round.h) to a
// template argument

template <typename T>
void float_kernel(const T* x, T* y, const Layout& L, const qtensor::FloatSpec<uint32_t>& s,
                  int mode_arg, uint32_t key) {
  const uint32_t om = qtensor::sr_or_mask(mode_arg);
  const int mode = qtensor::mode_base(mode_arg);
  const qtensor::FloatSpec<uint32_t> sp = s;
  qtensor::FastGrid g;
  const bool all_normal = s.emin == -126 && s.qlow == s.emin - s.man;
  if (!s.is_unsigned &&
      qtensor::make_fast_grid(g, s.man, s.emin, s.qlow, all_normal, false, mode == kStochastic)) {
    const uint32_t mx = s.max_bits, ovf = s.ovf_bits;
    QT_MODE_SWITCH(mode, elementwise<M == kStochastic, T>(x, y, L, key,
                                                         [g, mx, ovf, om](uint32_t u, uint32_t r) {
      return qtensor::round_float_fast<M>(u, g, mx, ovf, r | om);
    }));
    return;
  }
  QT_MODE_SWITCH(mode, elementwise<M == kStochastic, T>(x, y, L, key,
                                                       [sp, om](uint32_t u, uint32_t r) {
    return qtensor::round_float<M, uint32_t>(u, sp, r | om);
  }));
}

template <typename T>
void fixed_kernel(const T* x, T* y, const Layout& L, const qtensor::FixedSpec<uint32_t>& s,
                  bool wrap, int mode_arg, uint32_t key) {
  const uint32_t om = qtensor::sr_or_mask(mode_arg);
  const int mode = qtensor::mode_base(mode_arg);
  const qtensor::FixedSpec<uint32_t> sp = s;
  qtensor::FastGrid g;
  if (!wrap && qtensor::make_fast_grid(g, 0, 0, s.qexp, false, true, mode == kStochastic)) {
    const uint32_t pos = s.pos_bits, neg = s.neg_bits, neg_sat = s.neg_sat_bits;
    QT_MODE_SWITCH(mode, elementwise<M == kStochastic, T>(
                             x, y, L, key, [g, pos, neg, neg_sat, om](uint32_t u, uint32_t r) {
      return qtensor::round_fixed_fast<M>(u, g, pos, neg, neg_sat, r | om);
    }));
    return;
  }
  if (wrap) {
    QT_MODE_SWITCH(mode, elementwise<M == kStochastic, T>(x, y, L, key,
                                                         [sp, om](uint32_t u, uint32_t r) {
      return qtensor::round_fixed<M, true, uint32_t>(u, sp, r | om);
    }));
  } else {
    QT_MODE_SWITCH(mode, elementwise<M == kStochastic, T>(x, y, L, key,
                                                         [sp, om](uint32_t u, uint32_t r) {
      return qtensor::round_fixed<M, false, uint32_t>(u, sp, r | om);
    }));
  }
}

// dst[logical order] = src[strides], or (TO_LOGICAL false) dst[strides] = src[logical order],
// converting the element type (float32 <-> Half / BFloat16)
template <bool TO_LOGICAL, typename TS, typename TD>
void copy_logical(const TS* src, TD* dst, const Layout& L, const int64_t* strides) {
  if (L.ndim == 0) { dst[0] = (TD)(float)src[0]; return; }
  const int last = L.ndim - 1;
  const int64_t w = L.sizes[last], st = strides[last];
  at::parallel_for(0, L.numel / w, std::max<int64_t>(1, kGrain / w), [&](int64_t rb, int64_t re) {
    Counter rows;  // the dims before the last, with the strided side's offsets
    rows.nd = last;
    for (int d = 0; d < last; ++d) {
      rows.size[d] = L.sizes[d]; rows.sx[d] = strides[d]; rows.sy[d] = 0; rows.sl[d] = 0;
    }
    rows.set(rb);
    for (int64_t r = rb; r < re; ++r, rows.next()) {
      const int64_t o = rows.ox, lo = r * w;
      if (TO_LOGICAL) {
        if (st == 1) for (int64_t c = 0; c < w; ++c) dst[lo + c] = (TD)(float)src[o + c];
        else for (int64_t c = 0; c < w; ++c) dst[lo + c] = (TD)(float)src[o + c * st];
      } else {
        if (st == 1) for (int64_t c = 0; c < w; ++c) dst[o + c] = (TD)src[lo + c];
        else for (int64_t c = 0; c < w; ++c) dst[o + c * st] = (TD)src[lo + c];
      }
    }
  });
}

// Half and BFloat16 payloads are rounded as their float32 copy in logical order: the same bits
// (the widening is exact, every path stores the rounded value as float32 bits, and store_bits
// narrows those bits as the conversion back does). One set of block loops per mode and ISA
// instead of three (the build time) against two conversion passes, done a chunk of
// kStageChunk elements at a time (in cache) along dim 0, whole blocks per chunk. Stochastic
// rounding stages the whole tensor: its words follow the logical indices from 0.
constexpr int64_t kStageChunk = 1 << 15;

template <int MODE, typename T>
void blocks_via_float(const T* x, T* y, const Layout& L, const BlockArgs& a, uint32_t key) {
  if (L.numel == 0) return;
  const int64_t n0 = L.ndim == 0 ? 1 : L.sizes[0], unit = L.numel / n0;
  const int64_t step = L.ndim > 0 && a.axis == 0 ? a.block_size : 1;  // dim-0 indices per chunk
  const int64_t cnt = MODE == kStochastic
      ? n0 : std::min(n0, std::max<int64_t>(1, kStageChunk / (unit * step)) * step);
  const int64_t nchunks = (n0 + cnt - 1) / cnt;
  Layout Lf = L;  // a chunk's float32 copy: contiguous (its logical strides)
  Lf.contiguous = true;
  for (int d = 0; d < L.ndim; ++d) Lf.xs[d] = Lf.ys[d] = L.ls[d];
  const int64_t sx0 = L.ndim ? L.xs[0] : 0, sy0 = L.ndim ? L.ys[0] : 0;
  auto chunks = [&](int64_t cb, int64_t ce) {
    std::unique_ptr<float[]> buf(new float[cnt * unit]);
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t i0 = c * cnt, m = std::min(cnt, n0 - i0);
      Layout Lc = L, Lcf = Lf;
      if (L.ndim > 0) { Lc.sizes[0] = Lcf.sizes[0] = m; }
      Lc.numel = Lcf.numel = m * unit;
      copy_logical<true>(x + i0 * sx0, buf.get(), Lc, L.xs);
      blocks<MODE, float>(buf.get(), buf.get(), Lcf, a, key);
      copy_logical<false>(buf.get(), y + i0 * sy0, Lc, L.ys);
    }
  };
  // (one chunk: called directly, so that the loops inside it still run in parallel)
  if (nchunks == 1) chunks(0, 1);
  else at::parallel_for(0, nchunks, 1, chunks);
}

template <typename T>
void block_kernel(const T* x, T* y, const Layout& L, const BlockArgs& args, int mode_arg,
                  uint32_t key) {
  BlockArgs a = args;
  a.sr_or = qtensor::sr_or_mask(mode_arg);
  const int mode = qtensor::mode_base(mode_arg);
  if (a.whole_tensor) {
    QT_MODE_SWITCH(mode, whole_tensor_block<M, T>(x, y, L, a, key));
  } else if constexpr (std::is_same<T, float>::value) {
    QT_MODE_SWITCH(mode, blocks<M, T>(x, y, L, a, key));
  } else {
    QT_MODE_SWITCH(mode, blocks_via_float<M, T>(x, y, L, a, key));
  }
}

// ---- two-level block formats (tensor_scale=True): Transformer Engine's rule, every step one
// float32 operation in the order of reference._two_level_blocks (docs/formats.md, "NVFP4: the
// tensor scale"); the scalar roundings are round.h's, as the compiled quantize_float/fixed give
// them to the reference. One pass over the blocks after the tensor's amax (quantize.cpp).
using qtensor::TwoLevelArgs;
using qtensor::TwoLevelGeom;
using qtensor::kTlFloat;
using qtensor::kTlFixed;
using qtensor::kTlFp4;
constexpr float kFltMax = 3.40282346638528859812e+38f;

// reference._scale_code: t (>= 0; NaN and +Inf read as FLT_MAX) to the scale format, nearest and
// saturating, or upward (ceil), clamped to the scale's max
QT_BLOCK_FN float tl_code(float t, const TwoLevelArgs& a) {
  const float tt = t < kFltMax ? t : kFltMax;
  if (a.scale_rule == kRuleCeil) {
    const double up = qtensor::round_float_up((double)tt, a.sfd);
    return up < (double)a.sf_max ? (float)up : a.sf_max;
  }
  return u2f(qtensor::round_float<kNearest, uint32_t, false>(f2u(tt), a.sf, 0u));
}

// reference.te_scale_fns: a block's scale X (float32, a scale value) from its amax; cand 1 is
// 4over6's map-to-4 candidate
QT_BLOCK_FN float tl_scale(float am, int cand, const TwoLevelArgs& a) {
  if (a.scale_rule == kRule4over6) {
    const float t = (am / a.elem_max) * a.enc;
    return tl_code(cand ? t * 1.5f : t, a);
  }
  const float X = tl_code(am * a.c_amax, a);
  if (a.scale_rule != kRuleCeil) return X;
  const float down = u2f(qtensor::round_float<kTowardZero, uint32_t, false>(f2u(X * a.ceil_k),
                                                                           a.sf, 0u));
  return (a.elem_max * down) * a.dec >= am ? down : X;
}

// t (float32) rounded to the element format. e2m1 (kTlFp4) without the general bit operations:
// the deterministic modes compare |t| with the grid's boundaries (round.h, fp4_round_scaled at
// X = 1), stochastic rounding steps on the grid of |t|'s binade in float32, every step exact
// (y = |t| / spacing is a power-of-two product; y - floor(y) and its 2^32 multiple are exact)
// with the reference's test up iff word < floor(frac * 2^32).
template <int MODE, int EK>
QT_BLOCK_FN float tl_round(float t, uint32_t w, const TwoLevelArgs& a) {
  if (EK == kTlFixed) return u2f(qtensor::round_fixed<MODE, false, uint32_t>(f2u(t), a.ex, w));
  if (EK == kTlFloat) return u2f(qtensor::round_float<MODE, uint32_t, false>(f2u(t), a.ef, w));
  const uint32_t sign = f2u(t) & kSignBit;
  const float at = u2f(f2u(t) & kAbsMask);
  float v;
  if (MODE == kStochastic) {
    const float z = at < 8.0f ? at : 8.0f;  // (beyond 6: 6; keeps floor(y) small)
    const bool lo2 = z < 2.0f, lo4 = z < 4.0f;
    const float mul = lo2 ? 2.0f : (lo4 ? 1.0f : 0.5f), sp = lo2 ? 0.5f : (lo4 ? 1.0f : 2.0f);
    const float y = z * mul;
    const float fl = (float)(int32_t)y;
    const float F = (y - fl) * 4294967296.0f;
    const bool big = F >= 2147483648.0f;
    const uint32_t thr = big ? ((uint32_t)(int32_t)(F - 2147483648.0f) | 0x80000000u)
                             : (uint32_t)(int32_t)F;
    v = (fl + (w < thr ? 1.0f : 0.0f)) * sp;
    v = v < 6.0f ? v : 6.0f;
  } else {
    const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    const float grid[7] = {0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float step[7] = {0.5f, 0.5f, 0.5f, 0.5f, 1.0f, 1.0f, 2.0f};
    v = 0.0f;
    for (int k = 0; k < 7; ++k) {
      const float b = MODE == kTowardZero ? grid[k] : mid[k];
      const bool up = (MODE == kNearest && (k & 1) == 0) ? at > b : at >= b;
      v += up ? step[k] : 0.0f;
    }
  }
  return u2f(f2u(v) | sign);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // (always inlined: no call passes a vector)
// round.h's round_magnitude_add (nearest) on the lanes of z >= 0: the grid of a float format with
// subnormals whose smallest normal has the bits nmin_c, d = 23 - man bits dropped (dsh = d << 23;
// the caller keeps z's binade + d within float32's)
template <typename V>
QT_BLOCK_FN V round_add_v(V z, uint32_t nmin_c, uint32_t dsh) {
  using I = decltype(z < z);
  const I E = (I)z & (int32_t)kInfBits, nm = I{} + (int32_t)nmin_c;
  const V c = (V)((E > nm ? E : nm) + (int32_t)dsh);
  return (z + c) - c;
}

// min(a, b) on lanes a >= 0 (or NaN: b) and b >= 0 by their bits' integer order, which is theirs:
// one integer instruction where the float select takes a compare and a blend
template <typename V>
QT_BLOCK_FN V min_nonneg_v(V a, float b) {
  using I = decltype(a < a);
  const I ai = (I)a, bi = I{} + (int32_t)f2u(b);
  return (V)(ai < bi ? ai : bi);
}

// tl_round<MODE, kTlFp4> of N magnitudes at (words w) on N lanes: gcc turns the scalar form's
// selects into unpredictable branches. Nearest: e2m1's grid by round_add_v (at most 6, its max;
// smallest normal 1, 22 bits dropped), the same as the comparisons for every float32.
template <int MODE, int N>
QT_BLOCK_FN typename Lanes<N>::F tl_fp4_grid_v(typename Lanes<N>::F at,
                                               typename Lanes<N>::U w) {
  using F = typename Lanes<N>::F;
  using I = typename Lanes<N>::I;
  using U = typename Lanes<N>::U;
  if (MODE == kNearest) return round_add_v(min_nonneg_v(at, 6.0f), 0x3F800000u, 22u << 23);
  if (MODE != kStochastic) {
    qtensor::Fp4Bounds b1;
    const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    const float grid[7] = {0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int k = 0; k < 7; ++k) b1.t[k] = MODE == kTowardZero ? grid[k] : mid[k];
    return fp4_round_scaled8<MODE>(at, b1, 1.0f);
  }
  // z = min(|t|, 6), nearest's z: beyond 6 both give 6 (6 is on the grid, its fraction 0), and
  // every result is at most 6 (z in [4, 6): 4 or 6)
  const F z = min_nonneg_v(at, 6.0f);
  // the spacing sp = 2^(E - 128) and 1 / sp of z's binade E (at least 127, at most 129 as z < 8:
  // z < 2 and z >= 4 step by 0.5 and 2)
  const I E127 = I{} + (127 << 23);
  I E = (I)z & (int32_t)kInfBits;
  E = E < E127 ? E127 : E;
  const F sp = (F)(E - (1 << 23)), mul = (F)((255 << 23) - E);
  const F y = z * mul;
  const F fl = __builtin_convertvector(__builtin_convertvector(y, I), F);
  const U thr = __builtin_convertvector((y - fl) * 4294967296.0f, U);
  return (fl + (w < thr ? F{} + 1.0f : F{})) * sp;
}

// tl_payload (e2m1) of N elements (float32 bits xb, words w) under X with its inv: magnitudes,
// e (so p) takes x's sign
template <int MODE, int N>
QT_BLOCK_FN typename Lanes<N>::F tl_fp4_payload_v(typename Lanes<N>::U xb,
                                                  typename Lanes<N>::U w, float inv, float X,
                                                  float dec) {
  using F = typename Lanes<N>::F;
  using U = typename Lanes<N>::U;
  const U sign = xb & kSignBit;  // (x * inv's: inv > 0)
  const F ax = (F)(xb & kAbsMask), at = ax * inv;
  F v;
  if (MODE == kNearest || MODE == kNearestAway) {
    v = tl_fp4_grid_v<MODE, N>(at, w);
  } else {
    const F vn = tl_fp4_grid_v<kNearest, N>(at, w), vd = tl_fp4_grid_v<MODE, N>(at, w);
    v = (vn * X) * dec == ax ? vn : vd;
  }
  return (F)((U)v | sign) * X;
}

// the payloads p = e * X of a block's m elements x under the scale X (reference: payload):
// inv = min(1 / (X * dec), FLT_MAX), e = Q(x * inv); directed and stochastic rounding keep the
// nearest e where fl32(e * X * dec) is x itself
template <int MODE, int EK>
QT_BLOCK_FN void tl_payload(const float* __restrict__ x, const uint32_t* __restrict__ w,
                            int64_t m, float X, const TwoLevelArgs& a, float* __restrict__ p) {
  const float r = 1.0f / (X * a.dec);
  const float inv = r < kFltMax ? r : kFltMax;
  const float dec = a.dec;
  int64_t j0 = 0;
  if (EK == kTlFp4) {  // 8 lanes at a time
    for (; j0 + 8 <= m; j0 += 8) {
      qt_v8u xb, wv = qt_v8u{};
      std::memcpy(&xb, x + j0, 32);
      if (MODE == kStochastic) std::memcpy(&wv, w + j0, 32);
      const qt_v8f pv = tl_fp4_payload_v<MODE, 8>(xb, wv, inv, X, dec);
      std::memcpy(p + j0, &pv, 32);
    }
  }
  for (int64_t j = j0; j < m; ++j) {
    const float t = x[j] * inv;
    float e;
    if (MODE == kNearest || MODE == kNearestAway) {
      e = tl_round<MODE, EK>(t, 0u, a);
    } else {
      const float en = tl_round<kNearest, EK>(t, 0u, a);
      const float ed = tl_round<MODE, EK>(t, MODE == kStochastic ? w[j] : 0u, a);
      e = (en * X) * dec == x[j] ? en : ed;
    }
    p[j] = e * X;
  }
}

// One candidate scale rule's payloads (into p) and scale, settled if the format says so: while
// the scale of the block's rounded max (fl32(p * dec)) is lower, the block takes it.
template <int MODE, int EK>
QT_BLOCK_FN float tl_settled(const float* x, const uint32_t* w, int64_t m, float am, int cand,
                             const TwoLevelArgs& a, float* p) {
  float X = tl_scale(am, cand, a);
  tl_payload<MODE, EK>(x, w, m, X, a, p);
  while (a.settle) {
    float rmax = 0.0f;
    for (int64_t j = 0; j < m; ++j) {
      const float q = std::fabs(p[j] * a.dec);
      rmax = q > rmax ? q : rmax;
    }
    const float X2 = tl_scale(rmax, cand, a);
    if (!(X2 < X)) break;
    X = X2;
    tl_payload<MODE, EK>(x, w, m, X, a, p);
  }
  return X;
}

// One block: its values fl32(p * dec) into q (float32; a zero takes x's sign) and its scale X
// into *Xo, or false for a block holding Inf or NaN (all NaN, X = 0). p4: room for 4over6's
// second candidate.
template <int MODE, int EK>
QT_BLOCK_FN bool tl_block(const float* x, const uint32_t* w, int64_t m, const TwoLevelArgs& a,
                          float* q, float* p4, float* Xo) {
  int32_t bm = 0;  // |x|'s bits as int32: ordered as |x|, NaN above Inf (vectorizes: vpmaxsd)
  for (int64_t j = 0; j < m; ++j) {
    const int32_t v = (int32_t)(f2u(x[j]) & kAbsMask);
    bm = v > bm ? v : bm;
  }
  *Xo = 0.0f;
  if ((uint32_t)bm >= kInfBits) return false;
  const float am = u2f((uint32_t)bm);
  *Xo = tl_settled<MODE, EK>(x, w, m, am, 0, a, q);
  if (a.scale_rule == kRule4over6) {
    const float X4 = tl_settled<MODE, EK>(x, w, m, am, 1, a, p4);
    // TE's error sums: |fl32(fl32(p * amax) / M) - x| added in float32 in element order
    float e6 = 0.0f, e4 = 0.0f;
    for (int64_t j = 0; j < m; ++j) {
      e6 += std::fabs((q[j] * a.a32) / a.denom - x[j]);
      e4 += std::fabs((p4[j] * a.a32) / a.denom - x[j]);
    }
    if (e4 < e6) {
      for (int64_t j = 0; j < m; ++j) q[j] = p4[j];
      *Xo = X4;
    }
  }
  const float dec = a.dec;
  if (EK == kTlFp4) {  // (p, so its product with dec, has x's sign)
    for (int64_t j = 0; j < m; ++j) q[j] = q[j] * dec;
    return true;
  }
  for (int64_t j = 0; j < m; ++j) {
    const float v = q[j] * dec;
    const uint32_t zs = f2u(x[j]) & kSignBit;
    q[j] = v == 0.0f ? u2f(zs) : v;  // (e's sign is x's but for integer elements: x's)
  }
  return true;
}

// All blocks: the tiles of [groups, rows, cols] (contiguous x and y, which may be the same),
// in parallel; each block gathered into float32 (read in place for float32 rows), its random
// words by each element's index in x. Xs: each block's scale, in block order (nullptr: none).
template <int MODE, int EK, typename T>
void tl_blocks(const T* x, T* y, const TwoLevelGeom& G, const TwoLevelArgs& a, uint32_t key,
               float* Xs) {
  constexpr bool STOCH = MODE == kStochastic;
  const int64_t R = G.rows, C = G.cols, tr = G.tr, tc = G.tc, bs = tr * tc;
  const int64_t nbr = (R + tr - 1) / tr, nbc = (C + tc - 1) / tc, per = nbr * nbc;
  const int64_t nb = G.groups * per;
  at::parallel_for(0, nb, std::max<int64_t>(1, kGrain / bs), [&](int64_t b0, int64_t b1) {
    std::unique_ptr<float[]> buf(new float[3 * bs]);
    std::unique_ptr<uint32_t[]> wb(new uint32_t[STOCH ? bs : 1]);
    float *xf = buf.get(), *q = xf + bs, *p4 = q + bs;
    uint32_t* w = wb.get();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t g = b / per, rem = b % per, br = rem / nbc, bc = rem % nbc;
      const int64_t base = g * R * C + br * tr * C + bc * tc;
      const int64_t mr = std::min(tr, R - br * tr), mc = std::min(tc, C - bc * tc), m = mr * mc;
      const bool row = mr == 1;
      const float* xb = xf;
      if (std::is_same<T, float>::value && row) {
        xb = (const float*)(const void*)(x + base);
      } else {
        for (int64_t i = 0; i < mr; ++i)
          for (int64_t k = 0; k < mc; ++k) xf[i * mc + k] = u2f(load_bits<T>(x + base + i * C + k));
      }
      if (STOCH) {
        const uint64_t last = (uint64_t)(base + (mr - 1) * C + mc - 1);
        if (row && ((uint64_t)base >> 32) == (last >> 32)) {
          const uint32_t ikey = index_key(key, (uint64_t)base), lo = (uint32_t)base;
          for (int64_t j = 0; j < m; ++j) w[j] = random_word(ikey, lo + (uint32_t)j) | a.sr_or;
        } else {
          for (int64_t i = 0; i < mr; ++i)
            for (int64_t k = 0; k < mc; ++k) {
              const uint64_t o = (uint64_t)(base + i * C + k);
              w[i * mc + k] = random_word(index_key(key, o), (uint32_t)o) | a.sr_or;
            }
        }
      }
      float Xb;
      const bool ok = tl_block<MODE, EK>(xb, w, m, a, q, p4, &Xb);
      if (Xs != nullptr) Xs[b] = Xb;
      if (row) {
        T* yp = y + base;
        if (ok) for (int64_t j = 0; j < m; ++j) store_bits<T>(yp + j, f2u(q[j]));
        else for (int64_t j = 0; j < m; ++j) store_bits<T>(yp + j, kNaNBits);
      } else {
        for (int64_t i = 0; i < mr; ++i)
          for (int64_t k = 0; k < mc; ++k)
            store_bits<T>(y + base + i * C + k, ok ? f2u(q[i * mc + k]) : kNaNBits);
      }
    }
  });
}

// ---- the common case in registers: e2m1 elements in blocks of 16 along contiguous rows (cols a
// multiple of 16: block b is x[16 b, 16 b + 16)), amax or 4over6 scales, no settling, a scale
// format that round_add_v rounds (tl_fast_grid). Batches of 8 blocks: their amaxes (amax_8x)
// and scales on 8 lanes, a lane per block; then each block's elements as one vector of 16
// (tl_fp4_payload_v); 4over6's pick from error sums that provably pick as TE's do
// (tl_pick4_near), else TE's own on a lane per block after a transpose, each block's terms added
// in element order. The same bits as tl_block.
struct TlFast {
  uint32_t nmin_c, dsh;  // round_add_v's, for the scale format
  float sf_max;
};

// Whether tl_code's nearest rounding is round_add_v of min(t, max) (NaN: the max): a scale format
// with subnormals (round_magnitude_add's grid) whose max lies on it, with room above it for c.
inline bool tl_fast_grid(const TwoLevelArgs& a, TlFast& f) {
  const auto& s = a.sf;
  const uint32_t mb = f2u(a.sf_max), d = (uint32_t)(23 - s.man);
  if (s.qlow != s.emin - s.man || s.man < 0 || s.man > 22 || s.emin < -126 ||
      !(a.sf_max > 0.0f) || mb >= kInfBits || (mb >> 23) + d > 254 ||
      qtensor::round_float<kNearest, uint32_t, false>(mb, s, 0u) != mb)
    return false;
  f.nmin_c = qtensor::pow2_bits<uint32_t>(s.emin);
  f.dsh = d << 23;
  f.sf_max = a.sf_max;
  return true;
}

// tl_code (nearest) of 8 lanes t >= 0
QT_BLOCK_FN qt_v8f tl_code8(qt_v8f t, const TlFast& f) {
  const qt_v8f mx = v8f_of(f.sf_max);
  return round_add_v(t < mx ? t : mx, f.nmin_c, f.dsh);
}

// r[i][j] -> r[j][i]
QT_BLOCK_FN void transpose8(qt_v8f r[8]) {
  qt_v8f t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int b = 0; b < 8; b += 4)
    for (int h = 0; h < 2; ++h) {
      u[b + 2 * h] = __builtin_shufflevector(t[b + h], t[b + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[b + 2 * h + 1] =
          __builtin_shufflevector(t[b + h], t[b + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int i = 0; i < 4; ++i) {
    r[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[i + 4] = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

typedef Lanes<16>::F qt_v16f;
typedef Lanes<16>::U qt_v16u;

// 4over6's error sums of 8 blocks (d[k]: block k's terms), lane k block k's: the terms added in
// element order, from 0
QT_BLOCK_FN qt_v8f tl_sums8(const qt_v16f d[8]) {
  qt_v8f lo[8], hi[8];
  for (int k = 0; k < 8; ++k) {
    lo[k] = __builtin_shufflevector(d[k], d[k], 0, 1, 2, 3, 4, 5, 6, 7);
    hi[k] = __builtin_shufflevector(d[k], d[k], 8, 9, 10, 11, 12, 13, 14, 15);
  }
  transpose8(lo);
  transpose8(hi);
  qt_v8f e = v8f_of(0.0f);
  for (int j = 0; j < 8; ++j) e += lo[j];
  for (int j = 0; j < 8; ++j) e += hi[j];
  return e;
}

// The sums of 8 blocks' terms as tl_sums8, but added in another order (a tree: fewer shuffles)
QT_BLOCK_FN qt_v8f tl_sums8_any(const qt_v16f d[8]) {
  qt_v8f h[8], a[4], b[2];
  for (int k = 0; k < 8; ++k)
    h[k] = __builtin_shufflevector(d[k], d[k], 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(d[k], d[k], 8, 9, 10, 11, 12, 13, 14, 15);
  // a[i]: blocks 2i, 2i + 1 interleaved; b[j]: blocks 4j..4j+3; then 128-bit halves
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
           __builtin_shufflevector(h[2 * i], h[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  for (int j = 0; j < 2; ++j)
    b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  // b[0] lanes: blocks 0 1 2 3 (low half's share) 0 1 2 3 (high half's); b[1]: 4-7
  return __builtin_shufflevector(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// 4over6's picks of 8 blocks (lane k: block k takes the 4 candidate) by TE's rule e4 < e6, each
// error sum of the terms t = fl32(|fl32(fl32(p amax) / M) - x|) added in element order (p = e X,
// exact, with x's sign), when the terms t' = fl32(|fl32(p c) - x|), c = fl32(amax / M), added in
// any order (d4, d6: a block's t' in a vector; their sums e4', e6') decide it; else false.
// With r = |p| amax / M and u = 2^-24: fl32(p c) and TE's quotient are each within 2.0001 u r of
// r, so |t - t'| <= 4.01 u r + 2 u |r - x|; 16 non-negative terms added in any order are within
// 15.01 u of their exact total; so |e - e'| <= 4.04 u R + 32.1 u e', R the block's sum of r <=
// 96 X amax / M <= 96 W (1 + 3 u), W = fl32(X c). Where e4' and e6' differ by more than
// tol = 2^-18 (e4' + e6') + 3 2^-15 (W4 + W6) (at least twice those bounds), the picks are TE's.
// So are blocks whose candidates are one scale (X4 = X6: the same terms, e4 = e6, so 6) and
// blocks of Inf or NaN (`bad`: the pick is not used). The bounds hold where every intermediate is
// normal and finite: M >= 1 (the caller's check), W >= 2^-100 and fl32(6 X) amax finite, or X = 0
// (then every t and t' is |x|). Near ties (rare) are left to TE's terms in element order.
QT_BLOCK_FN bool tl_pick4_near(const qt_v16f d4[8], const qt_v16f d6[8], qt_v8f X4, qt_v8f X6,
                               qt_v8f W4, qt_v8f W6, qt_v8i bad, float a32, qt_v8i* pick4) {
  auto bounded = [&](qt_v8f X, qt_v8f W) {
    return (X == 0.0f) | ((W >= 0x1p-100f) & ((X * 6.0f) * a32 <= kFltMax));
  };
  const qt_v8f e4 = tl_sums8_any(d4), e6 = tl_sums8_any(d6);
  const qt_v8f tol = (e4 + e6) * 0x1p-18f + (W4 + W6) * 0x3p-15f;
  const qt_v8i same = X4 == X6;
  const qt_v8i sure = (((e4 - e6 > tol) | (e6 - e4 > tol)) & bounded(X4, W4) & bounded(X6, W6)) |
                      same | bad;
  uint64_t s[4];  // (every lane's all ones: one test, not a branch per lane)
  std::memcpy(s, &sure, 32);
  if ((s[0] & s[1] & s[2] & s[3]) != ~0ull) return false;
  *pick4 = e4 < e6;
  return true;
}

// The random words of the block of 16 at index o (a multiple of 16) from jk1 (tl_rows16: the
// first hash step of the batch's part of each word's input)
template <int MODE>
QT_BLOCK_FN qt_v16u tl_words16(qt_v16u jk1, uint64_t o, uint32_t sr_or) {
  if (MODE != kStochastic) return qt_v16u{};
  const uint32_t lo = (uint32_t)o;
  return lowbias32_rest_v(jk1 ^ (lo ^ (lo >> 16))) | sr_or;
}

template <typename T>
QT_BLOCK_FN void tl_store16(T* y, qt_v16f q) {
  if constexpr (std::is_same<T, float>::value) {
    std::memcpy(y, &q, 64);
  } else {
    for (int j = 0; j < 16; ++j) store_bits<T>(y + j, f2u(q[j]));
  }
}

// nb blocks of 16 at x (tl_blocks' block order: block b at 16 b)
template <int MODE, bool FOUR, typename T>
void tl_rows16(const T* x, T* y, int64_t nb, const TwoLevelArgs& a, const TlFast& f,
               uint32_t key, float* Xs) {
  constexpr bool four = FOUR;  // scale rule 4over6, else amax
  at::parallel_for(0, (nb + 7) / 8, std::max<int64_t>(1, kGrain / 128), [&](int64_t c0,
                                                                            int64_t c1) {
    // locals, which the loops keep in registers (a store through y could alias a capture)
    T* const yp = y;
    const float dec = a.dec, a32 = a.a32, denom = a.denom;
    const uint32_t sr_or = a.sr_or;
    // 4over6's close terms (tl_pick4_near): fl32(amax / M), and whether M >= 1
    const float cq = a32 / denom;
    const bool close = denom >= 1.0f;
    // a batch: its blocks as float32 (xb: x itself, or xf), which are Inf or NaN (all NaN, X =
    // 0), their scales and inv = min(1 / (X dec), FLT_MAX)
    struct Batch {
      const float* xb;
      qt_v8i bad;
      qt_v8f X6, X4, inv6, inv4;
    };
    alignas(64) float xf[2][128];
    auto scales = [&](int64_t c, float* xfc, Batch& B) {
      const int64_t b0 = c * 8, n = std::min<int64_t>(8, nb - b0);
      const uint64_t o0 = (uint64_t)b0 * 16;
      B.xb = xfc;  // (a short last batch: zeros after it)
      if (std::is_same<T, float>::value && n == 8) {
        B.xb = (const float*)(const void*)(x + o0);
      } else {
        for (int64_t j = 0; j < n * 16; ++j) xfc[j] = u2f(load_bits<T>(x + o0 + j));
        for (int64_t j = n * 16; j < 128; ++j) xfc[j] = 0.0f;
      }
      qt_v8u bm;
      amax_8x<16>(B.xb, (uint32_t*)&bm);
      B.bad = (qt_v8i)bm >= (int32_t)kInfBits;
      const qt_v8f am = B.bad ? v8f_of(0.0f) : (qt_v8f)bm;
      B.X4 = v8f_of(0.0f);
      if (four) {  // tl_scale's 4over6 candidates
        const qt_v8f t = (am / a.elem_max) * a.enc;
        B.X6 = tl_code8(t, f);
        B.X4 = tl_code8(t * 1.5f, f);
      } else {
        B.X6 = tl_code8(am * a.c_amax, f);
      }
      auto inv_of = [&](qt_v8f X) {
        const qt_v8f r = v8f_of(1.0f) / (X * dec);
        return r < v8f_of(kFltMax) ? r : v8f_of(kFltMax);
      };
      B.inv6 = inv_of(B.X6);
      B.inv4 = four ? inv_of(B.X4) : v8f_of(0.0f);
    };
    Batch Bs[2];
    scales(c0, xf[0], Bs[0]);
    for (int64_t c = c0; c < c1; ++c) {
      // the next batch's scales first: their divisions overlap this batch's elements
      if (c + 1 < c1) scales(c + 1, xf[(c + 1 - c0) & 1], Bs[(c + 1 - c0) & 1]);
      const Batch& B = Bs[(c - c0) & 1];
      const int64_t b0 = c * 8, n = std::min<int64_t>(8, nb - b0);
      const uint64_t o0 = (uint64_t)b0 * 16;  // (a batch's 128 indices share their high half)
      const float* xb = B.xb;
      const qt_v8i bad = B.bad;
      const qt_v8f X6 = B.X6, X4 = B.X4, inv6 = B.inv6, inv4 = B.inv4;
      // lowbias32's first step v ^ (v >> 16) of the words' inputs (o0 + 16 k + j) ^ ikey, j < 16,
      // o0 + 16 k a multiple of 16: (o0 + 16 k) ^ (j ^ ikey), so the step is the xor of the same
      // step of each part, the latter's once a batch
      const uint32_t ikey = MODE == kStochastic ? index_key(key, o0) : 0u;
      const qt_v16u iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      const qt_v16u jk = iota ^ ikey, jk1 = jk ^ (jk >> 16);
      const qt_v16f nan = (qt_v16f)(qt_v16u{} + kNaNBits);
      if constexpr (!four) {
        // (rolled: gcc re-broadcast the unrolled loop's constants for every block, slower)
#pragma GCC unroll 1
        for (int k = 0; k < n; ++k) {
          qt_v16u xv;
          std::memcpy(&xv, xb + k * 16, 64);
          const qt_v16u w = tl_words16<MODE>(jk1, o0 + k * 16, sr_or);
          const qt_v16f p = tl_fp4_payload_v<MODE, 16>(xv, w, inv6[k], X6[k], dec);
          tl_store16<T>(yp + o0 + k * 16, bad[k] ? nan : p * dec);
        }
        if (Xs != nullptr)
          for (int k = 0; k < n; ++k) Xs[b0 + k] = bad[k] ? 0.0f : X6[k];
        continue;
      }
      qt_v16f p6[8], p4[8], d6[8], d4[8];
      for (int k = 0; k < 8; ++k) {
        qt_v16u xv;
        std::memcpy(&xv, xb + k * 16, 64);
        const qt_v16u w = tl_words16<MODE>(jk1, o0 + k * 16, sr_or);
        p6[k] = tl_fp4_payload_v<MODE, 16>(xv, w, inv6[k], X6[k], dec);
        p4[k] = tl_fp4_payload_v<MODE, 16>(xv, w, inv4[k], X4[k], dec);
        // terms close to TE's (tl_pick4_near; p has x's sign)
        const qt_v16f xs = (qt_v16f)xv;
        d6[k] = (qt_v16f)((qt_v16u)(p6[k] * cq - xs) & kAbsMask);
        d4[k] = (qt_v16f)((qt_v16u)(p4[k] * cq - xs) & kAbsMask);
      }
      qt_v8i pick4;
      if (!(close && tl_pick4_near(d4, d6, X4, X6, X4 * cq, X6 * cq, bad, a32, &pick4))) {
        // TE's error terms |fl32(fl32(p * amax) / M) - x|, added in element order
        for (int k = 0; k < 8; ++k) {
          qt_v16f xs;
          std::memcpy(&xs, xb + k * 16, 64);
          d6[k] = (qt_v16f)((qt_v16u)((p6[k] * a32) / denom - xs) & kAbsMask);
          d4[k] = (qt_v16f)((qt_v16u)((p4[k] * a32) / denom - xs) & kAbsMask);
        }
        pick4 = tl_sums8(d4) < tl_sums8(d6);
      }
      if (Xs != nullptr) {
        const qt_v8f X = bad ? v8f_of(0.0f) : (pick4 ? X4 : X6);
        for (int k = 0; k < n; ++k) Xs[b0 + k] = X[k];
      }
      // each block's pick, and whether it is all NaN, as all-ones or all-zeros masks: selects
      // without a branch (the picks are as good as random)
      const qt_v8u m4 = (qt_v8u)pick4, mb = (qt_v8u)bad;
      for (int k = 0; k < n; ++k) {
        const qt_v16u m = qt_v16u{} + m4[k], mn = qt_v16u{} + mb[k];
        const qt_v16f q = (qt_v16f)(((qt_v16u)p4[k] & m) | ((qt_v16u)p6[k] & ~m)) * dec;
        tl_store16<T>(yp + o0 + k * 16, (qt_v16f)(((qt_v16u)nan & mn) | ((qt_v16u)q & ~mn)));
      }
    }
  });
}
#pragma GCC diagnostic pop

template <typename T>
void two_level_kernel(const T* x, T* y, const TwoLevelGeom& G, const TwoLevelArgs& args,
                      int mode_arg, uint32_t key, float* Xs) {
  TwoLevelArgs a = args;
  a.sr_or = qtensor::sr_or_mask(mode_arg);
  const int mode = qtensor::mode_base(mode_arg);
  TlFast f;
  if (a.elem_kind == kTlFp4 && (a.scale_rule == kRuleAmax || a.scale_rule == kRule4over6) &&
      !a.settle && G.tr == 1 && G.tc == 16 && G.cols % 16 == 0 && tl_fast_grid(a, f)) {
    const int64_t nb = G.groups * G.rows * G.cols / 16;
    if (a.scale_rule == kRule4over6) {
      QT_MODE_SWITCH(mode, (tl_rows16<M, true, T>(x, y, nb, a, f, key, Xs)));
    } else {
      QT_MODE_SWITCH(mode, (tl_rows16<M, false, T>(x, y, nb, a, f, key, Xs)));
    }
  } else if (a.elem_kind == kTlFp4) {
    QT_MODE_SWITCH(mode, tl_blocks<M, kTlFp4, T>(x, y, G, a, key, Xs));
  } else if (a.elem_kind == kTlFixed) {
    QT_MODE_SWITCH(mode, tl_blocks<M, kTlFixed, T>(x, y, G, a, key, Xs));
  } else {
    QT_MODE_SWITCH(mode, tl_blocks<M, kTlFloat, T>(x, y, G, a, key, Xs));
  }
}

template <typename T>
uint32_t finite_amax(const T* x, const Layout& L) { return amax_bits<true, T>(x, L); }
#undef QT_BLOCK_FN
