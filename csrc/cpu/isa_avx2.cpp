// The CPU loops compiled for AVX2 (used only where the CPU has it).
#include "cpu/isa_headers.h"
#ifdef QT_HAVE_ISA_CLONES
#pragma GCC push_options
#pragma GCC target("avx2")
#define QT_ISA_NS isa_avx2
#include "cpu/isa.inc"
#pragma GCC pop_options
#endif
