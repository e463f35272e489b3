"""Kernel edge cases found in review: strided outputs, 64-bit addressing on a > 2^31-element
pool, normalisation by an outside LSE with empty rows, and the widest page sizes."""

from __future__ import annotations

import pytest
import torch
from helpers import one_row

from tierattn.kernels import (
    PageTable,
    merge_states,
    paged_prefill,
    paged_prefill_mass,
    sparse_decode,
    sparse_decode_reference,
)
from tierattn.kernels.prefill import paged_prefill_reference
from tierattn.kernels.testing import check_rule

I32 = torch.int32




def test_decode_and_merge_write_strided_outputs(device):
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(6, 2, 8, 2, 32, generator=gen).to(device)
    q = torch.randn(2, 4, 32, generator=gen).to(device)
    table = PageTable.from_csr(torch.tensor([0, 3, 5], dtype=I32, device=device),
                               torch.tensor([4, 1, 3, 0, 2], dtype=I32, device=device),
                               torch.tensor([5, 8], dtype=I32, device=device))
    base = sparse_decode(q, pool, table, num_splits=2)
    out = torch.full((32, 4, 2), float("nan"), device=device).permute(2, 1, 0)  # [2, 4, 32]
    lse = torch.full((4, 2), float("nan"), device=device).T  # [2, 4], strided
    assert not out.is_contiguous() and not lse.is_contiguous()
    res = sparse_decode(q, pool, table, num_splits=2, out=out, lse=lse)
    assert res.out.data_ptr() == out.data_ptr()
    assert torch.equal(out, base.out) and torch.equal(lse, base.lse)
    o = torch.randn(3, 4, 16, generator=gen).to(device)
    s = torch.randn(3, 4, generator=gen).to(device)
    want = merge_states(o, s)
    out_m = torch.full((16, 4), float("nan"), device=device).T
    lse_m = torch.full((4, 2), float("nan"), device=device)[:, 0]
    merge_states(o, s, out=out_m, out_lse=lse_m)
    assert torch.equal(out_m, want[0]) and torch.equal(lse_m, want[1])


@pytest.fixture(scope="module")
def huge_pool():
    """A pool of more than 2^31 elements (4.3 GB of bf16, zero pages mapped lazily by the OS
    until written); only its first and last slots hold data."""
    p, h, d = 16, 8, 128
    slots = (1 << 31) // (2 * p * h * d) + 2
    pool = torch.zeros(slots, 2, p, h, d, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    pool[-1] = torch.randn(2, p, h, d, generator=gen).to(torch.bfloat16)
    pool[0] = torch.randn(2, p, h, d, generator=gen).to(torch.bfloat16)
    return pool


def test_decode_reads_past_2_pow_31_elements(huge_pool, figures):
    last = huge_pool.shape[0] - 1
    assert huge_pool.numel() > 1 << 31 and last * huge_pool.stride(0) > 1 << 31
    q = torch.randn(1, 32, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    table = one_row([0, last], 9)
    res = sparse_decode(q, huge_pool, table, return_page_mass=True)
    small = huge_pool[[0, last]]
    ref = sparse_decode_reference(q.double(), small.double(), one_row([0, 1], 9),
                                  return_page_mass=True)
    low = sparse_decode_reference(q, small, one_row([0, 1], 9), compute_dtype=torch.bfloat16)
    c = check_rule(res.out, ref.out, low.out, torch.bfloat16)
    figures.case("decode", c)
    assert c.ok, c
    assert res.page_mass[1].sum() > 0  # the far page was read, not masked


def test_prefill_reads_past_2_pow_31_elements(huge_pool, figures):
    last = huge_pool.shape[0] - 1
    q = torch.randn(5, 16, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    qo = torch.tensor([0, 5], dtype=I32)
    res = paged_prefill(q, huge_pool, one_row([0, last], 12), qo)
    small = huge_pool[[0, last]]
    ref = paged_prefill_reference(q.double(), small.double(), one_row([0, 1], 12), qo)
    low = paged_prefill_reference(q, small, one_row([0, 1], 12), qo, compute_dtype=torch.bfloat16)
    c = check_rule(res.out, ref.out, low.out, torch.bfloat16)
    figures.case("prefill", c)
    assert c.ok, c


@pytest.mark.parametrize("dt", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_prefill_mass_under_outside_lse_kernel_matches_reference(dt, device, figures):
    gen = torch.Generator().manual_seed(4)
    pages = torch.randn(6, 2, 8, 2, 40, generator=gen).to(dt)
    q = torch.randn(7, 8, 40, generator=gen).to(dt)
    table, qo = one_row([5, 0, 2, 3], 6), torch.tensor([0, 7], dtype=I32)
    kw = dict(sliding_window=11, softcap=15.0)
    lse = paged_prefill(q, pages, table, qo, **kw).lse + 0.3  # as if merged with other pages
    lse[2, 1] = float("-inf")  # an empty row contributes nothing, never NaN
    got = paged_prefill_mass(q.to(device), pages.to(device), table.to(device), qo.to(device),
                             lse.to(device), **kw)
    ref = paged_prefill_reference(q.double(), pages.double(), table, qo, return_page_mass=True,
                                  mass_lse=lse.double(), **kw).page_mass
    low = paged_prefill_reference(q, pages, table, qo, return_page_mass=True, mass_lse=lse,
                                  compute_dtype=dt, **kw).page_mass
    c = check_rule(got, ref, low, dt)
    figures.case("prefill", c)
    assert c.ok and not torch.isnan(got).any(), c


@pytest.mark.parametrize("page_size", [128, 100])
def test_decode_widest_pages(page_size, device, figures):
    gen = torch.Generator().manual_seed(page_size)
    pool = torch.randn(4, 2, page_size, 2, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, 4, 64, generator=gen).to(torch.bfloat16)
    table = one_row([3, 0, 2], page_size - 7)
    res = sparse_decode(q.to(device), pool.to(device), table.to(device), num_splits=2,
                        return_page_mass=True)
    ref = sparse_decode_reference(q.double(), pool.double(), table, return_page_mass=True)
    low = sparse_decode_reference(q, pool, table, return_page_mass=True,
                                  compute_dtype=torch.bfloat16)
    c = max(check_rule(res.out, ref.out, low.out, torch.bfloat16),
            check_rule(res.page_mass, ref.page_mass, low.page_mass, torch.bfloat16),
            key=lambda r: r.ratio)
    figures.case("decode", c)
    assert c.ok, c


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("pad", [0, 1, 5, 8, 13])
def test_first_lane_masks_left_padding_exactly(pad, backend, device, figures):
    """Masking the first ``pad`` tokens equals attending a sequence without them: decode,
    prefill and the prefill mass (the padded tokens get no mass)."""
    gen = torch.Generator().manual_seed(pad)
    p, hq, hkv, d = 8, 4, 2, 32
    n = 29
    pages = torch.randn(4, 2, p, hkv, d, generator=gen).to(torch.bfloat16)
    tokens = pages.permute(0, 2, 1, 3, 4).reshape(4 * p, 2, hkv, d)[:n]
    pages_nan = pages.clone()
    flat = pages_nan.permute(0, 2, 1, 3, 4)  # [page, lane, 2, H, D] view
    for t in range(pad):  # padded tokens hold garbage: masking must not read them
        flat[t // p, t % p] = float("nan")
    table = one_row([0, 1, 2, 3], n - 3 * p, device)
    first = torch.tensor([min(max(pad - e * p, 0), p) for e in range(4)], dtype=I32,
                         device=device)
    # the same tokens without the padding, packed from position 0
    kept = tokens[pad:]
    m = len(kept)
    packed = torch.zeros(4, p, 2, hkv, d, dtype=torch.bfloat16)
    packed.view(4 * p, 2, hkv, d)[:m] = kept
    packed = packed.permute(0, 2, 1, 3, 4).contiguous()
    ptab = one_row(list(range(-(-m // p))), m - (-(-m // p) - 1) * p)
    q = torch.randn(1, hq, d, generator=gen).to(torch.bfloat16)
    res = sparse_decode(q.to(device), pages_nan.to(device), table, first_lane=first,
                        return_page_mass=True, backend=backend)
    ref = sparse_decode_reference(q.double(), packed.double(), ptab)
    low = sparse_decode_reference(q, packed, ptab, compute_dtype=torch.bfloat16)
    c = check_rule(res.out, ref.out, low.out, torch.bfloat16)
    figures.case("decode", c)
    assert c.ok, c
    assert float(res.page_mass[: pad // p].sum()) == 0.0
    # prefill of the last 6 tokens (causal), and its mass under its own LSE
    qp = torch.randn(6, hq, d, generator=gen).to(torch.bfloat16)
    qo = torch.tensor([0, 6], dtype=I32)
    got = paged_prefill(qp.to(device), pages_nan.to(device), table, qo.to(device),
                        first_lane=first, return_page_mass=True, backend=backend)
    ref_p = paged_prefill_reference(qp.double(), packed.double(), ptab, qo)
    low_p = paged_prefill_reference(qp, packed, ptab, qo, compute_dtype=torch.bfloat16)
    c = check_rule(got.out, ref_p.out, low_p.out, torch.bfloat16)
    figures.case("prefill", c)
    assert c.ok, c
    again = paged_prefill_mass(qp.to(device), pages_nan.to(device), table, qo.to(device),
                               got.lse, first_lane=first, backend=backend)
    torch.testing.assert_close(again, got.page_mass, atol=1e-6, rtol=1e-6)
    assert torch.allclose(got.page_mass.sum(0).cpu(), torch.full((hkv,), 6.0 * hq / hkv),
                          atol=1e-4)
