"""A decode step reads nothing back from the device, whatever the configuration.

The runtime runs on PyTorch's ``meta`` device -- tensors there have shapes but no data, so a host
read of device state (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, ``nonzero``, a boolean
mask, ``torch.equal``) cannot be served -- with the kernels replaced by stubs of the right shapes
(:func:`tierattn.eval.hostcost.stub_kernels`). ``HostReads`` records every such read with the
line that made it. The host map and the policies' decisions stay on the host; the importance the
policies rank by is copied back only through the transfer engine's asynchronous ``to_host``,
counted here: at most a few snapshots per page filled. On a GPU the same is checked with
``torch.cuda.set_sync_debug_mode("error")`` (the GPU check).
"""

from __future__ import annotations

import pytest
import torch

from tierattn.cache import TieredKVCache
from tierattn.config import TierConfig, TierSpec
from tierattn.eval.hostcost import HostReads, MetaEngine, stub_kernels

L, HKV, HQ, D, P, B = 3, 2, 8, 16, 8, 3

CONFIGS = {
    "dense": TierConfig.preset("dense"),
    "offload": TierConfig.preset("offload", hot_budget=0.5),
    "offload-ddr+cxl": TierConfig(hot_budget=0.3, tiers=(TierSpec("hbm"),
                                                         TierSpec("ddr", capacity_pages=9),
                                                         TierSpec("cxl"))),
    "offload-quest-rank": TierConfig.preset("offload", hot_budget=0.4, score="hybrid"),
    "topk": TierConfig.preset("topk"),
    "topk-sync": TierConfig.preset("topk", prefetch="none"),
    "topk-speculative": TierConfig.preset("topk", prefetch="speculative"),
    "topk-quest": TierConfig.preset("topk", recall_score="quest"),
    "topk-2bit": TierConfig.preset("topk", key_bits=2),
    "topk-max": TierConfig.preset("topk", sketch_reduce="max"),
    "evict-h2o": TierConfig.preset("evict-h2o"),
    "evict-snapkv": TierConfig.preset("evict-snapkv"),
    "evict-streaming": TierConfig.preset("evict-streaming"),
    "evict-snapkv-decode": TierConfig.preset("evict-snapkv-decode"),
    "evict-rkv": TierConfig.preset("evict-rkv"),
    "grid-h2o-offload": TierConfig(hot_budget=0.3, evict_budget=0.3, evict_policy="h2o"),
}


def _meta_cache(cfg: TierConfig) -> TieredKVCache:
    cfg = cfg.replace(page_size=P, max_context=256, prefill_chunk_size=64, backend="torch")
    return TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=B,
                         dtype=torch.bfloat16, device="meta", kernels=stub_kernels(),
                         engine=MetaEngine())


def _decode(cache: TieredKVCache, steps: int, window: int | None = None) -> None:
    kv = torch.zeros(B, HKV, 1, D, dtype=torch.bfloat16, device="meta")
    q = torch.zeros(B, HQ, 1, D, dtype=torch.bfloat16, device="meta")
    for _ in range(steps):
        for layer in range(L):
            cache.update(layer, kv, kv)
            cache.attend(layer, q, sliding_window=window if layer == 1 else None)


def _prefill(cache: TieredKVCache, tokens: int, window: int | None = None) -> None:
    for start in range(0, tokens, 64):
        t = min(64, tokens - start)
        kv = torch.zeros(B, HKV, t, D, dtype=torch.bfloat16, device="meta")
        for layer in range(L):
            cache.update(layer, kv, kv)
            cache.attend(layer, torch.zeros(B, HQ, t, D, dtype=torch.bfloat16, device="meta"),
                         sliding_window=window if layer == 1 else None)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", ["plain", "padded+freed"])
def test_decode_steps_read_nothing_back(name, shape):
    cache = _meta_cache(CONFIGS[name])
    if shape != "plain":
        cache.set_padding([0, 5, 11])
    _prefill(cache, 100)
    if shape != "plain":
        cache.free(2)
    before = cache.engine.to_host_calls
    snapshots = []
    take = cache.importance.snapshot
    cache.importance.snapshot = lambda *a, **k: (snapshots.append(a), take(*a, **k))
    steps = 6 * P  # six pages filled: new pages, demotions, evictions, recall all happen
    with HostReads() as reads:
        _decode(cache, steps)
    assert reads.count == 0, f"host reads during decode steps: {dict(reads.sites)}"
    # the decisions' inputs came back asynchronously: a few snapshots per page filled (a page
    # started, a sequence's eviction target moved) per layer, and nothing else came back but
    # their tensors (mass, SnapKV mass or Quest bound, decode-window mass, a policy's own)
    assert len(snapshots) <= 3 * L * (steps // P + 1)
    assert cache.engine.to_host_calls - before <= 4 * len(snapshots)
    assert all(c.decode_steps == steps for c in cache.telemetry.layers)


def test_sliding_window_layer_reads_nothing_back():
    cache = _meta_cache(TierConfig.preset("dense"))
    _prefill(cache, 40, window=24)
    with HostReads() as reads:
        _decode(cache, 3 * P, window=24)
    assert reads.count == 0, dict(reads.sites)


def test_the_detector_sees_a_host_read():
    # the test above can fail: a read of device state inside a step is caught and located
    cache = _meta_cache(TierConfig.preset("offload", hot_budget=0.5))
    _prefill(cache, 40)
    with HostReads() as reads:
        _decode(cache, 1)
        bool(cache.importance.mass.any())  # what the first version did every layer
    assert reads.count == 1 and "Tensor.__bool__" in next(iter(reads.sites))
