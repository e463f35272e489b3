"""TierConfig: the orthogonal knobs of the tiered KV cache, and the named presets.

Budgets are per sequence and per layer, in tokens (an ``int``) or as a fraction of the
sequence's current length (a ``float`` in ``[0, 1]``); the runtime works in whole pages
(``page_size`` tokens), rounding a token budget up to pages. Invariants, all checked here:

* ``hot_budget`` tokens stay in HBM; the sink pages, the recent window and the page being filled
  are always hot, whatever the budget;
* ``evict_budget`` tokens are dropped for good (default 0: **offload never drops KV**);
* everything else is *demoted*: kept at full precision in the next tier with room.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tierattn.errors import TierConfigError

__all__ = ["PRESETS", "RemoteConfig", "SwapConfig", "TierConfig", "TierSpec", "parse_tiers"]

Attend = Literal["all", "topk", "split", "auto"]
Score = Literal["mass", "quest", "hybrid"]
RecallScore = Literal["sketch", "quest"]
SketchReduce = Literal["max", "lse"]
Prefetch = Literal["layer_ahead", "speculative", "none"]
DiskMisses = Literal["read", "defer"]
EvictPolicy = Literal["h2o", "streaming", "snapkv", "snapkv-decode", "rkv", "random"]
TIER_KINDS = ("hbm", "ddr", "cxl", "disk", "remote")


def _address(value: object, knob: str, *, url: bool = False) -> tuple[str, int]:
    """``(host, port)`` of ``value``, ``HOST:PORT`` (``url``: ``SCHEME://HOST:PORT/...``), or
    the error naming ``knob``."""
    text = str(value) if isinstance(value, str) else ""
    body = text.split("://", 1)[1] if url and "://" in text else text
    host, _, port = body.split("/", 1)[0].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or (url and "://" not in text):
        example = "'http://127.0.0.1:8080/metadata'" if url else "'127.0.0.1:50051'"
        raise TierConfigError(f"remote {knob}={value!r}: give {example}.")
    return host, int(port)


@dataclass(frozen=True)
class RemoteConfig:
    """Where the Mooncake Store is and how long to wait for it.

    Attributes:
        master: the master's RPC address, ``"HOST:PORT"`` (``mooncake_master --rpc_port``).
        metadata: the metadata server's URL, ``"http://HOST:PORT/metadata"`` (the master's own
            with ``--enable_http_metadata_server=true``).
        local_host: the address other clients reach this one at (loopback on one machine).
        protocol: ``"tcp"``, or ``"rdma"`` on a cluster with RDMA NICs (``device`` names them).
        segment_gib: memory this client lends the pool (objects of every instance may live in
            it; 0 lends none: this client only reads and writes others' memory).
        buffer_mib: this client's transfer buffer; a value larger than it cannot be moved.
        deadline_s: the longest one call may take before the store is taken for down.
        retry_s: how long a store taken for down is skipped before it is asked again.
        namespace: the first part of every key: instances share blocks when they use the same
            one (None: the engine's fingerprint of the model -- its name, dtype, block and layer
            geometry, tensor-parallel rank -- so only instances serving the same model do).
    """

    master: str
    metadata: str
    local_host: str = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""
    segment_gib: float = 1.0
    buffer_mib: int = 256
    deadline_s: float = 2.0
    retry_s: float = 5.0
    namespace: str | None = None

    def __post_init__(self) -> None:
        self.endpoints()
        if self.protocol not in ("tcp", "rdma"):
            raise TierConfigError(f"remote protocol={self.protocol!r}: use 'tcp' or 'rdma'.")
        for knob, lo in (("segment_gib", 0.0), ("buffer_mib", 1), ("deadline_s", 1e-3),
                         ("retry_s", 0.0)):
            v = getattr(self, knob)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo:
                raise TierConfigError(f"remote {knob}={v!r}: must be a number >= {lo}.")
        if self.namespace is not None and (not isinstance(self.namespace, str) or
                                           not self.namespace or "/" in self.namespace):
            raise TierConfigError(f"remote namespace={self.namespace!r}: a non-empty name "
                                  "without '/', or None.")

    def endpoints(self) -> dict[str, tuple[str, int]]:
        """``{"master": (host, port), "metadata": (host, port)}``, checked."""
        return {"master": _address(self.master, "master"),
                "metadata": _address(self.metadata, "metadata", url=True)}


@dataclass(frozen=True)
class TierSpec:
    """One tier of the hierarchy.

    Attributes:
        kind: ``"hbm"`` (device pool), ``"ddr"`` (host pool, pinned on CUDA), ``"cxl"`` (host
            pool with its own bandwidth profile, on ``numa_node`` where the machine has one),
            ``"disk"`` (a segment file under ``path``: :mod:`tierattn.storage.segment`) or
            ``"remote"`` (a Mooncake Store at ``remote``, below disk:
            :class:`tierattn.storage.tiers.RemoteTier`).
        capacity_pages: pages per layer this tier may hold; None sizes it from the config
            (``hbm``: the hot budget of every sequence plus headroom; host tiers: the rest of
            ``max_context``). Disk capacity is counted in pages as well.
        capacity_gib: the same capacity in GiB over all layers (rounded down to whole pages);
            give at most one of ``capacity_pages`` and ``capacity_gib``.
        path: directory of the disk tier.
        numa_node: NUMA node of a CXL tier (Linux only; elsewhere it is a plain host pool); a
            tuple gives one node per local rank (``LOCAL_RANK``) of a tensor-parallel job.
        remote: where the store of a remote tier is (:class:`RemoteConfig`).
    """

    kind: str
    capacity_pages: int | None = None
    path: str | None = None
    numa_node: int | tuple[int, ...] | None = None
    capacity_gib: float | None = None
    remote: RemoteConfig | None = None

    def __post_init__(self) -> None:
        if self.kind not in TIER_KINDS:
            raise TierConfigError(f"tiers: kind={self.kind!r} is not one of {TIER_KINDS}.")
        if self.capacity_pages is not None and (
                not _is_int(self.capacity_pages) or self.capacity_pages < 0):
            raise TierConfigError(
                f"tiers: {self.kind} capacity_pages={self.capacity_pages!r} must be an int >= 0 "
                "or None (sized from the config).")
        gib = self.capacity_gib
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float))
                                or not 0 <= gib < float("inf")):
            raise TierConfigError(
                f"tiers: {self.kind} capacity_gib={self.capacity_gib!r} must be a number >= 0 or "
                "None.")
        if self.capacity_gib is not None and self.capacity_pages is not None:
            raise TierConfigError(
                f"tiers: {self.kind} has both capacity_pages={self.capacity_pages} and "
                f"capacity_gib={self.capacity_gib}; give one of them.")
        if self.kind == "disk" and not self.path:
            raise TierConfigError("tiers: a disk tier needs path='DIR' (the page files' folder).")
        if self.kind == "remote" and not isinstance(self.remote, RemoteConfig):
            raise TierConfigError(
                f"tiers: a remote tier needs remote=RemoteConfig(master='HOST:PORT', "
                f"metadata='http://HOST:PORT/metadata'), got remote={self.remote!r}.")
        if self.kind != "remote" and self.remote is not None:
            raise TierConfigError(f"tiers: remote= is for a remote tier, not {self.kind!r}; "
                                  "give it to TierSpec('remote', remote=...).")
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise TierConfigError(f"tiers: path={self.path!r} must be a folder name.")
        nodes = self.numa_node if isinstance(self.numa_node, tuple) else (self.numa_node,)
        if self.numa_node is not None and (not nodes or not all(
                _is_int(n) and n >= 0 for n in nodes)):
            raise TierConfigError(f"tiers: numa_node={self.numa_node!r} must be an int >= 0, "
                                  "or a tuple of them (one per local rank).")

    def node(self) -> int | None:
        """This process's NUMA node: ``numa_node``, or its entry for ``LOCAL_RANK``."""
        if not isinstance(self.numa_node, tuple):
            return self.numa_node
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        if rank >= len(self.numa_node):
            raise TierConfigError(f"tiers: numa_node lists {len(self.numa_node)} nodes but this "
                                  f"is local rank {rank}; give one node per local rank.")
        return self.numa_node[rank]

    def capacity(self, page_bytes: int, num_layers: int = 1) -> int | None:
        """Pages per layer this tier may hold (``capacity_pages``, or ``capacity_gib`` in whole
        pages of ``page_bytes`` over ``num_layers`` layers); None: sized by the caller."""
        if self.capacity_gib is not None:
            return int(self.capacity_gib * 2**30) // (page_bytes * num_layers)
        return self.capacity_pages


def parse_tiers(tiers: object, *, knob: str = "tiers",
                kinds: tuple[str, ...] = TIER_KINDS) -> tuple[TierSpec, ...]:
    """``tiers`` as TierSpecs (a kind's name stands for ``TierSpec(kind)``), checked: a
    non-empty sequence of ``kinds``, each once, fastest first. Raises :class:`TierConfigError`
    naming ``knob``."""
    if isinstance(tiers, (str, TierSpec)) or not hasattr(tiers, "__iter__"):
        raise TierConfigError(
            f"{knob}: must be a sequence of TierSpec (or tier kinds), got {tiers!r}; e.g. "
            f"{knob}=(TierSpec({kinds[0]!r}), TierSpec({kinds[1 % len(kinds)]!r})).")
    specs = tuple(TierSpec(t) if isinstance(t, str) else t for t in tiers)
    bad = [t for t in specs if not isinstance(t, TierSpec)]
    if bad:
        raise TierConfigError(f"{knob}: {bad[0]!r} is neither a TierSpec nor a tier kind "
                              f"{kinds}.")
    if not specs:
        raise TierConfigError(f"{knob}: give at least one tier of {kinds}.")
    names = [t.kind for t in specs]
    if any(k not in kinds for k in names):
        raise TierConfigError(f"{knob}: {names} may only hold kinds {kinds}.")
    if len(set(names)) != len(names):
        raise TierConfigError(f"{knob}: each kind may appear once, got {names}.")
    order = [TIER_KINDS.index(k) for k in names]
    if order != sorted(order):
        raise TierConfigError(f"{knob}: tiers must go from fast to slow "
                              f"({', '.join(kinds)}), got {names}.")
    return specs


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tiers(*kinds: str) -> tuple[TierSpec, ...]:
    return tuple(TierSpec(k) for k in kinds)


@dataclass(frozen=True)
class TierConfig:
    """Knobs of the tiered KV cache. Build it directly or with :meth:`preset`.

    Attributes:
        page_size: tokens per page (the unit of scoring, transfer and residency).
        hot_budget: tokens (int) or fraction (float) of each sequence kept in HBM per layer.
        evict_budget: tokens (int) or fraction (float) dropped for good; 0 keeps every token.
        sink_pages: leading pages that are always hot (attention sinks).
        recent_pages: trailing pages that are always hot (the recent window), besides the
            page being filled.
        attend: ``"all"`` fetches every demoted page back before attention (exact);
            ``"topk"`` attends the hot set plus the ``recall_budget`` best cold pages by
            ``recall_score`` (approximate, less traffic); ``"split"`` attends the cold pages
            where they live, on the host CPU, and merges their partial state with the hot
            set's (exact; the link carries queries and partial states, not pages:
            :mod:`tierattn.runtime.hostattn`); ``"auto"`` chooses per layer, every ``adapt_every``
            decode steps, between ``"topk"``'s recall (where a probe step, attended exactly,
            measured that the pages the key sketch picks hold ``adapt_mass`` of the layer's
            cold attention) and the cheaper of ``"split"`` and ``"all"`` by the cost model
            (``link_bandwidth``, ``host_bandwidth``).
        recall_budget: cold pages recalled per step, as tokens (int) or a fraction (float)
            of ``recall_scope``, in whole pages (``attend="topk"`` only).
        recall_scope: what a fractional ``recall_budget`` is a fraction of: ``"sequence"``
            (the sequence's length) or ``"cold"`` (the tokens outside the hot budget, so the
            recall follows the budget: a fixed share of what exact offload would move, at any
            ``hot_budget``).
        recall_score: how ``attend="topk"`` ranks cold pages: ``"sketch"`` (the query against
            every key of the page, from the key sketch: each page's keys quantized to
            ``key_bits`` per channel, kept in HBM for every page; see ``sketch_reduce``) or
            ``"quest"`` (Quest's bound from the page's element-wise key range).
        key_bits: bits per key channel of the key sketch (2, 4 or 8).
        key_rank: channels of the key sketch: ``1.0`` (default) every channel of the key;
            fewer -- a fraction (float) of the head dim or a count (int) -- projects each key
            onto the directions that carry the first prompt chunk's logits, per layer and KV
            head (:func:`tierattn.runtime.importance.key_basis`), before quantizing (a key tier of
            ``key_bits * rank / (32 D)`` of the 16-bit KV bytes).
        sketch_reduce: what the sketch ranks a page by: ``"lse"`` (default: its estimated
            attention mass per KV head, the log of its exp-summed logits over the keys and the
            GQA group's query heads, taken as a share of the candidates' mass and summed over
            the KV heads; it also sees mass spread over many keys) or ``"max"`` (its largest
            logit, over the keys, the group's heads and the KV heads: the single best key).
        budget_rounding: ``"up"`` (default) gives a token budget the pages it touches;
            ``"down"`` only the whole pages it covers, so a sequence never holds more than its
            budget (an eval at equal budgets); the must-hot pages stay hot either way.
        score: importance used for demotion: accumulated attention ``"mass"``, the Quest
            bound of the latest query (``"quest"``), or ``"hybrid"`` (their normalised sum).
        evict_policy: which pages eviction drops: ``"h2o"`` (lowest accumulated attention,
            keeping heavy hitters and the recent window), ``"streaming"`` (everything but sinks
            and the recent window), ``"snapkv"`` (once, after prefill, by the pooled attention
            of the prompt's last ``snapkv_window`` queries), ``"snapkv-decode"`` (the same,
            then re-scored by the last ``snapkv_window`` decode queries whenever the budget
            binds while decoding), ``"rkv"`` (R-KV: attention of the last 8 queries less the
            page's redundancy with later pages, whenever the budget binds) or ``"random"``.
        snapkv_window: observation window (queries) of SnapKV.
        snapkv_kernel: max-pooling width (pages) of SnapKV's scores.
        prefetch: ``"layer_ahead"`` (while layer l runs, bring what layer l+1 needs: all its
            cold pages, or the previous step's top-k selection), ``"speculative"`` (top-k of
            layer l+1 scored with layer l's query) or ``"none"`` (fetch synchronously).
        disk_misses: ``attend="topk"`` with pages on disk: the disk pages of the previous
            step's selection are read ahead into host staging; a page selected now that was not
            staged is ``"read"`` at its layer (the default: the selection comes back to the
            host, one synchronous device read per layer with disk pages, and the missed pages
            are read from disk, counted as ``disk_sync_pages``: exact recall) or ``"defer"``-ed
            (no device read; the page is left out of this step and staged for the next,
            counted as ``disk_missed_pages``: a reasoning trace that needs a page the step it
            selects it loses it -- the tiny reasoner drops from 0.98 to 0.04 at 25% HBM).
        tiers: the hierarchy, fastest first; the first must be ``hbm``.
        max_context: tokens per sequence the pools are sized for.
        prefill_chunk_size: most tokens one ``append`` may add per sequence (pool headroom).
        backend: kernels' backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        seed: seed of the random eviction policy.
        adapt_every: ``attend="auto"``: decode steps between a layer's probes (steps 1, 1 + N,
            ...: attended exactly, they measure the share a recall would hold, copied to the
            host asynchronously and read by the next step's choice); 1: never a recall.
        adapt_mass: ``attend="auto"``: the share of a layer's cold attention mass (exact page
            LSEs of its last probe) the pages the key sketch picks must hold for the layer to
            recall rather than attend exactly.
        link_bandwidth: bytes per second between a lower tier and the device, for the cost
            model of ``attend="auto"`` (None: measured on this machine when the cache is built).
        host_bandwidth: KV bytes per second the host attends (split attention), for the same
            cost model (None: measured on this machine when the cache is built, then refitted
            from every split step's time; a number describes the machine, e.g. a modeled one,
            and is kept).
        link_latency, host_latency: ``attend="auto"``: seconds a recall and a host round trip
            (the query out, the partial state back) cost besides their bytes, for the same cost
            model (a modeled machine at scale, where bytes decide, may set them to 0).
        host_threads: threads of the host attention (None: torch's intra-op threads, or
            ``TIERATTN_HOST_THREADS``).
        cuda_graphs: capture each layer's decode step (the token's K/V write, attention over
            the hot and cold pages, merge, page mass) in a CUDA graph and replay it; the rare
            structural work (new pages, demotions) runs between replays. Needs a CUDA device;
            off by default until a GPU run shows replay token-identical to eager. Layers with a
            sliding window run eagerly; the layer-ahead prefetch is off (each graph copies its
            own cold pages).
    """

    page_size: int = 16
    hot_budget: int | float = 1.0
    evict_budget: int | float = 0
    sink_pages: int = 1
    recent_pages: int = 2
    attend: Attend = "all"
    recall_budget: int | float = 0.1
    recall_scope: Literal["sequence", "cold"] = "sequence"
    recall_score: RecallScore = "sketch"
    key_bits: int = 4
    key_rank: int | float = 1.0
    sketch_reduce: SketchReduce = "lse"
    budget_rounding: Literal["up", "down"] = "up"
    score: Score = "mass"
    evict_policy: EvictPolicy = "h2o"
    snapkv_window: int = 32
    snapkv_kernel: int = 3
    prefetch: Prefetch = "layer_ahead"
    disk_misses: DiskMisses = "read"
    tiers: tuple[TierSpec, ...] = field(default_factory=lambda: _tiers("hbm", "ddr"))
    max_context: int = 4096
    prefill_chunk_size: int = 512
    backend: str = "auto"
    seed: int = 0
    adapt_every: int = 16
    adapt_mass: float = 0.9
    link_bandwidth: float | None = None
    host_bandwidth: float | None = None
    link_latency: float = 10e-6
    host_latency: float = 30e-6
    host_threads: int | None = None
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        def fail(knob: str, msg: str) -> None:
            raise TierConfigError(f"{knob}: {msg}")

        if not _is_int(self.page_size) or self.page_size < 1:
            fail("page_size", f"must be an int >= 1, got {self.page_size!r}.")
        for knob in ("hot_budget", "evict_budget", "recall_budget"):
            v = getattr(self, knob)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                fail(knob, f"must be tokens (int) or a fraction (float), got {v!r}.")
            if isinstance(v, float) and not 0.0 <= v <= 1.0:
                fail(knob, f"a fraction must lie in [0, 1], got {v}; pass an int for tokens.")
            if isinstance(v, int) and v < 0:
                fail(knob, f"must be >= 0 tokens, got {v}.")
        if isinstance(self.hot_budget, float) and isinstance(self.evict_budget, float) and \
                self.hot_budget + self.evict_budget > 1.0 + 1e-9:
            fail("evict_budget", f"hot_budget {self.hot_budget} + evict_budget "
                 f"{self.evict_budget} exceed the whole sequence (1.0); lower one of them.")
        for knob in ("sink_pages", "recent_pages"):
            v = getattr(self, knob)
            if not _is_int(v) or v < 0:
                fail(knob, f"must be an int >= 0, got {v!r}.")
        if self.key_bits not in (2, 4, 8) or isinstance(self.key_bits, bool):
            fail("key_bits", f"must be 2, 4 or 8, got {self.key_bits!r}.")
        r = self.key_rank
        if isinstance(r, bool) or not isinstance(r, (int, float)) or \
                (isinstance(r, float) and not 0.0 < r <= 1.0) or (isinstance(r, int) and r < 1):
            fail("key_rank", f"must be a fraction of the head dim in (0, 1] (float) or a "
                 f"number of channels >= 1 (int), got {r!r}.")
        choices = {"attend": ("all", "topk", "split", "auto"), "score": ("mass", "quest", "hybrid"),
                   "recall_score": ("sketch", "quest"), "sketch_reduce": ("max", "lse"),
                   "budget_rounding": ("up", "down"), "recall_scope": ("sequence", "cold"),
                   "evict_policy": ("h2o", "streaming", "snapkv", "snapkv-decode", "rkv",
                                    "random"),
                   "prefetch": ("layer_ahead", "speculative", "none"),
                   "disk_misses": ("read", "defer"),
                   "backend": ("auto", "triton", "torch")}
        for knob, allowed in choices.items():
            if getattr(self, knob) not in allowed:
                fail(knob, f"{getattr(self, knob)!r} is not one of {allowed}.")
        if self.attend in ("all", "split") and self.prefetch == "speculative":
            fail("prefetch", f"'speculative' picks pages for attend='topk'; with attend="
                 f"{self.attend!r} every cold page is attended, so use prefetch='layer_ahead' "
                 "or 'none'.")
        if self.attend == "auto" and (self.recall_score, self.sketch_reduce) != ("sketch", "lse"):
            fail("attend", "'auto' estimates how concentrated each layer is from the key "
                 "sketch's attention shares: keep recall_score='sketch' and sketch_reduce='lse'.")
        if self.attend in ("split", "auto") and self.cuda_graphs:
            fail("cuda_graphs", f"attend={self.attend!r}: a split layer's host round trip (the "
                 "query to the host, the partial state back) cannot be captured in a CUDA "
                 "graph; set cuda_graphs=False.")
        if not _is_int(self.adapt_every) or self.adapt_every < 1:
            fail("adapt_every", f"must be an int >= 1 (decode steps), got {self.adapt_every!r}.")
        if isinstance(self.adapt_mass, bool) or not isinstance(self.adapt_mass, (int, float)) \
                or not 0.0 <= self.adapt_mass <= 1.0:
            fail("adapt_mass", f"must be a share in [0, 1], got {self.adapt_mass!r}.")
        for knob in ("link_bandwidth", "host_bandwidth"):
            v = getattr(self, knob)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or
                                  not 0 < v < float("inf")):
                fail(knob, f"must be bytes per second (> 0) or None (measured), got {v!r}.")
        for knob in ("link_latency", "host_latency"):
            v = getattr(self, knob)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not 0 <= v < float("inf"):
                fail(knob, f"must be seconds >= 0, got {v!r}.")
        if self.host_threads is not None and (not _is_int(self.host_threads) or
                                              self.host_threads < 1):
            fail("host_threads", f"must be an int >= 1 or None, got {self.host_threads!r}.")
        if isinstance(self.tiers, (list, tuple)) and not self.tiers:
            fail("tiers", "the first tier must be 'hbm' (the device pool), e.g. "
                 "tiers=(TierSpec('hbm'), TierSpec('ddr')).")
        tiers = parse_tiers(self.tiers)
        if tiers[0].kind != "hbm":
            fail("tiers", "the first tier must be 'hbm' (the device pool), e.g. "
                 "tiers=(TierSpec('hbm'), TierSpec('ddr')).")
        if len(tiers) == 1 and self.demotes():
            fail("tiers", "hot_budget keeps only part of the cache in HBM and evict_budget does "
                 "not drop the rest, but no lower tier is configured; add TierSpec('ddr'), set "
                 "hot_budget=1.0, or evict the rest (evict_budget=1 - hot_budget).")
        for knob in ("max_context", "prefill_chunk_size", "snapkv_window", "snapkv_kernel"):
            v = getattr(self, knob)
            if not _is_int(v) or v < 1:
                fail(knob, f"must be an int >= 1, got {v!r}.")
        if not _is_int(self.seed):
            fail("seed", f"must be an int, got {self.seed!r}.")
        if not isinstance(self.cuda_graphs, bool):
            fail("cuda_graphs", f"must be True or False, got {self.cuda_graphs!r}.")
        object.__setattr__(self, "tiers", tiers)

    @property
    def key_range(self) -> bool:
        """Whether every page keeps its element-wise key range (Quest metadata: a demotion or
        recall score reads it)."""
        return self.score in ("quest", "hybrid") or (self.recalls and
                                                     self.recall_score == "quest")

    @property
    def key_sketch(self) -> bool:
        """Whether every page keeps its key sketch (recall ranked by the sketch)."""
        return self.recalls and self.recall_score == "sketch"

    @property
    def recalls(self) -> bool:
        """Whether some layer may recall its best cold pages (``attend`` ``"topk"``/``"auto"``)."""
        return self.attend in ("topk", "auto")

    def demotes(self) -> bool:
        """True when some tokens may have to live below HBM (neither hot nor evicted)."""
        hot, evict = self.hot_budget, self.evict_budget
        if isinstance(hot, float) and isinstance(evict, float):
            return hot + evict < 1.0 - 1e-9
        if isinstance(hot, int) and hot >= self.max_context:
            return False
        return not (isinstance(hot, float) and hot == 1.0)

    def replace(self, **changes) -> TierConfig:
        """A copy with ``changes`` applied (validated again)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TierConfigError(f"replace: {unknown} are not TierConfig knobs.")
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides) -> TierConfig:
        """A named configuration; ``overrides`` replace any knob (see :data:`PRESETS`)."""
        if name not in PRESETS:
            raise TierConfigError(f"preset: {name!r} is not one of {tuple(PRESETS)}.")
        knobs = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - knobs)
        if unknown:
            raise TierConfigError(f"preset: {unknown} are not TierConfig knobs; the knobs are "
                                  f"{sorted(knobs)}.")
        return cls(**{**PRESETS[name], **overrides})

    def pages(self, budget: int | float, num_pages: int, num_tokens: int) -> int:
        """Pages a token/fraction ``budget`` allows for a sequence of ``num_tokens`` tokens."""
        tokens = int(round(budget * num_tokens if isinstance(budget, float) else budget))
        if self.budget_rounding == "down":
            return min(num_pages, tokens // self.page_size)
        return min(num_pages, -(-tokens // self.page_size) if tokens > 0 else 0)

    def key_channels(self, head_dim: int) -> int:
        """Channels the key sketch keeps per key of a ``head_dim`` head (``key_rank``): at most
        ``head_dim``, rounded down to whole bytes of codes (a multiple of ``8 / key_bits``),
        at least one byte's worth."""
        r = self.key_rank
        r = int(r * head_dim + 1e-9) if isinstance(r, float) else r
        step = 8 // self.key_bits
        return min(head_dim, max(step, r // step * step))

    def recall_pages(self, num_pages: int, num_tokens: int) -> int:
        """Cold pages ``attend="topk"`` recalls per step for a sequence of ``num_tokens`` tokens
        (``num_pages`` pages): ``recall_budget`` of the sequence, or with
        ``recall_scope="cold"`` of the tokens neither the hot budget nor the evict budget
        covers. Never more than with ``recall_scope="sequence"`` (which sizes the buffers)."""
        tokens = num_tokens
        if self.recall_scope == "cold" and isinstance(self.recall_budget, float):
            def share(budget: int | float) -> int:
                return int(round(budget * num_tokens)) if isinstance(budget, float) else budget
            tokens = max(0, num_tokens - share(self.hot_budget) - share(self.evict_budget))
        return self.pages(self.recall_budget, num_pages, tokens)


#: Named presets. The eviction presets drop everything that is not hot (``evict_budget`` is
#: the complement of ``hot_budget``), as the baselines' authors define them.
PRESETS: dict[str, dict] = {
    "dense": {"hot_budget": 1.0, "tiers": _tiers("hbm")},
    "offload": {"hot_budget": 0.5, "attend": "all", "score": "mass"},
    "topk": {"hot_budget": 0.25, "attend": "topk", "recall_budget": 0.25, "recall_scope": "cold",
             "key_rank": 0.375, "score": "mass"},
    "split": {"hot_budget": 0.25, "attend": "split", "score": "mass"},
    "adaptive": {"hot_budget": 0.25, "attend": "auto", "recall_budget": 0.25,
                 "recall_scope": "cold", "key_rank": 0.375, "score": "mass"},
    "evict-h2o": {"hot_budget": 0.5, "evict_budget": 0.5, "evict_policy": "h2o",
                  "tiers": _tiers("hbm")},
    "evict-streaming": {"hot_budget": 0.5, "evict_budget": 0.5, "evict_policy": "streaming",
                        "tiers": _tiers("hbm")},
    "evict-snapkv": {"hot_budget": 0.5, "evict_budget": 0.5, "evict_policy": "snapkv",
                     "tiers": _tiers("hbm")},
    "evict-snapkv-decode": {"hot_budget": 0.5, "evict_budget": 0.5,
                            "evict_policy": "snapkv-decode", "tiers": _tiers("hbm")},
    "evict-rkv": {"hot_budget": 0.5, "evict_budget": 0.5, "evict_policy": "rkv",
                  "tiers": _tiers("hbm")},
}

#: what a serving engine does with a preempted request's KV (:class:`SwapConfig`)
SWAP_POLICIES = ("auto", "swap", "recompute")
SwapPolicy = Literal["auto", "swap", "recompute"]
SWAP_TIER_KINDS = ("ddr", "cxl", "disk")


@dataclass(frozen=True)
class SwapConfig:
    """Where preempted sequences' KV goes, and when.

    Attributes:
        tiers: fastest first, kinds ``"ddr"``, ``"cxl"``, ``"disk"`` (a name or a
            :class:`~tierattn.config.TierSpec`; a disk tier needs ``path``). A full tier spills
            into the next; when every tier is full the request is recomputed. Capacities:
            ``capacity_gib`` (or ``capacity_pages``, in swap slots); by default DDR and CXL
            may hold up to half the host's physical memory, committed as blocks arrive (pinned
            on CUDA: four engine KV pools, reserved at start), disk four KV pools (at most 90%
            of the folder's free space) -- :func:`tierattn.serving.swaptiers.swap_capacities`.
        policy: ``"auto"`` swaps a victim when the measured store + load time is below the
            measured time to prefill its tokens again, ``"swap"`` whenever a tier has room,
            ``"recompute"`` never (the engines' default).
        calibration: a calibration file (:meth:`~tierattn.serving.costmodel.CostModel.save`, written
            by ``tierattn bench --serving``) whose transfer costs stand until this run has
            measured its own; None probes each tier when the store is built (``"auto"``).
        probe_slots: slots per calibration probe (probes of 1 and of this many slots, three
            times each).
        backend: the page-copy kernel's backend (``"auto"``, ``"triton"``, ``"torch"``).
        remote: a Mooncake Store below the tiers (:class:`RemoteConfig`). In vLLM's
            connector every stored block is also put there under its content key, and a lookup
            the tiers miss asks the store, so an engine instance loads what another one stored.
            In transformers' continuous batching (which has no lookup across instances) it is
            the last swap tier: a preempted request the tiers above have no room for is kept
            there (default capacity four KV pools) instead of being recomputed.
    """

    tiers: tuple[TierSpec | str, ...] = ("ddr",)
    policy: SwapPolicy = "auto"
    calibration: str | os.PathLike | None = None
    probe_slots: int = 8
    backend: str = "auto"
    remote: RemoteConfig | None = None

    def __post_init__(self) -> None:
        if self.remote is not None and not isinstance(self.remote, RemoteConfig):
            raise TierConfigError(f"SwapConfig.remote: a tierattn.config.RemoteConfig or None, "
                                  f"got {type(self.remote).__name__}.")
        if isinstance(self.tiers, (list, tuple)) and \
                "remote" in [getattr(t, "kind", t) for t in self.tiers]:
            raise TierConfigError("SwapConfig.tiers: a swap's remote store is not a tier of this "
                                  "list; give SwapConfig(remote=RemoteConfig(...)).")
        object.__setattr__(self, "tiers", parse_tiers(self.tiers, knob="SwapConfig.tiers",
                                                      kinds=SWAP_TIER_KINDS))
        if self.policy not in SWAP_POLICIES:
            raise TierConfigError(f"SwapConfig.policy: {self.policy!r} is not one of "
                                  f"{SWAP_POLICIES}.")
        if self.calibration is not None and not Path(self.calibration).is_file():
            raise TierConfigError(f"SwapConfig.calibration: {str(self.calibration)!r} is not a "
                                  "file; give a calibration JSON or None to measure at start.")
        if isinstance(self.probe_slots, bool) or not isinstance(self.probe_slots, int) or \
                self.probe_slots < 1:
            raise TierConfigError(f"SwapConfig.probe_slots: must be an int >= 1, got "
                                  f"{self.probe_slots!r}.")
        if self.backend not in ("auto", "triton", "torch"):
            raise TierConfigError(f"SwapConfig.backend: {self.backend!r} is not one of "
                                  "('auto', 'triton', 'torch').")

    @property
    def kinds(self) -> tuple[str, ...]:
        """Where a swap may keep KV, fastest first: the tiers' kinds, then ``"remote"`` when a
        store is given."""
        return tuple(t.kind for t in self.tiers) + (("remote",) if self.remote else ())
