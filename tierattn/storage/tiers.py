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
* ``disk``: one segment file of page-aligned slots per tier under a directory
  (:mod:`tierattn.storage.segment`: batched positional I/O on a small thread pool, a checksum per
  page in the page map, every read validated; no fsync -- a tier is a cache of the process);
* ``remote``: pages in a Mooncake Store shared by many hosts, below disk (:class:`RemoteTier`
  over :mod:`tierattn.storage.remote`: hard-pinned values behind a checksum, a deadline on
  every call; Mooncake is imported only when one is built).

Tiers that are not memory (disk, remote) share one contract beyond :class:`Tier`'s: pages come
back through host staging (``read_into``, ``read_async``), ``held`` says which page each slot
holds and how often it was written, ``forget`` empties slots, and ``generation``, ``discard``,
``advance`` let a saved cache be loaded beside the current pages before they go.
"""

from __future__ import annotations

import gc
import math
import os
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tierattn.config import RemoteConfig, TierConfig, TierSpec
from tierattn.errors import KVCapacityError, KVFileError, TierConfigError
from tierattn.kernels.sketch import sketch_bytes
from tierattn.storage.remote import RemoteStore, RemoteStoreError  # no Mooncake import here
from tierattn.storage.segment import Segment, pool_for, submit

__all__ = ["DiskTier", "MemoryTier", "RemoteTier", "Tier", "available_memory", "build_tier",
           "memory_for", "plan_memory"]

#: nominal bandwidth/latency per tier kind (GB/s, microseconds), not measured here: PCIe Gen5
#: x16 for host tiers as seen from the GPU, a CXL 2.0 x8 expander, an NVMe SSD, a Mooncake
#: Store reached over RDMA. Nothing reads
#: it yet; modeled transfer times (the benchmark issue) start from it until a GPU run measures.
PROFILES = {
    "hbm": {"bandwidth_gbps": 4800.0, "latency_us": 1.0},
    "ddr": {"bandwidth_gbps": 55.0, "latency_us": 5.0},
    "cxl": {"bandwidth_gbps": 30.0, "latency_us": 8.0},
    "disk": {"bandwidth_gbps": 7.0, "latency_us": 80.0},
    "remote": {"bandwidth_gbps": 25.0, "latency_us": 20.0},  # a 200 Gb/s RDMA NIC
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
        self.num_layers = num_layers
        # per layer: released slots (a stack) above the never-used ones ``fresh .. capacity-1``;
        # slots come from the stack first, then the lowest fresh one (a large tier costs no
        # list of its slots)
        self._released: list[list[int]] = [[] for _ in range(num_layers)]
        self._fresh = [0] * num_layers

    def num_free(self, layer: int) -> int:
        return len(self._released[layer]) + self.capacity - self._fresh[layer]

    def num_used(self, layer: int) -> int:
        return self.capacity - self.num_free(layer)

    def alloc(self, layer: int, n: int) -> list[int]:
        """``n`` free slots of ``layer``; raises :class:`KVCapacityError` (taking none) if short."""
        if n > self.num_free(layer):
            raise KVCapacityError(
                f"{self.kind} tier is full for layer {layer}: {n} pages requested, "
                f"{self.num_free(layer)} of {self.capacity} free. Raise its capacity_pages, "
                "add a lower tier, or lower the hot/recall budgets.")
        stack = self._released[layer]
        k = min(n, len(stack))
        taken = stack[len(stack) - k:][::-1]
        del stack[len(stack) - k:]
        first = self._fresh[layer]
        self._fresh[layer] = first + n - k
        return taken + list(range(first, first + n - k))

    def release(self, layer: int, slots: list[int]) -> None:
        self._released[layer].extend(reversed(slots))

    def clear(self, layer: int) -> None:
        """Mark every slot of ``layer`` free, in the order of a new tier (``alloc(layer, n)``
        then returns ``0..n-1``); for a layer whose slots were all released."""
        self._released[layer], self._fresh[layer] = [], 0

    def close(self) -> None:  # noqa: B027 - memory tiers: their pools go with the object
        """Release what the tier holds outside the process's memory (a disk tier's files)."""

    @abstractmethod
    def read(self, layer: int, slots: list[int], token_starts: list[int]) -> torch.Tensor:
        """``[n, *page_shape]`` copies of the pages (validated for the disk tier)."""

    @abstractmethod
    def write(self, layer: int, slots: list[int], pages: torch.Tensor,
              token_starts: list[int]) -> None:
        """Store ``pages [n, *page_shape]`` into ``slots``."""


class MemoryTier(Tier):
    """A pool tensor ``[num_layers, capacity, *page_shape]``.

    Allocated and zeroed at construction, or with ``grow=True`` (a host tier that is not
    pinned) reserved as address space only: the operating system commits a slot's memory
    when it is first written, and :meth:`grow` -- called by :meth:`alloc`, or by a caller that
    picks slots itself -- admits each new high-water mark only while the host has the memory
    to back it, so nothing is held up front that no page uses and a tier that cannot grow
    refuses with :class:`KVCapacityError` instead of running the host out of memory.
    """

    is_memory = True

    def __init__(self, kind: str, num_layers: int, capacity: int, page_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, *, pinned: bool = False,
                 numa_node: int | None = None, grow: bool = False) -> None:
        super().__init__(kind, num_layers, capacity, page_shape, dtype)
        self.device = device
        self.pinned = bool(pinned and device.type == "cpu" and torch.cuda.is_available())
        # pinned memory is committed when it is allocated: it cannot grow lazily
        self.growable = bool(grow and device.type == "cpu" and not self.pinned)
        #: slots per layer whose memory may be in use (every slot unless the tier grows)
        self.committed = 0 if self.growable else capacity
        need = num_layers * capacity * self.page_bytes
        if not self.growable:
            have = memory_for(need, device)
            if need > 0.9 * have:
                raise KVCapacityError(
                    f"{kind} tier needs {need / 2**30:.2f} GiB ({num_layers} layers x "
                    f"{capacity} pages x {self.page_bytes} B) but only {have / 2**30:.2f} GiB "
                    f"is available on {device} (at most 90% may be used); lower the tier's "
                    "capacity_gib or capacity_pages (TierConfig.tiers, SwapConfig.tiers) or "
                    "TierConfig.max_context.")
        # allocated pinned in place (a pinned copy of a pageable pool would need twice the
        # memory for a moment) and zeroed by the thread bound to the tier's NUMA node; a
        # growing tier is left untouched, so its pages are placed when first written
        with _first_touch_on(numa_node):
            self.pools = torch.empty((num_layers, capacity, *page_shape), dtype=dtype,
                                     device=device, pin_memory=self.pinned)
            if not self.growable:
                self.pools.zero_()

    def grow(self, slots: int) -> None:
        """Admit slots ``0 .. slots-1`` of every layer (a growing tier; no-op otherwise).

        Raises:
            KVCapacityError: the host has not the memory to back them (at most 90% of what is
                available may be used); the tier is unchanged.
        """
        if slots <= self.committed:
            return
        if slots > self.capacity:
            raise KVCapacityError(f"{self.kind} tier: slot {slots - 1} is past its capacity "
                                  f"of {self.capacity}.")
        # admit in steps of an eighth of what is held, so the check runs rarely
        slots = min(self.capacity, max(slots, self.committed + max(1, self.committed // 8)))
        need = (slots - self.committed) * self.num_layers * self.page_bytes
        have = memory_for(need, self.device)
        if need > 0.9 * have:
            raise KVCapacityError(
                f"{self.kind} tier cannot grow by {need / 2**20:.1f} MiB: the host has "
                f"{have / 2**20:.1f} MiB available (at most 90% may be used). Free host "
                "memory, set the tier's capacity_gib, or add a disk tier below it.")
        self.committed = slots

    def alloc(self, layer: int, n: int) -> list[int]:
        fresh = n - len(self._released[layer])
        if fresh > 0 and n <= self.num_free(layer):  # grown first: a refusal takes nothing
            self.grow(self._fresh[layer] + fresh)
        return super().alloc(layer, n)

    def held_bytes(self) -> int:
        """Bytes of memory the tier may hold (its committed slots, all layers)."""
        return self.committed * self.num_layers * self.page_bytes

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
        tier.growable, tier.committed = False, tier.capacity
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


class _ReadsInFlight:
    """Reads running on a tier's I/O threads, per layer: a release (after which a slot may be
    rewritten) waits for them first. Their errors are for their own waiters."""

    def __init__(self, num_layers: int) -> None:
        self._by_layer: list[list[Future]] = [[] for _ in range(num_layers)]

    def add(self, layer: int, fut: Future) -> Future:
        pending = self._by_layer[layer]
        pending[:] = [f for f in pending if not f.done()]
        pending.append(fut)
        return fut

    def settle(self, layer: int | None = None) -> None:
        """Wait for the reads of ``layer`` (None: every layer)."""
        for lst in self._by_layer if layer is None else [self._by_layer[layer]]:
            for f in lst:
                f.exception()
            lst.clear()


class DiskTier(Tier):
    """Pages in a segment file under ``directory`` (:mod:`tierattn.storage.segment`): one file per
    generation of the tier, whatever the number of pages, each page an aligned slot.

    A read checks the page map (the slot holds the page of that first token), the file (not
    deleted or truncated) and every page's checksum, and raises :class:`KVFileError` otherwise;
    shape and dtype come from the config, never from the file. Writes are batched positional
    I/O on ``io_threads`` threads, never fsynced (a tier is a cache of this process; its file is
    deleted when the tier goes).
    """

    def __init__(self, num_layers: int, capacity: int, page_shape: tuple[int, ...],
                 dtype: torch.dtype, directory: str | Path, fingerprint: str, *,
                 io_threads: int = 4) -> None:
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
        self.num_layers = num_layers
        #: the I/O pool: large batches are split over it, staging reads run on it
        self.pool = pool_for(io_threads)
        #: a load writes the next generation's segment before the current one is dropped
        self.generation = 0
        self._segments: dict[int, Segment] = {}
        self._reads = _ReadsInFlight(num_layers)
        self.segment(0)  # opened now: a folder that cannot hold it fails at construction

    def segment(self, generation: int | None = None) -> Segment:
        """The segment of ``generation`` (default: the current one), opened on first use."""
        gen = self.generation if generation is None else generation
        seg = self._segments.get(gen)
        if seg is None:
            try:
                seg = Segment(self.directory, self.fingerprint, self.num_layers, self.capacity,
                              self.page_shape, self.dtype, gen, self.pool)
            except OSError as e:
                if gen == self.generation and not self._segments:
                    raise TierConfigError(f"tiers: cannot create a segment file in the disk "
                                          f"tier's folder {self.directory} ({e}); give a "
                                          "writable folder.") from e
                raise
            self._segments[gen] = seg
        return seg

    def path(self, generation: int | None = None) -> Path:
        """The segment file of ``generation`` (default: the current one)."""
        return self.segment(generation).path

    def write(self, layer, slots, pages, token_starts, *, generation: int | None = None):
        """Store the pages in one batch of positional writes; if it fails (disk full, an I/O
        error, an interrupt), the slots hold nothing and the error propagates."""
        if slots:
            self.segment(generation).write(layer, slots, pages.detach().to("cpu"), token_starts)

    def read(self, layer, slots, token_starts):
        out = torch.empty((len(slots), *self.page_shape), dtype=self.dtype)
        self.segment().read_into(layer, slots, token_starts, out)
        return out

    def read_into(self, layer: int, slots: list[int], token_starts: list[int],
                  out: torch.Tensor, rows: list[int]) -> None:
        """Read pages into rows ``rows`` of ``out`` (a contiguous CPU pool), validated."""
        self.segment().read_into(layer, slots, token_starts, out, rows)

    def read_async(self, layer: int, slots: list[int], token_starts: list[int],
                   out: torch.Tensor, rows: list[int]) -> Future:
        """:meth:`read_into` on the I/O pool (inline without one); its slots are not released
        (nor rewritten) before it finished."""
        seg = self.segment()
        return self._reads.add(layer, submit(
            self.pool, lambda: seg.read_into(layer, slots, token_starts, out, rows)))

    def held(self, layer: int, slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The first token of the page each slot holds (-1: none) and the slot's write count
        (a page read earlier is still there while the count is unchanged)."""
        seg, idx = self.segment(), np.asarray(slots, dtype=np.int64)
        return seg.starts[layer, idx].copy(), seg.writes[layer, idx].copy()

    def forget(self, layer: int, slots: list[int]) -> None:
        """The slots hold nothing (released, or a failed store's): a read of them raises."""
        self._reads.settle(layer)
        self.segment().forget(layer, slots)

    def release(self, layer, slots):
        self.forget(layer, slots)
        super().release(layer, slots)

    def discard(self, generation: int) -> None:
        """Drop a generation's segment (a load that failed part way)."""
        self._reads.settle()
        seg = self._segments.pop(generation, None)
        if seg is not None:
            seg.close()

    def advance(self) -> None:
        """Make the next generation current and drop the old segment (a load landed)."""
        self.discard(self.generation)
        self.generation += 1
        self.segment()

    def close(self) -> None:
        """Delete the segment files and stop the I/O pool (also when the tier is collected)."""
        for gen in list(self._segments):
            self.discard(gen)
        if self.pool is not None:
            self.pool.shutdown(wait=True)


# --- the remote tier of a cache ---------------------------------------------------------------

@dataclass
class _Index:
    """Where one generation of a remote tier's pages is: per ``[layer, slot]`` the first token
    of the page it holds (-1: none) and its write count (part of the key: a rewritten slot
    gets a new key, so no read ever meets an older value)."""

    starts: np.ndarray
    writes: np.ndarray


@dataclass
class _Keys:
    """The keys a remote tier holds in the store (what its finalizer removes)."""

    prefix: str
    indices: dict[int, _Index] = field(default_factory=dict)
    orphans: list[str] = field(default_factory=list)  # removals the store did not answer

    def key(self, gen: int, layer: int, slot: int, write: int) -> str:
        return f"{self.prefix}/g{gen}.l{layer}.s{slot}.w{write}"

    def held(self, gen: int, layer: int | None = None, slots=None) -> list[str]:
        """Keys of the pages held by generation ``gen`` (of ``layer``'s ``slots``, or all)."""
        idx = self.indices.get(gen)
        if idx is None:
            return []
        if layer is None:
            layers, cols = np.nonzero(idx.starts >= 0)
        else:
            cols = np.asarray(slots, dtype=np.int64)
            cols = cols[idx.starts[layer, cols] >= 0]
            layers = np.full(len(cols), layer)
        return [self.key(gen, int(ly), int(c), int(idx.writes[ly, c]))
                for ly, c in zip(layers, cols)]


def _drop_all(store: RemoteStore, keys: _Keys, io: ThreadPoolExecutor) -> None:
    """Remove every page a remote tier holds, then close its client (``close`` or collection)."""
    io.shutdown(wait=True)
    store.remove([k for gen in list(keys.indices) for k in keys.held(gen)] + keys.orphans)
    keys.indices.clear()
    keys.orphans.clear()
    store.close()


class RemoteTier(Tier):
    """Pages in a Mooncake Store: the tier below disk (``TierSpec("remote", remote=...)``),
    whose capacity grows with the pool rather than with this host.

    The tier holds the pages of one cache: its keys are ``tierattn/<namespace>/<owner>/
    g<generation>.l<layer>.s<slot>.w<write>``, the owner unique to the tier (the model's
    fingerprint, the process, a random tag). Pages are put hard-pinned -- the store never
    evicts them: offload never drops KV -- and removed when their slot is released or the tier
    closes (a process that dies leaves them pinned until ``remove_by_regex`` of its owner or a
    master restart). Every read checks the page map (the slot holds the page of that first
    token), the value's length and its checksum. Like the disk tier's, the pages come back
    through host staging; reads run on the tier's own thread (:meth:`read_async`).

    A store that does not answer within ``deadline_s`` is skipped for ``retry_s``
    (:class:`RemoteStore`): a demotion into it is rolled back and raises
    :class:`~tierattn.errors.KVIOError` (the cache keeps the pages where they were and retries
    at the next step), and a read of a page there raises :class:`RemoteStoreError` -- the cache's
    storage failed, as with a failed disk; nothing is served wrong.

    Args:
        num_layers, capacity, page_shape, dtype: the tier's geometry (``capacity`` pages per
            layer; the store refuses puts past its own memory).
        config: where the store is.
        fingerprint: names the model (part of the owner).
        store: a :class:`RemoteStore` already set up (tests); None connects one.
    """

    def __init__(self, num_layers: int, capacity: int, page_shape: tuple[int, ...],
                 dtype: torch.dtype, config: RemoteConfig, fingerprint: str, *,
                 store: RemoteStore | None = None) -> None:
        super().__init__("remote", num_layers, capacity, page_shape, dtype)
        self.store = store if store is not None else RemoteStore(config)
        owner = f"{fingerprint}-{os.getpid()}-{uuid.uuid4().hex[:12]}".replace("/", "_")
        self._keys = _Keys(f"tierattn/{config.namespace or 'tier'}/{owner}")
        #: a load writes the next generation's pages before the current one's go
        self.generation = 0
        self._index(0)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierattn-remote-io")
        self._reads = _ReadsInFlight(num_layers)
        self._closer = weakref.finalize(self, _drop_all, self.store, self._keys, self._io)

    def _index(self, gen: int) -> _Index:
        idx = self._keys.indices.get(gen)
        if idx is None:
            shape = (self.num_layers, self.capacity)
            idx = self._keys.indices[gen] = _Index(np.full(shape, -1, dtype=np.int64),
                                                   np.zeros(shape, dtype=np.int64))
        return idx

    def _remove(self, keys: list[str]) -> None:
        """Remove ``keys`` (and the removals that failed before); kept for later if the store
        does not answer."""
        todo = self._keys.orphans + keys
        self._keys.orphans = [] if self.store.remove(todo) else todo

    # --- writes -------------------------------------------------------------------------------

    def write(self, layer, slots, pages, token_starts, *, generation: int | None = None):
        """Put the pages (one batch, hard-pinned); if any is refused (a full or dead store)
        the others are removed, the slots hold nothing and :class:`RemoteStoreError` is
        raised."""
        if not len(slots):
            return
        gen = self.generation if generation is None else generation
        idx, cols = self._index(gen), np.asarray(slots, dtype=np.int64)
        old = self._keys.held(gen, layer, cols)
        idx.starts[layer, cols] = -1
        idx.writes[layer, cols] += 1  # even if the put fails: a key is never written twice
        keys = [self._keys.key(gen, layer, int(c), int(idx.writes[layer, c])) for c in cols]
        flat = pages.detach().to("cpu").contiguous().reshape(len(cols), -1).view(torch.uint8)
        ok = self.store.put(keys, [flat[i].numpy() for i in range(len(cols))], pin=True)
        if not all(ok):  # (a failed batch may have stored some: every key goes)
            self._remove(old + keys)
            err = self.store.last_error
            raise RemoteStoreError(
                f"remote tier, layer {layer}: {ok.count(False)} of {len(ok)} pages were not "
                f"stored ({err.code_name if err else 'refused'}); none was kept. Check the "
                "Mooncake master, or give the pool more memory (its clients' segment_gib).",
                err.code if err else None)
        idx.starts[layer, cols] = token_starts
        self._remove(old)

    # --- reads --------------------------------------------------------------------------------

    def held(self, layer: int, slots) -> tuple[np.ndarray, np.ndarray]:
        """The first token of the page each slot holds (-1: none) and the slot's write count."""
        idx, cols = self._index(self.generation), np.asarray(slots, dtype=np.int64)
        return idx.starts[layer, cols].copy(), idx.writes[layer, cols].copy()

    def read(self, layer, slots, token_starts):
        out = torch.empty((len(slots), *self.page_shape), dtype=self.dtype)
        self.read_into(layer, slots, token_starts, out, list(range(len(slots))))
        return out

    def read_into(self, layer: int, slots, token_starts, out: torch.Tensor, rows) -> None:
        """Get the pages into rows ``rows`` of ``out`` (a contiguous CPU pool), checked.

        Raises:
            KVFileError: a slot holds no page of that first token, or a value is not a page
                of this tier (its length, or its checksum: the value is removed).
            RemoteStoreError: the store did not answer, or lost a page.
        """
        if not len(slots):
            return
        gen, cols = self.generation, np.asarray(slots, dtype=np.int64)
        idx = self._index(gen)
        have, want = idx.starts[layer, cols], np.asarray(token_starts, dtype=np.int64)
        if (have != want).any():
            i = int(np.flatnonzero(have != want)[0])
            raise KVFileError(f"remote tier, layer {layer}: slot {int(cols[i])} holds the page "
                              f"of token {int(have[i])}, not of token {int(want[i])}; the page "
                              "map and the tier disagree.")
        keys = [self._keys.key(gen, layer, int(c), int(idx.writes[layer, c])) for c in cols]
        corrupt = self.store.counters["corrupt"]
        values = self.store.get(keys)
        missing = [i for i, v in enumerate(values) if v is None]
        if missing and self.store.counters["corrupt"] == corrupt and self.store.up:
            # Mooncake answers a get whose transfer failed with an empty value, as it does a
            # missing key: the keys it still holds are asked once more
            there = self.store.contains([keys[i] for i in missing])
            again = [i for i, held in zip(missing, there) if held]
            for i, value in zip(again, self.store.get([keys[i] for i in again])):
                values[i] = value
        for i, (key, value) in enumerate(zip(keys, values)):
            if value is None or value.nbytes != self.page_bytes:
                if value is not None or self.store.counters["corrupt"] > corrupt:
                    raise KVFileError(f"remote tier, layer {layer}: the value of {key} is not "
                                      "the page written there (its length or checksum); it "
                                      "was removed.")
                if not self.store.up:
                    raise RemoteStoreError(f"remote tier, layer {layer}: the store did not "
                                           f"answer ({self.store.last_error}); its pages are "
                                           "unreachable until it does.")
                raise RemoteStoreError(f"remote tier, layer {layer}: the store lost {key} (a "
                                       "restarted master?)", -704)
            out[rows[i]].view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(value, np.uint8)

    def read_async(self, layer: int, slots, token_starts, out: torch.Tensor, rows) -> Future:
        """:meth:`read_into` on the tier's thread; its slots are not released (nor rewritten)
        before it finished."""
        return self._reads.add(layer, self._io.submit(self.read_into, layer, slots,
                                                      token_starts, out, rows))

    # --- releases and generations -------------------------------------------------------------

    def forget(self, layer: int, slots) -> None:
        """The slots hold nothing (a failed store's): their pages are removed."""
        self._reads.settle(layer)
        cols = np.asarray(slots, dtype=np.int64)
        self._remove(self._keys.held(self.generation, layer, cols))
        self._index(self.generation).starts[layer, cols] = -1

    def release(self, layer, slots):
        self.forget(layer, slots)
        super().release(layer, slots)

    def discard(self, generation: int) -> None:
        """Remove a generation's pages (a load that failed part way)."""
        self._reads.settle()
        self._remove(self._keys.held(generation))
        self._keys.indices.pop(generation, None)

    def advance(self) -> None:
        """Make the next generation current and remove the old one's pages (a load landed)."""
        self.discard(self.generation)
        self.generation += 1
        self._index(self.generation)

    def close(self) -> None:
        """Remove every page this tier put and close its client (also when it is collected)."""
        self._closer()


def build_tier(spec: TierSpec, *, num_layers: int, capacity: int, page_shape: tuple[int, ...],
               dtype: torch.dtype, device: torch.device, fingerprint: str,
               grow: bool = False) -> Tier:
    """The tier ``spec`` describes (``hbm`` on ``device``; host tiers pinned when CUDA is used;
    ``grow``: a host tier that is not pinned commits memory as slots are first used)."""
    if spec.kind == "hbm":
        return MemoryTier("hbm", num_layers, capacity, page_shape, dtype, device)
    if spec.kind in ("ddr", "cxl"):
        return MemoryTier(spec.kind, num_layers, capacity, page_shape, dtype,
                          torch.device("cpu"), pinned=device.type == "cuda",
                          numa_node=spec.node(), grow=grow)
    if spec.kind == "disk":
        return DiskTier(num_layers, capacity, page_shape, dtype, spec.path, fingerprint)
    if spec.kind == "remote":
        return RemoteTier(num_layers, capacity, page_shape, dtype, spec.remote, fingerprint)
    raise TierConfigError(f"tiers: unknown kind {spec.kind!r}")  # TierSpec already checks



def plan_memory(config: TierConfig, *, num_layers: int, batch_size: int,
                page_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                staging_pages: int | None, ring: int, holds_prompt: bool) -> tuple[list[int], int]:
    """Slots per layer of each tier and of a staging buffer for a cache of this geometry;
    refuses, with the numbers, a configuration that does not fit, before anything is allocated.

    Args:
        staging_pages: slots per staging buffer (None: every cold page of the batch for
            ``attend="all"``, twice the recall budget for ``"topk"`` and ``"auto"``, one page
            for ``"split"``, which stages nothing).
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
               "disk": b * mp, "remote": b * mp}
    itemsize = torch.empty((), dtype=dtype).element_size()
    page_bytes = math.prod(page_shape) * itemsize
    capacities = [spec.capacity(page_bytes, num_layers) for spec in cfg.tiers]
    capacities = [default[spec.kind] if cap is None else cap
                  for spec, cap in zip(cfg.tiers, capacities)]
    if cfg.attend == "split":  # cold pages are attended on the host: nothing is staged
        staging_pages = max(1, min(staging_pages or 1, b * mp))
    elif cfg.attend == "all":  # by default a row per sequence (demotions append in place)
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
        if spec.kind in ("hbm", "ddr", "cxl"):
            where = dev if spec.kind == "hbm" else "cpu"
            need.setdefault(where, []).append((f"{spec.kind} pool", num_layers * cap * page_bytes))
    need.setdefault(dev, []).extend([
        ("staging ring", ring * staging_pages * page_bytes),
        ("key range and sketch", num_layers * rows * (
            (2 * page_shape[2] * page_shape[3] * itemsize if cfg.key_range else 0)
            + (sketch_bytes(page_shape[1], page_shape[2], cfg.key_channels(page_shape[3]),
                            cfg.key_bits)
               if cfg.key_sketch else 0)))])
    need.setdefault("cpu", []).append(("page tables", num_layers * rows * 10))
    if any(spec.kind in ("disk", "remote") for spec in cfg.tiers):  # they land in host staging
        need["cpu"].append(("disk staging", ring * staging_pages * page_bytes))
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
