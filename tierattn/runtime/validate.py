"""Argument checks of the runtime's public calls: every bad value raises a typed error that names
the argument and the fix, before anything changes (the calls' contract: complete, or raise and
change nothing). The ``check_*`` functions take the :class:`~tierattn.runtime.cache.TieredKVCache`
being called (duck-typed: this module sits below the facade) and return the arguments normalised."""

from __future__ import annotations

import math
import numbers
import operator
from pathlib import Path

import torch

from tierattn.errors import KernelInputError, KVCapacityError, KVIOError
from tierattn.storage.pagemap import HOT, NONE

__all__ = ["check_attend", "check_evict", "check_move", "check_padding", "check_reorder",
           "check_save_dir", "check_sequence", "check_update", "floating", "index", "indices",
           "io_error"]


def index(name: str, value: object, size: int, *, what: str = "") -> int:
    """``value`` as an index in ``0..size-1``: an int (not a bool, not a float, not negative:
    ``-1`` is not "the last one" here)."""
    if isinstance(value, (bool, float)) or (isinstance(value, torch.Tensor) and
                                            (value.dim() or value.dtype.is_floating_point)):
        raise KernelInputError(f"{name} must be an int in 0..{size - 1}, got {value!r}.")
    try:
        i = operator.index(value)
    except TypeError:
        raise KernelInputError(f"{name} must be an int in 0..{size - 1}, got "
                               f"{type(value).__name__} {value!r}.") from None
    if not 0 <= i < size:
        raise KernelInputError(f"{name}={i} is out of range: {what or name} must be in "
                               f"0..{size - 1} (negative indices are not accepted).")
    return i


def indices(name: str, values: object, size: int, *, unique: bool = True) -> list[int]:
    """A list, tuple or 1-D integer tensor of indices in ``0..size-1`` (distinct if
    ``unique``)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise KernelInputError(f"{name} must be a 1-D integer tensor or a list of ints, got "
                                   f"{values.dtype} {list(values.shape)}.")
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise KernelInputError(f"{name} must be a list of ints, got {type(values).__name__}.")
    out = [index(f"{name}[{i}]", v, size, what=name) for i, v in enumerate(values)]
    if unique and len(set(out)) != len(out):
        dups = sorted({v for v in out if out.count(v) > 1})
        raise KernelInputError(f"{name} lists {dups} more than once; give each once.")
    return out


def floating(name: str, t: object, *, ndim: int, layout: str) -> torch.Tensor:
    """A floating-point tensor of rank ``ndim`` (``layout`` names the dimensions)."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a {layout} tensor, got {type(t).__name__}.")
    if t.dim() != ndim:
        raise KernelInputError(f"{name} must be {layout} ({ndim}-D), got {list(t.shape)}.")
    if not t.dtype.is_floating_point:
        raise KernelInputError(f"{name} has dtype {t.dtype}; the cache stores floating-point "
                               f"K/V: pass {name}.float() (or the model's dtype).")
    return t


def _number(name: str, value: object, *, positive: bool = True) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not math.isfinite(value) or (positive and value <= 0):
        raise KernelInputError(f"{name} must be a finite number > 0 (or None), got {value!r}.")
    return float(value)


def check_sequence(cache, name: str, sequence: object, *, alive: bool = True) -> int:
    """A sequence index of the batch (one still alive unless ``alive=False``)."""
    s = index(name, sequence, cache.batch_size, what="a sequence of the batch")
    if alive and not bool(cache.pages.alive[s]):
        raise KernelInputError(f"{name}={s}: that sequence was freed; it holds no KV until "
                               "reset() (or reorder() onto a live one).")
    return s


def check_update(cache, layer: object, k: object, v: object) -> tuple[int, int]:
    """``update``'s arguments: returns ``(layer, T)``."""
    layer = index("layer", layer, cache.num_layers, what="a layer of the cache")
    for name, x in (("k", k), ("v", v)):
        floating(name, x, ndim=4, layout="[B, H_kv, T, D]")
    if k.shape != v.shape:
        raise KernelInputError(f"k {list(k.shape)} and v {list(v.shape)} must match.")
    b, hkv, t, d = k.shape
    if (b, hkv, d) != (cache.batch_size, cache.num_kv_heads, cache.head_dim) or t < 1:
        raise KernelInputError(
            f"k/v have shape {list(k.shape)}; the cache holds B={cache.batch_size}, "
            f"H_kv={cache.num_kv_heads}, D={cache.head_dim} ([B, H_kv, T, D], T >= 1).")
    if t > cache.config.prefill_chunk_size:
        raise KernelInputError(
            f"update got {t} tokens per sequence; the pools have headroom for "
            f"prefill_chunk_size={cache.config.prefill_chunk_size}: prefill in chunks of at "
            "most that many tokens, or raise prefill_chunk_size.")
    n1 = cache.pages.length(layer) + t
    if n1 > cache.max_pages * cache.page_size:
        raise KVCapacityError(
            f"sequence length {n1} exceeds max_context={cache.config.max_context} of the "
            "config; nothing was appended. Raise max_context.")
    return layer, t


def check_attend(cache, layer: object, q: object, sm_scale: object, softcap: object,
                 sliding_window: object, sinks: object) -> int:
    """``attend``'s arguments: returns the layer."""
    layer = index("layer", layer, cache.num_layers, what="a layer of the cache")
    floating("q", q, ndim=4, layout="[B, H_q, T, D]")
    b, hq, t, d = q.shape
    if b != cache.batch_size or d != cache.head_dim or hq % cache.num_kv_heads or t < 1:
        raise KernelInputError(
            f"q has shape {list(q.shape)}; expected [B={cache.batch_size}, H_q (a multiple "
            f"of H_kv={cache.num_kv_heads}), T >= 1, D={cache.head_dim}].")
    if t > cache.pages.length(layer):
        raise KernelInputError(f"q has T={t} queries but layer {layer} holds "
                               f"{cache.pages.length(layer)} tokens; call update(layer, k, v) "
                               "first.")
    _number("sm_scale", sm_scale)
    _number("softcap", softcap)
    if sliding_window is not None and (isinstance(sliding_window, bool) or
                                       not isinstance(sliding_window, int) or sliding_window < 1):
        raise KernelInputError(f"sliding_window must be an int >= 1, got {sliding_window!r}.")
    if sinks is not None:
        floating("sinks", sinks, ndim=1, layout="[H_q]")
        if sinks.shape[0] != hq:
            raise KernelInputError(f"sinks has {sinks.shape[0]} logits; q has H_q={hq} heads.")
    return layer


def _filling(cache, layer: int) -> int | None:
    """The page the next token is written into, if it is already started."""
    n = cache.pages.length(layer)
    return n // cache.page_size if n % cache.page_size else None


def check_move(cache, layer: object, sequence: object, page: object,
               tier: object) -> tuple[int, int, int, int]:
    layer = index("layer", layer, cache.num_layers, what="a layer of the cache")
    sequence = check_sequence(cache, "sequence", sequence)
    page = index("page", page, cache.max_pages, what="a page index")
    tier = index("tier", tier, len(cache.tiers), what="a tier of the config")
    st = cache.pages.layers[layer]
    if int(st.tier[sequence, page]) == NONE:
        raise KernelInputError(f"page {page} of sequence {sequence} in layer {layer} holds no "
                               "KV (evicted, dropped, or past the end); move a live page.")
    if tier != HOT and page == _filling(cache, layer):
        raise KernelInputError(f"page {page} is being filled (the next token is written into "
                               "it in HBM); move it after it is full.")
    if tier != HOT and st.window is not None:
        raise KernelInputError(f"layer {layer} is a sliding-window layer: the pages its window "
                               "sees stay in HBM; move pages of a full-attention layer.")
    return layer, sequence, page, tier


def check_evict(cache, layer: object, sequence: object, pages: object) -> tuple[int, int, list]:
    layer = index("layer", layer, cache.num_layers, what="a layer of the cache")
    sequence = check_sequence(cache, "sequence", sequence)
    pages = indices("pages", pages, cache.max_pages)
    st = cache.pages.layers[layer]
    gone = [pg for pg in pages if int(st.tier[sequence, pg]) == NONE]
    if gone:
        raise KernelInputError(f"pages {gone} of sequence {sequence} in layer {layer} hold no "
                               "KV (already evicted, or past the end); nothing was evicted.")
    filling = _filling(cache, layer)
    if filling in pages:
        raise KernelInputError(f"page {filling} is being filled (the next token is written "
                               "into it); it cannot be evicted. Nothing was evicted.")
    first = int(cache.pages.pad_pages()[sequence])
    sinks = [pg for pg in pages if first <= pg < first + cache.config.sink_pages]
    if sinks:
        raise KernelInputError(f"pages {sinks} are attention sinks of sequence {sequence} "
                               f"(sink_pages={cache.config.sink_pages}); they are never "
                               "evicted. Nothing was evicted.")
    return layer, sequence, pages


def check_reorder(cache, index_: object) -> list[int]:
    out = indices("index", index_, cache.batch_size, unique=False)
    if len(out) != cache.batch_size:
        raise KernelInputError(f"reorder index must list {cache.batch_size} sequence ids, got "
                               f"{len(out)}.")
    return out


def check_padding(cache, pad: object) -> torch.Tensor:
    limit = cache.max_pages * cache.page_size + 1
    values = indices("pad", pad, limit, unique=False)
    if len(values) != cache.batch_size:
        raise KernelInputError(f"pad must list {cache.batch_size} token counts (one per "
                               f"sequence), got {len(values)}.")
    return torch.tensor(values, dtype=torch.long)


def check_save_dir(directory: object) -> Path:
    if not isinstance(directory, (str, Path)):
        raise KernelInputError(f"directory must be a path, got {type(directory).__name__}.")
    path = Path(directory)
    if not path.is_dir():
        raise KernelInputError(f"directory {path} is {'a file' if path.exists() else 'missing'}"
                               "; give an existing folder to save into.")
    return path


def io_error(e: BaseException, what: str) -> BaseException:
    """A storage failure (an OSError that is not one of ours) as a :class:`KVIOError`."""
    if isinstance(e, OSError) and not isinstance(e, KVIOError):
        err = KVIOError(e.errno, f"{what} failed ({e}); nothing changed.")
        err.__cause__ = e
        return err
    return e
