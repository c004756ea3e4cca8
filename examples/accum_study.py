"""Does the accumulator matter? FP8 training with Hopper-style accumulation, by promotion interval.

    python examples/accum_study.py             # digits CNN and char-GPT (several minutes)
    python examples/accum_study.py --quick     # a few steps (smoke test)
    python examples/accum_study.py --models kscan --out examples/results   # error vs K only
    python examples/accum_study.py --models refs --out examples/results    # two references

Every run has the same FP8 operands with fine-grained scales (MXFP8: weights and activations
E4M3, gradients E5M2, one power-of-two scale per 32 elements along K, which plays the role of
DeepSeek-V3's 1x128 tile scaling; BF16 values between ops, FP32 master weights) and differs only
in how the products are summed
(``qt.Recipe(..., accumulate=...)``, see qtensor/accum/):
- ``fp32``: today's emulation default, FP32 accumulation of the rounded operands;
- ``promote 1/4/16``: Hopper's FP8 tensor-core datapath (32-product chunks aligned to the largest
  exponent, 13 fractional bits, result truncated to 13 mantissa bits), with the partial sum
  added into an FP32 accumulator every 1, 4 (CUTLASS's default, 128 elements) or 16 chunks;
- ``never``: the same with no promotion (the whole K in the tensor core: "fast accumulation");
- ``wide never``: no promotion but a 25-bit accumulator (Hopper's BF16/FP16 datapath width).
Same initial weights and batches for every run of a model (the differences are paired), except
``fp32, seed 1``: FP32 adds with another seed, the run-to-run noise against which to read them.

``kscan``: the same accumulators on one matrix product of growing K (E4M3 operands, no
training), the relative error of each output against the exact sum of the same products, for
zero-mean operands and for non-negative ones (where truncation's bias adds up, as in DeepSeek-V3's
K = 4096 observation). Written to accum_study_k.md and accum_study_k.png.

``refs``: the result only a hardware-faithful accumulator shows. Long-K dot products of MXFP8
operands and the logits of a trained CNN (FP32-trained, evaluated with MXFP8 operands), summed by
several tensor-core presets and promotion intervals, each measured against two references: the
exact product of the quantized operands (the accumulator's own error) and the FP32 product of the
unquantized ones (what a user compares with; the quantization's error dominates it). Written to
accum_study_refs.md and accum_study_refs.png.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qtensor as qt  # noqa: E402
from qtensor import accum  # noqa: E402

RUNS = {
    "fp32": None,
    "promote 1": accum.hopper_fp8.replace(promote=1),
    "promote 4": accum.hopper_fp8,
    "promote 16": accum.hopper_fp8.replace(promote=16),
    "never": accum.hopper_fp8_fast,
    "wide never": accum.hopper_fp8_fast.replace(frac_bits=25, acc_man=23),
    "fp32, seed 1": None,  # FP32 adds again, another seed: the run-to-run noise level
}
COLORS = dict(zip(RUNS, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                         "tab:brown", "tab:gray"]))


def _seed(name, seed):
    return seed + 1 if name.endswith("seed 1") else seed


def _short(f):
    if f is None:
        return "FP32 adds"
    return (f"k{f.chunk}, {f.frac_bits} bits, {f.acc_man}-bit result, "
            f"promote {'never' if f.promote is None else f.promote}")


def _tail(losses):
    tail = max(1, len(losses) // 5)
    return sum(losses[-tail:]) / tail


def recipe(acc):
    return qt.Recipe(weight=(qt.fp32, qt.mxfp8_e4m3), bias=qt.fp32,
                     activation=(qt.bf16, qt.mxfp8_e4m3), grad=(qt.bf16, qt.mxfp8_e5m2),
                     master_weights=True, accumulate=acc)


def run_digits(name, data, steps, seed):
    x_train, y_train, x_test, y_test = data
    seed = _seed(name, seed)
    torch.manual_seed(seed)
    model = qt.convert(common.DigitsCNN(), recipe(RUNS[name]))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with common.Timer() as t:
        losses = common.train_classifier(model, opt, x_train, y_train, steps=steps, batch=64,
                                         seed=seed, desc=f"digits {name:>10}")
    return {"name": name, "losses": losses, "final": common.accuracy(model, x_test, y_test),
            "seconds": t.seconds}


def run_gpt(name, corpus, args):
    import mx_training as mt
    seed = _seed(name, args.seed)
    torch.manual_seed(seed)
    model = common.CharGPT(corpus.vocab, d=args.d, layers=2, heads=4, context=args.context)
    qt.convert(model, recipe(RUNS[name]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    lr_at = common.warmup_cosine(1e-2, args.gpt_steps)

    g = torch.Generator().manual_seed(seed)
    hi = len(corpus.train) - args.context - 1
    losses = []
    with common.Timer() as t, torch.nn.attention.sdpa_kernel(
            torch.nn.attention.SDPBackend.MATH):  # attention as bmm: emulated too
        for step in common.progress(range(args.gpt_steps), desc=f"gpt {name:>10}"):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            x, y = mt.Corpus.batch(corpus.train, torch.randint(0, hi, (args.batch,), generator=g),
                                   args.context)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                flat = common.plain(logits.detach()).reshape(-1, logits.shape[-1])
                losses.append(float(F.cross_entropy(flat, y.reshape(-1))))
    return {"name": name, "losses": losses, "final": _tail(losses), "seconds": t.seconds}


KSCAN_K = (128, 512, 2048, 8192, 32768)


KSCAN_HEAD = """# Accumulator study: the error of one matrix product by K

`python examples/accum_study.py --models kscan --out examples/results`: a 16 x K by K x 16
product of E4M3-rounded standard normal operands (zero-mean) or their absolute values
(non-negative), summed by FP32 adds (torch.mm) or by each accumulator of the training study; the
median over outputs of |C - exact| / (|A| |B|), where exact is the float64 sum of the same
products. 0.0 means exact (drawn at 1e-12 in accum_study_k.png).

"""


def kscan(ks, m=16, seed=0):
    """Median relative error |C - C_exact| / (|A| |B|) of each accumulator by K, per operand kind."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for kind in ("zero-mean", "non-negative"):
        for k in ks:
            a, b = torch.randn(m, k, generator=g), torch.randn(k, m, generator=g)
            if kind == "non-negative":
                a, b = a.abs(), b.abs()
            a, b = qt.quantize(a, "fp8_e4m3"), qt.quantize(b, "fp8_e4m3")
            exact, size = a.double() @ b.double(), a.double().abs() @ b.double().abs()
            for name, f in RUNS.items():
                if name.endswith("seed 1"):
                    continue
                c = a @ b if f is None else accum.accum_matmul(a, b, f)
                out[kind, k, name] = float(((c.double() - exact).abs() / size).median())
    return out


def kscan_table(err, ks, kind):
    names = [n for n in RUNS if not n.endswith("seed 1")]
    rows = [[str(k)] + [f"{err[kind, k, n]:.1e}" for n in names] for k in ks]
    return common.markdown_table(["K"] + [f"{n}" for n in names], rows)


def plot_kscan(err, ks, path):
    plt = common.plt_module()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, kind in zip(axes, ("zero-mean", "non-negative")):
        for n in RUNS:
            if n.endswith("seed 1"):
                continue
            ys = [max(err[kind, k, n], 1e-12) for k in ks]  # 0 (exact) drawn at the floor
            ax.loglog(ks, ys, marker="o", lw=1.3, color=COLORS[n], label=n)
        ax.set_title(f"{kind} E4M3 operands")
        ax.set_xlabel("K (products per output)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median |C - exact| / (|A| |B|)")
    axes[1].legend(fontsize=8)
    common.save_figure(fig, path)


# The accumulators of the two-reference study: presets by architecture, Hopper FP8's promotion
# intervals (CUTLASS's 4 = 128 K-elements, DeepSeek-V3's choice), and FP32 adds
REFS_RUNS = {
    "fp32 adds": None,
    "hopper_fp8 promote 1": accum.hopper_fp8.replace(promote=1),
    "hopper_fp8 promote 4": accum.hopper_fp8,
    "hopper_fp8 promote 16": accum.hopper_fp8.replace(promote=16),
    "hopper_fp8 never": accum.hopper_fp8_fast,
    "ada_fp8": accum.ada_fp8,
    "hopper_fp8_f16": accum.hopper_fp8_f16,
    "blackwell_f8f6f4": accum.blackwell_f8f6f4,
}
REFS_K = (256, 1024, 4096, 16384)
REFS_COLORS = dict(zip(REFS_RUNS, ["tab:blue", "tab:orange", "tab:green", "tab:red",
                                   "tab:purple", "tab:brown", "tab:pink", "tab:olive"]))

REFS_HEAD = """# Accumulator study: two references

`python examples/accum_study.py --models refs --out examples/results`. Each accumulator sums the
same MXFP8 (E4M3, one power-of-two scale per 32 K-elements) operands; its error is measured
against (1) the exact product of the quantized operands ("vs exact": the accumulator's own
error) and (2) the FP32 product of the unquantized operands ("vs FP32": what one compares a
low-precision run with, dominated by the quantization). Dot products: a 16 x K by K x 16 product
of standard normal operands, the mean over outputs of |C - ref| / (|A| |B|) (|A| |B|: the product
of the quantized magnitudes). Logits: a digits CNN with a K = {fc1_k} hidden layer, trained in
FP32, evaluated on the {n_test} test images with MXFP8 operands for every convolution and linear
layer (FP32 values between them), the mean over logits of |z - z_ref| / rms(z_ref); its exact
reference sums each contraction in one pass with {exact_bits} fractional bits and one rounding to
nearest FP32 (exact for these operands up to products {exact_bits} binades below a row's
largest). 0 means no difference (drawn at 1e-12).

"""


def _mx_pair(a, b):
    """a (M, K) and b (K, N) rounded to MXFP8 E4M3 with their blocks along K."""
    return qt.quantize(a, "mxfp8_e4m3"), qt.quantize(b.t(), "mxfp8_e4m3").t()


def refs_dots(ks, m=16, seed=0):
    """{(K, run, ref): mean relative error} for long-K dot products (zero-mean operands)."""
    g = torch.Generator().manual_seed(seed + 7)
    out = {}
    for k in ks:
        a, b = torch.randn(m, k, generator=g), torch.randn(k, m, generator=g)
        aq, bq = _mx_pair(a, b)
        exact = aq.double() @ bq.double()
        fp32 = (a @ b).double()  # the unquantized operands' FP32 product
        size = aq.double().abs() @ bq.double().abs()
        for name, f in REFS_RUNS.items():
            c = (aq @ bq if f is None else accum.accum_matmul(aq, bq, f)).double()
            out[k, name, "exact"] = float(((c - exact).abs() / size).mean())
            out[k, name, "fp32"] = float(((c - fp32).abs() / size).mean())
    return out


def _exact_accum(k):
    """One instruction over the whole K (up to 2048), the widest exact float64 alignment, one
    rounding to nearest FP32: the exact product of the quantized operands, rounded once."""
    chunk = 1 << max(0, (k - 1).bit_length())
    return accum.AccumFormat(chunk=chunk, frac_bits=51 - (chunk + 1).bit_length(),
                             align_rounding="nearest", acc_rounding="nearest")


def refs_logits(steps, n_test, seed=0, hidden_k=2048):
    """{(run, ref): mean |z - z_ref| / rms(z_ref)} of a trained CNN's logits, and the K."""
    import copy
    x_train, y_train, x_test, _ = common.load_digits_split()
    x_test = x_test[:n_test]
    torch.manual_seed(seed)
    c2 = hidden_k // 16  # fc1's K = c2 * 4 * 4
    model = common.DigitsCNN(c2=c2, hidden=128)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    common.train_classifier(model, opt, x_train, y_train, steps=steps, batch=64, seed=seed,
                            desc="refs CNN (fp32)")
    model.eval()

    def logits(f):
        rec = qt.Recipe(weight=(qt.fp32, qt.mxfp8_e4m3), bias=qt.fp32,
                        activation=(qt.fp32, qt.mxfp8_e4m3), accumulate=f)
        q = qt.convert(copy.deepcopy(model), rec)
        with torch.no_grad():
            return common.plain(q(x_test)).double()

    with torch.no_grad():
        fp32 = model(x_test).double()
    exact = logits(_exact_accum(hidden_k))
    out = {}
    for name, f in REFS_RUNS.items():
        z = logits(f)
        for ref, zr in (("exact", exact), ("fp32", fp32)):
            rms = float(zr.pow(2).mean().sqrt())
            out[name, ref] = float((z - zr).abs().mean()) / rms
    return out, hidden_k, len(x_test), _exact_accum(hidden_k).frac_bits


def refs_tables(dots, ks, lg):
    names = list(REFS_RUNS)
    dot_rows = [[n, _refs_short(REFS_RUNS[n])] + [f"{dots[k, n, r]:.2e}" for r in
                                                 ("exact", "fp32") for k in ks] for n in names]
    head = (["run", "datapath"] + [f"vs exact K={k}" for k in ks]
            + [f"vs FP32 K={k}" for k in ks])
    lg_rows = [[n, f"{lg[n, 'exact']:.2e}", f"{lg[n, 'fp32']:.3e}"] for n in names]
    return [("Long-K dot products", common.markdown_table(head, dot_rows)),
            ("Logits of the trained CNN", common.markdown_table(
                ["run", "vs exact", "vs FP32"], lg_rows))]


def _refs_short(f):
    if f is None:
        return "FP32 adds"
    promo = "never" if f.promote is None else f"{f.promote} (every {f.promote * f.chunk})"
    out = "FP16 RNE" if f.acc_man == 10 else f"{f.acc_man}-bit RZ"
    return f"k{f.chunk}, {f.frac_bits} bits, {out}, promote {promo}"


def plot_refs(dots, ks, lg, path):
    plt = common.plt_module()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    for ax, ref, title in ((axes[0], "exact", "vs the exact product of the quantized operands"),
                           (axes[1], "fp32", "vs the FP32 product of the unquantized operands")):
        for n in REFS_RUNS:
            ys = [max(dots[k, n, ref], 1e-12) for k in ks]
            ax.loglog(ks, ys, marker="o", lw=1.3, color=REFS_COLORS[n], label=n)
        ax.set_title(f"dot products {title}", fontsize=9)
        ax.set_xlabel("K (products per output)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("mean |C - ref| / (|A| |B|)")
    axes[1].sharey(axes[0])
    axes[0].legend(fontsize=7)
    names = list(REFS_RUNS)
    xs = range(len(names))
    w = 0.4
    ax = axes[2]
    ax.bar([x - w / 2 for x in xs], [max(lg[n, "exact"], 1e-12) for n in names], w,
           label="vs exact (quantized)", color="tab:blue")
    ax.bar([x + w / 2 for x in xs], [max(lg[n, "fp32"], 1e-12) for n in names], w,
           label="vs FP32 (unquantized)", color="tab:gray")
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
    ax.set_title("trained CNN logits: mean |z - ref| / rms(ref)", fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    common.save_figure(fig, path)


def plot(results, path, title, ylabel):
    plt = common.plt_module()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})
    window = max(1, len(results[0]["losses"]) // 20)
    base = results[0]
    for r in results:
        c = COLORS[r["name"]]
        ax.plot(common.smooth(r["losses"], window), lw=1.3, color=c, label=r["name"])
        if r is not base:
            diff = [a - b for a, b in zip(r["losses"], base["losses"])]
            ax2.plot(common.smooth(diff, 2 * window), lw=1.3, color=c, label=r["name"])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax2.axhline(0.0, color="k", lw=0.8)
    ax2.set_ylabel("minus the fp32 run\n(same batches, except seed 1)")
    ax2.set_xlabel("training step")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    common.save_figure(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=300, help="digits CNN steps")
    p.add_argument("--gpt-steps", type=int, default=300)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--models", default="digits,gpt,kscan,refs")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output folder (default examples/results/local, git-ignored; nothing "
                        "written with --quick; --out examples/results: the committed results)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.gpt_steps = 3, 2
    common.setup(args.threads, args.seed)
    sections, out_dir = [], common.output_dir(args.out, args.quick)
    models = args.models.split(",")
    if "digits" in models:
        data = common.load_digits_split()
        res = [run_digits(n, data, args.steps, args.seed) for n in RUNS]
        rows = [[r["name"], _short(RUNS[r["name"]]), f"{100 * r['final']:.1f}%",
                 f"{_tail(r['losses']):.4f}", f"{r['seconds']:.0f}"] for r in res]
        sections.append(("Digits CNN", common.markdown_table(
            ["run", "accumulator", "test acc", "train loss (last 20%)", "s"], rows)))
        if out_dir is not None:
            plot(res, out_dir / "accum_study_digits.png", "Digits CNN, MXFP8 operands",
                 "train cross-entropy")
    if "gpt" in models:
        import mx_training as mt
        corpus = mt.Corpus(max_bytes=2_000_000)
        res = [run_gpt(n, corpus, args) for n in RUNS]
        rows = [[r["name"], _short(RUNS[r["name"]]), f"{r['final']:.4f}",
                 f"{r['seconds']:.0f}"] for r in res]
        sections.append(("Char-GPT", common.markdown_table(
            ["run", "accumulator", "train loss (last 20%)", "s"], rows)))
        if out_dir is not None:
            plot(res, out_dir / "accum_study_gpt.png", "Char-GPT, MXFP8 operands",
                 "train cross-entropy (nats/char)")
    if "kscan" in models:
        ks = KSCAN_K[:3] if args.quick else KSCAN_K
        err = kscan(ks, seed=args.seed)
        ksec = [(f"Matmul error vs K, {kind} operands", kscan_table(err, ks, kind))
                for kind in ("zero-mean", "non-negative")]
        for title, table in ksec:
            print(f"\n## {title}\n\n{table}")
        if out_dir is not None:
            plot_kscan(err, ks, out_dir / "accum_study_k.png")
            common.save_text(out_dir / "accum_study_k.md", KSCAN_HEAD + "\n\n".join(
                f"## {t}\n\n{tab}" for t, tab in ksec) + "\n")
    if "refs" in models:
        ks = REFS_K[:2] if args.quick else REFS_K
        dots = refs_dots(ks, seed=args.seed)
        lg, fc1_k, n_test, exact_bits = refs_logits(
            3 if args.quick else 300, 32 if args.quick else 10_000, seed=args.seed,
            hidden_k=256 if args.quick else 2048)
        rsec = refs_tables(dots, ks, lg)
        for title, table in rsec:
            print(f"\n## {title}\n\n{table}")
        if out_dir is not None:
            plot_refs(dots, ks, lg, out_dir / "accum_study_refs.png")
            common.save_text(out_dir / "accum_study_refs.md", REFS_HEAD.format(
                fc1_k=fc1_k, n_test=n_test, exact_bits=exact_bits) + "\n\n".join(
                f"## {t}\n\n{tab}" for t, tab in rsec) + "\n")
    for title, table in sections:
        print(f"\n## {title}\n\n{table}")
    if out_dir is not None and sections:
        common.save_text(out_dir / "accum_study.md", "\n\n".join(
            f"## {t}\n\n{tab}" for t, tab in sections) + "\n")



if __name__ == "__main__":
    main()
