"""KernelSet: the kernel entry points the tiered runtime calls, gathered in one object.

Every component of :class:`~tierattn.runtime.cache.TieredKVCache` (and its transfer engine) calls
kernels through the cache's ``kernels`` attribute, never through module globals, so a tool that
wants to time them (``tierattn.eval.bench.hostcost.KernelTimer``) or replace them by instant stubs
(the host-cost benchmark) changes that one object: ``setattr(cache.kernels, "sparse_decode",
wrapped)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from .decode import decode_page_mass, merge_page_mass, sparse_decode
from .host import host_decode
from .merge import merge_states
from .metadata import page_metadata
from .page_copy import copy_pages
from .prefill import paged_prefill, paged_prefill_mass
from .score import quest_score
from .select import select_pages
from .sketch import sketch_score

__all__ = ["KernelSet"]


@dataclass
class KernelSet:
    """The kernels the runtime launches (defaults: the package's launchers)."""

    sparse_decode: Callable = sparse_decode
    decode_page_mass: Callable = decode_page_mass
    merge_page_mass: Callable = merge_page_mass
    merge_states: Callable = merge_states
    page_metadata: Callable = page_metadata
    paged_prefill: Callable = paged_prefill
    paged_prefill_mass: Callable = paged_prefill_mass
    quest_score: Callable = quest_score
    sketch_score: Callable = sketch_score
    select_pages: Callable = select_pages
    copy_pages: Callable = copy_pages
    host_decode: Callable = host_decode

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The entry points' names, in declaration order."""
        return tuple(f.name for f in fields(cls))
