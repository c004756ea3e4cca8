"""Fine-tune a (small, randomly initialised) Hugging Face GPT-2 with an MX recipe.

    python examples/hf_finetune.py            # ~1 min on one core
    python examples/hf_finetune.py --quick    # a few steps (tests/test_examples.py)

No download: the model is built from a GPT2Config (random init), the text is Python's own
standard library (bytes, vocabulary 256). The steps a user takes with a real checkpoint:

1. A "pretrained" checkpoint: the random model trains a few FP32 steps and is saved with
   ``save_pretrained`` (a stand-in for a model from the Hub).
2. ``GPT2LMHeadModel.from_pretrained(...)`` loads it (plain), ``model.to(qt.recipes.mxfp6)``
   converts it (MXFP6_E3M2 operands in every matrix multiply, BF16 vector ops, FP32 masters).
3. Fine-tuning with AdamW under ``sdpa_kernel(SDPBackend.MATH)``: HF's default SDPA attention
   decomposes into emulated matmuls and softmax (the fused CPU kernel would compute attention
   as one op). The first step runs under ``qt.leak_check(allow=qt.hf.LEAK_ALLOW)``: it raises
   if any value escaped the formats.
4. ``model.save_pretrained`` saves the fine-tuned model with its formats (in config.json; qt.convert
   gave the converted model this save_pretrained); ``qt.hf.from_pretrained`` loads it back
   converted, and its logits are checked bit for bit against the trained model.

The same fine-tuning runs in FP32 for comparison; the table gives the validation loss before and
after each. See docs/huggingface.md.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import qtensor as qt  # noqa: E402

try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
except ImportError as e:  # pragma: no cover - depends on the environment
    raise SystemExit("this example needs transformers and safetensors: "
                     "pip install transformers safetensors") from e


def batches(data: torch.Tensor, steps: int, batch: int, ctx: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=g)
        yield torch.stack([data[i:i + ctx] for i in idx.tolist()]).long()


def loss_of(model, ids) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    return out.loss


@torch.no_grad()
def val_loss(model, data, ctx: int, n: int = 8) -> float:
    model.eval()
    ids = torch.stack([data[i * ctx:(i + 1) * ctx] for i in range(n)]).long()
    with sdpa_kernel(SDPBackend.MATH):
        loss = common.plain(loss_of(model, ids)).item()
    model.train()
    return loss


def train(model, data, steps, args, seed, check_leaks=False):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for step, ids in enumerate(common.progress(batches(data, steps, args.batch, args.ctx, seed),
                                               total=steps, desc="train")):
        with sdpa_kernel(SDPBackend.MATH):
            if check_leaks and step == 0:  # raises on the first value outside the formats
                with qt.leak_check(optimizer=opt, allow=qt.hf.LEAK_ALLOW):
                    loss = loss_of(model, ids)
                    loss.backward()
                    opt.step()
            else:
                loss = loss_of(model, ids)
                loss.backward()
                opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(common.plain(loss).item())
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, a few steps")
    p.add_argument("--pre-steps", type=int, default=150)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    layers, d = 2, 64
    if args.quick:
        args.pre_steps, args.steps, args.batch, args.ctx, layers, d = 10, 4, 4, 32, 1, 32
    common.setup()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    text = common.load_stdlib_text(max_bytes=400_000 if not args.quick else 60_000)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = int(0.9 * data.numel())
    train_data, valid = data[:split], data[split:]

    config = GPT2Config(vocab_size=256, n_positions=args.ctx, n_embd=d, n_layer=layers, n_head=4,
                        bos_token_id=0, eos_token_id=0, use_cache=False)  # attention: SDPA
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp) / "base"
        model = GPT2LMHeadModel(config)
        train(model, train_data, args.pre_steps, args, seed=0)
        model.save_pretrained(base)  # 1. the stand-in for a pretrained checkpoint

        rows = []
        for label, recipe in (("FP32", None), ("qt.recipes.mxfp6", qt.recipes.mxfp6)):
            torch.manual_seed(1)
            model = GPT2LMHeadModel.from_pretrained(base)  # 2. load (plain) ...
            if recipe is not None:
                model.to(recipe)  # ... and convert: qt.convert(model, recipe)
            before = val_loss(model, valid, args.ctx)
            losses = train(model, train_data, args.steps, args, seed=2,  # 3. fine-tune
                           check_leaks=recipe is not None)
            after = val_loss(model, valid, args.ctx)
            if recipe is not None:  # 4. save with the formats, load back converted
                model.save_pretrained(pathlib.Path(tmp) / "tuned")
                loaded = qt.hf.from_pretrained(GPT2LMHeadModel, pathlib.Path(tmp) / "tuned")
                ids = valid[:args.ctx].long()[None]
                model.eval(), loaded.eval()
                with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
                    a, b = model(input_ids=ids).logits, loaded(input_ids=ids).logits
                same = torch.equal(common.plain(a), common.plain(b)) and a.fmt == b.fmt
                if not same:
                    raise SystemExit("the reloaded model's logits differ from the trained one's")
            rows.append((label, f"{before:.3f}", f"{losses[-1]:.3f}", f"{after:.3f}"))
    print(f"GPT-2 ({layers} layers, d={d}, context {args.ctx}), {args.pre_steps} FP32 steps, "
          f"then {args.steps} fine-tuning steps (AdamW, lr {args.lr}, batch {args.batch})\n")
    print(common.markdown_table(["run", "val loss before", "last train loss", "val loss after"],
                                rows))
    print("\nqt.recipes.mxfp6: no leaks in its first step (leak_check with qt.hf.LEAK_ALLOW); "
          "saved with model.save_pretrained, reloaded with qt.hf.from_pretrained: logits "
          "identical bit for bit")


if __name__ == "__main__":
    main()
