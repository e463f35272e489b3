"""Mover: every movement of a page between tiers, through one batched path.

One primitive, :meth:`Mover.copy`, copies a batch of pages of one layer from one source tier to a
destination (a tier, or a staging buffer on the device): between two memory pools it is one
page-copy launch on the transfer engine (on CUDA, the copy kernel reads pinned host pools over
UVA); with a disk tier on either side it is a validated read and a write. Everything that moves
pages -- demotion, fetching cold pages into staging, moving a page by hand, reordering sequences,
reading pages out for ``gather``/``save`` and writing them back on ``load`` -- groups its pages
by source tier and calls it, then edits the :class:`~tierattn.storage.pagemap.PageMap`. Destination
slots are always taken before anything changes, so a full hierarchy raises
:class:`~tierattn.errors.KVCapacityError` with nothing moved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierattn.errors import KernelInputError, KVCapacityError, KVIOError, TierAttnError
from tierattn.storage.pagemap import HOT, NONE, PageMap
from tierattn.telemetry import Telemetry
from tierattn.storage.tiers import MemoryTier, Tier
from tierattn.storage.transfer import TransferEngine

__all__ = ["Mover"]


class Mover:
    """Moves pages between ``tiers`` (fastest first, ``tiers[0]`` is HBM) and edits ``pages``.

    Args:
        tiers: the cache's tiers.
        pages: the page map it keeps in step with the data (None: only the tier-to-tier
            path -- :meth:`copy`, :meth:`atomic`, :meth:`count_bytes` -- is used, as by the
            swap store, which keeps its own map).
        engine: the transfer engine (memory-to-memory copies).
        telemetry: counters of bytes and copy launches.
        device: the compute device (slot lists of engine copies live there).
    """

    def __init__(self, tiers: list[Tier], pages: PageMap | None, engine: TransferEngine,
                 telemetry: Telemetry, device: torch.device) -> None:
        self.tiers, self.pages, self.engine = tiers, pages, engine
        self.telemetry, self.device = telemetry, device
        self.page_size = tiers[HOT].page_shape[1]
        self.page_bytes = tiers[0].page_bytes
        #: copy on the current stream without the engine's stream and events (a decode step
        #: being captured in a CUDA graph)
        self.direct = False

    # --- the one path ------------------------------------------------------------------------

    def copy(self, layer: int, src: int, src_slots: torch.Tensor, token_starts: torch.Tensor,
             dst: Tier | torch.Tensor, dst_slots: torch.Tensor, *, after: object = None,
             wait: bool = True) -> object:
        """Copy pages ``src_slots`` (``[n]`` long, CPU) of tier ``src`` into ``dst_slots`` of
        ``dst`` (a tier of this layer, or a ``[slots, *page_shape]`` device pool such as a
        staging buffer). ``token_starts [n]``: first token of each page (disk files record it).
        Returns the engine's ticket (None when synchronous or already waited on)."""
        tier = self.tiers[src]
        dst_tier = dst if isinstance(dst, Tier) else None
        dst_pool = dst.pool(layer) if isinstance(dst, MemoryTier) else dst
        if isinstance(tier, MemoryTier) and not (dst_tier is not None and
                                                 not isinstance(dst_tier, MemoryTier)):
            ticket = self.engine.copy(
                tier.pool(layer), src_slots.to(device=self.device, dtype=torch.int32),
                dst_pool, dst_slots.to(device=self.device, dtype=torch.int32), after=after)
            if wait:
                self.engine.wait(ticket)
                ticket = None
        elif isinstance(tier, MemoryTier):  # memory -> disk: one gather, one batched write
            idx = src_slots.to(device=tier.device, dtype=torch.long)
            pages = tier.pool(layer)[idx]
            if pages.device.type != "cpu":  # through the engine's one way back to the host
                host = torch.empty(pages.shape, dtype=pages.dtype,
                                   pin_memory=pages.device.type == "cuda")
                self.engine.wait_host(self.engine.to_host(pages, host))
                pages = host
            dst_tier.write(layer, dst_slots.tolist(), pages, token_starts.tolist())
            ticket = None
        else:  # disk -> anywhere: validated reads, then one indexed write
            data = self._read(tier, layer, src_slots.tolist(), token_starts.tolist())
            if dst_tier is not None:
                dst_tier.write(layer, dst_slots.tolist(), data, token_starts.tolist())
            else:
                dst_pool[dst_slots.to(dst_pool.device)] = data.to(dst_pool.device)
            ticket = None
        self._count(layer, src, dst_tier, src_slots.numel())
        return ticket

    @staticmethod
    def _read(tier: Tier, layer: int, slots: list[int], token_starts: list[int]) -> torch.Tensor:
        """``tier.read``, a storage failure raised as :class:`KVIOError` (nothing was moved)."""
        try:
            return tier.read(layer, slots, token_starts)
        except OSError as e:
            if isinstance(e, TierAttnError):
                raise
            raise KVIOError(e.errno, f"layer {layer}: reading pages of the {tier.kind} tier "
                            f"failed ({e}); nothing was moved. Check the disk tier's "
                            "storage.") from e

    def count_bytes(self, layer: int, src: int, n: int) -> None:
        """Count ``n`` pages moved from tier ``src`` into the device (no launch counted: a
        replayed graph launched them)."""
        c = self.telemetry.layers[layer]
        c.h2d_bytes[self.tiers[src].kind] += n * self.page_bytes
        if self.telemetry.decoding:
            c.h2d_decode_bytes += n * self.page_bytes

    def _count(self, layer: int, src: int, dst: Tier | None, n: int) -> None:
        tel = self.telemetry
        c = tel.layers[layer]
        c.copy_launches += 1
        c.copy_launches_decode += tel.decoding
        to_device = dst is None or dst is self.tiers[HOT]  # staging, or a promotion
        if to_device and src != HOT:
            c.h2d_bytes[self.tiers[src].kind] += n * self.page_bytes
            if tel.decoding:
                c.h2d_decode_bytes += n * self.page_bytes
        elif src == HOT and not to_device:  # out of the device
            c.d2h_launches_decode += tel.decoding
            c.d2h_bytes[dst.kind] += n * self.page_bytes

    def _by_tier(self, tiers: torch.Tensor) -> list[tuple[int, torch.Tensor | slice]]:
        """``(tier, selector)`` per source tier present in ``tiers [n]``, fastest first."""
        present = torch.unique(tiers).tolist()  # sorted: fastest tier first
        if len(present) == 1:
            return [(int(present[0]), slice(None))]
        return [(int(ti), tiers == ti) for ti in present]

    # --- slot lists on the device (the decode step) ---------------------------------------------

    def copy_slots(self, layer: int, src: int, src_slots: torch.Tensor, dst_pool: torch.Tensor,
                   dst_slots: torch.Tensor, *, pages: int | None, after: object = None,
                   wait: bool = True) -> object:
        """Copy pages of memory tier ``src`` into ``dst_pool`` (a staging buffer) by int32 slot
        lists already on the device (-1 pairs copy nothing): one launch, no host read.
        ``pages``: how many pairs are real, for the counters (None: counted on the device)."""
        if self.direct:  # inside a captured step: on the current stream, no events
            self.engine.kernels.copy_pages(self.tiers[src].pool(layer), src_slots, dst_pool,
                                           dst_slots, validate=False, backend=self.engine.backend)
            ticket = None
        else:
            ticket = self.engine.copy(self.tiers[src].pool(layer), src_slots, dst_pool,
                                      dst_slots, after=after)
            if wait:
                self.engine.wait(ticket)
                ticket = None
        if not self.direct:  # a captured step's bytes are counted per replay by the cache
            self._count(layer, src, None, pages or 0)
        else:
            self._count(layer, src, None, 0)
        return ticket

    def copy_recalled(self, layer: int, src: torch.Tensor, cols: torch.Tensor,
                      dst_pool: torch.Tensor, dst_slots: torch.Tensor, *, after: object = None,
                      wait: bool = True, pages: int | None = None,
                      counted: bool = False, held: list[int] | None = None) -> list:
        """Copy recalled pages into staging rows ``dst_slots [B * k]`` (int32): ``src
        [tiers - 1, B, k]`` holds each page's slot in lower tier ``t + 1`` (-1: not there, or
        not to copy), ``cols [B, k]`` their logical pages. One launch per lower memory tier
        holding pages of the layer; nothing is read back. ``pages``: how many are copied, when
        the host knows it and one tier holds them all; otherwise they are counted on the
        device, here, or already (``counted``: the selection kernel did). ``held``: the
        :meth:`memory_tiers_held` of the caller, when it has them. (Disk pages come through the
        prefetcher's disk stage, not here.)"""
        held = self.memory_tiers_held(layer) if held is None else held
        host_count = pages is not None and len(held) == 1
        tickets = []
        for t in held:
            mine = src[t - 1].view(-1)
            if not host_count and not counted:
                self.telemetry.count_recalled(layer, t, mine)
            tickets.append(self.copy_slots(layer, t, mine, dst_pool, dst_slots,
                                           pages=pages if host_count else 0, after=after,
                                           wait=wait))
        return tickets

    def memory_tiers_held(self, layer: int) -> list[int]:
        """The lower memory tiers holding pages of ``layer`` (host counts)."""
        return [t for t in range(1, len(self.tiers))
                if self.tiers[t].is_memory and self.tiers[t].num_used(layer)]

    def on_disk(self, layer: int) -> bool:
        """Whether a disk tier holds pages of ``layer`` (recall then stages them on the host)."""
        return any(not t.is_memory and t.num_used(layer) for t in self.tiers)

    # --- what the cache does with it ------------------------------------------------------------

    def fetch(self, layer: int, rows: torch.Tensor, cols: torch.Tensor, dst_pool: torch.Tensor,
              dst_slots: torch.Tensor, *, after: object = None, wait: bool = True) -> list:
        """Copy the cold pages ``(rows[i], cols[i])`` into ``dst_pool[dst_slots[i]]`` (a staging
        buffer): one launch per source tier. Returns the tickets (None entries when waited)."""
        st = self.pages.layers[layer]
        src_tier, src_slot = st.tier[rows, cols], st.slot[rows, cols].long()
        tickets = []
        for ti, sel in self._by_tier(src_tier):
            tickets.append(self.copy(layer, ti, src_slot[sel], cols[sel] * self.page_size,
                                     dst_pool, dst_slots[sel], after=after, wait=wait))
        return tickets

    def demote(self, layer: int, pages: list[tuple[int, int]]) -> None:
        """Move hot pages ``(sequence, page)`` to the first lower tiers with room: one copy
        launch per destination tier. All destination slots are taken first, so a full
        hierarchy raises :class:`KVCapacityError` with nothing changed."""
        plan, todo = [], list(pages)
        for ti in range(1, len(self.tiers)):
            if not todo:
                break
            n = min(len(todo), self.tiers[ti].num_free(layer))
            if n:
                plan.append((ti, todo[:n], self.tiers[ti].alloc(layer, n)))
                todo = todo[n:]
        if todo:
            for ti, _, slots in plan:
                self.tiers[ti].release(layer, slots)
            free = {t.kind: t.num_free(layer) for t in self.tiers[1:]}
            raise KVCapacityError(
                f"layer {layer}: {len(pages)} pages must leave HBM but the lower tiers have "
                f"room for {len(pages) - len(todo)} (free pages per tier: {free}); raise their "
                "capacity_pages, add a tier, or set evict_budget.")
        st = self.pages.layers[layer]
        jobs = []
        for ti, items, slots in plan:
            rows = torch.tensor([b for b, _ in items], dtype=torch.long)
            cols = torch.tensor([pg for _, pg in items], dtype=torch.long)
            jobs.append((ti, rows, cols, st.slot[rows, cols].long(), slots))

        def copy_all() -> None:
            for ti, _, cols, src, slots in jobs:
                # the freed HBM slots are rewritten by later kernels: the copy is waited on
                self.copy(layer, HOT, src, cols * self.page_size, self.tiers[ti],
                          torch.tensor(slots, dtype=torch.long))

        self.atomic(layer, [(ti, slots) for ti, _, slots in plan], copy_all)
        for ti, rows, cols, src, slots in jobs:  # every copy landed: commit
            self.telemetry.layers[layer].demoted_pages += len(slots)
            self.tiers[HOT].release(layer, src.tolist())
            self.pages.demote(layer, rows, cols, ti, slots, self.tiers)

    def atomic(self, layer: int, taken: list[tuple[int, list[int]]],
               copies: Callable[[], object]) -> None:
        """Run ``copies`` into the slots ``taken`` (``(tier, slots)``) all or nothing: if one
        fails (a full disk, an I/O error, an interrupt, a failed launch), the taken slots are
        given back (their files deleted) and the error is raised -- a storage failure as
        :class:`KVIOError` -- with every page where it was."""
        try:
            copies()
        except BaseException as e:
            for ti, slots in taken:
                self.tiers[ti].release(layer, slots)
            if isinstance(e, OSError) and not isinstance(e, TierAttnError):
                raise KVIOError(e.errno, f"layer {layer}: a page copy failed ({e}); it was "
                                "rolled back: the pages are where they were. Free space on the "
                                "disk tier or raise capacity elsewhere.") from e
            raise

    def move(self, layer: int, sequence: int, page: int, tier: int) -> None:
        """Move one live page to ``tier`` (spill to disk, reload, demote by hand)."""
        st = self.pages.layers[layer]
        src_t, src_s = int(st.tier[sequence, page]), int(st.slot[sequence, page])
        if src_t == NONE:
            raise KernelInputError(f"page {page} of sequence {sequence} does not exist "
                                   "(evicted or past the end).")
        if src_t == tier:
            return
        (slot,) = self.tiers[tier].alloc(layer, 1)
        self.atomic(layer, [(tier, [slot])], lambda: self.copy(
            layer, src_t, torch.tensor([src_s]), torch.tensor([page * self.page_size]),
            self.tiers[tier], torch.tensor([slot])))
        self.tiers[src_t].release(layer, [src_s])
        st.tier[sequence, page], st.slot[sequence, page] = tier, slot
        st.edited()

    def drop(self, layer: int, sequence: int, pages: list[int], *, window: bool = False) -> None:
        """Release ``pages`` of ``sequence``; ``window``: they left a sliding window (counted
        apart from evictions)."""
        st = self.pages.layers[layer]
        cols = torch.tensor(pages, dtype=torch.long)
        self.release(layer, st.tier[sequence, cols], st.slot[sequence, cols])
        st.tier[sequence, pages] = NONE
        st.evicted[sequence, pages] = True
        st.edited()
        c = self.telemetry.layers[layer]
        if window:
            c.window_dropped_tokens += len(pages) * self.page_size
        else:
            c.evicted_tokens += len(pages) * self.page_size

    def release(self, layer: int, tiers: torch.Tensor, slots: torch.Tensor) -> None:
        """Give slots ``slots[i]`` of tier ``tiers[i]`` back (``[n]`` tensors; NONE skipped)."""
        for ti, tier in enumerate(self.tiers):
            sl = slots[tiers == ti].tolist()
            if sl:
                tier.release(layer, sl)

    def free(self, sequence: int) -> None:
        """Release every page of ``sequence`` in every layer."""
        for layer, st in enumerate(self.pages.layers):
            live = st.tier[sequence] != NONE
            self.release(layer, st.tier[sequence][live], st.slot[sequence][live])
            st.tier[sequence] = NONE
            st.edited()

    def read(self, layer: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Pages ``(rows[i], cols[i])`` as one ``[n, *page_shape]`` CPU tensor, from wherever
        they live: one read per tier."""
        st = self.pages.layers[layer]
        hbm = self.tiers[HOT]
        out = torch.empty(len(cols), *hbm.page_shape, dtype=hbm.dtype)
        tiers = st.tier[rows, cols]
        for ti, tier in enumerate(self.tiers):
            sel = (tiers == ti).nonzero().flatten()
            if len(sel):
                out[sel] = self._read(tier, layer, st.slot[rows[sel], cols[sel]].tolist(),
                                     (cols[sel] * self.page_size).tolist()).cpu()
        return out

    def mean_keys(self, layer: int, n_pages: int) -> torch.Tensor:
        """``[B, n_pages, H_kv, D]`` fp32 mean key of every live page of ``layer`` over its
        tokens (zeros where no page is stored), on the device: what a redundancy-aware policy
        compares. Hot pages are gathered from the HBM pool on the device; pages in the other
        tiers are read where they live (host memory, disk) and copied in. Nothing is read back
        from the device."""
        st, p, dev = self.pages.layers[layer], self.page_size, self.device
        hbm = self.tiers[HOT]
        out = torch.zeros(self.pages.batch_size, n_pages, *hbm.page_shape[2:], device=dev)
        live = (st.tier[:, :n_pages] != NONE).nonzero()
        if not len(live):
            return out
        rows, cols = live[:, 0], live[:, 1]
        tiers, slots = st.tier[rows, cols], st.slot[rows, cols]
        keys = torch.empty(len(rows), *hbm.page_shape[1:], dtype=hbm.dtype, device=dev)
        for ti, tier in enumerate(self.tiers):
            sel = (tiers == ti).nonzero().flatten()
            if not len(sel):
                continue
            if ti == HOT:
                data = tier.pool(layer)[slots[sel].to(dev), 0]
            else:
                data = self._read(tier, layer, slots[sel].tolist(),
                                  (cols[sel] * p).tolist())[:, 0].to(dev, non_blocking=True)
            keys[sel.to(dev)] = data
        valid = ((cols[:, None] * p + torch.arange(p)) < st.length).to(dev)  # [n, P]
        keys = keys.float() * valid[:, :, None, None]
        out[rows.to(dev), cols.to(dev)] = keys.sum(1) / valid.sum(1).clamp_min(1)[:, None, None]
        return out

    def write(self, layer: int, rows: torch.Tensor, cols: torch.Tensor, tiers: torch.Tensor,
              data: torch.Tensor) -> None:
        """Store ``data [n, *page_shape]`` as pages ``(rows[i], cols[i])`` in tier ``tiers[i]``
        (the map must hold no page there); raises before anything changes if a tier is full."""
        plan = []
        for ti, tier in enumerate(self.tiers):
            sel = (tiers == ti).nonzero().flatten()
            if len(sel):
                try:
                    plan.append((ti, sel, tier.alloc(layer, len(sel))))
                except KVCapacityError:
                    for tj, _, slots in plan:
                        self.tiers[tj].release(layer, slots)
                    raise
        st = self.pages.layers[layer]

        def write_all() -> None:
            for ti, sel, slots in plan:
                self.tiers[ti].write(layer, slots, data[sel],
                                     (cols[sel] * self.page_size).tolist())

        self.atomic(layer, [(ti, slots) for ti, _, slots in plan], write_all)
        for ti, sel, slots in plan:
            st.tier[rows[sel], cols[sel]] = ti
            st.slot[rows[sel], cols[sel]] = torch.tensor(slots, dtype=torch.int32)
        st.edited()

    def reorder(self, index: list[int]) -> None:
        """Sequence ``i`` becomes old sequence ``index[i]`` (beam search). A sequence chosen
        twice gets its own copy of every page (in its tier, or the next one with room; the page
        being filled always in HBM); one not chosen is freed. Raises :class:`KVCapacityError`,
        changing nothing, when the copies do not fit.

        Copies go first into free slots (a failing one -- a full disk -- is rolled back), then,
        where those run short, into the memory-tier slots of the sequences not chosen (the
        last copies: memory to memory, nothing left to fail)."""
        b, p = self.pages.batch_size, self.page_size
        dropped = [s for s in range(b) if s not in index]
        firsts = {old: new for new, old in reversed(list(enumerate(index)))}
        dups = [(new, old) for new, old in enumerate(index) if firsts[old] != new]
        plans = []  # per layer: (new, old, page, dst tier, reused slot or None)
        for layer, st in enumerate(self.pages.layers):
            free = [t.num_free(layer) for t in self.tiers]
            reuse: list[list[int]] = [[] for _ in self.tiers]
            for old in dropped:
                for pg in (st.tier[old] != NONE).nonzero().flatten().tolist():
                    if self.tiers[int(st.tier[old, pg])].is_memory:
                        reuse[int(st.tier[old, pg])].append(int(st.slot[old, pg]))
            filling = st.length // p if st.length % p else None
            copies = []
            for new, old in dups:
                for pg in (st.tier[old] != NONE).nonzero().flatten().tolist():
                    src = int(st.tier[old, pg])
                    order = [HOT] if pg == filling else [src] + list(range(len(self.tiers)))
                    # a reused slot is overwritten: only by a copy that cannot fail (memory)
                    can_reuse = self.tiers[src].is_memory
                    dst = next((t for t in order if free[t] or (can_reuse and reuse[t])), None)
                    if dst is None:
                        raise KVCapacityError(
                            f"reorder duplicates sequences {sorted({o for _, o in dups})} but "
                            f"layer {layer} has no free slot left for their copies (page "
                            f"{pg}{', being filled, needs HBM' if pg == filling else ''}); raise "
                            "the tiers' capacity_pages (or free a sequence first). Nothing "
                            "changed.")
                    if free[dst]:
                        free[dst] -= 1
                        copies.append((new, old, pg, dst, None))
                    else:
                        copies.append((new, old, pg, dst, reuse[dst].pop()))
            plans.append(copies)
        made: list[list[tuple[int, int, int, int]]] = [[] for _ in plans]  # new, pg, dst, slot

        def copy_all() -> None:
            # every layer's copies into free slots (which may fail: a full disk) before any
            # into a reused slot (which overwrites a dropped sequence's page for good)
            order = sorted(((layer, c) for layer, copies in enumerate(plans) for c in copies),
                           key=lambda lc: lc[1][4] is not None)
            for layer, (new, old, pg, dst, slot) in order:
                st = self.pages.layers[layer]
                if slot is None:
                    (slot,) = self.tiers[dst].alloc(layer, 1)
                made[layer].append((new, pg, dst, slot))
                self.copy(layer, int(st.tier[old, pg]), st.slot[old, pg:pg + 1].long(),
                          torch.tensor([pg * p]), self.tiers[dst], torch.tensor([slot]))

        try:
            copy_all()
        except BaseException as e:
            for layer, (copies, done) in enumerate(zip(plans, made)):
                reused = {(c[3], c[4]) for c in copies if c[4] is not None}
                for _, _, dst, slot in done:
                    if (dst, slot) not in reused:
                        self.tiers[dst].release(layer, [slot])
            if isinstance(e, OSError) and not isinstance(e, TierAttnError):
                raise KVIOError(e.errno, f"reorder: a page copy failed ({e}); rolled back: "
                                "every sequence is as it was.") from e
            raise
        rows = torch.tensor(index)
        for layer, st in enumerate(self.pages.layers):  # every copy landed: commit
            reused = {(dst, slot) for new, old, pg, dst, slot in plans[layer] if slot is not None}
            old_tier, old_slot = st.tier.clone(), st.slot.clone()
            for old in dropped:
                live = old_tier[old] != NONE
                keep = torch.tensor([(int(t), int(s)) not in reused for t, s in
                                     zip(old_tier[old], old_slot[old])], dtype=torch.bool)
                self.release(layer, old_tier[old][live & keep], old_slot[old][live & keep])
            st.tier, st.slot, st.evicted = old_tier[rows], old_slot[rows], st.evicted[rows]
            for new, pg, dst, slot in made[layer]:
                st.tier[new, pg], st.slot[new, pg] = dst, slot
            st.edited()
