"""Policies: small classes that decide which pages leave HBM, which are dropped and which are
recalled; the :class:`~tierattn.storage.mover.Mover` acts on their decisions.

* demotion ranks (``TierConfig.score``): :class:`ByMass`, :class:`ByQuest`, :class:`Hybrid` --
  the lowest-ranked hot pages are demoted first;
* eviction baselines (``TierConfig.evict_policy``): :class:`H2O`, :class:`StreamingLLM`,
  :class:`SnapKV`, :class:`SnapKVDecode`, :class:`RKV`, :class:`RandomEviction` -- the
  lowest-ranked live pages are dropped first;
* recall (``TierConfig.attend``, ``recall_score``): :class:`AllCold` (exact),
  :class:`SketchTopK` (the key sketch's estimate of each page's attention share, or its
  largest logit), :class:`QuestTopK`.

:func:`build_policies` is the only place that reads the config's policy names.
:class:`Budgets` applies the hot and evict budgets with them after each attention call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierattn.config import TierConfig
from tierattn.errors import KVCapacityError
from tierattn.runtime.importance import Importance
from tierattn.storage.mover import Mover
from tierattn.storage.pagemap import HOT, NONE, LayerTables, PageMap

__all__ = ["H2O", "RKV", "AllCold", "Budgets", "ByMass", "ByQuest", "DemotionRank",
           "Eviction", "Hybrid", "Policies", "QuestTopK", "RandomEviction", "Recall",
           "SketchTopK", "SnapKV", "SnapKVDecode", "StreamingLLM", "DEMOTION_RANKS", "EVICTIONS",
           "RECALLS", "build_policies"]


# --- demotion ranks --------------------------------------------------------------------------

class DemotionRank:
    """Importance of hot pages for demotion: ``rank(layer, n_pages) -> [B, n_pages]`` on the host
    (higher stays hot), from the layer's importance snapshot (:meth:`Importance.host`)."""

    needs_mass = False  # reads the accumulated attention mass (the kernels must return it)
    needs_bound = False  # reads the Quest bound of the latest query over every page

    def __init__(self, importance: Importance) -> None:
        self.importance = importance

    def rank(self, layer: int, n_pages: int) -> torch.Tensor:
        raise NotImplementedError


class ByMass(DemotionRank):
    """Accumulated attention mass (H2O's heavy hitters stay hot)."""

    needs_mass = True

    def rank(self, layer, n_pages):
        return self.importance.host(layer).mass[:, :n_pages]


class ByQuest(DemotionRank):
    """Quest bound of the latest decode query (accumulated mass before the first one)."""

    needs_bound = True

    def rank(self, layer, n_pages):
        snap = self.importance.host(layer, bound=True)
        return (snap.mass if snap.bound is None else snap.bound)[:, :n_pages]


class Hybrid(DemotionRank):
    """Normalised sum of the accumulated mass and the latest query's Quest bound."""

    needs_mass = True
    needs_bound = True

    def rank(self, layer, n_pages):
        snap = self.importance.host(layer, bound=True)
        mass = snap.mass[:, :n_pages]
        if snap.bound is None:
            return mass
        norm = lambda x: (x - x.min(1, keepdim=True).values) / (
            x.max(1, keepdim=True).values - x.min(1, keepdim=True).values + 1e-12)
        return norm(mass) + norm(snap.bound[:, :n_pages])


# --- eviction baselines ------------------------------------------------------------------------

class Eviction:
    """Which live pages an eviction budget drops: ``rank(layer, n_pages) -> [B, n_pages]``
    (lowest dropped first), as the baseline's authors define it."""

    needs_mass = False  # ranks by accumulated attention mass
    needs_importance = False  # ranks from the importance snapshot (else from positions)
    window_mass = False  # needs the prompt's observation-window mass (SnapKV)
    one_shot = False  # evicts once, when decoding starts, and keeps every later token

    @classmethod
    def observation(cls, config: TierConfig) -> int:
        """Queries of its observation window (the prompt's last ones, and the last decode
        steps' for a policy that re-scores while decoding; 0: none)."""
        return config.snapkv_window if cls.window_mass else 0

    @classmethod
    def decode_window(cls, config: TierConfig) -> int:
        """Decode steps whose page mass it reads (0: none)."""
        return 0

    def __init__(self, importance: Importance, pages: PageMap) -> None:
        self.importance, self.pages = importance, pages

    def rank(self, layer: int, n_pages: int) -> torch.Tensor:
        raise NotImplementedError

    def reorder(self, index: torch.Tensor) -> None:  # noqa: B027 - stateless by default
        """Sequence ``i`` takes old sequence ``index[i]``'s state."""


class H2O(Eviction):
    """Heavy-Hitter Oracle (Zhang et al., 2023): drop the lowest accumulated attention."""

    needs_mass = True
    needs_importance = True

    def rank(self, layer, n_pages):
        return self.importance.host(layer).mass[:, :n_pages]


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
    needs_importance = True
    one_shot = True

    def __init__(self, importance: Importance, pages: PageMap, kernel: int) -> None:
        super().__init__(importance, pages)
        self.kernel = kernel

    def pooled(self, scores: torch.Tensor, n_pages: int) -> torch.Tensor:
        k = self.kernel
        return torch.nn.functional.max_pool1d(scores[:, None, :n_pages], k, stride=1,
                                              padding=k // 2)[:, 0, :n_pages]

    def rank(self, layer, n_pages):
        return self.pooled(self.importance.host(layer).snap, n_pages)


class SnapKVDecode(SnapKV):
    """SnapKV re-scored as the trace grows (the decode-time variant reasoning-aware evaluations
    use): the prompt is compressed as SnapKV does, and whenever the budget binds while decoding
    the pages the last ``snapkv_window`` decode queries attend least (max-pooled over
    ``kernel`` pages) are dropped."""

    one_shot = False

    @classmethod
    def decode_window(cls, config):
        return config.snapkv_window

    def rank(self, layer, n_pages):
        return self.pooled(self.importance.host(layer).window, n_pages)


class RKV(Eviction):
    """R-KV (Cai et al., 2025: redundancy-aware KV compression for reasoning models), per page.

    Whenever the budget binds (the prompt once it is in, then as the trace grows), each page
    scores ``Z = lam * I - (1 - lam) * R`` and the lowest are dropped:

    * importance ``I``: the attention the last ``WINDOW`` queries (the prompt's last ones, then
      the latest decode steps') pay to the page, normalised to sum 1 per sequence;
    * redundancy ``R``: per KV head, the cosine similarity of the page's mean key with the
      others, pairs under ``THRESHOLD`` ignored and, as the authors' ``retain_direction="last"``
      keeps the last of similar tokens, only *later* pages counted against a page (so the later
      copy stays); its mean over the pages, a softmax over the sequence's pages, then the mean
      over KV heads (one page selection serves every head here).

    ``WINDOW = 8``, ``THRESHOLD = 0.5`` and ``lam = 0.1`` are the authors' defaults. Their
    token-level selection becomes a page-level one (pages are the unit every tier moves), the
    mean key of a page standing for its tokens, and their 7-token max-pooling of the attention
    is within a page.
    """

    WINDOW = 8
    THRESHOLD = 0.5
    LAMBDA = 0.1
    window_mass = True
    needs_importance = True

    def __init__(self, importance: Importance, pages: PageMap,
                 page_keys: Callable[[int, int], torch.Tensor]) -> None:
        super().__init__(importance, pages)
        self.page_keys = page_keys  # (layer, n_pages) -> [B, n_pages, H_kv, D] on the device
        # the redundancy is computed on the device with each importance snapshot (a step
        # ahead of the decision, like the importance it is weighed against) and copied back
        # with it: the decision reads no page back
        importance.extra = self.redundancy

    @classmethod
    def observation(cls, config):
        return cls.WINDOW

    @classmethod
    def decode_window(cls, config):
        return cls.WINDOW

    def redundancy(self, layer: int) -> torch.Tensor:
        """``[B, max_pages]`` redundancy ``R`` of the pages stored now (0 past them), on the
        device."""
        n = self.pages.num_pages(layer)
        out = torch.zeros(self.pages.batch_size, self.pages.max_pages, device=self.pages.device)
        if n == 0:
            return out
        keys = torch.nn.functional.normalize(self.page_keys(layer, n), dim=-1)
        sim = torch.einsum("bphd,bqhd->bhpq", keys, keys)  # [B, H_kv, n, n] per head
        later = torch.ones(n, n, dtype=torch.bool, device=sim.device).triu(1)
        sim = torch.where(later & (sim > self.THRESHOLD), sim, 0.0)
        out[:, :n] = torch.softmax(sim.mean(-1), dim=-1).mean(1)
        return out

    def rank(self, layer, n_pages):
        snap = self.importance.host(layer)
        imp = snap.window[:, :n_pages]
        imp = imp / imp.sum(1, keepdim=True).clamp_min(1e-12)
        return self.LAMBDA * imp - (1 - self.LAMBDA) * snap.extra[:, :n_pages]


# --- recall ------------------------------------------------------------------------------------

class Recall:
    """Which cold pages a decode query attends: all of them (``exact``), or the ``budget``
    pages per sequence that rank best by their per-KV-head ``scores``, reduced over the heads
    by ``reduce`` (:func:`~tierattn.kernels.select_pages`), on the device."""

    exact = False
    reduce = "max"

    def __init__(self, importance: Importance, pages: PageMap, config: TierConfig) -> None:
        self.importance, self.pages, self.config = importance, pages, config

    def budget(self, layer: int) -> int:
        """Pages recalled per sequence at ``layer``'s current length (host)."""
        return 0

    def scores(self, layer: int, q: torch.Tensor, tabs: LayerTables, *, sm_scale: float,
               softcap: float | None) -> torch.Tensor:
        """``[B, max_pages, H_kv]`` score of each recall candidate of ``tabs`` per KV head (-inf
        past a row's candidates) for the decode query ``q [B, H_q, D]`` of an attention with
        ``sm_scale`` and ``softcap``, on the device."""
        raise NotImplementedError


class AllCold(Recall):
    """Exact attention: every cold page comes back, every step."""

    exact = True


class QuestTopK(Recall):
    """Quest (Tang et al., 2024): the ``recall_budget`` cold pages with the highest bound
    ``sum_d max(q_d kmax_d, q_d kmin_d)``, the query heads of a GQA group aggregated (max)
    and the selection shared by the KV heads (max over them)."""

    def budget(self, layer):
        return self.config.recall_pages(self.pages.num_pages(layer), self.pages.length(layer))

    def scores(self, layer, q, tabs, *, sm_scale, softcap):
        b, mp = self.pages.batch_size, self.pages.max_pages
        return self.importance.quest_bound(layer, q, tabs.candidates.table).view(b, mp, -1)


class SketchTopK(QuestTopK):
    """The ``recall_budget`` cold pages the key sketch (every key of every page at ``key_bits``
    per channel -- of ``key_rank`` projected channels -- in HBM) scores highest for the query,
    the query heads of a GQA group and the page's keys reduced in the kernel
    (``sketch_reduce``):

    - ``"lse"``: each page's estimated attention mass per KV head, turned into its share of the
      candidates' mass for that head (a softmax over the pages), summed over the KV heads: the
      pages that hold the most of the heads' attention between them;
    - ``"max"``: the page's largest logit, max over the KV heads.
    """

    def __init__(self, importance: Importance, pages: PageMap, config: TierConfig) -> None:
        super().__init__(importance, pages, config)
        self.reduce = config.sketch_reduce

    def scores(self, layer, q, tabs, *, sm_scale, softcap):
        b, mp = self.pages.batch_size, self.pages.max_pages
        return self.importance.sketch_score(layer, q, tabs.candidates.table, reduce=self.reduce,
                                            sm_scale=sm_scale, softcap=softcap).view(b, mp, -1)


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
                                        "snapkv": SnapKV, "snapkv-decode": SnapKVDecode,
                                        "rkv": RKV, "random": RandomEviction}
#: ``attend="all"`` is :class:`AllCold`; ``attend="topk"`` ranks by ``recall_score``
RECALLS: dict[str, type[Recall]] = {"all": AllCold, "quest": QuestTopK, "sketch": SketchTopK}


def build_policies(config: TierConfig, importance: Importance, pages: PageMap,
                   mover: Mover) -> Policies:
    """The policy objects ``config`` names (the only place its policy names are read)."""
    kind = EVICTIONS[config.evict_policy]
    extra = {SnapKV: {"kernel": config.snapkv_kernel},
             SnapKVDecode: {"kernel": config.snapkv_kernel},
             RKV: {"page_keys": mover.mean_keys},
             RandomEviction: {"seed": config.seed}}.get(kind, {})
    return Policies(DEMOTION_RANKS[config.score](importance), kind(importance, pages, **extra),
                    RECALLS[config.recall_score if config.recalls else "all"](
                        importance, pages, config))


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
        self._done: list[tuple | None] = [None] * pages.num_layers  # (version, key) applied

    def reset(self) -> None:
        self.pruned = [False] * self.pages.num_layers
        self._done = [None] * self.pages.num_layers

    def _key(self, layer: int, length: int, decode: bool) -> tuple:
        """What a decision at ``length`` depends on besides the map: it changes only at lengths
        the host knows (a page boundary, an eviction target, a window edge, decoding starts)."""
        st, p = self.pages.layers[layer], self.pages.page_size
        if st.window is not None:
            return ("window", (length - st.window + 1) // p, -(-length // p))
        key: tuple = (-(-length // p), decode and self.policies.eviction.one_shot)
        if self.evicting(layer):
            key += tuple(self.evict_pages(length - pad) for pad in self.pages.pad.tolist())
        return key

    def evicting(self, layer: int) -> bool:
        """Whether ``layer`` may still evict (a one-shot policy evicts once)."""
        return self.evicts and not (self.policies.eviction.one_shot and self.pruned[layer])

    def due(self, layer: int, *, decode: bool) -> bool:
        """Whether :meth:`rebalance` may change anything now: after a prompt chunk always;
        during decoding only when the map or the key changed since the last one."""
        st = self.pages.layers[layer]
        return not decode or self._done[layer] != (st.version, self._key(layer, st.length, True))

    def due_next(self, layer: int) -> bool:
        """Whether a decision will be due at the next decode step (its inputs are then copied
        to the host ahead, asynchronously)."""
        st = self.pages.layers[layer]
        return self._done[layer] != (st.version, self._key(layer, st.length + 1, True))

    def needs_importance(self, layer: int) -> bool:
        """Whether a decision at ``layer`` reads the importance snapshot (so one is taken
        ahead)."""
        demotes = self.num_tiers > 1
        return (demotes and (self.policies.demotion.needs_mass or
                             self.policies.demotion.needs_bound)) or \
            (self.evicting(layer) and self.policies.eviction.needs_importance)

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
        """Evict, then demote, as the budgets require (see the class docstring)."""
        self._rebalance(layer, decode)
        st = self.pages.layers[layer]
        self._done[layer] = (st.version, self._key(layer, st.length, decode))

    def _rebalance(self, layer: int, decode: bool) -> None:
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
