"""TieredKVCache: the "offload, not evict" KV hierarchy of one model, without transformers.

Per layer, every sequence's KV is a list of logical pages (``page_size`` tokens). Each page is
*hot* (a slot of the HBM pool), *cold* (a slot of a lower tier: DDR, CXL or disk, at full
precision) or *evicted* (dropped: only when ``evict_budget > 0``). The calls per layer are:

    cache.update(layer, k, v)        # append the new tokens' K/V (always into hot pages)
    out = cache.attend(layer, q)     # attention of the new queries over the whole cache

``attend`` runs attention over the hot set (one kernel on the HBM pool) and over the cold pages
it needs, fetched into a device staging buffer (one page-copy launch per source tier, usually
already in flight thanks to the layer-ahead prefetcher), merges the two partial states by LSE,
updates page importance from the kernels' per-page attention mass, and then applies the policy:
evict down to ``evict_budget``, demote down to ``hot_budget`` (never the sinks, the recent window
or the page being filled). Sequences advance in lockstep (a batch decodes one token per step, as
in HF generation with left padding); bookkeeping lives on the host, page data and page metadata
(Quest ``kmin``/``kmax`` of *every* page) on the device.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from pathlib import Path

import torch

from tierattn.config import TierConfig
from tierattn.errors import KernelInputError, KVCapacityError, KVFileError
from tierattn.kernels import (
    PageTable,
    decode_page_mass,
    merge_states,
    page_metadata,
    paged_prefill,
    paged_prefill_mass,
    quest_score,
    sparse_decode,
)
from tierattn.kvfile import read_kv_file, write_kv_file
from tierattn.telemetry import Telemetry
from tierattn.tiers import MemoryTier, Tier, available_memory, build_tier
from tierattn.transfer import TransferEngine, default_engine

__all__ = ["TieredKVCache", "ring_slot"]

HOT = 0  # tier index of HBM; -1 marks a page that does not exist (evicted or beyond the end)
NONE = -1
#: staging buffers in the ring: layer l+1's prefetch lands while layer l reads its own.
RING = 2


def ring_slot(step: int, layer: int, num_layers: int, ring: int = RING) -> int:
    """Staging buffer of ``layer`` at decode ``step``: consecutive layers, wrapping into the next
    step, never share a buffer while ``ring >= lookahead + 1``."""
    return (step * num_layers + layer) % ring


@dataclass
class _Layer:
    """Host bookkeeping of one layer (``[B, max_pages]`` tensors on the CPU)."""

    tier: torch.Tensor  # int8 tier index, NONE for no page
    slot: torch.Tensor  # int32 slot within that tier
    evicted: torch.Tensor  # bool
    mass: torch.Tensor  # float32 accumulated attention mass (importance)
    snap: torch.Tensor | None = None  # float32 SnapKV observation-window mass
    pruned: bool = False  # SnapKV's one-shot eviction done
    last_q: torch.Tensor | None = None  # [B, H_q, D] latest decode query (Quest importance)
    selection: list[list[int]] | None = None  # topk: pages recalled at the previous step
    prefetch: _Prefetch | None = None
    length: int = 0  # tokens per sequence
    calls: int = 0  # attend calls so far (the step index of the staging ring)
    window: int | None = None  # sliding window of this layer (HF semantics: q - k < window)


@dataclass
class _Prefetch:
    tickets: list  # one per source tier
    buffer: int
    pages: list[list[int]]  # per sequence, logical pages in flight
    slots: list[list[int]]  # their staging slots


@dataclass
class _Staged:
    """Cold pages of one batch resident in a staging buffer, ready to attend."""

    buffer: int
    pages: list[list[int]] = field(default_factory=list)
    slots: list[list[int]] = field(default_factory=list)

    @cached_property
    def entries(self) -> _Entries:
        """The batch's pages as table entries (built once: read only after the batch is
        yielded, when its lists no longer change)."""
        return _Entries.from_lists(self.pages)


@dataclass
class _Entries:
    """The logical pages of a page table's entries, in table order (sequence by sequence, page
    by page), as two ``[nnz]`` long CPU tensors: vectorised bookkeeping instead of Python
    lists per sequence (the host cost of a decode step)."""

    rows: torch.Tensor  # sequence of each entry
    cols: torch.Tensor  # logical page of each entry

    def __len__(self) -> int:
        return self.cols.numel()

    @classmethod
    def from_lists(cls, pages: list[list[int]]) -> _Entries:
        counts = torch.tensor([len(x) for x in pages], dtype=torch.long)
        return cls(torch.repeat_interleave(torch.arange(len(pages)), counts),
                   torch.tensor(list(chain.from_iterable(pages)), dtype=torch.long))


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
    """

    def __init__(self, config: TierConfig, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, batch_size: int = 1, dtype: torch.dtype = torch.float32,
                 device: str | torch.device | None = None, engine: TransferEngine | None = None,
                 fingerprint: str = "tierattn", staging_pages: int | None = None,
                 poison_freed: bool = False) -> None:
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
        self.engine = engine or default_engine(self.device, config.backend)
        self.backend = config.backend
        p = self.page_size = config.page_size
        self.max_pages = math.ceil(config.max_context / p)
        self.page_shape = (2, p, num_kv_heads, head_dim)
        self.must_hot = config.sink_pages + config.recent_pages + 1
        hot_max = max(config.pages(config.hot_budget, self.max_pages, config.max_context),
                      self.must_hot)
        headroom = math.ceil(config.prefill_chunk_size / p) + 1
        if len(config.tiers) == 1 and config.evict_policy == "snapkv":
            hot_max = self.max_pages  # SnapKV holds the whole prompt until it compresses it
        default_capacity = {
            "hbm": batch_size * min(self.max_pages, hot_max + headroom),
            "ddr": batch_size * self.max_pages, "cxl": batch_size * self.max_pages,
            "disk": batch_size * self.max_pages}
        capacities = [spec.capacity_pages if spec.capacity_pages is not None else
                      default_capacity[spec.kind] for spec in config.tiers]
        cold_max = batch_size * max(0, self.max_pages - self.must_hot)
        if staging_pages is None:
            recall = config.pages(config.recall_budget, self.max_pages, config.max_context)
            staging_pages = cold_max if config.attend == "all" else batch_size * max(1, recall)
        self.staging_pages = max(1, min(staging_pages, max(1, cold_max)))
        self._check_memory(capacities)
        self.tiers: list[Tier] = []
        for spec, cap in zip(config.tiers, capacities):
            self.tiers.append(build_tier(spec, num_layers=num_layers, capacity=cap,
                                         page_shape=self.page_shape, dtype=dtype,
                                         device=self.device, fingerprint=fingerprint))
        self.hbm: MemoryTier = self.tiers[0]  # type: ignore[assignment]
        for tier in self.tiers:
            tier.poison_freed = poison_freed
        staging_tier = MemoryTier("staging", 1, RING * self.staging_pages, self.page_shape,
                                  dtype, self.device)
        self.staging = staging_tier.pools[0].view(RING, self.staging_pages, *self.page_shape)
        b, mp = batch_size, self.max_pages
        self.kmin = torch.zeros(num_layers, b * mp, num_kv_heads, head_dim, dtype=dtype,
                                device=self.device)
        self.kmax = torch.zeros_like(self.kmin)
        self.alive = torch.ones(b, dtype=torch.bool)
        self.pad = torch.zeros(b, dtype=torch.long)  # leading padding tokens per sequence
        # logical page numbers and page ends, built once (sliced per call instead of rebuilt)
        self._page_idx = torch.arange(mp)
        self._seq_idx = torch.arange(b)
        self._page_ends = (self._page_idx + 1) * p
        self.layers = [self._new_layer() for _ in range(num_layers)]
        self.telemetry = Telemetry(num_layers)
        self._decoding = False  # the current attend is a decode step (telemetry)
        self._fence = None  # compute work a copy into a reused staging buffer must wait for
        self._rng = torch.Generator().manual_seed(config.seed)
        self._rank_noise = torch.rand(b, mp, generator=self._rng)  # the random policy's order

    def _check_memory(self, capacities: list[int]) -> None:
        """Refuse, with the numbers, a configuration that does not fit, before allocating."""
        page_bytes = torch.Size(self.page_shape).numel() * \
            torch.empty((), dtype=self.dtype).element_size()
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        rows = self.batch_size * self.max_pages
        need: dict[str, list[tuple[str, int]]] = {}
        dev = "cuda" if self.device.type == "cuda" else "cpu"
        for spec, cap in zip(self.config.tiers, capacities):
            if spec.kind != "disk":
                where = dev if spec.kind == "hbm" else "cpu"
                need.setdefault(where, []).append(
                    (f"{spec.kind} pool", self.num_layers * cap * page_bytes))
        need.setdefault(dev, []).extend([
            ("staging ring", RING * self.staging_pages * page_bytes),
            ("page metadata", 2 * self.num_layers * rows * self.num_kv_heads * self.head_dim *
             itemsize)])
        need.setdefault("cpu", []).append(("page tables", self.num_layers * rows * 10))
        for where, items in need.items():
            total = sum(n for _, n in items)
            have = available_memory(self.device if where == "cuda" else torch.device("cpu"))
            if total > 0.9 * have:
                parts = ", ".join(f"{name} {n / 2**30:.2f} GiB" for name, n in items)
                raise KVCapacityError(
                    f"the cache needs {total / 2**30:.2f} GiB on {where} ({parts}) but only "
                    f"{have / 2**30:.2f} GiB is available (at most 90% may be used); lower "
                    "max_context, batch_size or the tiers' capacity_pages.")

    def _new_layer(self) -> _Layer:
        b, mp = self.batch_size, self.max_pages
        return _Layer(tier=torch.full((b, mp), NONE, dtype=torch.int8),
                      slot=torch.zeros(b, mp, dtype=torch.int32),
                      evicted=torch.zeros(b, mp, dtype=torch.bool),
                      mass=torch.zeros(b, mp, dtype=torch.float32))

    # --- geometry ---------------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        return self.hbm.page_bytes

    def length(self, layer: int = 0) -> int:
        """Tokens per sequence stored for ``layer`` (evicted ones included)."""
        return self.layers[layer].length

    def num_pages(self, layer: int = 0) -> int:
        return math.ceil(self.layers[layer].length / self.page_size)

    def _must_hot(self, n_pages: int, layer: int | None = None) -> torch.Tensor:
        """``[B, n_pages]`` bool: per sequence, the sink pages (counted from its first page with
        a real token, after any left padding), the recent window and the page being filled; on
        a sliding-window layer, every page a future query can still see (kept contiguous and
        hot, which keeps positions exact for the window mask)."""
        m = torch.zeros(self.batch_size, n_pages, dtype=torch.bool)
        st = self.layers[layer] if layer is not None else None
        if st is not None and st.window is not None:
            keep_from = st.length - st.window + 1
            m[:, self._page_ends[:n_pages] > keep_from] = True
            return m
        first = self._pad_pages()
        idx = self._page_idx[None, :n_pages]
        m |= (idx >= first[:, None]) & (idx < first[:, None] + self.config.sink_pages)
        m[:, max(0, n_pages - self.config.recent_pages - 1):] = True
        return m

    def _pad_pages(self) -> torch.Tensor:
        """``[B]`` leading pages made only of left padding (never attended, never counted in
        a budget)."""
        return self.pad // self.page_size

    def set_padding(self, pad: torch.Tensor | list[int]) -> None:
        """Mark the first ``pad[b]`` tokens of sequence ``b`` as left padding: they stay stored
        but are never attended (pages made only of padding are skipped, the boundary page is
        masked token by token)."""
        pad = torch.as_tensor(pad, dtype=torch.long).flatten().cpu()
        if pad.numel() != self.batch_size or (pad < 0).any():
            raise KernelInputError(f"pad must list {self.batch_size} non-negative token counts, "
                                   f"got {pad.tolist()}.")
        self.pad = pad.clone()

    def _attendable(self, n_pages: int, start: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, n_pages]``: live sequences' pages holding a token at or after ``start[b]``
        (default: the end of the left padding)."""
        start = self.pad if start is None else start
        return self.alive[:, None] & (self._page_ends[None, :n_pages] > start[:, None])

    def _first_lane(self, entries: _Entries,
                    start: torch.Tensor | None = None) -> torch.Tensor | None:
        """Per table entry, the first lane at or after ``start[b]`` (default: the end of the
        padding); None when nothing is masked."""
        start = self.pad if start is None else start
        if not bool((start > 0).any()):
            return None
        p = self.page_size
        first = (start[entries.rows] - entries.cols * p).clamp(0, p)
        return first.to(torch.int32).to(self.device)

    # --- append ------------------------------------------------------------------------------

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``T`` new tokens per sequence to ``layer``.

        Args:
            k, v: ``[B, H_kv, T, D]`` (HF layout, keys post-RoPE), any float dtype (cast to the
                cache's dtype).
        """
        t0 = time.perf_counter()
        st = self.layers[layer]
        b, hkv, t, d = self._check_kv(k, v)
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
        alive = self.alive.nonzero().flatten().tolist()
        new = end - first_new
        if self.hbm.num_free(layer) < new * len(alive):
            self._make_room(layer, new * len(alive))
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
            meta_rows = self._seq_idx * self.max_pages + pg
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
            touched = self._page_idx[n0 // p:end]
            meta_slots = slot_rows[:, touched].flatten()
            lens = (torch.clamp(n1 - touched * p, max=p)).repeat(len(alive)).to(torch.int32)
            meta_rows = (rows[:, None] * self.max_pages + touched[None, :]).flatten()
        if meta_slots.numel():
            page_metadata(pool, meta_slots.to(self.device), lens.to(self.device),
                          kmin=self.kmin[layer], kmax=self.kmax[layer],
                          rows=meta_rows.to(torch.int32).to(self.device), validate=False,
                          backend=self.backend)
            self.telemetry.layers[layer].kernel_launches += 1
        st.length = n1
        self.telemetry.layers[layer].host_time_s += time.perf_counter() - t0

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise KernelInputError(f"{name} must be a [B, H_kv, T, D] tensor.")
        if k.shape != v.shape:
            raise KernelInputError(f"k {list(k.shape)} and v {list(v.shape)} must match.")
        b, hkv, t, d = k.shape
        want = (self.batch_size, self.num_kv_heads, d, self.head_dim)
        if (b, hkv, d) != (want[0], want[1], want[3]):
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
        st, cfg, tel = self.layers[layer], self.config, self.telemetry.layers[layer]
        b, hq, t, d = q.shape
        if b != self.batch_size or d != self.head_dim or hq % self.num_kv_heads:
            raise KernelInputError(
                f"q has shape {list(q.shape)}; expected [B={self.batch_size}, H_q (a multiple "
                f"of H_kv={self.num_kv_heads}), T, D={self.head_dim}].")
        if t > st.length:
            raise KernelInputError(f"q has T={t} queries but layer {layer} holds {st.length} "
                                   "tokens; call update(layer, k, v) first.")
        decode = t == 1
        self._decoding = decode
        if sliding_window is not None and (not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise KernelInputError(f"sliding_window must be an int >= 1, got {sliding_window!r}.")
        st.window = sliding_window
        buffer = ring_slot(st.calls, layer, self.num_layers)
        st.calls += 1
        qd = q.to(self.device, self.dtype)
        n_pages = self.num_pages(layer)
        # tokens before `visible_from` are padding or outside every query's window
        visible_from = self.pad
        if st.window is not None:
            visible_from = torch.clamp(self.pad, min=st.length - t - st.window + 1)
        attendable = self._attendable(n_pages, visible_from)
        cold = (st.tier[:, :n_pages] > HOT) & attendable
        if st.window is not None and not decode and bool(cold.any()):
            raise NotImplementedError(
                f"layer {layer}: a sliding-window prefill found demoted pages inside the window; "
                "pass sliding_window on every attend call of this layer.")

        if decode and cfg.attend == "topk":
            need = self._select_topk(layer, qd[:, :, 0], cold)
            st.selection = need
        else:
            need = self._page_lists(cold)

        hot_table, hot_pages = self._hot_table(layer, n_pages, attendable)
        # decode masks the window token by token; prefill lets the kernel apply it
        lane_from = torch.clamp(self.pad, min=st.length - st.window) \
            if st.window is not None and decode else self.pad
        hot_first = self._first_lane(hot_pages, lane_from)
        parts, staged_runs = [], []
        want_mass = cfg.score in ("mass", "hybrid") or (
            cfg.evict_budget != 0 and cfg.evict_policy == "h2o")
        scale = sm_scale if sm_scale is not None else d ** -0.5
        if decode:
            q1 = qd[:, :, 0]
            parts.append(sparse_decode(q1, self.hbm.pool(layer), hot_table, sm_scale=scale,
                                       softcap=softcap, return_page_mass=want_mass,
                                       validate=False, first_lane=hot_first,
                                       backend=self.backend))
            tel.kernel_launches += 1
        else:
            qf = qd.permute(0, 2, 1, 3).reshape(b * t, hq, d)
            qo = torch.arange(b + 1, dtype=torch.int32, device=self.device) * t
            # with no cold page the chunk's own softmax is the final one: its page mass is the
            # importance, without the second pass under the merged LSE
            hot_mass = want_mass and not any(need)
            parts.append(paged_prefill(qf, self.hbm.pool(layer), hot_table, qo, sm_scale=scale,
                                       softcap=softcap, validate=False, first_lane=hot_first,
                                       sliding_window=st.window, return_page_mass=hot_mass,
                                       backend=self.backend))
            tel.kernel_launches += 1
        for run in self._fetch(layer, need, buffer):
            table = self._staged_table(run)
            pool = self.staging[run.buffer]
            first = self._first_lane(run.entries, lane_from)
            if decode:
                parts.append(sparse_decode(q1, pool, table, sm_scale=scale, softcap=softcap,
                                           return_page_mass=want_mass, validate=False,
                                           first_lane=first, backend=self.backend))
            else:
                parts.append(paged_prefill(qf, pool, table, qo, sm_scale=scale, causal=False,
                                           softcap=softcap, validate=False, first_lane=first,
                                           backend=self.backend))
            tel.kernel_launches += 1
            staged_runs.append((run, table))
            # a later batch may reuse this buffer only after the kernel above has read it
            self._fence = self.engine.fence()
        if len(parts) == 1:
            out, lse = parts[0].out, parts[0].lse
        else:
            out, lse = merge_states(torch.stack([x.out for x in parts]),
                                    torch.stack([x.lse for x in parts]), backend=self.backend)
            tel.kernel_launches += 1
        if sinks is not None:  # the sink takes exp(sink) of the softmax mass and adds nothing
            sink = sinks.to(lse.device, torch.float32)
            out = out * torch.sigmoid(lse - sink).unsqueeze(-1)

        want_snap = not decode and cfg.evict_budget != 0 and cfg.evict_policy == "snapkv"
        if decode and want_mass:
            for part, (run, table) in zip(parts, [(None, hot_table)] + staged_runs):
                pages = hot_pages if run is None else run.entries
                mass = decode_page_mass(part.page_lse, lse, table, self.num_kv_heads,
                                        backend=self.backend)
                self._add_importance(pages, mass.sum(-1), st.mass)
        elif not decode and (want_mass or want_snap):
            snap = torch.zeros(b, self.max_pages) if want_snap else None
            imp = dict(qd=qd, lse=lse, scale=scale, softcap=softcap, mass=want_mass, snap=snap)
            if parts[0].page_mass is not None:
                self._add_importance(hot_pages, parts[0].page_mass.sum(-1), st.mass)
            self._prefill_importance(layer, hot_table, hot_pages, self.hbm.pool(layer), True,
                                     **{**imp, "mass": want_mass and parts[0].page_mass is None})
            if len(staged_runs) == 1:
                run, table = staged_runs[0]
                self._prefill_importance(layer, table, run.entries, self.staging[run.buffer],
                                         False, **imp)
            elif staged_runs:  # batches reused the buffer: stream the cold pages once more
                for run in self._fetch(layer, need, buffer):
                    self._prefill_importance(layer, self._staged_table(run), run.entries,
                                             self.staging[run.buffer], False, **imp)
                    self._fence = self.engine.fence()
            if want_snap:
                st.snap = snap
        if decode:
            st.last_q = q1
            tel.decode_steps += 1
        tel.attend_calls += 1
        self._rebalance(layer, decode)
        self._prefetch_next(layer, qd[:, :, -1] if decode else None)
        res = out.view(b, t, hq, d).permute(0, 2, 1, 3) if not decode else out.unsqueeze(2)
        tel.host_time_s += time.perf_counter() - t0
        return res.to(q.dtype)

    @staticmethod
    def _page_lists(mask: torch.Tensor) -> list[list[int]]:
        """Per sequence, the pages set in ``mask [B, n_pages]`` (one nonzero for the batch)."""
        if mask.shape[0] == 1:
            return [mask[0].nonzero().flatten().tolist()]
        nz = mask.nonzero()
        counts = mask.sum(1).tolist()
        cols = nz[:, 1].tolist()
        out, pos = [], 0
        for c in counts:
            out.append(cols[pos:pos + c])
            pos += c
        return out

    def _table(self, counts: list[int], idx: torch.Tensor, last: int) -> PageTable:
        """A CSR :class:`PageTable` from per-row entry ``counts``, the slots ``idx`` (int32)
        and the length of every non-empty row's last page, built on the host in two ops and
        moved to the device in one copy (three small synchronous copies per table would cost
        more than the table)."""
        b = len(counts)
        w = -(-b // 4) * 4  # segments start 16-byte aligned (kernels specialise on alignment)
        starts, pos = [], 0
        for c in counts:
            starts.append(pos)
            pos += c
        gap = [0] * (w - b)
        header = torch.tensor(starts + gap + counts + gap + [last if c else 0 for c in counts]
                              + gap, dtype=torch.int32)
        host = torch.cat([header, idx])
        dev = host if self.device.type == "cpu" else host.to(self.device)
        return PageTable(indices=dev[3 * w:], row_start=dev[:b], row_count=dev[w:w + b],
                         last_page_len=dev[2 * w:2 * w + b])

    def _hot_table(self, layer: int, n_pages: int,
                   attendable: torch.Tensor) -> tuple[PageTable, _Entries]:
        """Hot pages of each sequence in logical order (a compact row: the recent tail is
        contiguous and hot, so positions inside the tail stay exact for causal masking)."""
        st, p = self.layers[layer], self.page_size
        hot = (st.tier[:, :n_pages] == HOT) & attendable
        nz = hot.nonzero()  # row-major: sequence by sequence, page by page
        counts = hot.sum(1).tolist()
        last = st.length - (n_pages - 1) * p if n_pages else 0
        idx = st.slot[:, :n_pages][hot]
        return self._table(counts, idx, last), _Entries(nz[:, 0], nz[:, 1])

    def _staged_table(self, run: _Staged) -> PageTable:
        idx = torch.tensor(list(chain.from_iterable(run.slots)), dtype=torch.int32)
        return self._table([len(x) for x in run.slots], idx, self.page_size)

    def _select_topk(self, layer: int, q: torch.Tensor, cold: torch.Tensor) -> list[list[int]]:
        """Per sequence, the ``recall_budget`` cold pages with the highest Quest bound."""
        st, cfg = self.layers[layer], self.config
        rows = [c.nonzero().flatten() for c in cold]
        k = cfg.pages(cfg.recall_budget, cold.shape[1], st.length)
        if k == 0 or not any(r.numel() for r in rows):
            return [[] for _ in rows]
        counts = [r.numel() for r in rows]
        meta = torch.cat([bi * self.max_pages + r for bi, r in enumerate(rows)])
        indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        table = PageTable.from_csr(indptr.to(self.device), meta.to(torch.int32).to(self.device),
                                   torch.ones(len(rows), dtype=torch.int32, device=self.device))
        bound = quest_score(q, self.kmin[layer], self.kmax[layer], table, validate=False,
                            backend=self.backend).max(dim=-1).values.cpu()
        self.telemetry.layers[layer].kernel_launches += 1
        out, pos = [], 0
        for r, c in zip(rows, counts):
            best = torch.topk(bound[pos:pos + c], min(k, c)).indices
            out.append(sorted(r[best].tolist()))
            pos += c
        return out

    # --- moving pages ------------------------------------------------------------------------

    def _fetch(self, layer: int, need: list[list[int]], buffer: int):
        """Yield :class:`_Staged` batches holding every page in ``need`` (per sequence), each
        ready to read. Pages already prefetched for this layer are used in place (hits)."""
        st, tel = self.layers[layer], self.telemetry.layers[layer]
        pre, st.prefetch = st.prefetch, None
        buffer = pre.buffer if pre else buffer
        for other, ost in enumerate(self.layers):
            if ost.prefetch is not None and ost.prefetch.buffer == buffer:
                # layers attended out of order: another layer's prefetch targets this buffer;
                # let it land and drop it rather than overwrite a copy in flight
                self._cancel_prefetch(other)
        if not any(need):
            if pre is not None:
                tel.wasted_prefetches += sum(len(x) for x in pre.pages)
                self._wait_all(pre.tickets)
            return
        if pre is not None and pre.pages == need:  # the prefetch brought exactly what is needed
            self._wait_all(pre.tickets)
            tel.prefetch_hits += sum(len(x) for x in need)
            yield _Staged(buffer, pre.pages, pre.slots)
            return
        first = _Staged(buffer)
        used = set()
        if pre is not None:
            self._wait_all(pre.tickets)
            for bi, (pages, slots) in enumerate(zip(pre.pages, pre.slots)):
                want = set(need[bi])
                keep = [(pg, sl) for pg, sl in zip(pages, slots) if pg in want]
                first.pages.append([pg for pg, _ in keep])
                first.slots.append([sl for _, sl in keep])
                used.update(sl for _, sl in keep)
                tel.prefetch_hits += len(keep)
                tel.wasted_prefetches += len(pages) - len(keep)
        else:
            first.pages = [[] for _ in need]
            first.slots = [[] for _ in need]
        staged = [set(x) for x in first.pages]  # one set per sequence, not one per page
        missing = [[pg for pg in need[bi] if pg not in staged[bi]] for bi in range(len(need))]
        n_missing = sum(len(x) for x in missing)
        if pre is not None:
            tel.late_misses += n_missing
        run = first
        todo = [(bi, pg) for bi in range(len(missing)) for pg in missing[bi]]
        # the staging slots the prefetch left free (only listed when something is missing)
        free = ([s for s in range(self.staging_pages) if s not in used] if used else
                list(range(self.staging_pages))) if todo else []
        while todo:
            if not free:  # buffer full: attend what is staged, then reuse the buffer
                yield run
                run = _Staged(run.buffer, [[] for _ in need], [[] for _ in need])
                free = list(range(self.staging_pages))
            batch, todo = todo[:len(free)], todo[len(free):]
            slots, free = free[:len(batch)], free[len(batch):]
            # after the fence of the kernel that read this buffer's previous batch
            pairs = torch.tensor(batch, dtype=torch.long).view(-1, 2)
            self._copy_in(layer, pairs[:, 0], pairs[:, 1], run.buffer,
                          torch.tensor(slots, dtype=torch.long), after=self._fence)
            for (bi, pg), sl in zip(batch, slots):
                run.pages[bi].append(pg)
                run.slots[bi].append(sl)
        yield run

    def _cancel_prefetch(self, layer: int) -> None:
        """Let ``layer``'s copies in flight land, then forget them (their buffer is free)."""
        st = self.layers[layer]
        if st.prefetch is not None:
            self._wait_all(st.prefetch.tickets)
            self.telemetry.layers[layer].wasted_prefetches += sum(
                len(x) for x in st.prefetch.pages)
            st.prefetch = None

    def _wait_all(self, tickets: list) -> None:
        for ticket in tickets:
            self.engine.wait(ticket)

    def _copy_in(self, layer: int, bis: torch.Tensor, pgs: torch.Tensor, buffer: int,
                 slots: torch.Tensor, *, after: object = None, wait: bool = True) -> list:
        """Copy the cold pages ``(bis[i], pgs[i])`` (sequence, logical page) into staging slots
        ``slots[i]`` (``[n]`` long CPU tensors): one launch per source tier; returns the tickets
        (already waited on when ``wait``). Slot lists live on the compute device: on CUDA the
        copy kernel runs there and reads pinned host pools over UVA."""
        st, tel = self.layers[layer], self.telemetry.layers[layer]
        tickets = []
        # tier and slot of every page in two gathers; no Python work per page
        src_tier, src_slot = st.tier[bis, pgs], st.slot[bis, pgs]
        tiers = torch.unique(src_tier).tolist()  # sorted: fastest tier first
        dst_pool = self.staging[buffer]
        for ti in tiers:
            sel = (src_tier == ti) if len(tiers) > 1 else slice(None)
            src, dst = src_slot[sel], slots[sel]
            n = src.numel()
            tier = self.tiers[ti]
            if isinstance(tier, MemoryTier):
                ticket = self.engine.copy(
                    tier.pool(layer), src.to(device=self.device, dtype=torch.int32),
                    dst_pool, dst.to(device=self.device, dtype=torch.int32), after=after)
                tickets.append(ticket)
                if wait:
                    self.engine.wait(ticket)
            else:  # disk: validated reads, then one indexed host->device copy
                pages = tier.read(layer, src.tolist(), (pgs[sel] * self.page_size).tolist())
                dst_pool[dst.to(self.device)] = pages.to(self.device)
            tel.copy_launches += 1
            tel.copy_launches_decode += self._decoding
            tel.h2d_bytes[tier.kind] += n * self.page_bytes
            if self._decoding:
                tel.h2d_decode_bytes += n * self.page_bytes
        return tickets

    def _prefetch_next(self, layer: int, q: torch.Tensor | None) -> None:
        """Start fetching what the next layer (or layer 0 of the next step) will attend."""
        cfg = self.config
        if cfg.prefetch == "none" or (q is None and cfg.attend == "topk"):
            return
        nxt = (layer + 1) % self.num_layers
        st = self.layers[nxt]
        if st.length == 0 or (nxt == 0 and q is None):
            return
        n_pages = self.num_pages(nxt)
        cold = (st.tier[:, :n_pages] > HOT) & self._attendable(n_pages)
        if cfg.attend == "all":
            pages = self._page_lists(cold)
        elif cfg.prefetch == "speculative":
            pages = self._select_topk(nxt, q, cold)
        else:
            pages = [[pg for pg in sel if cold[bi, pg]] for bi, sel in
                     enumerate(st.selection or [[] for _ in range(self.batch_size)])]
        total = sum(len(x) for x in pages)
        if total == 0 or total > self.staging_pages:
            return  # too large to stage at once: the layer streams it in batches itself
        buffer = ring_slot(st.calls, nxt, self.num_layers)  # what its next attend call uses
        slots, pos = [], 0
        for row in pages:
            slots.append(list(range(pos, pos + len(row))))
            pos += len(row)
        entries = _Entries.from_lists(pages)
        tickets = self._copy_in(nxt, entries.rows, entries.cols, buffer, torch.arange(total),
                                after=self.engine.fence(), wait=False)
        st.prefetch = _Prefetch(tickets, buffer, pages, slots)

    # --- importance and policy ---------------------------------------------------------------

    @staticmethod
    def _add_importance(entries: _Entries, values: torch.Tensor,
                        into: torch.Tensor, accumulate: bool = True) -> None:
        """Scatter per-entry ``values`` (aligned with the table ``entries`` describe: sequence
        by sequence, page by page) into ``into [B, max_pages]``."""
        if not len(entries):
            return
        into.index_put_((entries.rows, entries.cols), values.float().cpu()[:len(entries)],
                        accumulate=accumulate)

    def _prefill_importance(self, layer: int, table: PageTable, pages: _Entries,
                            pool: torch.Tensor, causal: bool, *, qd: torch.Tensor,
                            lse: torch.Tensor, scale: float, softcap: float | None, mass: bool,
                            snap: torch.Tensor | None) -> None:
        """Importance from a prompt chunk over one page set, under the merged LSE: the
        chunk's attention mass (H2O) and SnapKV's observation-window mass."""
        if not len(pages):
            return
        b, hq, t, d = qd.shape
        window = self.layers[layer].window if causal else None
        kw = dict(sm_scale=scale, causal=causal, softcap=softcap, validate=False,
                  first_lane=self._first_lane(pages), sliding_window=window,
                  backend=self.backend)
        tel = self.telemetry.layers[layer]
        if mass:
            qf = qd.permute(0, 2, 1, 3).reshape(b * t, hq, d)
            qo = torch.arange(b + 1, dtype=torch.int32, device=self.device) * t
            m = paged_prefill_mass(qf, pool, table, qo, lse, **kw)
            self._add_importance(pages, m.sum(-1), self.layers[layer].mass)
            tel.kernel_launches += 1
        if snap is not None:
            w = min(self.config.snapkv_window, t)
            qw = qd[:, :, t - w:].permute(0, 2, 1, 3).reshape(b * w, hq, d)
            lw = lse.view(b, t, hq)[:, t - w:].reshape(b * w, hq).contiguous()
            qo = torch.arange(b + 1, dtype=torch.int32, device=self.device) * w
            m = paged_prefill_mass(qw, pool, table, qo, lw, **kw)
            self._add_importance(pages, m.sum(-1), snap, accumulate=False)
            tel.kernel_launches += 1

    def _rank(self, layer: int, n_pages: int) -> torch.Tensor:
        """``[B, n_pages]`` importance for demotion (higher stays hot)."""
        st, cfg = self.layers[layer], self.config
        mass = st.mass[:, :n_pages]
        if cfg.score == "mass" or st.last_q is None:
            return mass
        rows = torch.arange(self.batch_size)[:, None] * self.max_pages + torch.arange(n_pages)
        counts = [n_pages] * self.batch_size
        indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        table = PageTable.from_csr(indptr.to(self.device),
                                   rows.flatten().to(torch.int32).to(self.device),
                                   torch.ones(self.batch_size, dtype=torch.int32,
                                              device=self.device))
        bound = quest_score(st.last_q, self.kmin[layer], self.kmax[layer], table,
                            validate=False, backend=self.backend)
        bound = bound.max(-1).values.view(self.batch_size, n_pages).cpu()
        if cfg.score == "quest":
            return bound
        norm = lambda x: (x - x.min(1, keepdim=True).values) / (
            x.max(1, keepdim=True).values - x.min(1, keepdim=True).values + 1e-12)
        return norm(mass) + norm(bound)

    def _evict_rank(self, layer: int, n_pages: int) -> torch.Tensor:
        st, policy = self.layers[layer], self.config.evict_policy
        if policy == "streaming":
            return torch.arange(n_pages, dtype=torch.float32).expand(self.batch_size, -1)
        if policy == "random":
            return self._rank_noise[:, :n_pages]
        if policy == "snapkv":
            snap = st.snap if st.snap is not None else torch.zeros(self.batch_size,
                                                                   self.max_pages)
            k = self.config.snapkv_kernel
            pooled = torch.nn.functional.max_pool1d(snap[:, None, :n_pages], k, stride=1,
                                                    padding=k // 2)[:, 0, :n_pages]
            return pooled
        return st.mass[:, :n_pages]

    def _rebalance(self, layer: int, decode: bool) -> None:
        """Evict down to ``evict_budget``, then demote down to ``hot_budget``."""
        st, cfg, p = self.layers[layer], self.config, self.page_size
        n_pages = self.num_pages(layer)
        if n_pages == 0:
            return
        if st.window is not None:  # no future query sees pages ending before the window
            gone = ~self._must_hot(n_pages, layer) & (st.tier[:, :n_pages] != NONE)
            for bi in self.alive.nonzero().flatten().tolist():
                pages = gone[bi].nonzero().flatten().tolist()
                if pages:
                    self._drop(layer, bi, pages, window=True)
            return
        # budgets count each sequence's real tokens and pages, not its left padding
        pad_pages = self._pad_pages()
        real = self._page_idx[None, :n_pages] >= pad_pages[:, None]
        evicting = cfg.evict_budget != 0 and (cfg.evict_policy != "snapkv" or (decode and not
                                                                               st.pruned))
        if not evicting and len(self.tiers) > 1 and \
                self._within_hot_budget(layer, n_pages, pad_pages, real):
            return  # the usual decode step: nothing to demote, skip the policy's bookkeeping
        must = self._must_hot(n_pages)
        full = torch.ones(n_pages, dtype=torch.bool)
        if not st.length % p == 0:
            full[-1] = False
        real_tokens = st.length - self.pad
        alive = self.alive.nonzero().flatten().tolist()
        if evicting:
            rank = self._evict_rank(layer, n_pages)
            for bi in alive:
                live = (st.tier[bi, :n_pages] != NONE) & ~must[bi] & full & real[bi]
                extra = self._evict_pages(int(real_tokens[bi])) - \
                    int(st.evicted[bi, :n_pages].sum())
                if extra <= 0 or not live.any():
                    continue
                cand = live.nonzero().flatten()
                drop = cand[torch.argsort(rank[bi, cand], stable=True)[:extra]].tolist()
                self._drop(layer, bi, drop)
            if cfg.evict_policy == "snapkv" and decode:
                st.pruned = True
        # the hot budget counts the lanes from the first real page on (a first page that is
        # partly padding is held whole), so a budget of 1.0 holds every page
        span = st.length - pad_pages * p
        hot_target = [max(cfg.pages(cfg.hot_budget, n_pages - int(pad_pages[bi]),
                                    int(span[bi])), int((must[bi] & real[bi]).sum()))
                      for bi in range(self.batch_size)]
        if len(self.tiers) == 1:  # nowhere to demote: the hot budget is the whole budget
            if cfg.evict_policy == "snapkv":
                # SnapKV compresses the prompt once, when decoding starts, and keeps every
                # token generated afterwards
                if decode and not st.pruned:
                    self._drop_over(layer, n_pages, hot_target, must, real)
                    st.pruned = True
                return
            self._drop_over(layer, n_pages, hot_target, must, real)
            return
        over = []
        rank = None
        for bi in alive:
            hot = (st.tier[bi, :n_pages] == HOT) & real[bi]
            extra = int(hot.sum()) - hot_target[bi]
            if extra <= 0:
                continue
            if rank is None:
                rank = self._rank(layer, n_pages)
            cand = (hot & ~must[bi]).nonzero().flatten()
            order = torch.argsort(rank[bi, cand], stable=True)[:extra]
            over += [(bi, int(pg)) for pg in cand[order]]
        if over:
            self._demote(layer, over)

    def _within_hot_budget(self, layer: int, n_pages: int, pad_pages: torch.Tensor,
                           real: torch.Tensor) -> bool:
        """True when no sequence holds more hot real pages than the hot budget allows. The
        demotion target of :meth:`_rebalance` is that budget or more (it never goes below the
        pages that must stay hot), so then it demotes nothing: checking this first skips
        building the must-stay-hot mask and the per-sequence loop on most decode steps."""
        st, cfg = self.layers[layer], self.config
        hot = ((st.tier[:, :n_pages] == HOT) & real).sum(1).tolist()
        span = (st.length - pad_pages * self.page_size).tolist()
        return all(h <= cfg.pages(cfg.hot_budget, n_pages - pp, sp)
                   for h, pp, sp in zip(hot, pad_pages.tolist(), span))

    def _drop_over(self, layer: int, n_pages: int, keep: list[int], must: torch.Tensor,
                   real: torch.Tensor) -> None:
        """Evict the lowest-ranked pages of each sequence ``b`` beyond ``keep[b]`` live real
        pages (``must``/``real``: ``[B, n_pages]``)."""
        st = self.layers[layer]
        rank = self._evict_rank(layer, n_pages)
        for bi in self.alive.nonzero().flatten().tolist():
            live = (st.tier[bi, :n_pages] != NONE) & real[bi]
            extra = int(live.sum()) - keep[bi]
            cand = (live & ~must[bi]).nonzero().flatten()
            if extra > 0 and len(cand):
                drop = cand[torch.argsort(rank[bi, cand], stable=True)[:extra]].tolist()
                self._drop(layer, bi, drop)

    def _make_room(self, layer: int, need: int) -> None:
        """Demote the least important hot pages until ``need`` HBM slots are free (pages were
        moved into HBM by hand, or the budget shrank)."""
        st = self.layers[layer]
        n_pages = self.num_pages(layer)
        short = need - self.hbm.num_free(layer)
        must = self._must_hot(n_pages, layer)
        rank = self._rank(layer, n_pages) if n_pages else None
        cands = sorted((float(rank[bi, pg]), bi, pg)
                       for bi in self.alive.nonzero().flatten().tolist()
                       for pg in ((st.tier[bi, :n_pages] == HOT) & ~must[bi]).nonzero().flatten()
                       .tolist())
        if len(self.tiers) == 1 or len(cands) < short:
            raise KVCapacityError(
                f"hbm tier is full for layer {layer}: {need} pages needed, "
                f"{self.hbm.num_free(layer)} of {self.hbm.capacity} free and "
                f"{len(cands) if len(self.tiers) > 1 else 0} can be demoted; raise its "
                "capacity_pages or prefill in smaller chunks.")
        self._demote(layer, [(bi, pg) for _, bi, pg in cands[:short]])

    def _evict_pages(self, length: int) -> int:
        budget = self.config.evict_budget
        tokens = budget * length if isinstance(budget, float) else budget
        return int(tokens // self.page_size)

    def _drop(self, layer: int, bi: int, pages: list[int], window: bool = False) -> None:
        """Release ``pages``; ``window``: they left a sliding window (not an eviction)."""
        st = self.layers[layer]
        cols = torch.tensor(pages, dtype=torch.long)
        tiers, slots = st.tier[bi, cols].tolist(), st.slot[bi, cols].tolist()
        for ti, tier in enumerate(self.tiers):
            sl = [s for s, t in zip(slots, tiers) if t == ti]
            if sl:
                tier.release(layer, sl)
        st.tier[bi, pages] = NONE
        st.evicted[bi, pages] = True
        if window:
            self.telemetry.layers[layer].window_dropped_tokens += len(pages) * self.page_size
        else:
            self.telemetry.layers[layer].evicted_tokens += len(pages) * self.page_size

    def _demote(self, layer: int, pages: list[tuple[int, int]]) -> None:
        """Move hot pages to the first lower tiers with room: one copy launch per destination
        tier. All destination slots are taken first, so a full hierarchy raises
        :class:`KVCapacityError` with nothing changed."""
        st, tel = self.layers[layer], self.telemetry.layers[layer]
        plan, todo = [], list(pages)
        for ti in range(1, len(self.tiers)):
            if not todo:
                break
            n = min(len(todo), self.tiers[ti].num_free(layer))
            if n:
                plan.append((ti, todo[:n], self.tiers[ti].alloc(layer, n)))
                todo = todo[n:]
        if todo:
            for ti, _, slots in plan:
                self.tiers[ti].release(layer, slots)
            free = {t.kind: t.num_free(layer) for t in self.tiers[1:]}
            raise KVCapacityError(
                f"layer {layer}: {len(pages)} pages must leave HBM but the lower tiers have "
                f"room for {len(pages) - len(todo)} (free pages per tier: {free}); raise their "
                "capacity_pages, add a tier, or set evict_budget.")
        src_pool = self.hbm.pool(layer)
        for ti, items, slots in plan:
            tier = self.tiers[ti]
            bis = torch.tensor([bi for bi, _ in items], dtype=torch.long)
            pgs = torch.tensor([pg for _, pg in items], dtype=torch.long)
            src = st.slot[bis, pgs].tolist()
            if isinstance(tier, MemoryTier):
                ticket = self.engine.copy(
                    src_pool, torch.tensor(src, dtype=torch.int32, device=self.device),
                    tier.pool(layer), torch.tensor(slots, dtype=torch.int32, device=self.device))
                # the freed HBM slots are rewritten by later kernels: order them after the copy
                self.engine.wait(ticket)
            else:
                tier.write(layer, slots, src_pool[torch.tensor(src, dtype=torch.long,
                                                                device=self.device)],
                           [pg * self.page_size for _, pg in items])
            tel.copy_launches += 1
            tel.copy_launches_decode += self._decoding
            tel.d2h_launches_decode += self._decoding
            tel.d2h_bytes[tier.kind] += len(items) * self.page_bytes
            tel.demoted_pages += len(items)
            self.hbm.release(layer, src)
            st.tier[bis, pgs] = ti
            st.slot[bis, pgs] = torch.tensor(slots, dtype=torch.int32)

    # --- whole-cache operations ----------------------------------------------------------

    def move(self, layer: int, sequence: int, page: int, tier: int) -> None:
        """Move one live page to another tier (spill to disk, reload, demote by hand)."""
        st = self.layers[layer]
        self._cancel_prefetch(layer)  # a copy in flight may still read the slot freed below
        src_t, src_s = int(st.tier[sequence, page]), int(st.slot[sequence, page])
        if src_t == NONE:
            raise KernelInputError(f"page {page} of sequence {sequence} does not exist "
                                   "(evicted or past the end).")
        if src_t == tier:
            return
        dst = self.tiers[tier]
        (slot,) = dst.alloc(layer, 1)
        data = self.tiers[src_t].read(layer, [src_s], [page * self.page_size])
        dst.write(layer, [slot], data, [page * self.page_size])
        self.tiers[src_t].release(layer, [src_s])
        st.tier[sequence, page], st.slot[sequence, page] = tier, slot

    def evict(self, layer: int, sequence: int, pages: list[int]) -> None:
        """Drop ``pages`` of ``sequence`` in ``layer`` for good (counted as evicted tokens)."""
        st = self.layers[layer]
        bad = [pg for pg in pages if not 0 <= pg < self.max_pages or
               int(st.tier[sequence, pg]) == NONE]
        if bad:
            raise KernelInputError(f"pages {bad} of sequence {sequence} do not exist.")
        self._cancel_prefetch(layer)
        self._drop(layer, sequence, pages)

    def free(self, sequence: int) -> None:
        """Release every page of ``sequence``; it attends nothing until :meth:`reset`."""
        for layer, st in enumerate(self.layers):
            self._cancel_prefetch(layer)
            pages = (st.tier[sequence] != NONE).nonzero().flatten().tolist()
            for ti, tier in enumerate(self.tiers):
                sl = [int(st.slot[sequence, pg]) for pg in pages
                      if int(st.tier[sequence, pg]) == ti]
                if sl:
                    tier.release(layer, sl)
            st.tier[sequence] = NONE
            st.mass[sequence] = 0
        self.alive[sequence] = False

    def reorder(self, index: torch.Tensor | list[int]) -> None:
        """Sequence ``i`` becomes old sequence ``index[i]`` (beam search). A sequence chosen
        twice gets its own copy of every page (in its tier, or the next one with room); one
        not chosen is freed. Raises :class:`KVCapacityError`, changing nothing, when the
        copies do not fit."""
        index = [int(i) for i in (index.tolist() if isinstance(index, torch.Tensor) else index)]
        if len(index) != self.batch_size or not all(0 <= i < self.batch_size for i in index):
            raise KernelInputError(f"reorder index must list {self.batch_size} sequence ids in "
                                   f"0..{self.batch_size - 1}, got {index}.")
        dropped = [b for b in range(self.batch_size) if b not in index]
        firsts = {old: new for new, old in reversed(list(enumerate(index)))}
        dups = [(new, old) for new, old in enumerate(index) if firsts[old] != new]
        # plan every copy before changing anything: pages of dropped rows free up first
        plans = []
        for layer, st in enumerate(self.layers):
            free = [t.num_free(layer) for t in self.tiers]
            for old in dropped:
                for ti in st.tier[old][st.tier[old] != NONE].tolist():
                    free[ti] += 1
            copies = []
            for new, old in dups:
                for pg in (st.tier[old] != NONE).nonzero().flatten().tolist():
                    src = int(st.tier[old, pg])
                    dst = next((t for t in [src] + list(range(len(self.tiers))) if free[t]), None)
                    if dst is None:
                        raise KVCapacityError(
                            f"reorder duplicates sequences {sorted({o for _, o in dups})} but "
                            f"layer {layer} has no free slot left in any tier for their copies; "
                            "raise the tiers' capacity_pages.")
                    free[dst] -= 1
                    copies.append((new, old, pg, dst))
            plans.append(copies)
        for layer, (st, copies) in enumerate(zip(self.layers, plans)):
            self._cancel_prefetch(layer)  # its copies may read slots released below
            old_tables = (st.tier.clone(), st.slot.clone(), st.evicted.clone(), st.mass.clone())
            for old in dropped:
                for pg in (old_tables[0][old] != NONE).nonzero().flatten().tolist():
                    self.tiers[int(old_tables[0][old, pg])].release(
                        layer, [int(old_tables[1][old, pg])])
            rows = torch.tensor(index)
            st.tier, st.slot = old_tables[0][rows], old_tables[1][rows]
            st.evicted, st.mass = old_tables[2][rows], old_tables[3][rows]
            for new, old, pg, dst in copies:
                src_t, src_s = int(old_tables[0][old, pg]), int(old_tables[1][old, pg])
                (slot,) = self.tiers[dst].alloc(layer, 1)
                data = self.tiers[src_t].read(layer, [src_s], [pg * self.page_size])
                self.tiers[dst].write(layer, [slot], data, [pg * self.page_size])
                st.tier[new, pg], st.slot[new, pg] = dst, slot
            src = (rows[:, None] * self.max_pages + torch.arange(self.max_pages)).flatten()
            self.kmin[layer] = self.kmin[layer][src.to(self.device)]
            self.kmax[layer] = self.kmax[layer][src.to(self.device)]
            st.selection = None
        self.alive = self.alive[torch.tensor(index)]
        self.pad = self.pad[torch.tensor(index)]
        self._rank_noise = self._rank_noise[torch.tensor(index)]

    def gather(self, layer: int, sequence: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every live token of ``sequence`` as ``(positions [n], kv [n, 2, H_kv, D])`` on the
        CPU, read from wherever it lives: one read per tier (tests compare it with a shadow)."""
        st, p = self.layers[layer], self.page_size
        n_pages = self.num_pages(layer)
        tiers = st.tier[sequence, :n_pages]
        live = (tiers != NONE).nonzero().flatten()
        pages = torch.empty(len(live), *self.page_shape, dtype=self.dtype)
        for ti, tier in enumerate(self.tiers):
            sel = (tiers[live] == ti).nonzero().flatten()
            if len(sel):
                pg = live[sel]
                pages[sel] = tier.read(layer, st.slot[sequence, pg].tolist(),
                                       (pg * p).tolist()).cpu()
        pos = (live[:, None] * p + torch.arange(p)).flatten()
        kv = pages.permute(0, 2, 1, 3, 4).reshape(len(live) * p, 2, self.num_kv_heads,
                                                   self.head_dim)
        keep = pos < st.length  # the unfilled tail of the last page is not a token
        return pos[keep], kv[keep]

    # --- telemetry -----------------------------------------------------------------------------

    def stats(self) -> dict:
        """Telemetry per layer and in total (bytes per tier, launches, prefetch outcomes,
        evicted tokens, resident fraction per tier, host time)."""
        residency = []
        for st in self.layers:
            n_pages = math.ceil(st.length / self.page_size)
            live = (st.tier[:, :n_pages] != NONE) & self.alive[:, None]
            total = max(1, int(live.sum()))
            residency.append({t.kind: int(((st.tier[:, :n_pages] == ti) & live).sum()) / total
                              for ti, t in enumerate(self.tiers)})
        out = self.telemetry.stats(residency)
        out["total"]["page_bytes"] = self.page_bytes
        return out

    # --- save and restore ------------------------------------------------------------------

    def _meta(self) -> dict[str, str]:
        cfg = self.config
        return {"kind": "cache", "fingerprint": self.fingerprint,
                "page_size": str(cfg.page_size), "num_layers": str(self.num_layers),
                "num_kv_heads": str(self.num_kv_heads), "head_dim": str(self.head_dim),
                "batch_size": str(self.batch_size), "max_pages": str(self.max_pages),
                "dtype": str(self.dtype).removeprefix("torch."),
                "tiers": json.dumps([t.kind for t in self.tiers])}

    def save(self, directory: str | Path) -> Path:
        """Write the whole cache (every tier, tables, importance) to one safetensors file in
        ``directory``, atomically; returns its path."""
        tensors: dict[str, torch.Tensor] = {"alive": self.alive.to(torch.uint8),
                                            "pad": self.pad.clone()}
        for layer, st in enumerate(self.layers):
            live = (st.tier != NONE).nonzero()
            pages = torch.zeros(len(live), *self.page_shape, dtype=self.dtype)
            for i, (bi, pg) in enumerate(live.tolist()):
                ti = int(st.tier[bi, pg])
                pages[i] = self.tiers[ti].read(layer, [int(st.slot[bi, pg])],
                                               [pg * self.page_size])[0].cpu()
            tensors[f"layer{layer}.pages"] = pages
            tensors[f"layer{layer}.tier"] = st.tier.to(torch.int32)
            tensors[f"layer{layer}.evicted"] = st.evicted.to(torch.uint8)
            tensors[f"layer{layer}.mass"] = st.mass.clone()
            tensors[f"layer{layer}.length"] = torch.tensor([st.length], dtype=torch.int64)
        key = hashlib.sha256(f"{self.fingerprint}:{time.time_ns()}".encode()).hexdigest()
        return write_kv_file(directory, key, tensors, self._meta())

    def load(self, path: str | Path) -> None:
        """Replace this cache's content with a file written by :meth:`save` from a cache of
        the same geometry; the file is validated whole before anything changes."""
        b, mp = self.batch_size, self.max_pages
        meta = self._meta()
        limit = 64 * 1024 + sum(t.capacity for t in self.tiers) * self.num_layers * \
            self.page_bytes + self.num_layers * b * mp * 16

        def check(header) -> None:
            for k, want in meta.items():
                if header.meta.get(k) != want:
                    raise KVFileError(f"{header.path}: metadata {k}={header.meta.get(k)!r}, "
                                      f"this cache expects {want!r}.")
            want_names = {"alive", "pad"} | {f"layer{i}.{n}" for i in range(self.num_layers)
                                      for n in ("pages", "tier", "evicted", "mass", "length")}
            if set(header.tensors) != want_names:
                raise KVFileError(f"{header.path}: tensors {sorted(header.tensors)} do not match "
                                  "a saved cache of this geometry.")
            fixed = {"alive": (torch.uint8, (b,)), "pad": (torch.int64, (b,))}
            for i in range(self.num_layers):
                fixed.update({f"layer{i}.tier": (torch.int32, (b, mp)),
                              f"layer{i}.evicted": (torch.uint8, (b, mp)),
                              f"layer{i}.mass": (torch.float32, (b, mp)),
                              f"layer{i}.length": (torch.int64, (1,))})
                e = header.tensors[f"layer{i}.pages"]
                if e.dtype != self.dtype or tuple(e.shape[1:]) != self.page_shape or \
                        e.shape[0] > b * mp:
                    raise KVFileError(f"{header.path}: layer{i}.pages is {e.dtype} "
                                      f"{list(e.shape)}, expected {self.dtype} [<= {b * mp}, "
                                      f"{', '.join(map(str, self.page_shape))}].")
            for name, (dt, shape) in fixed.items():
                e = header.tensors[name]
                if e.dtype != dt or tuple(e.shape) != shape:
                    raise KVFileError(f"{header.path}: {name} is {e.dtype} {list(e.shape)}, "
                                      f"expected {dt} {list(shape)}.")

        data = read_kv_file(path, check, max_file_bytes=limit)
        for layer in range(self.num_layers):
            self._cancel_prefetch(layer)
        plans = []
        for i in range(self.num_layers):
            tier32 = data[f"layer{i}.tier"]
            length = int(data[f"layer{i}.length"][0])
            live = (tier32 != NONE).nonzero()
            if len(live) != data[f"layer{i}.pages"].shape[0] or not 0 <= length <= mp * \
                    self.page_size or (tier32 >= len(self.tiers)).any() or (tier32 < NONE).any():
                raise KVFileError(f"{path}: layer{i} tables are inconsistent with its pages.")
            plans.append((tier32.to(torch.int8), live, length))
        # every check passed: replace the content
        for layer, st in enumerate(self.layers):
            for bi in range(b):
                for pg in (st.tier[bi] != NONE).nonzero().flatten().tolist():
                    self.tiers[int(st.tier[bi, pg])].release(layer, [int(st.slot[bi, pg])])
        self.layers = [self._new_layer() for _ in range(self.num_layers)]
        self.alive = data["alive"].bool()
        self.pad = data["pad"].clamp(min=0)
        for layer, (tier, live, length) in enumerate(plans):
            st = self.layers[layer]
            st.length = length
            st.evicted = data[f"layer{layer}.evicted"].bool()
            st.mass = data[f"layer{layer}.mass"].clone()
            pages = data[f"layer{layer}.pages"]
            for ti, t in enumerate(self.tiers):
                sel = (tier[live[:, 0], live[:, 1]] == ti).nonzero().flatten()
                if not len(sel):
                    continue
                slots = t.alloc(layer, len(sel))
                t.write(layer, slots, pages[sel], [int(live[j, 1]) * self.page_size
                                                   for j in sel.tolist()])
                for j, sl in zip(sel.tolist(), slots):
                    bi, pg = int(live[j, 0]), int(live[j, 1])
                    st.tier[bi, pg], st.slot[bi, pg] = ti, sl
            self._refresh_metadata(layer)

    def _refresh_metadata(self, layer: int) -> None:
        """Recompute Quest metadata of every live page of ``layer`` (after a load)."""
        st, p = self.layers[layer], self.page_size
        for ti, tier in enumerate(self.tiers):
            items = (st.tier == ti).nonzero().tolist()
            if not items:
                continue
            data = tier.read(layer, [int(st.slot[bi, pg]) for bi, pg in items],
                             [pg * p for _, pg in items]).to(self.device)
            lens = torch.tensor([min(p, st.length - pg * p) for _, pg in items],
                                dtype=torch.int32, device=self.device)
            rows = torch.tensor([bi * self.max_pages + pg for bi, pg in items],
                                dtype=torch.int32, device=self.device)
            page_metadata(data, torch.arange(len(items), dtype=torch.int32, device=self.device),
                          lens, kmin=self.kmin[layer], kmax=self.kmax[layer], rows=rows,
                          validate=False, backend=self.backend)

