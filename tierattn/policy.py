"""Policies: small classes that decide which pages leave HBM, which are dropped and which are
recalled; the :class:`~tierattn.mover.Mover` acts on their decisions.

* demotion ranks (``TierConfig.score``): :class:`ByMass`, :class:`ByQuest`, :class:`Hybrid` --
  the lowest-ranked hot pages are demoted first;
* eviction baselines (``TierConfig.evict_policy``): :class:`H2O`, :class:`StreamingLLM`,
  :class:`SnapKV`, :class:`RandomEviction` -- the lowest-ranked live pages are dropped first;
* recall (``TierConfig.attend``): :class:`AllCold` (exact), :class:`QuestTopK`.

:func:`build_policies` is the only place that reads the config's policy names.
:class:`Budgets` applies the hot and evict budgets with them after each attention call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierattn.config import TierConfig
from tierattn.errors import KVCapacityError
from tierattn.importance import Importance
from tierattn.mover import Mover
from tierattn.pagemap import HOT, NONE, PageMap

__all__ = ["H2O", "AllCold", "Budgets", "ByMass", "ByQuest", "DemotionRank", "Eviction",
           "Hybrid", "Policies", "QuestTopK", "RandomEviction", "Recall", "SnapKV",
           "StreamingLLM", "DEMOTION_RANKS", "EVICTIONS", "RECALLS", "build_policies"]


# --- demotion ranks --------------------------------------------------------------------------

class DemotionRank:
    """Importance of hot pages for demotion: ``rank(layer, n_pages) -> [B, n_pages]`` (higher
    stays hot)."""

    needs_mass = False  # reads the accumulated attention mass (the kernels must return it)

    def __init__(self, importance: Importance) -> None:
        self.importance = importance

    def rank(self, layer: int, n_pages: int) -> torch.Tensor:
        raise NotImplementedError


class ByMass(DemotionRank):
    """Accumulated attention mass (H2O's heavy hitters stay hot)."""

    needs_mass = True

    def rank(self, layer, n_pages):
        return self.importance.mass[layer][:, :n_pages]


class ByQuest(DemotionRank):
    """Quest bound of the latest decode query (accumulated mass before the first one)."""

    def bound(self, layer: int, n_pages: int) -> torch.Tensor | None:
        q = self.importance.last_q[layer]
        if q is None:
            return None
        b = q.shape[0]
        rows = [torch.arange(n_pages)] * b
        return self.importance.quest_bound(layer, q, rows).view(b, n_pages)

    def rank(self, layer, n_pages):
        bound = self.bound(layer, n_pages)
        return self.importance.mass[layer][:, :n_pages] if bound is None else bound


class Hybrid(ByQuest):
    """Normalised sum of the accumulated mass and the latest query's Quest bound."""

    needs_mass = True

    def rank(self, layer, n_pages):
        mass = self.importance.mass[layer][:, :n_pages]
        bound = self.bound(layer, n_pages)
        if bound is None:
            return mass
        norm = lambda x: (x - x.min(1, keepdim=True).values) / (
            x.max(1, keepdim=True).values - x.min(1, keepdim=True).values + 1e-12)
        return norm(mass) + norm(bound)


# --- eviction baselines ------------------------------------------------------------------------

class Eviction:
    """Which live pages an eviction budget drops: ``rank(layer, n_pages) -> [B, n_pages]``
    (lowest dropped first), as the baseline's authors define it."""

    needs_mass = False  # ranks by accumulated attention mass
    window_mass = False  # needs the prompt's observation-window mass (SnapKV)
    one_shot = False  # evicts once, when decoding starts, and keeps every later token

    def __init__(self, importance: Importance, pages: PageMap) -> None:
        self.importance, self.pages = importance, pages

    def rank(self, layer: int, n_pages: int) -> torch.Tensor:
        raise NotImplementedError

    def reorder(self, index: torch.Tensor) -> None:  # noqa: B027 - stateless by default
        """Sequence ``i`` takes old sequence ``index[i]``'s state."""


class H2O(Eviction):
    """Heavy-Hitter Oracle (Zhang et al., 2023): drop the lowest accumulated attention."""

    needs_mass = True

    def rank(self, layer, n_pages):
        return self.importance.mass[layer][:, :n_pages]


class StreamingLLM(Eviction):
    """StreamingLLM (Xiao et al., 2023): keep the sinks and the most recent tokens."""

    def rank(self, layer, n_pages):
        return torch.arange(n_pages, dtype=torch.float32).expand(self.pages.batch_size, -1)


class RandomEviction(Eviction):
    """Drop pages in a random order, fixed per sequence by the config's seed (a control)."""

    def __init__(self, importance: Importance, pages: PageMap, seed: int) -> None:
        super().__init__(importance, pages)
        gen = torch.Generator().manual_seed(seed)
        self.noise = torch.rand(pages.batch_size, pages.max_pages, generator=gen)

    def rank(self, layer, n_pages):
        return self.noise[:, :n_pages]

    def reorder(self, index):
        self.noise = self.noise[index]


class SnapKV(Eviction):
    """SnapKV (Li et al., 2024): once, when decoding starts, drop the prompt pages the last
    ``snapkv_window`` prompt queries attend least (max-pooled over ``kernel`` pages)."""

    window_mass = True
    one_shot = True

    def __init__(self, importance: Importance, pages: PageMap, kernel: int) -> None:
        super().__init__(importance, pages)
        self.kernel = kernel

    def rank(self, layer, n_pages):
        snap = self.importance.snap[layer]
        if snap is None:
            snap = torch.zeros(self.pages.batch_size, self.pages.max_pages)
        k = self.kernel
        return torch.nn.functional.max_pool1d(snap[:, None, :n_pages], k, stride=1,
                                              padding=k // 2)[:, 0, :n_pages]


# --- recall ------------------------------------------------------------------------------------

class Recall:
    """Which cold pages a decode query attends (``select``) and which pages to fetch ahead for
    a layer (``prefetch``)."""

    def __init__(self, importance: Importance, pages: PageMap, config: TierConfig) -> None:
        self.importance, self.pages, self.config = importance, pages, config

    def select(self, layer: int, q: torch.Tensor, cold: torch.Tensor) -> list[list[int]]:
        """Pages per sequence (sorted) among ``cold [B, n_pages]`` that query ``q [B, H_q, D]``
        attends."""
        raise NotImplementedError

    def prefetch(self, layer: int, q: torch.Tensor | None,
                 cold: torch.Tensor) -> list[list[int]] | None:
        """Pages per sequence to fetch for ``layer`` before it runs; ``q`` is the decode query
        of the layer before (None after a prefill chunk)."""
        raise NotImplementedError

    def reset(self) -> None:  # noqa: B027 - stateless by default
        """Forget per-step state (after a reorder or a load)."""


class AllCold(Recall):
    """Exact attention: every cold page comes back, every step."""

    def select(self, layer, q, cold):
        return self.pages.page_lists(cold)

    def prefetch(self, layer, q, cold):
        return self.pages.page_lists(cold)


class QuestTopK(Recall):
    """Quest (Tang et al., 2024): the ``recall_budget`` cold pages with the highest bound
    ``sum_d max(q_d kmax_d, q_d kmin_d)``, the query heads of a GQA group aggregated.

    Prefetching (``speculative``) scores the next layer's pages with this layer's query, or
    (layer-ahead) fetches the next layer's selection of the previous step."""

    def __init__(self, importance: Importance, pages: PageMap, config: TierConfig) -> None:
        super().__init__(importance, pages, config)
        self.speculative = config.prefetch == "speculative"
        self.selection: list[list[list[int]] | None] = [None] * pages.num_layers

    def top(self, layer: int, q: torch.Tensor, cold: torch.Tensor) -> list[list[int]]:
        cfg = self.config
        rows = [c.nonzero().flatten() for c in cold]
        k = cfg.pages(cfg.recall_budget, cold.shape[1], self.pages.length(layer))
        if k == 0 or not any(r.numel() for r in rows):
            return [[] for _ in rows]
        bound = self.importance.quest_bound(layer, q, rows)
        out, pos = [], 0
        for r in rows:
            c = r.numel()
            best = torch.topk(bound[pos:pos + c], min(k, c)).indices
            out.append(sorted(r[best].tolist()))
            pos += c
        return out

    def select(self, layer, q, cold):
        self.selection[layer] = self.top(layer, q, cold)
        return self.selection[layer]

    def prefetch(self, layer, q, cold):
        if q is None:
            return None
        if self.speculative:
            return self.top(layer, q, cold)
        previous = self.selection[layer] or [[] for _ in range(self.pages.batch_size)]
        return [[pg for pg in sel if cold[bi, pg]] for bi, sel in enumerate(previous)]

    def reset(self):
        self.selection = [None] * self.pages.num_layers


# --- the budgets ---------------------------------------------------------------------------------

@dataclass
class Policies:
    demotion: DemotionRank
    eviction: Eviction
    recall: Recall


#: the classes behind the config's names (``score``, ``evict_policy``, ``attend``)
DEMOTION_RANKS: dict[str, type[DemotionRank]] = {"mass": ByMass, "quest": ByQuest,
                                                 "hybrid": Hybrid}
EVICTIONS: dict[str, type[Eviction]] = {"h2o": H2O, "streaming": StreamingLLM,
                                        "snapkv": SnapKV, "random": RandomEviction}
RECALLS: dict[str, type[Recall]] = {"all": AllCold, "topk": QuestTopK}


def build_policies(config: TierConfig, importance: Importance, pages: PageMap) -> Policies:
    """The policy objects ``config`` names (the only place its policy names are read)."""
    kind = EVICTIONS[config.evict_policy]
    extra = {SnapKV: {"kernel": config.snapkv_kernel},
             RandomEviction: {"seed": config.seed}}.get(kind, {})
    return Policies(DEMOTION_RANKS[config.score](importance), kind(importance, pages, **extra),
                    RECALLS[config.attend](importance, pages, config))


class Budgets:
    """Applies the hot and evict budgets of ``config`` to one layer after an attention call:
    evict down to ``evict_budget``, then demote down to ``hot_budget`` (never the sinks, the
    recent window or the page being filled); on a sliding-window layer, drop what left the
    window. The policies decide which pages; the mover moves them."""

    def __init__(self, config: TierConfig, pages: PageMap, policies: Policies, mover: Mover,
                 num_tiers: int) -> None:
        self.config, self.pages, self.policies, self.mover = config, pages, policies, mover
        self.num_tiers = num_tiers
        self.pruned = [False] * pages.num_layers  # one-shot eviction done, per layer

    @property
    def evicts(self) -> bool:
        return self.config.evict_budget != 0

    def wants_mass(self) -> bool:
        """Whether the kernels must return page mass (a policy in use reads it)."""
        return self.policies.demotion.needs_mass or (self.evicts and
                                                     self.policies.eviction.needs_mass)

    def wants_window_mass(self, decode: bool) -> bool:
        return not decode and self.evicts and self.policies.eviction.window_mass

    def evict_pages(self, length: int) -> int:
        budget = self.config.evict_budget
        tokens = budget * length if isinstance(budget, float) else budget
        return int(tokens // self.pages.page_size)

    def rebalance(self, layer: int, decode: bool) -> None:
        st, cfg, p = self.pages.layers[layer], self.config, self.pages.page_size
        n_pages = self.pages.num_pages(layer)
        if n_pages == 0:
            return
        alive = self.pages.alive.nonzero().flatten().tolist()
        if st.window is not None:  # no future query sees pages ending before the window
            gone = ~self.pages.must_hot(n_pages, layer) & (st.tier[:, :n_pages] != NONE)
            for bi in alive:
                pages = gone[bi].nonzero().flatten().tolist()
                if pages:
                    self.mover.drop(layer, bi, pages, window=True)
            return
        eviction = self.policies.eviction
        # budgets count each sequence's real tokens and pages, not its left padding
        pad_pages = self.pages.pad_pages()
        real = self.pages.page_idx[None, :n_pages] >= pad_pages[:, None]
        evicting = self.evicts and (not eviction.one_shot or (decode and not self.pruned[layer]))
        if not evicting and self.num_tiers > 1 and \
                self.within_hot_budget(layer, n_pages, pad_pages, real):
            return  # the usual decode step: nothing to demote, skip the policy's bookkeeping
        must = self.pages.must_hot(n_pages)
        full = torch.ones(n_pages, dtype=torch.bool)
        if not st.length % p == 0:
            full[-1] = False
        real_tokens = st.length - self.pages.pad
        if evicting:
            rank = eviction.rank(layer, n_pages)
            for bi in alive:
                live = (st.tier[bi, :n_pages] != NONE) & ~must[bi] & full & real[bi]
                extra = self.evict_pages(int(real_tokens[bi])) - \
                    int(st.evicted[bi, :n_pages].sum())
                if extra <= 0 or not live.any():
                    continue
                cand = live.nonzero().flatten()
                drop = cand[torch.argsort(rank[bi, cand], stable=True)[:extra]].tolist()
                self.mover.drop(layer, bi, drop)
            if eviction.one_shot and decode:
                self.pruned[layer] = True
        # the hot budget counts the lanes from the first real page on (a first page that is
        # partly padding is held whole), so a budget of 1.0 holds every page
        span = st.length - pad_pages * p
        hot_target = [max(cfg.pages(cfg.hot_budget, n_pages - int(pad_pages[bi]),
                                    int(span[bi])), int((must[bi] & real[bi]).sum()))
                      for bi in range(self.pages.batch_size)]
        if self.num_tiers == 1:  # nowhere to demote: the hot budget is the whole budget
            if eviction.one_shot:
                # a one-shot policy compresses the prompt once, when decoding starts, and
                # keeps every token generated afterwards
                if decode and not self.pruned[layer]:
                    self.drop_over(layer, n_pages, hot_target, must, real)
                    self.pruned[layer] = True
                return
            self.drop_over(layer, n_pages, hot_target, must, real)
            return
        over = []
        rank = None
        for bi in alive:
            hot = (st.tier[bi, :n_pages] == HOT) & real[bi]
            extra = int(hot.sum()) - hot_target[bi]
            if extra <= 0:
                continue
            if rank is None:
                rank = self.policies.demotion.rank(layer, n_pages)
            cand = (hot & ~must[bi]).nonzero().flatten()
            order = torch.argsort(rank[bi, cand], stable=True)[:extra]
            over += [(bi, int(pg)) for pg in cand[order]]
        if over:
            self.mover.demote(layer, over)

    def within_hot_budget(self, layer: int, n_pages: int, pad_pages: torch.Tensor,
                          real: torch.Tensor) -> bool:
        """True when no sequence holds more hot real pages than the hot budget allows. The
        demotion target of :meth:`rebalance` is that budget or more (it never goes below the
        pages that must stay hot), so then it demotes nothing: checking this first skips
        building the must-stay-hot mask and the per-sequence loop on most decode steps."""
        st, cfg = self.pages.layers[layer], self.config
        hot = ((st.tier[:, :n_pages] == HOT) & real).sum(1).tolist()
        span = (st.length - pad_pages * self.pages.page_size).tolist()
        return all(h <= cfg.pages(cfg.hot_budget, n_pages - pp, sp)
                   for h, pp, sp in zip(hot, pad_pages.tolist(), span))

    def drop_over(self, layer: int, n_pages: int, keep: list[int], must: torch.Tensor,
                  real: torch.Tensor) -> None:
        """Evict the lowest-ranked pages of each sequence ``b`` beyond ``keep[b]`` live real
        pages (``must``/``real``: ``[B, n_pages]``)."""
        st = self.pages.layers[layer]
        rank = self.policies.eviction.rank(layer, n_pages)
        for bi in self.pages.alive.nonzero().flatten().tolist():
            live = (st.tier[bi, :n_pages] != NONE) & real[bi]
            extra = int(live.sum()) - keep[bi]
            cand = (live & ~must[bi]).nonzero().flatten()
            if extra > 0 and len(cand):
                drop = cand[torch.argsort(rank[bi, cand], stable=True)[:extra]].tolist()
                self.mover.drop(layer, bi, drop)

    def make_room(self, layer: int, need: int) -> None:
        """Demote the least important hot pages until ``need`` HBM slots are free (pages were
        moved into HBM by hand, or the budget shrank)."""
        st, hbm = self.pages.layers[layer], self.mover.tiers[HOT]
        n_pages = self.pages.num_pages(layer)
        short = need - hbm.num_free(layer)
        must = self.pages.must_hot(n_pages, layer)
        rank = self.policies.demotion.rank(layer, n_pages) if n_pages else None
        cands = sorted((float(rank[bi, pg]), bi, pg)
                       for bi in self.pages.alive.nonzero().flatten().tolist()
                       for pg in ((st.tier[bi, :n_pages] == HOT) & ~must[bi]).nonzero().flatten()
                       .tolist())
        if self.num_tiers == 1 or len(cands) < short:
            raise KVCapacityError(
                f"hbm tier is full for layer {layer}: {need} pages needed, "
                f"{hbm.num_free(layer)} of {hbm.capacity} free and "
                f"{len(cands) if self.num_tiers > 1 else 0} can be demoted; raise its "
                "capacity_pages or prefill in smaller chunks.")
        self.mover.demote(layer, [(bi, pg) for _, bi, pg in cands[:short]])
