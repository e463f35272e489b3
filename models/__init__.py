"""Engine integrations. Hugging Face models: ``patch``/``PatchHandle``, the registered attention
function, and ``TieredCache`` (a transformers ``Cache``); transformers' continuous batching:
``swap``/``SwapHandle`` (preempted requests kept in the tiers). Imported on first use:
``import tierattn.models`` does not import transformers."""

from __future__ import annotations

_LAZY = {
    "patch": "tierattn.models.hf.patch",
    "PatchHandle": "tierattn.models.hf.patch",
    "check_model": "tierattn.models.hf.support",
    "unsupported_reason": "tierattn.models.hf.support",
    "tiered_attention": "tierattn.models.hf.patch",
    "TieredCache": "tierattn.models.hf.cache",
    "swap": "tierattn.models.hf.continuous",
    "SwapHandle": "tierattn.models.hf.continuous",
    "TieredOffloadingManager": "tierattn.models.hf.continuous",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tierattn.models' has no attribute {name!r}")
