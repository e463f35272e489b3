"""``tierattn bench --host-attn``: the host attention kernel against this machine's own read
bandwidth over the same bytes, measured in one run, and the GPU decode step it serves, modeled.

For two KV geometries (Llama-3-8B: 32 query / 8 KV heads, head dim 128; SmolLM2-135M: 9 / 3,
head dim 64), bf16 and fp32 pages of 16 tokens, at each context (4K-128K tokens) and batch
(1-8), one decode query per sequence:

* **host_decode**: :func:`~tierattn.kernels.host_decode` over each sequence's pages, which lie at
  random slots of a host pool ``[slots, 2, 16, H_kv, D]``: KV bytes scanned per second;
* **host_read**: :func:`~tierattn.kernels.host.host_read` over exactly the same pages with the
  same tasks and threads: the rate at which this machine reads those bytes at all. The ratio
  host_decode / host_read is the share of the read bandwidth the kernel turns into attention;
* **sdpa**: torch's ``scaled_dot_product_attention`` (``enable_gqa=True``) over the same KV laid
  out contiguously (``[B, H_kv, T, D]``): a reference rate of a general CPU kernel.

Each figure is the best of ``reps`` timed calls after a warm-up, the three kernels alternating.
The caches are flushed before every timed call (a plain read of a buffer twice the last-level
cache) because in a decode step a layer's pages were last touched a whole step earlier: without
the flush a 4K-token cell would be read from cache, not from memory. A cell whose pool would
exceed ``max_pool_bytes`` is skipped and listed as skipped.

Then, **modeled** (nothing here times a GPU): per layer and decode step, for one sequence at
each context and hot budget, on a hardware profile (``eval/hardware/``; h100 by default):

(a) exact offload: every cold byte over the host-to-device link;
(b) top-k recall: ``recall`` of the cold pages over the link;
(c) split: the cold bytes attended on the host at the profile's ``ddr_bandwidth_Bps`` times this
    machine's measured host_decode / host_read ratio for the geometry and dtype (the median over
    its cells), plus the query over the link and the partial state ``(out, lse)`` back;
(d) the hot set read from HBM at the profile's bandwidth x efficiency.

A transfer is ``memcpy_call_s + bytes / bandwidth`` (a layer's pages go in one copy). The host
kernel's fixed cost per call (waking its threads) is not modeled. Results go to
``results.json`` / ``rows.csv`` / ``rates.png`` in a new results folder.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tierattn.errors import KernelUnsupportedError
from tierattn.eval.bench.kv import load_profile
from tierattn.eval.report import format_table, new_results_dir, save_json, write_csv
from tierattn.eval.report import provenance as report_provenance
from tierattn.kernels import PageTable
from tierattn.kernels.host import host_decode, host_decode_available, host_read

__all__ = ["GEOMETRIES", "HeadGeometry", "HostAttnSpec", "hostattn_summary", "load_profiles",
           "measure_cell", "model_rows", "provenance", "run_hostattn_bench"]

#: the dtypes pages are measured in, by the name rows carry
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: bytes of the flush buffer when the last-level cache's size cannot be read (a server CPU's L3
#: is tens to hundreds of MiB; too large a flush only costs time)
FLUSH_FALLBACK_BYTES = 512 << 20
FLUSH_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class HeadGeometry:
    """The attention heads of one layer: what a page and a decode query look like."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        """Bytes of one page: K and V x ``page_size`` tokens x every KV head."""
        return 2 * page_size * self.kv_heads * self.head_dim * dtype_bytes


GEOMETRIES = (HeadGeometry("llama-8b", 32, 8, 128), HeadGeometry("smollm2-135m", 9, 3, 64))


@dataclass(frozen=True)
class HostAttnSpec:
    """What ``tierattn bench --host-attn`` measures and models (defaults: the full run)."""

    contexts: tuple[int, ...] = (4096, 16384, 32768, 65536, 131072)
    batches: tuple[int, ...] = (1, 2, 4, 8)
    dtypes: tuple[str, ...] = ("bf16", "fp32")
    geometries: tuple[HeadGeometry, ...] = GEOMETRIES
    page_size: int = 16
    reps: int = 3  # timed calls per kernel and cell (the best is kept), after one warm-up
    #: a cell whose pool (its KV) would exceed this is skipped; sdpa's contiguous copy of the
    #: same size sits beside the pool, so the run holds up to twice this (the default grid's
    #: largest kept cells hold 4 GiB: about 10 GiB of host memory at the peak)
    max_pool_bytes: int = 6 << 30
    sdpa: bool = True
    hot_budgets: tuple[float, ...] = (0.10, 0.25)  # modeled: the share of pages in HBM
    recall: float = 0.25  # modeled top-k: the share of the cold pages recalled per step
    hardware: tuple[str, ...] = ("h100",)
    threads: int | None = None  # None: torch.get_num_threads()
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("contexts", "batches"):
            got = getattr(self, name)
            if not got or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                              for v in got):
                raise ValueError(f"HostAttnSpec.{name} must be integers >= 1, got {got!r}.")
        bad = [d for d in self.dtypes if d not in DTYPES]
        if bad or not self.dtypes:
            raise ValueError(f"HostAttnSpec.dtypes {bad or 'empty'}: pick from {list(DTYPES)}.")
        if not all(0.0 < b < 1.0 for b in self.hot_budgets) or not self.hot_budgets:
            raise ValueError(f"HostAttnSpec.hot_budgets must lie in (0, 1), got "
                             f"{self.hot_budgets!r} (a budget of 1 leaves nothing cold).")
        if not 0.0 < self.recall <= 1.0:
            raise ValueError(f"HostAttnSpec.recall must lie in (0, 1], got {self.recall!r}.")
        for name in ("page_size", "reps", "max_pool_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"HostAttnSpec.{name} must be >= 1, got "
                                 f"{getattr(self, name)!r}.")
        if self.threads is not None and (isinstance(self.threads, bool) or
                                         not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"HostAttnSpec.threads must be None or an int >= 1, got "
                             f"{self.threads!r}.")

    @classmethod
    def smoke(cls, **changes) -> HostAttnSpec:
        """The reduced run (seconds): 4K and 16K contexts, batch 1 and 2, one repeat."""
        return cls(**{"contexts": (4096, 16384), "batches": (1, 2), "reps": 1, **changes})

    def replace(self, **changes) -> HostAttnSpec:
        return dataclasses.replace(self, **changes)

    def resolved_threads(self) -> int:
        """The thread count every kernel of the run gets."""
        return self.threads if self.threads is not None else torch.get_num_threads()

    def name(self) -> str:
        """The results folder's name: contexts, batches, threads and repeats."""
        return (f"hostattn-ctx{'_'.join(map(_ctx, self.contexts))}-b"
                f"{'_'.join(map(str, self.batches))}-t{self.resolved_threads()}-r{self.reps}")


def _ctx(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


# --- hardware profiles -----------------------------------------------------------------------

def load_profiles(names: tuple[str, ...] = ("h100",), files: tuple[str, ...] = ()) -> dict:
    """Profiles by name (``eval/hardware/NAME.json``) and by file, keyed by name / file stem.

    Returns:
        ``{key: profile dict}``; each has a positive numeric ``ddr_bandwidth_Bps`` (the host's
        memory bandwidth the split is modeled at), else ``ValueError`` naming the file.
    """
    out = {}
    for source in (*names, *files):
        prof = load_profile(source)
        ddr = prof.get("ddr_bandwidth_Bps")
        if isinstance(ddr, bool) or not isinstance(ddr, (int, float)) or ddr <= 0:
            raise ValueError(f"hardware profile {source} has no positive numeric "
                             "ddr_bandwidth_Bps (the host memory bandwidth the split is modeled "
                             "at); add it, as eval/hardware/h100.json has it.")
        out[Path(source).stem] = prof
    return out


# --- measuring -------------------------------------------------------------------------------

def _llc_bytes() -> int | None:
    """The machine's last-level cache in bytes (every instance summed: one per socket or CCD),
    from sysfs; None where it cannot be read."""
    seen: dict[str, int] = {}
    try:
        for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            nbytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
            seen[f"{level}|{shared}"] = nbytes
    except (OSError, ValueError):
        return None
    if not seen:
        return None
    top = max(int(k.split("|")[0]) for k in seen)
    return sum(v for k, v in seen.items() if int(k.split("|")[0]) == top)


class _Flush:
    """Evicts the pool's pages from every cache level: a plain read (``host_read``, the same
    threads) of a buffer twice the last-level cache. The buffer is written with ones, not
    zeros: untouched zero pages all map one physical page and would evict nothing."""

    PAGE = (2, 16, 8, 128)  # 64 KiB pages of bf16

    def __init__(self, threads: int) -> None:
        self.llc_bytes = _llc_bytes()
        want = 2 * self.llc_bytes if self.llc_bytes else FLUSH_FALLBACK_BYTES
        page_bytes = math.prod(self.PAGE) * 2
        self.pages = max(1, min(want, FLUSH_MAX_BYTES) // page_bytes)
        self.bytes = self.pages * page_bytes
        self.buf = torch.ones(self.pages, *self.PAGE, dtype=torch.bfloat16)
        self.table = _table(torch.arange(self.pages, dtype=torch.int32), 1, self.pages,
                            self.PAGE[1])
        self.threads = threads

    def __call__(self) -> None:
        host_read(self.buf, self.table, threads=self.threads)


def _table(slots: torch.Tensor, batch: int, pages: int, last_len: int) -> PageTable:
    """A page table of ``batch`` rows of ``pages`` pages each: row ``b`` is
    ``slots[b * pages:(b + 1) * pages]``, its last page holding ``last_len`` tokens."""
    return PageTable(indices=slots.to(torch.int32).contiguous(),
                     row_start=torch.arange(batch, dtype=torch.int32) * pages,
                     row_count=torch.full((batch,), pages, dtype=torch.int32),
                     last_page_len=torch.full((batch,), last_len, dtype=torch.int32))


def fill_pool(slots: int, geo: HeadGeometry, dtype: torch.dtype, page_size: int,
              gen: torch.Generator) -> torch.Tensor:
    """A host pool ``[slots, 2, page_size, H_kv, D]`` of ``dtype``, every byte written.

    Random pages are drawn for at most 256 slots and repeated over the rest: the rates do not
    depend on the values (no denormals, no infinities), and drawing gigabytes of normals would
    take longer than measuring them."""
    pool = torch.empty(slots, 2, page_size, geo.kv_heads, geo.head_dim, dtype=dtype)
    block = torch.randn(min(slots, 256), *pool.shape[1:], generator=gen).to(dtype)
    for s in range(0, slots, block.shape[0]):
        n = min(block.shape[0], slots - s)
        pool[s:s + n].copy_(block[:n])
    return pool


def _contiguous_kv(pool: torch.Tensor, table: PageTable, batch: int, pages: int,
                   context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's KV laid out for sdpa: K and V ``[B, H_kv, context, D]``, contiguous, the
    same values as the pages (copied a sequence at a time: no second full-size temporary)."""
    _, _, page_size, hkv, d = pool.shape
    k = torch.empty(batch, hkv, context, d, dtype=pool.dtype)
    v = torch.empty_like(k)
    for b in range(batch):
        rows = pool[table.indices[b * pages:(b + 1) * pages].long()]  # [pages, 2, P, H_kv, D]
        for i, dst in enumerate((k, v)):
            dst[b].copy_(rows[:, i].reshape(pages * page_size, hkv, d)[:context].transpose(0, 1))
    return k, v


def measure_cell(pool: torch.Tensor, geo: HeadGeometry, dtype_name: str, context: int,
                 batch: int, *, reps: int, threads: int, flush: _Flush, gen: torch.Generator,
                 sdpa: bool = True) -> dict:
    """host_decode, host_read and (optionally) sdpa on ``batch`` sequences of ``context``
    tokens whose pages lie at random slots of ``pool`` (``[slots, 2, P, H_kv, D]``; it needs
    ``batch * ceil(context / P)`` slots).

    Returns:
        One measured row: ``kv_bytes`` (the pages' bytes, which both host kernels read),
        ``decode_s`` / ``read_s`` / ``sdpa_s`` (best seconds per call), the rates ``*_Bps`` and
        ``ratio`` = host_decode rate / host_read rate.
    """
    page_size = pool.shape[2]
    pages = -(-context // page_size)
    slots = torch.randperm(pool.shape[0], generator=gen)[:batch * pages]
    table = _table(slots, batch, pages, context - (pages - 1) * page_size)
    q = torch.randn(batch, geo.q_heads, geo.head_dim, generator=gen).to(pool.dtype)
    out = torch.empty(batch, geo.q_heads, geo.head_dim)
    lse = torch.empty(batch, geo.q_heads)
    kv_bytes = batch * pages * pool[0].numel() * pool.element_size()

    kernels = {
        "decode": lambda: host_decode(q, pool, table, out=out, lse=lse, threads=threads,
                                      validate=False),
        "read": lambda: host_read(pool, table, threads=threads)}
    host_decode(q, pool, table, out=out, lse=lse, threads=threads)  # checks the table once
    sdpa_bytes = None
    if sdpa:
        k, v = _contiguous_kv(pool, table, batch, pages, context)
        q4 = q.unsqueeze(2)  # [B, H_q, 1, D]
        kernels["sdpa"] = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
        sdpa_bytes = 2 * k.numel() * k.element_size()
    best = dict.fromkeys(kernels, math.inf)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)  # sdpa gets the host kernel's threads
    try:
        for fn in kernels.values():  # warm-up
            fn()
        for _ in range(reps):  # alternating: a slow spell of the machine hits every kernel
            for name, fn in kernels.items():
                flush()
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
    finally:
        torch.set_num_threads(prev)
    row = {"kind": "measured", "geometry": geo.name, "q_heads": geo.q_heads,
           "kv_heads": geo.kv_heads, "head_dim": geo.head_dim, "dtype": dtype_name,
           "context": context, "ctx": _ctx(context), "batch": batch, "pages": batch * pages,
           "page_bytes": pool[0].numel() * pool.element_size(), "kv_bytes": kv_bytes,
           "threads": threads, "reps": reps,
           "decode_s": best["decode"], "read_s": best["read"],
           "decode_Bps": kv_bytes / best["decode"], "read_Bps": kv_bytes / best["read"],
           "sdpa_bytes": sdpa_bytes, "sdpa_s": best.get("sdpa"),
           "sdpa_Bps": sdpa_bytes / best["sdpa"] if sdpa else None}
    row["ratio"] = row["decode_Bps"] / row["read_Bps"]
    return row


def _skipped(geo: HeadGeometry, dtype_name: str, context: int, batch: int, nbytes: int,
             spec: HostAttnSpec) -> dict:
    return {"kind": "measured", "geometry": geo.name, "q_heads": geo.q_heads,
            "kv_heads": geo.kv_heads, "head_dim": geo.head_dim, "dtype": dtype_name,
            "context": context, "ctx": _ctx(context), "batch": batch, "kv_bytes": nbytes,
            "skipped": f"skipped: pool {_size(nbytes)} > cap {_size(spec.max_pool_bytes)}"}


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


# --- the model -------------------------------------------------------------------------------

def host_ratios(measured: list[dict]) -> dict:
    """Per ``geometry/dtype``: the median host_decode / host_read ratio over its measured cells
    (with their min, max and count); a group with every cell skipped is absent."""
    groups: dict[str, list[float]] = {}
    for r in measured:
        if r.get("ratio") is not None:
            groups.setdefault(f"{r['geometry']}/{r['dtype']}", []).append(r["ratio"])
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "cells": len(v)}
            for k, v in groups.items()}


def model_rows(spec: HostAttnSpec, profiles: dict, ratios: dict) -> list[dict]:
    """The modeled per-layer decode step of one sequence, for every profile, geometry, dtype,
    context and hot budget (formulas: the module docstring).

    Returns:
        Rows with ``kind="modeled"`` and times in microseconds per layer: ``modeled_offload_us``
        (a), ``modeled_topk_us`` (b), ``modeled_split_us`` (c; None where the geometry/dtype
        has no measured ratio), ``modeled_hot_us`` (d), ``modeled_host_Bps`` (the host rate
        (c) uses) and ``modeled_split_over_offload`` = (c) / (a).
    """
    rows = []
    for pname, prof in profiles.items():
        h2d, d2h, call = (prof["h2d_bandwidth_Bps"], prof["d2h_bandwidth_Bps"],
                          prof["memcpy_call_s"])
        hbm = prof["hbm_bandwidth_Bps"] * prof["hbm_efficiency"]

        def link(nbytes: float, bw: float, call: float = call) -> float:
            return call + nbytes / bw if nbytes else 0.0

        for geo in spec.geometries:
            for dname in spec.dtypes:
                nb = DTYPES[dname].itemsize
                page_bytes = geo.page_bytes(spec.page_size, nb)
                token_bytes = page_bytes // spec.page_size
                ratio = ratios.get(f"{geo.name}/{dname}")
                host_bps = prof["ddr_bandwidth_Bps"] * ratio["median"] if ratio else None
                q_bytes = geo.q_heads * geo.head_dim * nb
                state_bytes = geo.q_heads * (geo.head_dim + 1) * 4  # fp32 out and lse
                for context in spec.contexts:
                    pages = -(-context // spec.page_size)
                    for budget in spec.hot_budgets:
                        # the hot set holds the newest (possibly partial) page: cold pages are
                        # full pages
                        hot_pages = min(pages, max(1, math.ceil(budget * pages)))
                        cold_pages = pages - hot_pages
                        cold = cold_pages * page_bytes
                        recall_pages = math.ceil(spec.recall * cold_pages)
                        offload = link(cold, h2d)
                        split = (cold / host_bps + link(q_bytes, h2d) + link(state_bytes, d2h)
                                 if host_bps and cold else (0.0 if host_bps else None))
                        rows.append({
                            "kind": "modeled", "profile": pname,
                            "profile_name": prof.get("name", pname),
                            "profile_measured": bool(prof.get("measured")),
                            "geometry": geo.name, "dtype": dname, "context": context,
                            "ctx": _ctx(context), "batch": 1, "hot_budget": budget,
                            "hot_pages": hot_pages, "cold_pages": cold_pages,
                            "cold_bytes": cold, "recall_pages": recall_pages,
                            "host_ratio": ratio["median"] if ratio else None,
                            "modeled_host_Bps": host_bps,
                            "modeled_offload_us": 1e6 * offload,
                            "modeled_topk_us": 1e6 * link(recall_pages * page_bytes, h2d),
                            "modeled_split_us": None if split is None else 1e6 * split,
                            "modeled_hot_us": 1e6 * (context * token_bytes - cold) / hbm,
                            "modeled_split_over_offload":
                                split / offload if split is not None and offload else None})
    return rows


# --- provenance and the run ------------------------------------------------------------------

def provenance(threads: int) -> dict:
    """Where and how the figures were made (:func:`tierattn.eval.report.provenance`), with the
    threads measured on and the host kernel's build."""
    return report_provenance(threads=threads, host_kernel="compiled C" if host_decode_available()
                             else "torch reference")


def run_hostattn_bench(spec: HostAttnSpec = HostAttnSpec(), *,
                       out_root: str | Path | None = "results",
                       hardware_files: tuple[str, ...] = (), progress: bool = True) -> dict:
    """Measure every (geometry, dtype, context, batch) cell, model the decode step on each
    profile (``spec.hardware`` and ``hardware_files``), write the results folder.

    Returns:
        ``{"spec", "provenance", "profiles", "cache_flush", "host_ratio", "measured",
        "modeled", ...}``; with ``out_root``, also ``out`` (the folder) and ``plot`` (its PNG,
        or None with ``plot_note``).
    """
    profiles = load_profiles(spec.hardware, hardware_files)  # before minutes of measuring
    if not host_decode_available():
        raise KernelUnsupportedError(
            "tierattn bench --host-attn measures the compiled host kernel, which could not be "
            "built here (see the warning above): install a C compiler (gcc) or set CC.")
    threads = spec.resolved_threads()
    flush = _Flush(threads)
    gen = torch.Generator().manual_seed(spec.seed)
    t0 = time.perf_counter()
    measured: list[dict] = []
    groups = [(g, d) for g in spec.geometries for d in spec.dtypes]
    bar = tqdm(total=len(groups) * len(spec.contexts) * len(spec.batches), desc="host-attn cells",
               unit="cell", disable=not progress)
    for geo, dname in groups:
        dtype = DTYPES[dname]
        page_bytes = geo.page_bytes(spec.page_size, dtype.itemsize)
        cells = [(c, b, b * -(-c // spec.page_size)) for c in spec.contexts
                 for b in spec.batches]
        kept = [n for _, _, n in cells if n * page_bytes <= spec.max_pool_bytes]
        # one pool per group, as large as its largest kept cell; smaller cells draw their
        # random slots from all of it
        pool = fill_pool(max(kept), geo, dtype, spec.page_size, gen) if kept else None
        for context, batch, n in cells:
            if n * page_bytes > spec.max_pool_bytes:
                measured.append(_skipped(geo, dname, context, batch, n * page_bytes, spec))
            else:
                measured.append(measure_cell(pool, geo, dname, context, batch, reps=spec.reps,
                                             threads=threads, flush=flush, gen=gen,
                                             sdpa=spec.sdpa))
            bar.update(1)
        del pool
    bar.close()
    ratios = host_ratios(measured)
    result = {"spec": asdict(spec), "provenance": provenance(threads), "profiles": profiles,
              "cache_flush": {"llc_bytes": flush.llc_bytes, "flush_bytes": flush.bytes},
              "host_ratio": ratios, "measured": measured,
              "modeled": model_rows(spec, profiles, ratios),
              "wall_s": time.perf_counter() - t0}
    if out_root:
        out = new_results_dir(out_root, spec.name())
        result["out"] = str(out)
        write_csv(result["measured"] + result["modeled"], out / "rows.csv")
        result["plot"] = _plot(measured, spec, out / "rates.png")
        if result["plot"] is None:
            result["plot_note"] = "no plot: matplotlib is not installed (pip install matplotlib)"
        save_json(result, out / "results.json", quiet=True)
    return result


def _plot(rows: list[dict], spec: HostAttnSpec, path: Path) -> str | None:
    """GB/s against context, one panel per geometry/dtype: host_decode and host_read at the
    smallest and the largest batch measured. None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [(g.name, d) for g in spec.geometries for d in spec.dtypes]
    batches = sorted({min(spec.batches), max(spec.batches)})
    cols = min(2, len(panels))
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(5.2 * cols,
                             3.6 * -(-len(panels) // cols)), squeeze=False)
    for ax, (geo, dname) in zip(axes.flat, panels):
        for i, b in enumerate(batches):
            sel = sorted((r for r in rows if (r["geometry"], r["dtype"], r["batch"]) ==
                          (geo, dname, b) and r.get("decode_Bps")), key=lambda r: r["context"])
            x = [r["context"] for r in sel]
            ax.plot(x, [r["decode_Bps"] / 1e9 for r in sel], f"C{i}-o", label=f"host_decode b{b}")
            ax.plot(x, [r["read_Bps"] / 1e9 for r in sel], f"C{i}--s", label=f"host_read b{b}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(spec.contexts), [_ctx(c) for c in spec.contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("GB/s of KV")
        ax.set_title(f"{geo}, {dname}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"Host attention vs a plain read of the same pages "
                 f"({spec.resolved_threads()} threads, measured)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# --- the report ------------------------------------------------------------------------------

MEASURED_TABLE = [("geometry", "geometry", "s"), ("dtype", "dtype", "s"), ("ctx", "ctx", "s"),
                  ("batch", "batch", "d"), ("MiB", "kv_mib", ".1f"),
                  ("host_decode GB/s", "decode_GBps", ".2f"),
                  ("host_read GB/s", "read_GBps", ".2f"), ("decode/read", "ratio", ".3f"),
                  ("sdpa GB/s", "sdpa_GBps", ".2f"), ("decode ms", "decode_ms", ".2f"),
                  ("note", "skipped", "s")]
MODELED_TABLE = [("geometry", "geometry", "s"), ("dtype", "dtype", "s"), ("ctx", "ctx", "s"),
                 ("hot", "hot_budget", ".2f"), ("cold MiB", "cold_mib", ".1f"),
                 ("modeled offload us", "modeled_offload_us", ".1f"),
                 ("modeled topk us", "modeled_topk_us", ".1f"),
                 ("modeled split us", "modeled_split_us", ".1f"),
                 ("modeled hot us", "modeled_hot_us", ".2f"),
                 ("modeled split/offload", "modeled_split_over_offload", ".3f")]


def _display(row: dict) -> dict:
    """The row with the printed units added (MiB, GB/s, ms)."""
    out = dict(row, kv_mib=row["kv_bytes"] / 2**20) if "kv_bytes" in row else dict(row)
    for key in ("decode", "read", "sdpa"):
        if row.get(f"{key}_Bps") is not None:
            out[f"{key}_GBps"] = row[f"{key}_Bps"] / 1e9
    if row.get("decode_s") is not None:
        out["decode_ms"] = 1e3 * row["decode_s"]
    if "cold_bytes" in row:
        out["cold_mib"] = row["cold_bytes"] / 2**20
    return out


def device_check(dev: torch.device, *, tiny: bool = False) -> dict:
    """Split attention on ``dev`` (the GPU check's ``split`` section): ``attend="split"``
    against the all-resident cache there, step by step (the query's copy to the host, the host
    kernel, the partial state back, the merge), and the host kernel's rate against a plain read
    of the same pages with this machine's cores (``host_read``), bf16 and fp32, Llama-8B heads
    (``tiny``: toy sizes). Returns the figures as a dict."""
    from tierattn.runtime.cache import TieredKVCache
    from tierattn.config import TierConfig
    from tierattn.kernels.host import host_threads

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    layers, hq, hkv, d = (2, 4, 2, 32) if tiny else (4, 32, 8, 128)
    context, steps = (256, 8) if tiny else (4096, 16)
    backend = "auto" if dev.type == "cuda" else "torch"
    common = dict(page_size=16, max_context=context + steps + 16, prefill_chunk_size=1024,
                  backend=backend)
    caches = {name: TieredKVCache(cfg, num_layers=layers, num_kv_heads=hkv, head_dim=d,
                                  dtype=torch.bfloat16, device=dev)
              for name, cfg in (("dense", TierConfig.preset("dense", **common)),
                                ("split", TierConfig.preset("split", hot_budget=0.25, **common)))}
    gen = torch.Generator(device=dev).manual_seed(2)
    worst, t_split = 0.0, []
    for t in [1024] * (context // 1024) + [context % 1024] + [1] * steps:
        if not t:
            continue
        for layer in range(layers):
            k, v, q = (torch.randn(1, h, t, d, dtype=torch.bfloat16, device=dev, generator=gen)
                       for h in (hkv, hkv, hq))
            outs = {}
            for name, cache in caches.items():
                cache.update(layer, k, v)
                sync()
                t0 = time.perf_counter()
                outs[name] = cache.attend(layer, q)
                sync()
                if name == "split" and t == 1:
                    t_split.append(time.perf_counter() - t0)
            ref = outs["dense"].double()
            err = (outs["split"].double() - ref).norm() / ref.norm().clamp_min(1e-30)
            worst = max(worst, float(err))
    tot = caches["split"].stats()["total"]
    res = {"context": context, "layers": layers, "max_rel_err_vs_resident": worst,
           "split_steps": tot["split_steps"], "h2d_bytes": tot["h2d_bytes"],
           "ms_per_split_layer_step": 1e3 * statistics.median(t_split) if t_split else None,
           "host_kernel_compiled": host_decode_available(), "host_threads": host_threads()}
    del caches

    def rate(nbytes: int, fn) -> float:  # bytes per second, the best of 3 after a warm-up
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times)

    rates = {}
    tokens = 1024 if tiny else 32768
    pages = tokens // 16
    table = PageTable(indices=torch.randperm(pages).to(torch.int32),
                      row_start=torch.zeros(1, dtype=torch.int32),
                      row_count=torch.full((1,), pages, dtype=torch.int32),
                      last_page_len=torch.full((1,), 16, dtype=torch.int32))
    for dt in (torch.bfloat16, torch.float32):
        pool = torch.randn(pages, 2, 16, hkv, d).to(dt)
        q = torch.randn(1, hq, d).to(dt)
        nbytes = pool.numel() * pool.element_size()
        a = rate(nbytes, lambda p=pool, q=q: host_decode(q, p, table, validate=False))
        r = rate(nbytes, lambda p=pool: host_read(p, table)) if host_decode_available() else None
        rates[str(dt).split(".")[-1]] = {"tokens": tokens, "host_decode_Bps": a, "read_Bps": r,
                                         "ratio": a / r if r else None}
    res["host_rates"] = rates
    return res


def hostattn_summary(result: dict) -> str:
    """The printed report of :func:`run_hostattn_bench`: the measured table, the ratios the
    model uses, one modeled table per profile, where the files are."""
    spec, prov = result["spec"], result["provenance"]
    flush = result["cache_flush"]
    lines = [f"Host attention vs a plain read of the same pages, measured on "
             f"{prov['machine']['cpu_model']} ({prov['threads']} threads of "
             f"{prov['machine']['cpus_usable']} usable CPUs; pages of "
             f"{spec['page_size']} tokens at random pool slots; best of {spec['reps']} after a "
             f"warm-up; caches flushed before each call ({flush['flush_bytes'] / 2**20:.0f} MiB "
             "read); GB/s of KV; sdpa: torch over the same KV laid out contiguously):",
             format_table([_display(r) for r in result["measured"]], MEASURED_TABLE)]
    skipped = [r for r in result["measured"] if r.get("skipped")]
    if skipped:
        lines.append(f"{len(skipped)} cell(s) skipped: their pool would exceed the cap of "
                     f"{_size(spec['max_pool_bytes'])} (HostAttnSpec.max_pool_bytes).")
    lines += ["", "host_decode / host_read per geometry and dtype (median over its cells; the "
              "split model uses the median):"]
    lines += [f"  {k}: median {v['median']:.3f} (min {v['min']:.3f}, max {v['max']:.3f}, "
              f"{v['cells']} cells)" for k, v in result["host_ratio"].items()]
    for pname, prof in result["profiles"].items():
        rows = [_display(r) for r in result["modeled"] if r["profile"] == pname]
        kind = "measured" if prof.get("measured") else "nominal"
        hbm = prof["hbm_bandwidth_Bps"] * prof["hbm_efficiency"]
        lines += ["", f"Modeled per-layer decode step of one sequence on {prof.get('name', pname)} "
                  f"({kind} profile; modeled, not measured): (a) offload: every cold byte over "
                  f"the link at {prof['h2d_bandwidth_Bps'] / 1e9:.0f} GB/s; (b) topk: "
                  f"{spec['recall']:.0%} of the cold pages over it; (c) split: the cold bytes on "
                  f"the host at ddr_bandwidth_Bps {prof['ddr_bandwidth_Bps'] / 1e9:.0f} GB/s x "
                  "the measured ratio, the query and partial state over the link; (d) hot: the "
                  f"hot set from HBM at {hbm / 1e12:.2f} TB/s; memcpy_call_s "
                  f"{prof['memcpy_call_s'] * 1e6:.0f} us per copy:",
                  format_table(rows, MODELED_TABLE)]
    if result.get("out"):
        lines.append(f"\nresults: {result['out']}/results.json, rows.csv"
                     + (", rates.png" if result.get("plot") else ""))
    if result.get("plot_note"):
        lines.append(result["plot_note"])
    return "\n".join(lines)
