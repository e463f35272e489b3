"""Where tierattn's vLLM connector lived before :mod:`tierattn.models.vllm`: a
``kv_transfer_config`` written by an earlier release names this module, so it still loads it
(one release; write new configurations with :func:`tierattn.vllm_kv_transfer_config`)."""

from tierattn.models.vllm.connector import (TierattnOffloadingConnector,  # noqa: F401
                                            TierattnOffloadingSpec)
