#!/usr/bin/env bash
# GPU check of the Triton kernels (qtensor/gpu: quantization families and qt.accum's fused
# datapath), on a machine with a CUDA build of torch (which brings triton) and one GPU; no CUDA
# toolkit and no network needed. In under 8 minutes (each step has its own timeout):
#   1. the CPU extension (skipped where qtensor/_C already imports: e.g. carried over);
#   2. the CUDA tests: Triton kernels on the device against the CPU kernels and the reference,
#      bit for bit (test_kernels, test_two_level_kernel, test_accum, test_api), and the
#      first-use self-check of every
#      family, accumulator included (test_selfcheck), with the check itself off elsewhere;
#   3. the kernel benchmark: GB/s and ratio to copy_ (scalar, stochastic, MX, NVFP4);
#   4. qt.accum on CUDA: the Triton kernel's bits against the reference, and its time;
#   5. a GPT training step: bf16 eager and compiled; emulated eager and compiled,
#      decompositions off and on.
# Results under benchmarks/results/: gpu_check.log (the whole run), test_cuda.txt,
# kernels_cuda.txt/json, accum_cuda.txt, training_cuda.txt/json.
# Usage: scripts/gpu_check.sh [--dry-run] [python]   (default: python3 on PATH)
#   --dry-run: no GPU needed; prints each step's command, collects the test selection and
#   checks every benchmark's --help (what CI can check of this script).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
py=${1:-python3}
out=benchmarks/results
mkdir -p "$out"
if [ $dry -eq 0 ]; then exec > >(tee "$out/gpu_check.log") 2>&1; fi
status=0
start=$(date +%s)
step() { echo; echo "== $* ($(date -u +%H:%M:%S), +$(( $(date +%s) - start )) s)"; }
# run SECONDS LOGFILE CMD...: the command under a timeout, its output also in LOGFILE
run() {
  local t=$1 log=$2; shift 2
  if [ $dry -eq 1 ]; then echo "would run (timeout ${t}s, > $log): $*"; return 0; fi
  timeout "$t" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "TIMED OUT after ${t}s: $*"
  [ "$rc" -eq 0 ] || { echo "FAILED ($rc): $*"; status=1; }
}

TESTS=(tests/kernels/test_kernels.py tests/kernels/test_two_level_kernel.py tests/accum/test_accum.py tests/test_api.py tests/kernels/test_selfcheck.py)
SELECT="cuda"  # the tests that run on the device (the rest is CI's; test_triton*.py: CPU only)

if [ $dry -eq 1 ]; then
  step "dry run: the test selection, the scripts' options"
  "$py" -m pytest "${TESTS[@]}" -q -k "$SELECT" --collect-only -p no:cacheprovider | tail -25 \
    || status=1
  for s in benchmarks/bench_kernels.py benchmarks/bench_gpu_training.py; do
    "$py" "$s" --help > /dev/null || { echo "FAILED: $s --help"; status=1; }
  done
fi

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available(), 'triton', triton.__version__)"

step "install: the CPU extension (the GPU kernels are Triton's, compiled at first use)"
if "$py" -c "import qtensor._C" 2>/dev/null; then
  echo "qtensor/_C imports: not rebuilt"
else
  export MAX_JOBS=${MAX_JOBS:-16}
  run 120 "$out/build.log" "$py" setup.py build_ext --inplace
fi
if [ $dry -eq 0 ]; then
  "$py" -c "import torch, qtensor.kernels.ops as o; assert torch.cuda.is_available(), 'no GPU'; assert o.kernels_available('cuda'), 'no triton'; print('Triton kernels available on cuda')" || exit 1
fi

# the kernels themselves, not qtensor/kernels/selfcheck.py's fallback to the reference on a mismatch
# (test_selfcheck.py's CUDA test turns the first-use check back on and requires it to pass);
# once this script passes, set GPU_VERIFIED = True in qtensor/kernels/selfcheck.py with the log
export QTENSOR_KERNEL_CHECK=0

step "CUDA tests (Triton kernels on the device vs the CPU kernels and the reference, bit for bit)"
run 150 "$out/test_cuda.txt" "$py" -m pytest "${TESTS[@]}" -q -k "$SELECT" -p no:cacheprovider -rs

step "kernel benchmark (GB/s, ratio to copy_; goal: at least 0.8x copy_'s bandwidth)"
run 50 "$out/kernels_cuda.txt" "$py" benchmarks/bench_kernels.py --device cuda --repeat 21 \
  --no-others --json "$out/kernels_cuda.json"

step "qt.accum on CUDA (the Triton kernel of the fused datapath vs the reference; time)"
if [ $dry -eq 1 ]; then echo "would run (timeout 40s, > $out/accum_cuda.txt): the inline script"
else
timeout 40 "$py" - <<'PY' 2>&1 | tee "$out/accum_cuda.txt"
import torch, qtensor as qt
from qtensor import accum
def ms(f, n=5):
    f(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
n = 1024
a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
qa, qb = qt.quantize(a, "fp8_e4m3"), qt.quantize(b, "fp8_e4m3")
plain = ms(lambda: qa @ qb)
for f in (accum.hopper_fp8, accum.hopper_bf16, accum.blackwell_f8f6f4):
    want = accum.accum_matmul_reference(qa[:64].cpu(), qb.cpu(), f, a_emin=-6, b_emin=-6)
    got = accum.accum_matmul(qa[:64], qb, f, a_emin=-6, b_emin=-6).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{f.name}: CUDA != reference"
    t = ms(lambda: accum.accum_matmul(qa, qb, f, a_emin=-6, b_emin=-6))
    print(f"{n}^3 {f.name:>16}: bits = reference; fp32 matmul {plain:.3f} ms, accum {t:.3f} ms, "
          f"ratio {t / plain:.1f}")
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAILED: accum on CUDA"; status=1; }
fi

step "GPT training step (bf16 vs emulated; eager, compiled, decompositions off/on; goal: 1.1x)"
run 110 "$out/training_cuda.txt" "$py" benchmarks/bench_gpu_training.py --device cuda \
  --steps 5 --warmup 2 --json "$out/training_cuda.json"

step "done: status $status, $(( $(date +%s) - start )) s"
exit $status
