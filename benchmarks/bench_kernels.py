"""Kernel speed: each quantization's median time and its ratio to ``out.copy_(x)`` in the same run.

    python benchmarks/bench_kernels.py                 # CPU, 2 threads, 2^24 float32 elements
    python benchmarks/bench_kernels.py --device cuda --json benchmarks/results/kernels_cuda.json

Rows: fp8_e4m3, fp8_e5m2, bf16, fp6_e3m2, fp4_e2m1, fixed 8.4 (nearest), fp8_e4m3 stochastic,
mxfp8_e4m3, mxfp6_e3m2, mxfp4_e2m1, mxint8, nvfp4, nvfp4_single, mxfp4_e2m1 stochastic, nvfp4
stochastic, nvfp4_4over6 (the recipe's 4over6 format) (blocks on a 4096x4096 tensor). Beside each:
torch's native cast round trip where torch has the dtype, and QPyTorch / torchao when installed.
Every qtensor row writes into a preallocated output (``out=``), like copy_. The extra memory a
kernel needs beyond its output is measured too (peak RSS growth on CPU, peak allocation on CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import qtensor as qt  # noqa: E402
from qtensor.kernels import ops  # noqa: E402

ROWS = [  # (label, format, rounding, native dtype, qtorch call, torchao call)
    ("fp8_e4m3", "fp8_e4m3", None, "float8_e4m3fn", ("float", 4, 3, "nearest"), "fp8"),
    ("fp8_e5m2", "fp8_e5m2", None, "float8_e5m2", ("float", 5, 2, "nearest"), None),
    ("bf16", "bf16", None, "bfloat16", ("float", 8, 7, "nearest"), None),
    ("fp6_e3m2", "fp6_e3m2", None, None, ("float", 3, 2, "nearest"), None),
    ("fp4_e2m1", "fp4_e2m1", None, None, ("float", 2, 1, "nearest"), None),
    ("fixed 8.4 nearest", "fixed8.4", None, None, ("fixed", 8, 4, "nearest"), None),
    ("fp8_e4m3 stochastic", "fp8_e4m3", "stochastic", None, ("float", 4, 3, "stochastic"), None),
    ("mxfp8_e4m3", "mxfp8_e4m3", None, None, None, "mxfp8"),
    ("mxfp6_e3m2", "mxfp6_e3m2", None, None, None, None),
    ("mxfp4_e2m1", "mxfp4_e2m1", None, None, None, "mxfp4"),
    ("mxint8", "mxint8", None, None, ("block", 8, 0, "nearest"), None),
    ("nvfp4", "nvfp4", None, None, None, "nvfp4"),
    ("nvfp4_single", "nvfp4_single", None, None, None, None),
    ("mxfp4_e2m1 stochastic", "mxfp4_e2m1", "stochastic", None, None, None),
    ("nvfp4 stochastic", "nvfp4", "stochastic", None, None, None),
    ("nvfp4_4over6", "nvfp4_4over6", None, None, None, None),
]


def _format(name):
    """A preset, or the nvfp4_4over6 recipe's 4over6 operand format (no preset of its own)."""
    if name == "nvfp4_4over6":
        from qtensor.nn.recipes import _nvfp4_4over6
        return _nvfp4_4over6
    return qt.format(name)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device, repeat):
    fn()  # warm up (and first-call costs)
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_times(fn, ref, device, repeat):
    """Median times of fn and of ref (copy_), measured alternately so that drift (other
    processes on a shared machine) hits both alike."""
    fn(); ref()
    sync(device)
    a, b = [], []
    for _ in range(repeat):
        for f, acc in ((ref, b), (fn, a)):
            t0 = time.perf_counter()
            f()
            sync(device)
            acc.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def rss_peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def extra_memory(fn, device, x, out):
    """Bytes a call needs beyond x and its preallocated output."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    before = rss_peak_bytes()
    fn()
    return max(0, rss_peak_bytes() - before)


def load_qtorch():
    try:
        from qtorch.quant import block_quantize, fixed_point_quantize, float_quantize
    except Exception as e:  # noqa: BLE001 (any failure: not installed, cannot build)
        return None, f"qtorch not available ({type(e).__name__}: {e}): skipped"
    return (float_quantize, fixed_point_quantize, block_quantize), None


def load_torchao():
    try:
        import torchao  # noqa: F401
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
    except Exception as e:  # noqa: BLE001
        return None, f"torchao not available ({type(e).__name__}): skipped"
    return MXTensor, None


def qtorch_fn(q, spec, x):
    float_quantize, fixed_point_quantize, block_quantize = q
    kind = spec[0]
    if kind == "float":
        return lambda: float_quantize(x, exp=spec[1], man=spec[2], rounding=spec[3])
    if kind == "fixed":
        return lambda: fixed_point_quantize(x, wl=spec[1], fl=spec[2], rounding=spec[3])
    return lambda: block_quantize(x, wl=spec[1], dim=spec[2], rounding=spec[3])


def torchao_fn(MXTensor, kind, x):
    if kind == "fp8":
        return None
    if kind in ("mxfp8", "mxfp4"):
        dt = torch.float8_e4m3fn if kind == "mxfp8" else torch.float4_e2m1fn_x2
        return lambda: MXTensor.to_mx(x, dt, 32).dequantize(torch.float32)
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=11)
    p.add_argument("--log2n", type=int, default=24, help="elements = 2^log2n (blocks: square)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--no-others", action="store_true", help="skip QPyTorch and torchao")
    p.add_argument("--rows", default=None,
                   help="only the rows whose label contains one of these (comma-separated)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    n = 1 << args.log2n
    side = 1 << (args.log2n // 2)
    g = torch.Generator().manual_seed(0)
    x_flat = torch.randn(n, generator=g).to(device)
    x_sq = x_flat.reshape(side, -1)
    out = torch.empty_like(x_flat)
    out.copy_(x_flat)  # touch the output pages

    print(f"# qtensor kernels: {n} float32 elements ({side}x{n // side} for blocks), device "
          f"{device}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"kernels {'compiled' if ops.kernels_available(device) else 'NOT compiled (reference)'}")
    print(f"# {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus; median of {args.repeat}")

    qtorch, qtorch_msg = (None, "qtorch: skipped (--no-others)") if args.no_others else load_qtorch()
    torchao, torchao_msg = (None, "torchao: skipped (--no-others)") if args.no_others else load_torchao()
    if qtorch is not None and device.type == "cuda" and not torch.cuda.is_available():
        qtorch = None

    copy_t = median_time(lambda: out.copy_(x_flat), device, args.repeat)
    results = {"device": str(device), "threads": torch.get_num_threads(), "n": n,
               "copy_ms": copy_t * 1e3, "rows": []}

    def cell(fn):
        if fn is None:
            return None
        try:
            return median_time(fn, device, args.repeat)
        except Exception as e:  # noqa: BLE001 (another tool that cannot do this row)
            print(f"#   (failed: {type(e).__name__}: {str(e)[:80]})")
            return None

    header = (f"{'quantization':<22}{'ms':>8}{'GB/s':>8}{'copy ms':>8}{'x copy_':>9}"
              f"{'extra MB':>10}"
              f"{'native x':>10}{'qtorch x':>10}{'torchao x':>11}")
    print(f"copy_: {copy_t * 1e3:.2f} ms (x copy_: the row's time over copy_ timed alternately with"
          " it; the other tools' ratios are to this copy_)")
    print(header)
    for label, name, rounding, native, qspec, aospec in ROWS:
        if args.rows and not any(r in label for r in args.rows.split(",")):
            continue
        fmt = _format(name)
        x = x_sq if isinstance(fmt, qt.BlockFormat) else x_flat
        o = out.view_as(x)

        def ours(x=x, o=o, fmt=fmt, rounding=rounding):
            return qt.quantize(x, fmt, rounding=rounding, out=o)

        def copy(x=x, o=o):
            return o.copy_(x)

        t, c = paired_times(ours, copy, device, args.repeat)
        mem = extra_memory(ours, device, x, o)
        nat = cell((lambda x=x, d=getattr(torch, native): x.to(d).float()) if native else None)
        qto = cell(qtorch_fn(qtorch, qspec, x) if (qtorch and qspec) else None)
        tao = cell(torchao_fn(torchao, aospec, x) if (torchao and aospec) else None)

        def r(v):
            return f"{v / copy_t:.2f}" if v is not None else "-"

        gbs = 2 * x.numel() * x.element_size() / t / 1e9  # one read and one write of x
        print(f"{label:<22}{t * 1e3:8.2f}{gbs:8.1f}{c * 1e3:8.2f}{t / c:9.2f}{mem / 2 ** 20:10.2f}"
              f"{r(nat):>10}{r(qto):>10}{r(tao):>11}")
        results["rows"].append({"row": label, "ms": t * 1e3, "gb_per_s": gbs, "copy_ms": c * 1e3,
                                "ratio": t / c,
                                "extra_bytes": mem,
                                "native_ratio": nat / copy_t if nat else None,
                                "qtorch_ratio": qto / copy_t if qto else None,
                                "torchao_ratio": tao / copy_t if tao else None})
    copy_again = median_time(lambda: out.copy_(x_flat), device, args.repeat)
    print(f"copy_ again: {copy_again * 1e3:.2f} ms (drift check)")
    for msg in (qtorch_msg, torchao_msg):
        if msg:
            print(f"# {msg}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
