"""The package as a user meets it: bad arguments, the missing-extension warning, version, typing."""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest
import torch

import qtensor as qt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(*args: str) -> subprocess.CompletedProcess:
    """A fresh interpreter in the repository root (this checkout's qtensor first on the path)."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=180)


# ---------------------------------------------------------------------------------------------
# generator: a torch.Generator or None, refused precisely otherwise

@pytest.mark.parametrize("call", [
    lambda x, g: qt.quantize(x, qt.fp8_e4m3, rounding="stochastic", generator=g),
    lambda x, g: qt.quantize_(x, qt.mxfp4_e2m1, rounding="stochastic", generator=g),
    lambda x, g: qt.quantize(x, qt.bf16, generator=g),  # not stochastic: still checked
    lambda x, g: qt.reference.quantize(x, "fixed8.4", rounding="stochastic", generator=g),
    lambda x, g: qt.reference.quantize(x, "fixed8.4", generator=g),
], ids=["quantize", "quantize_", "quantize-nearest", "reference", "reference-nearest"])
@pytest.mark.parametrize("bad", [5, "cpu", torch.device("cpu")], ids=["int", "str", "device"])
def test_generator_must_be_a_torch_generator(call, bad):
    x = torch.randn(64)
    before = x.clone()
    with pytest.raises(TypeError, match=r"^generator must be a torch\.Generator or None, got "
                                        rf"{type(bad).__name__}$"):
        call(x, bad)
    assert torch.equal(x, before)  # quantize_ refused before touching x


def test_generator_makes_stochastic_rounding_reproducible():
    x = torch.randn(1000)
    a, b = (qt.quantize(x, qt.fp8_e4m3, rounding="stochastic",
                        generator=torch.Generator().manual_seed(3)) for _ in range(2))
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generator_of_another_device_feeds_the_seed():
    """One seed is drawn from the generator on its own device: a CUDA generator serves a CPU
    tensor, and the same seed gives the same bits as a CPU generator in the same state."""
    x = torch.randn(1000)
    g = torch.Generator("cuda").manual_seed(7)
    seed = qt.reference.draw_seed(torch.Generator("cuda").manual_seed(7))
    q = qt.quantize(x, qt.fp8_e4m3, rounding="stochastic", generator=g)
    ref = qt.reference.quantize_with_seed(x, qt.fp8_e4m3, "stochastic", seed)
    assert torch.equal(q.view(torch.int32), ref.view(torch.int32))


# ---------------------------------------------------------------------------------------------
# out=: any tensor torch's own out= ops take, or a precise error; never a crash

_NEG_OUT = """
import torch, qtensor as qt
ok = []
for dtype, ctype in [(torch.float32, torch.complex64), (torch.float64, torch.complex128)]:
    for fmt in (qt.fp8_e4m3, qt.format("fixed8.4"), qt.mxfp4_e2m1):
        x = torch.randn(2, 32, dtype=dtype)
        out = torch.zeros(2, 32, dtype=ctype).conj().imag  # the negative bit is set
        assert out.is_neg()
        r = qt.quantize(x, fmt, out=out)
        ok.append(r is out and torch.equal(out.resolve_neg(), qt.quantize(x, fmt)))
    ref = torch.zeros(6, dtype=ctype).conj().imag
    torch.neg(torch.ones(6, dtype=dtype), out=ref)  # what torch does with such an out
    ok.append(torch.equal(ref.resolve_neg(), -torch.ones(6, dtype=dtype)))
    x = torch.randn(2, 32, dtype=ctype).conj().imag  # as the input, and in place
    expected = qt.quantize(x.resolve_neg(), qt.mxfp4_e2m1)
    ok.append(torch.equal(qt.quantize(x, qt.mxfp4_e2m1), expected))
    ok.append(torch.equal(qt.quantize_(x, qt.mxfp4_e2m1).resolve_neg(), expected))
for _ in range(200):  # in place, torch's math-bit fallback freed a tensor it then read (now and
    x = torch.randn(2, 32, dtype=torch.complex64).conj().imag  # then a heap corruption)
    qt.quantize_(x, qt.mxfp4_e2m1)
print(ok)
"""


def test_quantize_out_with_the_negative_bit():
    """An out= view with the negative bit (complex.conj().imag) hit an internal assert of
    torch's math-bit fallback, then aborted the process: in a fresh interpreter."""
    r = _python("-c", _NEG_OUT)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-3000:]}"
    assert r.stdout.strip() == str([True] * 12), r.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_quantize_odd_outs(dtype):
    x = torch.randn(6, 8).to(dtype)
    expected = qt.quantize(x, qt.fp8_e5m2)
    out = torch.zeros(6, 16, dtype=dtype)[:, ::2]  # non-contiguous
    assert qt.quantize(x, qt.fp8_e5m2, out=out) is out and torch.equal(out, expected)
    out = torch.zeros(8, 6, dtype=dtype).t()  # transposed
    assert qt.quantize(x, qt.fp8_e5m2, out=out) is out and torch.equal(out, expected)
    y = x.clone()  # out is x: in place
    assert qt.quantize(y, qt.fp8_e5m2, out=y) is y and torch.equal(y, expected)
    if dtype != torch.bfloat16:  # (a QTensor's payload is float32 or float64)
        q = qt.as_qtensor(torch.zeros(6, 8, dtype=dtype), qt.bf16)  # rounded into its format
        qt.quantize(x, qt.fp8_e5m2, out=q)
        assert torch.equal(q.dequantize(), expected)
    with pytest.raises(TypeError, match="out has dtype"):
        qt.quantize(x, qt.fp8_e5m2, out=torch.zeros(6, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="out has shape"):
        qt.quantize(x, qt.fp8_e5m2, out=torch.zeros(6, 7, dtype=dtype))
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        qt.quantize(x, qt.fp8_e5m2, out=torch.zeros(1, dtype=dtype).expand(6, 8))
    buf = torch.randn(49, dtype=dtype)
    src = buf[:48].view(6, 8)
    before = qt.quantize(src, qt.fp8_e5m2)
    try:  # partial overlap: the kernels refuse it (as torch's out= ops); the reference's copy
        qt.quantize(src, qt.fp8_e5m2, out=buf[1:].view(6, 8))  # gives the right values
    except RuntimeError as e:
        assert dtype != torch.float64 and "refer to a single memory location" in str(e)
    else:
        assert dtype == torch.float64 and torch.equal(buf[1:].view(6, 8), before)
    with pytest.raises(RuntimeError, match="ZeroTensors are immutable"):
        qt.quantize(x, qt.fp8_e5m2, out=torch._efficientzerotensor(6, 8, dtype=dtype))
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        qt.quantize(x, qt.fp8_e5m2, out=[0.0] * 48)


# ---------------------------------------------------------------------------------------------
# Without the compiled extension: one warning that says what happened and what to do

_HIDE_EXTENSION = """
import sys, warnings
class HideExtension:  # as if qtensor/_C*.so had never been built
    def find_spec(self, name, path=None, target=None):
        if name == "qtensor._C":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, HideExtension())
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import qtensor as qt, torch
    q = qt.quantize(torch.tensor([1.1, 2.6]), "fp4_e2m1")
print([str(m.message) for m in w if m.category is RuntimeWarning])
print(q.tolist(), qt.kernels.ops.kernels_available())
"""


def test_missing_extension_warning_names_the_real_cause():
    r = _python("-c", _HIDE_EXTENSION)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    msgs = eval(lines[0])  # noqa: S307 (our own subprocess's repr of a list of str)
    assert len(msgs) == 1, msgs
    msg = msgs[0]
    assert "circular import" not in msg
    assert "qtensor._C could not be imported (ModuleNotFoundError: No module named " \
           "'qtensor._C')" in msg
    assert "pure-PyTorch reference" in msg and "same bits" in msg
    assert "`pip install --no-build-isolation -e .`" in msg
    assert lines[1] == "[1.0, 3.0] False"  # and quantization still works


# ---------------------------------------------------------------------------------------------
# Version and typing

def test_version_is_the_installed_one_and_setup_py_s():
    assert qt.__version__ == importlib.metadata.version("qtensor")
    r = _python("setup.py", "-q", "--version")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == qt.__version__
    r = _python("-m", "qtensor", "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"qtensor {qt.__version__}", r.stderr[-3000:]


def test_py_typed_is_shipped(tmp_path):
    """PEP 561: py.typed is in the package and in what a wheel is built from (build_py)."""
    assert os.path.isfile(os.path.join(os.path.dirname(qt.__file__), "py.typed"))
    r = _python("setup.py", "-q", "build_py", "--build-lib", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "qtensor" / "py.typed").is_file()


def test_cited_documents_exist():
    """Every document a docstring, comment or page cites (README.md, docs/convert.md,
    leak_check.md) is in the repo: a path from the root or from the citing file's folder, or a
    bare file name anywhere."""
    have, cited = set(), {}
    for top in ("qtensor", "csrc", "tests", "examples", "benchmarks", "scripts", "docs", "."):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [] if top == "." else [d for d in dirs if not d.startswith((".", "_"))]
            for name in files:
                have.add(name)
                if name.endswith((".py", ".cpp", ".h", ".cu", ".cuh", ".md", ".sh")):
                    with open(os.path.join(folder, name), encoding="utf-8") as f:
                        for doc in re.findall(r"(?<![\w/.-])([\w.-]+(?:/[\w.-]+)*\.md)\b", f.read()):
                            cited.setdefault((doc, folder), os.path.relpath(
                                os.path.join(folder, name), ROOT))

    def found(doc, folder):
        if "/" not in doc:
            return doc in have
        return any(os.path.exists(os.path.join(base, doc)) for base in (ROOT, folder))

    templates = {"out/name.md"}  # examples/common.py names the files it writes, not a document
    missing = {doc: where for (doc, folder), where in cited.items()
               if doc not in templates and not found(doc, folder)}
    assert not missing, f"cited but not in the repository: {missing}"


def test_formats_made_per_call_do_not_grow_the_caches():
    """A training loop that names its formats as strings, or builds them anew, per step: the
    format caches (keyed by a format's id) stay the same size (equal formats share their
    entries) and within their bound; memory does not grow with the number of steps."""
    from qtensor.kernels import backend
    caches = ("_KERNEL_CALLS", "_FIT_CACHE", "_AXIS_CACHE", "_BY_VALUE")
    w = torch.randn(64, 64)
    x = torch.randn(4, 64)

    def step(i, fresh):
        mm = (qt.mxfp4_e2m1.replace(rounding="nearest_away") if fresh
              else "mxfp4_e2m1(rounding=nearest_away)")
        a = qt.as_qtensor(x, "bf16", mm_fmt=mm)
        b = qt.as_qtensor(w, "bf16(rounding=nearest_away)", mm_fmt=mm)
        (a @ b).sum()

    for n in caches:  # (earlier tests' entries: the sizes below are this test's own)
        getattr(backend, n).clear()
    for i in range(20):
        step(i, fresh=False)
    sizes = {n: len(getattr(backend, n, {})) for n in caches}
    for i in range(300):
        step(i, fresh=False)
    assert {n: len(getattr(backend, n, {})) for n in caches} == sizes
    bound = 40
    old = backend._CACHE_SIZE
    backend._CACHE_SIZE = bound
    try:
        for i in range(300):
            step(i, fresh=True)
        for n in caches:
            assert len(getattr(backend, n, {})) <= bound + 1, n
    finally:
        backend._CACHE_SIZE = old
