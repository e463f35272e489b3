"""Which models the tiered cache serves, decided from their structure, never from their name.

The route needs a decoder-only causal LM whose attention modules dispatch through transformers'
attention interface (``attn_implementation`` reaches them), every layer full or sliding-window
causal attention over its own K/V, with K and V of one head dim. :func:`unsupported_reason`
reads that from the model's config and modules and names the first layer that breaks it;
:func:`check_model` raises it. What the structure cannot show (a layer whose attention does not
call the registered function) the cache's first-call guard catches on the first forward.
"""

from __future__ import annotations

from tierattn.errors import UnsupportedModelError

__all__ = ["SERVED_LAYER_TYPES", "check_model", "config_reason", "layer_kinds",
           "unsupported_reason"]

#: the ``layer_types`` entries the tiered cache serves
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")

#: why other layer types are refused (the fallback covers any type not listed)
_WHY = {
    "linear_attention": "a linear-attention/recurrent layer keeps a running state, not K/V pages",
    "mamba": "a state-space layer keeps a running state, not K/V pages",
    "conv": "a convolution layer keeps a rolling state, not K/V pages",
    "hybrid": "a hybrid layer runs a state-space mixer beside its attention",
    "hybrid_sliding": "a hybrid layer runs a convolution beside its attention",
    "chunked_attention": "chunked attention masks per chunk, which the paged cache does not",
    "indexed_attention": "a learned indexer picks the keys this layer attends",
    "heavily_compressed_attention": "the layer attends compressed K/V it computes itself",
    "dummy": "the layer stores no K/V of its own (it shares another layer's, or has no "
             "attention)",
}


def layer_kinds(text) -> list[tuple[str, int | None]]:
    """``(layer type, sliding window)`` per layer of a text config, as transformers' own cache
    reads them (``get_layer_types_and_kwargs``: explicit ``layer_types``, else a config-wide
    ``sliding_window`` or ``attention_chunk_size``; KV-sharing and attention-free layers are
    ``"dummy"``)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # older 5.x: the same rule, read from the config directly
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None:
        try:
            types, kwargs = get_layer_types_and_kwargs(text)
            return [(t, kw.get("sliding_window")) for t, kw in zip(types, kwargs)]
        except (AttributeError, TypeError, ValueError):  # a config it cannot read
            pass
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if types is None:
        chunk = getattr(text, "attention_chunk_size", None)
        types = ["sliding_attention" if window is not None else
                 "chunked_attention" if chunk is not None else "full_attention"] * \
            (getattr(text, "num_hidden_layers", None) or 0)
    return [(t, window if t == "sliding_attention" else None) for t in types]


_PER_LAYER = object()


def _attr(text, name: str):
    """``text.name``, None if absent, ``_PER_LAYER`` where the config keeps it per layer (and
    refuses a global value)."""
    try:
        return getattr(text, name, None)
    except Exception as e:  # transformers' AmbiguousGlobalPerLayerAttributeError
        if "per-layer" in str(e):
            return _PER_LAYER
        raise


def _k_v_head_dims(text) -> tuple[int | None, int | None]:
    v = _attr(text, "v_head_dim")
    k = _attr(text, "qk_head_dim")
    if k is None and _attr(text, "qk_nope_head_dim") is not None:
        k = text.qk_nope_head_dim + (_attr(text, "qk_rope_head_dim") or 0)
    if k is None:
        k = _attr(text, "head_dim")
    return k, v


def config_reason(config) -> str | None:
    """Why a model of this config cannot be served, from the config alone (naming the
    layer), or None: encoder-decoder, layer types, KV sharing, cross-attention, K/V head dims."""
    text = config.get_text_config()
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model: its decoder cross-attends to the encoder's states"
    for name in ("head_dim", "num_key_value_heads", "num_attention_heads"):
        if _attr(text, name) is _PER_LAYER:
            return (f"{name} varies across layers (per-layer configs); the cache holds one K/V "
                    "geometry for every layer")
    for i, (kind, _) in enumerate(layer_kinds(text)):
        if kind not in SERVED_LAYER_TYPES:
            why = _WHY.get(kind, "neither full nor sliding-window attention")
            return f"layer {i} is {kind!r}: {why}"
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    if shared:
        n = text.num_hidden_layers
        return (f"layers {n - shared}..{n - 1} reuse the K/V of earlier layers "
                f"(num_kv_shared_layers={shared}); the cache holds one K/V per layer")
    if getattr(text, "add_cross_attention", False):
        return "its layers cross-attend to an encoder's states (add_cross_attention=True)"
    k, v = _k_v_head_dims(text)
    if k is not None and v is not None and k != v:
        return (f"K and V have different head dims ({k} and {v}); a page stores both with "
                "one head dim")
    return None


def unsupported_reason(model) -> str | None:
    """Why ``model``'s structure cannot be served (naming the layer), or None: the config's
    reasons (:func:`config_reason`), then the model's: no ``generate``, attention outside
    transformers' interface, a module sharing K/V or attending without a causal mask."""
    why = config_reason(model.config)
    if why is not None:
        return why
    can = getattr(model, "can_generate", None)
    if not callable(can) or not can():
        return "not a generative model (no generate())"
    if not getattr(model, "_supports_attention_backend", False):
        return ("its attention modules do not dispatch through transformers' attention "
                "interface (_supports_attention_backend is False), so "
                "attn_implementation='tierattn' would not reach them")
    tp = getattr(model, "tp_size", None) or 1
    text = model.config.get_text_config()
    for name in ("num_key_value_heads", "num_attention_heads"):
        heads = _attr(text, name)
        if tp > 1 and isinstance(heads, int) and heads % tp:
            return (f"{name}={heads} does not split evenly over tp_size={tp} ranks; each rank's "
                    "cache holds an equal share of the heads: use a tp_size that divides it")
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            continue
        if getattr(module, "is_kv_shared_layer", False):
            return f"layer {idx} ({name}) reuses another layer's K/V"
        if getattr(module, "is_causal", None) is False:
            return (f"layer {idx} attends without a causal mask (a bidirectional encoder or "
                    "cross-attention layer)")
    return None


def check_model(model) -> None:
    """Raise :class:`UnsupportedModelError` if ``model``'s structure cannot be served."""
    why = unsupported_reason(model)
    if why is not None:
        text = model.config.get_text_config()
        raise UnsupportedModelError(
            f"tierattn.patch: cannot serve {type(model).__name__} (model_type "
            f"{getattr(text, 'model_type', '?')!r}): {why}.")
