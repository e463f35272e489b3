"""Split attention: the host kernel against the fp64 reference, ``attend="split"`` equal to the
dense cache and to exact offload at every step (tiers, page sizes, padding, chunked prompts,
eviction, disk), ``attend="auto"`` choosing per layer and exact whenever it splits, its
estimate read without a device read, faults in the host tier typed with nothing lost, and the
configuration refused by name where it cannot work."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Shadow, run_loop

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig, TierSpec
from tierattn.errors import KernelInputError, KVIOError, TierConfigError
from tierattn.kernels import PageTable, host_decode, sparse_decode_reference
from tierattn.kernels import host as host_mod

L, HKV, HQ, D = 3, 2, 6, 16


def table(counts: list[int], last: list[int], slots: int, gen: torch.Generator) -> PageTable:
    n = sum(counts)
    c = torch.tensor(counts, dtype=torch.int32)
    return PageTable(indices=torch.randperm(slots, generator=gen)[:n].to(torch.int32),
                     row_start=(torch.cumsum(c, 0) - c).to(torch.int32), row_count=c,
                     last_page_len=torch.tensor(last, dtype=torch.int32))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(a), fin)  # an empty row is -inf in both
    return float(((a.double() - ref)[fin]).abs().max()) if fin.any() else 0.0


# --- the host kernel -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,p", [(6, 2, 32, 8), (9, 3, 64, 16), (4, 1, 24, 5),
                                        (16, 1, 16, 1), (8, 8, 48, 3), (8, 2, 128, 32),
                                        (10, 2, 80, 16), (16, 2, 96, 16), (2, 2, 16, 16)],
                         ids=["gqa3-d32", "smollm2", "d24", "g16-p1", "mha-d48", "d128-p32",
                              "g5-d80", "g8-d96", "mha-d16"])
def test_host_kernel_equals_the_fp64_reference(dtype, hq, hkv, d, p, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(64, 2, p, hkv, d, generator=gen).to(dtype)
    q = torch.randn(4, hq, d, generator=gen).to(dtype)
    counts, last = [5, 0, 11, 1], [p, 0, max(1, p - 2), 1]
    t = table(counts, last, 64, gen)
    nnz = sum(counts)
    first = torch.randint(0, p + 1, (nnz,), generator=gen, dtype=torch.int32)
    for softcap in (None, 4.0):
        lse_buf = torch.full((nnz + 3, hq), 7.0)
        rows = torch.randperm(nnz + 3, generator=gen)[:nnz].to(torch.int32)
        res = host_decode(q, pool, t, softcap=softcap, first_lane=first, page_lse=lse_buf,
                          page_lse_index=rows, threads=2)
        ref_lse = torch.full((nnz + 3, hq), 7.0, dtype=torch.float64)
        ref = sparse_decode_reference(q.double(), pool.double(), t, softcap=softcap,
                                      first_lane=first, page_lse=ref_lse, page_lse_index=rows)
        # fp32 compute over exactly widened inputs: a few ulp of the fp64 result
        assert rel_err(res.out, ref.out) < 2e-6
        assert rel_err(res.lse, ref.lse) < 2e-6 * (1 + float(ref.lse[torch.isfinite(
            ref.lse)].abs().max()))
        assert rel_err(lse_buf, ref_lse) < 1e-5  # untouched rows stay 7
        assert torch.equal(res.out[1], torch.zeros(hq, d))  # the empty row: (0, -inf)


@pytest.mark.parametrize("d", [64, 80])
def test_host_kernel_fp32_query_on_a_bf16_pool(d, seed):
    """A bf16 query is scored by bf16 pair products where the CPU has them (vdpbf16ps); an fp32
    query on the same bf16 pool keeps its full precision (the keys widened instead): both
    within a few ulp of fp64, and the two differ by the query's rounding only."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(48, 2, 16, 2, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(3, 8, d, generator=gen) * 2
    t = table([9, 3, 14], [16, 5, 11], 48, gen)
    for query in (q, q.to(torch.bfloat16)):
        res = host_decode(query, pool, t, threads=2)
        ref = sparse_decode_reference(query.double(), pool.double(), t)
        assert rel_err(res.out, ref.out) < 2e-6
        assert rel_err(res.lse, ref.lse) < 2e-6 * (1 + float(ref.lse.abs().max()))


def as_vllm_cpu(pages: torch.Tensor) -> torch.Tensor:
    """tierattn pages ``[N, 2, P, H, D]`` as vLLM's CPU blocks ``[N, H, P, 2D]``: per KV head the
    keys transposed ``[D, P]``, then the values ``[P, D]``."""
    n, _, p, h, d = pages.shape
    k = pages[:, 0].permute(0, 2, 3, 1).reshape(n, h, d * p)  # [N, H, D, P]
    v = pages[:, 1].permute(0, 2, 1, 3).reshape(n, h, p * d)  # [N, H, P, D]
    return torch.cat((k, v), dim=-1).view(n, h, p, 2 * d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,p", [(9, 3, 64, 32), (6, 2, 32, 16), (16, 2, 64, 16),
                                        (4, 1, 24, 5), (8, 8, 48, 48), (4, 2, 128, 64)],
                         ids=["smollm2-p32", "gqa3-p16", "g8", "untiled", "mha-p48",
                              "d128-p64"])
def test_host_kernel_reads_vllm_blocks_and_a_second_pool(dtype, hq, hkv, d, p, seed):
    """``layout="vllm_cpu"`` reads vLLM's CPU KV cache in place (keys transposed per block and
    head) and ``cold_pool`` a second pool: entries e >= 0 from the first, ~e from the second,
    in one softmax -- the fp64 reference over the same pages as one pool of tierattn pages."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randn(40, 2, p, hkv, d, generator=gen).to(dtype)
    q = torch.randn(3, hq, d, generator=gen).to(dtype)
    t = table([6, 1, 13], [p, 1, max(1, p - 3)], 40, gen)
    hot = t.indices < 24  # pages 0..23 in the first pool, 24..39 in the second as ~(slot - 24)
    split = PageTable(torch.where(hot, t.indices, ~(t.indices - 24)).to(torch.int32),
                      t.row_start, t.row_count, t.last_page_len)
    blocks = as_vllm_cpu(pages)
    assert torch.equal(host_mod.vllm_cpu_pages(blocks), pages)
    first = torch.randint(0, p + 1, (t.indices.numel(),), generator=gen, dtype=torch.int32)
    for softcap in (None, 4.0):
        res = host_decode(q, blocks[:24].contiguous(), split, cold_pool=blocks[24:].contiguous(),
                          layout="vllm_cpu", softcap=softcap, first_lane=first, threads=2)
        ref = sparse_decode_reference(q.double(), pages.double(), t, softcap=softcap,
                                      first_lane=first)
        assert rel_err(res.out, ref.out) < 2e-6
        assert rel_err(res.lse, ref.lse) < 2e-6 * (1 + float(ref.lse.abs().max()))
    one = host_decode(q, blocks, t, layout="vllm_cpu", threads=1)  # one pool, no second
    ref = sparse_decode_reference(q.double(), pages.double(), t)
    assert rel_err(one.out, ref.out) < 2e-6


def test_the_second_pool_and_layout_are_refused_by_name():
    blocks = torch.randn(8, 2, 4, 32)
    q = torch.randn(1, 4, 16)
    t = PageTable(indices=torch.tensor([0, -9], dtype=torch.int32),
                  row_start=torch.tensor([0], dtype=torch.int32),
                  row_count=torch.tensor([2], dtype=torch.int32),
                  last_page_len=torch.tensor([4], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="outside the pool .-8, 8"):
        host_decode(q, blocks, t, cold_pool=blocks.clone(), layout="vllm_cpu")
    with pytest.raises(KernelInputError, match="layout must be one of"):
        host_decode(q, blocks, t, layout="nhd")
    with pytest.raises(KernelInputError, match="num_blocks, H_kv, page_size, 2 . D"):
        host_decode(q, torch.randn(8, 2, 2, 4, 16), t, layout="vllm_cpu")
    with pytest.raises(KernelInputError, match="cold_pool .* must have kv_pool's page shape"):
        host_decode(q, blocks, t, cold_pool=torch.randn(8, 2, 8, 32), layout="vllm_cpu")
    with pytest.raises(KernelInputError, match="outside the pool .0, 8"):  # no second pool
        host_decode(q, blocks, t, layout="vllm_cpu")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_host_kernel_splits_and_threads_agree(threads, seed):
    """A long row is cut into splits merged by LSE: any thread count, the same state."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(300, 2, 16, 2, 64, generator=gen)
    q = torch.randn(2, 8, 64, generator=gen)
    t = table([150, 97], [16, 9], 300, gen)
    one = host_decode(q, pool, t, threads=1)
    res = host_decode(q, pool, t, threads=threads)
    assert float((res.out - one.out).abs().max()) < 1e-5
    assert float((res.lse - one.lse).abs().max()) < 1e-5


def test_the_torch_fallback_gives_the_same_state(monkeypatch, seed):
    """Without a C compiler the reference serves (one warning, same numbers)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(40, 2, 8, 2, 32, generator=gen).to(torch.bfloat16)
    q = torch.randn(2, 4, 32, generator=gen).to(torch.bfloat16)
    t = table([7, 12], [8, 3], 40, gen)
    blocks = as_vllm_cpu(pool)  # and vLLM's blocks with a second pool: entries >= 20 there
    split = PageTable(torch.where(t.indices < 20, t.indices, ~(t.indices - 20)).to(torch.int32),
                      t.row_start, t.row_count, t.last_page_len)
    two = {"cold_pool": blocks[20:].contiguous(), "layout": "vllm_cpu"}
    fast = host_decode(q, pool, t)
    fast2 = host_decode(q, blocks[:20].contiguous(), split, **two)
    assert host_mod.host_decode_available()
    monkeypatch.setattr(host_mod, "_lib", False)
    assert not host_mod.host_decode_available()
    slow = host_decode(q, pool, t)
    slow2 = host_decode(q, blocks[:20].contiguous(), split, **two)
    for a, b in ((fast, slow), (fast2, slow2), (fast, fast2)):
        assert float((a.out - b.out).abs().max()) < 1e-5
        assert float((a.lse - b.lse).abs().max()) < 1e-5


def test_a_missing_compiler_warns_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TIERATTN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="plain-torch reference"):
        assert host_mod._build() is None


def test_host_kernel_refuses_bad_input_by_name():
    pool = torch.randn(8, 2, 4, 2, 16)
    q = torch.randn(1, 4, 16)
    t = PageTable(indices=torch.tensor([0, 9], dtype=torch.int32),
                  row_start=torch.tensor([0], dtype=torch.int32),
                  row_count=torch.tensor([2], dtype=torch.int32),
                  last_page_len=torch.tensor([4], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="outside the pool"):
        host_decode(q, pool, t)
    ok = PageTable(indices=torch.tensor([0, 1], dtype=torch.int32), row_start=t.row_start,
                   row_count=t.row_count, last_page_len=t.last_page_len)
    with pytest.raises(KernelInputError, match="page_lse and page_lse_index"):
        host_decode(q, pool, ok, page_lse=torch.zeros(2, 4))
    with pytest.raises(KernelInputError, match="page_table has 1 rows"):
        host_decode(torch.randn(2, 4, 16), pool, ok)
    with pytest.raises(KernelInputError, match="threads"):
        host_decode(q, pool, ok, threads=0)
    with pytest.raises(KernelInputError, match="contiguous"):
        host_decode(q, pool.transpose(0, 1).contiguous().transpose(0, 1), ok)
    if torch.cuda.is_available():
        with pytest.raises(KernelInputError, match="host memory"):
            host_decode(q.cuda(), pool, ok)


# --- the runtime ------------------------------------------------------------------------------

def make(cfg: TierConfig, batch: int = 2, dtype=torch.float32) -> TieredKVCache:
    return TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=batch,
                         dtype=dtype, device="cpu", poison_freed=True)


def exact(shadow: Shadow, tol: float):
    def check(layer, out, q):
        err = float((out.double() - shadow.attend(layer, q)).abs().max())
        assert err <= tol, f"layer {layer}: |out - dense| = {err}"
        return err
    return check


TIERS = {"ddr": (TierSpec("hbm"), TierSpec("ddr")),
         "ddr+cxl": (TierSpec("hbm"), TierSpec("ddr", capacity_pages=6), TierSpec("cxl"))}


@pytest.mark.parametrize("tiers", list(TIERS))
@pytest.mark.parametrize("hot,page", [(0.25, 4), (6, 1), (0.1, 8), (0.5, 5)],
                         ids=["hot25%-p4", "hot6tok-p1", "hot10%-p8", "hot50%-p5"])
def test_split_equals_dense_at_every_step(tiers, hot, page, seed):
    """Prompt chunks attend earlier chunks' demoted pages on the host too."""
    cfg = TierConfig(page_size=page, hot_budget=hot, attend="split", tiers=TIERS[tiers],
                     max_context=160, prefill_chunk_size=16, backend="torch", sink_pages=1,
                     recent_pages=1)
    cache, shadow = make(cfg, batch=3), Shadow(L, 3, HKV, D, torch.float32)
    run_loop(cache, shadow, prompt=45, steps=40, hq=HQ, gen=torch.Generator().manual_seed(seed),
             chunk=16, check=exact(shadow, 2e-5))
    total = cache.stats()["total"]
    assert total["demoted_pages"] > 0 and total["split_steps"] > 0
    # no page crossed the link: only queries out, partial states back
    assert set(total["h2d_bytes"]) == {"partial"} and total["host_attn_bytes"] > 0
    for layer in range(L):  # offload never drops a token
        for b in range(3):
            pos, kv = cache.gather(layer, b)
            assert torch.equal(pos, torch.arange(cache.length(layer)))


@pytest.mark.parametrize("evict", [0, 0.2], ids=["offload", "evict20%"])
def test_split_keeps_the_same_pages_as_exact_offload(evict, seed):
    """The cold pages' mass reaches importance as with recall: the same demotions and
    evictions, the same outputs, to rounding."""
    outs = {}
    for attend in ("all", "split"):
        cfg = TierConfig(page_size=4, hot_budget=0.3, evict_budget=evict, attend=attend,
                         max_context=160, prefill_chunk_size=16, backend="torch")
        cache = make(cfg, batch=2)
        got = []
        run_loop(cache, Shadow(L, 2, HKV, D, torch.float32), prompt=40, steps=30, hq=HQ,
                 gen=torch.Generator().manual_seed(seed), chunk=16,
                 check=lambda layer, out, q, got=got: got.append(out) or 0.0)
        outs[attend] = (got, [cache.pages.layers[i].tier.clone() for i in range(L)],
                        cache.stats()["total"])
    (a, tier_a, st_a), (b, tier_b, st_b) = outs["all"], outs["split"]
    assert all(torch.equal(x, y) for x, y in zip(tier_a, tier_b))
    assert st_a["demoted_pages"] == st_b["demoted_pages"]
    assert st_a["evicted_tokens"] == st_b["evicted_tokens"]
    assert max(float((x - y).abs().max()) for x, y in zip(a, b)) < 1e-5


def test_split_with_left_padding_and_bf16(seed):
    cfg = TierConfig(page_size=4, hot_budget=8, attend="split", max_context=128,
                     backend="torch", prefill_chunk_size=64)
    cache = make(cfg, batch=3, dtype=torch.bfloat16)
    cache.set_padding([0, 3, 9])
    shadow = Shadow(L, 3, HKV, D, torch.bfloat16)
    keep = None

    def check(layer, out, q):
        nonlocal keep
        n = cache.length(layer)
        keep = torch.arange(n)[None, :] >= cache.pad[:, None]
        ref = shadow.attend(layer, q, keep).nan_to_num(0.0)  # a padding query sees no key: 0
        err = float((out.double() - ref).abs().max())
        assert err < 2e-2, err  # bf16 outputs
        return err
    run_loop(cache, shadow, prompt=30, steps=25, hq=HQ, gen=torch.Generator().manual_seed(seed),
             check=check)
    assert cache.stats()["total"]["split_steps"] > 0


@pytest.mark.parametrize("prefetch", ["layer_ahead", "none"])
def test_split_over_disk_pages_and_a_failed_read_is_typed(prefetch, tmp_path, monkeypatch, seed):
    """Disk pages come into host memory each step (read ahead on the I/O threads while the
    layer before computes, or at the layer); a read that fails, ahead or not, raises KVIOError
    at the layer that needs it, and the same call succeeds once the disk answers again."""
    tiers = (TierSpec("hbm"), TierSpec("ddr", capacity_pages=4),
             TierSpec("disk", path=str(tmp_path / "kv")))
    cfg = TierConfig(page_size=4, hot_budget=8, attend="split", tiers=tiers, max_context=128,
                     backend="torch", prefetch=prefetch)
    cache, shadow = make(cfg, batch=2), Shadow(L, 2, HKV, D, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    run_loop(cache, shadow, prompt=40, steps=12, hq=HQ, gen=gen, check=exact(shadow, 2e-5))
    assert cache.residency()[0].get("disk", 0) > 0
    total = cache.stats()["total"]  # read into host memory each step
    if prefetch == "none":
        assert total["disk_sync_pages"] > 0 and total["disk_staged_pages"] == 0
    else:  # mostly ahead of the layer; at the layer after its cold set changed
        assert total["disk_staged_pages"] > total["disk_sync_pages"] > 0
    import tierattn.storage.segment as segment

    def broken(*a, **kw):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(segment.Segment, "read_into", broken)
    failed = None
    for layer in range(L):
        k, v, q = (torch.randn(2, h, 1, D, generator=gen) for h in (HKV, HKV, HQ))
        cache.update(layer, k, v)
        shadow.append(layer, k, v)
        if failed is None:
            try:
                cache.attend(layer, q)
                continue
            except KVIOError as e:
                assert "reading pages of the disk tier" in str(e)
                failed = layer
                monkeypatch.undo()  # the disk answers again: the same call succeeds
        out = cache.attend(layer, q)
        assert float((out.double() - shadow.attend(layer, q)).abs().max()) < 2e-5
    # at layer 0 without read-ahead; with it, at the first layer whose read started after the
    # disk broke (layer 1, unless layer 0's cold set changed since its read)
    assert failed == 0 if prefetch == "none" else failed in (0, 1)


# --- attend="auto" -------------------------------------------------------------------------------

def auto(**kw) -> TierConfig:
    return TierConfig.preset("adaptive", **{**dict(page_size=4, max_context=160,
                                                   prefill_chunk_size=16, backend="torch",
                                                   adapt_every=4), **kw})


def test_auto_that_always_splits_equals_dense(seed):
    """A slow link and a fast host: every layer's cheapest way is split, and it is exact."""
    cfg = auto(hot_budget=0.25, link_bandwidth=1.0, host_bandwidth=1e12, adapt_mass=1.0)
    cache, shadow = make(cfg, batch=2), Shadow(L, 2, HKV, D, torch.float32)
    run_loop(cache, shadow, prompt=45, steps=30, hq=HQ, gen=torch.Generator().manual_seed(seed),
             chunk=16, check=exact(shadow, 2e-5))
    total = cache.stats()["total"]
    assert total["split_steps"] > 0 and total["recall_steps"] == 0
    assert cache.planner.modes == ["split"] * L
    assert all(e is not None for e in cache.planner.estimates)  # the sketch was read


def test_auto_recalls_a_concentrated_layer_and_attends_a_diffuse_one_exactly(seed):
    """Keys aimed at their group's decode query make layer 0's cold mass sit on few pages (the
    prompt looked elsewhere, so they were demoted): the sketch's estimate sees it and the layer
    recalls; layer 1's random keys keep it exact (a fast link:
    bringing every cold page is its cheapest exact way)."""
    cfg = auto(hot_budget=0.25, recall_budget=0.25, link_bandwidth=1e12, host_bandwidth=1e6,
               adapt_mass=0.8, prefill_chunk_size=96)
    cache = TieredKVCache(cfg, num_layers=2, num_kv_heads=HKV, head_dim=D, batch_size=1,
                          device="cpu")
    gen = torch.Generator().manual_seed(seed)
    k_dir = torch.randn(HKV, D, generator=gen)
    k_dir = k_dir / k_dir.norm(dim=-1, keepdim=True)
    q = 3 * k_dir.repeat_interleave(HQ // HKV, 0)  # every query head looks along its KV head

    def step(t: int, pos: int) -> None:
        for layer in range(2):
            k = torch.randn(1, HKV, t, D, generator=gen)
            if layer == 0:  # one page in twelve holds keys in line with the queries
                hit = (torch.arange(pos, pos + t) // 4) % 12 == 5
                k[0, :, hit] = 8 * k_dir[:, None, :]
            v = torch.randn(1, HKV, t, D, generator=gen)
            cache.update(layer, k, v)
            # the prompt looks elsewhere, so those pages leave HBM; decoding then needs them
            cache.attend(layer, torch.randn(1, HQ, t, D, generator=gen) if t > 1 else
                         q[None, :, None, :])
    step(96, 0)
    for i in range(24):
        step(1, 96 + i)
    plan = cache.planner.as_dict()
    assert plan["modes"] == ["recall", "all"], plan
    assert plan["recall_share"][0] > 0.8 > plan["recall_share"][1], plan
    st = cache.stats()["layers"]
    assert st[0]["recall_steps"] > 0 and st[1]["recall_steps"] == 0


def test_a_probe_measures_what_the_sketchs_pick_holds_of_the_exact_mass():
    """The share a recall would hold comes from the probe step's exact page LSEs, not from the
    sketch's view of itself: a sketch sure of two pages that hold a sixth of the true mass
    gives 1/6; the smallest over the live rows; a row without cold pages holds all of it."""
    from tierattn.runtime.planner import AttendPlanner

    cache = make(auto(hot_budget=0.25))
    plan = AttendPlanner(cache.config, cache.pages, None)
    b, n, hq, hkv = 3, 6, 4, 2
    scores = torch.full((b, n, hkv), -math.inf)
    scores[:, :4] = torch.tensor([0.0, -30.0, 5.0, -30.0])[:, None]  # pages 0 and 2 ranked top
    scores[2] = -math.inf  # row 2: no cold page
    lse_index = torch.arange(b * n, dtype=torch.int32)
    page_lse = torch.full((b * n + 1, hq), -math.inf)
    page_lse[b * n] = 99.0  # the trash row: never read as a page
    true = torch.log(torch.tensor([1.0, 1.0, 0.0, 4.0]))  # pages 0 + 2 hold 1/6 of row 0's mass
    page_lse[0:4] = true[:, None]
    page_lse[n:n + 4] = torch.log(torch.tensor([2.0, 0.0, 2.0, 0.0]))[:, None]  # row 1: all
    for rows, want in ((None, 1 / 6), (torch.tensor([1, 2]), 1.0)):
        plan.estimate(0, scores, 2, page_lse, lse_index, reduce="lse", alive_rows=rows)
        host, ticket = plan._pending[0]
        plan.engine.wait_host(ticket)
        assert float(host[0]) == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("adapt_every", [1, 3])
def test_auto_probes_exactly_every_adapt_every_steps(adapt_every, seed):
    """Every recall is decided by a probe: steps 1, 1 + N, ... attend exactly (here by bringing
    every cold page: a fast link), the others recall (any share is enough); adapt_every=1
    never recalls. Every step stays within the dense cache's reach (exact steps to 2e-5)."""
    cfg = auto(hot_budget=0.25, link_bandwidth=1e12, host_bandwidth=1e3, adapt_mass=0.0,
               adapt_every=adapt_every)
    cache, shadow = make(cfg, batch=2), Shadow(L, 2, HKV, D, torch.float32)
    steps = 10
    run_loop(cache, shadow, prompt=45, steps=steps, hq=HQ,
             gen=torch.Generator().manual_seed(seed), chunk=16)
    probes = -(-steps // adapt_every)
    for layer in cache.stats()["layers"]:
        assert layer["recall_steps"] == steps - probes
        assert layer["split_steps"] == 0
    assert all(e is not None for e in cache.planner.estimates)


def test_auto_takes_the_cheapest_way_from_the_costs():
    """Recall only where the layer is concentrated and a recall is cheaper than the cheaper
    exact way; split where the host reads faster than the link carries."""
    from tierattn.serving.costmodel import AttendCosts
    from tierattn.runtime.planner import AttendPlanner

    cache = make(auto(hot_budget=0.25))
    cold, recall, link = 64 << 20, 16 << 20, 1 << 10

    def way(conc, link_bps, host_bps):
        plan = AttendPlanner(cache.config, cache.pages, AttendCosts(link_bps, host_bps))
        return plan.choose(conc, cold, recall, link)
    assert way(None, 50e9, 150e9) == "split"  # a server: DDR read beats PCIe
    assert way(None, 50e9, 10e9) == "all"  # a weak host: bring the pages
    assert way(0.95, 50e9, 10e9) == "recall"  # concentrated: a quarter of the bytes
    assert way(0.5, 50e9, 10e9) == "all"  # diffuse: exact
    assert way(0.95, 1e9, 1e12) == "split"  # a host so fast that reading all beats recall


@pytest.mark.parametrize("knobs,match", [
    (dict(attend="auto", recall_score="quest"), "sketch"),
    (dict(attend="auto", sketch_reduce="max"), "sketch_reduce='lse'"),
    (dict(attend="split", cuda_graphs=True), "CUDA graph"),
    (dict(attend="split", prefetch="speculative"), "speculative"),
    (dict(adapt_every=0), "adapt_every"),
    (dict(adapt_mass=1.5), "adapt_mass"),
    (dict(link_bandwidth=0), "link_bandwidth"),
    (dict(host_bandwidth="fast"), "host_bandwidth"),
    (dict(host_threads=0), "host_threads"),
])
def test_split_and_auto_knobs_are_checked_by_name(knobs, match):
    with pytest.raises(TierConfigError, match=match):
        TierConfig(**knobs)


def test_presets_split_and_adaptive():
    s, a = TierConfig.preset("split"), TierConfig.preset("adaptive")
    assert s.attend == "split" and not s.key_sketch
    assert a.attend == "auto" and a.key_sketch and a.recalls
    assert math.isclose(s.hot_budget, 0.25) and math.isclose(a.hot_budget, 0.25)


# --- through tierattn.patch ---------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2", "mistral", "gpt_oss"])
@pytest.mark.parametrize("attend", ["split", "auto"])
def test_split_generation_equals_the_reference(model_type, attend, figures):
    """Left-padded batch of 3 (softcap, sliding windows and sinks among the families);
    ``auto`` on a slow link splits every layer, and is exact too."""
    pytest.importorskip("transformers")
    import tierattn
    from test_hf import exact_config, generate, tiny

    model = tiny(model_type)
    ids = torch.randint(3, 128, (3, 29), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for b, pad in enumerate([0, 5, 11]):
        ids[b, :pad], mask[b, :pad] = 0, 0
    ref = generate(model, ids, attention_mask=mask)
    extra = dict(link_bandwidth=1.0, host_bandwidth=1e12, adapt_mass=1.0, adapt_every=4) \
        if attend == "auto" else {}
    with tierattn.patch(model, exact_config(attend=attend, **extra)) as handle:
        out = generate(model, ids, attention_mask=mask)
        stats = handle.stats()["total"]
    assert torch.equal(out.sequences, ref.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits)) < 1e-4
    text = model.config.get_text_config()
    if not getattr(text, "sliding_window", None) or model_type == "gpt_oss":
        assert stats["split_steps"] > 0 and stats["recall_steps"] == 0
    figures.count(f"HF architectures token-identical with attend={attend!r} (batch 3, "
                  "left-padded)")


def test_auto_measures_this_machine_once_per_geometry():
    """Rates left unset are measured when the cache is built (the link through the cache's
    engine, the host kernel on a synthetic pool), once per process and geometry."""
    from tierattn.runtime import hostattn

    a = make(auto(hot_budget=0.25))
    b = make(auto(hot_budget=0.25))
    key = [k for k in hostattn._RATES if k[2] == tuple(a.hbm.page_shape)]
    assert len(key) == 1 and hostattn._RATES[key[0]][0] > 0 and hostattn._RATES[key[0]][1] > 0
    costs = a.planner.costs.as_dict()
    assert costs["link_bandwidth_Bps"] == b.planner.costs.as_dict()["link_bandwidth_Bps"]
    assert a.planner.costs.refit and costs["host_observations"] == 0
