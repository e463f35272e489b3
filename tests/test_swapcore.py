"""The swap core without any engine: the store keeps a request's slots bytewise across tiers
(spilling, all or nothing, faults rolled back), the cost model fits what it is shown, and the
swapper decides, falls back to recompute and logs every decision."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from helpers import corrupt_pages, disk_segments, fail_disk_reads, fail_disk_writes, holds_nothing

from tierattn.config import TierConfig, TierSpec
from tierattn.serving.costmodel import CostModel, LinearFit, attention_work, prefill_work
from tierattn.errors import KVCapacityError, KVFileError, KVIOError, TierConfigError
from tierattn.serving import swaptiers
from tierattn.storage import tiers
from tierattn.serving.swapcore import SwapConfig, Swapper, SwapStore

ENOSPC = OSError(errno.ENOSPC, "No space left on device")
EIO = OSError(errno.EIO, "Input/output error")


def make_pool(device, n: int = 12, t: int = 4, h: int = 2, d: int = 8,
              seed: int = 0) -> torch.Tensor:
    """An engine's KV cache as swap slots (on the GPU when there is one: the DDR tier is then
    pinned and copies run on the transfer engine's stream)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, t, h, d, generator=g).to(device)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().contiguous().view(torch.uint8)


def noop(*_):
    pass


def disk(tmp_path, cap=None) -> TierSpec:
    return TierSpec("disk", path=str(tmp_path / "kv"), capacity_pages=cap)


# --- configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, knob", [
    ({"tiers": ("hbm",)}, "SwapConfig.tiers"),
    ({"tiers": (TierSpec("disk", path="kv"), "ddr")}, "SwapConfig.tiers"),
    ({"tiers": ("ddr", "ddr")}, "SwapConfig.tiers"),
    ({"tiers": ()}, "SwapConfig.tiers"),
    ({"tiers": "ddr"}, "SwapConfig.tiers"),
    ({"tiers": (3,)}, "SwapConfig.tiers"),
    ({"policy": "always"}, "SwapConfig.policy"),
    ({"probe_slots": 0}, "SwapConfig.probe_slots"),
    ({"probe_slots": True}, "SwapConfig.probe_slots"),
    ({"backend": "cuda"}, "SwapConfig.backend"),
    ({"calibration": "/no/such/file.json"}, "SwapConfig.calibration"),
], ids=lambda v: str(v))
def test_bad_swap_config_names_the_knob(kw, knob):
    with pytest.raises(TierConfigError, match=knob.replace(".", r"\.")):
        SwapConfig(**kw)


def test_tier_capacity_in_gib():
    assert TierSpec("ddr", capacity_gib=1).capacity(2**20, num_layers=4) == 256
    assert TierSpec("ddr", capacity_pages=7).capacity(123) == 7
    assert TierSpec("ddr").capacity(123) is None
    for bad in (-1, float("inf"), "1", True):
        with pytest.raises(TierConfigError, match="capacity_gib"):
            TierSpec("ddr", capacity_gib=bad)
    with pytest.raises(TierConfigError, match="give one of them"):
        TierSpec("ddr", capacity_pages=1, capacity_gib=1.0)


def test_the_runtime_sizes_a_tier_from_gib():
    from tierattn.runtime.cache import TieredKVCache

    page_bytes = 2 * 16 * 2 * 8 * 4  # [2, P=16, H=2, D=8] fp32
    gib = 3 * 5 * page_bytes / 2**30  # 5 pages per layer over 3 layers
    cfg = TierConfig(hot_budget=0.5, tiers=(TierSpec("hbm"), TierSpec("ddr", capacity_gib=gib)),
                     max_context=128)
    cache = TieredKVCache(cfg, num_layers=3, num_kv_heads=2, head_dim=8, batch_size=1,
                          dtype=torch.float32)
    assert cache.tiers[1].capacity == 5


# --- the store ----------------------------------------------------------------------------------

def test_store_and_load_are_bitwise_and_spill_to_disk(device, tmp_path):
    pool = make_pool(device)
    cfg = SwapConfig(tiers=(TierSpec("ddr", capacity_pages=3), disk(tmp_path)))
    store = SwapStore(cfg, pool)
    want = pool[[1, 4, 7, 9, 10]].clone()
    seen = []
    placed = store.store("a", [1, 4, 7, 9, 10], lambda *a: seen.append(a))
    store.watch.poll(wait=True)  # CUDA: the timings arrive when the copies have
    assert placed == [("ddr", 3 * store.slot_bytes), ("disk", 2 * store.slot_bytes)]
    assert {(k, d) for k, d, _, _ in seen} == {("ddr", "store"), ("disk", "store")}
    assert store.free_slots()["ddr"] == 0 and "a" in store
    pool[[1, 4, 7, 9, 10]] = float("nan")  # the engine reuses the freed blocks
    store.load("a", [0, 2, 3, 5, 6], noop)
    assert torch.equal(bits(pool[[0, 2, 3, 5, 6]]), bits(want))
    assert "a" not in store and store.free_slots()["ddr"] == 3
    assert holds_nothing(store.tiers[2], tmp_path / "kv")  # the disk slots are released


def test_load_skips_slots_the_engine_did_not_reallocate(device):
    pool = make_pool(device)
    store = SwapStore(SwapConfig(), pool)
    want = pool[[2, 3, 5]].clone()
    store.store("a", [2, 3, 5], noop)
    before = pool.clone()
    store.load("a", [8, -1, 9], noop)
    assert torch.equal(bits(pool[8]), bits(want[0])) and torch.equal(bits(pool[9]),
                                                                      bits(want[2]))
    untouched = [i for i in range(12) if i not in (8, 9)]
    assert torch.equal(bits(pool[untouched]), bits(before[untouched]))


def test_default_capacities_follow_one_rule(tmp_path):
    """Host tiers: up to HOST_SHARE of the host's memory over the workers (pinned ones, which
    are reserved when built: RESERVED_POOLS KV pools); disk: RESERVED_POOLS KV pools, at most
    90% of the folder's free space; a set capacity wins."""
    slot = 4096
    host = int(swaptiers.HOST_SHARE * swaptiers.host_memory())
    caps = swaptiers.swap_capacities((TierSpec("ddr"), TierSpec("cxl")), slot, 10)
    assert caps == [host // slot] * 2 and caps[0] > 1000 * 10  # far more than a KV pool
    assert swaptiers.swap_capacities((TierSpec("ddr"),), slot, 10, workers=4) == \
        [host // (4 * slot)]
    assert swaptiers.swap_capacities((TierSpec("ddr"),), slot, 10, pinned=True) == \
        [swaptiers.RESERVED_POOLS * 10]
    assert swaptiers.swap_capacities((disk(tmp_path, cap=4),), slot, 10) == [4]  # a set one
    assert swaptiers.swap_capacities((TierSpec("disk", path=str(tmp_path)),), slot, 10) == \
        [swaptiers.RESERVED_POOLS * 10]
    with pytest.raises(TierConfigError, match="capacity_gib"):
        swaptiers.swap_capacities((TierSpec("ddr", capacity_gib=1e-9),), slot, 10)


def test_host_tiers_reserve_nothing_up_front_and_grow_as_slots_are_used(device):
    store = SwapStore(SwapConfig(), make_pool(device))
    ddr = store.tiers[1]
    assert ddr.capacity > 100 * store.pool.shape[0]
    if device.type == "cuda":  # pinned: reserved whole when built
        pytest.skip("a pinned tier is allocated when built")
    assert store.swap.held_bytes() == {"ddr": 0}
    store.store("a", [0, 1, 2], noop)
    held = store.swap.held_bytes()["ddr"]
    assert 3 * store.slot_bytes <= held <= 4 * store.slot_bytes
    store.load("a", [5, 6, 7], noop)
    store.store("b", [0, 1, 2], noop)  # the released slots are used again: no growth
    assert store.swap.held_bytes()["ddr"] == held
    store.close()
    store.close()  # a second close (the handle's undo, then the engine's end) does nothing
    assert store.pool is None and store.swap is None


def test_a_tier_that_cannot_grow_turns_the_swap_into_a_recompute(device, monkeypatch):
    if device.type == "cuda":
        pytest.skip("a pinned tier is allocated when built")
    sw = Swapper(SwapConfig(policy="swap"))
    sw.attach(SwapStore(SwapConfig(policy="swap"), make_pool(device)))
    free = sw.store.free_slots()
    monkeypatch.setattr(tiers, "memory_for", lambda need, dev: need)  # the host is out of RAM
    d = sw.preempt("a", [0, 1], tokens=8, recompute_tokens=8, blocks=2)
    assert (d.action, d.reason.split(":")[0]) == ("recompute", "tiers full")
    assert "host" in d.reason and "capacity_gib" in d.reason  # the hint names the setting
    assert sw.store.free_slots() == free and "a" not in sw.store  # nothing taken
    assert sw.stats()["tiers_full"] == 1 and sw.stats()["reserved_bytes"] == {"ddr": 0}
    assert sw.stats()["peak_reserved_bytes"] == {"ddr": 0}


def test_a_tier_of_a_billion_slots_costs_no_slot_list_nor_memory():
    t = tiers.MemoryTier("ddr", 1, 10**9, (2, 1, 1, 1), torch.float32, torch.device("cpu"),
                         grow=True)  # 8 GB of address space
    assert t.held_bytes() == 0 and t._released == [[]]  # no list of its slots
    assert t.num_free(0) == 10**9 and t.alloc(0, 3) == [0, 1, 2]
    t.release(0, [1])
    assert t.alloc(0, 2) == [1, 3] and t.num_used(0) == 4
    assert 4 * t.page_bytes <= t.held_bytes() < 10 * t.page_bytes


def test_a_full_hierarchy_refuses_and_changes_nothing(device, tmp_path):
    store = SwapStore(SwapConfig(tiers=(TierSpec("ddr", capacity_pages=2),
                                        disk(tmp_path, cap=1))), make_pool(device))
    store.store("a", [0, 1], noop)
    free = store.free_slots()
    assert store.plan(2) is None and store.placement(1) == [("disk", store.slot_bytes)]
    with pytest.raises(KVCapacityError, match="full"):
        store.store("b", [2, 3], noop)
    assert store.free_slots() == free and "b" not in store


@pytest.mark.parametrize("exc, gap", [(ENOSPC, False), (EIO, False), (ENOSPC, True)],
                         ids=["ENOSPC", "EIO", "ENOSPC-second-run"])
def test_a_disk_fault_while_storing_rolls_back(device, tmp_path, monkeypatch, exc, gap):
    """A batch of three disk pages fails after part of it landed (in its first run of
    adjacent slots, or with ``gap`` in its second run, the first one written whole)."""
    pool = make_pool(device)
    store = SwapStore(SwapConfig(tiers=(TierSpec("ddr", capacity_pages=1), disk(tmp_path))),
                      pool)
    if gap:  # "y" keeps disk slot 1: the next store gets slots 0, 2, 3 -- two runs
        store.store("x", [5, 6], noop)
        store.store("y", [7], noop)
        store.discard("x")
    fail_disk_writes(monkeypatch, exc, after=int(gap))
    before = bits(pool).clone()
    with pytest.raises(KVIOError):
        store.store("a", [0, 1, 2, 3], noop)
    assert "a" not in store
    if gap:
        assert store.free_slots() == {"ddr": 1, "disk": store.tiers[2].capacity - 1}
        assert (store.tiers[2].segment().starts[0] >= 0).tolist().count(True) == 1
        store.discard("y")
    assert store.free_slots() == {"ddr": 1, "disk": store.tiers[2].capacity}
    assert holds_nothing(store.tiers[2], tmp_path / "kv")
    assert torch.equal(bits(pool), before)


@pytest.mark.parametrize("fault", ["EIO", "corrupted", "missing"])
def test_a_bad_read_releases_everything_and_raises(device, tmp_path, monkeypatch, fault):
    store = SwapStore(SwapConfig(tiers=(disk(tmp_path),)), make_pool(device))
    store.store("a", [0, 1], noop)
    (segment,) = disk_segments(tmp_path / "kv")  # one file, whatever the number of pages
    if fault == "EIO":
        fail_disk_reads(monkeypatch, EIO)
    elif fault == "corrupted":
        assert corrupt_pages(store.tiers[1]) == 2
    else:
        segment.unlink()
    with pytest.raises((KVIOError, KVFileError)):
        store.load("a", [5, 6], noop)
    assert "a" not in store and store.free_slots() == {"disk": store.tiers[1].capacity}
    if fault != "missing":
        assert holds_nothing(store.tiers[1], tmp_path / "kv")
    store.close()
    assert not any((tmp_path / "kv").iterdir())


def test_calibration_probes_leave_the_pool_and_tiers_as_they_were(device, tmp_path):
    pool = make_pool(device)
    store = SwapStore(SwapConfig(tiers=("ddr", disk(tmp_path))), pool)
    before = bits(pool).clone()
    costs = CostModel(store.kinds)
    store.calibrate(costs, probe_slots=3, repeats=2)
    assert torch.equal(bits(pool), before)
    assert store.free_slots() == {"ddr": store.tiers[1].capacity,
                                  "disk": store.tiers[2].capacity}
    for kind in ("ddr", "disk"):
        for d in ("store", "load"):
            assert costs.links[(kind, d)].count == 4  # sizes 1 and 3, twice each
            assert costs.transfer_s(kind, d, store.slot_bytes) > 0
    assert holds_nothing(store.tiers[2], tmp_path / "kv")


# --- the cost model ------------------------------------------------------------------------------

def test_linear_fit_recovers_its_coefficients():
    fit = LinearFit(("latency_s", "seconds_per_byte"), keep=1)
    for n in (1e3, 1e4, 1e5, 1e6):
        fit.add((1.0, n), 2e-4 + 5e-9 * n)
    lat, spb = fit.coef()
    assert lat == pytest.approx(2e-4, rel=1e-6) and spb == pytest.approx(5e-9, rel=1e-6)


def test_linear_fit_never_predicts_a_free_transfer():
    fit = LinearFit(("latency_s", "seconds_per_byte"), keep=1)
    fit.add((1.0, 100.0), 1.0)  # one size only: the mean rate
    assert fit.coef() == (0.0, 0.01)
    fit = LinearFit(("latency_s", "seconds_per_byte"), keep=1)
    for n, t in ((100, 1.0), (200, 0.9)):  # bigger is faster: no negative slope
        fit.add((1.0, float(n)), t)
    lat, spb = fit.coef()
    assert spb > 0 and lat >= 0
    assert LinearFit(("a", "b"), keep=1).coef() is None
    assert LinearFit(("a", "b"), keep=1, prior=(1.0, 2.0)).predict((1.0, 3.0)) == 7.0


def test_prefill_fit_prices_a_recompute_by_tokens_kv_and_attention():
    costs = CostModel(["ddr"])
    a, b, c, d = 3e-3, 2e-5, 6e-7, 4e-9
    for q, past, n in ((16, 0, 1), (64, 100, 1), (256, 0, 2), (8, 900, 8), (128, 512, 3),
                       (300, 40, 2), (4, 4000, 4)):
        w = attention_work(q, past)
        costs.observe_batch(q, past + q, w, a + b * q + c * (past + q) + d * w,
                            decode=q == n)
    # 1000 tokens in chunks of 400: 400 + 400 + 200 queries over 400, 800, 1000 held KV
    pairs = attention_work(400, 0) + attention_work(400, 400) + attention_work(200, 800)
    assert costs.recompute_s(1000, 400) == pytest.approx(
        b * 1000 + c * (400 + 800 + 1000) + d * pairs, rel=1e-6)
    assert prefill_work(1000, 400) == (1000, 2200, pairs)
    assert prefill_work(1000) == (1000, 1000, attention_work(1000, 0))
    assert costs.batch_s() == pytest.approx(a, rel=1e-6)
    assert costs.marginal_s(10, 5) == pytest.approx(
        b * 10 + c * 15 + d * attention_work(10, 5), rel=1e-6)


def test_a_long_decode_phase_keeps_the_prefill_batches():
    costs = CostModel(["ddr"], window=8)
    for q in (100, 200, 400, 800):
        costs.observe_batch(q, q, attention_work(q, 0), 1e-3 * q)
    for past in range(100):  # many decode steps after
        costs.observe_batch(4, 4 * (past + 1), 4 * (past + 1), 0.01 + 4e-3, decode=True)
    assert costs.prefill.count == 12
    assert costs.recompute_s(1000) == pytest.approx(1.0, rel=0.05)


def test_calibration_file_round_trip_and_bad_files(tmp_path):
    costs = CostModel(["ddr", "disk"])
    for n in (1e3, 1e6):
        costs.observe_transfer("ddr", "store", n, 1e-5 + n * 1e-10)
        costs.observe_transfer("ddr", "load", n, 2e-5 + n * 2e-10)
    path = tmp_path / "cal.json"
    costs.save(path)
    other = CostModel(["ddr", "disk"])
    other.load(path)
    assert other.transfer_s("ddr", "load", 1e6) == pytest.approx(2e-5 + 1e-6 * 2e2, rel=1e-6)
    assert other.transfer_s("disk", "load", 1e6) is None  # the file has no disk entry
    assert other.calibrated_from == str(path)
    bad = tmp_path / "bad.json"
    for text in ("{", json.dumps({"format": "x"}), json.dumps(
            {"format": "tierattn-swap-calibration", "links": {"ddr": {"store": {"latency_s": 1}}}}),
                 json.dumps({"format": "tierattn-swap-calibration", "links": {"ddr": {"load": {
                     "latency_s": 0, "seconds_per_byte": 0}}}})):
        bad.write_text(text)
        with pytest.raises(TierConfigError, match="calibration"):
            CostModel(["ddr"]).load(bad)


# --- the decisions -----------------------------------------------------------------------------

def primed(config: SwapConfig, pool: torch.Tensor, *, store_s: float, prefill_token_s: float):
    """A swapper over ``pool`` whose costs say: a slot costs ``store_s`` each way, a token
    ``prefill_token_s`` to prefill."""
    sw = Swapper(config)
    sw.attach(SwapStore(config, pool))
    slot = pool[0].numel() * pool.element_size()
    for kind in sw.costs.kinds:
        for d in ("store", "load"):
            fit = sw.costs.links[(kind, d)]
            fit.clear()
            fit.prior = (0.0, store_s / slot)
    for q in (10, 20, 40):
        sw.costs.observe_batch(q, 0, 0.0, q * prefill_token_s)
    return sw


@pytest.mark.parametrize("policy, token_s, action, reason", [
    ("auto", 1e-3, "swap", "swap cheaper"),      # 4 slots x 2 x 1 ms < 20 tokens x 1 ms
    ("auto", 1e-4, "recompute", "recompute cheaper"),
    ("swap", 1e-4, "swap", "policy"),
    ("recompute", 1e-3, "recompute", "policy"),
])
def test_the_policy_picks_the_cheaper_or_the_one_asked(device, policy, token_s, action, reason):
    pool = make_pool(device)
    sw = primed(SwapConfig(policy=policy, calibration=None), pool,
                store_s=1e-3, prefill_token_s=token_s)
    d = sw.preempt("a", [0, 1, 2, 3], tokens=16, recompute_tokens=20, blocks=4)
    assert (d.action, d.reason) == (action, reason)
    assert d.predicted_swap_s == pytest.approx(8e-3)
    assert d.predicted_recompute_s == pytest.approx(20 * token_s)
    assert ("a" in sw.store) == (action == "swap")
    st = sw.stats()
    assert st["swapped_out"] == (action == "swap") and st["decisions"][0]["action"] == action


def test_a_store_fault_or_full_tiers_become_recomputes(device, tmp_path, monkeypatch):
    pool = make_pool(device)
    cfg = SwapConfig(tiers=(TierSpec("ddr", capacity_pages=2), disk(tmp_path)), policy="swap")
    sw = Swapper(cfg)
    sw.attach(SwapStore(cfg, pool))
    fail_disk_writes(monkeypatch, ENOSPC)
    d = sw.preempt("a", [0, 1, 2], tokens=12, recompute_tokens=12, blocks=3)
    assert d.action == "recompute" and d.reason.startswith("store fault")
    monkeypatch.undo()
    full = Swapper(SwapConfig(tiers=(TierSpec("ddr", capacity_pages=1),), policy="swap"))
    full.attach(SwapStore(full.config, pool))
    d2 = full.preempt("b", [0, 1], tokens=8, recompute_tokens=8, blocks=2)
    assert (d2.action, d2.reason) == ("recompute", "tiers full")
    assert sw.stats()["faults"] == {"store": 1, "load": 0} and full.stats()["tiers_full"] == 1
    assert sw.stats()["held_bytes"] == {"ddr": 0, "disk": 0}


def test_resume_loads_or_reports_a_load_fault(device, tmp_path, monkeypatch):
    pool = make_pool(device)
    cfg = SwapConfig(tiers=(disk(tmp_path),), policy="swap")
    sw = Swapper(cfg)
    sw.attach(SwapStore(cfg, pool))
    want = pool[[0, 1]].clone()
    sw.preempt("a", [0, 1], tokens=8, recompute_tokens=8, blocks=2)
    sw.preempt("b", [2, 3], tokens=8, recompute_tokens=8, blocks=2)
    assert sw.resume("a", [6, 7])
    assert torch.equal(bits(pool[[6, 7]]), bits(want))
    fail_disk_reads(monkeypatch, EIO)
    assert not sw.resume("b", [8, 9])
    st = sw.stats()
    assert (st["swapped_in"], st["faults"]["load"], st["recomputed_requests"]) == (1, 1, 1)
    assert st["bytes"]["disk"] == {"stored": 4 * sw.store.slot_bytes,
                                   "loaded": 2 * sw.store.slot_bytes}
    assert "load fault" in st["decisions"][1]["reason"]
    a = st["decisions"][0]
    assert a["measured_store_s"] > 0 and a["measured_load_s"] > 0
    assert a["measured_s"] == a["measured_store_s"] + a["measured_load_s"]


def test_a_recompute_is_charged_its_share_of_the_batches(device):
    pool = make_pool(device)
    sw = primed(SwapConfig(policy="recompute"), pool, store_s=1e-3,
                prefill_token_s=1e-3)
    d = sw.preempt("a", [0], tokens=4, recompute_tokens=30, blocks=1)
    sw.begin_recompute("a", d)
    # two batches re-prefill "a" (20 then 10 tokens) beside a decode of "x"
    sw.observe_batch([("a", 20, 0, False), ("x", 1, 50, False)], 0.021)
    sw.observe_batch([("a", 10, 20, True), ("x", 1, 51, False)], 0.011)
    sw.observe_batch([("a", 1, 30, False)], 0.001)  # decoding: no longer charged
    assert d.measured_recompute_s == pytest.approx(0.020 + 0.010, rel=1e-6)
    st = sw.stats()
    assert st["recomputed_tokens"] == 30
    assert st["cost_check"]["recompute"]["measured_over_predicted"] == pytest.approx(1.0,
                                                                                     rel=1e-6)
