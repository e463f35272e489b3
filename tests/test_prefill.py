"""Paged prefill: numerics against an fp64 reference (flash-attention's 2x-lowp rule), exact
masking, red zones, determinism, page mass and bad inputs.

Every pool built here holds NaN in its unused slots and in the unused tail of each row's last
page, so a kernel that reads a token it must not see fails loudly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch

from tierattn.errors import KernelInputError, KernelUnsupportedError
from tierattn.kernels.page_table import PageTable
from tierattn.kernels.prefill import (PrefillOutput, paged_prefill, paged_prefill_mass,
                                      paged_prefill_reference)
from tierattn.kernels.testing import check_rule, margins_intact, red_zone

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
_DT_NAME = {F16: "fp16", BF16: "bf16", F32: "fp32"}


@dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    hq: int = 4
    hkv: int = 2
    d: int = 64
    page: int = 16
    dtype: torch.dtype = BF16
    window: int | None = None
    softcap: float | None = None
    causal: bool = True
    sm_scale: float | None = None
    shuffle: bool = True  # random page order (randperm of slots)
    padded: bool = False  # page table built with PageTable.from_padded
    block_m: int = 64
    block_n: int = 64

    @property
    def id(self) -> str:
        j = lambda xs: "+".join(map(str, xs))
        s = (f"B{len(self.q_lens)}-Q{j(self.q_lens)}-KV{j(self.kv_lens)}-H{self.hq}/{self.hkv}"
             f"-D{self.d}-P{self.page}-{_DT_NAME[self.dtype]}")
        s += f"-win{self.window}" if self.window is not None else ""
        s += f"-cap{self.softcap:g}" if self.softcap else ""
        s += "" if self.causal else "-noncausal"
        s += f"-scale{self.sm_scale:g}" if self.sm_scale else ""
        s += "" if self.shuffle else "-inorder"
        s += "-padded" if self.padded else ""
        s += f"-bm{self.block_m}" if self.block_m != 64 else ""
        s += f"-bn{self.block_n}" if self.block_n != 64 else ""
        return s

    def kwargs(self) -> dict:
        return dict(sm_scale=self.sm_scale, causal=self.causal, sliding_window=self.window,
                    softcap=self.softcap)


def _make(c: Case, device: torch.device):
    """Inputs of a case: ``(q, kv_pool, page_table, qo_indptr)`` on ``device``."""
    p = c.page
    pages = [-(-k // p) for k in c.kv_lens]
    nnz = sum(pages)
    slots = nnz + 2
    pool = torch.randn(slots, 2, p, c.hkv, c.d).to(c.dtype)
    order = torch.randperm(slots)[:nnz] if c.shuffle else torch.arange(nnz)
    used = torch.zeros(slots, dtype=torch.bool)
    used[order] = True
    pool[~used] = float("nan")
    starts = [sum(pages[:b]) for b in range(len(pages))]
    lasts = []
    for start, n, k in zip(starts, pages, c.kv_lens):
        lasts.append(k - (n - 1) * p if n else 0)
        if n:
            pool[order[start + n - 1], :, lasts[-1]:] = float("nan")
    if c.padded:
        width = max(pages, default=0) + 1
        table = torch.full((len(pages), width), 1 << 30, dtype=torch.int32)  # never read
        for b, (start, n) in enumerate(zip(starts, pages)):
            table[b, :n] = order[start:start + n]
        pt = PageTable.from_padded(table, torch.tensor(c.kv_lens, dtype=torch.int32), p)
    else:
        indptr = torch.tensor([0] + [s + n for s, n in zip(starts, pages)], dtype=torch.int32)
        pt = PageTable.from_csr(indptr, order.to(torch.int32),
                                torch.tensor(lasts, dtype=torch.int32))
    qo = torch.tensor([0] + [sum(c.q_lens[:b + 1]) for b in range(len(c.q_lens))],
                      dtype=torch.int32)
    q = torch.randn(sum(c.q_lens), c.hq, c.d).to(c.dtype)
    return q.to(device), pool.to(device), pt.to(device), qo.to(device)


def _check(got: PrefillOutput, q, pool, pt, qo, c: Case, figures, *, random_case=False,
           msg: str = "") -> None:
    """Rule check of out, lse and page_mass; records the worst ratio as one case."""
    ref = paged_prefill_reference(q.double(), pool.double(), pt, qo, return_page_mass=True,
                                  **c.kwargs())
    lowp = paged_prefill_reference(q, pool, pt, qo, return_page_mass=True,
                                   compute_dtype=c.dtype, **c.kwargs())
    checks = {name: check_rule(getattr(got, name), getattr(ref, name), getattr(lowp, name),
                               c.dtype)
              for name in ("out", "lse", "page_mass")}
    figures.case("prefill", max(checks.values(), key=lambda r: r.ratio), random=random_case)
    for name, r in checks.items():
        assert r.ok, f"{c.id} {msg}: {name} {r}"
    assert not got.out.isnan().any() and not got.lse.isnan().any(), f"{c.id} {msg}: NaN"


def _p(*args, **kw) -> pytest.param:
    c = Case(*args, **kw)
    return pytest.param(c, id=c.id)


CASES = [
    # whole-prompt prefill (q_len == kv_len), the odd lengths
    _p((1,), (1,), 4, 2, 64, 16, BF16),
    _p((2,), (2,), 8, 2, 40, 8, F16),
    _p((3,), (3,), 4, 4, 80, 1, F32),
    _p((5,), (5,), 5, 1, 100, 16, BF16),
    _p((17,), (17,), 8, 1, 128, 16, F16),
    _p((63,), (63,), 4, 2, 64, 8, BF16),
    _p((97,), (97,), 2, 1, 40, 16, F32),
    _p((111,), (111,), 4, 1, 80, 64, BF16),
    _p((127,), (127,), 2, 2, 64, 12, F16),
    _p((128,), (128,), 4, 2, 100, 16, BF16),
    _p((129,), (129,), 2, 1, 64, 16, F32),
    _p((129,), (129,), 8, 8, 40, 8, BF16),
    # longer sequences, a few
    _p((257,), (257,), 2, 1, 64, 16, BF16),
    _p((129,), (257,), 4, 2, 40, 12, F16, window=100),
    _p((5,), (799,), 4, 1, 64, 16, BF16),
    _p((2,), (1025,), 2, 1, 128, 64, F32, block_n=128),
    # kv_len at k*P-1, k*P, k*P+1 (chunked: the chunk starts mid-page)
    _p((5,), (31,), 4, 2, 64, 16, BF16),
    _p((5,), (32,), 4, 2, 64, 16, BF16),
    _p((5,), (33,), 4, 2, 64, 16, BF16),
    _p((17,), (63,), 4, 1, 40, 8, F16),
    _p((17,), (64,), 4, 1, 40, 8, F16),
    _p((17,), (65,), 4, 1, 40, 8, F16),
    _p((3,), (127,), 2, 1, 80, 64, F32),
    _p((3,), (128,), 2, 1, 80, 64, F32),
    _p((3,), (129,), 2, 1, 80, 64, F32),
    _p((2,), (23,), 5, 5, 64, 12, BF16),
    _p((2,), (24,), 5, 5, 64, 12, BF16),
    _p((2,), (25,), 5, 5, 64, 12, BF16),
    _p((17,), (17,), 2, 1, 64, 1, BF16),
    _p((1,), (63,), 4, 4, 64, 1, F16),
    # chunked prefill: q_len < kv_len
    _p((1,), (97,), 8, 2, 128, 16, BF16),
    _p((17,), (33,), 8, 2, 40, 8, BF16),
    _p((5,), (128,), 4, 1, 64, 16, F16),
    _p((63,), (129,), 2, 1, 64, 16, BF16),
    _p((2,), (111,), 4, 2, 100, 8, F32),
    _p((97,), (111,), 2, 2, 80, 16, F16),
    _p((63,), (127,), 2, 1, 64, 64, BF16),
    _p((3,), (17,), 10, 2, 64, 1, BF16),
    # batches with zero-length and one-token sequences, mixed chunking
    _p((17, 5), (33, 5), 8, 2, 40, 8, BF16),
    _p((0, 17), (5, 17), 4, 2, 64, 16, F16),
    _p((17, 0), (33, 0), 4, 1, 64, 16, BF16),
    _p((1, 1, 1), (1, 17, 97), 4, 2, 64, 16, BF16),
    _p((5, 0, 1, 17), (5, 63, 1, 17), 2, 1, 80, 8, F32),
    _p((63, 2), (63, 129), 4, 2, 100, 12, BF16),
    _p((3, 111), (64, 111), 2, 2, 64, 16, F16),
    _p((0, 0, 5), (0, 17, 5), 4, 2, 40, 16, BF16),
    _p((17, 5), (33, 5), 8, 2, 40, 8, BF16, padded=True),
    _p((2, 0, 63), (17, 8, 64), 4, 1, 64, 8, F16, padded=True),
    _p((17, 17), (17, 17), 4, 2, 64, 16, BF16, shuffle=False),
    # sliding windows (HF: t - j < window), causal and not
    _p((17,), (33,), 8, 2, 40, 8, BF16, window=16),
    _p((63,), (63,), 4, 2, 64, 16, F16, window=1),
    _p((63,), (63,), 4, 2, 64, 16, BF16, window=4),
    _p((97,), (129,), 4, 1, 64, 16, F32, window=33),
    _p((5,), (128,), 2, 1, 80, 8, BF16, window=17),
    _p((128,), (128,), 2, 1, 64, 1, F16, window=7),
    _p((17,), (17,), 4, 2, 64, 16, BF16, window=200),
    _p((63, 5), (127, 5), 4, 2, 100, 12, BF16, window=20),
    _p((17,), (33,), 4, 2, 64, 8, F16, window=5, causal=False),
    _p((63,), (63,), 2, 2, 40, 16, BF16, window=16, causal=False),
    _p((111,), (111,), 2, 1, 64, 64, BF16, window=64),
    # softcap (Gemma2: before masking), with large scores so the cap matters
    _p((17,), (33,), 4, 2, 64, 16, BF16, softcap=30.0),
    _p((63,), (63,), 4, 1, 128, 8, F16, softcap=5.0, sm_scale=0.5),
    _p((5, 17), (17, 17), 8, 2, 40, 16, F32, softcap=2.0),
    _p((97,), (97,), 2, 1, 80, 16, BF16, softcap=50.0, window=32),
    _p((3,), (65,), 4, 4, 64, 1, F16, softcap=10.0, causal=False),
    _p((127,), (127,), 2, 2, 64, 12, BF16, softcap=20.0, sm_scale=1.0),
    # non-causal
    _p((17,), (17,), 4, 2, 64, 16, BF16, causal=False),
    _p((5,), (97,), 4, 1, 40, 8, F16, causal=False),
    _p((63, 1), (63, 33), 2, 1, 100, 16, F32, causal=False),
    _p((129,), (129,), 2, 2, 64, 64, BF16, causal=False),
    # GQA ratios 1/2/4/5/8 and head dims
    _p((33,), (33,), 2, 2, 128, 16, BF16),
    _p((33,), (47,), 4, 2, 40, 16, F16),
    _p((33,), (47,), 8, 2, 80, 8, BF16),
    _p((33,), (47,), 10, 2, 100, 16, F16),
    _p((17,), (47,), 8, 1, 64, 16, BF16),
    _p((17,), (47,), 16, 2, 40, 8, F32),
    # peaky softmax (large scale): fp16/bf16 score precision matters
    _p((63,), (63,), 4, 2, 64, 16, BF16, sm_scale=1.0),
    _p((63,), (63,), 4, 2, 64, 16, F16, sm_scale=1.0),
    _p((17,), (129,), 4, 2, 128, 8, F32, sm_scale=2.0),
    # tile sizes: several pages per tile, tiles smaller than a page (raised), many query blocks
    _p((63,), (127,), 4, 2, 64, 8, BF16, block_m=16, block_n=16),
    _p((63,), (127,), 4, 2, 64, 64, BF16, block_m=16, block_n=16),
    _p((129,), (129,), 2, 1, 40, 12, F16, block_m=32, block_n=128, window=9),
    _p((97, 3), (97, 70), 2, 1, 64, 1, BF16, block_m=16, block_n=32),
    _p((128,), (128,), 2, 1, 64, 16, F32, block_m=128, block_n=16),
    _p((111,), (111,), 4, 2, 64, 8, BF16, block_m=32, block_n=32, window=40),
]


@pytest.mark.parametrize("case", CASES)
def test_prefill_grid(case: Case, device, seed, figures):
    q, pool, pt, qo = _make(case, device)
    got = paged_prefill(q, pool, pt, qo, return_page_mass=True, block_m=case.block_m,
                        block_n=case.block_n, **case.kwargs())
    _check(got, q, pool, pt, qo, case, figures, msg=f"seed={seed}")


_LENS = (1, 2, 3, 5, 17, 63, 97, 111, 127, 128, 129)


def _random_case(seed: int) -> Case:
    rng = random.Random(seed)
    batch = rng.choice((1, 1, 2, 3))
    kv_lens, q_lens = [], []
    for _ in range(batch):
        kv = rng.choice((0,) + _LENS if batch > 1 else _LENS)
        kv_lens.append(kv)
        q_lens.append(rng.choice([x for x in (0,) + _LENS if x <= kv] if batch > 1 else
                                 [x for x in _LENS if x <= kv]))
    while sum(q_lens) * sum(kv_lens) > 129 * 160:  # keep the interpreter fast
        i = max(range(batch), key=lambda b: q_lens[b])
        q_lens[i] = max(1, q_lens[i] // 3) if q_lens[i] > 1 else 0
    group = rng.choice((1, 2, 4, 5, 8))
    hkv = rng.choice((1, 2)) if group <= 4 else 1
    hq = hkv * group
    return Case(
        tuple(q_lens), tuple(kv_lens), hq, hkv,
        d=rng.choice((32, 40, 64, 80, 100, 128)),
        page=rng.choice((1, 8, 12, 16, 64)),
        dtype=rng.choice((F16, BF16, F32)),
        window=rng.choice((None, None, 1, 7, 16, 50)),
        softcap=rng.choice((None, None, 30.0)),
        causal=rng.random() < 0.8,
        block_m=rng.choice((16, 32, 64)),
        block_n=rng.choice((16, 32, 64)),
    )


@pytest.mark.parametrize("i", range(15))
def test_prefill_random(i: int, device, seed, figures):
    case = _random_case(seed)
    q, pool, pt, qo = _make(case, device)
    got = paged_prefill(q, pool, pt, qo, return_page_mass=True, block_m=case.block_m,
                        block_n=case.block_n, **case.kwargs())
    _check(got, q, pool, pt, qo, case, figures, random_case=True,
           msg=f"seed={seed}")


# ---- exact masking ----------------------------------------------------------------------------

@pytest.mark.parametrize("q_lens, kv_lens", [((5,), (3,)), ((4, 3), (0, 9)), ((7,), (1,))],
                         ids=["Q5-KV3", "B2-Q4+3-KV0+9", "Q7-KV1"])
def test_fully_masked_rows(q_lens, kv_lens, device, seed, figures):
    # more queries than keys (validate=False): rows at positions < 0 see no key at all
    case = Case(q_lens, kv_lens, 4, 2, 40, 8, BF16)
    q, pool, pt, qo = _make(case, device)
    got = paged_prefill(q, pool, pt, qo, return_page_mass=True, validate=False)
    masked = torch.cat([torch.arange(q0, q0 + max(0, ql - kl)) for q0, ql, kl in
                        zip(qo.tolist(), q_lens, kv_lens)]).to(device)
    exact = bool((got.out[masked] == 0).all() and (got.lse[masked] == float("-inf")).all()
                 and not got.out.isnan().any() and not got.lse.isnan().any()
                 and not got.page_mass.isnan().any())
    figures.masking("prefill", exact)
    assert exact, got.lse[masked]
    _check(got, q, pool, pt, qo, case, figures, msg=f"seed={seed}")
    visible_rows = sum(min(ql, kl) for ql, kl in zip(q_lens, kv_lens))
    assert abs(float(got.page_mass.sum()) - visible_rows * 4) < 1e-3  # G * H_kv = 2 * 2


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=_DT_NAME.get)
def test_single_visible_key_very_negative_score(dtype, device, figures):
    # window 1: each query sees only its own key, with score -512 * 1024 = -524288
    case = Case((40,), (70,), 4, 2, 40, 8, dtype, window=1, sm_scale=1.0)
    q, pool, pt, qo = _make(case, device)
    q.zero_()
    q[..., 0] = -512
    pool[:, 0, ..., 0] = torch.where(pool[:, 0, ..., 0].isnan(), pool[:, 0, ..., 0], 1024)
    pool[:, 0, ..., 1:] = torch.where(pool[:, 0, ..., 1:].isnan(), pool[:, 0, ..., 1:], 0)
    got = paged_prefill(q, pool, pt, qo, sm_scale=1.0, sliding_window=1, return_page_mass=True,
                        block_n=16)
    ref = paged_prefill_reference(q.double(), pool.double(), pt, qo, sm_scale=1.0,
                                  sliding_window=1, return_page_mass=True)
    values = pool[pt.indices.long(), 1].reshape(-1, 2, 40)[30:70]  # [q_len, H_kv, D]
    want = values.float().repeat_interleave(2, dim=1)
    exact = bool(torch.equal(got.out, want) and (got.lse == -524288.0).all()
                 and torch.equal(got.page_mass, ref.page_mass.float()))
    figures.masking("prefill", exact)
    assert exact, (got.out - want).abs().max()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_first_tile_fully_masked(causal, device, seed, figures):
    # later rows of the block see nothing in the first tiles the block loads
    case = Case((64,), (64,), 2, 1, 64, 16, F16, window=4, causal=causal, block_n=16)
    q, pool, pt, qo = _make(case, device)
    got = paged_prefill(q, pool, pt, qo, return_page_mass=True, block_n=16, **case.kwargs())
    no_nan = not (got.out.isnan().any() or got.lse.isnan().any() or got.page_mass.isnan().any())
    figures.masking("prefill", no_nan)
    assert no_nan
    _check(got, q, pool, pt, qo, case, figures, msg=f"seed={seed}")


# ---- red zones, layouts, determinism ------------------------------------------------------------

def test_red_zones(device, seed, figures):
    case = Case((17, 5), (40, 5), 4, 2, 40, 8, BF16)
    q0, pool0, pt, qo = _make(case, device)
    q, q_buf = red_zone(tuple(q0.shape), q0.dtype, device)
    pool, pool_buf = red_zone(tuple(pool0.shape), pool0.dtype, device)
    q.copy_(q0)
    pool.copy_(pool0)
    out, out_buf = red_zone((22, 4, 40), F32, device)
    lse, lse_buf = red_zone((22, 4), F32, device)
    got = paged_prefill(q, pool, pt, qo, out=out, lse=lse, return_page_mass=True)
    assert got.out.data_ptr() == out.data_ptr() and got.lse.data_ptr() == lse.data_ptr()
    for buf, view in ((out_buf, out), (lse_buf, lse), (q_buf, q), (pool_buf, pool)):
        assert margins_intact(buf, view)
    _check(got, q, pool, pt, qo, case, figures, msg=f"seed={seed}")


def test_strided_out_lse(device, seed, figures):
    # out with a padded head axis and lse transposed: written in place through their strides
    case = Case((17, 3), (17, 30), 4, 2, 40, 16, F16)
    q, pool, pt, qo = _make(case, device)
    out_buf = torch.full((20, 4, 48), 7.0, device=device)
    lse_buf = torch.full((4, 20), 7.0, device=device)
    out, lse = out_buf[..., :40], lse_buf.T
    got = paged_prefill(q, pool, pt, qo, out=out, lse=lse, return_page_mass=True)
    assert (out_buf[..., 40:] == 7.0).all()
    _check(got, q, pool, pt, qo, case, figures, msg=f"seed={seed}")


def test_deterministic_and_noncontiguous_q(device, seed, figures):
    case = Case((63, 17), (97, 17), 4, 2, 64, 8, BF16, window=40)
    q, pool, pt, qo = _make(case, device)
    kw = dict(return_page_mass=True, block_m=32, block_n=32, **case.kwargs())
    a = paged_prefill(q, pool, pt, qo, **kw)
    b = paged_prefill(q, pool, pt, qo, **kw)
    q_nc = torch.randn(4, 80, 64, device=device).to(BF16).transpose(0, 1)  # [T, H, D], strided
    q_nc.copy_(q)
    assert not q_nc.is_contiguous()
    c = paged_prefill(q_nc, pool, pt, qo, **kw)
    for other in (b, c):
        for name in ("out", "lse", "page_mass"):
            assert torch.equal(getattr(a, name), getattr(other, name)), name
    _check(a, q, pool, pt, qo, case, figures, msg=f"seed={seed}")


@pytest.mark.parametrize("case", [
    _p((17, 0, 1, 40), (40, 9, 1, 40), 8, 2, 40, 8, BF16, padded=True),
    _p((63,), (100,), 10, 2, 64, 12, F32, window=20, padded=True),
])
def test_page_mass_sums(case: Case, device, seed, figures):
    q, pool, pt, qo = _make(case, device)
    got = paged_prefill(q, pool, pt, qo, return_page_mass=True, **case.kwargs())
    group = case.hq // case.hkv
    member = torch.zeros(pt.indices.numel(), dtype=torch.bool)
    for b, (start, count) in enumerate(zip(pt.row_start.tolist(), pt.row_count.tolist())):
        member[start:start + count] = True
        want = torch.full((case.hkv,), float(case.q_lens[b] * group), device=device)
        torch.testing.assert_close(got.page_mass[start:start + count].sum(0), want,
                                   rtol=1e-5, atol=1e-5)
    assert (got.page_mass[~member.to(device)] == 0).all()  # padding entries of no row
    _check(got, q, pool, pt, qo, case, figures, msg=f"seed={seed}")


@pytest.mark.parametrize("case", CASES + [_p((17, 5), (33, 5), 8, 2, 40, 8, F16, window=9,
                                            softcap=20.0)])
def test_torch_backend_matches_reference(case: Case, device, seed, figures):
    """The torch backend (blocked, one softmax pass) meets the rule on every grid case, and its
    mass under a given LSE (``paged_prefill_mass``) is its own page mass."""
    q, pool, pt, qo = _make(case, device)
    out = torch.empty(q.shape[0], case.hq, case.d, device=device)
    got = paged_prefill(q, pool, pt, qo, out=out, return_page_mass=True, backend="torch",
                        **case.kwargs())
    assert got.out.data_ptr() == out.data_ptr()
    assert got.out.dtype == got.lse.dtype == got.page_mass.dtype == F32
    _check(got, q, pool, pt, qo, case, figures, msg=f"seed={seed}")
    again = paged_prefill_mass(q, pool, pt, qo, got.lse, backend="torch", **case.kwargs())
    torch.testing.assert_close(again, got.page_mass, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_torch_backend_batches_sequences_of_one_shape(causal, device, seed, figures):
    """The torch backend runs the sequences that share a shape (page count, last page length,
    chunk length) as one batch, split to fit its score-block budget: a left-padded batch of six
    sequences with two others of their own shapes, in 2- and 7-query blocks, with a window and
    a softcap, meets the rule against the reference, out, LSE and page mass, both with its own
    softmax and under a given LSE."""
    from tierattn.kernels.prefill import _paged_prefill_torch

    torch.manual_seed(seed)
    p, hq, hkv, d = 4, 6, 2, 16
    kv_lens = [13, 13, 13, 13, 13, 13, 9, 21]
    q_lens = [13, 13, 13, 13, 13, 13, 3, 21] if causal else [5] * 6 + [3, 8]
    case = Case(tuple(q_lens), tuple(kv_lens), hq, hkv, d, p, F32, window=11 if causal else None,
                softcap=30.0, causal=causal)
    q, pool, pt, qo = _make(case, device)
    pool = pool.nan_to_num(0.0)  # masked lanes hold values, as a left-padded pool's do
    first_lane = torch.zeros(pt.indices.numel(), dtype=torch.int32, device=device)
    for b in range(6):  # left padding: the first page of each batched row starts part-way
        first_lane[int(pt.row_start[b])] = b % 3
    kw = dict(scale=d ** -0.5, causal=causal, sliding_window=case.window, cap=30.0,
              first_lane=first_lane)
    ref = paged_prefill_reference(q.double(), pool.double(), pt, qo, return_page_mass=True,
                                  sm_scale=None, causal=causal, sliding_window=case.window,
                                  softcap=30.0, first_lane=first_lane)
    for block_q, budget in ((2, 1), (7, 2 * hq * 7 * 16)):  # one sequence per block; two
        out, lse, mass = _paged_prefill_torch(q, pool, pt, qo, want_out=True, mass_lse=None,
                                              want_mass=True, block_q=block_q,
                                              max_elements=budget, **kw)
        torch.testing.assert_close(out, ref.out.float(), atol=2e-5, rtol=1e-5)
        seen = ~torch.isinf(ref.lse)
        assert torch.equal(torch.isinf(lse), ~seen)  # rows that see no key: -inf, out 0
        torch.testing.assert_close(lse[seen], ref.lse.float()[seen], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(mass, ref.page_mass.float(), atol=1e-4, rtol=1e-5)
        again = _paged_prefill_torch(q, pool, pt, qo, want_out=False, mass_lse=lse,
                                     want_mass=True, block_q=block_q, max_elements=budget,
                                     **kw)[2]
        torch.testing.assert_close(again, mass, atol=1e-4, rtol=1e-5)
    figures.count("prefill torch backend: sequences of one shape batched", 2)


def test_boundaries(device, seed, figures):
    # head dim 256, window 1, empty batch and all-empty sequences all succeed
    case = Case((5,), (9,), 2, 1, 256, 8, BF16, window=1)
    q, pool, pt, qo = _make(case, device)
    _check(paged_prefill(q, pool, pt, qo, return_page_mass=True, **case.kwargs()),
           q, pool, pt, qo, case, figures, msg=f"seed={seed}")
    for q_lens, kv_lens in (((), ()), ((0, 0), (3, 0))):
        q, pool, pt, qo = _make(Case(q_lens, kv_lens), device)
        got = paged_prefill(q, pool, pt, qo, return_page_mass=True)
        assert got.out.shape == (0, 4, 64) and got.lse.shape == (0, 4)
        assert got.page_mass.shape == (pt.indices.numel(), 2) and (got.page_mass == 0).all()


# ---- bad inputs ---------------------------------------------------------------------------------

def _bad(name, mutate, match, exc=KernelInputError):
    return pytest.param(mutate, match, exc, id=name)


def _with_lens(qo_vals):
    return lambda a: a.update(qo_indptr=torch.tensor(qo_vals, dtype=torch.int32,
                                                     device=a["qo_indptr"].device))


BAD = [
    _bad("q-rank", lambda a: a.update(q=a["q"][0]), "q must have 3"),
    _bad("q-dtype", lambda a: a.update(q=a["q"].double()), "q has dtype"),
    _bad("q-pool-dtype", lambda a: a.update(q=a["q"].half()), "kv_pool"),
    _bad("pool-rank", lambda a: a.update(kv_pool=a["kv_pool"][0]), "kv_pool"),
    _bad("pool-kv-axis", lambda a: a.update(kv_pool=a["kv_pool"][:, :1]), "kv_pool"),
    _bad("pool-device", lambda a: a.update(kv_pool=a["kv_pool"].to("meta")), "kv_pool"),
    _bad("gqa", lambda a: a.update(q=a["q"][:, :3]), "H_q=3"),
    _bad("head-dim", lambda a: a.update(q=a["q"][..., :32]), "kv_pool has 40"),
    _bad("head-dim-256", lambda a: a.update(q=torch.zeros(6, 4, 264, dtype=BF16),
                                            kv_pool=torch.zeros(4, 2, 4, 2, 264, dtype=BF16)),
         "kv_pool", KernelUnsupportedError),
    _bad("page-table-type", lambda a: a.update(page_table=(1, 2)), "page_table"),
    _bad("qo-dtype", lambda a: a.update(qo_indptr=a["qo_indptr"].long()), "qo_indptr"),
    _bad("qo-rank", lambda a: a.update(qo_indptr=a["qo_indptr"][None]), "qo_indptr"),
    _bad("qo-device", lambda a: a.update(qo_indptr=a["qo_indptr"].to("meta")), "qo_indptr"),
    _bad("qo-length", _with_lens([0, 2, 4, 6]), "page_table has 2 rows"),
    _bad("qo-total", _with_lens([0, 2, 5]), "qo_indptr"),
    _bad("qo-decreasing", _with_lens([0, 7, 6]), "qo_indptr"),
    _bad("qo-start", _with_lens([1, 3, 6]), "qo_indptr"),
    _bad("q-longer-than-kv", _with_lens([0, 6, 6]), "qo_indptr"),
    _bad("window-0", lambda a: a.update(sliding_window=0), "sliding_window"),
    _bad("window-bool", lambda a: a.update(sliding_window=True), "sliding_window"),
    _bad("window-float", lambda a: a.update(sliding_window=2.5), "sliding_window"),
    _bad("sm-scale", lambda a: a.update(sm_scale=-1.0), "sm_scale"),
    _bad("softcap", lambda a: a.update(softcap=-3.0), "softcap"),
    _bad("out-shape", lambda a: a.update(out=torch.zeros(6, 4, 41)), "out"),
    _bad("out-dtype", lambda a: a.update(out=torch.zeros(6, 4, 40, dtype=F16)), "out"),
    _bad("lse-shape", lambda a: a.update(lse=torch.zeros(4, 6)), "lse"),
    _bad("page-id", lambda a: a["page_table"].indices.fill_(99), "page id 99"),
    _bad("last-page-len", lambda a: a["page_table"].last_page_len.fill_(9), "last_page_len"),
    _bad("negative-count", lambda a: a["page_table"].row_count.fill_(-1), "negative page count"),
    _bad("block-m", lambda a: a.update(block_m=48), "block_m"),
    _bad("backend", lambda a: a.update(backend="cuda"), "backend"),
]


@pytest.mark.parametrize("mutate, match, exc", BAD)
def test_bad_inputs(mutate, match, exc, device, figures):
    q, pool, pt, qo = _make(Case((2, 4), (5, 4), 4, 2, 40, 8, BF16), device)
    pt = replace(pt, indices=pt.indices.clone(), row_count=pt.row_count.clone(),
                 last_page_len=pt.last_page_len.clone())
    args = dict(q=q, kv_pool=pool, page_table=pt, qo_indptr=qo)
    mutate(args)
    figures.bad_input("prefill")
    with pytest.raises(exc, match=match):
        paged_prefill(**args)
