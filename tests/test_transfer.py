"""Transfer engines and the prefetch ring: a missing wait or fence fails deterministically with
the fake asynchronous engine; the ring never hands a buffer to two layers in flight."""

from __future__ import annotations

import pytest
import torch
from helpers import Shadow, run_loop

from tierattn.runtime.cache import TieredKVCache
from tierattn.runtime.prefetch import RING, ring_slot
from tierattn.config import TierConfig, TierSpec
from tierattn.storage.transfer import CPUTransferEngine, FakeAsyncEngine

L, HKV, HQ, D = 3, 2, 4, 16
TIERS = (TierSpec("hbm"), TierSpec("ddr", capacity_pages=10), TierSpec("cxl"))


def make(engine, attend="all", prefetch="layer_ahead"):
    cfg = TierConfig(page_size=4, hot_budget=0.3, attend=attend, prefetch=prefetch, tiers=TIERS,
                     max_context=128, prefill_chunk_size=32, backend="torch",
                     recall_budget=8)
    return TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=2,
                         device="cpu", engine=engine, poison_freed=True)


def dense_check(shadow):
    def check(layer, out, q):
        err = float((out.double() - shadow.attend(layer, q)).abs().max())
        assert err < 2e-5, err
        return err
    return check


@pytest.mark.parametrize("reorder", [False, True], ids=["in-order", "reordered"])
@pytest.mark.parametrize("attend", ["all", "topk"])
def test_fake_async_engine_exact_with_waits(reorder, attend, seed):
    engine = FakeAsyncEngine(reorder=reorder, seed=seed, backend="torch")
    cache, shadow = make(engine, attend), Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    check = dense_check(shadow) if attend == "all" else None
    run_loop(cache, shadow, prompt=40, steps=20, hq=HQ, gen=gen, chunk=20, check=check)
    total = cache.stats()["total"]
    assert engine.landed > 0 and total["prefetch_hits"] > 0
    if attend == "all":  # every cold page was in flight before its layer needed it
        assert total["late_misses"] == 0 and total["wasted_prefetches"] == 0


class NoWaitEngine(FakeAsyncEngine):
    """A broken engine: waits do nothing, so copies land only at the next copy or never."""

    def wait(self, ticket):
        pass


def test_missing_wait_is_caught():
    cache, shadow = make(NoWaitEngine(reorder=False, backend="torch")), \
        Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(AssertionError):  # NaN from an unlanded page, or a reused buffer
        run_loop(cache, shadow, prompt=40, steps=6, hq=HQ, gen=gen, chunk=20,
                 check=dense_check(shadow))


def test_reusing_a_destination_before_it_landed_raises():
    engine = FakeAsyncEngine(backend="torch")
    src = torch.randn(4, 2, 4, 1, 8)
    dst = torch.zeros(4, 2, 4, 1, 8)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    t1 = engine.copy(src, i32(0, 1), dst, i32(2, 3))
    assert torch.isnan(dst[2:]).all()  # unreadable until waited on
    with pytest.raises(AssertionError, match="reused before"):
        engine.copy(src, i32(2), dst, i32(3))
    engine.wait(t1)
    assert torch.equal(dst[2:], src[:2])
    engine.copy(src, i32(2), dst, i32(3))  # fine once the first copy landed


def test_cpu_engine_is_synchronous_and_counts_launches():
    engine = CPUTransferEngine(backend="torch")
    src, dst = torch.randn(5, 2, 4, 1, 8), torch.zeros(5, 2, 4, 1, 8)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    assert engine.copy(src, i32(4, 0, 2), dst, i32(0, 1, 2)) is None
    assert torch.equal(dst[:3], src[[4, 0, 2]]) and engine.launches == 1
    engine.copy(src, i32(), dst, i32())
    assert engine.launches == 1  # an empty copy launches nothing


@pytest.mark.parametrize("num_layers", [1, 2, 3, 5, 8, 32])
@pytest.mark.parametrize("ring", [2, 3, 4])
def test_ring_never_shares_a_buffer_within_lookahead(num_layers, ring):
    for lookahead in range(1, ring):
        seq = [ring_slot(step, layer, num_layers, ring)
               for step in range(4) for layer in range(num_layers)]
        for g in range(len(seq) - lookahead):
            window = seq[g:g + lookahead + 1]
            assert len(set(window)) == len(window), (num_layers, ring, lookahead, g)


def test_prefetch_targets_the_buffer_the_next_layer_reads(seed):
    """Across layers and steps (the wrap from the last layer to layer 0 included, with a
    layer count the ring does not divide), every cold page is a prefetch hit."""
    engine = FakeAsyncEngine(reorder=True, seed=seed, backend="torch")
    cache, shadow = make(engine), Shadow(L, 2, HKV, D, torch.float32)
    assert L % RING != 0
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=32, steps=9, hq=HQ, gen=gen, chunk=32,
             check=dense_check(shadow))
    layers = cache.stats()["layers"]
    assert all(x["late_misses"] == 0 for x in layers)
    assert all(x["prefetch_hits"] > 0 for x in layers)


@pytest.mark.parametrize("staging_pages", [1, 3, 7])
def test_cold_set_larger_than_staging_streams_in_batches_exactly(staging_pages, seed):
    """Cold pages that do not fit the staging buffer are attended in batches through it (each
    batch a partial state merged by LSE); the fake engine proves no batch overwrites a buffer
    before the kernel that read it is fenced, and the page mass under the merged LSE still
    sums to the number of query heads."""
    engine = FakeAsyncEngine(reorder=True, seed=seed, backend="torch")
    cfg = TierConfig(page_size=4, hot_budget=0.25, attend="all", tiers=TIERS, max_context=128,
                     prefill_chunk_size=32, backend="torch")
    cache = TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=2,
                          device="cpu", engine=engine, poison_freed=True,
                          staging_pages=staging_pages)
    shadow = Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    before = cache.importance.mass[0].sum().item()
    run_loop(cache, shadow, prompt=48, steps=8, hq=HQ, gen=gen, chunk=16,
             check=dense_check(shadow))
    assert cache.staging_pages == staging_pages
    # every query head distributes a probability mass of 1 over the pages it attends
    tokens = 48 + 8
    total_mass = cache.importance.mass[0].sum().item() - before
    assert total_mass == pytest.approx(2 * HQ * tokens, rel=1e-4)
