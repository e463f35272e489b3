"""Counters of the tiered cache: bytes moved per tier, launches, prefetch outcomes, evictions.

Plain Python integers updated on the host next to the work they count, so they are cheap enough
to stay on, plus the few counts only the device knows during a decode step (kept in device
tensors); :meth:`Telemetry.stats` aggregates them (per layer and in total) on request.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field

import torch

__all__ = ["LayerCounters", "Telemetry", "all_ranks", "handle_stats", "summarize"]


@dataclass
class LayerCounters:
    """Counters of one layer since the cache was built (or :meth:`Telemetry.reset`)."""

    h2d_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # by source tier
    d2h_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # by destination
    h2d_decode_bytes: int = 0  # the part of h2d_bytes moved during decode steps
    copy_launches: int = 0
    copy_launches_decode: int = 0  # the part of copy_launches issued during decode steps
    d2h_launches_decode: int = 0  # the part of copy_launches_decode that demoted pages (D2H)
    kernel_launches: int = 0
    prefetch_hits: int = 0  # pages a layer needed that were already in flight
    late_misses: int = 0  # pages fetched synchronously because no prefetch covered them
    wasted_prefetches: int = 0  # prefetched pages the layer did not attend
    disk_staged_pages: int = 0  # disk pages read into host staging ahead of their layer
    disk_sync_pages: int = 0  # disk pages read while their layer waited (no read ahead)
    disk_missed_pages: int = 0  # recall, "defer": selected disk pages not staged (next step)
    disk_selection_reads: int = 0  # recall, "read": selections copied back to find disk misses
    evicted_tokens: int = 0
    window_dropped_tokens: int = 0  # left a sliding window: no query can see them again
    demoted_pages: int = 0
    attend_calls: int = 0
    decode_steps: int = 0
    host_time_s: float = 0.0
    host_attn_bytes: int = 0  # cold KV bytes attended on the host (split attention)
    host_attn_s: float = 0.0  # the host attention's own time (part of host_time_s)
    host_attn_decode_bytes: int = 0  # the part of host_attn_bytes attended in decode steps
    partial_decode_bytes: int = 0  # partial states copied back in decode steps (in h2d_bytes)
    split_steps: int = 0  # decode steps this layer attended its cold pages on the host
    recall_steps: int = 0  # decode steps this layer recalled cold pages (attend="auto")

    def as_dict(self) -> dict:
        return {
            "h2d_bytes": dict(self.h2d_bytes), "d2h_bytes": dict(self.d2h_bytes),
            "h2d_bytes_total": sum(self.h2d_bytes.values()),
            "d2h_bytes_total": sum(self.d2h_bytes.values()),
            "h2d_decode_bytes": self.h2d_decode_bytes,
            "copy_launches": self.copy_launches, "kernel_launches": self.kernel_launches,
            "copy_launches_decode": self.copy_launches_decode,
            "d2h_launches_decode": self.d2h_launches_decode,
            "prefetch_hits": self.prefetch_hits, "late_misses": self.late_misses,
            "wasted_prefetches": self.wasted_prefetches, "evicted_tokens": self.evicted_tokens,
            "disk_staged_pages": self.disk_staged_pages, "disk_sync_pages": self.disk_sync_pages,
            "disk_missed_pages": self.disk_missed_pages,
            "disk_selection_reads": self.disk_selection_reads,
            "window_dropped_tokens": self.window_dropped_tokens,
            "demoted_pages": self.demoted_pages, "attend_calls": self.attend_calls,
            "decode_steps": self.decode_steps, "host_time_s": self.host_time_s,
            "host_attn_bytes": self.host_attn_bytes, "host_attn_s": self.host_attn_s,
            "host_attn_decode_bytes": self.host_attn_decode_bytes,
            "partial_decode_bytes": self.partial_decode_bytes,
            "split_steps": self.split_steps, "recall_steps": self.recall_steps,
        }


class Telemetry:
    """Per-layer counters plus the resident fractions computed by the cache at query time.

    What only the device knows during a decode step -- how many recalled pages came from each
    tier, how many of them the layer-ahead prefetch had staged -- is counted on the device
    (:meth:`count_recalled`, or the recall selection kernel adding to ``recalled`` and
    ``hits``) and folded in by :meth:`stats` (the one read).
    """

    def __init__(self, num_layers: int, *, tier_kinds: tuple[str, ...] = (),
                 page_bytes: int = 0, device: torch.device | None = None) -> None:
        self.layers = [LayerCounters() for _ in range(num_layers)]
        self.decoding = False  # the current attend is a decode step (counted apart)
        self.tier_kinds, self.page_bytes = tier_kinds, page_bytes
        # [L, tiers] recalled pages per source tier, [L] prefetch hits
        self.recalled = torch.zeros(num_layers, max(1, len(tier_kinds)), dtype=torch.int64,
                                    device=device)
        self.hits = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.disk_missed = torch.zeros(num_layers, dtype=torch.int64, device=device)
        # per layer, views a decode step's kernels add to (made once; reset zeroes in place):
        # ([1] hits, [tiers - 1] pages recalled from each lower tier)
        self.device_counters = [(self.hits[i:i + 1], self.recalled[i, 1:])
                                for i in range(num_layers)]

    def reset(self) -> None:
        self.layers = [LayerCounters() for _ in self.layers]
        self.recalled.zero_()
        self.hits.zero_()
        self.disk_missed.zero_()

    def count_disk_missed(self, layer: int, missed) -> None:
        """Add selected disk pages that were not staged (``missed``: bool), on the device."""
        self.disk_missed[layer:layer + 1].add_(missed.sum())

    def count_recalled(self, layer: int, tier: int, slots) -> None:
        """Add the pages of ``slots`` (-1: none) recalled from ``tier``, on the device."""
        self.recalled[layer, tier:tier + 1].add_((slots >= 0).sum())

    def _fold_device(self) -> list[LayerCounters]:
        """The host counters with the device-counted ones folded in (copies; one read)."""
        recalled, hits = self.recalled.tolist(), self.hits.tolist()
        missed = self.disk_missed.tolist()
        out = []
        for c, rec, h, m in zip(self.layers, recalled, hits, missed):
            c = copy.deepcopy(c)
            c.disk_missed_pages += m
            for ti, n in enumerate(rec):
                if n:
                    c.h2d_bytes[self.tier_kinds[ti]] += n * self.page_bytes
                    c.h2d_decode_bytes += n * self.page_bytes
            c.prefetch_hits += h
            c.late_misses -= h
            c.wasted_prefetches -= h
            out.append(c)
        return out

    def stats(self, residency: list[dict[str, float]]) -> dict:
        """``{"total": {...}, "layers": [{...}, ...]}``; ``residency[l]`` maps tier -> fraction
        of layer ``l``'s live tokens resident there."""
        per_layer = []
        for counters, resident in zip(self._fold_device(), residency):
            d = counters.as_dict()
            d["resident_fraction"] = resident
            per_layer.append(d)
        return {"total": summarize(per_layer), "layers": per_layer}


def summarize(per_layer: list[dict]) -> dict:
    """The total of per-layer stats (bytes, launches, prefetch outcomes summed; resident
    fraction averaged over layers; decode steps: the most any layer ran)."""
    total: dict = {}
    for key in ("h2d_bytes_total", "d2h_bytes_total", "h2d_decode_bytes", "copy_launches",
                "copy_launches_decode", "d2h_launches_decode", "kernel_launches",
                "prefetch_hits", "late_misses", "wasted_prefetches", "evicted_tokens",
                "window_dropped_tokens", "demoted_pages", "attend_calls", "host_time_s",
                "disk_staged_pages", "disk_sync_pages", "disk_missed_pages",
                "disk_selection_reads", "host_attn_bytes", "host_attn_s", "split_steps",
                "recall_steps", "host_attn_decode_bytes", "partial_decode_bytes"):
        total[key] = sum(d[key] for d in per_layer)
    for key in ("h2d_bytes", "d2h_bytes"):
        merged: dict[str, int] = defaultdict(int)
        for d in per_layer:
            for tier, n in d[key].items():
                merged[tier] += n
        total[key] = dict(merged)
    residency = [d["resident_fraction"] for d in per_layer]
    tiers = sorted({t for r in residency for t in r})
    total["resident_fraction"] = {
        t: sum(r.get(t, 0.0) for r in residency) / max(1, len(residency)) for t in tiers}
    steps = max((d["decode_steps"] for d in per_layer), default=0)
    total["decode_steps"] = steps
    if steps:
        total["h2d_bytes_per_decode_step"] = total["h2d_decode_bytes"] / steps
        total["copy_launches_per_layer_per_step"] = \
            total["copy_launches_decode"] / (steps * max(1, len(per_layer)))
    hits, misses = total["prefetch_hits"], total["late_misses"]
    total["prefetch_hit_rate"] = hits / (hits + misses) if hits + misses else None
    return total


def all_ranks(stats: dict) -> dict:
    """``stats`` of this rank plus, under tensor parallelism (``torch.distributed``
    initialised, several ranks), ``"ranks"`` (every rank's total, by rank) and ``"all_ranks"``
    (the total over every rank's layers). Collective: every rank must call it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {**stats, "ranks": [stats["total"]], "all_ranks": stats["total"]}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats["layers"])
    return {**stats, "ranks": [summarize(layers) for layers in gathered],
            "all_ranks": summarize([d for layers in gathered for d in layers])}


def handle_stats(handle: str, moved: dict[str, dict[str, int]], /, **rest) -> dict:
    """The one schema of every handle's ``stats()`` (``tierattn.patch``'s and
    ``tierattn.swap``'s): ``{"handle": "patch" | "swap", "bytes": {tier: {"stored": int,
    "loaded": int}}, ...}`` -- bytes written into each tier below the device and read back from
    it since the handle began -- then the handle's own keys (``rest``)."""
    return {"handle": handle, "bytes": {tier: {"stored": int(b.get("stored", 0)),
                                               "loaded": int(b.get("loaded", 0))}
                                        for tier, b in moved.items()}, **rest}
