"""qt.quantize(x, qt.nvfp4) at 4096x4096 against copy_ (best of a few runs, one thread):
OMP_NUM_THREADS=1 PYTHONPATH=<checkout> python benchmarks/bench_nvfp4_te.py <label>."""
import sys, time, torch
import qtensor as qt
torch.manual_seed(0)
x = torch.randn(4096, 4096)
out = torch.empty_like(x)
def t(f, n=5):
    f(); best = 1e9
    for _ in range(n):
        s = time.perf_counter(); f(); best = min(best, time.perf_counter() - s)
    return best
tc = t(lambda: out.copy_(x))
tq = t(lambda: qt.quantize(x, qt.nvfp4), 3)
print(f"{sys.argv[1]}: copy_ {tc*1e3:.2f} ms, quantize nvfp4 {tq*1e3:.1f} ms, ratio {tq/tc:.1f}x")
