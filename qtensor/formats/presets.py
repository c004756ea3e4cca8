"""The named formats: presets (``qt.fp8_e4m3``, ``qt.mxfp4_e2m1``, ``qt.nvfp4``, IEEE P3109's
binary8 family...), their aliases, the names refused with a reason, and the format families."""
from __future__ import annotations

from .block import BlockFormat
from .fixed import FixedFormat
from .float import _P3109_DOMAINS, FloatFormat, _p3109_name, p3109

# The format families (a new family adds its class here: torch.load and dynamo take these as values)
FORMAT_CLASSES = (FloatFormat, FixedFormat, BlockFormat)


def _presets() -> dict:
    fp8_e4m3 = FloatFormat(4, 3, specials="fn", saturate=True)
    fp6_e3m2 = FloatFormat(3, 2, specials="none")
    fp6_e2m3 = FloatFormat(2, 3, specials="none")
    fp4_e2m1 = FloatFormat(2, 1, specials="none")
    e8m0 = FloatFormat(8, 0, bias=127, subnormals=False, specials="fn", saturate=False,
                       signed=False)
    fp8_e5m2 = FloatFormat(5, 2)
    int8_mx = FixedFormat(8, 6, symmetric=True)  # MXINT8 elements: k/64, |k| <= 127
    # NVIDIA's UE5M3 scale (PTX ISA and CUDA 13.4 cuda_fp8.h __nv_fp8_ue5m3): 8 bits, no sign,
    # 5 exponent bits (bias 15, subnormals), 3 mantissa bits, no Inf, NaN only 0xFF, max
    # 114688; conversions saturate (__NV_SATFINITE)
    ue5m3 = FloatFormat(5, 3, bias=15, subnormals=True, specials="fn", saturate=True,
                        signed=False)
    p3109_8 = {}
    for signed in (True, False):
        for p in range(1, 8 if signed else 9):
            for domain in _P3109_DOMAINS:
                f = p3109(8, p, signed, domain)
                p3109_8[_p3109_name(f)] = f
    return {
        "fp32": FloatFormat(8, 23),
        "tf32": FloatFormat(8, 10),
        "bf16": FloatFormat(8, 7),
        "fp16": FloatFormat(5, 10),
        "fp8_e4m3": fp8_e4m3,
        "fp8_e5m2": fp8_e5m2,
        "fp6_e3m2": fp6_e3m2,
        "fp6_e2m3": fp6_e2m3,
        "fp4_e2m1": fp4_e2m1,
        "e8m0": e8m0,
        "mxfp8_e4m3": BlockFormat(fp8_e4m3, 32, scale=e8m0),
        "mxfp8_e5m2": BlockFormat(fp8_e5m2, 32, scale=e8m0),
        "mxfp6_e3m2": BlockFormat(fp6_e3m2, 32, scale=e8m0),
        "mxfp6_e2m3": BlockFormat(fp6_e2m3, 32, scale=e8m0),
        "mxfp4_e2m1": BlockFormat(fp4_e2m1, 32, scale=e8m0),
        "mxint8": BlockFormat(int8_mx, 32, scale=e8m0),
        # NVIDIA's NVFP4 (Transformer Engine, arXiv 2509.25149): E4M3 scales of 16 elements
        # under a per-tensor FP32 scale from the tensor's amax; nvfp4_single without the latter
        "nvfp4": BlockFormat(fp4_e2m1, 16, scale=fp8_e4m3, scale_rule="amax", tensor_scale=True),
        "nvfp4_single": BlockFormat(fp4_e2m1, 16, scale=fp8_e4m3, scale_rule="amax"),
        "ue5m3": ue5m3,
        # NVFP4 with UE5M3 block scales (Transformer Engine's prototype; the scale's range,
        # 2^-17..114688, needs no per-tensor scale)
        "nvfp4_ue5m3": BlockFormat(fp4_e2m1, 16, scale=ue5m3, scale_rule="amax"),
        # MXFP4 (E8M0 scales, floor rule) with blocks of 16
        "mxfp4_e2m1_b16": BlockFormat(fp4_e2m1, 16, scale=e8m0),
        # IEEE P3109 binary8 (signed p = 1..7, unsigned p = 1..8; extended and finite domains)
        **p3109_8,
    }


PRESETS = _presets()
_PRESET_NAMES = {f: name for name, f in PRESETS.items()}
ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
    "mxfp8": "mxfp8_e4m3", "mxfp6": "mxfp6_e3m2", "mxfp4": "mxfp4_e2m1",
    # the OCP names as everyone writes them (an IEEE-style e4m3 would be max 240, e2m1 max 3)
    "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2", "e3m2": "fp6_e3m2", "e2m3": "fp6_e2m3",
    "e2m1": "fp4_e2m1", "mxfp4_b16": "mxfp4_e2m1_b16",
}
# Names refused with a reason: they would look like a format but round differently.
_REFUSED = {
    "float8_e8m0fnu": (
        "torch's cast to torch.float8_e8m0fnu is not a rounding qtensor has: it drops the sign, "
        "turns 0 into 2^-127 and rounds every value in (2^-127, 2^-126) up to 2^-126; qtensor's "
        "E8M0 scale format is 'e8m0' (qt.e8m0: round to nearest, 0, negative values and NaN "
        "give NaN)"),
}


