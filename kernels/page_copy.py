"""Page copy: gather pages from one pool and scatter them into another, one launch per call.

``dst_pool[dst_slots[i]] = src_pool[src_slots[i]]`` for every ``i``, bit for bit. A page is one
contiguous block (K and V of ``page_size`` tokens, all KV heads), so the copy never looks at
heads or tokens: both pools are reinterpreted as rows of raw integers (the widest of 8/4/2/1
bytes that the page size, slot strides and base addresses allow), which keeps NaN payloads and
-0.0 intact and lets the GPU issue wide vector loads. A capped grid walks the work items
(page, chunk of ``BLOCK`` integers) with a grid-stride loop, so one launch moves any number of
pages. On CUDA one pool may be pinned host memory that the kernel reads or writes over UVA (the
host->device prefetch and the device->host write-back of the transfer engine).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from tierattn.errors import KernelInputError

from ._common import (
    INDEX_DTYPE,
    Backend,
    check_pool,
    check_tensor,
    next_pow2,
    resolve_backend,
    triton_interpreting,
)
from .tuning import check_config, resolve_config

__all__ = ["copy_pages", "copy_pages_reference"]

#: programs per SM of the default grid on CUDA (the grid-stride loop does the rest).
PROGRAMS_PER_SM = 4
#: default grid cap under the Triton interpreter, which runs programs one after another.
INTERPRETER_PROGRAMS = 4
#: default bytes per work item: 8 KiB on CUDA (4 KiB-64 KiB pages split into a few chunks),
#: 64 KiB under the interpreter (fewer, larger numpy copies).
BLOCK_BYTES_CUDA = 8192
BLOCK_BYTES_INTERPRETER = 65536

_INT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit(do_not_specialize=["num_pages"])
def _copy_pages_kernel(
    src_ptr, src_slots_ptr, dst_ptr, dst_slots_ptr,
    num_pages, page_len, src_num_slots, dst_num_slots,
    stride_src_slot, stride_dst_slot,
    BLOCK: tl.constexpr,
):
    i_p = tl.program_id(0).to(tl.int64)
    num_chunks = tl.cdiv(page_len, BLOCK)
    num_work = num_pages.to(tl.int64) * num_chunks
    o_b = tl.arange(0, BLOCK).to(tl.int64)
    for i_w in range(i_p, num_work, tl.num_programs(0)):
        i_m = i_w // num_chunks
        o_e = (i_w % num_chunks) * BLOCK + o_b  # [BLOCK] integer offsets within the page
        b_src = tl.load(src_slots_ptr + i_m).to(tl.int64)
        b_dst = tl.load(dst_slots_ptr + i_m).to(tl.int64)
        # an out-of-range slot copies nothing (validate=True reports it on the host)
        m_ok = (b_src >= 0) & (b_src < src_num_slots) & (b_dst >= 0) & (b_dst < dst_num_slots)
        # folded into the bound: the interpreter turns (vector & scalar) masks into int64
        m_e = o_e < tl.where(m_ok, page_len, 0)
        b_x = tl.load(src_ptr + b_src * stride_src_slot + o_e, mask=m_e, other=0)  # [BLOCK]
        tl.store(dst_ptr + b_dst * stride_dst_slot + o_e, b_x, mask=m_e)


def _page_numel(pool: torch.Tensor) -> int:
    return pool.shape[1] * pool.shape[2] * pool.shape[3] * pool.shape[4]


def _check_page_block(name: str, pool: torch.Tensor) -> None:
    """Each page must be one contiguous block and pages must not overlap each other."""
    numel = 1
    for dim in range(4, 0, -1):
        if pool.shape[dim] != 1 and pool.stride(dim) != numel:
            raise KernelInputError(
                f"{name} must hold each page as one contiguous block (strides "
                f"{list(pool.stride())} for shape {list(pool.shape)}; dims 1..4 must be "
                f"contiguous): allocate it as [num_slots, 2, page_size, H_kv, D] or pass "
                f"{name}.contiguous()."
            )
        numel *= pool.shape[dim]
    if pool.shape[0] > 1 and pool.stride(0) < numel:
        raise KernelInputError(
            f"{name} has slot stride {pool.stride(0)} < page size {numel} elements, so its pages "
            "overlap; give every slot its own block (e.g. .contiguous())."
        )


def _check_devices(src_pool: torch.Tensor, dst_pool: torch.Tensor) -> torch.device:
    """Return the device that runs the copy: both pools' device, or the CUDA one of a
    CUDA/pinned-host pair."""
    if src_pool.device == dst_pool.device:
        return src_pool.device
    for cuda_name, cuda, host_name, host in (("src_pool", src_pool, "dst_pool", dst_pool),
                                             ("dst_pool", dst_pool, "src_pool", src_pool)):
        if cuda.is_cuda and host.device.type == "cpu":
            if not host.is_pinned():
                raise KernelInputError(
                    f"{host_name} is in pageable host memory but {cuda_name} is on "
                    f"{cuda.device}; the kernel reads host pools over UVA, which needs pinned "
                    f"memory: allocate {host_name} pinned or pass {host_name}.pin_memory()."
                )
            return cuda.device
    raise KernelInputError(
        f"src_pool is on {src_pool.device} and dst_pool on {dst_pool.device}; copy_pages needs "
        "both pools on one device, or one CUDA pool and one pinned host pool (.pin_memory()). "
        "Move one pool, e.g. with .to(other_pool.device)."
    )


def _check_copy_inputs(src_pool, src_slots, dst_pool, dst_slots) -> torch.device:
    check_pool("src_pool", src_pool)
    check_pool("dst_pool", dst_pool)
    if dst_pool.dtype != src_pool.dtype:
        raise KernelInputError(
            f"dst_pool has dtype {dst_pool.dtype} but src_pool has {src_pool.dtype}; a page copy "
            "moves raw bits and never converts: use pools of one dtype."
        )
    if tuple(dst_pool.shape[1:]) != tuple(src_pool.shape[1:]):
        raise KernelInputError(
            f"dst_pool has page shape {list(dst_pool.shape[1:])} but src_pool has "
            f"{list(src_pool.shape[1:])} ([2, page_size, H_kv, D] must match; only num_slots "
            "may differ)."
        )
    _check_page_block("src_pool", src_pool)
    _check_page_block("dst_pool", dst_pool)
    device = _check_devices(src_pool, dst_pool)
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        check_tensor(name, slots, ndim=1)
        if slots.dtype != INDEX_DTYPE:
            raise KernelInputError(
                f"{name} has dtype {slots.dtype}; slot lists are int32 like every page id "
                f"(FlashInfer's convention): pass {name}.to(torch.int32)."
            )
        if slots.device != device:
            raise KernelInputError(
                f"{name} is on {slots.device} but the copy runs on {device}; move it with "
                f".to({str(device)!r})."
            )
    if dst_slots.numel() != src_slots.numel():
        raise KernelInputError(
            f"dst_slots has {dst_slots.numel()} entries but src_slots has {src_slots.numel()}; "
            "they pair up entry by entry and must have the same length."
        )
    return device


def _check_slot_values(src_pool, src_slots, dst_pool, dst_slots) -> None:
    """Host-side checks of the slot values (one sync on CUDA)."""
    src, dst = src_slots.long().cpu(), dst_slots.long().cpu()
    for name, slots, pool_name, pool in (("src_slots", src, "src_pool", src_pool),
                                         ("dst_slots", dst, "dst_pool", dst_pool)):
        bad = (slots < 0) | (slots >= pool.shape[0])
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            raise KernelInputError(
                f"{name}[{i}]={int(slots[i])} is out of range for {pool_name} with "
                f"{pool.shape[0]} slots (valid: 0..{pool.shape[0] - 1})."
            )
    values, counts = torch.unique(dst, return_counts=True)
    if (counts > 1).any():
        slot = int(values[counts > 1][0])
        where = torch.nonzero(dst == slot).flatten().tolist()
        raise KernelInputError(
            f"dst_slots lists slot {slot} more than once (entries {where}); the result would "
            "depend on copy order: write each destination slot at most once."
        )
    if src_pool.untyped_storage().data_ptr() == dst_pool.untyped_storage().data_ptr():
        # pages of one storage: byte ranges of equal length L overlap iff their starts differ by < L
        page_bytes = _page_numel(src_pool) * src_pool.element_size()
        es = src_pool.element_size()
        src_start = src_pool.data_ptr() + src * src_pool.stride(0) * es
        dst_start = dst_pool.data_ptr() + dst * dst_pool.stride(0) * es
        order = torch.argsort(dst_start)
        dst_sorted = dst_start[order]
        pos = torch.searchsorted(dst_sorted, src_start)
        for j in (pos - 1, pos):
            ok = (j >= 0) & (j < dst_sorted.numel())
            jc = j.clamp(0, max(0, dst_sorted.numel() - 1))
            hit = ok & ((src_start - dst_sorted[jc]).abs() < page_bytes)
            if hit.any():
                i = int(torch.nonzero(hit)[0])
                k = int(order[jc[i]])
                raise KernelInputError(
                    f"src_slots[{i}]={int(src[i])} and dst_slots[{k}]={int(dst[k])} are the same "
                    "memory (src_pool and dst_pool share storage): a page would be read and "
                    "written in one copy. Move pages within a pool only between disjoint slots."
                )


def _slot_stride(pool: torch.Tensor) -> int:
    # a pool of 0 or 1 slots may report any slot stride; it is never used
    return pool.stride(0) if pool.shape[0] > 1 else _page_numel(pool)


def _raw_rows(pool: torch.Tensor, width: int) -> torch.Tensor:
    """``[num_slots, page_bytes / width]`` integer view of the page blocks (no copy)."""
    rows = pool.as_strided((pool.shape[0], _page_numel(pool)), (_slot_stride(pool), 1))
    return rows.view(_INT_DTYPES[width])


def _raw_width(*pools: torch.Tensor) -> int:
    """Widest integer (bytes) that divides the page size, the slot strides and the bases."""
    es = pools[0].element_size()
    page_bytes = _page_numel(pools[0]) * es
    for width in (8, 4, 2, 1):
        if page_bytes % width == 0 and all(
            (_slot_stride(p) * es) % width == 0 and (p.storage_offset() * es) % width == 0
            and p.data_ptr() % width == 0 for p in pools
        ):
            return width
    return 1


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _default_config() -> dict[str, int]:
    """Launch parameters of an untuned call. The interpreter runs programs one after another,
    so there ``programs_per_sm`` is the whole grid cap (one "SM")."""
    if triton_interpreting():
        return {"block_bytes": BLOCK_BYTES_INTERPRETER, "programs_per_sm": INTERPRETER_PROGRAMS}
    return {"block_bytes": BLOCK_BYTES_CUDA, "programs_per_sm": PROGRAMS_PER_SM}


def _key_sizes(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_slots: torch.Tensor) -> dict:
    """Sizes of the tuned-table key (:func:`.tuning.bucket_key`), from host-known shapes."""
    return dict(page_bytes=_page_numel(src_pool) * src_pool.element_size(),
                pages=src_slots.numel(),
                path=f"{'d' if src_pool.is_cuda else 'h'}2{'d' if dst_pool.is_cuda else 'h'}")


def _launch(src_rows, src_slots, dst_rows, dst_slots, device, cfg) -> None:
    num_pages, page_len = src_slots.numel(), src_rows.shape[1]
    compiled = device.type == "cuda" and not triton_interpreting()
    max_programs = cfg.get("max_programs") or \
        cfg["programs_per_sm"] * (_num_sms(device.index or 0) if compiled else 1)
    block_bytes = cfg["block_bytes"]
    width = src_rows.element_size()
    block = max(16, min(block_bytes // width, next_pow2(page_len)))
    num_work = num_pages * triton.cdiv(page_len, block)
    grid = (min(max_programs, num_work),)
    # launch on the CUDA pool's device and its current stream (a pinned host pool has none)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _copy_pages_kernel[grid](
            src_rows, src_slots, dst_rows, dst_slots,
            num_pages, page_len, src_rows.shape[0], dst_rows.shape[0],
            src_rows.stride(0), dst_rows.stride(0),
            BLOCK=block,
        )


def copy_pages_reference(
    src_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_pool: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Plain-torch :func:`copy_pages`, one page at a time, on byte views (no validation)."""
    src_bytes, dst_bytes = src_pool.view(torch.uint8), dst_pool.view(torch.uint8)
    for s, d in zip(src_slots.tolist(), dst_slots.tolist(), strict=True):
        dst_bytes[d] = src_bytes[s].to(dst_bytes.device)


def copy_pages(
    src_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_pool: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    max_programs: int | None = None,
    block_bytes: int | None = None,
    validate: bool = True,
    config: dict[str, int] | None = None,
    backend: Backend | None = None,
) -> None:
    """Copy pages between pools in one launch: ``dst_pool[dst_slots[i]] = src_pool[src_slots[i]]``.

    The copy is bitwise (NaN payloads and -0.0 included); nothing else in ``dst_pool`` changes.
    The pools may be views into larger buffers with any slot stride, as long as each page is one
    contiguous block. On CUDA, one pool may be pinned host memory (``.pin_memory()``) accessed
    over UVA; the copy is queued on the current stream of the CUDA pool's device, so synchronise
    before the host reads a pinned ``dst_pool``.

    Args:
        src_pool: ``[S_src, 2, page_size, H_kv, D]`` pool to read (fp16/bf16/fp32).
        src_slots: ``[M]`` int32 slots of ``src_pool`` to read (repeats allowed).
        dst_pool: ``[S_dst, 2, page_size, H_kv, D]`` pool to write, same page shape and dtype.
        dst_slots: ``[M]`` int32 slots of ``dst_pool`` to write, each at most once.
        max_programs: grid cap (default: the tuned table's ``programs_per_sm * num_SMs`` on
            CUDA, else ``4 * num_SMs``; 4 under the interpreter); a grid-stride loop covers the
            remaining pages.
        block_bytes: bytes each program moves per loop step, a power of two >= 128 (default:
            the tuned table's on CUDA, else 8 KiB; 64 KiB under the interpreter).
        validate: check slot values on the host (one sync on CUDA): in range, no repeated
            ``dst_slots``, and, when the pools share storage, no page both read and written.
            The runtime, which builds its own slot lists, passes False; both backends then
            skip pairs with an out-of-range slot (fixed-capacity lists pad with -1).
        config: explicit launch parameters ``block_bytes`` and ``programs_per_sm`` (see
            :mod:`.tuning`); with it, ``max_programs`` or ``block_bytes`` the tuned table is
            not consulted (an explicit ``max_programs`` beats ``programs_per_sm``).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (indexed copies in one op).

    Returns:
        None; ``dst_pool`` is written in place.
    """
    device = _check_copy_inputs(src_pool, src_slots, dst_pool, dst_slots)
    if max_programs is not None and (isinstance(max_programs, bool) or not isinstance(
            max_programs, int) or max_programs < 1):
        raise KernelInputError(f"max_programs must be None or an int >= 1, got {max_programs!r}.")
    if block_bytes is not None and (isinstance(block_bytes, bool) or not isinstance(
            block_bytes, int) or block_bytes < 128 or block_bytes & (block_bytes - 1)):
        raise KernelInputError(
            f"block_bytes must be None or a power of two >= 128, got {block_bytes!r}.")
    config = check_config("copy", config)
    which = resolve_backend(backend, src_pool, dst_pool)
    if validate:
        _check_slot_values(src_pool, src_slots, dst_pool, dst_slots)
    if src_slots.numel() == 0 or _page_numel(src_pool) == 0:
        return

    width = _raw_width(src_pool, dst_pool)
    src_rows, dst_rows = _raw_rows(src_pool, width), _raw_rows(dst_pool, width)
    if which == "torch":
        src_idx, dst_idx = src_slots.long(), dst_slots.long()
        # like the kernel, a pair with an out-of-range slot (e.g. -1 padding) copies nothing
        ok = (src_idx >= 0) & (src_idx < src_pool.shape[0]) & (dst_idx >= 0) & \
            (dst_idx < dst_pool.shape[0])
        if not bool(ok.all()):
            src_idx, dst_idx = src_idx[ok], dst_idx[ok]
        pages = src_rows.index_select(0, src_idx.to(src_pool.device))
        dst_rows.index_copy_(0, dst_idx.to(dst_pool.device), pages.to(dst_pool.device))
        return
    cfg = resolve_config(
        "copy", device, _default_config(),
        {"block_bytes": block_bytes, "max_programs": max_programs, **config},
        _key_sizes(src_pool, dst_pool, src_slots))
    _launch(src_rows, src_slots, dst_rows, dst_slots, device, cfg)
