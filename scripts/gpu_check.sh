#!/usr/bin/env bash
# GPU check of the Triton quantization kernels (qtensor/gpu), on a machine with a CUDA build of
# torch (which brings triton) and one GPU; no CUDA toolkit needed. In under 8 minutes: builds the
# CPU extension, runs the CUDA tests (Triton kernels against the CPU kernels, bit for bit) and the
# kernel benchmark, and writes everything under benchmarks/results/:
#   gpu_check.log          the whole run
#   kernels_cuda.txt/json  the benchmark table (ratios to copy_ on the device)
#   test_kernels_cuda.txt  the CUDA test run (kernels, accumulator, API)
#   accum_cuda.txt         qt.accum on CUDA (the reference there: no GPU kernel yet): bits, timings
# Usage: scripts/gpu_check.sh [python]   (default: python3 on PATH)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${1:-python3}
out=benchmarks/results
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
status=0
step() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"

step "build (the CPU extension; the GPU kernels are Triton's, compiled at first use)"
export MAX_JOBS=${MAX_JOBS:-8}
timeout 330 "$py" setup.py build_ext --inplace > "$out/build.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$out/build.log"; exit 1; }
"$py" -c "import qtensor.ops as o, triton; assert o.kernels_available('cuda'), 'no CUDA kernels'; print('Triton', triton.__version__, 'kernels: available')" || exit 1

# the kernels themselves, not qtensor/selfcheck.py's fallback to the reference on a mismatch
# (test_selfcheck.py's CUDA test turns the first-use check back on and requires it to pass);
# once this script passes, set GPU_VERIFIED = True in qtensor/selfcheck.py with the log
export QTENSOR_KERNEL_CHECK=0

step "CUDA tests (CUDA vs CPU kernels, bit for bit)"
timeout 150 "$py" -m pytest tests/test_kernels.py tests/test_accum.py tests/test_api.py \
  tests/test_selfcheck.py -q -k "cuda" \
  -p no:cacheprovider 2>&1 | tee "$out/test_kernels_cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "benchmark"
timeout 120 "$py" benchmarks/bench_kernels.py --device cuda --threads 16 --repeat 21 --no-others \
  --json "$out/kernels_cuda.json" 2>&1 | tee "$out/kernels_cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "accumulator emulation on CUDA (qt.accum.accum_matmul vs the plain emulated matmul)"
timeout 90 "$py" - <<'PY' 2>&1 | tee "$out/accum_cuda.txt"
import torch, qtensor as qt
from qtensor import accum
def ms(f, n=5):
    f(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
for n in (256, 1024):
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    qa, qb = qt.quantize(a, "fp8_e4m3"), qt.quantize(b, "fp8_e4m3")
    want = accum.accum_matmul_reference(qa[:64].cpu(), qb.cpu(), accum.hopper_fp8)
    got = accum.accum_matmul(qa[:64], qb, accum.hopper_fp8).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), "CUDA != reference"
    plain = ms(lambda: qt.quantize(a, "fp8_e4m3") @ qt.quantize(b, "fp8_e4m3"))
    for f in (accum.hopper_fp8, accum.hopper_bf16, accum.blackwell_mxfp4):
        t = ms(lambda: accum.accum_matmul(qt.quantize(a, "fp8_e4m3"), qt.quantize(b, "fp8_e4m3"), f))
        print(f"{n}^3 {f.name:>16}: plain {plain:.3f} ms, accum {t:.3f} ms, ratio {t / plain:.1f}")
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "done: status $status"
exit $status
