"""The ``deepseek_v3_fp8`` preset does what DeepSeek-V3 (arXiv 2412.19437, sec. 3.3) states: the
three GEMMs of a linear layer take E4M3 operands with FP32 amax scales, activations and
activation gradients in 1x128 tiles along K (Wgrad: 128x1, along the tokens), weights in 128x128
blocks, partial sums promoted to FP32 every 128 K-elements (hopper_fp8); BF16 activations and
AdamW moments, FP32 weights and weight gradients; other contractions outside FP8."""
from __future__ import annotations

import torch
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.accum.matmul import accum_matmul

R = qt.recipes.deepseek_v3_fp8
ACT = qt.BlockFormat(qt.fp8_e4m3, 128, scale="fp32", scale_rule="amax")
W128 = qt.BlockFormat(qt.fp8_e4m3, block_shape=(128, 128), scale="fp32", scale_rule="amax")
F = qt.accum.hopper_fp8


def test_deepseek_v3_fp8_formats_and_source():
    g = R.gemm["linear"]
    assert (g.fprop_x, g.fprop_w, g.dgrad_dy, g.dgrad_w, g.wgrad_x, g.wgrad_dy) == (
        ACT, W128, ACT, W128, ACT, ACT)
    assert R.gemm["conv"] is None
    assert (R.weight.fmt, R.weight.mm_fmt, R.bias.fmt) == (qt.fp32, None, qt.fp32)
    assert (R.activation.fmt, R.activation.mm_fmt, R.grad.fmt) == (qt.bf16, None, qt.fp32)
    assert R.optimizer_state.fmt == qt.bf16 and not R.master_weights
    assert R.accumulate == F and F.chunk * F.promote == 128
    text = qt.recipes.describe(print_table=False)
    assert "deepseek_v3_fp8  (DeepSeek-V3 (arXiv 2412.19437) sec. 3.3" in text
    assert qt.recipes.PRESETS_BY_NAME["deepseek_v3_fp8"] is R


def test_deepseek_v3_fp8_gemms_bit_for_bit():
    """A converted Linear(256, 200) on 160 tokens: Fprop = hopper_fp8 sum of E4M3(x, 1x128 along
    in) and E4M3(W, 128x128), plus the bias, in BF16; Dgrad = dY (1x128 along out) times the same
    W tiles; Wgrad = dY^T and x^T in 128x1 tiles (along the tokens), an FP32 weight gradient."""
    torch.manual_seed(0)
    model = qt.convert(nn.Sequential(nn.Linear(256, 200)), R)
    lin = model[0]
    x = (torch.randn(160, 256) * 3).requires_grad_(True)
    g = torch.randn(160, 200)
    y = model(x)
    assert isinstance(y, qt.QTensor) and y.fmt == qt.bf16 and y.mm_fmt is None
    y.backward(g)
    xb = x.detach().bfloat16().float()  # the model input rounded to the activation role
    w, b = lin.weight.dequantize().detach(), lin.bias.dequantize().detach()
    wq = qt.quantize(w, W128)
    xq = qt.quantize(xb, ACT)
    want = (accum_matmul(xq, wq.t(), F) + b).bfloat16().float()
    assert_bits_equal(y.dequantize().detach(), want, "fprop")
    assert not torch.equal(want, (xq @ wq.t() + b).bfloat16().float())  # (the accumulator acts)
    dx = x.grad.dequantize() if isinstance(x.grad, qt.QTensor) else x.grad
    assert_bits_equal(dx, accum_matmul(qt.quantize(g, ACT), wq, F), "dgrad")
    gw = lin.weight.grad
    assert isinstance(gw, qt.QTensor) and gw.fmt == qt.fp32
    xt, gt = qt.quantize(xb.t().contiguous(), ACT), qt.quantize(g.t().contiguous(), ACT)
    assert_bits_equal(gw.dequantize(), accum_matmul(gt, xt.t(), F), "wgrad")


def test_deepseek_v3_fp8_trains_with_bf16_moments_and_a_bf16_head():
    """AdamW steps run, leak_check clean; the moments are BF16; a rule keeps the output head out
    of FP8 (its product takes the BF16 activation and the FP32 weight as they are)."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 64))
    model = qt.convert(net, R.replace(rules={"2": qt.bf16}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, target = torch.randn(32, 128), torch.randint(0, 64, (32,))
    losses, seen = [], {}
    net[2].register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    with qt.leak_check(action="raise", optimizer=opt, check_values=True):
        for _ in range(3):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x).dequantize(), target)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    state = opt.state[net[0].weight]
    assert state["exp_avg"].fmt == qt.bf16 and state["exp_avg_sq"].fmt == qt.bf16
    head = net[2]
    opt.zero_grad()
    model(x)  # (the weights after the last step)
    h = seen["x"]  # the head's input: BF16 activation values, which it multiplies as they are
    assert isinstance(h, qt.QTensor) and h.fmt == qt.bf16
    want = (accum_matmul(h.dequantize().detach(), head.weight.dequantize().detach().t(), F)
            + head.bias.dequantize().detach()).bfloat16().float()
    assert_bits_equal(seen["y"].dequantize().detach(), want, "head in higher precision")
