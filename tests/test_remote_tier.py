"""The remote tier (``TierSpec("remote")``, :class:`tierattn.storage.tiers.RemoteTier`) against a
real Mooncake Store started here on 127.0.0.1: pages round-trip byte-equal in any dtype and any
rows, every read is checked (page map, length, checksum), released pages leave the store, and a
:class:`~tierattn.runtime.cache.TieredKVCache` with the store below its host tier attends exactly
what the full cache does; a dead store is a typed error within one deadline and loses nothing
that was not in it."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import Shadow, run_loop
from mooncake_helpers import Master, mooncake_importable

from tierattn.config import RemoteConfig, TierConfig, TierSpec
from tierattn.errors import KVFileError, KVIOError, TierConfigError
from tierattn.runtime.cache import TieredKVCache
from tierattn.storage.remote import HEADER, RemoteStoreError
from tierattn.storage.tiers import RemoteTier

pytestmark = pytest.mark.skipif(
    not mooncake_importable(), reason="needs mooncake-transfer-engine-non-cuda (the [remote] "
    "extra) and libibverbs1; .ci/run installs both")

L, HKV, HQ, D = 2, 2, 4, 8


@pytest.fixture
def master(tmp_path):
    """A master and a pool of 64 MiB: the store's memory, which no tier client lends (a
    client that closes takes the values placed in its own segment with it)."""
    m = Master(tmp_path / "master.log", pool_mib=64)
    yield m
    m.stop()


def tier(master, *, shape=(2, 4, HKV, D), dtype=torch.float32, capacity=16, **kw):
    return RemoteTier(L, capacity, shape, dtype, master.config(segment_gib=0.0, **kw), "fp")


def in_store(t: RemoteTier) -> list[bool]:
    """Whether each key the tier ever wrote in generation 0 is in the store."""
    idx = t._keys.indices[t.generation]
    keys = [t._keys.key(t.generation, ly, s, w) for ly in range(L) for s in range(t.capacity)
            for w in range(1, int(idx.writes[ly, s]) + 1)]
    return t.store.contains(keys)


def test_a_remote_tier_needs_its_store_and_only_it_takes_one():
    rc = RemoteConfig(master="127.0.0.1:1", metadata="http://127.0.0.1:2/metadata")
    with pytest.raises(TierConfigError, match="remote=RemoteConfig"):
        TierSpec("remote")
    with pytest.raises(TierConfigError, match="TierSpec\\('remote', remote="):
        TierSpec("disk", path="/tmp/x", remote=rc)
    with pytest.raises(TierConfigError, match="fast to slow"):
        TierConfig(tiers=(TierSpec("hbm"), TierSpec("remote", remote=rc), TierSpec("ddr")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip_into_any_rows_and_every_read_is_checked(master, dtype, seed):
    t = tier(master, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    slots = t.alloc(1, 5)
    data = torch.randn(5, *t.page_shape, generator=gen).to(dtype)
    t.write(1, slots, data, [4 * s for s in slots])
    out = torch.zeros(8, *t.page_shape, dtype=dtype)
    rows = [7, 0, 3, 5, 1]
    t.read_async(1, slots, [4 * s for s in slots], out, rows).result()
    assert torch.equal(out[rows], data) and not out[[2, 4, 6]].any()
    starts, writes = t.held(1, slots)
    assert starts.tolist() == [4 * s for s in slots] and writes.tolist() == [1] * 5
    with pytest.raises(KVFileError, match="not of token"):  # the page map disagrees
        t.read(1, slots[:1], [99])
    with pytest.raises(KVFileError, match="not of token"):  # layer 0 holds nothing there
        t.read(0, slots[:1], [4 * slots[0]])
    t.write(1, slots[:2], data[2:4], [4 * s for s in slots[:2]])  # a rewrite: new keys
    assert torch.equal(t.read(1, slots[:2], [4 * s for s in slots[:2]]), data[2:4])
    assert in_store(t).count(True) == 5  # the first values of the two slots were removed
    t.release(1, slots)
    assert not any(in_store(t))  # released pages leave the store
    t.close()


def test_a_value_that_fails_its_checksum_is_refused_and_removed(master, seed):
    t = tier(master)
    data = torch.randn(2, *t.page_shape, generator=torch.Generator().manual_seed(seed))
    t.write(0, [0, 1], data, [0, 4])
    key = t._keys.key(0, 0, 1, 1)
    value = bytearray(t.store._client.get(key))
    value[HEADER.size + 7] ^= 0x10  # one bit of the payload, behind the header's checksum
    assert t.store._client.upsert(key, bytes(value)) == 0
    with pytest.raises(KVFileError, match="checksum"):
        t.read(0, [0, 1], [0, 4])
    assert t.store.stats()["corrupt"] == 1 and t.store.contains([key]) == [False]
    assert torch.equal(t.read(0, [0], [0]), data[:1])  # the other page is served
    t.close()


def test_close_removes_every_page_the_tier_put(master, seed):
    t = tier(master)
    data = torch.randn(6, *t.page_shape, generator=torch.Generator().manual_seed(seed))
    for layer in range(L):
        t.write(layer, t.alloc(layer, 3), data[3 * layer:3 * layer + 3], [0, 4, 8])
    other = tier(master)  # another tier of the same model: its own owner, its own keys
    other.write(0, other.alloc(0, 1), data[:1], [0])
    keys = [t._keys.key(0, ly, s, 1) for ly in range(L) for s in range(3)]
    store = other.store
    assert store.contains(keys) == [True] * 6
    t.close()
    assert store.contains(keys) == [False] * 6
    assert torch.equal(other.read(0, [0], [0]), data[:1])
    other.close()


def test_a_full_store_refuses_the_write_and_keeps_nothing(tmp_path, seed):
    # 1 MiB pages into a 16 MiB pool (Mooncake's least): the store refuses what does not fit
    # (hard-pinned pages are never evicted)
    master = Master(tmp_path / "small.log", pool_mib=16)
    t = tier(master, shape=(2, 256, 8, 64), capacity=24, buffer_mib=32)
    data = torch.randn(24, *t.page_shape, generator=torch.Generator().manual_seed(seed))
    slots = t.alloc(0, 24)
    with pytest.raises(RemoteStoreError, match="NO_AVAILABLE_HANDLE") as e:
        t.write(0, slots, data, [256 * s for s in slots])
    assert isinstance(e.value, KVIOError)
    assert (t.held(0, slots)[0] == -1).all() and not any(in_store(t))
    t.write(0, slots[:2], data[:2], [0, 256])  # what fits still goes in
    assert torch.equal(t.read(0, slots[:2], [0, 256]), data[:2])
    t.close()
    master.stop()


# --- the runtime: the store below the host tier -----------------------------------------------


def _cache(cfg, master, **remote):
    cfg = cfg.replace(tiers=(TierSpec("hbm"), TierSpec("ddr", capacity_pages=4),
                             TierSpec("remote", remote=master.config(segment_gib=0.0,
                                                                     **remote))))
    return TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=2,
                         dtype=torch.float32, device="cpu", poison_freed=True)


def test_exact_offload_over_the_remote_tier_equals_the_full_cache(master, seed):
    cfg = TierConfig(page_size=4, hot_budget=0.3, max_context=128, prefill_chunk_size=32,
                     backend="torch")
    cache, shadow = _cache(cfg, master), Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)

    def check(layer, out, q):
        err = float((out.double() - shadow.attend(layer, q)).abs().max())
        assert err <= 2e-5
        return err
    run_loop(cache, shadow, prompt=40, steps=16, hq=HQ, gen=gen, chunk=32, check=check)
    tot = cache.stats()["total"]
    assert tot["resident_fraction"]["remote"] > 0.3 and tot["evicted_tokens"] == 0
    assert tot["disk_staged_pages"] > 0  # remote pages staged a layer ahead, like disk pages
    remote = cache.tiers[-1]
    assert remote.store.stats()["get"] > 0 and remote.store.stats()["put_failed"] == 0
    for layer in range(L):  # every token's K/V, wherever it lives, is what was appended
        for b in range(2):
            _, kv = cache.gather(layer, b)
            want = torch.stack([shadow.k[layer][b], shadow.v[layer][b]]).permute(2, 0, 1, 3)
            assert torch.equal(kv, want)
    held = remote._keys.held(remote.generation)
    assert held and all(remote.store.contains(held))
    store = remote.store
    assert master.key_count() == len(held)  # one object per page, nothing else
    cache.close()
    assert store.stats()["up"] and not any(_alive(master, held)) and master.key_count() == 0


def _alive(master, keys):
    """Whether ``keys`` are in the store, asked by a client of its own."""
    from tierattn.storage.remote import RemoteStore

    with RemoteStore(master.config(segment_gib=0.0)) as s:
        return s.contains(keys)


def test_topk_over_the_remote_tier_equals_topk_over_ddr(master, seed):
    cfg = TierConfig.preset("topk", page_size=4, hot_budget=0.25, recall_budget=8,
                            max_context=128, prefill_chunk_size=64, backend="torch",
                            tiers=(TierSpec("hbm"), TierSpec("ddr")))
    ref = TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=2,
                        dtype=torch.float32, device="cpu")
    remote = _cache(cfg, master)
    gen = torch.Generator().manual_seed(seed)
    for step in range(7):  # a 64-token prompt, then fresh queries: the selections move
        t = 64 if step == 0 else 1
        for layer in range(L):
            k, v, q = (torch.randn(2, h, t, D, generator=gen) for h in (HKV, HKV, HQ))
            for c in (ref, remote):
                c.update(layer, k, v)
            torch.testing.assert_close(remote.attend(layer, q), ref.attend(layer, q), rtol=0,
                                       atol=1e-6)
    tot = remote.stats()["total"]
    assert tot["resident_fraction"]["remote"] > 0.3 and tot["disk_missed_pages"] == 0
    ref.close()
    remote.close()


def test_a_dead_store_is_a_typed_error_within_one_deadline_and_loses_no_other_page(master,
                                                                                  seed):
    cfg = TierConfig(page_size=4, hot_budget=0.3, max_context=128, prefill_chunk_size=32,
                     backend="torch")
    cache, shadow = _cache(cfg, master, deadline_s=1.0, retry_s=30.0), \
        Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=40, steps=2, hq=HQ, gen=gen, chunk=32)
    master.stop()  # the master dies mid-run
    t0 = time.monotonic()
    with pytest.raises(KVIOError, match="remote"):
        run_loop(cache, shadow, prompt=0, steps=1, hq=HQ, gen=gen)
    first = time.monotonic() - t0
    t0 = time.monotonic()
    with pytest.raises(KVIOError, match="remote"):  # skipped at once while it is down
        cache.attend(0, torch.randn(2, HQ, 1, D, generator=gen))
    assert first < 1.0 + 3.0 and time.monotonic() - t0 < 0.5
    # a dead master either misses its deadline (the store is taken for down) or answers at
    # once with an empty value (Mooncake's get reports a failed RPC so): the page is lost
    st = cache.tiers[-1].store.stats()
    assert st["down"] >= 1 or st["get_missed"] >= 1
    # the pages of the tiers that answer are where they were
    st, checked = cache.pages.layers[0], 0
    for b in range(2):
        for pg in cache.pages.live_pages(0, b).tolist():
            if cache.tiers[int(st.tier[b, pg])].kind != "remote":
                got = cache.mover.read(0, torch.tensor([b]), torch.tensor([pg]))[0, 0]
                want = shadow.k[0][b][:, 4 * pg:4 * pg + 4].permute(1, 0, 2)
                assert torch.equal(got[:len(want)], want)
                checked += 1
    assert checked > 0
    cache.close()  # the store is down: closing does not hang


def test_a_saved_cache_loads_its_remote_pages_beside_the_old_ones(master, tmp_path, seed):
    """``load`` writes the file's remote pages as the tier's next generation before the current
    pages go (a failure leaves the old content); then the old generation leaves the store."""
    cfg = TierConfig(page_size=4, hot_budget=0.3, max_context=128, prefill_chunk_size=32,
                     backend="torch")
    cache, shadow = _cache(cfg, master), Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=40, steps=4, hq=HQ, gen=gen, chunk=32)
    path = cache.save(tmp_path)
    remote = cache.tiers[-1]
    old = remote._keys.held(remote.generation)
    run_loop(cache, Shadow(L, 2, HKV, D, torch.float32), prompt=0, steps=3, hq=HQ, gen=gen)
    cache.load(path)  # back to the saved state
    assert remote.generation == 1 and not any(_alive(master, old))
    assert cache.stats()["total"]["resident_fraction"]["remote"] > 0
    for layer in range(L):
        for b in range(2):
            _, kv = cache.gather(layer, b)
            want = torch.stack([shadow.k[layer][b], shadow.v[layer][b]]).permute(2, 0, 1, 3)
            assert torch.equal(kv, want)
    cache.close()


def test_the_tier_bandwidth_cell_moves_and_checks_its_pages(master):
    from tierattn.eval.bench.remote import tier_bandwidth

    res = tier_bandwidth(master, page_shape=(2, 16, HKV, D), dtype="bfloat16", pages=64,
                         repeats=2)
    assert res["bytes"] == 64 * 2 * 16 * HKV * D * 2
    assert all(res[k] > 0 for k in ("tier_write_GBps", "raw_put_GBps", "tier_read_GBps",
                                    "raw_get_GBps", "write_ratio", "read_ratio"))


def test_a_write_larger_than_one_mooncake_batch_goes_in_batches(master, seed):
    from tierattn.storage.remote import BATCH_KEYS

    n = 2 * BATCH_KEYS + 5  # Mooncake's TCP transfer fails one batch of 4,096 values
    t = tier(master, capacity=n)
    data = torch.randn(n, *t.page_shape, generator=torch.Generator().manual_seed(seed))
    slots = t.alloc(0, n)
    t.write(0, slots, data, [4 * s for s in slots])
    assert torch.equal(t.read(0, slots, [4 * s for s in slots]), data)
    assert t.store.stats()["put"] == n and t.store.stats()["get"] == n
    t.close()


def test_swap_tiers_release_every_layers_remote_pages(master):
    """A swap counts its slots on layer 0 and copies every layer into them: giving them back
    (or probing the tier) removes every layer's pages from the store."""
    from tierattn.config import SwapConfig
    from tierattn.serving.swaptiers import SwapTiers

    pools = [torch.randn(6, 2, 4, HKV, D) for _ in range(3)]  # 3 layers of 6 engine blocks
    config = SwapConfig(tiers=("ddr",), remote=master.config(segment_gib=0.0))
    swap = SwapTiers(config, pools, fingerprint="t", remote_tier=True, capacities=[2, 8])
    assert swap.kinds == ("ddr", "remote")
    t = 2
    slots = swap.tiers[t].alloc(0, 3)
    swap.copy(0, torch.tensor([1, 2, 3]), torch.tensor([0, 4, 8]), t, torch.tensor(slots),
              lambda *a: None)
    assert master.key_count() == 3 * 3
    back = torch.zeros(3, 2, 4, HKV, D)
    swap.copy(t, torch.tensor(slots), torch.tensor([0, 4, 8]), back, torch.arange(3),
              lambda *a: None)
    assert torch.equal(back, pools[2][1:4])  # the last layer's blocks came back
    swap.release(t, slots)
    assert master.key_count() == 0 and swap.tiers[t].num_free(0) == 8
    swap.calibrate(lambda *a: None, probe_slots=2, repeats=1)
    assert master.key_count() == 0
    swap.close()
