"""The swap core: preempted sequences' KV kept in tierattn's tiers, engine-neutral.

When a serving engine runs out of KV blocks it preempts a sequence. tierattn keeps that
sequence's KV in its tiers instead of dropping it, when keeping it is cheaper:

* :class:`SwapStore` sees the engine's KV cache as a pool of slots ``[N, 2, T, H_kv, D]`` (an
  engine block, or an equal share of one) and a request's KV as a list of slots. ``store``
  copies them into the first tiers with room -- DDR, CXL (pinned on CUDA), then disk -- one
  copy launch per tier through the :class:`~tierattn.mover.Mover`, all or nothing; ``load``
  copies them back into the slots the engine allocated when the request resumes, and frees
  the tiers' slots.
* :class:`Swapper` decides, per victim: swap when the measured store + load time is below the
  measured recompute time (``policy="auto"``, :mod:`tierattn.costmodel`), or always / never
  (``"swap"`` / ``"recompute"``). A request that finds every tier full, or whose store or load
  fails (a full disk, an I/O error, a corrupted file), is recomputed instead: never a failed
  request, never a half-restored one. Every decision is logged with its predicted and
  measured costs, so the model can be checked.

Engine adapters (``tierattn.models.continuous`` for transformers' continuous batching) only
translate the engine's calls into these. A tier here is a cache of the running process: its
slots and files live as long as the store.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from tierattn.config import TierSpec, parse_tiers
from tierattn.costmodel import CostModel, Stopwatch, attention_work
from tierattn.errors import (KernelInputError, KVCapacityError, KVFileError, KVIOError,
                             TierConfigError)
from tierattn.kernels._common import FLOAT_DTYPES
from tierattn.mover import Mover
from tierattn.pagemap import HOT
from tierattn.telemetry import Telemetry
from tierattn.tiers import MemoryTier, build_tier
from tierattn.transfer import TransferEngine, default_engine

__all__ = ["Decision", "SwapConfig", "SwapLog", "SwapStore", "Swapper"]

Policy = Literal["auto", "swap", "recompute"]
POLICIES = ("auto", "swap", "recompute")
#: one INFO line per decision (``tierattn serve`` shows them)
logger = logging.getLogger("tierattn.swap")
SWAP_TIER_KINDS = ("ddr", "cxl", "disk")
#: default disk capacity, in KV pools: a disk tier is not allocated up front
DISK_POOLS = 4
#: decisions a log keeps, with their costs
DECISIONS_KEPT = 10_000


@dataclass(frozen=True)
class SwapConfig:
    """Where preempted sequences' KV goes, and when.

    Attributes:
        tiers: fastest first, kinds ``"ddr"``, ``"cxl"``, ``"disk"`` (a name or a
            :class:`~tierattn.config.TierSpec`; a disk tier needs ``path``). A full tier spills
            into the next; when every tier is full the request is recomputed. Capacities:
            ``capacity_gib`` (or ``capacity_pages``, in swap slots); by default DDR and CXL
            hold as much as the engine's KV pool, disk four times that (at most 90% of the
            folder's free space).
        policy: ``"auto"`` swaps a victim when the measured store + load time is below the
            measured time to prefill its tokens again, ``"swap"`` whenever a tier has room,
            ``"recompute"`` never (the engines' default).
        calibration: a calibration file (:meth:`~tierattn.costmodel.CostModel.save`, written
            by ``tierattn bench --serving``) whose transfer costs stand until this run has
            measured its own; None probes each tier when the store is built (``"auto"``).
        probe_slots: slots per calibration probe (probes of 1 and of this many slots, three
            times each).
        backend: the page-copy kernel's backend (``"auto"``, ``"triton"``, ``"torch"``).
    """

    tiers: tuple[TierSpec | str, ...] = ("ddr",)
    policy: Policy = "auto"
    calibration: str | os.PathLike | None = None
    probe_slots: int = 8
    backend: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", parse_tiers(self.tiers, knob="SwapConfig.tiers",
                                                      kinds=SWAP_TIER_KINDS))
        if self.policy not in POLICIES:
            raise TierConfigError(f"SwapConfig.policy: {self.policy!r} is not one of "
                                  f"{POLICIES}.")
        if self.calibration is not None and not Path(self.calibration).is_file():
            raise TierConfigError(f"SwapConfig.calibration: {str(self.calibration)!r} is not a "
                                  "file; give a calibration JSON or None to measure at start.")
        if isinstance(self.probe_slots, bool) or not isinstance(self.probe_slots, int) or \
                self.probe_slots < 1:
            raise TierConfigError(f"SwapConfig.probe_slots: must be an int >= 1, got "
                                  f"{self.probe_slots!r}.")
        if self.backend not in ("auto", "triton", "torch"):
            raise TierConfigError(f"SwapConfig.backend: {self.backend!r} is not one of "
                                  "('auto', 'triton', 'torch').")


@dataclass
class _Entry:
    """Where a stored request's slots are: ``(tier, tier slots, first position)`` per tier."""

    parts: list[tuple[int, list[int], int]]
    count: int


class SwapStore:
    """A request's KV slots kept in the tiers while it is preempted, by request id.

    Args:
        config: the tiers and their capacities.
        pool: ``[N, 2, T, H_kv, D]`` the engine's KV cache on its device, viewed as slots (a
            view: stores read it, loads write it).
        engine: the transfer engine (default: a copy stream on CUDA, synchronous on CPU).
    """

    def __init__(self, config: SwapConfig, pool: torch.Tensor, *,
                 engine: TransferEngine | None = None) -> None:
        if not isinstance(pool, torch.Tensor) or pool.dim() != 5 or pool.shape[1] != 2 or \
                pool.dtype not in FLOAT_DTYPES:
            raise KernelInputError(
                "SwapStore: pool must be the engine's KV viewed as [N, 2, T, H_kv, D] in a "
                f"float dtype, got {getattr(pool, 'shape', pool)!r}.")
        self.config, self.pool, self.device = config, pool, pool.device
        page_shape = tuple(pool.shape[1:])
        self.slot_bytes = pool[0].numel() * pool.element_size()
        #: files of a disk tier are named under this, unique to the store
        self.fingerprint = f"swap-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        tiers = [MemoryTier.over("hbm", pool.unsqueeze(0))]
        for spec in config.tiers:
            cap = spec.capacity(self.slot_bytes)
            if cap is None:
                cap = self._default_capacity(spec, pool.shape[0])
            tiers.append(build_tier(spec, num_layers=1, capacity=cap, page_shape=page_shape,
                                    dtype=pool.dtype, device=self.device,
                                    fingerprint=self.fingerprint))
        self.tiers = tiers
        self.telemetry = Telemetry(1, tier_kinds=tuple(t.kind for t in tiers),
                                   page_bytes=self.slot_bytes)
        engine = engine or default_engine(self.device, None if config.backend == "auto"
                                          else config.backend)
        self.mover = Mover(tiers, None, engine, self.telemetry, self.device)
        self.watch = Stopwatch(self.device)
        self.entries: dict[str, _Entry] = {}

    def _default_capacity(self, spec: TierSpec, pool_slots: int) -> int:
        if spec.kind != "disk":
            return pool_slots
        Path(spec.path).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(spec.path).free
        return min(DISK_POOLS * pool_slots, int(0.9 * free) // self.slot_bytes)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The swap tiers' kinds, fastest first."""
        return tuple(t.kind for t in self.tiers[1:])

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.entries

    def free_slots(self) -> dict[str, int]:
        return {t.kind: t.num_free(0) for t in self.tiers[1:]}

    def plan(self, n: int) -> list[tuple[int, int]] | None:
        """``(tier, slots)`` a store of ``n`` slots would fill, fastest tier first; None when
        the tiers together have no room for them."""
        out, left = [], n
        for t in range(1, len(self.tiers)):
            k = min(left, self.tiers[t].num_free(0))
            if k:
                out.append((t, k))
                left -= k
        return None if left else out

    def placement(self, n: int) -> list[tuple[str, int]] | None:
        """``(kind, bytes)`` per tier a store of ``n`` slots would use (None: no room)."""
        plan = self.plan(n)
        return None if plan is None else [(self.tiers[t].kind, k * self.slot_bytes)
                                          for t, k in plan]

    # --- moving -----------------------------------------------------------------------------

    def _copy(self, src: int, src_slots: torch.Tensor, positions: torch.Tensor, dst,
              dst_slots: torch.Tensor, done) -> None:
        """One batched copy of slots ``src_slots`` of tier ``src`` into ``dst_slots`` of
        ``dst`` (a tier, or a device buffer), timed: ``done(kind, direction, bytes, seconds)``
        with the swap tier's kind and ``"store"`` (out of the pool) or ``"load"``.
        ``positions``: each slot's place in its request (a disk file records it)."""
        stream = getattr(self.mover.engine, "stream", None)
        if stream is not None:  # start timing once the copy stream has caught up
            stream.wait_stream(torch.cuda.current_stream(self.device))
        start = self.watch.start(stream)
        self.mover.copy(0, src, src_slots, positions * self.tiers[HOT].page_shape[1], dst,
                        dst_slots)
        kind, direction = (dst.kind, "store") if src == HOT else (self.tiers[src].kind, "load")
        nbytes = len(src_slots) * self.slot_bytes
        self.watch.stop(start, lambda s: done(kind, direction, nbytes, s), stream)

    def store(self, request_id: str, slots: Sequence[int], done) -> list[tuple[str, int]]:
        """Copy pool ``slots`` of ``request_id`` into the tiers (fastest first, spilling);
        ``done(kind, "store", bytes, seconds)`` is called per tier copy. Returns ``(kind,
        bytes)`` per tier used.

        Raises:
            KVCapacityError: the tiers have no room for them (nothing changed).
            KVIOError: a copy failed (a full disk, an I/O error); rolled back: no slot or file
                is left behind.
        """
        if request_id in self.entries:
            raise KernelInputError(f"SwapStore.store: request {request_id!r} is already stored; "
                                   "load or discard it first.")
        plan = self.plan(len(slots))
        if plan is None:
            raise KVCapacityError(
                f"swap tiers are full: {len(slots)} slots of {self.slot_bytes} B needed, free "
                f"{self.free_slots()}; raise their capacity_gib or add a tier.")
        src = torch.tensor(list(slots), dtype=torch.long)
        parts, first = [], 0
        for t, k in plan:
            parts.append((t, self.tiers[t].alloc(0, k), first))
            first += k

        def copies() -> None:
            for t, dst, at in parts:
                pos = torch.arange(at, at + len(dst))
                self._copy(HOT, src[pos], pos, self.tiers[t], torch.tensor(dst), done)

        self.mover.atomic(0, [(t, dst) for t, dst, _ in parts], copies)
        self.entries[request_id] = _Entry(parts, len(slots))
        return [(self.tiers[t].kind, len(dst) * self.slot_bytes) for t, dst, _ in parts]

    def load(self, request_id: str, dst: Sequence[int], done) -> list[tuple[str, int]]:
        """Copy ``request_id``'s stored slots back into pool slots ``dst`` (``dst[i]`` takes
        stored slot ``i``; -1 skips it) and forget the request; ``done`` as in :meth:`store`.
        Returns ``(kind, bytes)`` per tier read.

        Raises:
            KVIOError, KVFileError: a read failed or a file did not validate. The request's
                slots are released all the same: its KV is gone and the caller recomputes it.
        """
        entry = self.entries.pop(request_id)
        try:
            if len(dst) > entry.count:
                raise KernelInputError(f"SwapStore.load: {len(dst)} destination slots for "
                                       f"{entry.count} stored ones of request {request_id!r}.")
            dst_all = torch.full((entry.count,), -1, dtype=torch.long)
            dst_all[:len(dst)] = torch.tensor(list(dst), dtype=torch.long)
            moved = []
            for t, slots, at in entry.parts:
                pos = torch.arange(at, at + len(slots))
                keep = dst_all[pos] >= 0
                if keep.any():
                    self._copy(t, torch.tensor(slots)[keep], pos[keep], self.tiers[HOT],
                               dst_all[pos][keep], done)
                    moved.append((self.tiers[t].kind, int(keep.sum()) * self.slot_bytes))
        finally:
            self._release(entry)
        return moved

    def discard(self, request_id: str) -> None:
        """Forget ``request_id`` (cancelled, or finished elsewhere); its slots are released."""
        entry = self.entries.pop(request_id, None)
        if entry is not None:
            self._release(entry)

    def clear(self) -> None:
        for request_id in list(self.entries):
            self.discard(request_id)

    def close(self) -> None:
        """Forget every request and delete the disk tiers' segment files."""
        self.clear()
        for t in self.tiers:
            t.close()

    def _release(self, entry: _Entry) -> None:
        for t, slots, _ in entry.parts:
            self.tiers[t].release(0, slots)

    # --- calibration ------------------------------------------------------------------------

    def calibrate(self, costs: CostModel, *, probe_slots: int, repeats: int = 3) -> None:
        """Time stores and loads of 1 and ``probe_slots`` slots into each tier (reading pool
        slot 0 onwards, loading into a scratch buffer, so the engine's KV is untouched) and
        feed them to ``costs``."""
        for t in range(1, len(self.tiers)):
            k = min(probe_slots, self.tiers[t].num_free(0), self.pool.shape[0])
            if k < 1:
                continue
            scratch = torch.zeros((k, *self.pool.shape[1:]), dtype=self.pool.dtype,
                                  device=self.device)
            for n in sorted({1, k}):
                pos = torch.arange(n)
                for _ in range(repeats):
                    dst = torch.tensor(self.tiers[t].alloc(0, n))
                    try:
                        self._copy(HOT, pos, pos, self.tiers[t], dst, costs.observe_transfer)
                        self._copy(t, dst, pos, scratch, pos, costs.observe_transfer)
                    finally:
                        self.tiers[t].release(0, dst.tolist())
        self.watch.poll(wait=True)
        self.telemetry.reset()  # probes are not swaps


@dataclass
class Decision:
    """One preempted request: what was done, why, and what it cost (seconds).

    ``predicted_*`` are the cost model's at decision time (None: not measured yet);
    ``measured_*`` fill in as the work happens (a swap's load and a recompute's prefill come
    when the request resumes; a recompute's time is its share of the batches that prefilled
    it again)."""

    request_id: str
    action: Literal["swap", "recompute"]
    reason: str
    tokens: int
    blocks: int
    nbytes: int
    placement: dict[str, int] = field(default_factory=dict)
    predicted_swap_s: float | None = None
    predicted_recompute_s: float | None = None
    measured_store_s: float | None = None
    measured_load_s: float | None = None
    measured_recompute_s: float | None = None

    @property
    def predicted_s(self) -> float | None:
        return self.predicted_swap_s if self.action == "swap" else self.predicted_recompute_s

    @property
    def measured_s(self) -> float | None:
        if self.action == "recompute":
            return self.measured_recompute_s
        if self.measured_store_s is None or self.measured_load_s is None:
            return None
        return self.measured_store_s + self.measured_load_s

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "predicted_s": self.predicted_s,
                "measured_s": self.measured_s}


@dataclass
class SwapLog:
    """Counters of a :class:`Swapper` (what ``handle.stats()`` reports)."""

    swapped_out: int = 0  # requests stored into the tiers
    swapped_in: int = 0  # requests loaded back
    swapped_blocks: int = 0  # engine blocks stored
    recomputed_requests: int = 0
    recomputed_tokens: int = 0  # tokens prefilled again by recomputed requests
    tiers_full: int = 0  # recomputes because no tier had room
    store_faults: int = 0
    load_faults: int = 0
    stored_bytes: dict[str, int] = field(default_factory=dict)
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    #: the most recent decisions (a server runs for days: older ones are only counted)
    decisions: deque[Decision] = field(default_factory=lambda: deque(maxlen=DECISIONS_KEPT))


class Swapper:
    """The decisions of the swap core, over the stores of one engine.

    Args:
        config: tiers and policy.
        costs: the cost model (default: a new one, calibrated when the first store attaches,
            from ``config.calibration`` or by probes); shared by the stores it serves.
    """

    def __init__(self, config: SwapConfig, costs: CostModel | None = None) -> None:
        self.config = config
        self.costs = costs or CostModel([s.kind for s in config.tiers])
        self.log = SwapLog()
        self.store: SwapStore | None = None
        self.prefill_chunk: int | None = None
        self._calibrated = False
        #: requests prefilling again after a recompute decision, and that decision
        self._recomputing: dict[str, Decision] = {}
        #: requests swapped out, and their decision (completed when they load)
        self._swapped: dict[str, Decision] = {}

    def attach(self, store: SwapStore, *, prefill_chunk: int | None = None) -> None:
        """Serve the engine cache behind ``store`` (the previous store's requests are
        forgotten); the first store calibrates the transfer costs. ``prefill_chunk``: most
        tokens of one request the engine prefills per forward (prices a recompute)."""
        if self.store is not None:
            self.store.close()
        self.store, self.prefill_chunk = store, prefill_chunk
        self._swapped.clear()
        self._recomputing.clear()
        if not self._calibrated:
            if self.config.calibration is not None:
                self.costs.load(self.config.calibration)
            elif self.config.policy == "auto":
                store.calibrate(self.costs, probe_slots=self.config.probe_slots)
                self.costs.calibrated_from = "probes at start"
            self._calibrated = True

    # --- decisions --------------------------------------------------------------------------

    def predict(self, *, slots: int, recompute_tokens: int) -> tuple[float | None, float | None]:
        """Predicted (swap, recompute) seconds of a victim; swap is None when no tier has
        room or a tier's costs are unknown, recompute None before any batch was timed."""
        place = self.store.placement(slots) if self.store is not None else None
        swap = None if place is None else self.costs.swap_s(place)
        return swap, self.costs.recompute_s(recompute_tokens, self.prefill_chunk)

    def restore_cost(self, *, slots: int, recompute_tokens: int) -> float | None:
        """What restoring a victim is predicted to cost under the policy (None: unknown)."""
        swap, recompute = self.predict(slots=slots, recompute_tokens=recompute_tokens)
        if self.config.policy == "recompute" or self.store.plan(slots) is None:
            return recompute
        if self.config.policy == "swap":
            return swap
        known = [c for c in (swap, recompute) if c is not None]
        return min(known) if known else None

    def preempt(self, request_id: str, slots: Sequence[int], *, tokens: int,
                recompute_tokens: int, blocks: int) -> Decision:
        """Decide for a victim and act: store its ``slots`` (its KV, ``tokens`` tokens in
        ``blocks`` engine blocks) or let it be recomputed (``recompute_tokens`` to prefill).
        The caller frees the engine's blocks after this returns, and recomputes the request
        when the decision says so (then also calls :meth:`begin_recompute`)."""
        store = self.store
        swap_s, recompute_s = self.predict(slots=len(slots), recompute_tokens=recompute_tokens)
        nbytes = len(slots) * store.slot_bytes
        d = Decision(request_id, "recompute", "", tokens, blocks, nbytes,
                     predicted_swap_s=swap_s, predicted_recompute_s=recompute_s)
        policy = self.config.policy
        if policy == "recompute":
            d.reason = "policy"
        elif not slots:
            d.reason = "nothing stored"
        elif store.plan(len(slots)) is None:
            d.reason = "tiers full"
            self.log.tiers_full += 1
        elif policy == "auto" and swap_s is not None and recompute_s is not None and \
                recompute_s <= swap_s:
            d.reason = "recompute cheaper"
        else:
            d.action = "swap"
            d.reason = "policy" if policy == "swap" else (
                "swap cheaper" if recompute_s is not None and swap_s is not None else
                "not measured yet")
            try:
                placed = store.store(request_id, slots, self._timing(d))
            except (KVIOError, KVCapacityError) as e:
                d.action, d.reason = "recompute", f"store fault: {e}"
                self.log.store_faults += 1
            else:
                d.placement = dict(placed)
                self.log.swapped_out += 1
                self.log.swapped_blocks += blocks
                for kind, n in placed:
                    self.log.stored_bytes[kind] = self.log.stored_bytes.get(kind, 0) + n
                self._swapped[request_id] = d
        self.log.decisions.append(d)
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s: %s (%s; %d tokens, %.1f MB; predicted swap %s, recompute %s)",
                        request_id, d.action, d.reason, tokens, nbytes / 1e6,
                        _seconds(swap_s), _seconds(recompute_s))
        return d

    def _timing(self, d: Decision):
        def done(kind: str, direction: str, nbytes: int, seconds: float) -> None:
            self.costs.observe_transfer(kind, direction, nbytes, seconds)
            attr = "measured_store_s" if direction == "store" else "measured_load_s"
            setattr(d, attr, (getattr(d, attr) or 0.0) + seconds)
        return done

    def resume(self, request_id: str, dst: Sequence[int]) -> bool:
        """Load a swapped request back into pool slots ``dst`` (see :meth:`SwapStore.load`).
        False when the load failed: the fault is counted, its slots are released, its
        decision now tracks a recompute, and the caller must prefill the request again."""
        d = self._swapped.pop(request_id)
        d.measured_load_s = None
        try:
            loaded = self.store.load(request_id, dst, self._timing(d))
        except (KVIOError, KVFileError) as e:
            self.log.load_faults += 1
            d.reason += f"; load fault: {e}"
            self.begin_recompute(request_id, d)
            return False
        self.log.swapped_in += 1
        for kind, n in loaded:
            self.log.loaded_bytes[kind] = self.log.loaded_bytes.get(kind, 0) + n
        return True

    def begin_recompute(self, request_id: str, decision: Decision) -> None:
        """``request_id`` will be prefilled again, as ``decision`` says."""
        d = decision
        self.log.recomputed_requests += 1
        d.measured_recompute_s = 0.0
        self._recomputing[request_id] = d

    def discard(self, request_id: str) -> None:
        """The engine dropped ``request_id`` (cancelled): forget its stored KV."""
        self._swapped.pop(request_id, None)
        self._recomputing.pop(request_id, None)
        if self.store is not None:
            self.store.discard(request_id)

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    # --- measurements -----------------------------------------------------------------------

    def observe_batch(self, rows: Sequence[tuple[str, int, int, bool]], seconds: float) -> None:
        """One forward batch took ``seconds``: ``rows`` are ``(request id, query tokens, past
        tokens, prefill finished)``. Feeds the prefill fit and charges recomputing requests
        their share."""
        tokens = sum(q for _, q, _, _ in rows)
        self.costs.observe_batch(tokens, sum(past + q for _, q, past, _ in rows),
                                 sum(attention_work(q, past) for _, q, past, _ in rows),
                                 seconds, decode=all(q == 1 for _, q, _, _ in rows))
        if not self._recomputing:
            return
        # each request's marginal time, over the batch's predicted time: the batch overhead
        # (the fit's constant) is paid by every batch and charged to none
        share = [self.costs.marginal_s(q, past) for _, q, past, _ in rows]
        total = sum(share) + self.costs.batch_s()
        if total <= 0:
            share, total = [q for _, q, _, _ in rows], max(1, tokens)
        for (rid, q, _, done), s in zip(rows, share):
            d = self._recomputing.get(rid)
            if d is None:
                continue
            d.measured_recompute_s += seconds * s / total
            self.log.recomputed_tokens += q
            if done:
                del self._recomputing[rid]

    def poll(self, *, wait: bool = False) -> None:
        """Fold in the timings the device has finished (CUDA; all of them with ``wait``)."""
        if self.store is not None:
            self.store.watch.poll(wait=wait)

    def stats(self) -> dict:
        """Counters, bytes per tier, the decisions (the last :data:`DECISIONS_KEPT`), and the
        cost model (predicted against measured, summed per action over the kept decisions
        measured so far)."""
        self.poll(wait=True)
        log = self.log
        check = {}
        for action in ("swap", "recompute"):
            done = [d for d in log.decisions if d.action == action and d.predicted_s is not None
                    and d.measured_s is not None]
            pred, meas = sum(d.predicted_s for d in done), sum(d.measured_s for d in done)
            check[action] = {"decisions": len(done), "predicted_s": pred, "measured_s": meas,
                             "measured_over_predicted": meas / pred if pred > 0 else None}
        kinds = self.store.kinds if self.store is not None else tuple(
            s.kind for s in self.config.tiers)
        return {
            "policy": self.config.policy,
            "swapped_out": log.swapped_out, "swapped_in": log.swapped_in,
            "swapped_blocks": log.swapped_blocks,
            "recomputed_requests": log.recomputed_requests,
            "recomputed_tokens": log.recomputed_tokens,
            "tiers_full": log.tiers_full,
            "faults": {"store": log.store_faults, "load": log.load_faults},
            "bytes": {k: {"stored": log.stored_bytes.get(k, 0),
                          "loaded": log.loaded_bytes.get(k, 0)} for k in kinds},
            "held_bytes": {k: (self.store.tiers[i + 1].num_used(0) * self.store.slot_bytes
                               if self.store is not None else 0) for i, k in enumerate(kinds)},
            "decisions": [d.as_dict() for d in log.decisions],
            "cost_check": check,
            "cost_model": self.costs.as_dict(),
        }


def _seconds(s: float | None) -> str:
    return "unmeasured" if s is None else f"{s * 1e3:.1f} ms"
