"""Typed errors of tierattn. Every message names the argument at fault and the fix.

This module imports nothing from the package, so every layer (kernels included) can raise them.
"""

from __future__ import annotations

__all__ = ["KVCapacityError", "KVFileError", "KVIOError", "KernelInputError",
           "KernelUnsupportedError", "TierAttnError", "TierConfigError", "TierStateError",
           "UnsupportedDecodingError", "UnsupportedEngineError", "UnsupportedModelError"]


class TierAttnError(Exception):
    """Base class of every error tierattn raises on purpose."""


class KernelInputError(TierAttnError, ValueError):
    """A kernel argument has the wrong shape, dtype, device, layout or value."""


class KernelUnsupportedError(TierAttnError, NotImplementedError):
    """A valid request that this build cannot serve (backend, head dim, device)."""


class TierConfigError(TierAttnError, ValueError):
    """A TierConfig knob, or a combination of knobs, is invalid; the message names the knob."""


class KVCapacityError(TierAttnError, MemoryError):
    """The configured tiers cannot hold the KV cache (at construction, or when all are full)."""


class KVFileError(TierAttnError, ValueError):
    """A KV file (disk tier page or saved cache) failed validation; nothing was loaded."""


class KVIOError(TierAttnError, OSError):
    """A tier's storage failed while pages moved (disk full, an I/O error); the move was rolled
    back: the pages are where they were and no slot or file is left behind."""


class UnsupportedModelError(TierAttnError, NotImplementedError):
    """A model whose structure the tiered cache cannot serve (a layer that is not full or
    sliding-window attention, KV shared across layers, cross-attention, K and V of different
    head dims); the message names the layer and the reason."""


class UnsupportedEngineError(TierAttnError, NotImplementedError):
    """A serving engine (or an engine release) whose internals tierattn's adapter was not
    checked against; the message names the releases that are."""


class UnsupportedDecodingError(TierAttnError, NotImplementedError):
    """A generation option or input the tiered cache does not serve (beam search, decoding that
    rolls the cache back, several sequences per prompt, padding other than a fixed left
    padding, attention dropout); the message names the option and what to use instead."""


class TierStateError(TierAttnError, RuntimeError):
    """A call made in a state that cannot serve it (a patched model run without its cache, an
    attention hook that never ran); the message names the call to make."""
