"""TieredKVCache: the "offload, not evict" KV hierarchy of one model, without transformers.

Per layer, every sequence's KV is a list of logical pages (``page_size`` tokens). Each page is
*hot* (a slot of the HBM pool), *cold* (a slot of a lower tier: DDR, CXL or disk, at full
precision) or *evicted* (dropped: only when ``evict_budget > 0``). The calls per layer are:

    cache.update(layer, k, v)        # append the new tokens' K/V (always into hot pages)
    out = cache.attend(layer, q)     # attention of the new queries over the whole cache

``attend`` runs attention over the hot set (one kernel on the HBM pool) and over the cold pages
it needs, staged on the device (one page-copy launch per source tier, usually already in flight
thanks to the layer-ahead prefetcher), merges the partial states by LSE, adds every page's
attention mass to its importance, and then applies the budgets: evict down to ``evict_budget``,
demote down to ``hot_budget`` (never the sinks, the recent window or the page being filled).
Sequences advance in lockstep (a batch decodes one token per step, as in HF generation with left
padding).

A decode step reads nothing back from the device: the page tables it needs are fixed-capacity
device tables (:mod:`~tierattn.storage.pagemap`) advanced in place, recall picks pages on the
device, and the rare structural work -- a new page, a demotion, an eviction, at most a few times
per page filled -- decides on the host from the host map and an importance snapshot copied
asynchronously one step ahead. With ``cuda_graphs`` the step's device work is captured once per
layer and replayed (:mod:`~tierattn.runtime.graphs`).

This class only orchestrates. The parts, one concept per module: :mod:`~tierattn.storage.pagemap`
(where each page lives), :mod:`~tierattn.storage.mover` (every page movement),
:mod:`~tierattn.runtime.prefetch` (staging ring, layer-ahead prefetch, recall),
:mod:`~tierattn.runtime.importance` (page mass, Quest metadata), :mod:`~tierattn.runtime.policy`
(demotion, eviction and recall policies; the budgets),
:mod:`~tierattn.runtime.attention` (the kernels of one call), :mod:`~tierattn.runtime.graphs`
(captured decode steps), :mod:`~tierattn.runtime.snapshot` (save/load). Kernels are called through
:attr:`kernels`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from tierattn import telemetry
from tierattn.runtime import snapshot, validate
from tierattn.runtime.attention import Attention
from tierattn.config import TierConfig
from tierattn.errors import KernelInputError, KVCapacityError, KVIOError, TierConfigError
from tierattn.serving.costmodel import AttendCosts
from tierattn.runtime.graphs import DecodeGraphs
from tierattn.runtime.hostattn import HostAttention, measure_rates
from tierattn.runtime.importance import Importance
from tierattn.kernels import KernelSet
from tierattn.storage.mover import Mover
from tierattn.storage.pagemap import HOT, NONE, LayerTables, PageMap
from tierattn.runtime.planner import AttendPlanner
from tierattn.runtime.policy import EVICTIONS, Budgets, build_policies
from tierattn.runtime.prefetch import RING, Prefetcher
from tierattn.telemetry import Telemetry
from tierattn.storage.tiers import Tier, build_tier, plan_memory
from tierattn.storage.transfer import TransferEngine, default_engine

__all__ = ["TieredKVCache"]


class TieredKVCache:
    """KV cache of ``num_layers`` layers over a hierarchy of tiers (see module docstring).

    The rule of every public call (``update``, ``attend``, ``move``, ``evict``, ``free``,
    ``reorder``, ``set_padding``, ``save``, ``load``, ``reset``): it completes, or it raises a
    typed error (:mod:`tierattn.errors`) and changes nothing. Arguments are validated first
    (:mod:`~tierattn.runtime.validate`: indices in range, no negatives or duplicates, never the page
    being filled, a sink or a freed sequence, dtypes and shapes the cache holds), slots are
    taken before pages move, and an I/O failure rolls back (slots released, partial files
    deleted) and raises :class:`~tierattn.errors.KVIOError`. The one deferred case: a demotion
    that fails inside ``attend`` (the lower tiers full, a disk error) leaves its pages in HBM
    and is retried when the next step starts (:meth:`settle`, called by ``update`` of layer 0),
    which raises, with nothing appended and every layer in step, if it still fails.

    Args:
        config: the :class:`~tierattn.config.TierConfig`.
        num_layers, num_kv_heads, head_dim: model geometry (``H_kv``, ``D``).
        batch_size: sequences decoded in lockstep.
        dtype: KV dtype (fp16/bf16/fp32).
        device: where the HBM pool, staging buffers and metadata live (default: CUDA if
            available).
        engine: transfer engine (default: CUDA copy stream on a GPU, synchronous on CPU).
        fingerprint: identifies the model in disk pages and saved caches.
        staging_pages: slots per staging buffer (default: every cold page of the batch for
            ``attend="all"``, twice the recall budget for ``"topk"``); larger cold sets are
            attended in several batches and merged.
        poison_freed: fill every released memory-tier slot with NaN (a debugging aid: a
            later read of a freed slot shows up as NaN; costs one fill per release).
        kernels: the kernel entry points (default: the package's); every component calls
            kernels through this one object, so tools can time or stub them.
        graph_backend: with ``config.cuda_graphs``: ``"cuda"`` (default; needs a CUDA device)
            or ``"eager"``, which re-runs the captured step instead of replaying a graph (the
            same buffers, keys and counters on a CPU; for tests).
    """

    def __init__(self, config: TierConfig, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, batch_size: int = 1, dtype: torch.dtype = torch.float32,
                 device: str | torch.device | None = None, engine: TransferEngine | None = None,
                 fingerprint: str = "tierattn", staging_pages: int | None = None,
                 poison_freed: bool = False, kernels: KernelSet | None = None,
                 graph_backend: str | None = None) -> None:
        if not isinstance(config, TierConfig):
            raise TierConfigError(f"config must be a TierConfig (e.g. TierConfig.preset("
                                  f"'offload', ...)), got {type(config).__name__}.")
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KernelInputError(f"{name} must be an int >= 1, got {v!r}.")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise KernelInputError(f"dtype must be fp16, bf16 or fp32, got {dtype}.")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if config.cuda_graphs and (graph_backend or "cuda") == "cuda" and device.type != "cuda":
            raise TierConfigError(
                f"cuda_graphs: capturing decode steps needs a CUDA device, the cache is on "
                f"{device}; set cuda_graphs=False.")
        self.config = config
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.batch_size, self.dtype = batch_size, dtype
        self.device = device
        self.fingerprint = fingerprint
        self.kernels = kernels or KernelSet()
        self.engine = engine or default_engine(self.device, config.backend)
        self.engine.kernels = self.kernels
        self.backend = config.backend
        p = self.page_size = config.page_size
        self.max_pages = math.ceil(config.max_context / p)
        self.page_shape = (2, p, num_kv_heads, head_dim)
        capacities, self.staging_pages = plan_memory(
            config, num_layers=num_layers, batch_size=batch_size, page_shape=self.page_shape,
            dtype=dtype, device=self.device, staging_pages=staging_pages, ring=RING,
            holds_prompt=EVICTIONS[config.evict_policy].one_shot)
        self.tiers: list[Tier] = [
            build_tier(spec, num_layers=num_layers, capacity=cap, page_shape=self.page_shape,
                       dtype=dtype, device=self.device, fingerprint=fingerprint)
            for spec, cap in zip(config.tiers, capacities)]
        for tier in self.tiers:
            tier.poison_freed = poison_freed
        self.hbm = self.tiers[HOT]
        self.telemetry = Telemetry(num_layers, tier_kinds=tuple(t.kind for t in self.tiers),
                                   page_bytes=self.hbm.page_bytes, device=self.device)
        self.pages = PageMap(num_layers=num_layers, batch_size=batch_size,
                             max_pages=self.max_pages, page_size=p, sink_pages=config.sink_pages,
                             recent_pages=config.recent_pages, device=self.device,
                             staging_pages=self.staging_pages)
        eviction = EVICTIONS[config.evict_policy] if config.evict_budget != 0 else None
        self.importance = Importance(
            self.pages, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
            snapkv_window=eviction.observation(config) if eviction else config.snapkv_window,
            window_mass=eviction is not None and eviction.window_mass,
            decode_window=eviction.decode_window(config) if eviction else 0,
            kernels=self.kernels, backend=self.backend, telemetry=self.telemetry,
            engine=self.engine, key_range=config.key_range,
            key_bits=config.key_bits if config.key_sketch else None,
            key_rank=config.key_channels(head_dim) if config.key_sketch else None)
        self.mover = Mover(self.tiers, self.pages, self.engine, self.telemetry, self.device)
        self.policies = build_policies(config, self.importance, self.pages, self.mover)
        if not self.policies.recall.exact:  # the tables carry the recall candidates
            # a share of the whole sequence bounds every recall_scope's (the tables' capacity)
            self.pages.recall_pages = config.pages(config.recall_budget, self.max_pages,
                                                   config.max_context)
        self.prefetcher = Prefetcher(num_layers=num_layers, staging_pages=self.staging_pages,
                                     page_shape=self.page_shape, dtype=dtype, device=self.device,
                                     pages=self.pages, mover=self.mover, engine=self.engine,
                                     telemetry=self.telemetry, disk_misses=config.disk_misses)
        self.budgets = Budgets(config, self.pages, self.policies, self.mover, len(self.tiers))
        self.host = HostAttention(
            pages=self.pages, tiers=self.tiers, telemetry=self.telemetry, kernels=self.kernels,
            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=self.device,
            threads=config.host_threads) if config.attend in ("split", "auto") else None
        costs = None
        if config.attend == "auto":  # the rates not given are measured here, once
            link, host = config.link_bandwidth, config.host_bandwidth
            if link is None or host is None:
                m_link, m_host = measure_rates(self.host, self.engine)
                link, host = link or m_link, host or m_host
            # rates given are a machine's description, kept; measured ones follow the steps
            costs = AttendCosts(link, host, link_latency_s=config.link_latency,
                                host_latency_s=config.host_latency,
                                refit=config.host_bandwidth is None)
        self.planner = AttendPlanner(config, self.pages, costs, self.engine)
        self.attention = Attention(
            pages=self.pages, tiers=self.tiers, importance=self.importance,
            prefetcher=self.prefetcher, policies=self.policies, budgets=self.budgets,
            mover=self.mover, planner=self.planner, host=self.host, kernels=self.kernels,
            telemetry=self.telemetry,
            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=self.device,
            backend=self.backend)
        self._filled: list[tuple | None] = [None] * num_layers  # page filled by the last token
        self.graphs = DecodeGraphs(self.telemetry, graph_backend or "cuda") \
            if config.cuda_graphs else None
        self._stash: list[tuple | None] = [None] * num_layers  # a graph step's k, v
        self._deferred: list[Exception | None] = [None] * num_layers  # a failed demotion

    # --- geometry ---------------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        return self.hbm.page_bytes

    @property
    def staging(self) -> torch.Tensor:
        """``[RING, staging_pages, *page_shape]`` staging buffers on the device."""
        return self.prefetcher.buffers

    def length(self, layer: int = 0) -> int:
        """Tokens per sequence stored for ``layer`` (evicted ones included)."""
        return self.pages.length(layer)

    def num_pages(self, layer: int = 0) -> int:
        return self.pages.num_pages(layer)

    @property
    def pad(self) -> torch.Tensor:
        """``[B]`` left-padding tokens of each sequence (see :meth:`set_padding`)."""
        return self.pages.pad

    def set_padding(self, pad: torch.Tensor | list[int]) -> None:
        """Mark the first ``pad[b]`` tokens of sequence ``b`` as left padding: they stay stored
        but are never attended (pages made only of padding are skipped, the boundary page is
        masked token by token)."""
        self.pages.pad = validate.check_padding(self, pad)
        self.pages.sequences_changed()

    def _tables(self, layer: int) -> LayerTables:
        return self.pages.tables(layer, self.tiers)

    # --- append ------------------------------------------------------------------------------

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``T`` new tokens per sequence to ``layer``.

        Args:
            k, v: ``[B, H_kv, T, D]`` (HF layout, keys post-RoPE), any float dtype (cast to the
                cache's dtype).
        """
        t0 = time.perf_counter()
        layer, t = validate.check_update(self, layer, k, v)
        st, pm, p = self.pages.layers[layer], self.pages, self.page_size
        k, v = k.detach(), v.detach()  # the cache stores values, not autograd history
        n0 = st.length
        n1 = n0 + t
        first_new, end = math.ceil(n0 / p), math.ceil(n1 / p)
        new = end - first_new
        if layer == 0:
            self._start_step(n0, new, t == 1)
        if new:  # take the new pages' HBM slots (demoting first if HBM is full)
            alive = pm.alive.nonzero().flatten().tolist()
            if self.hbm.num_free(layer) < new * len(alive):
                self.budgets.make_room(layer, new * len(alive))
            slots = self.hbm.alloc(layer, new * len(alive))  # raises before any change
            if t == 1:  # a decode token starts a page: the device tables are patched
                pm.add_pages(layer, alive, first_new, slots)
            else:
                rows_new = torch.tensor(alive, dtype=torch.long)[:, None]
                st.slot[rows_new, torch.arange(first_new, end)] = torch.tensor(
                    slots, dtype=torch.int32).view(len(alive), new)
                st.tier[rows_new, torch.arange(first_new, end)] = HOT
                st.edited(cold=False)
        if t == 1:
            if n1 % p == 0:  # the token fills its page: its metadata follows the attention
                tabs = self._tables(layer)
                self._filled[layer] = (tabs.current_slots, tabs.current_rows)
            if self._graphed(layer):  # written by the captured step, with the attention
                self._tables(layer)  # current at the old length: the write position is right
                self._stash[layer] = (k, v)
            else:
                self.attention.write_token(layer, k, v)
        else:
            self.attention.write_chunk(layer, k, v, pm.alive.nonzero().flatten().tolist(), n0, n1)
        st.length = n1
        self.telemetry.layers[layer].host_time_s += time.perf_counter() - t0

    def _start_step(self, n0: int, new: int, decode: bool) -> None:
        """Before layer 0 appends: settle what the last step deferred and give every layer in
        step HBM room for the pages this step starts, so a full hierarchy raises here, with
        nothing appended and every layer in step, not half-way through the step."""
        self.settle(decode=decode)
        if not new:  # the usual decode step: no page starts
            return
        need = new * int(self.pages.alive.sum())
        for layer in range(self.num_layers):
            if self.pages.length(layer) == n0 and self.hbm.num_free(layer) < need:
                self.budgets.make_room(layer, need)

    def settle(self, *, decode: bool = True) -> None:
        """Retry the demotions a step deferred (see the class docstring); raises
        :class:`KVCapacityError` or :class:`KVIOError` if one still fails (their pages stay
        in HBM, nothing else changes): free a sequence, free disk space or raise capacity,
        then call again."""
        if not any(self._deferred):
            return
        for layer, err in enumerate(self._deferred):
            if err is None:
                continue
            try:
                self.budgets.rebalance(layer, decode)
            except (KVCapacityError, KVIOError) as e:
                why = (f"{e} Nothing was appended: the pages over the hot budget stay in HBM "
                       "and every layer is in step; retry after freeing room.")
                raise (KVIOError(e.errno, why) if isinstance(e, KVIOError)
                       else KVCapacityError(why)) from e
            self._deferred[layer] = None

    # --- attention ---------------------------------------------------------------------------

    def attend(self, layer: int, q: torch.Tensor, *, sm_scale: float | None = None,
               softcap: float | None = None, sliding_window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the ``T`` newest tokens' queries over ``layer``'s cache (causal).

        Args:
            q: ``[B, H_q, T, D]`` queries (post-RoPE) of the tokens the last :meth:`update` added.
            sm_scale: score scale (default ``D ** -0.5``).
            softcap: optional logit softcap.
            sliding_window: this layer's window ``W`` (a query at ``t`` sees keys ``t - j < W``):
                pages no future query can see are dropped (as HF's sliding caches do), the rest
                stay hot; pass it on every call of a sliding layer.
            sinks: optional ``[H_q]`` attention-sink logits (GPT-OSS): an extra logit per head
                with a zero value vector, so ``out *= sigmoid(lse - sinks)``.

        Returns:
            ``[B, H_q, T, D]`` in ``q``'s dtype.
        """
        t0 = time.perf_counter()
        layer = validate.check_attend(self, layer, q, sm_scale, softcap, sliding_window, sinks)
        st, tel = self.pages.layers[layer], self.telemetry.layers[layer]
        b, hq, t, d = q.shape
        decode = t == 1
        self.telemetry.decoding = decode
        st.window = sliding_window
        tabs = self._tables(layer)
        if st.window is not None and not decode and tabs.cold_pages:
            raise NotImplementedError(
                f"layer {layer}: a sliding-window prefill found demoted pages; pass "
                "sliding_window on every attend call of this layer.")
        buffer = self.prefetcher.next_buffer(layer)
        qd = q.detach() if q.dtype == self.dtype and q.device == self.device else \
            q.detach().to(self.device, self.dtype)
        scale = sm_scale if sm_scale is not None else d ** -0.5
        common = dict(sm_scale=scale, softcap=softcap, validate=False, backend=self.backend)
        if decode and self._stash[layer] is not None:  # the captured step, replayed
            k, v = self._stash[layer]
            self._stash[layer] = None
            buffer = layer % RING  # a fixed staging buffer: the graph bakes its address
            att = self.attention
            res = self.graphs.run(
                layer, att.graph_key(layer, tabs, common, sinks, q.dtype), k, v, qd,
                lambda k_, v_, q_: att.graph_step(layer, k_, v_, q_, buffer, common, sinks,
                                                  q.dtype))
            att.count_replayed_copies(layer)
        else:
            run = self.attention.decode if decode else self.attention.prefill
            out, lse = run(layer, qd, tabs, buffer, common)
            res = self.attention.finish(out, lse, sinks, q.dtype, (b, hq, t, d))
        tel.attend_calls += 1
        self._after(layer, decode, qd[:, :, 0] if decode else None)
        tel.host_time_s += time.perf_counter() - t0
        return res

    def _graphed(self, layer: int) -> bool:
        """Whether ``layer``'s decode steps go through a captured graph (not on a sliding
        window layer, whose mask moves per token, nor with pages on a disk tier)."""
        return self.graphs is not None and self.pages.layers[layer].window is None and \
            not self.mover.on_disk(layer)

    def _after(self, layer: int, decode: bool, q1: torch.Tensor | None) -> None:
        """The structural work after a layer's attention: the Quest metadata of a page the step
        filled, the budgets when a decision is due, the importance snapshot the next decision
        reads (taken a step ahead, asynchronously), and the next layer's prefetch."""
        tel, budgets, imp = self.telemetry.layers[layer], self.budgets, self.importance
        imp.track(layer, decode)
        if decode:
            tel.decode_steps += 1
            imp.last_q[layer] = q1
            if self._filled[layer] is not None:
                slots, rows = self._filled[layer]
                self._filled[layer] = None
                imp.write_metadata(layer, self.hbm.pool(layer), slots,
                                   torch.full_like(slots, self.page_size), rows)
        needs = budgets.needs_importance(layer)
        bound = self.policies.demotion.needs_bound
        if budgets.due(layer, decode=decode):
            if needs and not decode:  # a prompt chunk: rank by its own, current importance
                imp.snapshot(layer, bound=bound)
            try:
                budgets.rebalance(layer, decode)
            except (KVCapacityError, KVIOError) as e:  # rolled back: retried at the next step
                self._deferred[layer] = e
        if needs and decode and budgets.due_next(layer):
            imp.snapshot(layer, bound=bound)
        self._prefetch_next(layer, decode)

    def _prefetch_next(self, layer: int, decode: bool) -> None:
        """Start fetching what the next layer (or layer 0 of the next step) will attend."""
        if self.config.prefetch == "none" or self.graphs is not None:
            return
        nxt = (layer + 1) % self.num_layers
        mode = self.planner.mode(nxt)
        if self.pages.length(nxt) == 0 or (nxt == 0 and not decode):
            return
        if mode == "split":  # nothing crosses the link; disk pages come into host memory
            if self.mover.on_disk(nxt):
                self.host.read_ahead(nxt)
            return
        if self.config.recalls and not decode:
            return
        tabs = self._tables(nxt)
        if tabs.cold_pages:
            self.prefetcher.start(nxt, tabs, recall=mode == "recall")

    # --- whole-cache operations ----------------------------------------------------------

    def move(self, layer: int, sequence: int, page: int, tier: int) -> None:
        """Move one live page to another tier (spill to disk, reload, demote by hand); never
        the page being filled, nor out of HBM on a sliding-window layer."""
        layer, sequence, page, tier = validate.check_move(self, layer, sequence, page, tier)
        self.prefetcher.cancel(layer)  # a copy in flight may still read the slot freed below
        self.mover.move(layer, sequence, page, tier)

    def evict(self, layer: int, sequence: int, pages: list[int]) -> None:
        """Drop ``pages`` (distinct live pages, not a sink nor the page being filled) of
        ``sequence`` in ``layer`` for good (counted as evicted tokens)."""
        layer, sequence, pages = validate.check_evict(self, layer, sequence, pages)
        if not pages:
            return
        self.prefetcher.cancel(layer)
        self.mover.drop(layer, sequence, pages)

    def free(self, sequence: int) -> None:
        """Release every page of ``sequence``; it attends nothing until :meth:`reset`."""
        sequence = validate.check_sequence(self, "sequence", sequence)
        self.importance.fit_sketch_all()  # before any row changes: no pending key goes stale
        self.prefetcher.cancel_all()
        self.mover.free(sequence)
        self.importance.clear_sequence(sequence)
        self.pages.alive[sequence] = False
        self.pages.sequences_changed()

    def reorder(self, index: torch.Tensor | list[int]) -> None:
        """Sequence ``i`` becomes old sequence ``index[i]`` (beam search). A sequence chosen
        twice gets its own copy of every page (in its tier, or the next one with room); one
        not chosen is freed. Raises :class:`KVCapacityError`, changing nothing, when the
        copies do not fit."""
        index = validate.check_reorder(self, index)
        self.importance.fit_sketch_all()  # before any row moves: no pending key goes stale
        self.prefetcher.reset()  # their copies may read slots released below
        if self.graphs is not None:
            self.graphs.reset()
        self.mover.reorder(index)
        self._forget_plans()
        rows = torch.tensor(index)
        self.importance.reorder(rows)
        self.policies.eviction.reorder(rows)
        self.pages.alive = self.pages.alive[rows]
        self.pages.pad = self.pages.pad[rows]
        self.pages.sequences_changed()

    def gather(self, layer: int, sequence: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every live token of ``sequence`` as ``(positions [n], kv [n, 2, H_kv, D])`` on the
        CPU, read from wherever it lives: one read per tier (tests compare it with a shadow)."""
        layer = validate.index("layer", layer, self.num_layers, what="a layer of the cache")
        sequence = validate.index("sequence", sequence, self.batch_size, what="a sequence")
        p, n = self.page_size, self.pages.length(layer)
        live = self.pages.live_pages(layer, sequence)
        pages = self.mover.read(layer, torch.full_like(live, sequence), live)
        pos = (live[:, None] * p + torch.arange(p)).flatten()
        kv = pages.permute(0, 2, 1, 3, 4).reshape(len(live) * p, 2, self.num_kv_heads,
                                                   self.head_dim)
        keep = pos < n  # the unfilled tail of the last page is not a token
        return pos[keep], kv[keep]

    # --- telemetry -----------------------------------------------------------------------------

    def residency(self) -> list[dict[str, int]]:
        """Per layer, pages of live sequences per tier kind (``{"hbm": n, "ddr": m, ...}``)."""
        return [{self.tiers[ti].kind: n for ti, n in self.pages.residency(layer).items()}
                for layer in range(self.num_layers)]

    def stats(self, *, all_ranks: bool = False) -> dict:
        """Telemetry per layer and in total (bytes per tier, launches, prefetch outcomes,
        evicted tokens, resident fraction per tier, host time); ``all_ranks``: also every
        rank's total and their sum under tensor parallelism (collective: call on every rank)."""
        fractions = []
        for counts in self.residency():
            total = max(1, sum(counts.values()))
            fractions.append({t.kind: counts.get(t.kind, 0) / total for t in self.tiers})
        out = self.telemetry.stats(fractions)
        out["total"]["page_bytes"], out["total"]["page_size"] = self.page_bytes, self.page_size
        return telemetry.all_ranks(out) if all_ranks else out

    # --- save and restore ------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write the whole cache (every tier, tables, importance) to one safetensors file in
        ``directory`` (an existing folder), atomically; returns its path. A storage failure
        raises :class:`KVIOError` and leaves no file behind."""
        directory = validate.check_save_dir(directory)
        try:
            return snapshot.save(self, directory)
        except OSError as e:
            raise validate.io_error(e, f"saving the cache into {directory}") from e

    def load(self, path: str | Path) -> None:
        """Replace this cache's content with a file written by :meth:`save` from a cache of
        the same geometry. The file is validated whole (format, checksum, geometry, the
        consistency of its tables) and the tiers' room checked before anything changes; its
        disk pages are written before the old content is released, so a failure leaves the old
        content intact."""
        snapshot.load(self, path)

    def reset(self) -> None:
        """Release every page and forget all per-sequence state (tables, importance, policy
        state, prefetches); the geometry and telemetry stay."""
        self.prefetcher.reset()
        for layer, st in enumerate(self.pages.layers):
            live = st.tier != NONE
            self.mover.release(layer, st.tier[live], st.slot[live])
        self.pages.reset()
        self.importance.reset()
        self.budgets.reset()
        self._forget_plans()
        self._filled = [None] * self.num_layers
        self._stash = [None] * self.num_layers
        self._deferred = [None] * self.num_layers
        if self.graphs is not None:
            self.graphs.reset()

    def _forget_plans(self) -> None:
        """The host's cached cold lists and the layers' chosen ways describe pages that moved
        (a reorder, a load, a reset): forget them."""
        if self.host is not None:
            self.host.reset()
        self.planner.reset()

    def close(self) -> None:
        """Let the reads in flight finish, delete the disk tiers' segment files and stop their
        I/O threads (otherwise done when the cache is garbage-collected or the process ends).
        The cache cannot be used after."""
        self.prefetcher.reset()
        for tier in self.tiers:
            tier.close()
