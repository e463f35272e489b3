"""The swap core: preempted sequences' KV kept in tierattn's tiers, engine-neutral.

When a serving engine runs out of KV blocks it preempts a sequence. tierattn keeps that
sequence's KV in its tiers instead of dropping it, when keeping it is cheaper:

* :class:`SwapStore` sees the engine's KV cache as a pool of slots ``[N, 2, T, H_kv, D]`` (an
  engine block, or an equal share of one) and a request's KV as a list of slots. ``store``
  copies them into the first tiers with room -- DDR, CXL (pinned on CUDA), disk, then the
  Mooncake Store of ``SwapConfig.remote`` (:class:`~tierattn.storage.tiers.RemoteTier`) -- one
  copy launch per tier through :class:`~tierattn.serving.swaptiers.SwapTiers` (the tiers, their
  default capacities, timing and probes, shared with vLLM's connector), all or nothing;
  ``load`` copies them back into the slots the engine allocated when the request resumes,
  and frees the tiers' slots.
* :class:`Swapper` decides, per victim: swap when the measured store + load time is below the
  measured recompute time (``policy="auto"``, :mod:`tierattn.serving.costmodel`), or always / never
  (``"swap"`` / ``"recompute"``). A request that finds every tier full, or whose store or load
  fails (a full disk, an I/O error, a corrupted file), is recomputed instead: never a failed
  request, never a half-restored one. Every decision is logged with its predicted and
  measured costs, so the model can be checked.

Engine adapters (``tierattn.models.hf.continuous`` for transformers' continuous batching) only
translate the engine's calls into these; vLLM's connector (``tierattn.models.vllm``) uses the
same tiers and counters under vLLM's own offloading manager contract. A tier here is a cache
of the running process: its slots and files live as long as the store.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from tierattn.config import SwapConfig
from tierattn.errors import KernelInputError, KVCapacityError, KVFileError, KVIOError
from tierattn.kernels._common import FLOAT_DTYPES
from tierattn.serving.costmodel import CostModel, attention_work
from tierattn.serving.swaptiers import SwapCounters, SwapTiers
from tierattn.storage.pagemap import HOT
from tierattn.storage.transfer import TransferEngine
from tierattn.telemetry import handle_stats

# SwapConfig lives in tierattn.config; re-exported here, where it was first defined
__all__ = ["Decision", "SwapConfig", "SwapLog", "SwapStore", "Swapper"]

#: one INFO line per decision (``tierattn serve`` shows them)
logger = logging.getLogger("tierattn.swap")
#: decisions a log keeps, with their costs
DECISIONS_KEPT = 10_000


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
        #: files of a disk tier are named under this, unique to the store
        self.fingerprint = f"swap-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.swap = SwapTiers(config, [pool], fingerprint=self.fingerprint, engine=engine,
                              remote_tier=True)
        self.tiers, self.mover, self.watch = self.swap.tiers, self.swap.mover, self.swap.watch
        self.telemetry, self.slot_bytes = self.swap.telemetry, self.swap.slot_bytes
        self.entries: dict[str, _Entry] = {}
        self._remote_closed: dict | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The swap tiers' kinds, fastest first."""
        return self.swap.kinds

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.entries

    def remote_stats(self) -> dict | None:
        """The remote tier's store counters (:meth:`RemoteStore.stats
        <tierattn.storage.remote.RemoteStore.stats>`), None without one."""
        if self.tiers is None:  # closed: what it counted while open
            return self._remote_closed
        last = self.tiers[-1]
        return last.store.stats() if last.kind == "remote" else None

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

    def store(self, request_id: str, slots: Sequence[int], done) -> list[tuple[str, int]]:
        """Copy pool ``slots`` of ``request_id`` into the tiers (fastest first, spilling);
        ``done(kind, "store", bytes, seconds)`` is called per tier copy. Returns ``(kind,
        bytes)`` per tier used.

        Raises:
            KVCapacityError: the tiers have no room for them, or a memory tier cannot grow
                into them (nothing changed).
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
                f"{self.free_slots()}; raise SwapConfig.tiers' capacity_gib or add a tier.")
        src = torch.tensor(list(slots), dtype=torch.long)
        parts, first = [], 0
        try:
            for t, k in plan:
                parts.append((t, self.tiers[t].alloc(0, k), first))
                first += k
        except KVCapacityError:  # a memory tier could not grow: give back what was taken
            for t, taken, _ in parts:
                self.tiers[t].release(0, taken)
            raise

        def copies() -> None:
            for t, dst, at in parts:
                pos = torch.arange(at, at + len(dst))
                self.swap.wait(self.swap.copy(HOT, src[pos], pos * self.pool.shape[2], t,
                                              torch.tensor(dst), done))

        try:
            self.mover.atomic(0, [(t, dst) for t, dst, _ in parts], copies)
        except BaseException:  # (atomic gave layer 0's slots back; the other layers' pages go)
            for t, dst, _ in parts:
                self.swap.forget(t, dst)
            raise
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
                    self.swap.wait(self.swap.copy(t, torch.tensor(slots)[keep],
                                                  pos[keep] * self.pool.shape[2], HOT,
                                                  dst_all[pos][keep], done))
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
        """Forget every request, delete the disk tiers' segment files and let go of the
        engine's KV cache and the host tiers' memory (again: nothing; the handle's undo and
        the engine's end both close it)."""
        if self.swap is None:
            return
        self.clear()
        self._remote_closed = self.remote_stats()
        self.swap.close()
        self.pool = self.swap = self.tiers = self.mover = None

    def _release(self, entry: _Entry) -> None:
        for t, slots, _ in entry.parts:
            self.swap.release(t, slots)

    def calibrate(self, costs: CostModel, *, probe_slots: int, repeats: int = 3) -> None:
        """Feed ``costs`` probes of each tier (:meth:`SwapTiers.calibrate`)."""
        self.swap.calibrate(costs.observe_transfer, probe_slots=probe_slots, repeats=repeats)


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
    """Counters of a :class:`Swapper` (what ``handle.stats()`` reports): per request, and what
    moved through the tiers (:class:`~tierattn.serving.swaptiers.SwapCounters`, as vLLM's connector
    counts it; ``moved.no_room`` counts the recomputes because no tier had room)."""

    swapped_out: int = 0  # requests stored into the tiers
    swapped_in: int = 0  # requests loaded back
    swapped_blocks: int = 0  # engine blocks stored
    recomputed_requests: int = 0
    recomputed_tokens: int = 0  # tokens prefilled again by recomputed requests
    moved: SwapCounters = field(default_factory=SwapCounters)
    #: the most memory each tier held at once (memory tiers grow as slots are stored)
    peak_reserved_bytes: dict[str, int] = field(default_factory=dict)
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
        self.costs = costs or CostModel(config.kinds)
        self.log = SwapLog()
        self.store: SwapStore | None = None
        self.prefill_chunk: int | None = None
        self._calibrated = False
        #: requests prefilling again after a recompute decision, and that decision
        self._recomputing: dict[str, Decision] = {}
        #: requests swapped out, and their decision (completed when they load)
        self._swapped: dict[str, Decision] = {}
        #: the remote tier's counters of the stores closed so far
        self._remote: dict | None = None

    def attach(self, store: SwapStore, *, prefill_chunk: int | None = None) -> None:
        """Serve the engine cache behind ``store`` (the previous store's requests are
        forgotten); the first store calibrates the transfer costs. ``prefill_chunk``: most
        tokens of one request the engine prefills per forward (prices a recompute)."""
        if self.store is not None:
            self._retire(self.store)
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

    def detach(self, store: SwapStore) -> None:
        """The engine behind ``store`` is gone: close it (its requests are forgotten) unless
        another store replaced it already."""
        if self.store is store:
            self.store = None
            self._swapped.clear()
            self._recomputing.clear()
            self._retire(store)

    def _retire(self, store: SwapStore) -> None:
        """Close ``store``, keeping its remote tier's counters for :meth:`stats`."""
        remote = store.remote_stats()
        if remote is not None:
            self._remote = _add_remote(self._remote, remote)
        store.close()

    def remote_stats(self) -> dict | None:
        """The remote tier's counters over every store this swapper served (None: no remote
        tier); ``up``: the latest store's view."""
        now = self.store.remote_stats() if self.store is not None else None
        return _add_remote(self._remote, now) if now is not None else self._remote

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
            self.log.moved.no_room += 1
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
            except KVCapacityError as e:  # a memory tier could not grow: the host is full
                d.action, d.reason = "recompute", f"tiers full: {e}"
                self.log.moved.no_room += 1
            except KVIOError as e:
                d.action, d.reason = "recompute", f"store fault: {e}"
                self.log.moved.store_faults += 1
            else:
                d.placement = dict(placed)
                for kind, n in store.swap.held_bytes().items():
                    self.log.peak_reserved_bytes[kind] = max(
                        n, self.log.peak_reserved_bytes.get(kind, 0))
                self.log.swapped_out += 1
                self.log.swapped_blocks += blocks
                for kind, n in placed:
                    self.log.moved.count("store", kind, n // store.slot_bytes, n)
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
            self.log.moved.load_faults += 1
            d.reason += f"; load fault: {e}"
            self.begin_recompute(request_id, d)
            return False
        self.log.swapped_in += 1
        for kind, n in loaded:
            self.log.moved.count("load", kind, n // self.store.slot_bytes, n)
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
        kinds = self.config.kinds
        moved = log.moved
        return handle_stats(
            "swap", {k: {"stored": moved.stored_bytes.get(k, 0),
                         "loaded": moved.loaded_bytes.get(k, 0)} for k in kinds},
            policy=self.config.policy,
            swapped_out=log.swapped_out, swapped_in=log.swapped_in,
            swapped_blocks=log.swapped_blocks,
            recomputed_requests=log.recomputed_requests,
            recomputed_tokens=log.recomputed_tokens,
            tiers_full=moved.no_room,
            faults={"store": moved.store_faults, "load": moved.load_faults},
            moved=moved.as_dict(),
            held_bytes={k: (self.store.tiers[i + 1].num_used(0) * self.store.slot_bytes
                            if self.store is not None else 0) for i, k in enumerate(kinds)},
            reserved_bytes=self.store.swap.held_bytes() if self.store is not None else
            dict.fromkeys(kinds, 0),
            peak_reserved_bytes={k: log.peak_reserved_bytes.get(k, 0) for k in kinds},
            decisions=[d.as_dict() for d in log.decisions],
            cost_check=check,
            cost_model=self.costs.as_dict(),
            remote=self.remote_stats())


def _add_remote(total: dict | None, more: dict) -> dict:
    """Two :meth:`RemoteStore.stats <tierattn.storage.remote.RemoteStore.stats>` summed (the
    error codes too); ``up`` is ``more``'s."""
    if total is None:
        return {**more, "codes": dict(more["codes"])}
    out = {k: (v + more[k] if k not in ("codes", "up") else more[k]) for k, v in total.items()}
    out["codes"] = {c: total["codes"].get(c, 0) + more["codes"].get(c, 0)
                    for c in {*total["codes"], *more["codes"]}}
    return out


def _seconds(s: float | None) -> str:
    return "unmeasured" if s is None else f"{s * 1e3:.1f} ms"
