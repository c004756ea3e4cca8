"""Published low-precision recipes as ``qt.Recipe`` presets: ``qt.convert(model, qt.recipes.mxfp6)``.

``qt.recipes.describe()`` prints every preset with its formats; ``recipe.describe()`` one of them.
Roles are those of docs/convert.md; a pair is (value format, contraction operand format).

- MX paper (Rouhani et al., "Microscaling Data Formats for Deep Learning", 2023; microxcaling):
  ``mxfp6``, ``mxfp4_weights``, ``mx_all(fmt)`` (``mx_all_mxfp8``, ``mx_all_mxfp6``,
  ``mx_all_mxfp4``), ``mxint8_inference``, ``direct_cast(fmt)`` (the paper's direct-cast
  inference in any format).
- QPyTorch (Zhang et al., 2019) and the papers it reproduces: ``fp16``, ``block8``, ``swalp``
  (SWALP), ``wage`` (WAGE).
- FP4 training: ``nvfp4_nvidia`` (NVIDIA's NVFP4 pretraining recipe, arXiv 2509.25149,
  and Transformer Engine's NVFP4BlockScaling), ``fp4_all_the_way`` (Chmiel et al., 2505.19115),
  ``quartet`` (Castro et al., 2505.14669, approximated: see its source).
- DeepSeek-V3 (arXiv 2412.19437): ``deepseek_v3_fp8`` (E4M3 GEMM operands of every linear layer
  with FP32 block scales: 1x128 activation tiles, 128x128 weight blocks; FP32 promotion every 128).
- ``mxfp8_pretraining`` (Mishra et al. 2025, arXiv 2506.08027: MXFP8 E4M3 everywhere, scales
  rounded up) and ``nvfp4_4over6`` (Transformer Engine's NVFP4 with 4over6 block scales).

Each preset's source, formats and where the emulation differs from it: docs/convert.md
("Published low-precision recipes").
"""
from __future__ import annotations

from typing import Optional

from .plans import Recipe
from ..tensor.attention import AttentionFormats
from ..tensor.transforms import Hadamard
from ..formats.block import BlockFormat
from ..formats.fixed import FixedFormat
from ..formats.float import FloatFormat
from ..formats.presets import PRESETS
from ..formats.parse import format as _format
from ..accum.format import PRESETS as _accum_presets

__all__ = ["mxfp6", "mxfp4_weights", "mx_all", "direct_cast", "mx_all_mxfp8", "mx_all_mxfp6", "mx_all_mxfp4",
           "mxint8_inference", "fp16", "block8", "swalp", "wage", "nvfp4_nvidia",
           "fp4_all_the_way", "quartet", "describe", "PRESETS_BY_NAME",
           "deepseek_v3_fp8", "mxfp8_pretraining", "nvfp4_4over6", "fa3_fp8_attention",
           "mx_attention", "mx_attention_mxfp8"]

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
    if not f.is_block:
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

# --- FP4 training recipes. Their roles keep every value in BF16/FP32 and every
# contraction outside a Linear/Conv (attention's batched GEMMs) in BF16; Recipe.gemm puts the
# three GEMMs of each Linear/Conv in FP4.
_nv = _P["nvfp4"]  # two-level: E4M3 scales of 16 elements under an FP32 tensor scale
_nv_sr = _nv.replace(rounding="stochastic")
_nv_w = _nv.replace(block_shape=(16, 16))  # 16x16 weight blocks: W and W^T round alike
_fp4_roles = dict(weight=(_fp32, _bf16), bias=_fp32, activation=_bf16, grad=_bf16,
                  optimizer_state=None, master_weights=True)

_nv_gemm = {"fprop": (_nv, _nv_w), "dgrad": (_nv_sr, _nv_w), "wgrad": (_nv, _nv_sr),
            "transform": {"wgrad": Hadamard(16, signs="te")}}
nvfp4_nvidia = Recipe(
    **_fp4_roles,
    # (a conv weight's K, its input channels, is not one of its last two dims: 1D blocks there)
    gemm={"linear": _nv_gemm,
          "conv": {**_nv_gemm, "fprop": (_nv, _nv), "dgrad": (_nv_sr, _nv)}},
    last_layers=(0.15, _bf16),
    name="nvfp4_nvidia",
    source="NVIDIA, 'Pretraining LLMs with NVFP4' (arXiv 2509.25149) and Transformer Engine's "
    "NVFP4BlockScaling: NVFP4 (E2M1, E4M3 scales of 16, FP32 per-tensor amax scale) for x, W "
    "and dY in all three GEMMs, each operand rounded from the high-precision tensor; stochastic "
    "rounding on the gradient dY only (dgrad and wgrad), round-to-nearest-even for x and W; the "
    "16x16 random Hadamard transform (TE's sign vector) on both wgrad operands along the tokens, "
    "tensor scale after it; the last 15% of the linear layers (the paper: ~15%, mostly at the "
    "end; here the last ones, rounded up, the output head included) in BF16; attention, "
    "norms, embeddings BF16, FP32 master weights and optimizer; Linear weights in 16x16 2D "
    "blocks (the same tiles in fprop and dgrad; conv weights, which the paper has none of, in "
    "1D blocks of 16 along K). Differs: the paper's first BF16 blocks are not kept")

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
    "FP32 per-tensor scale of NVFP4 (without it gradients flush) and SR on every "
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

# DeepSeek-V3 (arXiv 2412.19437, sec. 3.3): the GEMMs of every linear layer (Fprop, Dgrad, Wgrad)
# take E4M3 operands, all of them, with FP32 scales from each block's amax (amax / 448, "online"):
# activations and activation gradients in 1x128 tiles along the GEMM's K (Wgrad's K is the token
# dim: 128x1 tiles, as the paper re-quantizes them), weights in 128x128 blocks (the same tiles in
# Fprop and Dgrad); the partial sums promoted to FP32 every 128 K-elements (sec. 3.3.2, hopper_fp8).
_ds_act = BlockFormat(_P["fp8_e4m3"], 128, scale="fp32", scale_rule="amax")
_ds_weight = BlockFormat(_P["fp8_e4m3"], block_shape=(128, 128), scale="fp32", scale_rule="amax")
deepseek_v3_fp8 = Recipe(
    weight=_fp32, bias=_fp32, activation=_bf16, grad=_fp32, optimizer_state=_bf16,
    master_weights=False, accumulate=_accum_presets["hopper_fp8"],
    gemm={"linear": {"fprop": (_ds_act, _ds_weight), "dgrad": (_ds_act, _ds_weight),
                     "wgrad": (_ds_act, _ds_act)}, "conv": None},
    name="deepseek_v3_fp8",
    source="DeepSeek-V3 (arXiv 2412.19437) sec. 3.3 FP8 training: every nn.Linear's Fprop, Dgrad "
    "and Wgrad GEMM with E4M3 operands, FP32 per-block amax scales, 1x128 activation / "
    "activation-gradient tiles along K and 128x128 weight blocks, FP32 promotion every 128 "
    "K-elements (hopper_fp8, which sums the scaled values; DeepGEMM applies the scales at "
    "promotion); BF16 activations and BF16 AdamW moments; FP32 weights (the master copy) and "
    "weight gradients. Other contractions (attention's, convolutions) take BF16/FP32 operands, "
    "as the paper keeps attention in higher precision. Assumed: activation gradients have FP32 "
    "values (one grad role also gives the weight gradients' FP32); the output head and MoE "
    "gates need a rule to stay out of FP8 (.replace(rules={'lm_head': qt.bf16})); FP32 scales "
    "are rounded to 20 significant bits (amax_scale_format: element times scale a float32)")

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

# Attention formats (Recipe(attention=...), recipe.replace(attention=...); docs/attention.md).
# FlashAttention-3's FP8 forward (Shah et al. 2024, arXiv 2407.08608): Q, K, V in E4M3 with
# block quantization (one FP32 scale per block of 128 tokens x the head dim: 128x128 tiles), P
# cast to E4M3 as it is (its values are in [0, 1]), scores and softmax in FP32. FA3's FP8 path
# has no backward: here the backward GEMMs take BF16 operands, as FA3's BF16 backward.
_fa3_block = BlockFormat(_P["fp8_e4m3"], block_shape=(128, 128), scale="fp32", scale_rule="amax")
fa3_fp8_attention = AttentionFormats(
    qk=(_fa3_block, _fa3_block), pv=(_P["fp8_e4m3"], _fa3_block),
    dq=(_bf16, _bf16), dk=(_bf16, _bf16), dv=(_bf16, _bf16), dp=(_bf16, _bf16),
    name="fa3_fp8_attention")


def mx_attention(fmt="mxfp8_e4m3") -> AttentionFormats:
    """The MX paper's attention (Rouhani et al. 2023; microxcaling's mx.matmul/mx.bmm): every
    operand of QK^T, PV and their backward GEMMs in the MX format ``fmt`` (blocks of 32 along
    each GEMM's K); scores, P, the softmax and dS in BF16, as its vector ops."""
    f = _format(fmt)
    if not f.is_block:
        raise ValueError(f"mx_attention expects a block (MX) format, got {f}")
    pairs = {g: (f, f) for g in ("qk", "pv", "dq", "dk", "dv", "dp")}
    return AttentionFormats(**pairs, scores=_bf16, probs=_bf16, softmax=_bf16, ds=_bf16,
                            name=f"mx_attention({f})")


mx_attention_mxfp8 = mx_attention("mxfp8_e4m3")

PRESETS_BY_NAME = {r.name: r for r in (mxfp6, mxfp4_weights, mx_all_mxfp8, mx_all_mxfp6,
                                       mx_all_mxfp4, mxint8_inference, fp16, block8, swalp, wage,
                                       nvfp4_nvidia, fp4_all_the_way, quartet,
                                       deepseek_v3_fp8, mxfp8_pretraining, nvfp4_4over6)}


def describe(print_table: bool = True) -> Optional[str]:
    """Print every preset recipe with its source and formats (returns None, so the REPL shows
    them once), or return that text with ``print_table=False``."""
    text = "\n\n".join(r.describe() for r in PRESETS_BY_NAME.values())
    if print_table:
        print(text)
        return None
    return text
