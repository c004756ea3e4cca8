// The CPU loops for the baseline instruction set of the build (no -march).
#define QT_ISA_NS isa_base
#include "cpu/isa.inc"
