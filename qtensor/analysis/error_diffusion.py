"""Error diffusion (after Khodamoradi et al. 2024, arXiv 2410.11203: hyperparameter-free, no
Hessian, no backpropagation, the quantization error diffused layer by layer) on one flattened
weight, the loop of ``qt.error_diffusion`` (the model-level flow: :mod:`qtensor.analysis.ptq`):
the layer's output error on the calibration batch, u = X W^T - X~ Q^T (X the FP32 model's input
of the layer, X~ the quantized model's, which carries the error of the layers before), is
carried from column to column; each column is rounded from the value that cancels the most of
it, v_t = (x~_t . (u + x_t w_t)) / |x~_t|^2 (the greedy path-following rule of Lybrand and
Saab 2021). The paper's method section was not available to this implementation:
docs/analysis.md.
"""
from __future__ import annotations

import torch

from .weight_grid import _Grid


def _diffusion_matrix(w: torch.Tensor, x: torch.Tensor, xq: torch.Tensor,
                      grid: _Grid) -> torch.Tensor:
    q = torch.zeros_like(w)
    u = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)  # the output error, carried
    every = torch.arange(w.shape[0])
    for a, b in grid.groups:
        # within a block the error is carried through the block's Gram matrices (n x n), not
        # the (N x out) error itself: x~_c . u = p_c + sum_{j<c} (g1_cj w_j - g2_cj q_j)
        xg, xqg, wg = x[:, a:b], xq[:, a:b], w[:, a:b].T  # wg: (n, out)
        p = xqg.T @ u
        g1, g2 = xqg.T @ xg, xqg.T @ xqg
        live = torch.diagonal(g2) > 0  # an input always zero in the quantized model: keep w
        d1, d2 = torch.diagonal(g1)[:, None], torch.where(live, torch.diagonal(g2), 1.0)[:, None]
        cur = torch.where(live[:, None], (p + d1 * wg) / d2, wg).T  # the values at the start
        scale = grid.scales(cur, a, b)
        rows = every
        while len(rows):
            qg = torch.zeros(b - a, len(rows), dtype=torch.float64)
            sc = scale[rows] if scale is not None else None
            for j in range(b - a):
                v = wg[j, rows]
                if live[j]:
                    v = (p[j, rows] + g1[j, :j] @ wg[:j, rows] - g2[j, :j] @ qg[:j]
                         + g1[j, j] * v) / g2[j, j]
                qg[j] = grid.round(v, sc, rows, a + j)
            q[rows, a:b] = qg.T
            lower = grid.unsettled(q[rows, a:b], sc, rows, a, b)
            if scale is not None:
                scale[rows] = sc
            rows = rows[lower]
        u += xg @ wg - xqg @ q[:, a:b].T
    return q
