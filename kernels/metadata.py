"""Quest page metadata: element-wise min and max of a page's keys, per KV head.

Work split: one program per (page, KV head). The program streams the page's filled tokens in
tiles of ``BLOCK_T`` and keeps a running ``[D]`` min and max in fp32 (exact: fp16/bf16 values
are exact in fp32, and min/max only pick values), then stores them in the pool's dtype. Lanes
past the page's length are never read, so whatever an unfilled page tail holds (stale keys,
NaN) never reaches the metadata. A page is recomputed whole each time it is touched (the
runtime recomputes the last page as it fills), so no atomics are needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierattn.errors import KernelInputError

from ._common import Backend, INDEX_DTYPE, check_pool, check_tensor, next_pow2, resolve_backend

__all__ = ["page_metadata", "page_metadata_reference"]


@triton.jit
def _page_metadata_kernel(
    kv_ptr, slots_ptr, lens_ptr, rows_ptr, kmin_ptr, kmax_ptr,
    num_slots, num_meta, page_size, head_dim,
    stride_kv_slot, stride_kv_tok, stride_kv_head,
    stride_kmin_row, stride_kmin_head, stride_kmin_d,
    stride_kmax_row, stride_kmax_head, stride_kmax_d,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    b_slot = tl.load(slots_ptr + i_m).to(tl.int64)
    b_len = tl.load(lens_ptr + i_m).to(tl.int64)
    b_row = tl.load(rows_ptr + i_m).to(tl.int64)
    # an out-of-range slot or length reads nothing (the launcher's validate=True reports it)
    b_len = tl.minimum(tl.maximum(b_len, 0), page_size)
    b_len = tl.where((b_slot >= 0) & (b_slot < num_slots), b_len, 0)

    o_t = tl.arange(0, BLOCK_T).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_dim
    p_k = kv_ptr + b_slot * stride_kv_slot + i_h * stride_kv_head + o_d[None, :]  # [1, BD]

    b_min = tl.full([BLOCK_D], float("inf"), tl.float32)
    b_max = tl.full([BLOCK_D], float("-inf"), tl.float32)
    for t0 in range(0, b_len, BLOCK_T):
        m_t = (t0 + o_t) < b_len
        b_k = tl.load(p_k + (t0 + o_t)[:, None] * stride_kv_tok,
                      mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BT, BD]
        b_min = tl.minimum(b_min, tl.min(tl.where(m_t[:, None], b_k, float("inf")), axis=0))
        b_max = tl.maximum(b_max, tl.max(tl.where(m_t[:, None], b_k, float("-inf")), axis=0))
    # an empty page gets 0/0 (finite, so scoring it never makes NaN)
    b_min = tl.where(b_len > 0, b_min, 0.0)
    b_max = tl.where(b_len > 0, b_max, 0.0)

    # an out-of-range row writes nothing (a scalar & block mask breaks the interpreter)
    m_out = o_d < tl.where((b_row >= 0) & (b_row < num_meta), head_dim, 0)
    p_min = kmin_ptr + b_row * stride_kmin_row + i_h * stride_kmin_head + o_d * stride_kmin_d
    p_max = kmax_ptr + b_row * stride_kmax_row + i_h * stride_kmax_head + o_d * stride_kmax_d
    tl.store(p_min, b_min.to(kmin_ptr.dtype.element_ty), mask=m_out)
    tl.store(p_max, b_max.to(kmax_ptr.dtype.element_ty), mask=m_out)


def _check_index(name: str, t: object, length: int | None, device: torch.device) -> torch.Tensor:
    t = check_tensor(name, t, ndim=1, device=device)
    if t.dtype != INDEX_DTYPE:
        raise KernelInputError(f"{name} has dtype {t.dtype}; pass {name}.to(torch.int32).")
    if length is not None and t.numel() != length:
        raise KernelInputError(
            f"{name} has {t.numel()} entries but slots has {length}; pass one per page."
        )
    return t


def _check_metadata_inputs(kv_pool, slots, page_lens, kmin, kmax, rows, validate):
    check_pool("kv_pool", kv_pool)
    num_slots, _, page_size, hkv, d = kv_pool.shape
    slots = _check_index("slots", slots, None, kv_pool.device)
    page_lens = _check_index("page_lens", page_lens, slots.numel(), kv_pool.device)
    given = {"kmin": kmin is not None, "kmax": kmax is not None, "rows": rows is not None}
    if any(given.values()) and not all(given.values()):
        missing = ", ".join(k for k, v in given.items() if not v)
        raise KernelInputError(
            f"kmin, kmax and rows go together (in-place update); {missing} missing. Pass all "
            "three, or none to get fresh [M, H_kv, D] tensors."
        )
    if rows is not None:
        rows = _check_index("rows", rows, slots.numel(), kv_pool.device)
        check_tensor("kmin", kmin, ndim=3, dtypes=(kv_pool.dtype,), device=kv_pool.device)
        num_meta = kmin.shape[0]
        check_tensor("kmin", kmin, shape=[num_meta, hkv, d])
        check_tensor("kmax", kmax, shape=[num_meta, hkv, d], dtypes=(kv_pool.dtype,),
                     device=kv_pool.device)
        if kmin.data_ptr() == kmax.data_ptr() and kmin.numel() > 0:
            raise KernelInputError("kmin and kmax are the same buffer; pass two distinct buffers.")
    if validate:
        s, n = slots.long().cpu(), page_lens.long().cpu()
        bad = (s < 0) | (s >= num_slots)
        if bad.any():
            m = int(torch.nonzero(bad)[0])
            raise KernelInputError(
                f"slots[{m}]={int(s[m])} is out of range for kv_pool of {num_slots} slots "
                "(valid: 0..num_slots-1).")
        bad = (n < 0) | (n > page_size)
        if bad.any():
            m = int(torch.nonzero(bad)[0])
            raise KernelInputError(
                f"page_lens[{m}]={int(n[m])} is invalid: it must be in 0..{page_size} "
                "(the pool's page_size).")
        if rows is not None:
            r = rows.long().cpu()
            bad = (r < 0) | (r >= kmin.shape[0])
            if bad.any():
                m = int(torch.nonzero(bad)[0])
                raise KernelInputError(
                    f"rows[{m}]={int(r[m])} is out of range for kmin/kmax of {kmin.shape[0]} rows.")
            if torch.unique(r).numel() != r.numel():
                uniq, counts = torch.unique(r, return_counts=True)
                raise KernelInputError(
                    f"rows lists metadata row {int(uniq[counts > 1][0])} more than once; each "
                    "row may be written by one page per call.")
    return slots, page_lens, rows


def page_metadata_reference(
    kv_pool: torch.Tensor, slots: torch.Tensor, page_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`page_metadata`, one page at a time.

    Returns:
        ``(kmin, kmax)``, each ``[M, H_kv, D]`` in the pool's dtype (0 for empty pages).
    """
    _, _, _, hkv, d = kv_pool.shape
    m = slots.numel()
    kmin = torch.zeros(m, hkv, d, dtype=kv_pool.dtype, device=kv_pool.device)
    kmax = torch.zeros(m, hkv, d, dtype=kv_pool.dtype, device=kv_pool.device)
    for i, (slot, n) in enumerate(zip(slots.tolist(), page_lens.tolist())):
        if n > 0:
            keys = kv_pool[slot, 0, :n]  # [n, H_kv, D]
            kmin[i] = keys.amin(dim=0)
            kmax[i] = keys.amax(dim=0)
    return kmin, kmax


def page_metadata(
    kv_pool: torch.Tensor,
    slots: torch.Tensor,
    page_lens: torch.Tensor,
    *,
    kmin: torch.Tensor | None = None,
    kmax: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    validate: bool = True,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest metadata of pages: element-wise min and max of each page's filled keys.

    Args:
        kv_pool: ``[num_slots, 2, page_size, H_kv, D]``; keys (index 0 of dim 1) post-RoPE.
        slots: ``[M]`` int32 pool slots of the pages to (re)compute.
        page_lens: ``[M]`` int32 tokens filled in each page, ``0..page_size``; lanes past it are
            ignored whatever they hold.
        kmin: optional ``[num_meta, H_kv, D]`` buffer (pool dtype) updated in place.
        kmax: optional ``[num_meta, H_kv, D]`` buffer (pool dtype) updated in place.
        rows: ``[M]`` int32 rows of ``kmin``/``kmax`` to write (with the buffers only); rows not
            listed are left untouched.
        validate: check slots, lengths and rows on the host (one sync on CUDA); duplicate rows
            are an error. With False, out-of-range slots and lengths read nothing (empty page)
            and out-of-range rows are not written.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"``.

    Returns:
        ``(kmin, kmax)``: fresh ``[M, H_kv, D]`` tensors in the pool's dtype, or the given
        buffers. A page of length 0 gets ``kmin = kmax = 0``: its score is meaningless, so empty
        pages must not be scored.
    """
    slots, page_lens, rows = _check_metadata_inputs(kv_pool, slots, page_lens, kmin, kmax, rows,
                                                    validate)
    num_slots, _, page_size, hkv, d = kv_pool.shape
    m = slots.numel()
    if rows is None:
        kmin = torch.empty(m, hkv, d, dtype=kv_pool.dtype, device=kv_pool.device)
        kmax = torch.empty(m, hkv, d, dtype=kv_pool.dtype, device=kv_pool.device)
        rows = torch.arange(m, dtype=INDEX_DTYPE, device=kv_pool.device)

    if resolve_backend(backend, kv_pool) == "torch":
        # same masking as the kernel for unvalidated input: bad slots/lengths read nothing
        ok = (slots >= 0) & (slots < num_slots)
        lens = torch.where(ok, page_lens.clamp(0, page_size), 0)
        ref_min, ref_max = page_metadata_reference(kv_pool, torch.where(ok, slots, 0), lens)
        keep = (rows >= 0) & (rows < kmin.shape[0])
        kmin[rows[keep].long()] = ref_min[keep]
        kmax[rows[keep].long()] = ref_max[keep]
        return kmin, kmax

    block_d = next_pow2(d)
    # ~4K elements per tile keeps registers in check for big heads and long pages
    block_t = min(next_pow2(page_size), max(1, 4096 // block_d))
    if m > 0 and hkv > 0:
        _page_metadata_kernel[(m, hkv)](
            kv_pool, slots, page_lens, rows, kmin, kmax,
            num_slots, kmin.shape[0], page_size, d,
            kv_pool.stride(0), kv_pool.stride(2), kv_pool.stride(3),
            kmin.stride(0), kmin.stride(1), kmin.stride(2),
            kmax.stride(0), kmax.stride(1), kmax.stride(2),
            BLOCK_T=block_t, BLOCK_D=block_d,
        )
    return kmin, kmax
