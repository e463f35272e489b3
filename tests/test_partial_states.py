"""Attention split over page sets that live in different pools, merged by LSE, equals attention
over the union -- outputs and per-page mass alike. This is how the runtime attends a hot set in
HBM plus pages fetched into a staging buffer."""

from __future__ import annotations

import pytest
import torch
from helpers import one_row

from tierattn.kernels import (
    decode_page_mass,
    merge_states,
    paged_prefill,
    paged_prefill_mass,
    sparse_decode,
    sparse_decode_reference,
)
from tierattn.kernels.prefill import paged_prefill_reference
from tierattn.kernels.testing import check_rule

I32 = torch.int32




@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cold", [[1, 2], [0, 3, 4], []], ids=["cold2", "cold3", "cold0"])
def test_decode_hot_plus_staged_equals_dense(dt, cold, device, figures):
    gen = torch.Generator().manual_seed(len(cold))
    p, hkv, hq, d, n_pages, last = 8, 2, 8, 64, 7, 5
    pages = torch.randn(n_pages, 2, p, hkv, d, generator=gen).to(dt)
    q = torch.randn(1, hq, d, generator=gen).to(dt).to(device)
    hot = [i for i in range(n_pages) if i not in cold]
    # hot pages in an "HBM" pool (shuffled slots), cold ones in a separate "staging" pool
    hbm = torch.full((10, 2, p, hkv, d), float("nan"), dtype=dt)
    hbm_slots = torch.randperm(10, generator=gen)[:len(hot)].tolist()
    hbm[hbm_slots] = pages[hot]
    stage = pages[cold].clone() if cold else torch.zeros(1, 2, p, hkv, d, dtype=dt)
    a = sparse_decode(q, hbm.to(device), one_row(hbm_slots, last, device), return_page_mass=True)
    b = sparse_decode(q, stage.to(device), one_row(list(range(len(cold))), p, device),
                      return_page_mass=True)
    out, lse = merge_states(torch.stack([a.out, b.out]), torch.stack([a.lse, b.lse]))
    full = one_row(list(range(n_pages)), last, "cpu")
    ref = sparse_decode_reference(q.double().cpu(), pages.double(), full, return_page_mass=True)
    low = sparse_decode_reference(q.cpu(), pages, full, return_page_mass=True, compute_dtype=dt)
    c = check_rule(out, ref.out, low.out, dt)
    mass = torch.zeros(n_pages, hkv)
    mass[hot] = decode_page_mass(a.page_lse, lse, one_row(hbm_slots, last, device), hkv).cpu()
    if cold:
        mass[cold] = decode_page_mass(b.page_lse, lse, one_row(list(range(len(cold))), p, device),
                                      hkv).cpu()
    cm = check_rule(mass, ref.page_mass, low.page_mass, dt)
    figures.case("decode", max(c, cm, key=lambda r: r.ratio))
    assert c.ok and cm.ok, (c, cm)


@pytest.mark.parametrize("chunk", [1, 5, 13], ids=lambda c: f"chunk{c}")
def test_prefill_tail_plus_earlier_pages_equals_full(chunk, device, figures):
    """A chunk attends its hot tail with causality (compacted positions are exact because the
    tail is contiguous) and earlier pages, hot or staged, without a mask."""
    gen = torch.Generator().manual_seed(chunk)
    p, hkv, hq, d, dt = 4, 2, 4, 32, torch.bfloat16
    kv_len = 29
    n_pages = -(-kv_len // p)
    last = kv_len - (n_pages - 1) * p
    pages = torch.randn(n_pages, 2, p, hkv, d, generator=gen).to(dt)
    q = torch.randn(chunk, hq, d, generator=gen).to(dt)
    first_chunk_page = (kv_len - chunk) // p
    tail = list(range(first_chunk_page, n_pages))
    early_hot = [0, 2][: first_chunk_page]
    staged = [i for i in range(first_chunk_page) if i not in early_hot]
    qo = torch.tensor([0, chunk], dtype=I32, device=device)
    hot = early_hot + tail
    a_tab = one_row(list(range(len(hot))), last, device)
    b_tab = one_row(list(range(len(staged))), p, device)
    hbm, stage = pages[hot].to(device), pages[staged].to(device) if staged else None
    a = paged_prefill(q.to(device), hbm, a_tab, qo, validate=False)
    parts = [a]
    if staged:
        parts.append(paged_prefill(q.to(device), stage, b_tab, qo, causal=False, validate=False))
    out, lse = merge_states(torch.stack([x.out for x in parts]),
                            torch.stack([x.lse for x in parts]))
    full = one_row(list(range(n_pages)), last, "cpu")
    qo_cpu = qo.cpu()
    ref = paged_prefill_reference(q.double(), pages.double(), full, qo_cpu, return_page_mass=True)
    low = paged_prefill_reference(q, pages, full, qo_cpu, return_page_mass=True, compute_dtype=dt)
    c = check_rule(out, ref.out, low.out, dt)
    mass = torch.zeros(n_pages, hkv)
    mass[hot] = paged_prefill_mass(q.to(device), hbm, a_tab, qo, lse, validate=False).cpu()
    if staged:
        mass[staged] = paged_prefill_mass(q.to(device), stage, b_tab, qo, lse, causal=False,
                                          validate=False).cpu()
    cm = check_rule(mass, ref.page_mass, low.page_mass, dt)
    figures.case("prefill", max(c, cm, key=lambda r: r.ratio))
    assert c.ok and cm.ok, (c, cm)
    torch.testing.assert_close(mass.sum(0), torch.full((hkv,), chunk * hq / hkv), atol=1e-4,
                               rtol=0)


def test_paged_prefill_mass_torch_backend_agrees(device):
    gen = torch.Generator().manual_seed(3)
    pages = torch.randn(5, 2, 8, 2, 32, generator=gen)
    q = torch.randn(6, 4, 32, generator=gen)
    tab, qo = one_row([0, 1, 2, 3, 4], 3, "cpu"), torch.tensor([0, 6], dtype=I32)
    res = paged_prefill(q, pages, tab, qo, return_page_mass=True, backend="torch")
    again = paged_prefill_mass(q, pages, tab, qo, res.lse, backend="torch")
    torch.testing.assert_close(again, res.page_mass, atol=1e-6, rtol=0)
