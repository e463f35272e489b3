"""The scheduler half of tierattn in vLLM: which chunks of KV the tiers hold, and whether a hit
is worth loading.

:class:`TieredBlockManager` is vLLM's own ``CPUOffloadingManager`` -- its cache policy (LRU by
default: a finished request's prefix is evicted tail first, since a lookup stops at the first
miss), reference counts, KV events, ``touch()``, all-or-nothing ``prepare_store`` -- over the
slots of several tiers. A chunk's id names its tier: ids ``[0, c_1)`` are the first tier's
chunks, ``[c_1, c_1 + c_2)`` the second's, and so on (``c_i`` the tier's capacity in chunks),
and a new chunk takes the fastest tier with room. To that it adds:

* the cost model: under ``policy="auto"`` a lookup's whole hit is priced at once -- its chunks'
  loads from their tiers against prefilling its tokens, both measured -- and reported as none
  when prefilling is faster (:meth:`TieredBlockManager.worth_loading`);
* failed transfers (the workers report them; vLLM's offloading has no failed jobs): a failed
  store's chunks are dropped, a failed load's once their last reader completes;
* the counters of :class:`~tierattn.serving.swaptiers.SwapCounters` as ``vllm:tierattn_*`` metrics.

* the remote store (``SwapConfig.remote``: Mooncake Store, shared by engine instances): a key
  the tiers miss is asked there (every rank's copy must be there); a hit is loaded as a chunk
  of the ``"remote"`` kind, priced by the cost model like any tier, and read by the workers
  under its content key (:class:`TierLoadStoreSpec` carries the keys).

Documented differences from vLLM's CPU manager: ``policy="recompute"`` stores nothing; KV
events name ``Medium.CPU`` for every tier (disk included).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats)
from vllm.v1.kv_offload.base import (LoadStoreSpec, LookupResult, OffloadingEvent, OffloadKey,
                                     PrepareStoreOutput, ReqContext)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from tierattn.config import SwapConfig
from tierattn.serving.costmodel import CostModel
from tierattn.serving.swaptiers import SwapCounters
from tierattn.storage.remote import RemoteStore

__all__ = ["EXPLORE_EVERY", "METRIC", "TierLoadStoreSpec", "TieredBlockManager", "chunk_bounds",
           "remote_keys"]

#: under "auto", one declined load in this many is taken anyway, so the load fits stay measured
EXPLORE_EVERY = 16
#: prefix of tierattn's metrics (``llm.get_metrics()``, Prometheus)
METRIC = "vllm:tierattn_"


def remote_keys(namespace: str, key: OffloadKey, ranks: int) -> list[str]:
    """The remote store's keys of one chunk: one per tensor-parallel rank (each holds its
    shard of the heads)."""
    return [RemoteStore.key(namespace, key + r.to_bytes(2, "big")) for r in range(ranks)]


class TierLoadStoreSpec(CPULoadStoreSpec):
    """vLLM's CPU spec (chunk ids) plus each chunk's offload key, for the workers to name it
    in the remote store; chunk ids from ``remote_from`` on are chunks read from the remote
    store, not tier slots."""

    def __init__(self, chunk_ids: list[int], keys: list[OffloadKey], remote_from: int) -> None:
        super().__init__(chunk_ids)
        self.keys, self.remote_from = list(keys), remote_from


def chunk_bounds(capacities: Sequence[int], blocks_per_chunk: int) -> list[int]:
    """Chunk ids end per tier: chunk ``c`` is in the first tier ``i`` with ``c < bounds[i]``
    (the manager and the workers map ids to tier slots alike)."""
    return list(itertools.accumulate(c // blocks_per_chunk for c in capacities))


class TieredBlockManager(CPUOffloadingManager):
    """Chunks of vLLM's KV (by prefix key) in tierattn's tiers: vLLM's manager over the tiers'
    slots, with the cost model and failed transfers.

    Args:
        config: tiers and policy.
        capacities: slots per tier (vLLM blocks).
        blocks_per_chunk: vLLM blocks per stored chunk.
        tokens_per_chunk: tokens per stored chunk.
        chunk_bytes: bytes one worker moves per chunk (all layers).
        enable_events: emit KV events (vLLM's ``--kv-events-config``).
        cache_policy, store_threshold: as vLLM's CPU manager (``"lru"`` or ``"arc"``; offers a
            chunk needs before it is stored).
        remote: the remote store's client (``config.remote``), or None.
        namespace: the first part of the remote keys (the engine's model fingerprint).
        ranks: tensor-parallel ranks (each stores its shard under its own key).
    """

    def __init__(self, config: SwapConfig, capacities: Sequence[int], *, blocks_per_chunk: int,
                 tokens_per_chunk: int, chunk_bytes: int, enable_events: bool = False,
                 cache_policy: str = "lru", store_threshold: int = 0,
                 remote: RemoteStore | None = None, namespace: str = "", ranks: int = 1) -> None:
        self.bounds = chunk_bounds(capacities, blocks_per_chunk)
        super().__init__(num_chunks=self.bounds[-1], cache_policy=cache_policy,
                         enable_events=enable_events, store_threshold=store_threshold)
        self.config, self.policy = config, config.policy
        self.kinds = tuple(s.kind for s in config.tiers)
        self.bpc, self.tokens_per_chunk, self.chunk_bytes = (blocks_per_chunk, tokens_per_chunk,
                                                             chunk_bytes)
        self.capacities = list(capacities)
        self.remote, self.namespace, self.ranks = remote, namespace, ranks
        #: keys the remote store holds that this engine's tiers do not -> readers in flight
        self._remote: dict[OffloadKey, int] = {}
        #: keys whose remote load failed: never asked of the store again by this engine
        self._remote_refused: set[OffloadKey] = set()
        self._remote_faults = 0
        self.costs = CostModel(self.kinds + (("remote",) if remote is not None else ()))
        if config.calibration is not None:
            self.costs.load(config.calibration)
        self.counters = SwapCounters()
        self._reported = SwapCounters()
        self._failed: set[OffloadKey] = set()
        #: tiers of the chunks the current lookup of each request hit
        self._hits: dict[str, list[int]] = {}
        self._declines = 0

    def tier_of(self, chunk_id: int) -> int:
        """The swap tier (0: the fastest) chunk ``chunk_id`` lives in."""
        return bisect.bisect_right(self.bounds, chunk_id)

    def _kind(self, key: OffloadKey) -> str:
        return self.kinds[self.tier_of(self._policy.get(key).chunk_id)]

    def _get_load_store_spec(self, keys, chunks) -> TierLoadStoreSpec:
        return TierLoadStoreSpec([c.chunk_id for c in chunks], list(keys), self.bounds[-1])

    # --- slots: the fastest tier with room ---------------------------------------------------

    def _free_chunk(self, chunk: ChunkStatus) -> None:
        # the free list pops from its end: kept slowest tier first, each tier's most recently
        # freed chunk last
        bisect.insort(self._free_list, chunk.chunk_id, key=lambda c: -self.tier_of(c))

    def _allocate_chunks(self, keys: list[OffloadKey]) -> list[ChunkStatus]:
        out = []
        for _ in keys:
            fresh = self._num_allocated_chunks
            if fresh < self._num_chunks and (not self._free_list or self.tier_of(fresh) <=
                                             self.tier_of(self._free_list[-1])):
                self._num_allocated_chunks += 1
                out.append(ChunkStatus(fresh))
            else:
                out.append(ChunkStatus(self._free_list.pop()))
        return out

    def used_slots(self) -> dict[str, int]:
        """vLLM blocks held (or being written) per tier."""
        free = [0] * len(self.kinds)
        for c in self._free_list:
            free[self.tier_of(c)] += 1
        out, lo = {}, 0
        for i, hi in enumerate(self.bounds):
            taken = min(max(self._num_allocated_chunks - lo, 0), hi - lo)
            out[self.kinds[i]] = (taken - free[i]) * self.bpc
            lo = hi
        return out

    # --- decisions ----------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._failed:
            return LookupResult.MISS
        result = super().lookup(key, req_context)
        if result is LookupResult.HIT:
            self._hits.setdefault(req_context.req_id, []).append(
                self.tier_of(self._policy.get(key).chunk_id))
        elif result is LookupResult.MISS and self._in_remote(key):
            self._remote.setdefault(key, 0)
            self._hits.setdefault(req_context.req_id, []).append(len(self.kinds))
            return LookupResult.HIT
        return result

    def _in_remote(self, key: OffloadKey) -> bool:
        """Whether the remote store holds every rank's copy of ``key`` (not asked again for a
        key whose load from it failed)."""
        if self.remote is None or key in self._remote_refused:
            return False
        return key in self._remote or all(self.remote.contains(
            remote_keys(self.namespace, key, self.ranks)))

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> LoadStoreSpec:
        """vLLM's spec of the chunks to load, in ``keys`` order: the tiers' chunk ids, and for
        a chunk only the remote store holds an id past the tiers' (``remote_from`` on)."""
        keys = list(keys)
        local = [k for k in keys if k not in self._remote or self._policy.get(k) is not None]
        if len(local) == len(keys):
            return super().prepare_load(keys, req_context)
        ids = iter(super().prepare_load(local, req_context).chunk_ids.tolist() if local else ())
        out, extra = [], self.bounds[-1]
        for k in keys:
            if k in self._remote and self._policy.get(k) is None:
                self._remote[k] += 1
                out.append(extra)
                extra += 1
            else:
                out.append(next(ids))
        return TierLoadStoreSpec(out, keys, self.bounds[-1])

    def begin_lookup(self, req_id: str) -> None:
        """A request's prefix is about to be looked up (its hits are collected for
        :meth:`worth_loading`)."""
        self._hits[req_id] = []

    def worth_loading(self, req_id: str, tokens: int, past: int) -> bool:
        """Under ``"auto"``: whether loading the ``tokens`` tokens this lookup hit (after
        ``past`` tokens already in vLLM's cache) is predicted no slower than prefilling them.
        The whole hit is priced at once (vLLM loads a prefix or nothing past its first miss).
        True while a cost is unmeasured, and every :data:`EXPLORE_EVERY`-th time it would be
        False, so the load fits keep being measured."""
        tiers = self._hits.pop(req_id, [])
        if self.policy != "auto" or not tokens or not tiers:
            return True
        placement: dict[str, int] = {}
        kinds = self.kinds + ("remote",)
        for tier in tiers:
            placement[kinds[tier]] = placement.get(kinds[tier], 0) + self.chunk_bytes
        load = 0.0
        for kind, nbytes in placement.items():
            t = self.costs.transfer_s(kind, "load", nbytes)
            if t is None:
                return True
            load += t
        if self.costs.prefill.coef() is None or load <= self.costs.marginal_s(tokens, past):
            return True
        self._declines += 1
        if self._declines % EXPLORE_EVERY == 0:
            return True
        self.counters.declined_slots += len(tiers) * self.bpc
        return False

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        if self.policy == "recompute":
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]),
                                      evicted_keys=[])
        out = super().prepare_store(keys, req_context)
        if out is None:
            self.counters.no_room += 1
        else:
            self.counters.evicted_slots += len(out.evicted_keys) * self.bpc
        return out

    # --- completions and faults ---------------------------------------------------------------

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        keys = list(keys)
        pending = [k for k in keys if (c := self._policy.get(k)) is not None and not c.is_ready]
        bad = set(pending) if not success else {k for k in pending if k in self._failed}
        for k in pending:
            if k in bad:
                self.counters.store_faults += 1
            else:
                self.counters.count("store", self._kind(k), self.bpc, self.chunk_bytes)
        good = [k for k in keys if k not in bad]
        if good:
            super().complete_store(good, req_context, success=True)
        if bad:
            super().complete_store(list(bad), req_context, success=False)
        self._failed.difference_update(bad)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        remote = [k for k in keys if k in self._remote and self._policy.get(k) is None]
        for k in remote:
            if k in self._failed:
                self.counters.load_faults += 1
                self._failed.discard(k)
                self._remote.pop(k, None)
                self._remote_refused.add(k)  # prefilled from now on (stored anew if offered)
                continue
            self.counters.count("load", "remote", self.bpc, self.chunk_bytes)
            self._remote[k] -= 1
            if self._remote[k] <= 0:
                del self._remote[k]
        keys = [k for k in keys if k not in remote]
        if not keys:
            return
        super().complete_load(keys, req_context)
        for k in keys:
            chunk = self._policy.get(k)
            if k not in self._failed:
                self.counters.count("load", self._kind(k), self.bpc, self.chunk_bytes)
                continue
            self.counters.load_faults += 1
            if chunk.ref_cnt == 0:  # its last reader is done: the untrusted copy goes
                self._policy.remove(k)
                self._num_evictable_cache_chunks -= 1
                self._free_chunk(chunk)
                self._failed.discard(k)
                if self.events is not None:
                    self.events.append(OffloadingEvent(keys=[k], medium=self.medium,
                                                       removed=True))

    def mark_failed(self, keys: Collection[OffloadKey]) -> None:
        """The workers reported a failed transfer of ``keys``: their stored copies are not to
        be trusted (a miss from now on); they are dropped as their transfers complete."""
        self._failed.update(k for k in keys if self._policy.get(k) is not None or
                            k in self._remote)

    def reset_cache(self) -> None:
        """Forget every chunk: vLLM flushes in-flight jobs first and ignores their late
        completions."""
        super().reset_cache()
        self._failed.clear()
        self._hits.clear()
        self._remote.clear()
        self._remote_refused.clear()

    # --- measurements -------------------------------------------------------------------------

    def observe(self, transfers: Sequence[tuple[str, str, int, float]]) -> None:
        """Timed copies ``(kind, direction, bytes, seconds)`` the workers reported."""
        for kind, direction, nbytes, seconds in transfers:
            if kind in self.costs.kinds:
                self.costs.observe_transfer(kind, direction, nbytes, seconds)

    def get_stats(self) -> OffloadingConnectorStats:
        """vLLM's CPU-cache gauges, plus tierattn's counters since the last report (per tier)
        and the slots in use per tier."""
        out = super().get_stats()
        delta = self.counters.since(self._reported)
        self._reported = self.counters.copy()
        for name, value in delta.as_dict().items():
            if isinstance(value, dict):
                for kind, v in value.items():
                    if v:
                        out.increase_counter(METRIC + name, v, (kind,))
            elif value:
                out.increase_counter(METRIC + name, value)
        for kind, used in self.used_slots().items():
            out.set_gauge(METRIC + "used_slots", used, (kind,))
        if self.remote is not None:
            faults = sum(self.remote.codes.values())
            if faults > self._remote_faults:
                out.increase_counter(METRIC + "remote_faults", faults - self._remote_faults)
                self._remote_faults = faults
            out.set_gauge(METRIC + "remote_up", int(self.remote.up))
        return out

    def summary(self) -> dict:
        """Counters, slots in use and the cost model, as a dict (JSON-serialisable)."""
        return {**self.counters.as_dict(), "used_slots": self.used_slots(),
                "remote": self.remote.stats() if self.remote is not None else None,
                "capacities": dict(zip(self.kinds, self.capacities)),
                "policy": self.policy, "cost_model": self.costs.as_dict()}
