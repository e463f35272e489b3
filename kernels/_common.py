"""Shared launcher plumbing: backend choice, input validation, small host-side helpers.

Kernels in this package follow one numeric contract: every load of K/V/Q is upcast to fp32
right after it is read (the Triton interpreter computes garbage on bf16 otherwise, and on GPU
fp16/bf16 values are exact in tf32, so nothing is lost), softmax and outputs accumulate in fp32,
and every address is computed in int64.
"""

from __future__ import annotations

import os
from typing import Literal
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tierattn.errors import KernelInputError, KernelUnsupportedError

Backend = Literal["auto", "triton", "torch"]

#: dtypes accepted for K/V pools and queries.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: dtype of every page id, length and offset handed to a kernel (FlashInfer's convention).
INDEX_DTYPE = torch.int32
#: largest head dim the kernels accept (tests cover 16..256, odd sizes included).
MAX_HEAD_DIM = 256

_BACKENDS = ("auto", "triton", "torch")


def triton_interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def resolve_backend(backend: str | None, *tensors: torch.Tensor) -> Literal["triton", "torch"]:
    """Pick the implementation for one call.

    ``auto`` (the default, overridable with ``TIERATTN_BACKEND``) runs Triton on CUDA tensors or
    under the interpreter, and the torch reference otherwise.
    """
    if backend is None:
        backend = os.environ.get("TIERATTN_BACKEND", "auto")
    if backend not in _BACKENDS:
        raise KernelInputError(
            f"backend={backend!r} is not one of {_BACKENDS}; pass one of them "
            "(or fix the TIERATTN_BACKEND environment variable)."
        )
    on_cuda = any(t.is_cuda for t in tensors)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if (on_cuda or triton_interpreting()) else "torch"
    if not on_cuda and not triton_interpreting():
        raise KernelUnsupportedError(
            "backend='triton' got CPU tensors but the Triton interpreter is off; set "
            "TRITON_INTERPRET=1 before importing triton, move the tensors to CUDA, or use "
            "backend='torch'."
        )
    return "triton"


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    shape: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Raise :class:`KernelInputError` naming ``name`` unless ``t`` fits the description.

    ``shape`` entries that are None are not checked.
    """
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if ndim is not None and t.dim() != ndim:
        raise KernelInputError(
            f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}."
        )
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise KernelInputError(f"{name} has dtype {t.dtype}; expected one of: {allowed}.")
    if device is not None and t.device != device:
        raise KernelInputError(
            f"{name} is on {t.device} but the other inputs are on {device}; move it with "
            f".to({str(device)!r})."
        )
    if shape is not None:
        if len(shape) != t.dim() or any(
            want is not None and want != got for want, got in zip(shape, t.shape)
        ):
            want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise KernelInputError(f"{name} must have shape {want_s}, got {list(t.shape)}.")
    return t


def check_head_dim(name: str, d: int) -> None:
    if not 1 <= d <= MAX_HEAD_DIM:
        raise KernelUnsupportedError(
            f"{name} has head dim {d}; the kernels support 1..{MAX_HEAD_DIM}."
        )


def check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    """Return the group size ``H_q // H_kv`` or raise when the heads do not divide."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise KernelInputError(
            f"H_q={num_q_heads} query heads must be a multiple of H_kv={num_kv_heads} KV heads "
            "(grouped-query attention); check the head counts of q and kv_pool."
        )
    return num_q_heads // num_kv_heads


def check_pool(name: str, pool: object) -> torch.Tensor:
    """A KV page pool: ``[num_slots, 2, page_size, H_kv, D]`` with a unit-stride last dim."""
    t = check_tensor(name, pool, ndim=5, dtypes=FLOAT_DTYPES)
    if t.shape[1] != 2:
        raise KernelInputError(
            f"{name} must be laid out [num_slots, 2, page_size, H_kv, D] (K and V of a page in "
            f"one block); got shape {list(t.shape)} with {t.shape[1]} in dim 1."
        )
    if t.stride(-1) != 1:
        raise KernelInputError(f"{name} must have a unit stride in its last (head-dim) axis.")
    check_head_dim(name, t.shape[-1])
    return t


def check_out(name: str, out: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Validate a caller-provided output buffer, or allocate one."""
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    check_tensor(name, out, shape=list(shape), dtypes=(dtype,), device=device)
    return out


def check_sm_scale(sm_scale: float | None, head_dim: int) -> float:
    if sm_scale is None:
        return head_dim ** -0.5
    if not (isinstance(sm_scale, (int, float)) and sm_scale > 0 and sm_scale < float("inf")):
        raise KernelInputError(f"sm_scale must be a positive finite float, got {sm_scale!r}.")
    return float(sm_scale)


def check_softcap(softcap: float | None) -> float:
    """0.0 means no softcap (the kernels test ``SOFTCAP > 0`` as a constexpr)."""
    if softcap is None or softcap == 0:
        return 0.0
    if not (isinstance(softcap, (int, float)) and 0 < softcap < float("inf")):
        raise KernelInputError(f"softcap must be a positive finite float or None, got {softcap!r}.")
    return float(softcap)


def check_num_splits(num_splits: int | str) -> int | None:
    """A launcher's ``num_splits``: None for ``"auto"`` (sized from host-known shapes), else an
    int >= 1."""
    if num_splits == "auto":
        return None
    if isinstance(num_splits, int) and not isinstance(num_splits, bool) and num_splits >= 1:
        return num_splits
    raise KernelInputError(f"num_splits must be 'auto' or an int >= 1, got {num_splits!r}.")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def default_tiles(head_dim: int) -> tuple[int, int]:
    """``(block_n, num_warps)`` when the caller gives none: fp32 ``[64, D]`` K/V tiles spill
    registers past D=128 on GPU, so wide heads use 32-token tiles and 8 warps."""
    return (64, 4) if head_dim <= 128 else (32, 8)


#: Triton's default software-pipelining depth on CUDA
DEFAULT_NUM_STAGES = 3


def fit_num_stages(stage_bytes: int, device: torch.device) -> int | None:
    """A ``num_stages`` whose pipelined tiles (``stage_bytes`` of K/V per stage) fit the
    device's shared memory, or None when Triton's default already fits (or off CUDA).

    Triton buffers ``num_stages`` K/V tiles in shared memory; fp32 pools with wide tiles (e.g.
    128 tokens x D=128 x 4 bytes x K and V = 128 KiB per stage) overflow even an H100/H200's
    227 KiB at the default depth of 3 (seen on an H200: 320 KiB asked for).
    """
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024
    stages = DEFAULT_NUM_STAGES
    while stages > 1 and stages * stage_bytes > limit:
        stages -= 1
    return None if stages == DEFAULT_NUM_STAGES else stages


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision after the fp32 upcast: tf32 is exact for 16-bit inputs, not fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _softcap(s, SOFTCAP: tl.constexpr):
    # softcap * tanh(s / softcap), in the overflow-free form sign(x)(1-e^-2|x|)/(1+e^-2|x|)
    x = s / SOFTCAP
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return SOFTCAP * tl.where(x < 0, -t, t)
