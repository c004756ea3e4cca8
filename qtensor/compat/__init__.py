"""Drop-in front ends for users of other tools.

- ``qtensor.compat.qtorch``: QPyTorch 0.3.0's API (float_quantize, quantizer, OptimLP, ...).
- ``qtensor.compat.mx``: microxcaling's MxSpecs vocabulary mapped onto a ``qt.Recipe``.
"""
from . import qtorch  # noqa: F401
from . import mx  # noqa: F401
