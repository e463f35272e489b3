"""Tiered KV runtime end to end: exactness of attend="all", every preset, telemetry consistent
with the budgets, capacity errors, configuration errors, save/restore."""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import Shadow, corrupt_pages, run_loop

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import PRESETS, TierConfig, TierSpec
from tierattn.errors import KernelInputError, KVCapacityError, KVFileError, TierConfigError

L, HKV, HQ, D = 3, 2, 4, 16


#: backend='triton' on the CPU-resident caches of this file runs only under the interpreter; on a
#: GPU machine test_cuda_engine_with_pinned_host_tiers_equals_dense covers the compiled path
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="backend='triton' on CPU tensors needs "
                                              "TRITON_INTERPRET=1")


def make(cfg, batch=2, dtype=torch.float32, **kw):
    return TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=batch,
                         dtype=dtype, device="cpu", poison_freed=True, **kw)


def exact_check(shadow, cache, tol):
    def check(layer, out, q):
        err = float((out.double() - shadow.attend(layer, q)).abs().max())
        assert err <= tol, f"layer {layer} len {cache.length(layer)}: |out - dense| = {err}"
        return err
    return check


TIER_SETS = {
    "ddr": (TierSpec("hbm"), TierSpec("ddr")),
    "ddr+cxl": (TierSpec("hbm"), TierSpec("ddr", capacity_pages=6), TierSpec("cxl")),
}


@pytest.mark.parametrize("tiers", list(TIER_SETS), ids=list(TIER_SETS))
@pytest.mark.parametrize("hot", [0.25, 0.5, 6], ids=["hot25%", "hot50%", "hot6tok"])
@pytest.mark.parametrize("prefetch", ["layer_ahead", "none"])
def test_attend_all_equals_dense_at_every_step(tiers, hot, prefetch, seed):
    cfg = TierConfig(page_size=4, hot_budget=hot, attend="all", prefetch=prefetch,
                     tiers=TIER_SETS[tiers], max_context=160, prefill_chunk_size=16,
                     backend="torch", sink_pages=1, recent_pages=1)
    cache, shadow = make(cfg, batch=3), Shadow(L, 3, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=37, steps=40, hq=HQ, gen=gen, chunk=16,
             check=exact_check(shadow, cache, 2e-5))
    total = cache.stats()["total"]
    assert total["demoted_pages"] > 0 and total["h2d_bytes_total"] > 0  # demotion every step
    assert total["evicted_tokens"] == 0
    for layer in range(L):  # offload never drops a token
        for b in range(3):
            pos, kv = cache.gather(layer, b)
            assert torch.equal(pos, torch.arange(cache.length(layer)))
            ref = torch.stack([shadow.k[layer][b], shadow.v[layer][b]]).permute(2, 0, 1, 3)
            assert torch.equal(kv, ref)


def test_page_size_one_demotes_every_step_and_stays_exact(seed):
    cfg = TierConfig(page_size=1, hot_budget=8, attend="all", tiers=TIER_SETS["ddr+cxl"],
                     max_context=96, prefill_chunk_size=16, backend="torch")
    cache, shadow = make(cfg, batch=2), Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    demoted = []

    def check(layer, out, q):
        demoted.append(cache.telemetry.layers[layer].demoted_pages)
        return exact_check(shadow, cache, 2e-5)(layer, out, q)
    run_loop(cache, shadow, prompt=20, steps=30, hq=HQ, gen=gen, chunk=10, check=check)
    per_step = [b - a for a, b in zip(demoted[::L][2:], demoted[::L][3:])]  # layer 0, decode
    assert per_step and all(n >= 1 for n in per_step)  # a page leaves HBM at every step


def test_left_padding_is_never_attended(seed):
    cfg = TierConfig(page_size=4, hot_budget=0.3, tiers=TIER_SETS["ddr"], max_context=96,
                     prefill_chunk_size=32, backend="torch")
    cache, shadow = make(cfg, batch=3), Shadow(L, 3, HKV, D, torch.float32)
    pad = [0, 6, 13]
    cache.set_padding(pad)
    keep_fn = lambda n: torch.arange(n)[None, :] >= torch.tensor(pad)[:, None]

    def check(layer, out, q):
        want = shadow.attend(layer, q, keep=keep_fn(cache.length(layer)))
        padded_query = torch.isnan(want)  # a query inside the padding sees no key at all
        assert (out.double()[padded_query] == 0).all()
        err = float((out.double() - want)[~padded_query].abs().max())
        assert err < 2e-5, err
        return err
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=30, steps=14, hq=HQ, gen=gen, chunk=15, check=check)
    assert cache.stats()["total"]["demoted_pages"] > 0
    with pytest.raises(KernelInputError, match="pad must list 3"):
        cache.set_padding([1, 2])


@pytest.mark.parametrize("name", ["evict-streaming", "evict-h2o", "offload"])
def test_left_padded_sequence_is_budgeted_like_its_unpadded_self(name, seed):
    # budgets count real tokens and the sink is the first real page, not padding (the reasoning
    # eval found padding pages taken as the sink and counted in the budgets): a sequence padded
    # by two pages ends with the same hot/live page counts as an unpadded run of its real length
    cfg = TierConfig.preset(name, page_size=4, hot_budget=0.5, max_context=96,
                            prefill_chunk_size=64, backend="torch")
    if cfg.evict_budget:
        cfg = cfg.replace(evict_budget=0.5)

    def pages(pad: list[int], prompt: int) -> list[tuple[list[int], list[int]]]:
        cache, shadow = make(cfg, batch=2), Shadow(L, 2, HKV, D, torch.float32)
        cache.set_padding(pad)
        run_loop(cache, shadow, prompt=prompt, steps=12, hq=HQ,
                 gen=torch.Generator().manual_seed(seed))
        n_pages = math.ceil(cache.length() / 4)
        out = []
        for layer in range(L):
            tier = cache.pages.layers[layer].tier[1, pad[1] // 4:n_pages]
            out.append(((tier == 0).nonzero().flatten().tolist(),
                        (tier >= 0).nonzero().flatten().tolist()))
        return out

    padded, unpadded = pages([0, 8], 40), pages([0, 0], 32)
    for (hot_p, live_p), (hot_u, live_u) in zip(padded, unpadded):
        assert 0 in hot_p  # the sink: its first real page
        assert (len(hot_p), len(live_p)) == (len(hot_u), len(live_u))
        if name == "evict-streaming":  # position-only policy: the very same pages
            assert (hot_p, live_p) == (hot_u, live_u)


def test_full_budget_keeps_every_page_of_a_misaligned_padded_sequence(seed):
    # 6 padding tokens put 40 real tokens across 12 pages of 4, one more than 40 / 4: a budget
    # of 1.0 must still hold them all (it dropped one before the hot budget counted lanes)
    cfg = TierConfig(page_size=4, hot_budget=1.0, tiers=(TierSpec("hbm"),), max_context=96,
                     prefill_chunk_size=64, backend="torch")
    cache, shadow = make(cfg, batch=2), Shadow(L, 2, HKV, D, torch.float32)
    cache.set_padding([0, 6])
    run_loop(cache, shadow, prompt=46, steps=3, hq=HQ, gen=torch.Generator().manual_seed(seed))
    for layer in range(L):
        assert bool((cache.pages.layers[layer].tier[:, :math.ceil(49 / 4)] >= 0).all())
    assert cache.stats()["total"]["evicted_tokens"] == 0


def test_disk_tier_exact_and_files_validated(tmp_path, seed):
    tiers = (TierSpec("hbm"), TierSpec("ddr", capacity_pages=4),
             TierSpec("disk", path=str(tmp_path)))
    cfg = TierConfig(page_size=4, hot_budget=0.3, tiers=tiers, max_context=128,
                     prefill_chunk_size=32, backend="torch")
    cache, shadow = make(cfg), Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=30, steps=12, hq=HQ, gen=gen,
             check=exact_check(shadow, cache, 2e-5))
    res = cache.stats()["total"]["resident_fraction"]
    assert res["disk"] > 0
    # one segment file, whatever the number of pages on disk
    assert [p.name for p in tmp_path.iterdir()] == [cache.tiers[2].path().name]
    assert corrupt_pages(cache.tiers[2]) > 0  # a flipped byte is caught on the next read
    with pytest.raises(KVFileError, match="checksum"):
        run_loop(cache, shadow, prompt=0, steps=1, hq=HQ, gen=gen)


@needs_interpreter
def test_triton_backend_under_interpreter_equals_dense(seed):
    cfg = TierConfig(page_size=4, hot_budget=0.5, tiers=TIER_SETS["ddr"], max_context=64,
                     prefill_chunk_size=16, backend="triton")
    cache, shadow = make(cfg, dtype=torch.bfloat16), Shadow(L, 2, HKV, D, torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    worst = run_loop(cache, shadow, prompt=13, steps=6, hq=HQ, gen=gen,
                     check=exact_check(shadow, cache, 3e-2))
    assert worst < 3e-2 and cache.stats()["total"]["demoted_pages"] > 0


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_every_preset_runs_and_reports_consistent_telemetry(name, backend, seed):
    cfg = TierConfig.preset(name, page_size=4, max_context=128, prefill_chunk_size=32,
                            backend=backend)
    cache, shadow = make(cfg, batch=2), Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    steps = 24 if backend == "torch" else 5
    run_loop(cache, shadow, prompt=48, steps=steps, hq=HQ, gen=gen, chunk=32)
    stats = cache.stats()
    total, n = stats["total"], cache.length()
    assert len(stats["layers"]) == L and total["attend_calls"] == L * (2 + steps)
    n_pages = math.ceil(n / 4)
    must = cfg.sink_pages + cfg.recent_pages + 1
    hot_pages = max(cfg.pages(cfg.hot_budget, n_pages, n), must)
    res = total["resident_fraction"]
    if cfg.evict_budget == 0:
        assert total["evicted_tokens"] == 0
        assert res["hbm"] == pytest.approx(min(1.0, hot_pages / n_pages), abs=1e-9)
        if name != "dense":
            assert total["h2d_bytes_total"] > 0 and total["demoted_pages"] > 0
    else:
        assert total["evicted_tokens"] > 0 and total["h2d_bytes_total"] == 0
        for layer in range(L):
            pos, _ = cache.gather(layer, 0)
            dropped = n - pos.numel()
            assert dropped == stats["layers"][layer]["evicted_tokens"] // 2  # per sequence
    if cfg.attend == "topk":
        assert total["late_misses"] + total["prefetch_hits"] > 0


def test_topk_recall_budget_bounds_traffic(seed):
    cfg = TierConfig.preset("topk", page_size=4, hot_budget=0.25, recall_budget=8,
                            max_context=256, prefill_chunk_size=64, backend="torch")
    cache, shadow = make(cfg, batch=1), Shadow(L, 1, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=128, steps=10, hq=HQ, gen=gen, chunk=64)
    per_layer_step = [l_["h2d_bytes_total"] for l_ in cache.stats()["layers"]]
    page_bytes = cache.page_bytes
    # a prefill chunk streams the cold pages through the small staging buffer twice (attention,
    # then the page mass under the merged LSE); a decode step attends at most 2 recalled pages
    # (8 tokens) and moves at most 4: the previous step's selection, prefetched, plus late misses
    layers = cache.stats()["layers"]
    assert all(b <= 2 * (128 // 4) * page_bytes + 10 * 4 * page_bytes for b in per_layer_step)
    assert all(0 < x["h2d_decode_bytes"] <= 10 * 4 * page_bytes for x in layers)
    assert all(x["prefetch_hits"] + x["late_misses"] <= 10 * 2 for x in layers)


def test_recall_follows_the_budget():
    """``recall_scope="cold"``: the recall is a share of the tokens outside the hot (and evict)
    budget, so it shrinks as the budget grows; never more than the sequence scope."""
    cfg = TierConfig.preset("topk", page_size=8, budget_rounding="down", recall_budget=0.25)
    assert cfg.recall_scope == "cold"
    seq = cfg.replace(recall_scope="sequence")
    for hot, want in ((0.1, 28), (0.25, 24), (0.5, 16), (0.75, 8)):  # 1024 tokens, 128 pages
        c = cfg.replace(hot_budget=hot)
        assert c.recall_pages(128, 1024) == want == int(0.25 * (1 - hot) * 1024) // 8
        assert c.recall_pages(128, 1024) <= seq.replace(hot_budget=hot).recall_pages(128, 1024)
    assert seq.recall_pages(128, 1024) == 32  # a share of the whole sequence
    # tokens are tokens whatever the scope; an evict budget leaves fewer cold tokens
    assert cfg.replace(recall_budget=40).recall_pages(128, 1024) == 5
    assert cfg.replace(hot_budget=0.25, evict_budget=0.25).recall_pages(128, 1024) == 16
    assert cfg.replace(hot_budget=100).recall_pages(128, 1000) == 28  # 900 cold tokens
    assert cfg.replace(hot_budget=1.0).recall_pages(128, 1024) == 0


def test_key_channels_round_to_whole_bytes():
    cfg = TierConfig.preset("topk")
    assert cfg.key_rank == 0.375 and cfg.key_channels(16) == 6 and cfg.key_channels(64) == 24
    assert cfg.key_channels(128) == 48 and cfg.key_channels(80) == 30
    assert cfg.replace(key_rank=1.0).key_channels(64) == 64
    assert cfg.replace(key_rank=24).key_channels(64) == 24  # a count of channels
    assert cfg.replace(key_rank=500).key_channels(64) == 64  # never more than the head
    # codes fill whole bytes: a multiple of 8 / key_bits channels, at least one byte's worth
    assert cfg.replace(key_bits=2, key_rank=0.3).key_channels(64) == 16
    assert cfg.replace(key_bits=2, key_rank=1).key_channels(64) == 4
    assert cfg.replace(key_bits=8, key_rank=0.1875).key_channels(16) == 3


def test_free_and_reorder_keep_kv_intact(seed):
    cfg = TierConfig(page_size=4, hot_budget=0.5, tiers=TIER_SETS["ddr"], max_context=96,
                     prefill_chunk_size=32, backend="torch")
    cache, shadow = make(cfg, batch=3), Shadow(L, 3, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=21, steps=5, hq=HQ, gen=gen)
    cache.reorder([2, 2, 0])
    for layer in range(L):
        shadow.k[layer] = shadow.k[layer][[2, 2, 0]]
        shadow.v[layer] = shadow.v[layer][[2, 2, 0]]
    run_loop(cache, shadow, prompt=0, steps=4, hq=HQ, gen=gen,
             check=exact_check(shadow, cache, 2e-5))
    used = [t.num_used(0) for t in cache.tiers]
    cache.free(1)
    assert [t.num_used(0) for t in cache.tiers] < used or sum(
        t.num_used(0) for t in cache.tiers) < sum(used)
    for layer in range(L):
        pos, kv = cache.gather(layer, 0)
        ref = torch.stack([shadow.k[layer][0], shadow.v[layer][0]]).permute(2, 0, 1, 3)
        assert torch.equal(kv, ref)


# --- capacity ----------------------------------------------------------------------------

def test_capacity_checked_at_construction_with_numbers():
    cfg = TierConfig(max_context=1 << 22, page_size=16, hot_budget=1.0, tiers=TIER_SETS["ddr"])
    with pytest.raises(KVCapacityError, match=r"GiB .*available"):
        TieredKVCache(cfg, num_layers=64, num_kv_heads=8, head_dim=128, batch_size=64,
                      dtype=torch.float32, device="cpu")


def test_capacity_check_collects_a_dropped_cache_before_refusing(monkeypatch):
    """A dropped cache caught in a reference cycle (here one its caller made) holds its pools
    until the cyclic collector runs: the check collects and measures again before refusing a
    new one."""
    import gc
    import weakref

    import tierattn.storage.tiers as tiers
    cfg = TierConfig(page_size=4, max_context=64, backend="torch")
    gc.disable()
    try:
        old = make(cfg, batch=1)
        old.caller_state = {"cache": old}
        dropped = weakref.ref(old)
        del old
        assert dropped() is not None  # only the collector can free it
        # the fault forced: the host has room only once the dropped cache is gone
        monkeypatch.setattr(tiers, "available_memory",
                            lambda device: 1 << 40 if dropped() is None else 0)
        make(cfg, batch=1)
        collected = dropped() is None  # before enabling: the collector may run then
    finally:
        gc.enable()
    assert collected
    monkeypatch.setattr(tiers, "available_memory", lambda device: 0)
    with pytest.raises(KVCapacityError, match="available"):  # still refused when it does not help
        make(cfg, batch=1)


def test_all_tiers_full_raises_and_leaves_state_untouched(seed):
    tiers = (TierSpec("hbm"), TierSpec("ddr", capacity_pages=2))
    cfg = TierConfig(page_size=4, hot_budget=0.25, tiers=tiers, max_context=128,
                     prefill_chunk_size=64, backend="torch")
    cache = make(cfg, batch=1)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, HKV, 40, D, generator=gen)
    cache.update(0, k, k)
    before = (cache.pages.layers[0].tier.clone(), cache.pages.layers[0].slot.clone(),
              [t.num_free(0) for t in cache.tiers])
    # the demotion after the attention cannot fit: rolled back and deferred to the next step
    cache.attend(0, torch.randn(1, HQ, 40, D, generator=gen))
    for _ in range(2):  # which raises, appending nothing, as long as the tiers stay full
        with pytest.raises(KVCapacityError, match="lower tiers have room for 2.*Nothing was "
                                                  "appended"):
            cache.update(0, k[:, :, :1], k[:, :, :1])
        assert cache.length(0) == 40
        assert torch.equal(cache.pages.layers[0].tier, before[0])
        assert torch.equal(cache.pages.layers[0].slot, before[1])
        assert [t.num_free(0) for t in cache.tiers] == before[2]


def test_context_and_chunk_limits_are_clear_errors():
    cfg = TierConfig(page_size=4, max_context=16, prefill_chunk_size=8, backend="torch")
    cache = make(cfg, batch=1)
    with pytest.raises(KernelInputError, match="prefill_chunk_size=8"):
        cache.update(0, torch.zeros(1, HKV, 9, D), torch.zeros(1, HKV, 9, D))
    cache.update(0, torch.zeros(1, HKV, 8, D), torch.zeros(1, HKV, 8, D))
    cache.update(0, torch.zeros(1, HKV, 8, D), torch.zeros(1, HKV, 8, D))
    with pytest.raises(KVCapacityError, match="max_context=16"):
        cache.update(0, torch.zeros(1, HKV, 1, D), torch.zeros(1, HKV, 1, D))
    with pytest.raises(KernelInputError, match=r"\[B, H_kv, T, D\]"):
        cache.update(0, torch.zeros(2, HKV, 1, D), torch.zeros(2, HKV, 1, D))


# --- configuration ------------------------------------------------------------------------

BAD_CONFIGS = [
    ("page_size", dict(page_size=0)),
    ("hot_budget", dict(hot_budget=1.5)),
    ("hot_budget", dict(hot_budget=-3)),
    ("hot_budget", dict(hot_budget="half")),
    ("evict_budget", dict(hot_budget=0.7, evict_budget=0.5)),
    ("attend", dict(attend="some")),
    ("score", dict(score="l2")),
    ("prefetch", dict(attend="all", prefetch="speculative")),
    ("tiers", dict(tiers=(TierSpec("ddr"),))),
    ("tiers", dict(tiers=(TierSpec("hbm"), TierSpec("disk", path="x"), TierSpec("ddr")))),
    ("tiers", dict(hot_budget=0.5, tiers=(TierSpec("hbm"),))),
    ("backend", dict(backend="cuda")),
    ("sink_pages", dict(sink_pages=-1)),
    ("max_context", dict(max_context=0)),
    ("key_rank", dict(key_rank=0.0)),
    ("key_rank", dict(key_rank=1.5)),
    ("key_rank", dict(key_rank=0)),
    ("key_rank", dict(key_rank=True)),
    ("key_rank", dict(key_rank="half")),
    ("recall_scope", dict(recall_scope="hot")),
]


@pytest.mark.parametrize("knob,kw", BAD_CONFIGS, ids=[f"{k}-{i}" for i, (k, _) in
                                                      enumerate(BAD_CONFIGS)])
def test_bad_config_names_the_knob(knob, kw):
    with pytest.raises(TierConfigError, match=f"^{knob}"):
        TierConfig(**kw)


def test_tier_spec_and_preset_errors():
    with pytest.raises(TierConfigError, match="path="):
        TierSpec("disk")
    with pytest.raises(TierConfigError, match="kind='nvme'"):
        TierSpec("nvme")
    with pytest.raises(TierConfigError, match="preset"):
        TierConfig.preset("fast")
    assert TierConfig.preset("offload", hot_budget=0.3).hot_budget == 0.3


# --- save and restore -----------------------------------------------------------------------

def test_save_and_load_round_trip(tmp_path, seed):
    cfg = TierConfig(page_size=4, hot_budget=0.5, tiers=TIER_SETS["ddr"], max_context=96,
                     prefill_chunk_size=32, backend="torch")
    cache, shadow = make(cfg), Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=22, steps=3, hq=HQ, gen=gen)
    path = cache.save(tmp_path)
    fresh = make(cfg)
    fresh.load(path)
    for layer in range(L):
        for b in range(2):
            assert all(torch.equal(x, y) for x, y in zip(cache.gather(layer, b),
                                                         fresh.gather(layer, b)))
        assert torch.equal(fresh.pages.layers[layer].tier, cache.pages.layers[layer].tier)
    # the restored cache keeps decoding exactly
    run_loop(fresh, shadow, prompt=0, steps=3, hq=HQ, gen=gen,
             check=exact_check(shadow, fresh, 2e-5))
    other = TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=2,
                          dtype=torch.float32, device="cpu", fingerprint="another-model")
    with pytest.raises(KVFileError, match="fingerprint"):
        other.load(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(KVFileError):
        make(cfg).load(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attend", ["all", "topk"])
def test_cuda_engine_with_pinned_host_tiers_equals_dense(attend, seed):
    """On a GPU: HBM pool and staging on CUDA, DDR/CXL pinned on the host and read by the copy
    kernel over UVA on the copy stream, compiled Triton kernels."""
    cfg = TierConfig(page_size=16, hot_budget=0.25, attend=attend, tiers=TIER_SETS["ddr+cxl"],
                     max_context=512, prefill_chunk_size=128, backend="auto", recall_budget=64)
    cache = TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=64, batch_size=2,
                          dtype=torch.bfloat16, device="cuda")
    assert type(cache.engine).__name__ == "CUDATransferEngine"
    assert all(t.pinned for t in cache.tiers[1:])
    shadow = Shadow(L, 2, HKV, 64, torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)

    def check(layer, out, q):
        if attend == "topk":
            return 0.0
        err = float((out.double().cpu() - shadow.attend(layer, q.cpu())).abs().max())
        assert err < 2e-2, err
        return err
    run_loop(cache, shadow, prompt=256, steps=32, hq=HQ, gen=gen, chunk=128, check=check)
    total = cache.stats()["total"]
    assert total["demoted_pages"] > 0 and total["h2d_bytes_total"] > 0
    if attend == "all":
        assert total["late_misses"] == 0
