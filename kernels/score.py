"""Quest page scoring: an upper bound of ``q . k`` over every key of a page, from its metadata.

For one query head and a page with element-wise key bounds ``kmin <= k <= kmax``, Quest's bound
is ``sum_d max(q_d * kmax_d, q_d * kmin_d)``, an upper bound of ``q . k`` for every key of the
page. The kernel computes it in that form, as a ``[G, BLOCK_E, D]`` broadcast and a tree sum over
``d`` (fp32 after the upcast; products of fp16/bf16 values are exact in fp32). The equivalent
two-``tl.dot`` form ``relu(q) . kmax + min(q, 0) . kmin`` was measured to lose the fp32 error
rule at ``D = 256`` (sequential accumulation), and the op is memory-bound anyway.

Work split: one program per (sequence, KV head, split). The program loads the ``G = H_q/H_kv``
query heads of its group once, then streams its share of the row's entries in tiles of
``BLOCK_E`` metadata rows, so each metadata row is read once per group. The ``G`` per-head bounds
are reduced to one score per (entry, KV head) with ``max`` or ``sum``. Entries outside every row
are set to ``-inf`` before the launch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tierattn.errors import KernelInputError

from ._common import (
    check_num_splits,
    Backend,
    FLOAT_DTYPES,
    check_gqa,
    check_head_dim,
    check_out,
    check_tensor,
    next_pow2,
    resolve_backend,
)
from .tuning import check_config, resolve_config
from .page_table import PageTable

__all__ = ["quest_score", "quest_score_reference", "auto_score_splits", "GROUP_REDUCES"]

#: ways to turn the G per-query-head bounds of a KV head into one score.
GROUP_REDUCES = ("max", "sum")
#: most metadata rows per tile; fewer when ``G * D`` is large.
MAX_BLOCK_E = 64
#: target size of the ``[G, BLOCK_E, D]`` product tile (registers on GPU).
TILE_ELEMENTS = 8192
#: fewest entries (pages) of a row that "auto" gives one split.
ENTRIES_PER_SPLIT = 256
#: largest split count "auto" picks; explicit counts may be larger.
MAX_AUTO_SPLITS = 32


@triton.jit
def _quest_score_kernel(
    q_ptr, kmin_ptr, kmax_ptr, indices_ptr, row_start_ptr, row_count_ptr, out_ptr,
    num_meta, group, head_dim,
    stride_qb, stride_qh, stride_qd,
    stride_kmin_row, stride_kmin_head, stride_kmin_d,
    stride_kmax_row, stride_kmax_head, stride_kmax_d,
    stride_out_e, stride_out_h,
    GROUP_SUM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2).to(tl.int64)
    num_splits = tl.num_programs(2)

    row_start = tl.load(row_start_ptr + i_b).to(tl.int64)
    row_count = tl.load(row_count_ptr + i_b).to(tl.int64)
    per_split = tl.cdiv(row_count, num_splits)
    e_begin = i_s * per_split
    e_end = tl.minimum(e_begin + per_split, row_count)

    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    o_e = tl.arange(0, BLOCK_E)
    m_g = o_g < group
    m_d = o_d < head_dim
    o_qh = i_h * group + o_g  # [BLOCK_G] query heads of this group

    p_q = q_ptr + i_b * stride_qb + o_qh[:, None] * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BG, BD]

    for e0 in range(e_begin, e_end, BLOCK_E):
        m_e = (e0 + o_e) < e_end
        b_id = tl.load(indices_ptr + row_start + e0 + o_e, mask=m_e, other=0).to(tl.int64)
        # an out-of-range metadata row reads nothing and scores -inf (validate=True reports it)
        m_id = m_e & (b_id >= 0) & (b_id < num_meta)
        m_k = m_id[:, None] & m_d[None, :]
        p_kmin = kmin_ptr + b_id[:, None] * stride_kmin_row + i_h * stride_kmin_head \
            + o_d[None, :] * stride_kmin_d
        p_kmax = kmax_ptr + b_id[:, None] * stride_kmax_row + i_h * stride_kmax_head \
            + o_d[None, :] * stride_kmax_d
        b_kmin = tl.load(p_kmin, mask=m_k, other=0.0).to(tl.float32)  # [BE, BD]
        b_kmax = tl.load(p_kmax, mask=m_k, other=0.0).to(tl.float32)  # [BE, BD]

        b_hi = b_q[:, None, :] * b_kmax[None, :, :]  # [BG, BE, BD]
        b_lo = b_q[:, None, :] * b_kmin[None, :, :]  # [BG, BE, BD]
        b_s = tl.sum(tl.maximum(b_hi, b_lo), axis=2)  # [BG, BE]
        if GROUP_SUM:
            b_score = tl.sum(tl.where(m_g[:, None], b_s, 0.0), axis=0)  # [BE]
        else:
            b_score = tl.max(tl.where(m_g[:, None], b_s, float("-inf")), axis=0)  # [BE]
        b_score = tl.where(m_id, b_score, float("-inf"))
        p_out = out_ptr + (row_start + e0 + o_e) * stride_out_e + i_h * stride_out_h
        tl.store(p_out, b_score, mask=m_e)


def _default_config(group: int, head_dim: int) -> dict[str, int]:
    """Launch parameters of an untuned call: a ``[G, BLOCK_E, D]`` tile of ~TILE_ELEMENTS."""
    tile = next_pow2(group) * next_pow2(head_dim)
    return {"block_e": max(2, min(MAX_BLOCK_E, TILE_ELEMENTS // tile))}


def _key_sizes(q: torch.Tensor, kmin: torch.Tensor, page_table: PageTable) -> dict:
    """Sizes of the tuned-table key (:func:`.tuning.bucket_key`), from host-known shapes."""
    batch, hq, d = q.shape
    hkv = kmin.shape[1]
    return dict(d=d, group=hq // hkv, dtype=q.dtype,
                entries=page_table.indices.numel() // max(1, batch), rows=batch * hkv)


def auto_score_splits(batch: int, num_kv_heads: int, nnz: int, device: torch.device) -> int:
    """Split count that fills the GPU while keeping >= ``ENTRIES_PER_SPLIT`` entries per split.

    Uses only host-known sizes (no sync). On CPU it returns 1.
    """
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = math.ceil(2 * sms / max(1, batch * num_kv_heads))
    longest_useful = max(1, math.ceil(nnz / max(1, batch) / ENTRIES_PER_SPLIT))
    return max(1, min(want, longest_useful, MAX_AUTO_SPLITS))


def check_metadata_inputs(who: str, q, kmin, kmax, page_table):
    """The inputs every metadata scorer shares (``quest_score``, ``sketch_score``): a decode
    query ``q [B, H_q, D]``, per-row ranges ``kmin``/``kmax [num_meta, H_kv, D]`` and a page
    table with one row per sequence listing metadata rows. Returns
    ``(batch, H_q, D, num_meta, H_kv, group)``."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("kmin", kmin, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("kmax", kmax, ndim=3, dtypes=(q.dtype,), device=q.device)
    if kmin.shape != kmax.shape:
        raise KernelInputError(
            f"kmin has shape {list(kmin.shape)} but kmax has {list(kmax.shape)}; both are "
            "[num_meta, H_kv, D].")
    batch, hq, d = q.shape
    num_meta, hkv, meta_d = kmin.shape
    check_head_dim("q", d)
    if meta_d != d:
        raise KernelInputError(f"q has head dim {d} but kmin/kmax have {meta_d}.")
    group = check_gqa(hq, hkv)
    if not isinstance(page_table, PageTable):
        raise KernelInputError(
            "page_table must be a PageTable whose indices are metadata rows; build it with "
            "PageTable.from_csr(indptr, indices, last_page_len) or PageTable.from_padded(...).")
    if page_table.device != q.device:
        raise KernelInputError(f"page_table is on {page_table.device} but q is on {q.device}.")
    if page_table.num_rows != batch:
        raise KernelInputError(
            f"page_table has {page_table.num_rows} rows; {who} needs one per sequence "
            f"(B={batch}).")
    return batch, hq, d, num_meta, hkv, group


def _check_score_inputs(q, kmin, kmax, page_table, group_reduce):
    shapes = check_metadata_inputs("quest_score", q, kmin, kmax, page_table)
    if group_reduce not in GROUP_REDUCES:
        raise KernelInputError(
            f"group_reduce={group_reduce!r} is not one of {GROUP_REDUCES}.")
    return shapes


def quest_score_reference(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: PageTable,
    *,
    group_reduce: str = "max",
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`quest_score`, one row at a time, in the max-of-products form.

    Computes in ``compute_dtype`` (default: fp32, or fp64 for fp64 inputs) and returns
    ``[nnz, H_kv]`` of that dtype (``-inf`` for entries outside every row).
    """
    batch, hq, d = q.shape
    hkv = kmin.shape[1]
    group = hq // hkv
    dt = compute_dtype or torch.promote_types(q.dtype, torch.float32)
    out = torch.full((page_table.indices.numel(), hkv), float("-inf"), dtype=dt, device=q.device)
    starts, counts = page_table.row_start.tolist(), page_table.row_count.tolist()
    for b, (start, count) in enumerate(zip(starts, counts)):
        if count == 0:
            continue
        ids = page_table.indices[start:start + count].long()
        qb = q[b].to(dt).reshape(1, hkv, group, d)
        lo = kmin[ids].to(dt).unsqueeze(2)  # [n, H_kv, 1, D]
        hi = kmax[ids].to(dt).unsqueeze(2)
        bound = torch.maximum(qb * hi, qb * lo).sum(dim=-1)  # [n, H_kv, G]
        if group_reduce == "max":
            out[start:start + count] = bound.amax(dim=-1)
        else:
            out[start:start + count] = bound.sum(dim=-1)
    return out


def quest_score(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: PageTable,
    *,
    group_reduce: str = "max",
    num_splits: int | str = "auto",
    out: torch.Tensor | None = None,
    validate: bool = True,
    config: dict[str, int] | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Quest upper bound of ``q . k`` per (sequence, page, KV head), from page metadata.

    For each entry of a row (a metadata row ``p``) and KV head ``h``, the per-query-head bound
    ``sum_d max(q_d * kmax[p, h, d], q_d * kmin[p, h, d])`` is at least ``q . k`` for every key
    the metadata covers; the ``G = H_q/H_kv`` query heads of the group are reduced to one score
    so that one page selection serves the whole group. Scores are raw dot products: no
    ``sm_scale`` and no softcap are applied (both are monotonic, so a top-k picks the same
    pages). Empty pages (``kmin = kmax = 0``) score 0: do not list them.

    Args:
        q: ``[B, H_q, D]`` decode query (post-RoPE), fp16/bf16/fp32.
        kmin: ``[num_meta, H_kv, D]`` per-page key minima (same dtype as ``q``), e.g. from
            :func:`~tierattn.kernels.metadata.page_metadata`.
        kmax: ``[num_meta, H_kv, D]`` per-page key maxima, ``kmax >= kmin``.
        page_table: one row per sequence (``R = B``) whose ``indices`` are metadata rows (not
            pool slots). ``last_page_len`` is not read: a page's fill is already in its
            metadata.
        group_reduce: ``"max"`` (default: the page may matter to any head of the group) or
            ``"sum"`` over the group's query heads.
        num_splits: programs per (sequence, KV head) sharing a row's entries, an int >= 1 or
            ``"auto"`` (host sizes only, no sync); results do not depend on it.
        out: optional ``[nnz, H_kv]`` fp32 buffer.
        validate: check that every row's entries lie inside ``indices`` and every listed id is
            in ``0..num_meta-1`` (one host sync on CUDA). With False, out-of-range ids read
            nothing and score ``-inf``.
        config: explicit launch parameters ``block_e`` (metadata rows per tile) and
            ``num_warps`` (see :mod:`.tuning`); without it, CUDA launches use the tuned table
            and fall back to ``BLOCK_E`` from ``TILE_ELEMENTS``.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (the reference, in fp32).

    Returns:
        ``[nnz, H_kv]`` fp32 scores aligned with ``page_table.indices``; entries that belong to
        no row are ``-inf``, so a top-k never picks them.
    """
    batch, hq, d, num_meta, hkv, group = _check_score_inputs(q, kmin, kmax, page_table,
                                                            group_reduce)
    splits = check_num_splits(num_splits)
    config = check_config("score", config)
    nnz = page_table.indices.numel()
    out = check_out("out", out, (nnz, hkv), torch.float32, q.device)
    if validate:
        # scoring reads metadata rows, not pool slots, and no tokens: no last_page_len check
        page_table.validate(num_meta, None, ids="metadata rows of kmin/kmax")

    if resolve_backend(backend, q, kmin, kmax) == "torch":
        # same masking as the kernel for unvalidated ids: they read nothing and score -inf
        ids = page_table.indices
        bad = (ids < 0) | (ids >= num_meta)
        table = PageTable(torch.where(bad, 0, ids), page_table.row_start, page_table.row_count,
                          page_table.last_page_len)
        ref = quest_score_reference(q, kmin, kmax, table, group_reduce=group_reduce,
                                    compute_dtype=torch.float32)
        out.copy_(ref.masked_fill_(bad[:, None], float("-inf")))
        return out

    out.fill_(float("-inf"))
    if splits is None:
        splits = auto_score_splits(batch, hkv, nnz, q.device)
    cfg = resolve_config("score", q.device, _default_config(group, d), config,
                         _key_sizes(q, kmin, page_table))
    if batch > 0 and hkv > 0 and nnz > 0:
        _quest_score_kernel[(batch, hkv, splits)](
            q, kmin, kmax, page_table.indices, page_table.row_start, page_table.row_count, out,
            num_meta, group, d,
            q.stride(0), q.stride(1), q.stride(2),
            kmin.stride(0), kmin.stride(1), kmin.stride(2),
            kmax.stride(0), kmax.stride(1), kmax.stride(2),
            out.stride(0), out.stride(1),
            GROUP_SUM=group_reduce == "sum", BLOCK_E=cfg["block_e"], BLOCK_G=next_pow2(group),
            BLOCK_D=next_pow2(d), **({"num_warps": cfg["num_warps"]} if "num_warps" in cfg else {}),
        )
    return out
