"""quest_score: Quest page upper bounds against an fp64 reference, with the flash-attention rule
(kernel error <= 2x the error of torch in the inputs' precision + floor), plus the bound's
defining property checked on real keys.
"""

from __future__ import annotations

import random

import pytest
import torch

from tierattn.errors import KernelInputError, KernelUnsupportedError
from tierattn.kernels.metadata import page_metadata
from tierattn.kernels.page_table import PageTable
from tierattn.kernels.score import quest_score, quest_score_reference
from tierattn.kernels.testing import check_rule, csr_table, margins_intact, red_zone

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: id written into the unused tail of padded tables: far out of range, so reading it would show.
UNUSED_ID = 1 << 30


def _metadata(num_meta, p, hkv, d, dtype, device):
    """kmin/kmax of ``num_meta`` full random pages of ``p`` keys (P = 1 gives kmin == kmax)."""
    keys = torch.randn(num_meta, p, hkv, d, device=device).to(dtype)
    return keys.amin(dim=1), keys.amax(dim=1)


def _table(counts, num_meta, p, layout, device, pad=0):
    """One row per sequence listing ``counts[b]`` distinct metadata rows in random order.

    ``csr``: ``pad`` unused entries after the last row; ``padded``: a block table ``pad`` columns
    wider than the longest row. Unused entries hold an out-of-range id.
    """
    ids = [torch.randperm(num_meta, device=device)[:c].to(torch.int32) for c in counts]
    last = [int(torch.randint(1, p + 1, ())) if c else 0 for c in counts]
    if layout == "csr":
        indptr = torch.tensor([0] + counts, device=device).cumsum(0).to(torch.int32)
        tail = torch.full((pad,), UNUSED_ID, dtype=torch.int32, device=device)
        indices = torch.cat(ids + [tail])
        return PageTable.from_csr(indptr, indices, torch.tensor(last, dtype=torch.int32,
                                                               device=device))
    width = max(counts, default=0) + pad
    table = torch.full((len(counts), width), UNUSED_ID, dtype=torch.int32, device=device)
    for b, row in enumerate(ids):
        table[b, :row.numel()] = row
    kv_lens = torch.tensor([(c - 1) * p + n if c else 0 for c, n in zip(counts, last)],
                           dtype=torch.int32, device=device)
    return PageTable.from_padded(table, kv_lens, p)


def _check(q, kmin, kmax, table, group_reduce, out):
    """The rule against fp64, with torch in the inputs' dtype as the low-precision baseline."""
    ref = quest_score_reference(q.double(), kmin.double(), kmax.double(), table,
                                group_reduce=group_reduce)
    lowp = quest_score_reference(q, kmin, kmax, table, group_reduce=group_reduce,
                                 compute_dtype=q.dtype)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # entries outside every row are exactly -inf, and only those
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    return check_rule(out, ref, lowp, q.dtype)


def _case(b, hq, hkv, d, p, counts, layout, dt, gr, pad=0, num_meta=None):
    num_meta = num_meta or max(max(counts, default=0), 1) + 3
    cid = f"B{b}-H{hq}/{hkv}-D{d}-P{p}-n{'.'.join(map(str, counts))}-{layout}{pad or ''}-{dt}-{gr}"
    return pytest.param(b, hq, hkv, d, p, counts, layout, DTYPES[dt], gr, pad, num_meta, id=cid)


GRID = [
    # GQA 1/2/4/5/8, head dims 40/64/80/100/128 (+ 32, 256), page sizes 1/8/16/64
    _case(1, 1, 1, 64, 16, [5], "csr", "fp32", "max"),
    _case(2, 2, 2, 40, 8, [3, 4], "csr", "fp16", "max"),
    _case(3, 8, 8, 128, 1, [2, 0, 6], "padded", "bf16", "sum"),
    _case(2, 4, 2, 40, 8, [7, 1], "csr", "bf16", "max"),
    _case(2, 4, 2, 40, 8, [7, 1], "csr", "bf16", "sum"),
    _case(3, 8, 4, 64, 16, [4, 9, 2], "padded", "fp16", "max", pad=2),
    _case(1, 16, 8, 80, 64, [6], "csr", "fp32", "sum", pad=3),
    _case(2, 6, 3, 100, 16, [5, 5], "padded", "fp32", "max"),
    _case(2, 12, 6, 128, 8, [3, 8], "csr", "fp16", "sum"),
    _case(3, 8, 2, 40, 16, [3, 0, 5], "csr", "bf16", "max"),
    _case(2, 8, 2, 64, 1, [10, 2], "padded", "fp32", "max", pad=1),
    _case(2, 4, 1, 80, 8, [4, 6], "csr", "fp16", "max"),
    _case(2, 4, 1, 80, 8, [4, 6], "csr", "fp16", "sum"),
    _case(1, 8, 2, 100, 64, [9], "padded", "bf16", "sum"),
    _case(2, 16, 4, 128, 16, [6, 3], "csr", "fp32", "max", pad=4),
    _case(2, 10, 2, 40, 16, [5, 2], "csr", "fp32", "sum"),
    _case(3, 5, 1, 64, 8, [1, 4, 7], "padded", "bf16", "max"),
    _case(2, 20, 4, 80, 1, [3, 3], "csr", "fp16", "max"),
    _case(2, 15, 3, 100, 64, [2, 5], "padded", "fp16", "sum"),
    _case(1, 40, 8, 128, 16, [4], "csr", "bf16", "max"),
    _case(2, 8, 1, 40, 16, [6, 1], "padded", "fp16", "max"),
    _case(2, 16, 2, 64, 8, [3, 7], "csr", "bf16", "sum"),
    _case(2, 32, 4, 80, 64, [2, 4], "csr", "fp32", "max"),
    _case(2, 8, 1, 100, 1, [5, 0], "padded", "fp32", "sum", pad=2),
    _case(1, 64, 8, 128, 16, [5], "csr", "fp16", "max"),
    _case(2, 16, 2, 128, 8, [4, 2], "padded", "bf16", "max"),
    # zero-page rows only, a row longer than one tile, odd and extreme head dims
    _case(3, 4, 2, 64, 16, [0, 0, 0], "csr", "fp16", "max", pad=2),
    _case(2, 4, 2, 64, 16, [0, 0], "padded", "bf16", "sum", pad=3),
    _case(1, 4, 2, 64, 16, [150], "csr", "fp32", "max"),
    _case(2, 2, 1, 128, 8, [70, 3], "padded", "bf16", "sum"),
    _case(2, 8, 4, 32, 8, [3, 4], "csr", "fp32", "max"),
    _case(2, 8, 2, 256, 16, [4, 3], "csr", "fp32", "sum"),
    _case(2, 8, 2, 256, 16, [4, 3], "padded", "bf16", "max"),
    _case(2, 3, 1, 17, 8, [5, 2], "csr", "fp16", "sum"),
    _case(4, 4, 4, 40, 8, [1, 2, 0, 1], "padded", "fp16", "max"),
    _case(1, 4, 2, 64, 8, [1], "csr", "bf16", "max", num_meta=1),
]


@pytest.mark.parametrize("b, hq, hkv, d, p, counts, layout, dtype, group_reduce, pad, num_meta",
                         GRID)
def test_score_grid(b, hq, hkv, d, p, counts, layout, dtype, group_reduce, pad, num_meta,
                    device, seed, figures):
    kmin, kmax = _metadata(num_meta, p, hkv, d, dtype, device)
    # logit-scale queries (q.k / sqrt(D) is what a top-k ranks): keeps fp32 scores O(10), where
    # the 1e-5 floor still means something next to rounding errors of one or two ulps
    q = (torch.randn(b, hq, d, device=device) * d ** -0.5).to(dtype)
    table = _table(counts, num_meta, p, layout, device, pad=pad)
    out = quest_score(q, kmin, kmax, table, group_reduce=group_reduce)
    check = _check(q, kmin, kmax, table, group_reduce, out)
    figures.case("score", check)
    assert check.ok, str(check)


@pytest.mark.parametrize("i", range(10), ids=lambda i: f"random{i}")
def test_score_random(i, device, seed, figures):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 4, 8])
    group = rng.choice([1, 2, 3, 4, 5, 8])
    d = rng.choice([40, 64, 80, 100, 128, rng.randint(1, 256)])
    p = rng.choice([1, 8, 16, 64])
    dtype = rng.choice(list(DTYPES.values()))
    gr = rng.choice(["max", "sum"])
    b = rng.randint(1, 4)
    num_meta = rng.randint(1, 40)
    counts = [rng.randint(0, num_meta) for _ in range(b)]
    layout = rng.choice(["csr", "padded"])
    pad = rng.randint(0, 3)
    kmin, kmax = _metadata(num_meta, p, hkv, d, dtype, device)
    scale = d ** -0.5 * rng.choice([0.1, 1.0, 4.0])
    q = (torch.randn(b, hkv * group, d, device=device) * scale).to(dtype)
    table = _table(counts, num_meta, p, layout, device, pad=pad)
    out = quest_score(q, kmin, kmax, table, group_reduce=gr)
    check = _check(q, kmin, kmax, table, gr, out)
    figures.case("score", check, random=True)
    assert check.ok, (f"seed={seed} B={b} H={hkv * group}/{hkv} D={d} P={p} {dtype} {gr} "
                      f"counts={counts} {layout}{pad}: {check}")


NEGATIVE_CASES = [
    pytest.param(2, 5, 1, 40, 8, "fp32", "max", id="B2-H5/1-D40-P8-fp32-max"),
    pytest.param(2, 6, 2, 64, 16, "bf16", "max", id="B2-H6/2-D64-P16-bf16-max"),
    pytest.param(1, 12, 4, 100, 1, "fp16", "sum", id="B1-H12/4-D100-P1-fp16-sum"),
]


@pytest.mark.parametrize("b, hq, hkv, d, p, dt, gr", NEGATIVE_CASES)
def test_score_negative_bounds(b, hq, hkv, d, p, dt, gr, device, seed, figures):
    """Keys far below zero and positive queries: every bound is negative, so padded query heads
    (group sizes that are not powers of two) must not count as a score of 0."""
    dtype = DTYPES[dt]
    keys = (torch.randn(8, p, hkv, d, device=device) - 4).to(dtype)
    kmin, kmax = keys.amin(dim=1), keys.amax(dim=1)
    q = torch.randn(b, hq, d, device=device).abs().to(dtype)
    table = _table([5] * b, 8, p, "csr", device, pad=1)
    out = quest_score(q, kmin, kmax, table, group_reduce=gr)
    assert (out[:5 * b] < 0).all()
    check = _check(q, kmin, kmax, table, gr, out)
    figures.case("score", check)
    assert check.ok, str(check)


def test_score_fp16_does_not_overflow(device, seed):
    """Bounds beyond the fp16 range stay finite: they are accumulated and returned in fp32."""
    keys = (torch.randn(4, 8, 2, 128, device=device) * 60).to(torch.float16)
    kmin, kmax = keys.amin(dim=1), keys.amax(dim=1)
    q = (torch.randn(1, 4, 128, device=device) * 60).to(torch.float16)
    table = _table([4], 4, 8, "csr", device)
    out = quest_score(q, kmin, kmax, table, group_reduce="sum")
    ref = quest_score_reference(q.double(), kmin.double(), kmax.double(), table,
                                group_reduce="sum")
    assert out.abs().max() > 65504 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=0)


BOUND_CASES = [
    pytest.param(2, 4, 2, 40, 8, "bf16", id="B2-H4/2-D40-P8-bf16"),
    pytest.param(2, 5, 1, 64, 16, "fp16", id="B2-H5/1-D64-P16-fp16"),
    pytest.param(1, 8, 8, 80, 1, "fp32", id="B1-H8/8-D80-P1-fp32"),
    pytest.param(2, 8, 2, 100, 64, "fp32", id="B2-H8/2-D100-P64-fp32"),
    pytest.param(3, 8, 1, 128, 16, "bf16", id="B3-H8/1-D128-P16-bf16"),
]


@pytest.mark.parametrize("b, hq, hkv, d, p, dt", BOUND_CASES)
def test_score_is_upper_bound(b, hq, hkv, d, p, dt, device, seed, figures):
    """On real (partly filled) pages: q.k <= the per-head bound for every key and query head;
    the "max" score >= every head's best q.k and the "sum" score >= the sum of them."""
    dtype, group = DTYPES[dt], hq // hkv
    pages_per_row = 4
    num_slots = b * pages_per_row + 2
    pool = (torch.randn(num_slots, 2, p, hkv, d, device=device) * 2).to(dtype)
    slots = torch.randperm(num_slots, device=device)[:b * pages_per_row].to(torch.int32)
    lens = torch.randint(1, p + 1, (b * pages_per_row,), device=device).to(torch.int32)
    pool[slots[-1].long(), 0, lens[-1]:] = 1e4  # stale keys past a page's fill do not count
    rows = torch.randperm(num_slots, device=device)[:b * pages_per_row].to(torch.int32)
    kmin = torch.zeros(num_slots, hkv, d, dtype=dtype, device=device)
    kmax = torch.zeros(num_slots, hkv, d, dtype=dtype, device=device)
    page_metadata(pool, slots, lens, kmin=kmin, kmax=kmax, rows=rows)
    indptr = torch.arange(b + 1, device=device).to(torch.int32) * pages_per_row
    table = PageTable.from_csr(indptr, rows, lens.view(b, pages_per_row)[:, -1].contiguous())
    q = (torch.randn(b, hq, d, device=device) * 2).to(dtype)

    agg = {gr: quest_score(q, kmin, kmax, table, group_reduce=gr) for gr in ("max", "sum")}
    # per query head: score the heads of each group position g as their own groups of one
    per_head = torch.stack([quest_score(q[:, g::group], kmin, kmax, table)
                            for g in range(group)], dim=-1).double()  # [nnz, H_kv, G]
    for e in range(b * pages_per_row):
        bi, slot, n = e // pages_per_row, int(slots[e]), int(lens[e])
        keys = pool[slot, 0, :n].double()  # [n, H_kv, D]
        qk = torch.einsum("hgd,nhd->hgn", q[bi].double().view(hkv, group, d), keys)
        best = qk.amax(dim=-1)  # [H_kv, G]
        tol = 1e-5 * (1 + per_head[e].abs())
        assert (qk <= (per_head[e] + tol).unsqueeze(-1)).all(), f"entry {e}: bound below q.k"
        if n == 1 and p == 1:  # one key: the bound is that key's q.k
            torch.testing.assert_close(per_head[e], best, rtol=1e-5, atol=1e-5)
        assert (agg["max"][e].double() >= best.amax(-1) - tol.amax(-1)).all()
        assert (agg["sum"][e].double() >= best.sum(-1) - tol.sum(-1)).all()
    torch.testing.assert_close(agg["max"], per_head.amax(-1).float(), rtol=0, atol=0)
    figures.case("score")


def test_score_red_zone_and_out(device, seed, figures):
    """out= is written in place (every entry, padded tail included) and nothing around it."""
    q = torch.randn(2, 8, 64, device=device).to(torch.float16)
    kmin, kmax = _metadata(12, 16, 2, 64, torch.float16, device)
    table = _table([4, 6], 12, 16, "csr", device, pad=3)
    out, buf = red_zone((13, 2), torch.float32, device)
    res = quest_score(q, kmin, kmax, table, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert margins_intact(buf, out)
    assert torch.isneginf(out[10:]).all() and torch.isfinite(out[:10]).all()
    check = _check(q, kmin, kmax, table, "max", out)
    figures.case("score", check)
    assert check.ok, str(check)


def test_score_strided_inputs_equal_contiguous(device, seed, figures):
    """Transposed / strided q and metadata views give bitwise the contiguous result."""
    b, hq, hkv, d = 3, 8, 2, 80
    kmin, kmax = _metadata(10, 8, hkv, d, torch.bfloat16, device)
    q = torch.randn(b, hq, d, device=device).to(torch.bfloat16)
    table = _table([3, 5, 2], 10, 8, "padded", device, pad=1)
    want = quest_score(q, kmin, kmax, table)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # [B, H_q, D] with stride(0) < stride(1)
    q_s = torch.zeros(b, hq, 2 * d, dtype=q.dtype, device=device)[..., ::2]  # stride(-1) == 2
    q_s.copy_(q)
    wide_min = torch.zeros(10, hkv, d + 16, dtype=kmin.dtype, device=device)
    wide_max = torch.zeros(10, hkv, d + 16, dtype=kmin.dtype, device=device)
    wide_min[..., :d], wide_max[..., :d] = kmin, kmax
    views = [(q_t, kmin, kmax), (q_s, kmin, kmax), (q, wide_min[..., :d], wide_max[..., :d])]
    for qq, lo, hi in views:
        assert torch.equal(quest_score(qq, lo, hi, table), want)
    figures.case("score")


def test_score_deterministic_and_splits_agree(device, seed, figures):
    """Repeated calls and every split count (rows spanning several tiles) are bitwise equal."""
    kmin, kmax = _metadata(200, 16, 2, 64, torch.float16, device)
    q = torch.randn(2, 4, 64, device=device).to(torch.float16)
    table = _table([150, 37], 200, 16, "csr", device, pad=2)
    want = quest_score(q, kmin, kmax, table, group_reduce="sum", num_splits=1)
    for splits in (1, 2, 3, 7, "auto"):
        got = quest_score(q, kmin, kmax, table, group_reduce="sum", num_splits=splits)
        assert torch.equal(got, want), f"num_splits={splits}"
    check = _check(q, kmin, kmax, table, "sum", want)
    figures.case("score", check)
    assert check.ok, str(check)


@pytest.mark.parametrize("gr", ["max", "sum"])
def test_score_torch_backend_agrees(gr, device, seed, figures):
    kmin, kmax = _metadata(9, 8, 2, 100, torch.bfloat16, device)
    q = torch.randn(2, 10, 100, device=device).to(torch.bfloat16)
    table = _table([4, 5], 9, 8, "padded", device, pad=1)
    got = quest_score(q, kmin, kmax, table, group_reduce=gr, backend="torch")
    kernel = quest_score(q, kmin, kmax, table, group_reduce=gr, backend="triton")
    check = _check(q, kmin, kmax, table, gr, got)
    assert check.ok, str(check)
    torch.testing.assert_close(got, kernel, rtol=1e-6, atol=1e-5)
    figures.case("score", check)


def test_score_unvalidated_out_of_range_ids(device, seed, figures):
    """validate=False: an out-of-range id reads nothing and scores -inf; the rest is unchanged."""
    kmin, kmax = _metadata(6, 8, 2, 64, torch.float32, device)
    q = torch.randn(1, 4, 64, device=device)
    indices = torch.tensor([2, 99, -3, 0], dtype=torch.int32, device=device)
    table = PageTable.from_csr(torch.tensor([0, 4], dtype=torch.int32, device=device), indices,
                               torch.tensor([8], dtype=torch.int32, device=device))
    out = quest_score(q, kmin, kmax, table, validate=False)
    assert torch.equal(quest_score(q, kmin, kmax, table, validate=False, backend="torch")[1:3],
                       out[1:3])
    good = PageTable.from_csr(torch.tensor([0, 2], dtype=torch.int32, device=device),
                              indices[[0, 3]].contiguous(), table.last_page_len)
    want = quest_score(q, kmin, kmax, good)
    exact = bool(torch.isneginf(out[1:3]).all() and torch.equal(out[[0, 3]], want))
    figures.masking("score", exact)
    assert exact


def test_score_empty_batch(device):
    kmin, kmax = _metadata(3, 8, 2, 64, torch.float16, device)
    q = torch.zeros(0, 4, 64, dtype=torch.float16, device=device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    table = PageTable.from_csr(torch.zeros(1, dtype=torch.int32, device=device), empty, empty)
    assert quest_score(q, kmin, kmax, table).shape == (0, 2)


def _bad(name, match, **changes):
    return pytest.param(changes, match, id=name)


_csr = csr_table


BAD_INPUTS = [
    _bad("q-rank2", "q", q=torch.zeros(8, 64)),
    _bad("q-int", "q", q=torch.zeros(2, 8, 64, dtype=torch.int32)),
    _bad("kmin-dtype", "kmin", kmin=torch.zeros(5, 2, 64, dtype=torch.float16)),
    _bad("kmax-rank2", "kmax", kmax=torch.zeros(5, 128)),
    _bad("kmin-kmax-shape", "kmax", kmax=torch.zeros(6, 2, 64)),
    _bad("kmin-meta-device", "kmin", kmin=torch.zeros(5, 2, 64, device="meta")),
    _bad("gqa-indivisible", "H_q", q=torch.zeros(2, 7, 64)),
    _bad("head-dim-mismatch", "kmin", q=torch.zeros(2, 8, 40)),
    _bad("head-dim-300", "q", q=torch.zeros(2, 8, 300), kmin=torch.zeros(5, 2, 300),
         kmax=torch.zeros(5, 2, 300)),
    _bad("table-type", "page_table", page_table=torch.zeros(2, 3, dtype=torch.int32)),
    _bad("table-rows", "page_table", page_table=_csr([0, 1, 2, 3], [0, 1, 2])),
    _bad("table-id-out-of-range", "page_table", page_table=_csr([0, 2, 3], [0, 5, 1])),
    _bad("table-id-negative", "page_table", page_table=_csr([0, 1, 3], [0, 1, -1])),
    _bad("table-row-span", "page_table", page_table=PageTable(
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1, 3], dtype=torch.int32), torch.ones(2, dtype=torch.int32))),
    _bad("group-reduce", "group_reduce", group_reduce="mean"),
    _bad("out-shape", "out", out=torch.zeros(3, 8)),
    _bad("out-dtype", "out", out=torch.zeros(3, 2, dtype=torch.float16)),
    _bad("num-splits", "num_splits", num_splits=0),
    _bad("backend", "backend", backend="cuda"),
]


@pytest.mark.parametrize("changes, match", BAD_INPUTS)
def test_score_bad_input(changes, match, figures):
    args = dict(q=torch.zeros(2, 8, 64), kmin=torch.zeros(5, 2, 64), kmax=torch.zeros(5, 2, 64),
                page_table=_csr([0, 2, 3], [0, 4, 1]))
    args.update(changes)
    with pytest.raises((KernelInputError, KernelUnsupportedError), match=match):
        quest_score(**args)
    figures.bad_input("score")


def test_score_boundary_values_accepted(device):
    """The last metadata row, a one-entry table and any last_page_len are valid."""
    kmin, kmax = _metadata(5, 8, 2, 64, torch.float32, device)
    table = PageTable.from_csr(torch.tensor([0, 1, 1], dtype=torch.int32, device=device),
                               torch.tensor([4], dtype=torch.int32, device=device),
                               torch.tensor([0, 0], dtype=torch.int32, device=device))
    out = quest_score(torch.randn(2, 8, 64, device=device), kmin, kmax, table)
    assert torch.isfinite(out).all()
