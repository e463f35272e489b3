"""tierattn in vLLM, two features, one file per role.

Swap on preemption -- preempted requests and returning conversations loaded from tierattn's
tiers through vLLM's offloading connector:

* :mod:`.config` -- :func:`vllm_kv_transfer_config` and :func:`vllm_engine_args` (import no
  vLLM), the supported release and the vLLM internals relied on;
* :mod:`.manager` -- :class:`TieredBlockManager` (scheduler process): vLLM's own offloading
  manager over the tiers' slots, with the cost model and failed transfers;
* :mod:`.worker` -- :class:`TieredBlockWorker` (each worker process): the copies, through the
  swap core's :class:`~tierattn.serving.swaptiers.SwapTiers`;
* :mod:`.connector` -- the spec and connector vLLM loads by name.

The hot set -- each request keeps a share of its KV blocks on the device and attends the rest
from a host tier (:func:`vllm_engine_args`):

* :mod:`.hotset` -- :class:`HotSetSpec` and :class:`HotSetManager` (scheduler): which pages are
  cold, their host slots, and freeing a block only once its copy exists;
* :mod:`.hotattn` -- :class:`HotSetWorker` and the attention backend (workers): the host tier,
  the copies, attention over hot blocks plus cold pages;
* :mod:`.hotconnector` -- the connector vLLM loads: the scheduler's word to the workers each step;
* :mod:`.plugin` -- vLLM's general plugin: points ``CPU_ATTN`` at tierattn's backend, vLLM's
  own unless an engine asks for the hot set.

Only :mod:`.config` is imported with this package; the others import vLLM.
"""

from __future__ import annotations

from .config import (SUPPORTED, VLLM_INTERNALS, check_vllm, vllm_engine_args,
                     vllm_kv_transfer_config)

__all__ = ["SUPPORTED", "VLLM_INTERNALS", "check_vllm", "vllm_engine_args",
           "vllm_kv_transfer_config"]
