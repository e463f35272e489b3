"""``tierattn.swap(model, SwapConfig)``: transformers' continuous batching keeps preempted
requests in tierattn's tiers, or recomputes them, as the measured cost model decides.

transformers' continuous batching (``model.generate_batch``, ``model.init_continuous_batching``,
the engine behind ``transformers serve``) preempts requests when its paged KV cache runs out of
blocks. Its ``OffloadingManager`` either copies their blocks into one pinned host pool (off by
default; on a CPU-only torch every request then fails) or soft-resets them: their generated
tokens are folded into the prompt and prefilled again. Under :func:`swap`, every batch processor
the model builds gets a :class:`TieredOffloadingManager` instead: each victim's blocks are stored
into tierattn's tiers (DDR, CXL, disk; spilling, all or nothing) or the victim is recomputed, by
:class:`~tierattn.serving.swapcore.Swapper`'s policy; a swapped request is loaded back when the
scheduler admits it again, and one whose load fails is prefilled again instead.

This is the only file that knows transformers' continuous-batching internals (the manager's
``_create_batch_processor``, the processor's ``offloading_manager`` and ``_generation_step``, the
cache's allocators and ``can_store_request_tokens``, the scheduler's queues, ``RequestState``);
:data:`SUPPORTED` pins the releases whose internals it was checked against.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
import weakref

import torch
import transformers

try:
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager
    from transformers.generation.continuous_batching.requests import RequestStatus
except ImportError:  # a release without them: swap() refuses it by its version, clearly
    OffloadingManager, RequestStatus = object, None

from tierattn.errors import TierConfigError, UnsupportedEngineError, UnsupportedModelError
from tierattn.serving.swapcore import SwapConfig, Swapper, SwapStore

__all__ = ["SUPPORTED", "SwapHandle", "TieredOffloadingManager", "swap", "swap_every_model"]

#: transformers releases (major, minor) whose continuous-batching internals this adapter uses
#: unchanged (offloading manager, scheduler and request state are identical from 5.21 to 5.25)
SUPPORTED = ((5, 21), (5, 22), (5, 23), (5, 24), (5, 25))


#: How ``tierattn serve`` prints the swap decisions (the ``tierattn.swap`` logger).
LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"


def check_transformers(version: str | None = None) -> None:
    """Raise :class:`UnsupportedEngineError` unless transformers is a :data:`SUPPORTED`
    release."""
    version = version or transformers.__version__
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        major, minor = -1, -1
    if (major, minor) not in SUPPORTED:
        known = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        raise UnsupportedEngineError(
            f"tierattn.swap: transformers {version} is not a release whose continuous-batching "
            f"internals tierattn was checked against ({known}); install one of them, e.g. "
            "pip install 'transformers>=5.21,<5.26'.")


def slot_view(cache) -> tuple[torch.Tensor, dict[str, int]]:
    """The paged cache's tensor as swap slots ``[N, 2, T, H_kv, D]`` and, per allocator, the
    slots one of its blocks spans: a slot is the largest size every allocator's block is a
    whole number of (one block for models whose layers are all alike)."""
    allocators = cache.cache_allocators
    unit = math.gcd(*(a.bytes_per_block for a in allocators.values()))
    first = next(iter(allocators.values()))
    heads, dim = first.num_key_value_heads, first.head_dim
    itemsize = torch.empty((), dtype=cache.dtype).element_size()
    per_token = 2 * heads * dim * itemsize
    if unit % per_token or cache.cache_tensor.numel() % unit:
        sizes = [a.bytes_per_block for a in allocators.values()]
        raise UnsupportedModelError(
            f"tierattn.swap: the paged cache's blocks ({sizes} B) are not whole tokens of "
            f"{heads} KV heads x {dim} dims; its layout is not one tierattn knows.")
    pool = cache.cache_tensor.view(cache.dtype).view(-1, 2, unit // per_token, heads, dim)
    return pool, {name: a.bytes_per_block // unit for name, a in allocators.items()}


class TieredOffloadingManager(OffloadingManager):
    """transformers' offloading manager, with tierattn's tiers and cost model behind it.

    The engine calls it as its own: ``offload_requests`` when active requests are starved of
    blocks, ``restore_scheduled_requests`` before each forward, ``free_request_cpu_cache`` on
    cancellation, ``reset`` between sessions. transformers' host pool is never allocated.

    Args:
        processor: the engine's ``ContinuousBatchProcessor``.
        swapper: the decisions and their log (shared by every processor of a model).
    """

    def __init__(self, processor, swapper: Swapper) -> None:
        # transformers' bookkeeping, empty: its host pool is replaced by the tiers
        self.cache, self.scheduler = processor.cache, processor.scheduler
        self._compute_stream = processor.inputs_and_outputs.compute_stream
        self._cpu_pool, self._cpu_views, self._request_id_to_cpu_blocks = None, {}, {}
        self._num_cpu_sectors = 0
        self.swapper = swapper
        pool, self._slots_per_block = slot_view(self.cache)
        store = SwapStore(swapper.config, pool)
        swapper.attach(store, prefill_chunk=getattr(self.cache, "max_batch_tokens", None))
        # the store views the engine's KV cache: it goes with the engine, whatever holds the
        # swapper (a handle kept by a server outlives every engine it served)
        weakref.finalize(processor, swapper.detach, store)
        #: blocks stored per allocator, for each swapped request (pairing on the way back)
        self._stored_blocks: dict[str, dict[str, int]] = {}
        #: swapped requests loaded back at admission, not yet seen in a batch
        self._admitted: set[str] = set()
        #: a swapped request turned into a recompute since the scheduler last asked
        self._changed = False
        self._batch: list[tuple[str, int, int, bool]] = []
        # admission is where a swapped request's blocks exist again: load it there
        self._can_store = self.cache.can_store_request_tokens
        self.cache.can_store_request_tokens = _weak_method(self, TieredOffloadingManager._admit)

    # --- preemption ---------------------------------------------------------------------------

    def _slots(self, tables: dict[str, list[int]]) -> list[int]:
        """The swap slots of a request's blocks ``tables`` (allocator by allocator, block by
        block)."""
        return [s for name, blocks in tables.items() for b in blocks
                for s in range(b * self._slots_per_block[name],
                               (b + 1) * self._slots_per_block[name])]

    def _tables(self, request_id: str) -> dict[str, list[int]]:
        return {name: a.block_table.get(request_id, [])[:]
                for name, a in self.cache.cache_allocators.items()}

    @staticmethod
    def _recompute_tokens(state) -> int:
        return len(state.initial_tokens) + len(state.generated_tokens)

    def _order_starved(self) -> None:
        """Order the scheduler's starved requests so that transformers' loop, which takes
        the newest first, takes the cheapest to restore per block it frees first (ties, or no
        estimate yet: the newest, as transformers picks)."""
        starved = self.scheduler.starved_requests

        def cost(item) -> float:
            tables = self._tables(item[0].request_id)
            c = self.swapper.restore_cost(slots=len(self._slots(tables)),
                                          recompute_tokens=self._recompute_tokens(item[0]))
            return math.inf if c is None else c / max(1, sum(map(len, tables.values())))

        starved[:] = sorted(starved, key=cost, reverse=True)  # stable: ties keep their order

    def offload_requests(self) -> bool:
        """transformers' own preemption loop -- starved requests preempted until the rest can
        be scheduled, keeping one active, victims requeued oldest first -- with the victims
        taken cheapest to restore first, and each one swapped into the tiers or recomputed as
        the swap core decides (:meth:`_offload_to_cpu`). True when anything changed."""
        self._order_starved()
        changed = super().offload_requests() or self._changed
        self._changed = False
        return changed

    def _offload_to_cpu(self, victims: list, victim_block_tables: dict) -> set[str]:
        """Swap or recompute each victim (its blocks were just freed; their data is intact
        until the next forward). Returns the ids of the swapped ones."""
        swapped = set()
        with self._stream_ctx():  # on CUDA, copies are ordered after the engine's forwards
            for state in victims:
                rid, tables = state.request_id, victim_block_tables[state.request_id]
                counts = {name: len(blocks) for name, blocks in tables.items()}
                decision = self.swapper.preempt(
                    rid, self._slots(tables), tokens=state.current_len(),
                    recompute_tokens=self._recompute_tokens(state),
                    blocks=sum(counts.values()))
                if decision.action == "swap":
                    self._stored_blocks[rid] = counts
                    state.is_cpu_offloaded = True
                    swapped.add(rid)
                else:
                    self.swapper.begin_recompute(rid, decision)
        return swapped

    # --- resumption ---------------------------------------------------------------------------

    def _admit(self, state, request_len: int, dry_run: bool = False) -> bool:
        """The cache's ``can_store_request_tokens``, plus: a swapped request that got its
        blocks is loaded into them now; if the load fails, the blocks are freed, the request
        is queued to be prefilled again, and it is not admitted."""
        ok = self._can_store(state, request_len, dry_run)
        rid = state.request_id
        if not ok or dry_run or not state.is_cpu_offloaded or rid in self._admitted:
            return ok
        stored = self._stored_blocks.pop(rid)
        dst = []
        for name, a in self.cache.cache_allocators.items():
            new, k = a.block_table.get(rid, []), self._slots_per_block[name]
            for j in range(stored.get(name, 0)):
                dst.extend(range(new[j] * k, (new[j] + 1) * k) if j < len(new) else [-1] * k)
        with self._stream_ctx():
            loaded = self.swapper.resume(rid, dst)
        if loaded:
            self._admitted.add(rid)
            return True
        self.cache.free_blocks(rid, no_cache=True)
        fresh = state.create_equivalent_initial_request()
        state._status = RequestStatus.FINISHED
        state.is_cpu_offloaded = False
        self.scheduler.waiting_requests[rid] = fresh
        self._changed = True
        return False

    def restore_scheduled_requests(self, requests_in_batch: list) -> None:
        """Swapped requests were loaded when admitted; note the batch for the cost model."""
        rows = []
        for future in requests_in_batch:
            state = future.state
            rid = state.request_id
            if state.is_cpu_offloaded:
                if rid not in self._admitted:
                    raise UnsupportedEngineError(
                        f"tierattn.swap: request {rid!r} was scheduled from the swap tiers "
                        "without being admitted through the cache; transformers' internals "
                        "changed (see tierattn.models.hf.continuous.SUPPORTED).")
                self._admitted.discard(rid)
                state.is_cpu_offloaded = False
                if self.cache.use_prefix_sharing:  # as transformers: the loaded blocks re-hash
                    for name, a in self.cache.cache_allocators.items():
                        restored = state.position_offset // a.tokens_per_page
                        if restored:
                            future.complete_blocks[name] = \
                                future.complete_blocks.get(name, 0) + restored
            rows.append((rid, future.query_length, state.position_offset,
                         not state.remaining_prefill_tokens))
        self._batch = rows

    def take_batch(self) -> list[tuple[str, int, int, bool]]:
        """The batch just scheduled, as ``(request id, query tokens, past tokens, prefill
        done)`` rows (what the forward that follows is timed for)."""
        rows, self._batch = self._batch, []
        return rows

    # --- cleanup ------------------------------------------------------------------------------

    def free_request_cpu_cache(self, state) -> None:
        self.swapper.discard(state.request_id)
        self._stored_blocks.pop(state.request_id, None)
        self._admitted.discard(state.request_id)
        state.is_cpu_offloaded = False

    def free_all_waiting_cpu_caches(self) -> None:
        for state in list(self.scheduler.waiting_requests.values()):
            self.free_request_cpu_cache(state)

    def reset(self) -> None:
        self.free_all_waiting_cpu_caches()
        self.swapper.store.clear()
        self._stored_blocks.clear()
        self._admitted.clear()
        self._batch = []


def _weak_method(obj, func):
    """``func`` bound to ``obj`` without a strong reference to it: the wrappers tierattn sets on
    the engine's objects would otherwise close reference cycles through them, and an engine's
    KV cache would wait for the cyclic garbage collector instead of going with the engine."""
    ref = weakref.ref(obj)

    @functools.wraps(func)
    def call(*args, **kwargs):
        return func(ref(), *args, **kwargs)
    return call


class SwapHandle:
    """Undo handle of :func:`swap`; also a context manager (``with tierattn.swap(...)``).

    Attributes:
        swapper: the decisions, their log and the cost model, shared by every batch
            processor the model builds while the handle is active.
    """

    def __init__(self, model, config: SwapConfig) -> None:
        # weakly: a server that unloads a model frees it, whatever holds the handle
        self._model, self.config = weakref.ref(model), config
        self.swapper = Swapper(config)
        self.active = False
        self._managers: weakref.WeakSet = weakref.WeakSet()

    @property
    def model(self):
        """The model (None once it was freed)."""
        return self._model()

    def _apply(self) -> None:
        original = self.model.init_continuous_batching

        @functools.wraps(original)
        def init_continuous_batching(*args, **kwargs):
            manager = original(*args, **kwargs)
            if self.active:
                self._hook(manager)
            return manager

        self.model.init_continuous_batching = init_continuous_batching
        self.model._tierattn_swap = self
        self.active = True

    def _hook(self, manager) -> None:
        """Give ``manager``'s batch processors (now and later) the tiered offloading manager."""
        if manager in self._managers:
            return
        self._managers.add(manager)
        # transformers' own pinned pool is never allocated: the tiers replace it
        manager._tierattn_cpu_offload_space = manager.continuous_batching_config.cpu_offload_space
        manager.continuous_batching_config.cpu_offload_space = 0.0
        create = _weak_method(manager, manager._create_batch_processor.__func__)

        @functools.wraps(create)
        def create_batch_processor():
            processor = create()
            if self.active:
                self._install(processor)
            return processor

        manager._create_batch_processor = create_batch_processor
        if manager.batch_processor is not None and not manager.is_running():
            self._install(manager.batch_processor)

    def _install(self, processor) -> None:
        if isinstance(processor.offloading_manager, TieredOffloadingManager):
            return
        if processor.distributed_helper.tp_size > 1:
            raise UnsupportedModelError(
                "tierattn.swap: tensor-parallel continuous batching is not supported yet (each "
                "rank would decide alone); run it without tierattn.swap.")
        manager = TieredOffloadingManager(processor, self.swapper)
        processor.offloading_manager = manager
        step = _weak_method(processor, processor._generation_step.__func__)
        watch = manager.swapper.store.watch
        stream = processor.inputs_and_outputs.compute_stream

        @functools.wraps(step)
        def timed_step(model) -> None:
            rows = manager.take_batch()
            start = watch.start(stream)
            step(model)
            watch.stop(start, lambda s: self.swapper.observe_batch(rows, s), stream)

        processor._generation_step = timed_step

    def stats(self) -> dict:
        """What the swap core did: ``swapped_out`` / ``swapped_in`` (requests),
        ``swapped_blocks``, ``recomputed_requests`` / ``recomputed_tokens``, ``tiers_full``,
        ``faults`` (store, load), ``bytes`` stored and loaded per tier, every decision with its
        predicted and measured cost, and the cost model (:meth:`Swapper.stats`)."""
        return self.swapper.stats()

    def undo(self) -> None:
        """Restore the model and every manager the handle hooked that is not running
        (transformers' own offloading manager back on their processors); a running manager
        keeps tierattn's until it is destroyed (its swapped requests live there)."""
        if not self.active:
            return
        self.active = False
        model = self.model
        if model is not None:
            vars(model).pop("init_continuous_batching", None)
            vars(model).pop("_tierattn_swap", None)
        running = False
        for manager in list(self._managers):
            if manager.is_running():
                running = True
                warnings.warn("tierattn.swap: a continuous-batching manager is still running; "
                              "it keeps tierattn's offloading manager until it stops.",
                              stacklevel=2)
                continue
            del manager._create_batch_processor
            cfg = manager.continuous_batching_config
            cfg.cpu_offload_space = manager._tierattn_cpu_offload_space
            processor = manager.batch_processor
            if processor is not None and isinstance(processor.offloading_manager,
                                                    TieredOffloadingManager):
                processor.offloading_manager.reset()
                del processor.cache.can_store_request_tokens
                del processor._generation_step
                processor.offloading_manager = OffloadingManager(
                    cache=processor.cache, scheduler=processor.scheduler,
                    cpu_offload_space_gib=cfg.cpu_offload_space,
                    safety_threshold=cfg.cpu_offload_space_safety_threshold,
                    compute_stream=processor.inputs_and_outputs.compute_stream,
                    distributed_helper=processor.distributed_helper)
        self._managers = weakref.WeakSet()
        if not running and self.swapper.store is not None:  # its disk tiers' files go
            self.swapper.store.close()

    def __enter__(self) -> SwapHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def swap(model, config: SwapConfig | None = None) -> SwapHandle:
    """Keep ``model``'s preempted continuous-batching requests in tierattn's tiers (or
    recompute them), as ``config``'s policy decides; returns the undo handle.

    Covers ``model.generate_batch``, ``model.continuous_batching_context_manager`` and the
    managers of ``model.init_continuous_batching`` created while the handle is active.
    Applying it to a model that already has one returns that handle when the config is the
    same.

    Args:
        model: a transformers model with continuous batching (``init_continuous_batching``).
        config: tiers, policy, calibration (default: DDR, ``policy="auto"``).

    Raises:
        UnsupportedEngineError: transformers is not a :data:`SUPPORTED` release.
        TierConfigError: ``config`` is not a SwapConfig.
    """
    if config is not None and not isinstance(config, SwapConfig):
        raise TierConfigError(f"tierattn.swap: config must be a SwapConfig, got "
                              f"{type(config).__name__}; build one with SwapConfig(tiers=..., "
                              "policy=...).")
    check_transformers()
    config = config or SwapConfig()
    if not callable(getattr(model, "init_continuous_batching", None)):
        raise UnsupportedModelError(
            f"tierattn.swap: {type(model).__name__} has no continuous batching "
            "(init_continuous_batching); pass a transformers generation model.")
    existing = getattr(model, "_tierattn_swap", None)
    if existing is not None and existing.active:
        if existing.config != config:
            raise TierConfigError("tierattn.swap: the model already swaps with another config; "
                                  "call handle.undo() first.")
        return existing
    handle = SwapHandle(model, config)
    handle._apply()
    return handle


@contextlib.contextmanager
def swap_every_model(config: SwapConfig | None = None):
    """:func:`swap` for every model that starts continuous batching inside the block -- the
    models ``transformers serve`` loads itself (``tierattn serve``). transformers'
    ``ContinuousMixin.init_continuous_batching`` is wrapped for the block's duration, and the
    target of the engine process ``serve`` spawns (transformers >= 5.25) so the wrap is made
    there too; yields the list of handles made so far in this process (one per model), which
    are undone at the end."""
    check_transformers()
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    config = config or SwapConfig()
    original = ContinuousMixin.init_continuous_batching
    handles: list[SwapHandle] = []

    @functools.wraps(original)
    def init_continuous_batching(model, *args, **kwargs):
        manager = original(model, *args, **kwargs)
        handle = getattr(model, "_tierattn_swap", None)
        if handle is None or not handle.active:
            handle = SwapHandle(model, config)
            handle.active, model._tierattn_swap = True, handle
            handles.append(handle)
        handle._hook(manager)
        return manager

    ContinuousMixin.init_continuous_batching = init_continuous_batching
    # transformers >= 5.25's `serve` runs each model's engine in a spawned process, which
    # imports transformers afresh: its target is routed through _swapped_engine, which
    # applies this block there too.
    manager_module = _serve_model_manager()
    spawned = getattr(manager_module, "run_until_parent_exits", None)
    if spawned is not None:
        manager_module.run_until_parent_exits = functools.partial(
            _swapped_engine, config, logging.getLogger("tierattn.swap").getEffectiveLevel())
    try:
        yield handles
    finally:
        ContinuousMixin.init_continuous_batching = original
        if spawned is not None:
            manager_module.run_until_parent_exits = spawned
        for handle in handles:
            handle.undo()


def _serve_model_manager():
    """transformers serve's model-manager module, or None (no serving extras, or a release
    whose engine runs in the serving process)."""
    try:
        from transformers.cli.serving import model_manager
    except ImportError:
        return None
    return model_manager


def _swapped_engine(config: SwapConfig, log_level: int, *args, **kwargs):
    """The spawned engine process's target (picklable: module-level, config by value): runs
    transformers' own target inside :func:`swap_every_model`, the decisions logged at the
    parent's level."""
    from transformers.cli.serving import model_manager

    if log_level <= logging.INFO and not logging.getLogger().handlers:
        logging.basicConfig(format=LOG_FORMAT)
    logging.getLogger("tierattn.swap").setLevel(log_level)
    target = model_manager.run_until_parent_exits  # before the block routes it here again
    with swap_every_model(config):
        return target(*args, **kwargs)

