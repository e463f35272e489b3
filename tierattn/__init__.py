"""tierattn: Triton kernels for sparse and offloaded paged KV attention.

Nothing happens at import time: no patching, no kernel compilation, no device allocation.
"""

from __future__ import annotations

from tierattn.errors import (
    KernelInputError,
    KernelUnsupportedError,
    KVCapacityError,
    KVFileError,
    TierAttnError,
    TierConfigError,
)

__version__ = "0.1.0"

__all__ = [
    "KVCapacityError",
    "KVFileError",
    "KernelInputError",
    "KernelUnsupportedError",
    "TierAttnError",
    "TierConfigError",
    "__version__",
]
