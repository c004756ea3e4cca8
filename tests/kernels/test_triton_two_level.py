"""The Triton kernel of two-level formats (qtensor.kernels.gpu.quantize_two_level: Transformer
Engine's rule, the CUDA back end of nvfp4 and its variants) under Triton's CPU interpreter: bit
for bit against reference.quantize_two_level (values, decode tensor scale, block scales) in every
rounding mode and option the C++ kernel covers (tests/kernels/test_two_level_kernel.py), on small
packed inputs; and the callers (qt.quantize, out=, quantize_, a QTensor, a converted model's
training step, torch.compile) take it where the Triton kernels round (gpu.force). Skipped without
triton."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # (conftest.py sets it where there is no GPU)
    pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1",
                allow_module_level=True)

import qtensor as qt  # noqa: E402
from qtensor.kernels import backend, gpu, ops, reference  # noqa: E402
from qtensor.tensor import dispatch  # noqa: E402

from helpers import (check_two_level_callers, count_calls, one_sgd_step, two_level_caller_wants,  # noqa: E402
                     two_level_formats)

# (the interpreter's numpy casts of float64 steps that overflow float32 to Inf, as they must)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast")

FORMATS = two_level_formats()
ROUNDINGS = ["nearest", "nearest_away", "toward_zero", "stochastic", "stochastic5"]
SEED = 0x9E3779B97F4A7C15  # above 2^63: the op's signed seed, a key >= 2^31 in the kernel


def _bits(t):
    return t.detach().float().contiguous().view(torch.int32)


def _packed(seed=0):
    """One [12, 72] tensor of the hard cases (72 = 4.5 blocks of 16: a partial block per row):
    normal, heavy-tailed, tiny and float32-subnormal rows (scales below E4M3's range under the
    tensor scale of the others), a wide exponent spread, zeros and negative zeros, one hot block,
    Inf and NaN in some blocks, ties of the element grid."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 72, generator=g)
    x[1] /= torch.randn(72, generator=g).abs().pow(3)
    x[2] *= 1e-30
    x[3] *= 1e-41
    x[4] *= torch.exp2(torch.randint(-60, 60, (72,), generator=g).float())
    x[5] = 0.0
    x[6] = -0.0
    x[7, :16] *= 1e6
    x[8, 3], x[8, 40], x[9, 17] = float("inf"), float("nan"), -float("inf")
    x[10, :24] = torch.tensor([0.25, 0.75, 1.25, 2.5, 3.5, 5.0, -0.25, -1.75] * 3)
    return x


def _check(x, fmt, rounding, seed=SEED, tensor_scale=None):
    with gpu.force():
        assert backend._two_level_geom(x, fmt) is not None
        got = backend.two_level(x, fmt, rounding, seed, tensor_scale, block_scales=True)
    want = reference.quantize_two_level(x, fmt, rounding, seed, tensor_scale, block_scales=True)
    assert got[0].dtype == x.dtype and got[0].shape == x.shape
    for g, w, what in zip(got, want, ("values", "tensor scale", "block scales")):
        assert g.shape == w.shape, what
        d = _bits(g) != _bits(w)
        assert not d.any(), f"{what}: {int(d.sum())} differ, e.g. {g[d][:4]} vs {w[d][:4]}"


@pytest.fixture
def counted(monkeypatch):
    """The calls of the Triton two-level kernel."""
    return count_calls(monkeypatch, gpu, "quantize_two_level")


@pytest.mark.parametrize("name", list(FORMATS))
def test_kernel_matches_the_reference_bit_for_bit(name, counted):
    fmt = FORMATS[name]
    x = _packed()
    i = list(FORMATS).index(name)
    # two roundings per format, every rounding over several formats
    for rounding in (ROUNDINGS[i % 5], ROUNDINGS[(i + 2) % 5]):
        try:
            _check(x, fmt, rounding)
        except AssertionError as e:
            raise AssertionError(f"{name} {rounding}") from e
    assert len(counted) == 2


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_tensor_scales_at_the_ends_of_float32(rounding):
    g = torch.Generator().manual_seed(2)
    cases = {"subnormal": torch.randn(3, 32, generator=g) * 1e-41,
             "max": torch.full((2, 32), 3.4e38) * torch.sign(torch.randn(2, 32, generator=g)),
             "zeros": torch.zeros(2, 32), "all_nan": torch.full((2, 16), float("nan"))}
    for key, x in cases.items():
        try:
            _check(x, FORMATS["nvfp4"], rounding)
        except AssertionError as e:
            raise AssertionError(key) from e


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_payloads(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 48, generator=g) * torch.exp2(torch.randint(-20, 20, (6, 48), generator=g)
                                                       .float())).to(dtype)
    x[0, 5] = float("nan")
    x[3, 0] = 6e4 if dtype == torch.float16 else 3e38
    _check(x, FORMATS["4over6"], "nearest")
    _check(x, FORMATS["tiles"], "stochastic")


@pytest.mark.parametrize("name,rounding", [("nvfp4", "stochastic"), ("4over6", "toward_zero"),
                                           ("ceil", "nearest"), ("settle", "toward_zero")])
def test_given_tensor_scale(name, rounding):
    x = _packed(3)
    for s in (2.0 ** -126, torch.tensor(7.5e-6)):
        _check(x, FORMATS[name], rounding, tensor_scale=s)


def test_callers_take_the_kernel(counted, monkeypatch):
    """qt.quantize (out= too), quantize_, quantize_with_scale, a QTensor's rounding, a
    transposed input (random words by the element's index in x.t()) and the block scales of the
    flush statistics round with the Triton kernel where it takes x, with the reference's bits."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 48, generator=g)
    want, want_t = two_level_caller_wants(x)
    want_X = reference.quantize_two_level(x, qt.nvfp4, "nearest", block_scales=True)[2]

    def refuse(*a, **k):
        raise AssertionError("the reference ran")
    monkeypatch.setattr(reference, "quantize_two_level", refuse)
    monkeypatch.setattr(backend, "_CPU_KERNELS", False)
    with gpu.force():
        check_two_level_callers(x, want, want_t)
        _, _, X = backend.two_level(x, qt.nvfp4, "nearest", 0, block_scales=True)
        assert torch.equal(_bits(X), _bits(want_X))
    assert len(counted) == 9


def _train(recipe):
    torch.manual_seed(0)
    model = qt.convert(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)), recipe)
    return one_sgd_step(model, 32, 16, lr=1e-2, momentum=0.9)


def test_training_step_forced_gives_the_cpu_bits(counted, monkeypatch):
    """A converted model's step with NVIDIA's NVFP4 recipe (stochastic gradients, 2D weight
    tiles) on the Triton kernels gives the C++ kernels' bits."""
    want = _train(qt.recipes.nvfp4_nvidia)
    monkeypatch.setattr(backend, "_CPU_KERNELS", False)
    with gpu.force():
        got = _train(qt.recipes.nvfp4_nvidia)
    assert counted, "the Triton two-level kernel did not run"
    for g, w in zip(got, want):
        assert torch.equal(_bits(g), _bits(w))


def test_compiled_forced_matches_eager(counted, monkeypatch):
    monkeypatch.setattr(backend, "_CPU_KERNELS", False)
    x = _packed(5)[:, :64]
    want = reference.quantize(x, qt.nvfp4) * 2
    torch._dynamo.reset()
    with gpu.force():
        got = torch.compile(lambda t: qt.quantize(t, qt.nvfp4) * 2, backend="aot_eager",
                            fullgraph=True)(x)
    torch._dynamo.reset()
    assert counted and torch.equal(_bits(got), _bits(want))


def test_bad_arguments_are_refused():
    x = torch.randn(4, 16)
    elem, emax, scale, smax = qt.nvfp4.elem_scale_args()
    args = (elem, emax, 2, scale, smax, [4, 16, 1, 16], 448.0, False, None, False, 0, 0)
    with pytest.raises(RuntimeError, match="geom"):
        gpu.quantize_two_level(x, *args[:5], [3, 16, 1, 16], *args[6:])
    with pytest.raises(RuntimeError, match="scale_rule"):
        gpu.quantize_two_level(x, elem, emax, 0, *args[3:])
    with pytest.raises(RuntimeError, match="4over6 needs e2m1"):
        e6, m6, _, _ = FORMATS["fp6_elems"].elem_scale_args()
        gpu.quantize_two_level(x, e6, m6, 4, *args[3:])
    with pytest.raises(RuntimeError, match="tensor_scale must be one float32"):
        gpu.quantize_two_level(x, *args[:8], torch.ones(2), *args[9:])
    # the block kernel refuses tensor_scale=True: two-level formats round by quantize_two_level
    bargs = (*ops.op_args(qt.nvfp4.replace(tensor_scale=False))[1][:-1], True)
    with pytest.raises(RuntimeError, match="quantize_two_level"):
        gpu.quantize_block(x, *bargs, 0, 0)
