"""The first-use check of the CUDA kernels, until they have passed ``scripts/gpu_check.sh``.

The CUDA kernels (the Triton kernels of qtensor/gpu) are checked in CI under Triton's CPU
interpreter, but no GPU has run them yet. So that a
wrong CUDA result cannot pass unnoticed, the first use in a process of each kernel family on a
CUDA device compares the kernel with the pure-PyTorch reference (which runs on any device) on a
small fixed sample on that device. On any difference, or an error, that family uses the reference
from then on (the same bits, slower) and warns once, saying how to report it. The families:

- ``scalar``: float and fixed-point formats, deterministic rounding (``qtensor::quantize_float``,
  ``quantize_fixed``);
- ``block``: block formats, deterministic rounding (``qtensor::quantize_block``);
- ``stochastic``: any format with stochastic rounding;
- ``two_level``: two-level block formats (nvfp4: Transformer Engine's rule), every rounding
  (``qtensor::quantize_two_level``);
- ``accumulator``: ``qt.accum.accum_matmul`` (``qtensor::accum_matmul``).

No check runs on devices outside ``CHECKED_DEVICES`` (the CPU kernels are held to the reference
bit for bit by tests/kernels/test_kernels.py on every change), once ``GPU_VERIFIED`` is True (set it in
the commit that records a passing scripts/gpu_check.sh run), or with ``QTENSOR_KERNEL_CHECK=0``
in the environment (scripts/gpu_check.sh, which tests the kernels themselves). The modules that
own the kernels register each family's check (``register``); a check returns None when the
kernel agrees, else what differed.
"""
from __future__ import annotations

import os
from typing import Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..formats.block import BlockFormat
from ..formats.fixed import FixedFormat
from ..formats.float import FloatFormat
from ..formats.presets import PRESETS
from ..warn import warn

__all__ = ["GPU_VERIFIED", "CHECKED_DEVICES", "ENV", "FAMILIES", "family", "register",
           "trusted", "verdicts", "reset", "quantize_cases", "difference"]

GPU_VERIFIED = False  # True once scripts/gpu_check.sh has passed on a GPU
CHECKED_DEVICES = frozenset({"cuda"})  # device types whose kernels are checked on first use
ENV = "QTENSOR_KERNEL_CHECK"  # "0": trust the kernels without the check
FAMILIES = ("scalar", "block", "stochastic", "two_level", "accumulator")
REPORT = (
    "Please report it as an issue of the qtensor project, with this warning, the output of "
    "`nvidia-smi` and of `python -c \"import torch; print(torch.__version__, torch.version.cuda)\"`"
    ", and if you can the log of `scripts/gpu_check.sh` (in the qtensor checkout). "
    f"{ENV}=0 skips this check (and keeps the kernels).")

_checks: dict = {}    # family -> check(device) -> None or what differed
_verdicts: dict = {}  # (device type, family) -> True: the kernel agreed; False: the reference


def family(fmt, rounding: str) -> str:
    """The kernel family that rounds to ``fmt`` with ``rounding``."""
    if fmt.is_two_level:
        return "two_level"
    if rounding.startswith("stochastic"):  # (also "stochasticN")
        return "stochastic"
    return "block" if fmt.is_block else "scalar"


def register(name: str, check: Callable[[torch.device], Optional[str]]) -> None:
    """Set the check of kernel family ``name`` (called by the module that owns the kernels)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown kernel family {name!r}; expected one of {', '.join(FAMILIES)}")
    _checks[name] = check


def verdicts() -> dict:
    """What the checks found so far: {(device type, family): kernel trusted}."""
    return dict(_verdicts)


def reset() -> None:
    """Forget the verdicts: the next use of each family checks again (and may warn again)."""
    _verdicts.clear()


@torch.compiler.assume_constant_result  # under torch.compile: decided (and run) while tracing
def _decide(device: str, name: str) -> bool:
    dev = torch.device(device)
    key = (dev.type, name)
    verdict = _verdicts.get(key)
    if verdict is None:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False  # no check inside a CUDA graph capture (it syncs): the reference, for now
        verdict = _verdicts[key] = _run(dev, name)
    return verdict


def trusted(device_type: str, name: str, device=None) -> bool:
    """Whether kernel family ``name`` may run on ``device`` (of type ``device_type``); checks it
    on first use, on that device."""
    if device_type not in CHECKED_DEVICES or GPU_VERIFIED or os.environ.get(ENV) == "0":
        return True
    return _decide(str(device if device is not None else device_type), name)


def _run(device: torch.device, name: str) -> bool:
    check = _checks.get(name)
    if check is None:
        return True  # nothing registered runs this family
    # real tensors on the device, whatever traces around us (FakeTensor, make_fx, functorch)
    try:
        with _disable_current_modes(), torch._C._DisableFuncTorch(), torch.no_grad():
            found = check(device)
    except Exception as e:  # a launch failure, a missing kernel image, ...
        found = f"the kernel raised {type(e).__name__}: {e}"
    if found is None:
        return True
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    warn(f"qtensor: the {name} kernels do not agree with the reference on {device} ({gpu}): "
         f"{found}. qtensor now uses the pure-PyTorch reference for every {name} rounding "
         f"on {device.type} in this process: the results are right, but slower. The CUDA "
         f"kernels had never run on a GPU before. {REPORT}")
    return False


# ---------------------------------------------------------------------------------------------
# The sample of the quantization families: every kind of format the kernels distinguish, ties,
# subnormals, overflow, Inf and NaN, the three input dtypes, contiguous and strided.

_P = PRESETS
_SCALAR = [_P[n] for n in ("fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "tf32", "fp6_e3m2",
                           "fp6_e2m3", "fp4_e2m1", "e8m0")] + [
    FloatFormat(4, 3), FloatFormat(5, 2, subnormals=False), FloatFormat(4, 3, specials="fn"),
    FloatFormat(8, 3, bias=130, subnormals=False), FixedFormat(8, 4),
    FixedFormat(8, 4, saturate=False), FixedFormat(8, 4, signed=False),
    FixedFormat(16, 14, symmetric=True)]
_BLOCK = [_P[n] for n in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp4_e2m1", "mxint8",
                          "nvfp4_single")] + [
    BlockFormat(_P["fp8_e4m3"], 16, axis=0), BlockFormat(_P["fp4_e2m1"], None, axis=None),
    BlockFormat(_P["fp8_e4m3"], 32, scale_rule="ceil"),
    BlockFormat(FloatFormat(3, 4, specials="none"), 4, scale=_P["bf16"], scale_rule="amax"),
    BlockFormat(FixedFormat(8, 6, symmetric=True), 8, scale=_P["fp8_e4m3"], scale_rule="amax")]
_STOCHASTIC = [_P["fp8_e4m3"], _P["bf16"], _P["fp4_e2m1"], FixedFormat(8, 4), _P["mxfp4_e2m1"],
               _P["nvfp4_single"], _P["mxint8"], BlockFormat(_P["fp8_e4m3"], 16, axis=0)]
_E4M3 = _P["fp8_e4m3"]
_TWO_LEVEL = [_P["nvfp4"], _P["nvfp4"].replace(axis=0), _P["nvfp4"].replace(block_shape=(4, 8)),
              _P["nvfp4"].replace(settle=True),
              BlockFormat(_P["fp4_e2m1"], 16, scale=_E4M3, scale_rule="4over6", tensor_scale=True),
              BlockFormat(_P["fp4_e2m1"], 16, scale=_E4M3, scale_rule="ceil", tensor_scale=True),
              BlockFormat(_P["fp4_e2m1"], 16, scale="ue5m3", scale_rule="amax", tensor_scale=True),
              BlockFormat(FixedFormat(6, 2, symmetric=True), 8, scale=_E4M3, scale_rule="amax",
                          tensor_scale=True)]
_SEED = 0x5EED_0F_C0DA


def _values(device: torch.device) -> torch.Tensor:
    """256 float32 values (8 rows of 32): specials, ties at many scales, random magnitudes."""
    g = torch.Generator().manual_seed(0)  # a generator of its own: the user's stream is untouched
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 448.0, 464.0,
                            480.0, 57344.0, 65520.0, 3.4e38, 1.1754943508222875e-38, 1e-45,
                            2.0 ** -127, 6.0, 5.0, 0.25, -1.5, 127.0, 255.5, -128.5, 7.96875])
    ties = (torch.arange(-40, 40, dtype=torch.float32) + 0.5) / 8  # ties of 3-6 bit formats
    tiny = (torch.arange(1, 25, dtype=torch.float32) + 0.5) * 2.0 ** -140
    spread = torch.randn(256, generator=g) * torch.exp2(torch.randint(-30, 30, (256,),
                                                                      generator=g).float())
    x = torch.cat([special, ties, tiny, spread])[:256].reshape(8, 32)
    x[5] *= 2.0 ** -100  # a row of blocks below float32's normals
    x[6] *= 2.0 ** 90
    return x.to(device)


def quantize_cases(name: str, device: torch.device) -> Iterator[tuple]:
    """(x, fmt, rounding, seed) of the sample of quantization family ``name`` on ``device``."""
    base = _values(device)
    inputs = [base, base.t()]  # contiguous, and a strided view
    inputs += [base.to(dt) for dt in (torch.float16, torch.bfloat16)]
    if name == "scalar":
        for fmt in _SCALAR:
            for rounding in ("nearest", "nearest_away", "toward_zero"):
                for x in inputs:
                    yield x, fmt, rounding, 0
    elif name == "block":
        for fmt in _BLOCK:
            for rounding in ("nearest", "nearest_away", "toward_zero"):
                for x in inputs:
                    yield x, fmt, rounding, 0
    elif name == "two_level":
        inputs.insert(2, base[1:5])  # (without row 0's specials: a tensor scale of normal values)
        modes = ("nearest", "nearest_away", "toward_zero", "stochastic")
        for i, fmt in enumerate(_TWO_LEVEL):
            # (each format and mode is a kernel compiled on first use: every mode for nvfp4,
            # one for each other format)
            for rounding in modes if i == 0 else modes[i % 4:i % 4 + 1]:
                for x in inputs:
                    yield x, fmt, rounding, _SEED
    else:
        for fmt in _STOCHASTIC:
            for x in inputs:
                yield x, fmt, "stochastic", _SEED


def difference(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """None when got and want hold the same bits (NaN as NaN), else what differs."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"shape/dtype {tuple(got.shape)} {got.dtype} instead of "
                f"{tuple(want.shape)} {want.dtype}")
    g, w = got.reshape(-1), want.reshape(-1)
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[g.element_size()]
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    bad = (nan_g != nan_w) | (~nan_g & (g.contiguous().view(ints) != w.contiguous().view(ints)))
    n = int(bad.sum())
    if n == 0:
        return None
    i = int(bad.nonzero()[0])
    return f"{n} of {g.numel()} values differ (e.g. {g[i].item()!r} instead of {w[i].item()!r})"
