"""Published low-precision recipes as ``qt.Recipe`` presets: ``qt.convert(model, qt.recipes.mxfp6)``.

``qt.recipes.describe()`` prints every preset with its formats; ``recipe.describe()`` one of them.
Roles are those of docs/convert.md; a pair is (value format, contraction operand format).

- MX paper (Rouhani et al., "Microscaling Data Formats for Deep Learning", 2023; microxcaling):
  ``mxfp6``, ``mxfp4_weights``, ``mx_all(fmt)`` (``mx_all_mxfp8``, ``mx_all_mxfp6``,
  ``mx_all_mxfp4``), ``mxint8_inference``, ``direct_cast(fmt)`` (the paper's direct-cast
  inference in any format).
- QPyTorch (Zhang et al., 2019) and the papers it reproduces: ``fp16``, ``block8``, ``swalp``
  (SWALP), ``wage`` (WAGE).
- FP4 training (issue 21): ``nvfp4_nvidia`` (NVIDIA's NVFP4 pretraining recipe, arXiv 2509.25149,
  and Transformer Engine's NVFP4BlockScaling), ``fp4_all_the_way`` (Chmiel et al., 2505.19115),
  ``quartet`` (Castro et al., 2505.14669, approximated: see its source).

Each preset's source, formats and where the emulation differs from it: docs/convert.md
("Published low-precision recipes").
"""
from __future__ import annotations

from typing import Optional

from .plans import Recipe
from .transforms import Hadamard
from .formats import BlockFormat, FixedFormat, FloatFormat, PRESETS
from .formats import format as _format

__all__ = ["mxfp6", "mxfp4_weights", "mx_all", "direct_cast", "mx_all_mxfp8", "mx_all_mxfp6", "mx_all_mxfp4",
           "mxint8_inference", "fp16", "block8", "swalp", "wage", "nvfp4_nvidia",
           "fp4_all_the_way", "quartet", "describe", "PRESETS_BY_NAME"]

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

# --- FP4 training recipes (issue 21). Their roles keep every value in BF16/FP32 and every
# contraction outside a Linear/Conv (attention's batched GEMMs) in BF16; Recipe.gemm puts the
# three GEMMs of each Linear/Conv in FP4.
_nv = _P["nvfp4"]  # two-level: E4M3 scales of 16 elements under an FP32 tensor scale
_nv_sr = _nv.replace(rounding="stochastic")
_nv_w = _nv  # TODO(2D blocks): 16x16 weight blocks (W and W^T round alike) once 2D blocks exist
_fp4_roles = dict(weight=(_fp32, _bf16), bias=_fp32, activation=_bf16, grad=_bf16,
                  optimizer_state=None, master_weights=True)

nvfp4_nvidia = Recipe(
    **_fp4_roles,
    gemm={"fprop": (_nv, _nv_w), "dgrad": (_nv_sr, _nv_w), "wgrad": (_nv, _nv_sr),
          "transform": {"wgrad": Hadamard(16, signs="te")}},
    last_layers=(0.15, _bf16),
    name="nvfp4_nvidia",
    source="NVIDIA, 'Pretraining LLMs with NVFP4' (arXiv 2509.25149) and Transformer Engine's "
    "NVFP4BlockScaling: NVFP4 (E2M1, E4M3 scales of 16, FP32 per-tensor amax scale) for x, W "
    "and dY in all three GEMMs, each operand rounded from the high-precision tensor; stochastic "
    "rounding on the gradient dY only (dgrad and wgrad), round-to-nearest-even for x and W; the "
    "16x16 random Hadamard transform (TE's sign vector) on both wgrad operands along the tokens, "
    "tensor scale after it; the last 15% of the linear layers (the paper: ~15%, mostly at the "
    "end; here the last ones, rounded up, the output head included) in BF16; attention, "
    "norms, embeddings BF16, FP32 master weights and optimizer. Differs: weights in 1D blocks "
    "of 16 along K, not the paper's 16x16 2D blocks (pending); the paper's first BF16 blocks "
    "are not kept")

_fa_sr = _nv.replace(rounding="stochastic")
fp4_all_the_way = Recipe(
    **_fp4_roles,
    gemm={"fprop": (_nv, _nv), "dgrad": (_fa_sr, _fa_sr), "wgrad": (_fa_sr, _fa_sr)},
    name="fp4_all_the_way",
    source="Chmiel et al., 'FP4 All the Way' (arXiv 2505.19115): fully quantized training, "
    "NVFP4 (E2M1 blocks of 16, E4M3 scales) for every linear layer's x, W and dY; "
    "round-to-nearest in the forward GEMM, stochastic rounding in the backward (dgrad) and "
    "update (wgrad) GEMMs, every operand; no Hadamard transform, no layer kept in higher "
    "precision; BF16 elsewhere, FP32 master weights. Assumed (the abstract does not say): the "
    "FP32 per-tensor scale of NVFP4 (without it gradients flush, issue 21) and SR on every "
    "operand of the backward GEMMs; the paper's final quantization-aware BF16 phase is not "
    "part of the preset")

_mx4 = _P["mxfp4_e2m1"]
_mx4_sr = _mx4.replace(rounding="stochastic", scale_rule="ceil")
quartet = Recipe(
    **_fp4_roles,
    gemm={"fprop": (_mx4, _mx4), "dgrad": (_mx4_sr, _mx4_sr), "wgrad": (_mx4_sr, _mx4_sr),
          "transform": {"fprop": Hadamard(32, signs=None), "dgrad": Hadamard(32, signs=1),
                        "wgrad": Hadamard(32, signs=2)}},
    name="quartet",
    source="Castro et al., 'Quartet' (arXiv 2505.14669; IST-DASLab/Quartet): MXFP4 (E2M1 "
    "blocks of 32, E8M0 scales) for every linear layer's three GEMMs; forward: a 32x32 "
    "Hadamard transform of x and W along K, round-to-nearest; backward: a randomized 32x32 "
    "Hadamard transform of both operands of dgrad and wgrad along K, stochastic rounding. "
    "Approximated: QuEST's RMS-based clipping scale (and its trust-mask gradient) is the OCP "
    "floor scale; the backward signs are fixed per GEMM (seeds 1, 2), not redrawn each step; "
    "SR uses the ceil scale rule (no saturation, standing in for Quartet's 3/4 prescale); the "
    "backward operands are rounded from the high-precision tensors, not re-quantized from the "
    "forward's FP4 values")

PRESETS_BY_NAME = {r.name: r for r in (mxfp6, mxfp4_weights, mx_all_mxfp8, mx_all_mxfp6,
                                       mx_all_mxfp4, mxint8_inference, fp16, block8, swalp, wage,
                                       nvfp4_nvidia, fp4_all_the_way, quartet)}


def describe(print_table: bool = True) -> Optional[str]:
    """Print every preset recipe with its source and formats (returns None, so the REPL shows
    them once), or return that text with ``print_table=False``."""
    text = "\n\n".join(r.describe() for r in PRESETS_BY_NAME.values())
    if print_table:
        print(text)
        return None
    return text
