"""tierattn's vLLM plugin (entry point ``vllm.general_plugins``), loaded by every vLLM process.

On vLLM's CPU platform it points the CPU attention backend (``CPU_ATTN``) at
:class:`~tierattn.models.vllm.hotattn.TierAttentionBackend` (that platform ignores
``CUSTOM``), which is vLLM's own backend unless the engine is configured with tierattn's hot-set
connector (:func:`tierattn.vllm_engine_args`): installing tierattn changes nothing for an engine
that does not ask for it. On CUDA it registers
:class:`~tierattn.models.vllm.hotattn.TierAttentionDeviceBackend` as ``CUSTOM``, which only an
engine built with ``attention_backend="CUSTOM"`` (as :func:`tierattn.vllm_engine_args` writes)
uses -- a path no machine here has run end to end (the lent GPU machines have no vLLM).
"""

from __future__ import annotations

BACKEND = "tierattn.models.vllm.hotattn.TierAttentionBackend"
DEVICE_BACKEND = "tierattn.models.vllm.hotattn.TierAttentionDeviceBackend"


def register() -> None:
    """Register the override (a class path: nothing of tierattn is imported until vLLM builds
    an attention layer)."""
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError:  # a vLLM without the registry: leave vLLM as it is
        return
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.CUSTOM, DEVICE_BACKEND)
