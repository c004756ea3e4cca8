"""The FP4 training presets of qt.recipes: nvfp4_nvidia, fp4_all_the_way, quartet;
each checked against what its paper states (which operand of which GEMM gets which format,
rounding and transform), bit for bit on a converted nn.Linear against a manual computation; and
Recipe.last_layers (the last layers in higher precision)."""
import math

import pytest
import torch
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal

torch.set_num_threads(1)
R = qt.recipes
NV, BF = qt.nvfp4, qt.bf16
NV16 = NV.replace(block_shape=(16, 16))  # nvfp4_nvidia's weight blocks
SR = NV.replace(rounding="stochastic")


def plain(t):
    return t.dequantize() if isinstance(t, qt.QTensor) else t


def q(t, fmt, axis):
    return qt.quantize(t, fmt.replace(axis=axis))


# Stochastic rounding draws its random bits in the element order of the operand as the op gets
# it: dgrad mm(dY, W) (dY along axis 1, W along 0), then wgrad mm(dY^T, x) (dY^T along 1, x
# along 0), each operand in that order; the references draw them the same way.


def linear(recipe, seed=5, tokens=48, in_f=64, out_f=32):
    """A converted Linear's output and gradients, the backward run under manual_seed(seed)."""
    torch.manual_seed(0)
    m = nn.Linear(in_f, out_f)
    w, b = m.weight.detach().clone(), m.bias.detach().clone()
    qt.convert(m, recipe)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(tokens, in_f, generator=gen), torch.randn(tokens, out_f, generator=gen)
    xx = x.clone().requires_grad_()
    y = m(xx)
    torch.manual_seed(seed)
    y.backward(g)
    return dict(w=w, b=b, x=qt.quantize(x, BF), g=qt.quantize(g, BF), y=plain(y),
                gx=plain(xx.grad), gw=plain(m.weight.grad))


def test_nvfp4_nvidia_definition():
    r, g = R.nvfp4_nvidia, R.nvfp4_nvidia.gemm["linear"]
    # convolutions: the same, with 1D weight blocks of 16 along K (input channels, not 2D-tileable)
    c = R.nvfp4_nvidia.gemm["conv"]
    assert c == g.__class__(**{**vars(g), "fprop_w": NV, "dgrad_w": NV})
    # NVFP4 two-level: E2M1 elements, E4M3 scales of 16, FP32 per-tensor scale, for all six
    for f in (g.fprop_x, g.fprop_w, g.dgrad_dy, g.dgrad_w, g.wgrad_x, g.wgrad_dy):
        assert f.replace(rounding="nearest", block_shape=None, block_size=16) == NV
        assert f.tensor_scale
        assert f.scale == qt.fp8_e4m3 and f.elem.replace(rounding="nearest") == qt.fp4_e2m1
    # the weights in 16x16 2D blocks (W and W^T round alike), x and dY in 1D blocks of 16
    assert g.fprop_w == g.dgrad_w == NV16
    assert all(f.block_shape is None and f.block_size == 16
               for f in (g.fprop_x, g.dgrad_dy, g.wgrad_x, g.wgrad_dy))
    # stochastic rounding on the gradient dY only; x and W round to nearest even
    assert g.dgrad_dy.rounding == g.wgrad_dy.rounding == "stochastic"
    assert {f.rounding for f in (g.fprop_x, g.fprop_w, g.dgrad_w, g.wgrad_x)} == {"nearest"}
    # the 16x16 RHT with TE's signs on the wgrad GEMM only
    assert g.wgrad_transform == qt.Hadamard(16, signs="te")
    assert g.fprop_transform is None and g.dgrad_transform is None
    assert r.last_layers == (0.15, BF)
    # everything outside the linear layers' GEMMs in BF16, FP32 master weights
    assert r.activation == qt.Role(BF) and r.grad == qt.Role(BF) and r.master_weights


def test_nvfp4_nvidia_linear_bits():
    """One Linear (the last_layers rule off): fprop x, W to nearest; dgrad dY stochastic, W to
    nearest along out_features; wgrad x and dY along the tokens after the RHT, dY stochastic;
    each operand rounded from the high-precision (BF16/FP32) tensor, outputs in BF16."""
    r = R.nvfp4_nvidia.replace(last_layers=None)
    o = linear(r)
    w, b, x, g, H = o["w"], o["b"], o["x"], o["g"], qt.Hadamard()
    fwd = torch.addmm(b, q(x, NV, 1), q(w, NV16, 1).t())
    assert_bits_equal(o["y"], qt.quantize(fwd, BF), "fprop")
    torch.manual_seed(5)  # autograd runs dgrad first, then wgrad
    dy_d = q(g, SR, 1)
    dy_wt = q(H.apply(g, 0).t(), SR, 1)
    assert_bits_equal(o["gx"], qt.quantize(dy_d @ q(w, NV16, 0), BF), "dgrad")
    wgrad = dy_wt @ q(H.apply(x, 0), NV, 0)
    assert_bits_equal(o["gw"], qt.quantize(wgrad, BF), "wgrad")
    # W's 16x16 tiles are the same in fprop and dgrad (1D blocks along K would round W^T from
    # other blocks), so the forward's rounded W re-rounds to dgrad's W
    assert torch.equal(q(w, NV16, 1), q(w, NV16, 0))
    assert not torch.equal(q(w, NV, 1), q(w, NV, 0))
    # (re-rounded under W's own tensor scale, which the QTensor carries: a scale derived again
    # from the rounded W's amax is another one under TE's rule)
    s = qt.as_qtensor(w, NV16).tensor_scale
    assert torch.equal(qt.quantize(q(w, NV16, 1), NV16.replace(axis=0), tensor_scale=s),
                       q(w, NV16, 0))
    # stochastic only where the recipe says: another seed changes dgrad and wgrad, not fprop
    o2 = linear(r, seed=6)
    assert torch.equal(o["y"], o2["y"])
    assert not torch.equal(o["gx"], o2["gx"]) and not torch.equal(o["gw"], o2["gw"])
    # and it is reproducible under manual_seed
    o3 = linear(r, seed=5)
    assert torch.equal(o["gx"], o3["gx"]) and torch.equal(o["gw"], o3["gw"])


def test_fp4_all_the_way_definition_and_bits():
    g = R.fp4_all_the_way.gemm
    assert (g.fprop_x, g.fprop_w) == (NV, NV)
    assert all(f == SR for f in (g.dgrad_dy, g.dgrad_w, g.wgrad_x, g.wgrad_dy))
    assert (g.fprop_transform, g.dgrad_transform, g.wgrad_transform) == (None, None, None)
    assert R.fp4_all_the_way.last_layers is None
    o = linear(R.fp4_all_the_way)
    w, b, x, gg = o["w"], o["b"], o["x"], o["g"]
    fwd = torch.addmm(b, q(x, NV, 1), q(w, NV, 1).t())
    assert_bits_equal(o["y"], qt.quantize(fwd, BF), "fprop")
    torch.manual_seed(5)
    dy_d, w_d = q(gg, SR, 1), q(w, SR, 0)
    dy_wt, x_w = q(gg.t(), SR, 1), q(x, SR, 0)
    assert_bits_equal(o["gx"], qt.quantize(dy_d @ w_d, BF), "dgrad")
    assert_bits_equal(o["gw"], qt.quantize(dy_wt @ x_w, BF), "wgrad")


def test_quartet_definition_and_bits():
    g = R.quartet.gemm
    mx = qt.mxfp4_e2m1
    assert (g.fprop_x, g.fprop_w) == (mx, mx)
    for f in (g.dgrad_dy, g.dgrad_w, g.wgrad_x, g.wgrad_dy):
        assert f.block_size == 32 and f.scale == qt.e8m0 and f.rounding == "stochastic"
    assert g.fprop_transform == qt.Hadamard(32, signs=None)
    assert g.dgrad_transform.size == g.wgrad_transform.size == 32
    assert g.dgrad_transform.signs is not None and g.wgrad_transform.signs is not None
    o = linear(R.quartet, tokens=64)
    w, b, x, gg = o["w"], o["b"], o["x"], o["g"]
    hf = qt.Hadamard(32, signs=None)
    fwd = torch.addmm(b, q(hf.apply(x, 1), mx, 1), q(hf.apply(w, 1), mx, 1).t())
    assert_bits_equal(o["y"], qt.quantize(fwd, BF), "fprop")
    # the forward transform changes the forward bits (it ran), the product stays close
    plain_fwd = qt.quantize(torch.addmm(b, q(x, mx, 1), q(w, mx, 1).t()), BF)
    assert not torch.equal(o["y"], plain_fwd)
    hd, hw = g.dgrad_transform, g.wgrad_transform
    sr = g.dgrad_dy
    torch.manual_seed(5)
    dy_d, w_d = q(hd.apply(gg, 1), sr, 1), q(hd.apply(w, 0), sr, 0)
    dy_wt, x_w = q(hw.apply(gg.t(), 1), sr, 1), q(hw.apply(x, 0), sr, 0)
    assert_bits_equal(o["gx"], qt.quantize(dy_d @ w_d, BF), "dgrad")
    assert_bits_equal(o["gw"], qt.quantize(dy_wt @ x_w, BF), "wgrad")


def mlp(n=7, d=32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(d, d) for _ in range(n)])


def test_last_layers_run_their_gemms_in_bf16():
    """nvfp4_nvidia on 7 Linears: the last ceil(0.15 * 7) = 2 run every GEMM operand in BF16;
    the others NVFP4. Checked on the last layer's output bits and on the installed formats."""
    m = mlp()
    qt.convert(m, R.nvfp4_nvidia)
    kinds = [mod.forward.gemm for mod in m]
    high = qt.nn.plans.GemmFormats(fprop_x=BF, fprop_w=BF, dgrad_dy=BF, dgrad_w=BF, wgrad_x=BF,
                                wgrad_dy=BF)
    assert kinds[5:] == [high, high] and all(k == R.nvfp4_nvidia.gemm["linear"] for k in kinds[:5])
    seen = {}
    m[6].register_forward_hook(lambda mod, a, out: seen.update(x=plain(a[0]), y=plain(out)))
    w, b = plain(m[6].weight.detach()), plain(m[6].bias.detach())
    m(torch.randn(16, 32)).sum().backward()
    fwd = torch.addmm(b, qt.quantize(seen["x"], BF), qt.quantize(w, BF).t())
    assert_bits_equal(seen["y"], qt.quantize(fwd, BF), "last layer fprop")
    nv_fwd = torch.addmm(b, q(seen["x"], NV, 1), q(w, NV, 1).t())
    assert not torch.equal(seen["y"], qt.quantize(nv_fwd, BF))


@pytest.mark.parametrize("n,expected", [(1, 1), (3, 3), (0.15, 2), (0.5, 4), (20, 7)])
def test_last_layers_count(n, expected):
    m = mlp()
    r = qt.Recipe(weight=(None, NV), activation=(BF, NV), grad=BF, last_layers=(n, "bf16"))
    qt.convert(m, r)
    got = [isinstance(mod.__dict__.get("forward"), qt.nn.gemm_forward.GemmForward) for mod in m]
    assert got == [False] * (7 - expected) + [True] * expected
    assert expected == min(7, n if isinstance(n, int) else math.ceil(n * 7))


def test_last_layers_errors_and_describe():
    with pytest.raises(ValueError, match="pair"):
        qt.Recipe(last_layers=2)
    with pytest.raises(ValueError, match="int >= 1"):
        qt.Recipe(last_layers=(0, BF))
    with pytest.raises(ValueError, match="int >= 1"):
        qt.Recipe(last_layers=(1.5, BF))
    assert "last 2 Linear/Conv layers: every GEMM operand in bf16" in qt.Recipe(
        last_layers=(2, BF)).describe()


def test_describe_lists_the_fp4_presets_with_sources():
    text = R.describe(print_table=False)
    for name, src in (("nvfp4_nvidia", "2509.25149"), ("fp4_all_the_way", "2505.19115"),
                      ("quartet", "2505.14669")):
        assert name in text and src in text
        assert qt.convert(nn.Linear(32, 16), name) is not None  # by name, as qt.convert(m, "...")


def test_nvfp4_nvidia_trains_a_small_mlp():
    """Not a failure mode of its own: a few Adam steps lower the loss under the preset."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                      nn.Linear(64, 1))
    x = torch.randn(256, 16)
    y = x[:, :1] * 2 - x[:, 1:2]
    qt.convert(m, R.nvfp4_nvidia)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = (plain(m(x)) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0], losses
