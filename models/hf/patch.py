"""``tierattn.patch(model, config)``: serve a Hugging Face model's attention from the tiered cache.

The route uses only public registries of transformers 5.x: an attention function registered
with ``AttentionInterface`` and a mask function with ``AttentionMaskInterface`` (without it every
model silently receives ``attention_mask=None``), both under the name ``"tierattn"``, plus the
:class:`~tierattn.models.hf.cache.TieredCache` that reaches the attention function through the
attention kwargs. ``patch`` switches the model's attention implementation to ``"tierattn"`` and
gives ``generate`` a tiered cache when the caller passes none; the returned handle undoes both.
Nothing happens at import time.

Which models: any decoder-only causal LM whose structure fits (:mod:`.support` decides from the
config and modules, never from a name): attention through transformers' attention interface,
every layer full or sliding-window attention over its own K/V. What differs between families --
sliding windows (pages that left a layer's window are dropped, as HF's sliding caches do; the
window stays hot), logit softcap, attention sinks, scaling -- reaches the attention function
through its kwargs, so a family needs no code. Batches with left padding (the padded tokens are
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
from tierattn.errors import (TierConfigError, TierStateError, UnsupportedDecodingError,
                             UnsupportedModelError)
from tierattn.models.hf.cache import CACHE_KWARG, CURRENT, TieredCache
from tierattn.models.hf.support import check_model
from tierattn.telemetry import handle_stats

__all__ = ["ATTN_NAME", "PatchHandle", "patch", "tiered_attention"]

ATTN_NAME = "tierattn"


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
    CURRENT.set(None)  # consumed: an attention call with no update before it finds no cache
    if not isinstance(cache, TieredCache) or not cache.runtimes:
        raise TierStateError(
            "tierattn: the patched model ran attention without its TieredCache (plain forward "
            "without a cache?). Call generate(), or pass cache=TieredCache(model.config, config).")
    layer = cache.pending_layer  # the cache layer the module stored its K/V in
    _first_call_guard(module, cache, layer, key, value, attention_mask, kwargs)
    if attention_mask is not None:
        if query.shape[2] == 1:  # a decode step: checked on the device, once per step
            cache.check_decode_mask(attention_mask)
        else:
            _left_padding(cache, attention_mask)
    cache.pending_layer = None
    if dropout:
        raise UnsupportedDecodingError(
            "tierattn: attention dropout is not supported (inference only): call model.eval().")
    out = cache.attend(layer, query, sm_scale=scaling,
                               softcap=kwargs.get("softcap"),
                               sliding_window=kwargs.get("sliding_window"),
                               sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def _first_call_guard(module, cache: TieredCache, layer: int | None, key, value, mask,
                      kwargs: dict) -> None:
    """Refuse a module whose attention is not "the new queries over the K/V it just stored,
    as stored": what the structural checks at patch time cannot see. Cheap (identity and
    shape checks), so it runs on every call."""
    where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
    if layer is None:
        raise UnsupportedModelError(
            f"tierattn: {where} ran attention twice, or without storing its K/V first; the "
            "tiered cache serves one attention call over each layer's stored K/V.")
    if key is not cache.last_kv[0] or value is not cache.last_kv[1]:
        raise UnsupportedModelError(
            f"tierattn: {where} changes its K/V between storing them and attending (e.g. "
            "splits or mixes V); the tiered cache attends the K/V as stored.")
    if mask is not None and mask.dim() != 2:
        raise UnsupportedModelError(
            f"tierattn: {where} attends with a {mask.dim()}-D mask it built itself (a "
            "dynamic or learned mask); the tiered cache serves padding masks only.")
    window = cache.windows[layer] if layer < len(cache.windows) else None
    if window is not None and kwargs.get("sliding_window") is None:
        raise UnsupportedModelError(
            f"tierattn: {where} is a sliding-window layer for transformers' cache (which keeps "
            f"its last {window - 1} tokens) but the model passes no window to attention: its "
            "output depends on that cache's cropping, which the tiered cache does not copy.")


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
            raise UnsupportedDecodingError(
                "tierattn: only left padding is supported (attention_mask rows of the form "
                "0..0 1..1); pad on the left, as generate() expects for decoder-only models.")
    if not torch.equal(cache.pad, pad):
        if bool((cache.pad > 0).any()):
            raise UnsupportedDecodingError(
                f"tierattn: the padding changed from {cache.pad.tolist()} to {pad.tolist()} "
                "tokens during generation; the tiered cache supports a fixed left padding.")
        cache.set_padding(pad)


def _register() -> None:
    """Register the attention and mask functions (idempotent; registering is side-effect free
    for models that do not select ``"tierattn"``)."""
    AttentionInterface.register(ATTN_NAME, tiered_attention)
    AttentionMaskInterface.register(ATTN_NAME, flash_attention_mask)


def _layer_devices(model, num_layers: int) -> list[torch.device] | None:
    """The device of each attention layer's weights when the model is spread over several
    devices (``device_map``), else None (one device: the cache follows the K/V)."""
    devices: dict[int, torch.device] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and getattr(module, "is_causal", None) and idx not in devices:
            param = next(module.parameters(), None)
            if param is not None:
                devices[idx] = param.device
    if len(devices) != num_layers or len(set(devices.values())) < 2:
        return None
    return [devices[i] for i in range(num_layers)]


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    """The batch of a ``generate`` call (None when it cannot be told from the arguments)."""
    for x in (args[0] if args else None, kwargs.get("input_ids"), kwargs.get("inputs"),
              kwargs.get("inputs_embeds")):
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return x.shape[0]
    return None


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
                raise UnsupportedDecodingError("tierattn: beam search is not supported yet.")
            for name, what in (("assistant_model", "assisted decoding"),
                               ("prompt_lookup_num_tokens", "prompt-lookup decoding"),
                               ("penalty_alpha", "contrastive search")):
                if kwargs.get(name) is not None:
                    raise UnsupportedDecodingError(
                        f"tierattn: {what} rolls the cache back, which the tiered cache does not "
                        "support yet; use greedy or sampling decoding.")
            if kwargs.get("num_return_sequences", 1) != 1:
                raise UnsupportedDecodingError(
                    "tierattn: num_return_sequences > 1 is not supported yet; pass the prompt "
                    "several times instead.")
            if self._cache_arg not in kwargs:  # accept both names on every 5.x release
                other = "past_key_values" if self._cache_arg == "cache" else "cache"
                if other in kwargs:
                    kwargs[self._cache_arg] = kwargs.pop(other)
            cache = kwargs.get(self._cache_arg)
            if cache is None:
                cache = kwargs[self._cache_arg] = TieredCache(self.model.config, self.config)
            self.cache = cache if isinstance(cache, TieredCache) else None
            if self.cache is not None:
                self.cache.check_for(self.model.config, _batch_size(args, kwargs))
                devices = _layer_devices(self.model, self.cache.num_layers)
                if devices is not None and not self.cache.runtimes:
                    self.cache.set_layer_devices(devices)
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
            raise TierStateError(
                "tierattn: generate() finished but the tiered attention never ran (a broken "
                "attention registration would silently fall back to another implementation).")

    def stats(self) -> dict:
        """Telemetry of the last tiered cache ``generate`` used, in the handles' one schema
        (:func:`tierattn.telemetry.handle_stats`): ``handle`` ("patch"), ``bytes`` per tier
        (``stored``: pages demoted into it, ``loaded``: pages recalled from it), then the
        cache's own ``total`` and ``layers`` (:meth:`TieredKVCache.stats`; empty before the
        first call)."""
        if self.cache is None:
            return handle_stats("patch", {}, total={}, layers=[])
        own = self.cache.stats()
        total = own["total"]
        tiers = sorted(set(total["d2h_bytes"]) | set(total["h2d_bytes"]))
        return handle_stats("patch", {t: {"stored": total["d2h_bytes"].get(t, 0),
                                          "loaded": total["h2d_bytes"].get(t, 0)}
                                      for t in tiers}, **own)

    def undo(self) -> None:
        """Restore the model exactly (attention implementation, ``generate``); idempotent.
        Every tierattn handle undoes with ``undo()`` (:class:`~tierattn.models.SwapHandle`
        too)."""
        if not self.active:
            return
        self.model.set_attn_implementation(self._attn)
        if not self._had_generate:
            del self.model.generate
        del self.model._tierattn_handle
        self.active = False

    #: the former name of :meth:`undo`, kept as an alias
    unpatch = undo

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def patch(model, config: TierConfig | None = None, *,
          cuda_graphs: bool | None = None) -> PatchHandle:
    """Serve ``model``'s attention from a tiered KV cache; returns the undo handle.

    Patching an already patched model returns its handle (idempotent); pass a different
    ``config`` by unpatching first.

    Args:
        model: a Hugging Face causal LM (any family whose structure fits, see
            :mod:`tierattn.models.hf.support`; else :class:`UnsupportedModelError` names the
            layer and the reason).
        config: the :class:`~tierattn.config.TierConfig` (default: the ``offload`` preset).
        cuda_graphs: overrides ``config.cuda_graphs`` (each layer's decode step captured in a
            CUDA graph and replayed; needs the model on a CUDA device).
    """
    if config is not None and not isinstance(config, TierConfig):
        raise TierConfigError(
            f"tierattn.patch: config must be a TierConfig, got {type(config).__name__}; build "
            "one with TierConfig(...) or TierConfig.preset('offload', ...).")
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise TierConfigError(f"tierattn.patch: cuda_graphs must be True, False or None, got "
                              f"{cuda_graphs!r}.")
    config = config or TierConfig.preset("offload")
    if cuda_graphs is not None:
        config = config.replace(cuda_graphs=cuda_graphs)
    existing = getattr(model, "_tierattn_handle", None)
    if existing is not None and existing.active:
        if existing.config != config:
            raise TierConfigError("tierattn.patch: the model is already patched with another "
                                  "config; call handle.undo() first.")
        return existing
    check_model(model)
    handle = PatchHandle(model, copy.deepcopy(config))
    handle._apply()
    return handle
