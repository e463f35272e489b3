"""Numerical test helpers shared by the test suite and the GPU check.

The error rule is flash-attention's: a kernel's error against a high-precision reference may be
at most twice the error of plain torch doing the same computation in the inputs' low precision,
plus a small floor that travels with the dtype.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from .page_table import PageTable

__all__ = [
    "ERROR_FLOOR", "RuleCheck", "check_rule", "csr_table", "margins_intact", "nan_like_empty",
    "red_zone", "seed_from",
]

#: absolute floor added to the rule, per input dtype (fp32 errors are rounding-level).
ERROR_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3, torch.float64: 1e-9}


@dataclass(frozen=True)
class RuleCheck:
    """Outcome of :func:`check_rule`: ``ratio <= 1`` passes."""

    err: float
    lowp_err: float
    floor: float

    @property
    def bound(self) -> float:
        return 2 * self.lowp_err + self.floor

    @property
    def ratio(self) -> float:
        return self.err / self.bound

    @property
    def ok(self) -> bool:
        return self.err <= self.bound

    def __str__(self) -> str:
        return (f"max|out-ref|={self.err:.3e} vs bound 2*{self.lowp_err:.3e}+{self.floor:.0e}"
                f" (ratio {self.ratio:.3f})")


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch {list(a.shape)} vs {list(b.shape)}")
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
    if diff.numel() == 0:
        return 0.0
    return float(torch.nan_to_num(diff, nan=float("inf")).max())


def check_rule(out: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor,
               dtype: torch.dtype) -> RuleCheck:
    """Compare ``out`` (kernel) and ``lowp`` (torch in low precision) against ``ref`` (fp64).

    Matching infinities count as equal; a NaN in ``out`` is an infinite error. A non-finite
    low-precision error (torch itself broke) gives no slack: the bound falls back to the floor.
    """
    lowp_err = _max_abs_diff(lowp, ref)
    if lowp_err == float("inf"):
        lowp_err = 0.0
    return RuleCheck(_max_abs_diff(out, ref), lowp_err, ERROR_FLOOR[dtype])


def seed_from(test_id: str, base: int = 0) -> int:
    """A seed derived from a test id (stable across runs and machines)."""
    return zlib.crc32(f"{base}:{test_id}".encode()) & 0x7FFFFFFF


_TORCH_EMPTY = torch.empty
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


#: allocations at least this large are left unfilled: they are address space a growing host
#: tier reserves (:class:`tierattn.storage.tiers.MemoryTier`), which filling would commit whole
POISON_LIMIT = 1 << 30


def nan_like_empty(*args, **kwargs) -> torch.Tensor:
    """``torch.empty`` that fills NaN (floats) or a sentinel (ints): unwritten memory shows."""
    t = _TORCH_EMPTY(*args, **kwargs)
    if t.numel() * t.element_size() >= POISON_LIMIT:
        return t
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool and not t.is_complex():
        t.fill_(-0x3FFFFFFF if t.dtype in (torch.int32, torch.int64) else 0x5A)
    return t


def red_zone(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
             margin: int = 7, fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor of ``shape`` living inside a larger buffer with ``fill`` margins on each side.

    Returns ``(view, buffer)``; after a kernel ran, :func:`margins_intact` checks the margins.
    """
    n = 1
    for s in shape:
        n *= s
    buf = _TORCH_EMPTY(n + 2 * margin, dtype=dtype, device=device)
    buf.fill_(fill)
    return buf[margin:margin + n].view(shape), buf


def margins_intact(buffer: torch.Tensor, view: torch.Tensor, fill: float = float("nan")) -> bool:
    """True when every element of ``buffer`` outside ``view`` still holds ``fill``, bitwise."""
    start = view.storage_offset() - buffer.storage_offset()
    outside = torch.cat([buffer[:start], buffer[start + view.numel():]])
    bits = _INT_VIEW[outside.element_size()]
    return bool(torch.equal(outside.view(bits), torch.full_like(outside, fill).view(bits)))


def csr_table(indptr: list[int], indices: list[int]):
    """A :class:`~tierattn.kernels.page_table.PageTable` of host lists, every last page 1 token
    (for the metadata kernels, which ignore ``last_page_len``; bad-input tests)."""
    i32 = torch.int32
    return PageTable.from_csr(torch.tensor(indptr, dtype=i32), torch.tensor(indices, dtype=i32),
                              torch.ones(len(indptr) - 1, dtype=i32))
