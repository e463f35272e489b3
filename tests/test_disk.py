"""The disk tier's storage (:mod:`tierattn.storage.segment`) and its reads off the decode step
(:mod:`tierattn.storage.staging`): page-aligned slots in one file, batched and coalesced I/O, every
fault a typed error with the page map unchanged, and ``topk`` over disk pages equal to ``topk``
over DDR pages wherever the staged selection covered the step."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
from helpers import Shadow, fail_disk_reads, fail_disk_writes, run_loop

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig, TierSpec
from tierattn.errors import KVFileError, KVIOError
from tierattn.storage.segment import ALIGN, IOV_MAX, Segment, pool_for
from tierattn.storage.tiers import DiskTier

L, HKV, HQ, D = 2, 2, 4, 8


def segment(folder, *, page_shape=(2, 4, 2, 8), dtype=torch.float32, layers=2, capacity=16,
            pool=None) -> Segment:
    return Segment(folder, "fp", layers, capacity, page_shape, dtype, 0, pool)


def pages(n, shape, dtype, gen):
    return torch.randn(n, *shape, generator=gen).to(dtype)


@pytest.mark.parametrize("page_shape,dtype", [((2, 4, 2, 8), torch.float32),  # 512 B: padded
                                              ((2, 16, 8, 16), torch.bfloat16)],  # 8 KiB: not
                         ids=["padded-slot", "aligned-page"])
def test_round_trip_any_slots_any_rows(tmp_path, page_shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    seg = segment(tmp_path, page_shape=page_shape, dtype=dtype)
    assert seg.slot_bytes % ALIGN == 0 and seg.slot_bytes >= seg.page_bytes
    slots = [3, 4, 5, 9, 0, 15, 7]  # runs and gaps, unsorted
    data = pages(len(slots), page_shape, dtype, gen)
    seg.write(1, slots, data, [16 * s for s in slots])
    out = torch.zeros(10, *page_shape, dtype=dtype)
    rows = [9, 2, 0, 5, 1, 8, 3]
    seg.read_into(1, slots, [16 * s for s in slots], out, rows)
    assert torch.equal(out[rows], data)
    assert torch.equal(out[[4, 6, 7]], torch.zeros(3, *page_shape, dtype=dtype))  # untouched
    # another layer's slots of the same numbers hold nothing
    with pytest.raises(KVFileError, match="no page"):
        seg.read_into(0, [3], [48], out)


def test_adjacent_slots_are_one_call_and_the_file_count_is_one(tmp_path, monkeypatch, seed):
    gen = torch.Generator().manual_seed(seed)
    calls = {"pwritev": 0, "preadv": 0}
    for name in calls:
        real = getattr(os, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)
        monkeypatch.setattr(os, name, counted)
    tier = DiskTier(L, 256, (2, 4, 2, 8), torch.float32, tmp_path, "fp", io_threads=1)
    n = 200
    data = pages(n, tier.page_shape, tier.dtype, gen)
    tier.write(0, list(range(n)), data, list(range(n)))
    per_call = IOV_MAX // 2  # a padded slot is two buffers: the page and its padding
    assert calls["pwritev"] == -(-n // per_call)
    got = tier.read(0, list(range(n)), list(range(n)))
    assert torch.equal(got, data) and calls["preadv"] == -(-n // per_call)
    tier.write(1, [1, 3, 5], data[:3], [0, 1, 2])  # gaps: one call per run
    assert calls["pwritev"] == -(-n // per_call) + 3
    assert [p.name for p in tmp_path.iterdir()] == [tier.path().name]  # one file, any pages
    # sparse: disk space only where pages were written (where the file system supports it)
    st = os.stat(tier.path())
    assert st.st_size == ALIGN + L * 256 * tier.segment().slot_bytes
    tier.close()
    assert not list(tmp_path.iterdir())  # the segment goes with the tier


def test_large_batches_split_over_the_pool_land_whole(tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = pool_for(4)
    shape = (2, 16, 8, 16)  # 8 KiB pages: 256 of them (2 MiB) go to the pool in parts
    seg = segment(tmp_path, page_shape=shape, dtype=torch.float32, capacity=600, pool=pool)
    slots = list(range(0, 600, 2))[:256]  # every other slot: 256 runs
    data = pages(256, shape, torch.float32, gen)
    seg.write(0, slots, data, slots)
    out = torch.empty_like(data)
    seg.read_into(0, slots, slots, out)
    assert torch.equal(out, data)
    # two long runs of adjacent slots (fewer runs than threads): cut, so every thread reads
    calls = {"n": 0}
    real = os.preadv

    def counted(*a):
        calls["n"] += 1
        return real(*a)
    slots = list(range(128)) + list(range(300, 428))
    seg.write(1, slots, data, slots)
    out.zero_()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "preadv", counted)
        seg.read_into(1, slots, slots, out)
    assert torch.equal(out, data) and calls["n"] == 4  # 2 runs x 2 pieces of 1 MiB
    pool.shutdown()


def test_header_geometry_and_fingerprint_are_checked(tmp_path):
    seg = segment(tmp_path)
    seg.check_header()
    head = os.pread(seg.fd, ALIGN, 0)
    os.pwrite(seg.fd, head.replace(b'"capacity": 16', b'"capacity": 17'), 0)
    with pytest.raises(KVFileError, match="capacity"):
        seg.check_header()
    os.pwrite(seg.fd, b"NOTASEG!", 0)
    with pytest.raises(KVFileError, match="not a tierattn segment"):
        seg.check_header()
    with pytest.raises(KVFileError, match="fingerprint"):
        Segment(tmp_path, "x" * 5000, 1, 1, (2, 4, 2, 8), torch.float32, 0, None)
    assert [p.name for p in tmp_path.iterdir()] == [seg.path.name]  # the refused one is gone


def test_deleted_truncated_and_corrupted_segments_raise(tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(2, 2, 4, 2, 8)
    for fault, match in [("flip", "checksum mismatch"), ("truncate", "truncated"),
                         ("delete", "deleted")]:
        (tmp_path / fault).mkdir()
        seg = segment(tmp_path / fault)
        seg.write(0, [2, 3], pages(2, seg.page_shape, seg.dtype, gen), [0, 4])
        at = seg._offset(0, 3) + 17
        if fault == "flip":
            os.pwrite(seg.fd, bytes([os.pread(seg.fd, 1, at)[0] ^ 0x80]), at)
        elif fault == "truncate":
            os.truncate(seg.path, seg._offset(0, 3))
        else:
            os.unlink(seg.path)
        with pytest.raises(KVFileError, match=match):
            seg.read_into(0, [2, 3], [0, 4], out)
        seg.close()
    seg = segment(tmp_path)
    seg.write(0, [1], pages(1, seg.page_shape, seg.dtype, gen), [8])
    with pytest.raises(KVFileError, match="page of token 8, not the page of token 0"):
        seg.read_into(0, [1], [0], out)
    seg.forget(0, [1])
    with pytest.raises(KVFileError, match="released or never written"):
        seg.read_into(0, [1], [8], out)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_leaves_its_slots_empty_and_others_intact(tmp_path, monkeypatch, code,
                                                                  seed):
    gen = torch.Generator().manual_seed(seed)
    seg = segment(tmp_path)
    old = pages(2, seg.page_shape, seg.dtype, gen)
    seg.write(0, [0, 1], old, [0, 4])
    calls = fail_disk_writes(monkeypatch, OSError(code, os.strerror(code)))
    with pytest.raises(OSError) as info:
        seg.write(0, [1, 2, 3], pages(3, seg.page_shape, seg.dtype, gen), [4, 8, 12])
    assert info.value.errno == code and calls["failed"] == 1
    monkeypatch.undo()
    assert (seg.starts[0, [1, 2, 3]] == -1).all()  # the rewritten slot 1 holds nothing now
    out = torch.empty(1, *seg.page_shape)
    seg.read_into(0, [0], [0], out)
    assert torch.equal(out[0], old[0])
    with pytest.raises(KVFileError, match="no page"):
        seg.read_into(0, [2], [8], out)


def test_a_short_read_is_a_typed_error(tmp_path, monkeypatch, seed):
    gen = torch.Generator().manual_seed(seed)
    seg = segment(tmp_path)
    seg.write(0, [0, 1], pages(2, seg.page_shape, seg.dtype, gen), [0, 4])
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real(fd, bufs[:1], off))
    with pytest.raises(KVFileError, match="short read"):
        seg.read_into(0, [0, 1], [0, 4], torch.empty(2, *seg.page_shape))


def test_release_waits_for_reads_in_flight(tmp_path, monkeypatch, seed):
    # a staged read of a slot must finish before the slot can be released and rewritten
    gen = torch.Generator().manual_seed(seed)
    tier = DiskTier(1, 8, (2, 4, 2, 8), torch.float32, tmp_path, "fp", io_threads=2)
    data = pages(2, tier.page_shape, tier.dtype, gen)
    tier.write(0, [0, 1], data, [0, 4])
    real, started = os.preadv, threading.Event()

    def slow(*a):
        started.set()
        time.sleep(0.2)
        return real(*a)
    monkeypatch.setattr(os, "preadv", slow)
    out = torch.zeros(2, *tier.page_shape)
    fut = tier.read_async(0, [0, 1], [0, 4], out, [0, 1])
    started.wait(5)
    tier.release(0, [0, 1])
    assert fut.done() and torch.equal(out, data)
    tier.close()


# --- the runtime: disk pages staged off the step ---------------------------------------------


def _cache(cfg, folder=None):
    if folder is not None:
        cfg = cfg.replace(tiers=(TierSpec("hbm"), TierSpec("ddr", capacity_pages=4),
                                 TierSpec("disk", path=str(folder))))
    return TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=2,
                         dtype=torch.float32, device="cpu", poison_freed=True)


def test_exact_offload_reads_disk_pages_a_layer_ahead(tmp_path, seed):
    cfg = TierConfig(page_size=4, hot_budget=0.3, max_context=128, prefill_chunk_size=32,
                     backend="torch")
    cache, shadow = _cache(cfg, tmp_path), Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)

    def check(layer, out, q):
        err = float((out.double() - shadow.attend(layer, q)).abs().max())
        assert err <= 2e-5
        return err
    run_loop(cache, shadow, prompt=40, steps=24, hq=HQ, gen=gen, chunk=32, check=check)
    tot = cache.stats()["total"]
    assert tot["resident_fraction"]["disk"] > 0
    # layer 1's pages are read while layer 0 computes; only the step after a spill (the
    # layer's cold set changed) or layer 0 (nothing before it) waits on its reads
    assert tot["disk_staged_pages"] > tot["disk_sync_pages"] > 0
    assert tot["disk_missed_pages"] == 0
    cache.close()  # the segment goes with the cache
    assert not list(tmp_path.iterdir())


def _topk_twins(cfg, folder, seed):
    """``cfg`` over DDR and the same over DDR + disk, both prefilled with one 64-token prompt."""
    ref, disk = _cache(cfg), _cache(cfg, folder)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(L):
        k, v = (torch.randn(2, HKV, 64, D, generator=gen) for _ in range(2))
        q = torch.randn(2, HQ, 64, D, generator=gen)
        for c in (ref, disk):
            c.update(layer, k, v)
            c.attend(layer, q)
    return ref, disk, gen


@pytest.mark.parametrize("prefetch", ["layer_ahead", "none"])
def test_topk_over_disk_reads_its_misses_and_equals_topk_over_ddr(tmp_path, prefetch, seed):
    """disk_misses="read" (the default): every step equals topk over DDR; the disk pages the
    previous step chose are staged ahead, those chosen anew read at the layer."""
    cfg = TierConfig.preset("topk", page_size=4, hot_budget=0.25, recall_budget=8,
                            max_context=128, prefill_chunk_size=64, backend="torch",
                            tiers=(TierSpec("hbm"), TierSpec("ddr")), prefetch=prefetch)
    ref, disk, gen = _topk_twins(cfg, tmp_path, seed)
    for _step in range(8):  # fresh queries: the selections move
        for layer in range(L):
            k, v, q = (torch.randn(2, h, 1, D, generator=gen) for h in (HKV, HKV, HQ))
            for c in (ref, disk):
                c.update(layer, k, v)
            torch.testing.assert_close(disk.attend(layer, q), ref.attend(layer, q), rtol=0,
                                       atol=1e-6)
    tot = disk.stats()["total"]
    assert tot["resident_fraction"]["disk"] > 0.3 and tot["disk_missed_pages"] == 0
    assert tot["disk_sync_pages"] > 0 and tot["disk_selection_reads"] == 8 * L
    if prefetch == "layer_ahead":
        assert tot["disk_staged_pages"] > 0


def test_topk_over_disk_deferred_equals_topk_over_ddr_where_staged(tmp_path, seed):
    """disk_misses="defer": a step whose selected disk pages were all staged (the previous
    step chose them) gives topk-over-DDR's output; a page chosen anew is masked for one step
    and counted as a miss; no selection comes back to the host."""
    cfg = TierConfig.preset("topk", page_size=4, hot_budget=0.25, recall_budget=8,
                            max_context=128, prefill_chunk_size=64, backend="torch",
                            tiers=(TierSpec("hbm"), TierSpec("ddr")), disk_misses="defer")
    ref, disk, gen = _topk_twins(cfg, tmp_path, seed)
    q = torch.randn(2, HQ, 1, D, generator=gen)  # one query, repeated: selections repeat
    equal = missed_steps = 0
    for _ in range(6):
        before = disk.stats()["total"]["disk_missed_pages"]
        outs = []
        for layer in range(L):
            k, v = (torch.randn(2, HKV, 1, D, generator=gen) * 0.01 for _ in range(2))
            for c in (ref, disk):
                c.update(layer, k, v)
            outs.append([c.attend(layer, q) for c in (ref, disk)])
        if disk.stats()["total"]["disk_missed_pages"] == before:
            for a, b in outs:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            equal += 1
        else:
            missed_steps += 1
    tot = disk.stats()["total"]
    assert tot["resident_fraction"]["disk"] > 0.3 and tot["disk_staged_pages"] > 0
    assert missed_steps >= 1 and equal >= 3  # the first step misses, then the staging holds
    assert tot["evicted_tokens"] == 0 and tot["disk_selection_reads"] == 0


def test_topk_disk_read_failure_is_typed_and_loses_nothing(tmp_path, monkeypatch, seed):
    cfg = TierConfig.preset("topk", page_size=4, hot_budget=0.25, recall_budget=8,
                            max_context=128, prefill_chunk_size=64, backend="torch")
    cache, shadow = _cache(cfg, tmp_path), Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=64, steps=2, hq=HQ, gen=gen)
    fail_disk_reads(monkeypatch, OSError(errno.EIO, "I/O error"))
    with pytest.raises(KVIOError, match="disk tier"):
        run_loop(cache, shadow, prompt=0, steps=2, hq=HQ, gen=gen)
    monkeypatch.undo()
    for layer in range(L):  # nothing was lost: every appended token's K/V is where it was
        for b in range(2):
            _, kv = cache.gather(layer, b)
            ref = torch.stack([shadow.k[layer][b], shadow.v[layer][b]]).permute(2, 0, 1, 3)
            assert torch.equal(kv, ref)
