"""Recall selection in one launch: per-head page scores -> one rank per page -> the ``k`` best
pages of each sequence -> their table entries, and which of them a layer-ahead prefetch already
staged.

``attend="topk"`` scores every cold candidate page per KV head (the key sketch, or Quest's
bound) and must turn that into a staged table of ``k`` pages per sequence. Done in torch that is
~19 small launches per layer and step (a log-softmax, a logsumexp, a top-k, four gathers, the
hit test against the previous selection, the device counters); here it is one program per
sequence:

1. **rank** each candidate ``i`` from its per-head scores ``s[i, h]`` (``-inf``: padding):

   - ``reduce="max"``: ``max_h s[i, h]`` (Quest, or a sketch of largest logits);
   - ``reduce="lse"`` (scores are log attention masses): ``log sum_h share_h(i)``, with
     ``share_h(i) = exp(s[i, h]) / sum_j exp(s[j, h])`` the page's share of head ``h``'s mass
     over the row's candidates -- the pages that hold the most of the heads' attention between
     them. A head with no finite score in the row adds nothing.

2. **select** the ``k`` highest ranks, best first; ties go to the lower candidate index and
   padding comes last (a row with fewer than ``k`` candidates lists its real ones first). On the
   GPU this is one sort of ``(rank, index)`` packed in int64 keys.

3. **gather** each selected candidate's logical page (``cols``), metadata row (``lse``), first
   lane and slot in every lower tier (``slots``), and its **staging row** ``dst``: with no
   previous selection, ``b * k + j``; with one (``prev_cols [B, k]``, staged in rows
   ``b * k + j'`` by a layer-ahead prefetch), a page it holds is a *hit* and reads its row there,
   the others go to the second half, ``B * k + b * k + j``; ``src`` is ``slots`` with the hits
   masked out (-1: nothing to copy).

4. **count** on the device (optional): hits into ``hits [1]``, pages left to copy per lower tier
   into ``recalled [T]``.

Nothing is read back to the host: the step stays capturable in a CUDA graph. A row of more
than :data:`MAX_BLOCK_N` candidates (a 256K-token context of 16-token pages) is selected by the
torch path instead (the same result, in torch ops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tierattn.errors import KernelInputError

from ._common import Backend, check_out, check_tensor, next_pow2, resolve_backend

__all__ = ["PageSelection", "SELECT_REDUCES", "rank_pages", "select_pages",
           "select_pages_reference"]

#: how per-head scores become one rank per page
SELECT_REDUCES = ("max", "lse")


#: most candidates per row one program sorts (a 1M-token context of 16-token pages has 64K);
#: longer rows go through the torch path
MAX_BLOCK_N = 16384


def _num_warps(block_n: int) -> int:
    """Warps for a row of ``block_n`` keys: ~32 int64 keys per thread at most."""
    return max(4, min(16, block_n // 1024))


@dataclass
class PageSelection:
    """The ``k`` pages selected per sequence (entry ``[b, j]``, best first; padding past a row's
    candidates: ``cols`` -1, ``slots``/``src`` -1).

    Attributes:
        cols: int64 ``[B, k]`` logical page of each entry.
        slots: int32 ``[T, B, k]`` its slot in lower tier ``t + 1`` (-1: not there).
        src: int32 ``[T, B, k]`` the same with the prefetch's hits masked (-1): what to copy.
        lse: int32 ``[B, k]`` its metadata row (the candidates' ``lse`` entry).
        first: int32 ``[B, k]`` its first lane (None without ``cand_first``).
        dst: int32 ``[B, k]`` its staging row (see the module docstring).
    """

    cols: torch.Tensor
    slots: torch.Tensor
    src: torch.Tensor
    lse: torch.Tensor
    first: torch.Tensor | None
    dst: torch.Tensor


@triton.jit
def _logaddexp(a, b):
    m = tl.maximum(a, b)
    ref = tl.where(m == float("-inf"), 0.0, m)
    return ref + tl.log(tl.exp(a - ref) + tl.exp(b - ref))


@triton.jit
def _select_kernel(
    score_ptr, cols_ptr, lse_ptr, slots_ptr, first_ptr, prev_ptr,
    out_cols_ptr, out_slots_ptr, out_src_ptr, out_lse_ptr, out_first_ptr, out_dst_ptr,
    hits_ptr, recalled_ptr,
    batch, n, k, num_heads, num_tiers,
    REDUCE_LSE: tl.constexpr, HAS_FIRST: tl.constexpr, HAS_PREV: tl.constexpr,
    COUNT_HITS: tl.constexpr, COUNT_RECALLED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < n
    row = score_ptr + i_b * n * num_heads + o_n.to(tl.int64) * num_heads

    # 1. rank: one pass per head (a [BLOCK_N] column at a time keeps registers flat)
    rank = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for h in range(0, num_heads):
        s = tl.load(row + h, mask=m_n, other=float("-inf")).to(tl.float32)
        if REDUCE_LSE:
            mx = tl.max(s, axis=0)
            ref = tl.where(mx == float("-inf"), 0.0, mx)
            lse_h = ref + tl.log(tl.sum(tl.exp(s - ref), axis=0))
            # a dead head (every score -inf, so lse_h too) shares nothing
            share = tl.where(s > float("-inf"), s - tl.where(lse_h == float("-inf"), 0.0, lse_h),
                             float("-inf"))
            rank = _logaddexp(rank, share)
        else:
            rank = tl.maximum(rank, s)

    rank = tl.where(rank == rank, rank, float("-inf"))  # a NaN score ranks like padding

    # 2. select: sort (rank, index) keys, best first; ties to the lower index (lanes past n rank
    # -inf like padding and come after it: their index is higher)
    bits = tl.where(rank == 0.0, 0.0, rank).to(tl.int32, bitcast=True)  # -0.0 ties +0.0
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the float's value
    key = (order.to(tl.int64) << 32) | (BLOCK_N - 1 - o_n).to(tl.int64)
    key = tl.sort(key, descending=True)
    picked = BLOCK_N - 1 - key.to(tl.int32)  # the low word: BLOCK_N - 1 - index < 2**31
    # the first k sorted entries, through the output row (a register vector cannot be sliced)
    tl.store(out_dst_ptr + i_b * k + o_n, picked, mask=o_n < k)
    tl.debug_barrier()
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < k
    idx = tl.load(out_dst_ptr + i_b * k + o_k, mask=m_k, other=0).to(tl.int64)
    tl.debug_barrier()

    # 3. gather the entries, then their staging rows
    at = i_b * n + idx
    cols = tl.load(cols_ptr + at, mask=m_k, other=-1)
    real = m_k & (cols >= 0)
    out = i_b * k + o_k
    tl.store(out_cols_ptr + out, cols, mask=m_k)
    tl.store(out_lse_ptr + out, tl.load(lse_ptr + at, mask=m_k, other=0), mask=m_k)
    if HAS_FIRST:
        tl.store(out_first_ptr + out, tl.load(first_ptr + at, mask=m_k, other=0), mask=m_k)
    hit = tl.zeros([BLOCK_K], dtype=tl.int1)
    if HAS_PREV:
        pos = tl.zeros([BLOCK_K], dtype=tl.int32)
        for c0 in range(0, k, CHUNK):  # the previous selection, a chunk at a time
            o_c = c0 + tl.arange(0, CHUNK)
            prev = tl.load(prev_ptr + i_b * k + o_c, mask=o_c < k, other=-1)
            eq = (cols[:, None] == prev[None, :]) & (prev[None, :] >= 0)  # [BLOCK_K, CHUNK]
            hit = hit | (tl.sum(eq.to(tl.int32), axis=1) > 0)
            pos += tl.sum(tl.where(eq, o_c[None, :], 0), axis=1)
        hit = hit & real
        dst = tl.where(hit, i_b * k + pos, batch * k + i_b * k + o_k)
    else:
        dst = i_b * k + o_k
    tl.store(out_dst_ptr + out, dst.to(tl.int32), mask=m_k)
    for t in range(0, num_tiers):
        tier = t * batch * n
        slot = tl.load(slots_ptr + tier + at, mask=m_k, other=-1)
        dst_t = t * batch * k + out
        tl.store(out_slots_ptr + dst_t, slot, mask=m_k)
        copy = tl.where(hit, -1, slot)
        tl.store(out_src_ptr + dst_t, copy, mask=m_k)
        if COUNT_RECALLED:
            tl.atomic_add(recalled_ptr + t, tl.sum((m_k & (copy >= 0)).to(tl.int64), axis=0))

    # 4. the device counters
    if COUNT_HITS:
        tl.atomic_add(hits_ptr, tl.sum(hit.to(tl.int64), axis=0))


def rank_pages(scores: torch.Tensor, reduce: str) -> torch.Tensor:
    """``[B, n]`` rank of each candidate from per-head ``scores [B, n, H]`` (step 1 of the
    module docstring; -inf padding stays -inf, a NaN rank becomes -inf), in torch."""
    s = scores.float()
    if reduce == "max":
        rank = s.max(-1).values
    else:
        # a dead head (every score -inf) gives NaN shares: it adds nothing
        share = torch.log_softmax(s, dim=1).nan_to_num(nan=-math.inf, neginf=-math.inf)
        rank = share.logsumexp(-1)
    return rank.nan_to_num(nan=-math.inf, neginf=-math.inf)  # a NaN ranks like padding


def select_pages_reference(scores: torch.Tensor, k: int, *, reduce: str, cand_cols: torch.Tensor,
                           cand_lse: torch.Tensor, cand_slots: torch.Tensor,
                           cand_first: torch.Tensor | None = None,
                           prev_cols: torch.Tensor | None = None) -> PageSelection:
    """Plain-torch :func:`select_pages` (same selection, ties and staging rows); no counters."""
    b = scores.shape[0]
    idx = torch.sort(rank_pages(scores, reduce), dim=1, descending=True,
                     stable=True).indices[:, :k]
    cols = cand_cols.gather(1, idx)
    slots = cand_slots.gather(2, idx.expand(cand_slots.shape[0], b, k))
    iota = torch.arange(k, device=scores.device)
    first_half = (torch.arange(b, device=scores.device)[:, None] * k + iota).to(torch.int32)
    src, dst = slots, first_half
    if prev_cols is not None:
        eq = (cols[:, :, None] == prev_cols[:, None, :]) & (prev_cols[:, None, :] >= 0)
        hit = eq.any(-1) & (cols >= 0)
        pos = (eq * iota).sum(-1)
        dst = torch.where(hit, (torch.arange(b, device=scores.device)[:, None] * k + pos),
                          b * k + first_half).to(torch.int32)
        src = slots.masked_fill(hit, -1)
    return PageSelection(cols, slots, src, cand_lse.gather(1, idx),
                         cand_first.gather(1, idx) if cand_first is not None else None, dst)


def _check(scores, k, reduce, cand_cols, cand_lse, cand_slots, cand_first, prev_cols):
    check_tensor("scores", scores, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    if scores.dim() != 3:
        raise KernelInputError(f"scores must be [B, n, H_kv] per-head page scores; got "
                               f"{list(scores.shape)}.")
    b, n, _ = scores.shape
    if reduce not in SELECT_REDUCES:
        raise KernelInputError(f"reduce={reduce!r} is not one of {SELECT_REDUCES}.")
    if not isinstance(k, int) or not 1 <= k <= n:
        raise KernelInputError(f"k must be an int in [1, n={n}] (pages selected per row); "
                               f"got {k!r}.")
    dev = scores.device
    check_tensor("cand_cols", cand_cols, dtypes=(torch.int64,), device=dev)
    check_tensor("cand_lse", cand_lse, dtypes=(torch.int32,), device=dev)
    check_tensor("cand_slots", cand_slots, dtypes=(torch.int32,), device=dev)
    for name, t in (("cand_cols", cand_cols), ("cand_lse", cand_lse)):
        if tuple(t.shape) != (b, n):
            raise KernelInputError(f"{name} must be [B, n] = [{b}, {n}]; got {list(t.shape)}.")
    if cand_slots.dim() != 3 or tuple(cand_slots.shape[1:]) != (b, n):
        raise KernelInputError(f"cand_slots must be [T, B, n] = [T, {b}, {n}]; got "
                               f"{list(cand_slots.shape)}.")
    if cand_first is not None:
        check_tensor("cand_first", cand_first, dtypes=(torch.int32,), device=dev)
        if tuple(cand_first.shape) != (b, n):
            raise KernelInputError(f"cand_first must be [B, n] = [{b}, {n}]; got "
                                   f"{list(cand_first.shape)}.")
    if prev_cols is not None:
        check_tensor("prev_cols", prev_cols, dtypes=(torch.int64,), device=dev)
        if tuple(prev_cols.shape) != (b, k):
            raise KernelInputError(f"prev_cols must be the previous [B, k] = [{b}, {k}] "
                                   f"selection; got {list(prev_cols.shape)}.")


def select_pages(
    scores: torch.Tensor,
    k: int,
    *,
    reduce: str,
    cand_cols: torch.Tensor,
    cand_lse: torch.Tensor,
    cand_slots: torch.Tensor,
    cand_first: torch.Tensor | None = None,
    prev_cols: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    out_first: torch.Tensor | None = None,
    out_dst: torch.Tensor | None = None,
    hits: torch.Tensor | None = None,
    recalled: torch.Tensor | None = None,
    validate: bool = True,
    backend: Backend | None = None,
) -> PageSelection:
    """Select the ``k`` best candidate pages per sequence and write their staged table entries
    (see the module docstring for the rank, ties and staging rows).

    Args:
        scores: ``[B, n, H_kv]`` per-head score of candidate ``i`` of row ``b`` (``-inf`` past the
            row's candidates), from :func:`~tierattn.kernels.sketch_score` or
            :func:`~tierattn.kernels.quest_score` viewed per row.
        k: pages per row, ``1 <= k <= n`` (host int: the table's shape).
        reduce: ``"max"`` or ``"lse"``.
        cand_cols: int64 ``[B, n]`` logical page of each candidate (-1: padding).
        cand_lse: int32 ``[B, n]`` its metadata row.
        cand_slots: int32 ``[T, B, n]`` its slot in each of ``T`` lower tiers (-1: not there).
        cand_first: optional int32 ``[B, n]`` first lanes.
        prev_cols: optional int64 ``[B, k]``: the selection a prefetch staged in rows ``b*k+j'``.
        out_lse, out_first, out_dst: optional contiguous int32 ``[B, k]`` buffers (a staged
            table's arrays, written in place).
        hits: optional int64 ``[1]`` counter (+= hits); ``recalled``: optional int64 ``[T]``
            counter (+= pages left to copy per lower tier).
        validate: check the inputs (the runtime's hot path passes False).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"``.

    Returns:
        :class:`PageSelection` (``cols``, ``slots`` and ``src`` newly allocated; ``lse``,
        ``first``, ``dst`` the ``out_*`` buffers when given).
    """
    if validate:
        _check(scores, k, reduce, cand_cols, cand_lse, cand_slots, cand_first, prev_cols)
    elif not 1 <= k <= scores.shape[1]:  # host ints: checked even on the hot path
        raise KernelInputError(f"k must be in [1, n={scores.shape[1]}]; got {k}.")
    b, n, heads = scores.shape
    tiers = cand_slots.shape[0]
    dev = scores.device
    i32 = dict(dtype=torch.int32, device=dev)
    if validate:
        out_lse = check_out("out_lse", out_lse, (b, k), torch.int32, dev)
        out_dst = check_out("out_dst", out_dst, (b, k), torch.int32, dev)
        if cand_first is not None:
            out_first = check_out("out_first", out_first, (b, k), torch.int32, dev)
        for name, t in (("out_lse", out_lse), ("out_dst", out_dst), ("out_first", out_first)):
            if t is not None and not t.is_contiguous():
                raise KernelInputError(f"{name} must be contiguous (a table's own array).")
        for name, t, size in (("hits", hits, 1), ("recalled", recalled, tiers)):
            if t is not None:
                check_tensor(name, t, dtypes=(torch.int64,), device=dev)
                if t.numel() != size or not t.is_contiguous():
                    raise KernelInputError(f"{name} must be a contiguous int64 counter of "
                                           f"{size} entries; got {list(t.shape)}.")
    else:
        out_lse = out_lse if out_lse is not None else torch.empty(b, k, **i32)
        out_dst = out_dst if out_dst is not None else torch.empty(b, k, **i32)
        if cand_first is not None and out_first is None:
            out_first = torch.empty(b, k, **i32)
    # one program sorts a whole row: past MAX_BLOCK_N candidates the torch path does it
    if resolve_backend(backend, scores) == "torch" or next_pow2(n) > MAX_BLOCK_N:
        ref = select_pages_reference(scores, k, reduce=reduce, cand_cols=cand_cols,
                                     cand_lse=cand_lse, cand_slots=cand_slots,
                                     cand_first=cand_first, prev_cols=prev_cols)
        out_lse.copy_(ref.lse)
        out_dst.copy_(ref.dst)
        if out_first is not None:
            out_first.copy_(ref.first)
        if hits is not None and prev_cols is not None:
            hits.add_((ref.dst < b * k).sum())  # a hit reads the first half
        if recalled is not None:
            recalled.add_((ref.src >= 0).sum((1, 2)))
        return PageSelection(ref.cols, ref.slots, ref.src, out_lse, out_first, out_dst)

    cols = torch.empty(b, k, dtype=torch.int64, device=dev)
    both = torch.empty(2, tiers, b, k, **i32)  # slots, then src
    contiguous = [t.contiguous() for t in (scores, cand_cols, cand_lse, cand_slots)]
    first = cand_first.contiguous() if cand_first is not None else None
    prev = prev_cols.contiguous() if prev_cols is not None else None
    dummy = cols  # a valid pointer for the arguments a constexpr switches off
    block_k = next_pow2(k)
    _select_kernel[(b,)](
        *contiguous, first if first is not None else dummy,
        prev if prev is not None else dummy,
        cols, both[0], both[1], out_lse, out_first if out_first is not None else dummy,
        out_dst, hits if hits is not None else dummy,
        recalled if recalled is not None else dummy,
        b, n, k, heads, tiers,
        REDUCE_LSE=reduce == "lse", HAS_FIRST=first is not None, HAS_PREV=prev is not None,
        COUNT_HITS=hits is not None and prev is not None, COUNT_RECALLED=recalled is not None,
        BLOCK_N=next_pow2(n), BLOCK_K=block_k, CHUNK=min(block_k, 16),
        num_warps=_num_warps(next_pow2(n)),
    )
    return PageSelection(cols, both[0], both[1], out_lse, out_first, out_dst)
