"""Shared test helpers: bit-exact comparison.

Import from here (``from helpers import assert_bits_equal``) rather than redefining; keep it
small. Fixtures live in conftest.py, the exact format oracles in oracles.py.
"""
from __future__ import annotations

import torch

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a floating tensor as a same-width integer tensor (contiguous copy)."""
    return t.detach().contiguous().view(_INT_VIEW[t.dtype])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "",
                      inputs: torch.Tensor | None = None) -> None:
    """Equal shape, dtype and bits; NaN matches NaN by position (any payload, any sign).

    On failure, reports the number of mismatches and the first few (with ``inputs`` when given).
    """
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{msg} dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    bad = (a_nan != e_nan) | (~a_nan & ~e_nan & (as_bits(a) != as_bits(e)))
    if bool(bad.any()):
        where = bad.nonzero().reshape(-1)[:8].tolist()
        x = inputs.detach().cpu().reshape(-1) if inputs is not None else None
        rows = [f"  [{i}]" + (f" x={x[i].item()!r}" if x is not None else "")
                + f" got={a[i].item()!r} expected={e[i].item()!r}" for i in where]
        raise AssertionError(f"{msg}: {int(bad.sum())} of {a.numel()} values differ in bits\n"
                             + "\n".join(rows))


def assert_passes_under_isa(test_file: str, isa: str, selection: str) -> None:
    """The tests of test_file matching ``-k selection`` pass in a subprocess under
    QTENSOR_CPU_ISA=isa (the baseline or AVX2 copies of the CPU loops; the test process itself
    takes the best the CPU has), run from the repository root."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.abspath(test_file), "-k", selection],
                       env=dict(os.environ, QTENSOR_CPU_ISA=isa), cwd=root,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def two_level_formats() -> dict:
    """The two-level formats (tensor_scale=True) the two-level kernels are held to the reference
    on: every scale rule and option, element kind and blocking the kernels distinguish."""
    import qtensor as qt
    e4m3 = "fp8_e4m3"
    return {
        "nvfp4": qt.nvfp4,
        "4over6": qt.BlockFormat("fp4_e2m1", 16, scale=e4m3, scale_rule="4over6",
                                 tensor_scale=True),
        "ceil": qt.BlockFormat("fp4_e2m1", 16, scale=e4m3, scale_rule="ceil", tensor_scale=True),
        "ue5m3": qt.BlockFormat("fp4_e2m1", 16, scale="ue5m3", scale_rule="amax",
                                tensor_scale=True),
        "settle": qt.nvfp4.replace(settle=True),
        "4over6_settle": qt.BlockFormat("fp4_e2m1", 16, scale=e4m3, scale_rule="4over6",
                                        tensor_scale=True, settle=True),
        "fp6_elems": qt.BlockFormat("fp6_e2m3", 16, scale=e4m3, scale_rule="amax",
                                    tensor_scale=True),
        "fixed_elems": qt.BlockFormat(qt.FixedFormat(4, 0, symmetric=True), 16, scale=e4m3,
                                      scale_rule="amax", tensor_scale=True),
        "fixed_ceil_settle": qt.BlockFormat(qt.FixedFormat(6, 2, symmetric=True), 8, scale=e4m3,
                                            scale_rule="ceil", tensor_scale=True, settle=True),
        "axis0": qt.nvfp4.replace(axis=0),
        "axis_none": qt.nvfp4.replace(axis=None, block_size=None),
        "tiles": qt.nvfp4.replace(block_shape=(4, 8)),
        "tiles_axis0": qt.nvfp4.replace(block_shape=(4, 8), axis=-2),
    }


def two_level_op_args(x, fmt, **kw):
    """The arguments after x that backend.two_level(x, fmt, **kw) passes to
    qtensor::quantize_two_level (the call is made, and its arguments recorded), or None where it
    calls no op (no kernel takes x: the reference rounds it)."""
    from unittest import mock

    from qtensor.kernels import backend
    calls = []

    def op(x, *args):
        calls.append(args)
        return torch.ops.qtensor.quantize_two_level(x, *args)
    def kernel_ops(t):  # (the reference's scalar roundings call the other ops)
        real = kernel_ops.real(t)
        return type("Ops", (), {"quantize_two_level": staticmethod(op),
                                "__getattr__": lambda self, name: getattr(real, name)})()
    kernel_ops.real = backend.kernel_ops
    with mock.patch.object(backend, "kernel_ops", kernel_ops):
        backend.two_level(x, fmt, checked=False, **kw)
    assert len(calls) <= 1, f"{fmt}: backend.two_level called the kernel {len(calls)} times"
    return calls[0] if calls else None


def count_calls(monkeypatch, owner, name: str) -> list:
    """owner.name (a function) patched to append to the returned list on each call."""
    calls = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def two_level_inputs(more: bool = False) -> dict:
    """Inputs of two-level (NVFP4) rounding by name: normal, heavy-tailed, tiny, subnormal, huge,
    near FLT_MAX, zero, wide-exponent, partial-block and one-hot-block values; ``more``: also
    -0.0, a 3D tensor, Inf/NaN among finite values and all NaN."""
    g = torch.Generator().manual_seed(0)
    out = {
        "normal": torch.randn(8, 64, generator=g),
        # heavy tails: a normal divided by |normal|^3 (a few huge values per tensor)
        "heavy": torch.randn(8, 64, generator=g) / torch.randn(8, 64, generator=g).abs().pow(3),
        "tiny": torch.randn(8, 64, generator=g) * 1e-30,
        "subnormal": torch.randn(8, 64, generator=g) * 1e-41,
        "huge": torch.randn(8, 64, generator=g) * 1e37,
        "max": torch.full((2, 32), 3.4e38) * torch.sign(torch.randn(2, 32, generator=g)),
        "zeros": torch.zeros(2, 32),
        "wide": torch.randn(8, 64, generator=g) * torch.exp2(torch.randint(-60, 60, (8, 64),
                                                                         generator=g).float()),
        "partial": torch.randn(5, 23, generator=g),
    }
    if more:
        out["neg_zeros"] = -torch.zeros(3, 16)
        out["3d"] = torch.randn(3, 6, 20, generator=g)
    out["one_block_hot"] = out["normal"].clone()
    out["one_block_hot"][0, :16] *= 1e6  # all other blocks far below: subnormal E4M3 scales
    if more:
        bad = out["normal"].clone()
        bad[1, 3], bad[2, 40], bad[5, 17] = float("inf"), float("nan"), -float("inf")
        out["nonfinite"] = bad
        out["all_nan"] = torch.full((2, 16), float("nan"))
    return out


def two_level_caller_wants(x):
    """The reference's NVFP4 roundings of x that the callers' checks compare with: {rounding:
    values} (seed 9) and the stochastic rounding of x.t(); computed before a test refuses the
    reference."""
    import qtensor as qt
    from qtensor.kernels import reference
    want = {r: reference.quantize(x, qt.nvfp4, rounding=r,
                                  generator=torch.Generator().manual_seed(9))
            for r in ("nearest", "stochastic")}
    want_t = reference.quantize(x.t(), qt.nvfp4, rounding="stochastic",
                                generator=torch.Generator().manual_seed(9))
    return want, want_t


def check_two_level_callers(x, want, want_t):
    """qt.quantize (and out=), qt.quantize_, a transposed input (random words by the element's
    index in x.t()) and a QTensor's rounding give ``two_level_caller_wants``' bits."""
    import qtensor as qt

    def bits(t):
        return t.detach().float().contiguous().view(torch.int32)
    for r, w in want.items():
        gen = torch.Generator().manual_seed(9)
        assert torch.equal(bits(qt.quantize(x, qt.nvfp4, rounding=r, generator=gen)), bits(w))
        out = torch.empty_like(x)
        qt.quantize(x, qt.nvfp4, rounding=r, generator=torch.Generator().manual_seed(9), out=out)
        assert torch.equal(bits(out), bits(w))
        y = x.clone()
        qt.quantize_(y, qt.nvfp4, rounding=r, generator=torch.Generator().manual_seed(9))
        assert torch.equal(bits(y), bits(w))
    got_t = qt.quantize(x.t(), qt.nvfp4, rounding="stochastic",
                        generator=torch.Generator().manual_seed(9))
    assert torch.equal(bits(got_t), bits(want_t))
    qx = qt.as_qtensor(x, qt.nvfp4)
    assert torch.equal(bits(qx.dequantize()), bits(want["nearest"]))


def twos_complement_blocks(elem, bs: int, limit: int = 6000, seed: int = 0) -> torch.Tensor:
    """Blocks of bs (a [n, bs] float32 tensor) of a signed two's-complement FixedFormat elem:
    every bs-tuple (at most ``limit`` of them, drawn at random past that) of its codes and the
    points between neighbouring codes (quarters, ties), each tuple at the scales 2^-3, 1 and
    2^40, and 2^-146 (float32 subnormals: scales clamped to the smallest)."""
    kmin, kmax = -(2 ** (elem.wl - 1)), 2 ** (elem.wl - 1) - 1
    steps = torch.arange(4 * kmin, 4 * kmax + 1, dtype=torch.float64) / 4
    values = steps * 2.0 ** -elem.fl
    n = values.numel() ** bs
    if n <= limit:
        idx = torch.cartesian_prod(*[torch.arange(values.numel())] * bs).reshape(n, bs)
    else:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, values.numel(), (limit, bs), generator=g)
    rows = values[idx]
    return torch.cat([rows * 2.0 ** s for s in (-3, 0, 40, -146)]).float()


def one_sgd_step(model, n_in: int, n_out: int, **sgd) -> list:
    """The values of a converted ``model``'s parameters after one SGD step (``sgd``: its
    options) of the MSE against random targets, on a fixed batch of 16 ``n_in`` inputs."""
    import torch.nn.functional as F

    import qtensor as qt  # (here: the Triton tests set their environment before importing it)
    plain = lambda t: t.dequantize() if isinstance(t, qt.QTensor) else t  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), **sgd)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, n_in, generator=g), torch.randn(16, n_out, generator=g)
    opt.zero_grad()
    F.mse_loss(plain(model(x)), y).backward()
    opt.step()
    return [plain(p) for p in model.parameters()]
