"""Smoke tests of eval/bench/hostcost.py: fields and finiteness, and that the kernel timer is pure
instrumentation (originals restored, calls counted). No timing assertions: speed goals live in
the benchmarks."""

from __future__ import annotations

import math

import pytest
import torch

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig
from tierattn.eval.bench.hostcost import (
    KERNEL_NAMES,
    KernelTimer,
    attend_host_overhead,
    reasoner_step_times,
)


def _originals(cache):
    return {n: getattr(cache.kernels, n) for n in KERNEL_NAMES}


def _cache(hot: float, layers: int = 2) -> TieredKVCache:
    cfg = TierConfig.preset("offload", hot_budget=hot, page_size=4, max_context=128,
                            backend="torch")
    cache = TieredKVCache(cfg, num_layers=layers, num_kv_heads=2, head_dim=8, device="cpu")
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        cache.update(layer, torch.randn(1, 2, 40, 8, generator=g),
                     torch.randn(1, 2, 40, 8, generator=g))
        cache.attend(layer, torch.randn(1, 4, 40, 8, generator=g))
    return cache


def test_kernel_timer_counts_calls_and_restores_originals():
    cache = _cache(hot=1.0)
    before = _originals(cache)
    k = torch.randn(1, 2, 1, 8)
    with KernelTimer(cache) as kt:
        assert cache.kernels.sparse_decode is not before["sparse_decode"]
        assert cache.engine.kernels is cache.kernels  # the copies go through the same object
        assert "attend" in vars(cache)
        for layer in range(2):
            cache.update(layer, k, k)
            out = cache.attend(layer, torch.randn(1, 4, 1, 8))
    assert out.shape == (1, 4, 1, 8) and torch.isfinite(out).all()
    assert _originals(cache) == before
    assert "attend" not in vars(cache) and "update" not in vars(cache)
    # everything hot: per layer one decode over the hot set and one launch that merges (one
    # state) and adds the page mass; nothing cold, so no copy; no page filled (41 tokens,
    # pages of 4), so no metadata
    assert kt.calls == {"sparse_decode": 2, "merge_page_mass": 2}
    assert len(kt.attend) == len(kt.update) == 2
    s = kt.summary()
    assert s["attend_calls"] == 2
    for key in ("attend_wall_us_median", "attend_kernel_us_median", "attend_host_us_median"):
        assert math.isfinite(s[key]) and s[key] > 0
    assert s["attend_kernel_us_mean"] <= s["attend_wall_us_mean"]


def test_kernel_timer_counts_copies_and_restores_after_an_error():
    cache = _cache(hot=0.5)
    before = _originals(cache)
    launches = cache.engine.launches
    k = torch.randn(1, 2, 1, 8)
    with pytest.raises(RuntimeError, match="boom"), KernelTimer(cache) as kt:
        for layer in range(2):
            cache.update(layer, k, k)
            cache.attend(layer, torch.randn(1, 4, 1, 8))
        raise RuntimeError("boom")
    assert _originals(cache) == before and "attend" not in vars(cache)
    # half cold: the hot set and the fetched pages are attended apart, then merged with their
    # page mass in one launch
    assert kt.calls["sparse_decode"] == 4 and kt.calls["merge_page_mass"] == 2
    # every page-copy launch of the engine (fetches and demotions) went through the wrapper
    assert kt.calls["copy_pages"] == cache.engine.launches - launches >= 1


def test_attend_host_overhead_fields():
    cache = _cache(hot=0.5)
    k = torch.randn(1, 2, 1, 8)

    def step(i):
        for layer in range(2):
            cache.update(layer, k, k)
            cache.attend(layer, torch.randn(1, 4, 1, 8))

    out = attend_host_overhead(cache, step, steps=3, warmup=1)
    assert out["steps"] == 3 and out["layers_per_step"] == 2
    assert out["attend_calls"] == 6 and out["update_calls"] == 6
    for key in ("attend_wall_us_mean", "attend_host_us_mean", "update_wall_us_mean",
                "step_wall_us_median"):
        assert math.isfinite(out[key]) and out[key] > 0
    assert 0 < out["attend_host_fraction"] <= 1


def test_reasoner_step_times_fields():
    out = reasoner_step_times(prompt_tokens=96, steps=2, repeats=1, progress=False)
    assert set(out["variants"]) == {"sdpa", "tiered_hot100", "tiered_hot50"}
    for v in out["variants"].values():
        for key in ("median_ms", "p10_ms", "p90_ms", "ratio_to_sdpa"):
            assert math.isfinite(v[key]) and v[key] > 0
        assert v["n"] == 2
    assert out["ratios"]["sdpa"] == 1.0
    assert out["variants"]["tiered_hot100"]["resident_fraction"]["hbm"] == 1.0
    assert out["variants"]["tiered_hot50"]["h2d_bytes_per_decode_step"] > 0
    assert out["config"]["prompt_tokens"] == 96 and out["config"]["steps"] == 2
    for name in ("tiered_hot100", "tiered_hot50"):
        assert out["host_breakdown"][name]["attend_calls"] == 2 * out["config"]["layers"]
