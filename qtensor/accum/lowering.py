"""Contractions of QTensor (qtensor/tensor/dispatch.py) summed by an accumulator: each aten
contraction lowered to accum_matmul calls (the added term as the initial accumulator where it
is one, the epilogue in the payload precision), convolutions through their GEMMs (conv)."""
from __future__ import annotations

import torch

from . import kernel as _kernel
from .blocks import _block_matmul, _emin_of
from .conv import _conv, _conv_transpose, _conv_weight_grad, _geometry
from .format import AccumFormat

# Contractions of QTensor (qtensor/tensor/dispatch.py): the aten contraction ``packet`` on unwrapped,
# operand-rounded arguments, with the products summed by ``f``. The added term beta * C of
# addmm, baddbmm, addbmm, addmv and _addmm_activation, where C has the output's full shape and
# alpha == 1, is the datapath's initial accumulator; a broadcast C (a bias), alpha != 1, linear's
# bias and the activation of _addmm_activation are applied afterwards in the payload precision,
# as a GEMM epilogue does.

def _f32(x: torch.Tensor, packet: str) -> torch.Tensor:
    if x.dtype == torch.float64:
        y = x.float()
        if not torch.equal(y.double(), x):
            raise TypeError(f"qt.accum: {packet} with an accumulator format takes float32 "
                            "values; this float64 payload is not exactly float32")
        return y
    return x


def _arg(uargs, ukwargs, pos, name, default):
    return uargs[pos] if len(uargs) > pos else ukwargs.get(name, default)


def _epilogue(prod, bias, beta, alpha):
    out = prod if alpha == 1 else prod * alpha
    if bias is None or beta == 0:
        return out
    return out + (bias if beta == 1 else bias * beta)


CONTRACTIONS = ("mm", "bmm", "addmm", "_addmm_activation", "baddbmm", "addbmm", "mv", "addmv",
                "dot", "vdot", "linear", "convolution", "_convolution", "convolution_backward")



def contract(packet: str, uargs, ukwargs, f: AccumFormat, qargs=None) -> torch.Tensor:
    """The contraction ``packet`` (an aten op name) summed by ``f``; the payload dtype out.

    qargs: the op's original arguments (QTensors among them), whose formats give each operand's
    minimum normal exponent (MMA-Sim aligns a subnormal operand there)."""
    if packet not in CONTRACTIONS:
        raise NotImplementedError(
            f"qt.accum: {packet} has no accumulator emulation (supported: "
            f"{', '.join(CONTRACTIONS)}; matmul, einsum, F.linear, F.conv*d and "
            "F.conv_transpose*d decompose into these); drop the QTensor's .accum (or the "
            "Recipe's accumulate=) for it")
    q = list(qargs) if qargs is not None else []
    em = [_emin_of(q[i]) if i < len(q) else None for i in range(3)]
    qq = q + [None] * (3 - len(q))
    if packet in ("convolution", "_convolution"):
        return _conv_forward(uargs, ukwargs, f, em, qq)
    if packet == "convolution_backward":
        return _conv_backward(uargs, ukwargs, f, em, qq)
    out = ukwargs.get("out")
    ukwargs = {k: v for k, v in ukwargs.items() if k != "out"}
    t = [_f32(x, packet) if isinstance(x, torch.Tensor) else x for x in uargs]
    dtype = next(x.dtype for x in uargs if isinstance(x, torch.Tensor))
    e01 = dict(a_emin=em[0], b_emin=em[1])
    if packet in ("mm", "bmm"):
        res = _block_matmul(t[0], qq[0], t[1], qq[1], f, e01)
    elif packet in ("dot", "vdot"):
        res = _kernel._matmul(t[0][None], t[1][:, None], f, **e01)[0, 0]
    elif packet == "mv":
        res = _kernel._matmul(t[0], t[1][:, None], f, **e01)[:, 0]
    elif packet == "linear":
        x, w = t[0], t[1]
        bias = _arg(t, ukwargs, 2, "bias", None)
        x2 = x[None] if x.dim() == 1 else x
        res = _block_matmul(x2, qq[0], w.t(), qq[1], f, e01)
        res = _epilogue(res[0] if x.dim() == 1 else res, bias, 1, 1)
    else:  # an added term: (self, mat1, mat2, *, beta, alpha)
        bias, a, b = t[0], t[1], t[2]
        beta = _arg(t, ukwargs, 3, "beta", 1)
        alpha = _arg(t, ukwargs, 4, "alpha", 1)
        e12 = dict(a_emin=em[1], b_emin=em[2])
        # a C of the output's full shape is an accumulator: beta * C (rounded to float32 once)
        # is the first instruction's accumulator input (an mma's C operand). A broadcast C (a
        # bias: nn.Linear's addmm) and alpha != 1 stay in the epilogue (cuBLASLt's bias epilogue)
        oshape = (a.shape[0],) if packet == "addmv" else (
            (a.shape[1], b.shape[2]) if packet == "addbmm" else (*a.shape[:-1], b.shape[-1]))
        # (the ranks first: a tuple == compares items first, a guard on a dynamic batch size)
        fed = (alpha == 1 and beta != 0 and isinstance(bias, torch.Tensor)
               and bias.dim() == len(oshape) and tuple(bias.shape) == oshape)
        if fed:
            c = (bias if beta == 1 else bias * beta).float()
            e12["c"] = c[:, None] if packet == "addmv" else c
        if packet == "addmv":
            prod = _kernel._matmul(a, b[:, None], f, **e12)[:, 0]
        elif packet == "addbmm":  # the sum over the batch is one longer contraction
            B, M, K = a.shape
            prod = _kernel._matmul(a.transpose(0, 1).reshape(M, B * K), b.reshape(B * K, -1), f,
                                **e12)
        else:
            prod = _block_matmul(a, qq[1], b, qq[2], f, e12)
        res = prod if fed else _epilogue(prod, bias, beta, alpha)
        if packet == "_addmm_activation":  # ATen's GELU: exact on CPU, tanh (cuBLASLt) on CUDA
            gelu = _arg(t, ukwargs, 5, "use_gelu", False)
            approx = "tanh" if res.is_cuda else "none"
            res = (torch.nn.functional.gelu(res, approximate=approx) if gelu
                   else torch.relu(res))
    res = res.to(dtype)
    if out is not None:
        return out.copy_(res)
    return res


_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed",
              "output_padding", "groups")


def _conv_forward(uargs, ukwargs, f, em=(None, None, None), q=(None, None, None)):
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = (
        _arg(uargs, ukwargs, i, n, None) for i, n in enumerate(_CONV_ARGS))
    # torch's own checks (channels, groups, sizes) and output size, on an empty batch
    size = torch.ops.aten.convolution(x[:0], w, None, stride, padding, dilation, transposed,
                                      output_padding, groups).shape[2:]
    nd = w.dim() - 2
    geo = _geometry(stride, padding, dilation, groups, nd)
    x32, w32 = _f32(x, "convolution"), _f32(w, "convolution")
    out = (_conv_transpose if transposed else _conv)(x32, w32, geo, size, f, (em[0], em[1]),
                                                     (q[0], q[1]))
    if bias is not None:
        out = out + bias.view(-1, *[1] * nd)
    return out.to(x.dtype)


def _conv_backward(uargs, ukwargs, f, em=(None, None, None), q=(None, None, None)):
    (go, x, w, _bias_sizes, stride, padding, dilation, transposed, _output_padding, groups,
     mask) = uargs[:11]
    nd = w.dim() - 2
    geo = _geometry(stride, padding, dilation, groups, nd)
    go32, x32, w32 = (_f32(t, "convolution_backward") for t in (go, x, w))
    gi = gw = gb = None
    if mask[0]:  # the adjoint of the forward map: a transposed convolution, or the converse
        gi = (_conv if transposed else _conv_transpose)(go32, w32, geo, x.shape[2:], f,
                                                        (em[0], em[2]), (q[0], q[2]))
        gi = gi.to(go.dtype)
    if mask[1]:  # a transposed convolution's weight is that of the forward map go -> x
        a, b = (go32, x32) if transposed else (x32, go32)
        eab = (em[0], em[1]) if transposed else (em[1], em[0])
        qab = (q[0], q[1]) if transposed else (q[1], q[0])
        gw = _conv_weight_grad(a, b, w.shape[2:], geo, f, eab, qab).to(go.dtype)
    if mask[2]:  # grad_bias: a sum of grad_output values, not a contraction
        gb = go.sum([0, *range(2, go.dim())])
    return (gi, gw, gb)


