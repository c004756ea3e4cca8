"""The QTensor subclass (``subclass``) and what runs under it: the op rules of
``__torch_dispatch__`` (``dispatch``), per-GEMM operand tags and transforms, grouped GEMMs,
attention, KV caches, and the warnings raised while rounding (Inf/NaN in blocks, flushing and
clipping)."""
# checkpoints pickled before the package layout name qtensor.tensor.QTensor and
# qtensor.tensor._rebuild_qtensor
from .subclass import QTensor, _rebuild_qtensor  # noqa: F401
