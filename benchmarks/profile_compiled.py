"""Where a compiled emulated training step's time goes, next to FP32's.

    OMP_NUM_THREADS=1 python benchmarks/profile_compiled.py --only gpt256 [--quick]

For each configuration of bench_training.py: the first step's compile time split by phase
(dynamo's compile_times: tracing, AOTAutograd, inductor), the graph breaks, then one compiled
step of FP32 and of the emulated model under torch.profiler: the number of generated kernels
(cpp_fused_*), extern calls (mm/addmm/bmm, the qtensor ops) and the self time of each group.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_training as bt  # noqa: E402


def _group(name):
    if name.startswith(("cpp_fused", "graph_", "triton_")) or "fused" in name:
        return "inductor kernels"
    if "qtensor" in name:
        return "qtensor ops (" + name.split("::")[-1].split(".")[0] + ")"
    if name.startswith("aten::") and any(k in name for k in ("mm", "addmm", "bmm", "linear")):
        return "matmuls (" + name + ")"
    if name.startswith("aten::"):
        return "other aten (" + name + ")"
    return "other (" + name[:40] + ")"


def profile_step(trainer, label):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        trainer.step()
    groups = collections.defaultdict(lambda: [0, 0.0])
    kernels = set()
    for e in p.key_averages():
        if e.key.startswith(("Torch-Compiled Region", "CompiledFunction", "## ")):
            continue
        g = _group(e.key)
        groups[g][0] += e.count
        groups[g][1] += e.self_cpu_time_total / 1e3
        if g == "inductor kernels":
            kernels.add(e.key)
    total = sum(v[1] for v in groups.values())
    print(f"  {label}: {total:.1f} ms self time in all events; {len(kernels)} distinct inductor "
          "kernels")
    for g, (n, ms) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"    {ms:8.1f} ms  {n:5d} calls  {g}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="gpt256")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    bt.qt.set_flush_warnings(False)
    # the generated CPU kernels record themselves in the profile (else only extern calls show)
    torch._inductor.config.cpp.enable_kernel_profile = True
    from torch._dynamo.utils import counters, compile_times
    for name in args.only.split(","):
        fp32, emu, what = bt.make_pair(name, args.quick, True)
        print(f"== {name}: {what}")
        for label, tr in (("FP32", fp32), ("emulated", emu)):
            counters.clear()
            torch._dynamo.utils.compilation_time_metrics.clear()
            t = time.perf_counter()
            tr.step()
            first = time.perf_counter() - t
            breaks = sum(counters["graph_break"].values())
            print(f"  {label} first step {first:.1f} s; graph breaks {breaks}: "
                  f"{dict(counters['graph_break'])}")
            print("   ", compile_times(repr="str", aggregate=True).replace("\n", "\n    ")[:3000])
        for _ in range(2):
            fp32.step()
            emu.step()
        for label, tr in (("FP32", fp32), ("emulated", emu)):
            profile_step(tr, label)


if __name__ == "__main__":
    main()
