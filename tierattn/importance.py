"""Importance of pages: attention mass from the kernels, Quest metadata and bounds, on the device.

Per layer, ``mass`` accumulates each page's attention mass on the device (flat
``[B * max_pages + 1]``: page ``pg`` of sequence ``b`` at ``b * max_pages + pg``, the last entry a
trash row for unused table entries). A decode step scatters every attended page's LSE into one
per-page buffer (``page_lse``, written by the attention kernels themselves); one kernel merges
the step's partial states and adds the mass under the merged LSE; nothing is read back.
``snap`` holds SnapKV's observation-window mass of the last prefill chunk. The Quest metadata of
*every* page (element-wise ``kmin``/``kmax`` of its keys, per KV head) stays on the device, so
cold pages can be scored without moving them.

Policies rank pages on the host from a **snapshot**: when a structural decision is due at the
next step (a page filled, an eviction target grows), :meth:`Importance.snapshot` copies what the
policy reads to pinned host memory asynchronously; :meth:`Importance.host` returns it, waiting on
its event only if the copy has not landed (it was issued a whole step earlier). So ranks are at
most one step old and a decode step never blocks on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierattn.kernels import KernelSet, PageTable
from tierattn.pagemap import DeviceTable, PageMap
from tierattn.telemetry import Telemetry
from tierattn.transfer import TransferEngine

__all__ = ["HostImportance", "Importance"]


@dataclass
class HostImportance:
    """A host copy of one layer's importance (``[B, max_pages]`` CPU tensors)."""

    mass: torch.Tensor
    snap: torch.Tensor | None
    bound: torch.Tensor | None  # Quest bound of the latest decode query (None: none yet)
    tickets: list  # the transfer engine's tickets of the copies

    def ready(self, engine: TransferEngine) -> HostImportance:
        for ticket in self.tickets:
            engine.wait_host(ticket)
        self.tickets = []
        return self


class Importance:
    """Page mass, SnapKV window mass, Quest metadata and host snapshots, per layer.

    Args:
        pages: the page map (geometry, padding).
        num_kv_heads, head_dim, dtype: of the keys (metadata is kept in the KV dtype).
        snapkv_window: SnapKV's observation window (queries).
        window_mass: keep SnapKV's window mass (an eviction policy reads it).
        kernels, backend, telemetry: kernel entry points, their backend, launch counters.
        engine: the transfer engine (its asynchronous device-to-host copies take snapshots).
    """

    def __init__(self, pages: PageMap, *, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 snapkv_window: int, window_mass: bool, kernels: KernelSet, backend: str,
                 telemetry: Telemetry, engine: TransferEngine) -> None:
        self.pages, self.kernels, self.backend, self.telemetry = pages, kernels, backend, telemetry
        self.engine = engine
        self.snapkv_window, self.num_kv_heads = snapkv_window, num_kv_heads
        b, mp, n, dev = pages.batch_size, pages.max_pages, pages.num_layers, pages.device
        self.kmin = torch.zeros(n, b * mp, num_kv_heads, head_dim, dtype=dtype, device=dev)
        self.kmax = torch.zeros_like(self.kmin)
        self.mass = torch.zeros(n, b * mp + 1, dtype=torch.float32, device=dev)
        self.snap = torch.zeros_like(self.mass) if window_mass else None
        self.last_q: list[torch.Tensor | None] = [None] * n  # [B, H_q, D] latest decode query
        self.page_lse: torch.Tensor | None = None  # [B * max_pages + 1, H_q], built on first use
        self._pending = False  # page_lse holds a step's scatter not merged yet
        # one row per sequence over its max_pages rows of page_lse (for the mass kernel), and
        # over its metadata rows (Quest bound of every page)
        start = torch.arange(b, dtype=torch.int32, device=dev) * mp
        full = torch.full((b,), mp, dtype=torch.int32, device=dev)
        self.per_page = PageTable(indices=torch.arange(b * mp, dtype=torch.int32, device=dev),
                                  row_start=start, row_count=full,
                                  last_page_len=torch.ones(b, dtype=torch.int32, device=dev))
        self._host: list[HostImportance | None] = [None] * n
        pinned = dev.type == "cuda"
        self._host_bufs = [torch.zeros(3, b, mp, pin_memory=pinned) for _ in range(n)]

    def of(self, layer: int) -> torch.Tensor:
        """``[B, max_pages]`` view of ``layer``'s accumulated mass (on the device)."""
        b, mp = self.pages.batch_size, self.pages.max_pages
        return self.mass[layer, :b * mp].view(b, mp)

    def reset(self) -> None:
        self.mass.zero_()
        if self.snap is not None:
            self.snap.zero_()
        self.last_q = [None] * self.pages.num_layers
        self._host = [None] * self.pages.num_layers

    def clear_sequence(self, sequence: int) -> None:
        mp = self.pages.max_pages
        self.mass[:, sequence * mp:(sequence + 1) * mp] = 0

    # --- attention mass ------------------------------------------------------------------------

    def decode_buffer(self, num_q_heads: int) -> torch.Tensor:
        """The per-page LSE buffer of one decode step (every row -inf: the merge that consumes
        it resets the rows it read, so no step pays for a fill)."""
        rows = self.pages.batch_size * self.pages.max_pages + 1
        if self.page_lse is None or self.page_lse.shape[1] != num_q_heads:
            self.page_lse = torch.full((rows, num_q_heads), float("-inf"), dtype=torch.float32,
                                       device=self.pages.device)
        elif self._pending:  # a step stopped between its kernels and the merge
            self.page_lse.fill_(float("-inf"))
        self._pending = True
        return self.page_lse

    def merge_decode(self, layer: int, o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                     out_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge a decode step's partial states ``o [N, B, H_q, D]``, ``lse [N, B, H_q]`` and
        add every page's mass under the merged LSE to ``layer``'s importance: one kernel, on
        the device (:func:`~tierattn.kernels.merge_page_mass`)."""
        res = self.kernels.merge_page_mass(o, lse, self.page_lse, self.mass[layer],
                                           pages_per_row=self.pages.max_pages, out=out,
                                           out_lse=out_lse, backend=self.backend)
        self._pending = False
        self.telemetry.layers[layer].kernel_launches += 1
        return res

    def add_entries(self, layer: int, table: DeviceTable, values: torch.Tensor,
                    into: torch.Tensor | None = None) -> None:
        """Scatter-add per-entry ``values [cap, H_kv]`` (summed over heads) of ``table`` into
        ``layer``'s mass (or ``into``); unused entries land in the trash row."""
        target = self.mass if into is None else into
        target[layer].index_add_(0, table.lse_index, values.sum(-1).float())

    def add_prefill(self, layer: int, table: DeviceTable, pool: torch.Tensor, causal: bool, *,
                    qd: torch.Tensor, lse: torch.Tensor, scale: float, softcap: float | None,
                    mass: bool, snap: bool) -> None:
        """Importance from a prompt chunk ``qd [B, H_q, T, D]`` over one page set, under the
        merged ``lse``: the chunk's attention mass (H2O) and SnapKV's observation-window mass."""
        if not table.total:
            return
        b, hq, t, d = qd.shape
        kw = dict(sm_scale=scale, causal=causal, softcap=softcap, validate=False,
                  first_lane=table.first_lane,
                  sliding_window=self.pages.layers[layer].window if causal else None,
                  backend=self.backend)
        tel = self.telemetry.layers[layer]
        device = qd.device
        if mass:
            qf = qd.permute(0, 2, 1, 3).reshape(b * t, hq, d)
            qo = torch.arange(b + 1, dtype=torch.int32, device=device) * t
            self.add_entries(layer, table,
                             self.kernels.paged_prefill_mass(qf, pool, table.table, qo, lse, **kw))
            tel.kernel_launches += 1
        if snap:
            w = min(self.snapkv_window, t)
            qw = qd[:, :, t - w:].permute(0, 2, 1, 3).reshape(b * w, hq, d)
            lw = lse.view(b, t, hq)[:, t - w:].reshape(b * w, hq).contiguous()
            qo = torch.arange(b + 1, dtype=torch.int32, device=device) * w
            self.add_entries(layer, table,
                             self.kernels.paged_prefill_mass(qw, pool, table.table, qo, lw, **kw),
                             into=self.snap)
            tel.kernel_launches += 1

    # --- Quest metadata and bounds -------------------------------------------------------------

    def write_metadata(self, layer: int, pool: torch.Tensor, slots: torch.Tensor,
                       lens: torch.Tensor, rows: torch.Tensor) -> None:
        """Quest ``kmin``/``kmax`` of pages ``pool[slots[i]]`` (``lens[i]`` tokens) into
        metadata rows ``rows[i]`` (``b * max_pages + page``)."""
        dev = self.pages.device
        self.kernels.page_metadata(pool, slots.to(dev, torch.int32), lens.to(dev, torch.int32),
                                   kmin=self.kmin[layer], kmax=self.kmax[layer],
                                   rows=rows.to(dev, torch.int32), validate=False,
                                   backend=self.backend)
        self.telemetry.layers[layer].kernel_launches += 1

    def quest_bound(self, layer: int, q: torch.Tensor, table: PageTable) -> torch.Tensor:
        """Quest bound ``[nnz, H_kv]`` of query ``q [B, H_q, D]`` for the metadata rows
        ``table`` lists (on the device)."""
        self.telemetry.layers[layer].kernel_launches += 1
        return self.kernels.quest_score(q, self.kmin[layer], self.kmax[layer], table,
                                        validate=False, backend=self.backend)

    # --- host snapshots ------------------------------------------------------------------------

    def snapshot(self, layer: int, *, bound: bool = False) -> None:
        """Start copying ``layer``'s mass (and SnapKV mass, and with ``bound`` the Quest bound
        of its latest decode query over every page) to host memory, without waiting."""
        b, mp = self.pages.batch_size, self.pages.max_pages
        buf = self._host_bufs[layer]
        tickets = [self.engine.to_host(self.of(layer), buf[0])]
        if self.snap is not None:
            tickets.append(self.engine.to_host(self.snap[layer, :b * mp].view(b, mp), buf[1]))
        q = self.last_q[layer]
        have_bound = bound and q is not None
        if have_bound:
            scores = self.quest_bound(layer, q, self.per_page).max(-1).values.view(b, mp)
            tickets.append(self.engine.to_host(scores, buf[2]))
        self._host[layer] = HostImportance(buf[0], buf[1] if self.snap is not None else None,
                                           buf[2] if have_bound else None, tickets)

    def host(self, layer: int, *, bound: bool = False, fresh: bool = False) -> HostImportance:
        """The latest snapshot of ``layer`` (taken now if there is none, or with ``fresh``)."""
        snap = self._host[layer]
        if fresh or snap is None or (bound and snap.bound is None and
                                     self.last_q[layer] is not None):
            self.snapshot(layer, bound=bound)
        return self._host[layer].ready(self.engine)

    def reorder(self, index: torch.Tensor) -> None:
        """Sequence ``i`` takes old sequence ``index[i]``'s importance and metadata."""
        b, mp = self.pages.batch_size, self.pages.max_pages
        src = (index[:, None] * mp + torch.arange(mp)).flatten().to(self.kmin.device)
        for t in [self.mass] + ([self.snap] if self.snap is not None else []):
            t[:, :b * mp] = t[:, src]
        self.kmin[:] = self.kmin[:, src]
        self.kmax[:] = self.kmax[:, src]
        self._host = [None] * self.pages.num_layers
        self.last_q = [None] * self.pages.num_layers
