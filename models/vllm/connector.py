"""The connector half of tierattn in vLLM: the offloading spec and connector vLLM loads.

vLLM's V1 scheduler preempts by recompute only: a victim's blocks are freed and its tokens
prefilled again when it is readmitted. Its offloading framework (``vllm.v1.kv_offload``) stores
blocks, keyed by their prefix hash, into an external medium as requests compute them, and
turns a later prefill of the same prefix into a load: a preempted request's restart and a
returning conversation become a load instead of a recompute. tierattn gives that framework its
tiers and cost model:

* :class:`TierattnOffloadingSpec` builds the manager (scheduler process) and the worker (each
  worker process) from the same configuration, so both count the same slots;
* :class:`TierattnOffloadingConnector` is vLLM's ``OffloadingConnector`` plus the two things its
  framework lacks, carried in the per-step worker metadata (:class:`TierWorkerMetadata`):
  transfer failures (a failed load becomes vLLM's ``failed_recving`` and, with
  ``kv_load_failure_policy="recompute"``, a recompute) and timings (every transfer per tier and
  direction, every step's forward time with its token counts) feeding the manager's cost model.

The private vLLM attributes read here are listed in
:data:`tierattn.models.vllm.config.VLLM_INTERNALS` and checked when an engine starts.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector)
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (CanonicalKVCaches, OffloadingCounterMetadata,
                                     OffloadingGaugeMetadata, OffloadingSpec)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from tierattn.errors import TierConfigError
from tierattn.serving.costmodel import attention_work
from tierattn.serving.swaptiers import SwapCounters, swap_capacities
from tierattn.storage.remote import RemoteStore, RemoteStoreError

from .config import ENGINE_BLOCKS, check_vllm, swap_config
from .manager import METRIC, TieredBlockManager
from .worker import TieredBlockWorker

__all__ = ["TierWorkerMetadata", "TierattnOffloadingConnector", "TierattnOffloadingSpec"]

logger = logging.getLogger("tierattn.vllm")

#: what each of tierattn's metrics counts (:class:`~tierattn.serving.swaptiers.SwapCounters`)
_COUNTED = {
    "stored_slots": "vLLM blocks stored into a tierattn tier.",
    "loaded_slots": "vLLM blocks loaded from a tierattn tier.",
    "stored_bytes": "Bytes stored into a tierattn tier (per worker).",
    "loaded_bytes": "Bytes loaded from a tierattn tier (per worker).",
    "evicted_slots": "Stored blocks evicted (least recently used) to make room.",
    "declined_slots": "Stored blocks prefilled because recomputing them was predicted faster "
                      "than loading them.",
    "store_faults": "Chunks whose store failed (dropped).",
    "load_faults": "Chunks whose load failed (recomputed).",
    "no_room": "Stores refused: every slot was being read or written.",
}


class TierattnOffloadingSpec(OffloadingSpec):
    """vLLM's offloading spec for tierattn's tiers."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict:
        defs = CPUOffloadingSpec.build_metric_definitions(extra_config)
        per_kind = set(SwapCounters.PER_KIND)
        for name, doc in _COUNTED.items():
            defs[METRIC + name] = OffloadingCounterMetadata(
                documentation=doc, labelnames=("tier",) if name in per_kind else ())
        defs[METRIC + "used_slots"] = OffloadingGaugeMetadata(
            documentation="Slots (vLLM blocks) in use per tierattn tier.", labelnames=("tier",))
        defs[METRIC + "remote_faults"] = OffloadingCounterMetadata(
            documentation="Remote store calls that failed or ran past their deadline "
                          "(tierattn.storage.remote).", labelnames=())
        defs[METRIC + "remote_up"] = OffloadingGaugeMetadata(
            documentation="1 while the remote store answers, 0 while it is skipped.",
            labelnames=())
        return defs

    def __init__(self, config) -> None:
        super().__init__(config)
        check_vllm()
        if ENGINE_BLOCKS not in self.extra_config:
            raise TierConfigError(
                "TierattnOffloadingSpec runs under TierattnOffloadingConnector; write the "
                "kv_transfer_config with tierattn.vllm_kv_transfer_config().")
        self.swap = swap_config(dict(self.extra_config))
        self.block_bytes = config.worker_kv_bytes_per_block
        self.capacities = swap_capacities(
            self.swap.tiers, self.block_bytes, int(self.extra_config[ENGINE_BLOCKS]),
            workers=int(config.parallel.world_size), pinned=current_platform.is_cuda())
        self._manager: TieredBlockManager | None = None
        self._worker: TieredBlockWorker | None = None
        self.ranks = int(config.parallel.world_size)

    def namespace(self) -> str:
        """The remote keys' first part: ``RemoteConfig.namespace``, or a fingerprint of what
        the bytes are -- the model's name, dtype, block geometry and tensor-parallel size --
        so that only instances serving the same model share blocks."""
        if self.swap.remote is not None and self.swap.remote.namespace:
            return self.swap.remote.namespace
        what = (f"{self.config.model.name}|{self.config.model.dtype}|"
                f"{self.tokens_per_block[0] * self.blocks_per_chunk}|{self.block_bytes}|"
                f"{self.ranks}")
        return "vllm-" + hashlib.sha256(what.encode()).hexdigest()[:16]

    def _remote(self) -> RemoteStore | None:
        """A client of the remote store, or None without one -- and when the store does not
        answer at start: the engine serves from its own tiers (a warning says why)."""
        if self.swap.remote is None:
            return None
        try:
            return RemoteStore(self.swap.remote)
        except RemoteStoreError as e:
            logger.warning("tierattn: no remote store (%s); serving from the local tiers.", e)
            return None

    def get_manager(self) -> TieredBlockManager:
        if self._manager is None:
            bpc = self.blocks_per_chunk
            self._manager = TieredBlockManager(
                self.swap, self.capacities, blocks_per_chunk=bpc,
                tokens_per_chunk=self.tokens_per_block[0] * bpc,
                chunk_bytes=self.block_bytes * bpc,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                cache_policy=self.extra_config.get("eviction_policy", "lru"),
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                remote=self._remote(), namespace=self.namespace(), ranks=self.ranks)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> TieredBlockWorker:
        if self._worker is None:
            dtype = getattr(torch, str(self.config.model.dtype).removeprefix("torch."))
            fingerprint = f"vllm-{self.config.engine_id}-rank{self.config.parallel.rank}"
            self._worker = TieredBlockWorker(
                kv_caches, self.swap, self.capacities, tokens_per_block=self.tokens_per_block[0],
                blocks_per_chunk=self.blocks_per_chunk, dtype=dtype,
                fingerprint=fingerprint.replace("/", "_"), remote=self._remote(),
                namespace=self.namespace(), rank=int(self.config.parallel.rank))
        return self._worker


@dataclass
class TierWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's per-step worker metadata plus what tierattn's manager needs: failed jobs,
    timed transfers and the steps this report closes."""

    failed_jobs: dict[int, int] = field(default_factory=dict)
    transfers: list = field(default_factory=list)
    steps: list = field(default_factory=list)

    def aggregate(self, other):
        base = super().aggregate(other)
        failed = dict(self.failed_jobs)
        for j, v in getattr(other, "failed_jobs", {}).items():
            failed[j] = failed.get(j, 0) + v
        return TierWorkerMetadata(
            completed_jobs=base.completed_jobs, transfer_stats=base.transfer_stats,
            failed_jobs=failed, transfers=self.transfers + list(getattr(other, "transfers", [])),
            steps=sorted(set(self.steps) | set(getattr(other, "steps", []))))


class TierattnOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` over :class:`TierattnOffloadingSpec`, with failed
    transfers turned into recomputes and every transfer and step timed for the cost model."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra[ENGINE_BLOCKS] = int(kv_cache_config.num_blocks)
        super().__init__(vllm_config, role, kv_cache_config)
        self._step = 0
        self._workers = max(1, int(vllm_config.parallel_config.world_size))
        self._cpu = current_platform.is_cpu()
        #: scheduler side: step -> (start, query tokens, KV tokens, pairs, decode only)
        self._steps: dict[int, tuple] = {}
        self._worker_step: int | None = None

    # --- scheduler side -------------------------------------------------------------------

    @property
    def manager(self) -> TieredBlockManager | None:
        """tierattn's manager (None under another spec's manager: the connector then adds
        nothing to vLLM's, which is how vLLM's own connector tests run it)."""
        manager = self.scheduler.manager
        return manager if isinstance(manager, TieredBlockManager) else None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """vLLM's prefix lookup, then (``"auto"``) the whole hit priced at once: loading it
        from its tiers against prefilling its tokens; a hit not worth loading is reported as
        none, and the tokens are prefilled."""
        if self.manager is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        self.manager.begin_lookup(request.request_id)
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        # always asked, so the lookup's record is dropped whatever the hit
        worth = self.manager.worth_loading(request.request_id, hit or 0, num_computed_tokens)
        if hit and not worth:
            state = self.scheduler._req_status[request.request_id]
            state.partial_tail_boundary = None
            state.update_num_hit_chunks(num_computed_tokens)
            return 0, False
        return hit, is_async

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        self._step += 1
        meta.tierattn_step = self._step
        rows = []
        for req in scheduler_output.scheduled_new_reqs:
            rows.append((scheduler_output.num_scheduled_tokens.get(req.req_id, 0),
                         req.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for rid, past in zip(cached.req_ids, cached.num_computed_tokens):
            rows.append((scheduler_output.num_scheduled_tokens.get(rid, 0), past))
        rows = [(q, p) for q, p in rows if q > 0]
        if rows:
            self._steps[self._step] = (time.perf_counter(), sum(q for q, _ in rows),
                                       sum(q + p for q, p in rows),
                                       sum(attention_work(q, p) for q, p in rows),
                                       all(q == 1 for q, _ in rows))
        return meta

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, TierWorkerMetadata) and self.manager is not None:
            now = time.perf_counter()
            jobs = self.scheduler._jobs
            self.manager.mark_failed({k for j in meta.failed_jobs if j in jobs
                                      for k in jobs[j].keys})
            self.manager.observe(meta.transfers)
            # copies on the CPU platform run synchronously inside the step (workers in
            # parallel): not its forward; on CUDA they overlap it on a copy stream
            moved = sum(s for *_, s in meta.transfers) / self._workers if self._cpu else 0.0
            for step in meta.steps:
                entry = self._steps.pop(step, None)
                if entry is not None:  # synchronous copies ran inside the step: not its forward
                    start, q, kv, pairs, decode = entry
                    seconds = now - start - moved
                    if seconds > 0:
                        self.manager.costs.observe_batch(q, kv, pairs, seconds, decode=decode)
            for stale in [s for s in self._steps if s < min(meta.steps or [0]) - 64]:
                del self._steps[stale]
        super().update_connector_output(connector_output)

    # --- worker side ----------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker_step = getattr(connector_metadata, "tierattn_step", None)

    def get_transfer_results(self, finished_req_ids: set[str]):
        worker = self.connector_worker
        loads = dict(worker._load_jobs) if worker is not None else {}
        results = super().get_transfer_results(finished_req_ids)
        tiered = worker.worker if worker is not None else None
        if tiered is not None:  # loads that finished in this call and failed
            done = {j for j in tiered.failed_loads if j in loads and j not in worker._load_jobs}
            tiered.failed_loads -= done | {j for j in tiered.failed_loads if j not in loads}
            results.failed_recving |= {loads[j] for j in done}
        return results

    def build_connector_worker_meta(self):
        base = super().build_connector_worker_meta() or OffloadingWorkerMetadata()
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        meta = TierWorkerMetadata(completed_jobs=base.completed_jobs,
                                  transfer_stats=base.transfer_stats)
        if worker is not None:
            meta.failed_jobs = {j: 1 for j in worker.failed_jobs}
            worker.failed_jobs.clear()
            meta.transfers, worker.transfers = worker.transfers, []
        if self._worker_step is not None:
            meta.steps = [self._worker_step]
            self._worker_step = None
        return meta

