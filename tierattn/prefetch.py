"""Prefetcher: the staging ring on the device and the layer-ahead prefetch of cold pages.

Cold pages take part in attention through a staging buffer on the device: :meth:`Prefetcher.fetch`
yields batches of them resident there (one page-copy launch per source tier, usually already in
flight: while layer ``l`` computes, :meth:`Prefetcher.start` fetches what layer ``l+1`` will
attend). ``RING`` buffers rotate so that layer ``l+1``'s prefetch lands while layer ``l`` reads its
own; a buffer is refilled only after the kernel that read it (the compute fence).

:meth:`Prefetcher.attend_cold` is the seam of the "where does cold attention run" strategy: it
turns the cold pages a query needs into partial attention states ``(out, lse)`` that the cache
merges by LSE with the hot set's. This class fetches the pages and runs a kernel on the device;
a strategy that attends on the host (CPU attention over the DDR pool, only ``q`` and the small
partial state crossing the bus) would implement the same method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tierattn.kernels import PageTable
from tierattn.mover import Mover
from tierattn.pagemap import PageMap, Staged
from tierattn.telemetry import Telemetry
from tierattn.tiers import MemoryTier
from tierattn.transfer import TransferEngine

__all__ = ["RING", "Prefetcher", "ring_slot"]

#: staging buffers in the ring: layer l+1's prefetch lands while layer l reads its own.
RING = 2


def ring_slot(step: int, layer: int, num_layers: int, ring: int = RING) -> int:
    """Staging buffer of ``layer`` at decode ``step``: consecutive layers, wrapping into the next
    step, never share a buffer while ``ring >= lookahead + 1``."""
    return (step * num_layers + layer) % ring


@dataclass
class _InFlight:
    tickets: list  # one per source tier
    buffer: int
    pages: list[list[int]]  # per sequence, logical pages in flight
    slots: list[list[int]]  # their staging slots


class Prefetcher:
    """Staging ring of ``RING x staging_pages`` page slots on ``device`` and the copies in
    flight into it, per layer.

    Args:
        num_layers: layers of the cache (the ring wraps from the last to layer 0).
        staging_pages: page slots per buffer.
        page_shape, dtype, device: of a page.
        pages, mover, engine, telemetry: the cache's page map, mover, engine and counters.
    """

    def __init__(self, *, num_layers: int, staging_pages: int, page_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, pages: PageMap, mover: Mover,
                 engine: TransferEngine, telemetry: Telemetry) -> None:
        self.num_layers, self.staging_pages = num_layers, staging_pages
        self.pages, self.mover, self.engine, self.telemetry = pages, mover, engine, telemetry
        tier = MemoryTier("staging", 1, RING * staging_pages, page_shape, dtype, device)
        self.buffers = tier.pools[0].view(RING, staging_pages, *page_shape)
        self.calls = [0] * num_layers  # attend calls per layer: the step index of the ring
        self.in_flight: list[_InFlight | None] = [None] * num_layers
        self.fence = None  # compute work a copy into a reused staging buffer must wait for

    def next_buffer(self, layer: int) -> int:
        """The buffer ``layer``'s attend call reads (advances the layer's ring position)."""
        buffer = ring_slot(self.calls[layer], layer, self.num_layers)
        self.calls[layer] += 1
        return buffer

    def mark_read(self) -> None:
        """A kernel was just launched on a staging buffer: later copies into it wait for it."""
        self.fence = self.engine.fence()

    # --- fetching ------------------------------------------------------------------------------

    def attend_cold(self, layer: int, need: list[list[int]], buffer: int,
                    kernel: Callable[[torch.Tensor, PageTable, Staged], object]
                    ) -> Iterator[tuple[object, PageTable, Staged]]:
        """Partial attention states over the cold pages ``need`` (per sequence): for each batch
        staged on the device, ``kernel(pool, table, batch)`` (a decode or prefill launch) and the
        batch's table. A buffer is reused only after the kernel that read it."""
        for run in self.fetch(layer, need, buffer):
            table = self.pages.staged_table(run)
            part = kernel(self.buffers[run.buffer], table, run)
            self.mark_read()
            yield part, table, run

    def fetch(self, layer: int, need: list[list[int]], buffer: int) -> Iterator[Staged]:
        """Yield :class:`Staged` batches holding every page in ``need`` (per sequence), each
        ready to read. Pages already prefetched for this layer are used in place (hits)."""
        tel = self.telemetry.layers[layer]
        pre, self.in_flight[layer] = self.in_flight[layer], None
        buffer = pre.buffer if pre else buffer
        for other, fl in enumerate(self.in_flight):
            if fl is not None and fl.buffer == buffer:
                # layers attended out of order: another layer's prefetch targets this buffer;
                # let it land and drop it rather than overwrite a copy in flight
                self.cancel(other)
        if not any(need):
            if pre is not None:
                tel.wasted_prefetches += sum(len(x) for x in pre.pages)
                self._wait_all(pre.tickets)
            return
        if pre is not None and pre.pages == need:  # the prefetch brought exactly what is needed
            self._wait_all(pre.tickets)
            tel.prefetch_hits += sum(len(x) for x in need)
            yield Staged(buffer, pre.pages, pre.slots)
            return
        first = Staged(buffer)
        used = set()
        if pre is not None:
            self._wait_all(pre.tickets)
            for bi, (pages, slots) in enumerate(zip(pre.pages, pre.slots)):
                want = set(need[bi])
                keep = [(pg, sl) for pg, sl in zip(pages, slots) if pg in want]
                first.pages.append([pg for pg, _ in keep])
                first.slots.append([sl for _, sl in keep])
                used.update(sl for _, sl in keep)
                tel.prefetch_hits += len(keep)
                tel.wasted_prefetches += len(pages) - len(keep)
        else:
            first.pages = [[] for _ in need]
            first.slots = [[] for _ in need]
        staged = [set(x) for x in first.pages]  # one set per sequence, not one per page
        missing = [[pg for pg in need[bi] if pg not in staged[bi]] for bi in range(len(need))]
        n_missing = sum(len(x) for x in missing)
        if pre is not None:
            tel.late_misses += n_missing
        run = first
        todo = [(bi, pg) for bi in range(len(missing)) for pg in missing[bi]]
        # the staging slots the prefetch left free (only listed when something is missing)
        free = ([s for s in range(self.staging_pages) if s not in used] if used else
                list(range(self.staging_pages))) if todo else []
        while todo:
            if not free:  # buffer full: attend what is staged, then reuse the buffer
                yield run
                run = Staged(run.buffer, [[] for _ in need], [[] for _ in need])
                free = list(range(self.staging_pages))
            batch, todo = todo[:len(free)], todo[len(free):]
            slots, free = free[:len(batch)], free[len(batch):]
            # after the fence of the kernel that read this buffer's previous batch
            pairs = torch.tensor(batch, dtype=torch.long).view(-1, 2)
            self.mover.fetch(layer, pairs[:, 0], pairs[:, 1], self.buffers[run.buffer],
                             torch.tensor(slots, dtype=torch.long), after=self.fence)
            for (bi, pg), sl in zip(batch, slots):
                run.pages[bi].append(pg)
                run.slots[bi].append(sl)
        yield run

    def start(self, layer: int, pages: list[list[int]]) -> None:
        """Start copying ``pages`` (per sequence) of ``layer`` into the buffer its next attend
        call reads; a set larger than a buffer is left to that call (it streams in batches)."""
        total = sum(len(x) for x in pages)
        if total == 0 or total > self.staging_pages:
            return
        buffer = ring_slot(self.calls[layer], layer, self.num_layers)
        slots, pos = [], 0
        for row in pages:
            slots.append(list(range(pos, pos + len(row))))
            pos += len(row)
        entries = Staged(buffer, pages).entries
        tickets = self.mover.fetch(layer, entries.rows, entries.cols, self.buffers[buffer],
                                   torch.arange(total), after=self.engine.fence(), wait=False)
        self.in_flight[layer] = _InFlight(tickets, buffer, pages, slots)

    def cancel(self, layer: int) -> None:
        """Let ``layer``'s copies in flight land, then forget them (their buffer is free)."""
        fl = self.in_flight[layer]
        if fl is not None:
            self._wait_all(fl.tickets)
            self.telemetry.layers[layer].wasted_prefetches += sum(len(x) for x in fl.pages)
            self.in_flight[layer] = None

    def cancel_all(self) -> None:
        for layer in range(self.num_layers):
            self.cancel(layer)

    def _wait_all(self, tickets: list) -> None:
        for ticket in tickets:
            self.engine.wait(ticket)
