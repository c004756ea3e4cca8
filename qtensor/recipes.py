"""Published low-precision recipes as ``qt.Recipe`` presets: ``qt.convert(model, qt.recipes.mxfp6)``.

``qt.recipes.describe()`` prints every preset with its formats; ``recipe.describe()`` one of them.
Each preset states its source and where emulation differs from it. Roles are described in
``qtensor.convert``; a pair is (value format, contraction operand format).

MX paper (Rouhani et al., "Microscaling Data Formats for Deep Learning", 2023; microxcaling):

- ``mxfp6``: the paper's training setup. Every matrix multiply's weight, activation and gradient
  operands are MXFP6_E3M2 blocked along the reduction dimension (32 values, E8M0 scale); vector
  ops in BF16 (activations and gradients have BF16 values); weights keep FP32 values (they are
  rounded to MXFP6 per use, from FP32); FP32 master weights and optimizer.
- ``mxfp4_weights``: the same with MXFP4_E2M1 weight operands (activations and gradients MXFP6).
- ``mx_all(fmt)``, ``mx_all_mxfp8``, ``mx_all_mxfp6``, ``mx_all_mxfp4``: every value is MX, weights,
  biases, buffers, activations, gradients and optimizer state, no master copy; stricter than the
  paper, for comparison. Values are stored blocked along their last axis (the reduction axis of
  Linear weights and of (..., features) activations; for conv weights that is the kernel width)
  and enter contractions as they are. Updates use the format's nearest rounding: small updates
  are lost (use larger learning rates, or ``mx_all(fmt.replace(rounding="stochastic"))``).
- ``mxint8_inference``: direct-cast inference: weights and activations enter every matrix multiply
  as MXINT8, other values FP32. No gradients (inference).

QPyTorch (Zhang et al., "QPyTorch: A Low-Precision Arithmetic Simulation Framework", 2019) and the
papers it reproduces:

- ``fp16``: QPyTorch's FloatingPoint(exp=5, man=10) for weights, activations, gradients, errors and
  momentum (examples/lp_train/half_baseline): QPyTorch floats have no Inf/NaN codes and
  saturate (max 131008) and its nearest rounding breaks ties away from zero; so does this preset.
  For IEEE half with Inf, use ``qt.Recipe.uniform(qt.fp16)`` (momentum in FP16 too) or
  ``qt.convert(model, qt.fp16)`` (FP32 master weights and optimizer state). The string ``"fp16"``
  names both this preset and the format, so ``qt.convert`` refuses it (as ``"mxfp6"``).
- ``block8``: 8-bit block floating point everywhere, one shared exponent per tensor, nearest
  rounding (QPyTorch's BlockFloatingPoint(wl=8) as used by examples/lp_train/block_baseline).
  Element grid: step 2^(e+2-wl) with e the exponent of the block's largest magnitude, magnitudes
  up to (2^(wl-1)-1) * step: a ``BlockFormat`` of ``FixedFormat(8, 6, symmetric=True)`` elements
  with the floor scale rule (the MXINT8 element, one block per tensor).
- ``swalp``: SWALP (Yang et al., "SWALP: Stochastic Weight Averaging in Low-Precision Training",
  2019; QPyTorch examples/SWALP): 8-bit block floating point with stochastic rounding for weights,
  activations, gradients, errors and momentum. SWALP shares one exponent per index of the first
  dimension (per output row of a weight, per sample of an activation). Blocks here run along
  one axis, so this preset uses one block per last-axis row (``block_size=None, axis=-1``):
  exactly SWALP's grouping for 2-D tensors (Linear weights, batch x features activations), finer
  groups (one exponent per row of the last axis) for conv weights and 4-D activations.
  The weight averaging itself (SWA) is a training-loop choice, not a format.
- ``wage``: WAGE (Wu et al., "Training and Inference with Integers in Deep Neural Networks", 2018;
  QPyTorch examples/WAGE): 2-bit weights, 8-bit activations, gradients and errors, fixed point.
  Weights: 8-bit values FixedFormat(8, 7, symmetric) updated with stochastic rounding (WAGE's
  weight accumulator: its updates are stochastically rounded multiples of 2^-7) entering every
  matrix multiply as 2-bit ternary FixedFormat(2, 1, symmetric) = {-0.5, 0, 0.5}; activations FixedFormat(8, 7, symmetric), nearest rounding; errors and gradients:
  WAGE divides each by a power of two from its largest magnitude before 8-bit fixed-point
  rounding, i.e. 8-bit fixed point sharing one power-of-two scale per tensor (block floating
  point with FixedFormat(8, 7, symmetric) elements, ceil scale rule), stochastic rounding for
  gradients and errors as in QPyTorch's WAGE example. Differences: WAGE keeps errors divided by
  that shift (its learning rates are tuned for it), clips weights to +-(1-2^-1) for 2 bits and
  scales layers by a constant; those are training-script choices, not formats.
"""
from __future__ import annotations

from typing import Optional

from .plans import Recipe
from .formats import BlockFormat, FixedFormat, FloatFormat, PRESETS
from .formats import format as _format

__all__ = ["mxfp6", "mxfp4_weights", "mx_all", "mx_all_mxfp8", "mx_all_mxfp6", "mx_all_mxfp4",
           "mxint8_inference", "fp16", "block8", "swalp", "wage", "describe", "PRESETS_BY_NAME"]

_P = PRESETS
_fp32, _bf16 = _P["fp32"], _P["bf16"]

mxfp6 = Recipe(
    weight=(_fp32, _P["mxfp6_e3m2"]), bias=_fp32,
    activation=(_bf16, _P["mxfp6_e3m2"]), grad=(_bf16, _P["mxfp6_e3m2"]),
    optimizer_state=None, master_weights=True,
    name="mxfp6", source="Rouhani et al. 2023, MX training: MXFP6_E3M2 matmul operands, BF16 "
    "vector ops, FP32 master weights")

mxfp4_weights = Recipe(
    weight=(_fp32, _P["mxfp4_e2m1"]), bias=_fp32,
    activation=(_bf16, _P["mxfp6_e3m2"]), grad=(_bf16, _P["mxfp6_e3m2"]),
    optimizer_state=None, master_weights=True,
    name="mxfp4_weights", source="Rouhani et al. 2023, MX training: MXFP4_E2M1 weight operands, "
    "MXFP6_E3M2 activation and gradient operands, BF16 vector ops, FP32 master weights")


def mx_all(fmt) -> Recipe:
    """Every value in the MX format ``fmt`` (a BlockFormat, a preset name such as "mxfp8_e4m3")."""
    f = _format(fmt)
    if not isinstance(f, BlockFormat):
        raise ValueError(f"mx_all expects a block (MX) format, got {f}")
    return Recipe(weight=f, bias=f, activation=f, grad=f, optimizer_state=f, master_weights=False,
                  name=f"mx_all({f})",
                  source="every value MX (stricter than Rouhani et al. 2023, for comparison)")


mx_all_mxfp8 = mx_all(_P["mxfp8_e4m3"]).replace(name="mx_all_mxfp8")
mx_all_mxfp6 = mx_all(_P["mxfp6_e3m2"]).replace(name="mx_all_mxfp6")
mx_all_mxfp4 = mx_all(_P["mxfp4_e2m1"]).replace(name="mx_all_mxfp4")

mxint8_inference = Recipe(
    weight=(_fp32, _P["mxint8"]), bias=_fp32, activation=(_fp32, _P["mxint8"]), grad=None,
    optimizer_state=None,
    name="mxint8_inference", source="Rouhani et al. 2023, direct-cast inference: MXINT8 matmul "
    "operands (weights and activations), FP32 elsewhere")

# QPyTorch FloatingPoint(5, 10): every code finite, saturating, nearest = ties away from zero.
_qpt_fp16 = FloatFormat(5, 10, specials="none", rounding="nearest_away")
fp16 = Recipe.uniform(_qpt_fp16, name="fp16",
                      source="QPyTorch (Zhang et al. 2019) FP16 baseline: FloatingPoint(5, 10) "
                      "weights, activations, gradients, errors, momentum")

_bfp8_elem = FixedFormat(8, 6, symmetric=True)
block8 = Recipe.uniform(BlockFormat(_bfp8_elem, block_size=None, axis=None, rounding="nearest"),
                        name="block8",
                        source="QPyTorch (Zhang et al. 2019) Block8: BlockFloatingPoint(wl=8), one "
                        "exponent per tensor, nearest rounding")

swalp = Recipe.uniform(BlockFormat(_bfp8_elem, block_size=None, axis=-1, rounding="stochastic"),
                       name="swalp",
                       source="SWALP (Yang et al. 2019): 8-bit block floating point, stochastic "
                       "rounding, one exponent per row")

_wage_w8 = FixedFormat(8, 7, symmetric=True, rounding="stochastic")
_wage_w2 = FixedFormat(2, 1, symmetric=True)
_wage_err = BlockFormat(FixedFormat(8, 7, symmetric=True), block_size=None, axis=None,
                        scale_rule="ceil", rounding="stochastic")
_wage_act = FixedFormat(8, 7, symmetric=True)  # WAGE rounds activations to nearest
wage = Recipe(
    weight=(_wage_w8, _wage_w2), bias=(_wage_w8, _wage_w2), activation=_wage_act,
    grad=_wage_err, optimizer_state=None,
    name="wage", source="WAGE (Wu et al. 2018): 2-bit weights, 8-bit activations, gradients and "
    "errors, fixed point")

PRESETS_BY_NAME = {r.name: r for r in (mxfp6, mxfp4_weights, mx_all_mxfp8, mx_all_mxfp6,
                                       mx_all_mxfp4, mxint8_inference, fp16, block8, swalp, wage)}


def describe(print_table: bool = True) -> Optional[str]:
    """Print every preset recipe with its source and formats (returns None, so the REPL shows
    them once), or return that text with ``print_table=False``."""
    text = "\n\n".join(r.describe() for r in PRESETS_BY_NAME.values())
    if print_table:
        print(text)
        return None
    return text
