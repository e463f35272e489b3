"""The device tables a decode step reads are patched in place on structural edits (a page
started, pages demoted); after every step of random decoding they must describe exactly what a
rebuild from the host map describes: the same hot rows in the same order, the same cold pages
and copy pairs, the same recall candidates (order may differ where it does not matter)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig, TierSpec
from tierattn.storage.pagemap import LayerTables

L, HKV, HQ, D, P = 2, 2, 4, 8, 4


def _rows(table, b: int, mp: int, *arrays):
    start = int(table.table.row_start[b])
    n = table.counts[b]
    return [tuple(int(a[start + i]) if a is not None else 0 for a in arrays) for i in range(n)]


def _same(got: LayerTables, want: LayerTables, batch: int, mp: int, mid_page: bool) -> None:
    h, w = got.hot, want.hot
    assert h.counts == w.counts
    for b in range(batch):
        arrays = lambda t: (t.table.indices, t.lse_index, t.first_lane)
        assert _rows(h, b, mp, *arrays(h)) == _rows(w, b, mp, *arrays(w)), f"hot row {b}"
        if h.counts[b]:
            assert int(h.table.last_page_len[b]) == int(w.table.last_page_len[b])
    if mid_page:  # at a page boundary the next token's page is not allocated yet
        assert torch.equal(got.write_pos, want.write_pos)
        assert torch.equal(got.current_slots, want.current_slots)
    assert got.cold_pages == want.cold_pages

    def cold(t: LayerTables):
        pages, pairs = Counter(), Counter()
        for batch_ in t.cold:
            tab = batch_.table
            for b in range(batch):
                pages.update(_rows(tab, b, mp, tab.lse_index, tab.first_lane))
            for tier, src, dst in batch_.copies:
                for s, d in zip(src.tolist(), dst.tolist()):
                    if s >= 0:
                        pairs[(tier, s, int(tab.lse_index[d]))] += 1
        return pages, pairs

    assert cold(got) == cold(want)
    if want.candidates is not None:
        def cand(t: LayerTables):
            out = Counter()
            for b in range(batch):
                c = t.candidates
                for i in range(c.counts[b]):
                    e = b * mp + i
                    out[(int(c.table.indices[e]), int(t.cand_lse.view(-1)[e]),
                         int(t.cand_cols.view(-1)[e]),
                         tuple(int(x) for x in t.cand_slots.view(t.cand_slots.shape[0], -1)[:, e]),
                         int(t.cand_first.view(-1)[e]) if t.cand_first is not None else 0)] += 1
            return out
        assert cand(got) == cand(want)


CASES = {
    "offload-ddr": dict(hot_budget=0.5, tiers=(TierSpec("hbm"), TierSpec("ddr"))),
    "offload-ddr+cxl": dict(hot_budget=0.3, tiers=(TierSpec("hbm"),
                                                   TierSpec("ddr", capacity_pages=5),
                                                   TierSpec("cxl"))),
    "topk": dict(hot_budget=0.25, attend="topk", recall_budget=8),
    "topk-2tiers": dict(hot_budget=0.25, attend="topk", recall_budget=8,
                        tiers=(TierSpec("hbm"), TierSpec("ddr", capacity_pages=4),
                               TierSpec("cxl"))),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
def test_patched_tables_equal_a_rebuild(case, pad, seed):
    cfg = TierConfig(page_size=P, max_context=160, prefill_chunk_size=32, backend="torch",
                     sink_pages=1, recent_pages=1, **CASES[case])
    cache = TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=3,
                          device="cpu")
    if pad:
        cache.set_padding([0, 5, 9])
    gen = torch.Generator().manual_seed(seed)
    pm, patched = cache.pages, 0
    for t in [29] + [1] * 60:
        for layer in range(L):
            k = torch.randn(3, HKV, t, D, generator=gen)
            before = pm.cached_tables(layer)
            cache.update(layer, k, k)
            cache.attend(layer, torch.randn(3, HQ, t, D, generator=gen))
            tabs = pm.cached_tables(layer)
            if tabs is None:
                continue
            patched += tabs is before  # kept current by patches, not rebuilt
            pm.cold_batches(layer, cache.tiers)  # a patch may leave them to be rebuilt on use
            _same(tabs, pm._build(layer, cache.tiers, None), 3, cache.max_pages,
                  cache.length(layer) % P != 0)
    assert patched > 20  # the patches, not rebuilds, kept the tables current


def test_table_patch_writes_each_position_once(monkeypatch):
    """Demoting several pages of one row in one call writes the row's count once per page: the
    patch must keep the last value, and hand the indexed write each position once -- with a
    position repeated, a parallel CPU write (or CUDA) may keep any of its values, which lost
    cold pages from offload's tables (KL ~10 in the reasoning eval's filler control)."""
    from tierattn.storage.pagemap import _scatter

    writes = []
    real = torch.Tensor.__setitem__

    def spy(self, index, value):
        writes.append(index.clone() if isinstance(index, torch.Tensor) else index)
        return real(self, index, value)

    buf = torch.zeros(6, dtype=torch.int32)
    monkeypatch.setattr(torch.Tensor, "__setitem__", spy)
    _scatter(buf, [3, 1, 3, 5, 3], [7, 8, 9, 4, 11])
    _scatter(buf, torch.tensor([0, 2]), torch.tensor([5, 6]))
    _scatter(buf, [], [])
    monkeypatch.undo()
    assert buf.tolist() == [5, 8, 6, 11, 0, 4]
    assert len(writes) == 2 and all(len(set(w.tolist())) == len(w) for w in writes)
