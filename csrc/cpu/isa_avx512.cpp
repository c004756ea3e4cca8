// The CPU loops compiled for AVX-512 (F, BW, VL, DQ; used only where the CPU has them): twice
// the lanes of AVX2 for the compute-bound paths (stochastic rounding's hash, NVFP4).
#include "cpu/isa_headers.h"
#ifdef QT_HAVE_ISA_CLONES
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#define QT_ISA_NS isa_avx512
#include "cpu/isa.inc"
#pragma GCC pop_options
#endif
