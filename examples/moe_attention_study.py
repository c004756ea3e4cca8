"""Mixture-of-experts, attention and KV caches in low precision, in miniature: three studies on
Python's standard-library source (the char corpus of mx_training.py), 3 seeds each.

    python examples/moe_attention_study.py --threads 1 --out examples/results   # the recorded run
    python examples/moe_attention_study.py --quick                             # smoke test (CI)

1. **MoE training** (``--parts moe``): a tiny ``transformers`` Qwen3-MoE character model (2
   layers, 8 experts, top-2; its experts run through ``torch._grouped_mm``) trained in FP32,
   ``qt.recipes.mxfp8_pretraining`` and ``qt.recipes.nvfp4_nvidia``. The experts' grouped GEMMs
   take the recipe's operand formats per expert (docs/moe.md); the router (``*.mlp.gate``) stays
   FP32, as the recipes' papers keep it in high precision. One training step of each run is
   checked with ``qt.leak_check`` (nothing may escape the formats, the experts included).
2. **FP8 attention** (``--parts attention``): the char-GPT of the other studies with its attention
   through ``F.scaled_dot_product_attention``, linear layers in BF16 (FP32 master weights), and the
   attention role (``Recipe.attention``, docs/attention.md) in three settings: BF16 operands for
   QK^T and PV (scores and softmax in FP32), FlashAttention-3's FP8 forward
   (``qt.recipes.fa3_fp8_attention``: E4M3 Q/K/V with FP32 block scales, P in E4M3) and the MX
   paper's attention (``qt.recipes.mx_attention("mxfp8_e4m3")``); backward GEMMs in BF16 (MX's
   in MXFP8). Reported: validation loss, and the error of the attention scores S = QK^T/sqrt(d)
   and of the output O on the trained models' own Q, K, V (each run against FP64), and on the
   synthetic inputs of the FA3 paper's error table.
3. **KV-cache formats** (``--parts kv``): the FP32-trained MoE models of part 1 evaluated with
   their K and V stored in a cache format (``qt.kv_cache``: BF16, FP8 E4M3 unscaled, FP8 per
   token, FP8 per block of 32, MXFP8, NVFP4, MXFP4): validation perplexity, teacher-forced, one
   forward with a ``DynamicCache`` wrapped by ``qt.kv_cache.wrap`` (attention reads the stored,
   rounded K and V; a token never changes once stored, so this equals decoding token by token).

Sized for a shared 2-core machine (about 3 minutes with one thread): ~0.3M-parameter models,
a few hundred steps; the papers train billions of parameters on trillions of tokens. The tables
show what the formats cost early in training at tiny scale, nothing about long horizons.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402
import mx_training  # noqa: E402  (its Corpus, batches and train_step: the same data pipeline)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import qtensor as qt  # noqa: E402

R = qt.recipes
PARTS = ("moe", "attention", "kv")
MOE_HEAD_DIM = 32
DEFAULTS = dict(seeds=3, context=32, batch=8, lr=1e-2, moe_steps=150, gpt_steps=300,
                eval_windows=128)


def summary(values):
    """(mean, half the min-max spread)."""
    m = statistics.fmean(values)
    return m, ((max(values) - min(values)) / 2 if len(values) > 1 else 0.0)


def pm(values, digits=3, scale=1.0):
    m, s = summary([scale * v for v in values])
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def sci(values):
    m, s = summary(values)
    return f"{m:.2e} ± {s:.1e}"


def val_starts(corpus, args):
    g = torch.Generator().manual_seed(12345)  # the same validation windows for every run
    return torch.randint(0, len(corpus.val) - args.context - 1, (args.eval_windows,),
                         generator=g)


def train(model, corpus, args, seed, steps):
    """AdamW with the cosine schedule of the char-GPT studies; per-step FP32 losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    lr_at = common.warmup_cosine(args.lr, steps)
    g = torch.Generator().manual_seed(seed)  # the same batches for every format of one seed
    hi = len(corpus.train) - args.context - 1
    return [mx_training.train_step(model, opt, corpus, g, hi, args, lr_at(s))
            for s in range(steps)], opt


# ---------------------------------------------------------------------------------------------
# 1. MoE

class Logits(torch.nn.Module):
    """A Hugging Face causal LM as the char-GPT's interface: ids -> logits."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, idx, **kwargs):
        return self.lm(input_ids=idx, **kwargs).logits


def moe_model(vocab, args, seed):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=args.moe_d, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=MOE_HEAD_DIM, intermediate_size=2 * args.moe_d,
        moe_intermediate_size=args.moe_d, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=args.context, norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"  # (transformers' default; said for the reader)
    return Logits(transformers.Qwen3MoeForCausalLM(cfg))


def router_fp32(recipe):
    """The recipe with the router (``mlp.gate``) in FP32, as DeepSeek-V3 and the FP4 papers."""
    return recipe.replace(rules={**(recipe.rules or {}), "*.mlp.gate": "fp32"})


MOE_RUNS = {"fp32": None, "mxfp8_pretraining": router_fp32(R.mxfp8_pretraining),
            "nvfp4_nvidia": router_fp32(R.nvfp4_nvidia)}
MOE_LABELS = {"fp32": "FP32", "mxfp8_pretraining": "qt.recipes.mxfp8_pretraining",
              "nvfp4_nvidia": "qt.recipes.nvfp4_nvidia"}
MOE_PAPER = {
    "mxfp8_pretraining": "8B dense, 15T tokens: MXFP8 matches BF16 (2506.08027)",
    "nvfp4_nvidia": "12B, 10T tokens: loss within ~1-1.5% of FP8 (2509.25149)",
    "fp32": "MoE in FP8: DeepSeek-V3 671B within 0.25% of BF16 (2412.19437)",
}


def leak_findings(model, corpus, args):
    """Findings of qt.leak_check over one training step (forward, backward, optimizer)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the weights stay as they are
    x, y = mx_training.Corpus.batch(corpus.train, torch.arange(2) * 1000, args.context)
    with qt.leak_check(action="record", optimizer=opt, allow=qt.hf.LEAK_ALLOW) as report:
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return len(report.findings)


def moe_part(corpus, args, seeds, starts, names=tuple(MOE_RUNS)):
    curves, final, leaks, times, fp32_models = {}, {}, {}, {}, []
    for name in common.progress(names, desc="MoE runs", leave=True):
        curves[name], final[name] = [], []
        with common.Timer() as t:
            for seed in seeds:
                model = moe_model(corpus.vocab, args, seed)
                if MOE_RUNS[name] is not None:
                    qt.convert(model, MOE_RUNS[name])
                    if seed == seeds[0]:
                        leaks[name] = leak_findings(model, corpus, args)
                losses, _ = train(model, corpus, args, seed, args.moe_steps)
                curves[name].append(losses)
                final[name].append(mx_training.mean_loss(model, corpus.val, starts, args.context,
                                                         args.batch))
                if name == "fp32":
                    fp32_models.append(model)
        times[name] = t.seconds
    base = statistics.fmean(final["fp32"])
    rows = []
    for name in names:
        m = statistics.fmean(final[name])
        last = [statistics.fmean(c[-max(1, args.moe_steps // 10):]) for c in curves[name]]
        rows.append([MOE_LABELS[name], pm(final[name]),
                     "-" if name == "fp32" else f"{100 * (m - base) / base:+.1f}%", pm(last),
                     " / ".join(f"{v:.3f}" for v in final[name]), leaks.get(name, "-"),
                     f"{times[name]:.0f}", MOE_PAPER[name]])
    n_params = sum(p.numel() for p in fp32_models[0].parameters())
    n_experts = sum(p.numel() for n, p in fp32_models[0].named_parameters() if ".experts." in n)
    title = (f"## 1. MoE character model: FP32, MXFP8 and NVFP4 experts\n\n"
             f"Qwen3-MoE ({n_params / 1e6:.2f}M parameters, {n_experts / 1e6:.2f}M of them in "
             f"2 x 8 experts, top-2; d={args.moe_d}, 4 query / 2 KV heads of 32, context "
             f"{args.context}), {args.moe_steps} AdamW steps of {args.batch}x{args.context} "
             f"characters; validation loss on {args.eval_windows} windows. Router in FP32. "
             f"leak_check: findings in one training step (first seed).")
    table = common.markdown_table(
        ["run", "val loss", "vs FP32", "train loss (last 10%)", "val loss per seed",
         "leak_check", "time (s)", "the paper (its scale)"], rows)
    return [title, table], curves, fp32_models


# ---------------------------------------------------------------------------------------------
# 2. Attention formats

class SDPASelfAttention(common.CausalSelfAttention):
    """common.CausalSelfAttention through F.scaled_dot_product_attention (where the attention role
    applies); keeps its Q, K, V (plain, detached) when ``capture`` is a list."""

    capture = None

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in self.qkv(x).split(d, -1))
        if self.capture is not None:
            self.capture.append(tuple(common.plain(z.detach()).clone() for z in (q, k, v)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def gpt_model(vocab, args, seed):
    torch.manual_seed(seed)
    model = common.CharGPT(vocab, d=args.d, layers=2, heads=args.heads, context=args.context)
    for block in model.blocks:
        block.attn = SDPASelfAttention(args.d, args.heads)
    return model


_bf16 = qt.bf16
BF16_ATTENTION = dataclasses.replace(R.fa3_fp8_attention, qk=(_bf16, _bf16), pv=(_bf16, _bf16),
                                     name="bf16_attention")
ATTENTION = {"bf16": BF16_ATTENTION, "fa3_fp8": R.fa3_fp8_attention,
             "mx_mxfp8": R.mx_attention("mxfp8_e4m3")}
ATT_LABELS = {"bf16": "BF16 Q/K/V/P (scores, softmax FP32)",
              "fa3_fp8": "qt.recipes.fa3_fp8_attention", "mx_mxfp8": 'qt.recipes.mx_attention'
              '("mxfp8_e4m3")'}
# Everything but attention: BF16 values and GEMM operands, FP32 master weights.
GPT_BASE = qt.Recipe(weight=(qt.fp32, qt.bf16), bias=qt.fp32, activation=qt.bf16, grad=qt.bf16,
                     master_weights=True)


def rel(x, ref):
    """Relative RMS error of x against ref (FP64)."""
    x, ref = x.double(), ref.double()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def rounded(x, fmt, axis=-1):
    """x rounded to fmt blocked along axis, as attention's GEMM operands are (None: x)."""
    if fmt is None:
        return x
    if isinstance(fmt, qt.BlockFormat) and fmt.axis is not None:
        fmt = fmt.replace(axis=axis)
    return qt.quantize(x, fmt)


def attention_errors(q, k, v, fm, causal=True):
    """Relative RMS errors of the scores S = QK^T/sqrt(d) (Q and K rounded to fm.qk, the
    product in FP32) and of the emulated output O (qt.attention with fm), against FP64."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s_ref = (q.double() @ k.double().transpose(-2, -1)) * scale
    s = (rounded(q, fm.qk[0]) @ rounded(k, fm.qk[1]).transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        s, s_ref = s[..., keep], s_ref[..., keep]
    o_ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    o = qt.attention.scaled_dot_product_attention(q, k, v, is_causal=causal, formats=fm)
    return rel(s, s_ref), rel(o, o_ref), float((o.double() - o_ref).pow(2).mean().sqrt())


def attention_part(corpus, args, seeds, starts):
    final, curves, s_err, o_err = {}, {}, {}, {}
    x_eval, _ = mx_training.Corpus.batch(corpus.val, starts[:args.batch], args.context)
    for name in common.progress(["fp32", *ATTENTION], desc="attention runs", leave=True):
        final[name], curves[name], s_err[name], o_err[name] = [], [], [], []
        for seed in seeds:
            model = gpt_model(corpus.vocab, args, seed)
            if name != "fp32":
                qt.convert(model, GPT_BASE.replace(attention=ATTENTION[name]))
            losses, _ = train(model, corpus, args, seed, args.gpt_steps)
            curves[name].append(losses)
            final[name].append(mx_training.mean_loss(model, corpus.val, starts, args.context,
                                                     args.batch))
            if name == "fp32":
                continue
            captured = []  # the trained model's own Q, K, V on validation text
            for block in model.blocks:
                block.attn.capture = captured
            with torch.no_grad():
                model(x_eval)
            for block in model.blocks:
                block.attn.capture = None
            errs = [attention_errors(q, k, v, ATTENTION[name]) for q, k, v in captured]
            s_err[name].append(statistics.fmean(e[0] for e in errs))
            o_err[name].append(statistics.fmean(e[1] for e in errs))
    base = statistics.fmean(final["fp32"])
    rows = []
    for name in ["fp32", *ATTENTION]:
        m = statistics.fmean(final[name])
        rows.append(["FP32 (no recipe)" if name == "fp32" else ATT_LABELS[name],
                     pm(final[name]), "-" if name == "fp32" else f"{100 * (m - base) / base:+.1f}%",
                     " / ".join(f"{v:.3f}" for v in final[name]),
                     "-" if name == "fp32" else sci(s_err[name]),
                     "-" if name == "fp32" else sci(o_err[name])])
    title = (f"## 2. Char-GPT with FP8 attention vs BF16 attention\n\n"
             f"CharGPT (2 layers, d={args.d}, {args.heads} heads of {args.d // args.heads}, "
             f"context {args.context}) with SDPA attention, {args.gpt_steps} AdamW steps of "
             f"{args.batch}x{args.context} characters; linear layers in BF16 (FP32 master "
             f"weights), attention in the row's formats. Errors: relative RMS error against FP64 "
             f"of the scores S = QK^T/sqrt(d) (causal part) and of the attention output O, on "
             f"each trained model's own Q, K, V for {args.batch} validation windows (mean over "
             f"layers).")
    table = common.markdown_table(
        ["attention", "val loss", "vs FP32", "val loss per seed", "rel. error of S",
         "rel. error of O"], rows)
    return [title, table, fa3_table(args, seeds)], curves


def fa3_table(args, seeds):
    """The FA3 paper's numerical-error setup (arXiv 2407.08608, section 4.3): Q, K, V from
    N(0, 1) with 0.1% of the entries from N(0, 10) (outliers); RMSE of O against FP64."""
    b, h, n, d = (1, 2, 128, 128) if args.quick else (2, 4, 512, 128)
    e4m3 = qt.fp8_e4m3
    per_tensor = qt.BlockFormat(e4m3, axis=None, scale="fp32", scale_rule="amax")
    fp16 = qt.fp16 if hasattr(qt, "fp16") else "fp16"
    settings = {
        "FP16 Q/K/V/P (scores, softmax FP32)":
            (dataclasses.replace(BF16_ATTENTION, qk=(fp16, fp16), pv=(fp16, fp16)), False),
        "BF16 Q/K/V/P (scores, softmax FP32)": (BF16_ATTENTION, False),
        "FP8 E4M3, one scale per tensor": (
            qt.attention.AttentionFormats(qk=(per_tensor, per_tensor), pv=(e4m3, per_tensor)),
            False),
        "fa3_fp8_attention (block scales)": (R.fa3_fp8_attention, False),
        "fa3_fp8_attention + Hadamard on Q, K": (R.fa3_fp8_attention, True),
        "fa3_fp8_attention with P in FP32": (
            dataclasses.replace(R.fa3_fp8_attention, pv=(None, R.fa3_fp8_attention.pv[1])),
            False),
        "mx_attention(mxfp8_e4m3)": (R.mx_attention("mxfp8_e4m3"), False),
    }
    paper = {"FP16 Q/K/V/P (scores, softmax FP32)": "FA3 FP16: 1.9e-4 (baseline FP16 3.2e-4)",
             "FP8 E4M3, one scale per tensor": "baseline FP8 (per tensor): 2.4e-2",
             "fa3_fp8_attention (block scales)": "FA3 FP8 without incoherent processing: 2.4e-2",
             "fa3_fp8_attention + Hadamard on Q, K": "FA3 FP8 (block + incoherent): 9.1e-3"}
    errs = {k: [] for k in settings}
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)

        def draw():
            x = torch.randn(b, h, n, d, generator=g)
            outlier = torch.rand(b, h, n, d, generator=g) < 1e-3
            return torch.where(outlier, 10.0 * torch.randn(b, h, n, d, generator=g), x)
        q, k, v = draw(), draw(), draw()
        # incoherent processing: Q and K times one random orthogonal Hadamard matrix (QK^T
        # unchanged in exact arithmetic), spreading the outliers over the head dim
        hd = torch.ones(1, 1)
        while hd.shape[0] < d:
            hd = torch.cat([torch.cat([hd, hd], 1), torch.cat([hd, -hd], 1)], 0)
        signs = torch.randint(0, 2, (d,), generator=g) * 2 - 1
        rot = (signs[:, None] * hd) / math.sqrt(d)
        o_ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        for key, (fm, hadamard) in settings.items():
            qq, kk = (q @ rot, k @ rot) if hadamard else (q, k)
            o = qt.attention.scaled_dot_product_attention(qq, kk, v, formats=fm)
            errs[key].append(float((o.double() - o_ref).pow(2).mean().sqrt()))
    rows = [[key, sci(errs[key]), paper.get(key, "-")] for key in settings]
    title = (f"FA3's error setup (Q, K, V ~ N(0, 1) with 0.1% outliers ~ N(0, 10); batch {b}, "
             f"{h} heads, {n} tokens, head dim {d}, no mask; {len(seeds)} draws): RMSE of O "
             f"against FP64. The paper's column: its Table 3 (2407.08608), its kernels on H100.")
    return title + "\n\n" + common.markdown_table(["attention", "RMSE of O", "the paper"], rows)


# ---------------------------------------------------------------------------------------------
# 3. KV-cache formats

KV = {"none (FP32)": None, "bf16": "bf16", "fp8_e4m3 (no scale)": "fp8_e4m3",
      "FP8_PER_TOKEN": qt.kv_cache.FP8_PER_TOKEN, "FP8_PER_BLOCK": qt.kv_cache.FP8_PER_BLOCK,
      "MXFP8": qt.kv_cache.MXFP8, "NVFP4": qt.kv_cache.NVFP4, "MXFP4": qt.kv_cache.MXFP4}


def kv_bits(f, head_dim):
    """Bits per stored value, the scales included (a per-token scale spans the head dim)."""
    if f is None:
        return "32"
    if isinstance(f, qt.BlockFormat) and f.block_size is None and f.axis is not None:
        return f"{common.bits_of(f.elem) + common.bits_of(f.scale) / head_dim:g}"
    return f"{common.bits_of(f):g}"


@torch.no_grad()
def cached_loss(model, data, starts, args, fmt):
    """Validation loss with K and V read from a DynamicCache in ``fmt``."""
    import transformers
    total = 0.0
    for i in range(0, len(starts), args.batch):
        x, y = mx_training.Corpus.batch(data, starts[i:i + args.batch], args.context)
        cache = transformers.DynamicCache(config=model.lm.config)
        if fmt is not None:
            cache = qt.kv_cache.wrap(cache, fmt)
        logits = model(x, cache=cache, use_cache=True)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))) \
            * len(x)
    return total / len(starts)


def kv_part(corpus, args, models, starts):
    ppl = {name: [] for name in KV}
    for model in common.progress(models, desc="KV caches", leave=True):
        model.eval()
        for name, fmt in KV.items():
            ppl[name].append(math.exp(cached_loss(model, corpus.val, starts, args, fmt)))
    base = statistics.fmean(ppl["none (FP32)"])
    rows = []
    for name, fmt in KV.items():
        m = statistics.fmean(ppl[name])
        f = qt.kv_cache.cache_format(fmt) if fmt is not None else None
        rows.append([name, kv_bits(f, MOE_HEAD_DIM), pm(ppl[name], 4),
                     "-" if fmt is None else f"{100 * (m - base) / base:+.2f}%",
                     " / ".join(f"{v:.4f}" for v in ppl[name])])
    title = (f"## 3. Perplexity against the KV-cache format\n\n"
             f"The FP32-trained MoE models of part 1 ({len(models)} seeds), evaluated in FP32 "
             f"with K and V stored in the cache format (qt.kv_cache.wrap on a DynamicCache), "
             f"teacher-forced over {args.eval_windows} validation windows of {args.context} "
             f"characters. Anchors: vLLM's docs ('FP8 E4M3 quantization typically only minimally "
             f"degrades inference accuracy'), SGLang's ('may introduce minimal accuracy "
             f"degradation depending on the quantization format'); no numbers to compare at "
             f"this scale.")
    table = common.markdown_table(
        ["cache format", "bits/value", "val perplexity", "vs FP32 cache", "per seed"], rows)
    return [title, table]


# ---------------------------------------------------------------------------------------------

def plot(moe_curves, att_curves, path, args):
    plt = common.plt_module()
    panels = [(c, t) for c, t in ((moe_curves, "MoE: train loss (mean of seeds, band min-max)"),
                                  (att_curves, "char-GPT by attention format: train loss"))
              if c]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, (curves, title) in zip(axes[0], panels):
        for i, (name, runs) in enumerate(curves.items()):
            window = max(1, len(runs[0]) // 15)
            mean = [statistics.fmean(v) for v in zip(*runs)]
            lo, hi = [min(v) for v in zip(*runs)], [max(v) for v in zip(*runs)]
            xs = range(1, len(mean) + 1)
            ax.plot(xs, common.smooth(mean, window), color=cmap(i), lw=1.5,
                    label=MOE_LABELS.get(name) if curves is moe_curves
                    else ATT_LABELS.get(name, "FP32"))
            ax.fill_between(xs, common.smooth(lo, window), common.smooth(hi, window),
                            color=cmap(i), alpha=0.12)
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.set_ylabel("cross-entropy (moving average)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    common.save_figure(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ",".join(PARTS))
    p.add_argument("--steps", type=int, default=None,
                   help=f"MoE training steps (default {DEFAULTS['moe_steps']})")
    p.add_argument("--gpt-steps", type=int, default=None,
                   help=f"char-GPT training steps (default {DEFAULTS['gpt_steps']})")
    p.add_argument("--seeds", type=int, default=DEFAULTS["seeds"])
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--context", type=int, default=DEFAULTS["context"])
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--eval-windows", type=int, default=DEFAULTS["eval_windows"])
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output folder (default examples/results/local, git-ignored; nothing "
                        "written with --quick; --out examples/results: the committed results)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    command = " ".join(["python examples/moe_attention_study.py",
                        *(sys.argv[1:] if argv is None else argv)])
    args.d, args.heads, args.moe_d = 64, 2, 64
    if args.quick:
        args.steps = args.steps or 2
        args.gpt_steps = args.gpt_steps or 2
        args.seeds, args.batch, args.eval_windows = 1, 4, 8
    args.moe_steps = args.steps or DEFAULTS["moe_steps"]
    args.gpt_steps = args.gpt_steps or DEFAULTS["gpt_steps"]
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = [s for s in parts if s not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    out = common.output_dir(args.out, args.quick)
    common.setup(args.threads, args.seed)

    corpus = mx_training.Corpus(max_bytes=200_000 if args.quick else 2_000_000)
    starts = val_starts(corpus, args)
    seeds = list(range(args.seed, args.seed + args.seeds))
    sections = [f"# MoE, attention and KV caches in low precision\n\n{len(seeds)} seeds "
                f"(initialisation and batches) per setting: mean ± half the min-max spread. "
                f"{common.env_line()}.\n\nCommand: {command}"]
    moe_curves, att_curves, models = {}, {}, []
    with common.Timer() as total:
        # the MATH backend: SDPA as bmm's and softmax on the MoE model's QTensors (no fused
        # kernel for leak_check to report); the char-GPT's attention role takes SDPA before it
        with sdpa_kernel(SDPBackend.MATH):
            if "moe" in parts or "kv" in parts:
                names = tuple(MOE_RUNS) if "moe" in parts else ("fp32",)  # kv: FP32 models
                text, moe_curves, models = moe_part(corpus, args, seeds, starts, names)
                if "moe" in parts:
                    sections += text
                else:
                    moe_curves = {}
            if "attention" in parts:
                text, att_curves = attention_part(corpus, args, seeds, starts)
                sections += text
            if "kv" in parts:
                sections += kv_part(corpus, args, models, starts)
    sections.append(f"Total time: {total.seconds / 60:.1f} minutes.")
    common.publish(out, "moe_attention_study", sections,
                   lambda path: plot(moe_curves, att_curves, path, args))


if __name__ == "__main__":
    main()
