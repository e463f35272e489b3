"""The key sketch: every page's keys quantized to a few bits per channel, kept in HBM, scored
against a decode query to find the pages that query needs.

Quest's bound (:mod:`.score`) ranks a page by ``sum_d max(q_d kmax_d, q_d kmin_d)``: for small
head dims and pages of unrelated tokens it is too loose to single out the page a reasoning step
needs. The sketch keeps, per page and KV head, every key of the page quantized per channel into
a range ``[kmin, kmax]`` given per metadata row -- the page's own Quest range (tightest), or one
range per KV head and channel shared by every page (the runtime's choice: the key tier is then
the codes alone, ``bits / 32`` of 16-bit K+V, 12.5% at 4 bits):

    code[j, c] = round((k[j, c] - kmin[c]) / (kmax[c] - kmin[c]) * L),   L = 2**bits - 1
    k_hat[j, c] = kmin[c] + code[j, c] * (kmax[c] - kmin[c]) / L

(A smaller tier scores *projected* keys with the same kernel: ``D`` is then the projection's rank,
the codes are of ``basis^T k`` and the query is ``basis^T q``; see
:func:`tierattn.runtime.importance.key_basis`.)

and scores the page from the estimated logits ``s_gj = softcap(sm_scale q_g . k_hat_j)`` of the
``G`` query heads of the KV head's group and the page's ``P`` keys, reduced one of two ways:

- ``reduce="max"``: the largest logit ``max_{g, j} s_gj`` -- the page holding the single best
  key (a needle);
- ``reduce="lse"``: ``log sum_{g, j} exp(s_gj)``, the log of the page's unnormalized attention
  mass summed over the group's heads -- an estimate of how much of the softmax the page takes,
  which also counts a page whose mass is spread over many keys (real text).

Layout: ``codes [num_meta, H_kv, P, W]`` uint8 with ``W = D * bits / 8`` bytes per key. Byte
``w`` of a key holds the codes of channels ``w, w + W, w + 2W, ...`` at bit offsets
``0, bits, 2 bits, ...`` (channel-blocked packing: a kernel reads a ``[P, W]`` byte tile and
dots each bit-plane with a contiguous slice of the query).

Kernel (:func:`sketch_score`): ``q . k_hat_j = q . kmin + sum_c code[j, c] (q_c step_c)`` with
``step = (kmax - kmin) / L``, so per (entry, KV head) the ``G`` query heads give
``base[g] = q_g . kmin`` and ``qs[g, c] = q_g[c] step[c]`` (both from the metadata row, read once
per group). The ``[P, W]`` byte tile is read once and split into its ``8 / bits`` bit-planes,
``code_i = (byte >> bits i) & L`` for the channels ``i W .. i W + W - 1``; laid side by side
(plane-major) they line up with ``qs``, and ``base + codes . qs`` is reduced over the page's keys
and the group's heads (``lse`` online: a running max and a rescaled sum, as flash attention
does). ``sm_scale`` is folded into ``q`` once. One program per (sequence, KV head, split),
streaming its share of the row in tiles of ``BLOCK_E`` entries and ``BLOCK_P`` keys, like
:mod:`.score`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierattn.errors import KernelInputError

from ._common import (
    _softcap,
    FLOAT_DTYPES,
    Backend,
    check_num_splits,
    check_out,
    check_sm_scale,
    check_softcap,
    check_tensor,
    next_pow2,
    resolve_backend,
    triton_interpreting,
)
from .page_table import PageTable
from .score import auto_score_splits, check_metadata_inputs
from .tuning import check_config

__all__ = ["SKETCH_BITS", "SKETCH_REDUCES", "project_queries", "quantize_keys", "sketch_bytes",
           "sketch_score", "sketch_score_reference", "sketch_width", "unpack_keys"]

#: code widths the sketch supports
SKETCH_BITS = (2, 4, 8)
#: how a page's logits become its score: the largest, or the log of their exp-sum (page mass)
SKETCH_REDUCES = ("max", "lse")
#: most metadata rows per tile; fewer when ``G * P * D`` is large.
MAX_BLOCK_E = 16
#: target size of the ``[BLOCK_E, G, BLOCK_P, D]`` product tile (registers on GPU).
TILE_ELEMENTS = 8192
#: the same under the interpreter, where a tile costs its op count, not its registers.
INTERPRET_MAX_BLOCK_E, INTERPRET_TILE_ELEMENTS = 64, 1 << 17


@triton.jit
def _sketch_score_kernel(
    q_ptr, codes_ptr, kmin_ptr, kmax_ptr, indices_ptr, row_start_ptr, row_count_ptr, out_ptr,
    basis_ptr,
    num_meta, group, page_size, width, head_dim_q,
    stride_qb, stride_qh, stride_qd,
    stride_bh, stride_bd, stride_br,
    stride_c_row, stride_c_head, stride_c_p, stride_c_w,
    stride_kmin_row, stride_kmin_head, stride_kmin_d,
    stride_kmax_row, stride_kmax_head, stride_kmax_d,
    stride_out_e, stride_out_h,
    sm_scale,
    BITS: tl.constexpr, LEVELS: tl.constexpr, PLANES: tl.constexpr, SOFTCAP: tl.constexpr,
    REDUCE_LSE: tl.constexpr, HAS_BASIS: tl.constexpr, BLOCK_DQ: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr,
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

    o_e = tl.arange(0, BLOCK_E)
    o_g = tl.arange(0, BLOCK_G)
    o_p = tl.arange(0, BLOCK_P)
    o_w = tl.arange(0, BLOCK_W)  # byte of a key
    o_i = tl.arange(0, PLANES)  # bit-plane
    # lane x of the plane-major channel axis holds plane x // BLOCK_W, byte x % BLOCK_W: channel
    # (x // BLOCK_W) * W + x % BLOCK_W, or nothing when x % BLOCK_W >= W
    o_x = tl.arange(0, PLANES * BLOCK_W)
    o_xw = o_x % BLOCK_W
    o_c = (o_x // BLOCK_W).to(tl.int64) * width + o_xw
    m_x = o_xw < width
    m_g = o_g < group
    m_w = o_w < width
    o_qh = i_h * group + o_g  # [BLOCK_G] query heads of this group

    if HAS_BASIS:  # q through this KV head's basis [D_q, rank], a chunk of D_q at a time
        b_q = tl.zeros([BLOCK_G, PLANES * BLOCK_W], dtype=tl.float32)
        for d0 in range(0, head_dim_q, BLOCK_DQ):
            o_d = d0 + tl.arange(0, BLOCK_DQ)
            m_d = o_d < head_dim_q
            p_q = q_ptr + i_b * stride_qb + o_qh[:, None] * stride_qh + o_d[None, :] * stride_qd
            b_qd = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            p_b = basis_ptr + i_h * stride_bh + o_d[:, None].to(tl.int64) * stride_bd \
                + o_c[None, :] * stride_br
            b_bd = tl.load(p_b, mask=m_d[:, None] & m_x[None, :], other=0.0).to(tl.float32)
            b_q += tl.sum(b_qd[:, :, None] * b_bd[None, :, :], axis=1)  # [BG, BX]
    else:
        p_q = q_ptr + i_b * stride_qb + o_qh[:, None] * stride_qh + o_c[None, :] * stride_qd
        b_q = tl.load(p_q, mask=m_g[:, None] & m_x[None, :], other=0.0).to(tl.float32)
    b_q = b_q * sm_scale  # logits in softmax units from here on

    for e0 in range(e_begin, e_end, BLOCK_E):
        m_e = (e0 + o_e) < e_end
        b_id = tl.load(indices_ptr + row_start + e0 + o_e, mask=m_e, other=0).to(tl.int64)
        # an out-of-range metadata row reads nothing and scores -inf (validate=True reports it)
        m_id = m_e & (b_id >= 0) & (b_id < num_meta)
        m_k = m_id[:, None] & m_x[None, :]
        p_kmin = kmin_ptr + b_id[:, None] * stride_kmin_row + i_h * stride_kmin_head \
            + o_c[None, :] * stride_kmin_d
        p_kmax = kmax_ptr + b_id[:, None] * stride_kmax_row + i_h * stride_kmax_head \
            + o_c[None, :] * stride_kmax_d
        b_kmin = tl.load(p_kmin, mask=m_k, other=0.0).to(tl.float32)  # [BE, BX]
        b_kmax = tl.load(p_kmax, mask=m_k, other=0.0).to(tl.float32)  # [BE, BX]
        b_step = (b_kmax - b_kmin) / LEVELS
        b_base = tl.sum(b_q[None, :, :] * b_kmin[:, None, :], axis=2)  # [BE, BG] q . kmin
        b_qs = b_q[None, :, :] * b_step[:, None, :]  # [BE, BG, BX] q_c * step_c

        b_best = tl.full([BLOCK_E], float("-inf"), dtype=tl.float32)  # running max
        b_sum = tl.zeros([BLOCK_E], dtype=tl.float32)  # sum of exp(logit - b_best) (lse)
        p_row = codes_ptr + b_id * stride_c_row + i_h * stride_c_head  # [BE]
        for p0 in range(0, page_size, BLOCK_P):
            m_p = (p0 + o_p) < page_size
            p_c = p_row[:, None, None] + (p0 + o_p)[None, :, None].to(tl.int64) * stride_c_p \
                + o_w[None, None, :] * stride_c_w
            m_c = m_id[:, None, None] & m_p[None, :, None] & m_w[None, None, :]
            b_byte = tl.load(p_c, mask=m_c, other=0).to(tl.int32)  # [BE, BP, BW], read once
            b_code = (b_byte[:, :, None, :] >> (o_i * BITS)[None, None, :, None]) & LEVELS
            b_code = tl.reshape(b_code, (BLOCK_E, BLOCK_P, PLANES * BLOCK_W)).to(tl.float32)
            b_s = tl.sum(b_code[:, None, :, :] * b_qs[:, :, None, :], axis=3)  # [BE, BG, BP]
            b_s = b_s + b_base[:, :, None]
            if SOFTCAP > 0:
                b_s = _softcap(b_s, SOFTCAP)
            b_s = tl.where(m_g[None, :, None] & m_p[None, None, :], b_s, float("-inf"))
            # every tile holds a real key and head, so its max is finite: no inf - inf below
            b_new = tl.maximum(b_best, tl.max(tl.max(b_s, axis=2), axis=1))
            if REDUCE_LSE:
                b_p = tl.exp(b_s - b_new[:, None, None])
                b_sum = b_sum * tl.exp(b_best - b_new) + tl.sum(tl.sum(b_p, axis=2), axis=1)
            b_best = b_new
        if REDUCE_LSE:
            b_best = b_best + tl.log(b_sum)
        b_score = tl.where(m_id, b_best, float("-inf"))
        p_out = out_ptr + (row_start + e0 + o_e) * stride_out_e + i_h * stride_out_h
        tl.store(p_out, b_score, mask=m_e)


def sketch_width(head_dim: int, bits: int) -> int:
    """Bytes per key of a ``head_dim`` head at ``bits`` per channel."""
    if bits not in SKETCH_BITS:
        raise KernelInputError(f"bits={bits!r} is not one of {SKETCH_BITS}.")
    if (head_dim * bits) % 8:
        raise KernelInputError(
            f"head dim {head_dim}: at bits={bits} a key is not a whole number of bytes (D * bits "
            "must be a multiple of 8); use another bits.")
    return head_dim * bits // 8


def sketch_bytes(page_size: int, num_kv_heads: int, head_dim: int, bits: int) -> int:
    """Bytes one page's sketch codes take (without the Quest metadata they share)."""
    return page_size * num_kv_heads * sketch_width(head_dim, bits)


def quantize_keys(keys: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, *,
                  bits: int) -> torch.Tensor:
    """Codes of ``keys [n, P, H_kv, D]`` in the per-(page, head, channel) ranges ``kmin``,
    ``kmax [n, H_kv, D]``: ``[n, H_kv, P, W]`` uint8 (on the keys' device, no host sync)."""
    n, p, hkv, d = keys.shape
    w = sketch_width(d, bits)
    levels = (1 << bits) - 1
    lo, hi = kmin.float()[:, :, None, :], kmax.float()[:, :, None, :]
    k = keys.float().permute(0, 2, 1, 3)  # [n, H_kv, P, D]
    span = hi - lo
    scaled = torch.where(span > 0, (k - lo) / torch.where(span > 0, span, 1.0), 0.0)
    code = torch.round(scaled * levels).clamp_(0, levels).to(torch.int32)
    planes = code.view(n, hkv, p, 8 // bits, w)  # channel i * W + w -> plane i, byte w
    shifts = torch.arange(8 // bits, device=keys.device, dtype=torch.int32) * bits
    packed = (planes << shifts[:, None]).sum(dim=3)
    return packed.to(torch.uint8)


def unpack_keys(codes: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, *,
                bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dequantized keys ``k_hat [n, H_kv, P, D]`` of ``codes [n, H_kv, P, W]``."""
    n, hkv, p, w = codes.shape
    levels = (1 << bits) - 1
    shifts = torch.arange(8 // bits, device=codes.device, dtype=torch.int32) * bits
    code = (codes.to(torch.int32)[:, :, :, None, :] >> shifts[:, None]) & levels
    code = code.reshape(n, hkv, p, w * (8 // bits)).to(dtype)
    lo, hi = kmin.to(dtype)[:, :, None, :], kmax.to(dtype)[:, :, None, :]
    return lo + code * (hi - lo) / levels


def _logits(q: torch.Tensor, k_hat: torch.Tensor, sm_scale: float, softcap: float
            ) -> torch.Tensor:
    """``[n, H_kv, G, P]`` logits ``softcap(sm_scale q_g . k_hat_j)`` of queries ``q [n, H_kv,
    G, D]`` against keys ``k_hat [n, H_kv, P, D]``."""
    s = torch.einsum("nhgd,nhpd->nhgp", q * sm_scale, k_hat)
    return s.div_(softcap).tanh_().mul_(softcap) if softcap else s


def _reduce(logits: torch.Tensor, reduce: str) -> torch.Tensor:
    """``[n, H_kv]`` score of ``[n, H_kv, G, P]`` logits over the group's heads and the keys."""
    flat = logits.flatten(2)
    return flat.logsumexp(dim=2) if reduce == "lse" else flat.amax(dim=2)


def sketch_score_reference(q: torch.Tensor, codes: torch.Tensor, kmin: torch.Tensor,
                           kmax: torch.Tensor, page_table: PageTable, *, bits: int,
                           reduce: str = "max", sm_scale: float | None = None,
                           softcap: float | None = None,
                           compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-torch sketch score: ``[nnz, H_kv]`` score of each listed metadata row (``-inf`` for
    entries outside every row), one row at a time.

    Args:
        q: ``[B, H_q, D]`` decode query.
        codes: ``[num_meta, H_kv, P, W]`` uint8 (:func:`quantize_keys`); every listed page is
            full (``P`` keys).
        kmin, kmax: ``[num_meta, H_kv, D]`` the ranges the codes were made in.
        page_table: one row per sequence listing metadata rows.
        bits: the codes' width.
        reduce, sm_scale, softcap: as :func:`sketch_score`.
        compute_dtype: default fp32 (fp64 for fp64 inputs).
    """
    batch, hq, d = q.shape
    hkv = kmin.shape[1]
    group = hq // hkv
    scale, cap = check_sm_scale(sm_scale, d), check_softcap(softcap)
    dt = compute_dtype or torch.promote_types(q.dtype, torch.float32)
    out = torch.full((page_table.indices.numel(), hkv), float("-inf"), dtype=dt,
                     device=q.device)
    starts, counts = page_table.row_start.tolist(), page_table.row_count.tolist()
    for b, (start, count) in enumerate(zip(starts, counts)):
        if count == 0:
            continue
        ids = page_table.indices[start:start + count].long()
        k_hat = unpack_keys(codes[ids], kmin[ids], kmax[ids], bits=bits, dtype=dt)  # [n,H,P,D]
        qb = q[b].to(dt).view(1, hkv, group, d).expand(count, -1, -1, -1)
        out[start:start + count] = _reduce(_logits(qb, k_hat, scale, cap), reduce)
    return out


def _default_config(group: int, page_size: int, head_dim: int, bits: int) -> dict[str, int]:
    """Tiles of an unconfigured call: a ``[BLOCK_E, G, BLOCK_P, D]`` product of ~TILE_ELEMENTS
    (``D`` padded per bit-plane), whole pages when they fit."""
    tile, most_e = ((INTERPRET_TILE_ELEMENTS, INTERPRET_MAX_BLOCK_E) if triton_interpreting()
                    else (TILE_ELEMENTS, MAX_BLOCK_E))
    per_key = next_pow2(group) * (8 // bits) * next_pow2(sketch_width(head_dim, bits))
    block_p = max(1, min(next_pow2(page_size), tile // per_key))
    block_p = 1 << (block_p.bit_length() - 1)  # a power of two
    block_e = max(1, min(most_e, tile // (per_key * block_p)))
    return {"block_e": 1 << (block_e.bit_length() - 1), "block_p": block_p}


def _check_sketch_inputs(q, codes, kmin, kmax, page_table, bits, reduce, basis):
    if basis is not None:
        check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
        check_tensor("basis", basis, ndim=3, dtypes=FLOAT_DTYPES, device=q.device)
        check_tensor("kmin", kmin, ndim=3, dtypes=(q.dtype,), device=q.device)
        if basis.shape[0] != kmin.shape[1] or basis.shape[1] != q.shape[2] or \
                basis.shape[2] != kmin.shape[2] or basis.shape[2] > q.shape[2]:
            raise KernelInputError(
                f"basis must be [H_kv={kmin.shape[1]}, D={q.shape[2]}, rank={kmin.shape[2]}] "
                f"(q's head dim to the codes' channels, rank <= D; key_basis makes one), got "
                f"{list(basis.shape)}.")
        q = q[..., :basis.shape[2]]  # the projected query's shape, for the checks below
    batch, _, d, num_meta, hkv, group = check_metadata_inputs("sketch_score", q, kmin, kmax,
                                                              page_table)
    if reduce not in SKETCH_REDUCES:
        raise KernelInputError(f"reduce={reduce!r} is not one of {SKETCH_REDUCES}: 'max' for "
                               "the page's best logit, 'lse' for its attention mass.")
    check_tensor("codes", codes, ndim=4, dtypes=(torch.uint8,), device=q.device)
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SKETCH_BITS:
        raise KernelInputError(f"bits={bits!r} is not one of {SKETCH_BITS}.")
    width = sketch_width(d, bits)
    if codes.shape[0] != num_meta or codes.shape[1] != hkv or codes.shape[3] != width:
        raise KernelInputError(
            f"codes must have shape [num_meta={num_meta}, H_kv={hkv}, P, W={width}] (W = D * "
            f"bits / 8 = {d} * {bits} / 8, from quantize_keys), got {list(codes.shape)}.")
    if codes.shape[2] < 1:
        raise KernelInputError("codes has page size 0; pages hold at least one key.")
    return batch, d, num_meta, hkv, group, codes.shape[2]


def project_queries(q: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Queries ``[m, H_q, D]`` in a projected key sketch's channels, ``[m, H_q, rank]`` in their
    dtype: query head ``h`` through its KV head ``h // G``'s basis ``[H_kv, D, rank]`` (one op;
    :func:`sketch_score` with ``basis`` does this inside the kernel)."""
    m, hq, d = q.shape
    qg = q.view(m, basis.shape[0], hq // basis.shape[0], d)
    return torch.einsum("bkgd,kdr->bkgr", qg, basis.to(q.dtype)).reshape(m, hq, -1)


def _sketch_score_torch(q: torch.Tensor, codes: torch.Tensor, kmin: torch.Tensor,
                        kmax: torch.Tensor, page_table: PageTable, *, bits: int, reduce: str,
                        sm_scale: float, softcap: float) -> torch.Tensor:
    """The torch backend: every entry at once (no loop over rows, no host read), in fp32;
    like the kernel, an out-of-range metadata id reads nothing and scores -inf. ``q`` is
    already in the codes' channels."""
    batch, hq, d = q.shape
    num_meta, hkv = kmin.shape[0], kmin.shape[1]
    ids = page_table.indices.long()
    nnz = ids.numel()
    if batch == 0 or nnz == 0:
        return torch.full((nnz, hkv), float("-inf"), device=q.device)
    row, listed = page_table.entry_rows()
    valid = listed & (ids >= 0) & (ids < num_meta)
    safe = torch.where(valid, ids, 0)
    k_hat = unpack_keys(codes[safe], kmin[safe], kmax[safe], bits=bits)  # [nnz, H_kv, P, D]
    qe = q.float()[row].view(nnz, hkv, hq // hkv, d)
    score = _reduce(_logits(qe, k_hat, sm_scale, softcap), reduce)
    return score.masked_fill_(~valid[:, None], float("-inf"))


def sketch_score(
    q: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_table: PageTable,
    *,
    bits: int,
    reduce: str = "max",
    sm_scale: float | None = None,
    softcap: float | None = None,
    num_splits: int | str = "auto",
    out: torch.Tensor | None = None,
    validate: bool = True,
    config: dict[str, int] | None = None,
    basis: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Sketch estimate of each listed page's best logit or attention mass.

    For each entry of a row (a metadata row ``m``) and KV head ``h``: the logits
    ``s_gj = softcap(sm_scale q_g . k_hat_j)`` of the ``G = H_q/H_kv`` query heads of the group
    (``h G .. h G + G - 1``) against the page's ``P`` dequantized keys
    ``k_hat[m, h, j] = kmin + code * (kmax - kmin) / (2**bits - 1)`` (see the module docstring
    for the packing), reduced to ``max_{g, j} s_gj`` or ``log sum_{g, j} exp(s_gj)``. Unlike
    Quest's bound it is an estimate, not a bound: the error of one raw dot product is at most
    ``sum_c |q_c| step_c / 2``.

    Args:
        q: ``[B, H_q, D]`` decode query (post-RoPE), fp16/bf16/fp32.
        codes: ``[num_meta, H_kv, P, W]`` uint8, ``W = D * bits / 8``, from
            :func:`quantize_keys`; every listed page is full (``P`` keys).
        kmin, kmax: ``[num_meta, H_kv, D]`` (same dtype as ``q``), the ranges the codes were
            made in: each page's own (the Quest metadata) or one shared range expanded over
            the rows (stride 0).
        page_table: one row per sequence (``R = B``) whose ``indices`` are metadata rows;
            ``last_page_len`` is not read.
        bits: the codes' width, one of :data:`SKETCH_BITS`.
        reduce: ``"max"`` (the page's largest logit: a top-k by it finds the page of the single
            best key) or ``"lse"`` (the log of the page's exp-summed logits over the group's
            heads: its unnormalized attention mass, which ranks pages as the softmax weighs
            them). ``max`` is monotonic in ``sm_scale`` and ``softcap``; ``lse`` is not, so
            pass the attention's own.
        sm_scale: logit scale (default ``q``'s head dim ``** -0.5``: with ``basis``, the full
            ``D_q``'s, the attention's; a query projected outside and passed without a scale
            would get ``rank ** -0.5`` -- pass the attention's own).
        softcap: optional logit softcap ``c``: logits become ``c * tanh(s / c)``.
        num_splits: programs per (sequence, KV head) sharing a row's entries, an int >= 1 or
            ``"auto"`` (host sizes only, no sync); results do not depend on it.
        out: optional ``[nnz, H_kv]`` fp32 buffer.
        validate: check that every row's entries lie inside ``indices`` and every listed id is
            in ``0..num_meta-1`` (one host sync on CUDA). With False, out-of-range ids read
            nothing and score ``-inf``.
        config: launch parameters ``block_e`` (entries per tile), ``block_p`` (keys per tile)
            and ``num_warps``, powers of two; defaults from ``TILE_ELEMENTS``.
        basis: optional ``[H_kv, D_q, D]`` projection of a low-rank sketch: ``q`` is then
            ``[B, H_q, D_q]`` and each query head goes through its KV head's basis inside the
            kernel (fp32), ``basis^T q``, before scoring the ``D`` projected channels of the
            codes (:func:`tierattn.runtime.importance.key_basis`; :func:`project_queries` outside).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (vectorised, in fp32).

    Returns:
        ``[nnz, H_kv]`` fp32 scores aligned with ``page_table.indices``; entries that belong to
        no row are ``-inf``.
    """
    batch, d, num_meta, hkv, group, page_size = _check_sketch_inputs(
        q, codes, kmin, kmax, page_table, bits, reduce, basis)
    # the default scale is the attention's: of the query's own head dim
    scale, cap = check_sm_scale(sm_scale, q.shape[2]), check_softcap(softcap)
    splits = check_num_splits(num_splits)
    config = check_config("sketch", config)
    nnz = page_table.indices.numel()
    out = check_out("out", out, (nnz, hkv), torch.float32, q.device)
    if validate:
        page_table.validate(num_meta, None, ids="metadata rows of codes/kmin/kmax")

    if resolve_backend(backend, q, codes, kmin, kmax) == "torch":
        qp = q if basis is None else project_queries(q.float(), basis.float())
        out.copy_(_sketch_score_torch(qp, codes, kmin, kmax, page_table, bits=bits,
                                      reduce=reduce, sm_scale=scale, softcap=cap))
        return out

    out.fill_(float("-inf"))
    if splits is None:
        splits = auto_score_splits(batch, hkv, nnz, q.device)
    cfg = {**_default_config(group, page_size, d, bits), **config}
    if batch > 0 and hkv > 0 and nnz > 0 and num_meta > 0:
        width = d * bits // 8
        _sketch_score_kernel[(batch, hkv, splits)](
            q, codes, kmin, kmax, page_table.indices, page_table.row_start,
            page_table.row_count, out, basis if basis is not None else q,
            num_meta, group, page_size, width, q.shape[2],
            q.stride(0), q.stride(1), q.stride(2),
            *(basis.stride() if basis is not None else (0, 0, 0)),
            codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3),
            kmin.stride(0), kmin.stride(1), kmin.stride(2),
            kmax.stride(0), kmax.stride(1), kmax.stride(2),
            out.stride(0), out.stride(1),
            scale,
            BITS=bits, LEVELS=(1 << bits) - 1, PLANES=8 // bits, SOFTCAP=cap,
            REDUCE_LSE=reduce == "lse", HAS_BASIS=basis is not None,
            BLOCK_DQ=min(32, next_pow2(q.shape[2])),
            BLOCK_E=cfg["block_e"], BLOCK_G=next_pow2(group), BLOCK_P=cfg["block_p"],
            BLOCK_W=next_pow2(width),
            **({"num_warps": cfg["num_warps"]} if "num_warps" in cfg else {}),
        )
    return out
