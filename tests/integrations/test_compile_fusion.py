"""Scalar float roundings fused by inductor into the kernels that produce their inputs.

With ``decompositions.set_scalar_fusion(True)`` (off by default), under torch.compile QTensor
code rounds float32 payloads to scalar float formats through
``qtensor_dispatch::round_to_dtype`` (bf16, fp16 and the FP8 presets) and
``qtensor_dispatch::round_float`` (any other signed float format, deterministic rounding), whose
inductor decompositions (``qtensor.kernels.decompositions.round_float_fast``: integer arithmetic on the
float32 bits) inductor fuses into the producer. The oracles: the eager C++ kernel and torch's
eager casts (what eager QTensor code runs), compared as bits, NaN payloads included, over random
bit patterns, every float32 exponent with the mantissas at the rounding points, and the
specials (NaN, Inf, -0, subnormals, overflow).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.kernels import backend, decompositions, ops

pytestmark = pytest.mark.skipif(not ops.kernels_available("cpu"),
                                reason="the oracle is the compiled kernel")

FLOAT = ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "bf16", "fp16", "tf32",
         "e3m4(bias=3)", "e4m3(subnormals=False)", "e3m2(subnormals=False)",
         "e4m3(specials=ieee, saturate=False)", "e5m2(saturate=True)", "e8m7(subnormals=False)",
         "e5m0", "e2m22"]
MODES = ["nearest", "nearest_away", "toward_zero"]
CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
         "fp8_e5m2": torch.float8_e5m2}


def _bits_grid() -> torch.Tensor:
    """Every float32 exponent (both signs) with the mantissas around each format's rounding
    point, random bit patterns, and the specials; 64 * k elements (torch's CPU cast to float16
    gives its scalar tail's NaNs other bits than its vector loop: see decompositions)."""
    g = torch.Generator().manual_seed(0)
    e = torch.arange(256, dtype=torch.int32) << 23
    m = []
    for d in range(24):  # the rounding point d bits up: below, at and above the half
        h = 1 << d
        m += [h - 1, h, h + 1, (h >> 1) - 1 if d else 0, h >> 1, (h >> 1) + 1, 3 * h,
              3 * h + (h >> 1)]
    m = torch.tensor(sorted({v & 0x7FFFFF for v in m}), dtype=torch.int32)
    grid = (e[:, None] | m[None, :]).flatten()
    rand = torch.randint(-2 ** 31, 2 ** 31, (1 << 16,), generator=g, dtype=torch.int64)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                            -float("nan"), 1e-45, -1e-45, 2 ** -126, 2 ** -127, 3.4028235e38,
                            448.0, 464.0, 480.0, 500.0, 57344.0, 61440.0, 65504.0, 65520.0,
                            1e30, -1e30, 2 ** -9 * 1.5, 2 ** -10, 2 ** -24, 2 ** -25],
                           dtype=torch.float32).view(torch.int32)
    payload_nans = torch.tensor([0x7F800001, 0x7FA00000, 0x7FFFFFFF, 0x7F812345],
                                dtype=torch.int64).to(torch.int32)
    u = torch.cat([grid, grid | (-2 ** 31), rand.to(torch.int32), special, payload_nans,
                   payload_nans | (-2 ** 31)])
    u = torch.cat([u, torch.zeros((-u.numel()) % 64, dtype=torch.int32)])
    return u.view(torch.float32)


def assert_raw_bits(got, want, msg):
    """assert_bits_equal, and the NaNs' bits too (assert_bits_equal matches any NaN)."""
    assert_bits_equal(got, want, msg)
    g, w = got.view(torch.int32).reshape(-1), want.view(torch.int32).reshape(-1)
    bad = (g != w).nonzero().reshape(-1)
    assert bad.numel() == 0, f"{msg}: {bad.numel()} NaNs differ in bits, e.g. " + ", ".join(
        f"{g[i].item() & 0xFFFFFFFF:#x} != {w[i].item() & 0xFFFFFFFF:#x}" for i in bad[:4])


@pytest.fixture
def _fusion_on():
    decompositions.set_scalar_fusion(True)
    yield
    decompositions.set_scalar_fusion(False)


def _kernel(fmt, x, rounding):
    name, args = ops.op_args(fmt)
    return getattr(torch.ops.qtensor, name)(x, *args, backend.rounding_code(rounding), 0)


@pytest.mark.parametrize("rounding", MODES)
@pytest.mark.parametrize("spec", FLOAT)
def test_short_form_gives_the_kernels_bits(spec, rounding, _fusion_on):
    """round_float (the decomposition inductor fuses), run eagerly, against the kernel."""
    fmt = qt.format(spec)
    args = ops.op_args(fmt)[1]
    code = backend.rounding_code(rounding)
    assert decompositions.fast_float_applies(*args[:3], args[5], code), spec
    x = _bits_grid()
    got = decompositions.round_float(x, *args, code)
    assert_raw_bits(got, _kernel(fmt, x, rounding), f"{fmt} {rounding}")


@pytest.mark.parametrize("spec", list(CASTS))
def test_cast_short_form_gives_eagers_bits(spec, _fusion_on):
    """round_to_dtype's decomposition against what eager QTensor code gives on CPU: torch's cast
    down and back (bf16, fp16: NaNs as its vector loop makes them), the kernel for the float8
    dtypes (qtensor.kernels.backend._SLOW_CPU_CASTS)."""
    x = _bits_grid()
    dt = CASTS[spec]
    got = decompositions.round_to_dtype(x, dt)
    want = x.to(dt).to(torch.float32) if dt in (torch.bfloat16, torch.float16) else \
        _kernel(qt.format(spec), x, "nearest")
    assert_raw_bits(got, want, spec)
    # the presets' arguments are those of decompositions' table
    assert decompositions._CAST_FORMATS[dt][:5] == tuple(ops.op_args(qt.format(spec))[1][:5])


def test_formats_the_short_form_leaves_to_the_general_one():
    """Unsigned formats (e8m0), fp32's own precision and subnormal quanta below float32's."""
    for spec in ["e8m0", "e8m23", "e8m7(subnormals=False, bias=140)"]:
        args = ops.op_args(qt.format(spec))[1]
        assert not decompositions.fast_float_applies(*args[:3], args[5], 0), spec
    assert decompositions.round_float(torch.ones(4), *ops.op_args(qt.e8m0)[1], 0) \
        is NotImplemented


# ---------------------------------------------------------------------------------------------
# Under torch.compile: fused, with eager's bits

_FUSED = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "bf16(rounding=nearest_away)", "fp6_e3m2",
          "fp8_e4m3(rounding=toward_zero)", "e4m3(subnormals=False)"]
_FUSED_FORMATS = [qt.format(s) for s in _FUSED]


def _qtensor_code(qs):
    """Each QTensor times 1.7 (one float32 multiplication, which inductor computes as ATen does:
    the output rounding's input has eager's float32 values; ties and overflows included)."""
    return [(q * 1.7).dequantize() for q in qs]


def _qtensors(x):
    return [qt.as_qtensor(x, f) for f in _FUSED_FORMATS]


def _compiled_code(fn, *args):
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(codes)




def test_inductor_fuses_qtensor_scalar_roundings_with_eagers_bits(_fusion_on):
    """Compiled QTensor code on the specials: eager's bits, NaN payloads included, and no extern
    rounding call (the mul and its output rounding in one generated kernel), its bit casts
    vectorized."""
    qs = _qtensors(_bits_grid().reshape(-1, 64))
    got, code = _compiled_code(_qtensor_code, qs)
    want = _qtensor_code(qs)
    for spec, g, w in zip(_FUSED, got, want, strict=True):
        assert_raw_bits(g, w, f"compiled {spec}")
    assert "torch.ops.qtensor_dispatch" not in code and "torch.ops.qtensor." not in code, code
    assert "c10::bit_cast<int32_t>" not in code  # (the scalar loop of inductor's own bit cast)


def test_scalar_fusion_off_calls_the_kernels():
    """Off by default: the roundings are extern calls of the kernels, with their bits."""
    assert not decompositions._fast_enabled
    qs = _qtensors(torch.randn(64, 64))
    got, code = _compiled_code(_qtensor_code, qs)
    assert "torch.ops.qtensor_dispatch.round_to_dtype.default(" in code
    assert "torch.ops.qtensor_dispatch.round_float.default(" in code
    for spec, g, w in zip(_FUSED, got, _qtensor_code(qs), strict=True):
        assert_bits_equal(g, w, spec)


class _Mlp(nn.Module):
    """Linear layers (addmm forward, mm backward), ReLU and a residual add: ops whose float32
    values inductor computes as ATen does, so that every bit can be compared."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("spec", ["bf16", "bf16(rounding=nearest_away)"])
def test_compiled_model_with_fused_roundings_is_bit_identical_to_eager(spec, _fusion_on):
    """A converted model, forward and backward, default inductor: the output and every
    gradient are eager's bits, and no rounding is an extern call (the addmm stays addmm)."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    model = qt.convert(_Mlp(), qt.format(spec))
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True)
    x = torch.randn(32, 64)

    def run(m):
        y = m(x)
        y.square().sum().backward()
        return y.dequantize(), {n.removeprefix("_orig_mod."): p.grad
                                for n, p in m.named_parameters()}

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        (yc, gc), codes = run_and_get_code(run, compiled)
    y, g = run(model)
    assert_bits_equal(yc, y, "output")
    for name, grad in g.items():
        assert_bits_equal(gc[name].dequantize() if isinstance(gc[name], qt.QTensor)
                          else gc[name], grad.dequantize() if isinstance(grad, qt.QTensor)
                          else grad, f"grad of {name}")
    code = "\n".join(codes)
    assert "torch.ops.qtensor_dispatch" not in code and "torch.ops.qtensor." not in code, code
    assert "extern_kernels.addmm(" in code
