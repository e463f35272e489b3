"""A decode step reads nothing back from the device, whatever the configuration.

The runtime runs on PyTorch's ``meta`` device -- tensors there have shapes but no data, so a host
read of device state (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, ``nonzero``, a boolean
mask, ``torch.equal``) cannot be served -- with the kernels replaced by stubs of the right shapes
(:func:`tierattn.eval.bench.hostcost.stub_kernels`). ``HostReads`` records every such read with the
line that made it. The host map and the policies' decisions stay on the host; the importance the
policies rank by is copied back only through the transfer engine's asynchronous ``to_host``,
counted here: at most a few snapshots per page filled. On a GPU the same is checked with
``torch.cuda.set_sync_debug_mode("error")`` (the GPU check).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig, TierSpec
from tierattn.eval.bench.hostcost import HostReads, MetaEngine, stub_kernels

L, HKV, HQ, D, P, B = 3, 2, 8, 16, 8, 3
#: a small DDR tier over a disk tier (its folder set per test)
DISK = (TierSpec("hbm"), TierSpec("ddr", capacity_pages=12), TierSpec("disk", path="?"))

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
    # attend="auto" with every layer recalling (a fast link, a slow host, any concentration
    # enough): the choice reads its estimate through the engine's to_host, a step later
    "adaptive-recall": TierConfig.preset("adaptive", link_bandwidth=1e12, host_bandwidth=1e3,
                                         adapt_mass=0.0, adapt_every=4),
    "evict-h2o": TierConfig.preset("evict-h2o"),
    "evict-snapkv": TierConfig.preset("evict-snapkv"),
    "evict-streaming": TierConfig.preset("evict-streaming"),
    "evict-snapkv-decode": TierConfig.preset("evict-snapkv-decode"),
    "evict-rkv": TierConfig.preset("evict-rkv"),
    "grid-h2o-offload": TierConfig(hot_budget=0.3, evict_budget=0.3, evict_policy="h2o"),
    # pages on disk (DDR too small for the cold pages): read into host staging off the step
    "offload-disk": TierConfig.preset("offload", hot_budget=0.3, tiers=DISK),
    "offload-disk-sync": TierConfig.preset("offload", hot_budget=0.3, tiers=DISK,
                                           prefetch="none"),
    "topk-disk": TierConfig.preset("topk", tiers=DISK),  # misses read: one selection back
    "topk-disk-sync": TierConfig.preset("topk", tiers=DISK, prefetch="none"),
    "topk-disk-defer": TierConfig.preset("topk", tiers=DISK, disk_misses="defer"),
    "topk-disk-defer-sync": TierConfig.preset("topk", tiers=DISK, disk_misses="defer",
                                              prefetch="none"),
    "topk-quest-disk": TierConfig.preset("topk", tiers=DISK, recall_score="quest",
                                         disk_misses="defer"),
    "grid-h2o-offload-disk": TierConfig(hot_budget=0.3, evict_budget=0.3, evict_policy="h2o",
                                        tiers=DISK),
}


def _meta_cache(cfg: TierConfig, folder=None) -> TieredKVCache:
    cfg = cfg.replace(page_size=P, max_context=256, prefill_chunk_size=64, backend="torch")
    if any(t.kind == "disk" for t in cfg.tiers):
        cfg = cfg.replace(tiers=tuple(dataclasses.replace(t, path=str(folder))
                                      if t.kind == "disk" else t for t in cfg.tiers))
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
def test_decode_steps_read_nothing_back(name, shape, tmp_path):
    cache = _meta_cache(CONFIGS[name], tmp_path)
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
    disk = [t for t in cache.tiers if t.kind == "disk"]
    # with a disk tier also: a spill's pages (one copy per demotion to disk) and, for recall,
    # each step's selection (one copy per layer and step: the next step stages its disk pages)
    tel = cache.telemetry.layers
    spills = sum(c.demoted_pages for c in tel) if disk else 0
    recall_disk = bool(disk) and cache.config.attend == "topk"
    # (with "read" the synchronous copy is the note as well: one copy per layer and step)
    notes = steps * L if recall_disk and cache.config.disk_misses == "defer" else 0
    # disk_misses="read" brings each selection with disk pages back synchronously (counted):
    # the one device read a step may make, and only then; "defer" makes none
    sync = sum(c.disk_selection_reads for c in tel)
    if recall_disk and cache.config.disk_misses == "read":
        assert 0 < sync <= steps * L
    else:
        assert sync == 0
    # attend="auto": one estimate per layer every adapt_every steps
    estimates = steps // cache.config.adapt_every * L if cache.config.attend == "auto" else 0
    assert cache.engine.to_host_calls - before <= 4 * len(snapshots) + spills + notes + sync + \
        estimates
    if cache.config.attend == "auto":
        assert cache.planner.modes == ["recall"] * L
        assert all(c.recall_steps > 0 and c.split_steps == 0 for c in tel)
    assert all(c.decode_steps == steps for c in tel)
    if disk:
        assert disk[0].num_used(0) > 0
        if cache.config.attend == "all":  # (recall's selections are not data on meta)
            assert sum(c.disk_staged_pages + c.disk_sync_pages for c in tel) > 0


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
