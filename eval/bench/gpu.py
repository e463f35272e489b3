"""The prepared GPU check: ``python -m tierattn.eval.bench.gpu --out DIR`` (about 5 minutes on
an H200). In this order, each section written to ``DIR/gpu_check.json`` and ``DIR/gpu_check.md``
as soon as it finishes (a run cut short keeps what it measured):

1. **gate**: the kernel and runtime tests on the GPU (``pytest``); a red gate stops the check
   before any timing;
2. **calibration**: device-to-device copy bandwidth (bytes read + written), pinned host<->device
   bandwidth, the cost of one ``cudaMemcpyAsync`` of a 64 KiB / 16 KiB page, the GPU time of an
   empty kernel launch (back to back) and its host cost, and our page-copy kernel reading a
   pinned pool over UVA; saved as ``hardware-measured.json``, a profile ``tierattn bench
   --hardware`` models with;
3. **decode**: sparse paged decode (batch 1/8/64 x context 4K/32K/128K x budget full/4096/2048
   tokens, GQA 32/8, d=128, bf16) against torch SDPA over the full context (flash-attn too when
   importable), each output checked first: microseconds, achieved TB/s, % of the calibrated
   bandwidth;
4. **pipeline**: 32 Llama-8B-shaped layers (a 4096x53248 bf16 GEMM per layer stands for the
   layer's weight reads) decoding at 32K context: every page resident, ours (offload 50% hot
   with layer-ahead prefetch; topk 10% hot + 10% recall), ours with synchronous fetch, and
   whole-layer offloading with transformers' own ``DynamicCache(offloading=True)``: measured ms
   per token, the stall exposed over all-resident, and the model's prediction from the same
   run's telemetry and calibration;
5. **split**: split attention against the all-resident cache, and the host kernel's rate;
6. **vllm-hotset**: the hot set's device path for vLLM without vLLM (the lent machines have
   none): a decode step of 8 layers x 16 rows x 4K tokens, 25% hot, exact and top-k against
   every page resident, outputs checked first;
7. **hostcost**: the tiny reasoner's greedy decode step, transformers' sdpa with its default
   cache against the tiered path with everything hot and with 50% hot (the 1.3x target);
8. **tp**: two tensor-parallel ranks (two GPUs only);
9. **autotune**: a short, time-boxed sweep of each kernel's config space (one problem each),
   winners in ``tuned.json`` (copy it to ``kernels/tuned/<gpu>.json`` to ship it).

``--tiny`` runs every section at toy sizes, also on a CPU (torch backend, host timers): the
CI smoke test of this script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

SECTIONS = ("gate", "calibration", "decode", "pipeline", "split", "vllm-hotset", "hostcost", "tp",
            "autotune")
#: what runs without --sections: the runtime's checks (the kernel sweeps are opt-in; tp skips
#: itself on a machine with one GPU)
DEFAULT_SECTIONS = ("gate", "calibration", "pipeline", "split", "vllm-hotset", "hostcost", "tp")
REPO = Path(__file__).resolve().parent.parent.parent
GATE_TESTS = ("tests/test_decode.py", "tests/test_score.py", "tests/test_sketch.py",
              "tests/test_merge.py", "tests/test_prefill.py", "tests/test_metadata.py",
              "tests/test_copy.py", "tests/test_select.py",
              "tests/test_kernel_edges.py", "tests/test_partial_states.py",
              "tests/test_transfer.py", "tests/test_runtime.py", "tests/test_conservation.py",
              "tests/test_pagemap.py", "tests/test_decode_step.py", "tests/test_graphs.py",
              "tests/test_swapcore.py", "tests/test_split.py", "tests/test_vllm_device.py")


# --- timing --------------------------------------------------------------------------------


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench(fn, dev: torch.device, *, warmup_ms: int = 20, rep_ms: int = 80) -> float:
    """Median seconds of ``fn()``: CUDA events through ``triton.testing.do_bench`` on a GPU, a
    host timer elsewhere."""
    if dev.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                       return_mode="median") / 1e3
    fn()
    times = []
    end = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@triton.jit
def _empty_kernel(ptr, N: tl.constexpr):
    pass


# --- sections ------------------------------------------------------------------------------


def section_gate(ctx: dict) -> dict:
    """The GPU subset of the test suite; pass/fail with the tail of its output."""
    if ctx["tiny"]:
        tests = ["tests/test_merge.py"]
    else:
        tests = list(GATE_TESTS)
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    # -P: the checkout's own tierattn/ folder (not a package with kernels/) must not shadow the
    # installed package when pytest runs from the repository root
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    cmd = [sys.executable, *safe_path, "-m", "pytest", "-q", "--maxfail=10",
           "-p", "no:cacheprovider", "-n", str(workers), *tests]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=ctx["gate_timeout"])
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\n[gate] timed out after {ctx['gate_timeout']} s"
        rc = -1
    (ctx["out"] / "gate.log").write_text(out)
    summary = [ln for ln in out.splitlines() if " passed" in ln or " failed" in ln
               or " error" in ln]
    return {"passed": rc == 0, "returncode": rc, "seconds": time.perf_counter() - t0,
            "command": " ".join(cmd[1:]), "summary": summary[-1] if summary else "",
            "tail": out[-3000:] if rc != 0 else out[-600:]}


def section_calibration(ctx: dict) -> dict:
    dev, tiny = ctx["dev"], ctx["tiny"]
    cuda = dev.type == "cuda"
    n = (1 << 22) if tiny else (1 << 30)
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    res: dict = {"bytes": n}
    t = bench(lambda: y.copy_(x), dev)
    res["d2d_Bps"] = 2 * n / t  # read + written
    host = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory() if cuda else \
        torch.randint(0, 255, (n,), dtype=torch.uint8)
    res["h2d_Bps"] = n / bench(lambda: x.copy_(host, non_blocking=True), dev)
    res["d2h_Bps"] = n / bench(lambda: host.copy_(x, non_blocking=True), dev)
    # one copy call per page, pinned host -> device, pages scattered on the host
    m = 64 if tiny else 512
    for kib in (64, 16):
        width = kib * 1024
        src = host[: m * width].view(m, width)
        dst = y[: m * width].view(m, width)
        perm = torch.randperm(m).tolist()

        def per_page(src=src, dst=dst, perm=perm):
            for i, j in enumerate(perm):
                dst[i].copy_(src[j], non_blocking=True)

        t = bench(per_page, dev)
        res[f"memcpy_{kib}k_call_s"] = t / m
        res[f"memcpy_{kib}k_Bps"] = m * width / t
    res["memcpy_call_s"] = max(0.0, res["memcpy_64k_call_s"] - 65536 / res["h2d_Bps"])
    # an empty kernel: GPU time per launch back to back, and the host's cost to issue one
    if cuda or os.environ.get("TRITON_INTERPRET") == "1":
        k = 100
        launch = lambda: [_empty_kernel[(1,)](x, N=1) for _ in range(k)]  # noqa: E731
        launch()
        res["kernel_launch_s"] = bench(launch, dev) / k
        _sync(dev)
        t0 = time.perf_counter()
        launch()
        res["kernel_launch_host_s"] = (time.perf_counter() - t0) / k
        _sync(dev)
    else:
        res["kernel_launch_s"] = res["kernel_launch_host_s"] = None
    # our page-copy kernel: one launch moving scattered 64 KiB pages from a pinned pool
    from tierattn.kernels import copy_pages

    pages = 64 if tiny else 2048
    shape = (2, 16, 8, 128) if not tiny else (2, 4, 2, 32)
    pool = torch.randn(pages * 2, *shape, dtype=torch.bfloat16)
    pool = pool.pin_memory() if cuda else pool
    staging = torch.empty(pages, *shape, dtype=torch.bfloat16, device=dev)
    src = torch.randperm(pages * 2)[:pages].to(torch.int32).to(dev)
    dst = torch.arange(pages, dtype=torch.int32, device=dev)
    backend = "auto" if cuda else "torch"
    copy_pages(pool, src, staging, dst, backend=backend)
    ok = torch.equal(staging.cpu(), pool[src.long().cpu()])
    t = bench(lambda: copy_pages(pool, src, staging, dst, validate=False, backend=backend), dev)
    res["uva_copy_pages"] = pages
    res["uva_copy_Bps"] = staging.numel() * staging.element_size() / t
    res["uva_copy_correct"] = ok
    name = torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu"
    profile = {
        "name": f"{name} (measured)", "measured": True,
        "source": f"tierattn gpu_check {ctx['date']}, commit {ctx['commit']}",
        "hbm_bandwidth_Bps": res["d2d_Bps"], "hbm_efficiency": 1.0,
        "h2d_bandwidth_Bps": res["h2d_Bps"], "d2h_bandwidth_Bps": res["d2h_Bps"],
        "uva_copy_bandwidth_Bps": res["uva_copy_Bps"], "memcpy_call_s": res["memcpy_call_s"],
        "kernel_launch_s": res["kernel_launch_s"] or 0.0,
    }
    (ctx["out"] / "hardware-measured.json").write_text(json.dumps(profile, indent=2) + "\n")
    ctx["profile"] = profile
    res["profile"] = profile
    return res


def section_decode(ctx: dict) -> dict:
    """Sparse paged decode vs SDPA over the full context."""
    from tierattn.kernels import PageTable, sparse_decode

    dev, tiny = ctx["dev"], ctx["tiny"]
    hq, hkv, d, ps = (32, 8, 128, 16) if not tiny else (4, 2, 32, 16)
    batches = (1, 8, 64) if not tiny else (1, 2)
    contexts = (4096, 32768, 131072) if not tiny else (256, 512)
    budgets = (None, 4096, 2048) if not tiny else (None, 128)
    backend = "auto" if dev.type == "cuda" else "torch"
    bw = ctx.get("profile", {}).get("hbm_bandwidth_Bps")
    try:
        from flash_attn import flash_attn_with_kvcache  # noqa: F401
        has_flash = True
    except ImportError:
        has_flash = False
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    smax = max(contexts)
    for b in batches:
        # one pool and one contiguous K/V per batch size, at the longest context
        mp = smax // ps
        pool = torch.randn(b * mp, 2, ps, hkv, d, dtype=torch.bfloat16, device=dev,
                           generator=gen)
        # SDPA's K/V are the same tokens, laid out [B, H_kv, S, D]
        kv = pool.view(b, mp, 2, ps, hkv, d).permute(2, 0, 4, 1, 3, 5).reshape(2, b, hkv,
                                                                               smax, d)
        k_all, v_all = kv[0].contiguous(), kv[1].contiguous()
        del kv
        q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=dev, generator=gen)
        for s in contexts:
            n_pages = s // ps
            k, v = k_all[:, :, :s], v_all[:, :, :s]
            # GQA without copies: the G query heads of a KV head act as G query rows
            qg = q.view(b, hkv, hq // hkv, d)

            def sdpa(qg=qg, k=k, v=v):
                return torch.nn.functional.scaled_dot_product_attention(qg, k, v)

            t_sdpa = bench(sdpa, dev)
            ref_full = sdpa().reshape(b, hq, d)
            for budget in budgets:
                sel_pages = n_pages if budget is None else min(n_pages, budget // ps)
                if budget is None:
                    pages = torch.arange(n_pages, device=dev).repeat(b, 1)
                else:  # a random selection that keeps the first and the last page
                    mid = torch.rand(b, n_pages - 2, device=dev, generator=gen).argsort(-1)
                    mid = mid[:, : sel_pages - 2] + 1
                    pages = torch.cat([torch.zeros(b, 1, dtype=mid.dtype, device=dev), mid,
                                       torch.full((b, 1), n_pages - 1, device=dev,
                                                  dtype=mid.dtype)], 1).sort(-1).values
                slots = (pages + torch.arange(b, device=dev)[:, None] * mp).to(torch.int32)
                indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * sel_pages
                table = PageTable.from_csr(indptr, slots.flatten().contiguous(),
                                           torch.full((b,), ps, dtype=torch.int32, device=dev))
                run = lambda table=table, q=q, pool=pool: sparse_decode(  # noqa: E731
                    q, pool, table, validate=False, backend=backend)
                out = run().out
                if budget is None:
                    ref = ref_full
                else:  # SDPA over exactly the selected tokens
                    tok = (pages[:, :, None] * ps + torch.arange(ps, device=dev)).flatten(1)
                    idx = tok[:, None, :, None].expand(b, hkv, tok.shape[1], d)
                    ref = torch.nn.functional.scaled_dot_product_attention(
                        qg, k.gather(2, idx), v.gather(2, idx)).reshape(b, hq, d)
                err = _rel_err(out, ref.float())
                t = bench(run, dev)
                tokens = sel_pages * ps
                nbytes = b * tokens * 2 * hkv * d * 2
                row = {"batch": b, "context": s, "budget": budget or "full",
                       "tokens_read": tokens, "ours_us": t * 1e6, "sdpa_full_us": t_sdpa * 1e6,
                       "speedup_vs_sdpa_full": t_sdpa / t, "ours_TBps": nbytes / t / 1e12,
                       "sdpa_TBps": b * s * 2 * hkv * d * 2 / t_sdpa / 1e12,
                       "ours_pct_of_calibrated": 100 * nbytes / t / bw if bw else None,
                       "rel_err": err, "correct": err < 2e-2}
                rows.append(row)
                print(f"  decode b={b} ctx={s} budget={row['budget']}: {t * 1e6:.1f} us "
                      f"({row['ours_TBps']:.2f} TB/s) vs sdpa {t_sdpa * 1e6:.1f} us, "
                      f"err {err:.1e}", flush=True)
        del pool, k_all, v_all
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "flash_attn": has_flash, "geometry": f"{hq}/{hkv} heads, d={d}, "
            f"page {ps}, bf16", "all_correct": all(r["correct"] for r in rows)}


def section_pipeline(ctx: dict) -> dict:
    """Llama-8B-shaped decode with a GEMM per layer: resident vs ours vs whole-layer."""
    from tierattn.runtime.cache import TieredKVCache
    from tierattn.config import TierConfig
    from tierattn.eval.bench.kv import Geometry, fill_by_chunks, model_row, whole_layer

    dev, tiny = ctx["dev"], ctx["tiny"]
    geo = Geometry() if not tiny else Geometry(layers=4, q_heads=4, kv_heads=2, head_dim=32,
                                               weight_bytes_per_layer=2 * 256 * 1024)
    context = 32768 if not tiny else 512
    steps, warm = (8, 2) if not tiny else (3, 1)
    chunk = 8192 if not tiny else 256
    hidden = 4096 if not tiny else 256
    cols = geo.weight_bytes_per_layer // (2 * hidden)
    gen = torch.Generator(device=dev).manual_seed(1)
    w = torch.randn(hidden, cols, dtype=torch.bfloat16, device=dev, generator=gen)
    x = torch.randn(1, hidden, dtype=torch.bfloat16, device=dev, generator=gen)
    backend = "auto" if dev.type == "cuda" else "torch"

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device=dev, generator=gen)

    def decode_step(cache) -> None:
        for layer in range(geo.layers):
            torch.mm(x, w)
            cache.update(layer, rand(1, geo.kv_heads, 1, geo.head_dim),
                         rand(1, geo.kv_heads, 1, geo.head_dim))
            cache.attend(layer, rand(1, geo.q_heads, 1, geo.head_dim))

    def run_cache(cfg: TierConfig) -> dict:
        cache = TieredKVCache(cfg, num_layers=geo.layers, num_kv_heads=geo.kv_heads,
                              head_dim=geo.head_dim, dtype=torch.bfloat16, device=dev,
                              graph_backend=None if dev.type == "cuda" else "eager")
        fill_by_chunks(cache, context, chunk, lambda t: rand(1, geo.kv_heads, t, geo.head_dim),
                       lambda layer: rand(1, geo.q_heads, 1, geo.head_dim))
        times = []
        for i in range(warm + steps):
            if i == warm:
                cache.telemetry.reset()
            _sync(dev)
            t0 = time.perf_counter()
            decode_step(cache)
            _sync(dev)
            if i >= warm:
                times.append(time.perf_counter() - t0)
        tot = cache.stats()["total"]
        # one more whole decode step (every layer) with any host sync an error
        sync_free = None
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                decode_step(cache)
                sync_free = True
            except RuntimeError as e:
                sync_free = f"synced: {str(e)[:300]}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
        per = steps * geo.layers
        pb = tot["page_bytes"]
        h2d = tot["h2d_decode_bytes"] / per
        # without a prefetch every fetch is late; wasted prefetches are moved but not attended
        late = h2d if cfg.prefetch == "none" or cfg.cuda_graphs else tot["late_misses"] / per * pb
        used = h2d / pb - tot["wasted_prefetches"] / per
        attended = context if cfg.attend == "all" else \
            tot["resident_fraction"].get("hbm", 0) * context + used * cfg.page_size
        row = {"context_tokens": context, "batch": 1, "page_bytes": pb,
               "kernels_per_layer_step": tot["kernel_launches"] / per,
               "copies_per_layer_step": tot["copy_launches_decode"] / per,
               "h2d_bytes_per_layer_step": h2d, "d2h_bytes_per_layer_step":
               tot["d2h_bytes_total"] / per, "late_bytes_per_layer_step": late,
               "attended_tokens": attended}
        host_ms = 1e3 * tot["host_time_s"] / per
        graphs = cache.graphs
        del cache
        return {"ms": 1e3 * statistics.median(times), "host_ms_per_layer": host_ms,
                "prefetch_hit_rate": tot["prefetch_hit_rate"], "counts": row,
                "sync_free_step": sync_free,
                "graph_replays": graphs.replays if graphs is not None else None}

    common = dict(page_size=16, max_context=context + warm + steps + 16,
                  prefill_chunk_size=chunk, backend=backend)
    variants = {
        "all resident": TierConfig.preset("dense", **common),
        "ours offload 50%": TierConfig.preset("offload", hot_budget=0.5, **common),
        "ours offload 50%, sync fetch": TierConfig.preset("offload", hot_budget=0.5,
                                                          prefetch="none", **common),
        "ours topk 10%+10%": TierConfig.preset("topk", hot_budget=0.1, recall_budget=0.1,
                                               recall_scope="sequence", **common),
    }
    # the same with every layer's decode step captured in a CUDA graph and replayed (a split
    # layer's host round trip cannot be captured: those run eagerly, and sync)
    variants["ours split 25%"] = TierConfig.preset("split", hot_budget=0.25, **common)
    variants["ours adaptive 25%"] = TierConfig.preset("adaptive", hot_budget=0.25, **common)
    for name in list(variants):
        if "sync fetch" not in name and "split" not in name and "adaptive" not in name:
            variants[f"{name}, CUDA graphs"] = variants[name].replace(cuda_graphs=True)
    prof = ctx.get("profile")
    res: dict = {"context": context, "layers": geo.layers, "steps": steps, "rows": {}}
    for name, cfg in variants.items():
        try:
            r = run_cache(cfg)
            if prof:
                r["modeled"] = model_row(r["counts"], prof, geo)
            res["rows"][name] = r
            print(f"  pipeline {name}: {r['ms']:.2f} ms/token", flush=True)
        except Exception:
            res["rows"][name] = {"error": traceback.format_exc()[-2000:]}
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    # transformers' whole-layer offloading, its own code (it needs CUDA)
    try:
        from transformers import DynamicCache

        if dev.type != "cuda":
            raise RuntimeError("DynamicCache(offloading=True) needs CUDA")
        hf = DynamicCache(offloading=True)
        qg = lambda: rand(1, geo.kv_heads, geo.q_heads // geo.kv_heads, geo.head_dim)  # noqa
        for layer in range(geo.layers):
            hf.update(rand(1, geo.kv_heads, context, geo.head_dim),
                      rand(1, geo.kv_heads, context, geo.head_dim), layer)
        times = []
        for i in range(warm + steps):
            _sync(dev)
            t0 = time.perf_counter()
            for layer in range(geo.layers):
                torch.mm(x, w)
                k, v = hf.update(rand(1, geo.kv_heads, 1, geo.head_dim),
                                 rand(1, geo.kv_heads, 1, geo.head_dim), layer)
                torch.nn.functional.scaled_dot_product_attention(qg(), k, v)
            _sync(dev)
            if i >= warm:
                times.append(time.perf_counter() - t0)
        wl = whole_layer(context, geo)
        r = {"ms": 1e3 * statistics.median(times),
             "counts": {"h2d_bytes_per_layer_step": wl["h2d_bytes"],
                        "d2h_bytes_per_layer_step": wl["d2h_bytes"],
                        "copies_per_layer_step": wl["copy_calls"]}}
        if prof:
            fake = {"context_tokens": context, "batch": 1, "page_bytes": 65536,
                    "kernels_per_layer_step": 1, "copies_per_layer_step": 0,
                    "h2d_bytes_per_layer_step": 0, "d2h_bytes_per_layer_step": 0,
                    "late_bytes_per_layer_step": 0, "attended_tokens": context}
            r["modeled"] = {"whole_layer_ms": model_row(fake, prof, geo)["whole_layer_ms"]}
        res["rows"]["whole-layer offload (HF DynamicCache)"] = r
        print(f"  pipeline whole-layer: {r['ms']:.2f} ms/token", flush=True)
        del hf
    except Exception:
        res["rows"]["whole-layer offload (HF DynamicCache)"] = {
            "error": traceback.format_exc()[-2000:]}
    base = res["rows"].get("all resident", {}).get("ms")
    for name, r in res["rows"].items():
        if base and "ms" in r:
            r["exposed_vs_resident_ms"] = r["ms"] - base
        # the modeled time of the same design: prefetch-less variants fetch synchronously
        r["modeled_key"] = None if "split" in name or "adaptive" in name else \
            "whole_layer_ms" if name.startswith("whole") else \
            "resident_ms" if name.startswith("all resident") else \
            "sync_ms" if "graphs" in name or "sync" in name else "ours_ms"
        if "ms" in r and r.get("modeled", {}).get(r["modeled_key"]):
            r["measured_over_modeled"] = r["ms"] / r["modeled"][r["modeled_key"]]
    return res


def section_split(ctx: dict) -> dict:
    """Split attention on this machine (:func:`tierattn.eval.bench.host.device_check`):
    ``attend="split"`` against the all-resident cache on the device, and the host kernel's rate
    against a plain read of the same pages with this machine's cores."""
    from tierattn.eval.bench.host import device_check

    return device_check(ctx["dev"], tiny=ctx["tiny"])


def section_vllm_hotset(ctx: dict) -> dict:
    """The hot set's device path without vLLM
    (:func:`tierattn.eval.bench.vllm_hotset.device_check`): exact and top-k decode steps against
    every page resident, outputs checked first."""
    from tierattn.eval.bench.vllm_hotset import device_check

    return device_check(ctx["dev"], timer=bench, tiny=ctx["tiny"])


def section_hostcost(ctx: dict) -> dict:
    """The tiny reasoner's greedy decode step on this device: transformers' sdpa with its
    default cache against the tiered path with everything hot and with 50% hot."""
    from tierattn.eval.bench.hostcost import reasoner_step_times

    tiny = ctx["tiny"]
    return reasoner_step_times(device=ctx["dev"], steps=4 if tiny else 32,
                               repeats=1 if tiny else 3, progress=False, graphs=True)


def section_tp(ctx: dict) -> dict:
    """Two tensor-parallel ranks with NCCL (transformers' ``tp_plan="auto"``), exact offload
    token-identical to one process, DDR and disk tiers: ``tests/tp_worker.py``. Runs only on a
    machine with two GPUs."""
    n = torch.cuda.device_count()
    if n < 2:
        return {"skipped": f"needs two GPUs; this machine has {n}"}
    folder = ctx["out"] / "tp"
    folder.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(REPO / "tests" / "tp_worker.py"), str(folder), "llama,qwen3", "cuda"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    identical = all(row[t]["identical"] for r in ranks for row in r["families"].values()
                    for t in ("ddr", "disk"))
    return {"identical": identical, "ranks": ranks}


def section_autotune(ctx: dict) -> dict:
    """A time-boxed pass over each kernel's config space, one problem each (the decode problem
    is the one where SDPA beat us in this check's first run: batch 64, 32K context)."""
    from tierattn.kernels.autotune import DEFAULT_SHAPES, autotune

    if ctx["dev"].type != "cuda":
        return {"skipped": "autotuning needs CUDA"}
    out = {}
    budget = ctx["autotune_seconds"]
    plan = (("decode", {"batch": 64, "ctx": 32768}, 0.4), ("copy", {"pages": 2048}, 0.2),
            ("score", {"batch": 8, "ctx": 32768}, 0.2), ("prefill", {"q_len": 2048}, 0.2))
    for kernel, change, share in plan:
        shape = {**DEFAULT_SHAPES[kernel][0], **change}
        try:
            out[kernel] = autotune(kernel, shapes=[shape], out_path=ctx["out"] / "tuned.json",
                                   time_budget_s=budget * share, progress=False)
        except Exception:
            out[kernel] = {"error": traceback.format_exc()[-1500:]}
    return out


SECTION_FNS = {"gate": section_gate, "calibration": section_calibration, "split": section_split,
               "vllm-hotset": section_vllm_hotset,
               "decode": section_decode, "pipeline": section_pipeline,
               "hostcost": section_hostcost, "tp": section_tp,
               "autotune": section_autotune}


# --- report --------------------------------------------------------------------------------


def _fmt(v, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# tierattn GPU check: {env['gpu']}", "",
             f"{env['date']} · commit {env['commit']} · torch {env['torch']} · triton "
             f"{env['triton']} · transformers {env['transformers']} · Python {env['python']}", ""]
    s = result["sections"]
    if "split" in s and "error" not in s["split"]:
        sp = s["split"]
        lines += ["## Split attention (measured)", "",
                  f"split vs all-resident, {sp['layers']} layers at {sp['context']} tokens: max "
                  f"relative error {sp['max_rel_err_vs_resident']:.2e}, "
                  f"{_fmt(sp['ms_per_split_layer_step'])} ms per split layer step "
                  f"(host kernel compiled: {sp['host_kernel_compiled']}, "
                  f"{sp['host_threads']} threads)", "",
                  "| dtype | host_decode GB/s | plain read GB/s | ratio |", "|---|---|---|---|"]
        for dt, r in sp["host_rates"].items():
            lines.append(f"| {dt} | {r['host_decode_Bps'] / 1e9:.1f} | "
                         f"{_fmt(r['read_Bps'] and r['read_Bps'] / 1e9, '.1f')} | "
                         f"{_fmt(r['ratio'])} |")
        lines.append("")
    if "vllm-hotset" in s and "error" not in s["vllm-hotset"]:
        v = s["vllm-hotset"]
        lines += ["## The hot set's device path, without vLLM (measured)", "",
                  f"{v['rows']} decode rows x {v['context']} tokens, {v['layers']} layers, heads "
                  f"{v['heads']}, {v['dtype']}, {v['hot_share']:.0%} hot, pinned host tier: "
                  f"{v['pinned_host']}", "",
                  "| run | ms/step | ms/layer | ratio to resident | staged pages/layer | GB/s "
                  "staged | rel err vs resident |", "|---|---|---|---|---|---|---|"]
        for name, r in v["runs"].items():
            lines.append(f"| {name} | {r['ms_per_step']:.3f} | {r['ms_per_layer']:.3f} | "
                         f"{_fmt(r.get('ratio_to_resident'))} | "
                         f"{_fmt(r.get('staged_pages_per_layer'), 'd')} | "
                         f"{_fmt(r.get('staged_GBps'), '.1f')} | "
                         f"{_fmt(r.get('rel_err_vs_resident'), '.2e')} |")
        lines.append("")
    if "gate" in s:
        g = s["gate"]
        lines += ["## Gate", "", f"{'green' if g.get('passed') else 'RED'}: {g.get('summary', '')} "
                  f"({_fmt(g.get('seconds'), '.0f')} s)", ""]
    if "calibration" in s and "error" not in s["calibration"]:
        c = s["calibration"]
        lines += ["## Calibration (measured)", "", "| quantity | value |", "|---|---|",
                  f"| device-to-device copy (read + written) | {c['d2d_Bps'] / 1e12:.2f} TB/s |",
                  f"| pinned host -> device | {c['h2d_Bps'] / 1e9:.1f} GB/s |",
                  f"| device -> pinned host | {c['d2h_Bps'] / 1e9:.1f} GB/s |",
                  f"| one cudaMemcpyAsync of a 64 KiB page | {c['memcpy_64k_call_s'] * 1e6:.2f} us "
                  f"({c['memcpy_64k_Bps'] / 1e9:.1f} GB/s) |",
                  f"| one cudaMemcpyAsync of a 16 KiB page | {c['memcpy_16k_call_s'] * 1e6:.2f} us "
                  f"({c['memcpy_16k_Bps'] / 1e9:.1f} GB/s) |",
                  f"| empty kernel, GPU time per launch / host cost | "
                  f"{_fmt(c['kernel_launch_s'] and c['kernel_launch_s'] * 1e6)} us / "
                  f"{_fmt(c['kernel_launch_host_s'] and c['kernel_launch_host_s'] * 1e6)} us |",
                  f"| our page-copy kernel, {c['uva_copy_pages']} scattered pages from pinned "
                  f"host (UVA) | {c['uva_copy_Bps'] / 1e9:.1f} GB/s "
                  f"({'correct' if c['uva_copy_correct'] else 'WRONG'}) |", ""]
    if "decode" in s and "error" not in s["decode"]:
        dd = s["decode"]
        lines += [f"## Decode sweep ({dd['geometry']}; SDPA reads the full context)", "",
                  "| batch | context | budget | ours us | TB/s | % calibrated | SDPA full us | "
                  "SDPA TB/s | speedup | rel err |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in dd["rows"]:
            lines.append(f"| {r['batch']} | {r['context']} | {r['budget']} | "
                         f"{r['ours_us']:.1f} | {r['ours_TBps']:.2f} | "
                         f"{_fmt(r['ours_pct_of_calibrated'], '.0f')} | {r['sdpa_full_us']:.1f} | "
                         f"{r['sdpa_TBps']:.2f} | {r['speedup_vs_sdpa_full']:.2f} | "
                         f"{r['rel_err']:.1e} |")
        lines.append("")
    if "pipeline" in s and "error" not in s["pipeline"]:
        p = s["pipeline"]
        lines += [f"## Tiered pipeline ({p['layers']} Llama-8B-shaped layers, context "
                  f"{p['context']}, batch 1, GEMM per layer)", "",
                  "| variant | measured ms/token | modeled ms/token | measured/modeled | "
                  "exposed vs resident ms | host ms/layer | prefetch hit rate | step without "
                  "a sync |", "|---|---|---|---|---|---|---|---|"]
        for name, r in p["rows"].items():
            if "error" in r:
                lines.append(f"| {name} | error: {r['error'].splitlines()[-1][:80]} "
                             "| | | | | | |")
                continue
            m = r.get("modeled", {})
            lines.append(f"| {name} | {r['ms']:.2f} | {_fmt(m.get(r.get('modeled_key')))} | "
                         f"{_fmt(r.get('measured_over_modeled'))} | "
                         f"{_fmt(r.get('exposed_vs_resident_ms'))} | "
                         f"{_fmt(r.get('host_ms_per_layer'), '.3f')} | "
                         f"{_fmt(r.get('prefetch_hit_rate'))} | "
                         f"{_fmt(r.get('sync_free_step'))} |")
        lines.append("")
    if "hostcost" in s and "error" not in s["hostcost"]:
        h = s["hostcost"]
        lines += ["## Host cost: tiny reasoner decode step (measured side by side)", "",
                  "| variant | median ms | p10-p90 ms | ratio to sdpa |", "|---|---|---|---|"]
        for name, v in h["variants"].items():
            lines.append(f"| {name} | {v['median_ms']:.3f} | {v['p10_ms']:.3f}-{v['p90_ms']:.3f} "
                         f"| {v['ratio_to_sdpa']:.2f} |")
        lines.append("")
    if "tp" in s and "error" not in s["tp"]:
        tp = s["tp"]
        lines += ["## Tensor parallelism (2 ranks, NCCL)", "",
                  tp.get("skipped") or f"exact offload token-identical to one process on both "
                  f"ranks, DDR and disk tiers: {tp['identical']}", ""]
    if "autotune" in s and "error" not in s["autotune"]:
        from tierattn.kernels.autotune import format_summary

        lines += ["## Autotune (short, time-boxed pass)", "", "```"]
        for kernel, r in s["autotune"].items():
            if isinstance(r, dict) and "keys" in r:
                lines.append(format_summary(r))
            elif kernel != "section_seconds":
                lines.append(f"{kernel}: {str(r)[-600:]}")
        lines += ["```", ""]
    for name, sec in s.items():
        if isinstance(sec, dict) and "error" in sec:
            lines += [f"## {name}: error", "", "```", sec["error"][-1500:], "```", ""]
    return "\n".join(lines)


def _environment(commit: str) -> dict:
    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = None
    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name(0) if cuda else "none (CPU)",
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": tf, "python": platform.python_version(),
            "cuda": torch.version.cuda, "cpu_count": os.cpu_count()}


def _commit() -> str:
    from tierattn.eval.report import git_state

    return (git_state()["commit"] or "unknown")[:12]


def run(out: str | Path, *, sections: tuple[str, ...] = DEFAULT_SECTIONS, tiny: bool = False,
        commit: str | None = None, gate_timeout: int = 200, autotune_seconds: float = 80,
        device: str | None = None) -> dict:
    """Run the sections in order; returns the result dict (also written under ``out``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    commit = commit or _commit()
    from tierattn.eval.report import provenance

    result = {"environment": _environment(commit), "provenance": provenance(), "tiny": tiny,
              "sections": {}}
    ctx = {"dev": dev, "tiny": tiny, "out": out, "commit": commit, "gate_timeout": gate_timeout,
           "autotune_seconds": autotune_seconds, "date": result["environment"]["date"]}
    t_all = time.perf_counter()
    for name in sections:
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            sec = SECTION_FNS[name](ctx)
        except Exception:
            sec = {"error": traceback.format_exc()}
        sec["section_seconds"] = time.perf_counter() - t0
        result["sections"][name] = sec
        result["wall_s"] = time.perf_counter() - t_all
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out / "gpu_check.md").write_text(markdown(result))
        print(f"[gpu_check] {name} done in {sec['section_seconds']:.1f} s"
              + (" (error)" if "error" in sec else ""), flush=True)
        if name == "gate" and not sec.get("passed"):
            print("[gpu_check] the gate is red: no timing. See gate.log.", flush=True)
            break
    return result


def main(argv: list[str] | None = None, prog: str = "python -m tierattn.eval.bench.gpu") -> int:
    ap = argparse.ArgumentParser(prog=prog,
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json/.md and logs")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke test)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    ap.add_argument("--gate-timeout", type=int, default=200)
    ap.add_argument("--autotune-seconds", type=float, default=80)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    sections = tuple(s for s in args.sections.split(",") if s)
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown {bad}; choose from {','.join(SECTIONS)}")
    if not torch.cuda.is_available() and not args.tiny:
        print("gpu_check: no CUDA device here. This check times kernels on a GPU; run it on a "
              "machine with one (or pass --tiny for the CPU smoke test).", file=sys.stderr)
        return 2
    result = run(args.out, sections=sections, tiny=args.tiny, commit=args.commit,
                 gate_timeout=args.gate_timeout, autotune_seconds=args.autotune_seconds,
                 device=args.device)
    print(markdown(result))
    secs = result["sections"]
    ok = all("error" not in s for s in secs.values()) and secs.get("gate", {}).get("passed", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
