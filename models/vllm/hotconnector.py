"""The connector vLLM loads for tierattn's hot set (``kv_connector="TierattnHotSetConnector"``,
written by :func:`tierattn.vllm_engine_args`).

vLLM's connector interface is the one channel from its scheduler to its workers each step, and
the one hook around each attention layer; the hot set uses both and loads nothing from outside:

* scheduler process: :meth:`~TierattnHotSetConnector.build_connector_meta` asks the
  :class:`~tierattn.models.vllm.hotset.HotSetManager` for host slots of the pages turning cold
  this step and sends, with them, each scheduled request's cold pages (:class:`HotSetMetadata`);
* worker process: :meth:`~TierattnHotSetConnector.bind_connector_metadata` hands them to the
  worker (:class:`~tierattn.models.vllm.hotattn.CPUHotSetWorker` on vLLM's CPU engine,
  :class:`~tierattn.models.vllm.hotworker.DeviceHotSetWorker` on CUDA) before the forward,
  :meth:`~TierattnHotSetConnector.save_kv_layer`, after each layer wrote its K/V, copies the
  pages out, and :meth:`~TierattnHotSetConnector.wait_for_save` orders those copies before
  the next step.

Both sides size the host tier with the one rule of
:func:`tierattn.serving.swaptiers.swap_capacities` (:func:`host_slots`), so they count the same
slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata)
from vllm.forward_context import get_forward_context, is_forward_context_available

from tierattn.errors import TierConfigError
from tierattn.serving.swaptiers import swap_capacities

from .config import check_hot_set, check_vllm, hot_set_config, swap_config
from .hotset import HotSetManager

__all__ = ["HotSetMetadata", "TierattnHotSetConnector", "host_slots"]


@dataclass
class HotSetMetadata(KVConnectorMetadata):
    """One step's word from the scheduler to the workers.

    Attributes:
        stores: ``(device block, host slot)`` pages to copy out after each layer's write.
        cold: a scheduled request's first device block -> its cold ``(page, host slot)``.
    """

    stores: list[tuple[int, int]] = field(default_factory=list)
    cold: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


def host_slots(vllm_config, kv_cache_config) -> int:
    """Pages the host tier holds (per worker; the same count in every process of an engine)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    group = kv_cache_config.kv_cache_groups[0]
    slot_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    swap = swap_config(extra)
    return swap_capacities(swap.tiers, slot_bytes, int(kv_cache_config.num_blocks),
                           workers=vllm_config.parallel_config.world_size,
                           pinned=vllm_config.device_config.device_type == "cuda")[0]


class TierattnHotSetConnector(KVConnectorBase_V1):
    """tierattn's hot set in vLLM (module docstring). Loads nothing: ``get_num_new_matched_tokens``
    finds no external tokens."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_vllm()
        extra: dict[str, Any] = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.tier = hot_set_config(extra)
        self.swap = swap_config(extra)
        check_hot_set(self.tier, self.swap.tiers)
        if vllm_config.cache_config.enable_prefix_caching:
            raise TierConfigError(
                "enable_prefix_caching: tierattn's hot set frees cold blocks a prefix hit could "
                "share; build the engine with tierattn.vllm_engine_args(config), which turns it "
                "off.")
        if vllm_config.speculative_config is not None:
            raise TierConfigError(
                "speculative_config: tierattn's hot set binds one step's tables to the target "
                "model's forward, and a draft model's layers would run under them; serve "
                "without speculative decoding.")
        if vllm_config.parallel_config.use_ubatching:
            raise TierConfigError(
                "enable_dbo / ubatch_size: tierattn's hot set attends one batch per step, not "
                "micro-batches; serve without dual-batch overlap.")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise TierConfigError(
                f"tierattn's hot set serves models with one KV cache group (full attention in "
                f"every layer); this one has {len(kv_cache_config.kv_cache_groups)} (a hybrid "
                "or sliding-window model). Serve it without the hot set.")
        self.slots = host_slots(vllm_config, kv_cache_config)
        self.managers: list[HotSetManager] = []
        self.hot_worker = None
        self._stage = bool(extra.get("stage_cold", False))

    # -- scheduler side -------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.managers = [m for m in kv_cache_manager.coordinator.single_type_managers
                         if isinstance(m, HotSetManager)]
        for m in self.managers:
            m.set_host_slots(self.slots)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> HotSetMetadata:
        meta = HotSetMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for m in self.managers:
            for req_id, done in computed.items():
                m.reserve_copies(req_id, done + scheduled.get(req_id, 0))
                blocks = m.req_to_blocks.get(req_id)
                cold = m.cold_pages(req_id)
                if blocks and cold:
                    meta.cold[blocks[0].block_id] = cold
            meta.stores += m.take_pending()
        return meta

    def request_finished(self, request, block_ids):
        return False, None

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        config = self._vllm_config
        first = next(iter(kv_caches.values()))
        rank, engine = config.parallel_config.rank, self._kv_transfer_config.engine_id
        fingerprint = f"vllm-hot-{engine}-rank{rank}"
        if first.device.type == "cpu":
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            from .hotattn import CPUHotSetWorker

            isa = _get_attn_isa(config.model_config.dtype, first.shape[2], first.shape[3] // 2,
                                config.cache_config.cache_dtype)
            self.hot_worker = CPUHotSetWorker(self.tier, self.swap, kv_caches, self.slots,
                                              fingerprint=fingerprint, isa=isa,
                                              stage_cold=self._stage)
        else:
            from .hotworker import DeviceHotSetWorker

            self.hot_worker = DeviceHotSetWorker(self.tier, self.swap, kv_caches, self.slots,
                                                 fingerprint=fingerprint,
                                                 backend=self.swap.backend)

    def bind_connector_metadata(self, connector_metadata: HotSetMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.hot_worker is None:
            return
        # vLLM's V2 runner binds a step without tokens (one that only reports finished requests)
        # outside any forward context
        md = get_forward_context().attn_metadata if is_forward_context_available() else None
        self.hot_worker.begin_step(connector_metadata.stores, connector_metadata.cold,
                                   md if isinstance(md, dict) else None)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.hot_worker is not None:
            self.hot_worker.end_step()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        if self.hot_worker is not None:
            self.hot_worker.save(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self.hot_worker is not None:
            self.hot_worker.finish_step()

    def shutdown(self) -> None:
        if self.hot_worker is not None:
            self.hot_worker.close()
