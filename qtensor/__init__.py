"""qtensor: low-precision arithmetic emulation for PyTorch."""
__version__ = "0.1.0"  # the one place: setup.py reads it from here

from .formats.block import BlockFormat
from .formats.fixed import FixedFormat
from .formats.float import FloatFormat, p3109
from .formats.base import Format, FormatError
from .formats.presets import PRESETS
from .formats.parse import format
from .kernels import reference

globals().update(PRESETS)

from .kernels.ops import quantize, quantize_  # noqa: E402
from .tensor.subclass import QTensor, as_qtensor, quantize_grad  # noqa: E402
from .tensor import grouped  # noqa: E402,F401  (torch._grouped_mm as a contraction)
from .tensor.flush_warnings import set_flush_warnings  # noqa: E402
from .nn.convert import Recipe, Role, convert, describe, unconvert  # noqa: E402
from .tensor.transforms import Hadamard  # noqa: E402  (Recipe.gemm's "transform")
from .nn import recipes  # noqa: E402
from .nn import to_format  # noqa: E402,F401  (model.to(fmt), tensor.to(fmt))
from .integrations.serialization import (load_plain_state_dict, load_safetensors,  # noqa: E402
                                         plain_state_dict, qtensor_state_dict, save_safetensors)
from .integrations import hf  # noqa: E402,F401  (qt.hf.save_pretrained / from_pretrained)
from .tensor import attention, kv_cache  # noqa: E402,F401  (Recipe.attention, Recipe.kv_cache)
from .nn import attention_hooks  # noqa: E402,F401  (their hooks on converted models)
from .nn.training import LossScaler, master_weight  # noqa: E402
from .leaks import Finding, LeakError, LeakReport, LeakWarning, leak_check  # noqa: E402
from . import compat  # noqa: E402,F401  (qt.compat.qtorch, qt.compat.mx)
from . import accum  # noqa: E402,F401  (qt.accum.AccumFormat, qt.accum.hopper_fp8, ...)
from .analysis.analyze import AnalysisReport, analyze  # noqa: E402
from .analysis.suggest import suggest_recipe  # noqa: E402
from .analysis.ptq import error_diffusion, gptq  # noqa: E402

# Pickles name a class or function by the module that defined it. Whole objects pickled by the
# flat layout (torch.save(model) of a converted model: its hooks, plans, recipes, formats) name
# modules such as qtensor.convert and qtensor.plans: those names stay importable (in sys.modules
# only: qt.convert is still the function). Formats pickled while formats/ and accum/ had a core
# module name qtensor.formats.core / qtensor.accum.core.
import sys as _sys  # noqa: E402

from . import analysis, formats, integrations, kernels, nn, tensor  # noqa: E402

_FLAT_LAYOUT = {"convert": nn.convert, "plans": nn.plans, "gemm_forward": nn.gemm_forward,
                "training": nn.training, "spec": nn.spec, "distributed": nn.distributed,
                "to_format": nn.to_format, "attention_convert": nn.attention_hooks,
                "dispatch": tensor.dispatch, "gemm": tensor.gemm, "ops": kernels.ops,
                "transforms": tensor.transforms, "analysis": analysis.analyze,
                "suggest": analysis.suggest, "ptq": analysis.ptq,
                "serialization": integrations.serialization, "torch_function": formats.torch_function,
                "hf": integrations.hf, "reference": kernels.reference, "checks": kernels.checks,
                "selfcheck": kernels.selfcheck, "decompositions": kernels.decompositions,
                "gpu": kernels.gpu, "recipes": nn.recipes, "grouped": tensor.grouped,
                "attention": tensor.attention, "kv_cache": tensor.kv_cache,
                "flush_warnings": tensor.flush_warnings, "block_specials": tensor.block_specials,
                "formats.core": formats, "accum.core": accum}
for _old, _module in _FLAT_LAYOUT.items():
    _sys.modules.setdefault(f"qtensor.{_old}", _module)
del _old, _module
