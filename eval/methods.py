"""The methods an eval compares at one HBM budget, as :class:`~tierattn.config.TierConfig`s.

Every method keeps the same number of tokens in HBM per layer (``hbm`` of the sequence, rounded
up to pages, plus the sink page, the recent window and the page being filled, which every method
keeps whatever the budget; DESIGN.md measured that dropping them costs any method most of its
fidelity):

=================  ============================================================================
``full``           the model's own attention and cache (the reference; no budget)
``offload``        ``hbm`` hot, the rest demoted to DDR and fetched back for every step
                   (``attend="all"``): exact, whatever the budget
``topk``           ``hbm - recall`` hot plus the ``recall`` best cold pages per step by the
                   query-aware Quest bound, fetched from DDR (approximate, less traffic)
``evict-h2o``      ``hbm`` kept, the rest dropped by accumulated attention (H2O)
``evict-snapkv``   ``hbm`` kept, dropped once after prefill by the prompt's last queries (SnapKV)
``evict-streaming`` sinks + the most recent tokens (StreamingLLM)
``evict-random``   ``hbm`` kept, the rest dropped at random (seeded)
``oracle``         drops the same number of tokens right after prefill but keeps the pages
                   holding the edges the answer needs (an upper bound for any eviction policy)
=================  ============================================================================

``grid_config(hbm, evict)`` mixes the two: ``evict`` of the sequence dropped by H2O, ``hbm`` kept
hot and the rest offloaded, for the claim "accuracy depends on the eviction ratio, not the HBM
ratio".
"""

from __future__ import annotations

from tierattn.config import TierConfig, TierSpec

__all__ = ["METHODS", "RECALL", "evict_ratio", "grid_config", "method_config"]

METHODS = ("full", "offload", "topk", "evict-h2o", "evict-snapkv", "evict-streaming",
           "evict-random", "oracle")

#: fraction of the sequence top-k recalls per step (taken out of its hot budget)
RECALL = 0.1


def method_config(method: str, hbm: float, *, page_size: int = 16, max_context: int = 4096,
                  backend: str = "auto", seed: int = 0) -> TierConfig | None:
    """The TierConfig of ``method`` at HBM ratio ``hbm`` (None for ``full``).

    Raises:
        ValueError: unknown ``method`` or ``hbm`` outside ``(0, 1]``.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}.")
    if not 0.0 < hbm <= 1.0:
        raise ValueError(f"hbm={hbm!r} must be a fraction in (0, 1].")
    common = {"page_size": page_size, "max_context": max_context, "backend": backend,
              "prefill_chunk_size": max_context, "seed": seed}
    if method == "full":
        return None
    if method == "offload":
        return TierConfig.preset("offload", hot_budget=hbm, **common)
    if method == "topk":
        recall = min(RECALL, hbm / 2)
        return TierConfig.preset("topk", hot_budget=hbm - recall, recall_budget=recall, **common)
    if method == "oracle":  # no eviction by the runtime: the eval drops pages after prefill
        return TierConfig(hot_budget=1.0, tiers=(TierSpec("hbm"),), **common)
    if method == "evict-random":
        return TierConfig.preset("evict-h2o", evict_policy="random", hot_budget=hbm,
                                 evict_budget=1.0 - hbm, **common)
    return TierConfig.preset(method, hot_budget=hbm, evict_budget=1.0 - hbm, **common)


def evict_ratio(method: str, hbm: float) -> float:
    """The fraction of each sequence ``method`` drops for good at HBM ratio ``hbm``."""
    return 0.0 if method in ("full", "offload", "topk") else round(1.0 - hbm, 6)


def grid_config(hbm: float, evict: float, *, page_size: int = 16, max_context: int = 4096,
                backend: str = "auto") -> TierConfig:
    """``evict`` of each sequence dropped (H2O), ``hbm`` hot, the rest offloaded to DDR."""
    return TierConfig(hot_budget=hbm, evict_budget=evict, evict_policy="h2o", attend="all",
                      page_size=page_size, max_context=max_context,
                      prefill_chunk_size=max_context, backend=backend)
