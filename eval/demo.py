"""Kernel demo: one decode step of "offload, don't evict" at a 25% HBM budget, end to end.

Every number it prints is computed by the kernels in this run. The story in six launches:

1. ``paged_prefill`` over the prompt's last chunk gives each page its initial attention mass;
2. the hot set (sink page, recent window, the heaviest pages) is copied host -> device pool with
   one ``copy_pages`` launch; the other pages stay on the host at full precision;
3. ``page_metadata`` keeps Quest kmin/kmax of *every* page on the device;
4. a new query arrives that needs "needle" pages the prompt never attended to;
5. three strategies at the same HBM budget, each a ``sparse_decode`` (+ ``merge_states``):
   *evict* (attend the hot set only: the cold pages are gone), *offload-exact* (fetch every cold
   page, attend, merge by LSE: equals dense attention), *offload-topk* (``quest_score`` picks the
   cold pages to recall within a 10% budget);
6. each is compared with fp64 dense attention over the whole context.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from tierattn.kernels import (
    PageTable,
    copy_pages,
    merge_states,
    page_metadata,
    paged_prefill,
    quest_score,
    sparse_decode,
    sparse_decode_reference,
)
from tierattn.eval.report import save_json
from tierattn.kernels._common import resolve_backend

__all__ = ["DemoRow", "run_demo", "main"]


@dataclass
class DemoRow:
    method: str
    pages_attended: int
    pages_copied_h2d: int
    bytes_h2d: int
    max_abs_err: float
    mass_captured: float
    needles_attended: int
    ms: float


def _table(pages: torch.Tensor, page_size: int) -> PageTable:
    """A one-row page table over ``pages``, all of them full."""
    n, dev = pages.numel(), pages.device
    return PageTable.from_csr(torch.tensor([0, n], dtype=torch.int32, device=dev),
                              pages.to(torch.int32).contiguous(),
                              torch.tensor([page_size if n else 0], dtype=torch.int32, device=dev))


def run_demo(*, context: int = 1024, page_size: int = 16, num_q_heads: int = 8,
             num_kv_heads: int = 2, head_dim: int = 64, hot_fraction: float = 0.25,
             recall_fraction: float = 0.10, num_needles: int = 3, seed: int = 0,
             device: str | torch.device | None = None,
             dtype: torch.dtype = torch.bfloat16) -> dict:
    """Run the demo on one sequence; returns a JSON-ready dict (config, rows, checks)."""
    if context % page_size:
        raise ValueError(f"context={context} must be a multiple of page_size={page_size}.")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(seed)
    num_pages, hkv, d = context // page_size, num_kv_heads, head_dim
    page_bytes = 2 * page_size * hkv * d * torch.finfo(dtype).bits // 8

    # The host ("DDR") pool holds every page at full precision (pinned on CUDA: UVA reads).
    # Two hidden directions per KV head: the prompt's last chunk looks along `w` (so the pages
    # carrying `w` become the prompt's heavy hitters), the new query looks along `u` (so the
    # "needle" pages carrying `u` matter only later) -- importance revealed after the prompt.
    host = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen)
    u = torch.nn.functional.normalize(torch.randn(hkv, d, generator=gen), dim=-1)
    w = torch.randn(hkv, d, generator=gen)
    w = torch.nn.functional.normalize(w - (w * u).sum(-1, keepdim=True) * u, dim=-1)
    group = num_q_heads // hkv
    middle = torch.randperm(num_pages - 8, generator=gen) + 4  # never the sink or recent pages
    budget = max(3, int(hot_fraction * num_pages))
    needles, heavy = middle[:num_needles], middle[num_needles:num_needles + budget - 3]
    host[needles, 0] += 3.0 * u
    host[heavy, 0] += 3.0 * w
    q = torch.randn(1, num_q_heads, d, generator=gen) + d ** 0.5 * u.repeat_interleave(group, 0)
    chunk = 4 * page_size
    q_chunk = torch.randn(chunk, num_q_heads, d, generator=gen)
    u_q, w_q = u.repeat_interleave(group, 0), w.repeat_interleave(group, 0)
    q_chunk = q_chunk - (q_chunk * u_q).sum(-1, keepdim=True) * u_q + d ** 0.5 * w_q
    host, q, q_chunk = host.to(dtype), q.to(dtype).to(dev), q_chunk.to(dtype).to(dev)
    host = host.pin_memory() if dev.type == "cuda" else host

    # 1. prefill mass of the prompt's last chunk: initial importance of every page
    all_pages = torch.arange(num_pages, dtype=torch.int32, device=dev)
    full_table = _table(all_pages, page_size)
    qo = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    prefill_pool = host.to(dev)  # prefill runs before any page is demoted
    mass = paged_prefill(q_chunk, prefill_pool, full_table, qo, return_page_mass=True).page_mass
    importance = mass.sum(-1)  # [num_pages]

    # 2. hot set: sink page, recent window (2 pages), then the heaviest pages up to the budget
    forced = torch.tensor([0, num_pages - 2, num_pages - 1], device=dev)
    rank = importance.clone()
    rank[forced] = float("inf")
    hot = torch.sort(torch.topk(rank, budget).indices).values.to(torch.int32)
    cold = torch.tensor(sorted(set(range(num_pages)) - set(hot.tolist())), dtype=torch.int32,
                        device=dev)
    recall = max(1, int(recall_fraction * num_pages))
    # device ("HBM") pool: the hot set plus a staging area for recalled pages
    hbm = torch.empty(budget + cold.numel(), 2, page_size, hkv, d, dtype=dtype, device=dev)
    copy_pages(host, hot, hbm, torch.arange(budget, dtype=torch.int32, device=dev))

    # 3. metadata of every page on the device (computed here from the host copy once)
    kmin, kmax = page_metadata(prefill_pool, all_pages,
                               torch.full((num_pages,), page_size, dtype=torch.int32, device=dev))

    # dense fp64 reference over the whole context
    ref = sparse_decode_reference(q.double().cpu(), host.double().cpu(), full_table.to("cpu"),
                                  return_page_mass=True)
    needle_mass = float(ref.page_mass[needles].sum() / ref.page_mass.sum())

    hot_table = _table(torch.arange(budget, dtype=torch.int32, device=dev), page_size)
    rows = []

    def timed(fn):
        t0 = time.perf_counter()
        result = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return result, 1e3 * (time.perf_counter() - t0)

    def row(method, attended_logical, copied, out):
        err = float((out.double().cpu() - ref.out).abs().max())
        captured = float(ref.page_mass[attended_logical.long().cpu()].sum() / ref.page_mass.sum())
        found = len(set(attended_logical.tolist()) & set(needles.tolist()))
        return DemoRow(method, int(attended_logical.numel()), int(copied.numel()),
                       int(copied.numel()) * page_bytes, err, captured, found, 0.0)

    # evict: only the hot set exists
    res, ms = timed(lambda: sparse_decode(q, hbm, hot_table))
    r = row("evict (hot set only)", hot, hot[:0], res.out)
    r.ms = ms
    rows.append(r)

    # offload, exact: fetch every cold page (one launch), attend, merge the two partial states
    def exact():
        staged = torch.arange(budget, budget + cold.numel(), dtype=torch.int32, device=dev)
        copy_pages(host, cold, hbm, staged)
        a = sparse_decode(q, hbm, hot_table)
        b = sparse_decode(q, hbm, _table(staged, page_size))
        return merge_states(torch.stack([a.out, b.out]), torch.stack([a.lse, b.lse]))
    (out, _), ms = timed(exact)
    r = row("offload, exact (attend=all)", all_pages, cold, out)
    r.ms = ms
    rows.append(r)

    # offload, top-k: Quest bounds of the cold pages pick what to recall
    def topk():
        scores = quest_score(q, kmin, kmax, _table(cold, page_size))  # [num_cold, H_kv]
        pick = cold[torch.topk(scores.max(-1).values, recall).indices]
        staged = torch.arange(budget, budget + recall, dtype=torch.int32, device=dev)
        copy_pages(host, pick, hbm, staged)
        a = sparse_decode(q, hbm, hot_table)
        b = sparse_decode(q, hbm, _table(staged, page_size))
        return merge_states(torch.stack([a.out, b.out]), torch.stack([a.lse, b.lse]))[0], pick
    (out, pick), ms = timed(topk)
    r = row(f"offload, top-k recall ({recall} pages)", torch.cat([hot, pick]), pick, out)
    r.ms = ms
    rows.append(r)

    return {
        "config": {"context": context, "page_size": page_size, "heads": f"{num_q_heads}/{hkv}",
                   "head_dim": d, "dtype": str(dtype).removeprefix("torch."),
                   "hbm_budget_pages": budget, "num_pages": num_pages, "device": str(dev),
                   "backend": resolve_backend(None, q), "seed": seed},
        "needle_pages": sorted(needles.tolist()),
        "needle_mass_in_dense_attention": needle_mass,
        "needles_in_hot_set": sorted(set(needles.tolist()) & set(hot.tolist())),
        "rows": [asdict(r) for r in rows],
    }


def format_report(result: dict) -> str:
    c = result["config"]
    lines = [
        f"tierattn kernel demo: {c['context']} tokens = {c['num_pages']} pages of "
        f"{c['page_size']}, "
        f"heads {c['heads']}, d={c['head_dim']}, {c['dtype']}, device {c['device']}, "
        f"backend {c['backend']}",
        f"HBM budget {c['hbm_budget_pages']} pages; needle pages {result['needle_pages']} hold "
        f"{100 * result['needle_mass_in_dense_attention']:.1f}% of the new query's attention; "
        f"needles in the hot set: {result['needles_in_hot_set'] or 'none'}",
        "",
        f"{'method':<34} {'pages':>6} {'H2D pages':>10} {'H2D bytes':>10} "
        f"{'max|out-dense|':>15} {'mass kept':>10} {'needles':>8} {'ms':>8}",
    ]
    for r in result["rows"]:
        lines.append(f"{r['method']:<34} {r['pages_attended']:>6} {r['pages_copied_h2d']:>10} "
                     f"{r['bytes_h2d']:>10} {r['max_abs_err']:>15.2e} "
                     f"{100 * r['mass_captured']:>9.1f}% "
                     f"{r['needles_attended']:>4}/{len(result['needle_pages'])}   {r['ms']:>8.1f}")
    lines.append("(max|out-dense| against fp64 dense attention over all pages; ms is wall time "
                 "on this machine, interpreter times are not GPU times)")
    return "\n".join(lines)


def main(out: str | None = None, **kwargs) -> dict:
    result = run_demo(**kwargs)
    print(format_report(result))
    save_json(result, out)
    return result
