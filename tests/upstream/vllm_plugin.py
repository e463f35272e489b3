"""pytest plugin: vLLM's own offloading tests run against tierattn's classes.

Loaded with ``-p vllm_plugin`` by ``tests/upstream/vllm_offload.py`` before vLLM's test modules
are imported, it rebinds the names those tests build their objects from:

* ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` -> :class:`TierattnAsCPUManager`, a
  :class:`~tierattn.models.vllm.manager.TieredBlockManager` with one DDR tier of the test's
  ``num_chunks`` (one block per chunk, ``policy="swap"``: every store kept, as vLLM's manager);
* ``OffloadingConnector`` (its module, which vLLM's connector registry reads by name) ->
  :class:`~tierattn.models.vllm.connector.TierattnOffloadingConnector`, over the tests' own mock
  spec (the connector flow: lookups, stores, loads, preemption, metadata, events).

One adaptation this machine requires (no network): the model config vLLM's tests build their
engine configs from, ``facebook/opt-125m`` on the Hugging Face Hub, is an OPT config of the same
shape written to a local folder (the tests read its geometry only; no weights are loaded).

No test body is edited; differences of documented policy are listed in ``vllm_offload.py``.
"""

from __future__ import annotations

from tierattn.config import SwapConfig, TierSpec


def pytest_configure(config) -> None:
    import os

    import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector as oc
    import vllm.v1.kv_offload.cpu.manager as cpu_manager

    from tierattn.models.vllm.connector import TierattnOffloadingConnector
    from tierattn.models.vllm.manager import TieredBlockManager

    class TierattnAsCPUManager(TieredBlockManager):
        """vLLM's ``CPUOffloadingManager`` signature over one tierattn DDR tier."""

        def __init__(self, num_chunks: int, cache_policy: str = "lru",
                     cache_policy_module_path: str | None = None, enable_events: bool = False,
                     store_threshold: int = 1, max_tracker_size: int = 64_000) -> None:
            swap = SwapConfig(tiers=(TierSpec("ddr", capacity_pages=max(1, num_chunks)),),
                              policy="swap")
            super().__init__(swap, [max(1, num_chunks)], blocks_per_chunk=1,
                             tokens_per_chunk=16, chunk_bytes=1, enable_events=enable_events,
                             cache_policy=cache_policy, store_threshold=store_threshold)
            if num_chunks == 0:  # vLLM allows an empty cache; a tierattn tier holds a slot
                self._num_chunks = 0
            self.max_tracker_size = max_tracker_size
            if cache_policy_module_path is not None:
                raise NotImplementedError("out-of-tree cache policies are not tried here")

    _local_model_config()
    if os.environ.get("TIERATTN_UPSTREAM_PLAIN"):  # the baseline: vLLM's own classes
        return
    cpu_manager.CPUOffloadingManager = TierattnAsCPUManager
    # vLLM's connector registry reads the module's attribute when an engine is built
    oc.OffloadingConnector = TierattnOffloadingConnector


def pytest_collection_modifyitems(config, items) -> None:
    """The documented differences (``vllm_offload.EXPECTED_DIFFERENCES``) must fail."""
    import json
    import os

    import pytest

    expected = json.loads(os.environ.get("TIERATTN_UPSTREAM_EXPECTED", "{}"))
    for item in items:
        reason = expected.get(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


_OUTCOMES: dict[str, str] = {}


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
        _OUTCOMES[report.nodeid] = outcome


def pytest_unconfigure(config) -> None:
    import json
    import os

    path = os.environ.get("TIERATTN_UPSTREAM_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_OUTCOMES, f, indent=1, sort_keys=True)


def _local_model_config() -> None:
    """``create_vllm_config``'s default model: a local OPT-125m-shaped config (no Hub here)."""
    import tempfile

    from tests.v1.kv_connector.unit import utils
    from transformers import OPTConfig

    folder = tempfile.mkdtemp(prefix="tierattn-opt-125m-")
    OPTConfig(vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072,
              num_attention_heads=12, max_position_embeddings=2048,
              word_embed_proj_dim=768).save_pretrained(folder)
    fn = utils.create_vllm_config
    fn.__defaults__ = tuple(folder if d == "facebook/opt-125m" else d for d in fn.__defaults__)
