"""Tiers of the KV hierarchy: where a demoted page lives.

A tier holds whole pages (``[2, page_size, H_kv, D]``: K and V of ``page_size`` tokens, all KV
heads) in numbered slots, per layer. The interface is small -- ``alloc``, ``release``, ``read``,
``write`` -- and memory tiers also expose their pool tensor, so the transfer engine can move a
layer's pages between two pools with one page-copy launch. Adding a backend means one subclass
of :class:`Tier` in this file and one entry in :func:`build_tier`.

* ``hbm``: the device pool (attention reads it directly);
* ``ddr``: a host pool, pinned on CUDA (the copy kernel reads it over UVA), allocated once;
* ``cxl``: a host pool with CXL's bandwidth profile. On Linux, when ``numa_node`` is given, it is
  first-touched by a thread bound to that node's CPUs, so the kernel places its pages there (the
  node of a CXL memory expander); elsewhere it is an ordinary host pool (a documented stand-in);
* ``disk``: one safetensors file per page under a directory (:mod:`tierattn.kvfile`: atomic
  writes, digest names, every read validated before any allocation).
"""

from __future__ import annotations

import gc
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from tierattn.config import TierConfig, TierSpec
from tierattn.errors import KVCapacityError, TierConfigError
from tierattn.kernels.sketch import sketch_bytes
from tierattn.kvfile import expect, kv_file_name, read_kv_file, write_kv_file

__all__ = ["DiskTier", "MemoryTier", "Tier", "available_memory", "build_tier", "memory_for",
           "plan_memory"]

#: nominal bandwidth/latency per tier kind (GB/s, microseconds), not measured here: PCIe Gen5
#: x16 for host tiers as seen from the GPU, a CXL 2.0 x8 expander, an NVMe SSD. Nothing reads
#: it yet; modeled transfer times (the benchmark issue) start from it until a GPU run measures.
PROFILES = {
    "hbm": {"bandwidth_gbps": 4800.0, "latency_us": 1.0},
    "ddr": {"bandwidth_gbps": 55.0, "latency_us": 5.0},
    "cxl": {"bandwidth_gbps": 30.0, "latency_us": 8.0},
    "disk": {"bandwidth_gbps": 7.0, "latency_us": 80.0},
}


def available_memory(device: torch.device) -> int:
    """Bytes that may still be allocated on ``device``: free HBM plus the blocks PyTorch's
    caching allocator holds unused (it allocates from those first), or MemAvailable on the
    host."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_for(need: int, device: torch.device) -> int:
    """:func:`available_memory` on ``device``, measured again after collecting unreachable
    objects when ``need`` bytes exceed 90% of it: a dropped cache caught in a reference cycle
    (its caller's objects) keeps its pools until the cyclic collector runs, and a cache built
    right after it would be refused for memory nothing uses."""
    have = available_memory(device)
    if need > 0.9 * have:
        gc.collect()
        have = available_memory(device)
    return have


class Tier(ABC):
    """Slots holding whole pages, per layer, with a free list."""

    kind: str
    #: fill released slots with NaN (memory tiers), so a read after free shows
    poison_freed: bool = False
    #: a pool tensor the copy kernel can read (False: pages are read through ``read``)
    is_memory: bool = False

    def __init__(self, kind: str, num_layers: int, capacity: int, page_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.kind = kind
        self.capacity = capacity
        self.page_shape = page_shape
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.page_bytes = torch.Size(page_shape).numel() * itemsize
        # stacks of free slots; popping from the end hands out low slots first
        self._free = [list(range(capacity - 1, -1, -1)) for _ in range(num_layers)]

    def num_free(self, layer: int) -> int:
        return len(self._free[layer])

    def num_used(self, layer: int) -> int:
        return self.capacity - len(self._free[layer])

    def alloc(self, layer: int, n: int) -> list[int]:
        """``n`` free slots of ``layer``; raises :class:`KVCapacityError` (taking none) if short."""
        free = self._free[layer]
        if n > len(free):
            raise KVCapacityError(
                f"{self.kind} tier is full for layer {layer}: {n} pages requested, "
                f"{len(free)} of {self.capacity} free. Raise its capacity_pages, add a lower "
                "tier, or lower the hot/recall budgets.")
        taken = free[len(free) - n:][::-1]
        del free[len(free) - n:]
        return taken

    def release(self, layer: int, slots: list[int]) -> None:
        self._free[layer].extend(reversed(slots))

    def clear(self, layer: int) -> None:
        """Mark every slot of ``layer`` free, in the order of a new tier (``alloc(layer, n)``
        then returns ``0..n-1``); for a layer whose slots were all released."""
        self._free[layer] = list(range(self.capacity - 1, -1, -1))

    @abstractmethod
    def read(self, layer: int, slots: list[int], token_starts: list[int]) -> torch.Tensor:
        """``[n, *page_shape]`` copies of the pages (validated for the disk tier)."""

    @abstractmethod
    def write(self, layer: int, slots: list[int], pages: torch.Tensor,
              token_starts: list[int]) -> None:
        """Store ``pages [n, *page_shape]`` into ``slots``."""


class MemoryTier(Tier):
    """A pool tensor ``[num_layers, capacity, *page_shape]`` allocated once, at construction."""

    is_memory = True

    def __init__(self, kind: str, num_layers: int, capacity: int, page_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, *, pinned: bool = False,
                 numa_node: int | None = None) -> None:
        super().__init__(kind, num_layers, capacity, page_shape, dtype)
        self.device = device
        need = num_layers * capacity * self.page_bytes
        have = memory_for(need, device)
        if need > 0.9 * have:
            raise KVCapacityError(
                f"{kind} tier needs {need / 2**30:.2f} GiB ({num_layers} layers x {capacity} "
                f"pages x {self.page_bytes} B) but only {have / 2**30:.2f} GiB is available on "
                f"{device} (at most 90% may be used); lower capacity_pages or max_context.")
        self.pinned = bool(pinned and device.type == "cpu" and torch.cuda.is_available())
        # allocated pinned in place (a pinned copy of a pageable pool would need twice the
        # memory for a moment) and zeroed by the thread bound to the tier's NUMA node
        with _first_touch_on(numa_node):
            self.pools = torch.empty((num_layers, capacity, *page_shape), dtype=dtype,
                                     device=device, pin_memory=self.pinned).zero_()

    @classmethod
    def over(cls, kind: str, pools: torch.Tensor | Sequence[torch.Tensor]) -> MemoryTier:
        """A tier over ``pools [num_layers, capacity, *page_shape]`` (or a list of per-layer
        ``[capacity, *page_shape]`` tensors, when the layers are separate allocations) that
        someone else allocated and owns (a serving engine's KV cache viewed as pages): nothing
        is allocated or poisoned, and which slots are in use is the owner's business."""
        first = pools if isinstance(pools, torch.Tensor) else pools[0]
        if not isinstance(pools, torch.Tensor):
            first = first.unsqueeze(0)
            if any(p.shape != first.shape[1:] or p.dtype != first.dtype for p in pools):
                raise TierConfigError(f"MemoryTier.over: the {kind} layers' pools differ in "
                                      "shape or dtype; give pools of one page geometry.")
        tier = cls.__new__(cls)
        Tier.__init__(tier, kind, len(pools), first.shape[1], tuple(first.shape[2:]),
                      first.dtype)
        tier.device, tier.pinned, tier.pools = first.device, first.is_pinned(), pools
        return tier

    def pool(self, layer: int) -> torch.Tensor:
        """``[capacity, 2, page_size, H_kv, D]`` view of ``layer``'s pool."""
        return self.pools[layer]

    def release(self, layer, slots):
        if self.poison_freed and slots:
            idx = torch.tensor(slots, dtype=torch.long, device=self.device)
            self.pools[layer].index_fill_(0, idx, float("nan"))
        super().release(layer, slots)

    def read(self, layer, slots, token_starts):
        return self.pools[layer][torch.tensor(slots, dtype=torch.long)]

    def write(self, layer, slots, pages, token_starts):
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.pools[layer].index_copy_(0, idx, pages.to(self.device, non_blocking=True))


@contextmanager
def _first_touch_on(numa_node: int | None):
    """Bind this thread to ``numa_node``'s CPUs while memory is first written (Linux)."""
    if numa_node is None:
        yield
        return
    cpulist = Path(f"/sys/devices/system/node/node{numa_node}/cpulist")
    if not cpulist.exists() or not hasattr(os, "sched_setaffinity"):
        raise TierConfigError(
            f"tiers: numa_node={numa_node} does not exist on this machine (no {cpulist}); "
            "omit numa_node to use a plain host pool.")
    cpus: set[int] = set()
    for part in cpulist.read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class DiskTier(Tier):
    """One safetensors file per (layer, slot) page under ``directory``.

    Each file records the cache fingerprint, page size, layer, slot and the page's first token;
    a read checks all of them, the shape and dtype from the config (never from the file) and
    the checksum before it allocates anything, and raises :class:`KVFileError` otherwise.
    """

    def __init__(self, num_layers: int, capacity: int, page_shape: tuple[int, ...],
                 dtype: torch.dtype, directory: str | Path, fingerprint: str) -> None:
        super().__init__("disk", num_layers, capacity, page_shape, dtype)
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise TierConfigError(f"tiers: the disk tier's path {self.directory} is a file; "
                                  "give a folder (it is created if missing).")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TierConfigError(f"tiers: cannot create the disk tier's folder "
                                  f"{self.directory} ({e}); give a writable folder.") from e
        self.fingerprint = fingerprint
        #: files of a generation never collide with another's (a load writes the next one
        #: before the old content is released)
        self.generation = 0
        self._max_bytes = self.page_bytes + (1 << 16)

    def _key(self, layer: int, slot: int, generation: int | None = None) -> str:
        gen = self.generation if generation is None else generation
        return f"{self.fingerprint}/g{gen}/layer{layer}/slot{slot}"

    def _meta(self, layer: int, slot: int, token_start: int) -> dict[str, str]:
        return {"kind": "page", "fingerprint": self.fingerprint,
                "page_size": str(self.page_shape[1]), "layer": str(layer), "slot": str(slot),
                "token_start": str(token_start)}

    def path(self, layer: int, slot: int, generation: int | None = None) -> Path:
        return self.directory / kv_file_name(self._key(layer, slot, generation))

    def write(self, layer, slots, pages, token_starts, *, generation: int | None = None):
        """Store the pages, one atomic file each; if one fails (disk full, an I/O error, an
        interrupt), the files this call wrote are deleted before the error propagates."""
        pages = pages.detach().to("cpu")
        started = []  # the slots are fresh: any file under their names is this call's
        try:
            for i, (slot, start) in enumerate(zip(slots, token_starts)):
                started.append(slot)
                write_kv_file(self.directory, self._key(layer, slot, generation),
                              {"kv": pages[i]}, self._meta(layer, slot, start))
        except BaseException:
            for slot in started:  # a failure after the rename (the folder's fsync) included
                self.path(layer, slot, generation).unlink(missing_ok=True)
            raise

    def read(self, layer, slots, token_starts):
        out = torch.empty((len(slots), *self.page_shape), dtype=self.dtype)
        for i, (slot, start) in enumerate(zip(slots, token_starts)):
            meta = self._meta(layer, slot, start)
            check = lambda h, meta=meta: expect(
                h, meta=meta, tensors={"kv": (self.dtype, tuple(self.page_shape))})
            out[i] = read_kv_file(self.path(layer, slot), check,
                                  max_file_bytes=self._max_bytes)["kv"]
        return out

    def release(self, layer, slots):
        for slot in slots:
            try:
                self.path(layer, slot).unlink()
            except OSError:  # a file left behind is never read: its slot is rewritten whole
                pass
        super().release(layer, slots)


def build_tier(spec: TierSpec, *, num_layers: int, capacity: int, page_shape: tuple[int, ...],
               dtype: torch.dtype, device: torch.device, fingerprint: str) -> Tier:
    """The tier ``spec`` describes (``hbm`` on ``device``; host tiers pinned when CUDA is used)."""
    if spec.kind == "hbm":
        return MemoryTier("hbm", num_layers, capacity, page_shape, dtype, device)
    if spec.kind in ("ddr", "cxl"):
        return MemoryTier(spec.kind, num_layers, capacity, page_shape, dtype,
                          torch.device("cpu"), pinned=device.type == "cuda",
                          numa_node=spec.node())
    if spec.kind == "disk":
        return DiskTier(num_layers, capacity, page_shape, dtype, spec.path, fingerprint)
    raise TierConfigError(f"tiers: unknown kind {spec.kind!r}")  # TierSpec already checks



def plan_memory(config: TierConfig, *, num_layers: int, batch_size: int,
                page_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                staging_pages: int | None, ring: int, holds_prompt: bool) -> tuple[list[int], int]:
    """Slots per layer of each tier and of a staging buffer for a cache of this geometry;
    refuses, with the numbers, a configuration that does not fit, before anything is allocated.

    Args:
        staging_pages: slots per staging buffer (None: every cold page of the batch for
            ``attend="all"``, the recall budget for ``"topk"``).
        ring: staging buffers.
        holds_prompt: the eviction policy keeps the whole prompt until decoding starts.

    Raises:
        KVCapacityError: the pools, staging ring, metadata and tables exceed 90% of the free
            memory of a device.
    """
    cfg, b, p = config, batch_size, config.page_size
    mp = math.ceil(cfg.max_context / p)
    must_hot = cfg.sink_pages + cfg.recent_pages + 1
    hot_max = max(cfg.pages(cfg.hot_budget, mp, cfg.max_context), must_hot)
    headroom = math.ceil(cfg.prefill_chunk_size / p) + 1
    if len(cfg.tiers) == 1 and holds_prompt:
        hot_max = mp  # nowhere to demote: the whole prompt stays until it is compressed
    default = {"hbm": b * min(mp, hot_max + headroom), "ddr": b * mp, "cxl": b * mp,
               "disk": b * mp}
    itemsize = torch.empty((), dtype=dtype).element_size()
    page_bytes = math.prod(page_shape) * itemsize
    capacities = [spec.capacity(page_bytes, num_layers) for spec in cfg.tiers]
    capacities = [default[spec.kind] if cap is None else cap
                  for spec, cap in zip(cfg.tiers, capacities)]
    if cfg.attend == "all":  # by default a row per sequence (demotions append in place)
        staging_pages = max(1, min(staging_pages, b * mp)) if staging_pages else b * mp
    else:  # recall: the selection, and as much again for the pages a prefetch missed
        need = b * max(1, min(cfg.pages(cfg.recall_budget, mp, cfg.max_context),
                              mp - must_hot))
        if staging_pages is not None and staging_pages < need:
            raise TierConfigError(
                f"staging_pages={staging_pages} cannot hold the recall budget of the batch "
                f"({need} pages at max_context); pass at least {need} (twice that lets the "
                "layer-ahead prefetch work), or None.")
        staging_pages = staging_pages or 2 * need

    rows = b * mp
    need: dict[str, list[tuple[str, int]]] = {}
    dev = "cuda" if device.type == "cuda" else "cpu"
    for spec, cap in zip(cfg.tiers, capacities):
        if spec.kind != "disk":
            where = dev if spec.kind == "hbm" else "cpu"
            need.setdefault(where, []).append((f"{spec.kind} pool", num_layers * cap * page_bytes))
    need.setdefault(dev, []).extend([
        ("staging ring", ring * staging_pages * page_bytes),
        ("key range and sketch", num_layers * rows * (
            (2 * page_shape[2] * page_shape[3] * itemsize if cfg.key_range else 0)
            + (sketch_bytes(page_shape[1], page_shape[2], page_shape[3], cfg.key_bits)
               if cfg.key_sketch else 0)))])
    need.setdefault("cpu", []).append(("page tables", num_layers * rows * 10))
    for where, items in need.items():
        total = sum(n for _, n in items)
        have = memory_for(total, device if where == "cuda" else torch.device("cpu"))
        if total > 0.9 * have:
            parts = ", ".join(f"{name} {n / 2**30:.2f} GiB" for name, n in items)
            raise KVCapacityError(
                f"the cache needs {total / 2**30:.2f} GiB on {where} ({parts}) but only "
                f"{have / 2**30:.2f} GiB is available (at most 90% may be used); lower "
                "max_context, batch_size or the tiers' capacity_pages.")
    return capacities, staging_pages
