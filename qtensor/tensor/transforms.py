"""Orthogonal transforms of GEMM operands along the reduction dimension (``Recipe.gemm``'s
``"transform"``): :class:`Hadamard`, the (random) Hadamard transform of the NVFP4 and MXFP4
training recipes.

A GEMM C = A B sums over K. For an orthogonal Q (Q Q^T = I) acting on K, (A Q)(Q^T B) = A B: the
transform changes nothing in exact arithmetic, but the transformed operands are rounded to their
operand formats, and the transform spreads a block's outlier over the block, which the block scale
then fits better. Both operands of the GEMM get the same Q along K (for B: Q^T B, i.e. B's K-rows
mixed by the same matrix), so the product is preserved.
Details: docs/convert.md, "Transforms of the GEMM operands".
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = ["Hadamard", "TE_WGRAD_SIGNS", "sylvester"]

# Transformer Engine's hard-coded sign vector of the NVFP4 weight-gradient RHT
# (transformer_engine/pytorch/tensor/nvfp4_tensor.py, get_wgrad_sign_vector)
TE_WGRAD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def sylvester(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix with entries +-1 (n a power of two), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@dataclass(frozen=True)
class Hadamard:
    """The block-diagonal (random) Hadamard transform along a GEMM's reduction dimension K: each
    run of ``size`` consecutive K indices (a row vector v of them) becomes
    ``v @ (diag(s) @ H) / sqrt(size)``, H the Sylvester Hadamard matrix, s a sign vector.

    ``signs``: ``"te"`` (default: Transformer Engine's fixed NVFP4 wgrad vector, size 16 only),
    ``None`` (no signs: the plain Hadamard transform), or an int seed (signs drawn from
    ``torch.Generator().manual_seed(seed)``: reproducible, the same on every machine).
    The transform is computed in float64 and rounded once to the payload dtype (float32), so it
    is the same bits on every device. A trailing run of K shorter than ``size`` is left as it
    is (the identity is orthogonal too: the product is still exact).
    """

    size: int = 16
    signs: Union[str, int, None] = "te"

    def __post_init__(self):
        n = self.size
        if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n & (n - 1):
            raise ValueError(f"Hadamard: size must be a power of two >= 2, got {n!r}")
        s = self.signs
        if s == "te":
            if n != 16:
                raise ValueError(f"Hadamard: signs='te' is Transformer Engine's 16-entry vector; "
                                 f"size {n} needs signs=None or an int seed")
        elif s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise ValueError(f"Hadamard: signs must be 'te', None or an int seed, got {s!r}")

    def sign_vector(self) -> torch.Tensor:
        """The signs s (float64, +-1)."""
        if self.signs == "te":
            return torch.tensor(TE_WGRAD_SIGNS, dtype=torch.float64)
        if self.signs is None:
            return torch.ones(self.size, dtype=torch.float64)
        g = torch.Generator().manual_seed(self.signs)
        return torch.randint(0, 2, (self.size,), generator=g).to(torch.float64) * 2 - 1

    def matrix(self) -> torch.Tensor:
        """diag(s) @ H / sqrt(size) (float64, orthogonal): v @ matrix() transforms a run v."""
        return _matrix(self).clone()

    def apply(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        """x transformed along ``axis`` (runs of ``size`` consecutive indices; a shorter tail is
        left as it is), in x's dtype."""
        if not x.is_floating_point():
            return x
        axis = axis % x.dim()
        k = x.shape[axis]
        full = k - k % self.size
        if full == 0:
            return x
        mode = _fake_mode(x)
        if mode is None:
            m = _matrix(self).to(x.device)
        else:
            # a traced x (fake tensors: compile, export) cannot meet the cached real tensor:
            # the matrix made under x's fake mode, a constant of the graph
            with mode:
                m = torch.tensor(_matrix_values(self), dtype=torch.float64, device=x.device)
        moved = x.movedim(axis, -1)
        head = moved[..., :full].to(torch.float64)
        head = head.reshape(*head.shape[:-1], full // self.size, self.size) @ m
        head = head.reshape(*moved.shape[:-1], full).to(x.dtype)
        out = torch.cat([head, moved[..., full:]], -1) if full < k else head
        return out.movedim(-1, axis).contiguous()

    def __str__(self) -> str:
        s = {"te": "TE signs", None: "no signs"}.get(self.signs, f"signs seed {self.signs}")
        return f"Hadamard({self.size}, {s})"


@functools.lru_cache(maxsize=64)
def _matrix_values(h: Hadamard) -> list:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():  # (called inside a trace: the real values)
        return _matrix(h).tolist()


def _fake_mode(x):
    """The fake tensor mode of a traced x (compile, export), else None."""
    if type(x) is torch.Tensor:
        return None
    from torch._subclasses.fake_tensor import maybe_get_fake_mode
    return maybe_get_fake_mode(x)


@functools.lru_cache(maxsize=64)
def _matrix(h: Hadamard) -> torch.Tensor:  # built once per transform (a frozen, hashable value)
    return h.sign_vector()[:, None] * sylvester(h.size) / h.size ** 0.5


def check_transform(t, what: str) -> Optional[Hadamard]:
    """t if it is a transform (None passes), else a TypeError naming ``what``."""
    if t is None or isinstance(t, Hadamard):
        return t
    raise TypeError(f"{what}: a transform must be a qt.Hadamard (or None), got "
                    f"{type(t).__name__}: {t!r}")
