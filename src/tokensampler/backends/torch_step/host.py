"""numpy on the host, when it is there: a few CPU passes (sorting short rows, unpacking a token
bitmask) are cheaper through numpy. numpy is not a dependency: every caller has a torch route."""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def numpy_module() -> ModuleType | None:
    """numpy if it imports and torch can share memory with it (`Tensor.numpy()` works), else None."""
    try:
        import numpy
        import torch

        torch.zeros(1).numpy()
    except (ImportError, RuntimeError):
        return None
    return numpy
