"""tierattn's vLLM plugin (entry point ``vllm.general_plugins``), loaded by every vLLM process.

It points vLLM's CPU attention backend (``CPU_ATTN``) at
:class:`~tierattn.models.vllm.hotattn.TierAttentionBackend`, which is vLLM's own backend unless
the engine is configured with tierattn's hot-set connector (:func:`tierattn.vllm_engine_args`):
installing tierattn changes nothing for an engine that does not ask for it. On vLLM's CPU
platform only an override of ``CPU_ATTN`` takes effect (it ignores ``CUSTOM``); on CUDA the same
class would be registered as ``CUSTOM`` and chosen with ``attention_backend="CUSTOM"`` -- a path
no machine here has run (vLLM has no CUDA build on the lent GPU machines).
"""

from __future__ import annotations

BACKEND = "tierattn.models.vllm.hotattn.TierAttentionBackend"


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
