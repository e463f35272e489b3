"""tierattn in vLLM: preempted requests and returning conversations loaded from tierattn's
tiers through vLLM's offloading connector, one file per role:

* :mod:`.config` -- :func:`vllm_kv_transfer_config` (imports no vLLM), the supported release
  and the vLLM internals relied on;
* :mod:`.manager` -- :class:`TieredBlockManager` (scheduler process): vLLM's own offloading
  manager over the tiers' slots, with the cost model and failed transfers;
* :mod:`.worker` -- :class:`TieredBlockWorker` (each worker process): the copies, through the
  swap core's :class:`~tierattn.swaptiers.SwapTiers`;
* :mod:`.connector` -- the spec and connector vLLM loads by name.

Only :mod:`.config` is imported with this package; the others import vLLM.
"""

from __future__ import annotations

from .config import SUPPORTED, VLLM_INTERNALS, check_vllm, vllm_kv_transfer_config

__all__ = ["SUPPORTED", "VLLM_INTERNALS", "check_vllm", "vllm_kv_transfer_config"]
