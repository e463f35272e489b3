"""TieredKVCache: the "offload, not evict" KV hierarchy of one model, without transformers.

Per layer, every sequence's KV is a list of logical pages (``page_size`` tokens). Each page is
*hot* (a slot of the HBM pool), *cold* (a slot of a lower tier: DDR, CXL or disk, at full
precision) or *evicted* (dropped: only when ``evict_budget > 0``). The calls per layer are:

    cache.update(layer, k, v)        # append the new tokens' K/V (always into hot pages)
    out = cache.attend(layer, q)     # attention of the new queries over the whole cache

``attend`` runs attention over the hot set (one kernel on the HBM pool) and over the cold pages
it needs, fetched into a device staging buffer (one page-copy launch per source tier, usually
already in flight thanks to the layer-ahead prefetcher), merges the two partial states by LSE,
updates page importance from the kernels' per-page attention mass, and then applies the budgets:
evict down to ``evict_budget``, demote down to ``hot_budget`` (never the sinks, the recent window
or the page being filled). Sequences advance in lockstep (a batch decodes one token per step, as
in HF generation with left padding).

This class only orchestrates. The parts, one concept per module: :mod:`~tierattn.pagemap` (where
each page lives), :mod:`~tierattn.mover` (every page movement), :mod:`~tierattn.prefetch`
(staging ring, layer-ahead prefetch), :mod:`~tierattn.importance` (page mass, Quest metadata),
:mod:`~tierattn.policy` (demotion, eviction and recall policies; the budgets),
:mod:`~tierattn.snapshot` (save/load). Kernels are called through :attr:`kernels`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from tierattn import snapshot
from tierattn.config import TierConfig
from tierattn.errors import KernelInputError, KVCapacityError
from tierattn.importance import Importance
from tierattn.kernels import KernelSet
from tierattn.mover import Mover
from tierattn.pagemap import HOT, NONE, PageMap
from tierattn.policy import EVICTIONS, Budgets, build_policies
from tierattn.prefetch import RING, Prefetcher
from tierattn.telemetry import Telemetry
from tierattn.tiers import Tier, build_tier, plan_memory
from tierattn.transfer import TransferEngine, default_engine

__all__ = ["TieredKVCache"]


class TieredKVCache:
    """KV cache of ``num_layers`` layers over a hierarchy of tiers (see module docstring).

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
            ``attend="all"``, the recall budget for ``"topk"``); larger cold sets are attended
            in several batches and merged.
        poison_freed: fill every released memory-tier slot with NaN (a debugging aid: a
            later read of a freed slot shows up as NaN; costs one fill per release).
        kernels: the kernel entry points (default: the package's); every component calls
            kernels through this one object, so tools can time or stub them.
    """

    def __init__(self, config: TierConfig, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, batch_size: int = 1, dtype: torch.dtype = torch.float32,
                 device: str | torch.device | None = None, engine: TransferEngine | None = None,
                 fingerprint: str = "tierattn", staging_pages: int | None = None,
                 poison_freed: bool = False, kernels: KernelSet | None = None) -> None:
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("batch_size", batch_size)):
            if not isinstance(v, int) or v < 1:
                raise KernelInputError(f"{name} must be an int >= 1, got {v!r}.")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise KernelInputError(f"dtype must be fp16, bf16 or fp32, got {dtype}.")
        self.config = config
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.batch_size, self.dtype = batch_size, dtype
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
        self.telemetry = Telemetry(num_layers)
        self.pages = PageMap(num_layers=num_layers, batch_size=batch_size,
                             max_pages=self.max_pages, page_size=p, sink_pages=config.sink_pages,
                             recent_pages=config.recent_pages, device=self.device)
        self.importance = Importance(self.pages, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     dtype=dtype, snapkv_window=config.snapkv_window,
                                     kernels=self.kernels, backend=self.backend,
                                     telemetry=self.telemetry)
        self.policies = build_policies(config, self.importance, self.pages)
        self.tiers: list[Tier] = [
            build_tier(spec, num_layers=num_layers, capacity=cap, page_shape=self.page_shape,
                       dtype=dtype, device=self.device, fingerprint=fingerprint)
            for spec, cap in zip(config.tiers, capacities)]
        for tier in self.tiers:
            tier.poison_freed = poison_freed
        self.hbm = self.tiers[HOT]
        self.mover = Mover(self.tiers, self.pages, self.engine, self.telemetry, self.device)
        self.prefetcher = Prefetcher(num_layers=num_layers, staging_pages=self.staging_pages,
                                     page_shape=self.page_shape, dtype=dtype, device=self.device,
                                     pages=self.pages, mover=self.mover, engine=self.engine,
                                     telemetry=self.telemetry)
        self.budgets = Budgets(config, self.pages, self.policies, self.mover, len(self.tiers))

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
        pad = torch.as_tensor(pad, dtype=torch.long).flatten().cpu()
        if pad.numel() != self.batch_size or (pad < 0).any():
            raise KernelInputError(f"pad must list {self.batch_size} non-negative token counts, "
                                   f"got {pad.tolist()}.")
        self.pages.pad = pad.clone()

    # --- append ------------------------------------------------------------------------------

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``T`` new tokens per sequence to ``layer``.

        Args:
            k, v: ``[B, H_kv, T, D]`` (HF layout, keys post-RoPE), any float dtype (cast to the
                cache's dtype).
        """
        t0 = time.perf_counter()
        st, pm = self.pages.layers[layer], self.pages
        b, _, t, _ = self._check_kv(k, v)
        if t > self.config.prefill_chunk_size:
            raise KernelInputError(
                f"update got {t} tokens per sequence; the pools have headroom for "
                f"prefill_chunk_size={self.config.prefill_chunk_size}: prefill in chunks of at "
                "most that many tokens, or raise prefill_chunk_size.")
        p, n0 = self.page_size, st.length
        n1 = n0 + t
        if n1 > self.max_pages * p:
            raise KVCapacityError(
                f"sequence length {n1} exceeds max_context={self.config.max_context} of the "
                "config; raise max_context.")
        first_new, end = math.ceil(n0 / p), math.ceil(n1 / p)
        alive = pm.alive.nonzero().flatten().tolist()
        new = end - first_new
        if self.hbm.num_free(layer) < new * len(alive):
            self.budgets.make_room(layer, new * len(alive))
        slots = self.hbm.alloc(layer, new * len(alive))  # raises before any state changes
        if new:  # most decode steps fill the current page: no new page, no table change
            rows_new = torch.tensor(alive, dtype=torch.long)[:, None]
            st.slot[rows_new, torch.arange(first_new, end)] = torch.tensor(
                slots, dtype=torch.int32).view(len(alive), new)
            st.tier[rows_new, torch.arange(first_new, end)] = HOT
        # scatter the tokens into their pages: one indexed write per layer
        every = len(alive) == b  # no freed sequence: skip selecting rows
        pool = self.hbm.pool(layer)
        if t == 1 and every:
            # a decode step: one token per sequence, all into page n0 // p at lane n0 % p (the
            # general path below with T = 1, in a third of the small host-side ops)
            pg = n0 // p
            meta_slots = st.slot[:, pg].contiguous()  # kernels read dense int32 arrays
            page_slot = meta_slots.long().to(self.device)
            pool[page_slot, 0, n0 % p] = k[:, :, 0].to(self.device, self.dtype)
            pool[page_slot, 1, n0 % p] = v[:, :, 0].to(self.device, self.dtype)
            lens = torch.full((b,), min(n1 - pg * p, p), dtype=torch.int32)
            meta_rows = pm.seq_idx * self.max_pages + pg
        else:
            rows = torch.tensor(alive, dtype=torch.long)
            slot_rows = st.slot if every else st.slot[rows]
            pos = torch.arange(n0, n1)
            page_slot = slot_rows[:, pos // p].long().to(self.device)  # [b_alive, T]
            off = (pos % p).to(self.device)
            if not every:
                k, v = k[rows.to(k.device)], v[rows.to(v.device)]
            kk = k.permute(0, 2, 1, 3).to(self.device, self.dtype)  # [b, T, H, D]
            vv = v.permute(0, 2, 1, 3).to(self.device, self.dtype)
            pool[page_slot, 0, off[None, :].expand_as(page_slot)] = kk
            pool[page_slot, 1, off[None, :].expand_as(page_slot)] = vv
            # Quest metadata of every touched page (the partly filled last page included)
            touched = pm.page_idx[n0 // p:end]
            meta_slots = slot_rows[:, touched].flatten()
            lens = (torch.clamp(n1 - touched * p, max=p)).repeat(len(alive)).to(torch.int32)
            meta_rows = (rows[:, None] * self.max_pages + touched[None, :]).flatten()
        if meta_slots.numel():
            self.importance.write_metadata(layer, pool, meta_slots, lens, meta_rows)
        st.length = n1
        self.telemetry.layers[layer].host_time_s += time.perf_counter() - t0

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise KernelInputError(f"{name} must be a [B, H_kv, T, D] tensor.")
        if k.shape != v.shape:
            raise KernelInputError(f"k {list(k.shape)} and v {list(v.shape)} must match.")
        b, hkv, t, d = k.shape
        if (b, hkv, d) != (self.batch_size, self.num_kv_heads, self.head_dim):
            raise KernelInputError(
                f"k/v have shape {list(k.shape)}; the cache holds B={self.batch_size}, "
                f"H_kv={self.num_kv_heads}, D={self.head_dim} ([B, H_kv, T, D]).")
        return b, hkv, t, d

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
        pm, tel, ks = self.pages, self.telemetry.layers[layer], self.kernels
        st = pm.layers[layer]
        b, hq, t, d = q.shape
        if b != self.batch_size or d != self.head_dim or hq % self.num_kv_heads:
            raise KernelInputError(
                f"q has shape {list(q.shape)}; expected [B={self.batch_size}, H_q (a multiple "
                f"of H_kv={self.num_kv_heads}), T, D={self.head_dim}].")
        if t > st.length:
            raise KernelInputError(f"q has T={t} queries but layer {layer} holds {st.length} "
                                   "tokens; call update(layer, k, v) first.")
        decode = t == 1
        self.telemetry.decoding = decode
        if sliding_window is not None and (not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise KernelInputError(f"sliding_window must be an int >= 1, got {sliding_window!r}.")
        st.window = sliding_window
        buffer = self.prefetcher.next_buffer(layer)
        qd = q.to(self.device, self.dtype)
        n_pages = pm.num_pages(layer)
        # tokens before `visible_from` are padding or outside every query's window
        visible_from = pm.pad
        if st.window is not None:
            visible_from = torch.clamp(pm.pad, min=st.length - t - st.window + 1)
        attendable = pm.attendable(n_pages, visible_from)
        cold = (st.tier[:, :n_pages] > HOT) & attendable
        if st.window is not None and not decode and bool(cold.any()):
            raise NotImplementedError(
                f"layer {layer}: a sliding-window prefill found demoted pages inside the window; "
                "pass sliding_window on every attend call of this layer.")
        need = self.policies.recall.select(layer, qd[:, :, 0], cold) if decode else \
            pm.page_lists(cold)
        hot_table, hot_pages = pm.hot_table(layer, n_pages, attendable)
        # decode masks the window token by token; prefill lets the kernel apply it
        lane_from = torch.clamp(pm.pad, min=st.length - st.window) \
            if st.window is not None and decode else pm.pad
        want_mass = self.budgets.wants_mass()
        scale = sm_scale if sm_scale is not None else d ** -0.5
        common = dict(sm_scale=scale, softcap=softcap, validate=False, backend=self.backend)
        q1 = qd[:, :, 0]
        if not decode:
            qf = qd.permute(0, 2, 1, 3).reshape(b * t, hq, d)
            qo = torch.arange(b + 1, dtype=torch.int32, device=self.device) * t

        def kernel(pool, table, entries, causal, mass):
            first = pm.first_lane(entries, lane_from)
            if decode:
                return ks.sparse_decode(q1, pool, table, return_page_mass=want_mass,
                                        first_lane=first, **common)
            return ks.paged_prefill(qf, pool, table, qo, causal=causal, first_lane=first,
                                    sliding_window=st.window if causal else None,
                                    return_page_mass=mass, **common)

        # with no cold page the chunk's own softmax is the final one: its page mass is the
        # importance, without the second pass under the merged LSE
        pool = self.hbm.pool(layer)
        parts = [kernel(pool, hot_table, hot_pages, True, want_mass and not any(need))]
        tables, entries, pools = [hot_table], [hot_pages], [pool]
        for part, table, run in self.prefetcher.attend_cold(
                layer, need, buffer, lambda pool, table, run: kernel(pool, table, run.entries,
                                                                     False, False)):
            parts.append(part)
            tables.append(table)
            entries.append(run.entries)
            pools.append(self.staging[run.buffer])
        tel.kernel_launches += len(parts)
        if len(parts) == 1:
            out, lse = parts[0].out, parts[0].lse
        else:
            out, lse = ks.merge_states(torch.stack([x.out for x in parts]),
                                       torch.stack([x.lse for x in parts]), backend=self.backend)
            tel.kernel_launches += 1
        if sinks is not None:  # the sink takes exp(sink) of the softmax mass and adds nothing
            out = out * torch.sigmoid(lse - sinks.to(lse.device, torch.float32)).unsqueeze(-1)
        if decode and want_mass:
            for part, table, ents in zip(parts, tables, entries):
                self.importance.add_decode(layer, part, table, ents, lse)
        elif not decode:
            self._prefill_importance(layer, parts, tables, entries, pools, need, buffer, qd,
                                     lse, scale, softcap, want_mass)
        if decode:
            self.importance.last_q[layer] = q1
            tel.decode_steps += 1
        tel.attend_calls += 1
        self.budgets.rebalance(layer, decode)
        self._prefetch_next(layer, q1 if decode else None)
        res = out.view(b, t, hq, d).permute(0, 2, 1, 3) if not decode else out.unsqueeze(2)
        tel.host_time_s += time.perf_counter() - t0
        return res.to(q.dtype)

    def _prefill_importance(self, layer, parts, tables, entries, pools, need, buffer, qd, lse,
                            scale, softcap, want_mass) -> None:
        """A prompt chunk's page mass (and SnapKV's window mass) under the merged LSE."""
        want_snap = self.budgets.wants_window_mass(decode=False)
        if not (want_mass or want_snap):
            return
        imp = self.importance
        snap = torch.zeros(self.batch_size, self.max_pages) if want_snap else None
        kw = dict(qd=qd, lse=lse, scale=scale, softcap=softcap, snap=snap)
        if parts[0].page_mass is not None:
            imp.add_mass(layer, entries[0], parts[0].page_mass.sum(-1))
        imp.add_prefill(layer, tables[0], entries[0], pools[0], True,
                        **{**kw, "mass": want_mass and parts[0].page_mass is None})
        if len(parts) == 2:
            imp.add_prefill(layer, tables[1], entries[1], pools[1], False, mass=want_mass, **kw)
        elif len(parts) > 2:  # batches reused the buffer: stream the cold pages once more
            for _ in self.prefetcher.attend_cold(
                    layer, need, buffer, lambda pool, table, run: imp.add_prefill(
                        layer, table, run.entries, pool, False, mass=want_mass, **kw)):
                pass
        if want_snap:
            imp.snap[layer] = snap

    def _prefetch_next(self, layer: int, q: torch.Tensor | None) -> None:
        """Start fetching what the next layer (or layer 0 of the next step) will attend."""
        if self.config.prefetch == "none":
            return
        nxt = (layer + 1) % self.num_layers
        if self.pages.length(nxt) == 0 or (nxt == 0 and q is None):
            return
        n_pages = self.pages.num_pages(nxt)
        cold = (self.pages.layers[nxt].tier[:, :n_pages] > HOT) & self.pages.attendable(n_pages)
        pages = self.policies.recall.prefetch(nxt, q, cold)
        if pages is not None:
            self.prefetcher.start(nxt, pages)

    # --- whole-cache operations ----------------------------------------------------------

    def move(self, layer: int, sequence: int, page: int, tier: int) -> None:
        """Move one live page to another tier (spill to disk, reload, demote by hand)."""
        self.prefetcher.cancel(layer)  # a copy in flight may still read the slot freed below
        self.mover.move(layer, sequence, page, tier)

    def evict(self, layer: int, sequence: int, pages: list[int]) -> None:
        """Drop ``pages`` of ``sequence`` in ``layer`` for good (counted as evicted tokens)."""
        st = self.pages.layers[layer]
        bad = [pg for pg in pages if not 0 <= pg < self.max_pages or
               int(st.tier[sequence, pg]) == NONE]
        if bad:
            raise KernelInputError(f"pages {bad} of sequence {sequence} do not exist.")
        self.prefetcher.cancel(layer)
        self.mover.drop(layer, sequence, pages)

    def free(self, sequence: int) -> None:
        """Release every page of ``sequence``; it attends nothing until :meth:`reset`."""
        self.prefetcher.cancel_all()
        self.mover.free(sequence)
        for mass in self.importance.mass:
            mass[sequence] = 0
        self.pages.alive[sequence] = False

    def reorder(self, index: torch.Tensor | list[int]) -> None:
        """Sequence ``i`` becomes old sequence ``index[i]`` (beam search). A sequence chosen
        twice gets its own copy of every page (in its tier, or the next one with room); one
        not chosen is freed. Raises :class:`KVCapacityError`, changing nothing, when the
        copies do not fit."""
        index = [int(i) for i in (index.tolist() if isinstance(index, torch.Tensor) else index)]
        if len(index) != self.batch_size or not all(0 <= i < self.batch_size for i in index):
            raise KernelInputError(f"reorder index must list {self.batch_size} sequence ids in "
                                   f"0..{self.batch_size - 1}, got {index}.")
        self.prefetcher.cancel_all()  # their copies may read slots released below
        self.mover.reorder(index)
        rows = torch.tensor(index)
        self.importance.reorder(rows)
        self.policies.eviction.reorder(rows)
        self.policies.recall.reset()
        self.pages.alive = self.pages.alive[rows]
        self.pages.pad = self.pages.pad[rows]

    def gather(self, layer: int, sequence: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every live token of ``sequence`` as ``(positions [n], kv [n, 2, H_kv, D])`` on the
        CPU, read from wherever it lives: one read per tier (tests compare it with a shadow)."""
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

    def stats(self) -> dict:
        """Telemetry per layer and in total (bytes per tier, launches, prefetch outcomes,
        evicted tokens, resident fraction per tier, host time)."""
        fractions = []
        for counts in self.residency():
            total = max(1, sum(counts.values()))
            fractions.append({t.kind: counts.get(t.kind, 0) / total for t in self.tiers})
        out = self.telemetry.stats(fractions)
        out["total"]["page_bytes"] = self.page_bytes
        return out

    # --- save and restore ------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write the whole cache (every tier, tables, importance) to one safetensors file in
        ``directory``, atomically; returns its path."""
        return snapshot.save(self, directory)

    def load(self, path: str | Path) -> None:
        """Replace this cache's content with a file written by :meth:`save` from a cache of
        the same geometry; the file is validated whole before anything changes."""
        snapshot.load(self, path)

    def reset_content(self) -> None:
        """Release every page and forget all per-sequence state (tables, importance, policy
        state, prefetches); the geometry and telemetry stay."""
        self.prefetcher.cancel_all()
        for layer, st in enumerate(self.pages.layers):
            live = st.tier != NONE
            self.mover.release(layer, st.tier[live], st.slot[live])
        self.pages.layers = [self.pages.new_layer() for _ in range(self.num_layers)]
        for layer in range(self.num_layers):
            self.importance.reset(layer)
        self.policies.recall.reset()
        self.budgets.pruned = [False] * self.num_layers
        self.prefetcher.calls = [0] * self.num_layers

    def refresh_metadata(self, layer: int) -> None:
        """Recompute the Quest metadata of every live page of ``layer`` (after a load)."""
        st, p = self.pages.layers[layer], self.page_size
        live = (st.tier != NONE).nonzero()
        if not len(live):
            return
        rows, cols = live[:, 0], live[:, 1]
        data = self.mover.read(layer, rows, cols).to(self.device)
        lens = torch.clamp(st.length - cols * p, max=p).to(torch.int32)
        self.importance.write_metadata(layer, data, torch.arange(len(live), dtype=torch.int32),
                                       lens, rows * self.max_pages + cols)

