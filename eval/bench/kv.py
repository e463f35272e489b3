"""``tierattn bench``: what the tiered runtime moves per generated token, counted exactly, next to
whole-layer offloading and a per-page memcpy design, with modeled H100/H200 times.

For Llama-8B-shaped KV (32 layers, 32 query / 8 KV heads, d=128, bf16, random data, no weights)
at each context and hot budget, the real :class:`~tierattn.runtime.cache.TieredKVCache` prefills the
context and decodes a few tokens; its telemetry gives the counts per layer and step:

* kernel and copy launches, H2D/D2H bytes, HBM-resident fraction, prefetch hits and late
  misses, and pages demoted more than once (a repeated D2H of an unchanged page);
* **whole-layer offloading** as transformers' ``DynamicCache(offloading=True)`` does it
  (``cache_utils.py``: before layer ``l`` runs it prefetches layer ``l+1`` whole, keys and values
  host->device, and after it offloads layer ``l`` whole device->host): counted from that
  algorithm, since it needs CUDA to run;
* a **per-page memcpy** design that moves the same pages as we do with one copy call per page.

Counts do not depend on the device. Times do: the modeled H100/H200 times come from the
formulas in DESIGN.md ("Benchmarks") and a hardware-profile JSON (``eval/hardware/``, nominal
datasheet values until ``python -m tierattn.eval.bench.gpu`` writes a measured one; pass it with
``--hardware``). They are labelled *modeled*; nothing here times a GPU.

Only ``layers`` layers (default 2) are simulated: with random data every layer sees the same
sizes, so per-layer counts are those of any layer, and per-token figures are per-layer figures
times the model's 32 layers. Two layers keep the layer-ahead prefetch ring honest (the last
layer prefetches layer 0 of the next step, as with 32).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig
from tierattn.eval.bench.hostcost import KernelTimer
from tierattn.eval.report import (format_table, git_state, new_results_dir, save_json,
                                  target_lines, write_csv)

__all__ = ["BenchSpec", "Geometry", "fill_by_chunks", "host_summary", "load_profile",
           "model_row", "run_bench", "run_host_bench", "whole_layer", "HARDWARE_DIR"]

HARDWARE_DIR = Path(__file__).resolve().parent.parent / "hardware"
#: the runtime modes a bench row can run (see :attr:`BenchSpec.modes`)
MODES = ("offload", "topk", "topk-sync")


@dataclass(frozen=True)
class Geometry:
    """The model whose KV is benchmarked (default: Llama-3-8B)."""

    layers: int = 32
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2  # bf16
    #: weights one decoder layer reads per step (Llama-3-8B: q,o 4096^2, k,v 4096x1024,
    #: MLP 3 x 4096x14336 = 218.1M params in bf16); the compute a prefetch can hide behind
    weight_bytes_per_layer: int = 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class BenchSpec:
    """What ``tierattn bench kv`` runs (the defaults are the committed full run)."""

    contexts: tuple[int, ...] = (4096, 32768, 131072)
    budgets: tuple[float, ...] = (1.0, 0.5, 0.25, 0.1)
    #: ``offload`` (exact: every cold page comes back each step, layer-ahead prefetch),
    #: ``topk`` (hot set + the recall budget's best cold pages by Quest bound, the previous
    #: step's selection prefetched a layer ahead) and ``topk-sync`` (the same without prefetch:
    #: the recall is fetched when the layer runs, so nothing is fetched in vain)
    modes: tuple[str, ...] = MODES
    recall: float = 0.1  # topk: cold tokens recalled per step, a fraction of the context
    layers: int = 2  # layers simulated (see the module docstring)
    #: decode steps counted after the prefill: one page's worth, so the occasional demotion of
    #: a page (one per page filled) is amortised as in a long run
    steps: int = 16
    batch: int = 1
    page_size: int = 16
    prefill_chunk: int = 8192
    #: consecutive decode queries are ``rho * q_prev + sqrt(1 - rho^2) * noise`` per layer:
    #: real models' queries drift slowly (which is what makes layer-ahead prefetch of a top-k
    #: selection pay); rho = 0 draws every query afresh, the worst case for prefetching
    query_rho: float = 0.9
    seed: int = 0
    hardware: tuple[str, ...] = ("h100", "h200")
    host_cost: bool = True  # also time the tiny reasoner's decode step against sdpa
    host_steps: int = 32  # decode steps per timed repeat of the host-cost measurement
    host_repeats: int = 5
    geometry: Geometry = field(default_factory=Geometry)

    @classmethod
    def smoke(cls) -> BenchSpec:
        """The reduced run CI does (seconds on a CPU): every code path, small sizes."""
        return cls(contexts=(1024, 4096), budgets=(1.0, 0.5, 0.1), steps=4, prefill_chunk=1024,
                   host_steps=4, host_repeats=1)

    def replace(self, **changes) -> BenchSpec:
        return dataclasses.replace(self, **changes)

    def name(self) -> str:
        ctx = "_".join(f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in self.contexts)
        return f"bench-ctx{ctx}-L{self.layers}-s{self.steps}-b{self.batch}-seed{self.seed}"


# --- hardware profiles and the performance model -------------------------------------------

PROFILE_KEYS = ("hbm_bandwidth_Bps", "hbm_efficiency", "h2d_bandwidth_Bps", "d2h_bandwidth_Bps",
                "uva_copy_bandwidth_Bps", "memcpy_call_s", "kernel_launch_s")


def load_profile(name_or_path: str | Path) -> dict:
    """A hardware profile: a name under ``eval/hardware/`` (``h100``, ``h200``) or a JSON path
    (e.g. the ``hardware-measured.json`` a GPU check wrote)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = HARDWARE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))
        raise FileNotFoundError(f"hardware profile {str(name_or_path)!r} not found; pass one of "
                                f"{known} or a JSON file path.")
    prof = json.loads(path.read_text())
    missing = [k for k in PROFILE_KEYS if not isinstance(prof.get(k), (int, float))]
    if missing:
        raise ValueError(f"hardware profile {path} lacks numeric {missing}; see "
                         f"{HARDWARE_DIR / 'h200.json'} for the fields.")
    return prof


def whole_layer(context: int, geo: Geometry, batch: int = 1) -> dict:
    """Per layer and decode step, what ``DynamicCache(offloading=True)`` moves at ``context``
    tokens: layer ``l+1`` comes host->device whole (keys and values: 2 copies) before layer
    ``l`` runs, layer ``l`` (one token longer) goes device->host whole after it (2 copies); HBM
    holds two layers' KV of ``geo.layers``."""
    kv = geo.kv_bytes_per_token_layer * batch
    return {"h2d_bytes": context * kv, "d2h_bytes": (context + 1) * kv, "copy_calls": 4,
            "resident_hbm": min(1.0, 2 / geo.layers)}


def model_row(row: dict, prof: dict, geo: Geometry) -> dict:
    """Modeled milliseconds per generated token (all ``geo.layers`` layers) for: every page
    resident, ours (layer-ahead prefetch), ours with synchronous fetch, the per-page memcpy
    design, and whole-layer offloading. Per layer (DESIGN.md, Benchmarks):

    * compute ``T_c = W / (eta BW_hbm) + bytes_attended / (eta BW_hbm) + n_kernels t_launch``
      (a batch-1 step reads every weight once; decode attention reads every attended byte once);
    * ours: a copy is one launch of the page-copy kernel over UVA (``launch + bytes / uva``);
      a layer-ahead prefetch overlaps the previous layer's weight reads, exposed ``max(0,
      T_copy - W/(eta BW_hbm))``; late misses (every fetch when prefetching is off) and
      demotions (the compute stream waits on them) are exposed whole;
    * per-page design: the same pages, ``memcpy_call + page_bytes / h2d`` per page, same overlap;
    * whole-layer offloading: its D2H runs on the compute stream (``.to("cpu",
      non_blocking=True)`` after the update), its H2D on a side stream overlapping the layer;
      its per-step ``torch.cat`` of the layer's KV in HBM is left out (in its favour).
    """
    hbm = prof["hbm_bandwidth_Bps"] * prof["hbm_efficiency"]
    launch, call = prof["kernel_launch_s"], prof["memcpy_call_s"]
    uva, h2d, d2h = (prof["uva_copy_bandwidth_Bps"], prof["h2d_bandwidth_Bps"],
                     prof["d2h_bandwidth_Bps"])
    kv = geo.kv_bytes_per_token_layer * row["batch"]
    t_w = geo.weight_bytes_per_layer / hbm
    ctx = row["context_tokens"]

    def compute(tokens: float, kernels: float) -> float:
        return t_w + tokens * kv / hbm + kernels * launch

    resident = compute(ctx, 1)
    t_c = compute(row["attended_tokens"], row["kernels_per_layer_step"])
    late_b = row["late_bytes_per_layer_step"]
    pre_b = row["h2d_bytes_per_layer_step"] - late_b
    d2h_b = row["d2h_bytes_per_layer_step"]
    # ours: one launch per copy; the late part and demotions are waited on
    late_t = (launch + late_b / uva) if late_b else 0.0
    dem_t = (launch + d2h_b / uva) if d2h_b else 0.0
    pre_t = (launch + pre_b / uva) if pre_b else 0.0
    ours = t_c + max(0.0, pre_t - t_w) + late_t + dem_t
    sync = t_c + pre_t + late_t + dem_t
    # per page: the same pages, one memcpy call each
    pages_pre = pre_b / row["page_bytes"]
    pages_late = late_b / row["page_bytes"]
    per_page = (t_c + max(0.0, pages_pre * call + pre_b / h2d - t_w)
                + pages_late * call + late_b / h2d + d2h_b / d2h
                + (d2h_b / row["page_bytes"]) * call)
    wl = whole_layer(ctx, geo, row["batch"])
    wl_c = compute(ctx, 1) + 2 * call + wl["d2h_bytes"] / d2h
    whole = wl_c + max(0.0, 2 * call + wl["h2d_bytes"] / h2d - wl_c)
    ms = 1e3 * geo.layers
    return {"resident_ms": resident * ms, "ours_ms": ours * ms, "sync_ms": sync * ms,
            "per_page_ms": per_page * ms, "whole_layer_ms": whole * ms,
            "ours_stall_ms": (ours - t_c) * ms}


# --- running the runtime -------------------------------------------------------------------


class _Queries:
    """Per-layer decode queries that drift: ``q_t = rho q_{t-1} + sqrt(1 - rho^2) eps``."""

    def __init__(self, spec: BenchSpec, gen: torch.Generator) -> None:
        g = spec.geometry
        self.shape = (spec.batch, g.q_heads, 1, g.head_dim)
        self.rho, self.gen = spec.query_rho, gen
        self.prev = [torch.randn(self.shape, generator=gen) for _ in range(spec.layers)]

    def next(self, layer: int) -> torch.Tensor:
        eps = torch.randn(self.shape, generator=self.gen)
        q = self.rho * self.prev[layer] + math.sqrt(1 - self.rho ** 2) * eps
        self.prev[layer] = q
        return q


def _config(spec: BenchSpec, context: int, mode: str, budget: float, backend: str) -> TierConfig:
    extra = {"recall_budget": spec.recall, "recall_scope": "sequence"} \
        if mode != "offload" else {}
    if mode == "topk-sync":
        extra["prefetch"] = "none"
    return TierConfig.preset(mode.removesuffix("-sync"), hot_budget=budget,
                             page_size=spec.page_size,
                             max_context=context + spec.steps + spec.page_size,
                             prefill_chunk_size=min(spec.prefill_chunk, context),
                             backend=backend, **extra)


def _cold_pages(cache: TieredKVCache) -> int:
    return sum(n for layer in cache.residency() for kind, n in layer.items() if kind != "hbm")


def fill_by_chunks(cache: TieredKVCache, context: int, chunk: int,
                   kv: Callable[[int], torch.Tensor], q: Callable[[int], torch.Tensor]) -> None:
    """Prefill ``context`` tokens into every layer of ``cache``, ``chunk`` at a time.

    Only a chunk's last token queries (``q(layer)``: ``[B, H_q, 1, D]``): the cache gets the
    same pages, importance from a decode-style attention and the same demotions, without an
    O(context^2) prefill attention that a CPU could not run at 128K tokens. ``kv(t)`` gives one
    ``[B, H_kv, t, D]`` tensor (called for K, then V).
    """
    for start in range(0, context, chunk):
        t = min(chunk, context - start)
        for layer in range(cache.num_layers):
            cache.update(layer, kv(t), kv(t))
            cache.attend(layer, q(layer))


def run_row(spec: BenchSpec, context: int, mode: str, budget: float, *,
            device: torch.device, backend: str) -> dict:
    """Prefill ``context`` random tokens, decode ``spec.steps`` more, return the counts."""
    g = spec.geometry
    cfg = _config(spec, context, mode, budget, backend)
    cache = TieredKVCache(cfg, num_layers=spec.layers, num_kv_heads=g.kv_heads,
                          head_dim=g.head_dim, batch_size=spec.batch, dtype=torch.bfloat16,
                          device=device)
    gen = torch.Generator().manual_seed(spec.seed)
    queries = _Queries(spec, gen)

    def kv(t: int) -> torch.Tensor:
        return torch.randn(spec.batch, g.kv_heads, t, g.head_dim, generator=gen,
                           dtype=torch.float32).to(device, torch.bfloat16)

    fill_by_chunks(cache, context, cfg.prefill_chunk_size, kv,
                   lambda layer: queries.next(layer).to(device, torch.bfloat16))
    cache.telemetry.reset()
    cold_before = _cold_pages(cache)
    wall = time.perf_counter()
    # host orchestration = update/attend wall time minus the time inside kernel and copy calls
    with KernelTimer(cache) as timer:
        for _ in range(spec.steps):
            for layer in range(spec.layers):
                cache.update(layer, kv(1), kv(1))
                cache.attend(layer, queries.next(layer).to(device, torch.bfloat16))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - wall
    host = timer.summary()
    tot = cache.stats()["total"]
    per = spec.steps * spec.layers  # layer-steps counted
    page_bytes = tot["page_bytes"]
    h2d = tot["h2d_decode_bytes"] / per
    d2h = tot["d2h_bytes_total"] / per
    # with prefetching off every fetch happens when the layer runs (telemetry counts late
    # misses only against a prefetch)
    late_pages = h2d / page_bytes if cfg.prefetch == "none" else tot["late_misses"] / per
    # pages never come back to HBM, so every demotion should make one more page cold; a page
    # demoted twice shows up as a demotion without a new cold page
    repeated = tot["demoted_pages"] - (_cold_pages(cache) - cold_before)
    # cold tokens attended per sequence and step: what was fetched, less what was fetched in vain
    used_pages = h2d / page_bytes - tot["wasted_prefetches"] / per
    cold_per_layer = used_pages * spec.page_size / spec.batch
    hot_tokens = tot["resident_fraction"].get("hbm", 0.0) * (context + spec.steps)
    attended = context + spec.steps if mode == "offload" else hot_tokens + cold_per_layer
    wl = whole_layer(context, g, spec.batch)
    row = {
        "context": f"{context // 1024}K" if context % 1024 == 0 else str(context),
        "context_tokens": context, "mode": mode, "hot_budget": budget,
        "recall": spec.recall if mode != "offload" else None, "batch": spec.batch,
        "page_bytes": page_bytes,
        "kernels_per_layer_step": tot["kernel_launches"] / per,
        "copies_per_layer_step": tot["copy_launches_decode"] / per,
        "h2d_copies_per_layer_step": (tot["copy_launches_decode"] - tot["d2h_launches_decode"])
        / per,
        "d2h_copies_per_layer_step": tot["d2h_launches_decode"] / per,
        "h2d_bytes_per_layer_step": h2d, "d2h_bytes_per_layer_step": d2h,
        "late_bytes_per_layer_step": late_pages * page_bytes,
        "h2d_bytes_per_token": h2d * g.layers, "d2h_bytes_per_token": d2h * g.layers,
        "resident_hbm": tot["resident_fraction"].get("hbm", 0.0),
        "prefetch_hit_rate": tot["prefetch_hit_rate"],
        "late_misses_per_layer_step": late_pages,
        "wasted_prefetch_pages_per_layer_step": tot["wasted_prefetches"] / per,
        "repeated_d2h_pages": repeated,
        "attended_tokens": attended,
        "whole_layer_h2d_bytes_per_token": wl["h2d_bytes"] * g.layers,
        "whole_layer_d2h_bytes_per_token": wl["d2h_bytes"] * g.layers,
        "whole_layer_copies_per_layer_step": wl["copy_calls"],
        "whole_layer_resident_hbm": wl["resident_hbm"],
        "h2d_ratio_vs_whole_layer": h2d * g.layers / (wl["h2d_bytes"] * g.layers),
        "per_page_copies_per_layer_step": (h2d + d2h) / page_bytes,
        "host_orchestration_us_per_layer_step": host["attend_host_us_mean"]
        + host["update_host_us_mean"],
        "kernel_us_per_layer_step": host["attend_kernel_us_mean"] + host["update_kernel_us_mean"],
        "cpu_wall_s": wall,
    }
    # the copy ratio to the per-page design (None when nothing moved)
    row["copies_ratio_vs_per_page"] = (row["copies_per_layer_step"]
                                       / row["per_page_copies_per_layer_step"]
                                       if row["per_page_copies_per_layer_step"] else None)
    return row


# --- the suite -----------------------------------------------------------------------------

TABLE = [("context", "context", "s"), ("mode", "mode", "s"), ("hot", "hot_budget", ".2f"),
         ("kern/L/step", "kernels_per_layer_step", ".2f"),
         ("H2D copies/L/step", "h2d_copies_per_layer_step", ".2f"),
         ("D2H copies/L/step", "d2h_copies_per_layer_step", ".3f"),
         ("H2D MB/token", "h2d_mb_per_token", ".1f"), ("D2H MB/token", "d2h_mb_per_token", ".2f"),
         ("whole-layer H2D MB", "whole_layer_h2d_mb_per_token", ".0f"),
         ("ours/whole", "h2d_ratio_vs_whole_layer", ".3f"),
         ("per-page copies/L/step", "per_page_copies_per_layer_step", ".0f"),
         ("HBM resident", "resident_hbm", ".2f"), ("hit rate", "prefetch_hit_rate", ".2f"),
         ("late/L/step", "late_misses_per_layer_step", ".1f"),
         ("rep. D2H", "repeated_d2h_pages", "d"),
         ("host us/L/step", "host_orchestration_us_per_layer_step", ".0f")]


def _modeled_table(hw: str) -> list[tuple[str, str, str]]:
    return [("context", "context", "s"), ("mode", "mode", "s"), ("hot", "hot_budget", ".2f")] + [
        (f"{name} ms", f"{hw}_{key}", ".2f") for name, key in
        (("resident", "resident_ms"), ("ours", "ours_ms"), ("sync fetch", "sync_ms"),
         ("per-page", "per_page_ms"), ("whole-layer", "whole_layer_ms"))]


def targets(rows: list[dict], host: dict | None) -> list[dict]:
    """The issue's targets, each with the measured value and whether it is met."""
    out = []
    for mode in MODES:
        moving = [r for r in rows if r["h2d_bytes_per_layer_step"] > 0 and r["mode"] == mode]
        if not moving:
            continue
        h2d = max(r["h2d_copies_per_layer_step"] for r in moving)
        d2h = max(r["d2h_copies_per_layer_step"] for r in moving)
        out.append({"target": f"{mode}: one H2D copy launch per layer per step",
                    "value": f"max {h2d:.2f} H2D (+ {d2h:.3f} D2H demotion launches)",
                    "met": h2d <= 1.0 + 1e-9})
    for mode, bud, want, what in (("topk", None, 0.1, "topk: >= 10x fewer H2D bytes/token "
                                   "than whole-layer at 32K"),
                                  ("topk-sync", None, 0.1, "topk-sync: >= 10x fewer H2D "
                                   "bytes/token than whole-layer at 32K"),
                                  ("offload", 0.5, 0.5, "offload 50% hot: <= 1/2 of whole-layer "
                                   "H2D at 32K")):
        sel = [r for r in rows if r["mode"] == mode and r["context_tokens"] == 32768
               and (bud is None or r["hot_budget"] == bud) and r["hot_budget"] < 1.0]
        if sel:
            worst = max(r["h2d_ratio_vs_whole_layer"] for r in sel)
            out.append({"target": what, "value": f"ours/whole-layer {worst:.4f} "
                        f"({1 / worst if worst else float('inf'):.2f}x fewer)",
                        "met": worst <= want})
    rep = sum(r["repeated_d2h_pages"] for r in rows)
    out.append({"target": "no repeated D2H of unchanged pages", "value": f"{rep} pages",
                "met": rep == 0})
    if host:
        ratio = host["ratios"]["tiered_hot100"]
        out.append({"target": "host overhead, everything hot: <= 1.3x sdpa step (tiny reasoner)",
                    "value": f"{ratio:.2f}x", "met": ratio <= 1.3})
    return out


def run_bench(spec: BenchSpec = BenchSpec(), *, out_root: str | Path | None = "results",
              device: str | None = None, hardware_files: tuple[str, ...] = (),
              progress: bool = True) -> dict:
    """Run every (context, mode, budget) row, model the times, write the results folder."""
    bad = [m for m in spec.modes if m not in MODES]
    if bad:  # before any row runs: a full run takes minutes
        raise ValueError(f"bench modes {bad} are not among {MODES}; pass --modes with those.")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # on CPU the kernels' torch references run (the interpreter would take hours at 128K)
    backend = "auto" if dev.type == "cuda" else "torch"
    profiles = {name: load_profile(name) for name in spec.hardware}
    for path in hardware_files:
        profiles[Path(path).stem] = load_profile(path)
    combos = [(c, m, b) for c in spec.contexts for m in spec.modes for b in spec.budgets]
    rows = []
    t0 = time.perf_counter()
    for c, m, b in tqdm(combos, desc="bench rows", unit="row", disable=not progress):
        row = run_row(spec, c, m, b, device=dev, backend=backend)
        for name, prof in profiles.items():
            row.update({f"{name}_{k}": v for k, v in model_row(row, prof, spec.geometry).items()})
        mb = 1e-6
        row["h2d_mb_per_token"] = row["h2d_bytes_per_token"] * mb
        row["d2h_mb_per_token"] = row["d2h_bytes_per_token"] * mb
        row["whole_layer_h2d_mb_per_token"] = row["whole_layer_h2d_bytes_per_token"] * mb
        rows.append(row)
    host = None
    if spec.host_cost:
        from tierattn.eval.bench.hostcost import reasoner_step_times

        host = reasoner_step_times(steps=spec.host_steps, repeats=spec.host_repeats,
                                   progress=progress)
    result = {
        "spec": {**asdict(spec), "geometry": asdict(spec.geometry)},
        "environment": {"device": str(dev), "backend": backend, "torch": torch.__version__,
                        "commit": git_state()["commit"],
                        "python": platform.python_version(), "machine": platform.machine(),
                        "cpu_count": __import__("os").cpu_count()},
        "profiles": profiles,
        "rows": rows,
        "host_cost": host,
        "targets": targets(rows, host),
        "wall_s": time.perf_counter() - t0,
    }
    if out_root:
        out = new_results_dir(out_root, spec.name())
        result["out"] = str(out)
        save_json(result, out / "results.json", quiet=True)
        write_csv(rows, out / "rows.csv")
        (out / "summary.md").write_text(markdown(result))
        result["plots"] = _plots(rows, profiles, out)
    return result


#: the host-cost rows of ``tierattn bench --host`` and their targets (issue: runtime v2)
HOST_CONTEXTS, HOST_BATCHES = (4096, 32768), (1, 8)
HOST_TARGETS = {"dense": (60.0, 3), "offload": (60.0, 5), "topk": (100.0, None)}
HOST_TABLE = [("variant", "variant", "s"), ("context", "context", "d"), ("batch", "batch", "d"),
              ("host us/L/step", "host_us_per_layer_step", ".1f"),
              ("median", "host_us_median", ".1f"),
              ("launches/L/step", "launches_per_layer_step", ".2f"),
              ("device reads/L/step", "device_reads_per_layer_step", ".2f"),
              ("torch ops/L/step", "torch_ops_per_layer_step", ".1f"),
              ("views/L/step", "views_per_layer_step", ".1f"),
              ("async D2H/L/step", "to_host_copies_per_layer_step", ".3f")]


def run_host_bench(*, contexts: tuple[int, ...] = HOST_CONTEXTS,
                   batches: tuple[int, ...] = HOST_BATCHES, steps: int = 64,
                   out_root: str | Path | None = "results", progress: bool = True) -> dict:
    """``tierattn bench --host``: the runtime's own work per layer and decode step
    (:func:`~tierattn.eval.bench.hostcost.host_row`: kernels replaced by instant stubs; host reads
    counted on the meta device) for every variant, context and batch; writes ``host.csv``
    and ``host.json`` to a new results folder."""
    from tierattn.eval.bench.hostcost import HOST_VARIANTS, host_row

    combos = [(v, c, b) for v in HOST_VARIANTS for c in contexts for b in batches]
    rows = [host_row(v, c, b, steps=steps)
            for v, c, b in tqdm(combos, desc="host rows", unit="row", disable=not progress)]
    out = []
    for r in rows:
        if (r["context"], r["batch"]) != (4096, 1) or r["variant"] not in HOST_TARGETS:
            continue
        us, launches = HOST_TARGETS[r["variant"]]
        out.append({"target": f"{r['variant']} 4K batch 1: <= {us:.0f} us host per layer and "
                    "step", "value": f"{r['host_us_per_layer_step']:.1f} us",
                    "met": r["host_us_per_layer_step"] <= us})
        if launches is not None:
            out.append({"target": f"{r['variant']}: <= {launches} launches per layer and step",
                        "value": f"{r['launches_per_layer_step']:.2f}",
                        "met": r["launches_per_layer_step"] <= launches})
    reads = max(r["device_reads_per_layer_step"] for r in rows)
    out.append({"target": "0 host reads of device data in a decode step (every row)",
                "value": f"max {reads:.2f} per layer and step", "met": reads == 0})
    result = {"rows": rows, "targets": out, "steps": steps, "commit": git_state()["commit"],
              "environment": {"torch": torch.__version__, "python": platform.python_version(),
                              "machine": platform.machine()}}
    if out_root:
        folder = new_results_dir(out_root, "host-ctx" + "_".join(
            f"{c // 1024}k" for c in contexts) + "-b" + "_".join(map(str, batches)))
        result["out"] = str(folder)
        save_json(result, folder / "host.json", quiet=True)
        write_csv([{k: v for k, v in r.items() if k != "read_sites"} for r in rows],
                  folder / "host.csv")
    return result


def host_summary(result: dict) -> str:
    """The printed report of :func:`run_host_bench`."""
    lines = ["Host cost of the tiered runtime per layer and decode step (kernels replaced by "
             "instant stubs; CPU wall time minus the stubs; reads counted on the meta device; "
             f"{result['steps']} decode steps after the prefill, structural work included):",
             format_table(result["rows"], HOST_TABLE)] + target_lines(result["targets"])
    if result.get("out"):
        lines.append(f"\nresults: {result['out']}/host.csv, host.json")
    return "\n".join(lines)


def _plots(rows: list[dict], profiles: dict, out: Path) -> list[str]:
    """H2D bytes per token against the hot budget (log scale), per context: ours (offload,
    topk) against whole-layer offloading; and the modeled ms/token per design."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional (the eval extra installs matplotlib)
        return []
    contexts = sorted({r["context_tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.6), squeeze=False)
    for ax, c in zip(axes[0], contexts):
        sel = [r for r in rows if r["context_tokens"] == c]
        for mode, style in (("offload", "o-"), ("topk", "s-"), ("topk-sync", "^--")):
            pts = sorted((r["hot_budget"], r["h2d_bytes_per_token"]) for r in sel
                         if r["mode"] == mode and r["h2d_bytes_per_token"] > 0)
            if pts:
                ax.plot(*zip(*pts), style, label=f"ours: {mode}")
        ax.axhline(sel[0]["whole_layer_h2d_bytes_per_token"], color="k", ls="--",
                   label="whole-layer offload")
        ax.set_yscale("log")
        ax.set_title(f"context {sel[0]['context']}")
        ax.set_xlabel("hot budget (fraction in HBM)")
        ax.set_ylabel("H2D bytes per token (32 layers)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "h2d_bytes_vs_budget.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    hw = next((n for n in ("h200", "h100") if n in profiles), next(iter(profiles), None))
    if hw:
        sel = [r for r in rows if r["hot_budget"] < 1.0]
        labels = [f"{r['context']} {r['mode']} {r['hot_budget']:.2f}" for r in sel]
        fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(sel)), 4.0))
        x = range(len(sel))
        for key, name in (("resident_ms", "all resident"), ("ours_ms", "ours"),
                          ("sync_ms", "ours, sync fetch"), ("whole_layer_ms", "whole-layer")):
            ax.plot(x, [r[f"{hw}_{key}"] for r in sel], "o-", label=name, ms=3)
        ax.set_yscale("log")
        ax.set_xticks(list(x), labels, rotation=75, fontsize=7)
        ax.set_ylabel(f"modeled ms per token ({profiles[hw]['name']})")
        ax.set_title("modeled decode time per token (not measured)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / f"modeled_ms_{hw}.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return [str(p) for p in paths]


def _md_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    out = ["| " + " | ".join(h for h, _, _ in columns) + " |",
           "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join("-" if r.get(k) is None else format(r[k], f)
                                     for _, k, f in columns) + " |")
    return out


def markdown(result: dict) -> str:
    """The report as markdown (``summary.md`` of a results folder; BENCHMARKS.md quotes it)."""
    rows, env = result["rows"], result["environment"]
    layers = result["spec"]["geometry"]["layers"]
    lines = [f"Device {env['device']} (backend {env['backend']}), torch {env['torch']}, "
             f"{result['spec']['layers']} layers simulated x {result['spec']['steps']} decode "
             f"steps per row; per token = per layer x {layers} layers.", "",
             "Exact counts (the runtime's telemetry):", ""]
    lines += _md_table(rows, TABLE)
    for hw, prof in result["profiles"].items():
        kind = "measured" if prof.get("measured") else "nominal"
        lines += ["", f"Modeled ms per token, {prof['name']} ({kind} profile; modeled, not "
                  "measured):", ""]
        lines += _md_table([r for r in rows if r["hot_budget"] < 1.0], _modeled_table(hw))
    host = result.get("host_cost")
    if host:
        lines += ["", f"Host cost, tiny reasoner greedy decode step ({host['config']['device']}, "
                  "measured side by side):", "", "| variant | median ms | p10-p90 ms | ratio |",
                  "|---|---|---|---|"]
        for name, v in host["variants"].items():
            lines.append(f"| {name} | {v['median_ms']:.3f} | {v['p10_ms']:.3f}-"
                         f"{v['p90_ms']:.3f} | {v['ratio_to_sdpa']:.2f} |")
    lines += ["", "Targets:", ""]
    lines += [f"- {'met' if t['met'] else '**not met**'}: {t['target']}: {t['value']}"
              for t in result["targets"]]
    return "\n".join(lines) + "\n"


def summary(result: dict) -> str:
    """The printed report: counts, modeled times, host cost, targets."""
    rows = result["rows"]
    lines = ["Exact counts (telemetry of the runtime; per token = per layer x "
             f"{result['spec']['geometry']['layers']} layers):", format_table(rows, TABLE)]
    for hw, prof in result["profiles"].items():
        lines += ["", f"Modeled ms per token on {prof['name']} "
                  f"({'measured profile' if prof.get('measured') else 'nominal profile'}; "
                  "modeled, not measured):", format_table(rows, _modeled_table(hw))]
    host = result.get("host_cost")
    if host:
        v = host["variants"]
        lines += ["", f"Host cost, tiny reasoner greedy decode step ({host['config']['device']}, "
                  "median, measured side by side):",
                  f"  sdpa {v['sdpa']['median_ms']:.3f} ms | tiered all hot "
                  f"{v['tiered_hot100']['median_ms']:.3f} ms "
                  f"({v['tiered_hot100']['ratio_to_sdpa']:.2f}x) | tiered 50% hot "
                  f"{v['tiered_hot50']['median_ms']:.3f} ms "
                  f"({v['tiered_hot50']['ratio_to_sdpa']:.2f}x)"]
    lines += target_lines(result["targets"])
    if result.get("out"):
        lines.append(f"\nresults: {result['out']}/results.json, rows.csv, summary.md")
    lines += [f"plot: {p}" for p in result.get("plots", [])]
    return "\n".join(lines)
