"""The cost of recovering block scales in QTensor contractions (qtensor/accum/blocks.py `_scale_plan`,
docs/accum.md "Block scales through QTensor contractions"): a 128 x 512 x 128 product of
operands rounded to NVFP4, MXFP4 and MXFP8 (both operands' scales; MXFP8: the per-element clamps
of blackwell_mxf8f6f4), one thread, the best of 7 runs of 20 calls, next to the kernel's time.

    python benchmarks/bench_block_scales.py
"""
import time

import torch

import qtensor as qt
from qtensor import accum
from qtensor.accum import blocks as accum_blocks


def best(fn, n=20, reps=7):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            out = fn()
        times.append((time.perf_counter() - t) / n)
    return min(times), out


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 512, generator=g), torch.randn(512, 128, generator=g)
    for name, f in [("nvfp4", accum.blackwell_nvfp4), ("mxfp4", accum.blackwell_mxfp4),
                    ("mxfp8_e4m3", accum.blackwell_mxf8f6f4)]:
        fa = qt.formats.format(name).replace(axis=-1)
        fb = qt.formats.format(name).replace(axis=-2)
        qa, qb = qt.quantize(a, fa), qt.quantize(b, fb)
        A, B = qt.QTensor(qa, fa), qt.QTensor(qb, fb)
        plan = lambda: accum_blocks._scale_plan(f, qa, A, qb, B)  # noqa: E731
        plan()
        tp, (a2, b2, kw, _post) = best(plan)
        tk, _ = best(lambda: accum.accum_matmul(a2, b2, f, **kw))
        print(f"{name}: scale recovery {tp * 1e3:.2f} ms, kernel {tk * 1e3:.2f} ms "
              f"(passes {', '.join(sorted(kw))})")


if __name__ == "__main__":
    main()
