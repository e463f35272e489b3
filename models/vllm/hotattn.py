"""tierattn's hot set in vLLM's attention: the attention backends, and the CPU engine's worker.

The step tables and the top-k choice every worker shares, and the device path, live in
:mod:`.hotworker` (it imports no vLLM). Here:

:class:`CPUHotSetWorker` (vLLM's CPU engine) keeps a cold page in the host tier as vLLM's own
block (``[H_kv, P, 2 * D]``: per KV head the keys transposed, then the values): a copy out is a
block copy, and both pools read alike. Per layer (:meth:`CPUHotSetWorker.attend`), after vLLM
wrote the step's K/V into its blocks:

* decode rows (one query token each): the compiled host kernel
  (:func:`tierattn.kernels.host.host_decode`, ``layout="vllm_cpu"``) reads each row's hot
  blocks in vLLM's cache and its cold pages in the host tier in place, in one call and one
  softmax -- every cold page (``attend="all"``: exact), or the ``recall_budget`` pages with the
  highest Quest bound for this layer's query (``attend="topk"``);
* prompt chunks: their pages, hot and cold, are copied into a staging buffer of vLLM blocks
  and vLLM's own CPU attention kernel runs over it (causal, every cold page): a chunk's
  attention is compute-bound, the copy a small part of it. Decode rows take this path too
  where no C compiler built the host kernel, or with ``stage_cold=True``.

The backends: :class:`TierAttentionBackend` is vLLM's CPU attention (``CPU_ATTN``) with the hot
set behind it; :class:`TierAttentionDeviceBackend` is vLLM's Triton attention on CUDA
(registered as ``CUSTOM``, which :func:`tierattn.vllm_engine_args` selects) with
:class:`~tierattn.models.vllm.hotworker.DeviceHotSetWorker` behind it. Registered by
tierattn's vLLM plugin, each is vLLM's own backend in an engine that is not configured with the
hot-set connector (:func:`engine_hot_set`).

vLLM internals relied on (0.32): the CPU cache layout (checked by :func:`check_layout` on the
engine's own write kernel), ``ops.cpu_attention_with_kv_cache`` and
``ops.cpu_attn_get_scheduler_metadata``; on CUDA the logical ``[N, H_kv, P, 2D]`` cache with a
token-head's key then value (:func:`~tierattn.models.vllm.hotworker.block_pages`), the Triton
backend's classes and ``AttentionCGSupport``; the attention metadata's ``block_table``,
``seq_lens`` and ``query_start_loc``.
"""

from __future__ import annotations

from dataclasses import fields

import torch
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.attention.backends.triton_attn import (TritonAttentionBackend, TritonAttentionImpl,
                                                    TritonAttentionMetadataBuilder)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from tierattn.config import SwapConfig, TierConfig
from tierattn.errors import UnsupportedEngineError, UnsupportedModelError
from tierattn.kernels import PageTable
from tierattn.kernels.host import host_decode, host_decode_available, vllm_cpu_pages
from tierattn.storage.tiers import build_tier

from .config import HOT_SET_CONNECTOR, hot_set_config
from .hotset import HotSetSpec
from .hotworker import HotSetWorker, RowGroup

__all__ = ["CPUHotSetWorker", "TierAttentionBackend", "TierAttentionDeviceBackend",
           "TierAttentionDeviceImpl", "TierAttentionImpl", "check_layout", "engine_hot_set"]

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


class CPUHotSetWorker(HotSetWorker):
    """The hot set on vLLM's CPU engine: the host tier keeps cold pages as vLLM's CPU blocks,
    read in place by the host kernel (module docstring).

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
        super().__init__(tier, kv_caches)
        self.isa = isa
        first = next(iter(kv_caches.values()))
        check_layout(isa, self.dtype, self.kv_heads, self.page, self.head_dim)
        # the host tier holds vLLM's blocks as they are: copies out are block copies
        self.host = build_tier(swap.tiers[0], num_layers=len(kv_caches), capacity=host_slots,
                               page_shape=tuple(first.shape[1:]), dtype=self.dtype,
                               device=self.device, fingerprint=fingerprint, grow=True)
        if self.host.device != self.device:
            raise UnsupportedEngineError(
                "tierattn's hot set on vLLM's CPU engine keeps cold pages in the memory vLLM's "
                "blocks live in; a device engine takes DeviceHotSetWorker.")
        self.stage_decode = stage_cold or not host_decode_available()
        self.staging = torch.empty((0, *first.shape[1:]), dtype=self.dtype, device=self.device)

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
            self._keep_ranges(layer, vllm_cpu_pages(pages)[:, 0], slots)

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

class _HotSetImpl:
    """vLLM's attention impl, over the hot set when the engine has one (mixed in before the
    engine's own impl class)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        hot = engine_hot_set(get_current_vllm_config_or_none())
        _BUILT[0] = hot
        self.hot_set = hot is not None
        if self.hot_set and (self.sliding_window not in (-1, None, (-1, -1))
                             or self.alibi_slopes is not None or self.sinks is not None):
            raise UnsupportedModelError(
                "tierattn's hot set in vLLM serves dense causal attention; this model has a "
                "sliding window, ALiBi or attention sinks. Serve it without the hot set.")
        if self.hot_set and getattr(self, "kv_sharing_target_layer_name", None) is not None:
            raise UnsupportedModelError(
                "tierattn's hot set keeps each layer's cold pages itself; this model shares KV "
                "caches across layers. Serve it without the hot set.")
        if self.hot_set and self.kv_cache_dtype != "auto":
            raise UnsupportedModelError(
                f"kv_cache_dtype={self.kv_cache_dtype!r}: tierattn's hot set keeps every page at "
                "the model's precision; serve with kv_cache_dtype='auto'.")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        worker = _worker() if self.hot_set else None
        if worker is None or attn_metadata is None or not worker.has_cold(attn_metadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        worker.attend(self, layer, query, kv_cache, output)
        return output

    def fused_output_quant_supported(self, quant_key) -> bool:
        # the hot set's attention writes the output unquantised
        return False if self.hot_set else super().fused_output_quant_supported(quant_key)


class TierAttentionImpl(_HotSetImpl, CPUAttentionBackendImpl):
    """vLLM's CPU attention (``CPU_ATTN``), over the hot set when the engine has one."""


def _worker() -> HotSetWorker | None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), "hot_worker", None)


class _HotSetBackend:
    """An attention backend whose KV-cache spec is the hot set's in engines configured for it
    (mixed in before the engine's own backend class)."""

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


class TierAttentionBackend(_HotSetBackend, CPUAttentionBackend):
    """``CPU_ATTN`` with tierattn's hot set behind it in engines configured for it."""

    @staticmethod
    def get_impl_cls() -> type[TierAttentionImpl]:
        return TierAttentionImpl


# -- CUDA: vLLM's Triton attention with the device worker behind it (registered as CUSTOM) ----


class TierAttentionDeviceImpl(_HotSetImpl, TritonAttentionImpl):
    """vLLM's Triton attention (a CUDA engine), over the hot set when the engine has one:
    :class:`~tierattn.models.vllm.hotworker.DeviceHotSetWorker` attends the steps with cold
    pages, vLLM's kernel the others."""


class TierAttentionDeviceBuilder(TritonAttentionMetadataBuilder):
    """vLLM's Triton metadata; the hot set's step tables are host work between layers, so no
    CUDA graph holds attention (vLLM captures the rest piecewise)."""

    _cudagraph_support = AttentionCGSupport.NEVER


class TierAttentionDeviceBackend(_HotSetBackend, TritonAttentionBackend):
    """The hot set's backend on CUDA, chosen with ``attention_backend="CUSTOM"``
    (:func:`tierattn.vllm_engine_args` sets it; the plugin registers this class)."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[TierAttentionDeviceImpl]:
        return TierAttentionDeviceImpl

    @staticmethod
    def get_builder_cls() -> type[TierAttentionDeviceBuilder]:
        return TierAttentionDeviceBuilder
