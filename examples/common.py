"""Shared pieces of the examples: real data that ships in packages, small models, a training loop,
tables and plots. Nothing here downloads anything.

Data:
- ``load_digits_split``: scikit-learn's 1,797 real 8x8 handwritten digits (UCI optdigits test
  set), pixels scaled to [0, 1], a fixed stratified 80/20 train/test split.
- ``load_stdlib_text``: the source of Python's standard library (the top-level ``*.py`` files of
  ``sysconfig.get_paths()["stdlib"]``, sorted by name), as bytes for a character-level model.
"""
from __future__ import annotations

import contextlib
import math
import os
import pathlib
import re
import sys
import sysconfig
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"  # the committed results
LOCAL_RESULTS_DIR = RESULTS_DIR / "local"  # where a run writes by default (git-ignored)


def output_dir(out: Optional[pathlib.Path], quick: bool) -> Optional[pathlib.Path]:
    """Where a script writes its tables and plots: ``--out DIR`` if given, else the git-ignored
    examples/results/local/ (nothing with --quick), so that a run never overwrites the committed
    results; regenerating those is an explicit ``--out examples/results``."""
    if out is not None:
        return out
    return None if quick else LOCAL_RESULTS_DIR

try:  # run from a source checkout without installing: the repository root holds qtensor/
    import qtensor  # noqa: F401
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def setup(threads: int = 1, seed: int = 0) -> None:
    """Few threads: these models are tiny, and the machines running them are shared."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)


def progress(iterable=None, **kwargs):
    """tqdm progress bar (to stderr, so the printed tables stay clean); plain iterable if absent."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the examples still run, just without bars
        return iterable if iterable is not None else range(kwargs.get("total", 0))
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("file", sys.stderr)
    return tqdm(iterable, **kwargs)


def short_warning(text: str, limit: int = 200) -> str:
    """A warning's gist on one line: its first sentence without the parenthesised asides."""
    while True:  # innermost parentheses first
        shorter = re.sub(r"\s*\([^()]*\)", "", text)
        if shorter == text:
            break
        text = shorter
    text = " ".join(re.split(r"(?<=\.)\s+(?=[A-Z])", text.strip())[0].split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def warnings_after_bars(label: str):
    """Warnings raised inside are shown after it, above the progress bars rather than inside
    them, each once and shortened to one line (``short_warning``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    lines = dict.fromkeys(f"{label}: {w.category.__name__}: {short_warning(str(w.message))}"
                          for w in caught)
    try:
        from tqdm.auto import tqdm
        write = tqdm.write  # (clears the bars, writes, draws them again)
    except ImportError:
        write = print
    for line in lines:
        write(line, file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Data

def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """(x_train, y_train, x_test, y_test): float32 images (N, 1, 8, 8) in [0, 1], int64 labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("this example needs scikit-learn: pip install scikit-learn") from e
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    # Stratified split with a fixed permutation: the same 1,437 / 360 images on every machine.
    g = torch.Generator().manual_seed(seed)
    train_idx, test_idx = [], []
    for c in range(10):
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_test = round(len(idx) * test_fraction)
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    train_idx = torch.cat(train_idx).sort().values
    test_idx = torch.cat(test_idx).sort().values
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def load_stdlib_text(max_bytes: Optional[int] = None) -> bytes:
    """The top-level .py files of Python's standard library, concatenated in sorted order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise SystemExit(f"no .py files found under {root}")
    chunks, total = [], 0
    for p in files:
        data = p.read_bytes()
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    text = b"".join(chunks)
    return text[:max_bytes] if max_bytes is not None else text


# ---------------------------------------------------------------------------------------------
# Models

class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a max pool and two linear layers: ~37k parameters, ~98% on digits."""

    def __init__(self, c1: int = 16, c2: int = 32, hidden: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.fc1 = nn.Linear(c2 * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class CausalSelfAttention(nn.Module):
    """Attention written with matmuls (not SDPA), so both attention products are contractions
    that an emulated format rounds like any other matrix multiply."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.reshape(b, t, h, d // h).transpose(1, 2)
        k = k.reshape(b, t, h, d // h).transpose(1, 2)
        v = v.reshape(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    """A GPT-2-style decoder (pre-LayerNorm blocks, learned positions) over byte tokens."""

    def __init__(self, vocab: int, d: int = 128, layers: int = 2, heads: int = 4,
                 context: int = 64):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("positions", torch.arange(context), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(self.positions[:t])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# ---------------------------------------------------------------------------------------------
# Training and evaluation

def plain(x: torch.Tensor) -> torch.Tensor:
    """x's values as a plain tensor (a QTensor dequantized; anything else unchanged)."""
    import qtensor as qt
    return x.dequantize() if isinstance(x, qt.QTensor) else x


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        pred = model(x[i:i + batch]).argmax(dim=1)
        correct += int((pred == y[i:i + batch]).sum())
    model.train()
    return correct / len(x)


def train_classifier(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                     y: torch.Tensor, *, steps: int, batch: int = 64, seed: int = 0,
                     desc: str = "", loss_scale: float = 1.0,
                     callback: Optional[Callable[[int], None]] = None) -> List[float]:
    """Minibatch training for ``steps`` steps with a fixed shuffling order; per-step losses.

    loss_scale multiplies the loss before backward (static loss scaling, for gradient formats
    whose smallest value is far above typical gradients); SGD/Adam see scaled gradients, so the
    caller divides the learning rate (SGD) or relies on Adam's scale invariance.
    callback(step) runs after each optimizer step (e.g. weight averaging).
    """
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    pos = 0
    losses = []
    model.train()
    for step in progress(range(steps), desc=desc):
        if pos + batch > len(x):
            order, pos = torch.randperm(len(x), generator=g), 0
        idx = order[pos:pos + batch]
        pos += batch
        logits = model(x[idx])
        loss = F.cross_entropy(logits, y[idx])  # in the model's format: this one is trained
        opt.zero_grad(set_to_none=True)
        (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        opt.step()
        # Recorded: the loss of the emulated logits computed in FP32 (the loss above is itself
        # rounded to the format, e.g. to 3 mantissa bits in FP8, too coarse to plot).
        with torch.no_grad():
            losses.append(float(F.cross_entropy(plain(logits.detach()), y[idx])))
        if callback is not None:
            callback(step)
    return losses


def plain_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's parameters as plain float tensors (a QTensor's values, dequantized)."""
    out = {}
    for name, p in model.named_parameters():
        p = plain(p.detach())
        # torch.nn.utils.parametrize keeps the raw tensor under "<name>.parametrizations.X.original"
        out[name.replace(".parametrizations.", ".").replace(".original", "")] = p.clone()
    return out


def warmup_cosine(lr: float, steps: int):
    """The learning rate of each step: a linear warmup over the first 5% of the steps, then a
    cosine decay to 10% of ``lr`` (the schedule of the char-GPT studies)."""
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
    return lr_at


def smooth(values: Sequence[float], window: int) -> List[float]:
    """Trailing moving average (window shrinks at the start), for readable loss curves."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


# ---------------------------------------------------------------------------------------------
# Tables and plots

def markdown_table(header: Sequence[str], rows: Sequence[Sequence], align: str = "") -> str:
    """A GitHub markdown table; align is one char per column ('l' or 'r', default 'r' but col 0)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    align = align or ("l" + "r" * (len(header) - 1))

    def fmt_row(r):
        return "| " + " | ".join(
            c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1))
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([fmt_row(cells[0]), sep] + [fmt_row(r) for r in cells[1:]])


def bits_of(fmt) -> float:
    return float(getattr(fmt, "bits", 32))


def fmt_bits(b: float) -> str:
    return f"{b:g}"


def save_text(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")


def publish(out, name: str, sections, plot=None) -> None:
    """Print the sections (title, tables, ...) and, with an output folder, write them to
    ``out/name.md`` and, given ``plot(path)``, the picture to ``out/name.png``."""
    text = "\n\n".join(sections)
    print()
    print(text)
    if out is None:
        return
    written = [out / f"{name}.md"]
    save_text(written[0], text)
    if plot is not None:
        written.append(out / f"{name}.png")
        plot(written[1])
    print(f"\nwrote {' and '.join(str(w) for w in written)}")


def plt_module():
    """matplotlib with a file-only backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: pathlib.Path) -> None:
    """Lay out, write (110 dpi) and close a matplotlib figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt_module().close(fig)


def env_line() -> str:
    import platform
    return (f"torch {torch.__version__}, Python {platform.python_version()}, "
            f"{torch.get_num_threads()} thread(s), {os.cpu_count()} CPU(s)")
