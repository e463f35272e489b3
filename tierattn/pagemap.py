"""PageMap: where every page of every layer and sequence lives, and the page tables kernels read.

Per layer, each sequence's KV is a list of logical pages of ``page_size`` tokens. A page is *hot*
(tier 0, a slot of the HBM pool), *cold* (a slot of a lower tier: DDR, CXL or disk) or gone
(``NONE``: evicted, dropped from a sliding window, or past the end). The map holds, per layer,
``[B, max_pages]`` tier and slot tensors on the host and the layer's length; per sequence,
whether it is alive and how many tokens of left padding it starts with. It decides nothing and
moves nothing: policies read it, the :mod:`~tierattn.mover` edits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain

import torch

from tierattn.kernels import PageTable

__all__ = ["HOT", "NONE", "Entries", "LayerPages", "PageMap", "Staged"]

HOT = 0  # tier index of HBM
NONE = -1  # no page: evicted, dropped from a window, or beyond the end


@dataclass
class LayerPages:
    """One layer's page tables (``[B, max_pages]`` host tensors) and length."""

    tier: torch.Tensor  # int8 tier index, NONE for no page
    slot: torch.Tensor  # int32 slot within that tier
    evicted: torch.Tensor  # bool: dropped for good (or left a sliding window)
    length: int = 0  # tokens per sequence (padding and evicted ones included)
    window: int | None = None  # sliding window of this layer (HF semantics: q - k < window)


@dataclass
class Entries:
    """The logical pages of a page table's entries, in table order (sequence by sequence, page
    by page), as two ``[nnz]`` long CPU tensors."""

    rows: torch.Tensor  # sequence of each entry
    cols: torch.Tensor  # logical page of each entry

    def __len__(self) -> int:
        return self.cols.numel()

    @classmethod
    def from_lists(cls, pages: list[list[int]]) -> Entries:
        counts = torch.tensor([len(x) for x in pages], dtype=torch.long)
        return cls(torch.repeat_interleave(torch.arange(len(pages)), counts),
                   torch.tensor(list(chain.from_iterable(pages)), dtype=torch.long))


@dataclass
class Staged:
    """Cold pages of one batch resident in a staging buffer, ready to attend."""

    buffer: int
    pages: list[list[int]] = field(default_factory=list)
    slots: list[list[int]] = field(default_factory=list)

    @cached_property
    def entries(self) -> Entries:
        """The batch's pages as table entries (built once: read only after the batch is
        yielded, when its lists no longer change)."""
        return Entries.from_lists(self.pages)


class PageMap:
    """Tier and slot of every page, per layer and sequence (see the module docstring).

    Args:
        num_layers, batch_size: ``L`` and ``B``.
        max_pages: pages per sequence the tables hold (``ceil(max_context / page_size)``).
        page_size: tokens per page.
        sink_pages, recent_pages: pages that always stay hot at the start and the end.
        device: where the kernels read the tables.
    """

    def __init__(self, *, num_layers: int, batch_size: int, max_pages: int, page_size: int,
                 sink_pages: int, recent_pages: int, device: torch.device) -> None:
        self.num_layers, self.batch_size = num_layers, batch_size
        self.max_pages, self.page_size = max_pages, page_size
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        self.device = device
        self.alive = torch.ones(batch_size, dtype=torch.bool)
        self.pad = torch.zeros(batch_size, dtype=torch.long)  # leading padding tokens
        # logical page numbers and page ends, built once (sliced per call instead of rebuilt)
        self.page_idx = torch.arange(max_pages)
        self.seq_idx = torch.arange(batch_size)
        self.page_ends = (self.page_idx + 1) * page_size
        self.layers = [self.new_layer() for _ in range(num_layers)]

    def new_layer(self) -> LayerPages:
        b, mp = self.batch_size, self.max_pages
        return LayerPages(tier=torch.full((b, mp), NONE, dtype=torch.int8),
                          slot=torch.zeros(b, mp, dtype=torch.int32),
                          evicted=torch.zeros(b, mp, dtype=torch.bool))

    # --- geometry ----------------------------------------------------------------------------

    def length(self, layer: int) -> int:
        return self.layers[layer].length

    def num_pages(self, layer: int) -> int:
        return math.ceil(self.layers[layer].length / self.page_size)

    def pad_pages(self) -> torch.Tensor:
        """``[B]`` leading pages made only of left padding (never attended, never counted in
        a budget)."""
        return self.pad // self.page_size

    def must_hot(self, n_pages: int, layer: int | None = None) -> torch.Tensor:
        """``[B, n_pages]`` bool: per sequence, the sink pages (counted from its first page with
        a real token, after any left padding), the recent window and the page being filled; on
        a sliding-window layer, every page a future query can still see (kept contiguous and
        hot, which keeps positions exact for the window mask)."""
        m = torch.zeros(self.batch_size, n_pages, dtype=torch.bool)
        st = self.layers[layer] if layer is not None else None
        if st is not None and st.window is not None:
            keep_from = st.length - st.window + 1
            m[:, self.page_ends[:n_pages] > keep_from] = True
            return m
        first = self.pad_pages()
        idx = self.page_idx[None, :n_pages]
        m |= (idx >= first[:, None]) & (idx < first[:, None] + self.sink_pages)
        m[:, max(0, n_pages - self.recent_pages - 1):] = True
        return m

    def attendable(self, n_pages: int, start: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, n_pages]``: live sequences' pages holding a token at or after ``start[b]``
        (default: the end of the left padding)."""
        start = self.pad if start is None else start
        return self.alive[:, None] & (self.page_ends[None, :n_pages] > start[:, None])

    def first_lane(self, entries: Entries, start: torch.Tensor | None = None
                   ) -> torch.Tensor | None:
        """Per table entry, the first lane at or after ``start[b]`` (default: the end of the
        padding), on the device; None when nothing is masked."""
        start = self.pad if start is None else start
        if not bool((start > 0).any()):
            return None
        p = self.page_size
        first = (start[entries.rows] - entries.cols * p).clamp(0, p)
        return first.to(torch.int32).to(self.device)

    def live_pages(self, layer: int, sequence: int) -> torch.Tensor:
        """``[n]`` logical pages of ``sequence`` that still hold KV (any tier)."""
        return (self.layers[layer].tier[sequence] != NONE).nonzero().flatten()

    def residency(self, layer: int) -> dict[int, int]:
        """Pages of live sequences per tier index in ``layer``."""
        st = self.layers[layer]
        tiers = st.tier[:, :self.num_pages(layer)][self.alive]
        return {int(t): int(n) for t, n in zip(*torch.unique(tiers[tiers != NONE],
                                                             return_counts=True))}

    # --- page tables for the kernels -------------------------------------------------------------

    @staticmethod
    def page_lists(mask: torch.Tensor) -> list[list[int]]:
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

    def table(self, counts: list[int], idx: torch.Tensor, last: int) -> PageTable:
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

    def hot_table(self, layer: int, n_pages: int,
                  attendable: torch.Tensor) -> tuple[PageTable, Entries]:
        """Hot pages of each sequence in logical order (a compact row: the recent tail is
        contiguous and hot, so positions inside the tail stay exact for causal masking)."""
        st, p = self.layers[layer], self.page_size
        hot = (st.tier[:, :n_pages] == HOT) & attendable
        nz = hot.nonzero()  # row-major: sequence by sequence, page by page
        counts = hot.sum(1).tolist()
        last = st.length - (n_pages - 1) * p if n_pages else 0
        idx = st.slot[:, :n_pages][hot]
        return self.table(counts, idx, last), Entries(nz[:, 0], nz[:, 1])

    def staged_table(self, run: Staged) -> PageTable:
        idx = torch.tensor(list(chain.from_iterable(run.slots)), dtype=torch.int32)
        return self.table([len(x) for x in run.slots], idx, self.page_size)
