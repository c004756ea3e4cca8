"""qtensor: low-precision arithmetic emulation for PyTorch."""
__version__ = "0.1.0"  # the one place: setup.py reads it from here

from .formats import (BlockFormat, FixedFormat, FloatFormat, Format, FormatError, PRESETS,
                      format, p3109)
from . import reference

globals().update(PRESETS)

from .ops import quantize, quantize_  # noqa: E402
from .tensor import QTensor, as_qtensor, quantize_grad  # noqa: E402
from . import grouped  # noqa: E402,F401  (grouped GEMMs: torch._grouped_mm as a contraction)
from .flush_warnings import set_flush_warnings  # noqa: E402
from .convert import Recipe, Role, convert, describe, unconvert  # noqa: E402
from .transforms import Hadamard  # noqa: E402  (Recipe.gemm's "transform")
from . import recipes  # noqa: E402
from . import to_format  # noqa: E402,F401  (model.to(fmt), tensor.to(fmt))
from .serialization import (load_plain_state_dict, load_safetensors, plain_state_dict,  # noqa: E402
                            qtensor_state_dict, save_safetensors)
from . import hf  # noqa: E402,F401  (qt.hf.save_pretrained / from_pretrained)
from .training import LossScaler, master_weight  # noqa: E402
from .leaks import Finding, LeakError, LeakReport, LeakWarning, leak_check  # noqa: E402
from . import compat  # noqa: E402,F401  (qt.compat.qtorch, qt.compat.mx)
from . import accum  # noqa: E402,F401  (qt.accum.AccumFormat, qt.accum.hopper_fp8, ...)
from .analysis import AnalysisReport, analyze  # noqa: E402
from .suggest import suggest_recipe  # noqa: E402
from .ptq import error_diffusion, gptq  # noqa: E402
