"""PageMap: where every page of every layer and sequence lives, and the page tables kernels read.

Per layer, each sequence's KV is a list of logical pages of ``page_size`` tokens. A page is *hot*
(tier 0, a slot of the HBM pool), *cold* (a slot of a lower tier: DDR, CXL or disk) or gone
(``NONE``: evicted, dropped from a sliding window, or past the end).

Two views of the same state:

* the **host map**, ``[B, max_pages]`` tier and slot tensors per layer, the layer's length, and
  per sequence whether it is alive and how many tokens of left padding it starts with. Every
  structural edit (a page added, demoted, promoted, dropped) happens here, on the host, and
  bumps the layer's ``version``;
* the **device tables** (:class:`LayerTables`), the page tables the decode step reads, at fixed
  capacity (``max_pages`` entries per sequence) so their storage never moves: the hot table,
  the cold pages staged for attention, the recall candidates, where the next token is written.
  :meth:`PageMap.tables` rebuilds a layer's tables from the host map when its version changed
  (at most a few times per page filled) and moves them to the device in one copy per dtype;
  between structural edits a decode step only advances them in place on the device (the
  write position and the last page's length), so it reads nothing back and can be captured
  in a CUDA graph.

The map decides nothing and moves nothing: policies read it, the :mod:`~tierattn.storage.mover`
edits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tierattn.kernels import PageTable

__all__ = ["HOT", "NONE", "ColdBatch", "DeviceTable", "LayerPages", "LayerTables", "PageMap"]

HOT = 0  # tier index of HBM
NONE = -1  # no page: evicted, dropped from a window, or beyond the end


@dataclass
class LayerPages:
    """One layer's host map (``[B, max_pages]`` tensors) and length."""

    tier: torch.Tensor  # int8 tier index, NONE for no page
    slot: torch.Tensor  # int32 slot within that tier
    evicted: torch.Tensor  # bool: dropped for good (or left a sliding window)
    length: int = 0  # tokens per sequence (padding and evicted ones included)
    window: int | None = None  # sliding window of this layer (HF semantics: q - k < window)
    version: int = 0  # bumped by every structural edit; device tables follow it
    cold_version: int = 0  # bumped when the set of cold pages (or their slots) changes

    def edited(self, *, cold: bool = True) -> None:
        """A structural edit; ``cold=False``: the cold pages are as they were (a new hot
        page), so prefetches of them stay valid."""
        self.version += 1
        self.cold_version += cold


@dataclass
class DeviceTable:
    """A page table on the device and, per entry, the logical page it holds.

    ``table.indices[row_start[r] : row_start[r] + row_count[r]]`` are row ``r``'s pool slots;
    ``lse_index[e]`` is ``b * max_pages + page`` of entry ``e`` (``B * max_pages``, a trash row,
    for an unused entry), the row of a per-page buffer its page LSE or mass goes to.
    """

    table: PageTable
    lse_index: torch.Tensor  # int32 [cap]
    first_lane: torch.Tensor | None  # int32 [cap]: tokens before it are padding; None: no padding
    counts: list[int]  # entries per row (host)

    @property
    def total(self) -> int:
        return sum(self.counts)


@dataclass
class ColdBatch:
    """Cold pages of one layer staged together: the copies that bring them to a staging buffer
    (slot ``i`` holds the batch's entry ``i``) and the table that attends them there."""

    table: DeviceTable
    #: per memory source tier: (tier index, source slots, staging slots), int32 on the device,
    #: padded with -1 to the staging capacity (a -1 pair copies nothing)
    copies: list[tuple[int, torch.Tensor, torch.Tensor]]
    #: per disk tier: (tier index, source slots, first tokens, staging slots), host lists
    reads: list[tuple[int, list[int], list[int], list[int]]]
    pages_by_tier: dict[int, int]  # pages copied from each source tier (telemetry)
    #: row-blocked layout (row b's entries at b * max_pages, a copy list for every lower
    #: memory tier): a demotion appends in place (:meth:`PageMap.demote`); else None
    blocked: bool = False


@dataclass
class LayerTables:
    """The device tables of one layer, built from its host map at ``version``."""

    version: int
    cold_version: int
    hot: DeviceTable
    cold: list[ColdBatch] | None  # None: stale after a patch, rebuilt on use (cold_batches)
    #: [B_alive * 2] flat row (``slot * 2P + kv * P + lane``) in the HBM pool viewed as
    #: ``[slots * 2 * P, H_kv, D]`` where the next token's K and V go (advanced per token)
    write_pos: torch.Tensor
    #: [B_alive] long on the device: the live sequences (None when every sequence is alive)
    alive_rows: torch.Tensor | None
    #: the page being filled: its HBM slots and metadata rows (``b * max_pages + page``)
    current_slots: torch.Tensor  # int32 [B_alive]
    current_rows: torch.Tensor  # int32 [B_alive]
    padded: bool  # some sequence has left padding (the tables carry first lanes)
    cold_pages: int  # attendable cold pages of live sequences (host)
    hot_storage: tuple  # the device buffers the tables are views of
    cold_storage: tuple
    by_tier: dict[int, int] = field(default_factory=dict)  # live pages per tier (host)
    #: recall candidates (``attend="topk"``): every attendable cold page, compacted per row
    candidates: DeviceTable | None = None
    cand_cols: torch.Tensor | None = None  # long [B, max_pages] page of candidate i (pad -1)
    cand_lse: torch.Tensor | None = None  # int32 [B, max_pages] b * max_pages + page (trash)
    #: int32 [tiers - 1, B, max_pages]: candidate i's slot in lower tier t + 1, else -1
    cand_slots: torch.Tensor | None = None
    cand_first: torch.Tensor | None = None  # int32 [B, max_pages] first lane (padding)


class PageMap:
    """Tier and slot of every page, per layer and sequence (see the module docstring).

    Args:
        num_layers, batch_size: ``L`` and ``B``.
        max_pages: pages per sequence the tables hold (``ceil(max_context / page_size)``).
        page_size: tokens per page.
        sink_pages, recent_pages: pages that always stay hot at the start and the end.
        device: where the kernels read the tables.
        staging_pages: slots of a staging buffer (the most cold pages one batch stages).
    """

    def __init__(self, *, num_layers: int, batch_size: int, max_pages: int, page_size: int,
                 sink_pages: int, recent_pages: int, device: torch.device,
                 staging_pages: int) -> None:
        self.num_layers, self.batch_size = num_layers, batch_size
        self.max_pages, self.page_size = max_pages, page_size
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        self.device, self.staging_pages = device, staging_pages
        self.alive = torch.ones(batch_size, dtype=torch.bool)
        self.pad = torch.zeros(batch_size, dtype=torch.long)  # leading padding tokens
        # logical page numbers and page ends, built once (sliced per call instead of rebuilt)
        self.page_idx = torch.arange(max_pages)
        self.seq_idx = torch.arange(batch_size)
        self.page_ends = (self.page_idx + 1) * page_size
        self.layers = [self.new_layer() for _ in range(num_layers)]
        self._tables: list[LayerTables | None] = [None] * num_layers
        self.recall_pages = 0  # recall candidates are compacted when > 0 (attend="topk")

    def new_layer(self) -> LayerPages:
        b, mp = self.batch_size, self.max_pages
        return LayerPages(tier=torch.full((b, mp), NONE, dtype=torch.int8),
                          slot=torch.zeros(b, mp, dtype=torch.int32),
                          evicted=torch.zeros(b, mp, dtype=torch.bool))

    def reset(self) -> None:
        """Forget every page (the storage of the device tables is kept)."""
        version = max(max(st.version, st.cold_version) for st in self.layers) + 1
        self.layers = [self.new_layer() for _ in range(self.num_layers)]
        for st in self.layers:  # never equal to a version tables were built from
            st.version = st.cold_version = version
        self.alive = torch.ones(self.batch_size, dtype=torch.bool)
        self.pad = torch.zeros(self.batch_size, dtype=torch.long)

    def sequences_changed(self) -> None:
        """Padding or liveness changed: every layer's tables are stale."""
        for st in self.layers:
            st.edited()

    # --- geometry ----------------------------------------------------------------------------

    def length(self, layer: int) -> int:
        return self.layers[layer].length

    def num_pages(self, layer: int) -> int:
        return math.ceil(self.layers[layer].length / self.page_size)

    def pad_pages(self) -> torch.Tensor:
        """``[B]`` leading pages made only of left padding (never attended, never counted in
        a budget)."""
        return self.pad // self.page_size

    def must_hot(self, n_pages: int, layer: int | None = None) -> torch.Tensor:
        """``[B, n_pages]`` bool: per sequence, the sink pages (counted from its first page with
        a real token, after any left padding), the recent window and the page being filled; on
        a sliding-window layer, every page a future query can still see (kept contiguous and
        hot, which keeps positions exact for the window mask)."""
        m = torch.zeros(self.batch_size, n_pages, dtype=torch.bool)
        st = self.layers[layer] if layer is not None else None
        if st is not None and st.window is not None:
            keep_from = st.length - st.window + 1
            m[:, self.page_ends[:n_pages] > keep_from] = True
            return m
        first = self.pad_pages()
        idx = self.page_idx[None, :n_pages]
        m |= (idx >= first[:, None]) & (idx < first[:, None] + self.sink_pages)
        m[:, max(0, n_pages - self.recent_pages - 1):] = True
        return m

    def attendable(self, n_pages: int, start: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, n_pages]``: live sequences' pages holding a token at or after ``start[b]``
        (default: the end of the left padding)."""
        start = self.pad if start is None else start
        return self.alive[:, None] & (self.page_ends[None, :n_pages] > start[:, None])

    def live_pages(self, layer: int, sequence: int) -> torch.Tensor:
        """``[n]`` logical pages of ``sequence`` that still hold KV (any tier)."""
        return (self.layers[layer].tier[sequence] != NONE).nonzero().flatten()

    def residency(self, layer: int) -> dict[int, int]:
        """Pages of live sequences per tier index in ``layer``."""
        st = self.layers[layer]
        tiers = st.tier[:, :self.num_pages(layer)][self.alive]
        return {int(t): int(n) for t, n in zip(*torch.unique(tiers[tiers != NONE],
                                                             return_counts=True))}

    # --- device tables -----------------------------------------------------------------------

    def tables(self, layer: int, tiers: list) -> LayerTables:
        """``layer``'s device tables, rebuilt from the host map if it changed since they were
        built (``tiers``: the cache's tiers, to tell memory tiers from the disk)."""
        st, tabs = self.layers[layer], self._tables[layer]
        if tabs is None or tabs.version != st.version:
            tabs = self._tables[layer] = self._build(layer, tiers, tabs)
        return tabs

    def cached_tables(self, layer: int) -> LayerTables | None:
        """The tables if they match the host map (no rebuild), else None."""
        tabs = self._tables[layer]
        return tabs if tabs is not None and tabs.version == self.layers[layer].version else None

    def add_pages(self, layer: int, rows: list[int], page: int, slots: list[int]) -> None:
        """Sequences ``rows`` start logical ``page`` in HBM slots ``slots`` (a decode token
        crossed a page boundary). The host map is edited; current device tables are patched in
        place -- one entry appended to each hot row, the write position moved to the new page --
        in one indexed write per dtype instead of a rebuild."""
        st, tabs = self.layers[layer], self._tables[layer]
        current = tabs is not None and tabs.version == st.version and \
            st.length == page * self.page_size
        st.tier[rows, page] = HOT
        st.slot[rows, page] = torch.tensor(slots, dtype=torch.int32)
        st.edited(cold=False)
        if not current:
            return
        mp, p, hot = self.max_pages, self.page_size, tabs.hot
        s32, s64 = tabs.hot_storage
        at = lambda view, i: view.storage_offset() - s32.storage_offset() + i
        pos32, val32, pos64, val64 = [], [], [], []
        for i, (b, slot) in enumerate(zip(rows, slots)):
            e = b * mp + hot.counts[b]
            pos32 += [at(hot.table.indices, e), at(hot.lse_index, e),
                      at(hot.table.row_count, b), at(hot.table.last_page_len, b),
                      at(tabs.current_slots, i), at(tabs.current_rows, i)]
            val32 += [slot, b * mp + page, hot.counts[b] + 1, 0, slot, b * mp + page]
            if hot.first_lane is not None:
                pos32.append(at(hot.first_lane, e))
                val32.append(max(0, min(p, int(self.pad[b]) - page * p)))
            base = tabs.write_pos.storage_offset() - s64.storage_offset() + 2 * i
            pos64 += [base, base + 1]
            val64 += [slot * 2 * p, slot * 2 * p + p]
            hot.counts[b] += 1
        _scatter(s32, pos32, val32)
        _scatter(s64, pos64, val64)
        tabs.by_tier[HOT] = tabs.by_tier.get(HOT, 0) + len(rows)
        tabs.version = st.version

    def _build(self, layer: int, tiers: list, old: LayerTables | None) -> LayerTables:
        """Everything the decode step reads, built on the host in whole-tensor ops and copied
        into the previous tables' storage (captured graphs keep reading the right memory); the
        cold batches are rebuilt only when the cold pages changed."""
        st, p = self.layers[layer], self.page_size
        b, mp = self.batch_size, self.max_pages
        n, live, attend, cold = self._masks(layer)
        trash = b * mp
        padded = bool((self.pad > 0).any())
        rows = self.seq_idx[:, None].expand(b, mp)
        arrays = _Arrays()
        # the hot table: row b at b * max_pages, hot pages in logical order
        order, counts, valid = self._compact(attend & (st.tier == HOT))
        last = st.length - (n - 1) * p if n else 0
        hot = arrays.table(
            torch.where(valid, st.slot.gather(1, order), -1), self.seq_idx * mp, counts,
            torch.where(counts > 0, last, 0), torch.where(valid, rows * mp + order, trash),
            self._first_lane(rows, order) if padded else None)
        # where the next token goes: lane (length % P) of each live sequence's current page
        alive = self.alive.nonzero().flatten()
        cur_page = min(st.length // p, mp - 1)
        cur_slot = st.slot[alive, cur_page].long()
        pos = arrays.put((cur_slot * 2 * p)[:, None] + torch.tensor([0, p]) + st.length % p,
                         torch.int64)
        cur = (arrays.put(cur_slot, torch.int32), arrays.put(alive * mp + cur_page, torch.int32))
        alive_rows = arrays.put(alive, torch.int64) if len(alive) < b else None
        cand = None
        if self.recall_pages:  # every attendable cold page, compacted per row
            order, counts, valid = self._compact(cold)
            lse = torch.where(valid, rows * mp + order, trash)
            tier, slot = st.tier.gather(1, order), st.slot.gather(1, order)
            cand = dict(
                table=arrays.table(torch.where(valid, rows * mp + order, -1), self.seq_idx * mp,
                                   counts, torch.where(counts > 0, 1, 0), lse, None),
                cols=arrays.put(torch.where(valid, order, -1), torch.int64),
                lse=arrays.put(lse, torch.int32),
                slots=arrays.put(torch.stack([torch.where(valid & (tier == t), slot, -1)
                                              for t in range(1, len(tiers))]), torch.int32),
                first=arrays.put(self._first_lane(rows, order), torch.int32) if padded else None)
        dev = arrays.upload(self.device, old.hot_storage if old is not None else None)
        if old is not None and old.cold_version == st.cold_version and \
                old.padded == padded and old.cold is not None:
            cold_batches, cold_storage = old.cold, old.cold_storage
        else:
            cold_batches, cold_storage = self._cold_batches(
                layer, tiers, cold, padded, old.cold_storage if old is not None else None)
        res = LayerTables(
            version=st.version, cold_version=st.cold_version, hot=dev.table(hot),
            cold=cold_batches, write_pos=dev[pos],
            alive_rows=dev[alive_rows] if alive_rows is not None else None,
            current_slots=dev[cur[0]], current_rows=dev[cur[1]], padded=padded,
            cold_pages=int(cold.sum()), hot_storage=dev.storage, cold_storage=cold_storage,
            by_tier={int(t): int(k) for t, k in zip(*torch.unique(
                st.tier[live & self.alive[:, None]], return_counts=True))})
        if cand is not None:
            res.candidates = dev.table(cand["table"])
            res.cand_cols = dev[cand["cols"]].view(b, mp)
            res.cand_lse = dev[cand["lse"]].view(b, mp)
            res.cand_slots = dev[cand["slots"]].view(len(tiers) - 1, b, mp)
            res.cand_first = dev[cand["first"]].view(b, mp) if cand["first"] is not None \
                else None
        return res

    def _masks(self, layer: int):
        """``layer``'s pages as the tables see them: how many (``n``, counting a page allocated
        for the next token), which hold KV, which are attendable, which of those are cold."""
        st, p, mp = self.layers[layer], self.page_size, self.max_pages
        n = self.num_pages(layer)
        if st.length % p == 0 and n < mp and bool((st.tier[:, n] != NONE).any()):
            n += 1  # the page the next token starts is allocated: it holds 0 tokens so far
        live = (st.tier != NONE) & (self.page_idx[None, :] < n)
        attend = live & self.attendable(mp)
        return n, live, attend, attend & (st.tier > HOT)

    def cold_batches(self, layer: int, tiers: list) -> list[ColdBatch]:
        """``layer``'s cold batches (rebuilt here when a patch left them stale)."""
        tabs = self.tables(layer, tiers)
        if tabs.cold is None:
            tabs.cold, tabs.cold_storage = self._cold_batches(
                layer, tiers, self._masks(layer)[3], tabs.padded, tabs.cold_storage)
        return tabs.cold

    def _compact(self, mask: torch.Tensor):
        """Per row, the set columns first (in logical order); their counts; which of the
        ``max_pages`` positions of each row are used."""
        order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
        counts = mask.sum(1)
        return order, counts, self.page_idx[None, :] < counts[:, None]

    def _first_lane(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """First lane of page ``cols`` of sequence ``rows`` after the left padding."""
        return (self.pad[rows] - cols * self.page_size).clamp(0, self.page_size)

    def _cold_batches(self, layer: int, tiers: list, cold: torch.Tensor, padded: bool,
                      storage: tuple | None) -> tuple[list[ColdBatch], tuple]:
        """The cold pages of live sequences staged for attention (staging slot ``i`` holds the
        batch's entry ``i``). When a staging buffer holds ``B * max_pages`` pages, one batch in
        which row ``b``'s pages start at ``b * max_pages``, with a copy list for every lower
        memory tier (so a demotion is an append); otherwise row by row, in batches of at most
        ``staging_pages``."""
        st, p = self.layers[layer], self.page_size
        b, mp = self.batch_size, self.max_pages
        trash = b * mp
        nz = cold.nonzero()
        cap = self.staging_pages
        blocked = cap >= b * mp
        arrays, specs = _Arrays(), []
        for lo in range(0, max(1, len(nz)) if blocked else len(nz), cap):
            part = nz if blocked else nz[lo:lo + cap]
            r, c = part[:, 0], part[:, 1]
            per_row = torch.bincount(r, minlength=b)
            starts = self.seq_idx * mp if blocked else torch.cumsum(per_row, 0) - per_row
            at = starts[r] + (torch.arange(len(r)) - (torch.cumsum(per_row, 0) - per_row)[r])
            ti, sl = st.tier[r, c].long(), st.slot[r, c]
            copies, reads, by_tier = [], [], {}
            kinds = range(1, len(tiers)) if blocked else torch.unique(ti).tolist()
            for t in kinds:
                sel = ti == t
                by_tier[t] = int(sel.sum())
                if tiers[t].is_memory:
                    src = torch.full((cap,), -1, dtype=torch.int32)
                    dst = torch.full((cap,), -1, dtype=torch.int32)
                    src[:by_tier[t]], dst[:by_tier[t]] = sl[sel], at[sel].to(torch.int32)
                    copies.append((t, arrays.put(src, torch.int32), arrays.put(dst, torch.int32)))
                elif by_tier[t]:
                    reads.append((t, sl[sel].tolist(), (c[sel] * p).tolist(), at[sel].tolist()))
            lse = torch.full((cap,), trash, dtype=torch.long)
            lse[at] = r * mp + c
            first = torch.zeros(cap, dtype=torch.long)
            first[at] = self._first_lane(r, c)
            specs.append((arrays.table(
                torch.arange(cap), starts, per_row, torch.where(per_row > 0, p, 0), lse,
                first if padded else None), copies, reads, by_tier))
        dev = arrays.upload(self.device, storage)
        batches = [ColdBatch(dev.table(t), [(i, dev[s], dev[d]) for i, s, d in copies], reads,
                             by_tier, blocked) for t, copies, reads, by_tier in specs]
        return batches, dev.storage

    def demote(self, layer: int, rows: torch.Tensor, cols: torch.Tensor, tier: int,
               slots: list[int], tiers: list) -> None:
        """Hot pages ``(rows[i], cols[i])`` now live in lower ``tier`` at ``slots[i]``. The host
        map is edited; current device tables in the row-blocked layout are patched in place --
        each page appended to its row of the cold batch and to the tier's copy list, the hot
        rows it left rewritten -- in one indexed write per dtype instead of a rebuild."""
        st, tabs = self.layers[layer], self._tables[layer]
        blocked = tabs is not None and tabs.cold is not None and len(tabs.cold) == 1 and \
            tabs.cold[0].blocked
        current = tabs is not None and tabs.version == st.version and \
            tiers[tier].is_memory and (blocked or tabs.candidates is not None)
        st.tier[rows, cols] = tier
        st.slot[rows, cols] = torch.tensor(slots, dtype=torch.int32)
        st.edited()
        if not current:
            return
        mp, p, hot = self.max_pages, self.page_size, tabs.hot
        h32 = tabs.hot_storage[0]
        hot_at = lambda view, i: view.storage_offset() - h32.storage_offset() + i
        hpos, hval, cpos, cval = [], [], [], []
        if blocked:
            batch = tabs.cold[0]
            ctab, c32 = batch.table, tabs.cold_storage[0]
            cold_at = lambda view, i: view.storage_offset() - c32.storage_offset() + i
            src, dst = next((s, d) for t, s, d in batch.copies if t == tier)
        else:  # the cold batches are rebuilt when used (prefill, rare for recall)
            tabs.cold = None
        for b, pg, slot in zip(rows.tolist(), cols.tolist(), slots) if blocked else ():
            e = b * mp + ctab.counts[b]
            j = batch.pages_by_tier[tier]
            cpos += [cold_at(ctab.lse_index, e), cold_at(ctab.table.row_count, b),
                     cold_at(ctab.table.last_page_len, b), cold_at(src, j), cold_at(dst, j)]
            cval += [b * mp + pg, ctab.counts[b] + 1, p, slot, e]
            if ctab.first_lane is not None:
                cpos.append(cold_at(ctab.first_lane, e))
                cval.append(max(0, min(p, int(self.pad[b]) - pg * p)))
            ctab.counts[b] += 1
            batch.pages_by_tier[tier] += 1
        n = self.num_pages(layer)
        if st.length % p == 0 and n < mp and bool((st.tier[:, n] != NONE).any()):
            n += 1
        h_pos, h_val = [torch.tensor(hpos, dtype=torch.long)], [torch.tensor(hval)]
        trash = self.batch_size * mp
        for b in sorted(set(rows.tolist())):  # the hot rows the pages left, rewritten whole
            keep = ((st.tier[b, :n] == HOT) & (self.page_ends[:n] > self.pad[b])).nonzero()
            keep, old = keep.flatten(), hot.counts[b]
            span, gap = torch.arange(old), old - len(keep)
            h_pos += [hot_at(hot.table.indices, b * mp) + span,
                      hot_at(hot.lse_index, b * mp) + span]
            h_val += [torch.cat([st.slot[b, keep].long(), torch.full((gap,), -1)]),
                      torch.cat([b * mp + keep, torch.full((gap,), trash)])]
            if hot.first_lane is not None:
                h_pos.append(hot_at(hot.first_lane, b * mp) + span[:len(keep)])
                h_val.append(self._first_lane(torch.full_like(keep, b), keep))
            h_pos.append(torch.tensor([hot_at(hot.table.row_count, b)]))
            h_val.append(torch.tensor([len(keep)]))
            hot.counts[b] = len(keep)
        if tabs.candidates is not None:  # recall: the pages join their rows' candidates
            cand, h64 = tabs.candidates, tabs.hot_storage[1]
            at64 = lambda view, i: view.storage_offset() - h64.storage_offset() + i
            c64pos, c64val = [], []
            for b, pg, slot in zip(rows.tolist(), cols.tolist(), slots):
                e = b * mp + cand.counts[b]
                h_pos.append(torch.tensor([
                    hot_at(cand.table.indices, e), hot_at(cand.lse_index, e),
                    hot_at(cand.table.row_count, b), hot_at(cand.table.last_page_len, b),
                    hot_at(tabs.cand_lse, e)] + [hot_at(tabs.cand_slots[t - 1], e)
                                                 for t in range(1, len(tiers))]))
                h_val.append(torch.tensor([b * mp + pg, b * mp + pg, cand.counts[b] + 1, 1,
                                           b * mp + pg] + [slot if t == tier else -1
                                                           for t in range(1, len(tiers))]))
                if tabs.cand_first is not None:
                    h_pos.append(torch.tensor([hot_at(tabs.cand_first, e)]))
                    h_val.append(torch.tensor([max(0, min(p, int(self.pad[b]) - pg * p))]))
                c64pos.append(at64(tabs.cand_cols, e))
                c64val.append(pg)
                cand.counts[b] += 1
            _scatter(h64, c64pos, c64val)
        _scatter(h32, torch.cat(h_pos), torch.cat(h_val))
        if blocked:
            _scatter(tabs.cold_storage[0], cpos, cval)
        tabs.cold_pages += len(slots)
        tabs.by_tier[HOT] -= len(slots)
        tabs.by_tier[tier] = tabs.by_tier.get(tier, 0) + len(slots)
        tabs.version, tabs.cold_version = st.version, st.cold_version


def _scatter(buf: torch.Tensor, pos, val) -> None:
    """``buf[pos[i]] = val[i]`` in order, on the device (lists or host tensors): one small
    upload, one indexed write. A position written more than once (a row's count, once per page
    appended to it) gets its last value: the repeats are dropped on the host first, because an
    indexed write with repeated positions may keep any of their values (CPU threads and CUDA
    both race on it)."""
    if not len(pos):
        return
    pos = torch.as_tensor(pos, dtype=torch.long)
    val = torch.as_tensor(val)
    uniq, inv = torch.unique(pos, return_inverse=True)
    if len(uniq) < len(pos):  # the last write of each position
        last = torch.zeros(len(uniq), dtype=torch.long).scatter_reduce_(
            0, inv, torch.arange(len(pos)), "amax", include_self=False)
        pos, val = uniq, val[last]
    buf[pos.to(buf.device)] = val.to(buf.device, buf.dtype)


class _Arrays:
    """Host arrays gathered for one upload: one host-to-device copy per dtype, into the previous
    upload's storage when the sizes match (so the device addresses stay the same)."""

    def __init__(self) -> None:
        self.parts: dict[torch.dtype, list[torch.Tensor]] = {torch.int32: [], torch.int64: []}

    def put(self, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.dtype, int]:
        self.parts[dtype].append(t.to(dtype).flatten())
        return dtype, len(self.parts[dtype]) - 1

    def table(self, indices, row_start, row_count, last, lse, first) -> dict:
        i32 = torch.int32
        return dict(indices=self.put(indices, i32), row_start=self.put(row_start, i32),
                    row_count=self.put(row_count, i32), last=self.put(last, i32),
                    lse=self.put(lse, i32), first=self.put(first, i32) if first is not None
                    else None, counts=row_count.tolist())

    def upload(self, device: torch.device, storage: tuple | None) -> _Uploaded:
        bufs, views = [], {}
        for i, (dtype, parts) in enumerate(self.parts.items()):
            host = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)
            prev = storage[i] if storage is not None else None
            if prev is not None and prev.numel() == host.numel():
                buf = prev.copy_(host)
            else:
                buf = host.to(device) if device.type != "cpu" else host
            bufs.append(buf)
            pos = 0
            for j, t in enumerate(parts):
                views[dtype, j] = buf[pos:pos + t.numel()]
                pos += t.numel()
        return _Uploaded(tuple(bufs), views)


@dataclass
class _Uploaded:
    storage: tuple
    views: dict

    def __getitem__(self, key: tuple) -> torch.Tensor:
        return self.views[key]

    def table(self, spec: dict) -> DeviceTable:
        return DeviceTable(
            PageTable(indices=self[spec["indices"]], row_start=self[spec["row_start"]],
                      row_count=self[spec["row_count"]], last_page_len=self[spec["last"]]),
            self[spec["lse"]], self[spec["first"]] if spec["first"] is not None else None,
            spec["counts"])
