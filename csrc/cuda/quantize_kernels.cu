// CUDA kernels of the quantization ops. Torch-free: compile-checked on its own with
//   nvcc -std=c++17 -c -I csrc/include csrc/cuda/quantize_kernels.cu -o /dev/null
// The rounding math is qtensor/round.h, the same functions the CPU kernels call, so CPU and CUDA
// give the same bits (stochastic rounding included: the random word of an element depends only
// on the seed and the element's logical index).
//
// Kernels: grid-stride loops; contiguous float32 data moves in 16-byte float4 loads/stores; an MX
// block (block_size 4..128 along a contiguous last axis) is held by block_size/4 lanes of one warp,
// and its amax is one warp-level shuffle reduction; everything else (strided layouts, halves,
// other axes) goes through generic kernels that index through the Layout.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launch.h"
#include "qtensor/round.h"

namespace qtensor {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kAllLanes = 0xFFFFFFFFu;  // shuffle mask: every lane of the warp

template <typename T> struct IO;
template <> struct IO<float> {
  static __device__ __forceinline__ uint32_t load(const float* p) { return __float_as_uint(*p); }
  static __device__ __forceinline__ void store(float* p, uint32_t b) { *p = __uint_as_float(b); }
};
template <> struct IO<__half> {
  static __device__ __forceinline__ uint32_t load(const __half* p) {
    return __float_as_uint(__half2float(*p));
  }
  static __device__ __forceinline__ void store(__half* p, uint32_t b) {
    // NaN as c10's scalar conversion (the CPU kernels) writes it: the sign and 0x7E00; cvt's
    // canonical NaN is 0x7FFF (docs/formats.md, "NaN bits")
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
      *p = __ushort_as_half((unsigned short)(((b >> 16) & 0x8000u) | 0x7E00u));
      return;
    }
    *p = __float2half_rn(__uint_as_float(b));
  }
};
template <> struct IO<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t load(const __nv_bfloat16* p) {
    return __float_as_uint(__bfloat162float(*p));
  }
  static __device__ __forceinline__ void store(__nv_bfloat16* p, uint32_t b) {
    // NaN as c10's scalar conversion writes it: 0x7FC0 (cvt's is 0x7FFF)
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) { *p = __ushort_as_bfloat16((unsigned short)0x7FC0u); return; }
    *p = __float2bfloat16_rn(__uint_as_float(b));
  }
};

// x and y offsets of logical element i
__device__ __forceinline__ void offsets(const Layout& L, int64_t i, int64_t& ox, int64_t& oy) {
  if (L.contiguous) { ox = oy = i; return; }
  ox = oy = 0;
  for (int d = L.ndim - 1; d >= 0; --d) {
    const int64_t k = i % L.sizes[d];
    i /= L.sizes[d];
    ox += k * L.xs[d];
    oy += k * L.ys[d];
  }
}

__device__ __forceinline__ uint32_t word(uint32_t key, int64_t i) {
  return random_word(index_key(key, (uint64_t)i), (uint32_t)(uint64_t)i);
}

// ---- per-element functors ----------------------------------------------------------------------
template <int MODE> struct FloatOp {
  FloatSpec<uint32_t> s;
  __device__ __forceinline__ uint32_t operator()(uint32_t u, uint32_t r) const {
    return round_float<MODE, uint32_t>(u, s, r);
  }
};
template <int MODE, bool WRAP> struct FixedOp {
  FixedSpec<uint32_t> s;
  __device__ __forceinline__ uint32_t operator()(uint32_t u, uint32_t r) const {
    return round_fixed<MODE, WRAP, uint32_t>(u, s, r);
  }
};

// ---- elementwise -------------------------------------------------------------------------------
template <int MODE, typename T, typename Op>
__global__ void elementwise_kernel(const T* __restrict__ x, T* __restrict__ y, Layout L,
                                   int64_t begin, uint32_t key, Op op) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = begin + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < L.numel;
       i += stride) {
    int64_t ox, oy;
    offsets(L, i, ox, oy);
    const uint32_t r = MODE == kStochastic ? word(key, i) : 0u;
    IO<T>::store(y + oy, op(IO<T>::load(x + ox), r));
  }
}

template <int MODE, typename Op>
__global__ void elementwise_vec4(const float4* __restrict__ x, float4* __restrict__ y,
                                 int64_t nvec, uint32_t key, Op op) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += stride) {
    const float4 a = x[v];
    const int64_t i = v * 4;
    float4 b;
    b.x = __uint_as_float(op(__float_as_uint(a.x), MODE == kStochastic ? word(key, i) : 0u));
    b.y = __uint_as_float(op(__float_as_uint(a.y), MODE == kStochastic ? word(key, i + 1) : 0u));
    b.z = __uint_as_float(op(__float_as_uint(a.z), MODE == kStochastic ? word(key, i + 2) : 0u));
    b.w = __uint_as_float(op(__float_as_uint(a.w), MODE == kStochastic ? word(key, i + 3) : 0u));
    y[v] = b;
  }
}

int grid_for(int64_t work) {
  static int sms = 0;
  if (sms == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0)
      sms = 80;
  }
  int64_t g = (work + kThreads - 1) / kThreads;
  const int64_t cap = (int64_t)sms * 16;
  g = g < 1 ? 1 : (g > cap ? cap : g);
  return (int)g;
}

bool aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }

template <int MODE, typename T, typename Op>
void run_elementwise(const void* xv, void* yv, const Layout& L, uint32_t key, Op op,
                     cudaStream_t st) {
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  int64_t begin = 0;
  if (sizeof(T) == 4 && L.contiguous && aligned16(x) && aligned16(y)) {
    const int64_t nvec = L.numel / 4;
    if (nvec > 0)
      elementwise_vec4<MODE, Op><<<grid_for(nvec), kThreads, 0, st>>>(
          reinterpret_cast<const float4*>(x), reinterpret_cast<float4*>(y), nvec, key, op);
    begin = nvec * 4;
  }
  if (begin < L.numel)
    elementwise_kernel<MODE, T, Op><<<grid_for(L.numel - begin), kThreads, 0, st>>>(
        x, y, L, begin, key, op);
}

template <typename T>
cudaError_t float_typed(const void* x, void* y, const Layout& L, const FloatSpec<uint32_t>& s,
                        int mode, uint32_t key, cudaStream_t st) {
  QT_MODE_SWITCH(mode, run_elementwise<M, T>(x, y, L, key, FloatOp<M>{s}, st));
  return cudaGetLastError();
}

template <typename T, bool WRAP>
cudaError_t fixed_typed(const void* x, void* y, const Layout& L, const FixedSpec<uint32_t>& s,
                        int mode, uint32_t key, cudaStream_t st) {
  QT_MODE_SWITCH(mode, run_elementwise<M, T>(x, y, L, key, FixedOp<M, WRAP>{s}, st));
  return cudaGetLastError();
}

// ---- amax (whole-tensor blocks, NVFP4's tensor scale) ------------------------------------------
template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, Layout L, bool finite, uint32_t* amax) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  uint32_t m = 0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < L.numel; i += stride) {
    int64_t ox, oy;
    offsets(L, i, ox, oy);
    const uint32_t a = IO<T>::load(x + ox) & F32::ABS;
    m = ((!finite || a < F32::INF) && a > m) ? a : m;
  }
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(kAllLanes, m, off));
  if ((threadIdx.x & 31) == 0) atomicMax(amax, m);
}

// ---- blocks ------------------------------------------------------------------------------------
// The rounding of one element of a block whose amax (bits) is known.
struct BlockScale {
  bool bad;        // NaN or Inf in the block
  bool pow2;
  BlockElemSpec e;  // power-of-two scales
  double sc;        // amax rule
};

__device__ __forceinline__ BlockScale block_scale(uint32_t amax, const BlockArgs& a) {
  BlockScale b;
  b.bad = amax >= F32::INF;
  b.pow2 = a.scale_rule != kRuleAmax;
  b.sc = 0.0;
  if (b.pow2) {
    // (even: nearest modes only, whose blocks never need settle_even_exp: quantize_cuda.cu)
    const int k = block_scale_exp(amax, a.scale_rule == kRuleCeil, a.elem_emax, a.elem_max,
                                  a.scale_emin, a.scale_emax, a.even_mbits);
    b.e = shift_elem(a.elem_fixed, a.man, a.emin, a.qlow, a.elem_max, a.wl, a.fl, a.is_signed,
                     a.symmetric, k);
  } else {
    b.sc = amax_block_scale(amax, a.amax_spec, a.tensor_scale, a.ts);
  }
  return b;
}

template <int MODE>
__device__ __forceinline__ uint32_t block_elem(uint32_t u, const BlockScale& b, const BlockArgs& a,
                                               uint32_t r) {
  if (b.bad) return F32::QNAN;
  if (b.pow2) return round_block_elem<MODE>(u, b.e, r);
  return __float_as_uint(round_amax_elem<MODE>(__uint_as_float(u), b.sc, a.amax_spec,
                                               a.tensor_scale, r));
}

// Contiguous float32, blocks along the last axis, block_size = 4 * LANES, rows a whole number of
// blocks: LANES neighbouring lanes hold a block (4 elements each, one float4), the amax is a
// shuffle reduction among them.
template <int MODE, int LANES>
__global__ void block_vec4(const float4* __restrict__ x, float4* __restrict__ y, int64_t nvec,
                           BlockArgs a, uint32_t key) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x; base < nvec; base += stride) {
    const int64_t v = base + threadIdx.x;
    const bool active = v < nvec;
    const float4 in = active ? x[v] : make_float4(0.f, 0.f, 0.f, 0.f);
    const uint32_t u0 = __float_as_uint(in.x), u1 = __float_as_uint(in.y),
                   u2 = __float_as_uint(in.z), u3 = __float_as_uint(in.w);
    uint32_t m = max(max(u0 & F32::ABS, u1 & F32::ABS), max(u2 & F32::ABS, u3 & F32::ABS));
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1)
      m = max(m, __shfl_xor_sync(kAllLanes, m, off, LANES));
    BlockScale b = block_scale(m, a);  // (inactive lanes: m = 0, a zero scale)
    const int64_t i = v * 4;
    if (!b.pow2) {
      // idempotence of the amax rule (round.h, settle_amax_scale); a lane group (one block)
      // agrees on the scale, and the loop with shuffles runs warp-uniformly
      if (rounded_amax_from_amax<MODE>(a.amax_spec)) {
        if (!b.bad) b.sc = settle_amax_scale(b.sc, a.amax_spec, a.tensor_scale, a.ts, [&](double s) {
          return __float_as_uint(round_amax_elem<MODE>(__uint_as_float(m), s, a.amax_spec,
                                                       a.tensor_scale, 0u)) & F32::ABS;
        });
      } else {
        for (;;) {
          uint32_t r = 0;
          const bool live = !b.bad && b.sc > 0;
          if (live) {
            const uint32_t us[4] = {u0, u1, u2, u3};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const float q = round_amax_elem<MODE>(__uint_as_float(us[k]), b.sc, a.amax_spec,
                                                    a.tensor_scale,
                                                    MODE == kStochastic ? word(key, i + k) : 0u);
              r = max(r, __float_as_uint(q) & F32::ABS);
            }
          }
#pragma unroll
          for (int off = LANES / 2; off > 0; off >>= 1)
            r = max(r, __shfl_xor_sync(kAllLanes, r, off, LANES));
          const double again = live
              ? amax_block_scale(r, a.amax_spec, a.tensor_scale, a.ts) : b.sc;
          const bool lower = again < b.sc;
          if (!__any_sync(kAllLanes, lower)) break;
          if (lower) b.sc = again;
        }
      }
    }
    if (active) {
      float4 out;
      out.x = __uint_as_float(block_elem<MODE>(u0, b, a, MODE == kStochastic ? word(key, i) : 0u));
      out.y = __uint_as_float(block_elem<MODE>(u1, b, a, MODE == kStochastic ? word(key, i + 1) : 0u));
      out.z = __uint_as_float(block_elem<MODE>(u2, b, a, MODE == kStochastic ? word(key, i + 2) : 0u));
      out.w = __uint_as_float(block_elem<MODE>(u3, b, a, MODE == kStochastic ? word(key, i + 3) : 0u));
      y[v] = out;
    }
  }
}

// Any layout: one thread per block (unit = outer index, block, inner index), two passes over the
// block (amax, then rounding) through the Layout's strides.
template <int MODE, typename T>
__global__ void block_generic(const T* __restrict__ x, T* __restrict__ y, Layout L, BlockArgs a,
                              uint32_t key) {
  const int ax = a.axis;
  const int64_t len = L.sizes[ax], bs = a.block_size, nb = (len + bs - 1) / bs;
  int64_t inner = 1;
  for (int d = ax + 1; d < L.ndim; ++d) inner *= L.sizes[d];
  int64_t outer = 1;
  for (int d = 0; d < ax; ++d) outer *= L.sizes[d];
  const int64_t units = outer * nb * inner;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += stride) {
    int64_t i = u % inner, rest = u / inner;
    const int64_t b = rest % nb, o = rest / nb;
    int64_t ox = 0, oy = 0, ol = 0;
    for (int d = L.ndim - 1; d > ax; --d) {
      const int64_t k = i % L.sizes[d];
      i /= L.sizes[d];
      ox += k * L.xs[d]; oy += k * L.ys[d]; ol += k * L.ls[d];
    }
    int64_t oo = o;
    for (int d = ax - 1; d >= 0; --d) {
      const int64_t k = oo % L.sizes[d];
      oo /= L.sizes[d];
      ox += k * L.xs[d]; oy += k * L.ys[d]; ol += k * L.ls[d];
    }
    const int64_t j0 = b * bs;
    const int64_t m = len - j0 < bs ? len - j0 : bs;
    ox += j0 * L.xs[ax]; oy += j0 * L.ys[ax]; ol += j0 * L.ls[ax];
    uint32_t amax = 0;
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t v = IO<T>::load(x + ox + j * L.xs[ax]) & F32::ABS;
      amax = v > amax ? v : amax;
    }
    BlockScale sc = block_scale(amax, a);
    if (!sc.pow2 && !sc.bad) {  // idempotence of the amax rule (round.h, settle_amax_scale)
      const bool from_amax = rounded_amax_from_amax<MODE>(a.amax_spec);
      sc.sc = settle_amax_scale(sc.sc, a.amax_spec, a.tensor_scale, a.ts, [&](double s) {
        if (from_amax)
          return __float_as_uint(round_amax_elem<MODE>(__uint_as_float(amax), s, a.amax_spec,
                                                       a.tensor_scale, 0u)) & F32::ABS;
        uint32_t mm = 0;
        for (int64_t j = 0; j < m; ++j) {
          const uint32_t r = MODE == kStochastic ? word(key, ol + j * L.ls[ax]) : 0u;
          const float q = round_amax_elem<MODE>(__uint_as_float(IO<T>::load(x + ox + j * L.xs[ax])),
                                                s, a.amax_spec, a.tensor_scale, r);
          mm = max(mm, __float_as_uint(q) & F32::ABS);
        }
        return mm;
      });
    }
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t r = MODE == kStochastic ? word(key, ol + j * L.ls[ax]) : 0u;
      IO<T>::store(y + oy + j * L.ys[ax],
                   block_elem<MODE>(IO<T>::load(x + ox + j * L.xs[ax]), sc, a, r));
    }
  }
}

// axis=None with the amax rule: the idempotent scale (round.h, settle_amax_scale) of the one
// block, by one CUDA block (re-rounding the whole tensor is needed only for stochastic rounding
// or unsigned elements, and only while the scale drops: rare).
template <int MODE, typename T>
__global__ void whole_settle(const T* __restrict__ x, Layout L, BlockArgs a, uint32_t key,
                             const uint32_t* __restrict__ amax, double* __restrict__ sc_out) {
  __shared__ uint32_t part[kThreads / 32];
  __shared__ double next;
  __shared__ int go;
  const uint32_t am = *amax;
  double sc = amax_block_scale(am, a.amax_spec, a.tensor_scale, a.ts);
  if (am >= F32::INF || !(sc > 0)) {
    if (threadIdx.x == 0) *sc_out = sc;
    return;
  }
  if (rounded_amax_from_amax<MODE>(a.amax_spec)) {
    if (threadIdx.x == 0)
      *sc_out = settle_amax_scale(sc, a.amax_spec, a.tensor_scale, a.ts, [&](double s) {
        return __float_as_uint(round_amax_elem<MODE>(__uint_as_float(am), s, a.amax_spec,
                                                     a.tensor_scale, 0u)) & F32::ABS;
      });
    return;
  }
  for (;;) {
    uint32_t m = 0;
    for (int64_t i = threadIdx.x; i < L.numel; i += blockDim.x) {
      int64_t ox, oy;
      offsets(L, i, ox, oy);
      const uint32_t r = MODE == kStochastic ? word(key, i) : 0u;
      const float q = round_amax_elem<MODE>(__uint_as_float(IO<T>::load(x + ox)), sc,
                                            a.amax_spec, a.tensor_scale, r);
      m = max(m, __float_as_uint(q) & F32::ABS);
    }
    for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(kAllLanes, m, off));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t mm = 0;
      for (int w = 0; w < (int)(blockDim.x >> 5); ++w) mm = max(mm, part[w]);
      const double again = amax_block_scale(mm, a.amax_spec, a.tensor_scale, a.ts);
      go = again < sc;
      next = again;
    }
    __syncthreads();
    if (!go) break;
    sc = next;
    __syncthreads();
  }
  if (threadIdx.x == 0) *sc_out = sc;
}

// axis=None: one block, its amax already on the device (and for the amax rule its settled
// scale, whole_settle).
template <int MODE, typename T>
__global__ void whole_block(const T* __restrict__ x, T* __restrict__ y, Layout L, BlockArgs a,
                            uint32_t key, const uint32_t* __restrict__ amax,
                            const double* __restrict__ settled) {
  BlockScale sc = block_scale(*amax, a);
  if (!sc.pow2) sc.sc = *settled;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < L.numel; i += stride) {
    int64_t ox, oy;
    offsets(L, i, ox, oy);
    const uint32_t r = MODE == kStochastic ? word(key, i) : 0u;
    IO<T>::store(y + oy, block_elem<MODE>(IO<T>::load(x + ox), sc, a, r));
  }
}

template <int MODE, int LANES>
void launch_vec4(const void* x, void* y, int64_t n, const BlockArgs& a, uint32_t key,
                 cudaStream_t st) {
  const int64_t nvec = n / 4;
  block_vec4<MODE, LANES><<<grid_for(nvec), kThreads, 0, st>>>(
      static_cast<const float4*>(x), static_cast<float4*>(y), nvec, a, key);
}

template <int MODE>
bool try_vec4(const void* x, void* y, DType dt, const Layout& L, const BlockArgs& a, uint32_t key,
              cudaStream_t st) {
  if (dt != kF32 || !L.contiguous || a.whole_tensor || a.axis != L.ndim - 1) return false;
  if (!aligned16(x) || !aligned16(y) || L.numel == 0) return false;
  const int64_t len = L.sizes[L.ndim - 1], bs = a.block_size;
  if (len % bs != 0) return false;
  switch (bs) {
    case 4: launch_vec4<MODE, 1>(x, y, L.numel, a, key, st); return true;
    case 8: launch_vec4<MODE, 2>(x, y, L.numel, a, key, st); return true;
    case 16: launch_vec4<MODE, 4>(x, y, L.numel, a, key, st); return true;
    case 32: launch_vec4<MODE, 8>(x, y, L.numel, a, key, st); return true;
    case 64: launch_vec4<MODE, 16>(x, y, L.numel, a, key, st); return true;
    case 128: launch_vec4<MODE, 32>(x, y, L.numel, a, key, st); return true;
    default: return false;
  }
}

template <int MODE, typename T>
void block_typed(const void* xv, void* yv, DType dt, const Layout& L, const BlockArgs& a,
                 uint32_t key, const uint32_t* amax_dev, cudaStream_t st) {
  if (L.numel == 0) return;
  if (try_vec4<MODE>(xv, yv, dt, L, a, key, st)) return;
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  if (a.whole_tensor) {
    // amax_dev[2..3]: the settled scale of the amax rule, a double (8-byte aligned)
    double* settled = reinterpret_cast<double*>(const_cast<uint32_t*>(amax_dev) + 2);
    if (a.scale_rule == kRuleAmax)
      whole_settle<MODE, T><<<1, kThreads, 0, st>>>(x, L, a, key, amax_dev, settled);
    whole_block<MODE, T><<<grid_for(L.numel), kThreads, 0, st>>>(x, y, L, a, key, amax_dev,
                                                                  settled);
    return;
  }
  const int64_t len = L.sizes[a.axis];
  const int64_t units = (L.numel / (len > 0 ? len : 1)) * ((len + a.block_size - 1) / a.block_size);
  block_generic<MODE, T><<<grid_for(units), kThreads, 0, st>>>(x, y, L, a, key);
}

template <typename T>
cudaError_t block_mode(const void* x, void* y, DType dt, const Layout& L, const BlockArgs& a,
                       int mode, uint32_t key, const uint32_t* amax_dev, cudaStream_t st) {
  QT_MODE_SWITCH(mode, block_typed<M, T>(x, y, dt, L, a, key, amax_dev, st));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_float(const void* x, void* y, DType dt, const Layout& L,
                         const FloatSpec<uint32_t>& s, int mode, uint32_t key, cudaStream_t st) {
  if (L.numel == 0) return cudaSuccess;
  switch (dt) {
    case kF32: return float_typed<float>(x, y, L, s, mode, key, st);
    case kF16: return float_typed<__half>(x, y, L, s, mode, key, st);
    default: return float_typed<__nv_bfloat16>(x, y, L, s, mode, key, st);
  }
}

cudaError_t launch_fixed(const void* x, void* y, DType dt, const Layout& L,
                         const FixedSpec<uint32_t>& s, bool wrap, int mode, uint32_t key,
                         cudaStream_t st) {
  if (L.numel == 0) return cudaSuccess;
  switch (dt) {
    case kF32: return wrap ? fixed_typed<float, true>(x, y, L, s, mode, key, st)
                           : fixed_typed<float, false>(x, y, L, s, mode, key, st);
    case kF16: return wrap ? fixed_typed<__half, true>(x, y, L, s, mode, key, st)
                           : fixed_typed<__half, false>(x, y, L, s, mode, key, st);
    default: return wrap ? fixed_typed<__nv_bfloat16, true>(x, y, L, s, mode, key, st)
                         : fixed_typed<__nv_bfloat16, false>(x, y, L, s, mode, key, st);
  }
}

cudaError_t launch_amax(const void* x, DType dt, const Layout& L, bool finite, uint32_t* amax,
                        cudaStream_t st) {
  if (L.numel == 0) return cudaSuccess;
  const int g = grid_for(L.numel);
  switch (dt) {
    case kF32: amax_kernel<float><<<g, kThreads, 0, st>>>(static_cast<const float*>(x), L, finite, amax); break;
    case kF16: amax_kernel<__half><<<g, kThreads, 0, st>>>(static_cast<const __half*>(x), L, finite, amax); break;
    default:
      amax_kernel<__nv_bfloat16><<<g, kThreads, 0, st>>>(static_cast<const __nv_bfloat16*>(x), L,
                                                         finite, amax);
  }
  return cudaGetLastError();
}

cudaError_t launch_block(const void* x, void* y, DType dt, const Layout& L, const BlockArgs& a,
                         int mode, uint32_t key, const uint32_t* amax_dev, cudaStream_t st) {
  switch (dt) {
    case kF32: return block_mode<float>(x, y, dt, L, a, mode, key, amax_dev, st);
    case kF16: return block_mode<__half>(x, y, dt, L, a, mode, key, amax_dev, st);
    default: return block_mode<__nv_bfloat16>(x, y, dt, L, a, mode, key, amax_dev, st);
  }
}

}  // namespace cuda
}  // namespace qtensor
