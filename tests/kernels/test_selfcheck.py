"""The first-use check of the CUDA kernels (qtensor/kernels/selfcheck.py), exercised on the CPU.

No GPU has run the CUDA kernels, so until scripts/gpu_check.sh passes, each kernel family is
compared with the reference on its first use on a CUDA device; a family that disagrees uses the
reference, with one warning. Here the CPU plays the checked device (``CHECKED_DEVICES``) and a
wrong kernel is injected in place of the compiled op: the user must get the reference's bits and
exactly one warning per family; a right kernel must be kept, silently.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import qtensor as qt
from qtensor import accum
from qtensor.kernels import ops, reference, selfcheck

from helpers import assert_bits_equal

pytestmark = pytest.mark.skipif(not ops.kernels_available("cpu"),
                                reason="qtensor._C not built (pip install --no-build-isolation -e .)")


class _Packet:
    """Stands in for torch.ops.qtensor.<op>: calls the real op and spoils (or counts) its result."""

    def __init__(self, real, spoil=None, when=lambda args: True):
        self.real, self.spoil, self.when, self.calls = real, spoil, when, 0

    def _result(self, r, args):
        self.calls += 1
        if self.spoil is not None and self.when(args):
            return self.spoil(r)
        return r

    def __call__(self, x, *args):
        return self._result(self.real(x, *args), args)

    def out(self, x, *args, out):
        out.copy_(self(x, *args))
        return out

    @property
    def default(self):
        return self


def _one_ulp_up(t):
    return torch.nextafter(t, torch.full_like(t, math.inf))


def _raise(t):
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


@pytest.fixture
def cpu_checked(monkeypatch):
    """The CPU as a device whose kernels are checked on first use; fresh verdicts."""
    monkeypatch.setattr(selfcheck, "CHECKED_DEVICES", frozenset({"cpu"}))
    monkeypatch.delenv(selfcheck.ENV, raising=False)
    selfcheck.reset()
    yield
    selfcheck.reset()


def _inject(monkeypatch, op, spoil=None, when=lambda args: True):
    packet = _Packet(getattr(torch.ops.qtensor, op), spoil, when)
    monkeypatch.setattr(torch.ops.qtensor, op, packet)
    return packet


def _user_input():
    return torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 10


def _caught(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(m.message) for m in w if "do not agree with the reference" in
                    str(m.message)]


@pytest.mark.parametrize("family,op,fmt,rounding", [
    ("scalar", "quantize_float", "fp8_e4m3", "nearest"),
    ("scalar", "quantize_fixed", "fixed8.4", "toward_zero"),
    ("block", "quantize_block", "mxfp4_e2m1", "nearest"),
    ("block", "quantize_block", "nvfp4_single", "nearest_away"),
    ("stochastic", "quantize_float", "bf16", "stochastic"),
    ("stochastic", "quantize_block", "mxfp6_e3m2", "stochastic"),
])
def test_a_wrong_kernel_is_replaced_by_the_reference(cpu_checked, monkeypatch, family, op, fmt,
                                                     rounding):
    stochastic = family == "stochastic"
    wrong = _inject(monkeypatch, op, _one_ulp_up,
                    when=lambda args: (args[-2] == 3) == stochastic)  # args[-2]: the rounding code
    x = _user_input()
    torch.manual_seed(0)
    q, warned = _caught(lambda: qt.quantize(x, fmt, rounding=rounding))
    torch.manual_seed(0)
    assert_bits_equal(q, reference.quantize(x, fmt, rounding=rounding), f"{fmt} {rounding}")
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"qtensor: the {family} kernels do not agree with the reference "
                                "on cpu")
    for part in ("qtensor now uses the pure-PyTorch reference for every", "the results are right",
                 "Please report it as an issue of the qtensor project", "nvidia-smi",
                 "scripts/gpu_check.sh", "QTENSOR_KERNEL_CHECK=0"):
        assert part in warned[0], part
    assert selfcheck.verdicts() == {("cpu", family): False}
    # from then on: the reference, no second warning, in place and out= too
    calls = wrong.calls
    q2, warned2 = _caught(lambda: qt.quantize(x, fmt, rounding="nearest" if stochastic else None))
    y = x.clone()
    out = torch.empty_like(x)
    _, warned3 = _caught(lambda: (qt.quantize_(y, fmt, rounding=rounding),
                                  qt.quantize(x, fmt, rounding=rounding, out=out)))
    assert warned2 == [] and warned3 == []
    if not stochastic:
        assert_bits_equal(y, reference.quantize(x, fmt, rounding=rounding), "in place")
        assert_bits_equal(out, reference.quantize(x, fmt, rounding=rounding), "out=")
        assert wrong.calls == calls  # the wrong kernel is not run again
    # the other families keep their (right) kernels: deterministic rounding on the same op too
    if family == "scalar":
        op2, fmt2 = "quantize_block", "mxfp8_e4m3"
    elif family == "block":
        op2, fmt2 = "quantize_float", "fp8_e5m2"
    else:
        op2, fmt2 = op, {"quantize_float": "fp8_e5m2", "quantize_block": "mxfp8_e4m3"}[op]
    other = wrong if op2 == op else _inject(monkeypatch, op2)
    calls = other.calls
    q3, warned4 = _caught(lambda: qt.quantize(x, fmt2))
    assert warned4 == [] and other.calls > calls
    assert_bits_equal(q3, reference.quantize(x, fmt2), fmt2)


def test_a_right_kernel_is_kept_silently(cpu_checked, monkeypatch):
    packets = {op: _inject(monkeypatch, op) for op in ("quantize_float", "quantize_block")}
    x = _user_input()
    (a, b), warned = _caught(lambda: (qt.quantize(x, "fp8_e4m3"), qt.quantize(x, "mxfp4_e2m1")))
    assert warned == []
    assert selfcheck.verdicts() == {("cpu", "scalar"): True, ("cpu", "block"): True}
    n = {op: p.calls for op, p in packets.items()}
    qt.quantize(x, "fp8_e4m3")
    assert packets["quantize_float"].calls == n["quantize_float"] + 1  # the kernel does the work
    assert_bits_equal(a, reference.quantize(x, "fp8_e4m3"))
    assert_bits_equal(b, reference.quantize(x, "mxfp4_e2m1"))


@pytest.mark.parametrize("fmt", [qt.nvfp4, qt.nvfp4.replace(scale_rule="4over6")], ids=str)
def test_a_wrong_two_level_kernel_is_replaced(cpu_checked, monkeypatch, fmt):
    wrong = _inject(monkeypatch, "quantize_two_level", lambda r: (_one_ulp_up(r[0]), *r[1:]))
    x = _user_input()
    q, warned = _caught(lambda: qt.quantize(x, fmt))
    assert_bits_equal(q, reference.quantize(x, fmt), str(fmt))
    assert len(warned) == 1 and warned[0].startswith(
        "qtensor: the two_level kernels do not agree with the reference on cpu")
    # (the reference then rounds with the scalar kernels: their family is checked too)
    assert selfcheck.verdicts()[("cpu", "two_level")] is False
    calls = wrong.calls
    y = x.clone()
    (q2, _), warned2 = _caught(lambda: (qt.quantize(x, fmt, rounding="stochastic"),
                                        qt.quantize_(y, fmt)))
    assert warned2 == [] and wrong.calls == calls  # the wrong kernel is not run again
    assert_bits_equal(y, reference.quantize(x, fmt), "in place")


def test_a_right_two_level_kernel_is_kept_silently(cpu_checked, monkeypatch):
    packet = _inject(monkeypatch, "quantize_two_level")
    x = _user_input()
    q, warned = _caught(lambda: qt.quantize(x, "nvfp4"))
    assert warned == [] and selfcheck.verdicts() == {("cpu", "two_level"): True}
    n = packet.calls
    qt.quantize(x, "nvfp4")
    assert packet.calls == n + 1  # the kernel does the work
    assert_bits_equal(q, reference.quantize(x, "nvfp4"))


def test_a_kernel_that_raises_is_replaced(cpu_checked, monkeypatch):
    _inject(monkeypatch, "quantize_block", _raise)
    x = _user_input()
    q, warned = _caught(lambda: qt.quantize(x, "mxfp8_e4m3"))
    assert_bits_equal(q, reference.quantize(x, "mxfp8_e4m3"))
    assert len(warned) == 1 and "the kernel raised RuntimeError: CUDA error: no kernel image" in \
        warned[0]


def test_a_wrong_accumulator_kernel_is_replaced(cpu_checked, monkeypatch):
    _inject(monkeypatch, "accum_matmul", _one_ulp_up)
    g = torch.Generator().manual_seed(1)
    a = qt.quantize(torch.randn(3, 8, 160, generator=g), "fp8_e4m3")
    b = qt.quantize(torch.randn(3, 160, 5, generator=g), "fp8_e4m3")
    got, warned = _caught(lambda: accum.accum_matmul(a, b, accum.hopper_fp8))
    assert_bits_equal(got, accum.accum_matmul_reference(a, b, accum.hopper_fp8), "accum")
    assert len(warned) == 1 and warned[0].startswith("qtensor: the accumulator kernels do not")
    # a contraction of QTensors with an accumulator format goes the same way, silently now
    qa = qt.as_qtensor(a[0], "fp32")
    qa.accum = accum.hopper_fp8
    y, warned2 = _caught(lambda: qa @ qt.as_qtensor(b[0], "fp32"))
    assert warned2 == []
    assert_bits_equal(y.dequantize(), accum.accum_matmul_reference(a[0], b[0], accum.hopper_fp8),
                      "QTensor matmul")


def test_a_wrong_kernel_under_torch_compile(cpu_checked, monkeypatch):
    """The check runs while tracing (real tensors, not fakes), and the graph takes the
    reference: a compiled function gives the reference's bits, with the one warning."""
    _inject(monkeypatch, "quantize_float", _one_ulp_up)
    torch._dynamo.reset()
    x = _user_input()
    f = torch.compile(lambda t: qt.quantize(t * 2, "fp8_e4m3") + 1, backend="aot_eager",
                      fullgraph=True)
    got, warned = _caught(lambda: f(x))
    torch._dynamo.reset()
    assert_bits_equal(got, reference.quantize(x * 2, "fp8_e4m3") + 1, "compiled")
    assert len(warned) == 1


def test_under_fake_tensors_the_check_runs_on_real_tensors(cpu_checked, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    wrong = _inject(monkeypatch, "quantize_float", _one_ulp_up)
    with FakeTensorMode() as mode:
        xf = mode.from_tensor(_user_input())
        q, warned = _caught(lambda: qt.quantize(xf, "fp8_e4m3"))
    assert q.shape == xf.shape and len(warned) == 1 and wrong.calls >= 1


def test_no_check_on_unchecked_devices_or_when_verified(monkeypatch):
    selfcheck.reset()
    wrong = _inject(monkeypatch, "quantize_float", _one_ulp_up)
    x = _user_input()
    assert "cpu" not in selfcheck.CHECKED_DEVICES  # the CPU kernels are tested on every change
    q = qt.quantize(x, "fp8_e4m3")
    assert selfcheck.verdicts() == {} and wrong.calls == 1
    assert not torch.equal(q, reference.quantize(x, "fp8_e4m3"))  # the injected kernel ran
    monkeypatch.setattr(selfcheck, "CHECKED_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(selfcheck, "GPU_VERIFIED", True)
    qt.quantize(x, "fp8_e4m3")
    monkeypatch.setattr(selfcheck, "GPU_VERIFIED", False)
    monkeypatch.setenv(selfcheck.ENV, "0")
    qt.quantize(x, "fp8_e4m3")
    assert selfcheck.verdicts() == {} and wrong.calls == 3


def test_the_check_leaves_the_users_random_stream_alone(cpu_checked):
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    for fmt, mode in (("fp8_e4m3", None), ("mxfp4_e2m1", None), ("bf16", "stochastic")):
        qt.quantize(torch.ones(4), fmt, rounding=mode)
    torch.manual_seed(5)
    qt.quantize(torch.ones(4), "fp8_e4m3")
    assert torch.equal(torch.rand(3), want)
    assert set(selfcheck.verdicts().values()) == {True}


@pytest.mark.parametrize("family", ["scalar", "block", "stochastic", "two_level", "accumulator"])
def test_every_sample_agrees_on_the_cpu_kernels(family):
    """The samples themselves: the real CPU kernels pass them (a check that fails on right
    kernels would push every GPU user onto the reference)."""
    assert selfcheck._checks[family](torch.device("cpu")) is None


def test_the_reference_keeps_to_the_device_of_its_input():
    """The fallback must run on CUDA: on meta tensors (no GPU needed), a CPU tensor that the
    reference made would meet a meta one and raise a device mismatch, as on CUDA (both take
    0-dim CPU tensors); a .item() would fail too (a device sync on CUDA; the amax rule's
    idempotent scale takes one per settling step, and none on meta)."""
    fmts = ([qt.PRESETS[n] for n in qt.PRESETS] + [qt.format("fixed8.4(saturate=False)")]
            + [qt.BlockFormat(qt.fp8_e4m3, 16, axis=0), qt.BlockFormat(qt.fp4_e2m1, None, axis=None),
               qt.BlockFormat(qt.fp4_e2m1, 16, scale=qt.fp8_e4m3, scale_rule="amax",
                              tensor_scale=True)])
    with pytest.raises(RuntimeError, match="device"):  # the probe works
        torch.empty(3, device="meta") + torch.ones(3)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = torch.empty(6, 32, device="meta", dtype=dtype)
        for fmt in fmts:
            for mode in ("nearest", "stochastic"):
                q = reference.quantize_with_seed(x, fmt, mode, seed=7)
                assert q.device.type == "meta" and q.dtype == dtype and q.shape == x.shape
    a = torch.empty(2, 3, 70, device="meta")
    b = torch.empty(2, 70, 4, device="meta")
    for f in accum.PRESETS.values():
        assert accum.accum_matmul_reference(a, b, f).device.type == "meta"


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ops.kernels_available("cuda")),
                          reason="needs a GPU and the CUDA kernels")


@cuda
def test_cuda_kernels_pass_their_first_use_check(monkeypatch):
    """On a GPU (scripts/gpu_check.sh): every family's check passes, so no user is sent to the
    reference. Run with the check on, whatever the environment says."""
    monkeypatch.delenv(selfcheck.ENV, raising=False)
    monkeypatch.setattr(selfcheck, "GPU_VERIFIED", False)
    selfcheck.reset()
    for family in selfcheck.FAMILIES:
        assert selfcheck._checks[family](torch.device("cuda")) is None, family
    x = torch.randn(64, 64, device="cuda")
    qt.quantize(x, "fp8_e4m3"), qt.quantize(x, "nvfp4_single"), qt.quantize(x, "bf16", rounding="stochastic")
    qt.quantize(x, "nvfp4")
    accum.accum_matmul(x, x, accum.hopper_fp8)
    assert selfcheck.verdicts() == {("cuda", f): True for f in selfcheck.FAMILIES}
    selfcheck.reset()
