"""Paged prefill: causal (optionally sliding-window, softcapped) attention of a prompt chunk
over paged KV, with the per-page attention mass that seeds importance-based policies.

The chunk's own K/V are already in the pool: the ``q_len`` queries of a sequence are its last
``q_len`` tokens. Work split: a host plan lists ``BLOCK_M``-row query blocks; pass 1 runs one
program per (block, query head), a flash-attention loop over the KV tiles the block can see
(tiles of ``NP`` whole pages, each padded to ``P_PAD`` lanes, as in :mod:`.decode`). Pass 2, only
for the page mass, is KV-major: one program per (KV tile, KV head) recomputes the scores of every
query row and group head that can see the tile and sums ``exp(s - lse)`` per page, so each mass
entry is written by exactly one program (deterministic, no atomics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tierattn.errors import KernelInputError

from ._common import (
    _softcap,
    Backend,
    INDEX_DTYPE,
    check_out,
    check_sm_scale,
    check_softcap,
    check_tensor,
    default_tiles,
    dot_precision,
    fit_num_stages,
    next_pow2,
    resolve_backend,
    triton_interpreting,
)
from .tuning import check_config, resolve_config
from .page_table import PageTable, check_paged_attention_args

__all__ = ["PrefillOutput", "paged_prefill", "paged_prefill_mass", "paged_prefill_reference"]


@triton.jit(do_not_specialize=["num_slots", "window"])
def _prefill_fwd_kernel(
    q_ptr, kv_ptr, items_ptr, qo_indptr_ptr, indices_ptr, row_start_ptr, row_count_ptr,
    last_len_ptr, first_lane_ptr, out_ptr, lse_ptr,
    num_slots, page_size, group, head_dim, sm_scale, window,
    stride_qt, stride_qh,
    stride_kv_slot, stride_kv_kv, stride_kv_tok, stride_kv_head,
    stride_ot, stride_oh, stride_lt, stride_lh,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_FIRST_LANE: tl.constexpr,
    P_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_w = tl.program_id(0).to(tl.int64)
    i_hq = tl.program_id(1).to(tl.int64)
    NP: tl.constexpr = BLOCK_N // P_PAD
    i_b = tl.load(items_ptr + 2 * i_w).to(tl.int64)
    i_m0 = tl.load(items_ptr + 2 * i_w + 1).to(tl.int64)
    i_hk = i_hq // group

    qo_start = tl.load(qo_indptr_ptr + i_b).to(tl.int64)
    q_len = tl.load(qo_indptr_ptr + i_b + 1).to(tl.int64) - qo_start
    row_start = tl.load(row_start_ptr + i_b).to(tl.int64)
    row_count = tl.load(row_count_ptr + i_b).to(tl.int64)
    # clamped: an unvalidated last_page_len can never reach past the row's last page
    last_len = tl.minimum(tl.maximum(tl.load(last_len_ptr + i_b).to(tl.int64), 0), page_size)
    kv_len = tl.where(row_count > 0, (row_count - 1) * page_size + last_len, 0)
    q_off = kv_len - q_len  # absolute position of the chunk's first query

    o_m = i_m0 + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    o_page = o_n // P_PAD  # [BLOCK_N] page of each lane within the tile
    o_lane = (o_n % P_PAD).to(tl.int64)  # [BLOCK_N] token of each lane within its page
    m_m = o_m < q_len
    m_d = o_d < head_dim
    o_t = q_off + o_m  # [BLOCK_M] absolute query positions

    p_q = q_ptr + (qo_start + o_m)[:, None] * stride_qt + i_hq * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BM, BD]

    # keys [j_lo, j_hi) are the only ones some row of this block can see
    j_hi = kv_len
    if CAUSAL:
        j_hi = tl.minimum(j_hi, q_off + tl.minimum(i_m0 + BLOCK_M, q_len))
    j_hi = tl.maximum(j_hi, 0)
    j_lo = 0
    if USE_WINDOW:
        j_lo = tl.maximum(q_off + i_m0 - window + 1, 0)
    e_lo = j_lo // page_size
    e_hi = (j_hi + page_size - 1) // page_size

    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    for e0 in range(e_lo, e_hi, NP):
        o_e = e0 + o_page  # [BLOCK_N] entry (within the row) of each lane
        o_j = o_e * page_size + o_lane  # [BLOCK_N] absolute key positions
        m_n = (o_lane < page_size) & (o_j < kv_len)
        if HAS_FIRST_LANE:  # tokens before an entry's first lane are padding
            b_first = tl.load(first_lane_ptr + row_start + o_e, mask=m_n, other=0)
            m_n = m_n & (o_lane >= b_first)
        b_slot = tl.load(indices_ptr + row_start + o_e, mask=m_n, other=0).to(tl.int64)
        # an out-of-range page id reads nothing (the launcher's validate=True reports it)
        m_n = m_n & (b_slot >= 0) & (b_slot < num_slots)
        o_kv = b_slot * stride_kv_slot + o_lane * stride_kv_tok + i_hk * stride_kv_head  # [BN]
        p_k = kv_ptr + o_kv[:, None] + o_d[None, :]
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(p_k, mask=m_kv, other=0.0).to(tl.float32)  # [BN, BD]
        b_v = tl.load(p_k + stride_kv_kv, mask=m_kv, other=0.0).to(tl.float32)  # [BN, BD]

        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * sm_scale  # [BM, BN]
        if SOFTCAP > 0:
            b_s = _softcap(b_s, SOFTCAP)
        m_s = m_n[None, :] & m_m[:, None]
        if CAUSAL:
            m_s = m_s & (o_j[None, :] <= o_t[:, None])
        if USE_WINDOW:
            m_s = m_s & (o_t[:, None] - o_j[None, :] < window)
        b_s = tl.where(m_s, b_s, float("-inf"))

        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        # a row that has seen only masked keys keeps max -inf: shift by 0, never exp(-inf - -inf)
        b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp(b_m - b_shift)
        b_p = tl.exp(b_s - b_shift[:, None])  # [BM, BN]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new

    b_out = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    b_lse = tl.where(b_l > 0, b_m + tl.log(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
    p_o = out_ptr + (qo_start + o_m)[:, None] * stride_ot + i_hq * stride_oh + o_d[None, :]
    tl.store(p_o, b_out, mask=m_m[:, None] & m_d[None, :])
    tl.store(lse_ptr + (qo_start + o_m) * stride_lt + i_hq * stride_lh, b_lse, mask=m_m)


@triton.jit(do_not_specialize=["num_slots", "window"])
def _prefill_mass_kernel(
    q_ptr, kv_ptr, items_ptr, qo_indptr_ptr, indices_ptr, row_start_ptr, row_count_ptr,
    last_len_ptr, first_lane_ptr, lse_ptr, mass_ptr,
    num_slots, page_size, group, head_dim, sm_scale, window,
    stride_qt, stride_qh,
    stride_kv_slot, stride_kv_tok, stride_kv_head,
    stride_lt, stride_lh, stride_mass_e,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_FIRST_LANE: tl.constexpr,
    P_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # mass[entry, kv head] = sum over queries and group heads of exp(s - lse), per page
    i_w = tl.program_id(0).to(tl.int64)
    i_hk = tl.program_id(1).to(tl.int64)
    NP: tl.constexpr = BLOCK_N // P_PAD
    i_b = tl.load(items_ptr + 2 * i_w).to(tl.int64)
    e0 = tl.load(items_ptr + 2 * i_w + 1).to(tl.int64)

    qo_start = tl.load(qo_indptr_ptr + i_b).to(tl.int64)
    q_len = tl.load(qo_indptr_ptr + i_b + 1).to(tl.int64) - qo_start
    row_start = tl.load(row_start_ptr + i_b).to(tl.int64)
    row_count = tl.load(row_count_ptr + i_b).to(tl.int64)
    # clamped: an unvalidated last_page_len can never reach past the row's last page
    last_len = tl.minimum(tl.maximum(tl.load(last_len_ptr + i_b).to(tl.int64), 0), page_size)
    kv_len = tl.where(row_count > 0, (row_count - 1) * page_size + last_len, 0)
    q_off = kv_len - q_len

    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    o_page = o_n // P_PAD
    o_lane = (o_n % P_PAD).to(tl.int64)
    m_d = o_d < head_dim
    o_e = e0 + o_page
    o_j = o_e * page_size + o_lane  # [BLOCK_N] absolute key positions
    m_n = (o_lane < page_size) & (o_j < kv_len)
    if HAS_FIRST_LANE:
        b_first = tl.load(first_lane_ptr + row_start + o_e, mask=m_n, other=0)
        m_n = m_n & (o_lane >= b_first)
    b_slot = tl.load(indices_ptr + row_start + o_e, mask=m_n, other=0).to(tl.int64)
    m_n = m_n & (b_slot >= 0) & (b_slot < num_slots)
    o_kv = b_slot * stride_kv_slot + o_lane * stride_kv_tok + i_hk * stride_kv_head
    p_k = kv_ptr + o_kv[:, None] + o_d[None, :]
    b_k = tl.load(p_k, mask=m_n[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BN, BD]

    # query rows [i_lo, i_hi) are the only ones that can see a key of this tile
    i_lo = 0
    if CAUSAL:
        i_lo = tl.maximum(e0 * page_size - q_off, 0)
    i_hi = q_len
    if USE_WINDOW:
        j_last = tl.minimum((e0 + NP) * page_size, kv_len) - 1
        i_hi = tl.minimum(i_hi, tl.maximum(j_last + window - q_off, 0))

    b_mass = tl.zeros([BLOCK_N], tl.float32)
    for g in range(0, group):
        i_hq = i_hk * group + g
        for m0 in range(i_lo, i_hi, BLOCK_M):
            o_m = m0 + tl.arange(0, BLOCK_M)
            m_m = o_m < q_len
            o_t = q_off + o_m
            p_q = q_ptr + (qo_start + o_m)[:, None] * stride_qt + i_hq * stride_qh + o_d[None, :]
            b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            b_lse = tl.load(lse_ptr + (qo_start + o_m) * stride_lt + i_hq * stride_lh, mask=m_m,
                            other=float("inf"))  # [BM]
            b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)  # masked row: mass 0

            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * sm_scale  # [BM, BN]
            if SOFTCAP > 0:
                b_s = _softcap(b_s, SOFTCAP)
            m_s = m_n[None, :] & m_m[:, None]
            if CAUSAL:
                m_s = m_s & (o_j[None, :] <= o_t[:, None])
            if USE_WINDOW:
                m_s = m_s & (o_t[:, None] - o_j[None, :] < window)
            b_s = tl.where(m_s, b_s, float("-inf"))
            b_p = tl.exp(b_s - b_lse[:, None])  # [BM, BN]
            b_mass += tl.sum(b_p, axis=0)

    b_page = tl.sum(tl.reshape(b_mass, (NP, P_PAD)), axis=1)  # [NP]
    o_pe = e0 + tl.arange(0, NP)
    tl.store(mass_ptr + (row_start + o_pe) * stride_mass_e + i_hk, b_page, mask=o_pe < row_count)


@dataclass(frozen=True)
class PrefillOutput:
    """Result of :func:`paged_prefill`.

    Attributes:
        out: ``[total_q, H_q, D]`` fp32 attention output.
        lse: ``[total_q, H_q]`` fp32 natural-log LSE of the scaled scores (``-inf`` for a row
            that sees no key).
        page_mass: ``[nnz, H_kv]`` fp32 aligned with ``page_table.indices``: softmax
            probability summed over the page's tokens, the chunk's queries and the group's query
            heads (sums to ``q_len * G`` per sequence and KV head when no row is fully masked).
            ``None`` unless requested; entries outside every row are 0.
    """

    out: torch.Tensor
    lse: torch.Tensor
    page_mass: torch.Tensor | None = None


def _default_config(head_dim: int) -> dict[str, int]:
    """Launch parameters of an untuned call (Triton's own default ``num_stages``)."""
    block_n, num_warps = default_tiles(head_dim)
    return {"block_m": 64, "block_n": block_n, "num_warps": num_warps}


def _key_sizes(q: torch.Tensor, kv_pool: torch.Tensor, qo_indptr: torch.Tensor) -> dict:
    """Sizes of the tuned-table key (:func:`.tuning.bucket_key`), from host-known shapes."""
    total_q, hq, d = q.shape
    return dict(d=d, group=hq // kv_pool.shape[3], page_size=kv_pool.shape[2], dtype=q.dtype,
                q_len=total_q // max(1, qo_indptr.numel() - 1))


def _check_prefill_inputs(q, kv_pool, page_table, qo_indptr, sliding_window):
    num_q_heads, head_dim, page_size, group = check_paged_attention_args(q, kv_pool, page_table)
    check_tensor("qo_indptr", qo_indptr, ndim=1, device=q.device)
    if qo_indptr.dtype != INDEX_DTYPE:
        raise KernelInputError(
            f"qo_indptr has dtype {qo_indptr.dtype}; it must be int32: pass "
            "qo_indptr.to(torch.int32)."
        )
    if qo_indptr.numel() < 1:
        raise KernelInputError("qo_indptr must have B+1 >= 1 entries, got an empty tensor.")
    num_kv_heads = kv_pool.shape[3]
    batch = qo_indptr.numel() - 1
    if page_table.num_rows != batch:
        raise KernelInputError(
            f"page_table has {page_table.num_rows} rows but qo_indptr describes B={batch} "
            "sequences; prefill takes one page list per sequence, in logical token order."
        )
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise KernelInputError(
            f"sliding_window must be None or an int >= 1 (keys with t - j < window are seen), "
            f"got {sliding_window!r}."
        )
    return batch, num_q_heads, head_dim, page_size, num_kv_heads, group


def _plan(q, page_table, qo_indptr, page_size, block_m, pages_per_tile, validate, need_mass,
          causal=True):
    """Host work list (one device->host copy): ``q_items [n, 2]`` = (sequence, first query row)
    and, for the page mass, ``kv_items [k, 2]`` = (sequence, first entry of a KV tile)."""
    batch = qo_indptr.numel() - 1
    host = torch.cat([qo_indptr, page_table.row_count, page_table.last_page_len]).long().cpu()
    indptr, count, last = host[:batch + 1], host[batch + 1:2 * batch + 1], host[2 * batch + 1:]
    q_lens = indptr[1:] - indptr[:-1]
    if int(indptr[0]) != 0 or (q_lens < 0).any() or int(indptr[-1]) != q.shape[0]:
        raise KernelInputError(
            f"qo_indptr must start at 0, be non-decreasing and end at total_q={q.shape[0]} "
            f"(q.shape[0]); got {indptr.tolist()[:8]}{' ...' if batch > 7 else ''}."
        )
    if validate and causal:  # without causality positions do not matter
        kv_lens = torch.where(count > 0, (count - 1) * page_size + last, 0)
        bad = q_lens > kv_lens
        if bad.any():
            b = int(torch.nonzero(bad)[0])
            raise KernelInputError(
                f"qo_indptr gives sequence {b} q_len={int(q_lens[b])} queries but its page table "
                f"row holds only kv_len={int(kv_lens[b])} tokens; the chunk's own K/V must be "
                "written to the pool before prefill (q_len <= kv_len)."
            )

    def items(per_seq: torch.Tensor, step: int) -> torch.Tensor:
        n = torch.div(per_seq.clamp(min=0) + step - 1, step, rounding_mode="floor")
        seq = torch.repeat_interleave(torch.arange(batch), n)
        first = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        return torch.stack([seq, (torch.arange(seq.numel()) - first) * step], dim=1)

    q_items = items(q_lens, block_m)
    kv_items = None
    if need_mass:
        kv_items = items(torch.where(q_lens > 0, count, 0), pages_per_tile)
    to_dev = lambda t: t.to(device=q.device, dtype=INDEX_DTYPE).contiguous()
    return to_dev(q_items), (to_dev(kv_items) if kv_items is not None else None)


@dataclass
class _Prepared:
    """Checked arguments, the host plan and the launch parameters shared by both passes."""

    hq: int
    d: int
    scale: float
    cap: float
    q_items: torch.Tensor
    kv_items: torch.Tensor | None
    common: dict
    tables: tuple
    window: int
    group: int


def _prepare(q, kv_pool, page_table, qo_indptr, *, sm_scale, causal, sliding_window, softcap,
             validate, block_m, block_n, config, first_lane, need_mass) -> _Prepared:
    batch, hq, d, page_size, hkv, group = _check_prefill_inputs(
        q, kv_pool, page_table, qo_indptr, sliding_window)
    if first_lane is not None:
        check_tensor("first_lane", first_lane, shape=(page_table.indices.numel(),),
                     dtypes=(INDEX_DTYPE,), device=q.device)
    scale = check_sm_scale(sm_scale, d)
    cap = check_softcap(softcap)
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if val is not None and (not isinstance(val, int) or val < 1 or val & (val - 1)):
            raise KernelInputError(f"{name} must be a power of two, got {val!r}.")
    cfg = resolve_config(
        "prefill", q.device, _default_config(d),
        {"block_m": block_m, "block_n": block_n, **check_config("prefill", config)},
        _key_sizes(q, kv_pool, qo_indptr))
    if validate:
        page_table.validate(kv_pool.shape[0], page_size)
    p_pad = next_pow2(page_size)
    block_m, block_n = max(cfg["block_m"], 16), max(cfg["block_n"], p_pad, 16)
    q_items, kv_items = _plan(q, page_table, qo_indptr, page_size, block_m, block_n // p_pad,
                              validate, need_mass, bool(causal))
    stages = {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}
    # a tuned num_stages was checked on this GPU for its key, which pins D and the dtype (the
    # tile bytes): only the untuned default is fitted to the shared memory
    if "num_stages" not in stages and not triton_interpreting():
        fit = fit_num_stages(2 * block_n * next_pow2(d) * kv_pool.element_size(), q.device)
        if fit is not None:
            stages["num_stages"] = fit
    common = dict(
        CAUSAL=bool(causal), USE_WINDOW=sliding_window is not None, SOFTCAP=cap,
        HAS_FIRST_LANE=first_lane is not None,
        P_PAD=p_pad, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(d)),
        DOT_PRECISION=dot_precision(q.dtype), **stages,
    )
    tables = (qo_indptr.contiguous(), page_table.indices, page_table.row_start,
              page_table.row_count, page_table.last_page_len,
              first_lane.contiguous() if first_lane is not None else page_table.indices)
    return _Prepared(hq, d, scale, cap, q_items, kv_items, common, tables, sliding_window or 0,
                     group)


def paged_prefill_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: PageTable,
    qo_indptr: torch.Tensor,
    *,
    sm_scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_page_mass: bool = False,
    mass_lse: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    first_lane: torch.Tensor | None = None,
) -> PrefillOutput:
    """Plain-torch :func:`paged_prefill`, one sequence at a time: gather, mask, softmax, sum.

    Computes in ``compute_dtype`` (default: fp32, or fp64 for fp64 inputs) and returns tensors
    of that dtype. With ``mass_lse [total_q, H_q]`` the page mass is ``exp(s - mass_lse)``
    summed (:func:`paged_prefill_mass`) instead of this call's own softmax.
    """
    total_q, hq, d = q.shape
    _, _, page_size, hkv, _ = kv_pool.shape
    group = hq // hkv
    dt = compute_dtype or torch.promote_types(q.dtype, torch.float32)
    scale = check_sm_scale(sm_scale, d)
    cap = check_softcap(softcap)
    out = torch.zeros(total_q, hq, d, dtype=dt, device=q.device)
    lse = torch.full((total_q, hq), float("-inf"), dtype=dt, device=q.device)
    mass = torch.zeros(page_table.indices.numel(), hkv, dtype=dt, device=q.device)
    bounds = qo_indptr.tolist()
    starts, counts = page_table.row_start.tolist(), page_table.row_count.tolist()
    lasts = page_table.last_page_len.tolist()
    for b, (start, count, last) in enumerate(zip(starts, counts, lasts)):
        q0, q1 = bounds[b], bounds[b + 1]
        if q1 == q0:
            continue
        slots = page_table.indices[start:start + count].long()
        n_tok = (count - 1) * page_size + last if count > 0 else 0
        keys = kv_pool[slots, 0].to(dt).reshape(count * page_size, hkv, d)[:n_tok]
        values = kv_pool[slots, 1].to(dt).reshape(count * page_size, hkv, d)[:n_tok]
        keys = keys.repeat_interleave(group, dim=1)  # [n_tok, H_q, D]
        values = values.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].to(dt), keys) * scale  # [H_q, q_len, n_tok]
        if cap:
            s = cap * torch.tanh(s / cap)
        pos_q = torch.arange(n_tok - (q1 - q0), n_tok, device=q.device)
        pos_k = torch.arange(n_tok, device=q.device)
        visible = torch.ones(q1 - q0, n_tok, dtype=torch.bool, device=q.device)
        if causal:
            visible &= pos_k[None, :] <= pos_q[:, None]
        if sliding_window is not None:
            visible &= pos_q[:, None] - pos_k[None, :] < sliding_window
        if first_lane is not None:  # left padding: lanes before first_lane[e] are masked
            first = first_lane[start:start + count].long().repeat_interleave(page_size)[:n_tok]
            keep = pos_k % page_size >= first
            visible &= keep[None, :]
            values = torch.where(keep[:, None, None], values, 0)  # masked lanes may be garbage
        s = s.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [H_q, q_len]
        p = torch.exp(s - torch.where(torch.isinf(row_lse), 0, row_lse)[..., None])
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, values)
        lse[q0:q1] = row_lse.T
        if mass_lse is not None:
            norm = mass_lse[q0:q1].T.to(dt)  # [H_q, q_len]; -inf (an empty row) gives mass 0
            p = torch.exp(s - torch.where(torch.isinf(norm), float("inf"), norm)[..., None])
        if count > 0:
            p = torch.nn.functional.pad(p, (0, count * page_size - n_tok))
            per_page = p.reshape(hkv, group, q1 - q0, count, page_size).sum(dim=(1, 2, 4))
            mass[start:start + count] = per_page.T
    return PrefillOutput(out, lse, mass if return_page_mass else None)


def _paged_prefill_torch(q, kv_pool, page_table, qo_indptr, *, scale, causal, sliding_window,
                         cap, want_out, mass_lse, want_mass, first_lane, block_q=64,
                         max_elements=1 << 22):
    """The torch backend of :func:`paged_prefill` and :func:`paged_prefill_mass`: what the
    reference computes, in fp32, without its copies per query head (the group's heads share a
    batched matmul against their KV head), over ``block_q`` query rows at a time so that a
    causal block sees no page past its last query (about half the square, as dense attention
    does), and over every sequence of one shape at once: a left-padded batch (one page count,
    one chunk length) is one batched matmul per block, not a Python loop over its sequences.

    A block's scores and gathered KV hold about ``max_elements`` fp32 values (16 MiB): fewer
    rows per block for long sequences, fewer sequences per batch; one sequence's single query
    row over its whole context is the floor (``H_q x N`` scores). Returns ``(out,
    lse, mass)``; ``out``/``lse`` are None unless ``want_out``, ``mass`` None unless
    ``want_mass`` (normalised by ``mass_lse`` when given, else by the call's own LSE).
    """
    total_q, hq, d = q.shape
    page_size, hkv = kv_pool.shape[2], kv_pool.shape[3]
    group, dev, neg = hq // hkv, q.device, float("-inf")
    out = torch.zeros(total_q, hq, d, device=dev) if want_out else None
    lse = torch.full((total_q, hq), neg, device=dev) if want_out else None
    mass = torch.zeros(page_table.indices.numel(), hkv, device=dev) if want_mass else None
    bounds = qo_indptr.tolist()  # host tables: the torch backend plans on the host, as the
    starts = page_table.row_start.tolist()  # reference does (it is not the decode hot path)
    counts, lasts = page_table.row_count.tolist(), page_table.last_page_len.tolist()
    shapes: dict[tuple[int, int, int], list[int]] = {}
    for b, (count, last) in enumerate(zip(counts, lasts)):
        if bounds[b + 1] > bounds[b] and count > 0:
            shapes.setdefault((count, last, bounds[b + 1] - bounds[b]), []).append(b)
    qs = q.float() * scale  # the scale folded into the queries: one pass over T x D, not T x N
    for (count, last, t), seqs in shapes.items():
        n_pad = count * page_size
        n_tok = n_pad - page_size + last
        rows_q = max(1, min(t, block_q, max_elements // (hq * n_pad)))
        # a sequence's share: its score block and its KV gathered in fp32 (three copies: the
        # cast, keys and values laid out for the matmuls)
        per_seq = hq * rows_q * n_pad + 3 * 2 * hkv * d * n_pad
        batch = max(1, max_elements // per_seq)
        for s0 in range(0, len(seqs), batch):
            part = seqs[s0:s0 + batch]
            _prefill_shape(qs, kv_pool, page_table, first_lane, out, lse, mass, mass_lse,
                           seqs=torch.tensor(part, device=dev),
                           q_start=torch.tensor([bounds[b] for b in part], device=dev),
                           e_start=torch.tensor([starts[b] for b in part], device=dev),
                           count=count, n_tok=n_tok, t=t, rows_q=rows_q, causal=causal,
                           window=sliding_window, cap=cap, group=group)
    return out, lse, mass


#: torch's fused CPU attention that also returns the LSE (None where this torch lacks it)
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefill_shape(qs, kv_pool, page_table, first_lane, out, lse, mass, mass_lse, *, seqs,
                   q_start, e_start, count, n_tok, t, rows_q, causal, window, cap, group):
    """:func:`_paged_prefill_torch` for ``S`` sequences of one shape: ``count`` pages holding
    ``n_tok`` tokens, ``t`` queries each (the last ``t`` positions), ``rows_q`` at a time.

    On the CPU, for the output and LSE alone (no page mass, no softcap), each block is one call
    of torch's fused flash attention (``_scaled_dot_product_flash_attention_for_cpu``: blocked,
    vectorised, no score tensor) with the masks as an additive bias; a KV head's group of
    query heads goes as ``G x rows`` query rows of that head, so K and V are not repeated."""
    page_size, hkv, d = kv_pool.shape[2], kv_pool.shape[3], kv_pool.shape[4]
    dev, neg, n_seq = qs.device, float("-inf"), seqs.numel()
    fused = _CPU_FLASH is not None and dev.type == "cpu" and out is not None and \
        mass is None and mass_lse is None and not cap
    n_pad = count * page_size
    entries = e_start[:, None] + torch.arange(count, device=dev)  # [S, count]
    kv = kv_pool[page_table.indices[entries].long()].float()  # [S, count, 2, P, H_kv, D]
    pos_k = torch.arange(n_pad, device=dev)
    keep = (pos_k < n_tok).expand(n_seq, n_pad)  # [S, N]
    if first_lane is not None:  # left padding: lanes before first_lane[e] are masked
        first = first_lane[entries].long().repeat_interleave(page_size, dim=1)
        keep = keep & (pos_k % page_size >= first)
    values = kv[:, :, 1].permute(0, 3, 1, 2, 4).reshape(n_seq, hkv, n_pad, d)  # [S, H_kv, N, D]
    values = torch.where(keep[:, None, :, None], values, 0.0)  # masked lanes may be garbage
    if fused:  # [S, H_kv, N, D], masked lanes zeroed too: a bias of -inf does not mask a NaN
        keys = kv[:, :, 0].permute(0, 3, 1, 2, 4).reshape(n_seq, hkv, n_pad, d)
        keys = torch.where(keep[:, None, :, None], keys, 0.0)
    else:  # [S, H_kv, D, N]: the matmul's right operand
        keys = kv[:, :, 0].permute(0, 3, 4, 1, 2).reshape(n_seq, hkv, d, n_pad)
    for i0 in range(0, t, rows_q):
        rows = min(t, i0 + rows_q) - i0
        first_q = n_tok - t + i0
        pos_q = torch.arange(first_q, first_q + rows, device=dev)
        # causal: the block sees no page past its last query's (the fused call takes whole,
        # contiguous K and V -- a slice of them sends it down a path several times slower --
        # and the bias masks the rest)
        hi = min(n_pad, -(-(first_q + rows) // page_size) * page_size) if causal else n_pad
        if fused and hi > 0:
            hi = n_pad
        if hi <= 0:  # more queries than keys (unvalidated input): these rows see nothing
            continue
        q_rows = q_start[:, None] + i0 + torch.arange(rows, device=dev)  # [S, rows]
        qb = qs[q_rows].view(n_seq, rows, hkv, group, d).permute(0, 2, 3, 1, 4)
        visible = keep[:, None, :hi]  # [S, 1 | rows, N']
        if causal:
            visible = visible & (pos_k[None, None, :hi] <= pos_q[None, :, None])
        if window is not None:
            visible = visible & (pos_q[None, :, None] - pos_k[None, None, :hi] < window)
        if fused:
            vis = visible.expand(n_seq, rows, hi)
            bias = torch.zeros((n_seq, 1, group, rows, hi), device=dev).masked_fill_(
                ~vis[:, None, None], neg).view(n_seq, 1, group * rows, hi)
            o, row_lse = _CPU_FLASH(qb.reshape(n_seq, hkv, group * rows, d), keys, values,
                                    0.0, False, attn_mask=bias, scale=1.0)[:2]
            # a row that sees no key: out 0 (as torch gives) and LSE -inf (torch gives 0)
            seen = vis.any(-1)[:, None, None, :].expand(n_seq, hkv, group, rows)
            row_lse = row_lse.view(n_seq, hkv, group, rows).masked_fill(~seen, neg)
            out[q_rows] = o.view(n_seq, hkv, group, rows, d).permute(0, 3, 1, 2, 4).reshape(
                n_seq, rows, hkv * group, d)
            lse[q_rows] = row_lse.permute(0, 3, 1, 2).reshape(n_seq, rows, hkv * group)
            continue
        s = torch.matmul(qb.reshape(n_seq, hkv, group * rows, d), keys[..., :hi])
        s = s.view(n_seq, hkv, group, rows, hi)
        if cap:
            s = s.div_(cap).tanh_().mul_(cap)
        s.masked_fill_(~visible[:, None, None], neg)
        if mass_lse is not None:  # normalised by the given LSE: exp(s - lse)
            norm = mass_lse[q_rows].float().view(n_seq, rows, hkv, group).permute(0, 2, 3, 1)
            p = s.sub_(torch.where(torch.isinf(norm), float("inf"), norm)[..., None]).exp_()
            weight = None
        else:
            row_max = s.amax(dim=-1, keepdim=True)
            shift = torch.where(torch.isinf(row_max), 0.0, row_max)
            p = s.sub_(shift).exp_()
            denom = p.sum(dim=-1, keepdim=True)
            weight = 1.0 / denom.clamp_min(1e-30)  # [S, H_kv, G, rows, 1]
            if out is not None:
                o = torch.matmul(p.view(n_seq, hkv, group * rows, hi), values[:, :, :hi])
                o = o.view(n_seq, hkv, group, rows, d) * weight
                out[q_rows] = o.permute(0, 3, 1, 2, 4).reshape(n_seq, rows, hkv * group, d)
                row_lse = (shift + denom.log()).squeeze(-1)  # -inf where nothing is seen
                lse[q_rows] = row_lse.permute(0, 3, 1, 2).reshape(n_seq, rows, hkv * group)
        if mass is not None:  # sum over the group's heads and the block's rows of p / denom
            flat = p.view(n_seq, hkv, 1, group * rows, hi)
            per_tok = flat.sum(-2) if weight is None else torch.matmul(
                weight.reshape(n_seq, hkv, 1, 1, group * rows), flat).squeeze(-2)
            per_page = per_tok.view(n_seq, hkv, hi // page_size, page_size).sum(-1)
            mass[entries[:, :hi // page_size]] += per_page.transpose(1, 2)


def paged_prefill(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: PageTable,
    qo_indptr: torch.Tensor,
    *,
    sm_scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_page_mass: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    validate: bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
    first_lane: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    backend: Backend | None = None,
) -> PrefillOutput:
    """Attention of prompt chunks (ragged batch) over their sequences' paged KV.

    Query ``i`` of sequence ``b`` sits at position ``kv_len_b - q_len_b + i`` and sees key ``j``
    iff ``(not causal or j <= t)`` and ``(sliding_window is None or t - j < sliding_window)``.

    Args:
        q: ``[total_q, H_q, D]`` queries (post-RoPE), fp16/bf16/fp32, same dtype as the pool;
            rows ``qo_indptr[b]:qo_indptr[b+1]`` belong to sequence ``b``.
        kv_pool: ``[num_slots, 2, page_size, H_kv, D]``: K (index 0) and V (index 1) of a page;
            already holds the chunk's own K/V.
        page_table: one row per sequence (``R = B``), entries in logical token order; only a
            row's last entry may be partly filled.
        qo_indptr: ``[B+1]`` int32 query offsets (``qo_indptr[0] == 0``, ``qo_indptr[B] ==
            total_q``); read on the host once (the plan).
        sm_scale: score scale (default ``D ** -0.5``).
        causal: mask keys after the query's position.
        sliding_window: optional window ``w >= 1``: keys with ``t - j >= w`` are masked.
        softcap: optional logit softcap ``c``: scores become ``c * tanh(s / c)`` before masking.
        return_page_mass: also return the per-entry attention mass (a second pass).
        out: optional ``[total_q, H_q, D]`` fp32 output buffer.
        lse: optional ``[total_q, H_q]`` fp32 LSE buffer.
        validate: check every page id and length (``q_len <= kv_len``) on the host.
        block_m: query rows per program (power of two, raised to 16 if smaller; default: the
            tuned table's on CUDA, else 64).
        block_n: tokens per KV tile (power of two; raised to the padded page size if smaller;
            default: the tuned table's on CUDA, else 64, or 32 for head dims above 128).
        first_lane: optional ``[nnz]`` int32: the tokens of entry ``e`` before lane
            ``first_lane[e]`` are masked (left padding); 0 masks nothing.
        config: explicit launch parameters ``block_m``, ``block_n``, ``num_warps``,
            ``num_stages`` (see :mod:`.tuning`); with it, ``block_m`` or ``block_n`` the
            tuned table is not consulted.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"``.

    Returns:
        :class:`PrefillOutput` with ``out [total_q, H_q, D]`` and ``lse [total_q, H_q]`` (fp32)
        and optionally ``page_mass [nnz, H_kv]`` (fp32).
    """
    pre = _prepare(q, kv_pool, page_table, qo_indptr, sm_scale=sm_scale, causal=causal,
                   sliding_window=sliding_window, softcap=softcap, validate=validate,
                   block_m=block_m, block_n=block_n, config=config, first_lane=first_lane,
                   need_mass=return_page_mass)
    total_q, hq, d = q.shape[0], pre.hq, pre.d
    out = check_out("out", out, (total_q, hq, d), torch.float32, q.device)
    lse = check_out("lse", lse, (total_q, hq), torch.float32, q.device)

    if resolve_backend(backend, q, kv_pool) == "torch":
        o, row_lse, mass = _paged_prefill_torch(
            q, kv_pool, page_table, qo_indptr, scale=pre.scale, causal=bool(causal),
            sliding_window=sliding_window, cap=pre.cap, want_out=True, mass_lse=None,
            want_mass=return_page_mass, first_lane=first_lane)
        out.copy_(o)
        lse.copy_(row_lse)
        return PrefillOutput(out, lse, mass)

    if q.stride(-1) != 1:
        q = q.contiguous()
    out_k = out if out.stride(-1) == 1 else torch.empty(total_q, hq, d, dtype=torch.float32,
                                                        device=q.device)
    if pre.q_items.shape[0] > 0:
        _prefill_fwd_kernel[(pre.q_items.shape[0], hq)](
            q, kv_pool, pre.q_items, *pre.tables, out_k, lse,
            kv_pool.shape[0], kv_pool.shape[2], pre.group, d, pre.scale, pre.window,
            q.stride(0), q.stride(1),
            kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
            out_k.stride(0), out_k.stride(1), lse.stride(0), lse.stride(1),
            **pre.common,
        )
    if out_k.data_ptr() != out.data_ptr():
        out.copy_(out_k)
    mass = _launch_mass(q, kv_pool, page_table, lse, pre) if return_page_mass else None
    return PrefillOutput(out, lse, mass)


def _launch_mass(q, kv_pool, page_table, lse, pre: _Prepared) -> torch.Tensor:
    hkv, page_size, d = kv_pool.shape[3], kv_pool.shape[2], q.shape[2]
    mass = torch.zeros(page_table.indices.numel(), hkv, dtype=torch.float32, device=q.device)
    if pre.kv_items.shape[0] > 0:
        _prefill_mass_kernel[(pre.kv_items.shape[0], hkv)](
            q, kv_pool, pre.kv_items, *pre.tables, lse, mass,
            kv_pool.shape[0], page_size, pre.group, d, pre.scale, pre.window,
            q.stride(0), q.stride(1),
            kv_pool.stride(0), kv_pool.stride(2), kv_pool.stride(3),
            lse.stride(0), lse.stride(1), mass.stride(0),
            **pre.common,
        )
    return mass


def paged_prefill_mass(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: PageTable,
    qo_indptr: torch.Tensor,
    lse: torch.Tensor,
    *,
    sm_scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    validate: bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
    first_lane: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Page mass of a chunk normalised by a given LSE (pass 2 of :func:`paged_prefill` alone).

    When a chunk's attention is split over several page sets (hot pages in one pool, fetched
    pages in another) and the partial states are merged, each page's share of the attention is
    ``exp(s - lse_merged)``, which no partial call knows; this recomputes the scores of one
    page set and normalises them by the merged ``lse``.

    Args:
        q, kv_pool, page_table, qo_indptr, sm_scale, causal, sliding_window, softcap: as in
            :func:`paged_prefill` for this page set.
        lse: ``[total_q, H_q]`` fp32 LSE to normalise by (``-inf`` rows contribute nothing).
        first_lane, block_m, block_n, config: as in :func:`paged_prefill`.

    Returns:
        ``[nnz, H_kv]`` fp32 mass aligned with ``page_table.indices``.
    """
    pre = _prepare(q, kv_pool, page_table, qo_indptr, sm_scale=sm_scale, causal=causal,
                   sliding_window=sliding_window, softcap=softcap, validate=validate,
                   block_m=block_m, block_n=block_n, config=config, first_lane=first_lane,
                   need_mass=True)
    check_tensor("lse", lse, shape=(q.shape[0], pre.hq), dtypes=(torch.float32,),
                 device=q.device)
    if resolve_backend(backend, q, kv_pool) == "torch":
        return _paged_prefill_torch(
            q, kv_pool, page_table, qo_indptr, scale=pre.scale, causal=bool(causal),
            sliding_window=sliding_window, cap=pre.cap, want_out=False, mass_lse=lse,
            want_mass=True, first_lane=first_lane)[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    return _launch_mass(q, kv_pool, page_table, lse, pre)
