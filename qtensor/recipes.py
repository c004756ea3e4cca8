"""Published low-precision recipes as ``qt.Recipe`` presets: ``qt.convert(model, qt.recipes.mxfp6)``.

``qt.recipes.describe()`` prints every preset with its formats; ``recipe.describe()`` one of them.
Roles are those of docs/convert.md; a pair is (value format, contraction operand format).

- MX paper (Rouhani et al., "Microscaling Data Formats for Deep Learning", 2023; microxcaling):
  ``mxfp6``, ``mxfp4_weights``, ``mx_all(fmt)`` (``mx_all_mxfp8``, ``mx_all_mxfp6``,
  ``mx_all_mxfp4``), ``mxint8_inference``, ``direct_cast(fmt)`` (the paper's direct-cast
  inference in any format).
- QPyTorch (Zhang et al., 2019) and the papers it reproduces: ``fp16``, ``block8``, ``swalp``
  (SWALP), ``wage`` (WAGE).
- ``mxfp8_pretraining`` (Mishra et al. 2025, arXiv 2506.08027: MXFP8 E4M3 everywhere, scales
  rounded up) and ``nvfp4_4over6`` (Transformer Engine's NVFP4 with 4over6 block scales).

Each preset's source, formats and where the emulation differs from it: docs/convert.md
("Published low-precision recipes").
"""
from __future__ import annotations

from typing import Optional

from .plans import Recipe
from .formats import BlockFormat, FixedFormat, FloatFormat, PRESETS
from .formats import format as _format

__all__ = ["mxfp6", "mxfp4_weights", "mx_all", "direct_cast", "mx_all_mxfp8", "mx_all_mxfp6", "mx_all_mxfp4",
           "mxint8_inference", "fp16", "block8", "swalp", "wage", "mxfp8_pretraining",
           "nvfp4_4over6", "describe", "PRESETS_BY_NAME"]

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

def direct_cast(fmt) -> Recipe:
    """The MX paper's direct-cast inference in ``fmt`` (any format: "mxfp8_e4m3", "nvfp4",
    qt.bf16, a BlockFormat): a trained FP32 model evaluated with every contraction's operands
    (weights and activations) rounded to ``fmt`` along the reduction dimension and summed in
    FP32; every value (weights, biases, activations, the vector ops) stays FP32, and gradients
    are left plain."""
    f = _format(fmt)
    return Recipe(weight=(_fp32, f), bias=_fp32, activation=(_fp32, f), grad=None,
                  optimizer_state=None, name=f"direct_cast({f})",
                  source="Rouhani et al. 2023, direct-cast inference: matmul operands (weights "
                  f"and activations) in {f}, FP32 elsewhere")


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

# MXFP8 pre-training (Mishra, Stosic, Layton, Micikevicius 2025, arXiv 2506.08027): MXFP8 E4M3
# (blocks of 32, E8M0 scales) for the operands of all three GEMMs, weights, activations and
# gradients alike (E4M3 for gradients too), the scale rounded up ("round-to-infinity": the
# smallest power of two with amax / X <= 448, scale_rule ceil = torchao's RCEIL) instead of OCP's
# floor, which saturates the block max and made their 8B run diverge; BF16 elsewhere, FP32
# master weights. Each operand is rounded along its GEMM's reduction dim from the high-precision
# source (a transpose is not a re-rounding of the other layout).
_mxfp8_rceil = BlockFormat(_P["fp8_e4m3"], 32, scale=_P["e8m0"], scale_rule="ceil")
mxfp8_pretraining = Recipe(
    weight=(_fp32, _mxfp8_rceil), bias=_fp32,
    activation=(_bf16, _mxfp8_rceil), grad=(_bf16, _mxfp8_rceil),
    optimizer_state=None, master_weights=True,
    name="mxfp8_pretraining", source="Mishra et al. 2025 (arXiv 2506.08027), Recipes for "
    "Pre-training LLMs with MXFP8: MXFP8 E4M3 operands of every GEMM (weights, activations, "
    "gradients), block 32, E8M0 scales rounded up (RCEIL), BF16 vector ops, FP32 master weights")

# Transformer Engine's NVFP4BlockScaling with NVTE_NVFP4_4OVER6=all (TE's default error metric
# MAE, E4M3 bound 256): weight and activation operands NVFP4 (e2m1, 16-element E4M3 scales
# under an FP32 tensor scale) whose blocks pick the scale mapping their max to 4 or to 6 (the
# lower sum of |x - q|); gradients plain NVFP4 with stochastic rounding (TE refuses 4over6 with
# stochastic rounding). TE targets 4over6 at post-training and has no 4over6 path with the
# Random Hadamard Transform, so none here. Differs from TE: 1x16 weight blocks (TE's NVFP4
# weights are 16x16 2D blocks), the error sum exact in double (TE: float32).
_nvfp4_4over6 = BlockFormat(_P["fp4_e2m1"], 16, scale=_P["fp8_e4m3"], scale_rule="4over6",
                            tensor_scale=True)
_nvfp4_sr = _P["nvfp4"].replace(rounding="stochastic")
nvfp4_4over6 = Recipe(
    weight=(_fp32, _nvfp4_4over6), bias=_fp32,
    activation=(_bf16, _nvfp4_4over6), grad=(_bf16, _nvfp4_sr),
    optimizer_state=None, master_weights=True,
    name="nvfp4_4over6", source="Transformer Engine NVFP4BlockScaling, 4over6 (NVTE_NVFP4_4OVER6"
    "=all, MAE, E4M3 bound 256): NVFP4 weight and activation operands whose 16-element blocks "
    "map their max to 4 or 6 (lower block error), NVFP4 gradients with stochastic rounding, no "
    "RHT (TE has none with 4over6), 1x16 weight blocks (TE: 16x16), BF16 vector ops, FP32 "
    "master weights")

PRESETS_BY_NAME = {r.name: r for r in (mxfp6, mxfp4_weights, mx_all_mxfp8, mx_all_mxfp6,
                                       mx_all_mxfp4, mxint8_inference, fp16, block8, swalp, wage,
                                       mxfp8_pretraining, nvfp4_4over6)}


def describe(print_table: bool = True) -> Optional[str]:
    """Print every preset recipe with its source and formats (returns None, so the REPL shows
    them once), or return that text with ``print_table=False``."""
    text = "\n\n".join(r.describe() for r in PRESETS_BY_NAME.values())
    if print_table:
        print(text)
        return None
    return text
