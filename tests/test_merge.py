"""LSE merge: exactness against attention over the union, associativity, infinities, bad inputs."""

from __future__ import annotations

import random

import pytest
import torch

from tierattn.errors import KernelInputError
from tierattn.kernels.decode import sparse_decode_reference
from tierattn.kernels.merge import merge_state, merge_states, merge_states_reference
from tierattn.kernels.page_table import PageTable
from tierattn.kernels.testing import check_rule, margins_intact, red_zone

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def random_states(n, batch, d, dtype, gen, *, neg_inf_frac=0.0, pos_inf=False):
    o = torch.randn(n, *batch, d, generator=gen).to(dtype)
    lse = torch.randn(n, *batch, generator=gen) * 8
    if neg_inf_frac:
        lse[torch.rand(lse.shape, generator=gen) < neg_inf_frac] = float("-inf")
    if pos_inf:
        lse.view(-1)[:: max(1, lse.numel() // 3)] = float("inf")
    return o, lse


def check(o, lse, figures, device, *, random_case=False):
    res_o, res_lse = merge_states(o.to(device), lse.to(device))
    ref_o, ref_lse = merge_states_reference(o.double(), lse.double())
    low_o, low_lse = merge_states_reference(o.float(), lse)
    c = max(check_rule(res_o, ref_o, low_o, torch.float32),
            check_rule(res_lse, ref_lse, low_lse, torch.float32), key=lambda r: r.ratio)
    figures.case("merge", c, random=random_case)
    assert c.ok, c
    assert not torch.isnan(res_o).any() and not torch.isnan(res_lse).any()
    return res_o, res_lse


def _cases():
    cases = []
    for n in (1, 2, 3, 5, 8, 17):
        for d in (1, 40, 64, 100, 128):
            dt = ("fp32", "bf16", "fp16")[(n + d) % 3]
            cases.append(pytest.param(n, (3, 2), d, dt, 0.0, False, id=f"N{n}-D{d}-{dt}"))
    for frac in (0.3, 0.7, 1.0):
        for n in (2, 4):
            cases.append(pytest.param(n, (5,), 64, "fp32", frac, False, id=f"N{n}-neginf{frac}"))
    for n in (1, 3):
        cases.append(pytest.param(n, (4,), 32, "fp32", 0.2, True, id=f"N{n}-posinf"))
    cases.append(pytest.param(3, (0,), 16, "fp32", 0.0, False, id="empty-batch"))
    return cases


@pytest.mark.parametrize("n,batch,d,dt,neg_inf,pos_inf", _cases())
def test_merge_cases(n, batch, d, dt, neg_inf, pos_inf, device, figures):
    gen = torch.Generator().manual_seed(n * 1000 + d)
    o, lse = random_states(n, batch, d, DTYPES[dt], gen, neg_inf_frac=neg_inf, pos_inf=pos_inf)
    check(o, lse, figures, device)


@pytest.mark.parametrize("i", range(10))
def test_merge_random(i, seed, device, figures):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n = rng.randint(1, 9)
    batch = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
    o, lse = random_states(n, batch, rng.choice([8, 40, 64, 96, 128]), torch.float32, gen,
                           neg_inf_frac=rng.choice([0.0, 0.25]))
    try:
        check(o, lse, figures, device, random_case=True)
    except AssertionError as e:
        raise AssertionError(f"seed={seed} n={n} batch={batch}: {e}") from None


@pytest.mark.parametrize("splits", [[10], [3, 7], [1, 1, 8], [4, 0, 6]])
def test_merge_of_disjoint_pages_equals_attention_over_union(splits, device, figures):
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, p = 4, 2, 64, 8
    pool = torch.randn(12, 2, p, hkv, d, generator=gen)
    q = torch.randn(1, hq, d, generator=gen)
    slots = torch.randperm(12, generator=gen)[:10].to(torch.int32)
    full = PageTable.from_csr(torch.tensor([0, 10], dtype=torch.int32), slots,
                              torch.tensor([p], dtype=torch.int32))
    outs, lses, pos = [], [], 0
    for k in splits:
        part = PageTable.from_csr(torch.tensor([0, k], dtype=torch.int32),
                                  slots[pos:pos + k].contiguous(),
                                  torch.tensor([p if k else 0], dtype=torch.int32))
        r = sparse_decode_reference(q, pool, part)
        outs.append(r.out)
        lses.append(r.lse)
        pos += k
    o, lse = merge_states(torch.stack(outs).to(device), torch.stack(lses).float().to(device))
    ref = sparse_decode_reference(q.double(), pool.double(), full)
    low = sparse_decode_reference(q, pool, full)
    c = check_rule(o, ref.out, low.out, torch.float32)
    figures.case("merge", c)
    assert c.ok, c
    torch.testing.assert_close(lse.double().cpu(), ref.lse, atol=1e-5, rtol=0)


def test_associative_and_commutative(device, figures):
    gen = torch.Generator().manual_seed(3)
    o, lse = random_states(3, (6,), 64, torch.float32, gen, neg_inf_frac=0.2)
    o, lse = o.to(device), lse.to(device)
    ab = merge_state(o[0], lse[0], o[1], lse[1])
    left = merge_state(*ab, o[2], lse[2])
    bc = merge_state(o[1], lse[1], o[2], lse[2])
    right = merge_state(o[0], lse[0], *bc)
    swapped = merge_states(o.flip(0), lse.flip(0))
    for a, b in ((left, right), (left, swapped)):
        torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=0)
    figures.case("merge")


def test_empty_states_merge_to_empty(device, figures):
    o = torch.zeros(3, 4, 16, device=device)
    lse = torch.full((3, 4), float("-inf"), device=device)
    res_o, res_lse = merge_states(o, lse)
    exact = bool((res_o == 0).all() and torch.isneginf(res_lse).all())
    figures.masking("merge", exact)
    assert exact


def test_empty_state_is_identity(device, figures):
    gen = torch.Generator().manual_seed(1)
    o, lse = random_states(1, (5,), 32, torch.float32, gen)
    empty_o = torch.full_like(o[0], float("nan"))  # an empty state's output is never read
    res_o, res_lse = merge_state(o[0].to(device), lse[0].to(device), empty_o.to(device),
                                 torch.full_like(lse[0], float("-inf")).to(device))
    exact = bool(torch.equal(res_o.cpu(), o[0]) and torch.equal(res_lse.cpu(), lse[0]))
    figures.masking("merge", exact)
    assert exact


def test_pos_inf_dominates_without_nan(device, figures):
    o = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]], device=device)
    lse = torch.tensor([[float("inf")], [0.0], [float("inf")]], device=device)
    res_o, res_lse = merge_states(o, lse)
    exact = bool(torch.equal(res_o.cpu(), torch.tensor([[3.0, 4.0]]))
                 and torch.isposinf(res_lse).all())
    figures.masking("merge", exact)
    assert exact


def test_red_zone_outputs_and_strided_input(device, figures):
    gen = torch.Generator().manual_seed(5)
    o, lse = random_states(4, (3, 5), 40, torch.float32, gen)
    o_nc = o.transpose(1, 2).contiguous().transpose(1, 2).to(device)  # non-contiguous batch dims
    out, out_buf = red_zone((3, 5, 40), torch.float32, device)
    out_lse, lse_buf = red_zone((3, 5), torch.float32, device)
    merge_states(o_nc, lse.to(device), out=out, out_lse=out_lse)
    assert margins_intact(out_buf, out) and margins_intact(lse_buf, out_lse)
    base_o, base_lse = merge_states(o.to(device), lse.to(device))
    assert torch.equal(out, base_o) and torch.equal(out_lse, base_lse)
    figures.case("merge")


def test_torch_backend_agrees(device):
    gen = torch.Generator().manual_seed(9)
    o, lse = random_states(4, (7,), 64, torch.float32, gen, neg_inf_frac=0.3)
    a = merge_states(o, lse, backend="torch")
    b = merge_states(o.to(device), lse.to(device))
    torch.testing.assert_close(a[0], b[0].cpu(), atol=1e-6, rtol=0)
    torch.testing.assert_close(a[1], b[1].cpu(), atol=1e-6, rtol=0)


_BAD = [
    ("o-dtype", lambda: merge_states(torch.zeros(2, 3, 4, dtype=torch.int32), torch.zeros(2, 3)),
     "o has dtype"),
    ("lse-dtype", lambda: merge_states(torch.zeros(2, 3, 4), torch.zeros(2, 3).double()),
     "lse has dtype"),
    ("shape", lambda: merge_states(torch.zeros(2, 3, 4), torch.zeros(2, 4)),
     "lse \\[N, \\*batch\\]"),
    ("rank", lambda: merge_states(torch.zeros(4), torch.zeros(())), "o must be"),
    ("no-states", lambda: merge_states(torch.zeros(0, 3, 4), torch.zeros(0, 3)), "N >= 1"),
    ("out-shape", lambda: merge_states(torch.zeros(2, 3, 4), torch.zeros(2, 3),
                                       out=torch.zeros(3, 5)), "out must have shape"),
    ("out-lse-dtype", lambda: merge_states(torch.zeros(2, 3, 4), torch.zeros(2, 3),
                                           out_lse=torch.zeros(3, dtype=torch.half)),
     "out_lse has dtype"),
    ("pair-mismatch", lambda: merge_state(torch.zeros(3, 4), torch.zeros(3), torch.zeros(2, 4),
                                          torch.zeros(2)), "must match pairwise"),
    ("device", lambda: merge_states(torch.zeros(2, 3, 4), torch.zeros(2, 3, device="meta")),
     "lse is on meta"),
    ("backend", lambda: merge_states(torch.zeros(2, 3, 4), torch.zeros(2, 3), backend="jax"),
     "backend='jax'"),
]


@pytest.mark.parametrize("name,call,match", _BAD, ids=[b[0] for b in _BAD])
def test_bad_inputs(name, call, match, figures):
    with pytest.raises(KernelInputError, match=match):
        call()
    figures.bad_input("merge")


# --- merge and page mass in one launch (the decode step's epilogue) ------------------------------

@pytest.mark.parametrize("n,b,hq,d,pages,inf", [
    (1, 2, 8, 16, 5, "none"), (2, 3, 6, 40, 70, "neg"), (3, 1, 32, 128, 130, "neg"),
    (2, 2, 4, 64, 1, "pos"), (4, 3, 12, 100, 17, "none")],
    ids=["N1", "N2-neginf", "N3-long", "N2-posinf", "N4-D100"])
def test_merge_page_mass_equals_merge_then_mass(n, b, hq, d, pages, inf, device, figures):
    from tierattn.kernels import merge_page_mass, merge_page_mass_reference

    gen = torch.Generator().manual_seed(n * 100 + pages)
    o = torch.randn(n, b, hq, d, generator=gen)
    lse = torch.randn(n, b, hq, generator=gen) * 4
    if inf == "neg":
        lse[0, 0, 1] = float("-inf")
        lse[:, -1, 0] = float("-inf")  # a head that saw no key at all: out 0, lse -inf, mass 0
    if inf == "pos":
        lse[0, 1, 2] = float("inf")
    plse = torch.full((b * pages + 2, hq), float("-inf"))
    hit = torch.randperm(b * pages, generator=gen)[:max(1, b * pages // 2)]
    plse[hit] = torch.randn(len(hit), hq, generator=gen) - 1
    mass = torch.rand(b * pages + 2, generator=gen)
    want_o, want_lse = merge_states_reference(o.double(), lse.double())
    norm = torch.where(torch.isneginf(want_lse), float("inf"), want_lse)
    want_mass = mass.double().clone()
    want_mass[:b * pages] += torch.exp(plse[:b * pages].double().view(b, pages, hq)
                                       - norm[:, None, :]).sum(-1).view(-1)
    got_plse, got_mass = plse.clone().to(device), mass.clone().to(device)
    out, out_lse = merge_page_mass(o.to(device), lse.to(device), got_plse, got_mass,
                                   pages_per_row=pages)
    low_o, low_lse, _ = merge_page_mass_reference(o, lse, plse, pages)
    c = max(check_rule(out, want_o, low_o, torch.float32),
            check_rule(out_lse, want_lse, low_lse, torch.float32), key=lambda r: r.ratio)
    figures.case("merge", c)
    assert c.ok, c
    assert not torch.isnan(out).any() and not torch.isnan(out_lse).any()
    assert torch.allclose(got_mass.cpu().double(), want_mass, rtol=1e-5, atol=1e-6)
    assert torch.isneginf(got_plse.cpu()[:b * pages]).all()  # reset for the next step
    assert torch.equal(got_plse.cpu()[b * pages:], plse[b * pages:])  # rows past B*P untouched
    assert torch.equal(got_mass.cpu()[b * pages:], mass[b * pages:])


def test_merge_page_mass_bad_inputs(figures):
    from tierattn.kernels import merge_page_mass

    o, lse = torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4)
    with pytest.raises(KernelInputError, match="page_lse must be"):
        merge_page_mass(o, lse, torch.zeros(3, 4), torch.zeros(8), pages_per_row=8)
    with pytest.raises(KernelInputError, match="mass must be"):
        merge_page_mass(o, lse, torch.zeros(8, 4), torch.zeros(3), pages_per_row=8)
    with pytest.raises(KernelInputError, match="pages_per_row"):
        merge_page_mass(o, lse, torch.zeros(8, 4), torch.zeros(8), pages_per_row=-1)
    figures.bad_input("merge")
