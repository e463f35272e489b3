"""Snapshot: save a whole tiered cache to one safetensors file and load it back.

The file holds every live page (read from whichever tier it lives in), the page tables, the
importance and the lengths, written atomically by :mod:`tierattn.kvfile` (temp file, fsync,
rename; safetensors only). :func:`load` validates the whole file -- format, fingerprint, geometry,
dtypes and shapes from this cache (never from the file), checksum, and the consistency of its
tables -- before it changes anything.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from tierattn.errors import KVFileError
from tierattn.kvfile import read_kv_file, write_kv_file
from tierattn.pagemap import NONE

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
    :class:`~tierattn.cache.TieredKVCache` that calls this with itself (this module sits below
    the facade and does not import it)."""
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
        if set(header.tensors) != want_names:
            raise KVFileError(f"{header.path}: tensors {sorted(header.tensors)} do not match "
                              "a saved cache of this geometry.")
        fixed = {"alive": (torch.uint8, (b,)), "pad": (torch.int64, (b,))}
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
    cache.prefetcher.cancel_all()
    plans = []
    for i in range(n_layers):
        tier32 = data[f"layer{i}.tier"]
        length = int(data[f"layer{i}.length"][0])
        live = (tier32 != NONE).nonzero()
        if len(live) != data[f"layer{i}.pages"].shape[0] or not 0 <= length <= mp * \
                cache.page_size or (tier32 >= len(cache.tiers)).any() or (tier32 < NONE).any():
            raise KVFileError(f"{path}: layer{i} tables are inconsistent with its pages.")
        plans.append((tier32.to(torch.int8), live, length))
    # every check passed: replace the content
    cache.reset_content()
    pages = cache.pages
    pages.alive = data["alive"].bool()
    pages.pad = data["pad"].clamp(min=0)
    pages.sequences_changed()
    for layer, (tier, live, length) in enumerate(plans):
        st = pages.layers[layer]
        st.length = length
        st.evicted = data[f"layer{layer}.evicted"].bool()
        cache.importance.of(layer).copy_(data[f"layer{layer}.mass"])
        cache.mover.write(layer, live[:, 0], live[:, 1], tier[live[:, 0], live[:, 1]],
                          data[f"layer{layer}.pages"])
        cache.refresh_metadata(layer)
