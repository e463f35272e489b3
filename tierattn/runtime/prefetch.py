"""Prefetcher: the staging ring on the device, the layer-ahead prefetch, and recall.

Cold pages take part in attention through a staging buffer on the device. For exact attention
(``attend="all"``) a layer's cold pages and the copies that stage them are fixed between
structural edits, so they are part of the layer's device tables (:class:`~tierattn.storage.pagemap.
ColdBatch`): while layer ``l`` computes, :meth:`Prefetcher.start` launches layer ``l+1``'s copies,
and layer ``l+1`` attends the staged pages after waiting on their event. For recall
(``attend="topk"``) the pages are chosen per step on the device (:meth:`Prefetcher.recall`): the
top ``k`` candidates by a policy's scores, copied by slot lists built on the device; with the
layer-ahead prefetch, the previous step's selection of the layer is staged ahead and only the
pages it missed are copied when the layer runs. Hits and recalled pages are counted on the
device; nothing is read back during a step.

``RING`` buffers rotate so that layer ``l+1``'s prefetch lands while layer ``l`` reads its own; a
buffer is refilled only after the kernel that read it (the compute fence).

:meth:`Prefetcher.attend_cold` is the seam of the "where does cold attention run" strategy: it
turns the cold pages a query needs into partial attention states that the cache merges by LSE
with the hot set's. This class stages pages on the device and runs the caller's kernel there; a
strategy that attends on the host (CPU attention over the DDR pool, only ``q`` and the small
partial state crossing the bus) would implement the same method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tierattn.kernels import PageTable
from tierattn.storage.mover import Mover
from tierattn.storage.pagemap import ColdBatch, DeviceTable, LayerTables, PageMap
from tierattn.storage.staging import DiskStage
from tierattn.telemetry import Telemetry
from tierattn.storage.tiers import MemoryTier
from tierattn.storage.transfer import TransferEngine

__all__ = ["RING", "Prefetcher", "ring_slot"]

#: staging buffers in the ring: layer l+1's prefetch lands while layer l reads its own.
RING = 2


def ring_slot(step: int, layer: int, num_layers: int, ring: int = RING) -> int:
    """Staging buffer of ``layer`` at decode ``step``: consecutive layers, wrapping into the next
    step, never share a buffer while ``ring >= lookahead + 1``."""
    return (step * num_layers + layer) % ring


@dataclass
class _Selection:
    """A recall selection of one layer, on the device (padding entries -1)."""

    cols: torch.Tensor  # long [B, k]: logical pages
    src: torch.Tensor  # int32 [tiers - 1, B, k]: slot in each lower tier, else -1
    k: int
    version: int  # cold_version of the layer's tables it was chosen from
    pages: int  # real entries (host)


@dataclass
class _RecallLayout:
    """A selection of ``k`` pages per sequence staged in a buffer."""

    table: DeviceTable
    first: torch.Tensor  # int32 [B * k]: slot b * k + j (the prefetched half; the misses of
    # a prefetched selection go to the second half, B * k + b * k + j)
    #: [B, k] views of the table's arrays the selection kernel writes (lse, first lanes, rows)
    outs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]


@dataclass
class _InFlight:
    """Copies started for a layer before it runs."""

    tickets: list
    buffer: int
    version: int  # cold_version of the layer's tables the copies were built from
    pages: int
    selection: _Selection | None = None  # recall: the selection staged (first half of buffer)
    batch: ColdBatch | None = None  # exact: the batch staged


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
                 engine: TransferEngine, telemetry: Telemetry,
                 disk_misses: str = "read") -> None:
        self.num_layers, self.staging_pages = num_layers, staging_pages
        self.disk_misses = disk_misses  # recall's disk pages not staged: "read" or "defer"
        self.pages, self.mover, self.engine, self.telemetry = pages, mover, engine, telemetry
        self.device = device
        tier = MemoryTier("staging", 1, RING * staging_pages, page_shape, dtype, device)
        self.buffers = tier.pools[0].view(RING, staging_pages, *page_shape)
        self.calls = [0] * num_layers  # attend calls per layer: the step index of the ring
        self.in_flight: list[_InFlight | None] = [None] * num_layers
        self.selection: list[_Selection | None] = [None] * num_layers
        self.fence = None  # compute work a copy into a reused staging buffer must wait for
        self._recall_layouts: dict[tuple, _RecallLayout] = {}
        #: disk pages staged in host memory ahead of their layer (None: no disk tier)
        self.disk = DiskStage(tiers=mover.tiers, num_layers=num_layers, rows=staging_pages,
                              page_shape=page_shape, dtype=dtype, device=device, engine=engine,
                              telemetry=telemetry, ring=RING) \
            if any(not t.is_memory for t in mover.tiers) else None

    def next_buffer(self, layer: int) -> int:
        """The buffer ``layer``'s attend call reads (advances the layer's ring position)."""
        buffer = ring_slot(self.calls[layer], layer, self.num_layers)
        self.calls[layer] += 1
        return buffer

    def mark_read(self) -> None:
        """A kernel was just launched on a staging buffer: later copies into it wait for it
        (copies on the compute stream itself, in a captured step, need no fence)."""
        if not self.mover.direct:
            self.fence = self.engine.fence()

    # --- exact attention: the layer's static cold batches ---------------------------------------

    def _copy(self, layer: int, batch: ColdBatch, buffer: int, *, after: object,
              wait: bool) -> list:
        """Launch ``batch``'s copies into staging ``buffer``: one per source memory tier. Its
        disk pages are read into host staging on the disk tiers' I/O pools and copied in now
        (``wait``: a synchronous read, counted) or by :meth:`stage` (a read ahead)."""
        pool = self.buffers[buffer]
        tickets = [self.mover.copy_slots(layer, t, src, pool, dst, pages=batch.pages_by_tier[t],
                                         after=after, wait=wait)
                   for t, src, dst in batch.copies if batch.pages_by_tier[t]]
        if batch.reads:
            job = self.disk.read(layer, buffer, batch.reads)
            if wait:
                self.disk.land(layer, pool, after=after, job=job)
        return tickets

    def stage(self, layer: int, tabs: LayerTables, buffer: int
              ) -> Iterator[tuple[DeviceTable, torch.Tensor]]:
        """Yield ``layer``'s cold batches staged on the device: the prefetched one in place
        (hits), the others copied now into ``buffer``, each after the previous was read."""
        tel = self.telemetry.layers[layer]
        pre = self._take(layer, buffer)
        if pre is not None:
            self._wait_all(pre.tickets)
            if pre.version == tabs.cold_version and pre.selection is None:
                if self.disk is not None:
                    self.disk.land(layer, self.buffers[pre.buffer])
                tel.prefetch_hits += pre.pages  # every cold page arrived ahead of the layer
                yield pre.batch.table, self.buffers[pre.buffer]
                return
            tel.wasted_prefetches += pre.pages
            if self.disk is not None:
                self.disk.cancel(layer)
        for batch in self.pages.cold_batches(layer, self.mover.tiers):
            if not batch.table.total:
                continue
            # a reused buffer is refilled after the kernel that read its previous batch
            self._copy(layer, batch, buffer, after=self.fence, wait=True)
            if pre is not None:
                tel.late_misses += batch.table.total
            yield batch.table, self.buffers[buffer]

    # --- recall: pages chosen per step on the device -------------------------------------------

    def recall(self, layer: int, tabs: LayerTables, scores: torch.Tensor, k: int,
               buffer: int, reduce: str = "max") -> Iterator[tuple[DeviceTable, torch.Tensor]]:
        """Stage the ``k`` candidates of each sequence that rank highest by their per-KV-head
        ``scores [B, max_pages, H_kv]`` (aligned with ``tabs``' candidates; padding -inf), ranked
        by ``reduce``, and yield their table: one launch selects them and writes the table
        (:func:`~tierattn.kernels.select_pages`). Pages the layer-ahead prefetch staged are used
        in place (hits); only the others are copied."""
        pre = self._take(layer, buffer)
        if pre is not None:
            self._wait_all(pre.tickets)
        tel = self.telemetry.layers[layer]
        rc = self.recall_layout(tabs, k)
        if not rc.table.total:
            if pre is not None:
                tel.wasted_prefetches += pre.pages
            return
        sel = pre.selection if pre is not None and pre.selection is not None and \
            pre.selection.version == tabs.cold_version and pre.selection.k == k else None
        on_disk = self.disk is not None and self.mover.on_disk(layer)
        held = self.mover.memory_tiers_held(layer)
        # the host counts the copied pages when it knows them: nothing was prefetched, one tier
        # holds them all, no disk, and not a captured step (its host totals would be baked in)
        host_count = sel is None and not self.mover.direct and not on_disk and len(held) == 1
        table = rc.table
        out_lse, out_first, out_dst = rc.outs
        hits, recalled = self.telemetry.device_counters[layer]
        picked = self.engine.kernels.select_pages(
            scores, k, reduce=reduce, cand_cols=tabs.cand_cols, cand_lse=tabs.cand_lse,
            cand_slots=tabs.cand_slots, cand_first=tabs.cand_first,
            prev_cols=sel.cols if sel is not None else None, out_lse=out_lse,
            out_first=out_first if tabs.cand_first is not None else None, out_dst=out_dst,
            hits=hits if sel is not None else None,
            recalled=None if host_count or on_disk else recalled,
            validate=False, backend=self.engine.backend)
        tel.kernel_launches += 1
        if sel is None:  # everything is fetched now, into the first half
            pool = self.buffers[buffer]
            if pre is not None:
                tel.wasted_prefetches += pre.pages
                tel.late_misses += table.total
        else:  # the prefetched pages are used in place; the misses go to the second half
            pool = self.buffers[pre.buffer]
            # counted as if nothing hit; stats() moves the hits the device counted across
            tel.late_misses += table.total
            tel.wasted_prefetches += sel.pages
        if table.first_lane is not None and tabs.cand_first is None:
            table.first_lane.zero_()  # (disk staging's mask below needs the array)
        src, full, cols = picked.src, picked.slots, picked.cols
        if on_disk:
            src = self._recall_disk(layer, src, rc, pool, buffer)
            if self.disk_misses == "defer":  # the next step stages its disk pages
                self.disk.selection_to_host(layer, full, wait=False)
        self.mover.copy_recalled(layer, src, cols, pool, rc.table.table.indices,
                                 after=self.fence, pages=table.total if host_count else None,
                                 counted=not on_disk and not host_count, held=held)
        self.selection[layer] = _Selection(cols, full, k, tabs.cold_version, rc.table.total)
        yield rc.table, pool

    def _recall_disk(self, layer: int, src: torch.Tensor, rc: _RecallLayout,
                     pool: torch.Tensor, buffer: int) -> torch.Tensor:
        """Copy the selected disk pages the disk stage holds into their staging rows (one
        launch per disk tier, by slot lists built on the device); the others are read now
        (``disk_misses="read"``: the selection comes to the host first) or masked out of this
        step (``"defer"``: a miss, counted on the device). Returns ``src`` without the disk
        tiers."""
        disk = self.disk
        need = None
        if self.disk_misses == "read":  # the selection's disk slots, on the host now (and
            # noted: the next step stages them)
            host = disk.selection_to_host(layer, src, wait=True)
            self.telemetry.layers[layer].disk_selection_reads += 1
            need = [h.view(-1).numpy() for h in host]
        elif disk.jobs[layer] is None:  # nothing read ahead (prefetch off): read it now
            job = disk.stage_selection(layer, buffer)
            if job is not None:
                self.telemetry.layers[layer].disk_sync_pages += len(job.rows)
        staged = disk.staged(layer, buffer, need)
        dst = rc.table.table.indices
        missed = torch.zeros_like(src[0], dtype=torch.bool)
        src = src.clone()
        for i, t in enumerate(disk.disk):
            mine = src[t - 1]
            row = disk.maps[layer, i].gather(0, mine.clamp_min(0).view(-1).long()).view_as(mine)
            ok = (mine >= 0) & (row >= 0)
            missed |= (mine >= 0) & (row < 0)
            if staged is not None:
                host, job = staged
                rows = torch.where(ok, row, -1).view(-1)
                ticket = self.engine.copy(host, rows, pool, dst, after=self.fence)
                self.engine.wait(ticket)
                disk.copied(job, ticket)
                self.telemetry.count_recalled(layer, t, torch.where(ok, mine, -1))
                self.telemetry.layers[layer].copy_launches += 1
            src[t - 1] = -1
        self.telemetry.count_disk_missed(layer, missed)
        rc.table.first_lane.view_as(missed).masked_fill_(missed, self.pages.page_size)
        return src

    def recall_layout(self, tabs: LayerTables, k: int) -> _RecallLayout:
        """The staged table of a ``k``-page selection (row ``b`` at ``b * k`` with
        ``min(k, count_b)`` entries; its page rows are written per step) and the staging slots
        of the two halves: the prefetched selection, then what it missed. Allocated once per
        ``k``; the row counts are updated in place when the candidates change (so a captured
        step keeps reading the same buffers; call it before a replay)."""
        b = self.pages.batch_size
        counts = [min(k, c) for c in tabs.candidates.counts]
        # a disk tier's misses are masked through the first lanes: the array is always there
        key = (k, tabs.cand_first is not None or self.disk is not None)
        layout = self._recall_layouts.get(key)
        i32 = dict(dtype=torch.int32, device=self.device)
        if layout is None:
            first = torch.arange(b * k, **i32)
            table = DeviceTable(PageTable(indices=first.clone(),
                                          row_start=torch.arange(b, **i32) * k,
                                          row_count=torch.zeros(b, **i32),
                                          last_page_len=torch.zeros(b, **i32)),
                                torch.zeros(b * k, **i32),
                                torch.zeros(b * k, **i32) if key[1] else None, [0] * b)
            layout = _RecallLayout(table, first, (
                table.lse_index.view(b, k),
                table.first_lane.view(b, k) if key[1] else None,
                table.table.indices.view(b, k)))
            self._recall_layouts = {key: layout}  # one selection size at a time
        if layout.table.counts != counts:
            layout.table.table.row_count.copy_(torch.tensor(counts, **i32))
            layout.table.table.last_page_len.copy_(
                torch.tensor([self.pages.page_size if c else 0 for c in counts], **i32))
            layout.table.counts[:] = counts
        return layout

    # --- the seam ------------------------------------------------------------------------------

    def attend_cold(self, layer: int, tabs: LayerTables, buffer: int,
                    kernel: Callable[[torch.Tensor, DeviceTable], object], *,
                    recall: bool = False, scores: torch.Tensor | None = None,
                    k: int = 0, reduce: str = "max") -> Iterator[object]:
        """Partial attention states over ``layer``'s cold pages: all of them, or with
        ``recall`` the ``k`` best per sequence by ``scores [B, max_pages, H_kv]`` reduced over
        the heads by ``reduce``; ``kernel(pool, table)`` runs on each staged batch (a decode or
        prefill launch)."""
        staged = self.recall(layer, tabs, scores, k, buffer, reduce) if recall else \
            self.stage(layer, tabs, buffer)
        for table, pool in staged:
            part = kernel(pool, table)
            self.mark_read()
            yield part

    # --- layer-ahead prefetch ------------------------------------------------------------------

    def start(self, layer: int, tabs: LayerTables, *, recall: bool) -> None:
        """Start copying what ``layer`` will attend into the buffer its next attend call reads:
        its cold pages (exact), or its previous selection (recall), if one batch holds them and
        no disk read is needed."""
        buffer = ring_slot(self.calls[layer], layer, self.num_layers)
        if not recall:
            cold = self.pages.cold_batches(layer, self.mover.tiers)
            if len(cold) != 1 or not cold[0].table.total:
                return  # several batches: the layer streams them itself
            batch = cold[0]
            tickets = self._copy(layer, batch, buffer, after=self.engine.fence(), wait=False)
            self.in_flight[layer] = _InFlight(tickets, buffer, tabs.cold_version,
                                              batch.table.total, batch=batch)
            return
        if self.disk is not None and self.mover.on_disk(layer):
            # the disk pages of the previous selection, read into host staging now; the
            # layer copies what it selects again (recall on the device, no prefetch there)
            self.disk.stage_selection(layer, buffer)
            return
        sel = self.selection[layer]
        b = self.pages.batch_size
        if sel is None or sel.version != tabs.cold_version or not sel.pages or \
                2 * b * sel.k > self.staging_pages:
            return
        rc = self.recall_layout(tabs, sel.k)
        tickets = self.mover.copy_recalled(layer, sel.src, sel.cols, self.buffers[buffer],
                                           rc.first, after=self.engine.fence(), wait=False,
                                           pages=sel.pages)
        self.in_flight[layer] = _InFlight(tickets, buffer, tabs.cold_version, sel.pages, sel)

    def cancel(self, layer: int) -> None:
        """Let ``layer``'s copies in flight land, then forget them (their buffer is free)."""
        if self.disk is not None:
            self.disk.cancel(layer)
        fl = self.in_flight[layer]
        if fl is not None:
            self._wait_all(fl.tickets)
            self.telemetry.layers[layer].wasted_prefetches += fl.pages
            self.in_flight[layer] = None

    def cancel_all(self) -> None:
        for layer in range(self.num_layers):
            self.cancel(layer)

    def reset(self) -> None:
        """Forget every prefetch, selection and ring position (after a load or reorder)."""
        self.cancel_all()
        if self.disk is not None:
            self.disk.cancel_all()
        self.selection = [None] * self.num_layers
        self.calls = [0] * self.num_layers

    def _take(self, layer: int, buffer: int) -> _InFlight | None:
        """``layer``'s prefetch (now its own to use). Another layer's prefetch into the buffer
        this call may write (layers attended out of order) is let land and dropped."""
        pre, self.in_flight[layer] = self.in_flight[layer], None
        targets = {buffer, pre.buffer} if pre is not None else {buffer}
        for other, fl in enumerate(self.in_flight):
            if fl is not None and fl.buffer in targets:
                self.cancel(other)
        return pre

    def _wait_all(self, tickets: list) -> None:
        for ticket in tickets:
            self.engine.wait(ticket)
