"""page_metadata: exact (bitwise) element-wise key min/max per page and KV head.

Every pool is poisoned outside the filled lanes (NaN and huge keys in page tails, huge values in
the V plane and in unused slots), so metadata that reads one lane too many fails loudly.
"""

from __future__ import annotations

import random

import pytest
import torch

from tierattn.errors import KernelInputError, KernelUnsupportedError
from tierattn.kernels.metadata import page_metadata, page_metadata_reference
from tierattn.kernels.testing import margins_intact, red_zone

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HUGE = {torch.float32: 1e30, torch.float16: 6e4, torch.bfloat16: 1e30}


def _lens(m: int, p: int) -> list[int]:
    """Page lengths cycling through full, one token, empty, one short of full, and a middle."""
    pattern = [p, 1, 0, max(p - 1, 0), (p + 1) // 2]
    return [pattern[i % len(pattern)] for i in range(m)]


def _pool(num_slots, p, h, d, dtype, device, slots, lens):
    """Random keys in the filled lanes; NaN / +-huge everywhere a kernel must not read."""
    huge = HUGE[dtype]
    pool = torch.full((num_slots, 2, p, h, d), huge, dtype=dtype, device=device)
    pool[:, 1] = -huge  # V plane
    for slot, n in zip(slots.tolist(), lens.tolist()):
        pool[slot, 0, :n] = torch.randn(n, h, d, device=device).to(dtype) * 3
        tail = pool[slot, 0, n:]
        tail[: (p - n) // 2] = float("nan")
        tail[(p - n) // 2:] = -huge if n % 2 else huge
    return pool


def _inputs(m, num_slots, p, h, d, dtype, device, lens=None):
    slots = torch.randperm(num_slots, device=device)[:m].to(torch.int32)
    lens = torch.tensor(_lens(m, p) if lens is None else lens, dtype=torch.int32, device=device)
    return _pool(num_slots, p, h, d, dtype, device, slots, lens), slots, lens


def _assert_exact(kmin, kmax, pool, slots, lens):
    ref_min, ref_max = page_metadata_reference(pool, slots, lens)
    assert kmin.dtype == pool.dtype and kmax.dtype == pool.dtype
    assert torch.equal(kmin, ref_min), "kmin differs from the reference"
    assert torch.equal(kmax, ref_max), "kmax differs from the reference"
    # garbage lanes (NaN, +-huge) never reach the metadata; empty pages are 0/0
    assert torch.isfinite(kmin).all() and kmin.abs().max() < 100
    assert torch.isfinite(kmax).all() and kmax.abs().max() < 100
    empty = lens == 0
    assert (kmin[empty] == 0).all() and (kmax[empty] == 0).all()
    assert (kmin[~empty] <= kmax[~empty]).all()


def _case(m, num_slots, p, h, d, dt):
    cid = f"M{m}-S{num_slots}-P{p}-H{h}-D{d}-{dt}"
    return pytest.param(m, num_slots, p, h, d, DTYPES[dt], id=cid)


FRESH_CASES = [
    _case(5, 9, 1, 2, 64, "fp32"),
    _case(5, 9, 1, 1, 40, "bf16"),
    _case(3, 3, 1, 3, 100, "fp16"),
    _case(6, 11, 8, 2, 40, "bf16"),
    _case(6, 11, 8, 4, 64, "fp16"),
    _case(7, 8, 8, 1, 80, "fp32"),
    _case(5, 13, 8, 3, 100, "bf16"),
    _case(10, 16, 8, 2, 128, "fp16"),
    _case(5, 7, 16, 2, 40, "fp16"),
    _case(6, 9, 16, 4, 64, "bf16"),
    _case(5, 5, 16, 2, 80, "fp16"),
    _case(8, 12, 16, 1, 100, "fp32"),
    _case(5, 10, 16, 8, 128, "bf16"),
    _case(4, 9, 16, 2, 128, "fp32"),
    _case(5, 6, 64, 2, 40, "fp32"),
    _case(5, 8, 64, 1, 64, "bf16"),
    _case(6, 7, 64, 2, 80, "fp16"),
    _case(5, 9, 64, 3, 100, "bf16"),
    _case(5, 5, 64, 2, 128, "fp16"),
    _case(1, 4, 16, 2, 32, "fp32"),
    _case(1, 1, 8, 1, 256, "bf16"),
    _case(5, 6, 13, 2, 96, "fp16"),
]


@pytest.mark.parametrize("m, num_slots, p, h, d, dtype", FRESH_CASES)
def test_metadata_matches_reference(m, num_slots, p, h, d, dtype, device, seed, figures):
    pool, slots, lens = _inputs(m, num_slots, p, h, d, dtype, device)
    kmin, kmax = page_metadata(pool, slots, lens)
    assert kmin.shape == (m, h, d) and kmax.shape == (m, h, d)
    _assert_exact(kmin, kmax, pool, slots, lens)
    figures.case("metadata")


IN_PLACE_CASES = [
    _case(4, 9, 1, 2, 64, "fp16"),
    _case(5, 8, 8, 2, 40, "bf16"),
    _case(5, 10, 8, 4, 100, "fp32"),
    _case(6, 9, 16, 2, 80, "fp16"),
    _case(5, 7, 16, 1, 128, "bf16"),
    _case(5, 6, 64, 2, 64, "fp32"),
    _case(3, 5, 64, 3, 40, "bf16"),
]


@pytest.mark.parametrize("m, num_slots, p, h, d, dtype", IN_PLACE_CASES)
def test_metadata_in_place(m, num_slots, p, h, d, dtype, device, seed, figures):
    """Listed rows get the metadata; unlisted rows and the red zones stay bitwise unchanged."""
    pool, slots, lens = _inputs(m, num_slots, p, h, d, dtype, device)
    num_meta = m + 5
    kmin, kmin_buf = red_zone((num_meta, h, d), dtype, device)
    kmax, kmax_buf = red_zone((num_meta, h, d), dtype, device)
    kmin.copy_(torch.randn(num_meta, h, d, device=device))
    kmax.copy_(torch.randn(num_meta, h, d, device=device))
    before_min, before_max = kmin.clone(), kmax.clone()
    rows = torch.randperm(num_meta, device=device)[:m].to(torch.int32)

    out_min, out_max = page_metadata(pool, slots, lens, kmin=kmin, kmax=kmax, rows=rows)
    assert out_min.data_ptr() == kmin.data_ptr() and out_max.data_ptr() == kmax.data_ptr()
    _assert_exact(kmin[rows.long()], kmax[rows.long()], pool, slots, lens)
    untouched = torch.ones(num_meta, dtype=torch.bool, device=device)
    untouched[rows.long()] = False
    assert torch.equal(kmin[untouched], before_min[untouched])
    assert torch.equal(kmax[untouched], before_max[untouched])
    assert margins_intact(kmin_buf, kmin) and margins_intact(kmax_buf, kmax)
    figures.case("metadata")


@pytest.mark.parametrize("p, dt", [pytest.param(8, "bf16", id="P8-bf16"),
                                   pytest.param(16, "fp16", id="P16-fp16"),
                                   pytest.param(1, "fp32", id="P1-fp32")])
def test_metadata_incremental_fill(p, dt, device, seed, figures):
    """Recomputing the touched last page token by token equals a fresh computation each time."""
    dtype, h, d = DTYPES[dt], 2, 40
    pool = torch.full((3, 2, p, h, d), float("nan"), dtype=dtype, device=device)
    keys = torch.randn(p, h, d, device=device).to(dtype)
    slots = torch.tensor([1], dtype=torch.int32, device=device)
    rows = torch.tensor([2], dtype=torch.int32, device=device)
    kmin = torch.zeros(4, h, d, dtype=dtype, device=device)
    kmax = torch.zeros(4, h, d, dtype=dtype, device=device)
    for n in range(p + 1):
        if n > 0:
            pool[1, 0, n - 1] = keys[n - 1]
        lens = torch.tensor([n], dtype=torch.int32, device=device)
        page_metadata(pool, slots, lens, kmin=kmin, kmax=kmax, rows=rows)
        _assert_exact(kmin[2:3], kmax[2:3], pool, slots, lens)
    assert torch.equal(kmin[2], keys.amin(0)) and torch.equal(kmax[2], keys.amax(0))
    figures.case("metadata")


@pytest.mark.parametrize("i", range(6), ids=lambda i: f"random{i}")
def test_metadata_random(i, device, seed, figures):
    rng = random.Random(seed)
    p = rng.choice([1, 2, 8, 16, 31, 64])
    h = rng.randint(1, 4)
    d = rng.choice([16, 40, 64, 80, 100, 128, rng.randint(1, 256)])
    dtype = rng.choice(list(DTYPES.values()))
    num_slots = rng.randint(1, 12)
    m = rng.randint(1, num_slots)
    lens = [rng.randint(0, p) for _ in range(m)]
    pool, slots, lens_t = _inputs(m, num_slots, p, h, d, dtype, device, lens=lens)
    kmin, kmax = page_metadata(pool, slots, lens_t)
    try:
        _assert_exact(kmin, kmax, pool, slots, lens_t)
    except AssertionError as e:
        raise AssertionError(f"seed={seed} P={p} H={h} D={d} {dtype} lens={lens}: {e}") from e
    figures.case("metadata", random=True)


def test_metadata_deterministic_and_torch_backend(device, seed, figures):
    pool, slots, lens = _inputs(6, 9, 16, 2, 80, torch.bfloat16, device)
    first = page_metadata(pool, slots, lens)
    second = page_metadata(pool, slots, lens)
    ref = page_metadata(pool, slots, lens, backend="torch")
    for a, b, c in zip(first, second, ref):
        assert torch.equal(a, b) and torch.equal(a, c)
    figures.case("metadata")


def test_metadata_strided_pool_and_buffers(device, seed, figures):
    """A pool that is a view (every other slot, head dim cut from a wider buffer) and metadata
    buffers with a padded row stride give the same result as contiguous inputs."""
    p, h, d, dtype = 8, 2, 40, torch.float16
    pool, slots, lens = _inputs(5, 10, p, h, d, dtype, device)
    wide = torch.full((20, 2, p, h, d + 24), float("nan"), dtype=dtype, device=device)
    view = wide[::2, ..., :d]
    view.copy_(pool)
    assert not view.is_contiguous() and view.stride(-1) == 1
    kmin_w = torch.zeros(7, h, d + 8, dtype=dtype, device=device)
    kmax_w = torch.zeros(7, h, d + 8, dtype=dtype, device=device)
    rows = torch.tensor([6, 0, 3, 1, 4], dtype=torch.int32, device=device)
    page_metadata(view, slots, lens, kmin=kmin_w[..., :d], kmax=kmax_w[..., :d], rows=rows)
    _assert_exact(kmin_w[rows.long(), :, :d], kmax_w[rows.long(), :, :d], pool, slots, lens)
    assert (kmin_w[..., d:] == 0).all() and (kmax_w[..., d:] == 0).all()
    figures.case("metadata")


def test_metadata_unvalidated_out_of_range(device, seed, figures):
    """validate=False: a bad slot reads nothing (0/0), a bad row writes nothing, no crash."""
    pool, _, _ = _inputs(2, 4, 8, 2, 64, torch.float32, device, lens=[8, 8])
    kmin = torch.full((3, 2, 64), 5.0, device=device)
    kmax = torch.full((3, 2, 64), 5.0, device=device)
    slots = torch.tensor([99, 0, 1], dtype=torch.int32, device=device)
    lens = torch.tensor([8, 8, 8], dtype=torch.int32, device=device)
    rows = torch.tensor([0, 1000, -1], dtype=torch.int32, device=device)
    page_metadata(pool, slots, lens, kmin=kmin, kmax=kmax, rows=rows, validate=False)
    exact = bool((kmin[0] == 0).all() and (kmax[0] == 0).all()
                 and (kmin[1:] == 5).all() and (kmax[1:] == 5).all())
    figures.masking("metadata", exact)
    assert exact


def test_metadata_empty_batch(device):
    pool, _, _ = _inputs(1, 2, 8, 2, 64, torch.float16, device)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    kmin, kmax = page_metadata(pool, none, none)
    assert kmin.shape == (0, 2, 64) and kmax.shape == (0, 2, 64)


def _bad(name, match, **changes):
    return pytest.param(changes, match, id=name)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


BAD_INPUTS = [
    _bad("pool-rank4", "kv_pool", kv_pool=torch.zeros(4, 2, 8, 64)),
    _bad("pool-int-dtype", "kv_pool", kv_pool=torch.zeros(4, 2, 8, 2, 64, dtype=torch.int32)),
    _bad("pool-dim1-3", "kv_pool", kv_pool=torch.zeros(4, 3, 8, 2, 64)),
    _bad("pool-strided-D", "kv_pool", kv_pool=torch.zeros(4, 2, 8, 2, 128)[..., ::2]),
    _bad("pool-D300", "kv_pool", kv_pool=torch.zeros(4, 2, 8, 2, 300)),
    _bad("slots-int64", "slots", slots=torch.tensor([0, 1])),
    _bad("slots-rank2", "slots", slots=_i32(0, 1).view(1, 2)),
    _bad("slots-meta-device", "slots", slots=torch.zeros(2, dtype=torch.int32, device="meta")),
    _bad("slots-out-of-range", "slots", slots=_i32(0, 4)),
    _bad("slots-negative", "slots", slots=_i32(-1, 0)),
    _bad("lens-length", "page_lens", page_lens=_i32(3)),
    _bad("lens-over-page", "page_lens", page_lens=_i32(3, 9)),
    _bad("lens-negative", "page_lens", page_lens=_i32(-1, 2)),
    _bad("buffers-no-rows", "rows", kmin=torch.zeros(3, 2, 64), kmax=torch.zeros(3, 2, 64)),
    _bad("rows-no-kmax", "kmax", kmin=torch.zeros(3, 2, 64), rows=_i32(0, 1)),
    _bad("kmin-dtype", "kmin", kmin=torch.zeros(3, 2, 64, dtype=torch.float16),
         kmax=torch.zeros(3, 2, 64), rows=_i32(0, 1)),
    _bad("kmax-shape", "kmax", kmin=torch.zeros(3, 2, 64), kmax=torch.zeros(3, 2, 40),
         rows=_i32(0, 1)),
    _bad("kmin-head-count", "kmin", kmin=torch.zeros(3, 1, 64), kmax=torch.zeros(3, 1, 64),
         rows=_i32(0, 1)),
    _bad("rows-duplicate", "rows", kmin=torch.zeros(3, 2, 64), kmax=torch.zeros(3, 2, 64),
         rows=_i32(1, 1)),
    _bad("rows-out-of-range", "rows", kmin=torch.zeros(3, 2, 64), kmax=torch.zeros(3, 2, 64),
         rows=_i32(0, 3)),
    _bad("rows-int64", "rows", kmin=torch.zeros(3, 2, 64), kmax=torch.zeros(3, 2, 64),
         rows=torch.tensor([0, 1])),
    _bad("backend", "backend", backend="cuda"),
]


@pytest.mark.parametrize("changes, match", BAD_INPUTS)
def test_metadata_bad_input(changes, match, figures):
    args = dict(kv_pool=torch.zeros(4, 2, 8, 2, 64), slots=_i32(0, 1), page_lens=_i32(3, 8))
    args.update(changes)
    with pytest.raises((KernelInputError, KernelUnsupportedError), match=match):
        page_metadata(**args)
    figures.bad_input("metadata")


def test_metadata_same_buffer_rejected(figures):
    buf = torch.zeros(3, 2, 64)
    with pytest.raises(KernelInputError, match="kmin and kmax"):
        page_metadata(torch.zeros(4, 2, 8, 2, 64), _i32(0, 1), _i32(3, 8), kmin=buf, kmax=buf,
                      rows=_i32(0, 1))
    figures.bad_input("metadata")


def test_metadata_boundary_values_accepted(device):
    """Lengths 0 and page_size, the last slot and the last row are all valid."""
    pool = torch.randn(4, 2, 8, 2, 64, device=device)
    kmin = torch.zeros(3, 2, 64, device=device)
    kmax = torch.zeros(3, 2, 64, device=device)
    page_metadata(pool, _i32(3, 0).to(device), _i32(0, 8).to(device), kmin=kmin, kmax=kmax,
                  rows=_i32(2, 0).to(device))
    assert torch.equal(kmax[0], pool[0, 0].amax(0)) and (kmax[2] == 0).all()
