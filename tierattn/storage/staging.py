"""Disk staging: disk pages read into host memory ahead of the step that attends them.

A decode step never reads a file: the disk tiers' I/O pools read the pages a layer will need
into a host staging pool (DDR, pinned on CUDA) while earlier layers compute, and the step copies
them to the device staging buffer with the same page-copy launch as a DDR page.

* Exact attention (``attend="all"``): a layer's disk pages are fixed between structural edits
  and known on the host (:class:`~tierattn.storage.pagemap.ColdBatch` ``reads``), so
  :meth:`DiskStage.read` starts them a layer ahead (the prefetcher's
  :meth:`~tierattn.runtime.prefetch.Prefetcher.start`) and
  :meth:`DiskStage.land` waits for them when the layer runs. Without a prefetch in flight (the
  first step after an edit, ``prefetch="none"``) the same read runs when the layer does: a
  synchronous read, counted (``disk_sync_pages``).
* Recall (``attend="topk"``): the pages are chosen on the device, per step, and reach the host
  through the transfer engine's ``to_host`` (:meth:`selection_to_host`). The disk pages of the
  previous step's selection are staged a layer ahead (:meth:`stage_selection`), and a
  device-side map (disk slot -> staged row, :meth:`staged`) lets the step copy those it
  selects again; a staged row stays valid while its slot is not rewritten (the segment counts
  writes per slot), so an edit between steps costs only the pages it moved. A page selected
  now that was not staged is read at its layer (``disk_misses="read"``: the selection is
  copied back synchronously, one device read per layer with disk pages, and the missed pages
  counted as ``disk_sync_pages``) or left out of this step and staged for the next
  (``"defer"``: no device read; its table entry's first lane set past the page, counted on the
  device as ``disk_missed_pages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from tierattn.errors import KVIOError, TierAttnError
from tierattn.telemetry import Telemetry
from tierattn.storage.tiers import Tier
from tierattn.storage.transfer import TransferEngine

__all__ = ["DiskStage"]


@dataclass
class _Job:
    """Disk reads into one host staging buffer, and where their pages go on the device."""

    layer: int
    buffer: int
    futures: list[Future]
    tiers: list[tuple[int, int]]  # (tier, pages) read
    rows: list[int] = field(default_factory=list)  # host staging rows, in read order
    dst: list[int] = field(default_factory=list)  # device staging slots (exact attention)
    slot_rows: torch.Tensor | None = None  # recall: [disk tiers, capacity] int32 slot -> row
    writes: list[tuple[int, list[int], np.ndarray]] = field(default_factory=list)
    # recall: (disk tier index, slots, their write counts when read)


class DiskStage:
    """Host staging of disk pages: ``ring x rows`` page slots and the reads in flight into it
    (a tier's :meth:`~tierattn.storage.tiers.DiskTier.release` waits for its reads, so a slot is
    never rewritten under one).

    Args:
        tiers: the cache's tiers (those that are not memory are read here).
        num_layers, rows, page_shape, dtype: of the staging pool (``rows`` per buffer).
        device: the compute device (the recall maps live there).
        engine, telemetry: the cache's transfer engine and counters.
        ring: staging buffers (the prefetcher's ring).
    """

    def __init__(self, *, tiers: list[Tier], num_layers: int, rows: int,
                 page_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 engine: TransferEngine, telemetry: Telemetry, ring: int) -> None:
        self.tiers, self.engine, self.telemetry, self.device = tiers, engine, telemetry, device
        self.disk = [t for t in range(1, len(tiers)) if not tiers[t].is_memory]
        self.capacity = rows  # page rows per host buffer
        pinned = device.type == "cuda"
        self.pool = torch.zeros((ring, rows, *page_shape), dtype=dtype, pin_memory=pinned)
        self.jobs: list[_Job | None] = [None] * num_layers
        self._copies: list[object] = [None] * ring  # last copy out of each host buffer
        cap = max((tiers[t].capacity for t in self.disk), default=0)
        #: recall: per layer and disk tier, disk slot -> staged row of the layer's buffer
        self.maps = torch.full((num_layers, len(self.disk), cap), -1, dtype=torch.int32,
                               device=device)
        #: per layer: (ticket, host copy of the selection's disk slots) of the last step
        self._noted: list[tuple | None] = [None] * num_layers
        #: the disk tiers' rows in a selection's ``[tiers - 1, B, k]`` slot tensor
        self._rows = torch.tensor([t - 1 for t in self.disk], device=device)
        self._hosts: list[torch.Tensor | None] = [None] * num_layers  # per-layer selection copy

    # --- reads ---------------------------------------------------------------------------------

    def _reserve(self, buffer: int) -> torch.Tensor:
        """Host buffer ``buffer``, once the copy that last read it landed."""
        if self._copies[buffer] is not None:
            self.engine.wait_host(self._copies[buffer])
            self._copies[buffer] = None
        return self.pool[buffer]

    def read(self, layer: int, buffer: int,
             reads: Sequence[tuple[int, list[int], list[int], list[int]]]) -> _Job:
        """Start reading ``reads`` (``(tier, slots, first tokens, device staging slots)``)
        into host buffer ``buffer`` on the tiers' I/O pools."""
        for other, job in enumerate(self.jobs):  # the buffer's last reads are not needed
            if job is not None and (other == layer or job.buffer == buffer):
                self.cancel(other)
        self._reserve(buffer)
        job = _Job(layer, buffer, [], [])
        self._submit(job, reads)
        self.jobs[layer] = job
        return job

    def _submit(self, job: _Job, reads) -> list[Future]:
        """Add ``reads`` to ``job``, into the rows after those it holds; returns their futures."""
        host, at, futures = self.pool[job.buffer], len(job.rows), []
        for t, slots, starts, dst in reads:
            if not len(slots):
                continue
            rows = list(range(at, at + len(slots)))
            at += len(slots)
            futures.append(self.tiers[t].read_async(job.layer, slots, starts, host, rows))
            job.tiers.append((t, len(slots)))
            job.rows += rows
            job.dst += dst
        job.futures += futures
        return futures

    def _wait(self, job: _Job) -> None:
        """Block until ``job``'s reads landed; a failed one raises (a storage failure as
        :class:`KVIOError`) after every read of the job finished."""
        err = None
        for f in job.futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - the first failure is raised below
                err = err or e
        if err is None:
            return
        if isinstance(err, OSError) and not isinstance(err, TierAttnError):
            raise KVIOError(err.errno, f"layer {job.layer}: reading pages of the disk tier "
                            f"failed ({err}); nothing was moved. Check the disk tier's "
                            "storage.") from err
        raise err

    def cancel(self, layer: int) -> None:
        """Let ``layer``'s reads finish and forget them (a failure is not raised: nothing
        will use the pages)."""
        job, self.jobs[layer] = self.jobs[layer], None
        if job is not None:
            for f in job.futures:
                f.exception()

    def cancel_all(self) -> None:
        for layer in range(len(self.jobs)):
            self.cancel(layer)
        self._noted = [None] * len(self._noted)

    def land(self, layer: int, dst_pool: torch.Tensor, *, after: object = None,
             job: _Job | None = None) -> None:
        """Exact attention: wait for ``layer``'s reads, then copy them from host staging into
        ``dst_pool`` (the device staging buffer) with one page-copy launch. Counted as staged
        (read ahead: ``layer``'s own job) or synchronous (``job`` given: read at the layer)."""
        sync = job is not None
        job = job or self.jobs[layer]
        self.jobs[layer] = None
        if job is None:
            return
        self._wait(job)
        c = self.telemetry.layers[layer]
        if sync:
            c.disk_sync_pages += len(job.rows)
        else:
            c.disk_staged_pages += len(job.rows)
        if not job.rows:
            return
        i32 = dict(dtype=torch.int32)
        src = torch.tensor(job.rows, **i32).to(self.device, non_blocking=True)
        dst = torch.tensor(job.dst, **i32).to(self.device, non_blocking=True)
        ticket = self.engine.copy(self.pool[job.buffer], src, dst_pool, dst, after=after)
        self.engine.wait(ticket)
        self._copies[job.buffer] = ticket
        self._count(layer, job)

    def _count(self, layer: int, job: _Job) -> None:
        c = self.telemetry.layers[layer]
        for t, n in job.tiers:
            nbytes = n * self.tiers[0].page_bytes
            c.h2d_bytes[self.tiers[t].kind] += nbytes
            c.h2d_decode_bytes += nbytes if self.telemetry.decoding else 0
        c.copy_launches += 1
        c.copy_launches_decode += self.telemetry.decoding

    # --- recall --------------------------------------------------------------------------------

    def selection_to_host(self, layer: int, src: torch.Tensor, *, wait: bool) -> torch.Tensor:
        """Copy ``layer``'s selection's disk slots (``src [tiers - 1, B, k]``: its slots per
        lower tier, -1: not there) into the layer's host buffer and note them for the next
        step's staging: asynchronously, or (``wait``) landed when this returns (a device read).
        Returns the host copy ``[disk tiers, B, k]``."""
        want = src.index_select(0, self._rows)
        host = self._hosts[layer]
        if host is None or host.shape != want.shape:  # allocated once per layer and shape
            host = self._hosts[layer] = torch.empty(want.shape, dtype=want.dtype,
                                                    pin_memory=self.device.type == "cuda")
        ticket = self.engine.to_host(want, host)
        if wait:
            self.engine.wait_host(ticket)
            ticket = None
        self._noted[layer] = (ticket, host)
        return host

    def stage_selection(self, layer: int, buffer: int) -> _Job | None:
        """Start reading the disk pages of ``layer``'s noted selection into host buffer
        ``buffer`` (its copy to the host was started a step earlier, so waiting on it normally
        finds it landed); None when nothing was noted. A slot is read with the page it holds
        now (an edit since may have moved pages: :meth:`staged` keeps only slots not rewritten
        since the read)."""
        noted, self._noted[layer] = self._noted[layer], None
        if noted is None:
            return None
        ticket, host = noted
        if ticket is not None:
            self.engine.wait_host(ticket)
        reads, writes = [], []
        slot_rows = torch.full(self.maps.shape[1:], -1, dtype=torch.int32)
        at = 0
        for i, t in enumerate(self.disk):
            slots = np.unique(host[i].numpy())
            slots = slots[(slots >= 0) & (slots < self.tiers[t].capacity)]
            if not len(slots):
                continue
            starts, counts = self.tiers[t].held(layer, slots)
            keep = starts >= 0  # (a slot released since holds nothing to read)
            slots, starts, counts = slots[keep], starts[keep], counts[keep]
            slots = slots[:self.capacity - at]  # (the selection fits; a guard, not a policy)
            n = len(slots)
            if not n:
                continue
            slot_rows[i, torch.from_numpy(slots)] = torch.arange(at, at + n, dtype=torch.int32)
            at += n
            reads.append((t, slots.tolist(), starts[:n].tolist(), []))
            writes.append((i, slots, counts[:n]))
        job = self.read(layer, buffer, reads)
        job.slot_rows, job.writes = slot_rows, writes
        return job

    def staged(self, layer: int, buffer: int,
               need: list[np.ndarray] | None = None) -> tuple[torch.Tensor, _Job] | None:
        """Recall: wait for ``layer``'s staged reads, point ``maps[layer]`` (disk slot -> host
        staging row, -1: not staged) at them and return the host buffer and the job; None
        without a staged selection (every map entry -1). ``need``: the selection's slots per
        disk tier (host arrays, -1: none): those not staged are read now, into the same
        buffer (or, when they do not fit beside the staged rows, a fresh one in ``buffer``),
        and counted as ``disk_sync_pages``."""
        job, self.jobs[layer] = self.jobs[layer], None
        if job is not None and job.slot_rows is None:
            job = None
        if job is not None:
            try:
                self._wait(job)
            except (OSError, TierAttnError):
                self.maps[layer].fill_(-1)
                raise
            for i, slots, counts in job.writes:  # a slot rewritten since holds another page
                now = self.tiers[self.disk[i]].held(layer, slots)[1]
                stale = slots[now != counts]
                if len(stale):
                    job.slot_rows[i, torch.from_numpy(stale)] = -1
            self.telemetry.layers[layer].disk_staged_pages += len(job.rows)
        if need is not None:
            job = self._read_missing(layer, buffer, job, need)
        if job is None:
            self.maps[layer].fill_(-1)
            return None
        self.maps[layer].copy_(job.slot_rows, non_blocking=True)
        return self.pool[job.buffer], job

    def _read_missing(self, layer: int, buffer: int, job: _Job | None,
                      need: list[np.ndarray]) -> _Job | None:
        """Read the slots of ``need`` that ``job`` did not stage, now (see :meth:`staged`)."""
        wanted = []
        for i, n in enumerate(need):
            tier = self.tiers[self.disk[i]]
            s = np.unique(n[(n >= 0) & (n < tier.capacity)])
            # a slot holding no page cannot be selected from a sound table (it would stay
            # unstaged and count as a miss; the meta device's selections are not data)
            wanted.append(s[tier.held(layer, s)[0] >= 0])
        missing = [w if job is None else w[job.slot_rows[i, torch.from_numpy(w)].numpy() < 0]
                   for i, w in enumerate(wanted)]
        total = sum(len(m) for m in missing)
        if not total:
            return job
        if job is None or len(job.rows) + total > self.capacity:  # (start over in ``buffer``)
            for other, j in enumerate(self.jobs):
                if j is not None and j.buffer == buffer:
                    self.cancel(other)
            self._reserve(buffer)
            job = _Job(layer, buffer, [], [],
                       slot_rows=torch.full(self.maps.shape[1:], -1, dtype=torch.int32))
            missing, total = wanted, sum(len(w) for w in wanted)
        reads = []
        at = len(job.rows)
        for i, (t, slots) in enumerate(zip(self.disk, missing)):
            if not len(slots):
                continue
            starts = self.tiers[t].held(layer, slots)[0]
            job.slot_rows[i, torch.from_numpy(slots)] = torch.arange(
                at, at + len(slots), dtype=torch.int32)
            at += len(slots)
            reads.append((t, slots.tolist(), starts.tolist(), []))
        futures = self._submit(job, reads)
        try:
            self._wait(_Job(layer, job.buffer, futures, []))
        except (OSError, TierAttnError):
            self.maps[layer].fill_(-1)
            raise
        self.telemetry.layers[layer].disk_sync_pages += total
        return job

    def copied(self, job: _Job, ticket: object) -> None:
        """The copy out of ``job``'s host buffer (the host must not refill it before)."""
        self._copies[job.buffer] = ticket

