// The CPU loops' entry points. csrc/quantize_cpu.h is compiled once per instruction set, each in
// its own translation unit (csrc/cpu/isa_*.cpp, compiled in parallel), into namespace
// qtensor_cpu::<isa>; quantize.cpp picks one at run time.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "qtensor/args.h"

namespace qtensor_cpu {
// 0: baseline, 1: AVX2, 2: AVX-512 F/BW/VL/DQ (capped by QTENSOR_CPU_ISA=base|avx2)
int cpu_isa();
}  // namespace qtensor_cpu

#define QT_DECLARE_CPU_KERNELS(ns)                                                            \
  namespace qtensor_cpu {                                                                     \
  namespace ns {                                                                              \
  template <typename T>                                                                       \
  void float_kernel(const T* x, T* y, const qtensor::Layout& L,                               \
                    const qtensor::FloatSpec<uint32_t>& s, int mode, uint32_t key);           \
  template <typename T>                                                                       \
  void fixed_kernel(const T* x, T* y, const qtensor::Layout& L,                               \
                    const qtensor::FixedSpec<uint32_t>& s, bool wrap, int mode, uint32_t key); \
  template <typename T>                                                                       \
  void block_kernel(const T* x, T* y, const qtensor::Layout& L, const qtensor::BlockArgs& a,  \
                    int mode, uint32_t key);                                                  \
  template <typename T>                                                                       \
  uint32_t finite_amax(const T* x, const qtensor::Layout& L);                                 \
  template <typename T>                                                                       \
  void two_level_kernel(const T* x, T* y, const qtensor::TwoLevelGeom& G,                     \
                        const qtensor::TwoLevelArgs& a, int mode, uint32_t key, float* Xs);   \
  }                                                                                           \
  }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QT_HAVE_ISA_CLONES 1
#endif
