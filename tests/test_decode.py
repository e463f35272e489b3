"""Sparse paged decode: adversarial cases, seeded random cases, masking, red zones, bad inputs."""

from __future__ import annotations

import random

import pytest
import torch

from tierattn.errors import KernelInputError, KernelUnsupportedError
from tierattn.kernels.decode import sparse_decode, sparse_decode_reference
from tierattn.kernels.page_table import PageTable
from tierattn.kernels.testing import check_rule, margins_intact, red_zone

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def build(kv_lens, hq, hkv, d, page_size, dtype, device, *, head_rows=False, padded=False,
          extra_slots=3, gen=None):
    """Random pool + page table whose rows hold ``kv_lens`` tokens on randomly ordered slots."""
    gen = gen or torch.Generator().manual_seed(0)
    rows_lens = [n for n in kv_lens for _ in range(hkv)] if head_rows else list(kv_lens)
    counts = [-(-n // page_size) for n in rows_lens]
    num_slots = sum(counts) + extra_slots
    pool = torch.randn(num_slots, 2, page_size, hkv, d, generator=gen).to(dtype).to(device)
    q = torch.randn(len(kv_lens), hq, d, generator=gen).to(dtype).to(device)
    perm = torch.randperm(num_slots, generator=gen)[: sum(counts)].to(torch.int32)
    lens = torch.tensor(rows_lens, dtype=torch.int32)
    if padded:
        width = max(counts, default=0) + 1
        table = torch.full((len(rows_lens), width), 10**6, dtype=torch.int32)  # junk padding
        pos = 0
        for r, c in enumerate(counts):
            table[r, :c] = perm[pos:pos + c]
            pos += c
        pt = PageTable.from_padded(table.to(device), lens.to(device), page_size)
    else:
        indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        last = torch.where(torch.tensor(counts) > 0, lens - (torch.tensor(counts) - 1) * page_size,
                           0).to(torch.int32)
        pt = PageTable.from_csr(indptr.to(device), perm.to(device), last.to(device))
    # poison every slot no row uses and the unfilled tail of each row's last page: a kernel
    # that reads a token it should not sees NaN
    used = set(perm.tolist())
    for s in range(num_slots):
        if s not in used:
            pool[s] = float("nan")
    pos = 0
    for n, c in zip(rows_lens, counts):
        if c:
            pool[int(perm[pos + c - 1]), :, n - (c - 1) * page_size:] = float("nan")
        pos += c
    return q, pool, pt


def run_and_check(q, pool, pt, figures, *, random_case=False, **kw):
    dtype = q.dtype
    res = sparse_decode(q, pool, pt, return_page_mass=True, **kw)
    kw.pop("num_splits", None)
    kw.pop("backend", None)
    ref = sparse_decode_reference(q.double(), pool.double(), pt, return_page_mass=True, **kw)
    lowp = sparse_decode_reference(q, pool, pt, return_page_mass=True, compute_dtype=dtype, **kw)
    checks = {name: check_rule(getattr(res, name), getattr(ref, name), getattr(lowp, name), dtype)
              for name in ("out", "lse", "page_mass")}
    worst = max(checks.values(), key=lambda c: c.ratio)
    figures.case("decode", worst, random=random_case)
    for name, c in checks.items():
        assert c.ok, f"{name}: {c}"
    assert not torch.isnan(res.out).any() and not torch.isnan(res.lse).any()
    return res


def _cases():
    cases = []
    # page-boundary lengths k*P-1, k*P, k*P+1 for every page size
    for p in (1, 8, 16, 64):
        for k in (1, 2, 3):
            lens = [n for n in (k * p - 1, k * p, k * p + 1) if n > 0]
            cases.append(pytest.param(lens, 8, 2, 64, p, "bf16", False, False, 1, None,
                                      id=f"boundary-P{p}-k{k}"))
    # odd sequence lengths, one per case, with the head dim and GQA ratio rotating
    dims, groups = (40, 64, 80, 100, 128), ((4, 4), (4, 2), (8, 2), (10, 2), (8, 1))
    for i, n in enumerate((1, 2, 3, 5, 17, 63, 97, 111, 127, 128, 129, 257, 799, 1025)):
        d, (hq, hkv) = dims[i % 5], groups[i % 5]
        dt = ("bf16", "fp16", "fp32")[i % 3]
        cases.append(pytest.param([n], hq, hkv, d, 16, dt, False, i % 2 == 1, 1, None,
                                  id=f"T{n}-H{hq}/{hkv}-D{d}-P16-{dt}"))
    # head dims x GQA ratios x dtypes
    for d in (40, 64, 80, 100, 128):
        for hq, hkv in ((2, 2), (4, 2), (8, 2), (5, 1), (16, 2)):
            for dt in ("bf16", "fp16"):
                cases.append(pytest.param([37, 70], hq, hkv, d, 8, dt, False, False, 2, None,
                                          id=f"D{d}-H{hq}/{hkv}-{dt}"))
    # batches with zero-length and one-token sequences, per-sequence and per-head rows
    for head_rows in (False, True):
        for padded in (False, True):
            for lens in ([0, 1, 33], [1, 0, 0, 16], [0], [5, 0, 129, 1]):
                cases.append(pytest.param(lens, 6, 2, 48, 16, "bf16", head_rows, padded, 2, None,
                                          id=f"batch{'-'.join(map(str, lens))}"
                                             f"-{'head' if head_rows else 'seq'}rows"
                                             f"-{'padded' if padded else 'csr'}"))
    # split counts (explicit, more splits than pages, auto)
    for splits in (1, 2, 3, 5, 16, "auto"):
        cases.append(pytest.param([200, 7, 64], 8, 4, 64, 8, "fp16", False, False, splits, None,
                                  id=f"splits{splits}"))
    # softcap and non-power-of-two page sizes
    for cap in (1.0, 30.0):
        for p in (12, 16):
            cases.append(pytest.param([50, 100], 8, 2, 64, p, "bf16", False, False, 3, cap,
                                      id=f"softcap{cap}-P{p}"))
    return cases


@pytest.mark.parametrize("lens,hq,hkv,d,page_size,dt,head_rows,padded,splits,softcap", _cases())
def test_decode_cases(lens, hq, hkv, d, page_size, dt, head_rows, padded, splits, softcap,
                      device, figures):
    q, pool, pt = build(lens, hq, hkv, d, page_size, DTYPES[dt], device, head_rows=head_rows,
                        padded=padded)
    run_and_check(q, pool, pt, figures, num_splits=splits, softcap=softcap)


@pytest.mark.parametrize("i", range(25))
def test_decode_random(i, seed, device, figures):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 3, 4])
    hq = hkv * rng.choice([1, 2, 4, 5, 8])
    d = rng.choice([16, 32, 40, 64, 80, 96, 100, 128])
    p = rng.choice([1, 2, 4, 8, 12, 16, 32, 64])
    lens = [rng.choice([0, 1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 4))]
    dt = rng.choice(list(DTYPES))
    head_rows, padded = rng.random() < 0.3, rng.random() < 0.5
    splits = rng.choice([1, 2, 3, "auto"])
    cap = rng.choice([None, None, 20.0])
    q, pool, pt = build(lens, hq, hkv, d, p, DTYPES[dt], device, head_rows=head_rows,
                        padded=padded, gen=torch.Generator().manual_seed(seed))
    try:
        run_and_check(q, pool, pt, figures, random_case=True, num_splits=splits, softcap=cap)
    except AssertionError as e:
        raise AssertionError(f"seed={seed} lens={lens} H={hq}/{hkv} D={d} P={p} {dt} "
                             f"head_rows={head_rows} splits={splits} cap={cap}: {e}") from None


@pytest.mark.parametrize("splits", [1, 2, 3, "auto"])
def test_splits_agree(splits, device, figures):
    q, pool, pt = build([300, 41], 8, 2, 64, 16, torch.bfloat16, device)
    base = sparse_decode(q, pool, pt, num_splits=1, return_page_mass=True)
    res = sparse_decode(q, pool, pt, num_splits=splits, return_page_mass=True)
    ref = sparse_decode_reference(q.double(), pool.double(), pt)
    lowp = sparse_decode_reference(q, pool, pt, compute_dtype=q.dtype)
    c = check_rule(res.out, ref.out, lowp.out, q.dtype)
    figures.case("decode", c)
    assert c.ok, c
    # split-K only reorders fp32 sums: results agree far below the bf16 rule. On a GPU the
    # P.V dot runs in tf32, which rounds the fp32 probabilities to 10 mantissa bits, so the
    # splits' partial sums differ by ~1e-4 there (measured on an H200: 2.3e-4 at most)
    atol = 2e-6 if device.type == "cpu" else 1e-3
    torch.testing.assert_close(res.out, base.out, atol=atol, rtol=0)
    torch.testing.assert_close(res.page_mass, base.page_mass, atol=2e-6, rtol=0)


def test_page_mass_sums_to_group(device, figures):
    q, pool, pt = build([33, 0, 100], 12, 3, 32, 8, torch.float32, device)
    res = run_and_check(q, pool, pt, figures, num_splits=3)
    per_row = torch.stack([res.page_mass[s:s + c].sum(0) for s, c in
                           zip(pt.row_start.tolist(), pt.row_count.tolist())])
    want = torch.tensor([[4.0] * 3, [0.0] * 3, [4.0] * 3], device=device)
    torch.testing.assert_close(per_row, want, atol=1e-5, rtol=0)


# --- exact masking semantics -------------------------------------------------------------------

def test_empty_rows_give_zero_and_neg_inf(device, figures):
    q, pool, pt = build([0, 0], 4, 2, 32, 8, torch.bfloat16, device)
    res = sparse_decode(q, pool, pt, num_splits=2, return_page_mass=True)
    exact = bool((res.out == 0).all() and torch.isneginf(res.lse).all()
                 and (res.page_mass.numel() == 0))
    figures.masking("decode", exact)
    assert exact


@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
def test_single_key_very_negative_score_returns_v_exactly(dt, device, figures):
    dtype = DTYPES[dt]
    pool = torch.zeros(2, 2, 4, 1, 16, dtype=dtype)
    pool[1, 0, 0, 0, 0] = -1024.0  # the only valid key
    pool[1, 1, 0, 0] = torch.linspace(-3, 3, 16).to(dtype)
    q = torch.zeros(1, 1, 16, dtype=dtype)
    q[0, 0, 0] = 512.0
    pt = PageTable.from_csr(torch.tensor([0, 1], dtype=torch.int32),
                            torch.tensor([1], dtype=torch.int32),
                            torch.tensor([1], dtype=torch.int32))
    res = sparse_decode(q.to(device), pool.to(device), pt.to(device), sm_scale=1.0,
                        return_page_mass=True)
    exact = bool(torch.equal(res.out[0, 0].cpu(), pool[1, 1, 0, 0].float())
                 and res.lse.item() == -524288.0 and res.page_mass.item() == 1.0)
    figures.masking("decode", exact)
    assert exact, (res.out, res.lse)


def test_first_tile_fully_masked_gives_no_nan(device, figures):
    # with validate=False, out-of-range page ids are masked inside the kernel: the first
    # tile (8 pages of 8 tokens) has nothing valid, the rest must equal attention over the rest
    q, pool, pt = build([200], 4, 1, 32, 8, torch.bfloat16, device)
    bad = pt.indices.clone()
    bad[:8] = 10**6
    masked = PageTable(bad, pt.row_start, pt.row_count, pt.last_page_len)
    res = sparse_decode(q, pool, masked, validate=False, block_n=64)
    keep = PageTable.from_csr(torch.tensor([0, pt.indices.numel() - 8], dtype=torch.int32,
                                           device=device),
                              pt.indices[8:].contiguous(), pt.last_page_len)
    ref = sparse_decode(q, pool, keep)
    exact = bool(not torch.isnan(res.out).any() and torch.equal(res.out, ref.out))
    figures.masking("decode", exact)
    assert exact


def test_softcap_huge_scores_finite(device, figures):
    q, pool, pt = build([40], 4, 2, 32, 8, torch.float32, device)
    res = run_and_check(q * 1e3, pool * 1e3, pt, figures, softcap=5.0)
    assert torch.isfinite(res.lse).all()


# --- red zones, determinism, layouts -------------------------------------------------------------

def test_red_zones_and_views(device, figures):
    q, pool, pt = build([70, 3], 8, 2, 40, 16, torch.bfloat16, device)
    big_q = torch.full((4, 8, 40), float("nan"), dtype=q.dtype, device=device)
    big_q[1:3] = q
    big_pool = torch.full((pool.shape[0] + 2, *pool.shape[1:]), float("nan"), dtype=pool.dtype,
                          device=device)
    big_pool[1:-1] = pool
    pool_before = big_pool.clone()
    out, out_buf = red_zone((2, 8, 40), torch.float32, device)
    lse, lse_buf = red_zone((2, 8), torch.float32, device)
    res = sparse_decode(big_q[1:3], big_pool[1:-1], pt, out=out, lse=lse, num_splits=2)
    assert res.out.data_ptr() == out.data_ptr() and res.lse.data_ptr() == lse.data_ptr()
    assert margins_intact(out_buf, out) and margins_intact(lse_buf, lse)
    assert torch.equal(big_pool.view(torch.int16), pool_before.view(torch.int16))
    ref = sparse_decode_reference(q.double(), pool.double(), pt)
    lowp = sparse_decode_reference(q, pool, pt, compute_dtype=q.dtype)
    c = check_rule(out, ref.out, lowp.out, q.dtype)
    figures.case("decode", c)
    assert c.ok, c


def test_bitwise_deterministic(device):
    q, pool, pt = build([333, 18], 8, 2, 64, 16, torch.bfloat16, device)
    a = sparse_decode(q, pool, pt, num_splits=3, return_page_mass=True)
    b = sparse_decode(q, pool, pt, num_splits=3, return_page_mass=True)
    for x, y in ((a.out, b.out), (a.lse, b.lse), (a.page_mass, b.page_mass)):
        assert torch.equal(x, y)


def test_non_contiguous_q_equals_contiguous(device):
    q, pool, pt = build([90, 45], 8, 2, 64, 16, torch.float16, device)
    q_nc = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, permuted strides
    assert not q_nc.is_contiguous()
    a = sparse_decode(q, pool, pt, num_splits=2)
    b = sparse_decode(q_nc, pool, pt, num_splits=2)
    assert torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)


@pytest.mark.parametrize("lens,hq,hkv,d,page_size,dt,head_rows,padded,splits,softcap", _cases())
def test_torch_backend_matches_reference(lens, hq, hkv, d, page_size, dt, head_rows, padded,
                                         splits, softcap, device, figures):
    """The torch backend (every entry at once, no host read) meets the rule on every case, its
    page LSE included, with the NaN-poisoned lanes and slots of :func:`build`."""
    q, pool, pt = build(lens, hq, hkv, d, page_size, DTYPES[dt], device, head_rows=head_rows,
                        padded=padded)
    res = run_and_check(q, pool, pt, figures, softcap=softcap, backend="torch")
    ref = sparse_decode_reference(q.double(), pool.double(), pt, return_page_mass=True,
                                  softcap=softcap)
    finite = torch.isfinite(ref.page_lse)
    assert torch.equal(torch.isfinite(res.page_lse).cpu(), finite.cpu())
    torch.testing.assert_close(res.page_lse[finite], ref.page_lse[finite].float(), atol=2e-2,
                               rtol=2e-2)


# --- bad inputs ----------------------------------------------------------------------------------

def _ok():
    return build([20, 9], 4, 2, 32, 8, torch.float16, "cpu")


def _bad_cases():
    q, pool, pt = _ok()
    n = pool.shape[0]
    return [
        ("q-rank", lambda: sparse_decode(q[0], pool, pt), KernelInputError, "q must have 3"),
        ("q-dtype", lambda: sparse_decode(q.int(), pool, pt), KernelInputError, "q has dtype"),
        ("pool-rank", lambda: sparse_decode(q, pool[0], pt), KernelInputError, "kv_pool"),
        ("pool-layout", lambda: sparse_decode(q, torch.cat([pool, pool[:, :1]], 1), pt),
         KernelInputError, "kv_pool must be laid out"),
        ("dtype-mismatch", lambda: sparse_decode(q, pool.bfloat16(), pt), KernelInputError,
         "kv_pool"),
        ("gqa", lambda: sparse_decode(q[:, :3], pool, pt), KernelInputError, "H_q=3"),
        ("head-dim-mismatch", lambda: sparse_decode(q[..., :16], pool, pt), KernelInputError,
         "head dim"),
        ("head-dim-unsupported", lambda: sparse_decode(
            torch.zeros(2, 4, 300, dtype=torch.float16),
            torch.zeros(n, 2, 8, 2, 300, dtype=torch.float16), pt), KernelUnsupportedError,
         "kv_pool has head dim 300"),
        ("table-type", lambda: sparse_decode(q, pool, (pt.indices,)), KernelInputError,
         "page_table must be a PageTable"),
        ("table-rows", lambda: sparse_decode(q[:1].repeat(3, 1, 1), pool, pt), KernelInputError,
         "page_table has 2 rows"),
        ("page-id-range", lambda: sparse_decode(q, pool, PageTable(
            pt.indices + n, pt.row_start, pt.row_count, pt.last_page_len)), KernelInputError,
         "page id"),
        ("negative-id", lambda: sparse_decode(q, pool, PageTable(
            pt.indices - n, pt.row_start, pt.row_count, pt.last_page_len)), KernelInputError,
         "page id"),
        ("negative-length", lambda: sparse_decode(q, pool, PageTable.from_padded(
            torch.zeros(2, 3, dtype=torch.int32), torch.tensor([-5, 3], dtype=torch.int32), 8)),
         KernelInputError, "negative length"),
        ("negative-count", lambda: sparse_decode(q, pool, PageTable.from_csr(
            torch.tensor([0, 2, 1], dtype=torch.int32), pt.indices, pt.last_page_len)),
         KernelInputError, "negative page count"),
        ("last-page-len", lambda: sparse_decode(q, pool, PageTable(
            pt.indices, pt.row_start, pt.row_count, pt.last_page_len + 8)), KernelInputError,
         "last_page_len"),
        ("indptr-dtype", lambda: PageTable.from_csr(torch.tensor([0, 1, 2]),
                                                    pt.indices, pt.last_page_len),
         KernelInputError, "indptr has dtype"),
        ("indptr-length", lambda: PageTable.from_csr(torch.tensor([0, 1], dtype=torch.int32),
                                                     pt.indices, pt.last_page_len),
         KernelInputError, "indptr has 2 entries"),
        ("out-shape", lambda: sparse_decode(q, pool, pt, out=torch.zeros(2, 4, 16)),
         KernelInputError, "out must have shape"),
        ("lse-dtype", lambda: sparse_decode(q, pool, pt, lse=torch.zeros(2, 4, dtype=torch.half)),
         KernelInputError, "lse has dtype"),
        ("splits", lambda: sparse_decode(q, pool, pt, num_splits=0), KernelInputError,
         "num_splits"),
        ("sm-scale", lambda: sparse_decode(q, pool, pt, sm_scale=-1.0), KernelInputError,
         "sm_scale"),
        ("softcap", lambda: sparse_decode(q, pool, pt, softcap=-2.0), KernelInputError, "softcap"),
        ("backend", lambda: sparse_decode(q, pool, pt, backend="cuda"), KernelInputError,
         "backend='cuda'"),
        ("block-n", lambda: sparse_decode(q, pool, pt, block_n=48), KernelInputError, "block_n"),
        ("table-device", lambda: sparse_decode(q, pool, pt.to("meta")), KernelInputError,
         "page_table is on meta"),
    ]


@pytest.mark.parametrize("name,call,exc,match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs(name, call, exc, match, figures):
    with pytest.raises(exc, match=match):
        call()
    figures.bad_input("decode")


def test_triton_backend_without_interpreter_or_cuda_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, pool, pt = _ok()
    with pytest.raises(KernelUnsupportedError, match="TRITON_INTERPRET=1"):
        sparse_decode(q, pool, pt, backend="triton")


# --- page LSE scattered by logical page (the runtime's decode step) ------------------------------

@pytest.mark.parametrize("lens,hq,hkv,d,p", [
    ([37, 1, 16], 8, 2, 64, 16), ([5, 0, 9, 33], 4, 4, 40, 4), ([129], 16, 2, 128, 16),
    ([7, 8, 9], 10, 2, 100, 8)], ids=["B3-P16", "B4-P4-empty", "B1-long", "odd-D100"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_page_lse_scattered_by_index_equals_page_lse(lens, hq, hkv, d, p, backend, device,
                                                     figures):
    # each entry's page LSE lands in the row page_lse_index names; rows not named stay as they
    # were, and with the merged LSE the scattered rows give the page mass
    gen = torch.Generator().manual_seed(len(lens) + d)
    q, pool, pt = build(lens, hq, hkv, d, p, torch.float32, device, gen=gen)
    nnz = pt.indices.numel()
    dest = torch.randperm(nnz + 5, generator=gen)[:nnz].to(torch.int32)
    plse = torch.full((nnz + 5, hq), 7.0, device=device)
    res = sparse_decode(q, pool, pt, page_lse=plse, page_lse_index=dest.to(device),
                        backend=backend)
    ref = sparse_decode_reference(q.double(), pool.double(), pt, return_page_mass=True)
    assert res.page_mass is None and res.page_lse is plse
    assert check_rule(res.out, ref.out, ref.out.float(), torch.float32).ok
    got = plse.cpu()[dest.long()]
    want = ref.page_lse.float().cpu()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=False)
    untouched = torch.ones(nnz + 5, dtype=torch.bool)
    untouched[dest.long()] = False
    assert (plse.cpu()[untouched] == 7.0).all()
    figures.case("decode")


def test_page_lse_scatter_refuses_mixing_and_head_rows(device, figures):
    q, pool, pt = build([9], 4, 2, 16, 4, torch.float32, device)
    plse = torch.zeros(8, 4, device=device)
    idx = torch.zeros(pt.indices.numel(), dtype=torch.int32, device=device)
    with pytest.raises(KernelInputError, match="go together"):
        sparse_decode(q, pool, pt, page_lse=plse)
    with pytest.raises(KernelInputError, match="excludes"):
        sparse_decode(q, pool, pt, page_lse=plse, page_lse_index=idx, return_page_mass=True)
    with pytest.raises(KernelInputError, match="page_lse must be"):
        sparse_decode(q, pool, pt, page_lse=torch.zeros(8, 3, device=device), page_lse_index=idx)
    figures.bad_input("decode")
