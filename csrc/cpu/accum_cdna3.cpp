// qtensor::accum_matmul_cdna3: a batched matrix product summed by AMD CDNA3's (MI300) MFMA
// datapath (AccumFormat stages "cdna3" / "cdna3_fp8", MMA-Sim's MMA_TR_FDPA / MMA_GTR_FDPA) on
// CPU, bit for bit qtensor/accum.py's accum_matmul_reference (its _cdna3_chunk per instruction,
// chains, promotion, an initial accumulator c).
//
// The one-stage kernel of cpu/accum.cpp has one alignment per chunk; CDNA3 has two (the
// products, then the partial) with a floor at each and a 31-bit floor before the FP32 rounding,
// and fp8's two interleaved halves. Where the operands allow (fast_decode: FP16/BF16/FP8 values
// within 2^+-40, c finite), the float32/int32 chains (cpu/accum_cdna3.h's chain_fast) run on
// operands decoded into float32 values and int32 exponents; else the double lanes: the operands
// decoded once into doubles and their alignment exponents (a: (B, M, K); b: panels of P columns,
// (B, N / P, K, P)). A task runs R rows of a against one panel, the K loop innermost, compiled
// for the baseline, AVX2 and AVX-512 (the lanes vectorize), picked at run time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "cpu/kernels.h"
#include "qtensor/accum.h"

namespace {

constexpr int P = 8;  // output columns per task
constexpr int R = 4;  // rows of a per task: R * P independent chains

namespace cdna3_base {
#include "cpu/accum_cdna3.h"
}  // namespace cdna3_base
#if defined(QT_HAVE_ISA_CLONES)
#pragma GCC push_options
#pragma GCC target("avx2")
namespace cdna3_avx2 {
#include "cpu/accum_cdna3.h"
}  // namespace cdna3_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace cdna3_avx512 {
#include "cpu/accum_cdna3.h"
}  // namespace cdna3_avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

using Chain = void (*)(const double*, const int*, int64_t, const double*, const int*, int64_t,
                       int, int, bool, int, double*, float*);

Chain chain_for_isa() {
#if defined(QT_HAVE_ISA_CLONES)
  const int isa = qtensor_cpu::cpu_isa();
  if (isa == 2) return &cdna3_avx512::chain_panel<R, P>;
  if (isa == 1) return &cdna3_avx2::chain_panel<R, P>;
#endif
  return &cdna3_base::chain_panel<R, P>;
}

// The fast chains (cpu/accum_cdna3.h's chain_fast): panels of PF columns, 16 on AVX-512 (one
// float32 vector) and AVX2 (two: ~10% faster than one), 8 on the baseline.
using FastChain = void (*)(const float*, const int*, int64_t, const float*, const int*, int64_t,
                           int, int, bool, int, float*, float*);

FastChain fast_chain_for_isa(int* pf) {
  *pf = 8;
#if defined(QT_HAVE_ISA_CLONES)
  const int isa = qtensor_cpu::cpu_isa();
  if (isa == 2) {
    *pf = 16;
    return &cdna3_avx512::chain_fast_panel<R, 16>;
  }
  if (isa == 1) {
    *pf = 16;
    return &cdna3_avx2::chain_fast_panel<R, 16>;
  }
#endif
  return &cdna3_base::chain_fast_panel<R, 8>;
}

// fast_decode's test of an operand x (its float32 bits u, its clamp emin): zero, or finite and
// normal with at most 12 significant bits, its exponent and max(exponent, emin) in
// [-kFastExp, kFastExp]; and its alignment exponent (kAccZeroExp for zero).
inline bool fast_bad(uint32_t u, int emin) {
  const int be = (int)((u >> 23) & 0xff) - 127, lim = cdna3_base::kFastExp;
  return (u & qtensor::F32::ABS) != 0 && ((u & 0xfffu) != 0 || be < -lim || be > lim || emin > lim);
}
inline int fast_exp(uint32_t u, int emin) {
  const int be = (int)((u >> 23) & 0xff) - 127;
  return (u & qtensor::F32::ABS) == 0 ? qtensor::kAccZeroExp : (be > emin ? be : emin);
}

// Per-element clamps (int32 in x's shape) or undefined.
at::Tensor clamps(const c10::optional<at::Tensor>& v, const at::Tensor& x, const char* name) {
  if (!v) return at::Tensor();
  TORCH_CHECK(v->sizes() == x.sizes() && !at::isFloatingType(v->scalar_type()),
              "qtensor::accum_matmul_cdna3: ", name, " must be an integer tensor of shape ",
              x.sizes(), ", got ", v->sizes());
  return v->to(at::kInt).contiguous();
}

// n operands x (clamps emins, or emin where emins is null) into v (zeros as +0) and e
// (fast_exp); nonzero where one fails fast_bad. The clamp's source is tested outside the loops,
// so that they vectorize.
inline int fast_decode(const float* x, const int* emins, int emin, int64_t n, float* v, int* e) {
  int nok = 0;
  if (emins) {
#pragma omp simd reduction(| : nok)
    for (int64_t k = 0; k < n; ++k) {
      const uint32_t u = qtensor::f2u(x[k]);
      nok |= fast_bad(u, emins[k]);
      v[k] = qtensor::u2f((u & qtensor::F32::ABS) != 0 ? u : 0u);
      e[k] = fast_exp(u, emins[k]);
    }
  } else {
#pragma omp simd reduction(| : nok)
    for (int64_t k = 0; k < n; ++k) {
      const uint32_t u = qtensor::f2u(x[k]);
      nok |= fast_bad(u, emin);
      v[k] = qtensor::u2f((u & qtensor::F32::ABS) != 0 ? u : 0u);
      e[k] = fast_exp(u, emin);
    }
  }
  return nok;
}

// The fast chains over the whole product (accum_matmul_cdna3's fast conditions hold): a and b
// (contiguous float32) decoded into float32 values and int32 alignment exponents (a: (B, MR, K);
// b: panels of PF columns, (B, N / PF, K, PF)), tasks of R rows against one panel.
at::Tensor fast_matmul(const at::Tensor& ac, const at::Tensor& bc, const at::Tensor& ev,
                       const at::Tensor& fv, bool fp8, int64_t chunk, int64_t frac_bits,
                       int64_t promote, int64_t a_emin, int64_t b_emin, const at::Tensor* cc,
                       at::Tensor out) {
  int PF;
  const FastChain chain = fast_chain_for_isa(&PF);
  const int64_t B = ac.size(0), M = ac.size(1), K = ac.size(2), N = bc.size(2);
  const int64_t NP = (N + PF - 1) / PF, MR = (M + R - 1) / R * R;
  at::Tensor af = at::empty({B, MR, K}, ac.options());
  at::Tensor ea = at::empty({B, MR, K}, ac.options().dtype(at::kInt));
  at::Tensor bf = at::empty({B, NP, K, PF}, ac.options());
  at::Tensor eb = at::empty({B, NP, K, PF}, ac.options().dtype(at::kInt));
  std::atomic<bool> bad{false};  // an operand the chains do not take: undefined, the caller
  {                              // runs the double lanes
    const float* pa = ac.data_ptr<float>();
    const int* pv = ev.defined() ? ev.data_ptr<int>() : nullptr;
    float* paf = af.data_ptr<float>();
    int* pea = ea.data_ptr<int>();
    at::parallel_for(0, B * MR, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K)),
                     [&](int64_t lo, int64_t hi) {
      int nok = 0;
      for (int64_t t = lo; t < hi; ++t) {  // t: (batch, row); rows past M are zeros
        const int64_t bi = t / MR, i = t % MR, src = (bi * M + i) * K;
        if (i >= M) {
          std::fill(paf + t * K, paf + (t + 1) * K, 0.0f);
          std::fill(pea + t * K, pea + (t + 1) * K, qtensor::kAccZeroExp);
          continue;
        }
        nok |= fast_decode(pa + src, pv ? pv + src : nullptr, (int)a_emin, K, paf + t * K,
                           pea + t * K);
      }
      if (nok) bad = true;
    });
    const float* pb = bc.data_ptr<float>();
    const int* pw = fv.defined() ? fv.data_ptr<int>() : nullptr;
    float* pbf = bf.data_ptr<float>();
    int* peb = eb.data_ptr<int>();
    at::parallel_for(0, B * NP * K, std::max<int64_t>(1, (1 << 14) / PF), [&](int64_t lo,
                                                                             int64_t hi) {
      int nok = 0;
      for (int64_t t = lo; t < hi; ++t) {  // t: (batch, panel, k); columns past N are zeros
        const int64_t bi = t / (NP * K), q = t / K % NP, k = t % K;
        const int64_t src = (bi * K + k) * N + q * PF, nc = std::min<int64_t>(PF, N - q * PF);
        nok |= fast_decode(pb + src, pw ? pw + src : nullptr, (int)b_emin, nc, pbf + t * PF,
                           peb + t * PF);
        std::fill(pbf + t * PF + nc, pbf + (t + 1) * PF, 0.0f);  // columns past N: zeros
        std::fill(peb + t * PF + nc, peb + (t + 1) * PF, qtensor::kAccZeroExp);
      }
      if (nok) bad = true;
    });
  }
  if (bad) return at::Tensor();
  const float* paf = af.data_ptr<float>();
  const int* pea = ea.data_ptr<int>();
  const float* pbf = bf.data_ptr<float>();
  const int* peb = eb.data_ptr<int>();
  const float* pc = cc ? cc->data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  const int ch = (int)chunk, F = (int)frac_bits, pr = (int)promote;
  const int64_t TM = MR / R;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, R * PF * K));
  at::parallel_for(0, B * NP * TM, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {  // tasks (batch, panel, R rows), rows fastest
      const int64_t bi = t / (NP * TM), q = t / TM % NP, i0 = t % TM * R;
      const int64_t row = (bi * MR + i0) * K, panel = (bi * NP + q) * K * PF;
      const int64_t nc = std::min<int64_t>(PF, N - q * PF), nr = std::min<int64_t>(R, M - i0);
      float p[R * 16], o[R * 16];
      for (int r = 0; r < R; ++r)  // the initial accumulator: c itself (-0.0 is K = 0's output)
        for (int j = 0; j < PF; ++j)
          p[r * PF + j] = pc && r < nr && j < nc ? pc[(bi * M + i0 + r) * N + q * PF + j] : 0.0f;
      chain(paf + row, pea + row, K, pbf + panel, peb + panel, K, ch, F, fp8, pr, p, o);
      for (int64_t r = 0; r < nr; ++r)
        std::copy(o + r * PF, o + r * PF + nc, po + (bi * M + i0 + r) * N + q * PF);
    }
  });
  return out;
}

at::Tensor accum_matmul_cdna3(const at::Tensor& a, const at::Tensor& b, bool fp8, int64_t chunk,
                              int64_t frac_bits, int64_t promote, int64_t a_emin, int64_t b_emin,
                              const c10::optional<at::Tensor>& c,
                              const c10::optional<at::Tensor>& a_emins,
                              const c10::optional<at::Tensor>& b_emins) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
              "qtensor::accum_matmul_cdna3: a (batch, M, K) and b (batch, K, N), got ", a.sizes(),
              " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat,
              "qtensor::accum_matmul_cdna3: a and b must be float32, got ", a.scalar_type(),
              " and ", b.scalar_type());
  TORCH_CHECK(chunk >= 1 && chunk <= 65536, "qtensor::accum_matmul_cdna3: chunk must be in "
              "[1, 65536], got ", chunk);
  // frac_bits <= 24: every step exact in double and the all-zero exponent's scales normal
  TORCH_CHECK(frac_bits >= 0 && frac_bits <= 24, "qtensor::accum_matmul_cdna3: frac_bits must "
              "be in [0, 24], got ", frac_bits);
  TORCH_CHECK(promote >= 0 && promote <= INT32_MAX, "qtensor::accum_matmul_cdna3: promote must "
              "be >= 0 (0: never), got ", promote);
  TORCH_CHECK(a_emin >= -1000 && a_emin <= 127 && b_emin >= -1000 && b_emin <= 127,
              "qtensor::accum_matmul_cdna3: a_emin and b_emin must be in [-1000, 127], got ",
              a_emin, " and ", b_emin);
  const int64_t B = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  const int64_t NP = (N + P - 1) / P;
  at::Tensor out = at::empty({B, M, N}, a.options());
  if (out.numel() == 0) return out;
  at::Tensor cc;
  if (c) {
    TORCH_CHECK(c->scalar_type() == at::kFloat, "qtensor::accum_matmul_cdna3: c must be "
                "float32, got ", c->scalar_type());
    cc = c->expand({B, M, N}).contiguous();
  }
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const at::Tensor ev = clamps(a_emins, a, "a_emins"), fv = clamps(b_emins, b, "b_emins");
  // the fast chains where their conditions hold (c finite, every chunk's int32 sum, below
  // chunk * 2^(F + 2), in range; the operands: fast_matmul's decoding checks them)
  if ((int64_t)chunk << (frac_bits + 2) < ((int64_t)1 << 31) &&
      (!c || at::isfinite(cc).all().item<bool>())) {
    at::Tensor r = fast_matmul(ac, bc, ev, fv, fp8, chunk, frac_bits, promote, a_emin, b_emin,
                               c ? &cc : nullptr, out);
    if (r.defined()) return r;
  }
  // decoded once: values as doubles, alignment exponents (accum.h's acc_exp_f32)
  // a's rows padded to whole tasks (zero rows), b's columns to whole panels (zero columns)
  const int64_t MR = (M + R - 1) / R * R;
  at::Tensor ad = at::empty({B, MR, K}, a.options().dtype(at::kDouble));
  at::Tensor ea = at::empty({B, MR, K}, a.options().dtype(at::kInt));
  at::Tensor bd = at::empty({B, NP, K, P}, a.options().dtype(at::kDouble));
  at::Tensor eb = at::empty({B, NP, K, P}, a.options().dtype(at::kInt));
  {
    const float* pa = ac.data_ptr<float>();
    const int* pv = ev.defined() ? ev.data_ptr<int>() : nullptr;
    double* pad = ad.data_ptr<double>();
    int* pea = ea.data_ptr<int>();
    at::parallel_for(0, B * MR, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K)),
                     [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {  // t: (batch, row)
        const int64_t bi = t / MR, i = t % MR;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t src = (bi * M + i) * K + k;
          const bool in = i < M;
          // a value that is 0 as a double is a zero term (a float32 subnormal under
          // torch.set_flush_denormal(True), as in the reference's float64 operands)
          const double x = in ? (double)pa[src] : 0.0;
          pad[t * K + k] = x;
          pea[t * K + k] = x != 0.0 ? qtensor::acc_exp_f32(pa[src], pv ? pv[src] : (int)a_emin)
                                    : qtensor::kAccZeroExp;
        }
      }
    });
    const float* pb = bc.data_ptr<float>();
    const int* pw = fv.defined() ? fv.data_ptr<int>() : nullptr;
    double* pbd = bd.data_ptr<double>();
    int* peb = eb.data_ptr<int>();
    at::parallel_for(0, B * NP * K, std::max<int64_t>(1, (1 << 14) / P), [&](int64_t lo,
                                                                            int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {  // t: (batch, panel, k)
        const int64_t bi = t / (NP * K), q = t / K % NP, k = t % K;
        for (int j = 0; j < P; ++j) {
          const int64_t col = q * P + j, src = (bi * K + k) * N + col;
          const bool in = col < N;  // zero columns pad the last panel
          const double x = in ? (double)pb[src] : 0.0;
          pbd[t * P + j] = x;
          peb[t * P + j] = x != 0.0 ? qtensor::acc_exp_f32(pb[src], pw ? pw[src] : (int)b_emin)
                                    : qtensor::kAccZeroExp;
        }
      }
    });
  }
  const Chain chain = chain_for_isa();
  const double* pad = ad.data_ptr<double>();
  const int* pea = ea.data_ptr<int>();
  const double* pbd = bd.data_ptr<double>();
  const int* peb = eb.data_ptr<int>();
  const float* pc = c ? cc.data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  const int ch = (int)chunk, F = (int)frac_bits, pr = (int)promote;
  // tasks (batch, panel, R rows), rows fastest: consecutive tasks share the panel (in cache)
  const int64_t TM = MR / R;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, R * P * K));
  at::parallel_for(0, B * NP * TM, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t bi = t / (NP * TM), q = t / TM % NP, i0 = t % TM * R;
      const int64_t row = (bi * MR + i0) * K, panel = (bi * NP + q) * K * P;
      const int64_t nc = std::min<int64_t>(P, N - q * P), nr = std::min<int64_t>(R, M - i0);
      double p[R * P];
      float o[R * P];
      for (int r = 0; r < R; ++r)  // the initial accumulator: c itself (-0.0 is K = 0's output)
        for (int j = 0; j < P; ++j)
          p[r * P + j] = pc && r < nr && j < nc
                             ? (double)pc[(bi * M + i0 + r) * N + q * P + j] : 0.0;
      chain(pad + row, pea + row, K, pbd + panel, peb + panel, K, ch, F, fp8, pr, p, o);
      for (int64_t r = 0; r < nr; ++r)
        std::copy(o + r * P, o + r * P + nc, po + (bi * M + i0 + r) * N + q * P);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qtensor, m) {
  m.def("accum_matmul_cdna3(Tensor a, Tensor b, bool fp8, int chunk, int frac_bits, int promote, "
        "int a_emin, int b_emin, Tensor? c, Tensor? a_emins=None, Tensor? b_emins=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(qtensor, CPU, m) { m.impl("accum_matmul_cdna3", &accum_matmul_cdna3); }
