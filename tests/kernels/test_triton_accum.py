"""The Triton kernel of qt.accum's fused datapath (qtensor/kernels/gpu/accum.py, the CUDA back end of
qt.accum.accum_matmul) under Triton's CPU interpreter: bit for bit against the C++ kernel
(qtensor::accum_matmul, itself held to the reference and an exact oracle by test_accum.py) and
the reference, on the hard cases (cancellation, signed zeros, subnormal products, Inf/NaN, short
last chunks, exponent spread, e_zero), every fused preset and custom datapaths, group exponents,
per-element clamps, an initial accumulator, batches and strided operands; and qt.accum with the
Triton kernel forced on CPU, as a CUDA device takes it. Sizes are small: the interpreter costs
~50 ms per chunk of K. Skipped without triton."""
import os

import pytest
import torch
from torch import nn

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # (conftest.py sets it where there is no GPU)
    pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1",
                allow_module_level=True)

import qtensor as qt  # noqa: E402
from qtensor import accum
from qtensor.accum import kernel as accum_kernel
from qtensor.accum import reference as accum_reference
from qtensor.tensor import dispatch
from qtensor.kernels import backend
from qtensor.kernels import gpu  # noqa: E402
from qtensor.accum.format import AccumFormat  # noqa: E402

from helpers import one_sgd_step  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::qtensor.accum.OperandFormatWarning",
                                        "ignore:invalid value encountered",
                                        "ignore:overflow encountered")

CUSTOM = [
    AccumFormat(chunk=4, frac_bits=10, align_rounding="floor"),
    AccumFormat(chunk=8, frac_bits=12, align_rounding="nearest", acc_rounding="nearest"),
    AccumFormat(chunk=8, frac_bits=16, acc_in_alignment=False, acc_man=10, promote=2),
    AccumFormat(chunk=6, frac_bits=20, promote=1, e_zero=-20),  # a chunk of no power of two
    AccumFormat(chunk=12, frac_bits=20, group=4, promote=1),    # 3 groups
    AccumFormat(chunk=2, frac_bits=3, acc_man=5, promote=3, acc_emin=-14, acc_emax=15),
]
FUSED = [p for p in accum.PRESETS.values() if p.stages == "fused"] + CUSTOM


def bits(t):
    return t.contiguous().view(torch.int32)


def hard(g, M, K, N):
    """a (M, K), b (K, N) whose rows x columns are the hard cases: bf16 values, +-pairs that
    cancel exactly beside tiny terms, float32 subnormals (products below float32's range),
    exponents spread over float32's range, zeros of both signs, a row with an inf and one with
    a NaN, a column with an inf, huge values whose chunk sums overflow the accumulator."""
    a = qt.quantize(torch.randn(M, K, generator=g), "bf16")
    b = qt.quantize(torch.randn(K, N, generator=g), "bf16")
    big = 2.0 ** torch.randint(8, 24, (K // 2,), generator=g).float()
    a[1, 0:K - K % 2:2], a[1, 1:K - K % 2:2] = big, -big  # cancelling pairs ...
    b[1:K - K % 2:2, 1] = b[0:K - K % 2:2, 1]
    a[1, ::5] *= 2.0 ** -20  # ... beside tiny terms
    a[2] = torch.randn(K, generator=g) * 2.0 ** torch.randint(-150, -120, (K,), generator=g)
    a[3] = a[3] * 2.0 ** torch.randint(-100, 60, (K,), generator=g).float()
    a[4] = torch.where(torch.rand(K, generator=g) < 0.5, 0.0, -0.0)
    a[5, K // 3] = float("inf")
    a[6, K - 1] = float("nan")
    a[7] = 3.0e38
    b[:, 2] = torch.where(torch.rand(K, generator=g) < 0.3, -0.0, b[:, 2])
    b[K // 2, 3] = -float("inf")
    b[:, 4] = b[:, 4] * 2.0 ** -140  # subnormal products with the -126 clamps
    b[:, 5] = b[:, 5].abs()
    return a, b


def cpu_kernel(a3, b3, args, *extra):
    extra = extra + (None,) * (5 - len(extra))
    return torch.ops.qtensor.accum_matmul(a3, b3, *args, *extra)


def triton_kernel(a3, b3, args, *extra):
    extra = extra + (None,) * (5 - len(extra))
    return gpu.accum_matmul(a3, b3, *args, *extra)


def assert_same(got, want, what):
    d = bits(got) != bits(want)
    assert not d.any(), f"{what}: {int(d.sum())} differ, e.g. {got[d][:4]} vs {want[d][:4]}"


@pytest.mark.parametrize("f", FUSED, ids=str)
def test_every_fused_datapath_on_the_hard_cases(f):
    g = torch.Generator().manual_seed(f.chunk * 131 + f.frac_bits)
    K = 2 * f.chunk + f.chunk // 2 + 1  # two whole chunks and a short last one
    a, b = hard(g, 8, K, 6)
    args = accum_kernel.op_args(f)
    got = triton_kernel(a[None], b[None], args)
    assert_same(got, cpu_kernel(a[None], b[None], args), f"{f} vs the C++ kernel")
    assert_same(got[0], accum_reference._reference(a, b, f), f"{f} vs the reference")
    # fp8 operands with their formats' clamps (e4m3: -6), where subnormal elements bind
    a8, b8 = qt.quantize(a * 2.0 ** -4, "fp8_e4m3"), qt.quantize(b, "fp8_e5m2")
    args = accum_kernel.op_args(f, -6, -14)
    assert_same(triton_kernel(a8[None], b8[None], args), cpu_kernel(a8[None], b8[None], args),
                f"{f} fp8 clamps")


def test_group_exponents_clamps_initial_accumulator_batches_and_strides():
    g = torch.Generator().manual_seed(5)
    f = accum.blackwell_nvfp4
    B, M, K, N = 2, 5, 80, 3  # a short last chunk of one whole group and a partial one
    G = -(-K // f.group)
    a = qt.quantize(torch.randn(B, M, K, generator=g), "fp4_e2m1")
    b = qt.quantize(torch.randn(B, N, K, generator=g), "fp4_e2m1").transpose(1, 2)  # strided
    a[0, 1, :16] = 0.0  # an all-zero group: e_zero, with or without group exponents
    a[1, 2, 20] = float("inf")
    ga = torch.randint(-30, 10, (B, M, G), generator=g)
    gb = torch.randint(-30, 10, (B, G, N), generator=g)
    c = torch.randn(B, M, N, generator=g) * 2.0 ** 20
    c[0, 0, 0], c[1, 0, 1], c[0, 3, 2] = 0.0, -0.0, float("nan")
    args = accum_kernel.op_args(f)
    for extra in [(), (ga, gb), (ga, gb, c), (None, None, c)]:
        assert_same(triton_kernel(a, b, args, *extra), cpu_kernel(a, b, args, *extra),
                    f"groups {len(extra)}")
    # per-element clamps (MX operands: the element's emin plus its block's scale exponent), an
    # initial accumulator and a batch broadcast by a stride-0 operand
    f = accum.blackwell_mxf8f6f4
    a = qt.quantize(torch.randn(B, M, 70, generator=g) * 2.0 ** -8, "fp8_e4m3")
    b = qt.quantize(torch.randn(1, 70, N, generator=g), "fp8_e4m3").expand(B, 70, N)
    ea = torch.randint(-12, 0, (B, M, 70), generator=g)
    eb = torch.randint(-8, 2, (B, 70, N), generator=g)
    args = accum_kernel.op_args(f, -1000, -1000)
    for extra in [(None, None, None, ea, eb), (None, None, c, ea, None)]:
        assert_same(triton_kernel(a, b, args, *extra), cpu_kernel(a, b, args, *extra),
                    "clamps")
    # the empty K: c (or 0) unchanged; a datapath without promotion
    e = torch.zeros(B, M, 0)
    for pf in (accum.hopper_fp8, accum.hopper_fp8_fast):
        assert_same(triton_kernel(e, e.transpose(1, 2)[:, :, :N].reshape(B, 0, N),
                                  accum_kernel.op_args(pf), None, None, c),
                    torch.where(torch.isnan(c), float("nan"), c), "K = 0")


# ---------------------------------------------------------------------------------------------
# qt.accum with the Triton kernel forced on CPU, as on a CUDA device

@pytest.fixture
def calls(monkeypatch):
    from qtensor.kernels.gpu import accum as gpu_accum
    seen = []
    real = gpu_accum.accum_matmul
    monkeypatch.setattr(gpu_accum, "accum_matmul",
                        lambda *a, **k: seen.append(1) or real(*a, **k))
    monkeypatch.setattr(backend, "_CPU_KERNELS", False)
    return seen


def test_forced_accum_matmul_takes_the_triton_kernel(calls):
    g = torch.Generator().manual_seed(7)
    a = qt.quantize(torch.randn(3, 6, 96, generator=g), "fp8_e4m3")
    b = qt.quantize(torch.randn(96, 5, generator=g), "fp8_e4m3")
    c = torch.randn(3, 6, 5, generator=g)
    cases = [dict(accum="hopper_fp8", a_fmt="fp8_e4m3", b_fmt="fp8_e4m3"),
             dict(accum="hopper_bf16", c=c),
             dict(accum="ada_fp8", a_emin=-6, b_emin=-6)]
    for kw in cases:
        want = accum.accum_matmul(a, b, **kw)
        with gpu.force():
            got = accum.accum_matmul(a, b, **kw)
        assert_same(got, want, str(kw))
    assert len(calls) == len(cases)
    # block-scaled operands: the group exponents recovered from MXFP4 values
    x = qt.quantize(torch.randn(4, 64, generator=g), "mxfp4_e2m1")
    y = qt.quantize(torch.randn(5, 64, generator=g), "mxfp4_e2m1").t()
    kw = dict(a_fmt="mxfp4_e2m1", b_fmt=qt.formats.PRESETS["mxfp4_e2m1"].replace(axis=0))
    want = accum.accum_matmul(x, y, "blackwell_mxfp4", **kw)
    with gpu.force():
        got = accum.accum_matmul(x, y, "blackwell_mxfp4", **kw)
    assert_same(got, want, "mxfp4 groups")
    assert len(calls) == len(cases) + 1
    # CDNA3's two stages have no Triton kernel: the reference, as on CUDA
    with gpu.force():
        got = accum.accum_matmul(a[0], b, "cdna3_fp8")
    assert_same(got, accum.accum_matmul_reference(a[0], b, "cdna3_fp8"), "cdna3")
    assert len(calls) == len(cases) + 1


def _train(seed=0):
    torch.manual_seed(seed)
    recipe = qt.Recipe(weight=("bf16", "fp8_e4m3"), activation=("bf16", "fp8_e4m3"),
                       grad=("bf16", "fp8_e5m2"), accumulate=accum.hopper_fp8)
    model = qt.convert(nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 8)), recipe)
    return one_sgd_step(model, 40, 8, lr=1e-2)


def test_training_step_with_the_accumulator_forced_gives_the_cpu_bits(calls):
    want = _train()
    with gpu.force():
        got = _train()
    assert len(calls) >= 3, "forward, grad_input and grad_weight contractions"
    for x, y in zip(got, want):
        assert_same(x.detach(), y.detach(), "training step")


def test_compiled_forced_accum_matches_eager(calls):
    g = torch.Generator().manual_seed(9)
    a = qt.quantize(torch.randn(6, 64, generator=g), "bf16")
    b = qt.quantize(torch.randn(64, 4, generator=g), "bf16")

    def fn(x, y):
        return accum.accum_matmul(x, y, accum.hopper_bf16) * 2
    want = fn(a, b)
    with gpu.force():
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(a, b)
    assert calls
    assert_same(got, want, "compiled")


def test_forced_first_use_check_runs_the_triton_kernel(calls, monkeypatch):
    # the accumulator's check compares the device's kernel (here the Triton one) with the
    # reference; a wrong kernel is found
    from qtensor.kernels.gpu import accum as gpu_accum
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 5, 8, generator=g), torch.randn(2, 8, 3, generator=g)
    with gpu.force():
        got = qt.kernels.ops.kernel_ops(x).accum_matmul(x, y, *accum_kernel.op_args(accum.volta_fp16),
                                                None, None, None, None, None)
    assert calls
    assert_same(got, accum_reference._reference(x, y, accum.volta_fp16), "kernel_ops")
    monkeypatch.setattr(gpu_accum, "accum_matmul", lambda a, b, *r: torch.zeros(
        a.shape[0], a.shape[1], b.shape[2]))
    monkeypatch.setattr(accum_kernel, "PRESETS", {"volta_fp16": accum.volta_fp16})
    with gpu.force():
        assert "accumulator volta_fp16" in accum_kernel._sample_check(torch.device("cpu"))
