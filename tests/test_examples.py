"""Each example runs end to end in --quick mode, as a user would run it (a subprocess from the
repository root), and prints its table; the demo also writes its PNG.

Needs scikit-learn (the digits), tqdm and matplotlib: the ``examples`` extra.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

pytest.importorskip("sklearn", reason="the examples' digits come from scikit-learn")
pytest.importorskip("matplotlib", reason="the examples plot with matplotlib")


def run_example(script, *args, timeout=120, stderr=False):
    """The example's stdout (with stderr=True: (stdout, stderr))."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return (proc.stdout, proc.stderr) if stderr else proc.stdout


def table_rows(text):
    """Markdown table rows (first cell -> remaining cells), header and separator excluded."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|:") and not line.startswith("|-"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def percent(cell):
    m = re.fullmatch(r"([0-9.]+)%", cell)
    assert m, f"not a percentage: {cell!r}"
    return float(m.group(1))


def test_demo_quick_writes_table_and_png(tmp_path):
    out = run_example("demo.py", "--quick", "--out", str(tmp_path))
    rows = table_rows(out)
    for name in ["fp32", "bf16", "fp8_e4m3", "mxfp8_e4m3", "mxfp6_e3m2", "mxfp4_e2m1",
                 "mxint8"]:
        assert name in rows, f"no row for {name} in:\n{out}"
        assert 0.0 <= percent(rows[name][1]) <= 100.0
        if name != "fp32":
            assert rows[name][6] == "0", f"qt.leak_check found leaks under {name}:\n{out}"
    assert any(n.startswith("fixed") for n in rows)
    assert rows["mxfp4_e2m1"][0] == "4.25"  # bits per value, the shared scale included
    png = tmp_path / "demo.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "demo.md").read_text().count("\n|") >= 9


def test_demo_warnings_are_short_lines_outside_the_progress_bars(tmp_path):
    """MXFP4's clipping warnings (the demo's mxfp4_e2m1 row warns): each on a line of its own,
    not inside a tqdm bar's line, and short."""
    pytest.importorskip("tqdm")
    _, err = run_example("demo.py", "--formats", "mxfp4_e2m1", "--steps", "6", "--seeds", "1",
                         "--out", str(tmp_path), stderr=True)
    lines = [line for line in err.split("\n") if "Warning" in line]
    assert lines, err[-3000:]
    for line in lines:
        assert "it/s" not in line and "%|" not in line, line  # no bar on the warning's line
        assert len(line) <= 260, line


def test_demo_writes_to_an_untracked_folder_by_default():
    """`python examples/demo.py` (the README's first command) writes to the git-ignored
    examples/results/local/, never over the committed examples/results/demo.md; every script
    takes its output folder from the same rule."""
    committed = (EXAMPLES / "results" / "demo.md").read_bytes()
    out = run_example("demo.py", "--formats", "fp32,bf16", "--steps", "2", "--seeds", "2")
    local = EXAMPLES / "results" / "local"
    assert f"wrote {local / 'demo.md'} and {local / 'demo.png'}" in out, out
    assert (EXAMPLES / "results" / "demo.md").read_bytes() == committed
    assert "per seed (%)" in out and len(table_rows(out)["fp32"][2].split(" / ")) == 2
    ignored = subprocess.run(["git", "check-ignore", "-q", str(local / "demo.md")], cwd=ROOT)
    assert ignored.returncode in (0, 128), "examples/results/local/ is not git-ignored"
    for script in ("demo.py", "direct_cast.py", "mx_training.py", "qpytorch_recipes.py",
                   "accum_study.py", "fp4_recipes_study.py", "analysis_study.py",
                   "ptq_study.py", "moe_attention_study.py"):
        assert "common.output_dir(args.out, args.quick)" in (EXAMPLES / script).read_text()


def test_direct_cast_quick():
    out = run_example("direct_cast.py", "--quick")
    cnn_text, _, gpt_text = out.partition("Character-level GPT")
    rows, gpt_rows = table_rows(cnn_text), table_rows(gpt_text)
    for name in ["mxint8", "mxfp8_e4m3", "mxfp6_e3m2", "mxfp4_e2m1", "nvfp4"]:
        assert name in rows and name in gpt_rows
        assert float(gpt_rows[name][1]) > 0.0  # a finite loss with MX matmul operands
    # Casting to MXINT8 is nearly lossless: its predictions agree with FP32 on most digits
    # even after a short training.
    assert percent(rows["mxint8"][3]) >= 90.0


def test_ptq_study_quick():
    out = run_example("ptq_study.py", "--quick", "--formats", "mxint8,mxfp4_e2m1,nvfp4")
    cnn_text, _, gpt_text = out.partition("Character-level GPT")
    rows, gpt_rows = table_rows(cnn_text), table_rows(gpt_text)
    for name in ["mxint8", "mxfp4_e2m1", "nvfp4"]:
        assert name in rows and name in gpt_rows
        # accuracy and loss of direct cast, GPTQ and error diffusion: numbers, finite losses
        for acc in rows[name][1::2]:
            assert 0.0 <= float(acc) <= 100.0
        for loss in gpt_rows[name][1::2]:
            assert 0.0 < float(loss) < 10.0
    assert "GPTQ" in out and "error diffusion" in out


def test_analysis_study_quick():
    out = run_example("analysis_study.py", "--quick", "--seeds", "1", timeout=300)
    cnn_text, _, gpt_text = out.partition("## Character-level GPT")
    for text in (cnn_text, gpt_text):
        rows = table_rows(text)
        for uniform in ("mxfp6_e3m2", "nvfp4"):
            same = rows[f"uniform {uniform}"]
            mixed = rows[f"suggested @ {uniform} bits"]
            layers = rows[f"suggested layers @ {uniform} bits"]
            # equal bits: the suggested weights stay within the uniform recipe's bits per
            # weight, the suggested layers within its bits per weight+activation
            assert float(mixed[0]) <= float(same[0]) + 1e-3, rows
            assert float(layers[1]) <= float(same[1]) + 1e-3, rows
            loss = 2 if text is gpt_text else 4  # (the CNN's columns: accuracy first)
            for row in (mixed, layers):
                assert 0.0 < float(row[loss].split(" ")[0]) < 10.0, rows
        assert "| layer" in text and "weights in" in text  # the choices of seed 0


def test_qpytorch_recipes_quick():
    rows = table_rows(run_example("qpytorch_recipes.py", "--quick"))
    for name in ["fp32", "fp16", "block8", "wage", "swalp"]:
        assert name in rows
    assert any(n.startswith("swalp + SWA") for n in rows)


def test_mx_training_quick():
    rows = table_rows(run_example("mx_training.py", "--quick"))
    assert {"FP32", "MXFP6_E3M2 (W, A, G)", "MXFP4 weights + MXFP6_E3M2 (A, G)"} <= set(rows)
    for cells in rows.values():
        if cells[0] != "train loss":
            assert 0.0 < float(cells[0]) < 10.0  # a finite cross-entropy


def test_fp4_recipes_study_quick():
    out = run_example("fp4_recipes_study.py", "--quick", "--runs",
                      "fp32,nvfp4_nvidia,nvidia-rht,quartet")
    rows = table_rows(out)
    assert {"FP32", "qt.recipes.nvfp4_nvidia", "nvfp4_nvidia without wgrad RHT",
            "qt.recipes.quartet"} <= set(rows)
    for name, cells in rows.items():
        if cells[0] != "GPT val loss":
            assert 0.0 < float(cells[0].split(" ± ")[0]) < 10.0, (name, cells)  # finite
            assert 0.0 <= float(cells[3].split(" ± ")[0]) <= 100.0
    assert "Command: python examples/fp4_recipes_study.py --quick" in out


def test_moe_attention_study_quick():
    """The three parts run and print their tables: the MoE recipes train to finite losses with
    no leak_check finding (the experts' grouped GEMMs in their formats), the attention formats
    give finite losses and score errors ordered as their precision, every KV-cache format a
    perplexity."""
    pytest.importorskip("transformers", reason="the MoE model is a transformers Qwen3-MoE")
    out = run_example("moe_attention_study.py", "--quick")
    moe, _, rest = out.partition("## 2.")
    att, _, kv = rest.partition("## 3.")
    att, _, fa3 = att.partition("FA3's error setup")
    rows = table_rows(moe)
    assert {"FP32", "qt.recipes.mxfp8_pretraining", "qt.recipes.nvfp4_nvidia"} <= set(rows)
    for name in ("qt.recipes.mxfp8_pretraining", "qt.recipes.nvfp4_nvidia"):
        assert 0.0 < float(rows[name][0].split(" ± ")[0]) < 10.0, rows
        assert rows[name][4] == "0", f"leak_check findings under {name}:\n{moe}"
    rows = table_rows(att)
    bf16, fp8 = rows["BF16 Q/K/V/P (scores, softmax FP32)"], rows["qt.recipes.fa3_fp8_attention"]
    for cells in (bf16, fp8):
        assert 0.0 < float(cells[0].split(" ± ")[0]) < 10.0, rows
    err = lambda cells, i: float(cells[i].split(" ± ")[0])  # noqa: E731
    assert err(bf16, 3) < err(fp8, 3) and err(bf16, 4) < err(fp8, 4), rows  # S, then O
    assert "fa3_fp8_attention + Hadamard on Q, K" in table_rows(fa3)
    rows = table_rows(kv)
    for name in ("none (FP32)", "bf16", "FP8_PER_TOKEN", "NVFP4", "MXFP4"):
        assert 1.0 < float(rows[name][1].split(" ± ")[0]) < 1000.0, rows
    assert "Command: python examples/moe_attention_study.py --quick" in out


def test_hf_finetune_quick():
    pytest.importorskip("transformers", reason="the Hugging Face example needs transformers")
    pytest.importorskip("safetensors", reason="the Hugging Face example saves safetensors")
    out = run_example("hf_finetune.py", "--quick")
    rows = table_rows(out)
    assert {"FP32", "qt.recipes.mxfp6"} <= set(rows)
    for name in ("FP32", "qt.recipes.mxfp6"):
        before, _last, after = map(float, rows[name])
        assert 0.0 < after < before < 10.0, rows  # it learns, with finite losses
    assert "logits identical bit for bit" in out


def test_demo_learns_under_mxint8(tmp_path):
    # A real (short) training run: the emulated model must learn, not only run.
    rows = table_rows(run_example("demo.py", "--formats", "fp32,mxint8", "--steps", "120",
                                  "--out", str(tmp_path)))
    fp32, mxint8 = percent(rows["fp32"][1]), percent(rows["mxint8"][1])
    assert fp32 >= 90.0, rows
    assert mxint8 >= 90.0 and abs(mxint8 - fp32) <= 5.0, rows


def test_mx_contractions_of_the_gpt_match_quantize_then_multiply():
    # examples/RESULTS.md attributes the MXFP6 gap of the GPT study to the format, not to the
    # emulation: the three contractions of its forward pass (linear layers, q @ k^T, att @ v)
    # with MXFP6 operands equal an independent quantize-then-multiply, bit for bit.
    import torch
    import torch.nn.functional as F
    import qtensor as qt

    f = qt.mxfp6_e3m2
    g = torch.Generator().manual_seed(0)

    def q(t, axis):
        return qt.quantize(t, f.replace(axis=axis))

    def wrap(t, fmt=qt.bf16):
        return qt.as_qtensor(t, fmt, mm_fmt=f)

    x = qt.quantize(torch.randn(2, 64, 128, generator=g), qt.bf16)
    w, b = torch.randn(384, 128, generator=g), torch.randn(384, generator=g)
    got = F.linear(wrap(x), wrap(w, qt.fp32), b).dequantize()
    want = qt.quantize(q(x, -1) @ q(w, -1).T + b, qt.bf16)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))

    qq, k, v = (qt.quantize(torch.randn(2, 4, 64, 32, generator=g), qt.bf16) for _ in range(3))
    got = (wrap(qq) @ wrap(k).transpose(-2, -1)).dequantize()
    want = qt.quantize(q(qq, -1) @ q(k, -1).transpose(-2, -1), qt.bf16)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))

    att = qt.quantize(torch.softmax(torch.randn(2, 4, 64, 64, generator=g), -1), qt.bf16)
    got = (wrap(att) @ wrap(v)).dequantize()
    want = qt.quantize(q(att, -1) @ q(v, -2), qt.bf16)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_demo_mxfp4_study_quick():
    """The script behind RESULTS.md's explanation of the demo's MXFP4 divergence runs and
    prints one row per variant and seed; its clipping count matches the floor rule by hand."""
    out = run_example("demo_mxfp4_study.py", "--variants", "base,grad_ceil", "--seeds", "0",
                      "--steps", "3", "--every", "1")
    rows = [line for line in out.splitlines() if line.startswith("| base |")
            or line.startswith("| grad_ceil |")]
    assert len(rows) == 2, out
    sys.path.insert(0, str(EXAMPLES))
    import torch
    import demo_mxfp4_study as study
    # block amax 7 -> floor scale 2^(2 - 2) = 1: 7 and 6.5 exceed 6 (clipped), 6 does not
    x = torch.zeros(2, 32)
    x[0, :4] = torch.tensor([7.0, 6.5, 6.0, 1.0])
    x[1, :2] = torch.tensor([5.0, 1.0])  # amax 5 -> scale 1: nothing clipped
    assert study.clipped_share(x, 1) == 2 / 6
