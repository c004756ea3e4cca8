"""Build qtensor and its compiled kernels (the `qtensor._C` extension).

    pip install torch==2.13.0 && pip install --no-build-isolation -e ".[test]"

The extension is a CppExtension (the CPU kernels). The GPU kernels are Triton kernels
(qtensor/gpu), compiled at run time by the triton package that torch's CUDA wheels depend on: a
GPU install needs no CUDA toolkit. Without a compiler qtensor still imports and falls back to the
pure-PyTorch reference (with a warning).
"""
import glob
import os
import re
import sys
import sysconfig

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

# qtorch (QPyTorch 0.3.0) and gfloat are independent oracles for the compat and reference tests;
# mmasim (MMA-Sim: bit-accurate tensor-core models, needs torch>=2.9) for tests/accum/test_accum_mmasim.py
# triton: tests/kernels/test_triton.py runs the GPU kernels under Triton's CPU interpreter; 3.7.1 is the
# version torch 2.13's CUDA wheels pin (the one GPU users have), and the CPU wheel brings none.
TEST = ["pytest", "hypothesis", "ml_dtypes", "expecttest", "numpy", "ninja", "qtorch==0.3.0",
        "gfloat", "mmasim==2.1.1", 'triton==3.7.1; platform_system=="Linux"']
EXAMPLES = ["tqdm", "matplotlib", "scikit-learn"]
# qtensor.integrations.hf and the safetensors helpers (tests skip without them); neither pulls a torch
HF = ["safetensors", "transformers"]


def version():
    """qtensor.__version__, read from the source (importing qtensor needs torch and _C)."""
    with open(os.path.join(HERE, "qtensor", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def extensions():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # no torch yet: metadata-only (pip install torch first)
        return [], {}
    include = [os.path.join(HERE, "csrc"), os.path.join(HERE, "csrc", "include")]
    # -O3 but no -march: the build must run on any x86-64 (AVX2/AVX-512 loops are picked at run
    # time).
    # -ffp-contract=off: no fused multiply-adds, every double operation is rounded as written.
    # -fno-trapping-math: lets gcc if-convert (and so vectorize) the int-to-float conversions.
    # -g0: no debug information (Python's default CFLAGS ask for -g): the same code, a faster
    # build and a several times smaller library.
    cxx = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-g0"]
    # a few translation units, compiled in parallel: the schemas and glue, and the CPU loops once
    # per instruction set (csrc/cpu/isa_*.cpp). Listed longest first, so that with two jobs the
    # longest one does not start last (ninja starts them in this order).
    sources = ["csrc/cpu/isa_base.cpp", "csrc/quantize.cpp", "csrc/cpu/isa_avx512.cpp",
               "csrc/cpu/isa_avx2.cpp", "csrc/cpu/accum.cpp", "csrc/cpu/accum_cdna3.cpp"]
    missing = set(glob.glob("csrc/cpu/*.cpp")) - set(sources)
    if missing:
        raise RuntimeError(f"setup.py: add {sorted(missing)} to the sources")
    ext = cpp_extension.CppExtension(
        "qtensor._C", sources, include_dirs=include, extra_compile_args=cxx,
        extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": _persistent_build(cpp_extension.BuildExtension).with_options(
        use_ninja=True)}


def _persistent_build(base):
    """build_ext whose object files stay in build/temp.* of the checkout, also for
    `pip install -e` (which compiles in a fresh temporary folder otherwise): a second install
    (the README's two Quick start commands, another extra) relinks without compiling, and
    `python setup.py build_ext --inplace` shares the objects. ninja rebuilds what changed,
    a compiler flag or torch's headers (new torch: new include path) included."""
    class BuildExt(base):
        def finalize_options(self):
            super().finalize_options()
            tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = os.path.join(HERE, "build", f"temp.{tag}")
    return BuildExt


ext_modules, cmdclass = extensions()

setup(
    name="qtensor",
    version=version(),
    description="Low-precision arithmetic emulation for PyTorch: formats, fused kernels, QTensor",
    packages=find_packages(include=["qtensor*"]),
    package_data={"qtensor": ["py.typed"]},  # PEP 561: the package's annotations are for users
    python_requires=">=3.9",
    install_requires=["torch"],
    extras_require={"test": TEST + EXAMPLES + HF, "examples": EXAMPLES, "hf": HF},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
