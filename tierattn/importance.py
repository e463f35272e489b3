"""Importance of pages: attention mass from the kernels, Quest metadata and bounds.

Per layer and sequence, ``mass [B, max_pages]`` accumulates each page's attention mass (the
decode and prefill kernels return it as a by-product, normalised under the final LSE), and
``snap`` holds SnapKV's observation-window mass of the last prefill chunk. The Quest metadata of
*every* page (element-wise ``kmin``/``kmax`` of its keys, per KV head) stays on the device, so
cold pages can be scored without moving them. Policies (:mod:`tierattn.policy`) read these to
rank pages; nothing here decides or moves anything.
"""

from __future__ import annotations

import torch

from tierattn.kernels import KernelSet, PageTable
from tierattn.pagemap import Entries, PageMap
from tierattn.telemetry import Telemetry

__all__ = ["Importance"]


class Importance:
    """Page mass, SnapKV window mass, the latest decode query and Quest metadata per layer.

    Args:
        pages: the page map (geometry, padding).
        num_kv_heads, head_dim, dtype: of the keys (metadata is kept in the KV dtype).
        snapkv_window: SnapKV's observation window (queries).
        kernels, backend, telemetry: kernel entry points, their backend, launch counters.
    """

    def __init__(self, pages: PageMap, *, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 snapkv_window: int, kernels: KernelSet, backend: str,
                 telemetry: Telemetry) -> None:
        self.pages, self.kernels, self.backend, self.telemetry = pages, kernels, backend, telemetry
        self.snapkv_window = snapkv_window
        self.num_kv_heads = num_kv_heads
        b, mp, n = pages.batch_size, pages.max_pages, pages.num_layers
        self.kmin = torch.zeros(n, b * mp, num_kv_heads, head_dim, dtype=dtype,
                                device=pages.device)
        self.kmax = torch.zeros_like(self.kmin)
        self.mass = [torch.zeros(b, mp, dtype=torch.float32) for _ in range(n)]
        self.snap: list[torch.Tensor | None] = [None] * n
        self.last_q: list[torch.Tensor | None] = [None] * n  # [B, H_q, D] latest decode query

    def reset(self, layer: int) -> None:
        self.mass[layer] = torch.zeros_like(self.mass[layer])
        self.snap[layer] = None
        self.last_q[layer] = None

    # --- attention mass ------------------------------------------------------------------------

    @staticmethod
    def add(entries: Entries, values: torch.Tensor, into: torch.Tensor,
            accumulate: bool = True) -> None:
        """Scatter per-entry ``values`` (aligned with the table ``entries`` describe: sequence
        by sequence, page by page) into ``into [B, max_pages]``."""
        if not len(entries):
            return
        into.index_put_((entries.rows, entries.cols), values.float().cpu()[:len(entries)],
                        accumulate=accumulate)

    def add_mass(self, layer: int, entries: Entries, values: torch.Tensor) -> None:
        self.add(entries, values, self.mass[layer])

    def add_decode(self, layer: int, part, table: PageTable, entries: Entries,
                   lse: torch.Tensor) -> None:
        """Add a decode partial state's page mass, normalised under the merged ``lse``."""
        mass = self.kernels.decode_page_mass(part.page_lse, lse, table, self.num_kv_heads,
                                             backend=self.backend)
        self.add_mass(layer, entries, mass.sum(-1))

    def add_prefill(self, layer: int, table: PageTable, pages: Entries, pool: torch.Tensor,
                    causal: bool, *, qd: torch.Tensor, lse: torch.Tensor, scale: float,
                    softcap: float | None, mass: bool, snap: torch.Tensor | None) -> None:
        """Importance from a prompt chunk ``qd [B, H_q, T, D]`` over one page set, under the
        merged ``lse``: the chunk's attention mass (H2O) and SnapKV's observation-window mass
        (written into ``snap``)."""
        if not len(pages):
            return
        b, hq, t, d = qd.shape
        window = self.pages.layers[layer].window if causal else None
        kw = dict(sm_scale=scale, causal=causal, softcap=softcap, validate=False,
                  first_lane=self.pages.first_lane(pages), sliding_window=window,
                  backend=self.backend)
        tel = self.telemetry.layers[layer]
        device = qd.device
        if mass:
            qf = qd.permute(0, 2, 1, 3).reshape(b * t, hq, d)
            qo = torch.arange(b + 1, dtype=torch.int32, device=device) * t
            m = self.kernels.paged_prefill_mass(qf, pool, table, qo, lse, **kw)
            self.add_mass(layer, pages, m.sum(-1))
            tel.kernel_launches += 1
        if snap is not None:
            w = min(self.snapkv_window, t)
            qw = qd[:, :, t - w:].permute(0, 2, 1, 3).reshape(b * w, hq, d)
            lw = lse.view(b, t, hq)[:, t - w:].reshape(b * w, hq).contiguous()
            qo = torch.arange(b + 1, dtype=torch.int32, device=device) * w
            m = self.kernels.paged_prefill_mass(qw, pool, table, qo, lw, **kw)
            self.add(pages, m.sum(-1), snap, accumulate=False)
            tel.kernel_launches += 1

    # --- Quest metadata and bounds -------------------------------------------------------------

    def write_metadata(self, layer: int, pool: torch.Tensor, slots: torch.Tensor,
                       lens: torch.Tensor, rows: torch.Tensor) -> None:
        """Quest ``kmin``/``kmax`` of pages ``pool[slots[i]]`` (``lens[i]`` tokens) into
        metadata rows ``rows[i]`` (``b * max_pages + page``)."""
        dev = self.pages.device
        self.kernels.page_metadata(pool, slots.to(dev), lens.to(dev), kmin=self.kmin[layer],
                                   kmax=self.kmax[layer], rows=rows.to(torch.int32).to(dev),
                                   validate=False, backend=self.backend)
        self.telemetry.layers[layer].kernel_launches += 1

    def quest_bound(self, layer: int, q: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
        """Quest bound (max over KV heads) of query ``q [B, H_q, D]`` for the pages ``rows[b]``
        of each sequence, concatenated, on the host (``[sum len(rows[b])]``)."""
        dev, mp = self.pages.device, self.pages.max_pages
        counts = [r.numel() for r in rows]
        meta = torch.cat([bi * mp + r for bi, r in enumerate(rows)])
        indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        table = PageTable.from_csr(indptr.to(dev), meta.to(torch.int32).to(dev),
                                   torch.ones(len(rows), dtype=torch.int32, device=dev))
        bound = self.kernels.quest_score(q, self.kmin[layer], self.kmax[layer], table,
                                         validate=False, backend=self.backend)
        self.telemetry.layers[layer].kernel_launches += 1
        return bound.max(dim=-1).values.cpu()

    def reorder(self, index: torch.Tensor) -> None:
        """Sequence ``i`` takes old sequence ``index[i]``'s importance and metadata."""
        mp = self.pages.max_pages
        src = (index[:, None] * mp + torch.arange(mp)).flatten().to(self.kmin.device)
        for layer in range(self.pages.num_layers):
            self.mass[layer] = self.mass[layer][index]
            self.kmin[layer] = self.kmin[layer][src]
            self.kmax[layer] = self.kmax[layer][src]
