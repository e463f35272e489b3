"""sketch_score: the key sketch's codes (packing, round trip), the kernel against an fp64
reference with the flash-attention rule, its masking and input checks, and how well its scores
rank pages against the exact per-page max logit, next to Quest's bound on the same pages.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tierattn.errors import KernelInputError, KernelUnsupportedError
from tierattn.runtime.importance import Importance, key_basis
from tierattn.kernels.page_table import PageTable
from tierattn.kernels.score import quest_score
from tierattn.kernels.sketch import (
    SKETCH_BITS,
    SKETCH_REDUCES,
    project_queries,
    quantize_keys,
    sketch_bytes,
    sketch_score,
    sketch_score_reference,
    sketch_width,
    unpack_keys,
)
from tierattn.kernels.testing import check_rule, csr_table, margins_intact, red_zone

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: id written into the unused tail of padded tables: far out of range, so reading it would show.
UNUSED_ID = 1 << 30


def _pages(num_meta, p, hkv, d, dtype, device, bits, scale=1.0):
    """``num_meta`` full pages of random keys ``[n, P, H_kv, D]``, their Quest ranges and codes."""
    keys = (torch.randn(num_meta, p, hkv, d, device=device) * scale).to(dtype)
    kmin, kmax = keys.amin(dim=1), keys.amax(dim=1)
    return keys, quantize_keys(keys, kmin, kmax, bits=bits), kmin, kmax


def _table(counts, num_meta, layout, device, pad=0):
    """One row per sequence listing ``counts[b]`` distinct metadata rows in random order.

    ``csr``: ``pad`` unused entries after the last row; ``padded``: a block table ``pad`` columns
    wider than the longest row. Unused entries hold an out-of-range id. (Scoring reads no tokens,
    so every row's last page is full.)
    """
    ids = [torch.randperm(num_meta, device=device)[:c].to(torch.int32) for c in counts]
    if layout == "csr":
        indptr = torch.tensor([0] + counts, device=device).cumsum(0).to(torch.int32)
        tail = torch.full((pad,), UNUSED_ID, dtype=torch.int32, device=device)
        last = torch.tensor([1 if c else 0 for c in counts], dtype=torch.int32, device=device)
        return PageTable.from_csr(indptr, torch.cat(ids + [tail]), last)
    width = max(counts, default=0) + pad
    table = torch.full((len(counts), width), UNUSED_ID, dtype=torch.int32, device=device)
    for b, row in enumerate(ids):
        table[b, :row.numel()] = row
    kv_lens = torch.tensor(counts, dtype=torch.int32, device=device)  # pages of one token
    return PageTable.from_padded(table, kv_lens, 1)


def _check(q, codes, kmin, kmax, table, bits, out, **kw):
    """The rule against fp64, with torch in the inputs' dtype as the low-precision baseline
    (``kw``: reduce, sm_scale, softcap)."""
    ref = sketch_score_reference(q.double(), codes, kmin.double(), kmax.double(), table,
                                 bits=bits, **kw)
    lowp = sketch_score_reference(q, codes, kmin, kmax, table, bits=bits, compute_dtype=q.dtype,
                                  **kw)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # entries outside every row are exactly -inf, and only those
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    return check_rule(out, ref, lowp, q.dtype)


def _exact_max_logit(q, keys, table, reduce="max", sm_scale=1.0):
    """``[nnz, H_kv]`` fp64 ``max_{g, j} s_gj`` (or ``log sum exp`` with ``reduce="lse"``) of
    the raw logits ``s_gj = sm_scale q_g . k_j`` over the true keys of each listed page."""
    batch, hq, d = q.shape
    hkv = keys.shape[2]
    out = torch.full((table.indices.numel(), hkv), float("-inf"), dtype=torch.float64)
    for b, (start, count) in enumerate(zip(table.row_start.tolist(), table.row_count.tolist())):
        ids = table.indices[start:start + count].long()
        qb = q[b].double().view(hkv, hq // hkv, d)
        logits = torch.einsum("hgd,nphd->nhgp", qb, keys[ids].double()).flatten(2) * sm_scale
        out[start:start + count] = logits.logsumexp(2) if reduce == "lse" else logits.amax(2)
    return out


# --- the codes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", SKETCH_BITS)
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_quantize_round_trip(bits, dt, device, seed):
    """Every dequantized key is within half a step of the key; a constant channel and a
    one-key page (kmax == kmin) come back exactly; codes are uint8 ``[n, H_kv, P, W]``."""
    n, p, hkv, d = 6, 12, 2, 40
    keys = (torch.randn(n, p, hkv, d, device=device) * 3).to(DTYPES[dt])
    keys[:, :, :, 7] = 0.75  # a constant channel
    keys[2, :, 1] = keys[2, :1, 1]  # page 2, head 1: every key the same
    kmin, kmax = keys.amin(dim=1), keys.amax(dim=1)
    codes = quantize_keys(keys, kmin, kmax, bits=bits)
    assert codes.dtype == torch.uint8 and codes.shape == (n, hkv, p, sketch_width(d, bits))
    assert codes.device == keys.device
    k_hat = unpack_keys(codes, kmin, kmax, bits=bits, dtype=torch.float64)
    k = keys.double().permute(0, 2, 1, 3)
    step = ((kmax.double() - kmin.double()) / ((1 << bits) - 1))[:, :, None, :]
    assert ((k_hat - k).abs() <= step / 2 + 1e-6 * (1 + k.abs())).all()
    assert torch.equal(k_hat[..., 7], k[..., 7])
    assert torch.equal(k_hat[2, 1], k[2, 1])
    # the range's ends are codes 0 and L
    levels = (1 << bits) - 1
    code = ((codes.long()[..., None, :] >> (torch.arange(8 // bits) * bits)[:, None]) & levels)
    code = code.reshape(n, hkv, p, d)
    assert (code.amin(dim=2) == 0).all()
    assert ((code.amax(dim=2) == levels) | (kmax == kmin)).all()


@pytest.mark.parametrize("bits", SKETCH_BITS)
def test_codes_layout_is_channel_blocked(bits, device, seed):
    """Byte ``w`` of a key holds channels ``w, w + W, w + 2W, ...`` at bit offsets ``0, bits,
    2 bits, ...`` (keys already on the code grid: kmin = 0, kmax = L)."""
    d, levels = 32, (1 << bits) - 1
    width = sketch_width(d, bits)
    want = torch.randint(0, levels + 1, (3, 4, 2, d), device=device)  # [n, P, H_kv, D]
    want[:, 0], want[:, 1] = 0, levels  # every channel spans the whole range
    codes = quantize_keys(want.float(), want.float().amin(1), want.float().amax(1), bits=bits)
    packed = torch.zeros(3, 2, 4, width, dtype=torch.long, device=device)
    for c in range(d):
        packed[..., c % width] += want.permute(0, 2, 1, 3)[..., c].long() << (bits * (c // width))
    assert torch.equal(codes.long(), packed)
    assert sketch_bytes(16, 8, 128, bits) == 16 * 8 * 128 * bits // 8


@pytest.mark.parametrize("reduce", ["max", "lse"])
def test_sketch_exact_on_the_code_grid(reduce, device, seed):
    """Keys on the code grid (and one-key pages, kmin == kmax) are represented exactly: the
    sketch score is the exact max logit, or the exact log-sum-exp of the page's logits (to
    fp32 rounding), at any sm_scale; a one-key, one-head page's two reductions agree."""
    bits, levels = 2, 3
    keys = torch.randint(0, levels + 1, (6, 8, 2, 64), device=device).float() - 1.0
    keys[:, 0], keys[:, 1] = -1.0, levels - 1.0  # ranges [-1, 2]: step 1
    kmin, kmax = keys.amin(dim=1), keys.amax(dim=1)
    codes = quantize_keys(keys, kmin, kmax, bits=bits)
    q = torch.randn(2, 8, 64, device=device)
    table = _table([4, 2], 6, "csr", device)
    for scale in (1.0, 0.125):
        out = sketch_score(q, codes, kmin, kmax, table, bits=bits, reduce=reduce,
                           sm_scale=scale)
        torch.testing.assert_close(out.double(), _exact_max_logit(q, keys, table, reduce, scale),
                                   rtol=1e-5, atol=1e-5)
    one = torch.randn(5, 1, 2, 64, device=device)
    codes1 = quantize_keys(one, one[:, 0], one[:, 0], bits=8)
    table1 = _table([2, 3], 5, "padded", device)
    out1 = sketch_score(q, codes1, one[:, 0], one[:, 0], table1, bits=8, reduce=reduce)
    torch.testing.assert_close(out1.double(), _exact_max_logit(q, one, table1, reduce, 0.125),
                               rtol=1e-5, atol=1e-5)
    q1 = q[:, ::4].contiguous()  # one query head per KV head: lse of one logit is the logit
    lse, top = (sketch_score(q1, codes1, one[:, 0], one[:, 0], table1, bits=8, reduce=r)
                for r in ("lse", "max"))
    torch.testing.assert_close(lse, top, rtol=1e-6, atol=1e-6)


# --- the kernel against the reference -----------------------------------------------------------

def _case(b, hq, hkv, d, p, counts, layout, dt, bits, pad=0, num_meta=None, reduce="max",
          softcap=None):
    num_meta = num_meta or max(max(counts, default=0), 1) + 3
    cid = (f"B{b}-H{hq}/{hkv}-D{d}-P{p}-n{'.'.join(map(str, counts))}-{layout}{pad or ''}-{dt}"
           f"-b{bits}-{reduce}{f'-cap{softcap:g}' if softcap else ''}")
    return pytest.param(b, hq, hkv, d, p, counts, layout, DTYPES[dt], bits, pad, num_meta,
                        {"reduce": reduce, "softcap": softcap}, id=cid)


def _grid():
    """bits x D, each with three (G, P, dtype, reduce) that cycle so every pair of values meets;
    tables alternate csr/padded with unused tails and empty rows; every fourth case softcapped."""
    cases = []
    gs, ps, dts = (1, 4, 5), (1, 4, 16), ("fp32", "fp16", "bf16")
    count_sets = ([5], [3, 0, 4], [2, 6], [4, 1, 0, 3])
    for i, (bits, d) in enumerate(itertools.product(SKETCH_BITS, (16, 64, 128))):
        for k in range(3):
            g, p, dt = gs[(k + i) % 3], ps[(k + i // 3) % 3], dts[(k + 2 * i) % 3]
            hkv = (1, 2, 3)[(i + 2 * k) % 3]
            counts = count_sets[(i + k) % 4]
            layout = ("csr", "padded")[(i + k) % 2]
            reduce = ("max", "lse")[(i + 2 * k) % 2]
            cases.append(_case(len(counts), hkv * g, hkv, d, p, counts, layout, dt, bits,
                               pad=(i * k) % 3, reduce=reduce,
                               softcap=2.0 if (3 * i + k) % 4 == 0 else None))
    return cases


GRID = _grid() + [
    # odd widths (W = 10, 20, 40 bytes), P = 12 and 64, D = 256, a row longer than one tile
    _case(2, 6, 2, 40, 12, [3, 5], "csr", "bf16", 2, pad=1),
    _case(2, 8, 2, 40, 4, [4, 2], "padded", "fp16", 4, reduce="lse"),
    _case(1, 3, 1, 40, 16, [6], "csr", "fp32", 8),
    _case(2, 4, 2, 256, 8, [3, 2], "csr", "bf16", 2, reduce="lse"),
    _case(1, 2, 1, 64, 64, [5], "padded", "fp16", 4, pad=2, reduce="lse", softcap=1.5),
    _case(1, 4, 1, 16, 4, [150], "csr", "fp32", 2),
    _case(1, 4, 1, 16, 4, [150], "csr", "fp32", 2, reduce="lse"),
    _case(3, 4, 2, 64, 4, [0, 0, 0], "csr", "fp16", 8, pad=2, reduce="lse"),
    _case(1, 4, 2, 64, 8, [1], "csr", "bf16", 4, num_meta=1),
]


@pytest.mark.parametrize("b, hq, hkv, d, p, counts, layout, dtype, bits, pad, num_meta, kw",
                         GRID)
def test_sketch_grid(b, hq, hkv, d, p, counts, layout, dtype, bits, pad, num_meta, kw, device,
                     seed, figures):
    _, codes, kmin, kmax = _pages(num_meta, p, hkv, d, dtype, device, bits)
    # logit-scale queries with the default sm_scale (q.k / sqrt(D)), as in test_score
    q = torch.randn(b, hq, d, device=device).to(dtype)
    table = _table(counts, num_meta, layout, device, pad=pad)
    out = sketch_score(q, codes, kmin, kmax, table, bits=bits, **kw)
    check = _check(q, codes, kmin, kmax, table, bits, out, **kw)
    figures.case("sketch", check)
    assert check.ok, str(check)


@pytest.mark.parametrize("i", range(6), ids=lambda i: f"random{i}")
def test_sketch_random(i, device, seed, figures):
    rng = random.Random(seed)
    bits = rng.choice(SKETCH_BITS)
    d = rng.choice([d for d in (8, 16, 24, 40, 64, 80, 96, 128, 256) if d * bits % 8 == 0])
    hkv, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4, 5, 8])
    p = rng.choice([1, 2, 4, 8, 12, 16])
    dtype = rng.choice(list(DTYPES.values()))
    b = rng.randint(1, 3)
    num_meta = rng.randint(1, 20)
    counts = [rng.randint(0, num_meta) for _ in range(b)]
    layout, pad = rng.choice(["csr", "padded"]), rng.randint(0, 3)
    kw = {"reduce": rng.choice(["max", "lse"]), "sm_scale": rng.choice([None, 0.05, 1.0]),
          "softcap": rng.choice([None, None, 5.0])}
    _, codes, kmin, kmax = _pages(num_meta, p, hkv, d, dtype, device, bits,
                                  scale=rng.choice([0.1, 1.0, 8.0]))
    q = (torch.randn(b, hkv * group, d, device=device) * d ** -0.5).to(dtype)
    table = _table(counts, num_meta, layout, device, pad=pad)
    out = sketch_score(q, codes, kmin, kmax, table, bits=bits, **kw)
    check = _check(q, codes, kmin, kmax, table, bits, out, **kw)
    figures.case("sketch", check, random=True)
    assert check.ok, (f"seed={seed} bits={bits} B={b} H={hkv * group}/{hkv} D={d} P={p} "
                      f"{dtype} counts={counts} {layout}{pad} {kw}: {check}")


def test_sketch_negative_scores(device, seed, figures):
    """Keys far below zero and positive queries: every score is negative, so padded query
    heads (G = 5) and padded keys (P = 12) must not count as a logit of 0."""
    keys = (torch.randn(8, 12, 1, 40, device=device) - 4).to(torch.bfloat16)
    kmin, kmax = keys.amin(dim=1), keys.amax(dim=1)
    codes = quantize_keys(keys, kmin, kmax, bits=4)
    q = torch.randn(2, 5, 40, device=device).abs().to(torch.bfloat16)
    table = _table([5, 3], 8, "csr", device, pad=1)
    out = sketch_score(q, codes, kmin, kmax, table, bits=4)
    assert (out[:8] < 0).all()
    check = _check(q, codes, kmin, kmax, table, 4, out)
    figures.case("sketch", check)
    assert check.ok, str(check)


@pytest.mark.parametrize("bits, reduce", [(2, "max"), (4, "lse"), (8, "max"), (8, "lse")])
def test_sketch_tiles_and_splits_agree(bits, reduce, device, seed, figures):
    """Every split count gives bitwise the same scores; smaller tiles (several entry tiles,
    several key chunks per page: the online log-sum-exp's rescaling) give the same scores to
    rounding."""
    d = 40 if bits != 2 else 64
    _, codes, kmin, kmax = _pages(20, 12, 2, d, torch.float16, device, bits)
    q = torch.randn(2, 6, d, device=device).to(torch.float16)
    table = _table([11, 4], 20, "csr", device, pad=2)
    want = sketch_score(q, codes, kmin, kmax, table, bits=bits, reduce=reduce, num_splits=1)
    for splits in (2, 3, 7, "auto"):
        got = sketch_score(q, codes, kmin, kmax, table, bits=bits, reduce=reduce,
                           num_splits=splits)
        assert torch.equal(got, want), f"num_splits={splits}"
    for config in ({"block_e": 1, "block_p": 1}, {"block_e": 4, "block_p": 4},
                   {"block_e": 8, "block_p": 16, "num_warps": 2}):
        got = sketch_score(q, codes, kmin, kmax, table, bits=bits, reduce=reduce, num_splits=2,
                           config=config)
        # the online log-sum-exp rescales across key chunks: a few more ulps than max's
        tol = 1e-5 if reduce == "lse" else 1e-6
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=str(config))
    check = _check(q, codes, kmin, kmax, table, bits, want, reduce=reduce)
    figures.case("sketch", check)
    assert check.ok, str(check)


def test_sketch_red_zone_and_out(device, seed, figures):
    """out= is written in place (every entry, unused tail included) and nothing around it."""
    _, codes, kmin, kmax = _pages(12, 16, 2, 64, torch.float16, device, 2)
    q = (torch.randn(2, 8, 64, device=device) * 0.125).to(torch.float16)
    table = _table([4, 6], 12, "csr", device, pad=3)
    out, buf = red_zone((13, 2), torch.float32, device)
    res = sketch_score(q, codes, kmin, kmax, table, bits=2, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert margins_intact(buf, out)
    assert torch.isneginf(out[10:]).all() and torch.isfinite(out[:10]).all()
    check = _check(q, codes, kmin, kmax, table, 2, out)
    figures.case("sketch", check)
    assert check.ok, str(check)


def test_sketch_strided_inputs_equal_contiguous(device, seed, figures):
    """Strided q, codes and metadata views give bitwise the contiguous result."""
    b, hq, hkv, d, p, bits = 3, 8, 2, 80, 8, 4
    _, codes, kmin, kmax = _pages(10, p, hkv, d, torch.bfloat16, device, bits)
    q = torch.randn(b, hq, d, device=device).to(torch.bfloat16)
    table = _table([3, 5, 2], 10, "padded", device, pad=1)
    want = sketch_score(q, codes, kmin, kmax, table, bits=bits)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)
    q_s = torch.zeros(b, hq, 2 * d, dtype=q.dtype, device=device)[..., ::2]
    q_s.copy_(q)
    codes_t = codes.transpose(1, 2).contiguous().transpose(1, 2)  # [n, H_kv, P, W], P-major
    codes_s = torch.zeros(10, hkv, p, 3 * codes.shape[3], dtype=torch.uint8,
                          device=device)[..., ::3]
    codes_s.copy_(codes)
    wide_min = torch.zeros(10, hkv, d + 16, dtype=kmin.dtype, device=device)
    wide_max = torch.zeros(10, hkv, d + 16, dtype=kmin.dtype, device=device)
    wide_min[..., :d], wide_max[..., :d] = kmin, kmax
    views = [(q_t, codes, kmin, kmax), (q_s, codes, kmin, kmax), (q, codes_t, kmin, kmax),
             (q, codes_s, kmin, kmax), (q, codes, wide_min[..., :d], wide_max[..., :d])]
    for qq, cc, lo, hi in views:
        assert torch.equal(sketch_score(qq, cc, lo, hi, table, bits=bits), want)
    figures.case("sketch")


@pytest.mark.parametrize("bits", SKETCH_BITS)
@pytest.mark.parametrize("reduce", ["max", "lse"])
def test_sketch_torch_backend_agrees(bits, reduce, device, seed, figures):
    d = 100 if bits != 2 else 96
    _, codes, kmin, kmax = _pages(9, 8, 2, d, torch.bfloat16, device, bits)
    q = torch.randn(2, 10, d, device=device).to(torch.bfloat16)
    table = _table([4, 5], 9, "padded", device, pad=1)
    kw = {"reduce": reduce, "softcap": 3.0 if bits == 4 else None}
    got = sketch_score(q, codes, kmin, kmax, table, bits=bits, backend="torch", **kw)
    kernel = sketch_score(q, codes, kmin, kmax, table, bits=bits, backend="triton", **kw)
    check = _check(q, codes, kmin, kmax, table, bits, got, **kw)
    assert check.ok, str(check)
    torch.testing.assert_close(got, kernel, rtol=1e-5, atol=1e-5)
    figures.case("sketch", check)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sketch_unvalidated_out_of_range_ids(backend, device, seed, figures):
    """validate=False: an out-of-range id reads nothing and scores -inf; the rest is unchanged."""
    _, codes, kmin, kmax = _pages(6, 8, 2, 64, torch.float32, device, 4)
    q = torch.randn(1, 4, 64, device=device)
    indices = torch.tensor([2, 99, -3, 0, 6], dtype=torch.int32, device=device)
    table = PageTable.from_csr(torch.tensor([0, 5], dtype=torch.int32, device=device), indices,
                               torch.tensor([8], dtype=torch.int32, device=device))
    out = sketch_score(q, codes, kmin, kmax, table, bits=4, validate=False, backend=backend)
    good = PageTable.from_csr(torch.tensor([0, 2], dtype=torch.int32, device=device),
                              indices[[0, 3]].contiguous(), table.last_page_len)
    want = sketch_score(q, codes, kmin, kmax, good, bits=4, backend=backend)
    exact = bool(torch.isneginf(out[[1, 2, 4]]).all() and torch.equal(out[[0, 3]], want))
    figures.masking("sketch", exact)
    assert exact


def test_sketch_empty_batch_and_empty_rows(device, seed):
    _, codes, kmin, kmax = _pages(3, 8, 2, 64, torch.float16, device, 2)
    q = torch.zeros(0, 4, 64, dtype=torch.float16, device=device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    table = PageTable.from_csr(torch.zeros(1, dtype=torch.int32, device=device), empty, empty)
    assert sketch_score(q, codes, kmin, kmax, table, bits=2).shape == (0, 2)
    q = torch.zeros(2, 4, 64, dtype=torch.float16, device=device)
    out = sketch_score(q, codes, kmin, kmax, _table([0, 0], 3, "padded", device, pad=2), bits=2)
    assert out.shape == (4, 2) and torch.isneginf(out).all()


def _bad(name, match, **changes):
    return pytest.param(changes, match, id=name)


_csr = csr_table


U8 = torch.uint8
BAD_INPUTS = [
    _bad("q-rank2", "q", q=torch.zeros(8, 64)),
    _bad("q-int", "q", q=torch.zeros(2, 8, 64, dtype=torch.int32)),
    _bad("codes-float", "codes", codes=torch.zeros(5, 2, 4, 16)),
    _bad("codes-int8", "codes", codes=torch.zeros(5, 2, 4, 16, dtype=torch.int8)),
    _bad("codes-rank3", "codes", codes=torch.zeros(5, 2, 64, dtype=U8)),
    _bad("codes-width", "codes", codes=torch.zeros(5, 2, 4, 32, dtype=U8)),
    _bad("codes-width-for-bits", "codes", bits=4),
    _bad("codes-num-meta", "codes", codes=torch.zeros(6, 2, 4, 16, dtype=U8)),
    _bad("codes-heads", "codes", codes=torch.zeros(5, 1, 4, 16, dtype=U8)),
    _bad("codes-page-size-0", "codes", codes=torch.zeros(5, 2, 0, 16, dtype=U8)),
    _bad("codes-meta-device", "codes", codes=torch.zeros(5, 2, 4, 16, dtype=U8, device="meta")),
    _bad("bits-3", "bits", bits=3),
    _bad("bits-16", "bits", bits=16),
    _bad("bits-float", "bits", bits=2.0),
    _bad("bits-bool", "bits", bits=True),
    _bad("reduce", "reduce", reduce="mean"),
    _bad("sm-scale-0", "sm_scale", sm_scale=0.0),
    _bad("sm-scale-inf", "sm_scale", sm_scale=float("inf")),
    _bad("softcap-negative", "softcap", softcap=-1.0),
    _bad("bits-head-dim-not-bytes", "head dim", q=torch.zeros(2, 8, 17),
         kmin=torch.zeros(5, 2, 17), kmax=torch.zeros(5, 2, 17), bits=4,
         codes=torch.zeros(5, 2, 4, 8, dtype=U8)),
    _bad("kmin-dtype", "kmin", kmin=torch.zeros(5, 2, 64, dtype=torch.float16)),
    _bad("kmax-rank2", "kmax", kmax=torch.zeros(5, 128)),
    _bad("kmin-kmax-shape", "kmax", kmax=torch.zeros(6, 2, 64)),
    _bad("kmin-meta-device", "kmin", kmin=torch.zeros(5, 2, 64, device="meta")),
    _bad("gqa-indivisible", "H_q", q=torch.zeros(2, 7, 64)),
    _bad("head-dim-mismatch", "kmin", q=torch.zeros(2, 8, 40)),
    _bad("head-dim-300", "q", q=torch.zeros(2, 8, 300), kmin=torch.zeros(5, 2, 300),
         kmax=torch.zeros(5, 2, 300), codes=torch.zeros(5, 2, 4, 75, dtype=U8)),
    _bad("table-type", "page_table", page_table=torch.zeros(2, 3, dtype=torch.int32)),
    _bad("table-rows", "page_table", page_table=_csr([0, 1, 2, 3], [0, 1, 2])),
    _bad("table-device", "page_table", page_table=_csr([0, 2, 3], [0, 4, 1]).to("meta")),
    _bad("table-id-out-of-range", "page_table", page_table=_csr([0, 2, 3], [0, 5, 1])),
    _bad("table-id-negative", "page_table", page_table=_csr([0, 1, 3], [0, 1, -1])),
    _bad("table-row-span", "page_table", page_table=PageTable(
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1, 3], dtype=torch.int32), torch.ones(2, dtype=torch.int32))),
    _bad("out-shape", "out", out=torch.zeros(3, 8)),
    _bad("out-dtype", "out", out=torch.zeros(3, 2, dtype=torch.float16)),
    _bad("num-splits", "num_splits", num_splits=0),
    _bad("config-key", "config", config={"block_n": 16}),
    _bad("config-value", "config", config={"block_p": 3}),
    _bad("backend", "backend", backend="cuda"),
    _bad("basis-rank", "basis", basis=torch.zeros(2, 64, 32)),
    _bad("basis-heads", "basis", basis=torch.zeros(3, 64, 64)),
    _bad("basis-head-dim", "basis", basis=torch.zeros(2, 48, 64)),
    _bad("basis-dtype", "basis", basis=torch.zeros(2, 64, 64, dtype=torch.int32)),
    _bad("basis-rank-above-d", "basis", q=torch.zeros(2, 8, 32),
         basis=torch.zeros(2, 32, 64)),
]


@pytest.mark.parametrize("changes, match", BAD_INPUTS)
def test_sketch_bad_input(changes, match, figures):
    args = dict(q=torch.zeros(2, 8, 64), codes=torch.zeros(5, 2, 4, 16, dtype=U8),
                kmin=torch.zeros(5, 2, 64), kmax=torch.zeros(5, 2, 64),
                page_table=_csr([0, 2, 3], [0, 4, 1]), bits=2)
    args.update(changes)
    with pytest.raises((KernelInputError, KernelUnsupportedError), match=match):
        sketch_score(**args)
    figures.bad_input("sketch")


def test_sketch_width_rejects_bad_sizes():
    with pytest.raises(KernelInputError, match="bits"):
        sketch_width(64, 3)
    with pytest.raises(KernelInputError, match="head dim 17"):
        sketch_width(17, 2)


# --- ranking pages ------------------------------------------------------------------------------

#: page sets per ranking test: rows x KV heads, each (row, head) ranks its own pages
RANK_ROWS, RANK_HKV, RANK_PAGES, RANK_P, RANK_G, RANK_D = 64, 2, 32, 16, 4, 64


def _spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation of each row of ``a`` and ``b`` ``[T, N]`` (no ties here)."""
    ra = a.argsort(dim=1).argsort(dim=1).double()
    rb = b.argsort(dim=1).argsort(dim=1).double()
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    return (ra * rb).sum(1) / (ra.norm(dim=1) * rb.norm(dim=1))


def _rank_pages(device, needle: bool):
    """``RANK_ROWS`` sequences of ``RANK_PAGES`` bf16 pages of random keys; with ``needle``,
    one key of one page per (sequence, KV head) is set close to one of the group's queries.

    Returns the keys, q, the table, the exact max logit per (page set, page) ``[T, N]`` and the
    needle page of each page set ``[T]`` (None without needles)."""
    b, hkv, n, p, g, d = RANK_ROWS, RANK_HKV, RANK_PAGES, RANK_P, RANK_G, RANK_D
    keys = torch.randn(b * n, p, hkv, d, device=device)
    q = torch.randn(b, hkv * g, d, device=device)
    page = None
    if needle:
        page = torch.randint(0, n, (b, hkv), device=device)
        slot = torch.randint(0, p, (b, hkv), device=device)
        head = torch.randint(0, g, (b, hkv), device=device)
        for r, h in itertools.product(range(b), range(hkv)):
            qd = q[r, h * g + head[r, h]]
            m = r * n + page[r, h]
            # about 0.75 sqrt(D) along the query: the page's best logit by a clear margin
            keys[m, slot[r, h], h] = 0.5 * keys[m, slot[r, h], h] + 0.75 * d ** 0.5 * qd / qd.norm()
        page = page.reshape(-1)
    keys, q = keys.to(torch.bfloat16), q.to(torch.bfloat16)
    table = PageTable.from_csr(torch.arange(b + 1, device=device).to(torch.int32) * n,
                               torch.arange(b * n, device=device).to(torch.int32),
                               torch.full((b,), p, dtype=torch.int32, device=device))
    exact = _exact_max_logit(q, keys, table)
    return keys, q, table, _per_set(exact), page


def _per_set(scores: torch.Tensor) -> torch.Tensor:
    """``[B * N, H_kv]`` entry scores -> ``[B * H_kv, N]``, one row per (sequence, KV head)."""
    return scores.view(RANK_ROWS, RANK_PAGES, RANK_HKV).transpose(1, 2).reshape(-1, RANK_PAGES)


def _scores(keys, q, table):
    """Quest's bound and the sketch at every width, ``[T, N]`` each, and the sketch's error."""
    kmin, kmax = keys.amin(dim=1), keys.amax(dim=1)
    out = {"quest": _per_set(quest_score(q, kmin, kmax, table).double())}
    for bits in SKETCH_BITS:
        codes = quantize_keys(keys, kmin, kmax, bits=bits)
        out[bits] = _per_set(sketch_score(q, codes, kmin, kmax, table, bits=bits,
                                          sm_scale=1.0).double())
        # one logit's error is at most sum_c |q_c| step_c / 2: so is the max's
        step = (kmax.double() - kmin.double()) / ((1 << bits) - 1)  # [n, H_kv, D]
        qg = q.double().view(RANK_ROWS, 1, RANK_HKV, RANK_G, RANK_D)
        slack = (qg.abs() * step.view(RANK_ROWS, RANK_PAGES, RANK_HKV, 1, RANK_D)).sum(-1) / 2
        out[f"slack{bits}"] = _per_set(slack.amax(-1).reshape(-1, RANK_HKV))
        # as the runtime keeps it: one range per KV head and channel for every page (the
        # first keys' range, here all of them, widened by the runtime's margin)
        lo, hi = keys.float().amin(dim=(0, 1)), keys.float().amax(dim=(0, 1))
        pad = (hi - lo) * Importance.SKETCH_MARGIN
        glo = (lo - pad).to(keys.dtype).expand_as(kmin)
        ghi = (hi + pad).to(keys.dtype).expand_as(kmax)
        codes = quantize_keys(keys, glo, ghi, bits=bits)
        out[f"shared{bits}"] = _per_set(
            sketch_score(q, codes, glo, ghi, table, bits=bits, sm_scale=1.0).double())
    return out


def _rank_rows(scores, exact, target):
    """Per scorer (Quest, the sketch per width, the shared-range sketch per width): Spearman
    against ``exact`` and whether page ``target`` of each page set is its top-1 / top-2."""
    rows = {}
    for name in ("quest", *SKETCH_BITS, *(f"shared{b}" for b in SKETCH_BITS)):
        s = scores[name]
        rows[f"sketch{name}" if isinstance(name, int) else name] = {
            "spearman": _spearman(exact, s),
            "top1": s.argmax(dim=1) == target,
            "top2": (s.topk(2, dim=1).indices == target[:, None]).any(dim=1),
        }
    return rows


def _report(title, rows, figures):
    print(f"\n{title} ({len(next(iter(rows.values()))['top1'])} page sets of {RANK_PAGES} "
          f"pages, P={RANK_P}, G={RANK_G}, D={RANK_D}, bf16)")
    for name, r in rows.items():
        stats = "  ".join(f"{k} {float(v.double().mean()):.3f}" for k, v in r.items())
        print(f"  {name:>12}: {stats}")
        figures.count(f"page ranking, {title}: {name} top-1 hits (of {r['top1'].numel()})",
                      int(r["top1"].sum()))


def test_sketch_ranks_random_pages_like_exact(device, seed, figures):
    """Pages of random keys: the sketch's ranking against the exact per-page max logit, next to
    Quest's bound. Measured on 2000 page sets of these shapes: Spearman 0.79 / 0.98 / 0.9995
    at 2 / 4 / 8 bits (Quest 0.17); exact top-1 found 52% / 88% / 99.5% (Quest 6%), in the
    sketch's top 2: 73% / 98% / 100% (Quest 11%). The thresholds leave room for the 128 sets
    here (seeds 0..5: 8-bit top-1 99.2-100%, 4-bit 87-94%)."""
    keys, q, table, exact, _ = _rank_pages(device, needle=False)
    scores = _scores(keys, q, table)
    top = exact.argmax(dim=1)
    rows = _rank_rows(scores, exact, top)
    _report("random pages", rows, figures)
    for bits in SKETCH_BITS:
        assert ((scores[bits] - exact).abs() <= scores[f"slack{bits}"] + 1e-3).all()
    s8, s4, s2, quest = (rows[k] for k in ("sketch8", "sketch4", "sketch2", "quest"))
    assert s8["spearman"].mean() > 0.99 and s8["spearman"].min() > 0.98
    assert s8["top1"].double().mean() >= 0.97
    assert s4["spearman"].mean() > 0.95
    assert s4["top1"].double().mean() >= 0.8 and s4["top2"].double().mean() >= 0.95
    assert s2["spearman"].mean() > 0.7
    # one shared range per head and channel (the runtime's): coarser steps, still far better
    # than Quest (this set: top-1 23 / 91 / 124 of 128 at 2 / 4 / 8 bits, Quest 11)
    assert rows["shared4"]["top1"].double().mean() >= 0.55
    assert rows["shared8"]["top1"].double().mean() >= 0.9
    for s in (s2, s4, s8):  # every width ranks better than Quest's bound
        assert s["spearman"].mean() > quest["spearman"].mean() + 0.4
        assert s["top1"].double().mean() > quest["top1"].double().mean() + 0.3


def test_sketch_finds_the_needle_page(device, seed, figures):
    """One key of one page per page set points at a query: the sketch ranks that page first
    (or second at 2 bits) almost always; Quest's bound barely notices it (its ranges grow in a
    few channels only). Measured on 2000 page sets: needle top-1 99.5% / 99.7% / 99.8% and
    top-2 99.9% / 100% / 100% at 2 / 4 / 8 bits (Quest: 4% / 7%); the needle page is the exact
    best page in 99.8%."""
    keys, q, table, exact, page = _rank_pages(device, needle=True)
    scores = _scores(keys, q, table)
    assert (exact.argmax(dim=1) == page).double().mean() >= 0.98  # the needle is the best page
    rows = _rank_rows(scores, exact, page)
    _report("needle pages", rows, figures)
    s8, s4, s2, quest = (rows[k] for k in ("sketch8", "sketch4", "sketch2", "quest"))
    assert s8["top1"].double().mean() >= 0.97
    assert s4["top1"].double().mean() >= 0.95
    assert rows["shared4"]["top1"].double().mean() >= 0.95  # the runtime's shared range
    assert s2["top2"].double().mean() >= 0.95
    assert quest["top2"].double().mean() < 0.5
    for s in (s2, s4, s8):
        assert s["top2"].double().mean() > quest["top2"].double().mean() + 0.4


def _mass_pages(device):
    """Page sets (as :func:`_rank_pages`) where a query's attention mass is spread the way real
    text spreads it: each page set has pages of one strong key (a peak) and pages of several
    moderately aligned keys (a spread), so the page with the best key is not the page with the
    most mass. Returns keys, q, the table, the exact page mass ``log sum exp`` of the
    ``q . k / sqrt(D)`` logits per (page set, page) ``[T, N]``."""
    b, hkv, n, p, g, d = RANK_ROWS, RANK_HKV, RANK_PAGES, RANK_P, RANK_G, RANK_D
    keys = torch.randn(b * n, p, hkv, d, device=device)
    q = torch.randn(b, hkv * g, d, device=device)
    qdir = q.view(b, 1, hkv, g, d).mean(3)  # the group's mean query per KV head
    qdir = (qdir / qdir.norm(dim=-1, keepdim=True)).expand(b, n, hkv, d).reshape(b * n, hkv, d)
    kind = torch.randint(0, 3, (b * n, hkv), device=device)  # 0 plain, 1 peak, 2 spread
    strength = torch.rand(b * n, hkv, device=device)
    key = torch.arange(p, device=device)[None, :, None, None]
    peak = (kind == 1)[:, None, :, None] & (key == 0)
    spread = (kind == 2)[:, None, :, None] & (key < 12)
    # a peak's key sits higher than a spread's keys, but 12 of those often outweigh it
    lift = torch.where(peak, (0.8 + 0.8 * strength)[:, None, :, None] * d ** 0.5,
                       torch.where(spread, (0.3 + 0.6 * strength)[:, None, :, None] * d ** 0.5,
                                   0.0))
    keys = (keys + lift * qdir[:, None]).to(torch.bfloat16)
    q = q.to(torch.bfloat16)
    table = PageTable.from_csr(torch.arange(b + 1, device=device).to(torch.int32) * n,
                               torch.arange(b * n, device=device).to(torch.int32),
                               torch.full((b,), p, dtype=torch.int32, device=device))
    mass = _exact_max_logit(q, keys, table, "lse", d ** -0.5)
    return keys, q, table, _per_set(mass)


def test_sketch_lse_ranks_pages_by_attention_mass(device, seed, figures):
    """When mass is spread over many keys, the sketch's log-sum-exp finds the pages that hold
    the attention mass; the max logit is drawn to a single strong key. Measured over the top 4
    pages of each page set: the share of the exact top-4 pages' mass they hold and Spearman
    against the exact page mass, at 4 bits in the runtime's shared range."""
    keys, q, table, mass = _mass_pages(device)
    lo, hi = keys.float().amin(dim=(0, 1)), keys.float().amax(dim=(0, 1))
    pad = (hi - lo) * Importance.SKETCH_MARGIN
    glo = (lo - pad).to(keys.dtype).expand(keys.shape[0], -1, -1)
    ghi = (hi + pad).to(keys.dtype).expand(keys.shape[0], -1, -1)
    codes = quantize_keys(keys, glo, ghi, bits=4)
    weight = torch.softmax(mass, dim=1)  # each page's share of the page set's attention
    best = weight.topk(4, dim=1).values.sum(1)
    rows = {}
    for reduce in ("max", "lse"):
        s = _per_set(sketch_score(q, codes, glo, ghi, table, bits=4, reduce=reduce).double())
        got = weight.gather(1, s.topk(4, dim=1).indices).sum(1)
        rows[reduce] = {"spearman": _spearman(mass, s), "mass_share": got / best}
    print(f"\npage mass ({mass.shape[0]} page sets of {RANK_PAGES} pages, 4-bit shared range)")
    for name, r in rows.items():
        print(f"  {name}: " + "  ".join(f"{k} {float(v.mean()):.3f}" for k, v in r.items()))
        figures.count(f"page mass, {name}: top-4 share of the exact top-4 mass (x1000)",
                      int(1000 * float(r["mass_share"].mean())))
    # measured over seeds 0..5: lse Spearman 0.99, share 0.99; max 0.92, 0.91
    lse, top = rows["lse"], rows["max"]
    assert lse["spearman"].mean() > 0.97 and lse["mass_share"].mean() > 0.97
    assert lse["spearman"].mean() > top["spearman"].mean() + 0.04
    assert lse["mass_share"].mean() > top["mass_share"].mean() + 0.04


# --- the projected sketch (key_rank < 1): fit and ranking ---------------------------------------

def _quiet_loud(device, *, sets=32, n=24, p=8, hkv=2, g=2, d=32, r=8):
    """Page sets whose keys are *loud* (std 4) along ``r`` directions no query reads and
    *quiet* (std 1) along ``r`` others the queries live in; one key of one page per (set, KV
    head) points at one of the group's queries there (the needle). Returns keys ``[sets * n, p,
    hkv, d]``, q ``[sets, hkv * g, d]``, the table, the prompt's queries ``[N, hkv, g, d]``,
    the needle page per (set, head) ``[sets * hkv]``."""
    gen = torch.Generator().manual_seed(5)
    basis = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
    loud, quiet = basis[:, :r], basis[:, r:2 * r]
    keys = (4 * torch.randn(sets * n, p, hkv, r, generator=gen) @ loud.T
            + torch.randn(sets * n, p, hkv, r, generator=gen) @ quiet.T
            + 0.1 * torch.randn(sets * n, p, hkv, d, generator=gen))
    q = 3 * torch.randn(sets, hkv * g, r, generator=gen) @ quiet.T
    prompt_q = 3 * torch.randn(256, hkv, g, r, generator=gen) @ quiet.T
    needle = torch.randint(0, n, (sets, hkv), generator=gen)
    for s, h in itertools.product(range(sets), range(hkv)):
        qd = q[s, h * g + int(torch.randint(0, g, (1,), generator=gen))]
        keys[s * n + needle[s, h], 0, h] += 1.5 * qd / qd.norm() * d ** 0.5
    table = PageTable.from_csr(torch.arange(sets + 1).to(torch.int32) * n,
                               torch.arange(sets * n).to(torch.int32),
                               torch.full((sets,), p, dtype=torch.int32))
    to = dict(device=device)
    return (keys.to(**to), q.to(**to), table.to(device), prompt_q.to(**to),
            (needle.view(-1) + 0).to(**to))


def _projected_scores(keys, q, table, basis, bits=4):
    """The runtime's projected sketch: keys through ``basis [H_kv, D, r]``, 4-bit codes in one
    range per head and channel (the keys' own, widened), the query projected by the kernel,
    its ``lse``."""
    n, p, hkv, d = keys.shape
    pk = torch.einsum("npkd,kdr->npkr", keys, basis)
    lo, hi = pk.amin(dim=(0, 1)), pk.amax(dim=(0, 1))
    pad = (hi - lo) * Importance.SKETCH_MARGIN
    lo, hi = (lo - pad).expand(n, -1, -1), (hi + pad).expand(n, -1, -1)
    codes = quantize_keys(pk, lo, hi, bits=bits)
    return sketch_score(q.contiguous(), codes, lo.contiguous(), hi.contiguous(), table,
                        bits=bits, reduce="lse", sm_scale=d ** -0.5, basis=basis.contiguous())


@pytest.mark.parametrize("hq,hkv,d,r,bits", [(4, 2, 16, 8, 4), (8, 2, 64, 24, 4),
                                             (3, 1, 32, 8, 2), (8, 8, 128, 48, 8)])
@pytest.mark.parametrize("reduce", SKETCH_REDUCES)
def test_sketch_projects_the_query_in_the_kernel(hq, hkv, d, r, bits, reduce, device, seed,
                                                 figures):
    """``basis=``: the kernel's own projection of the full query scores like the reference on
    the query projected outside (the error rule against fp64), and like the kernel fed the
    projected query; the default scale is the full head dim's."""
    b, p, num_meta = 3, 8, 12
    basis = torch.linalg.qr(torch.randn(hkv, d, d))[0][..., :r].contiguous().to(device)
    _, codes, kmin, kmax = _pages(num_meta, p, hkv, r, torch.float32, device, bits)
    q = torch.randn(b, hq, d, device=device)
    table = _table([5, 0, 12], num_meta, "csr", device, pad=2)
    out = sketch_score(q, codes, kmin, kmax, table, bits=bits, reduce=reduce, basis=basis)
    qp = project_queries(q.double(), basis.double())
    ref = sketch_score_reference(qp, codes, kmin.double(), kmax.double(), table, bits=bits,
                                 reduce=reduce, sm_scale=d ** -0.5)
    lowp = sketch_score_reference(qp.float(), codes, kmin, kmax, table, bits=bits,
                                  reduce=reduce, sm_scale=d ** -0.5)
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    c = check_rule(out, ref, lowp, torch.float32)
    figures.case("sketch", c)
    assert c.ok, c
    outside = sketch_score(qp.float().contiguous(), codes, kmin, kmax, table, bits=bits,
                           reduce=reduce, sm_scale=d ** -0.5)
    torch.testing.assert_close(out, outside, atol=1e-4, rtol=1e-4)


def test_key_basis_is_orthonormal_and_ignores_padding(device):
    keys = torch.randn(6, 8, 2, 16, device=device)
    lens = torch.tensor([8, 8, 8, 8, 8, 3], device=device)
    q = torch.randn(40, 2, 3, 16, device=device)
    for queries in (None, q):
        basis = key_basis(keys, lens, 6, queries)
        assert basis.shape == (2, 16, 6) and basis.dtype == torch.float32
        eye = torch.eye(6, device=device).expand(2, -1, -1)
        torch.testing.assert_close(basis.transpose(1, 2) @ basis, eye, atol=1e-5, rtol=0)
        junk = keys.clone()
        junk[5, 3:] = 1e4  # past the last page's length: not keys
        again = key_basis(junk, lens, 6, queries)
        # the same subspace (eigenvectors are defined up to sign)
        torch.testing.assert_close(basis @ basis.transpose(1, 2),
                                   again @ again.transpose(1, 2), atol=1e-4, rtol=0)


def test_projected_sketch_reads_the_directions_queries_use(device, figures):
    """Keys whose largest variance lies where no query looks: their own principal directions
    (``queries=None``) keep the loud directions and lose the needle; weighted by the prompt's
    queries the basis keeps the quiet ones, and a quarter of the head dim at 4 bits ranks the
    pages like the exact keys (the kernel's scores against exact page masses)."""
    keys, q, table, prompt_q, needle = _quiet_loud(device)
    lens = torch.full((keys.shape[0],), keys.shape[1], device=device)
    exact = _exact_max_logit(q, keys, table, "lse", keys.shape[-1] ** -0.5)
    rows = {}
    for name, queries in (("query-weighted", prompt_q), ("keys alone", None)):
        basis = key_basis(keys, lens, 8, queries)
        s = _projected_scores(keys, q, table, basis).double()
        per = s.view(32, 24, 2).transpose(1, 2).reshape(-1, 24)
        ex = exact.view(32, 24, 2).transpose(1, 2).reshape(-1, 24).double()
        rows[name] = {"top1": float((per.argmax(1) == needle).double().mean()),
                      "spearman": float(_spearman(ex, per).mean())}
        figures.count(f"projected sketch (rank 8 of 32, 4 bits), {name}: needle top-1 of 64",
                      int(round(64 * rows[name]["top1"])))
    print(f"\nprojected sketch: {rows}")
    good, bad = rows["query-weighted"], rows["keys alone"]
    assert good["top1"] >= 0.95 and good["spearman"] > 0.9
    assert bad["top1"] < 0.5 and good["spearman"] > bad["spearman"] + 0.3


def test_topk_fits_its_projection_on_the_prompt(tmp_path):
    """The runtime fits the projection when the first prompt chunk's attention brings its
    queries, codes every prompt page in it, scores decode queries through it; a restored cache
    (no queries) fits on the keys alone and decodes on."""
    from tierattn.runtime.cache import TieredKVCache
    from tierattn.config import TierConfig

    cfg = TierConfig.preset("topk", page_size=4, hot_budget=0.25, max_context=128,
                            prefill_chunk_size=64, backend="torch")
    assert cfg.key_rank == 0.375
    cache = TieredKVCache(cfg, num_layers=2, num_kv_heads=2, head_dim=16, batch_size=1,
                          dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, 2, 40, 16, generator=gen)
    q = torch.randn(1, 4, 40, 16, generator=gen)
    imp = cache.importance
    assert imp.basis.shape == (2, 2, 16, 6) and imp.codes.shape[-1] == 3  # 6 channels x 4 bits
    cache.update(0, k, v)
    assert not imp._sk_set[0] and imp._unfit[0]  # waits for the chunk's queries
    cache.attend(0, q)
    assert imp._sk_set[0] and not imp._unfit[0]
    pages = k[0].permute(1, 0, 2).reshape(10, 4, 2, 16)
    want = key_basis(pages, torch.full((10,), 4), 6, q.permute(0, 2, 1, 3).reshape(40, 2, 2, 16))
    torch.testing.assert_close(imp.basis[0] @ imp.basis[0].transpose(1, 2),
                               want @ want.transpose(1, 2), atol=1e-4, rtol=0)
    assert bool((imp.codes[0, :10] != 0).any()) and not bool(imp.codes[0, 10:].any())
    cache.update(1, k, v)
    cache.attend(1, q)
    for _ in range(3):  # decode: the sketch scores the cold pages through the projection
        for layer in range(2):
            cache.update(layer, *torch.randn(2, 1, 2, 1, 16, generator=gen))
            out = cache.attend(layer, torch.randn(1, 4, 1, 16, generator=gen))
            assert torch.isfinite(out).all()
    path = cache.save(tmp_path)
    fresh = TieredKVCache(cfg, num_layers=2, num_kv_heads=2, head_dim=16, batch_size=1,
                          dtype=torch.float32, device="cpu")
    fresh.load(path)
    # the saved fit comes back: the restored pages are coded as the saved cache coded them
    assert all(fresh.importance._sk_set)
    torch.testing.assert_close(fresh.importance.basis, imp.basis, atol=0, rtol=0)
    torch.testing.assert_close(fresh.importance.sk_lo, imp.sk_lo, atol=0, rtol=0)
    for layer in range(2):  # every full page (the one being filled is coded when it fills)
        full = cache.pages.layers[layer].length // 4
        assert torch.equal(fresh.importance.codes[layer, :full], imp.codes[layer, :full])
    for layer in range(2):
        fresh.update(layer, *torch.randn(2, 1, 2, 1, 16, generator=gen))
        assert torch.isfinite(fresh.attend(layer, torch.randn(1, 4, 1, 16, generator=gen))).all()


def test_projection_pending_keys_never_go_stale():
    """A chunk whose queries never came is fitted on its keys alone before anything else
    changes: when a second chunk arrives, before a row is freed or moved."""
    from tierattn.runtime.cache import TieredKVCache
    from tierattn.config import TierConfig

    cfg = TierConfig.preset("topk", page_size=4, hot_budget=0.25, max_context=128,
                            prefill_chunk_size=64, backend="torch")
    gen = torch.Generator().manual_seed(1)

    def fresh(batch=1):
        return TieredKVCache(cfg, num_layers=1, num_kv_heads=2, head_dim=16, batch_size=batch,
                             dtype=torch.float32, device="cpu")

    cache = fresh()
    k, v = torch.randn(2, 1, 2, 16, 16, generator=gen)
    cache.update(0, k, v)
    cache.update(0, k, v)  # a second chunk, no attention between: the first is fitted now
    imp = cache.importance
    assert imp._sk_set[0] and not imp._unfit[0]
    assert bool(imp.codes[0, :8].any())  # both chunks' pages are coded
    for op in ("free", "reorder"):
        cache = fresh(batch=2)
        cache.update(0, *torch.randn(2, 2, 2, 16, 16, generator=gen))
        assert cache.importance._unfit[0]
        cache.free(1) if op == "free" else cache.reorder([1, 0])
        assert cache.importance._sk_set[0] and not cache.importance._unfit[0]


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("layer0.sketch_hi"), "do not match"),  # half a layer's fit
    (lambda t: t["layer1.sketch_basis"].__setitem__((0, 0, 0), float("nan")), "non-finite"),
    (lambda t: t.__setitem__("layer0.sketch_lo", t["layer0.sketch_lo"][:, :4].clone()),
     "sketch_lo"),
])
def test_a_bad_saved_sketch_fit_is_refused(tmp_path, edit, match):
    """The saved fit is validated with the rest of the file: a file with part of a layer's fit,
    a non-finite basis or a wrong shape is refused and the cache keeps what it held."""
    from tierattn.runtime.cache import TieredKVCache
    from tierattn.config import TierConfig
    from tierattn.errors import KVFileError
    from tierattn.storage.kvfile import read_kv_file, read_kv_header, write_kv_file

    cfg = TierConfig.preset("topk", page_size=4, hot_budget=0.25, max_context=64,
                            prefill_chunk_size=32, backend="torch")
    gen = torch.Generator().manual_seed(2)
    caches = [TieredKVCache(cfg, num_layers=2, num_kv_heads=2, head_dim=16, batch_size=1,
                            dtype=torch.float32, device="cpu") for _ in range(2)]
    for cache in caches:
        k, v = torch.randn(2, 1, 2, 24, 16, generator=gen)
        q = torch.randn(1, 4, 24, 16, generator=gen)
        for layer in range(2):
            cache.update(layer, k, v)
            cache.attend(layer, q)
    src, dst = caches
    path = src.save(tmp_path)
    header = read_kv_header(path, max_file_bytes=1 << 30)
    tensors = read_kv_file(path, lambda h: None, max_file_bytes=1 << 30)
    assert {"layer0.sketch_basis", "layer0.sketch_lo", "layer0.sketch_hi"} <= set(tensors)
    edit(tensors)
    meta = {k: v for k, v in header.meta.items() if k not in ("checksum", "format_version")}
    (tmp_path / "bad").mkdir()
    bad = write_kv_file(tmp_path / "bad", "bad", tensors, meta)
    before = (dst.importance.basis.clone(), dst.importance.codes.clone(), dst.length(0))
    with pytest.raises(KVFileError, match=match):
        dst.load(bad)
    assert torch.equal(dst.importance.basis, before[0])
    assert torch.equal(dst.importance.codes, before[1]) and dst.length(0) == before[2]
