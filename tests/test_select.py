"""Recall selection kernel: the same pages, order, staging rows and counters as the torch
reference over a grid of shapes (ties, padding, empty rows, dead heads), hand-built cases for the
rank and the prefetch hits, and bad inputs."""

from __future__ import annotations

import pytest
import torch

from tierattn.errors import KernelInputError
from tierattn.kernels.select import rank_pages, select_pages, select_pages_reference
from tierattn.kernels.testing import margins_intact, red_zone

FIELDS = ("cols", "slots", "src", "lse", "first", "dst")


def candidates(b, n, heads, tiers, gen, *, counts=None, ties=True, max_page=None):
    """Random candidate arrays as the page map lays them out: row ``b``'s first ``counts[b]``
    entries real (distinct logical pages, one lower tier each), the rest padding."""
    counts = counts if counts is not None else torch.randint(0, n + 1, (b,), generator=gen)
    valid = torch.arange(n)[None] < counts[:, None]
    scores = torch.randn(b, n, heads, generator=gen) * 3
    if ties:  # coarse values: many exact ties, -0.0 among them
        scores = torch.round(scores) / 2
    scores = scores.masked_fill(~valid[..., None], float("-inf"))
    pages = max_page or 2 * n
    cols = torch.stack([torch.randperm(pages, generator=gen)[:n] for _ in range(b)])
    cols = cols.where(valid, -1)
    tier = torch.randint(0, tiers, (b, n), generator=gen)
    slots = torch.stack([torch.where(valid & (tier == t), torch.randint(0, 999, (b, n),
                                                                        generator=gen), -1)
                         for t in range(tiers)]).to(torch.int32)
    lse = torch.randint(0, 10_000, (b, n), generator=gen, dtype=torch.int32)
    first = torch.randint(0, 16, (b, n), generator=gen, dtype=torch.int32)
    return scores, cols, lse, slots, first


def previous(cols, k, gen, overlap=0.5):
    """A previous selection sharing about ``overlap`` of each row's real pages, -1 padded."""
    b = cols.shape[0]
    prev = torch.full((b, k), -1, dtype=torch.int64)
    for r in range(b):
        real = cols[r][cols[r] >= 0]
        keep = real[torch.rand(len(real), generator=gen) < overlap][:k]
        fresh = torch.arange(10_000, 10_000 + k - len(keep))  # pages no candidate has
        row = torch.cat([keep, fresh])[torch.randperm(k, generator=gen)]
        prev[r] = row.masked_fill(torch.rand(k, generator=gen) < 0.2, -1)
    return prev


def run_both(device, scores, k, reduce, cols, lse, slots, first, prev):
    """(kernel result, reference result, kernel counters, reference counters, red zones ok)."""
    b, tiers = scores.shape[0], slots.shape[0]
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    out_lse, buf_lse = red_zone((b, k), torch.int32, device, fill=-7)
    out_dst, buf_dst = red_zone((b, k), torch.int32, device, fill=-7)
    hits = torch.zeros(1, dtype=torch.int64, device=device)
    recalled = torch.zeros(tiers, dtype=torch.int64, device=device)
    got = select_pages(to(scores), k, reduce=reduce, cand_cols=to(cols), cand_lse=to(lse),
                       cand_slots=to(slots), cand_first=to(first), prev_cols=to(prev),
                       out_lse=out_lse, out_dst=out_dst, hits=hits, recalled=recalled,
                       backend="triton")
    ref_hits = torch.zeros(1, dtype=torch.int64)
    ref_rec = torch.zeros(tiers, dtype=torch.int64)
    want = select_pages(scores, k, reduce=reduce, cand_cols=cols, cand_lse=lse,
                        cand_slots=slots, cand_first=first, prev_cols=prev, hits=ref_hits,
                        recalled=ref_rec, backend="torch")
    zones = margins_intact(buf_lse, out_lse, fill=-7) and margins_intact(buf_dst, out_dst,
                                                                         fill=-7)
    return got, want, (hits.cpu(), recalled.cpu()), (ref_hits, ref_rec), zones


def assert_same(got, want):
    real = want.cols >= 0  # padding entries' metadata rows and lanes are never read
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        if w is None:
            assert g is None, name
            continue
        g = g.cpu()
        if name in ("lse", "first"):
            g, w = g[real], w[real]
        assert torch.equal(g.to(w.dtype), w), (name, g, w)


@pytest.mark.parametrize("reduce", ["lse", "max"])
@pytest.mark.parametrize("with_prev", [False, True])
@pytest.mark.parametrize("b,n,heads,tiers", [(1, 5, 1, 1), (3, 24, 4, 2), (2, 40, 8, 1),
                                              (4, 17, 2, 3)])
def test_matches_reference(device, seed, figures, reduce, with_prev, b, n, heads, tiers):
    gen = torch.Generator().manual_seed(seed)
    for k in sorted({1, max(1, n // 4), n // 2 + 1, n}):
        scores, cols, lse, slots, first = candidates(b, n, heads, tiers, gen)
        prev = previous(cols, k, gen) if with_prev else None
        got, want, counts, ref_counts, zones = run_both(device, scores, k, reduce, cols, lse,
                                                        slots, first, prev)
        assert_same(got, want)
        assert torch.equal(counts[0], ref_counts[0]) and torch.equal(counts[1], ref_counts[1])
        assert zones, "select_pages wrote outside its [B, k] outputs"
        figures.case("select_pages")


def test_order_ties_and_padding(device):
    """Best first; equal ranks go to the lower candidate (-0.0 ties +0.0); a row with fewer
    candidates than k lists them first, then padding; an empty row is all padding."""
    scores = torch.tensor([[[1.0], [3.0], [-0.0], [3.0], [0.0], [float("-inf")]],
                           [[2.0], [float("-inf")], [float("-inf")], [float("-inf")],
                            [float("-inf")], [float("-inf")]],
                           [[float("-inf")]] * 6])
    cols = torch.tensor([[10, 11, 12, 13, 14, -1], [20, -1, -1, -1, -1, -1], [-1] * 6])
    lse = torch.arange(18, dtype=torch.int32).view(3, 6)
    slots = torch.where(cols >= 0, cols, -1).to(torch.int32)[None]
    got = select_pages(scores.to(device), 4, reduce="max", cand_cols=cols.to(device),
                       cand_lse=lse.to(device), cand_slots=slots.to(device), backend="triton")
    assert got.cols.cpu().tolist() == [[11, 13, 10, 12], [20, -1, -1, -1], [-1, -1, -1, -1]]
    assert got.dst.cpu().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_lse_rank_is_the_heads_shares(device):
    """``lse``: a page holding all of one head's mass beats a page holding a third of each of
    two heads' (1 > 2/3); ``max``: the largest logit wins. A head with no candidate scores (all
    -inf) adds nothing instead of making the row NaN."""
    inf = float("-inf")
    # head 0: page 0 has everything; head 1 split over pages 1, 2, 3; head 2 dead
    s = torch.tensor([[[0.0, -30.0, inf], [-30.0, 0.0, inf], [-30.0, 0.0, inf],
                       [-30.0, 0.0, inf]]])
    cols = torch.tensor([[0, 1, 2, 3]])
    lse = torch.zeros(1, 4, dtype=torch.int32)
    slots = torch.zeros(1, 1, 4, dtype=torch.int32)
    rank = rank_pages(s, "lse")
    assert torch.isfinite(rank).all()
    assert torch.allclose(rank.exp(), torch.tensor([[1.0, 1 / 3, 1 / 3, 1 / 3]]), atol=1e-6)
    got = select_pages(s.to(device), 1, reduce="lse", cand_cols=cols.to(device),
                       cand_lse=lse.to(device), cand_slots=slots.to(device), backend="triton")
    assert got.cols.cpu().tolist() == [[0]]
    s[0, 2, 1] = 5.0  # page 2's logit is now the largest anywhere
    got = select_pages(s.to(device), 1, reduce="max", cand_cols=cols.to(device),
                       cand_lse=lse.to(device), cand_slots=slots.to(device), backend="triton")
    assert got.cols.cpu().tolist() == [[2]]


def test_prefetch_hits_read_their_staged_rows(device):
    """A selected page the previous selection holds at position j' reads row ``b * k + j'``
    and copies nothing; the others go to the second half ``B * k + b * k + j``."""
    k, b = 3, 2
    scores = torch.tensor([[[4.0], [3.0], [2.0], [1.0]], [[1.0], [2.0], [3.0], [4.0]]])
    cols = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    slots = (cols * 10).to(torch.int32)[None]
    lse = torch.zeros(b, 4, dtype=torch.int32)
    prev = torch.tensor([[9, 7, 5], [-1, 4, -1]])  # row 0 staged 7 at 1 and 5 at 2; row 1: 4
    hits = torch.zeros(1, dtype=torch.int64, device=device)
    recalled = torch.zeros(1, dtype=torch.int64, device=device)
    got = select_pages(scores.to(device), k, reduce="max", cand_cols=cols.to(device),
                       cand_lse=lse.to(device), cand_slots=slots.to(device),
                       prev_cols=prev.to(device), hits=hits, recalled=recalled,
                       backend="triton")
    assert got.cols.cpu().tolist() == [[5, 6, 7], [4, 3, 2]]
    assert got.dst.cpu().tolist() == [[2, 7, 1], [4, 10, 11]]
    assert got.src.cpu().tolist() == [[[-1, 60, -1], [-1, 30, 20]]]
    assert got.slots.cpu().tolist() == [[[50, 60, 70], [40, 30, 20]]]
    assert hits.item() == 3 and recalled.item() == 3


def test_bad_inputs(device, figures):
    gen = torch.Generator().manual_seed(0)
    scores, cols, lse, slots, first = candidates(2, 8, 2, 1, gen)
    ok = dict(reduce="lse", cand_cols=cols, cand_lse=lse, cand_slots=slots)
    bad = [
        ((scores[0], 2), {}, "scores"),
        ((scores, 0), {}, "k must"),
        ((scores, 9), {}, "k must"),
        ((scores, 2), {"reduce": "mean"}, "reduce"),
        ((scores, 2), {"cand_cols": cols.int()}, "cand_cols"),
        ((scores, 2), {"cand_lse": lse[:, :4]}, "cand_lse"),
        ((scores, 2), {"cand_slots": slots[0]}, "cand_slots"),
        ((scores, 2), {"cand_first": first[:1]}, "cand_first"),
        ((scores, 2), {"prev_cols": cols[:, :3]}, "prev_cols"),
        ((scores, 2), {"out_dst": torch.zeros(2, 4, dtype=torch.int32)[:, ::2]}, "out_dst"),
        ((scores, 2), {"hits": torch.zeros(2, dtype=torch.int64)}, "hits"),
        ((scores, 2), {"recalled": torch.zeros(1, dtype=torch.int32)}, "recalled"),
    ]
    for args, override, name in bad:
        with pytest.raises(KernelInputError, match=name):
            select_pages(*args, **{**ok, **override})
        figures.bad_input("select_pages")


def test_reference_is_the_runtime_rank():
    """The reference's selection is the top-k of :func:`rank_pages` (what the key-tier probe
    ranks by), with stable ties."""
    gen = torch.Generator().manual_seed(3)
    scores, cols, lse, slots, _ = candidates(3, 20, 4, 1, gen, ties=False)
    for reduce in ("lse", "max"):
        ref = select_pages_reference(scores, 6, reduce=reduce, cand_cols=cols, cand_lse=lse,
                                     cand_slots=slots)
        rank = rank_pages(scores, reduce)
        top = rank.topk(6, dim=1)
        real = top.values > float("-inf")
        assert torch.equal(ref.cols[real], cols.gather(1, top.indices)[real])


def test_nan_scores_rank_last_and_k_is_checked_on_the_hot_path(device):
    """A NaN score never puts padding among the real pages: with ``max`` the NaN page ranks like
    padding, after every real one; with ``lse`` it poisons its head's normalizer, so the row's
    ranks are all -inf and the compacted candidates keep their order, padding last -- kernel and
    reference alike. ``k`` outside [1, n] raises even with ``validate=False``."""
    scores = torch.tensor([[[float("nan")], [1.0], [2.0], [float("-inf")]]])
    cols = torch.tensor([[7, 8, 9, -1]])
    lse = torch.zeros(1, 4, dtype=torch.int32)
    slots = torch.zeros(1, 1, 4, dtype=torch.int32)
    for reduce, want in (("max", [[9, 8, 7]]), ("lse", [[7, 8, 9]])):
        for backend in ("triton", "torch"):
            got = select_pages(scores.to(device), 3, reduce=reduce, cand_cols=cols.to(device),
                               cand_lse=lse.to(device), cand_slots=slots.to(device),
                               backend=backend)
            assert got.cols.cpu().tolist() == want, (reduce, backend)
    for k in (0, 5):
        with pytest.raises(KernelInputError, match="k must"):
            select_pages(scores, k, reduce="max", cand_cols=cols, cand_lse=lse,
                         cand_slots=slots, validate=False)
