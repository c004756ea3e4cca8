"""The Triton kernels (qtensor/gpu, the CUDA back end) under Triton's CPU interpreter: bit for bit
against the C++ CPU kernels (themselves held to the reference by test_kernels.py) and the
reference, on the hard cases (specials, ties, subnormals, random bit patterns, partial blocks,
strided views, every preset, custom formats), and a converted model's training step with the
Triton kernels forced on CPU, which must give the CPU kernels' bits. Skipped without triton."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # (conftest.py sets it where there is no GPU)
    pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1",
                allow_module_level=True)

import qtensor as qt  # noqa: E402
from qtensor.tensor import dispatch
from qtensor.kernels import backend
from qtensor.kernels import gpu, ops, reference  # noqa: E402
from qtensor.formats.presets import PRESETS
from qtensor.formats.block import BlockFormat
from qtensor.formats.fixed import FixedFormat
from qtensor.formats.float import FloatFormat  # noqa: E402
# (assert_bits_equal: NaN payloads, where the reference's differ)
from helpers import assert_bits_equal, twos_complement_blocks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:qt.convert. non-floating tensors",
                                        "ignore:invalid value encountered in cast")

ROUNDINGS = ["nearest", "nearest_away", "toward_zero", "stochastic", "stochastic8"]
SEED = 0x9E3779B97F4A7C15  # above 2^63: the op's signed seed, a key >= 2^31 in the kernels


def bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def hard(n, seed=0):
    """n float32s: a wide range of magnitudes (float32 subnormals up to 2^20), random bit
    patterns (NaN payloads, Infs, subnormals), ties of every small grid, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-150, 20, (n,), generator=g).float())
    k = n // 8
    x[:k] = torch.randint(0, 2 ** 32, (k,), generator=g, dtype=torch.int64).to(torch.int32).view(
        torch.float32)
    ties = (torch.randint(-64, 64, (k,), generator=g) + 0.5) * torch.exp2(
        torch.randint(-12, 6, (k,), generator=g).float())
    x[k:2 * k] = ties
    x[-8:] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 448.0, 464.0,
                           -57344.0])
    return x


def call(family, x, args, rounding, seed=SEED):
    return getattr(gpu, family)(x, *args, ops.rounding_code(rounding), ops.seed_arg(seed))


def cpu(family, x, args, rounding, seed=SEED):
    return getattr(torch.ops.qtensor, family)(x, *args, ops.rounding_code(rounding),
                                              ops.seed_arg(seed))


def assert_same(got, want, what):
    d = (bits(got) != bits(want))
    assert not d.any(), f"{what}: {int(d.sum())} differ, e.g. {got[d][:4]} vs {want[d][:4]}"


SCALAR_FLOATS = [n for n, f in PRESETS.items() if isinstance(f, FloatFormat)] + [
    FloatFormat(3, 2, specials="none"), FloatFormat(4, 3, subnormals=False),
    FloatFormat(2, 1, saturate=True), FloatFormat(8, 23, specials="ieee")]


@pytest.mark.parametrize("fmt", SCALAR_FLOATS, ids=str)
def test_float_formats_every_rounding(fmt):
    x = hard(1 << 16)
    f = qt.format(fmt)
    name, args = ops.op_args(f)
    for r in ROUNDINGS:
        assert_same(call(name, x, args, r), cpu(name, x, args, r), f"{f} {r}")
    # and the reference, stochastic included (the same random words on every device)
    y = x[::7]
    got = call(name, y, args, "stochastic")
    if reference.needs_sign_fixup(f):  # (P3109, UE5M3: ops applies it after any device's kernel)
        got = reference.sign_fixup(y, got, f, "stochastic")
    assert_bits_equal(got, reference.quantize_with_seed(y, f, "stochastic", SEED),
                      f"{f} vs reference")


FIXED = [FixedFormat(8, 4), FixedFormat(8, 4, saturate=False),
         FixedFormat(12, 20, signed=False), FixedFormat(6, 2, symmetric=True, saturate=False),
         FixedFormat(24, 140), FixedFormat(16, -10, saturate=False),
         FixedFormat(1, 0, signed=False, saturate=False), FixedFormat(3, 1, signed=False)]


@pytest.mark.parametrize("fmt", FIXED, ids=str)
def test_fixed_formats_saturating_and_wrapping(fmt):
    x = hard(1 << 15, seed=1)
    name, args = ops.op_args(fmt)
    for r in ROUNDINGS:
        assert_same(call(name, x, args, r), cpu(name, x, args, r), f"{fmt} {r}")
    assert_bits_equal(call(name, x, args, "nearest"),
                      reference.quantize_with_seed(x, fmt, "nearest"), f"{fmt} vs reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_strided_views_dtypes_out_and_in_place(dtype):
    base = hard(4 * 8 * 16 * 33, seed=2).reshape(4, 8, 16, 33).to(dtype)
    f = PRESETS["fp8_e4m3"]
    name, args = ops.op_args(f)
    views = [base.transpose(1, 3), base[:, ::2, 1:, ::3], base.permute(3, 1, 0, 2)[..., 1:],
             base.unsqueeze(2).expand(4, 8, 2, 16, 33)[:, 1::3]]  # 5 dims with a 0 stride
    for v in views:
        assert_same(call(name, v, args, "stochastic"), cpu(name, v, args, "stochastic"),
                    f"{dtype} {v.shape} {v.stride()}")
    out = torch.empty(33, 16, 8, 4, dtype=dtype).permute(3, 2, 1, 0)
    x = base.clone()
    assert gpu.quantize_float(x, *args, 3, 5, out=out) is out
    assert_same(out, cpu(name, x, args, "stochastic", 5), "strided out=")
    want = cpu(name, x, args, "nearest_away")
    gpu.quantize_float(x, *args, 1, 0, out=x)
    assert_same(x, want, "in place")


def _block_cases():
    # (two-level formats, nvfp4: quantize_two_level, tests/kernels/test_triton_two_level.py)
    names = [n for n, f in PRESETS.items()
             if isinstance(f, BlockFormat) and f.block_shape is None and f.scale_rule != "4over6"
             and not f.tensor_scale]
    return names


@pytest.mark.parametrize("name", _block_cases())
def test_block_presets_both_axes(name):
    x = hard(128 * 257, seed=3).reshape(128, 257)  # partial blocks at each row's end
    x[3] = torch.randn(257) * 1e-30  # a block of scales below the scale format's range
    x[5, :40] = 3.0  # ties of the scale rules
    for axis, roundings in ((-1, ROUNDINGS), (0, ("nearest", "stochastic"))):
        f = PRESETS[name].replace(axis=axis)
        fam, args = ops.op_args(f)
        for r in roundings:
            assert_same(call(fam, x, args, r), cpu(fam, x, args, r), f"{f} {r}")


FOUR_OVER_SIX = BlockFormat(PRESETS["fp4_e2m1"], 16, scale=PRESETS["fp8_e4m3"],
                            scale_rule="4over6")


def test_4over6_every_rounding_both_axes_strided(monkeypatch):
    x = hard(24 * 129, seed=8).reshape(24, 129)  # partial blocks at each row's end
    x[3] = torch.randn(129) * 1e-30  # scales below E4M3's range
    x[5, :48] = torch.tensor([6.0, 4.0, 3.0, 2.0] * 12) * 2.0 ** torch.arange(-6, 6).repeat(4)
    x[6, :32] = torch.linspace(-5, 5, 32)  # blocks whose errors under both scales are close
    x[7, :16] = torch.tensor([4.0, 2.0, 1.0, 0.0] * 4)  # exact under both: a tie, 6 wins
    for axis, roundings in ((-1, ("nearest", "toward_zero", "stochastic8")),
                            (0, ("nearest_away", "stochastic"))):
        f = FOUR_OVER_SIX.replace(axis=axis)
        fam, args = ops.op_args(f)
        for r in roundings:
            assert_same(call(fam, x, args, r), cpu(fam, x, args, r), f"{f} {r}")
    v = x.t()[:20]  # a strided block axis, with the reference
    f = FOUR_OVER_SIX.replace(axis=0)
    fam, args = ops.op_args(f)
    assert_bits_equal(call(fam, v, args, "nearest"), reference.quantize(v, f), "4over6 ref")
    # qt.quantize on a device the Triton kernels take runs it (the tensor-scaled rule: not yet)
    calls = []
    real = gpu.quantize_block
    monkeypatch.setattr(gpu, "quantize_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(backend, "_CPU_KERNELS", False)
    with gpu.force():
        got = qt.quantize(x, FOUR_OVER_SIX)
    assert calls and gpu.covers(FOUR_OVER_SIX, "nearest")
    assert not gpu.covers(FOUR_OVER_SIX.replace(tensor_scale=True), "nearest")
    assert_same(got, qt.quantize(x, FOUR_OVER_SIX), "forced")


CUSTOM_BLOCKS = [
    BlockFormat(PRESETS["fp6_e2m3"], 24, scale_rule="even"),
    BlockFormat(FixedFormat(8, 6, symmetric=True), None, axis=None),  # block8: the whole tensor
    BlockFormat(FixedFormat(6, 4, signed=False), 7, scale_rule="even"),
    BlockFormat(PRESETS["fp8_e4m3"], 128, scale="fp32", scale_rule="amax"),
    BlockFormat(PRESETS["fp4_e2m1"], 16, scale="bf16", scale_rule="amax"),
    BlockFormat(PRESETS["fp4_e2m1"], 32, scale=PRESETS["fp8_e4m3"], scale_rule="ceil"),
    BlockFormat(PRESETS["fp8_e5m2"], 5, scale_rule="ceil", axis=1),
    BlockFormat(FixedFormat(4, 2, symmetric=True), 3, scale=PRESETS["fp8_e4m3"], scale_rule="amax",
                axis=0),
]


@pytest.mark.parametrize("fmt", CUSTOM_BLOCKS, ids=str)
def test_custom_blocks_every_rule(fmt):
    x = hard(12 * 20 * 37, seed=4).reshape(12, 20, 37)
    x[1] *= 1e-35
    v = x.transpose(0, 2)  # a strided block axis
    fam, args = ops.op_args(fmt)
    for r in ("nearest", "toward_zero", "stochastic", "stochastic4"):
        for t in (x, v):
            assert_same(call(fam, t, args, r), cpu(fam, t, args, r), f"{fmt} {r} {t.stride()}")
    y = x[:, :5]
    assert_bits_equal(call(fam, y, args, "toward_zero"),
                      reference.quantize_with_seed(y, fmt, "toward_zero"), f"{fmt} vs reference")


@pytest.mark.parametrize("elem", [FixedFormat(2, 0), FixedFormat(3, 1), FixedFormat(4, -2)],
                         ids=str)
def test_twos_complement_floor_blocks(elem):
    """The floor rule's exponent with two's-complement elements (a negative power of two counts
    a binade lower): every tuple of codes and points between them in blocks of 2 to 4, every
    rounding mode, along rows and a strided axis, gives the C++ kernels' and the reference's
    bits, and rounding again gives them back."""
    for bs in (2, 3, 4):
        x = twos_complement_blocks(elem, bs, limit=800)
        for t, f in ((x, BlockFormat(elem, bs)), (x.t(), BlockFormat(elem, bs, axis=0))):
            fam, args = ops.op_args(f)
            for r in ROUNDINGS:
                got = call(fam, t, args, r)
                assert_same(got, cpu(fam, t, args, r), f"{f} {r}")
                assert_same(call(fam, got, args, r, SEED + 1), got, f"{f} {r} q(q(x))")
            assert_bits_equal(call(fam, t, args, "stochastic"),
                              reference.quantize_with_seed(t, f, "stochastic", SEED),
                              f"{f} vs reference")


def test_hypothesis_custom_float_and_block_formats():
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies
    x = hard(4096, seed=5).reshape(64, 64)

    @hyp.settings(max_examples=12, deadline=None, derandomize=True)
    @hyp.given(e=st.integers(2, 8), m=st.integers(0, 10), bs=st.integers(1, 70),
               rule=st.sampled_from(["floor", "ceil", "even"]),
               r=st.sampled_from(ROUNDINGS), sub=st.booleans())
    def check(e, m, bs, rule, r, sub):
        elem = FloatFormat(e, m, subnormals=sub, saturate=True)
        assert_same(call("quantize_float", x, ops.op_args(elem)[1], r),
                    cpu("quantize_float", x, ops.op_args(elem)[1], r), f"{elem} {r}")
        try:
            f = BlockFormat(elem, bs, scale_rule=rule, axis=0)
        except qt.formats.FormatError:  # (its range does not fit float32's: no format)
            hyp.assume(False)
        fam, args = ops.op_args(f)
        assert_same(call(fam, x, args, r), cpu(fam, x, args, r), f"{f} {r}")
    check()


# ---------------------------------------------------------------------------------------------
# The Triton kernels as a CUDA device takes them: forced on CPU tensors

@pytest.fixture
def forced(monkeypatch):
    # dispatch's CPU fast paths call the C++ kernels directly: off, so that every rounding goes
    # through qtensor.kernels.ops, which picks the kernels per device
    monkeypatch.setattr(backend, "_CPU_KERNELS", False)
    with gpu.force():
        yield


def test_forced_quantize_takes_the_triton_kernels(forced, monkeypatch):
    x = hard(4096, seed=6).reshape(64, 64)
    calls = []
    real = gpu.quantize_block
    monkeypatch.setattr(gpu, "quantize_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    for f in ("mxfp4_e2m1", "mxfp8_e4m3"):
        got = qt.quantize(x, f)
        with gpu.force(False):
            want = qt.quantize(x, f)
        assert_same(got, want, str(f))
    assert len(calls) == 2
    # the two-level formats (NVFP4's TE rule, 4over6 included) take their own Triton kernel
    # (tests/kernels/test_triton_two_level.py), with the reference's bits
    calls2 = []
    real2 = gpu.quantize_two_level
    monkeypatch.setattr(gpu, "quantize_two_level",
                        lambda *a, **k: calls2.append(1) or real2(*a, **k))
    tiles = PRESETS["nvfp4"].replace(block_shape=(16, 16))
    for f in (PRESETS["nvfp4"].replace(scale_rule="4over6"), PRESETS["nvfp4"], tiles,
              PRESETS["nvfp4"].replace(rounding="stochastic")):
        got = qt.quantize(x, f, generator=torch.Generator().manual_seed(3))
        want = reference.quantize(x, f, generator=torch.Generator().manual_seed(3))
        assert_bits_equal(got, want, str(f))
    assert len(calls) == 2 and len(calls2) == 4


def _train(recipe, seed=0):
    torch.manual_seed(seed)
    model = qt.convert(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)), recipe)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 32, generator=g), torch.randn(24, 16, generator=g)
    for _ in range(2):
        opt.zero_grad()
        out = model(x)
        F.mse_loss(out.dequantize() if isinstance(out, qt.QTensor) else out, y).backward()
        opt.step()
    return [p.dequantize() if isinstance(p, qt.QTensor) else p for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["nvfp4_nvidia", "swalp", "mxfp6"])
def test_training_step_forced_gives_the_cpu_bits(recipe, monkeypatch):
    want = _train(getattr(qt.recipes, recipe))
    calls = []
    for fam in gpu.FAMILIES:
        real = getattr(gpu, fam)
        monkeypatch.setattr(gpu, fam, lambda *a, _r=real, **k: calls.append(1) or _r(*a, **k))
    monkeypatch.setattr(backend, "_CPU_KERNELS", False)
    with gpu.force():
        got = _train(getattr(qt.recipes, recipe))
    assert calls, "the Triton kernels did not run"
    for g, w in zip(got, want):
        assert_same(g, w, recipe)


def test_compiled_forced_matches_eager(forced):
    x = hard(4096, seed=7).reshape(64, 64)

    def f(t):
        return qt.quantize(t, "fp8_e4m3") + qt.quantize(t, "mxfp8_e5m2")
    with gpu.force(False):
        want = f(x)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert_same(got, want, "compiled")
