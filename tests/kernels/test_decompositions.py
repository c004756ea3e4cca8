"""qtensor/kernels/decompositions.py: the rounding ops as pointwise torch ops for inductor.

The oracle is the eager C++ kernel (itself tested bit for bit against qtensor/kernels/reference.py in
test_kernels.py): the decomposition, run eagerly and compiled by inductor, gives its bits on
random values over float32's whole range, every bit pattern (NaNs, Infs, subnormals) and the
formats' boundaries, for each format family and deterministic rounding mode.
"""
from __future__ import annotations

import pytest
import torch

import qtensor as qt
from helpers import assert_bits_equal, two_level_op_args, twos_complement_blocks
from qtensor.kernels import backend, decompositions, ops
from qtensor.formats.block import BlockFormat
from qtensor.formats.fixed import FixedFormat
from qtensor.formats.float import FloatFormat

pytestmark = pytest.mark.skipif(not ops.kernels_available("cpu"),
                                reason="the oracle is the compiled kernel")

FLOAT = ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "e8m0", "bf16", "fp16",
         "tf32", "e3m4(bias=3)", "e4m3(subnormals=False)", "e4m3(specials=ieee, saturate=False)",
         "e5m2(saturate=True)", "e8m7(subnormals=False)"]
FIXED = ["fixed8.4", "fixed(wl=8, fl=9)", "fixed8.4(signed=False)", "fixed8.4(symmetric=True)",
         "fixed16.-2", "fixed24.20", "fixed1.0"]
BLOCK = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8",
         BlockFormat("fp4_e2m1", scale_rule="ceil"), BlockFormat("fixed8.6(symmetric=True)", 16),
         BlockFormat("fp8_e4m3", block_size=24, axis=0), BlockFormat("fp6_e2m3", axis=None),
         BlockFormat("fixed4.2(signed=False)", block_size=8),
         BlockFormat("e5m2", block_size=None, scale=FloatFormat(5, 0, saturate=True))]
MODES = ["nearest", "nearest_away", "toward_zero"]


def _values(n: int = 2048) -> torch.Tensor:
    """float32 values: random over the whole range, random bit patterns, and specials."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(n, generator=g) * torch.exp2(
        torch.randint(-150, 128, (n,), generator=g).float())
    bits = torch.randint(-2 ** 31, 2 ** 31, (n,), generator=g, dtype=torch.int64)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
                            1e-45, -1e-45, 2 ** -126, 2 ** -127, 3.4028235e38, 448.0, 464.0,
                            480.0, 57344.0, 61440.0, 6.0, 6.5, 7.0, 0.25, 0.75, 1.5, 2.5, 0.0625,
                            0.03125, 7.96875, 7.9375, 127.5, 255.5, -128.5],
                           dtype=torch.float32)
    return torch.cat([wide, bits.to(torch.int32).view(torch.float32), special,
                      torch.randn(n, generator=g)])


def _op_args(fmt, x, rounding):
    """(the qtensor:: op that rounds x to fmt, its arguments after x) as the library calls it: a
    two-level format's op is quantize_two_level, with the arguments backend.two_level passes
    (None where no kernel takes x: the reference rounds it)."""
    if fmt.is_two_level:
        return (torch.ops.qtensor.quantize_two_level,
                two_level_op_args(x, fmt, rounding=rounding, seed=0))
    name, args = ops.op_args(fmt)
    return getattr(torch.ops.qtensor, name), (*args, backend.rounding_code(rounding), 0)


def _call(fmt, x, rounding, impl, op_args=None):
    """x rounded to fmt by the op (impl="kernel") or by the op's entry in the decompositions'
    table, which inductor gets: NotImplemented where it declines or the op has none (the op
    then stays an extern call). op_args: _op_args's, made before (outside a compiled graph)."""
    op, args = op_args or _op_args(fmt, x, rounding)
    decomposition = decompositions._ops_table().get(op.default)
    if impl != "kernel" and decomposition is None:
        return NotImplemented
    assert args is not None, f"{fmt}: no kernel takes x"
    if impl == "kernel":
        q = op(x, *args)
        return q[0] if fmt.is_two_level else q  # (quantize_two_level: values, scales)
    return decomposition(x, *args)


def _shaped(fmt, x):
    return x[: 64 * 96].reshape(64, 96) if isinstance(fmt, BlockFormat) else x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rounding", MODES)
@pytest.mark.parametrize("spec", FLOAT + FIXED + BLOCK, ids=str)
def test_decomposition_gives_the_kernels_bits(spec, rounding, dtype):
    fmt = qt.format(spec) if isinstance(spec, str) else spec
    x = _shaped(fmt, _values()).to(dtype)
    want = _call(fmt, x, rounding, "kernel")
    got = _call(fmt, x, rounding, "decomposition")
    assert got is not NotImplemented
    assert got.dtype == dtype and got.shape == x.shape
    assert_bits_equal(got, want, f"{fmt} {rounding} {dtype}")


def test_twos_complement_floor_blocks():
    """The floor rule with two's-complement elements counts a negative power of two a binade
    lower (docs/formats.md): every tuple of codes and points between them, the kernel's bits."""
    for elem in (FixedFormat(2, 0), FixedFormat(4, -2)):
        x = twos_complement_blocks(elem, 3, limit=2000)
        for rounding in MODES:
            fmt = BlockFormat(elem, 3)
            assert_bits_equal(_call(fmt, x, rounding, "decomposition"),
                              _call(fmt, x, rounding, "kernel"), f"{fmt} {rounding}")


def test_block_edge_shapes():
    """Padding (an axis not a multiple of the block), a 0-dim tensor, a block axis in the
    middle, one element per block."""
    g = torch.Generator().manual_seed(1)
    cases = [(BlockFormat("fp8_e4m3", block_size=32, axis=1), torch.randn(3, 45, 2, generator=g)),
             (BlockFormat("fp4_e2m1", block_size=1), torch.randn(5, 7, generator=g)),
             (BlockFormat("fp4_e2m1"), torch.tensor(3.3)),
             (BlockFormat("fixed8.6", axis=None), torch.randn(4, 5, generator=g))]
    for fmt, x in cases:
        for rounding in MODES:
            assert_bits_equal(_call(fmt, x, rounding, "decomposition"),
                              _call(fmt, x, rounding, "kernel"), f"{fmt} {list(x.shape)}")


@pytest.mark.parametrize("fmt", [qt.format("fp8_e4m3(rounding=stochastic)"), qt.nvfp4,
                                 qt.nvfp4_single, qt.format("fixed8.4(saturate=False)")],
                         ids=str)
def test_not_decomposed_where_not_exact(fmt):
    """Stochastic rounding, the amax scale rule (its idempotence loop) and wrapping fixed point
    keep the custom op: the decomposition declines (nvfp4's op, quantize_two_level, has none)."""
    x = _shaped(fmt, _values())
    assert _call(fmt, x, fmt.rounding, "decomposition") is NotImplemented


# one compiled function for several formats (compiling is slow on CI's few cores)
_COMPILED = [(qt.format(s), m) for s, m in [
    ("fp8_e4m3", "nearest"), ("fp6_e2m3", "toward_zero"), ("e8m0", "nearest"),
    ("e4m3(specials=ieee, saturate=False)", "nearest_away"),
    ("fixed8.4(signed=False)", "nearest")]] + [
    (qt.mxfp4_e2m1, "nearest_away"), (qt.mxint8, "toward_zero"),
    (BlockFormat("fp8_e5m2", block_size=24, axis=0, scale_rule="ceil"), "nearest")]


def _many(x, h, nvfp4):
    """Each rounding of 2 * x (exact: the kernel sees the same float32 values), of a bfloat16
    input h, nvfp4_single (quantize_block, amax rule) and nvfp4 (quantize_two_level, with
    ``nvfp4``, _op_args's). (A cast to bfloat16 inside the graph would not do: inductor keeps
    the float32 value of a fused cast.)"""
    y = x * 2.0
    out = [_call(f, _shaped(f, y), m, "kernel") for f, m in _COMPILED]
    out += [_call(f, _shaped(f, h), m, "kernel") for f, m in _COMPILED[:2]]
    out.append(_call(qt.nvfp4_single, _shaped(qt.nvfp4_single, y), "nearest", "kernel"))
    out.append(_call(qt.nvfp4, _shaped(qt.nvfp4, y), "nearest", "kernel", nvfp4))
    return out


@pytest.fixture
def _enabled():
    decompositions.set_enabled(True)
    yield
    decompositions.set_enabled(False)


def test_inductor_fuses_the_roundings_with_the_kernels_bits(_enabled):
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    x = _values() / 2
    x = torch.where(x.isfinite(), x, _values())  # 2 * x: the specials again, and overflows
    h = _values().to(torch.bfloat16)
    nvfp4 = _op_args(qt.nvfp4, _shaped(qt.nvfp4, x * 2.0), "nearest")
    # (no caches: a graph compiled before, in another process, would not show what inductor does)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        got, (code,) = run_and_get_code(
            torch.compile(lambda x, h: _many(x, h, nvfp4), fullgraph=True), x, h)
    want = _many(x, h, nvfp4)
    names = _COMPILED + _COMPILED[:2] + [(qt.nvfp4_single, "nearest"), (qt.nvfp4, "nearest")]
    for (f, m), g, w in zip(names, got, want, strict=True):
        assert_bits_equal(g, w, f"compiled {f} {m} {g.dtype}")
    # only nvfp4_single (amax rule) and nvfp4 are extern calls; everything else is generated code
    assert code.count("torch.ops.qtensor.quantize_block.default(") == 1, code
    assert code.count("torch.ops.qtensor.quantize_two_level.default(") == 1, code
    assert "qtensor.quantize_float" not in code and "qtensor.quantize_fixed" not in code


def test_off_by_default_the_ops_stay_extern_calls():
    """Without set_enabled(True) inductor calls the kernels (faster on CPU), with their bits."""
    from torch._inductor.utils import run_and_get_code
    assert not decompositions._enabled
    torch._dynamo.reset()
    f = qt.fp6_e2m3
    x = _values()
    fn = lambda a: _call(f, a * 2.0, "nearest", "kernel")  # noqa: E731
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        got, (code,) = run_and_get_code(torch.compile(fn, fullgraph=True), x / 2)
    assert "torch.ops.qtensor.quantize_float.default(" in code
    assert_bits_equal(got, fn(x / 2))


def test_environment_variable_turns_them_on_at_the_first_trace():
    """QTENSOR_INDUCTOR_DECOMPOSITIONS=1: the fake implementation (run when torch.compile traces
    the op) puts the decompositions in inductor's table; without it, nothing is registered."""
    import os
    import subprocess
    import sys
    script = (
        "import torch, qtensor as qt\n"
        "from qtensor.kernels import ops\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "name, args = ops.op_args(qt.fp6_e2m3)\n"
        "with FakeTensorMode():\n"
        "    torch.ops.qtensor.quantize_float(torch.empty(4), *args, 0, 0)\n"
        "from torch._inductor.decomposition import select_decomp_table\n"
        "print(torch.ops.qtensor.quantize_float.default in select_decomp_table())\n")
    for value, want in (("1", "True"), ("0", "False")):
        env = dict(os.environ, QTENSOR_INDUCTOR_DECOMPOSITIONS=value)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True, cwd=os.path.dirname(os.path.dirname(
                                 os.path.dirname(os.path.abspath(__file__)))))
        assert out.stdout.strip().splitlines()[-1] == want, out.stderr


def _every_block_format():
    """Each scale rule with each scale format it takes (exponent-only, E4M3, E5M2, BF16, FP32),
    float and fixed-point elements, with and without a tensor scale."""
    from qtensor.formats.block import SCALE_RULES
    for rule in SCALE_RULES:
        for scale in ("e8m0", "fp8_e4m3", "fp8_e5m2", "bf16", "fp32"):
            for elem in ("fp4_e2m1", "fp8_e4m3", "fixed8.6(symmetric=True)"):
                for tensor_scale in (False, True):
                    try:
                        yield BlockFormat(elem, 16, scale=scale, scale_rule=rule,
                                          tensor_scale=tensor_scale)
                    except ValueError:  # a combination the format refuses
                        pass


def test_every_scale_rule_and_scale_format_is_exact_or_declines():
    """The block decomposition shifts the element grid by a power of two: exact for the floor
    rule and for ceil with exponent-only scales, which it must cover; every other rule (even,
    4over6, amax, ceil with scales of mantissa bits) must keep the custom op, as must every
    two-level format (tensor_scale=True: quantize_two_level's)."""
    x = _values()[: 64 * 96].reshape(64, 96)
    formats = list(_every_block_format())
    assert {f.scale_rule for f in formats} == {"floor", "ceil", "amax", "even", "4over6"}
    covered = 0
    for fmt in formats:
        for rounding in MODES:
            got = _call(fmt, x, rounding, "decomposition")
            if fmt.scale_rule == "floor" or (fmt.scale_rule == "ceil" and fmt.scale.man == 0):
                assert got is not NotImplemented, fmt
                covered += 1
            if got is not NotImplemented:
                assert_bits_equal(got, _call(fmt, x, rounding, "kernel"), f"{fmt} {rounding}")
    assert covered > 0


def test_compiled_quantize_keeps_the_kernels_bits_for_every_scale_rule(_enabled):
    """A user compiles qt.quantize with the decompositions on: the even, 4over6 and E4M3-scale
    ceil blocks (which the decomposition cannot do exactly) give eager's bits."""
    fmts = [BlockFormat("fp4_e2m1", scale_rule="even"), BlockFormat("fp8_e4m3", scale_rule="even"),
            BlockFormat("fp4_e2m1", 16, scale="fp8_e4m3", scale_rule="4over6"),
            BlockFormat("fp4_e2m1", 16, scale="fp8_e4m3", scale_rule="ceil"), qt.mxfp4_e2m1]
    torch._dynamo.reset()
    x = _values()[: 64 * 96].reshape(64, 96)
    fn = lambda a: [qt.quantize(a * 2.0, f) for f in fmts]  # noqa: E731
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        got = torch.compile(fn, fullgraph=True)(x / 2)
    for f, g, w in zip(fmts, got, fn(x / 2), strict=True):
        assert_bits_equal(g, w, f"compiled {f}")


def test_cache_of_a_process_with_the_switch_on_is_not_reused_with_it_off(tmp_path):
    """Inductor's caches do not key on the decomposition table: a process with
    QTENSOR_INDUCTOR_DECOMPOSITIONS=1 and a later one without it, sharing the cache directory,
    must not share compiled graphs (the later one calls the kernels); the same switch again
    hits the cache."""
    import os
    import subprocess
    import sys
    script = (
        "import torch, qtensor as qt\n"
        "from torch._dynamo.utils import counters\n"
        "from torch._inductor.utils import run_and_get_code\n"
        "f = qt.mxfp4_e2m1\n"
        "fn = torch.compile(lambda a: qt.quantize(a * 2.0, f), fullgraph=True)\n"
        "x = torch.randn(64, 96)\n"
        "got, code = run_and_get_code(fn, x)\n"
        "assert torch.equal(got.view(torch.int32), qt.quantize(x * 2.0, f).view(torch.int32))\n"
        "hits = counters['inductor']['fxgraph_cache_hit'] + counters['aot_autograd']"
        "['autograd_cache_hit']\n"
        "print(hits, any('qtensor.quantize_block' in c for c in code))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    results = []
    for value in ("1", "0", "1"):
        env = dict(os.environ, QTENSOR_INDUCTOR_DECOMPOSITIONS=value,
                   TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
        env.pop("TORCHINDUCTOR_FX_GRAPH_CACHE", None)
        env.pop("TORCHINDUCTOR_AUTOGRAD_CACHE", None)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, cwd=root)
        assert out.returncode == 0, out.stderr
        results.append(out.stdout.strip().splitlines()[-1])
    # on: fused (no extern call), compiled; off: the extern call, compiled anew; on: a hit
    assert results[0] == "0 False", results
    assert results[1] == "0 True", results
    assert results[2].split()[0] != "0", results
