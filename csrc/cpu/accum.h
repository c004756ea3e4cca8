// Torch glue of qtensor::accum_matmul shared by the CPU (csrc/cpu/accum.cpp) and CUDA
// (csrc/cuda/accum_cuda.cu) implementations: the argument checks and the AccumSpec.
#pragma once

#include <ATen/ATen.h>

#include "qtensor/accum.h"

namespace qtensor_accum {

inline qtensor::AccumSpec make_spec(int64_t chunk, int64_t frac_bits, int64_t group,
                                    int64_t align_rounding, bool acc_in_alignment,
                                    int64_t acc_man, int64_t acc_rounding, int64_t promote,
                                    int64_t e_zero, int64_t a_emin, int64_t b_emin,
                                    int64_t acc_emin, int64_t acc_emax) {
  TORCH_CHECK(chunk >= 1 && chunk <= 65536, "qtensor::accum_matmul: chunk must be in [1, 65536], "
              "got ", chunk);
  TORCH_CHECK(group >= 1 && chunk % group == 0 && (group == 1 || chunk / group <= 256),
              "qtensor::accum_matmul: group must divide chunk into at most 256 groups, got "
              "chunk=", chunk, ", group=", group);
  // the chunk's scaled terms (each below 2^(frac_bits + 2)) must sum exactly in double
  int64_t lg = 0;
  while ((int64_t{1} << lg) < chunk / group + 1) ++lg;
  TORCH_CHECK(frac_bits >= 0 && frac_bits <= 51 - lg, "qtensor::accum_matmul: frac_bits must be "
              "in [0, ", 51 - lg, "] for chunk=", chunk, ", group=", group, ", got ", frac_bits);
  TORCH_CHECK(align_rounding >= 0 && align_rounding <= 2, "qtensor::accum_matmul: align_rounding "
              "must be 0 (toward_zero), 1 (floor) or 2 (nearest), got ", align_rounding);
  TORCH_CHECK(acc_rounding == 0 || acc_rounding == 2, "qtensor::accum_matmul: acc_rounding must "
              "be 0 (toward_zero) or 2 (nearest), got ", acc_rounding);
  TORCH_CHECK(acc_man >= 0 && acc_man <= 23, "qtensor::accum_matmul: acc_man must be in [0, 23], "
              "got ", acc_man);
  TORCH_CHECK(promote >= 0, "qtensor::accum_matmul: promote must be >= 0 (0: never), got ",
              promote);
  TORCH_CHECK(e_zero == qtensor::kAccZeroExp || (e_zero >= -1000 && e_zero <= 128),
              "qtensor::accum_matmul: e_zero must be in [-1000, 128] or ", qtensor::kAccZeroExp,
              " (none), got ", e_zero);
  TORCH_CHECK(a_emin >= -1000 && a_emin <= 127 && b_emin >= -1000 && b_emin <= 127,
              "qtensor::accum_matmul: a_emin and b_emin must be in [-1000, 127], got ", a_emin,
              " and ", b_emin);
  TORCH_CHECK(acc_emin >= -126 && acc_emin <= 0 && acc_emax >= 1 && acc_emax <= 127,
              "qtensor::accum_matmul: acc_emin must be in [-126, 0] and acc_emax in [1, 127], "
              "got ", acc_emin, " and ", acc_emax);
  qtensor::AccumSpec s;
  s.chunk = (int)chunk; s.frac_bits = (int)frac_bits; s.group = (int)group;
  s.align_round = (int)align_rounding; s.acc_in_alignment = acc_in_alignment;
  s.acc_man = (int)acc_man; s.acc_round = (int)acc_rounding; s.promote = (int)promote;
  s.e_zero = (int)e_zero; s.a_emin = (int)a_emin; s.b_emin = (int)b_emin;
  s.acc_emin = (int)acc_emin; s.acc_emax = (int)acc_emax;
  return s;
}

inline void check_operands(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3, "qtensor::accum_matmul: a and b must be 3-D "
              "(batch, M, K) and (batch, K, N), got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat,
              "qtensor::accum_matmul: a and b must be float32, got ", a.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(a.size(0) == b.size(0) && a.size(2) == b.size(1), "qtensor::accum_matmul: shapes ",
              a.sizes(), " and ", b.sizes(), " do not multiply");
  TORCH_CHECK(a.device() == b.device(), "qtensor::accum_matmul: a is on ", a.device(),
              " but b is on ", b.device());
}

}  // namespace qtensor_accum
