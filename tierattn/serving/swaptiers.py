"""The storage half of the swap core: an engine's KV pool with swap tiers below it.

Both serving adapters -- transformers' continuous batching
(:class:`tierattn.serving.swapcore.SwapStore`) and vLLM's offloading connector
(``tierattn.models.vllm``) -- see the engine's KV cache as slots ``[N, 2, T, H_kv, D]`` per layer
(an engine block, or an equal share of one) and keep
copies of slots in DDR, CXL (pinned on CUDA) and disk tiers, and for transformers' engine in
the Mooncake Store of ``SwapConfig.remote`` below them. This module is what they share:

* :func:`swap_capacities`, the one default capacity rule. A DDR or CXL tier may hold up to
  :data:`HOST_SHARE` of the host's physical memory (over all workers of the engine), and grows
  into it as slots are first used (:meth:`~tierattn.storage.tiers.MemoryTier.grow`): nothing is
  reserved up front, and a tier that cannot grow because the host has no memory left refuses
  the store, which the engine turns into a recompute. Tiers that must be reserved when they
  are built -- pinned memory on CUDA -- and disk tiers default to :data:`RESERVED_POOLS` times
  the engine's KV pool (a disk tier at most 90% of its folder's free space), and so does the
  remote store's tier (its pool's memory is the store's to refuse).
* :class:`SwapTiers`: the tiers, the :class:`~tierattn.storage.mover.Mover` over them, one timed
  batched copy of slots across every layer (:meth:`SwapTiers.copy`), and calibration probes that
  feed the :class:`~tierattn.serving.costmodel.CostModel`.
* :class:`SwapCounters`: what moved, per tier kind -- the one schema both engines report.

The capacity rule uses the host's physical memory, not what is free at the moment, so that an
engine's scheduler and its workers -- separate processes, started at different times -- count
the same slots.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from tierattn.config import SwapConfig, TierSpec
from tierattn.serving.costmodel import Stopwatch
from tierattn.errors import TierConfigError
from tierattn.storage.mover import Mover
from tierattn.storage.pagemap import HOT
from tierattn.telemetry import Telemetry
from tierattn.storage.tiers import MemoryTier, Tier, build_tier
from tierattn.storage.transfer import TransferEngine, default_engine

__all__ = ["HOST_SHARE", "RESERVED_POOLS", "SwapCounters", "SwapTiers", "swap_capacities"]

#: a DDR/CXL swap tier holds at most this share of the host's physical memory by default
HOST_SHARE = 0.5
#: default capacity, in engine KV pools, of a tier reserved when built (pinned, disk)
RESERVED_POOLS = 4
#: ``done(kind, direction, bytes, seconds)``: a timed copy of a swap tier
Timing = Callable[[str, str, int, float], None]


def host_memory() -> int:
    """The host's physical memory, bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def swap_capacities(tiers: Sequence[TierSpec], slot_bytes: int, pool_slots: int, *,
                    workers: int = 1, pinned: bool = False) -> list[int]:
    """Slots each swap tier holds: its ``capacity_gib``/``capacity_pages``, or the default rule
    (module docstring). ``slot_bytes``: one worker's bytes per slot, all layers;
    ``pool_slots``: slots of the engine's KV pool; ``pinned``: host tiers are pinned (CUDA).

    Raises:
        TierConfigError: a tier that would hold no slot.
    """
    out = []
    per_slot = max(1, slot_bytes * workers)
    for spec in tiers:
        cap = spec.capacity(slot_bytes)
        if cap is None and spec.kind == "remote":  # the pool's memory is the store's to refuse
            cap = RESERVED_POOLS * pool_slots
        elif cap is None and spec.kind == "disk":
            Path(spec.path).mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(spec.path).free
            cap = min(RESERVED_POOLS * pool_slots, int(0.9 * free) // per_slot)
        elif cap is None:
            cap = int(HOST_SHARE * host_memory()) // per_slot
            if pinned:
                cap = min(cap, RESERVED_POOLS * pool_slots)
        if cap < 1:
            raise TierConfigError(
                f"SwapConfig.tiers: the {spec.kind} tier would hold no slot of {slot_bytes} B "
                f"(capacity {spec.capacity_gib or spec.capacity_pages}); raise its "
                "capacity_gib, or free space in its folder.")
        out.append(int(cap))
    return out


@dataclass
class SwapCounters:
    """What moved through the swap tiers (slots and bytes per tier kind; bytes per worker)."""

    stored_slots: dict[str, int] = field(default_factory=dict)
    loaded_slots: dict[str, int] = field(default_factory=dict)
    stored_bytes: dict[str, int] = field(default_factory=dict)
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    evicted_slots: int = 0   # stored copies dropped to make room for newer ones
    declined_slots: int = 0  # hits prefilled: recomputing them was predicted faster
    store_faults: int = 0    # stores that failed (nothing kept)
    load_faults: int = 0     # loads that failed (recomputed)
    no_room: int = 0         # stores refused: every tier full (or busy)

    PER_KIND: ClassVar[tuple[str, ...]] = ("stored_slots", "loaded_slots", "stored_bytes",
                                           "loaded_bytes")

    def count(self, direction: str, kind: str, slots: int, nbytes: int) -> None:
        """``slots`` slots (``nbytes`` bytes) stored into (``"store"``) or loaded from
        (``"load"``) the ``kind`` tier."""
        done = "stored" if direction == "store" else "loaded"
        for name, n in ((f"{done}_slots", slots), (f"{done}_bytes", nbytes)):
            d = getattr(self, name)
            d[kind] = d.get(kind, 0) + n

    def copy(self) -> SwapCounters:
        return dataclasses.replace(self, **{n: dict(getattr(self, n)) for n in self.PER_KIND})

    def since(self, before: SwapCounters) -> SwapCounters:
        """The counts added since the snapshot ``before`` (a :meth:`copy`)."""
        out = SwapCounters()
        for f in dataclasses.fields(self):
            now, was = getattr(self, f.name), getattr(before, f.name)
            setattr(out, f.name, {k: v - was.get(k, 0) for k, v in now.items()}
                    if isinstance(now, dict) else now - was)
        return out

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class SwapTiers:
    """An engine's KV pool and the swap tiers below it, with the mover, timing and probes.

    Args:
        config: the tiers (capacities and copy backend).
        pools: per layer, the engine's KV viewed as slots ``[N, 2, T, H_kv, D]`` (views: stores
            read them, loads write them); one geometry across layers.
        capacities: slots per swap tier (None: :func:`swap_capacities`).
        workers: the engine's workers (they share the host's memory).
        fingerprint: names this engine's disk files (unique to the engine and worker).
        engine: the transfer engine (default: a copy stream on CUDA, synchronous on CPU).
        remote_tier: ``config.remote`` becomes the last tier (a
            :class:`~tierattn.storage.tiers.RemoteTier`; an engine without a lookup across
            instances); False leaves the store to the caller (vLLM's connector).
    """

    def __init__(self, config: SwapConfig, pools: Sequence[torch.Tensor], *,
                 capacities: Sequence[int] | None = None, workers: int = 1,
                 fingerprint: str, engine: TransferEngine | None = None,
                 remote_tier: bool = False) -> None:
        hot = MemoryTier.over("hbm", list(pools))
        self.device = hot.device
        self.num_layers = len(pools)
        #: bytes of one slot over all layers (this worker's share)
        self.slot_bytes = hot.page_bytes * self.num_layers
        specs = tuple(config.tiers)
        if remote_tier and config.remote is not None:
            specs += (TierSpec("remote", remote=config.remote),)
        if capacities is None:
            capacities = swap_capacities(specs, self.slot_bytes, hot.capacity,
                                         workers=workers, pinned=self.device.type == "cuda")
        tiers: list[Tier] = [hot]
        for spec, cap in zip(specs, capacities):
            tiers.append(build_tier(spec, num_layers=self.num_layers, capacity=int(cap),
                                    page_shape=hot.page_shape, dtype=hot.dtype,
                                    device=self.device, fingerprint=fingerprint, grow=True))
        self.tiers = tiers
        self.telemetry = Telemetry(self.num_layers, tier_kinds=tuple(t.kind for t in tiers),
                                   page_bytes=hot.page_bytes)
        backend = None if config.backend == "auto" else config.backend
        if backend is None and self.device.type == "cpu":
            # an engine on the CPU runs no compiled Triton; under TRITON_INTERPRET (a test
            # harness) "auto" would pick the interpreted kernel, 20-55x slower than torch's copy
            backend = "torch"
        self.engine = engine or default_engine(self.device, backend)
        self.mover = Mover(tiers, None, self.engine, self.telemetry, self.device)
        self.watch = Stopwatch(self.device)
        self.host_watch = Stopwatch(torch.device("cpu"))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The swap tiers' kinds, fastest first."""
        return tuple(t.kind for t in self.tiers[1:])

    def held_bytes(self) -> dict[str, int]:
        """Bytes each swap tier holds now (memory tiers: what they have grown to)."""
        return {t.kind: t.held_bytes() if isinstance(t, MemoryTier)
                else t.num_used(0) * t.page_bytes * self.num_layers for t in self.tiers[1:]}

    def copy(self, src: int, src_slots: torch.Tensor, starts: torch.Tensor,
             dst: int | torch.Tensor, dst_slots: torch.Tensor, done: Timing) -> list:
        """Copy slots ``src_slots`` of tier ``src`` into ``dst_slots`` of tier ``dst`` (or of
        a scratch buffer ``[n, 2, T, H_kv, D]``) in every layer: one batched copy per layer.
        ``starts [n]``: each slot's first token (a disk page records it). Timed on the copy
        stream for memory tiers, by the wall clock for disk: ``done(kind, direction, bytes,
        seconds)`` with the swap tier's kind and ``"store"`` (out of the pool) or ``"load"``.
        Returns the copies' tickets (CUDA; empty when synchronous)."""
        swap = dst if src == HOT else src
        tier = self.tiers[swap]
        if src == HOT and isinstance(tier, MemoryTier) and len(dst_slots):
            tier.grow(int(dst_slots.max()) + 1)  # a slot chosen by the caller (vLLM)
        kind, direction = tier.kind, "store" if src == HOT else "load"
        stream = getattr(self.engine, "stream", None) if tier.is_memory else None
        if stream is not None:  # time from when the copy stream caught up with the forward
            stream.wait_stream(torch.cuda.current_stream(self.device))
        watch = self.watch if stream is not None else self.host_watch
        start = watch.start(stream)
        target = self.tiers[dst] if isinstance(dst, int) else dst
        tickets = []
        for layer in range(self.num_layers):
            t = self.mover.copy(layer, src, src_slots, starts, target, dst_slots, wait=False)
            if t is not None:
                tickets.append(t)
        nbytes = len(src_slots) * self.slot_bytes
        watch.stop(start, lambda s: done(kind, direction, nbytes, s), stream)
        return tickets

    def forget(self, tier: int, slots: Sequence[int]) -> None:
        """A failed store's ``slots`` of ``tier``, in every layer: no disk page of them reads
        as valid, no remote page of them stays in the store."""
        t = self.tiers[tier]
        if not t.is_memory:
            for layer in range(self.num_layers):
                t.forget(layer, list(slots))

    def release(self, tier: int, slots: Sequence[int]) -> None:
        """Give ``slots`` of ``tier`` back (a swap counts its slots on layer 0 and copies every
        layer into them): the pages of every layer are forgotten first."""
        self.forget(tier, slots)
        self.tiers[tier].release(0, list(slots))

    def calibrate(self, observe: Timing, *, probe_slots: int, repeats: int = 3) -> None:
        """Time stores and loads of 1 and ``probe_slots`` slots into each tier (reading pool
        slots 0 onwards, loading into a scratch buffer: the engine's KV is untouched; tier
        slots are taken and given back) and report them through ``observe``."""
        hot = self.tiers[HOT]
        for t in range(1, len(self.tiers)):
            k = min(probe_slots, self.tiers[t].num_free(0), hot.capacity)
            if k < 1:
                continue
            scratch = torch.zeros((k, *hot.page_shape), dtype=hot.dtype, device=self.device)
            for n in sorted({1, k}):
                pos = torch.arange(n)
                for _ in range(repeats):
                    dst = torch.tensor(self.tiers[t].alloc(0, n))
                    try:
                        self.wait(self.copy(HOT, pos, pos, t, dst, observe))
                        self.wait(self.copy(t, dst, pos, scratch, pos, observe))
                    finally:
                        self.release(t, dst.tolist())
        self.watch.poll(wait=True)
        self.telemetry.reset()  # probes are not swaps

    def wait(self, tickets: Sequence) -> None:
        for t in tickets:
            self.engine.wait(t)

    def close(self) -> None:
        """Delete the disk tiers' files and the remote tier's pages."""
        for t in self.tiers:
            t.close()
