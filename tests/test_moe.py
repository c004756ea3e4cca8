"""Grouped GEMMs (torch._grouped_mm / F.grouped_mm, the experts of mixture-of-experts layers) on
converted models: each expert's GEMMs bit for bit those of a loop over converted nn.Linear layers
with the same formats, forward and backward (docs/moe.md)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtensor as qt


def _bits(t):
    t = t.dequantize() if isinstance(t, qt.QTensor) else t
    return t.detach().contiguous().view(torch.int32)


def _same(a, b):
    return torch.equal(_bits(a), _bits(b))


class Experts(nn.Module):
    """Experts as transformers stores them: one (E, N, K) weight, tokens sorted by expert."""

    def __init__(self, E, K, N, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(E, N, K, generator=g) / K ** 0.5)

    def forward(self, x, offs):
        return F.grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)


def _linears(experts):
    """One nn.Linear per expert, with the expert's (unconverted) weight."""
    out = []
    for w in experts.weight.detach():
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        out.append(lin)
    return out


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


_ACC = qt.recipes.mxfp8_pretraining.replace(accumulate="hopper_fp8", name=None)
RECIPES = {
    "mxfp6": qt.recipes.mxfp6,
    "mxfp8_pretraining": qt.recipes.mxfp8_pretraining,
    "nvfp4_tensor_scale": qt.Recipe(weight=("fp32", "nvfp4"), activation=("bf16", "nvfp4"),
                                    grad=("bf16", "nvfp4")),
    "accumulate": _ACC,
}


def _run_grouped_and_loop(recipe, counts, K=64, N=48, seed=0):
    E = len(counts)
    torch.manual_seed(seed)
    experts = Experts(E, K, N, seed)
    lins = _linears(experts)
    qt.convert(experts, recipe)
    for lin in lins:
        qt.convert(lin, recipe)
    M = sum(counts)
    x = torch.randn(M, K)
    gy = torch.randn(M, N)
    offs = _offsets(counts)
    xg = x.clone().requires_grad_(True)
    y = experts(xg, offs)
    (y.dequantize() * gy).sum().backward()
    ys, gxs = [], []
    start = 0
    for lin, n in zip(lins, counts):
        xi = x[start:start + n].clone().requires_grad_(True)
        yi = lin(xi)
        (yi.dequantize() * gy[start:start + n]).sum().backward()
        ys.append(yi)
        gxs.append(xi.grad)
        start += n
    return experts, lins, y, xg.grad, ys, gxs


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_mm_is_a_loop_of_linears(name):
    """Forward output, input gradient and each expert's weight gradient: the bits of a loop
    over converted nn.Linear layers with the same formats (an expert without tokens too)."""
    counts = [5, 0, 11, 7]
    experts, lins, y, gx, ys, gxs = _run_grouped_and_loop(RECIPES[name], counts)
    start = 0
    for g, n in enumerate(counts):
        assert _same(y[start:start + n], ys[g]), f"forward of expert {g}"
        assert _same(gx[start:start + n], gxs[g]), f"dgrad of expert {g}"
        if n:
            assert _same(experts.weight.grad[g], lins[g].weight.grad), f"wgrad of expert {g}"
        else:
            assert not experts.weight.grad[g].dequantize().any()
        start += n


def test_grouped_mm_operands_are_rounded():
    """The regression: _grouped_mm on QTensors ran without its operands' rounding."""
    counts = [6, 10]
    x = torch.randn(16, 64)
    w = torch.randn(2, 64, 32)
    offs = _offsets(counts)
    fmt = qt.mxfp4_e2m1
    qx = qt.as_qtensor(x, "fp32", mm_fmt=fmt)
    qw = qt.as_qtensor(w, "fp32", mm_fmt=fmt)
    y = torch._grouped_mm(qx, qw, offs)
    rx = qt.quantize(x, fmt.replace(axis=-1))
    rw = qt.quantize(w, fmt.replace(axis=-2))
    ref = torch.cat([rx[:6] @ rw[0], rx[6:] @ rw[1]])
    assert _same(y, ref)
    assert not _same(y, torch._grouped_mm(x, w, offs))
