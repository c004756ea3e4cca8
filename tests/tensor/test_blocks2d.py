"""2D block formats (``BlockFormat(block_shape=(r, c))``: r x c tiles of the last two dims, c along
``axis``) and FP32 block scales (``scale='fp32'`` with the amax rule, DeepSeek-V3's): their string
form and errors, the reference against a tile-by-tile oracle, the kernel path against the
reference bit for bit, W and W.T rounding alike, and 2D-blocked QTensors under transposes and in a
converted nn.Linear (forward, backward, optimizer step)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.kernels import reference
from qtensor.formats.block import BlockFormat
from qtensor.formats.base import FormatError
from qtensor.nn.plans import Recipe

MODES = ("nearest", "nearest_away", "toward_zero", "stochastic")
NV16 = BlockFormat(qt.fp4_e2m1, scale=qt.fp8_e4m3, scale_rule="amax", tensor_scale=True,
                   block_shape=(16, 16))  # NVIDIA's NVFP4 weight blocks
NV16_SINGLE = NV16.replace(tensor_scale=False)
DS128 = BlockFormat(qt.fp8_e4m3, scale="fp32", scale_rule="amax", block_shape=(128, 128))
MX_4x8 = BlockFormat(qt.fp8_e4m3, block_shape=(4, 8))  # floor rule, non-square
AMAX_3x5 = BlockFormat(qt.fp4_e2m1, scale=qt.fp8_e4m3, scale_rule="amax", block_shape=(3, 5))
FORMATS_2D = [NV16, NV16_SINGLE, DS128.replace(block_shape=(8, 8)), MX_4x8, AMAX_3x5,
              AMAX_3x5.replace(axis=-2), MX_4x8.replace(scale_rule="ceil")]


def _x(shape, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * spread)


# ---------------------------------------------------------------------------------------------
# The format: fields, string form, errors

def test_block_shape_fields_and_string_form():
    assert NV16.block_size == 256 and NV16.block_shape == (16, 16)
    assert NV16.bits == 4 + 8 / 256
    assert str(NV16) == ("block(elem=fp4_e2m1, scale=fp8_e4m3, scale_rule=amax, tensor_scale=True, "
                         "block_shape=16x16)")
    for f in FORMATS_2D + [DS128]:
        assert qt.format(str(f)) == f, str(f)
    # the string form and a list spell the same shape; block_size may repeat r * c
    assert BlockFormat(qt.fp8_e4m3, block_shape="4x8") == MX_4x8
    assert BlockFormat(qt.fp8_e4m3, block_size=32, block_shape=[4, 8]) == MX_4x8
    assert MX_4x8.replace(axis=0).axis == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_shape=(16,)), "two ints"),
    (dict(block_shape="16 by 16"), "'RxC'"),
    (dict(block_shape=(16, 0)), "cols must be 1..2"),
    (dict(block_shape=(16, 16.0)), "must be an int"),
    (dict(block_shape=(16, 16), axis=None), "not axis=None"),
    (dict(block_shape=(16, 16), block_size=16), "256 elements per block, but block_size=16"),
])
def test_block_shape_refused(kwargs, match):
    with pytest.raises(FormatError, match=match):
        BlockFormat(qt.fp8_e4m3, **kwargs)


def test_2d_format_on_tensors_it_cannot_tile():
    with pytest.raises(FormatError, match=r"16x16 blocks tile the last two dims, but x has shape "
                                          r"\(32,\) \(1 dim\)"):
        qt.quantize(torch.ones(32), NV16)
    with pytest.raises(FormatError, match="but x has shape"):
        reference.quantize(torch.tensor(1.0), NV16)
    with pytest.raises(FormatError, match="axis 0 is not one of them for a tensor of shape "
                                          r"\(2, 3, 4\)"):
        qt.quantize(torch.ones(2, 3, 4), NV16.replace(axis=0))


# ---------------------------------------------------------------------------------------------
# The values: an independent oracle, the kernels, transposes

def _tile_oracle(x, fmt, rounding="nearest"):
    """Each tile rounded on its own as one block (axis=None: the whole tensor one block); with a
    tensor scale, next to a row holding the tensor's finite amax (so that the per-tensor scale
    is the whole tensor's) in a 2-row tensor of 1D blocks of the tile's length."""
    r, c = fmt.block_shape
    if fmt.axis % x.dim() == x.dim() - 2:
        r, c = c, r
    out = torch.empty_like(x)
    amax = torch.where(torch.isfinite(x), x.abs(), 0).amax()
    one = fmt.replace(block_shape=None, block_size=None, axis=None)
    for lead in (torch.cartesian_prod(*[torch.arange(n) for n in x.shape[:-2]]).reshape(
            -1, x.dim() - 2).tolist() if x.dim() > 2 else [[]]):
        m = x[tuple(lead)]
        for i in range(0, m.shape[0], r):
            for j in range(0, m.shape[1], c):
                tile = m[i:i + r, j:j + c]
                if fmt.tensor_scale:
                    flat = tile.reshape(1, -1)
                    pair = torch.cat([flat, torch.zeros_like(flat)])
                    pair[1, 0] = amax
                    q = reference.quantize(pair, fmt.replace(block_shape=None,
                                                             block_size=flat.shape[1], axis=-1),
                                           rounding=rounding)[0]
                else:
                    q = reference.quantize(tile, one, rounding=rounding)
                out[tuple(lead)][i:i + r, j:j + c] = q.reshape(tile.shape)
    return out


@pytest.mark.parametrize("fmt", FORMATS_2D, ids=str)
@pytest.mark.parametrize("shape", [(40, 37), (2, 19, 33), (16, 16), (5, 3)])
def test_2d_blocks_are_tiles(quantize, fmt, shape):
    """Every tile (partial ones at the ends included) rounds as one block of its own."""
    x = _x(shape, seed=shape[-1])
    for rounding in ("nearest", "toward_zero"):
        assert_bits_equal(quantize(x, fmt, rounding=rounding), _tile_oracle(x, fmt, rounding),
                          f"{fmt} {rounding}", inputs=x)


@pytest.mark.parametrize("fmt", FORMATS_2D + [DS128], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2d_kernel_path_matches_reference(fmt, dtype):
    """qt.quantize (tiles laid out for the 1D block kernel) equals the reference, bit for bit, in
    every rounding mode (stochastic: the same seed gives the same bits), also quantize_ and out=."""
    x = _x((2, 40, 140), seed=1, spread=2.0).to(dtype)
    x[0, 0, 0] = float("nan")
    x[1, 20, 3] = float("inf")
    for mode in MODES:
        seed = 1234
        got = qt.kernels.ops.quantize_with_seed(x, fmt, mode, seed)
        assert_bits_equal(got, reference.quantize_with_seed(x, fmt, mode, seed), f"{fmt} {mode}")
    want = qt.quantize(x, fmt)
    y = x.clone()
    qt.quantize_(y, fmt)
    assert_bits_equal(y, want, "quantize_")
    out = torch.empty_like(x)
    qt.quantize(x, fmt, out=out)
    assert_bits_equal(out, want, "out=")
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert_bits_equal(qt.quantize(x, fmt, rounding="stochastic", generator=g1),
                      qt.quantize(x, fmt, rounding="stochastic", generator=g2), "reproducible")


@pytest.mark.parametrize("fmt", [NV16, NV16_SINGLE, DS128, MX_4x8, AMAX_3x5], ids=str)
def test_w_and_w_t_round_identically(quantize, fmt):
    """W.T in the format with its axis on the other dim (what W.t() of a QTensor carries) has
    the transposed bits of W's rounding; square tiles give them whatever the axis."""
    w = _x((300, 260), seed=3, spread=1.0)
    q = quantize(w, fmt)
    other = fmt.replace(axis=-2 if fmt.axis == -1 else -1)
    assert_bits_equal(quantize(w.t().contiguous(), other), q.t().contiguous(), "W.T")
    assert_bits_equal(quantize(w.t(), other), q.t().contiguous(), "W.T (a view)")
    r, c = fmt.block_shape
    if r == c:
        assert_bits_equal(quantize(w.t().contiguous(), fmt), q.t().contiguous(), "square tiles")
    # 1D blocks of the same scale along the rows and along the columns do not (the point of 2D)
    one = fmt.replace(block_shape=None, block_size=c)
    assert not torch.equal(quantize(w.t().contiguous(), one), quantize(w, one).t())


def test_tensor_scale_with_2d_blocks():
    """Two-level NVFP4 with 16x16 blocks: one per-tensor scale over the tiles' E4M3 scales. A
    tensor of gradient-sized values (1e-4) keeps them (single-level flushes to 0 below 2^-10)."""
    x = _x((64, 48), seed=4, spread=0.5) * 1e-4
    q = qt.quantize(x, NV16)
    assert float((q == 0).float().mean()) < 0.3  # (E2M1 flushes below 1/24 of a tile's max)
    assert float((qt.quantize(x, NV16_SINGLE) == 0).float().mean()) > 0.9
    assert_bits_equal(q, _tile_oracle(x, NV16), "tiles with the tensor scale")
    # the per-tensor scale is the whole tensor's: scaling one tile's values scales no other's
    y = x.clone()
    y[:16, :16] *= 1024
    qy = qt.quantize(y, NV16)
    assert not torch.equal(qy[16:], q[16:])  # the tensor amax moved: every tile sees it


# ---------------------------------------------------------------------------------------------
# FP32 scales (the amax rule)

def _round_sig(t: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 t rounded to nearest-even at ``bits`` significant bits."""
    m, e = torch.frexp(t)
    return torch.ldexp(torch.round(torch.ldexp(m, torch.full_like(e, bits))), e - bits)


def test_fp32_scale_is_amax_over_448_in_20_bits(quantize):
    """scale='fp32' (1D blocks of 128 along the last dim, DeepSeek-V3's activations): X =
    amax / 448 rounded to 20 significant bits (so that E4M3 element times X is a float32), the
    elements E4M3(x / X): not a power of two, unlike MX."""
    fmt = BlockFormat(qt.fp8_e4m3, 128, scale="fp32", scale_rule="amax")
    grid = fmt.amax_scale_format  # 20 bits; multiples of 2^-140: E4M3's 2^-9 times it >= 2^-149
    assert (grid.man, grid.emin, grid.emax, grid.min_quantum_exp) == (19, -121, 127, -140)
    x = _x((6, 256), seed=5, spread=1.0).double()
    q = quantize(x.float(), fmt).double()
    blocks = x.reshape(6, 2, 128)
    scale = _round_sig(blocks.abs().amax(-1, keepdim=True) / 448, 20)
    want = (qt.quantize(blocks / scale, qt.fp8_e4m3) * scale).reshape(6, 256)
    assert_bits_equal(q, want, "fp32 scales")
    assert not bool((torch.frexp(scale)[0] == 0.5).all())  # not powers of two
    # the block's max element is +-448 exactly: re-rounding derives the same scale
    assert bool((q.reshape(6, 2, 128).abs().amax(-1, keepdim=True) == 448 * scale).all())


def test_fp32_scale_tiny_blocks_stay_float32():
    """A block whose scale is near float32's bottom: its scale is a multiple of 2^-140, so that
    its values (down to E4M3's 2^-9 times it) are float32s and re-round to themselves (a 20-bit
    scale of 2^-125 would put a lowest bit at 2^-153: the first rounding moved on the second)."""
    fmt = BlockFormat(qt.fp8_e4m3, 128, scale="fp32", scale_rule="amax")
    x = _x((8, 128), seed=7, spread=3.0)  # block maxima 2e-36..3e-35: scales 2^-128..2^-124
    x = x / x.abs().amax(-1, keepdim=True) * torch.linspace(2e-36, 3e-35, 8)[:, None]
    # (the failure it guards against: a 20-bit grid down to 2^-126, e8m19(subnormals=False))
    old = fmt.replace(scale=qt.FloatFormat(8, 19, subnormals=False))
    q_old = qt.quantize(x, old, rounding="toward_zero")
    assert not torch.equal(qt.quantize(q_old, old, rounding="toward_zero"), q_old)
    for mode in ("nearest", "toward_zero"):
        q = qt.quantize(x, fmt, rounding=mode)
        assert_bits_equal(reference.quantize(x, fmt, rounding=mode), q, mode)
        assert_bits_equal(qt.quantize(q, fmt, rounding=mode), q, f"{mode} re-rounded")
        if mode == "nearest":  # (then each block's max is 448 X)
            scales = q.abs().double().amax(-1) / 448
            assert bool(((scales * 2.0 ** 140) % 1 == 0).all())


def test_fp32_scale_limits():
    """FP32 scales leave no bits for a per-tensor scale; the floor rule needs exponent-only
    scales; a float32-like scale of 23 mantissa bits that is not FP32 is still refused."""
    with pytest.raises(FormatError, match="tensor_scale=True with fp8_e4m3 elements"):
        BlockFormat(qt.fp8_e4m3, 128, scale="fp32", scale_rule="amax", tensor_scale=True)
    with pytest.raises(FormatError, match="exponent-only scale format"):
        BlockFormat(qt.fp8_e4m3, 128, scale="fp32")
    with pytest.raises(FormatError, match="more than the float32 carrier's 24"):
        BlockFormat(qt.fp8_e4m3, 128, scale=qt.FloatFormat(8, 22), scale_rule="amax")


# ---------------------------------------------------------------------------------------------
# QTensors and dispatch

def test_2d_qtensor_transposes_stay_in_format():
    """t(), .T, .mT, transpose and permutes that keep the tiles' two dims last keep the values
    and give the tiles' format with the axis on the moved dim (leak_check finds nothing); ops
    that re-round (mul, cat, contiguous) then give the same values."""
    q = qt.as_qtensor(_x((2, 20, 30), seed=6), AMAX_3x5)
    v = q.dequantize()
    with qt.leak_check(action="raise", check_values=True):
        cases = [(q[0].t(), v[0].t(), 0), (q[0].T, v[0].T, 0), (q.mT, v.mT, 1),
                 (q.transpose(1, 2), v.transpose(1, 2), 1), (q.permute(0, 2, 1), v.mT, 1),
                 (q.mT * 1, v.mT, 1), (q.mT.contiguous(), v.mT, 1), (q.mT.clone(), v.mT, 1),
                 (torch.cat([q.mT, q.mT]), torch.cat([v.mT, v.mT]), -2),
                 (q[0].t().t() * 1, v[0], 1)]
        for i, (t, ref, axis) in enumerate(cases):
            assert t.fmt.block_shape == (3, 5) and t.fmt.axis == axis, (i, t.fmt)
            assert_bits_equal(t.dequantize(), ref, f"case {i}")
            assert_bits_equal(qt.quantize(ref, t.fmt), ref, f"case {i} in format")
    # a reshape across tiles (20 rows of 3-row tiles stacked into 40) regroups them: the result
    # is rounded in its new tiles, as cat of 1D blocks re-rounds
    flat = q.view(40, 30) * 1
    assert_bits_equal(flat.dequantize(), qt.quantize(v.view(40, 30), AMAX_3x5), "regrouped")
    # a permute that moves a tile dim away from the last two: the tiles are re-formed (-1)
    p = q.permute(2, 0, 1) * 1
    assert p.fmt.axis == -1
    # fewer than 2 dims: a row of tiles, i.e. 1D blocks of c
    assert q[0, 0].fmt == AMAX_3x5.replace(block_shape=None, block_size=5)


def test_converted_linear_with_16x16_weight_blocks_trains():
    """A converted nn.Linear whose weight operand is 16x16 two-level NVFP4: the forward product
    and the input gradient use the same tiles of W (bit for bit; 1D blocks along the reduction
    dim would round W differently in the two), an SGD step runs, and leak_check is clean."""
    torch.manual_seed(0)
    lin = nn.Linear(40, 24)
    recipe = Recipe(weight=(qt.fp32, NV16), bias=qt.fp32, activation=(qt.fp32, qt.nvfp4),
                    grad=(qt.fp32, qt.nvfp4), optimizer_state=None, master_weights=True,
                    name="nvfp4 16x16 weights")
    model = qt.convert(nn.Sequential(lin), recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 40, requires_grad=True)
    g = torch.randn(8, 24)
    with qt.leak_check(action="raise", optimizer=opt, check_values=True):
        y = model(x)
        y.backward(g)
        w = lin.weight.dequantize().detach().clone()
        b = lin.bias.dequantize().detach().clone()
        opt.step()
    wq = qt.quantize(w, NV16)
    xq = qt.quantize(x.detach(), qt.nvfp4)
    assert_bits_equal(y.dequantize().detach(),
                      nn.functional.linear(xq, wq, b), "forward")
    dx = x.grad.dequantize() if isinstance(x.grad, qt.QTensor) else x.grad
    assert_bits_equal(dx, qt.quantize(g, qt.nvfp4) @ wq, "input gradient")
    assert not torch.equal(qt.quantize(w, qt.nvfp4.replace(axis=0)), wq)
    assert lin.weight.grad is not None
    assert not torch.equal(lin.weight.dequantize(), w)  # the step moved the weights
    assert lin.weight.mm_fmt == NV16 and lin.weight.t().mm_fmt == NV16


def test_2d_weight_operand_of_a_conv_is_refused():
    """A conv weight's K (its input channels, dim 1) is not one of its last two dims: a 2D
    operand format there is a FormatError naming the shape, not tiles over the kernel dims."""
    model = qt.convert(nn.Sequential(nn.Conv2d(3, 32, 3)),
                       Recipe(weight=(qt.fp32, NV16), bias=qt.fp32, activation=qt.bf16))
    with pytest.raises(FormatError, match=r"axis 1 is not one of them for a tensor of shape "
                                          r"\(32, 3, 3, 3\)"):
        model(torch.randn(2, 3, 8, 8))


class _TiledOperand(nn.Module):
    """A weight in a 2D-tile operand format times the input."""

    def __init__(self, fmt):
        super().__init__()
        self.w = nn.Parameter(qt.as_qtensor(_x((32, 136), 2), qt.fp32, mm_fmt=fmt))

    def forward(self, x):
        return (x @ self.w).dequantize()


@pytest.mark.parametrize("fmt", [NV16, DS128], ids=["nvfp4_16x16", "fp8_128x128"])
def test_2d_tiles_under_compile_and_export(fmt):
    """A 16x16 (NVFP4 weight tiles) or 128x128 (DeepSeek-V3) format under torch.compile and
    torch.export: both crashed with "Cannot access data pointer of Tensor (FakeTensor)" (the
    tiles' rounding compared data pointers). qt.quantize and a contraction with a 2D-tiled
    operand give eager's bits."""
    x = _x((8, 32), 1)
    torch._dynamo.reset()
    f = torch.compile(lambda t: qt.quantize(t, fmt), backend="aot_eager", fullgraph=True)
    assert_bits_equal(f(_x((40, 136))), qt.quantize(_x((40, 136)), fmt), "compiled quantize")
    model = _TiledOperand(fmt)
    want = model(x)
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert_bits_equal(got, want, "compiled contraction")
    with torch.no_grad():
        exported = torch.export.export(model, (x,)).module()
        assert_bits_equal(exported(x), want, "exported contraction")
    torch._dynamo.reset()
