"""The recall selector and the decode-time eviction baselines, in the runtime: the key sketch
finds the page a query needs, R-KV drops the earlier copy of repeated content, the decode
window holds exactly the last steps' page mass."""

from __future__ import annotations

import pytest
import torch
from helpers import Shadow

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig
from tierattn.storage.pagemap import NONE

L, HKV, HQ, D, P = 1, 2, 4, 16, 4


def make(cfg, batch=1):
    return TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=batch,
                         device="cpu", poison_freed=True)


def needle_prompt(gen, n_pages=12, needle_page=5):
    """Random keys of small norm, one key of page ``needle_page`` along the query's direction:
    the query's attention is almost all on it."""
    k = 0.3 * torch.randn(1, HKV, n_pages * P, D, generator=gen)
    v = torch.randn(1, HKV, n_pages * P, D, generator=gen)
    q_dir = torch.nn.functional.normalize(torch.randn(HKV, D, generator=gen), dim=-1)
    k[0, :, needle_page * P + 1] = 6 * q_dir
    q = q_dir.repeat_interleave(HQ // HKV, 0)[None, :, None, :] * 3
    return k, v, q


def assert_recalls(k, v, q, gen, page, *, cold, sm_scale=None, **config):
    """Prefill ``k, v`` with a 3-page hot budget and a one-page recall, check that pages
    ``cold`` left HBM, add one token, decode ``q``: exactly the hot pages and ``page`` must be
    attended (against an fp64 shadow). Returns the cache."""
    cfg = TierConfig(page_size=P, hot_budget=3 * P, attend="topk", recall_budget=P,
                     recall_score="sketch", sink_pages=1, recent_pages=0, max_context=64,
                     prefill_chunk_size=64, backend="torch", **config)
    cache, shadow = make(cfg), Shadow(L, 1, HKV, D, torch.float32)
    cache.update(0, k, v)
    shadow.append(0, k, v)
    cache.attend(0, torch.randn(1, HQ, k.shape[2], D, generator=gen) * 0.01)
    st = cache.pages.layers[0]
    assert all(int(st.tier[0, c]) != 0 for c in cold), f"pages {cold} should have left HBM"
    k1, v1 = 0.1 * torch.randn(1, HKV, 1, D, generator=gen), torch.randn(1, HKV, 1, D)
    cache.update(0, k1, v1)
    shadow.append(0, k1, v1)
    hot = (st.tier[0, :cache.num_pages(0)] == 0).nonzero().flatten().tolist()
    out = cache.attend(0, q, sm_scale=sm_scale)
    keep = torch.zeros(1, cache.length(0), dtype=torch.bool)
    for pg in hot + [page]:
        keep[0, pg * P:(pg + 1) * P] = True
    want = shadow.attend(0, q, keep, sm_scale=sm_scale).float()
    assert float((out - want).abs().max()) < 1e-5
    return cache


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_sketch_recall_finds_the_needle_page(bits, seed):
    gen = torch.Generator().manual_seed(seed)
    k, v, q = needle_prompt(gen)
    # exactly the hot pages and the needle's page were attended: the one recalled page
    cache = assert_recalls(k, v, q, gen, 5, cold=[5], key_bits=bits)
    assert cache.stats()["total"]["h2d_decode_bytes"] == cache.page_bytes  # and only it


@pytest.mark.parametrize("reduce, sm_scale, want_page", [
    ("max", None, 3), ("lse", None, 7), ("lse", 1.0, 3), ("max", 1.0, 3)])
def test_sketch_reduce_picks_the_page_with_the_mass(reduce, sm_scale, want_page, seed):
    """Page 3 holds one key along the query (a peak), page 7 four weaker ones (a spread). At the
    default scale the spread page holds more attention mass (4 e^3.75 against e^4.5): ranked
    by the page's mass (``lse``) it is recalled, ranked by the best logit (``max``) the peak is.
    At ``sm_scale=1`` the peak holds the mass (e^18 against 4 e^15), and ``lse`` follows the
    scale the attention call passes."""
    gen = torch.Generator().manual_seed(seed)
    k, v, q = needle_prompt(gen, needle_page=3)
    q_dir = q[0, ::HQ // HKV, 0] / 3
    k[0, :, 3 * P + 1] = 6 * q_dir
    k[0, :, 7 * P:8 * P] = 5 * q_dir[:, None]
    assert_recalls(k, v, q, gen, want_page, cold=[3, 7], sm_scale=sm_scale,
                   sketch_reduce=reduce, key_bits=8)


@pytest.mark.parametrize("reduce, want_page", [("lse", 8), ("max", 4)])
def test_sketch_lse_weighs_each_kv_head_by_its_share(reduce, want_page, seed):
    """KV head 0 attends every page about equally, at large logits (page 4 a little more);
    KV head 1 attends almost only page 8, at small logits. Summing each head's share of the
    cold pages' mass, ``lse`` recalls page 8, which holds most of head 1's attention; the
    largest logit over the heads (``max``) goes to head 0's page 4, whose share is small."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = 12
    k = 0.1 * torch.randn(1, HKV, n_pages * P, D, generator=gen)
    v = torch.randn(1, HKV, n_pages * P, D, generator=gen)
    q_dir = torch.nn.functional.normalize(torch.randn(HKV, D, generator=gen), dim=-1)
    scale = D ** -0.5
    # head 0: every key at logit 10 (page 4's at 10.5); head 1: page 8's keys at logit 5
    k[0, 0] += 10 / (3 * scale) * q_dir[0]
    k[0, 0, 4 * P:5 * P] += 0.5 / (3 * scale) * q_dir[0]
    k[0, 1, 8 * P:9 * P] += 5 / (3 * scale) * q_dir[1]
    q = q_dir.repeat_interleave(HQ // HKV, 0)[None, :, None, :] * 3
    assert_recalls(k, v, q, gen, want_page, cold=[4, 8], sketch_reduce=reduce, key_bits=8)


def test_decode_window_holds_the_last_steps_mass(seed):
    cfg = TierConfig.preset("evict-rkv", page_size=P, max_context=64, prefill_chunk_size=64,
                            backend="torch")
    cache = make(cfg)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, HKV, 8, D, generator=gen)
    cache.update(0, x, x)
    cache.attend(0, torch.randn(1, HQ, 8, D, generator=gen))
    imp = cache.importance
    masses = []
    for _ in range(11):  # more steps than the window (8)
        before = imp.mass[0].clone()
        x = torch.randn(1, HKV, 1, D, generator=gen)
        cache.update(0, x, x)
        cache.attend(0, torch.randn(1, HQ, 1, D, generator=gen))
        masses.append(imp.mass[0] - before)
    want = torch.stack(masses[-8:]).sum(0)
    assert torch.allclose(imp.recent[0].sum(0), want, atol=1e-5)
    assert torch.allclose(imp.host(0, fresh=True).recent.flatten(),
                          want[:-1].view(-1), atol=1e-5)


def test_rkv_drops_the_earlier_copy_of_repeated_content(seed):
    """Pages 3 and 7 hold the same keys; queries attend nothing in particular: R-KV's
    redundancy term drops page 3 (the earlier copy) first."""
    gen = torch.Generator().manual_seed(seed)
    n = 10
    k = torch.randn(1, HKV, n * P, D, generator=gen)
    k[:, :, 3 * P:4 * P] = k[:, :, 7 * P:8 * P]
    cfg = TierConfig(page_size=P, hot_budget=1.0, evict_budget=P, evict_policy="rkv",
                     sink_pages=1, recent_pages=0, max_context=64, prefill_chunk_size=64,
                     backend="torch", tiers=("hbm", "ddr"))
    cache = make(cfg)
    cache.update(0, k, k)
    cache.attend(0, torch.zeros(1, HQ, n * P, D))  # uniform attention: importance ties
    dropped = (cache.pages.layers[0].evicted[0, :n]).nonzero().flatten().tolist()
    assert dropped == [3]
    assert int(cache.pages.layers[0].tier[0, 7]) != NONE


def test_snapkv_decode_keeps_evicting_as_the_trace_grows(seed):
    gen = torch.Generator().manual_seed(seed)
    cfg = TierConfig.preset("evict-snapkv-decode", page_size=P, max_context=64,
                            prefill_chunk_size=64, backend="torch", snapkv_window=4,
                            sink_pages=1, recent_pages=0)
    cache = make(cfg)
    x = torch.randn(1, HKV, 16, D, generator=gen)
    cache.update(0, x, x)
    cache.attend(0, torch.randn(1, HQ, 16, D, generator=gen))
    before = cache.stats()["total"]["evicted_tokens"]
    for _ in range(16):
        x = torch.randn(1, HKV, 1, D, generator=gen)
        cache.update(0, x, x)
        cache.attend(0, torch.randn(1, HQ, 1, D, generator=gen))
    after = cache.stats()["total"]["evicted_tokens"]
    assert after > before  # a one-shot SnapKV would keep every decoded token
    live = int((cache.pages.layers[0].tier[0] != NONE).sum())
    assert live <= cache.num_pages(0) // 2 + 2  # the budget (half) plus the must-hot pages
