"""The worker half of tierattn in vLLM: blocks copied between vLLM's paged KV cache and the
tiers, in each worker process.

:class:`TieredBlockWorker` translates vLLM's jobs -- device blocks and the manager's chunk ids
-- into the swap core's copies (:class:`~tierattn.serving.swaptiers.SwapTiers`: one batched copy per
tier and layer; synchronous on CPU, a copy stream on CUDA; disk pages are checksummed pages in
a segment file that validate on read; host tiers grow as blocks arrive). A failed store or
load -- a full disk, an I/O error, a corrupted page, a host tier that cannot grow -- is
reported, never a wrong token: the connector turns it into dropped chunks and a recompute.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, OffloadingWorker,
                                     TransferResult)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from tierattn.config import SwapConfig
from tierattn.errors import KVFileError, KVIOError, TierAttnError, UnsupportedEngineError
from tierattn.storage.pagemap import HOT
from tierattn.serving.swaptiers import SwapTiers

from .manager import chunk_bounds

__all__ = ["TieredBlockWorker"]

#: a warning per failed transfer (its chunks are dropped and recomputed)
logger = logging.getLogger("tierattn.vllm")


@dataclass
class _Job:
    tickets: list
    result: TransferResult
    failed: bool = False


class TieredBlockWorker(OffloadingWorker):
    """Copies vLLM blocks to and from the tiers.

    Args:
        kv_caches: vLLM's KV cache as byte views ``(num_blocks, page_bytes)`` per layer.
        config: tiers (their capacities come from ``capacities``).
        capacities: slots per tier, as the manager counts them.
        tokens_per_block: vLLM's block size (a disk page records its first token).
        blocks_per_chunk: blocks per stored chunk.
        dtype: the KV dtype (pages are copied bitwise; the dtype only sizes them).
        fingerprint: names this engine's disk files (unique per engine and rank).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, config: SwapConfig, capacities: Sequence[int],
                 *, tokens_per_block: int, blocks_per_chunk: int, dtype: torch.dtype,
                 fingerprint: str) -> None:
        if len(kv_caches.group_data_refs) != 1:
            raise UnsupportedEngineError(
                f"tierattn's vLLM connector supports one KV-cache group (full attention in "
                f"every layer); this model has {len(kv_caches.group_data_refs)} (sliding-window "
                "or hybrid layers). Serve it without tierattn's connector.")
        self.layers = [ref.tensor_idx for ref in kv_caches.group_data_refs[0]]
        page_bytes = {kv_caches.tensors[i].page_size_bytes for i in self.layers}
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(page_bytes) != 1 or next(iter(page_bytes)) % (2 * tokens_per_block * itemsize):
            raise UnsupportedEngineError(
                f"tierattn's vLLM connector needs one page size across layers, a whole number "
                f"of {dtype} K and V rows per token; got page sizes {sorted(page_bytes)} B.")
        page = next(iter(page_bytes))
        width = page // (2 * tokens_per_block * itemsize)
        # a page is copied bitwise; [2, T, 1, H*D] only sizes it (disk files record T)
        pools = [kv_caches.tensors[i].tensor[:, :page].view(dtype).view(
            -1, 2, tokens_per_block, 1, width) for i in self.layers]
        self.swap = SwapTiers(config, pools, capacities=capacities, fingerprint=fingerprint)
        self.tiers, self.device = self.swap.tiers, self.swap.device
        self.tokens_per_block, self.bpc = tokens_per_block, blocks_per_chunk
        self.bounds = [0] + chunk_bounds(capacities, blocks_per_chunk)
        self.block_bytes = self.swap.slot_bytes
        self._jobs: dict[int, _Job] = {}
        self._done: deque[int] = deque()
        #: ``(kind, direction, bytes, seconds)`` of finished copies, for the manager's costs
        self.transfers: list[tuple[str, str, int, float]] = []
        #: failed jobs not yet reported to the manager / loads not yet reported to vLLM
        self.failed_jobs: set[int] = set()
        self.failed_loads: set[int] = set()
        if config.policy == "auto" and config.calibration is None:
            self.swap.calibrate(lambda *t: self.transfers.append(t), probe_slots=8)

    # --- copies ---------------------------------------------------------------------------

    def _slots(self, chunk_id: int) -> tuple[int, range]:
        """The tier (1: the fastest swap tier) and tier slots of chunk ``chunk_id``."""
        tier = bisect.bisect_right(self.bounds, chunk_id)  # as the manager's tier_of, + 1
        first = (chunk_id - self.bounds[tier - 1]) * self.bpc
        return tier, range(first, first + self.bpc)

    def _blocks(self, device_spec: GPULoadStoreSpec, spec: CPULoadStoreSpec):
        """``(tier, tier slots, engine blocks, first tokens)`` per tier the job touches."""
        size = int(device_spec.group_sizes[0]) if len(device_spec.group_sizes) else 0
        skip = int(device_spec.block_indices[0]) % self.bpc if size else 0
        flat = [(tier, s) for c in spec.chunk_ids.tolist()
                for tier, slots in (self._slots(c),) for s in slots][skip:skip + size]
        if len(flat) != size:
            raise UnsupportedEngineError(
                f"a transfer of {size} blocks got {len(flat)} tier slots; the manager and the "
                "workers disagree on blocks per chunk.")
        blocks = torch.as_tensor(device_spec.block_ids[:size], dtype=torch.long)
        first = int(device_spec.block_indices[0]) if size else 0
        starts = (torch.arange(size) + first) * self.tokens_per_block
        by_tier: dict[int, list[int]] = {}
        for i, (tier, _) in enumerate(flat):
            by_tier.setdefault(tier, []).append(i)
        out = []
        for tier, idx in sorted(by_tier.items()):
            sel = torch.tensor(idx)
            out.append((tier, torch.tensor([flat[i][1] for i in idx]), blocks[sel], starts[sel]))
        return out

    def _run(self, job_id: int, device_spec: GPULoadStoreSpec, spec: CPULoadStoreSpec,
             store: bool) -> bool:
        result = TransferResult(job_id, True, 0, 0.0)
        job = _Job([], result)
        self._jobs[job_id] = job
        written: list[tuple[int, torch.Tensor]] = []

        def timed(kind: str, direction: str, nbytes: int, seconds: float) -> None:
            self.transfers.append((kind, direction, nbytes, seconds))
            if not job.failed:  # a later tier's failure voids the job's figures
                result.transfer_size += nbytes
                result.transfer_time += seconds

        try:
            for tier, slots, blocks, starts in self._blocks(device_spec, spec):
                if store:
                    written.append((tier, slots))
                    job.tickets += self.swap.copy(HOT, blocks, starts, tier, slots, timed)
                else:
                    job.tickets += self.swap.copy(tier, slots, starts, HOT, blocks, timed)
        except (OSError, TierAttnError) as e:  # a full disk, an I/O error, a corrupt file
            job.failed = True
            self.failed_jobs.add(job_id)
            if not store:
                self.failed_loads.add(job_id)
            result.transfer_size = result.transfer_time = None
            for tier, slots in written:  # no slot of a half-written chunk reads as a page
                self.swap.forget(tier, slots.tolist())
            logger.warning(
                "%s job %d failed (%s); its chunks are dropped and recomputed.",
                "store" if store else "load", job_id,
                e if isinstance(e, (KVIOError, KVFileError)) else repr(e))
        self._done.append(job_id)
        return True  # vLLM asserts submissions succeed; failures travel in the metadata

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: CPULoadStoreSpec) -> bool:
        return self._run(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: CPULoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._run(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        """Jobs whose copies landed, in submission order. (On CUDA a job's timing joins its
        result if its end event completed by then; the cost model gets every timing.)"""
        self.swap.watch.poll()
        out = []
        while self._done:
            job = self._jobs[self._done[0]]
            if any(not _landed(t) for t in job.tickets):
                break
            self.swap.watch.poll()
            out.append(self._jobs.pop(self._done.popleft()).result)
        return out

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            for t in job.tickets if job is not None else ():
                t.synchronize()

    def shutdown(self) -> None:
        self.swap.close()


def _landed(ticket) -> bool:
    return ticket is None or not hasattr(ticket, "query") or ticket.query()
