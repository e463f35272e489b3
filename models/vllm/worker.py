"""The worker half of tierattn in vLLM: blocks copied between vLLM's paged KV cache and the
tiers, in each worker process.

:class:`TieredBlockWorker` translates vLLM's jobs -- device blocks and the manager's chunk ids
-- into the swap core's copies (:class:`~tierattn.serving.swaptiers.SwapTiers`: one batched copy per
tier and layer; synchronous on CPU, a copy stream on CUDA; disk pages are checksummed pages in
a segment file that validate on read; host tiers grow as blocks arrive). A failed store or
load -- a full disk, an I/O error, a corrupted page, a host tier that cannot grow -- is
reported, never a wrong token: the connector turns it into dropped chunks and a recompute.

With a remote store (``SwapConfig.remote``), a stored chunk is also put there under its content
key once its copy landed, read from the host tier that holds it (this rank's shard of the
heads: ``[blocks, layers, K/V, tokens, heads x dim]`` bytes), and
a chunk the manager found only there is read from it straight into vLLM's blocks; a chunk the
store lacks, or whose checksum fails, fails the load (recomputed).
"""

from __future__ import annotations

import bisect
import logging
import time
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
from tierattn.storage.remote import RemoteStore

from .manager import TierLoadStoreSpec, chunk_bounds, remote_keys

__all__ = ["TieredBlockWorker"]

#: a warning per failed transfer (its chunks are dropped and recomputed)
logger = logging.getLogger("tierattn.vllm")


@dataclass
class _Job:
    tickets: list
    result: TransferResult
    failed: bool = False
    #: chunks to put into the remote store once the copies landed (:meth:`_whole_chunks`)
    remote: list | None = None


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
        remote: the remote store's client (``config.remote``), or None.
        namespace: the first part of the remote keys (the model fingerprint the manager uses).
        rank: this worker's tensor-parallel rank (its shard's key).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, config: SwapConfig, capacities: Sequence[int],
                 *, tokens_per_block: int, blocks_per_chunk: int, dtype: torch.dtype,
                 fingerprint: str, remote: RemoteStore | None = None, namespace: str = "",
                 rank: int = 0) -> None:
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
        self.pools = pools
        self.remote, self.namespace, self.rank = remote, namespace, rank
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

    def _flat(self, device_spec: GPULoadStoreSpec, spec: CPULoadStoreSpec) -> list[tuple]:
        """``(chunk id, block in chunk)`` of each engine block of the job, in order."""
        size = int(device_spec.group_sizes[0]) if len(device_spec.group_sizes) else 0
        skip = int(device_spec.block_indices[0]) % self.bpc if size else 0
        return [(c, j) for c in spec.chunk_ids.tolist() for j in range(self.bpc)][skip:skip + size]

    def _blocks(self, device_spec: GPULoadStoreSpec, spec: CPULoadStoreSpec):
        """``(tier, tier slots, engine blocks, first tokens)`` per tier the job touches (tier
        None: chunks read from the remote store, slots their ``(chunk id, block)``)."""
        size = int(device_spec.group_sizes[0]) if len(device_spec.group_sizes) else 0
        remote_from = getattr(spec, "remote_from", None)
        flat = []
        for c, j in self._flat(device_spec, spec):
            if remote_from is not None and c >= remote_from:
                flat.append((None, (c, j)))
            else:
                tier, slots = self._slots(c)
                flat.append((tier, slots[j]))
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
        for tier, idx in sorted(by_tier.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            sel = torch.tensor(idx)
            slots = [flat[i][1] for i in idx] if tier is None else \
                torch.tensor([flat[i][1] for i in idx])
            out.append((tier, slots, blocks[sel], starts[sel]))
        return out

    # --- the remote store -----------------------------------------------------------------

    def _remote_key(self, key: bytes) -> str:
        return remote_keys(self.namespace, key, self.rank + 1)[self.rank]

    def _whole_chunks(self, device_spec: GPULoadStoreSpec, spec: TierLoadStoreSpec) -> list:
        """``(remote key, tier, tier slots, first tokens)`` of each chunk the store job wrote
        whole (a partial chunk is not put: its key names all of its blocks)."""
        keys = dict(zip(spec.chunk_ids.tolist(), spec.keys))
        first = int(device_spec.block_indices[0]) if len(device_spec.block_indices) else 0
        starts: dict[int, list[int]] = {}
        for i, (c, _) in enumerate(self._flat(device_spec, spec)):
            starts.setdefault(c, []).append((first + i) * self.tokens_per_block)
        out = []
        for c, s in starts.items():
            if len(s) == self.bpc:
                tier, slots = self._slots(c)
                out.append((self._remote_key(keys[c]), tier, list(slots), s))
        return out

    def _put_remote(self, chunks: list) -> None:
        """Put landed chunks into the remote store, read from the host tier that holds them
        (no device read; best effort: the tiers hold them, a failed put is counted by the
        store). Payload: ``[blocks, layers, *page]`` bytes, as :meth:`_get_remote` reads."""
        t0 = time.perf_counter()
        payloads = [torch.stack([self.tiers[tier].read(layer, slots, starts)
                                 for layer in range(len(self.pools))], dim=1).contiguous()
                    for _, tier, slots, starts in chunks]
        views = [p.view(torch.uint8).numpy().data for p in payloads]
        if all(self.remote.put([k for k, *_ in chunks], views)):
            self.transfers.append(("remote", "store", sum(v.nbytes for v in views),
                                   time.perf_counter() - t0))

    def _get_remote(self, spec: TierLoadStoreSpec, entries: list[tuple[int, int]],
                    blocks: torch.Tensor) -> int:
        """Read ``entries`` (chunk id, block in chunk) from the remote store into the engine
        ``blocks`` (one copy per layer); raises :class:`KVIOError` for a chunk the store cannot
        give back."""
        t0 = time.perf_counter()
        keys = dict(zip(spec.chunk_ids.tolist(), spec.keys))
        ids = sorted({c for c, _ in entries})
        got = self.remote.get([self._remote_key(keys[c]) for c in ids])
        missing = [c for c, g in zip(ids, got) if g is None]
        if missing:
            raise KVIOError(f"the remote store could not give back {len(missing)} of "
                            f"{len(ids)} chunks (missing, corrupted or the store is down)")
        shape = (self.bpc, len(self.pools), *self.pools[0].shape[1:])
        data = {c: torch.frombuffer(bytearray(g), dtype=torch.uint8).view(
            self.pools[0].dtype).view(shape) for c, g in zip(ids, got)}
        rows = torch.stack([data[c][j] for c, j in entries])  # [n, layers, *page]
        idx = blocks.to(self.pools[0].device)
        for layer, pool in enumerate(self.pools):
            pool.index_copy_(0, idx, rows[:, layer].to(pool.device, non_blocking=True))
        self.transfers.append(("remote", "load", rows.numel() * rows.element_size(),
                               time.perf_counter() - t0))
        return rows.numel() * rows.element_size()

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
                if tier is None:  # only the remote store holds these chunks
                    if self.remote is None or not isinstance(spec, TierLoadStoreSpec):
                        raise UnsupportedEngineError("a load names remote chunks but this "
                                                     "worker has no remote store")
                    self._get_remote(spec, slots, blocks)
                elif store:
                    written.append((tier, slots))
                    job.tickets += self.swap.copy(HOT, blocks, starts, tier, slots, timed)
                else:
                    job.tickets += self.swap.copy(tier, slots, starts, HOT, blocks, timed)
            if store and self.remote is not None and isinstance(spec, TierLoadStoreSpec):
                job.remote = self._whole_chunks(device_spec, spec)  # put once they land
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
            if job.remote and not job.failed:  # its slots stay reserved until vLLM hears of it
                self._put_remote(job.remote)
            out.append(self._jobs.pop(self._done.popleft()).result)
        return out

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            for t in job.tickets if job is not None else ():
                t.synchronize()

    def shutdown(self) -> None:
        self.swap.close()
        if self.remote is not None:
            self.remote.close()


def _landed(ticket) -> bool:
    return ticket is None or not hasattr(ticket, "query") or ticket.query()
