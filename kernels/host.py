"""Host attention: decode attention over pages that live in host memory, computed on the CPU.

The split-attention strategy (``TierConfig.attend="split"``) does not bring cold pages to the
query: the CPU that holds the DDR/CXL pool reads them where they are, at memory bandwidth, and
returns the partial state ``(out [B, H_q, D], lse [B, H_q])`` -- a few bytes per head -- for the
device to merge with its hot set's (:func:`~tierattn.kernels.merge_states`). Exact at any budget.

:func:`host_decode` has :func:`~tierattn.kernels.sparse_decode`'s contract (a page table with one
row per sequence, first lanes, the page-LSE scatter, softcap) on CPU tensors. Its kernel is C
(``csrc/host_decode.c``), compiled on first use with the machine's C compiler -- the one Triton
itself needs -- for this CPU (``-march=native``, OpenMP threads) and cached in
``$TIERATTN_CACHE_DIR`` (default ``~/.cache/tierattn``). Tasks of (sequence, split of its pages)
run in parallel; each page is read once from memory (the next one prefetched), scored against
every query head of its GQA groups while its keys sit in L1, with an online softmax per page;
bf16 and fp16 pages are widened to fp32 as they are read. Without a compiler it falls back,
with one warning, to the plain-torch reference
(:func:`~tierattn.kernels.sparse_decode_reference`), with the same results;
:func:`host_decode_available` tells which path runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from tierattn.errors import KernelInputError

from ._common import check_out, check_sm_scale, check_softcap
from .decode import DecodeOutput, _check_decode_inputs, sparse_decode_reference
from .page_table import PageTable

__all__ = ["host_decode", "host_decode_available", "host_read", "host_threads",
           "vllm_cpu_pages"]

_SOURCES = ("host_decode.c", "host_decode_body.h")
_FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
#: page layouts the kernel reads (its ``layout`` argument)
_LAYOUTS = {"pages": 0, "vllm_cpu": 1}
_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: no compiled kernel here


def _cpu_signature() -> str:
    """What the compiled code depends on besides its source: the CPU (``-march=native``)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
                if line.strip() == "":
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags}"


def _compile(src_dir: Path, out: Path) -> str | None:
    """Build the shared library at ``out``; returns None, or why it could not."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler found (install gcc, or set CC)"
    why = ""
    # the best build this compiler takes: this CPU's vector units and OpenMP threads, then less
    for extra in (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ()):
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            cmd = [cc, *_FLAGS, *extra, str(src_dir / _SOURCES[0]), "-o", str(tmp_out), "-lm"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode == 0:
                os.replace(tmp_out, out)  # atomic: concurrent processes may build it too
                return None
            why = res.stderr.strip().splitlines()[-1:] or [f"exit {res.returncode}"]
            why = f"{cc} failed: {why[0]}"
    return why


def _load() -> ctypes.CDLL | None:
    """The compiled kernel (built and cached on first use), or None where it cannot be built."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = _build() or False
        return _lib or None


def _build() -> ctypes.CDLL | None:
    if os.environ.get("TIERATTN_HOST_KERNEL", "c") == "torch":  # forced off (tests, debugging)
        return None
    src_dir = Path(__file__).with_name("csrc")
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((src_dir / name).read_bytes())
    digest.update(repr((_FLAGS, os.environ.get("CC"), _cpu_signature())).encode())
    root = Path(os.environ.get("TIERATTN_CACHE_DIR") or Path.home() / ".cache" / "tierattn")
    path = root / f"host_decode-{digest.hexdigest()[:16]}.so"
    why = None
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            why = _compile(src_dir, path)
        if why is None:
            lib = ctypes.CDLL(str(path))
            for suffix in _SUFFIX.values():
                fn = getattr(lib, f"host_decode_{suffix}")
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 7 + \
                    [ctypes.c_int] * 5 + \
                    [ctypes.c_float] * 2 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 5
            lib.host_read.restype = ctypes.c_uint32
            lib.host_read.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int64] + \
                [ctypes.c_int] * 2
            return lib
    except OSError as e:
        why = str(e)
    warnings.warn(f"tierattn: host attention runs the plain-torch reference (slow): its C kernel "
                  f"could not be built ({why}).", RuntimeWarning, stacklevel=3)
    return None


def host_decode_available() -> bool:
    """Whether :func:`host_decode` runs its compiled kernel (built on first call) rather than
    the torch reference."""
    return _load() is not None


def host_threads(threads: int | None = None) -> int:
    """Threads the host kernel uses: ``threads`` (checked), else ``TIERATTN_HOST_THREADS``,
    else the threads torch uses for intra-op work."""
    if threads is None:
        env = os.environ.get("TIERATTN_HOST_THREADS")
        if env is None:
            return torch.get_num_threads()
        if not (env.isdigit() and int(env) >= 1):
            raise KernelInputError(
                f"TIERATTN_HOST_THREADS={env!r}: set it to a thread count >= 1, or unset it.")
        threads = int(env)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise KernelInputError(f"threads must be an int >= 1, got {threads!r}.")
    return threads


def _splits(batch: int, max_pages: int, threads: int) -> int:
    """Splits of each row's pages: about four tasks per thread, at least four pages a split."""
    want = math.ceil(4 * threads / max(1, batch))
    return max(1, min(want, max_pages // 4 or 1))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def host_decode(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: PageTable,
    *,
    sm_scale: float | None = None,
    softcap: float | None = None,
    first_lane: torch.Tensor | None = None,
    page_lse: torch.Tensor | None = None,
    page_lse_index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    threads: int | None = None,
    validate: bool = True,
    cold_pool: torch.Tensor | None = None,
    layout: str = "pages",
) -> DecodeOutput:
    """Decode attention of one query token per sequence over pages of a host pool, on the CPU.

    Args:
        q: ``[B, H_q, D]`` query (post-RoPE) on the CPU, the pool's dtype or fp32.
        kv_pool: contiguous host pool (fp32/bf16/fp16) in ``layout``: ``"pages"``, tierattn's
            ``[num_slots, 2, page_size, H_kv, D]``; ``"vllm_cpu"``, vLLM's CPU KV cache
            ``[num_blocks, H_kv, page_size, 2 * D]`` (per block and KV head the keys
            transposed, ``[D, page_size]``, then the values, ``[page_size, D]``), read in
            place.
        page_table: one row per sequence, on the CPU; only a row's last entry may be partly
            filled. With ``cold_pool`` an entry ``e < 0`` names page ``~e`` of ``cold_pool``.
        cold_pool: optional second pool of the same layout, page shape and dtype (a hot set's
            pages in one pool and its cold pages in another, attended in one softmax).
        layout: how both pools lay a page out (above).
        sm_scale, softcap: as :func:`~tierattn.kernels.sparse_decode`.
        first_lane: optional ``[nnz]`` int32: tokens of entry ``e`` before this lane are masked.
        page_lse, page_lse_index: optional ``[N, H_q]`` fp32 CPU buffer and ``[nnz]`` int32
            rows: each entry's page LSE per query head is written to row ``page_lse_index[e]``.
        out, lse: optional ``[B, H_q, D]`` / ``[B, H_q]`` fp32 CPU buffers for the result.
        threads: worker threads (default :func:`host_threads`).
        validate: check the page ids against the pool (the runtime's own tables pass False).

    Returns:
        :class:`~tierattn.kernels.DecodeOutput` with ``out`` and ``lse`` (fp32; ``(0, -inf)``
        for an empty row) and ``page_lse`` (the buffer given).
    """
    if layout not in _LAYOUTS:
        raise KernelInputError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}.")
    pools = (("kv_pool", kv_pool),) if cold_pool is None else \
        (("kv_pool", kv_pool), ("cold_pool", cold_pool))
    for name, t in pools:
        if layout == "vllm_cpu" and (not isinstance(t, torch.Tensor) or t.dim() != 4 or
                                     t.shape[-1] % 2):
            raise KernelInputError(
                f"{name} must be a [num_blocks, H_kv, page_size, 2 * D] tensor for "
                f"layout='vllm_cpu' (vLLM's CPU KV cache), got "
                f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
    if cold_pool is not None and (cold_pool.shape[1:] != kv_pool.shape[1:] or
                                  cold_pool.dtype != kv_pool.dtype):
        raise KernelInputError(
            f"cold_pool {list(cold_pool.shape)} {cold_pool.dtype} must have kv_pool's page "
            f"shape {list(kv_pool.shape[1:])} and dtype {kv_pool.dtype}.")
    blocks = None
    if layout == "vllm_cpu":  # the shared checks read a pool's shape as tierattn's pages
        blocks = kv_pool
        n, hkv_, p_, d2 = kv_pool.shape
        kv_pool = kv_pool.as_strided((n, 2, p_, hkv_, d2 // 2),
                                     (hkv_ * p_ * d2, hkv_ * p_ * d2 // 2, hkv_ * d2 // 2,
                                      d2 // 2, 1))
    for name, t in (("q", q), ("kv_pool", blocks if blocks is not None else kv_pool),
                    ("cold_pool", cold_pool)):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise KernelInputError(
                f"{name} is on {t.device}: host attention reads host memory; pass CPU tensors "
                "(the runtime copies the query over and the partial state back).")
    if isinstance(q, torch.Tensor) and isinstance(kv_pool, torch.Tensor) and \
            q.dtype == torch.float32 and kv_pool.dtype != q.dtype:
        checked_q = q.to(kv_pool.dtype)  # the shared checks want one dtype; fp32 q is kept
    else:
        checked_q = q
    batch, hq, d, page_size, hkv, group, head_rows = _check_decode_inputs(
        checked_q, kv_pool, page_table)
    if head_rows or page_table.num_rows != batch:
        raise KernelInputError(
            f"page_table has {page_table.num_rows} rows; host_decode takes one row per "
            f"sequence ({batch}).")
    for name, t in (("kv_pool", blocks if blocks is not None else kv_pool),
                    ("cold_pool", cold_pool)):
        if t is not None and not t.is_contiguous():
            raise KernelInputError(f"{name} must be contiguous (a tier's pool is).")
    if (page_lse is None) != (page_lse_index is None):
        raise KernelInputError("page_lse and page_lse_index go together: pass both or neither.")
    scale = check_sm_scale(sm_scale, d)
    cap = check_softcap(softcap)
    table = (page_table.indices, page_table.row_start, page_table.row_count,
             page_table.last_page_len)
    if any(t.device.type != "cpu" for t in table):
        raise KernelInputError("page_table must be on the CPU for host attention.")
    nnz = page_table.indices.numel()
    if validate and nnz:
        low = -cold_pool.shape[0] if cold_pool is not None else 0
        bad = (page_table.indices < low) | (page_table.indices >= kv_pool.shape[0])
        if bool(bad.any()):
            raise KernelInputError(
                f"page_table.indices holds slots outside the pool [{low}, {kv_pool.shape[0]})"
                + (" (e < 0: page ~e of cold_pool)." if cold_pool is not None else "."))
    for name, t, n in (("first_lane", first_lane, nnz), ("page_lse_index", page_lse_index, nnz)):
        if t is not None and (t.numel() != n or t.dtype != torch.int32 or
                              t.device.type != "cpu" or not t.is_contiguous()):
            raise KernelInputError(f"{name} must be a contiguous int32 CPU tensor of the "
                                   f"table's {n} entries.")
    if page_lse is not None and (page_lse.dtype != torch.float32 or page_lse.dim() != 2 or
                                 page_lse.shape[1] != hq or not page_lse.is_contiguous()):
        raise KernelInputError(f"page_lse must be a contiguous fp32 [N, {hq}] CPU tensor.")
    out = check_out("out", out, (batch, hq, d), torch.float32, q.device)
    lse = check_out("lse", lse, (batch, hq), torch.float32, q.device)
    threads = host_threads(threads)
    lib = _load()
    if lib is None:
        if blocks is not None or cold_pool is not None:  # the reference reads one pool of pages
            kv_pool, page_table = _as_pages(blocks if blocks is not None else kv_pool, cold_pool,
                                            page_table, layout)
        ref = sparse_decode_reference(q.float(), kv_pool.float(), page_table, sm_scale=scale,
                                      softcap=cap or None, first_lane=first_lane,
                                      page_lse=page_lse, page_lse_index=page_lse_index)
        out.copy_(ref.out)
        lse.copy_(ref.lse)
        return DecodeOutput(out=out, lse=lse, page_mass=None, page_lse=page_lse)
    splits = _splits(batch, int(page_table.row_count.max()) if batch else 0, threads)
    qf = q.detach().to(torch.float32).contiguous()
    parts = torch.empty(batch * splits * hq * (d + 2))  # the splits' (acc, m, l)
    o_part = parts[:batch * splits * hq * d]
    m_part = parts[batch * splits * hq * d:batch * splits * hq * (d + 1)]
    l_part = parts[batch * splits * hq * (d + 1):]
    fn = getattr(lib, f"host_decode_{_SUFFIX[kv_pool.dtype]}")
    pool = blocks if blocks is not None else kv_pool
    failed = fn(_ptr(qf), _ptr(pool), _ptr(cold_pool), _LAYOUTS[layout],
                *(_ptr(t) for t in table), _ptr(first_lane),
                _ptr(page_lse), _ptr(page_lse_index), batch, hkv, group, d, page_size, scale,
                cap or 0.0, splits, threads, _ptr(o_part), _ptr(m_part), _ptr(l_part),
                _ptr(out), _ptr(lse))
    if failed:
        raise MemoryError("host_decode: a worker thread could not allocate its scratch memory.")
    return DecodeOutput(out=out, lse=lse, page_mass=None, page_lse=page_lse)


def vllm_cpu_pages(blocks: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU KV-cache blocks ``[N, H_kv, P, 2 * D]`` as tierattn pages ``[N, 2, P, H_kv,
    D]`` (a copy): per block and KV head vLLM keeps the keys transposed, ``[D, P]``, then the
    values, ``[P, D]``."""
    n, h, p, d2 = blocks.shape
    d = d2 // 2
    b = blocks.reshape(n, h, 2, p * d)
    k = b[:, :, 0].reshape(n, h, d, p).permute(0, 3, 1, 2)
    v = b[:, :, 1].reshape(n, h, p, d).permute(0, 2, 1, 3)
    return torch.stack((k, v), dim=1)


def _as_pages(pool: torch.Tensor, cold_pool: torch.Tensor | None, page_table: PageTable,
              layout: str) -> tuple[torch.Tensor, PageTable]:
    """The pages ``page_table`` lists, from either pool, as one pool of tierattn pages (entry
    ``e`` its page ``e``) for the reference path."""
    idx = page_table.indices.long()
    pages = pool.index_select(0, idx.clamp_min(0))
    if cold_pool is not None:
        cold = cold_pool.index_select(0, (~idx).clamp_min(0))
        pages = torch.where((idx >= 0).view(-1, *[1] * (pool.dim() - 1)), pages, cold)
    if layout == "vllm_cpu":
        pages = vllm_cpu_pages(pages)
    return pages, PageTable(torch.arange(idx.numel(), dtype=torch.int32),
                            page_table.row_start, page_table.row_count,
                            page_table.last_page_len)


def host_read(kv_pool: torch.Tensor, page_table: PageTable, *, threads: int | None = None,
              splits: int | None = None) -> int:
    """Read every byte of the pages ``page_table`` lists, with :func:`host_decode`'s tasks and
    threads, and nothing else (a checksum of 32-bit words): the machine's read bandwidth over
    the same bytes, which the host kernel's rate is measured against. Needs the compiled
    kernel (:func:`host_decode_available`)."""
    lib = _load()
    if lib is None:
        raise KernelInputError("host_read needs the compiled host kernel (a C compiler).")
    if kv_pool.device.type != "cpu" or not kv_pool.is_contiguous():
        raise KernelInputError("kv_pool must be a contiguous CPU tensor.")
    threads = host_threads(threads)
    batch = page_table.num_rows
    page_bytes = kv_pool[0].numel() * kv_pool.element_size()
    if page_bytes % 64:
        raise KernelInputError(f"host_read reads pages in 64-byte vectors; {page_bytes} is not "
                               "a multiple of 64.")
    if splits is None:
        splits = _splits(batch, int(page_table.row_count.max()) if batch else 0, threads)
    return int(lib.host_read(_ptr(kv_pool), _ptr(page_table.indices), _ptr(page_table.row_start),
                             _ptr(page_table.row_count), batch, page_bytes, splits, threads))
