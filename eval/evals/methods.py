"""The methods an eval compares at one HBM budget, as :class:`~tierattn.config.TierConfig`s, at
**equal HBM bytes**.

At HBM budget ``hbm`` every method holds at most ``hbm`` of the full KV bytes per layer, counting
its resident pages, the pages it must keep hot (the sink page and the page being filled), and
its key tier (the key range and key sketch of every page, for ``topk``); staging buffers are
reported apart. Bytes are counted for 16-bit KV, the deployment dtype, whatever precision a run
computes in. Budgets round *down* to whole pages (``budget_rounding="down"``), so no method
holds a partial page over its share; a cell whose must-hot pages do not fit in its share is
**infeasible** and is reported as such, not run over budget.

=================  ============================================================================
``full``           the model's own attention and cache (the reference; no budget)
``offload``        ``hbm`` hot, the rest demoted to DDR and fetched back for every step
                   (``attend="all"``): exact, whatever the budget
``topk``           ``hbm`` minus the key tier hot, plus the best ``RECALL`` of the cold pages
                   per step by the key sketch (each page's estimated share of each KV head's
                   attention, from 4-bit codes of every key projected onto 3/8 of the head
                   dim: ``KEY_TIERS``), fetched from DDR into staging
``topk-max``       the same ranked by the sketch's largest logit per page (the needle finder)
``topk-quest``     the same with Quest's bound instead of the sketch (the key range only)
``split``          ``hbm`` hot, the cold pages attended where they live, on the host CPU, their
                   partial state merged with the hot set's (``attend="split"``): exact; the
                   link carries the query and the partial state
``adaptive``       ``topk``'s budget and key tier, each layer choosing every 16 steps between
                   ``topk``'s recall (where its last probe -- a step attended exactly -- found
                   that the sketch's pick holds 90% of the cold mass) and the cheaper exact
                   way, split or all, by the cost model of a modeled server (``SERVER``: PCIe
                   and DDR rates, not this machine's)
``evict-h2o``      ``hbm`` kept, the rest dropped by accumulated attention (H2O)
``evict-snapkv``   ``hbm`` kept, dropped once after prefill by the prompt's last queries (SnapKV)
``evict-snapkv-decode``  the same, re-scored by the last decode queries as the trace grows
``evict-rkv``      ``hbm`` kept as the trace grows by R-KV (recent attention less redundancy)
``evict-streaming`` sinks + the most recent tokens (StreamingLLM)
``evict-random``   ``hbm`` kept, the rest dropped at random (seeded)
``oracle``         drops right after prefill all but ``hbm`` of the prompt, keeping the sink, the
                   page being filled and, within that budget, the pages holding the edges the
                   answer needs (an upper bound for any eviction policy at that budget)
=================  ============================================================================

Must-hot pages count inside the budget, so each method keeps the smallest set its authors'
design needs: the page being filled always, the sink page for every method but ``topk``
(StreamingLLM, R-KV and the others keep the first tokens; ``topk`` recalls the first page like
any other when its keys score), no extra recent pages. ``topk``'s resident share is what its key
tier leaves: at 25% HBM, 25% - 4.7% = 20.3%. The key tier is 4-bit codes of each key projected
onto the 3/8 of the head dim that carry the prompt's logits (``key_rank=0.375``,
:func:`~tierattn.runtime.importance.key_basis`). Measured on the reasoner (200 items, 8-token pages,
recall 25% of the cold pages): it scores 0.975 / 0.990 / 0.995 / 0.990 at 10 / 25 / 50 / 75% HBM,
where every channel at 4 bits (12.5%) scores - / 0.970 / 0.990 / 0.975 at a 20% recall (0.970 /
0.985 / 0.995 / 0.990 projected at that recall): the pages the smaller tier gives back to the
hot set are worth more than the channels it drops. On SmolLM2 (``tierattn eval keytier``, 2K
context, 8-token pages, 10% recalled) it misses 1.05x the oracle's attention mass, against
1.03x for every channel at 4 bits and 1.23x at 2 bits (6.25%). Where the 4.7% tier leaves the
must-hot pages no room (below ~7% HBM on the reasoner's prompts) it narrows to 1/4 of the head
dim (3.1%; 1.08x the oracle there).

Recall follows the budget (``recall_scope="cold"``): ``RECALL`` of the tokens outside the hot
set, so ``topk`` moves about ``RECALL x (1 - hbm + key tier) / (1 - hbm)`` of offload's bytes at
every budget (a fraction of the *sequence*, as before, moved 20% at 25% HBM but 65% at 75%).

Why 8-token pages (``PAGE_SIZE``): on the reasoner's ~290-token prompts a 16-token page is 5.5%
of the prompt, so at 25% HBM ``topk`` keeps 2 resident pages and a recall of 20% fetches ~3
pages of ~5 unrelated edges each; 8-token pages give 4 resident pages and recall twice as many
distinct places for the same bytes (measured on 100 items: 0.76-0.89 at 16 tokens, 0.98 at 8).
The must-hot set (2 pages for the eviction methods, 5.5% of the prompt) leaves every method room
to choose at 25%. The previous default (16-token pages with sink, two recent pages and the page
being filled: 21% of the prompt) made every method hold more than 25% there.

Recall is synchronous in the eval (``prefetch="none"``): the layer-ahead prefetch of the
previous step's selection is a latency optimization that, on this model, fetches ~36% of its
bytes for nothing, and the H2D column counts every byte moved.

``grid_config(hbm, evict)`` mixes offload and eviction: ``evict`` of the sequence dropped by H2O,
``hbm`` kept hot and the rest offloaded, for the claim "accuracy depends on the eviction ratio,
not the HBM ratio".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tierattn.config import TierConfig, TierSpec

__all__ = ["KEY_TIERS", "METHODS", "PAGE_SIZE", "RECALL", "SERVER", "TOPK", "SINK_PAGES",
           "RECENT_PAGES",
           "Cell",
           "evict_ratio", "grid_config", "key_tier_fraction", "method_config", "plan_cell",
           "sketch_bits", "sketch_rank"]

METHODS = ("full", "offload", "split", "topk", "adaptive", "topk-max", "topk-quest", "evict-h2o",
           "evict-snapkv", "evict-snapkv-decode", "evict-rkv", "evict-streaming", "evict-random",
           "oracle")

#: the recall methods: the same budget and recall, ranked three ways
TOPK = ("topk", "topk-max", "topk-quest")
#: the recall methods that rank by the key sketch (the others by Quest's key range)
SKETCH_METHODS = ("topk", "topk-max", "adaptive")
#: the machine ``adaptive`` chooses for (modeled, not measured): a PCIe Gen5 x16 link
#: (``eval/hardware/h100.json``'s host-to-device rate) and a server socket's DDR5 read at 75%
#: by the host attention kernel, by bytes alone -- no fixed latencies: the reasoners' KV is
#: 256 bytes per token and layer (a Llama-8B layer's is 4 KiB), so at their size a recall's
#: and a round trip's fixed costs would decide every choice, which says nothing of a model at
#: scale; on this 2-core machine the host itself attends at ~16-25 GB/s
SERVER = {"link_bandwidth": 55e9, "host_bandwidth": 0.75 * 150e9, "link_latency": 0.0,
          "host_latency": 0.0}
#: tokens per page of the eval (see the module docstring)
PAGE_SIZE = 8
#: pages top-k recalls per step, as a fraction of the cold tokens (``recall_scope="cold"``:
#: a fixed share of what offload moves at every budget; into staging, outside the budget;
#: ``TierConfig.recall_budget``)
RECALL = 0.25
#: ``(key_bits, key_rank)`` of ``topk``'s key sketch: the first of these that leaves the
#: must-hot pages room (:func:`plan_cell`): 4-bit codes of 3/8 of the channels, projected
#: (4.7% of the KV bytes), else of 1/4 (3.1%)
KEY_TIERS = ((4, 0.375), (4, 0.25))
#: the must-hot set (see the module docstring); ``topk`` keeps no sink page
SINK_PAGES, RECENT_PAGES = 1, 0
#: bytes per K or V element the budgets are counted in (16-bit KV)
KV_BYTES = 2


def sketch_bits(config: TierConfig | None) -> int | None:
    """Bits per key channel of ``config``'s key sketch (None without one)."""
    return config.key_bits if config is not None and config.key_sketch else None


def sketch_rank(config: TierConfig | None) -> float | None:
    """The share of the head dim ``config``'s key sketch keeps (None without one)."""
    return config.key_rank if config is not None and config.key_sketch else None


def key_tier_fraction(config: TierConfig | None) -> float:
    """HBM the key tier of ``config`` holds, as a fraction of the full K+V bytes: the key range
    (two rows of ``D`` per page against ``2 P`` rows of K and V) and the key sketch
    (``key_bits`` per kept key channel -- ``key_rank`` of them, a fraction of the head dim --
    against ``2 x 16`` bits of K and V; its quantization range and projection, per layer and
    KV head, are negligible)."""
    if config is None:
        return 0.0
    frac = 1.0 / config.page_size if config.key_range else 0.0
    if config.key_sketch:
        if not isinstance(config.key_rank, float):
            raise ValueError(f"key_rank={config.key_rank!r}: the eval counts a key sketch's "
                             "channels as a fraction of the head dim; pass a float.")
        frac += config.key_bits * config.key_rank / (8 * 2 * KV_BYTES)
    return frac


@dataclass(frozen=True)
class Cell:
    """One method at one HBM budget: its config and its HBM accounting.

    Attributes:
        resident: fraction of the KV pages it may keep in HBM (budget less the key tier).
        key_tier: fraction of the full KV bytes its key tier holds.
        must_pages: pages every sequence keeps hot whatever the budget.
        feasible: False when ``must_pages`` do not fit in ``resident`` (``reason`` says why).
    """

    method: str
    hbm: float
    config: TierConfig | None
    resident: float
    key_tier: float
    must_pages: int
    feasible: bool = True
    reason: str = ""


def method_config(method: str, hbm: float, *, page_size: int = PAGE_SIZE, max_context: int = 4096,
                  backend: str = "auto", seed: int = 0, recall: float = RECALL,
                  key_bits: int = KEY_TIERS[0][0], key_rank: float = KEY_TIERS[0][1]
                  ) -> TierConfig | None:
    """The TierConfig of ``method`` at HBM ratio ``hbm`` (None for ``full``), sized so that its
    resident pages and key tier together hold at most ``hbm`` of the KV bytes; ``recall``: the
    cold pages the ``topk`` methods recall per step, as a fraction of the cold tokens (into
    staging); ``key_bits``, ``key_rank``: the width and the channels (a fraction of the head
    dim) of the sketch methods' key sketch.

    Raises:
        ValueError: unknown ``method``, ``hbm`` outside ``(0, 1]``, or a key tier that alone
            exceeds ``hbm``.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}.")
    if not 0.0 < hbm <= 1.0:
        raise ValueError(f"hbm={hbm!r} must be a fraction in (0, 1].")
    if not 0.0 < recall <= 1.0:
        raise ValueError(f"recall={recall!r} must be a fraction of the cold tokens in (0, 1].")
    common = {"page_size": page_size, "max_context": max_context, "backend": backend,
              "prefill_chunk_size": max_context, "seed": seed, "sink_pages": SINK_PAGES,
              "recent_pages": RECENT_PAGES, "budget_rounding": "down"}
    if method == "full":
        return None
    if method in ("offload", "split"):
        return TierConfig.preset(method, hot_budget=hbm, **common)
    if method in (*TOPK, "adaptive"):
        score = "sketch" if method in SKETCH_METHODS else "quest"
        reduce = "max" if method == "topk-max" else "lse"
        extra = SERVER if method == "adaptive" else {}
        cfg = TierConfig.preset("adaptive" if method == "adaptive" else "topk",
                                recall_budget=recall, recall_scope="cold",
                                recall_score=score, sketch_reduce=reduce, key_bits=key_bits,
                                key_rank=key_rank, prefetch="none",
                                **{**common, "sink_pages": 0}, **extra)
        resident = round(hbm - key_tier_fraction(cfg), 6)
        if resident <= 0:
            raise ValueError(f"{method}: its key tier ({key_tier_fraction(cfg):.3f} of the KV "
                             f"bytes) alone exceeds hbm={hbm}.")
        return cfg.replace(hot_budget=resident)
    if method == "oracle":  # no eviction by the runtime: the eval drops pages after prefill
        return TierConfig(hot_budget=1.0, tiers=(TierSpec("hbm"),),
                          **{**common, "budget_rounding": "up"})
    if method == "evict-random":
        return TierConfig.preset("evict-h2o", evict_policy="random", hot_budget=hbm,
                                 evict_budget=round(1.0 - hbm, 6), **common)
    return TierConfig.preset(method, hot_budget=hbm, evict_budget=round(1.0 - hbm, 6), **common)


def plan_cell(method: str, hbm: float, *, prompt_tokens: int, page_size: int = PAGE_SIZE,
              max_context: int = 4096, backend: str = "auto", seed: int = 0,
              recall: float = RECALL) -> Cell:
    """``method`` at ``hbm`` with its accounting; infeasible when the must-hot pages do not fit
    in the resident share of the shortest prompt (``prompt_tokens``). A key sketch takes the
    first of :data:`KEY_TIERS` that leaves them room (the last attempt's reason when none
    does)."""
    tiers = KEY_TIERS if method in SKETCH_METHODS else KEY_TIERS[:1]
    cells = []
    for bits, rank in tiers:
        cells.append(_plan(method, hbm, bits, rank, prompt_tokens=prompt_tokens,
                           page_size=page_size, max_context=max_context, backend=backend,
                           seed=seed, recall=recall))
        if cells[-1].feasible:
            return cells[-1]
    if len(cells) == 1:
        return cells[0]
    tried = "; ".join(f"{b}-bit sketch of {r:g} of the channels: {c.reason.rstrip('.')}"
                      for (b, r), c in zip(tiers, cells))
    return dataclasses.replace(cells[-1], reason=tried)


def _plan(method: str, hbm: float, key_bits: int, key_rank: float, *, prompt_tokens: int,
          page_size: int, max_context: int, backend: str, seed: int, recall: float) -> Cell:
    """:func:`plan_cell` at one key sketch."""
    try:
        cfg = method_config(method, hbm, page_size=page_size, max_context=max_context,
                            backend=backend, seed=seed, recall=recall, key_bits=key_bits,
                            key_rank=key_rank)
    except ValueError as e:
        if method not in METHODS or not 0.0 < hbm <= 1.0 or not 0.0 < recall <= 1.0:
            raise
        return Cell(method, hbm, None, 0.0, 0.0, 1, False, str(e))
    must = 1 if cfg is None else cfg.sink_pages + cfg.recent_pages + 1
    key = key_tier_fraction(cfg)
    resident = 1.0 if cfg is None else hbm if method == "oracle" else round(hbm - key, 6)
    allowed = int(resident * prompt_tokens) // page_size
    if cfg is not None and must > allowed:
        return Cell(method, hbm, cfg, resident, key, must, False,
                    f"{must} must-hot pages do not fit in {resident:.3f} of a {prompt_tokens}-"
                    f"token prompt ({allowed} pages of {page_size})")
    return Cell(method, hbm, cfg, resident, key, must)


def evict_ratio(method: str, hbm: float) -> float:
    """The fraction of each sequence ``method`` drops for good at HBM ratio ``hbm``."""
    return 0.0 if method in ("full", "offload", "split", "adaptive", *TOPK) else \
        round(1.0 - hbm, 6)


def grid_config(hbm: float, evict: float, *, page_size: int = PAGE_SIZE, max_context: int = 4096,
                backend: str = "auto") -> TierConfig:
    """``evict`` of each sequence dropped (H2O), ``hbm`` hot, the rest offloaded to DDR."""
    return TierConfig(hot_budget=hbm, evict_budget=evict, evict_policy="h2o", attend="all",
                      page_size=page_size, max_context=max_context,
                      prefill_chunk_size=max_context, backend=backend, sink_pages=SINK_PAGES,
                      recent_pages=RECENT_PAGES, budget_rounding="down")
