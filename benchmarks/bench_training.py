"""Training steps of emulated models against FP32, in the same run.

    python benchmarks/bench_training.py                 # eager, every configuration
    python benchmarks/bench_training.py --compile       # also torch.compile'd (model compiled)
    python benchmarks/bench_training.py --profile       # plus where the emulated step's time goes
    python benchmarks/bench_training.py --quick         # tiny sizes, few steps (smoke test)
    python benchmarks/bench_training.py --only gpt256,mlp_fp8

One training step = zero_grad, forward, cross-entropy, backward, optimizer step (AdamW for the
transformers, Adam for the MLPs). The loss is computed on the model's output as it is (a QTensor
in the emulated model, as the examples train): a compiled model whose QTensor output is
dequantized before the loss cannot run backward (torch 2.13: "Expected a QTensor tangent but
got a plain Tensor"). qtensor's flush/saturation warnings are off unless
--flush-warnings (they are on by default in the library). Each configuration builds one model, copies it, converts the
copy; both train on the same batches. Steps of the two are interleaved (FP32, emulated, FP32,
...) after warm-up steps, and the table gives the median of each and their ratio, so load from
other processes on the machine hits both alike. One thread unless --threads.

Configurations (their names for --only):
  gpt256      GPT d=256, 4 layers, 4 heads, T=128, batch 8 (examples/common.py CharGPT),
              microxcaling's MXFP6 spec through qt.compat.mx.recipe
  chargpt     char-GPT d=128, 2 layers, T=64, batch 32 (examples/mx_training.py), qt.recipes.mxfp6
  hf_gpt2     transformers GPT2LMHeadModel, d=128, 2 layers, T=128, batch 8, qt.recipes.mxfp6
  hf_llama    transformers LlamaForCausalLM, d=128, 2 layers, T=128, batch 8, qt.recipes.mxfp6
  mlp_fp8     MLP 1024 -> 3x1024 -> 10, batch 256, qt.convert(m, qt.fp8_e4m3) (FP32 masters)
  mlp_mxfp8   the same MLP, qt.convert(m, qt.mxfp8_e4m3)
  mlp_fp8_hopper / mlp_mxfp8_hopper   the same with accumulate=qt.accum.hopper_fp8
(hf_* are skipped when transformers is not installed.)

--profile: the emulated step of each configuration once under cProfile, its time grouped by
where it is spent (see ``profile_summary``), and the rounding kernels' own time from
torch.profiler. cProfile's own overhead inflates the Python parts; read the shares, not the ms.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import qtensor as qt  # noqa: E402
import common  # noqa: E402  (examples/common.py: CharGPT)


# ---------------------------------------------------------------------------------------------
# Configurations

# microxcaling's MXFP6 training spec (its examples' "MXFP6_E3M2" with BF16 vector ops)
MX_SPECS_MXFP6 = {"scale_bits": 8, "w_elem_format": "fp6_e3m2", "a_elem_format": "fp6_e3m2",
                  "block_size": 32, "bfloat": 16, "custom_cuda": False,
                  "quantize_backprop": True}


class MLP(nn.Module):
    def __init__(self, width=1024, depth=3, n_in=1024, n_out=10):
        super().__init__()
        layers, d = [], n_in
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        layers.append(nn.Linear(d, n_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def _lm_batches(vocab, batch, t, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, t + 1), generator=g) for _ in range(n)]


def _gpt_step_fn(hf):
    def loss_of(model, b):
        x, y = b[:, :-1], b[:, 1:]
        logits = model(x).logits if hf else model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return loss_of


def _mlp_loss(model, b):
    x, y = b
    return F.cross_entropy(model(x), y)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def config(name, quick):
    """(model builder, recipe, batches, loss fn, optimizer factory, description), or a str: why
    it is skipped."""
    s = 4 if quick else 1  # --quick divides the sizes
    if name in ("gpt256", "chargpt"):
        d, layers, t, batch = (256, 4, 128, 8) if name == "gpt256" else (128, 2, 64, 32)
        d, t, batch = d // s, t // s, max(2, batch // s)
        vocab = 256

        def build():
            return common.CharGPT(vocab, d=d, layers=layers, heads=4, context=t)
        if name == "gpt256":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its approximations are named in docs/compat.md
                recipe = qt.compat.mx.recipe(MX_SPECS_MXFP6)
            what = f"GPT d={d}, {layers} layers, T={t}, batch {batch}, microxcaling MXFP6 spec"
        else:
            recipe = qt.recipes.mxfp6
            what = f"char-GPT d={d}, {layers} layers, T={t}, batch {batch}, qt.recipes.mxfp6"
        return build, recipe, _lm_batches(vocab, batch, t, 4), _gpt_step_fn(False), _adamw, what
    if name in ("hf_gpt2", "hf_llama"):
        try:
            import transformers
        except ImportError:
            return "transformers is not installed"
        d, layers, t, batch, vocab = 128 // s, 2, 128 // s, max(2, 8 // s), 256
        if name == "hf_gpt2":
            cfg = transformers.GPT2Config(n_layer=layers, n_embd=d, n_head=4, vocab_size=vocab,
                                          n_positions=t, bos_token_id=0, eos_token_id=0,
                                          attn_implementation="eager")
            cls, what = transformers.GPT2LMHeadModel, "HF GPT-2"
        else:
            cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=d,
                                           intermediate_size=4 * d, num_attention_heads=4,
                                           num_key_value_heads=4, vocab_size=vocab,
                                           max_position_embeddings=t, bos_token_id=0,
                                           eos_token_id=0, pad_token_id=0,
                                           attn_implementation="eager")
            cls, what = transformers.LlamaForCausalLM, "HF Llama"

        def build():
            return cls(cfg)
        what += f" d={d}, {layers} layers, T={t}, batch {batch}, qt.recipes.mxfp6"
        return build, qt.recipes.mxfp6, _lm_batches(vocab, batch, t, 4), _gpt_step_fn(True), \
            _adamw, what
    if name.startswith("mlp_"):
        width, batch = 1024 // s, 256 // s
        base = name[4:].replace("_hopper", "")
        fmt = {"fp8": qt.fp8_e4m3, "mxfp8": qt.mxfp8_e4m3}[base]
        recipe = qt.nn.spec.as_recipe(fmt)
        what = f"MLP {width}x3, batch {batch}, qt.convert(m, qt.{fmt})"
        if name.endswith("_hopper"):
            recipe = recipe.replace(accumulate=qt.accum.hopper_fp8)
            what += ", accumulate=hopper_fp8"
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(batch, width, generator=g),
                    torch.randint(0, 10, (batch,), generator=g)) for _ in range(4)]
        return (lambda: MLP(width, 3, width)), recipe, batches, _mlp_loss, _adam, what
    raise SystemExit(f"unknown configuration {name!r}; see --help")


CONFIGS = ["gpt256", "chargpt", "hf_gpt2", "hf_llama", "mlp_fp8", "mlp_mxfp8",
           "mlp_fp8_hopper", "mlp_mxfp8_hopper"]


# ---------------------------------------------------------------------------------------------
# Timing

class Trainer:
    def __init__(self, model, opt, loss_of, batches):
        self.model, self.opt, self.loss_of, self.batches, self.i = model, opt, loss_of, batches, 0

    def step(self):
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_of(self.model, b)
        loss.backward()
        self.opt.step()
        return loss

    def timed_step(self):
        t = time.perf_counter()
        self.step()
        return time.perf_counter() - t


def make_pair(name, quick, compiled):
    cfg = config(name, quick)
    if isinstance(cfg, str):
        return cfg
    build, recipe, batches, loss_of, make_opt, what = cfg
    torch.manual_seed(0)
    ref = build()
    emu = qt.convert(copy.deepcopy(ref), recipe)
    pair = []
    for m in (ref, emu):
        opt = make_opt(m)
        if compiled:
            # static shapes: the models' shapes differ, and a recompilation with automatic
            # dynamic shapes meets torch 2.13's subclass-stride issue (qtensor refuses it with
            # a precise error; benchmarks/RESULTS.md "Compiled training steps")
            m = torch.compile(m, dynamic=False)
        pair.append(Trainer(m, opt, loss_of, batches))
    return pair[0], pair[1], what


def measure(fp32, emu, warmup, steps):
    """First-step times, then medians of interleaved steps (seconds)."""
    first = (fp32.timed_step(), emu.timed_step())
    for _ in range(warmup - 1):
        fp32.step()
        emu.step()
    tf, te = [], []
    for _ in range(steps):
        tf.append(fp32.timed_step())
        te.append(emu.timed_step())
    return first, statistics.median(tf), statistics.median(te)


# ---------------------------------------------------------------------------------------------
# Profile

# Where the emulated step's time goes. Python functions by the file they are in (tottime:
# their own time, not their callees'); the named qtensor functions by cumulative time.
_CUMULATIVE = [
    ("operand rounding per use (dispatch._round_operand, _round_gemm_operands)",
     ("dispatch.py", ("_round_operand", "_round_gemm_operands", "_convolution_backward"))),
    ("output rounding in dispatch (dispatch._wrap_out incl. rounding)",
     ("dispatch.py", ("_wrap_out",))),
    ("in-place rounding (dispatch._round_inplace: optimizer updates, copy_)",
     ("dispatch.py", ("_round_inplace",))),
    ("role roundings (plans.round_to: activations, grads, weights)", ("plans.py", ("round_to",))),
    ("  of which flush/saturation watch (flush_warnings.check)",
     ("flush_warnings.py", ("check",))),
    ("block NaN watch (block_specials.check)", ("block_specials.py", ("check",))),
    ("master weights and state hooks (training._pre_step, _post_step)",
     ("training.py", ("_pre_step", "_post_step"))),
    ("accumulator emulation (accum.contract)", ("accum.py", ("contract",))),
    ("whole __torch_dispatch__ (tensor.QTensor.__torch_dispatch__)",
     ("tensor.py", ("__torch_dispatch__",))),
]


def _group_of(filename):
    f = filename.replace("\\", "/")
    if "/qtensor/" in f:
        return "qtensor/" + f.split("/qtensor/")[-1] + " (Python)"
    if "torch/autograd" in f or "torch/_tensor.py" in f:
        return "torch autograd / Tensor Python"
    if "torch/optim" in f:
        return "torch.optim Python"
    if "torch/nn" in f:
        return "torch.nn Python (modules, hooks)"
    if "torch/utils/_python_dispatch" in f or "torch/utils/_pytree" in f:
        return "torch dispatch helpers (aliasing, pytree)"
    if f.startswith("~") or f == "":
        return None  # builtins: by name below
    return "other Python"


def profile_summary(trainer, total_s):
    """Print where one emulated step's time goes (cProfile), and the kernels' (torch.profiler)."""
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    for _ in range(2):
        trainer.step()
    wall = (time.perf_counter() - t) / 2
    prof.disable()
    st = pstats.Stats(prof)
    groups, cum = {}, {}
    for (fname, _line, func), (_cc, _nc, tt, ct, _callers) in st.stats.items():
        g = _group_of(fname)
        if g is None:
            g = "builtin: torch ops and kernels" if ("torch" in func or "method" in func
                                                     or "built-in" in func) else "builtin: other"
        groups[g] = groups.get(g, 0.0) + tt / 2
        for label, (file, funcs) in _CUMULATIVE:
            if fname.endswith("/" + file) and func in funcs:
                cum[label] = cum.get(label, 0.0) + ct / 2
    print(f"   cProfile: one step {wall * 1e3:.1f} ms under the profiler ({total_s * 1e3:.1f} ms "
          "without); own time by where the code is:")
    for g, v in sorted(groups.items(), key=lambda kv: -kv[1])[:10]:
        print(f"     {v * 1e3:8.1f} ms  {100 * v / wall:5.1f}%  {g}")
    print("   cumulative time of qtensor's parts (callees included; they overlap):")
    for label, _ in _CUMULATIVE:
        v = cum.get(label, 0.0)
        print(f"     {v * 1e3:8.1f} ms  {100 * v / wall:5.1f}%  {label}")
    # kernels: the rounding ops' own time, and the casts that round to dtype-exact formats
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        trainer.step()
    ev = p.key_averages()
    total = sum(e.self_cpu_time_total for e in ev) / 1e3
    rnd = sum(e.self_cpu_time_total for e in ev if e.key.startswith("qtensor::")) / 1e3
    acc = sum(e.self_cpu_time_total for e in ev if "accum" in e.key) / 1e3
    cast = sum(e.self_cpu_time_total for e in ev if e.key in ("aten::_to_copy", "aten::copy_")) / 1e3
    print(f"   torch.profiler (self CPU time of ops, one step, {total:.1f} ms in all ops): "
          f"rounding kernels (qtensor::*) {rnd:.1f} ms, of which accumulator kernels {acc:.1f} ms;"
          f" copies (aten::_to_copy, copy_: the bf16/fp16 casts, the transposing copies that put"
          f" an MX operand's block axis innermost, master-weight copies) {cast:.1f} ms")


# ---------------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps (smoke test)")
    p.add_argument("--compile", action="store_true", help="also run torch.compile'd models")
    p.add_argument("--profile", action="store_true", help="a profile of each emulated step")
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    p.add_argument("--steps", type=int, default=None, help="timed steps of each (default 15)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--flush-warnings", action="store_true",
                   help="keep qtensor's flush/saturation watch on (the library's default; off "
                   "here: it costs a few reductions per role rounding until it warns)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    qt.set_flush_warnings(args.flush_warnings)
    names = args.only.split(",") if args.only else CONFIGS
    steps = args.steps or (3 if args.quick else 15)
    warmup = args.warmup or (1 if args.quick else 3)
    modes = [False, True] if args.compile else [False]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); medians of {steps} "
          f"interleaved steps after {warmup} warm-up steps")
    rows = []
    for name in names:
        for compiled in modes:
            mode = "compiled" if compiled else "eager"
            made = make_pair(name, args.quick, compiled)
            if isinstance(made, str):
                print(f"== {name} ({mode}): skipped: {made}")
                continue
            fp32, emu, what = made
            first, tf, te = measure(fp32, emu, warmup, steps)
            rows.append((name, what, mode, tf, te, first))
            print(f"== {name} ({mode}): {what}: FP32 {tf * 1e3:.1f} ms, emulated "
                  f"{te * 1e3:.1f} ms, {te / tf:.2f}x; first step {first[0]:.2f} s / "
                  f"{first[1]:.2f} s", flush=True)
            if args.profile and not compiled:
                profile_summary(emu, te)
    print("\n| configuration | mode | FP32 step | emulated step | emulated / FP32 | first step "
          "FP32 / emulated |")
    print("|---|---|---|---|---|---|")
    for name, what, mode, tf, te, first in rows:
        print(f"| {what} | {mode} | {tf * 1e3:.1f} ms | {te * 1e3:.1f} ms | **{te / tf:.2f}x** | "
              f"{first[0]:.2f} s / {first[1]:.2f} s |")
    return rows


if __name__ == "__main__":
    main()
