"""Hardware-faithful accumulation (``qt.accum``): what a matrix-multiply unit does with products.

Elsewhere a contraction rounds its operands and accumulates in float32. Tensor cores do not: one
MMA instruction aligns the products of ``chunk`` K-elements (and the running partial sum) to the
largest exponent, keeps ``frac_bits`` fractional bits of each, and normalizes the sum to an
accumulator format; libraries add that partial sum into an FP32 accumulator every ``promote``
instructions. :class:`AccumFormat` describes such a datapath (presets from Volta to Blackwell);
:func:`accum_matmul` computes a matrix product with it (fused C++ kernel; a Triton kernel on
CUDA), bit for bit equal to
:func:`accum_matmul_reference`, the pure-PyTorch statement of the model (MMA-Sim v2's
``t_fdpa``/``gst_fdpa``: subnormal operands aligned at their format's minimum normal exponent,
zero terms at ``e_zero``, block-scaled groups at their scales' exponents), in which every step is
exact in float64; tests/accum/test_accum_mmasim.py checks every preset against ``mmasim``.

Use: ``qt.Recipe(..., accumulate=qt.accum.hopper_fp8)`` or ``t.accum = ...``: every contraction
with an operand that carries an accumulator sums its products with it, convolutions of every kind
included (1-, 2-, 3-D, grouped, transposed: lowered to GEMMs, ``conv``).
Under torch.compile the accumulator travels with the QTensor and the kernel is one opaque op.

One concern per module: ``format`` (AccumFormat, presets), ``exponents`` (the exact float64
arithmetic), ``reference`` (the datapath in float64), ``scaled`` (block scales applied where
the datapath applies them), ``kernel`` (the C++/Triton glue), ``blocks`` (block and tensor
scales of QTensor operands), ``matmul`` (the public entry points), ``conv`` (im2col) and
``lowering`` (aten contractions). The model step by step, its sources and the known differences
from hardware: docs/accum.md.
"""
from .format import (ACC_ROUNDINGS, ALIGN_ROUNDINGS, PRESETS, AccumFormat,  # noqa: F401
                     AccumFormatError, as_accum)
from .lowering import contract  # noqa: F401
from .matmul import OperandFormatWarning, accum_matmul, accum_matmul_reference  # noqa: F401

__all__ = ["AccumFormat", "AccumFormatError", "OperandFormatWarning", "accum_matmul",
           "accum_matmul_reference",
           "as_accum", "contract", "PRESETS", "ALIGN_ROUNDINGS", "ACC_ROUNDINGS"]

globals().update(PRESETS)  # qt.accum.hopper_fp8, ...
