"""`python -m qtensor`: a table of the preset formats and how much a random tensor loses in each."""
import argparse

import torch

from . import PRESETS, __version__, quantize


def format_table(n: int = 1 << 16, seed: int = 0) -> str:
    """Bits, range and the relative error of quantizing N(0,1) samples, for every preset."""
    torch.manual_seed(seed)
    x = torch.randn(n)
    rows = [("format", "bits", "max", "min normal", "min subnormal", "rel. error (randn)")]
    for name, fmt in PRESETS.items():
        if name == "e8m0":
            sample = x.abs() + 1e-3  # E8M0 holds positive powers of two only
        else:
            sample = x
        q = quantize(sample, fmt)
        err = ((q - sample).norm() / sample.norm()).item()
        bits = f"{fmt.bits:g}"
        rows.append((name, bits, f"{fmt.max:.4g}", f"{fmt.min_normal:.4g}",
                     f"{fmt.min_subnormal:.4g}", f"{err:.3e}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m qtensor", description=__doc__)
    parser.add_argument("--n", type=int, default=1 << 16, help="samples per format")
    parser.add_argument("--version", action="version", version=f"qtensor {__version__}")
    args = parser.parse_args(argv)
    print(format_table(args.n))


if __name__ == "__main__":
    main()
