"""Number formats: Format values (float, fixed point, block), the format protocol, presets and
parsing (``core``), and the ``__torch_function__`` mixin that gives them ``model.to(fmt)``
(``torch_function``). Everything public in ``core`` is re-exported here (``qt.formats.X``)."""
from .core import *  # noqa: F401,F403
