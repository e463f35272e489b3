"""Page tables in FlashInfer's vocabulary, normalised to one form every kernel reads.

A page table lists, for each *row* (a sequence, or a (sequence, KV head) pair for per-head
selections), the pool slots of its pages. Two input forms are accepted:

* CSR (``indptr [R+1]``, ``indices [nnz]``, ``last_page_len [R]``), FlashInfer's paged-KV form;
* padded (``table [R, max_pages]`` plus ``kv_lens [R]``), vLLM's block-table form.

Both become :class:`PageTable` (``indices``, ``row_start``, ``row_count``, ``last_page_len``),
built with device-side torch ops only (no host sync), so kernels never care which form the
caller used. Row ``r`` holds entries ``indices[row_start[r] : row_start[r] + row_count[r]]``;
every entry is a full page except the row's last, which holds ``last_page_len[r]`` tokens
(between 1 and ``page_size``; 0 for an empty row). Entries are read in list order; for
prefill and for the page-mass outputs, list order is logical token order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierattn.errors import KernelInputError

from ._common import FLOAT_DTYPES, INDEX_DTYPE, check_gqa, check_pool, check_tensor

__all__ = ["PageTable", "check_paged_attention_args"]


def _index(name: str, t: object, ndim: int) -> torch.Tensor:
    t = check_tensor(name, t, ndim=ndim)
    if t.dtype != INDEX_DTYPE:
        raise KernelInputError(
            f"{name} has dtype {t.dtype}; page tables are int32 (FlashInfer's convention): "
            f"pass {name}.to(torch.int32)."
        )
    return t


@dataclass(frozen=True)
class PageTable:
    """Normalised page table (all tensors int32, same device).

    Attributes:
        indices: ``[nnz]`` pool slot of each entry.
        row_start: ``[R]`` offset of each row's first entry in ``indices``.
        row_count: ``[R]`` number of entries (pages) of each row.
        last_page_len: ``[R]`` tokens in each row's last entry (0 when the row is empty).
    """

    indices: torch.Tensor
    row_start: torch.Tensor
    row_count: torch.Tensor
    last_page_len: torch.Tensor

    def __post_init__(self) -> None:
        # kernels read these as dense int32 arrays: a strided or int64 view would be misread
        fields = {"indices": self.indices, "row_start": self.row_start,
                  "row_count": self.row_count, "last_page_len": self.last_page_len}
        for name, t in fields.items():
            _index(f"PageTable.{name}", t, 1)
            if not t.is_contiguous():
                raise KernelInputError(f"PageTable.{name} must be contiguous; pass "
                                       f"{name}.contiguous().")
            if t.device != self.indices.device:
                raise KernelInputError(f"PageTable.{name} is on {t.device} but indices is on "
                                       f"{self.indices.device}.")
        rows = self.row_start.numel()
        if self.row_count.numel() != rows or self.last_page_len.numel() != rows:
            raise KernelInputError(
                f"PageTable.row_start, row_count and last_page_len must have one entry per row; "
                f"got {rows}, {self.row_count.numel()} and {self.last_page_len.numel()}.")

    @classmethod
    def from_csr(
        cls, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor
    ) -> PageTable:
        """FlashInfer form: row ``r`` is ``indices[indptr[r]:indptr[r+1]]``.

        Args:
            indptr: ``[R+1]`` int32, non-decreasing, ``indptr[0] == 0``.
            indices: ``[nnz]`` int32 pool slots.
            last_page_len: ``[R]`` int32 tokens in each row's last page.
        """
        indptr = _index("indptr", indptr, 1)
        indices = _index("indices", indices, 1)
        last_page_len = _index("last_page_len", last_page_len, 1)
        if indptr.numel() != last_page_len.numel() + 1:
            raise KernelInputError(
                f"indptr has {indptr.numel()} entries but last_page_len has "
                f"{last_page_len.numel()}; indptr must have one entry more (R+1 vs R)."
            )
        for n, t in (("indices", indices), ("last_page_len", last_page_len)):
            if t.device != indptr.device:
                raise KernelInputError(f"{n} is on {t.device} but indptr is on {indptr.device}.")
        return cls(
            indices=indices.contiguous(),
            row_start=indptr[:-1].contiguous(),
            row_count=(indptr[1:] - indptr[:-1]).to(INDEX_DTYPE).contiguous(),
            last_page_len=last_page_len.contiguous(),
        )

    @classmethod
    def from_padded(
        cls, table: torch.Tensor, kv_lens: torch.Tensor, page_size: int
    ) -> PageTable:
        """Block-table form: row ``r`` uses ``table[r, :ceil(kv_lens[r] / page_size)]``.

        Args:
            table: ``[R, max_pages]`` int32 pool slots; entries past a row's length are ignored.
            kv_lens: ``[R]`` int32 tokens per row.
            page_size: tokens per page.
        """
        table = _index("table", table, 2)
        kv_lens = _index("kv_lens", kv_lens, 1)
        if kv_lens.numel() != table.shape[0]:
            raise KernelInputError(
                f"kv_lens has {kv_lens.numel()} entries but table has {table.shape[0]} rows."
            )
        if kv_lens.device != table.device:
            raise KernelInputError(
                f"kv_lens is on {kv_lens.device} but table is on {table.device}.")
        if not isinstance(page_size, int) or page_size < 1:
            raise KernelInputError(f"page_size must be a positive int, got {page_size!r}.")
        rows, max_pages = table.shape
        count = torch.div(kv_lens + (page_size - 1), page_size, rounding_mode="floor")
        # a negative kv_len stays visible in last_page_len so validate() reports it
        last = torch.where(count > 0, kv_lens - (count - 1) * page_size, kv_lens)
        start = torch.arange(rows, dtype=INDEX_DTYPE, device=table.device) * max_pages
        return cls(
            indices=table.contiguous().reshape(-1),
            row_start=start,
            row_count=count.to(INDEX_DTYPE).contiguous(),
            last_page_len=last.to(INDEX_DTYPE).contiguous(),
        )

    @property
    def num_rows(self) -> int:
        return self.row_count.numel()

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def kv_lens(self, page_size: int) -> torch.Tensor:
        """``[R]`` int64 tokens per row: ``(count - 1) * page_size + last_page_len``."""
        count = self.row_count.long()
        return torch.where(count > 0, (count - 1) * page_size + self.last_page_len.long(), 0)

    def entry_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row, listed)``, both ``[nnz]``: the row each entry belongs to (0 for an entry of no
        row) and whether it belongs to one; on the device, no host read (the torch backends)."""
        entry = torch.arange(self.indices.numel(), device=self.indices.device)
        start = self.row_start.long()[:, None]
        inside = (entry[None, :] >= start) & \
            (entry[None, :] < start + self.row_count.long()[:, None])
        return inside.int().argmax(0), inside.any(0)

    def to(self, device: torch.device | str) -> PageTable:
        return PageTable(*(t.to(device) for t in
                           (self.indices, self.row_start, self.row_count, self.last_page_len)))

    def validate(self, num_ids: int, page_size: int | None, *,
                 ids: str = "pool slots") -> None:
        """Check every value (reads the table on the host: one sync on CUDA).

        Args:
            num_ids: ids must lie in ``0..num_ids-1`` (pool slots, or metadata rows).
            page_size: checks ``last_page_len`` against it; None skips that check (scoring
                reads no tokens).
            ids: what the ids index, for the message.

        Raises:
            KernelInputError: naming the offending row, entry or id.
        """
        start, count = self.row_start.long().cpu(), self.row_count.long().cpu()
        last = self.last_page_len.long().cpu()
        idx = self.indices.long().cpu()
        if (count < 0).any():
            r = int(torch.nonzero(count < 0)[0])
            raise KernelInputError(
                f"page_table: row {r} has a negative page count {int(count[r])} "
                "(indptr must be non-decreasing; kv_lens must be >= 0).")
        if page_size is not None and (last < 0).any():
            r = int(torch.nonzero(last < 0)[0])
            raise KernelInputError(
                f"page_table: row {r} has a negative length {int(last[r])} "
                "(kv_lens and last_page_len must be >= 0).")
        outside = (start < 0) | (start + count > idx.numel())
        if outside.any():
            r = int(torch.nonzero(outside)[0])
            raise KernelInputError(
                f"page_table: row {r} spans entries [{int(start[r])}, {int(start[r] + count[r])}) "
                f"outside indices of length {idx.numel()}.")
        if page_size is not None:
            bad_last = ((count > 0) & ((last < 1) | (last > page_size))) | \
                ((count == 0) & (last != 0))
            if bad_last.any():
                r = int(torch.nonzero(bad_last)[0])
                raise KernelInputError(
                    f"page_table: last_page_len[{r}]={int(last[r])} is invalid: it must be in "
                    f"1..{page_size} for a row with pages and 0 for an empty row.")
        # entries covered by some row: +1 at each row's start, -1 past its end, prefix-summed
        cover = torch.zeros(idx.numel() + 1, dtype=torch.long)
        cover.index_add_(0, start, torch.ones_like(start))
        cover.index_add_(0, start + count, -torch.ones_like(start))
        bad = (cover.cumsum(0)[:-1] > 0) & ((idx < 0) | (idx >= num_ids))
        if bad.any():
            e = int(torch.nonzero(bad)[0])
            raise KernelInputError(
                f"page_table: page id {int(idx[e])} (indices[{e}]) is out of range for "
                f"{num_ids} {ids} (valid ids: 0..{num_ids - 1}).")

def check_paged_attention_args(
    q: object, kv_pool: object, page_table: object
) -> tuple[int, int, int, int]:
    """Checks shared by the attention ops: ``q [*, H_q, D]`` (rank 3), a pool of the same dtype,
    device and head dim, a :class:`PageTable` on that device, ``H_q % H_kv == 0``.

    Returns:
        ``(H_q, D, page_size, group)``.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_pool("kv_pool", kv_pool)
    if kv_pool.dtype != q.dtype:
        raise KernelInputError(
            f"q has dtype {q.dtype} but kv_pool has {kv_pool.dtype}; cast q to the pool's dtype."
        )
    if kv_pool.device != q.device:
        raise KernelInputError(f"kv_pool is on {kv_pool.device} but q is on {q.device}.")
    if not isinstance(page_table, PageTable):
        raise KernelInputError(
            "page_table must be a PageTable; build it with PageTable.from_csr(indptr, indices, "
            "last_page_len) or PageTable.from_padded(table, kv_lens, page_size)."
        )
    if page_table.device != q.device:
        raise KernelInputError(f"page_table is on {page_table.device} but q is on {q.device}.")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads, pool_dim = kv_pool.shape[2:]
    if pool_dim != head_dim:
        raise KernelInputError(f"q has head dim {head_dim} but kv_pool has {pool_dim}.")
    return num_q_heads, head_dim, page_size, check_gqa(num_q_heads, num_kv_heads)
