"""Writes tests/convert/data/converted_model_before_split.pt: a whole converted model
torch.save'd by the flat layout (qtensor/convert.py, qtensor/plans.py, ...; run it from a
checkout of that layout, e.g. commit 4935e4d), with its forward output and weight gradients as
bits."""
import sys

import torch
from torch import nn
import qtensor as qt
try:
    from qtensor.nn.plans import GemmFormats
except ImportError:  # the flat layout
    from qtensor.plans import GemmFormats



def _plain(t):
    return t.dequantize() if isinstance(t, qt.QTensor) else t


torch.manual_seed(0)
r = qt.Recipe(weight="fp8_e4m3", bias="bf16", activation="bf16", grad="bf16",
              rules={"4": None},
              gemm=GemmFormats(fprop_x=qt.fp8_e4m3, fprop_w=qt.fp8_e4m3, dgrad_dy=qt.fp8_e5m2))
# torch.nn classes only: the pickle names nothing of the script's
m = qt.convert(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4),
                             nn.Linear(4, 4)), r)
x = torch.randn(6, 8)
path = sys.argv[1]
torch.save(m, path)
m.train()
out = m(x)
out.dequantize().sum().backward() if isinstance(out, qt.QTensor) else out.sum().backward()
want = {"out": _plain(out).detach().clone(),
        "grads": {n: _plain(p.grad).detach().clone() for n, p in m.named_parameters()},
        "running_mean": _plain(m[1].running_mean).detach().clone()}
torch.save({"x": x, "want": want}, path + ".expected")
print(type(m.forward), type(m[0].forward), [type(h) for h in m[0]._forward_hooks.values()], type(out))
