"""The scheduler half of tierattn's hot set in vLLM: which of a request's pages stay on the
device, which have a copy in the host tier, and when a device block may be freed.

A request's pages are vLLM blocks. :class:`HotSetSpec` is the KV-cache spec of a layer served
with a hot set (vLLM's ``FullAttentionSpec`` plus the :class:`~tierattn.config.TierConfig`);
vLLM's KV-cache spec registry gives every group of such layers a :class:`HotSetManager`, vLLM's
full-attention manager with three changes:

* a request keeps on the device its *hot set* -- ``sink_pages`` leading pages, the most recent
  full pages the ``hot_budget`` allows (at least ``recent_pages``), and the pages being written
  -- and its other full pages are *cold*;
* a cold page gets a slot in the host tier (:meth:`HotSetManager.reserve_copies`, asked by the
  connector the step the page turns cold, so the worker copies it right after the layer wrote
  it), and its device block is freed one step later, when vLLM frees blocks outside a
  window (:meth:`~HotSetManager.remove_skipped_blocks`): a block is freed only once its copy
  exists. When the host tier is full the page stays on the device: the request then holds
  more blocks, and vLLM's own preemption (recompute) follows if the pool runs out -- never a
  lost page;
* admission (``scheduler_reserve_full_isl``) counts the blocks a prompt holds at its peak with
  the hot set (:meth:`~HotSetManager.peak_blocks`), not its full length; a block pool running
  low shrinks the hot sets to their floor (:meth:`~HotSetManager.tight`) before vLLM would
  preempt.

A preempted or finished request gives its host slots back with its blocks. Prefix caching is
refused (a request's first block names it on the worker, and a shared block could be freed by
one request while another reads it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Self

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from tierattn.config import TierConfig
from tierattn.errors import TierConfigError

from .config import cold_end

__all__ = ["HotSetManager", "HotSetSpec", "cold_end", "register_spec"]


@dataclass(frozen=True, kw_only=True)
class HotSetSpec(FullAttentionSpec):
    """``FullAttentionSpec`` of a layer served with tierattn's hot set.

    Attributes:
        tier: the hot-set knobs (``page_size`` is vLLM's block size).
        chunk_tokens: the most prompt tokens one step adds to a request (its chunk's pages are
            hot while they are written).
    """

    tier: TierConfig | None = None
    chunk_tokens: int = 0

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        # FullAttentionSpec.merge builds cls(...) from the base fields only
        merged = super().merge(specs)
        if any((s.tier, s.chunk_tokens) != (specs[0].tier, specs[0].chunk_tokens)
               for s in specs):
            raise TierConfigError("tierattn's hot set: the layers of one KV cache group were "
                                  "given different hot sets; build the engine with one "
                                  "tierattn.vllm_engine_args(config).")
        return replace(merged, tier=specs[0].tier, chunk_tokens=specs[0].chunk_tokens)


class HotSetManager(FullAttentionManager):
    """vLLM's full-attention manager over a hot set per request (module docstring).

    Host slots: ``host_slots`` (set by the connector) numbered ``0..host_slots-1``; a request's
    copies are ``self.copies[req_id] = {page: slot}``.
    """

    def __init__(self, kv_cache_spec: HotSetSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        if self.enable_caching:
            raise TierConfigError(
                "tierattn's hot set: prefix caching is not supported (a cold block may be shared "
                "by several requests); build the engine with enable_prefix_caching=False "
                "(tierattn.vllm_engine_args does).")
        self.tier: TierConfig = kv_cache_spec.tier
        self.chunk_tokens = kv_cache_spec.chunk_tokens
        self.host_slots = 0
        self._free_slots: list[int] = []
        self._fresh = 0
        self.copies: defaultdict[str, dict[int, int]] = defaultdict(dict)
        #: the computed tokens of the step each copy is made in: its block is freed once vLLM
        #: has processed that many (the step is over)
        self.copied_at: defaultdict[str, dict[int, int]] = defaultdict(dict)
        #: (device block, host slot) copies decided since the connector last took them
        self.pending: list[tuple[int, int]] = []
        #: counters: pages copied out, blocks freed, copies refused for want of host room
        self.stored_pages = 0
        self.freed_blocks = 0
        self.no_room = 0

    # -- host slots -------------------------------------------------------------------------

    def set_host_slots(self, slots: int) -> None:
        """The host tier holds ``slots`` pages (the connector's capacity)."""
        self.host_slots = int(slots)

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        if self._fresh < self.host_slots:
            self._fresh += 1
            return self._fresh - 1
        return None

    def free_host_slots(self) -> int:
        return len(self._free_slots) + self.host_slots - self._fresh

    def reserve_copies(self, request_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Host slots for the pages of ``request_id`` that are cold once it has ``num_tokens``
        computed tokens and have no copy yet; returns ``(device block, host slot)`` pairs for
        the worker to copy this step (after each layer's KV write). Pages that find no slot
        stay on the device."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return []
        copies, at = self.copies[request_id], self.copied_at[request_id]
        end = cold_end(self.tier, num_tokens, tight=self.tight())
        out = []
        for page in range(self.tier.sink_pages, min(end, len(blocks))):
            if page in copies or blocks[page].is_null:
                continue
            slot = self._take_slot()
            if slot is None:
                self.no_room += 1
                break
            copies[page] = slot
            at[page] = num_tokens
            out.append((blocks[page].block_id, slot))
        self.stored_pages += len(out)
        self.pending.extend(out)
        return out

    def tight(self) -> bool:
        """The block pool running low -- fewer free blocks than one block per request holding
        blocks plus a prompt chunk's: the hot sets shrink to their floor (sinks,
        ``recent_pages``, the page being written) rather than vLLM preempting a request. Exact
        attention reads every cold page anyway; top-k recalls the pages it demoted on top of
        its budget (:func:`~tierattn.models.vllm.config.recall_pages`), so it attends as many
        pages as before, the demoted ones ranked with the rest."""
        chunk = -(-max(1, self.chunk_tokens) // self.tier.page_size) + 1
        return self.block_pool.get_num_free_blocks() < len(self.req_to_blocks) + chunk

    def take_pending(self) -> list[tuple[int, int]]:
        out, self.pending = self.pending, []
        return out

    def cold_pages(self, request_id: str) -> list[tuple[int, int]]:
        """``(page, host slot)`` of the request's pages whose device block is freed."""
        blocks = self.req_to_blocks.get(request_id, [])
        return sorted((p, s) for p, s in self.copies.get(request_id, {}).items()
                      if p < len(blocks) and blocks[p].is_null)

    # -- vLLM's hooks -----------------------------------------------------------------------

    def peak_blocks(self, num_tokens: int) -> int:
        """Device blocks a request holds at most while its first ``num_tokens`` tokens are
        computed: sinks, the recent pages of its budget, and a chunk's pages being written."""
        tier = self.tier
        full = num_tokens // tier.page_size
        hot = full - (cold_end(tier, num_tokens) - tier.sink_pages)
        chunk = -(-max(1, self.chunk_tokens) // tier.page_size) + 1
        return min(-(-num_tokens // tier.page_size), hot + chunk)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args,
                                   apply_admission_cap: bool = False, **kwargs) -> int:
        if apply_admission_cap:  # the full-prompt admission check: the hot set's peak
            self.max_admission_blocks_per_request = self.peak_blocks(num_tokens)
        try:
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens, *args, apply_admission_cap=apply_admission_cap,
                **kwargs)
        finally:
            self.max_admission_blocks_per_request = None

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the device blocks of cold pages whose host copy exists: made in a step that
        computed at most ``processed_computed_tokens`` tokens (the connector reserved it when
        that step was scheduled; vLLM has processed it)."""
        blocks = self.req_to_blocks.get(request_id)
        at = self.copied_at.get(request_id)
        if not blocks or not at:
            return
        freed = []
        for page, tokens in at.items():
            if tokens <= processed_computed_tokens and page < len(blocks) and \
                    not blocks[page].is_null:
                freed.append(blocks[page])
                blocks[page] = self._null_block
        if freed:
            self.freed_blocks += len(freed)
            self.block_pool.free_blocks(freed)

    def pop_blocks_for_free(self, request_id: str):
        """A finished or preempted request: its host slots go back with its blocks (a
        preempted request is recomputed from its tokens)."""
        self._free_slots.extend(self.copies.pop(request_id, {}).values())
        self.copied_at.pop(request_id, None)
        return [b for b in super().pop_blocks_for_free(request_id) if not b.is_null]


def register_spec() -> None:
    """Give :class:`HotSetSpec` layers a :class:`HotSetManager` (vLLM's spec registry; the
    built-in specs are registered first, as vLLM registers them only into an empty
    registry)."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(HotSetSpec, HotSetManager,
                                 uniform_type_base_spec=FullAttentionSpec)


register_spec()
