"""What the Triton launchers share: dtypes, layouts, launch sizes and the stochastic key."""
import os

import torch
import triton

from ..reference import seed_key

MAX_DIMS = 4  # the strided dims the kernels address (more: a contiguous copy)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launcher(kernel):
    """kernel, wrapped for torch.compile (torch.library.wrap_triton) where the launch is a real
    GPU one; the interpreter's kernels are called as they are (wrapping them breaks
    tracing)."""
    if interpreted() or not torch.cuda.is_available():
        return kernel
    return torch.library.wrap_triton(kernel)


def key_and_mode(seed: int, rounding: int):
    """(the 32-bit key of the seed, the bits OR-ed into each random word, the base mode) of the
    op's seed and rounding arguments (round.h sr_or_mask, mode_base)."""
    base, drop = rounding & 0xFF, rounding >> 8
    if not (0 <= base <= 3 and (drop == 0 or (base == 3 and 1 <= drop <= 31))):
        raise RuntimeError(
            f"rounding must be 0 (nearest), 1 (nearest_away), 2 (toward_zero), 3 (stochastic) or "
            f"3 + 256 * (32 - N) (stochastic with N = 1..31 random bits), got {rounding}")
    return seed_key(seed), (1 << drop) - 1 if drop else 0, base


def launch_args(n: int):
    """(elements per program, grid) of an elementwise launch: large programs under the
    interpreter (each program costs ~7 ms there), GPU-sized ones otherwise."""
    block = 16384 if interpreted() else 1024
    return block, (triton.cdiv(n, block),)


def prepare(x: torch.Tensor, out):
    """(x as float32, the float32 tensor the kernel writes: out itself where it can). float16
    and bfloat16 go through float32 (torch's exact widening and nearest-even narrowing, as the
    CPU kernels' loads and stores)."""
    xf = x if x.dtype is torch.float32 else x.float()
    if out is not None and out.dtype is torch.float32:
        if _dims(xf, out) is None:
            xf = xf.contiguous()
        if _dims(xf, out) is not None:
            return xf, out
    if _dims(xf, xf) is None:
        xf = xf.contiguous()
    return xf, torch.empty_like(xf, memory_format=torch.contiguous_format)


def finish(x, y, out):
    """The launcher's result: out (written by the kernel, or from y), else y as x's dtype."""
    if out is not None and y is out:
        return out
    if x.dtype is not torch.float32:
        y = _narrow(y, x.dtype)
    return y if out is None else out.copy_(y)


def _narrow(y, dtype):
    """float32 y as float16/bfloat16 as the CPU kernels store it (c10's conversions: a NaN
    becomes the canonical quiet NaN, signed for float16, +0x7FC0 for bfloat16)."""
    q = y.to(dtype)
    nan = (0x7E00 | (y.view(torch.int32) < 0).to(torch.int16) << 15) if dtype is torch.float16 \
        else torch.tensor(0x7FC0, dtype=torch.int16, device=y.device)
    return torch.where(torch.isnan(y), nan.to(torch.int16), q.view(torch.int16)).view(dtype)


def _dims(x, y):
    """x's and y's layouts as at most MAX_DIMS joint (size, x stride, y stride) dims, or None."""
    dims = [(s, a, b) for s, a, b in zip(x.shape, x.stride(), y.stride()) if s != 1]
    merged = []
    for s, a, b in dims:
        if merged and merged[-1][1] == a * s and merged[-1][2] == b * s:
            ps, _, _ = merged[-1]
            merged[-1] = (ps * s, a, b)
        else:
            merged.append((s, a, b))
    if len(merged) > MAX_DIMS:
        return None
    return [(1, 0, 0)] * (MAX_DIMS - len(merged)) + merged


def elementwise_layout(x, y):
    """(sizes, x strides, y strides, x contiguous, y contiguous) for the kernels' _offsets."""
    d = _dims(x, y)
    shape = [s for s, _, _ in d]
    xs = [a for _, a, _ in d]
    ys = [b for _, _, b in d]
    return shape, xs, ys, x.is_contiguous(), y.is_contiguous()
