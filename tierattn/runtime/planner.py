"""AttendPlanner: how each layer attends its cold pages -- recall them, bring them all, or
attend them on the host.

``attend`` fixes one way for every layer (``"all"``, ``"topk"``: recall, ``"split"``), except
``"auto"``, which chooses per layer from two things:

* **how concentrated the layer is**: the key sketch's estimate of the share of the layer's
  cold attention mass that the ``recall_budget`` best pages hold (per sequence, the smallest
  over the batch). A layer whose recalled pages hold ``adapt_mass`` of it may recall; a diffuse
  one is attended exactly;
* **what each way costs** (:class:`~tierattn.serving.costmodel.AttendCosts`): the recalled bytes
  over the link; all the cold bytes over the link; or all the cold bytes read by the host plus the
  query and partial state on the link. A recall is taken only where it is also cheaper than the
  cheaper exact way.

The choice is made off the per-token path: at the end of a prompt chunk and every
``adapt_every`` decode steps a layer's sketch scores are reduced to its concentration on the
device and copied to the host asynchronously; the next step reads the copy (no device read
waits) and sets the layer's way until the next choice. Prompt chunks attend exactly (``"auto"``
brings their cold pages; ``"split"`` attends them on the host).
"""

from __future__ import annotations

import torch

from tierattn.config import TierConfig
from tierattn.serving.costmodel import AttendCosts
from tierattn.kernels.select import rank_pages
from tierattn.storage.pagemap import PageMap
from tierattn.storage.transfer import CPUTransferEngine, TransferEngine

__all__ = ["AttendPlanner", "MODES"]

#: the ways a layer attends its cold pages in a decode step
MODES = ("all", "recall", "split")
_FIXED = {"all": "all", "topk": "recall", "split": "split"}


class AttendPlanner:
    """Per layer, the way its decode steps attend cold pages (see the module docstring).

    Args:
        config: the cache's :class:`~tierattn.config.TierConfig`.
        pages: the page map (lengths, live sequences).
        costs: the cost model (``attend="auto"`` only).
        engine: the transfer engine, whose asynchronous ``to_host`` brings the estimates back.
    """

    def __init__(self, config: TierConfig, pages: PageMap, costs: AttendCosts | None,
                 engine: TransferEngine | None = None) -> None:
        self.config, self.pages, self.costs = config, pages, costs
        self.engine = engine or CPUTransferEngine()
        self.auto = config.attend == "auto"
        n = pages.num_layers
        self.modes: list[str] = [_FIXED.get(config.attend, "split")] * n
        self._steps = [0] * n
        self._pending: list[tuple[torch.Tensor, object] | None] = [None] * n
        #: the last concentration each layer's choice read (None before the first)
        self.estimates: list[float | None] = [None] * n
        self._host: list[torch.Tensor | None] = [None] * n  # each layer's landing buffer

    def mode(self, layer: int) -> str:
        return self.modes[layer]

    # --- decode steps -------------------------------------------------------------------------

    def begin_decode(self, layer: int, *, cold_bytes: int, recall_bytes: int,
                     link_bytes: int) -> str:
        """The way ``layer`` attends in this decode step: an estimate copied at an earlier step
        is read (its copy has landed) and the layer's way chosen anew. ``cold_bytes``: its cold
        pages; ``recall_bytes``: what a recall moves; ``link_bytes``: a split step's query and
        partial state."""
        if not self.auto:
            return self.modes[layer]
        self._steps[layer] += 1
        pend, self._pending[layer] = self._pending[layer], None
        if pend is not None:
            host, ticket = pend
            self.engine.wait_host(ticket)  # a copy queued a step ago: already landed
            self.estimates[layer] = float(host[0])
        self.modes[layer] = self.choose(self.estimates[layer], cold_bytes, recall_bytes,
                                        link_bytes)
        return self.modes[layer]

    def choose(self, concentration: float | None, cold_bytes: int, recall_bytes: int,
               link_bytes: int) -> str:
        """The cheapest exact way, or a recall where the layer is concentrated enough and a
        recall is cheaper still."""
        c = self.costs
        split_s = c.split_s(cold_bytes, link_bytes)
        exact, exact_s = ("split", split_s) if split_s <= c.recall_s(cold_bytes) else \
            ("all", c.recall_s(cold_bytes))
        if concentration is not None and concentration >= self.config.adapt_mass and \
                c.recall_s(recall_bytes) < exact_s:
            return "recall"
        return exact

    def due(self, layer: int) -> bool:
        """Whether this decode step of ``layer`` estimates its concentration for the next
        choice (every ``adapt_every`` steps)."""
        return self.auto and self._steps[layer] % self.config.adapt_every == 0

    def estimate(self, layer: int, scores: torch.Tensor, k: int,
                 alive_rows: torch.Tensor | None = None) -> None:
        """Reduce ``layer``'s sketch scores ``[B, max_pages, H_kv]`` (log masses per KV head,
        -inf past a row's candidates) to the share of the cold mass the ``k`` best pages hold,
        the smallest over the live sequences (``alive_rows``, on the device; None: every
        one), and start its copy to the host."""
        w = torch.exp(rank_pages(scores, "lse"))  # [B, n] each page's share (sums to H_kv)
        top = w.topk(min(max(k, 1), w.shape[1]), dim=1).values.sum(1)
        tot = w.sum(1)
        conc = torch.where(tot > 0, top / tot.clamp_min(1e-30), torch.ones_like(tot))
        if alive_rows is not None:
            conc = conc.index_select(0, alive_rows)
        conc = conc.min().reshape(1)
        host = self._host[layer]
        if host is None:  # allocated once (pinned on CUDA): read before the next estimate
            host = self._host[layer] = torch.zeros(1, dtype=conc.dtype,
                                                   pin_memory=conc.device.type == "cuda")
        self._pending[layer] = (host, self.engine.to_host(conc, host))

    def observe_split(self, nbytes: int, seconds: float) -> None:
        """A split step's host attention took ``seconds`` for ``nbytes`` (refits its cost)."""
        if self.costs is not None and nbytes:
            self.costs.observe_host(nbytes, seconds)

    def reset(self) -> None:
        n = self.pages.num_layers
        self.modes = [_FIXED.get(self.config.attend, "split")] * n
        self._steps = [0] * n
        self._pending, self.estimates = [None] * n, [None] * n

    def as_dict(self) -> dict:
        """The layers' current ways and estimates, and the cost model's figures."""
        return {"modes": list(self.modes), "concentration": list(self.estimates),
                "costs": self.costs.as_dict() if self.costs is not None else None}
