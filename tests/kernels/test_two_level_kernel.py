"""The fused two-level kernel (qtensor::quantize_two_level, CPU) gives reference.quantize_two_level's
bits (Transformer Engine's rule, the spec) in every rounding mode and option the reference has:
4over6, ceil, settle=, a given tensor scale, UE5M3 scales, float and fixed-point elements, 1D
blocks along any axis, 2D tiles, float32/half/bf16 payloads; and every caller takes it."""
from __future__ import annotations

import pytest
import torch

import qtensor as qt
from qtensor.kernels import backend, ops, reference

from helpers import (check_two_level_callers, two_level_caller_wants, two_level_formats,
                     two_level_inputs)

pytestmark = pytest.mark.skipif(not ops.kernels_available("cpu"), reason="no compiled kernels")

FORMATS = two_level_formats()
ROUNDINGS = ["nearest", "nearest_away", "toward_zero", "stochastic", "stochastic5"]


def _bits(t):
    return t.detach().float().contiguous().view(torch.int32)


def _inputs():
    return two_level_inputs(more=True)


def _check(x, fmt, rounding, seed=12345, tensor_scale=None):
    want = reference.quantize_two_level(x, fmt, rounding, seed, tensor_scale, block_scales=True)
    got = backend.two_level(x, fmt, rounding, seed, tensor_scale, block_scales=True)
    assert got[0].dtype == x.dtype and got[0].shape == x.shape
    assert torch.equal(_bits(got[0]), _bits(want[0]))
    assert torch.equal(_bits(got[1]), _bits(want[1]))
    assert got[2].shape == want[2].shape
    assert torch.equal(_bits(got[2]), _bits(want[2]))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", list(FORMATS))
def test_kernel_matches_the_reference_bit_for_bit(name, rounding):
    fmt = FORMATS[name]
    for key, x in _inputs().items():
        if fmt.block_shape is not None and x.dim() < 2:
            continue
        try:
            _check(x, fmt, rounding)
        except AssertionError as e:
            raise AssertionError(f"{name} {rounding} {key}") from e


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", ["nvfp4", "4over6", "tiles", "axis0"])
def test_half_payloads(name, rounding, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 48, generator=g) * torch.exp2(torch.randint(-20, 20, (6, 48), generator=g)
                                                       .float())).to(dtype)
    x[0, 5] = float("nan")
    x[3, 0] = 6e4 if dtype == torch.float16 else 3e38
    _check(x, FORMATS[name], rounding)


def _whole_block_rows():
    """Rows of whole blocks of 16 (the kernel's register path, 8 blocks at a time): 15 blocks
    (a short last batch) with an Inf, a NaN (in the short batch), -0 blocks and elements, a huge
    and a subnormal block; 4480 blocks of exponents far apart (many parallel chunks); a 1-D row."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 48, generator=g)
    x[0, 17], x[4, 40] = -float("inf"), float("nan")
    x[2, :16] = -0.0
    x[1, 0] = x[1, 33] = -0.0
    x[3, 16:32] *= 1e30
    x[3, 32:48] *= 1e-40
    e = torch.randint(-30, 30, (70, 64, 1), generator=g).float()
    big = (torch.randn(70, 64, 16, generator=g) * torch.exp2(e)).reshape(70, 1024)
    return {"short": x, "big": big, "flat": torch.randn(16 * 13, generator=g)}


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", ["nvfp4", "4over6", "e5m2_scales"])
def test_rows_of_whole_blocks(name, rounding):
    fmt = FORMATS.get(name) or qt.BlockFormat("fp4_e2m1", 16, scale="fp8_e5m2",
                                              scale_rule="amax", tensor_scale=True)
    for key, x in _whole_block_rows().items():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            try:
                _check(x.to(dtype), fmt, rounding)
            except AssertionError as err:
                raise AssertionError(f"{key} {dtype}") from err


def _near_ties(seed):
    """Blocks of 16 on which 4over6's two error sums tie or nearly tie: values on the e2m1 grid
    times a power of two, or 1.5 times one (exact, or nearly, under both candidate scales), some
    moved by an ulp; among ordinary blocks, zero blocks and blocks whose candidates saturate."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    rows = []
    for k in range(512):
        kind = k % 8
        if kind < 5:
            a = 2.0 ** int(torch.randint(-12, 12, (), generator=g)) * (1.5 if kind % 2 else 1.0)
            b = grid[torch.randint(0, 8, (16,), generator=g)] * a
            if kind >= 3:  # an ulp off the grid
                j = torch.randint(0, 16, (3,), generator=g)
                b[j] = torch.nextafter(b[j], torch.full((3,), float("inf")))
        elif kind == 5:
            b = torch.zeros(16)
        elif kind == 6:
            b = torch.randn(16, generator=g) * 1e6  # past the tensor's amax: saturated scales
        else:
            b = torch.randn(16, generator=g)
        rows.append(b * torch.where(torch.rand(16, generator=g) < 0.5, -1.0, 1.0))
    return torch.stack(rows).reshape(64, 128)


@pytest.mark.parametrize("rounding", ["nearest", "toward_zero", "stochastic"])
def test_4over6_near_ties(rounding):
    """The register path decides 4over6 from error sums added in any order where they prove TE's
    element-order pick, else from TE's own sums: near ties take the latter, and give the
    reference's bits (with the tensor's own scale and given ones, so also tiny and huge
    intermediates)."""
    fmt = FORMATS["4over6"]
    for seed in (1, 2, 3):
        x = _near_ties(seed)
        _check(x, fmt, rounding, seed=seed)
        for s in (2.0 ** -120, float(torch.tensor(1e-3)), 2.0 ** 100):
            _check(x, fmt, rounding, seed=seed, tensor_scale=s)


@pytest.mark.parametrize("rounding", ["stochastic", "stochastic5"])
@pytest.mark.parametrize("name", ["nvfp4", "4over6"])
def test_stochastic_elements_past_the_grid_max(name, rounding):
    """Register path, stochastic e2m1: elements whose |x| / (X dec) lies past 6 (in (6, 8): a block
    scale rounded down; at or past 8: the smallest scale, or a zero scale's inv of FLT_MAX) give
    the reference's bits (the kernel clamps at 6 before its grid step)."""
    g = torch.Generator().manual_seed(3)
    fmt = FORMATS[name]
    # the tensor's amax 1: enc = 6 * bound, X = code(amax * enc / 6) for amax and 4over6 alike
    enc = 6.0 * float(fmt.tensor_scale_bound)
    X_of = [1.0625, 1.125, 1.0, 2.0 ** -9 * 1.4, 2.0 ** -9 * 0.6, 2.0 ** -12]
    rows = []
    for k in range(64):
        t = X_of[k % len(X_of)] * (1.0 + 0.06 * torch.rand((), generator=g).item())
        b = torch.rand(16, generator=g) * (t * 6.0 / enc)
        b[k % 16] = t * 6.0 / enc  # the block's amax
        rows.append(b * torch.where(torch.rand(16, generator=g) < 0.5, -1.0, 1.0))
    x = torch.stack(rows).reshape(8, 128)
    x[0, 0] = 1.0
    for seed in (1, 2, 3):
        _check(x, fmt, rounding, seed=seed)
    _, dec, X = backend.two_level(x, fmt, "nearest", 0, block_scales=True)
    at = x.reshape(-1, 16).abs() / (X.reshape(-1, 1) * dec)
    assert ((at > 6) & (at < 8)).any() and (at >= 8).any()


@pytest.mark.parametrize("rounding", ["nearest", "toward_zero", "stochastic"])
@pytest.mark.parametrize("name", ["nvfp4", "4over6", "ceil", "settle"])
def test_given_tensor_scale(name, rounding):
    x = _inputs()["wide"]
    for s in (1e-3, 2.0 ** -126, 3.0, torch.tensor(7.5e-6)):
        if not isinstance(s, torch.Tensor):
            s = float(torch.tensor(s, dtype=torch.float32))
        _check(x, FORMATS[name], rounding, tensor_scale=s)


def test_strided_and_inplace_callers_take_the_kernel(monkeypatch):
    """qt.quantize (out= too), quantize_, quantize_with_scale, a QTensor's rounding and accum's
    source scales all go to the kernel, with the reference's bits."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 48, generator=g)
    want, want_t = two_level_caller_wants(x)

    def refuse(*a, **k):
        raise AssertionError("the reference ran")
    monkeypatch.setattr(reference, "quantize_two_level", refuse)
    check_two_level_callers(x, want, want_t)
    for r, w in want.items():
        q, s = ops.quantize_with_scale(x, qt.nvfp4, rounding=r,
                                      generator=torch.Generator().manual_seed(9))
        assert torch.equal(_bits(q), _bits(w)) and s.dtype == torch.float32


def test_kernel_is_refused_for_bad_arguments():
    x = torch.randn(4, 16)
    fmt = qt.nvfp4
    elem, emax, scale, smax = fmt.elem_scale_args()
    args = (elem, emax, 2, scale, smax, [4, 16, 1, 16], 448.0, False, None, False, 0, 0)
    op = torch.ops.qtensor.quantize_two_level
    with pytest.raises(RuntimeError, match="geom"):
        op(x, *args[:5], [3, 16, 1, 16], *args[6:])
    with pytest.raises(RuntimeError, match="scale_rule"):
        op(x, elem, emax, 0, *args[3:])
    with pytest.raises(RuntimeError, match="tensor_scale"):
        op(x, *args[:8], torch.tensor(-1.0), *args[9:])


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ops.kernels_available("cuda")),
                          reason="needs a CUDA device and the CUDA kernels")


@cuda
def test_cuda_matches_the_cpu_kernel():
    """On a GPU (scripts/gpu_check.sh): the Triton kernel gives the CPU kernel's bits (values,
    tensor scale, block scales) on every format, rounding and input above, half payloads, a
    given tensor scale, and a big tensor with strided views (many programs)."""
    def same(x, fmt, rounding, tensor_scale=None, what=""):
        want = backend.two_level(x, fmt, rounding, 12345, tensor_scale, block_scales=True)
        got = backend.two_level(x.cuda(), fmt, rounding, 12345, tensor_scale, block_scales=True)
        for g, w in zip(got, want):
            assert torch.equal(_bits(g.cpu()), _bits(w)), what
    for i, (name, fmt) in enumerate(FORMATS.items()):
        # (each format and mode is a kernel compiled on first use: every mode for nvfp4, one
        # for each other format, every mode over several formats)
        modes = ROUNDINGS if name == "nvfp4" else (ROUNDINGS[i % 5],)
        for rounding in modes:
            for key, x in _inputs().items():
                if fmt.block_shape is None or x.dim() >= 2:
                    same(x, fmt, rounding, what=f"{name} {rounding} {key}")
            for dtype in (torch.float16, torch.bfloat16):
                same(_inputs()["wide"].clamp(-6e4, 6e4).to(dtype), fmt, rounding,
                     what=f"{name} {rounding} {dtype}")
            same(_inputs()["wide"], fmt, rounding, 3e-6, f"{name} {rounding} tensor_scale")
    big = torch.randn(1000, 4099)
    for name in ("nvfp4", "4over6", "axis0", "tiles"):
        for v in (big, big.t(), big[:, 1:]):
            for rounding in ("nearest", "stochastic"):
                same(v, FORMATS[name], rounding, what=f"big {name} {rounding} {v.stride()}")
