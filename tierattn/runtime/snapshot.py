"""Snapshot: save a whole tiered cache to one safetensors file and load it back.

The file holds every live page (read from whichever tier it lives in), the page tables, the
importance, the lengths and each layer's fitted key sketch (its range and projection, when the
cache keeps one: the restored pages are coded as the saved ones were), written atomically by
:mod:`tierattn.storage.kvfile` (temp file, fsync, rename; safetensors only). :func:`load` validates
the whole file -- format, fingerprint, geometry, dtypes and shapes from this cache (never from the
file), checksum, and the consistency of its tables (lengths vs live pages, tier indices, flags,
padding, importance) -- and checks that every tier has room, before it changes anything; the
file's disk pages are then written into the disk tier's next generation (a segment file of its
own), and only when all of them landed is the old segment dropped (a failure deletes the new one
and leaves the old content as it was)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from tierattn.runtime import validate
from tierattn.errors import KVCapacityError, KVFileError
from tierattn.storage.kvfile import read_kv_file, write_kv_file
from tierattn.storage.pagemap import NONE

__all__ = ["load", "save"]


def _meta(cache) -> dict[str, str]:
    return {"kind": "cache", "fingerprint": cache.fingerprint,
            "page_size": str(cache.page_size), "num_layers": str(cache.num_layers),
            "num_kv_heads": str(cache.num_kv_heads), "head_dim": str(cache.head_dim),
            "batch_size": str(cache.batch_size), "max_pages": str(cache.max_pages),
            "dtype": str(cache.dtype).removeprefix("torch."),
            "tiers": json.dumps([t.kind for t in cache.tiers])}


def save(cache, directory: str | Path) -> Path:
    """Write the whole ``cache`` (every tier, tables, importance) to one safetensors file in
    ``directory``, atomically; returns its path. ``cache`` is the
    :class:`~tierattn.runtime.cache.TieredKVCache` that calls this with itself (this module sits
    below the facade and does not import it)."""
    pages = cache.pages
    tensors: dict[str, torch.Tensor] = {"alive": pages.alive.to(torch.uint8),
                                        "pad": pages.pad.clone()}
    for layer, st in enumerate(pages.layers):
        live = (st.tier != NONE).nonzero()
        tensors[f"layer{layer}.pages"] = cache.mover.read(layer, live[:, 0], live[:, 1])
        tensors[f"layer{layer}.tier"] = st.tier.to(torch.int32)
        tensors[f"layer{layer}.evicted"] = st.evicted.to(torch.uint8)
        tensors[f"layer{layer}.mass"] = cache.importance.of(layer).cpu()
        tensors[f"layer{layer}.length"] = torch.tensor([st.length], dtype=torch.int64)
        tensors.update({f"layer{layer}.{name}": t.cpu()
                        for name, t in cache.importance.sketch_fit(layer).items()})
    key = hashlib.sha256(f"{cache.fingerprint}:{time.time_ns()}".encode()).hexdigest()
    return write_kv_file(directory, key, tensors, _meta(cache))


def load(cache, path: str | Path) -> None:
    """Replace ``cache``'s content with a file written by :func:`save` from a cache of the same
    geometry; the file is validated whole before anything changes."""
    b, mp, n_layers = cache.batch_size, cache.max_pages, cache.num_layers
    meta = _meta(cache)
    limit = 64 * 1024 + sum(t.capacity for t in cache.tiers) * n_layers * \
        cache.page_bytes + n_layers * b * mp * 16

    def check(header) -> None:
        for k, want in meta.items():
            if header.meta.get(k) != want:
                raise KVFileError(f"{header.path}: metadata {k}={header.meta.get(k)!r}, "
                                  f"this cache expects {want!r}.")
        want_names = {"alive", "pad"} | {f"layer{i}.{n}" for i in range(n_layers)
                                         for n in ("pages", "tier", "evicted", "mass", "length")}
        # a layer's fitted key sketch (range, and basis when projected): all of it or none
        shapes = cache.importance.sketch_fit_shapes()
        fit = {f"layer{i}.{n}": (cache.dtype, s) for i in range(n_layers)
               for n, s in shapes.items()}
        extra = set(header.tensors) - want_names
        partial = any(0 < len(extra & {f"layer{i}.{n}" for n in shapes}) < len(shapes)
                      for i in range(n_layers))
        if not want_names <= set(header.tensors) or not extra <= set(fit) or partial:
            raise KVFileError(f"{header.path}: tensors {sorted(header.tensors)} do not match "
                              "a saved cache of this geometry.")
        fixed = {"alive": (torch.uint8, (b,)), "pad": (torch.int64, (b,))}
        fixed.update({name: fit[name] for name in extra})
        for i in range(n_layers):
            fixed.update({f"layer{i}.tier": (torch.int32, (b, mp)),
                          f"layer{i}.evicted": (torch.uint8, (b, mp)),
                          f"layer{i}.mass": (torch.float32, (b, mp)),
                          f"layer{i}.length": (torch.int64, (1,))})
            e = header.tensors[f"layer{i}.pages"]
            if e.dtype != cache.dtype or tuple(e.shape[1:]) != cache.page_shape or \
                    e.shape[0] > b * mp:
                raise KVFileError(f"{header.path}: layer{i}.pages is {e.dtype} "
                                  f"{list(e.shape)}, expected {cache.dtype} [<= {b * mp}, "
                                  f"{', '.join(map(str, cache.page_shape))}].")
        for name, (dt, shape) in fixed.items():
            e = header.tensors[name]
            if e.dtype != dt or tuple(e.shape) != shape:
                raise KVFileError(f"{header.path}: {name} is {e.dtype} {list(e.shape)}, "
                                  f"expected {dt} {list(shape)}.")

    data = read_kv_file(path, check, max_file_bytes=limit)
    plans = [_layer_plan(cache, path, data, i) for i in range(n_layers)]
    _check_sequences(cache, path, data)
    for layer, (tier, live, _) in enumerate(plans):  # room in every tier, before any change
        counts = torch.bincount(tier[live[:, 0], live[:, 1]].long(), minlength=len(cache.tiers))
        for ti, t in enumerate(cache.tiers):
            if int(counts[ti]) > t.capacity:
                raise KVCapacityError(
                    f"{path}: layer {layer} holds {int(counts[ti])} pages in the {t.kind} tier, "
                    f"which has {t.capacity} slots per layer here; load it into a cache whose "
                    f"{t.kind} capacity_pages is at least that. Nothing changed.")
    # the disk pages go first, into the disk tiers' next generation's segment: the old content
    # is untouched until every write landed (a failure deletes the new segment)
    disks = [(ti, t) for ti, t in enumerate(cache.tiers) if not t.is_memory]
    try:
        for layer, (tier, live, _) in enumerate(plans):
            for ti, t in disks:
                sel = (tier[live[:, 0], live[:, 1]] == ti).nonzero().flatten()
                slots = list(range(len(sel)))
                t.write(layer, slots, data[f"layer{layer}.pages"][sel],
                        (live[sel, 1] * cache.page_size).tolist(),
                        generation=t.generation + 1)
    except BaseException as e:
        for _, t in disks:  # the next generation's segment goes, with whatever it got
            t.discard(t.generation + 1)
        raise validate.io_error(e, f"loading {path} (writing its disk pages)") from e
    # commit: nothing below does I/O
    cache.prefetcher.cancel_all()
    cache.reset()
    for _, t in disks:
        t.advance()
    pages = cache.pages
    pages.alive = data["alive"].bool()
    pages.pad = data["pad"].clone()
    pages.sequences_changed()
    for layer, (tier, live, length) in enumerate(plans):
        st = pages.layers[layer]
        st.length = length
        st.evicted = data[f"layer{layer}.evicted"].bool()
        cache.importance.of(layer).copy_(data[f"layer{layer}.mass"])
        where = tier[live[:, 0], live[:, 1]]
        for ti, t in enumerate(cache.tiers):
            sel = (where == ti).nonzero().flatten()
            t.clear(layer)
            slots = t.alloc(layer, len(sel))  # 0..n-1: the slots the disk pages were written to
            if t.is_memory and len(sel):
                t.write(layer, slots, data[f"layer{layer}.pages"][sel], [])
            st.tier[live[sel, 0], live[sel, 1]] = ti
            st.slot[live[sel, 0], live[sel, 1]] = torch.tensor(slots, dtype=torch.int32)
        st.edited()
        cache.importance.restore_sketch_fit(layer, {
            name: data[f"layer{layer}.{name}"] for name in cache.importance.sketch_fit_shapes()
            if f"layer{layer}.{name}" in data})
        _refresh_metadata(cache, layer)


def _layer_plan(cache, path, data, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Layer ``i``'s tables checked for consistency: ``(tier [B, mp] int8, live [n, 2],
    length)``. Raises :class:`KVFileError` naming the fault."""
    p, mp, n_tiers = cache.page_size, cache.max_pages, len(cache.tiers)
    tier32, evicted = data[f"layer{i}.tier"], data[f"layer{i}.evicted"]
    length = int(data[f"layer{i}.length"][0])
    alive = data["alive"].bool()

    def bad(what: str) -> KVFileError:
        return KVFileError(f"{path}: layer{i} tables are inconsistent ({what}); nothing was "
                           "loaded.")

    if not 0 <= length <= mp * p:
        raise bad(f"length {length} outside 0..{mp * p}")
    if ((tier32 < NONE) | (tier32 >= n_tiers)).any():
        raise bad(f"a tier index outside -1..{n_tiers - 1}")
    if (evicted > 1).any():
        raise bad("evicted flags other than 0/1")
    live = tier32 != NONE
    n_pages = -(-length // p)
    if live[:, n_pages:].any() or evicted[:, n_pages:].any():
        raise bad(f"pages past the length ({length} tokens = {n_pages} pages)")
    if (live & evicted.bool()).any():
        raise bad("a page both live and evicted")
    if live[~alive].any():
        raise bad("a freed sequence holds pages")
    if (live[alive, :n_pages] == evicted.bool()[alive, :n_pages]).any():
        raise bad("a page of a live sequence neither stored nor evicted")
    if int(live.sum()) != data[f"layer{i}.pages"].shape[0]:
        raise bad(f"{int(live.sum())} live pages in the tables, "
                  f"{data[f'layer{i}.pages'].shape[0]} stored")
    if not torch.isfinite(data[f"layer{i}.mass"]).all():
        raise bad("a non-finite importance")
    for name in cache.importance.sketch_fit_shapes():
        if f"layer{i}.{name}" in data and not torch.isfinite(data[f"layer{i}.{name}"]).all():
            raise bad(f"a non-finite key sketch {name}")
    return tier32.to(torch.int8), live.nonzero(), length


def _check_sequences(cache, path, data) -> None:
    alive, pad = data["alive"], data["pad"]
    if (alive > 1).any():
        raise KVFileError(f"{path}: alive flags other than 0/1; nothing was loaded.")
    limit = cache.max_pages * cache.page_size
    if ((pad < 0) | (pad > limit)).any():
        raise KVFileError(f"{path}: padding {pad.tolist()} outside 0..{limit} tokens; nothing "
                          "was loaded.")


def _refresh_metadata(cache, layer: int) -> None:
    """Recompute the Quest metadata of every live page of ``layer`` (after a load)."""
    st, p = cache.pages.layers[layer], cache.page_size
    live = (st.tier != NONE).nonzero()
    if not len(live):
        return
    rows, cols = live[:, 0], live[:, 1]
    data = cache.mover.read(layer, rows, cols).to(cache.device)
    lens = torch.clamp(st.length - cols * p, max=p).to(torch.int32)
    cache.importance.write_metadata(layer, data, torch.arange(len(live), dtype=torch.int32),
                                    lens, rows * cache.max_pages + cols)
