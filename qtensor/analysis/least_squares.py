"""A layer that qt.gptq and qt.error_diffusion process, as least-squares problems: the rows that
multiply its weight and its weight as matrices whose columns run along the reduction axis (the
axis its contraction blocks), one problem per conv group; and the formats of its forward GEMM.

Convolutions are least-squares problems on their patches (the windows of the padded input
under each output position, input channels innermost); a grouped convolution is one problem per
group (its output channels, on the patches of its input channels, with its own Hessian), whose
weights share the tensor scale; a transposed convolution is the forward convolution (stride 1)
of its zero-inserted input with its flipped, transposed kernel, solved as that one (its weight
blocks, along its input channels, are the same).
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.gemm_forward import gemm_formats
from ..tensor.subclass import QTensor


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _input_axis(mod: nn.Module) -> int:
    """The axis along which the contraction rounds the layer's input (its blocks' axis)."""
    return -1 if isinstance(mod, nn.Linear) else 1


def _weight_axis(mod: nn.Module) -> int:
    """The axis along which the contraction rounds the weight: in_features of a Linear, the
    input channels of a Conv (dim 1 of (O, C/groups, *k)) and of a ConvTranspose (dim 0 of
    (C, O/groups, *k))."""
    return -1 if isinstance(mod, nn.Linear) else 0 if isinstance(mod, _TRANSPOSED) else 1


def _pad(x: torch.Tensor, pads) -> torch.Tensor:
    """x (B, C, *S) zero-padded by (lo, hi) per spatial dim; negative amounts crop."""
    return F.pad(x, [p for lo_hi in reversed(pads) for p in lo_hi])


def _columns(mod: nn.Module, x: torch.Tensor, output_size=None) -> torch.Tensor:
    """The rows (groups, N, K/groups) that multiply each group's flattened weight (see
    :func:`_flat_weight`): a Linear's inputs (one group); a convolution's patches (the windows
    of its padded input under each output position, built with Tensor.unfold on each spatial
    dim, input channels innermost), one set per conv group from that group's channels. A
    transposed convolution is the convolution (stride 1) of its input with zeros inserted
    between the elements (stride - 1 of them), padded by dilation * (k - 1) - padding (and the
    output padding at the end), with the flipped, transposed kernel: its patches are those."""
    x = x.double()
    if isinstance(mod, nn.Linear):
        return x.reshape(1, -1, x.shape[-1])
    nd = len(mod.kernel_size)
    if x.dim() == nd + 1:  # an unbatched input
        x = x.unsqueeze(0)
    k, dil = mod.kernel_size, mod.dilation
    if isinstance(mod, _TRANSPOSED):
        b, c, *size = x.shape
        z = x.new_zeros(b, c, *((n - 1) * s + 1 for n, s in zip(size, mod.stride)))
        z[(..., *(slice(None, None, s) for s in mod.stride))] = x
        op = mod._output_padding(x, output_size, list(mod.stride), list(mod.padding),
                                 list(k), nd, list(dil))
        pads = [(d * (kk - 1) - p, d * (kk - 1) - p + o)
                for kk, d, p, o in zip(k, dil, mod.padding, op)]
        x, stride = z, (1,) * nd
    else:
        pad = (0,) * nd if isinstance(mod.padding, str) else mod.padding  # 'valid'
        pads, stride = [(p, p) for p in pad], mod.stride
    x = _pad(x, pads)
    for i, (kk, s, d) in enumerate(zip(k, stride, dil)):
        x = x.unfold(2 + i, d * (kk - 1) + 1, s)
    win = x[(..., *(slice(None, None, d) for d in dil))]  # (B, C, *L, *k)
    b, c = win.shape[:2]
    g = mod.groups
    win = win.reshape(b, g, c // g, -1, math.prod(k)).permute(1, 0, 3, 4, 2)  # (G, B, L, P, Cg)
    return win.reshape(g, -1, math.prod(k) * (c // g))


def _grouped_kernel(mod: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """A convolution's weight as (groups, O/groups, C/groups, *k), the kernel of each group's
    forward convolution (a ConvTranspose's: transposed and flipped, see :func:`_columns`)."""
    g = mod.groups
    if isinstance(mod, _TRANSPOSED):
        c, og, *k = w.shape
        return w.reshape(g, c // g, og, *k).transpose(1, 2).flip(list(range(3, 3 + len(k))))
    o, cg, *k = w.shape
    return w.reshape(g, o // g, cg, *k)


def _flat_weight(mod: nn.Module, w: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """The weight as matrices (groups, out/groups, K/groups) whose columns run along the
    reduction axis innermost (the blocks' axis), and the length of one run (in_features; a
    Conv's input channels per group)."""
    if isinstance(mod, nn.Linear):
        return w[None], w.shape[1]
    kern = _grouped_kernel(mod, w)
    g, og, cg = kern.shape[:3]
    return kern.reshape(g, og, cg, -1).permute(0, 1, 3, 2).reshape(g, og, -1), cg


def _unflatten_weight(mod: nn.Module, flat: torch.Tensor, shape) -> torch.Tensor:
    if isinstance(mod, nn.Linear):
        return flat[0].reshape(shape)
    k = tuple(_grouped_kernel(mod, torch.empty(shape, device="meta")).shape[3:])
    g, og = flat.shape[:2]
    kern = flat.reshape(g, og, math.prod(k), -1).permute(0, 1, 3, 2).reshape(g, og, -1, *k)
    if isinstance(mod, _TRANSPOSED):
        kern = kern.flip(list(range(3, 3 + len(k)))).transpose(1, 2)
    return kern.reshape(shape)


def _fprop(mod: nn.Module, x=None) -> tuple:
    """(x format, W format, transform) of the layer's forward GEMM (``Recipe.gemm`` included);
    a ConvTranspose (no per-GEMM formats): its operands' own formats."""
    used = gemm_formats(mod, getattr(x, "mm_fmt", None), x_plain=not isinstance(x, QTensor))
    if used is not None:
        return used["fprop"]
    w = mod.weight
    return (getattr(x, "mm_fmt", None) if isinstance(x, QTensor) else None,
            w.mm_fmt if isinstance(w, QTensor) else None, None)
