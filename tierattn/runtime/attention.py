"""Attention: the device work of one ``update``/``attend`` call of a layer.

A decode token's K/V is written by device-side write positions (:meth:`Attention.write_token`);
a prompt chunk by one indexed write (:meth:`Attention.write_chunk`). Attention runs a kernel over
the hot table and, for the cold pages, the way the :class:`~tierattn.runtime.planner.AttendPlanner`
gives the layer: a kernel over each staged batch of cold pages (all of them, or the recalled ones),
or the host's partial state over them where they live
(:class:`~tierattn.runtime.hostattn.HostAttention`); each writes its partial state into
preallocated buffers (:meth:`Attention.decode`,
:meth:`Attention.prefill`). A decode step's kernels also scatter every page's LSE into one
per-page buffer, and one kernel merges the partial states and adds the page mass.
:meth:`Attention.graph_step` is that same decode work as a CUDA graph captures it, and
:meth:`Attention.graph_key` the host values the capture bakes in.
The facade (:mod:`tierattn.runtime.cache`) decides when each runs; the structural work is not here.
"""

from __future__ import annotations

import math

import torch

from tierattn.runtime.hostattn import HostAttention
from tierattn.runtime.importance import Importance
from tierattn.kernels import KernelSet, PrefillOutput
from tierattn.storage.mover import Mover
from tierattn.storage.pagemap import LayerTables, PageMap
from tierattn.runtime.planner import AttendPlanner
from tierattn.runtime.policy import Budgets, Policies
from tierattn.runtime.prefetch import Prefetcher
from tierattn.telemetry import Telemetry
from tierattn.storage.tiers import Tier

__all__ = ["Attention"]


class Attention:
    """Writes and attends one layer's tokens with the cache's parts (see the module docstring).

    Args:
        pages, tiers, importance, prefetcher, policies, budgets, mover: the cache's parts.
        planner: how each layer attends its cold pages; host: the host side of split
            attention (None when no layer splits).
        kernels, telemetry: kernel entry points and counters.
        num_kv_heads, head_dim, dtype, device, backend: the cache's geometry and kernels'
            backend.
    """

    def __init__(self, *, pages: PageMap, tiers: list[Tier], importance: Importance,
                 prefetcher: Prefetcher, policies: Policies, budgets: Budgets, mover: Mover,
                 planner: AttendPlanner, host: HostAttention | None, kernels: KernelSet,
                 telemetry: Telemetry, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, backend: str) -> None:
        self.pages, self.tiers, self.importance = pages, tiers, importance
        self.planner, self.host = planner, host
        self.prefetcher, self.policies, self.budgets, self.mover = prefetcher, policies, \
            budgets, mover
        self.kernels, self.telemetry = kernels, telemetry
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, \
            dtype, device
        self.backend = backend
        self.hbm = tiers[0]
        self.batch_size, self.max_pages = pages.batch_size, pages.max_pages
        self.page_size = pages.page_size
        # the HBM pool of each layer as [slots * 2 * P, H_kv, D] rows (one token's K or V each)
        self._rows = [self.hbm.pool(i).view(-1, num_kv_heads, head_dim)
                      for i in range(pages.num_layers)]
        self._parts: tuple | None = None  # decode partial states, allocated on first use

    def write_token(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A decode token: every live sequence's K and V into its current page, by write
        positions kept on the device and advanced in place (no host read, no table change)."""
        tabs = self.pages.tables(layer, self.tiers)
        kv = torch.stack((k, v), 1)  # [B, 2, H_kv, 1, D]
        if kv.dtype != self.dtype or kv.device != self.device:
            kv = kv.to(self.device, self.dtype)
        if tabs.alive_rows is not None:
            kv = kv.index_select(0, tabs.alive_rows)
        self._rows[layer].index_copy_(0, tabs.write_pos,
                                      kv.view(-1, self.num_kv_heads, self.head_dim))
        tabs.write_pos.add_(1)
        tabs.hot.table.last_page_len.add_(1)

    def write_chunk(self, layer: int, k: torch.Tensor, v: torch.Tensor, alive: list[int],
                     n0: int, n1: int) -> None:
        """A prompt chunk: one indexed write per layer, then the Quest metadata of every page
        it touched (the partly filled last page included)."""
        st, pm, p = self.pages.layers[layer], self.pages, self.page_size
        rows = torch.tensor(alive, dtype=torch.long)
        every = len(alive) == self.batch_size
        slot_rows = st.slot if every else st.slot[rows]
        pos = torch.arange(n0, n1)
        page_slot = slot_rows[:, pos // p].long().to(self.device)  # [b_alive, T]
        off = (pos % p).to(self.device)
        if not every:
            k, v = k[rows.to(k.device)], v[rows.to(v.device)]
        pool = self.hbm.pool(layer)
        pool[page_slot, 0, off[None, :].expand_as(page_slot)] = \
            k.permute(0, 2, 1, 3).to(self.device, self.dtype)
        pool[page_slot, 1, off[None, :].expand_as(page_slot)] = \
            v.permute(0, 2, 1, 3).to(self.device, self.dtype)
        touched = pm.page_idx[n0 // p:math.ceil(n1 / p)]
        if len(alive) and len(touched):
            lens = torch.clamp(n1 - touched * p, max=p).repeat(len(alive))
            self.importance.write_metadata(layer, pool, slot_rows[:, touched].flatten(), lens,
                                           (rows[:, None] * self.max_pages + touched).flatten(),
                                           queries_follow=True)
        st.edited(cold=False)  # the write position and the last page's length moved

    def decode(self, layer: int, qd: torch.Tensor, tabs: LayerTables, buffer: int,
                common: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One query token per sequence: the hot set, then the cold pages the layer's way
        (:meth:`mode`): each staged batch of them, the recalled ones, or the host's partial
        state over them; each partial state goes into a preallocated buffer (and each kernel's
        pages' LSE into the per-page buffer); then one kernel merges them and adds the page
        mass."""
        ks, tel, q1 = self.kernels, self.telemetry.layers[layer], qd[:, :, 0]
        mode = self.mode(layer, tabs, q1) if tabs.cold_pages else "all"
        recall, planner = self.policies.recall, self.planner
        probe = bool(tabs.cold_pages) and planner.due(layer)  # exact, its page LSEs measured
        want_mass = self.budgets.wants_mass() or probe
        page_lse = self.importance.decode_buffer(q1.shape[1]) if want_mass else None
        if mode == "split":  # the query leaves before the hot-set kernel is queued
            self.host.send_query(q1)
        batches = len(self.pages.cold_batches(layer, self.tiers)) if mode == "all" else 1
        parts_o, parts_lse, merged = self._decode_buffers(q1.shape[1], batches + 1)
        n = 0

        def run(pool, table, first=None):
            nonlocal n
            ks.sparse_decode(q1, pool, table.table, out=parts_o[n], lse=parts_lse[n],
                             first_lane=table.first_lane if first is None else first,
                             page_lse=page_lse,
                             page_lse_index=table.lse_index if want_mass else None, **common)
            n += 1

        run(self.hbm.pool(layer), tabs.hot, self._window_lanes(layer, tabs))
        scores = None
        if mode == "split":
            self.host.decode(layer, parts_o[n], parts_lse[n], sm_scale=common["sm_scale"],
                             softcap=common["softcap"], page_lse=page_lse)
            n += 1
            planner.observe_split(*self.host.last)
        elif mode == "all":
            for _ in self.prefetcher.attend_cold(layer, tabs, buffer, run):
                pass
        else:
            k = recall.budget(layer) if tabs.cold_pages else 0
            scores = self._scores(layer, q1, tabs, common) if k else None
            for _ in self.prefetcher.attend_cold(layer, tabs, buffer, run, scores=scores, k=k,
                                                 recall=True, reduce=recall.reduce):
                pass
            tel.recall_steps += bool(k)
        if probe:  # the share a recall would hold, for the next choice
            planner.estimate(layer, self._scores(layer, q1, tabs, common), recall.budget(layer),
                             page_lse, tabs.candidates.lse_index, reduce=recall.reduce,
                             alive_rows=tabs.alive_rows)
        tel.kernel_launches += n
        if want_mass:  # merge and page mass in one launch
            return self.importance.merge_decode(layer, parts_o[:n], parts_lse[:n], *merged)
        if n == 1:
            return parts_o[0], parts_lse[0]
        tel.kernel_launches += 1
        return ks.merge_states(parts_o[:n], parts_lse[:n], out=merged[0], out_lse=merged[1],
                               backend=self.backend)

    def mode(self, layer: int, tabs: LayerTables, q1: torch.Tensor) -> str:
        """How ``layer`` attends its cold pages this decode step (the planner's choice, from
        what each way would move and scan)."""
        planner = self.planner
        if not planner.auto:
            return planner.mode(layer)
        b, hq, d = q1.shape
        alive = int(self.pages.alive.sum())
        return planner.begin_decode(
            layer, cold_bytes=self.host.cold_bytes(layer),
            recall_bytes=self.policies.recall.budget(layer) * alive * self.hbm.page_bytes,
            link_bytes=q1.numel() * q1.element_size() + b * hq * (d + 1) * 4)

    def _scores(self, layer: int, q1: torch.Tensor, tabs: LayerTables, common: dict
                ) -> torch.Tensor:
        return self.policies.recall.scores(layer, q1, tabs, sm_scale=common["sm_scale"],
                                           softcap=common["softcap"])

    def _decode_buffers(self, num_q_heads: int, parts: int) -> tuple:
        """``[parts, B, H_q, D]`` outputs, ``[parts, B, H_q]`` LSEs and the merged pair, kept
        across steps (fixed addresses for graph capture)."""
        shape = (self.batch_size, num_q_heads, self.head_dim)
        if self._parts is None or self._parts[0].shape[0] < parts or \
                self._parts[0].shape[1:] != shape:
            f32 = dict(dtype=torch.float32, device=self.device)
            self._parts = (torch.empty(max(parts, 2), *shape, **f32),
                           torch.empty(max(parts, 2), *shape[:2], **f32),
                           (torch.empty(shape, **f32), torch.empty(shape[:2], **f32)))
        return self._parts

    def _window_lanes(self, layer: int, tabs: LayerTables) -> torch.Tensor | None:
        """On a sliding-window layer, the hot entries' first lanes for this decode step: the
        query sees only the last ``W`` keys, masked token by token (None elsewhere)."""
        st = self.pages.layers[layer]
        if st.window is None:
            return None
        start = torch.clamp(self.pages.pad, min=st.length - st.window).to(self.device)
        mp, idx = self.max_pages, tabs.hot.lse_index.long()
        rows = torch.clamp(idx // mp, max=self.batch_size - 1)
        return (start[rows] - (idx % mp) * self.page_size).clamp(0, self.page_size).to(
            torch.int32)

    def prefill(self, layer: int, qd: torch.Tensor, tabs: LayerTables, buffer: int,
                 common: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt chunk: causal attention over the hot pages, every cold page staged and
        attended, one merge; the chunk's page mass (and SnapKV's) under the merged LSE."""
        ks, tel, st = self.kernels, self.telemetry.layers[layer], self.pages.layers[layer]
        b, hq, t, d = qd.shape
        qf = qd.permute(0, 2, 1, 3).reshape(b * t, hq, d)
        qo = torch.arange(b + 1, dtype=torch.int32, device=self.device) * t
        want_mass = self.budgets.wants_mass()
        want_snap = self.budgets.wants_window_mass(decode=False)
        pool = self.hbm.pool(layer)
        # with no cold page the chunk's own softmax is the final one: its page mass is the
        # importance, without a second pass under the merged LSE
        parts = [ks.paged_prefill(qf, pool, tabs.hot.table, qo, causal=True,
                                  first_lane=tabs.hot.first_lane, sliding_window=st.window,
                                  return_page_mass=want_mass and not tabs.cold_pages, **common)]
        staged = []

        def cold_kernel(staging, table):
            staged.append((staging, table))
            return ks.paged_prefill(qf, staging, table.table, qo, causal=False,
                                    first_lane=table.first_lane, **common)

        on_host = self.host is not None and self.planner.config.attend == "split"
        if on_host and tabs.cold_pages:  # split: the cold pages are attended on the host
            parts += [PrefillOutput(o, lse_, None) for o, lse_ in self.host.prefill(
                layer, qf, qo, sm_scale=common["sm_scale"], softcap=common["softcap"])]
        else:
            parts += list(self.prefetcher.attend_cold(layer, tabs, buffer, cold_kernel))
        tel.kernel_launches += len(parts)
        if len(parts) == 1:
            out, lse = parts[0].out, parts[0].lse
        else:
            out, lse = ks.merge_states(torch.stack([x.out for x in parts]),
                                       torch.stack([x.lse for x in parts]), backend=self.backend)
            tel.kernel_launches += 1
        imp = self.importance
        if parts[0].page_mass is not None:
            imp.add_entries(layer, tabs.hot, parts[0].page_mass)
        if want_snap:
            imp.snap[layer].zero_()
        if (want_mass and parts[0].page_mass is None) or want_snap:
            kw = dict(qd=qd, lse=lse, scale=common["sm_scale"], softcap=common["softcap"],
                      snap=want_snap)
            imp.add_prefill(layer, tabs.hot, pool, True, mass=want_mass and
                            parts[0].page_mass is None, **kw)
            if on_host and tabs.cold_pages:
                self.host.prefill_mass(
                    layer, qd, lse, scale=common["sm_scale"], softcap=common["softcap"],
                    mass=imp.mass[layer] if want_mass else None,
                    snap=imp.snap[layer] if want_snap else None,
                    snapkv_window=imp.snapkv_window)
            if len(staged) == 1:
                imp.add_prefill(layer, staged[0][1], staged[0][0], False, mass=want_mass, **kw)
            elif staged:  # batches reused the buffer: stream the cold pages once more
                for _ in self.prefetcher.attend_cold(
                        layer, tabs, buffer, lambda staging, table: imp.add_prefill(
                            layer, table, staging, False, mass=want_mass, **kw)):
                    pass
        # a projected key sketch is fitted on the chunk's queries once its attention has run
        # (only decode steps read the codes; a failed prefill leaves the fit to the next chunk)
        imp.fit_sketch(layer, qd)
        return out, lse

    def finish(self, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None,
                dtype: torch.dtype, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """``[B, H_q, T, D]`` in ``dtype`` from the merged state (``[B*T, H_q, D]`` or, for a
        decode step, ``[B, H_q, D]``), with the attention sinks applied."""
        b, hq, t, d = shape
        if sinks is not None:  # the sink takes exp(sink) of the softmax mass and adds nothing
            out = out * torch.sigmoid(lse - sinks.to(lse.device, torch.float32)).unsqueeze(-1)
        res = out.unsqueeze(2) if t == 1 else out.view(b, t, hq, d).permute(0, 2, 1, 3)
        return res.to(dtype, copy=True)  # the partial-state buffers are reused next layer

    def graph_step(self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                    buffer: int, common: dict, sinks: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
        """The device work of a decode step, as it is captured: the token's write, the
        attention, the merge, on the compute stream (no engine stream or events)."""
        self.mover.direct = True
        try:
            self.write_token(layer, k, v)
            out, lse = self.decode(layer, q, self.pages.tables(layer, self.tiers), buffer, common)
            return self.finish(out, lse, sinks, dtype, (*q.shape[:2], 1, q.shape[3]))
        finally:
            self.mover.direct = False

    def graph_key(self, layer: int, tabs: LayerTables, common: dict,
                   sinks: torch.Tensor | None, dtype: torch.dtype) -> tuple:
        """The host values a captured decode step of ``layer`` bakes in: table storage, the
        cold batches present, the recall budget, which tiers hold pages, the kernels' scalars."""
        recall = self.policies.recall
        cold = self.pages.cold_batches(layer, self.tiers) if recall.exact else []
        k = recall.budget(layer) if not recall.exact and tabs.cold_pages else 0
        if k:  # outside the graph: the selection's row counts follow the candidates
            self.prefetcher.recall_layout(tabs, k)
        return (tuple(t.data_ptr() for t in tabs.hot_storage),
                tuple(t.data_ptr() for t in tabs.cold_storage) if cold else (),
                tuple(tuple(t for t, n in x.pages_by_tier.items() if n) for x in cold), k,
                tuple(t.num_used(layer) > 0 for t in self.tiers[1:]),
                tabs.alive_rows is None, tabs.padded, self.budgets.wants_mass(),
                common["sm_scale"], common["softcap"],
                None if sinks is None else sinks.data_ptr(), dtype)

    def count_replayed_copies(self, layer: int) -> None:
        """Count the bytes a replayed step's cold copies moved: the device tables' current
        pages per tier (a graph replays the launches; the host counts what they carried)."""
        if not self.policies.recall.exact:
            return  # recall counts its pages on the device, inside the step
        for batch in self.pages.cold_batches(layer, self.tiers):
            for t, n in batch.pages_by_tier.items():
                if n and self.tiers[t].is_memory:
                    self.mover.count_bytes(layer, t, n)
