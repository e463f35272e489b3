"""TieredCache: a transformers ``Cache`` whose layers live in a :class:`TieredKVCache`.

``update`` appends the new tokens to the runtime and hands the cache to the attention function
that the same attention module calls right after it: through the attention kwargs where the
module passes them to ``update`` (transformers >= 5.2x), and through a context variable
otherwise. ``update`` returns the new tokens' K/V unchanged: no model served here reads them back
(KV-sharing models are refused by :mod:`.patch`).
"""

from __future__ import annotations

import contextvars
import copy
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig
from tierattn.errors import (KernelInputError, TierConfigError, UnsupportedDecodingError,
                             UnsupportedModelError)
from tierattn.models.hf.support import layer_kinds
from tierattn.telemetry import all_ranks as all_ranks_stats
from tierattn.telemetry import summarize

__all__ = ["CACHE_KWARG", "TieredCache"]

#: key of the attention kwargs under which the cache reaches the attention function
CACHE_KWARG = "tierattn_cache"
#: the cache whose layer was updated last in this thread/task (for versions without kwargs)
CURRENT: contextvars.ContextVar[TieredCache | None] = contextvars.ContextVar(
    "tierattn_current_cache", default=None)


class _TieredLayer(CacheLayerMixin):
    """One attention layer's view of the shared runtime."""

    is_sliding = False

    def __init__(self, owner: TieredCache, layer_idx: int) -> None:
        super().__init__()
        # a weak reference: the owner holds its layers, and a cycle would keep a dropped
        # cache's pools (GBs) allocated until the cyclic collector happened to run
        self._owner, self.layer_idx = weakref.ref(owner), layer_idx

    def __deepcopy__(self, memo: dict) -> _TieredLayer:
        # a copy of the cache (``copy.deepcopy(cache)``, a fork of every sequence's state)
        # hands its layers a reference to the copied owner, not to the original
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key != "_owner":
                setattr(new, key, copy.deepcopy(value, memo))
        owner = self._owner()
        new._owner = self._owner if owner is None else weakref.ref(copy.deepcopy(owner, memo))
        return new

    @property
    def owner(self) -> TieredCache:
        owner = self._owner()
        if owner is None:
            raise ReferenceError("tierattn: this cache layer outlived its TieredCache; keep the "
                                 "cache, not only its layers.")
        return owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner._start(key_states)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        owner = self.owner
        if owner.pending_layer is not None:  # the first-call guard, before anything is stored
            raise UnsupportedModelError(
                f"tierattn: layer {owner.pending_layer} stored its K/V in the tiered cache but "
                "its attention did not run through tierattn (a module that computes attention "
                "itself); this model cannot be served.")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            owner._start(key_states)  # checks the batch of a reused cache
        rt, local = owner.route(self.layer_idx)
        if key_states.shape[-1] != value_states.shape[-1] or \
                key_states.shape[1] != rt.num_kv_heads or key_states.shape[-1] != rt.head_dim:
            raise UnsupportedModelError(
                f"tierattn: layer {self.layer_idx} has K {list(key_states.shape)} and V "
                f"{list(value_states.shape)}; the cache holds {rt.num_kv_heads} KV heads of dim "
                f"{rt.head_dim} for K and V in every layer (the first layer's geometry).")
        if not _same_device(key_states.device, rt.device):
            raise KernelInputError(
                f"tierattn: layer {self.layer_idx}'s K/V are on {key_states.device} but its "
                f"pools on {rt.device}; for a model spread over devices (device_map), let "
                "tierattn.patch() make the cache, or pass TieredCache(..., layer_devices=).")
        rt.update(local, key_states, value_states)
        owner.pending_layer = self.layer_idx  # the attention call that follows reads it
        owner.last_kv = (key_states, value_states)  # what that call must be given
        attn_kwargs = kwargs.get("kwargs")
        if isinstance(attn_kwargs, dict):
            attn_kwargs[CACHE_KWARG] = self.owner
        CURRENT.set(self.owner)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # early 5.x passes cache_position
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if not self.owner.runtimes:
            return 0
        rt, local = self.owner.route(self.layer_idx)
        return rt.length(local)

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the name of get_max_length before transformers 5.x.y
        return -1

    def reset(self) -> None:
        self.owner.runtimes, self.owner.where = [], []
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedDecodingError(
            "tierattn: beam search is not supported by the tiered cache yet; use greedy or "
            "sampling (num_beams=1).")

    def crop(self, max_length: int) -> None:
        raise UnsupportedDecodingError(
            "tierattn: cropping the tiered cache (assisted or contrastive decoding) is not "
            "supported; use greedy or sampling decoding.")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise UnsupportedDecodingError(
                "tierattn: num_return_sequences > 1 is not supported by the tiered cache yet.")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedDecodingError("tierattn: selecting batch rows of the tiered cache is not "
                                  "supported.")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


def _rank_suffix() -> str:
    """``-tp{rank}of{world}`` under tensor parallelism (``torch.distributed`` initialised with
    several ranks): every rank's disk pages and saved caches get their own names."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"-tp{dist.get_rank()}of{dist.get_world_size()}"
    return ""


class TieredCache(Cache):
    """A ``Cache`` for ``generate(cache=...)`` backed by :class:`TieredKVCache` runtimes.

    Args:
        model_config: the model's ``PretrainedConfig`` (its layers).
        config: the :class:`~tierattn.config.TierConfig`.
        layer_devices: the device of each layer, for a model spread over devices
            (``device_map``): one runtime per device holds that device's layers, its pools on
            that device. None: every layer on the device of the first K/V (``patch`` passes the
            model's own map).

    The runtimes are built on the first ``update``, when the batch size, dtype, device and the
    K/V geometry are known: the KV heads and head dim are those of the K/V the model stores,
    so under tensor parallelism each rank's cache holds that rank's heads (and its disk pages
    and saved files carry the rank in their names). ``stats()`` returns the telemetry.
    """

    def __init__(self, model_config, config: TierConfig | None = None, *,
                 layer_devices: list | None = None) -> None:
        if config is not None and not isinstance(config, TierConfig):
            raise TierConfigError(
                f"TieredCache: config must be a TierConfig, got {type(config).__name__}; build "
                "one with TierConfig(...) or TierConfig.preset('offload', ...).")
        if not hasattr(model_config, "num_hidden_layers") and \
                not hasattr(model_config, "get_text_config"):
            raise KernelInputError(f"TieredCache: model_config must be the model's config "
                                   f"(model.config), got {type(model_config).__name__}.")
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") \
            else model_config
        self.model_config = text
        self.tier_config = config or TierConfig.preset("offload")
        self.num_layers = text.num_hidden_layers
        self.num_kv_heads = getattr(text, "num_key_value_heads", None) or \
            text.num_attention_heads
        self.head_dim = getattr(text, "head_dim", None) or \
            text.hidden_size // text.num_attention_heads
        self.runtimes: list[TieredKVCache] = []  # one per device
        self.where: list[tuple[int, int]] = []  # layer -> (runtime, its layer index there)
        self.layer_devices: list[torch.device] | None = None
        if layer_devices is not None:
            self.set_layer_devices(layer_devices)
        self.pending_layer: int | None = None  # updated, not yet attended
        self.last_kv: tuple | None = None  # the K/V update returned to that layer
        #: per layer, the sliding window transformers' own cache would keep (None: full)
        self.windows = [w for _, w in layer_kinds(text)]
        self._mask_seen: torch.Tensor | None = None  # the mask checked last (once per step)
        self._mask_bad: torch.Tensor | None = None  # device flag: a decode mask was wrong
        self._pad_of: torch.Tensor | None = None  # the runtime padding _pad was made from
        super().__init__(layers=[_TieredLayer(self, i) for i in range(self.num_layers)])

    def set_layer_devices(self, devices: list) -> None:
        """The device of each layer (before the first forward)."""
        devices = [torch.device(d) for d in devices]
        if len(devices) != self.num_layers:
            raise KernelInputError(f"layer_devices lists {len(devices)} devices; the model has "
                                   f"{self.num_layers} layers.")
        if self.runtimes and devices != self.layer_devices:
            raise KernelInputError("layer_devices: the cache is already built; make a new "
                                   "TieredCache for another device map.")
        self.layer_devices = devices

    @property
    def runtime(self) -> TieredKVCache | None:
        """The runtime (None before the first forward); with layers on several devices, the
        first device's (see :attr:`runtimes`)."""
        return self.runtimes[0] if self.runtimes else None

    def route(self, layer: int) -> tuple[TieredKVCache, int]:
        """``(runtime, layer index in it)`` of model layer ``layer``."""
        r, local = self.where[layer]
        return self.runtimes[r], local

    def _start(self, key_states: torch.Tensor) -> None:
        """Build the runtimes on the first K/V: the geometry is the tensors' (a config's
        ``head_dim`` is not always the K/V head dim, e.g. with MLA; under tensor parallelism a
        rank holds a share of the heads)."""
        if not self.runtimes:
            self.num_kv_heads, self.head_dim = key_states.shape[1], key_states.shape[-1]
            devices = self.layer_devices or [key_states.device] * self.num_layers
            groups: list[torch.device] = []
            for d in devices:
                if d not in groups:
                    groups.append(d)
            self.where = []
            counts = [0] * len(groups)
            for d in devices:
                g = groups.index(d)
                self.where.append((g, counts[g]))
                counts[g] += 1
            suffix = _rank_suffix()
            self.runtimes = [TieredKVCache(
                self.tier_config, num_layers=n, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, batch_size=key_states.shape[0], dtype=key_states.dtype,
                device=d, fingerprint=f"{self.model_config.model_type}{suffix}"
                + (f"-dev{g}" if len(groups) > 1 else ""))
                for g, (d, n) in enumerate(zip(groups, counts))]
        elif key_states.shape[0] != self.runtime.batch_size:
            raise KernelInputError(
                f"TieredCache holds {self.runtime.batch_size} sequences; this forward has "
                f"{key_states.shape[0]}: use a new TieredCache for another batch.")

    def attend(self, layer: int, query: torch.Tensor, **kw) -> torch.Tensor:
        """The runtime's ``attend`` for model layer ``layer``."""
        rt, local = self.route(layer)
        return rt.attend(local, query, **kw)

    @property
    def pad(self) -> torch.Tensor:
        return self.runtime.pad

    def set_padding(self, pad: torch.Tensor) -> None:
        for rt in self.runtimes:
            rt.set_padding(pad)
    def check_for(self, model_config, batch_size: int | None) -> None:
        """Refuse, before ``generate`` runs the model, a cache made for another model's layers
        or holding another batch size."""
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") \
            else model_config
        if text.num_hidden_layers != self.num_layers:
            raise KernelInputError(
                f"cache: this TieredCache was made for {self.num_layers} layers; the model has "
                f"{text.num_hidden_layers}. Make it with TieredCache(model.config, config).")
        keys = ("model_type", "num_attention_heads", "num_key_value_heads", "hidden_size")
        mine = {k: getattr(self.model_config, k, None) for k in keys}
        theirs = {k: getattr(text, k, None) for k in keys}
        if mine != theirs:
            raise KernelInputError(
                f"cache: this TieredCache was made for another model ({mine}; this model: "
                f"{theirs}); make it with TieredCache(model.config, config).")
        if self.runtime is not None and batch_size is not None and \
                batch_size != self.runtime.batch_size:
            raise KernelInputError(
                f"cache: this TieredCache holds {self.runtime.batch_size} sequences; generate "
                f"got {batch_size}. Use a new TieredCache for another batch.")
        self.pending_layer = None

    def check_decode_mask(self, mask: torch.Tensor) -> None:
        """Check a decode step's ``[B, kv_len]`` padding mask against the runtime's left
        padding on the device, without reading it back: the model passes the same mask to every
        layer, so it is checked once per step; a mismatch raises at :meth:`verify` (at the end
        of ``generate``)."""
        if mask is self._mask_seen:
            return
        self._mask_seen = mask
        rt = self.runtime
        if self._mask_bad is None or self._mask_bad.device != mask.device:
            self._mask_bad = torch.zeros((), dtype=torch.bool, device=mask.device)
            self._positions = torch.arange(rt.config.max_context, device=mask.device)
        if self._pad_of is not rt.pad:  # set once per prompt
            self._pad_of, self._pad = rt.pad, rt.pad.to(mask.device)
        want = self._positions[:mask.shape[1]] >= self._pad[:, None]
        self._mask_bad.logical_or_((mask.bool() != want).any())

    def verify(self) -> None:
        """At the end of ``generate``: raise if a decode step's padding mask was not the
        prompt's left padding (the tiered cache serves a fixed left padding), or if a demotion
        the last step deferred still fails (:meth:`TieredKVCache.settle`)."""
        for rt in self.runtimes:
            rt.settle()
        if self._mask_bad is not None and bool(self._mask_bad):
            raise UnsupportedDecodingError(
                "tierattn: a decode step's attention_mask was not the prompt's left padding "
                "followed by ones; the tiered cache supports a fixed left padding (pad on the "
                "left, as generate() does for decoder-only models).")

    def stats(self, *, all_ranks: bool = False) -> dict:
        """The telemetry (empty before the first forward): per model layer and in total,
        over every device's runtime; ``all_ranks``: also every tensor-parallel rank's total
        and their sum (collective: call it on every rank)."""
        if not self.runtimes:
            return {}
        if len(self.runtimes) == 1:
            out = self.runtime.stats()
        else:
            parts = [rt.stats()["layers"] for rt in self.runtimes]
            layers = [parts[r][local] for r, local in self.where]
            out = {"total": summarize(layers), "layers": layers}
            out["total"]["page_bytes"] = self.runtime.page_bytes
            out["total"]["page_size"] = self.runtime.page_size
        return all_ranks_stats(out) if all_ranks else out
