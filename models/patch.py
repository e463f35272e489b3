"""``tierattn.patch(model, config)``: serve a Hugging Face model's attention from the tiered cache.

The route uses only public registries of transformers 5.x: an attention function registered
with ``AttentionInterface`` and a mask function with ``AttentionMaskInterface`` (without it every
model silently receives ``attention_mask=None``), both under the name ``"tierattn"``, plus the
:class:`~tierattn.models.cache.TieredCache` that reaches the attention function through the
attention kwargs. ``patch`` switches the model's attention implementation to ``"tierattn"`` and
gives ``generate`` a tiered cache when the caller passes none; the returned handle undoes both.
Nothing happens at import time.

Supported here: decoder-only models whose attention layers are full or sliding-window
attention (no KV sharing, no linear-attention or chunked layers): sliding windows (pages that
left a layer's window are dropped, as HF's sliding caches do; the window stays hot), logit
softcap (Gemma 2), attention sinks (GPT-OSS), batches with left padding (the padded tokens are
stored but never attended), greedy and sampling. Everything else raises a clear error rather
than produce different output.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from tierattn.config import TierConfig
from tierattn.models.cache import CACHE_KWARG, CURRENT, TieredCache

__all__ = ["ATTN_NAME", "PatchHandle", "SUPPORTED_MODEL_TYPES", "patch", "tiered_attention"]

ATTN_NAME = "tierattn"

#: model families served by this route. What differs between them (softcap, sliding windows,
#: attention sinks) reaches the attention function through its kwargs, so a family needs no code.
SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma2", "gemma3_text",
    "olmo2", "cohere2", "gpt_oss"})


def tiered_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """The registered attention function.

    Args:
        query: ``[B, H_q, T, D]`` post-RoPE; ``key``/``value`` were already appended to the cache.
        attention_mask: ``None`` or the ``[B, kv_len]`` padding mask (``flash_attention_mask``);
            left padding is handed to the runtime, other patterns are refused.

    Returns:
        ``([B, T, H_q, D], None)``.
    """
    cache = kwargs.get(CACHE_KWARG) or CURRENT.get()
    if not isinstance(cache, TieredCache) or cache.runtime is None or \
            cache.pending_layer != module.layer_idx:
        raise RuntimeError(
            "tierattn: the patched model ran attention without its TieredCache (plain forward "
            "without a cache?). Call generate(), or pass cache=TieredCache(model.config, config).")
    if attention_mask is not None:
        if query.shape[2] == 1:  # a decode step: checked on the device, once per step
            cache.check_decode_mask(attention_mask)
        else:
            _left_padding(cache, attention_mask)
    cache.pending_layer = None
    if dropout:
        raise NotImplementedError("tierattn: attention dropout is not supported (inference only).")
    out = cache.runtime.attend(module.layer_idx, query, sm_scale=scaling,
                               softcap=kwargs.get("softcap"),
                               sliding_window=kwargs.get("sliding_window"),
                               sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def _left_padding(cache: TieredCache, mask: torch.Tensor) -> None:
    """Hand the runtime the left padding of a prompt chunk's ``[B, kv_len]`` padding mask (HF
    pads on the left for generation); any other padding pattern is refused. Read on the host:
    a prompt chunk is not a decode step (those check the mask on the device)."""
    if mask is cache._mask_seen:  # every layer gets the same mask: checked once
        return
    cache._mask_seen = mask
    keep = mask.bool()
    pad = (~keep).sum(dim=1).cpu()
    if bool(keep.all()):
        pad = torch.zeros_like(pad)
    else:
        left = torch.arange(keep.shape[1], device=keep.device)[None, :] >= pad.to(keep.device)[
            :, None]
        if not torch.equal(keep, left):
            raise NotImplementedError(
                "tierattn: only left padding is supported (attention_mask rows of the form "
                "0..0 1..1); pad on the left, as generate() expects for decoder-only models.")
    runtime = cache.runtime
    if not torch.equal(runtime.pad, pad):
        if bool((runtime.pad > 0).any()):
            raise NotImplementedError(
                f"tierattn: the padding changed from {runtime.pad.tolist()} to {pad.tolist()} "
                "tokens during generation; the tiered cache supports a fixed left padding.")
        runtime.set_padding(pad)


def _register() -> None:
    """Register the attention and mask functions (idempotent; registering is side-effect free
    for models that do not select ``"tierattn"``)."""
    AttentionInterface.register(ATTN_NAME, tiered_attention)
    AttentionMaskInterface.register(ATTN_NAME, flash_attention_mask)


def _check_supported(model, config: TierConfig) -> None:
    text = model.config.get_text_config()
    kind = text.model_type
    if kind not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"tierattn.patch: model_type {kind!r} is not supported yet; supported: "
            f"{sorted(SUPPORTED_MODEL_TYPES)}.")
    if getattr(text, "num_kv_shared_layers", 0):
        raise NotImplementedError("tierattn.patch: KV-sharing layers are not supported.")
    layer_types = getattr(text, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise NotImplementedError(f"tierattn.patch: layer types {odd} are not supported.")


class PatchHandle:
    """Undo handle of :func:`patch`; also a context manager (``with tierattn.patch(...)``)."""

    def __init__(self, model, config: TierConfig) -> None:
        self.model, self.config = model, config
        self._attn = model.config._attn_implementation
        self._had_generate = "generate" in vars(model)
        self.cache: TieredCache | None = None
        self.active = False
        # transformers renamed `past_key_values` to `cache` during 5.x: use the model's name
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def _apply(self) -> None:
        _register()
        self.model.set_attn_implementation(ATTN_NAME)
        original = self.model.generate

        @functools.wraps(original)
        def generate(*args, **kwargs):
            if kwargs.get("num_beams", 1) != 1:
                raise NotImplementedError("tierattn: beam search is not supported yet.")
            for name, what in (("assistant_model", "assisted decoding"),
                               ("prompt_lookup_num_tokens", "prompt-lookup decoding"),
                               ("penalty_alpha", "contrastive search")):
                if kwargs.get(name) is not None:
                    raise NotImplementedError(
                        f"tierattn: {what} rolls the cache back, which the tiered cache does not "
                        "support yet; use greedy or sampling decoding.")
            if kwargs.get("num_return_sequences", 1) != 1:
                raise NotImplementedError("tierattn: num_return_sequences > 1 is not supported "
                                          "yet.")
            if self._cache_arg not in kwargs:  # accept both names on every 5.x release
                other = "past_key_values" if self._cache_arg == "cache" else "cache"
                if other in kwargs:
                    kwargs[self._cache_arg] = kwargs.pop(other)
            cache = kwargs.get(self._cache_arg)
            if cache is None:
                cache = kwargs[self._cache_arg] = TieredCache(self.model.config, self.config)
            self.cache = cache if isinstance(cache, TieredCache) else None
            out = original(*args, **kwargs)
            self._guard()
            return out

        self.model.generate = generate
        self.model._tierattn_handle = self
        self.active = True

    def _guard(self) -> None:
        if self.cache is not None:
            self.cache.verify()
        stats = self.stats()
        if not stats or not stats["total"]["attend_calls"]:
            raise RuntimeError(
                "tierattn: generate() finished but the tiered attention never ran (a broken "
                "attention registration would silently fall back to another implementation).")

    def stats(self) -> dict:
        """Telemetry of the last tiered cache ``generate`` used ({} before the first call)."""
        return self.cache.stats() if self.cache is not None else {}

    def unpatch(self) -> None:
        """Restore the model exactly (attention implementation, ``generate``)."""
        if not self.active:
            return
        self.model.set_attn_implementation(self._attn)
        if not self._had_generate:
            del self.model.generate
        del self.model._tierattn_handle
        self.active = False

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


def patch(model, config: TierConfig | None = None, *,
          cuda_graphs: bool | None = None) -> PatchHandle:
    """Serve ``model``'s attention from a tiered KV cache; returns the undo handle.

    Patching an already patched model returns its handle (idempotent); pass a different
    ``config`` by unpatching first.

    Args:
        model: a Hugging Face causal LM.
        config: the :class:`~tierattn.config.TierConfig` (default: the ``offload`` preset).
        cuda_graphs: overrides ``config.cuda_graphs`` (each layer's decode step captured in a
            CUDA graph and replayed; needs the model on a CUDA device).
    """
    config = config or TierConfig.preset("offload")
    if cuda_graphs is not None:
        config = config.replace(cuda_graphs=cuda_graphs)
    existing = getattr(model, "_tierattn_handle", None)
    if existing is not None and existing.active:
        if existing.config != config:
            raise ValueError("tierattn.patch: the model is already patched with another "
                             "config; call handle.unpatch() first.")
        return existing
    _check_supported(model, config)
    handle = PatchHandle(model, copy.deepcopy(config))
    handle._apply()
    return handle
