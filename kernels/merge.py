"""LSE merge of partial attention states.

A partial state over a key set ``S`` is ``(o_S, lse_S)`` with ``lse_S = log sum_{j in S} exp(s_j)``
and ``o_S = sum_j softmax_S(s)_j v_j``. For disjoint sets the exact state of the union is

    lse = log sum_i exp(lse_i),      o = sum_i exp(lse_i - lse) o_i,

which is associative and commutative. The empty state is ``(0, -inf)``: it has weight 0 and a
merge of only empty states is empty again (never NaN). States with ``lse = +inf`` (an
overflowed score) dominate: they share the weight equally and the result has ``lse = +inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierattn.errors import KernelInputError

from ._common import Backend, check_out, check_tensor, next_pow2, resolve_backend

__all__ = ["merge_states", "merge_state", "merge_states_reference"]


@triton.jit
def _merge_kernel(
    o_ptr, lse_ptr, out_ptr, out_lse_ptr,
    num_rows, num_states, head_dim,
    stride_on, stride_or, stride_ln, stride_lr, stride_out_r,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < num_states
    m_d = o_d < head_dim

    b_lse = tl.load(lse_ptr + o_n.to(tl.int64) * stride_ln + i_r * stride_lr, mask=m_n,
                    other=float("-inf")).to(tl.float32)  # [BLOCK_N]
    b_max = tl.max(b_lse, axis=0)
    # -inf max: every state empty; +inf max: the +inf states share the weight.
    m_pinf = b_max == float("inf")
    m_ninf = b_max == float("-inf")
    b_ref = tl.where(m_pinf | m_ninf, 0.0, b_max)
    b_w = tl.where(m_pinf, tl.where(b_lse == float("inf"), 1.0, 0.0), tl.exp(b_lse - b_ref))
    b_w = tl.where(m_n, b_w, 0.0)
    b_sum = tl.sum(b_w, axis=0)
    b_den = tl.where(b_sum > 0, b_sum, 1.0)

    p_o = o_ptr + o_n.to(tl.int64)[:, None] * stride_on + i_r * stride_or + o_d[None, :]
    b_o = tl.load(p_o, mask=m_n[:, None] & m_d[None, :] & (b_w[:, None] > 0), other=0.0)
    b_out = tl.sum(b_o.to(tl.float32) * b_w[:, None], axis=0) / b_den  # [BLOCK_D]
    b_out_lse = tl.where(m_pinf | m_ninf, b_max, b_ref + tl.log(b_den))

    tl.store(out_ptr + i_r * stride_out_r + o_d, b_out, mask=m_d)
    tl.store(out_lse_ptr + i_r, b_out_lse)


def merge_states_reference(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch merge (fp32 or the input's wider dtype). ``o: [N, *, D]``, ``lse: [N, *]``."""
    acc = torch.promote_types(o.dtype, torch.float32)
    o, lse = o.to(acc), lse.to(acc)
    lse_max = lse.max(dim=0).values
    pinf = lse_max == float("inf")
    empty = lse_max == float("-inf")
    ref = torch.where(pinf | empty, torch.zeros_like(lse_max), lse_max)
    w = torch.where(pinf, (lse == float("inf")).to(acc), torch.exp(lse - ref))
    total = w.sum(dim=0)
    den = torch.where(total > 0, total, torch.ones_like(total))
    out = (w.unsqueeze(-1) * torch.where(w.unsqueeze(-1) > 0, o, 0)).sum(dim=0) / den.unsqueeze(-1)
    out_lse = torch.where(pinf | empty, lse_max, ref + torch.log(den))
    return out, out_lse


def merge_states(
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``N`` partial attention states over disjoint key sets.

    Args:
        o: ``[N, *batch, D]`` partial outputs (any float dtype; fp32 recommended).
        lse: ``[N, *batch]`` their log-sum-exps (``-inf`` marks an empty state).
        out: optional ``[*batch, D]`` fp32 buffer for the merged output.
        out_lse: optional ``[*batch]`` fp32 buffer for the merged LSE.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"``.

    Returns:
        ``(out [*batch, D] fp32, lse [*batch] fp32)``.
    """
    check_tensor("o", o, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor("lse", lse, dtypes=(torch.float32,), device=o.device)
    if o.dim() < 2 or tuple(lse.shape) != tuple(o.shape[:-1]):
        raise KernelInputError(
            f"o must be [N, *batch, D] and lse [N, *batch]; got o {list(o.shape)} and "
            f"lse {list(lse.shape)}."
        )
    if o.shape[0] < 1:
        raise KernelInputError("merge_states needs at least one state (N >= 1); got N = 0.")
    batch, d, n = tuple(o.shape[1:-1]), o.shape[-1], o.shape[0]
    out = check_out("out", out, (*batch, d), torch.float32, o.device)
    out_lse = check_out("out_lse", out_lse, batch, torch.float32, o.device)
    if resolve_backend(backend, o) == "torch":
        ref_o, ref_lse = merge_states_reference(o, lse)
        out.copy_(ref_o)
        out_lse.copy_(ref_lse)
        return out, out_lse

    rows = out_lse.numel()
    o3 = o.reshape(n, rows, d)
    if o3.stride(-1) != 1:
        o3 = o3.contiguous()
    lse2 = lse.reshape(n, rows)
    f32 = {"dtype": torch.float32, "device": o.device}
    out2 = out.view(rows, d) if out.is_contiguous() else torch.empty(rows, d, **f32)
    out_lse1 = out_lse.view(rows) if out_lse.is_contiguous() else torch.empty(rows, **f32)
    if rows > 0:
        _merge_kernel[(rows,)](
            o3, lse2, out2, out_lse1,
            rows, n, d,
            o3.stride(0), o3.stride(1), lse2.stride(0), lse2.stride(1), out2.stride(0),
            BLOCK_N=next_pow2(n), BLOCK_D=next_pow2(d),
        )
    if out2.data_ptr() != out.data_ptr():
        out.copy_(out2.view(out.shape))
    if out_lse1.data_ptr() != out_lse.data_ptr():
        out_lse.copy_(out_lse1.view(out_lse.shape))
    return out, out_lse


def merge_state(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
    *, backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial states: ``o_*: [*batch, D]``, ``lse_*: [*batch]`` -> same shapes, fp32."""
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape:
        raise KernelInputError(
            f"o_a {list(o_a.shape)} / o_b {list(o_b.shape)} and lse_a {list(lse_a.shape)} / "
            f"lse_b {list(lse_b.shape)} must match pairwise."
        )
    return merge_states(torch.stack([o_a, o_b]), torch.stack([lse_a, lse_b]), backend=backend)
