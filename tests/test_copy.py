"""Page copy: explicit case list, raw bit patterns, views with red zones, launch count, bad inputs.

Every check is bitwise (``.view(torch.uint8)``): the whole buffer behind each pool, margins and
padding between slots included, must equal the buffer before the call with exactly the listed
pages replaced.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from tierattn.errors import KernelInputError, KernelUnsupportedError
from tierattn.kernels import page_copy as copy_mod
from tierattn.kernels.page_copy import copy_pages, copy_pages_reference
from tierattn.kernels.testing import margins_intact, red_zone

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_INT = {2: torch.int16, 4: torch.int32}
#: NaN payloads (quiet and signalling, both signs), -0.0, +-inf, denormals, per dtype.
SPECIAL_BITS = {
    torch.float16: [0x7E00, 0x7C01, 0xFE01, 0x7DFF, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x83FF],
    torch.bfloat16: [0x7FC0, 0x7F81, 0xFF81, 0x7FBF, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F],
    torch.float32: [0x7FC00000, 0x7F800001, 0xFFBADBAD, 0x7FFFFFFF, 0x80000000, 0x7F800000,
                    0xFF800000, 0x00000001, 0x807FFFFF],
}


#: both implementations run wherever the suite runs (interpreter on CPU, compiled on CUDA).
BACKENDS = ("triton", "torch")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _random_bits(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``n`` elements of ``dtype`` with uniformly random bit patterns (NaNs included)."""
    width = torch.empty(0, dtype=dtype).element_size()
    lo, hi = -(2 ** (8 * width - 1)), 2 ** (8 * width - 1)
    return torch.randint(lo, hi, (n,), dtype=_INT[width], generator=gen).view(dtype)


def _special_bits(n: int, dtype: torch.dtype) -> torch.Tensor:
    width = torch.empty(0, dtype=dtype).element_size()
    pats = [p - (1 << (8 * width)) if p >= 1 << (8 * width - 1) else p for p in SPECIAL_BITS[dtype]]
    vals = torch.tensor(pats, dtype=_INT[width])
    return vals.repeat(-(-n // len(pats)))[:n].view(dtype)


@dataclass(frozen=True)
class Layout:
    """Where a pool lives: ``margin`` elements before and after it, ``pad`` between slots."""

    margin: int = 0
    pad: int = 0

    @property
    def name(self) -> str:
        return "plain" if self == PLAIN else f"m{self.margin}p{self.pad}"


PLAIN = Layout()
RED = Layout(margin=7)  # misaligned base: the raw copy falls back to narrow integers
STRIDED = Layout(margin=3, pad=5)  # odd slot stride with NaN gaps between slots


def make_pool(num_slots, page_shape, dtype, device, layout, gen, fill="random"):
    """``(pool, buffer)``: a pool of random bits living in ``buffer`` as ``layout`` says;
    everything in ``buffer`` outside the pages is NaN."""
    page = 1
    for s in page_shape:
        page *= s
    stride = page + layout.pad
    n = 2 * layout.margin + num_slots * stride
    buf = torch.full((n,), float("nan"), dtype=dtype)
    inner = (page_shape[1] * page_shape[2] * page_shape[3], page_shape[2] * page_shape[3],
             page_shape[3], 1)
    pool = buf.as_strided((num_slots, *page_shape), (stride, *inner), layout.margin)
    data = _random_bits(num_slots * page, dtype, gen) if fill == "random" else \
        _special_bits(num_slots * page, dtype)
    pool.copy_(data.view(num_slots, *page_shape))
    buf = buf.to(device)
    pool = buf.as_strided(pool.shape, pool.stride(), layout.margin)
    return pool, buf


def check_copy(src_pool, src_buf, src_slots, dst_pool, dst_buf, dst_slots, backends, **kw):
    """Run each backend from the same starting bits; every buffer must match the expectation."""
    src_before, dst_before = src_buf.clone(), dst_buf.clone()
    shared = src_buf.data_ptr() == dst_buf.data_ptr()
    # expectation: the starting bits with exactly the listed pages replaced, one at a time
    expected = dst_before.clone()
    exp_pool = expected.as_strided(dst_pool.shape, dst_pool.stride(), dst_pool.storage_offset())
    src_snapshot = src_before.as_strided(src_pool.shape, src_pool.stride(),
                                         src_pool.storage_offset())
    for s, d in zip(src_slots.tolist(), dst_slots.tolist(), strict=True):
        _bits(exp_pool)[d] = _bits(src_snapshot)[s]
    ref_buf = dst_before.clone()
    ref_src = src_before.clone() if not shared else ref_buf
    copy_pages_reference(
        ref_src.as_strided(src_pool.shape, src_pool.stride(), src_pool.storage_offset()),
        src_slots,
        ref_buf.as_strided(dst_pool.shape, dst_pool.stride(), dst_pool.storage_offset()),
        dst_slots)
    assert torch.equal(_bits(ref_buf), _bits(expected)), "copy_pages_reference"
    for backend in backends:
        _bits(src_buf).copy_(_bits(src_before))
        _bits(dst_buf).copy_(_bits(dst_before))
        copy_pages(src_pool, src_slots, dst_pool, dst_slots, backend=backend, **kw)
        assert torch.equal(_bits(dst_buf), _bits(expected)), f"backend={backend}: dst differs"
        if not shared:
            assert torch.equal(_bits(src_buf), _bits(src_before)), f"backend={backend}: src written"


def pick_slots(n_src, n_dst, m, same_pool, dup_src, gen):
    if same_pool:
        perm = torch.randperm(n_src, generator=gen)
        return perm[:m].int(), perm[m:2 * m].int()
    dst = torch.randperm(n_dst, generator=gen)[:m]
    if dup_src or m > n_src:
        src = torch.randint(0, n_src, (m,), generator=gen)
    else:
        src = torch.randperm(n_src, generator=gen)[:m]
    return src.int(), dst.int()


def run_case(dt, p, h, d, n_src, n_dst, m, device, gen, *, same_pool=False, dup_src=False,
             src_layout=PLAIN, dst_layout=PLAIN, fill="random", **kw):
    dtype, page_shape = DTYPES[dt], (2, p, h, d)
    m = n_dst if m == "all" else m
    src_pool, src_buf = make_pool(n_src, page_shape, dtype, device, src_layout, gen, fill)
    if same_pool:
        dst_pool, dst_buf = src_pool, src_buf
    else:
        dst_pool, dst_buf = make_pool(n_dst, page_shape, dtype, device, dst_layout, gen, fill)
    src_slots, dst_slots = pick_slots(n_src, n_dst, m, same_pool, dup_src, gen)
    check_copy(src_pool, src_buf, src_slots.to(device), dst_pool, dst_buf, dst_slots.to(device),
               BACKENDS, **kw)


def _cases():
    c = []

    def add(dt, p, h, d, n_src, n_dst, m, **kw):
        short = {"max_programs": "prog", "block_bytes": "blk", "src_layout": "src-",
                 "dst_layout": "dst-", "same_pool": "same-pool", "dup_src": "dup-src"}
        extra = "".join(
            f"-{short.get(k, k)}" + ("" if v is True else v.name if isinstance(v, Layout) else
                                     str(v))
            for k, v in kw.items() if v not in (False, None))
        c.append(pytest.param(dt, p, h, d, n_src, n_dst, m, kw,
                              id=f"{dt}-P{p}-H{h}-D{d}-S{n_src}-T{n_dst}-M{m}{extra}"))

    # M = 0, 1, 2, 17 and all slots (a random permutation), pools of different sizes
    add("fp16", 16, 2, 64, 8, 8, 0)
    add("fp16", 16, 2, 64, 8, 8, 1)
    add("fp16", 16, 2, 64, 8, 8, 2)
    add("fp16", 16, 2, 64, 32, 24, 17)
    add("fp16", 16, 2, 64, 12, 12, "all")
    add("bf16", 16, 2, 64, 12, 12, "all")
    add("fp32", 16, 2, 64, 12, 12, "all")
    add("bf16", 16, 8, 128, 8, 20, 17, dup_src=True)  # one source page to several slots
    add("fp16", 16, 1, 128, 40, 40, 17)
    add("fp32", 16, 8, 40, 2, 2, 1)
    add("bf16", 8, 8, 40, 5, 16, 0)
    add("fp32", 1, 1, 40, 1, 1, 1)  # one-slot pools
    add("fp16", 1, 1, 40, 1, 1, 0)
    # page sizes 1/8/64 x head dims 40/64/128 x H_kv 1/2/8
    add("fp16", 1, 1, 40, 6, 9, 5)
    add("bf16", 1, 8, 128, 5, 5, "all")
    add("fp32", 1, 2, 40, 3, 7, 3)
    add("fp16", 8, 1, 40, 10, 4, "all")
    add("bf16", 8, 2, 64, 4, 10, 4)
    add("fp32", 8, 8, 128, 6, 6, 2)
    add("fp16", 64, 1, 64, 4, 5, 3)
    add("bf16", 64, 2, 40, 3, 3, "all")
    add("fp32", 64, 8, 128, 3, 4, 2)
    # moves within one pool between disjoint slots
    add("fp16", 16, 2, 64, 20, 20, 8, same_pool=True)
    add("bf16", 1, 1, 40, 9, 9, 4, same_pool=True)
    add("fp32", 8, 8, 128, 6, 6, 3, same_pool=True)
    add("fp16", 16, 2, 64, 2, 2, 1, same_pool=True)
    # fewer programs than pages, several chunks per page, a partial last chunk
    add("fp16", 16, 2, 64, 12, 12, 7, max_programs=1)
    add("fp16", 16, 2, 64, 12, 12, 7, max_programs=2)
    add("fp16", 16, 2, 64, 12, 12, 7, max_programs=3)
    add("fp16", 8, 2, 40, 6, 6, 5, max_programs=1, block_bytes=128)
    add("fp16", 1, 1, 40, 7, 7, 7, max_programs=2, block_bytes=128)  # 160 B: chunks 128 + 32
    add("bf16", 16, 2, 64, 10, 10, 9, max_programs=3, block_bytes=256)
    add("fp32", 1, 1, 40, 5, 5, 5, max_programs=3, block_bytes=128)  # 320 B: 128+128+64
    add("fp16", 64, 8, 128, 2, 3, 2, max_programs=2, block_bytes=4096)
    add("bf16", 8, 2, 40, 9, 9, 4, same_pool=True, max_programs=2, block_bytes=512)
    # pools as views into larger buffers: NaN margins (red zones) and gaps between slots
    add("fp16", 16, 2, 64, 8, 8, 5, src_layout=RED, dst_layout=RED)
    add("bf16", 1, 1, 40, 5, 6, 3, src_layout=RED, dst_layout=RED)
    add("fp32", 8, 2, 40, 4, 4, "all", src_layout=RED, dst_layout=RED)
    add("fp16", 16, 2, 64, 6, 9, 6, src_layout=STRIDED)
    add("bf16", 8, 1, 40, 7, 5, 5, dst_layout=STRIDED)
    add("fp32", 1, 2, 64, 5, 5, 4, src_layout=STRIDED, dst_layout=STRIDED)
    add("fp16", 1, 1, 40, 8, 8, 3, same_pool=True, src_layout=STRIDED)
    add("bf16", 16, 2, 64, 6, 6, 6, src_layout=RED, dst_layout=STRIDED, max_programs=1,
        block_bytes=256)
    add("fp32", 8, 8, 64, 4, 6, 3, src_layout=STRIDED, dst_layout=RED, max_programs=3)
    # odd head dims: 132- and 84-byte pages take 4-byte raw elements (2-byte with a red zone)
    add("fp16", 1, 1, 33, 5, 5, 4, max_programs=2, block_bytes=128)
    add("bf16", 3, 1, 7, 6, 4, "all", dst_layout=RED)
    # raw bit patterns: NaN payloads (quiet/signalling, both signs), -0.0, infinities, denormals
    for dt in DTYPES:
        add(dt, 8, 2, 40, 6, 6, "all", fill="special")
    add("bf16", 1, 1, 40, 4, 4, 3, fill="special", src_layout=RED, dst_layout=STRIDED,
        block_bytes=128)
    return c


@pytest.mark.parametrize("dt,p,h,d,n_src,n_dst,m,kw", _cases())
def test_copy_cases(dt, p, h, d, n_src, n_dst, m, kw, seed, device, figures):
    run_case(dt, p, h, d, n_src, n_dst, m, device, torch.Generator().manual_seed(seed), **kw)
    figures.case("copy")


@pytest.mark.parametrize("i", range(10))
def test_copy_random(i, seed, device, figures):
    rng = random.Random(seed)
    dt = rng.choice(list(DTYPES))
    p, h, d = rng.choice([1, 8, 16, 64]), rng.choice([1, 2, 8]), rng.choice([40, 64, 128])
    n_src, n_dst = rng.randint(1, 12), rng.randint(1, 12)
    same_pool = rng.random() < 0.25
    if same_pool:
        n_dst = n_src
        m = rng.randint(0, n_src // 2)
    else:
        m = rng.randint(0, n_dst)
    layouts = [PLAIN, RED, STRIDED, Layout(margin=rng.randint(0, 9), pad=rng.randint(0, 9))]
    src_layout, dst_layout = rng.choice(layouts), rng.choice(layouts)
    page_bytes = 2 * p * h * d * DTYPES[dt].itemsize
    # at most ~64 chunks per page keeps the interpreter quick
    block = rng.choice([None, 128, 512, 4096])
    if block is not None:
        block = max(block, 1 << max(7, (page_bytes // 64 - 1).bit_length()))
    kw = dict(same_pool=same_pool, dup_src=rng.random() < 0.3, src_layout=src_layout,
              dst_layout=dst_layout, max_programs=rng.choice([None, 1, 2, 3]), block_bytes=block)
    try:
        run_case(dt, p, h, d, n_src, n_dst, m, device, torch.Generator().manual_seed(seed), **kw)
    except AssertionError as e:
        raise AssertionError(f"seed={seed} {dt} P={p} H={h} D={d} S={n_src} T={n_dst} M={m} "
                             f"{kw}: {e}") from None
    figures.case("copy", random=True)


def test_repeat_is_bitwise_deterministic(device, figures):
    gen = torch.Generator().manual_seed(7)
    src, _ = make_pool(9, (2, 8, 2, 64), torch.bfloat16, device, PLAIN, gen)
    base, _ = make_pool(9, (2, 8, 2, 64), torch.bfloat16, device, PLAIN, gen)
    src_slots = torch.randperm(9, generator=gen).int().to(device)
    dst_slots = torch.randperm(9, generator=gen).int().to(device)
    outs = []
    for max_programs in (None, 1, 3, None):
        dst = base.clone()
        copy_pages(src, src_slots, dst, dst_slots, max_programs=max_programs, backend="triton")
        outs.append(_bits(dst))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    figures.case("copy")


def test_red_zone_helper_margins_untouched(device, figures):
    # the shared red_zone helper: both pools inside NaN-margined buffers
    gen = torch.Generator().manual_seed(3)
    shape = (6, 2, 8, 2, 40)
    src, src_buf = red_zone(shape, torch.float16, device, margin=5)
    dst, dst_buf = red_zone(shape, torch.float16, device, margin=11)
    src.copy_(_random_bits(src.numel(), torch.float16, gen).view(shape))
    dst.copy_(_random_bits(dst.numel(), torch.float16, gen).view(shape))
    before = dst.clone()
    ss = torch.tensor([5, 0, 2], dtype=torch.int32, device=device)
    ds = torch.tensor([1, 4, 0], dtype=torch.int32, device=device)
    copy_pages(src, ss, dst, ds, max_programs=2, backend="triton")
    assert margins_intact(src_buf, src) and margins_intact(dst_buf, dst)
    assert torch.equal(_bits(dst[ds.long()]), _bits(src[ss.long()]))
    untouched = torch.tensor([2, 3, 5])
    assert torch.equal(_bits(dst[untouched]), _bits(before[untouched]))
    figures.case("copy")


def test_unvalidated_out_of_range_pairs_copy_nothing(device, figures):
    # validate=False (the runtime's path): the kernel skips pairs with a bad slot, copies the rest
    gen = torch.Generator().manual_seed(5)
    src, src_buf = make_pool(4, (2, 8, 1, 40), torch.float16, device, RED, gen)
    dst, dst_buf = make_pool(5, (2, 8, 1, 40), torch.float16, device, RED, gen)
    ss = torch.tensor([1, 9, 0, -3, 2], dtype=torch.int32)
    ds = torch.tensor([0, 1, 70000, 2, 4], dtype=torch.int32)
    ok = (ss >= 0) & (ss < 4) & (ds >= 0) & (ds < 5)
    expected = dst_buf.clone()
    exp_pool = expected.as_strided(dst.shape, dst.stride(), dst.storage_offset())
    _bits(exp_pool)[ds[ok].long().to(device)] = _bits(src)[ss[ok].long().to(device)]
    copy_pages(src, ss.to(device), dst, ds.to(device), validate=False, backend="triton",
               max_programs=2)
    assert torch.equal(_bits(dst_buf.cpu()), _bits(expected.cpu()))
    figures.case("copy")


def test_torch_backend_skips_out_of_range_pairs_like_the_kernel(figures):
    # fixed-capacity slot lists pad with -1: the reference path skips those pairs too
    gen = torch.Generator().manual_seed(6)
    src, _ = make_pool(4, (2, 8, 1, 40), torch.float32, "cpu", PLAIN, gen)
    dst, _ = make_pool(5, (2, 8, 1, 40), torch.float32, "cpu", PLAIN, gen)
    before = dst.clone()
    ss = torch.tensor([1, -1, 0, 3, -1], dtype=torch.int32)
    ds = torch.tensor([0, -1, 4, 9, 2], dtype=torch.int32)
    copy_pages(src, ss, dst, ds, validate=False, backend="torch")
    assert torch.equal(_bits(dst[torch.tensor([0, 4])]), _bits(src[torch.tensor([1, 0])]))
    for s in (1, 2, 3):
        assert torch.equal(_bits(dst[s]), _bits(before[s]))
    figures.case("copy")


# --- one launch per call -------------------------------------------------------------------------

@pytest.mark.parametrize("m", [0, 1, 17, 40])
def test_one_launch_per_call(m, device, monkeypatch):
    kernel = copy_mod._copy_pages_kernel
    launches = []
    run = kernel.run

    def counting_run(*args, **kwargs):
        launches.append(kwargs["grid"])
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counting_run)
    gen = torch.Generator().manual_seed(m)
    src, _ = make_pool(40, (2, 1, 1, 40), torch.float16, device, PLAIN, gen)
    dst, _ = make_pool(40, (2, 1, 1, 40), torch.float16, device, PLAIN, gen)
    slots = torch.randperm(40, generator=gen)[:m].int().to(device)
    copy_pages(src, slots, dst, slots.flip(0), max_programs=3, backend="triton")
    assert len(launches) == (1 if m else 0)
    assert all(g[0] <= 3 for g in launches)


@pytest.mark.parametrize("m", [0, 1, 17, 40])
def test_torch_backend_is_one_indexed_copy(m, monkeypatch):
    calls = []
    index_copy = torch.Tensor.index_copy_

    def counting_index_copy(self, *args, **kwargs):
        calls.append(1)
        return index_copy(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_copy_", counting_index_copy)
    gen = torch.Generator().manual_seed(m)
    src, _ = make_pool(40, (2, 1, 1, 40), torch.float16, "cpu", PLAIN, gen)
    dst, _ = make_pool(40, (2, 1, 1, 40), torch.float16, "cpu", PLAIN, gen)
    slots = torch.randperm(40, generator=gen)[:m].int()
    copy_pages(src, slots, dst, slots.flip(0), backend="torch")
    assert len(calls) == (1 if m else 0)


# --- GPU only: pinned host pools over UVA, int64 addresses ----------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device")


@gpu
@needs_cuda
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_pinned_host_pool_over_uva(direction, dt, figures):
    gen = torch.Generator().manual_seed(11)
    dev = torch.device("cuda")
    host, host_buf = make_pool(10, (2, 16, 2, 64), DTYPES[dt], "cpu", RED, gen)
    host_buf = host_buf.pin_memory()
    host = host_buf.as_strided(host.shape, host.stride(), host.storage_offset())
    gpu_pool, gpu_buf = make_pool(12, (2, 16, 2, 64), DTYPES[dt], dev, STRIDED, gen)
    if direction == "h2d":
        src, src_buf, dst, dst_buf = host, host_buf, gpu_pool, gpu_buf
    else:
        src, src_buf, dst, dst_buf = gpu_pool, gpu_buf, host, host_buf
    src_slots = torch.randperm(src.shape[0], generator=gen)[:7].int().to(dev)
    dst_slots = torch.randperm(dst.shape[0], generator=gen)[:7].int().to(dev)

    for backend in ("triton", "torch"):
        src_before, dst_before = src_buf.clone(), dst_buf.clone()
        copy_pages(src, src_slots, dst, dst_slots, backend=backend)
        torch.cuda.synchronize()  # the host reads a pinned dst only after the stream finished
        expected = dst_before.clone()
        exp_pool = expected.as_strided(dst.shape, dst.stride(), dst.storage_offset())
        src_view = src_before.as_strided(src.shape, src.stride(), src.storage_offset())
        _bits(exp_pool)[dst_slots.long().to(expected.device)] = \
            _bits(src_view)[src_slots.long().to(src_view.device)].to(expected.device)
        assert torch.equal(_bits(dst_buf), _bits(expected)), backend
        assert torch.equal(_bits(src_buf), _bits(src_before)), backend
        _bits(dst_buf).copy_(_bits(dst_before))
    figures.case("copy")


@gpu
@needs_cuda
def test_pageable_host_pool_with_cuda_pool_is_refused(figures):
    host = torch.zeros(4, 2, 8, 1, 40, dtype=torch.float16)
    dev_pool = torch.zeros(4, 2, 8, 1, 40, dtype=torch.float16, device="cuda")
    slots = torch.arange(2, dtype=torch.int32, device="cuda")
    with pytest.raises(KernelInputError, match=r"src_pool is in pageable.*pin_memory"):
        copy_pages(host, slots, dev_pool, slots)
    with pytest.raises(KernelInputError, match=r"dst_pool is in pageable.*pin_memory"):
        copy_pages(dev_pool, slots, host, slots)
    with pytest.raises(KernelInputError, match="src_slots is on cpu"):
        copy_pages(host.pin_memory(), slots.cpu(), dev_pool, slots)
    figures.bad_input("copy")


@gpu
@needs_cuda
def test_int64_addresses_past_2_31_elements(figures):
    # an odd slot stride forces 2-byte raw elements; slot 2 starts past 2**31 of them (4 GiB)
    stride = 2 ** 30 + 1
    page = (2, 1, 1, 8)
    buf = torch.full((2 * stride + 16,), float("nan"), dtype=torch.float16, device="cuda")
    pool = buf.as_strided((3, *page), (stride, 8, 8, 8, 1))
    src = torch.arange(16, dtype=torch.float16, device="cuda").view(1, *page)
    slots = torch.tensor([2], dtype=torch.int32, device="cuda")
    copy_pages(src, torch.zeros(1, dtype=torch.int32, device="cuda"), pool, slots)
    assert torch.equal(_bits(pool[2]), _bits(src[0]))
    back = torch.zeros_like(src)
    copy_pages(pool, slots, back, torch.zeros(1, dtype=torch.int32, device="cuda"))
    assert torch.equal(_bits(back), _bits(src))
    figures.case("copy")


# --- bad inputs ----------------------------------------------------------------------------------

def _pools(device="cpu"):
    gen = torch.Generator().manual_seed(1)
    src, _ = make_pool(6, (2, 8, 2, 40), torch.float16, device, PLAIN, gen)
    dst, _ = make_pool(5, (2, 8, 2, 40), torch.float16, device, PLAIN, gen)
    return src, dst


def _i32(*v, device="cpu"):
    return torch.tensor(v, dtype=torch.int32, device=device)


def _bad_cases():
    src, dst = _pools()
    s, d = _i32(0, 3), _i32(1, 4)
    page = src[0].numel()
    half_page = src.view(-1)[page // 2:][: 5 * page].view(5, 2, 8, 2, 40)  # aliases src, shifted
    return [
        ("src-rank", lambda: copy_pages(src[0], s, dst, d), KernelInputError,
         "src_pool must have 5 dimensions"),
        ("src-not-tensor", lambda: copy_pages(src.numpy(), s, dst, d), KernelInputError,
         "src_pool must be a torch.Tensor"),
        ("pool-int-dtype", lambda: copy_pages(src.view(torch.int16), s, dst.view(torch.int16), d),
         KernelInputError, "src_pool has dtype torch.int16"),
        ("pool-layout", lambda: copy_pages(src, s, torch.zeros(5, 3, 8, 2, 40).half(), d),
         KernelInputError, "dst_pool must be laid out"),
        ("dtype-mismatch", lambda: copy_pages(src, s, dst.bfloat16(), d), KernelInputError,
         "dst_pool has dtype torch.bfloat16 but src_pool has torch.float16"),
        ("page-shape-mismatch", lambda: copy_pages(src, s, dst[:, :, :4].contiguous(), d),
         KernelInputError, "dst_pool has page shape"),
        ("page-not-contiguous", lambda: copy_pages(src, s, dst.transpose(2, 3).contiguous()
                                                   .transpose(2, 3), d),
         KernelInputError, "dst_pool must hold each page as one contiguous block"),
        ("slots-overlap-in-pool", lambda: copy_pages(
            src.as_strided((4, 2, 8, 2, 40), (100, 640, 80, 40, 1)), s, dst, d),
         KernelInputError, "src_pool has slot stride 100"),
        ("slot-dtype-int64", lambda: copy_pages(src, s.long(), dst, d), KernelInputError,
         r"src_slots has dtype torch.int64.*to\(torch.int32\)"),
        ("slot-rank", lambda: copy_pages(src, s, dst, d[None]), KernelInputError,
         "dst_slots must have 1 dimensions"),
        ("lengths-differ", lambda: copy_pages(src, s, dst, _i32(1, 2, 3)), KernelInputError,
         "dst_slots has 3 entries but src_slots has 2"),
        ("src-out-of-range", lambda: copy_pages(src, _i32(0, 6), dst, d), KernelInputError,
         r"src_slots\[1\]=6 is out of range for src_pool with 6 slots"),
        ("dst-out-of-range", lambda: copy_pages(src, s, dst, _i32(5, 0)), KernelInputError,
         r"dst_slots\[0\]=5 is out of range for dst_pool with 5 slots"),
        ("negative-slot", lambda: copy_pages(src, _i32(-1, 2), dst, d), KernelInputError,
         r"src_slots\[0\]=-1 is out of range"),
        ("duplicate-dst", lambda: copy_pages(src, _i32(0, 1, 2), dst, _i32(4, 2, 4)),
         KernelInputError, r"dst_slots lists slot 4 more than once \(entries \[0, 2\]\)"),
        ("same-pool-overlap", lambda: copy_pages(src, _i32(0, 2, 5), src, _i32(3, 4, 2)),
         KernelInputError, r"src_slots\[1\]=2 and dst_slots\[2\]=2 are the same memory"),
        ("aliasing-views-overlap", lambda: copy_pages(src, _i32(0), half_page, _i32(0)),
         KernelInputError, r"src_slots\[0\]=0 and dst_slots\[0\]=0 are the same memory"),
        ("max-programs", lambda: copy_pages(src, s, dst, d, max_programs=0), KernelInputError,
         "max_programs must be"),
        ("block-bytes", lambda: copy_pages(src, s, dst, d, block_bytes=100), KernelInputError,
         "block_bytes must be"),
        ("backend-bogus", lambda: copy_pages(src, s, dst, d, backend="bogus"), KernelInputError,
         "backend='bogus'"),
        ("pool-device", lambda: copy_pages(src, s, dst.to("meta"), d), KernelInputError,
         "src_pool is on cpu and dst_pool on meta"),
        ("slot-device", lambda: copy_pages(src, s.to("meta"), dst, d), KernelInputError,
         "src_slots is on meta but the copy runs on cpu"),
    ]


@pytest.mark.parametrize("name,call,exc,match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs(name, call, exc, match, figures):
    with pytest.raises(exc, match=match):
        call()
    figures.bad_input("copy")


def test_refused_call_writes_nothing(device):
    src, dst = _pools(device)
    before = dst.clone()
    for ss, ds in ((_i32(0, 9), _i32(1, 2)), (_i32(0, 1), _i32(3, 3)), (_i32(0, 1), _i32(2, -1))):
        ss, ds = ss.to(device), ds.to(device)
        with pytest.raises(KernelInputError):
            copy_pages(src, ss, dst, ds, backend="triton")
        with pytest.raises(KernelInputError):
            copy_pages(src, ss, dst, ds, backend="torch")
    assert torch.equal(_bits(dst), _bits(before))


def test_triton_backend_without_interpreter_or_cuda_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    src, dst = _pools()
    with pytest.raises(KernelUnsupportedError, match="TRITON_INTERPRET=1"):
        copy_pages(src, _i32(0), dst, _i32(0), backend="triton")
