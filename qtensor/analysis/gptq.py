"""GPTQ (Frantar et al. 2022, arXiv 2210.17323) on one flattened weight, the loop of ``qt.gptq``
(the model-level flow: :mod:`qtensor.analysis.ptq`): the weight's columns (the reduction axis)
are rounded one at a time, and the rounding error of each is compensated on the columns not yet
rounded through the inverse Hessian of the layer's least-squares problem (H = 2 X^T X / N, X
the layer's input as the contraction receives it in the partly quantized model, damped by
``damp`` times its mean diagonal), with lazy batch updates one block at a time. With
``act_order=True`` the columns are taken in decreasing order of the Hessian diagonal, kept
to the format's blocks (:meth:`qtensor.analysis.weight_grid._Grid.act_order`,
docs/analysis.md).
"""
from __future__ import annotations

import torch

from .weight_grid import _Grid


def _gptq_matrix(w: torch.Tensor, xq: torch.Tensor, grid: _Grid, damp: float,
                 act_order: bool = False) -> torch.Tensor:
    w = w.clone()
    n = xq.shape[0]
    h = 2.0 * xq.T @ xq / n
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0  # an input that is always zero: its weight does not matter (GPTQ)
    perm = None
    if act_order:  # the columns in the order of grid.act_order (the diagonal before damping)
        perm = grid.act_order(torch.diagonal(h).clone())
        w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    try:
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except RuntimeError as e:  # torch.linalg.LinAlgError
        raise ValueError(f"qt.gptq: {grid.name}: the damped Hessian is not positive definite "
                         f"({e}); raise damp") from e
    q = torch.zeros_like(w)
    every = torch.arange(w.shape[0])
    for a, b in grid.groups:
        w0 = w[:, a:b].clone()
        scale = grid.scales(w0, a, b)
        err = torch.zeros_like(w0)
        rows = every
        while len(rows):
            wg = w0[rows].clone()
            sc = scale[rows] if scale is not None else None
            for j in range(b - a):
                c = a + j
                qc = grid.round(wg[:, j], sc, rows, c)
                e = (wg[:, j] - qc) / u[c, c]
                wg[:, j + 1:] -= e[:, None] * u[c, c + 1:b][None, :]
                q[rows, c] = qc
                err[rows, j] = e
            lower = grid.unsettled(q[rows, a:b], sc, rows, a, b)
            if scale is not None:
                scale[rows] = sc
            rows = rows[lower]
        w[:, b:] -= err @ u[a:b, b:]
    return q if perm is None else q[:, torch.argsort(perm)]
