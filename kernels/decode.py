"""Sparse paged decode: flash-decoding of one query token over a selected list of KV pages.

Work split: one program per (sequence, KV head, split). The program loads the ``G = H_q/H_kv``
query heads of its group once and streams its share of the row's pages, so each KV page is read
once per group (GQA packing). A tile holds ``NP`` whole pages, each padded to ``P_PAD`` lanes, so
page boundaries never cross tiles and any page size works. Splits write partial states that
:mod:`.merge` combines (split-K). The per-page attention mass is exact across splits because each
program stores the page's own log-sum-exp and the mass is formed only after the final LSE is
known: ``mass(page) = sum_g exp(page_lse_g - lse_g)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tierattn.errors import KernelInputError

from ._common import (
    check_num_splits,
    _softcap,
    Backend,
    check_gqa,
    check_out,
    check_sm_scale,
    check_softcap,
    check_tensor,
    default_tiles,
    dot_precision,
    next_pow2,
    resolve_backend,
)
from .tuning import check_config, resolve_config
from .merge import _merge_kernel
from .page_table import PageTable, check_paged_attention_args

__all__ = [
    "DecodeOutput",
    "auto_num_splits",
    "decode_page_mass",
    "merge_page_mass",
    "merge_page_mass_reference",
    "sparse_decode",
    "sparse_decode_reference",
]

#: largest split count "auto" picks; explicit counts may be larger.
MAX_AUTO_SPLITS = 16


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, indices_ptr, row_start_ptr, row_count_ptr, last_len_ptr, first_lane_ptr,
    part_o_ptr, part_lse_ptr, page_lse_ptr, lse_index_ptr,
    num_slots, page_size, group, head_dim, num_kv_heads, sm_scale,
    stride_qb, stride_qh,
    stride_kv_slot, stride_kv_kv, stride_kv_tok, stride_kv_head,
    stride_po_s, stride_po_b, stride_po_h,
    stride_pl_s, stride_pl_b,
    stride_pg_e,
    HEAD_ROWS: tl.constexpr, RETURN_MASS: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_FIRST_LANE: tl.constexpr, HAS_LSE_INDEX: tl.constexpr,
    P_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2).to(tl.int64)
    num_splits = tl.num_programs(2)
    NP: tl.constexpr = BLOCK_N // P_PAD

    i_row = i_b * num_kv_heads + i_h if HEAD_ROWS else i_b
    row_start = tl.load(row_start_ptr + i_row).to(tl.int64)
    row_count = tl.load(row_count_ptr + i_row).to(tl.int64)
    last_len = tl.load(last_len_ptr + i_row).to(tl.int64)
    per_split = tl.cdiv(row_count, num_splits)
    e_begin = i_s * per_split
    e_end = tl.minimum(e_begin + per_split, row_count)

    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    o_page = o_n // P_PAD  # [BLOCK_N] page of each lane within the tile
    o_lane = (o_n % P_PAD).to(tl.int64)  # [BLOCK_N] token of each lane within its page
    m_g = o_g < group
    m_d = o_d < head_dim
    o_qh = i_h * group + o_g  # [BLOCK_G] query heads of this group

    p_q = q_ptr + i_b * stride_qb + o_qh[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BG, BD]

    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    for e0 in range(e_begin, e_end, NP):
        o_e = e0 + o_page  # [BLOCK_N] entry (within the row) of each lane
        m_e = o_e < e_end
        b_slot = tl.load(indices_ptr + row_start + o_e, mask=m_e, other=0).to(tl.int64)
        # an out-of-range page id reads nothing (the launcher's validate=True reports it)
        m_e = m_e & (b_slot >= 0) & (b_slot < num_slots)
        m_n = m_e & (o_lane < page_size) & ((o_e != row_count - 1) | (o_lane < last_len))
        if HAS_FIRST_LANE:  # tokens before an entry's first lane are padding
            b_first = tl.load(first_lane_ptr + row_start + o_e, mask=m_e, other=0)
            m_n = m_n & (o_lane >= b_first)
        o_kv = b_slot * stride_kv_slot + o_lane * stride_kv_tok + i_h * stride_kv_head  # [BN]
        p_k = kv_ptr + o_kv[:, None] + o_d[None, :]
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(p_k, mask=m_kv, other=0.0).to(tl.float32)  # [BN, BD]
        b_v = tl.load(p_k + stride_kv_kv, mask=m_kv, other=0.0).to(tl.float32)  # [BN, BD]

        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
        b_s = b_s * sm_scale  # [BG, BN]
        if SOFTCAP > 0:
            b_s = _softcap(b_s, SOFTCAP)
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))

        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        # a row that saw only masked keys keeps max -inf: shift by 0, never exp(-inf - -inf)
        b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp(b_m - b_shift)
        b_p = tl.exp(b_s - b_shift[:, None])  # [BG, BN]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new

        if RETURN_MASS:
            b_s3 = tl.reshape(b_s, (BLOCK_G, NP, P_PAD))
            b_pm = tl.max(b_s3, axis=2)  # [BG, NP]
            b_pm_shift = tl.where(b_pm == float("-inf"), 0.0, b_pm)
            b_ps = tl.sum(tl.exp(b_s3 - b_pm_shift[:, :, None]), axis=2)
            b_ps_safe = tl.where(b_ps > 0, b_ps, 1.0)
            b_page_lse = tl.where(b_ps > 0, b_pm_shift + tl.log(b_ps_safe), float("-inf"))
            o_pe = e0 + tl.arange(0, NP)  # [NP]
            m_pe = o_pe < e_end
            # page_lse rows: the entry itself, or the row lse_index names (scattered by page)
            if HAS_LSE_INDEX:
                o_dst = tl.load(lse_index_ptr + row_start + o_pe, mask=m_pe, other=0).to(tl.int64)
            else:
                o_dst = row_start + o_pe
            # page_lse columns: the group's query heads (per-head rows) or all query heads
            o_col = o_g if HEAD_ROWS else o_qh
            p_pl = page_lse_ptr + o_dst[None, :] * stride_pg_e + o_col[:, None]
            tl.store(p_pl, b_page_lse, mask=m_g[:, None] & m_pe[None, :])

    b_out = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    b_lse = tl.where(b_l > 0, b_m + tl.log(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
    p_po = part_o_ptr + i_s * stride_po_s + i_b * stride_po_b + o_qh[:, None] * stride_po_h
    tl.store(p_po + o_d[None, :], b_out, mask=m_g[:, None] & m_d[None, :])
    tl.store(part_lse_ptr + i_s * stride_pl_s + i_b * stride_pl_b + o_qh, b_lse, mask=m_g)


@triton.jit
def _decode_mass_kernel(
    lse_ptr, row_start_ptr, row_count_ptr, page_lse_ptr, mass_ptr,
    group, num_kv_heads,
    stride_lb, stride_pg_e, stride_mass_e,
    HEAD_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
):
    # mass[entry, head] = sum over the group's query heads of exp(page_lse - lse)
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_row = i_b * num_kv_heads + i_h if HEAD_ROWS else i_b
    row_start = tl.load(row_start_ptr + i_row).to(tl.int64)
    row_count = tl.load(row_count_ptr + i_row).to(tl.int64)
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < group
    o_qh = i_h * group + o_g
    b_lse = tl.load(lse_ptr + i_b * stride_lb + o_qh, mask=m_g, other=float("-inf"))
    b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)  # empty row: mass 0
    o_col = o_g if HEAD_ROWS else o_qh
    for e0 in range(0, row_count, BLOCK_E):
        o_e = e0 + tl.arange(0, BLOCK_E)
        m_e = o_e < row_count
        p_pl = page_lse_ptr + (row_start + o_e)[:, None] * stride_pg_e + o_col[None, :]
        b_pl = tl.load(p_pl, mask=m_e[:, None] & m_g[None, :], other=float("-inf"))
        b_mass = tl.sum(tl.exp(b_pl - b_lse[None, :]), axis=1)  # [BLOCK_E]
        o_m = (row_start + o_e) * stride_mass_e + (0 if HEAD_ROWS else i_h)
        tl.store(mass_ptr + o_m, b_mass, mask=m_e)


@dataclass(frozen=True)
class DecodeOutput:
    """Result of :func:`sparse_decode`.

    Attributes:
        out: ``[B, H_q, D]`` fp32 attention output over the selected pages.
        lse: ``[B, H_q]`` fp32 natural-log LSE of the scaled scores (``-inf`` for no keys).
        page_mass: ``[nnz, H_kv]`` fp32 (rows per sequence) or ``[nnz]`` (rows per
            (sequence, KV head)), aligned with ``page_table.indices``: softmax probability summed
            over the page's tokens and the group's query heads (sums to ``G`` per row and KV
            head). ``None`` unless requested; entries outside every row are 0.
        page_lse: ``[nnz, H_q]`` (rows per sequence) or ``[nnz, G]`` (rows per (sequence, KV
            head)) fp32 log-sum-exp of each page's scores per query head (``-inf`` outside every
            row), returned with ``page_mass``. :func:`decode_page_mass` turns it into the mass
            under another LSE, e.g. the merged LSE of several partial states.
    """

    out: torch.Tensor
    lse: torch.Tensor
    page_mass: torch.Tensor | None = None
    page_lse: torch.Tensor | None = None


def auto_num_splits(num_programs: int, avg_pages: float, page_size: int,
                    device: torch.device) -> int:
    """Split count that fills the GPU without making splits shorter than ~256 tokens.

    Uses only host-known sizes (no sync). On CPU it returns 1.
    """
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = math.ceil(2 * sms / max(1, num_programs))
    longest_useful = max(1, math.ceil(avg_pages * page_size / 256))
    return max(1, min(want, longest_useful, MAX_AUTO_SPLITS))


def _default_config(head_dim: int) -> dict[str, int]:
    """Launch parameters of an untuned call (Triton's own default ``num_stages``)."""
    block_n, num_warps = default_tiles(head_dim)
    return {"block_n": block_n, "num_warps": num_warps}


def _key_sizes(q: torch.Tensor, kv_pool: torch.Tensor, page_table: PageTable) -> dict:
    """Sizes of the tuned-table key (:func:`.tuning.bucket_key`), from host-known shapes."""
    batch, hq, d = q.shape
    page_size, hkv = kv_pool.shape[2], kv_pool.shape[3]
    ctx = page_table.indices.numel() * page_size // max(1, page_table.num_rows)
    return dict(d=d, group=hq // hkv, page_size=page_size, dtype=q.dtype, ctx=ctx,
                rows=batch * hkv)


def _check_decode_inputs(q, kv_pool, page_table):
    hq, d, page_size, group = check_paged_attention_args(q, kv_pool, page_table)
    batch, num_kv_heads = q.shape[0], kv_pool.shape[3]
    rows = page_table.num_rows
    if rows not in (batch, batch * num_kv_heads):
        raise KernelInputError(
            f"page_table has {rows} rows; expected B={batch} (one page list per sequence) or "
            f"B*H_kv={batch * num_kv_heads} (one per sequence and KV head)."
        )
    return batch, hq, d, page_size, num_kv_heads, group, rows != batch


def sparse_decode_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: PageTable,
    *,
    sm_scale: float | None = None,
    softcap: float | None = None,
    return_page_mass: bool = False,
    compute_dtype: torch.dtype | None = None,
    first_lane: torch.Tensor | None = None,
    page_lse: torch.Tensor | None = None,
    page_lse_index: torch.Tensor | None = None,
) -> DecodeOutput:
    """Plain-torch :func:`sparse_decode`, one row at a time: gather, softmax, weighted sum.

    Computes in ``compute_dtype`` (default: fp32, or fp64 for fp64 inputs) and returns tensors
    of that dtype. With ``page_lse``/``page_lse_index`` it writes each entry's page LSE into
    ``page_lse[page_lse_index[e]]`` and returns no mass (see :func:`sparse_decode`).
    """
    batch, hq, d = q.shape
    _, _, page_size, hkv, _ = kv_pool.shape
    group = hq // hkv
    head_rows = page_table.num_rows != batch
    dt = compute_dtype or torch.promote_types(q.dtype, torch.float32)
    scale = check_sm_scale(sm_scale, d)
    cap = check_softcap(softcap)
    out = torch.zeros(batch, hq, d, dtype=dt, device=q.device)
    lse = torch.full((batch, hq), float("-inf"), dtype=dt, device=q.device)
    nnz = page_table.indices.numel()
    mass = torch.zeros((nnz,) if head_rows else (nnz, hkv), dtype=dt, device=q.device)
    scatter = page_lse
    page_lse = torch.full((nnz, group if head_rows else hq), float("-inf"), dtype=dt,
                          device=q.device)
    starts, counts = page_table.row_start.tolist(), page_table.row_count.tolist()
    lasts = page_table.last_page_len.tolist()
    for r, (start, count, last) in enumerate(zip(starts, counts, lasts)):
        if count == 0:
            continue
        b, heads = (r // hkv, [r % hkv]) if head_rows else (r, range(hkv))
        slots = page_table.indices[start:start + count].long()
        n_tok = (count - 1) * page_size + last
        keys = kv_pool[slots, 0].to(dt).reshape(count * page_size, hkv, d)[:n_tok]
        values = kv_pool[slots, 1].to(dt).reshape(count * page_size, hkv, d)[:n_tok]
        valid = torch.ones(n_tok, dtype=torch.bool, device=q.device)
        if first_lane is not None:  # left padding: lanes before first_lane[e] are masked
            lane = torch.arange(count * page_size, device=q.device) % page_size
            first = first_lane[start:start + count].long().repeat_interleave(page_size)
            valid = (lane >= first)[:n_tok]
        for h in heads:
            qh = slice(h * group, (h + 1) * group)
            s = (q[b, qh].to(dt) @ keys[:, h].T) * scale  # [G, n_tok]
            if cap:
                s = cap * torch.tanh(s / cap)
            s = s.masked_fill(~valid, float("-inf"))
            row_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - torch.where(torch.isinf(row_lse), 0, row_lse)[:, None])
            out[b, qh] = p @ torch.where(valid[:, None], values[:, h], 0)
            lse[b, qh] = row_lse
            per_page = torch.nn.functional.pad(p, (0, count * page_size - n_tok))
            page_mass = per_page.reshape(group, count, page_size).sum(dim=(0, 2))
            s_pages = torch.nn.functional.pad(s, (0, count * page_size - n_tok),
                                              value=float("-inf"))
            plse = torch.logsumexp(s_pages.reshape(group, count, page_size), dim=-1).T
            if head_rows:
                mass[start:start + count] = page_mass
                page_lse[start:start + count] = plse
            else:
                mass[start:start + count, h] = page_mass
                page_lse[start:start + count, qh] = plse
    if scatter is not None:  # every entry's page LSE, scattered to the rows the caller chose
        counts = page_table.row_count.long()
        entry = torch.arange(nnz, device=q.device)
        start = page_table.row_start.long()
        covered = ((entry[None, :] >= start[:, None]) &
                   (entry[None, :] < (start + counts)[:, None])).any(0)
        scatter[page_lse_index.long()[covered]] = page_lse[covered].to(scatter.dtype)
        return DecodeOutput(out, lse, None, scatter)
    if not return_page_mass:
        return DecodeOutput(out, lse)
    return DecodeOutput(out, lse, mass, page_lse)


def _sparse_decode_torch(q, kv_pool, page_table, *, scale, cap, first_lane):
    """The torch backend of :func:`sparse_decode`: every entry at once, in fp32, with no host
    read and no loop over rows (the reference's per-row loop costs a host sync and a dozen
    launches per row and head). Each entry's scores give its page LSE; a row's LSE is the
    log-sum-exp of its entries' (scatter max, then sum), and its output the entries' outputs
    weighted by ``exp(page_lse - row_lse)``.

    Returns ``(out [B, H_q, D], lse [B, H_q], mass, page_lse, listed)`` with ``mass``
    ``[nnz, H_kv]`` and ``page_lse`` ``[nnz, H_q]`` (``[nnz]`` and ``[nnz, G]`` for rows per KV
    head), ``listed [nnz]`` whether an entry belongs to a row (:meth:`PageTable.entry_rows`).
    """
    batch, hq, d = q.shape
    page_size, hkv = kv_pool.shape[2], kv_pool.shape[3]
    group, dev, neg = hq // hkv, q.device, float("-inf")
    num_rows = page_table.num_rows
    head_rows = num_rows != batch
    ids = page_table.indices.long()
    nnz = ids.numel()
    entry = torch.arange(nnz, device=dev)
    start, count = page_table.row_start.long(), page_table.row_count.long()
    row, in_row = page_table.entry_rows()  # an entry of no row is masked out
    lane = torch.arange(page_size, device=dev)
    lanes = torch.where(entry == (start + count - 1)[row], page_table.last_page_len.long()[row],
                        page_size)
    valid = (lane[None, :] < lanes[:, None]) & in_row[:, None]  # [nnz, P]
    if first_lane is not None:  # left padding: lanes before first_lane[e] are masked
        valid &= lane[None, :] >= first_lane.long()[:, None]
    kv = kv_pool[torch.where(in_row, ids, 0)].float()  # [nnz, 2, P, H_kv, D]
    seq = row // hkv if head_rows else row
    s = torch.einsum("nhgd,nphd->nhgp", q.float()[seq].view(nnz, hkv, group, d), kv[:, 0])
    s = s.mul_(scale)
    if cap:
        s = s.div_(cap).tanh_().mul_(cap)
    s = s.masked_fill_(~valid[:, None, None, :], neg)  # [nnz, H_kv, G, P]
    page_lse = s.logsumexp(-1)  # [nnz, H_kv, G]
    idx = row[:, None, None].expand_as(page_lse)
    top = torch.full((num_rows, hkv, group), neg, device=dev).scatter_reduce_(
        0, idx, page_lse, "amax")
    top = torch.where(torch.isinf(top), 0.0, top)
    total = torch.zeros(num_rows, hkv, group, device=dev).index_add_(
        0, row, torch.exp(page_lse - top[row]))
    row_lse = top + total.log()  # -inf for a row that sees no key
    share = torch.exp(page_lse - torch.where(torch.isinf(row_lse), 0.0, row_lse)[row])
    p = torch.exp(s - torch.where(torch.isinf(page_lse), 0.0, page_lse)[..., None])
    values = torch.where(valid[:, :, None, None], kv[:, 1], 0.0)  # masked lanes may be garbage
    o = torch.einsum("nhgp,nphd->nhgd", p, values) * share[..., None]
    out_rows = torch.zeros(num_rows, hkv, group, d, device=dev).index_add_(0, row, o)
    if not head_rows:
        return (out_rows.view(batch, hq, d), row_lse.view(batch, hq), share.sum(-1),
                page_lse.view(nnz, hq), in_row)
    heads = torch.arange(num_rows, device=dev) % hkv  # row b * H_kv + h holds head h only
    out = out_rows[torch.arange(num_rows, device=dev), heads].view(batch, hq, d)
    lse = row_lse[torch.arange(num_rows, device=dev), heads].view(batch, hq)
    mine = (row % hkv)[:, None, None].expand(nnz, 1, group)
    return (out, lse, share.gather(1, mine).sum(-1).view(nnz),
            page_lse.gather(1, mine).view(nnz, group), in_row)


def sparse_decode(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: PageTable,
    *,
    sm_scale: float | None = None,
    softcap: float | None = None,
    num_splits: int | str | None = "auto",
    return_page_mass: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    validate: bool = True,
    block_n: int | None = None,
    first_lane: torch.Tensor | None = None,
    page_lse: torch.Tensor | None = None,
    page_lse_index: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    backend: Backend | None = None,
) -> DecodeOutput:
    """Decode attention of one query token per sequence over a page list drawn from a pool.

    Args:
        q: ``[B, H_q, D]`` query (post-RoPE), fp16/bf16/fp32, same dtype as the pool.
        kv_pool: ``[num_slots, 2, page_size, H_kv, D]``: K (index 0) and V (index 1) of a page.
        page_table: rows per sequence (``R = B``) or per (sequence, KV head) (``R = B*H_kv``,
            row ``b*H_kv + h``); only a row's last entry may be partly filled.
        sm_scale: score scale (default ``D ** -0.5``).
        softcap: optional logit softcap ``c``: scores become ``c * tanh(s / c)``.
        num_splits: split-K count, an int >= 1 or ``"auto"`` (host sizes only, no sync).
        return_page_mass: also return the per-entry attention mass.
        out: optional ``[B, H_q, D]`` fp32 output buffer.
        lse: optional ``[B, H_q]`` fp32 LSE buffer.
        validate: check every page id and length on the host (one sync on CUDA); the runtime,
            which builds its own tables, passes False. Kernels mask out-of-range ids either way.
        block_n: tokens per tile (power of two; raised to the padded page size if smaller;
            default: the tuned table's on CUDA, else 64, or 32 for head dims above 128).
        first_lane: optional ``[nnz]`` int32: the tokens of entry ``e`` before lane
            ``first_lane[e]`` are masked (left padding); 0 masks nothing.
        page_lse: optional ``[N, H_q]`` fp32 buffer (rows per sequence only): each entry's
            page LSE (per query head) is written to row ``page_lse_index[e]``; other rows are
            left as they are. A runtime that attends several page lists of one sequence
            scatters them by logical page into one buffer and forms the page mass once under
            the merged LSE (:func:`decode_page_mass`). Excludes ``return_page_mass``.
        page_lse_index: ``[nnz]`` int32 destination rows in ``page_lse`` (distinct within the
            table's rows), given with ``page_lse``.
        config: explicit launch parameters ``block_n``, ``num_warps``, ``num_stages`` (see
            :mod:`.tuning`); with it or ``block_n`` the tuned table is not consulted.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"``.

    Returns:
        :class:`DecodeOutput` with ``out [B, H_q, D]`` and ``lse [B, H_q]`` (fp32) and
        optionally ``page_mass`` (or ``page_lse``, the buffer given).
    """
    batch, hq, d, page_size, hkv, group, head_rows = _check_decode_inputs(
        q, kv_pool, page_table)
    scale = check_sm_scale(sm_scale, d)
    cap = check_softcap(softcap)
    splits = check_num_splits("auto" if num_splits is None else num_splits)
    if block_n is not None and (not isinstance(block_n, int) or block_n < 1
                                or block_n & (block_n - 1)):
        raise KernelInputError(f"block_n must be a power of two, got {block_n!r}.")
    config = check_config("decode", config)
    out = check_out("out", out, (batch, hq, d), torch.float32, q.device)
    lse = check_out("lse", lse, (batch, hq), torch.float32, q.device)
    if validate:
        page_table.validate(kv_pool.shape[0], page_size)
    nnz = page_table.indices.numel()
    if first_lane is not None:
        check_tensor("first_lane", first_lane, shape=(nnz,), dtypes=(torch.int32,),
                     device=q.device)
    if (page_lse is None) != (page_lse_index is None):
        raise KernelInputError("page_lse and page_lse_index go together: pass both or neither.")
    if page_lse is not None:
        if return_page_mass or head_rows:
            raise KernelInputError(
                "page_lse= scatters page LSEs of per-sequence rows; it excludes "
                "return_page_mass=True and page tables with one row per (sequence, KV head).")
        check_tensor("page_lse", page_lse, ndim=2, dtypes=(torch.float32,), device=q.device)
        if page_lse.shape[1] != hq or page_lse.stride(-1) != 1:
            raise KernelInputError(f"page_lse must be [N, H_q={hq}] with unit column stride; "
                                   f"got {list(page_lse.shape)}.")
        check_tensor("page_lse_index", page_lse_index, shape=(nnz,), dtypes=(torch.int32,),
                     device=q.device)

    if resolve_backend(backend, q, kv_pool) == "torch":
        o, row_lse, mass, entry_lse, covered = _sparse_decode_torch(
            q, kv_pool, page_table, scale=scale, cap=cap, first_lane=first_lane)
        out.copy_(o)
        lse.copy_(row_lse)
        if page_lse is not None:  # every entry of a row, to the page-LSE row it names
            page_lse[page_lse_index.long()[covered]] = entry_lse[covered]
            return DecodeOutput(out, lse, None, page_lse)
        if not return_page_mass:
            return DecodeOutput(out, lse)
        return DecodeOutput(out, lse, mass, entry_lse)

    if q.stride(-1) != 1:
        q = q.contiguous()
    cfg = resolve_config("decode", q.device, _default_config(d), {"block_n": block_n, **config},
                         _key_sizes(q, kv_pool, page_table))
    p_pad = next_pow2(page_size)
    block_n = max(cfg["block_n"], p_pad, 16)
    if splits is None:
        avg_pages = nnz / max(1, page_table.num_rows)
        splits = auto_num_splits(batch * hkv, avg_pages, page_size, q.device)
    # splits == 1 writes straight into out/lse; otherwise into partials merged below
    if splits == 1 and out.is_contiguous() and lse.is_contiguous():
        part_o, part_lse = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        part_o = torch.empty(splits, batch, hq, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, batch, hq, dtype=torch.float32, device=q.device)
    cols = group if head_rows else hq
    scatter = page_lse is not None
    if not scatter:
        page_lse = torch.full((nnz, cols), float("-inf"), dtype=torch.float32,
                              device=q.device) if return_page_mass else part_lse  # unused if off
    block_g = max(16, next_pow2(group))
    block_d = max(16, next_pow2(d))
    if batch > 0 and hkv > 0:
        _decode_split_kernel[(batch, hkv, splits)](
            q, kv_pool, page_table.indices, page_table.row_start, page_table.row_count,
            page_table.last_page_len,
            first_lane.contiguous() if first_lane is not None else page_table.indices,
            part_o, part_lse, page_lse, page_lse_index if scatter else page_table.indices,
            kv_pool.shape[0], page_size, group, d, hkv, scale,
            q.stride(0), q.stride(1),
            kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            page_lse.stride(0),
            HEAD_ROWS=head_rows, RETURN_MASS=return_page_mass or scatter, SOFTCAP=cap,
            HAS_FIRST_LANE=first_lane is not None, HAS_LSE_INDEX=scatter,
            P_PAD=p_pad, BLOCK_N=block_n, BLOCK_G=block_g, BLOCK_D=block_d,
            DOT_PRECISION=dot_precision(q.dtype),
            **{k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg},
        )
    if part_o.data_ptr() != out.data_ptr() or part_o.shape[0] != 1:
        rows = batch * hq
        o_flat, l_flat = part_o.view(splits, rows, d), part_lse.view(splits, rows)
        f32 = {"dtype": torch.float32, "device": q.device}
        out2 = out.view(rows, d) if out.is_contiguous() else torch.empty(rows, d, **f32)
        lse2 = lse.view(rows) if lse.is_contiguous() else torch.empty(rows, **f32)
        if rows > 0:
            _merge_kernel[(rows,)](
                o_flat, l_flat, out2, lse2, rows, splits, d,
                o_flat.stride(0), o_flat.stride(1), l_flat.stride(0), l_flat.stride(1),
                out2.stride(0), BLOCK_N=next_pow2(splits), BLOCK_D=next_pow2(d),
            )
        if out2.data_ptr() != out.data_ptr():
            out.copy_(out2.view(batch, hq, d))
        if lse2.data_ptr() != lse.data_ptr():
            lse.copy_(lse2.view(batch, hq))

    if scatter:
        return DecodeOutput(out, lse, None, page_lse)
    if not return_page_mass:
        return DecodeOutput(out, lse)
    mass = decode_page_mass(page_lse, lse, page_table, hkv, backend="triton")
    return DecodeOutput(out, lse, mass, page_lse)


def decode_page_mass(
    page_lse: torch.Tensor,
    lse: torch.Tensor,
    page_table: PageTable,
    num_kv_heads: int,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Per-page attention mass under a given LSE: ``mass = sum_g exp(page_lse_g - lse_g)``.

    Args:
        page_lse: ``[nnz, H_q]`` or ``[nnz, G]`` from :class:`DecodeOutput` (the layout follows
            the page table: rows per sequence or per (sequence, KV head)).
        lse: ``[B, H_q]`` fp32 LSE to normalise by, e.g. the merged LSE of the hot-set and
            fetched-page partial states (``-inf`` rows give mass 0).
        page_table: the table ``page_lse`` was computed with.
        num_kv_heads: ``H_kv``.

    Returns:
        ``[nnz, H_kv]`` (or ``[nnz]`` for per-head rows) fp32; 0 outside every row.
    """
    check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,))
    batch, hq = lse.shape
    check_gqa(hq, num_kv_heads)
    group = hq // num_kv_heads
    head_rows = page_table.num_rows != batch
    if page_table.num_rows not in (batch, batch * num_kv_heads):
        raise KernelInputError(
            f"page_table has {page_table.num_rows} rows; expected B={batch} or "
            f"B*H_kv={batch * num_kv_heads} (lse is [B, H_q]).")
    nnz = page_table.indices.numel()
    check_tensor("page_lse", page_lse, shape=(nnz, group if head_rows else hq),
                 dtypes=(torch.float32,), device=lse.device)
    if page_table.device != lse.device:
        raise KernelInputError(f"page_table is on {page_table.device} but lse is on {lse.device}.")
    page_lse = page_lse if page_lse.stride(-1) == 1 else page_lse.contiguous()
    mass = torch.zeros((nnz,) if head_rows else (nnz, num_kv_heads), dtype=torch.float32,
                       device=lse.device)
    if resolve_backend(backend, lse) == "torch":
        starts, counts = page_table.row_start.tolist(), page_table.row_count.tolist()
        for r, (start, count) in enumerate(zip(starts, counts)):
            for h in ([r % num_kv_heads] if head_rows else range(num_kv_heads)):
                b = r // num_kv_heads if head_rows else r
                qh = slice(h * group, (h + 1) * group)
                cols = slice(0, group) if head_rows else qh
                norm = lse[b, qh]
                norm = torch.where(torch.isneginf(norm), float("inf"), norm)
                m = torch.exp(page_lse[start:start + count, cols] - norm).sum(-1)
                if head_rows:
                    mass[start:start + count] = m
                else:
                    mass[start:start + count, h] = m
        return mass
    if batch > 0 and num_kv_heads > 0:
        _decode_mass_kernel[(batch, num_kv_heads)](
            lse.contiguous(), page_table.row_start, page_table.row_count, page_lse, mass,
            group, num_kv_heads, hq, page_lse.stride(0), 1 if head_rows else mass.stride(0),
            HEAD_ROWS=head_rows, BLOCK_E=64, BLOCK_G=next_pow2(group),
        )
    return mass


@triton.jit
def _merge_mass_kernel(
    o_ptr, lse_ptr, page_lse_ptr, mass_ptr, out_ptr, out_lse_ptr,
    num_parts, num_heads, head_dim, pages_per_row,
    stride_on, stride_ob, stride_oh, stride_ln, stride_lb, stride_pl, stride_outb,
    stride_outh, stride_olb,
    RESET: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # one program per (sequence, block of pages); each recomputes the merged LSE of all heads
    i_b = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < num_heads
    b_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for n in range(num_parts):
        b_l = tl.load(lse_ptr + n * stride_ln + i_b * stride_lb + o_h, mask=m_h,
                      other=float("-inf"))
        b_max = tl.maximum(b_max, b_l)
    m_pinf = b_max == float("inf")
    m_ninf = b_max == float("-inf")
    b_ref = tl.where(m_pinf | m_ninf, 0.0, b_max)
    b_sum = tl.zeros([BLOCK_H], tl.float32)
    for n in range(num_parts):
        b_l = tl.load(lse_ptr + n * stride_ln + i_b * stride_lb + o_h, mask=m_h,
                      other=float("-inf"))
        b_w = tl.where(m_pinf, tl.where(b_l == float("inf"), 1.0, 0.0), tl.exp(b_l - b_ref))
        b_sum += b_w
    b_den = tl.where(b_sum > 0, b_sum, 1.0)
    b_lse = tl.where(m_pinf | m_ninf, b_max, b_ref + tl.log(b_den))  # [BH] merged LSE
    if i_p == 0:  # the first page block also writes the merged state
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < head_dim
        b_acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n in range(num_parts):
            b_l = tl.load(lse_ptr + n * stride_ln + i_b * stride_lb + o_h, mask=m_h,
                          other=float("-inf"))
            b_w = tl.where(m_pinf, tl.where(b_l == float("inf"), 1.0, 0.0),
                           tl.exp(b_l - b_ref))
            p_o = o_ptr + n * stride_on + i_b * stride_ob + o_h[:, None] * stride_oh + \
                o_d[None, :]
            b_o = tl.load(p_o, mask=m_h[:, None] & m_d[None, :] & (b_w[:, None] > 0),
                          other=0.0)
            b_acc += b_o.to(tl.float32) * b_w[:, None]
        p_out = out_ptr + i_b * stride_outb + o_h[:, None] * stride_outh + o_d[None, :]
        tl.store(p_out, b_acc / b_den[:, None], mask=m_h[:, None] & m_d[None, :])
        tl.store(out_lse_ptr + i_b * stride_olb + o_h, b_lse, mask=m_h)
    # page mass under the merged LSE (an empty row normalises by +inf: mass 0)
    b_norm = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    m_p = o_p < pages_per_row
    o_row = i_b * pages_per_row + o_p  # [BP] rows of page_lse and mass
    p_pl = page_lse_ptr + o_row[:, None] * stride_pl + o_h[None, :]
    m_pl = m_p[:, None] & m_h[None, :]
    b_pl = tl.load(p_pl, mask=m_pl, other=float("-inf"))
    b_mass = tl.sum(tl.exp(b_pl - b_norm[None, :]), axis=1)  # [BP]
    b_old = tl.load(mass_ptr + o_row, mask=m_p, other=0.0)
    tl.store(mass_ptr + o_row, b_old + b_mass, mask=m_p)
    if RESET:  # ready for the next step's scatter
        tl.store(p_pl, tl.full([BLOCK_P, BLOCK_H], float("-inf"), tl.float32), mask=m_pl)


def merge_page_mass_reference(
    o: torch.Tensor, lse: torch.Tensor, page_lse: torch.Tensor, pages_per_row: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`merge_page_mass`: :func:`~.merge.merge_states_reference` of the parts,
    then ``mass[b * P + p] = sum_h exp(page_lse[b * P + p, h] - lse[b, h])`` (``P`` pages per
    sequence; an empty row's mass is 0). Returns ``(out, lse, mass [B * P])`` in fp32."""
    from .merge import merge_states_reference

    out, out_lse = merge_states_reference(o, lse)
    batch, hq = out_lse.shape
    norm = torch.where(torch.isneginf(out_lse), float("inf"), out_lse).float()
    pl = page_lse[:batch * pages_per_row].float().view(batch, pages_per_row, hq)
    mass = torch.exp(pl - norm[:, None, :]).sum(-1).reshape(-1)
    return out.float(), out_lse.float(), mass


def merge_page_mass(
    o: torch.Tensor,
    lse: torch.Tensor,
    page_lse: torch.Tensor,
    mass: torch.Tensor,
    *,
    pages_per_row: int,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    reset: bool = True,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode step's epilogue in one launch: merge ``N`` partial states by LSE and add each
    page's attention mass under the merged LSE into ``mass``.

    The decode kernels scatter every attended page's LSE into ``page_lse`` by logical page
    (``sparse_decode(page_lse=, page_lse_index=)``: row ``b * P + p``); pages not attended
    hold ``-inf`` and get no mass. With ``reset`` the rows read are set back to ``-inf``.

    Args:
        o: ``[N, B, H_q, D]`` fp32 partial outputs (N >= 1; N = 1 copies the state through).
        lse: ``[N, B, H_q]`` fp32 their LSEs.
        page_lse: ``[>= B * P, H_q]`` fp32 per-page LSEs (unit column stride).
        mass: ``[>= B * P]`` fp32 accumulated importance; ``mass[b * P + p]`` gains
            ``sum_h exp(page_lse[b * P + p, h] - lse_merged[b, h])``.
        pages_per_row: ``P``, pages per sequence in ``page_lse`` and ``mass``.
        out, out_lse: optional ``[B, H_q, D]``, ``[B, H_q]`` fp32 buffers for the merged state.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"``.

    Returns:
        ``(out [B, H_q, D], lse [B, H_q])`` fp32, the merged state.
    """
    check_tensor("o", o, ndim=4, dtypes=(torch.float32,))
    n, batch, hq, d = o.shape
    check_tensor("lse", lse, shape=(n, batch, hq), dtypes=(torch.float32,), device=o.device)
    if n < 1:
        raise KernelInputError("merge_page_mass needs at least one partial state (N >= 1).")
    if not isinstance(pages_per_row, int) or pages_per_row < 0:
        raise KernelInputError(f"pages_per_row must be an int >= 0, got {pages_per_row!r}.")
    rows = batch * pages_per_row
    check_tensor("page_lse", page_lse, ndim=2, dtypes=(torch.float32,), device=o.device)
    if page_lse.shape[0] < rows or page_lse.shape[1] != hq or page_lse.stride(-1) != 1:
        raise KernelInputError(f"page_lse must be [>= B*P={rows}, H_q={hq}] with unit column "
                               f"stride; got {list(page_lse.shape)}.")
    check_tensor("mass", mass, ndim=1, dtypes=(torch.float32,), device=o.device)
    if mass.shape[0] < rows or mass.stride(0) != 1:
        raise KernelInputError(f"mass must be a contiguous [>= B*P={rows}] fp32 vector; got "
                               f"{list(mass.shape)}.")
    out = check_out("out", out, (batch, hq, d), torch.float32, o.device)
    out_lse = check_out("out_lse", out_lse, (batch, hq), torch.float32, o.device)
    if resolve_backend(backend, o) == "torch":
        ref_o, ref_lse, ref_mass = merge_page_mass_reference(o, lse, page_lse, pages_per_row)
        out.copy_(ref_o)
        out_lse.copy_(ref_lse)
        mass[:rows] += ref_mass
        if reset:
            page_lse[:rows] = float("-inf")
        return out, out_lse
    o = o if o.stride(-1) == 1 else o.contiguous()
    if batch > 0 and hq > 0:
        block_p = max(1, min(64, 4096 // next_pow2(hq)))
        _merge_mass_kernel[(batch, max(1, triton.cdiv(pages_per_row, block_p)))](
            o, lse, page_lse, mass, out, out_lse,
            n, hq, d, pages_per_row,
            o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
            page_lse.stride(0), out.stride(0), out.stride(1), out_lse.stride(0),
            RESET=reset, BLOCK_H=next_pow2(hq), BLOCK_D=next_pow2(d), BLOCK_P=block_p,
        )
    return out, out_lse
