"""Why topk misses the 3-point target at 10% HBM on the long task (a diagnostic, not a study).

The shipped long reasoner, the long task's main section (seed 2026), 10% HBM, greedy:

0. spread  -- the plain model (no tierattn, eager attention), ``--spread-items`` items: where
              each layer's answer-step queries put their attention over the prompt's edges
              (mass on edge sources, targets, separators, fillers), the share of the tokens
              that hold 90% of it and its effective number of tokens (exp of the entropy).
1. mass    -- for every decode step, layer and sequence of ``--mass-items`` items: the share of
              each head's cold attention mass that the recalled pages hold (as run: the 4-bit
              key sketch's selection), that the same number of pages would hold if chosen by the
              exact mass (oracle, one selection shared by the KV heads as topk's is), and if
              each KV head chose its own pages (oracle per head); the cold set's share of the
              whole mass; the share of the cold pages the oracle needs for 90% / 95% of the
              cold mass. Means per layer.
   (1b, ``mass-recalls``: the same at the larger recall shares ``--mass-recalls``.)
2. curve   -- accuracy and H2D bytes per token as the recalled share of the cold tokens grows
              (``recall_budget`` with ``recall_scope="cold"``: 0.25 is topk's default), next to
              the full cache and exact offload: what this reader costs.
3. tails   -- the recalled pages plus an estimate of what the unrecalled cold tokens contribute
              (their exact mass, so an upper bound for any estimate of it):
                 exact  their exact weighted values (a check of the plumbing: offload's result);
                 page   each page's mean value, weighted by the page's exact mass;
                 mean   the mean value of all of them (SparQ's "mean value reallocation").
4. sketched -- the ``exact`` tail computed from estimated keys (weights) or values, on
              ``--sketched-items`` items beside the full cache and topk as shipped: keys or
              values at 8 / 6 / 4 bits per channel (uniform over each channel's range), and
              topk's own key tier (``key_rank`` channels of the fitted basis at ``key_bits``).
5. split   -- the recall shared unevenly by the layers (``--splits``: the share of the cold tokens
              each layer recalls), to compare with the curve's uniform recalls at similar bytes:
              what a recall that follows each layer's mass would do; and one layer's recall
              made exact (1.0) with the others' at topk's 0.25: which layers' reads matter.
6. short   -- parts 0 and 1 for the short reasoner on its own task (``--short-items``, its
              full cache and topk at the same HBM share beside them): is it less diffuse?

    python eval/results/reasoning-reasoner_long-long-n200-ps8-seed2026-diagnosis-b0.1/diagnose.py

(run from outside the repository root, or the top-level ``kernels/`` folder shadows the
package's; 18 minutes on 2 CPU cores; ``--parts`` runs some parts and keeps the others'
results, part 5 reading offload's bytes from part 2's). Writes ``diagnosis.json`` and
``curve.png`` beside itself. Parts 1, 1b, 3, 4 and 6 patch
:meth:`tierattn.attention.Attention.decode` in this process only: their extra passes over the
cold pages are diagnostics and their bytes are not topk's; part 5 replaces
``SketchTopK.budget`` the same way.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from tierattn.attention import Attention
from tierattn.importance import project_keys
from tierattn.kernels import merge_states
from tierattn.kernels.sketch import quantize_keys, unpack_keys
from tierattn.policy import SketchTopK
from tierattn.eval import reasoning as R
from tierattn.eval.methods import plan_cell
from tierattn.eval.tasks import EOS, PAD, SEP, make_examples
from tierattn.eval.train_reasoner import SHIPPED, SHIPPED_LONG, load_reasoner

HERE = Path(__file__).parent
ORIGINAL = Attention.decode
NEG = float("-inf")


def entry_rows(table) -> torch.Tensor:
    """``[nnz]`` row of each entry of a PageTable, -1 for slots no row owns (a recall layout
    reserves ``k`` slots per row and fills ``min(k, count)``)."""
    rows = torch.full((table.indices.numel(),), -1, dtype=torch.long)
    for r, (s, c) in enumerate(zip(table.row_start.tolist(), table.row_count.tolist())):
        rows[s:s + c] = r
    return rows


def page_terms(q: torch.Tensor, pool: torch.Tensor, dtable, scale: float, ref: torch.Tensor,
               keys=None, values=None) -> dict[str, torch.Tensor]:
    """Per row, over the staged pages of ``dtable``, with page masses relative to ``exp(ref)``
    (``ref [B, H_q]``), in fp64:
    ``mass [B, H_q]`` sum of the pages' exact masses; ``exact [B, H_q, D]`` their exact
    mass-weighted values; ``page`` each page's mean value times its mass; ``vsum``/``count``
    the sum of the values and the number of tokens; ``pages [nnz, H_q]`` each entry's mass and
    ``rows [nnz]`` its row. ``keys``/``values``: functions of the staged
    ``[nnz, P, H_kv, D]`` keys / values and the ``[nnz, P]`` mask of real tokens that return
    an estimate of them (the tail variants' sketches)."""
    t = dtable.table
    b, hq, d = q.shape
    rows = entry_rows(t)
    own = rows >= 0
    kv = pool[t.indices.long()].float()  # [nnz, 2, P, H_kv, D]
    k, v = kv[:, 0], kv[:, 1]
    nnz, p, hkv = k.shape[0], k.shape[1], k.shape[2]
    g = hq // hkv
    lane = torch.arange(p)
    valid = own[:, None].expand(nnz, p).clone()
    if dtable.first_lane is not None:
        valid &= lane[None] >= dtable.first_lane.long()[:, None]
    last = (t.row_start + t.row_count - 1).long()
    full = torch.full((nnz,), p)
    has = t.row_count > 0
    full[last[has]] = t.last_page_len[has].long()
    valid &= lane[None] < full[:, None]
    k = k if keys is None else keys(k, valid)
    v = v if values is None else values(v, valid)
    r = rows.clamp(min=0)
    qe = q[r].view(nnz, hkv, g, d)
    logit = torch.einsum("nhgd,nphd->nhgp", qe, k) * scale
    logit = logit.masked_fill(~valid[:, None, None, :], NEG)
    lse = torch.logsumexp(logit, -1).reshape(nnz, hq)  # [nnz, H_q]
    w = torch.exp((lse - ref[r]).double()).nan_to_num(0.0)  # fp64: sharp heads pass 1e38
    prob = torch.softmax(logit, -1).nan_to_num(0.0)
    vexact = torch.einsum("nhgp,nphd->nhgd", prob, v).reshape(nnz, hq, d)
    cnt = valid.sum(1).float()
    vsum = (v * valid[..., None, None]).sum(1).repeat_interleave(g, 1)  # [nnz, H_q, D]
    vmean = vsum / cnt.clamp(min=1)[:, None, None]

    def add(x):
        x = x.double()
        return torch.zeros(b, *x.shape[1:], dtype=x.dtype).index_add_(0, r[own], x[own])
    return {"mass": add(w), "exact": add(w[..., None] * vexact), "page": add(w[..., None] * vmean),
            "vsum": add(vsum), "count": add(cnt[:, None].expand(nnz, hq).contiguous()),
            "pages": w, "rows": rows}


def quantized(bits: int):
    """An estimate of staged keys or values ``[nnz, P, H_kv, D]``: each channel of each head
    quantized to ``bits`` over the range its real tokens span (uniform, round to nearest)."""
    def estimate(x, valid):
        x = x.nan_to_num(0.0)
        big = torch.finfo(x.dtype).max
        m = valid[..., None, None]
        lo = torch.where(m, x, big).amin(dim=(0, 1), keepdim=True)
        hi = torch.where(m, x, -big).amax(dim=(0, 1), keepdim=True)
        step = (hi - lo).clamp(min=1e-8) / (2 ** bits - 1)
        return torch.round((x - lo) / step) * step + lo
    return estimate


def key_sketch(att, layer: int):
    """An estimate of staged keys ``[nnz, P, H_kv, D]``: topk's own key tier (``key_rank``
    channels of the fitted basis at ``key_bits``, its fitted range), mapped back to D
    channels so that ``q . k_hat`` is the logit the sketch kernel estimates."""
    imp = att.importance

    def estimate(k, valid):
        basis = None if imp.basis is None else imp.basis[layer].float()
        kp = k if basis is None else project_keys(k.nan_to_num(0.0), basis)
        n = kp.shape[0]
        lo = imp.sk_lo[layer].float().expand(n, -1, -1)
        hi = imp.sk_hi[layer].float().expand(n, -1, -1)
        k_hat = unpack_keys(quantize_keys(kp, lo, hi, bits=imp.key_bits), lo, hi,
                            bits=imp.key_bits).float()
        return k_hat if basis is None else torch.einsum("nphr,hdr->nphd", k_hat, basis)
    return estimate


class Probe:
    """Wraps :meth:`Attention.decode` on topk's decode steps: runs it as shipped, then reads
    every cold page once more (diagnostic) to measure (``mode="mass"``) or to add a tail
    (``mode`` in ``exact``/``page``/``mean``)."""

    def __init__(self):
        self.mode = None
        self.stats = collections.defaultdict(list)
        # the tail's estimates of the unrecalled keys / values: None (exact) or
        # ``f(att, layer) -> estimate(x, valid)``
        self.keys = self.values = None

    def take_means(self) -> dict[str, float]:
        """The mass statistics gathered since the last call, averaged; then cleared."""
        means = {k: sum(v) / len(v) for k, v in sorted(self.stats.items())}
        self.stats.clear()
        return means

    def install(self):
        probe = self

        def decode(att, layer, qd, tabs, buffer, common):
            if probe.mode is None or att.policies.recall.exact or not tabs.cold_pages:
                return ORIGINAL(att, layer, qd, tabs, buffer, common)
            return probe.decode(att, layer, qd, tabs, buffer, common)
        Attention.decode = decode

    def decode(self, att, layer, qd, tabs, buffer, common):
        q1, scale = qd[:, :, 0].float(), common["sm_scale"]
        est = {"keys": self.keys and self.keys(att, layer),
               "values": self.values and self.values(att, layer)}
        real, hot_ptr = att.kernels.sparse_decode, att.hbm.pool(layer).data_ptr()
        seen = {}

        def spy(q, pool, table, **kw):  # the shipped launches, and what they attended
            res = real(q, pool, table, **kw)
            if pool.data_ptr() == hot_ptr:
                seen["hot"] = torch.nan_to_num(kw["lse"].clone(), neginf=0.0)
            else:
                dt = SimpleNamespace(table=table, first_lane=kw.get("first_lane"))
                seen["sel"] = page_terms(q1, pool, dt, scale, seen["hot"], **est)
            return res
        att.kernels.sparse_decode = spy
        try:
            out, lse = ORIGINAL(att, layer, qd, tabs, buffer, common)
        finally:
            att.kernels.sparse_decode = real
        out, lse, ref = out.clone(), lse.clone(), seen["hot"]
        cold = []
        for _ in att.prefetcher.attend_cold(
                layer, tabs, buffer,
                lambda pool, dt: cold.append(page_terms(q1, pool, dt, scale, ref, **est))):
            pass
        sel = seen.get("sel")

        def total(key):
            return sum(c[key] for c in cold) - (sel[key] if sel is not None else 0)
        if self.mode == "mass":
            self.measure(att, layer, ref, cold, sel, k=att.policies.recall.budget(layer))
            return out, lse
        mass = total("mass").clamp(min=0)
        if self.mode == "mean":
            tail = total("vsum") / total("count").clamp(min=1)[..., None]
        else:
            tail = total(self.mode) / mass.clamp(min=1e-30)[..., None]
        tail_lse = torch.where(mass > 0, mass.clamp(min=1e-30).log() + ref,
                               torch.full_like(mass, NEG))
        return merge_states(torch.stack([out, tail.float()]),
                            torch.stack([lse, tail_lse.float()]), backend="torch")

    def measure(self, att, layer, ref, cold, sel, k):
        """Shares of the cold mass held by the recalled pages, the oracle shared selection and
        the oracle per-KV-head selection of the same ``k`` pages; the cold share of the mass; the
        share of the cold pages the oracle shared ranking needs to hold 90% / 95% of it."""
        hkv = att.num_kv_heads
        cold_mass = sum(c["mass"] for c in cold)  # [B, H_q] relative to the hot set's mass
        got = sel["mass"] if sel is not None else torch.zeros_like(cold_mass)
        pages = torch.cat([c["pages"] for c in cold])
        rows = torch.cat([c["rows"] for c in cold])
        for b in range(cold_mass.shape[0]):
            mine = pages[rows == b]
            if not len(mine) or not k:
                continue
            g = mine.shape[1] // hkv
            share = (mine / cold_mass[b].clamp(min=1e-30)).view(len(mine), hkv, g).mean(-1)
            kk = min(k, len(mine))
            shared = share[share.sum(1).topk(kk).indices].sum(0)  # [H_kv]
            per_head = share.topk(kk, dim=0).values.sum(0)
            order = share.sum(1).argsort(descending=True)
            cum = share[order].mean(1).cumsum(0)  # the heads' mean share, best pages first
            need = {f"oracle_pages_for_{int(100 * f)}": (cum < f).sum().add(1).clamp(
                max=len(mine)).double() / len(mine) for f in (0.9, 0.95)}
            recalled = (got[b] / cold_mass[b].clamp(min=1e-30)).view(hkv, g).mean(-1)
            cold_share = (cold_mass[b] / (1 + cold_mass[b])).mean()  # hot's mass is exp(ref)
            for key, val in (("cold_share", cold_share), ("recalled", recalled.mean()),
                             ("oracle_shared", shared.mean()),
                             ("oracle_per_head", per_head.mean()),
                             ("pages_recalled", torch.tensor(kk / len(mine))),
                             *need.items()):
                self.stats[f"layer{layer}/{key}"].append(float(val))


def spread(model, vocab, examples) -> dict[str, float]:
    """Part 0: per layer, the answer-step queries' attention over the prompt body (heads and
    steps averaged): mass by token class, tokens for 90% of it, effective tokens."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only one that returns the weights
    classes = ("source", "target", "sep", "filler")
    acc = collections.defaultdict(list)
    for e in examples:
        body = len(e.prompt) - 3  # the prompt's edges, before ``? v0 >``
        p = e.prompt
        cls = torch.tensor([0 if vocab.is_node(p[i]) and p[i + 2] == SEP else
                            1 if vocab.is_node(p[i]) else 2 if p[i] == SEP else 3
                            for i in range(1, body)])
        ids = torch.tensor([e.prompt + e.target[:-1]])
        with torch.no_grad():
            attn = model(ids, output_attentions=True).attentions
        for layer, a in enumerate(attn):
            a = a[0, :, len(e.prompt) - 1:, 1:body]  # [H, steps, body tokens]
            a = a / a.sum(-1, keepdim=True)
            for c, name in enumerate(classes):
                acc[f"layer{layer}/mass_{name}"].append(float(a[..., cls == c].sum(-1).mean()))
            cum = a.sort(-1, descending=True).values.cumsum(-1)
            acc[f"layer{layer}/tokens_for_90"].append(float(
                ((cum < 0.9).sum(-1) + 1).float().mean() / a.shape[-1]))
            acc[f"layer{layer}/effective_tokens"].append(float(
                torch.exp(-(a * a.clamp(min=1e-12).log()).sum(-1)).mean()))
            acc[f"layer{layer}/body_tokens"].append(float(a.shape[-1]))
    model.set_attn_implementation(before)
    return {k: sum(v) / len(v) for k, v in sorted(acc.items())}


class Reader:
    """A shipped reasoner on ``n`` items of its task's main section (seed 2026), its cells
    planned as the study plans them (8-token pages) at ``hbm``."""

    def __init__(self, path: Path, task: str, n: int, hbm: float):
        self.model, self.vocab = load_reasoner(path)
        cfg = R.tasks(self.vocab, task)["main"]
        self.examples = make_examples(cfg, n, seed=2026)
        self.steps = cfg.hop_range[1] + 4
        longest = max(len(e.prompt) for e in self.examples)
        self.max_context = -(-(longest + self.steps + 8) // 8) * 8
        self.shortest = min(len(e.prompt) for e in self.examples)
        self.hbm = hbm

    def run(self, method: str, name: str | None = None, **plan) -> dict:
        """The run of ``method`` (``plan``: :func:`plan_cell`'s options, ``recall``)."""
        if method == "full":
            return {"method": "full", "config": None}
        config = plan_cell(method, self.hbm, prompt_tokens=self.shortest,
                           max_context=self.max_context, **plan).config
        return {"method": name or method, "config": config, "hbm": self.hbm}

    def evaluate(self, runs: list[dict], n: int) -> list[dict]:
        """Greedy rows of ``runs`` on the first ``n`` items."""
        return R.evaluate_items(self.model, R._pointer_items(self.examples[:n]), runs,
                                steps=self.steps, eos_id=EOS, pad_id=PAD,
                                teacher_forcing=False)


#: part 4's tails: (name, keys estimate, values estimate); None: exact
SKETCHED = (("keys 8-bit", lambda att, layer: quantized(8), None),
            ("keys 6-bit", lambda att, layer: quantized(6), None),
            ("keys 4-bit", lambda att, layer: quantized(4), None),
            ("topk's key sketch", key_sketch, None),
            ("values 8-bit", None, lambda att, layer: quantized(8)),
            ("values 6-bit", None, lambda att, layer: quantized(6)),
            ("values 4-bit", None, lambda att, layer: quantized(4)))


class Split:
    """Per-layer recall shares for :class:`SketchTopK` (``None``: the config's own)."""

    def __init__(self):
        self.shares = None
        budget = SketchTopK.budget

        def per_layer(recall, layer):
            if self.shares is None:
                return budget(recall, layer)
            config = dataclasses.replace(recall.config, recall_budget=self.shares[layer])
            return config.recall_pages(recall.pages.num_pages(layer), recall.pages.length(layer))
        SketchTopK.budget = per_layer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--spread-items", type=int, default=20)
    ap.add_argument("--mass-items", type=int, default=20)
    ap.add_argument("--sketched-items", type=int, default=50)
    ap.add_argument("--hbm", type=float, default=0.1)
    ap.add_argument("--recalls", default="0.25,0.4,0.6,0.8,1.0")
    ap.add_argument("--short-items", type=int, default=40)
    ap.add_argument("--mass-recalls", default="0.4,0.6",
                    help="part 1b: part 1 again at these recall shares")
    ap.add_argument("--splits", default="0.25/1/0.25,1/0.25/1,0.8/0.07/0.8,0.35/0.05/0.35",
                    help="part 5: comma-separated per-layer recall shares, '/' between layers")
    ap.add_argument("--parts", default="spread,mass,mass-recalls,curve,tails,sketched,split,short",
                    help="which parts to run; the others keep their results in diagnosis.json")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    long = Reader(SHIPPED_LONG, "long", args.items, args.hbm)

    def topk(recall, name=None):
        return long.run("topk", name, recall=recall)

    def tail_run(n, name):
        return long.evaluate([topk(0.25, f"topk-r0.25+tail-{name}")], n)[-1]["accuracy"]
    out = HERE / "diagnosis.json"
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update({"model": str(SHIPPED_LONG.name), "task": "long", "seed": 2026,
                   "hbm": args.hbm, "recall_budget": 0.25})
    probe = Probe()
    probe.install()
    t0 = time.time()
    if "spread" in parts:
        result["spread"] = {"items": args.spread_items,
                            **spread(long.model, long.vocab, long.examples[:args.spread_items])}
        print(json.dumps(result["spread"], indent=1), flush=True)
    if "mass" in parts:
        probe.mode = "mass"
        probe.take_means()
        long.evaluate([topk(0.25)], args.mass_items)
        result["mass"] = {"items": args.mass_items, **probe.take_means()}
        print(json.dumps(result["mass"], indent=1), f"{time.time() - t0:.0f}s", flush=True)
    if "mass-recalls" in parts:
        result["mass_by_recall"] = {}
        for r in map(float, args.mass_recalls.split(",")):
            probe.mode = "mass"
            probe.take_means()
            long.evaluate([topk(r)], args.mass_items)
            result["mass_by_recall"][f"{r:g}"] = {"items": args.mass_items,
                                                  **probe.take_means()}
            print(r, json.dumps(result["mass_by_recall"][f"{r:g}"], indent=1), flush=True)
    if "curve" in parts:
        probe.mode = None
        runs = [long.run("full"), long.run("offload")]
        runs += [topk(r, f"topk-r{r:g}") for r in map(float, args.recalls.split(","))]
        rows = long.evaluate(runs, args.items)
        offload = next(r["h2d_bytes_per_token"] for r in rows if r["method"] == "offload")
        result["curve"] = {"items": args.items, "rows": [
            {"method": r["method"], "accuracy": r["accuracy"],
             "h2d_bytes_per_token": r.get("h2d_bytes_per_token"),
             "bytes_vs_offload": (r.get("h2d_bytes_per_token") or 0) / offload} for r in rows]}
        print(json.dumps(result["curve"], indent=1), f"{time.time() - t0:.0f}s", flush=True)
    if "tails" in parts:
        result["tails"] = {"items": args.items, "rows": []}
        for mode in ("exact", "page", "mean"):
            probe.mode = mode
            result["tails"]["rows"].append({"tail": mode, "accuracy": tail_run(args.items, mode)})
            print(result["tails"]["rows"][-1], f"{time.time() - t0:.0f}s", flush=True)
    if "sketched" in parts:
        probe.mode = None  # the references on the same items: full cache, topk as shipped
        ref = long.evaluate([long.run("full"), topk(0.25)], args.sketched_items)
        result["sketched"] = {"items": args.sketched_items, "rows": [
            {"tail": f"({r['method']})", "accuracy": r["accuracy"]} for r in ref]}
        probe.mode = "exact"
        for name, keys, values in SKETCHED:
            probe.keys, probe.values = keys, values
            acc = tail_run(args.sketched_items, name.replace(" ", "-"))
            result["sketched"]["rows"].append({"tail": name, "accuracy": acc})
            print(result["sketched"]["rows"][-1], f"{time.time() - t0:.0f}s", flush=True)
        probe.keys = probe.values = None
    if "split" in parts:
        probe.mode, split = None, Split()
        offload = next(r["h2d_bytes_per_token"] for r in result["curve"]["rows"]
                       if r["method"] == "offload")
        result["split"] = {"items": args.items, "rows": []}
        for spec in args.splits.split(","):
            split.shares = [float(x) for x in spec.split("/")]
            # the staging buffers are sized by the config's share: the largest layer's
            row = long.evaluate([topk(max(split.shares), f"topk-split-{spec}")],
                                args.items)[-1]
            result["split"]["rows"].append({
                "shares": split.shares, "accuracy": row["accuracy"],
                "bytes_vs_offload": row["h2d_bytes_per_token"] / offload})
            print(result["split"]["rows"][-1], f"{time.time() - t0:.0f}s", flush=True)
        split.shares = None
    if "short" in parts:  # parts 0 and 1 on the short reasoner and its own task
        short = Reader(SHIPPED, "short", args.short_items, args.hbm)
        probe.mode = "mass"
        probe.take_means()
        rows = short.evaluate([short.run("full"), short.run("topk", recall=0.25)],
                              args.short_items)
        result["short"] = {
            "model": SHIPPED.name, "items": args.short_items,
            "accuracy": {r["method"]: r["accuracy"] for r in rows},
            "mass": probe.take_means(),
            "spread": spread(short.model, short.vocab, short.examples[:args.spread_items])}
        print(json.dumps(result["short"], indent=1), f"{time.time() - t0:.0f}s", flush=True)
    probe.mode = None
    out.write_text(json.dumps(result, indent=1))
    plot(result)


def plot(result):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curve = result["curve"]["rows"]
    full = next(r["accuracy"] for r in curve if r["method"] == "full")
    pts = [r for r in curve if r["method"].startswith("topk")]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([100 * r["bytes_vs_offload"] for r in pts], [r["accuracy"] for r in pts], "o-",
            label="topk, recall 25/40/60/80/100% of the cold tokens")
    for r in pts:
        ax.annotate(r["method"].removeprefix("topk-"), (100 * r["bytes_vs_offload"],
                    r["accuracy"]), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.axhline(full, color="k", ls="--", lw=1, label=f"full cache {full:.3f}")
    ax.axhline(full - 0.03, color="grey", ls=":", lw=1, label="3 points under full")
    ax.axvline(30, color="r", ls=":", lw=1, label="30% of offload's bytes")
    ax.set_xlabel("H2D bytes per token, % of exact offload's")
    ax.set_ylabel("accuracy (exact chain)")
    ax.set_title(f"long task, {int(100 * result['hbm'])}% HBM, "
                 f"{result['curve']['items']} items")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(HERE / "curve.png", dpi=120)


if __name__ == "__main__":
    main()
