"""Number formats, one concern per module: the format protocol (``base``), the families
(``float``, ``fixed``, ``block``), the named formats (``presets``), string forms and parsing
(``parse``), and the ``__torch_function__`` mixin that gives formats ``model.to(fmt)``
(``torch_function``). Every public name is re-exported here (``qt.formats.X``)."""
from .base import (ROUNDING_MODES, Format, FormatError, is_stochastic,  # noqa: F401
                   stochastic_bits)
from .block import SCALE_RULES, BlockFormat  # noqa: F401
from .fixed import FixedFormat  # noqa: F401
from .float import SPECIALS, FloatFormat, p3109  # noqa: F401
from .presets import ALIASES, PRESETS  # noqa: F401
from .parse import format  # noqa: F401  (imported last: it registers the string form in base)

__all__ = [
    "ROUNDING_MODES", "SPECIALS", "SCALE_RULES", "Format", "FormatError", "FloatFormat",
    "FixedFormat", "BlockFormat", "format", "PRESETS", "ALIASES", "is_stochastic",
    "stochastic_bits", "p3109",
]
