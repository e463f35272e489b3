"""tierattn's tiers under vLLM (models/vllm/), on vLLM's CPU platform.

Engine tests: tiny random llama and qwen3 models (head_dim 32, fp32) in vLLM with a KV cache of
seven 128-token blocks, four requests of 200..221 prompt tokens and 64 greedy tokens each, so
requests preempt one another. Every engine runs in-process, one after another, inside a
module-scoped fixture (before the function-scoped fixtures of conftest.py), and gives back what
it did: per round the tokens, ``num_cached_tokens`` and a ``get_metrics()`` snapshot. Every run
is compared token for token with vLLM without the connector on the same tight cache.

Unit tests: ``vllm_kv_transfer_config``'s checks, :class:`TieredBlockManager`'s slots, LRU,
faults and cost decisions, and :class:`TieredBlockWorker`'s copies and faults over a
hand-made KV cache (no engine).

CI runs this file alone in a venv with vLLM (``.venv-vllm``); without vLLM it is skipped.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,  # noqa: E402
                                     CanonicalKVCacheTensor, GPULoadStoreSpec, LookupResult,
                                     ReqContext, make_offload_key)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm_helpers import (BLOCK_BYTES, corrupt_files, delete_files, disk_files,  # noqa: E402
                          disk_pages, run_engine, save_tiny_models)

from tierattn.config import TierSpec  # noqa: E402
from tierattn.serving.costmodel import attention_work  # noqa: E402
from tierattn.errors import TierConfigError, UnsupportedEngineError  # noqa: E402
from tierattn.models.vllm import config as vcfg  # noqa: E402
from tierattn.models.vllm import connector as vconn  # noqa: E402
from tierattn.models.vllm import manager as vman  # noqa: E402
from tierattn.models.vllm import worker as vwork  # noqa: E402
from tierattn.config import SwapConfig  # noqa: E402

engine = pytest.mark.skipif(
    not any(vllm.__version__ == v or vllm.__version__.startswith(v + ".") for v in vcfg.SUPPORTED),
    reason=f"vLLM {vllm.__version__} is not a release the connector supports {vcfg.SUPPORTED}")

#: engines compared with vLLM: name -> (family, policy, DDR of 2 blocks over a disk tier, rounds)
ENGINES = {
    # rounds: 0 stores (DDR full -> disk), 1 loads from both tiers, then every page file is
    # corrupted; 2 loads fail (recomputed); 3 stores the dropped chunks again, then every
    # page file is deleted; 4 loads fail again
    "llama-swap-disk": ("llama", "swap", True, 5),
    "llama-auto": ("llama", "auto", False, 2),
    "qwen3-swap": ("qwen3", "swap", False, 2),
    "qwen3-auto-disk": ("qwen3", "auto", True, 2),
    "qwen3-recompute": ("qwen3", "recompute", False, 2),
}
CORRUPTED_AFTER, DELETED_AFTER = 1, 3  # rounds of llama-swap-disk


# --- engines ----------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return save_tiny_models(tmp_path_factory.mktemp("vllm-models"))


@pytest.fixture(scope="module")
def _runs() -> dict:
    """Every engine's Run by name, each engine built once in this module."""
    return {}


@pytest.fixture(scope="module")
def reference(request, models, _runs):
    """vLLM without the connector (its recompute on preemption), on the same tight cache."""
    family = request.param
    if family not in _runs:
        ref = run_engine(f"{family}-vllm", models[family])
        # the premise: vLLM's greedy tokens do not depend on the round
        assert ref.tokens[1] == ref.tokens[0], f"{family}: vLLM alone is not deterministic"
        _runs[family] = ref
    return _runs[family]


@pytest.fixture(scope="module")
def run(request, models, _runs, tmp_path_factory):
    """One engine of :data:`ENGINES` with tierattn's connector."""
    name = request.param
    if name in _runs:
        return _runs[name]
    family, policy, disk, rounds = ENGINES[name]
    folder = tmp_path_factory.mktemp(f"{name}-pages")
    tiers = (TierSpec("ddr", capacity_pages=2), TierSpec("disk", path=str(folder))) if disk \
        else ("ddr",)
    config = vcfg.vllm_kv_transfer_config(tiers, policy=policy)
    json.dumps(config)  # what `vllm serve --kv-transfer-config` would get

    def between(r, run):
        run.notes[f"files_after_{r}"] = len(disk_files(folder))
        run.notes[f"pages_after_{r}"] = disk_pages(folder)
        if name == "llama-swap-disk" and r == CORRUPTED_AFTER:
            run.notes["corrupted"] = corrupt_files(folder)
        if name == "llama-swap-disk" and r == DELETED_AFTER:
            run.notes["deleted"] = delete_files(folder)

    out = run_engine(name, models[family], config, rounds=rounds, between=between)
    out.notes["tiers"] = [t if isinstance(t, str) else t.kind for t in tiers]
    out.notes["files_after_shutdown"] = len(disk_files(folder))
    _runs[name] = out
    return out


def _engine_params(*names: str) -> list:
    return [pytest.param(n, ENGINES[n][0], id=n) for n in names]


def _loaded(run, *, round: int) -> dict[str, float]:
    return {t: run.delta("tierattn_loaded_slots", t, round=round) for t in run.notes["tiers"]}


#: one engine with vLLM's worker processes (``vllm serve``'s layout), run from its own process
MULTIPROCESS_RUN = """
import json
from vllm_helpers import run_engine
from tierattn.config import TierSpec
from tierattn.models.vllm import vllm_kv_transfer_config

if __name__ == "__main__":
    tiers = (TierSpec("ddr", capacity_pages=2), TierSpec("disk", path={disk!r}))
    run = run_engine("multiprocess", {model!r}, vllm_kv_transfer_config(tiers, policy="swap"))
    print("RESULT" + json.dumps({{"tokens": run.tokens,
                                 "loaded": run.delta("tierattn_loaded_slots", "disk", round=1),
                                 "preempted": run.value("num_preemptions", after=0)}}))
"""


@engine
@pytest.mark.parametrize("reference", ["llama"], indirect=True)
def test_the_connector_runs_across_vllm_processes(reference, models, tmp_path):
    """With ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (``vllm serve``) the manager runs in the engine
    core's process and the worker in another: slot specs, failures and timings cross by
    pickle, and the tokens still equal vLLM's."""
    script = tmp_path / "multiprocess_run.py"
    script.write_text(MULTIPROCESS_RUN.format(disk=str(tmp_path / "pages"),
                                              model=models["llama"]))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "PYTHONPATH": str(Path(__file__).parent)}  # the tests' helpers
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    assert result["preempted"] > 0
    assert result["tokens"] == [reference.tokens[0]] * 2
    assert result["loaded"] > 0, "the second round loaded nothing from disk"


@engine
@pytest.mark.parametrize("run, reference", _engine_params(*ENGINES), indirect=True)
def test_tokens_identical_to_vllm_under_preemption(run, reference):
    """Greedy tokens of every round equal vLLM's own, with requests preempted."""
    assert run.value("num_preemptions", after=0) > 0, "the cache is not tight: no preemption"
    assert reference.value("num_preemptions", after=0) > 0
    for r, tokens in enumerate(run.tokens):
        for i, (got, want) in enumerate(zip(tokens, reference.tokens[0], strict=True)):
            assert got == want, f"round {r}, request {i}: tokens differ from vLLM's"
    if ENGINES[run.name][1] != "recompute":
        assert sum(run.value("tierattn_stored_slots", t) for t in run.notes["tiers"]) > 0


@engine
@pytest.mark.parametrize("run, reference", _engine_params("qwen3-swap", "llama-swap-disk"),
                         indirect=True)
def test_a_second_round_loads_from_the_tiers(run, reference):
    """The same prompts again: their first blocks come back from the tiers (vLLM alone, whose
    small cache lost them, computes them again)."""
    loaded = _loaded(run, round=1)
    assert sum(loaded.values()) > 0, loaded
    for tier, chunks in loaded.items():
        assert run.delta("tierattn_loaded_bytes", tier, round=1) == chunks * BLOCK_BYTES
    assert run.delta("external_prefix_cache_hits", round=1) > 0
    assert any(c > 0 for c in run.cached[1]), run.cached
    assert sum(run.cached[1]) > sum(reference.cached[1]), (run.cached, reference.cached)
    assert run.value("tierattn_load_faults", after=1) == 0
    assert run.value("tierattn_store_faults") == 0


@engine
@pytest.mark.parametrize("run, reference", _engine_params("qwen3-swap"), indirect=True)
def test_default_tiers_keep_every_request_for_the_next_round(run, reference):
    """Default tiers (sized from the host, not from vLLM's 7-block cache): nothing evicted, and
    every request of the second round finds its prompt's blocks there."""
    assert run.notes["tiers"] == ["ddr"]
    assert run.value("tierattn_evicted_slots") == 0 and run.value("tierattn_no_room") == 0
    assert all(c > 0 for c in run.cached[1]), run.cached
    assert run.value("tierattn_used_slots", "ddr", after=0) >= 7  # more than vLLM's own cache


@engine
@pytest.mark.parametrize("run, reference", _engine_params("llama-swap-disk", "qwen3-auto-disk"),
                         indirect=True)
def test_a_full_ddr_tier_spills_to_disk(run, reference):
    """DDR holds two blocks: the rest goes to disk, pages in one segment file per worker
    (whatever the number of pages), which shutdown removes."""
    assert run.value("tierattn_stored_slots", "ddr", after=0) == 2
    assert run.value("tierattn_used_slots", "ddr", after=0) == 2
    stored = run.value("tierattn_stored_slots", "disk", after=0)
    assert stored > 0
    assert run.value("tierattn_stored_bytes", "disk", after=0) == stored * BLOCK_BYTES
    assert run.notes["pages_after_0"] >= 2 * stored  # a page per layer and block
    assert run.notes["files_after_0"] == 1  # in one segment file
    assert run.notes["files_after_shutdown"] == 0, "the engine left page files behind"


@engine
@pytest.mark.parametrize("run, reference", _engine_params("llama-swap-disk"), indirect=True)
def test_swap_loads_from_disk(run, reference):
    loaded = _loaded(run, round=1)
    assert loaded["disk"] > 0, loaded
    assert run.delta("tierattn_loaded_bytes", "disk", round=1) == loaded["disk"] * BLOCK_BYTES
    assert run.tokens[1] == reference.tokens[0]


@engine
@pytest.mark.parametrize("run, reference", _engine_params("llama-swap-disk"), indirect=True)
@pytest.mark.parametrize("fault, round", [("corrupted", CORRUPTED_AFTER + 1),
                                          ("deleted", DELETED_AFTER + 1)])
def test_a_disk_fault_is_recomputed_never_a_wrong_token(run, reference, fault, round):
    """Page files corrupted (checksum) or deleted between rounds: the loads fail, the requests
    are prefilled again, and the tokens stay vLLM's."""
    assert run.notes[fault] > 0, run.notes
    assert run.value("tierattn_load_faults", after=CORRUPTED_AFTER) == 0  # before any fault
    assert run.delta("tierattn_load_faults", round=round) >= 1
    assert run.tokens[round] == reference.tokens[0]
    assert run.value("tierattn_store_faults") == 0


@engine
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine: vLLM's CUDA platform")
@pytest.mark.parametrize("run, reference", _engine_params("qwen3-swap"), indirect=True)
def test_the_cpu_platform_runs_the_connector(run, reference):
    assert current_platform.is_cpu()
    assert run.value("tierattn_stored_slots", "ddr") > 0
    assert run.value("tierattn_loaded_slots", "ddr") > 0
    assert run.tokens == [reference.tokens[0]] * len(run.tokens)


@engine
@pytest.mark.parametrize("run, reference", _engine_params("qwen3-recompute"), indirect=True)
def test_policy_recompute_stores_nothing(run, reference):
    for name in ("stored_slots", "loaded_slots", "stored_bytes", "loaded_bytes"):
        assert run.value("tierattn_" + name, "ddr") == 0, name
    assert run.value("tierattn_used_slots", "ddr") == 0
    assert run.value("external_prefix_cache_hits") == 0
    assert run.cached == reference.cached
    assert run.tokens == [reference.tokens[0]] * len(run.tokens)


# --- vllm_kv_transfer_config ------------------------------------------------------------------


def test_the_config_names_the_connector_and_is_json(tmp_path):
    calibration = tmp_path / "cal.json"
    calibration.write_text("{}")
    config = vcfg.vllm_kv_transfer_config(
        ("ddr", TierSpec("cxl", capacity_gib=0.5), TierSpec("disk", path=str(tmp_path))),
        "swap", calibration=calibration, prompt_only=True, block_size=256, backend="torch")
    assert json.loads(json.dumps(config)) == config
    assert config["kv_connector"] == "TierattnOffloadingConnector"
    assert config["kv_connector_module_path"] == "tierattn.models.vllm.connector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_role"] == "kv_both"
    extra = config["kv_connector_extra_config"]
    assert extra["tiers"] == [{"kind": "ddr"}, {"kind": "cxl", "capacity_gib": 0.5},
                              {"kind": "disk", "path": str(tmp_path)}]
    assert (extra["policy"], extra["backend"], extra["block_size"]) == ("swap", "torch", 256)
    assert extra["offload_prompt_only"] is True
    assert extra["calibration"] == str(calibration.resolve())
    # what vLLM loads by name
    module = importlib.import_module(config["kv_connector_module_path"])
    assert getattr(module, config["kv_connector"]) is vconn.TierattnOffloadingConnector
    assert getattr(importlib.import_module(extra["spec_module_path"]),
                   extra["spec_name"]) is vconn.TierattnOffloadingSpec
    # the defaults: one DDR tier, auto, the generated blocks kept too
    default = vcfg.vllm_kv_transfer_config()["kv_connector_extra_config"]
    assert (default["tiers"], default["policy"]) == ([{"kind": "ddr"}], "auto")
    assert default["offload_prompt_only"] is False
    assert "block_size" not in default and "calibration" not in default


def test_the_config_is_json_with_a_path_object(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative folder is made absolute: engines may start elsewhere
    config = vcfg.vllm_kv_transfer_config(("ddr", TierSpec("disk", path=Path("kv"))))
    assert json.loads(json.dumps(config))["kv_connector_extra_config"]["tiers"][1] == \
        {"kind": "disk", "path": str((tmp_path / "kv").resolve())}


def test_the_config_takes_a_swap_config(tmp_path):
    swap = SwapConfig(tiers=("ddr", TierSpec("disk", path=str(tmp_path))), policy="swap",
                      backend="torch")
    assert vcfg.vllm_kv_transfer_config(swap) == vcfg.vllm_kv_transfer_config(
        swap.tiers, "swap", backend="torch")


def test_the_vllm_internals_relied_on_are_checked(monkeypatch):
    """Each private vLLM name the adapter reads is found in vLLM 0.32; one that moved makes
    an engine refuse to start, naming it."""
    vcfg.check_vllm()
    module, cls, attr, _ = vcfg.VLLM_INTERNALS[0]
    monkeypatch.setattr(vcfg, "VLLM_INTERNALS", ((module, cls, "_gone", "a test"),))
    with pytest.raises(UnsupportedEngineError, match=f"{cls}._gone"):
        vcfg.check_vllm()


@pytest.mark.parametrize("kwargs", [
    {"policy": "sometimes"},
    {"tiers": ("disk",)},  # a disk tier without path
    {"tiers": ()},
    {"tiers": ("disk", "ddr")},
    {"tiers": ("hbm",)},
    {"block_size": 0},
    {"block_size": -128},
    {"block_size": True},
    {"block_size": 128.0},
    {"block_size": "128"},
    {"calibration": "/nonexistent/calibration.json"},
    {"backend": "cuda"},
], ids=lambda k: "-".join(f"{a}={b!r}" for a, b in k.items()))
def test_a_bad_config_is_refused(kwargs):
    with pytest.raises(TierConfigError):
        vcfg.vllm_kv_transfer_config(**kwargs)


# --- TieredBlockManager -----------------------------------------------------------------------


def key(i: int):
    return make_offload_key(bytes([i]) * 32, 0)


def manager(tmp_path, policy: str = "swap") -> vman.TieredBlockManager:
    """DDR of 2 slots over a disk of 4, one block (128 tokens, 1 KiB) per chunk."""
    config = SwapConfig(tiers=(TierSpec("ddr", capacity_pages=2),
                               TierSpec("disk", path=str(tmp_path))), policy=policy)
    return vman.TieredBlockManager(config, [2, 4], blocks_per_chunk=1, tokens_per_chunk=128,
                                 chunk_bytes=1024)


def store(m, keys, ctx):
    out = m.prepare_store(keys, ctx)
    m.complete_store(out.keys_to_store, ctx)
    return out


def tiers(m, spec) -> list[str]:
    """The tier kind of each chunk a store or load spec names."""
    return [m.kinds[m.tier_of(c)] for c in spec.chunk_ids.tolist()]


def test_manager_fills_ddr_then_spills_to_disk(tmp_path):
    m, ctx = manager(tmp_path), ReqContext("r")
    out = m.prepare_store([key(i) for i in range(3)], ctx)
    assert out.keys_to_store == [key(0), key(1), key(2)] and out.evicted_keys == []
    assert tiers(m, out.store_spec) == ["ddr", "ddr", "disk"]
    assert len(set(out.store_spec.chunk_ids.tolist())) == 3
    assert m.lookup(key(0), ctx) is LookupResult.HIT_PENDING  # stored once complete_store says
    assert m.lookup(key(9), ctx) is LookupResult.MISS
    m.complete_store(out.keys_to_store, ctx)
    assert all(m.lookup(key(i), ctx) is LookupResult.HIT for i in range(3))
    assert m.counters.stored_slots == {"ddr": 2, "disk": 1}
    assert m.counters.stored_bytes == {"ddr": 2048, "disk": 1024}
    assert m.used_slots() == {"ddr": 2, "disk": 1}
    # storing a stored key again is a no-op
    again = m.prepare_store([key(2), key(3)], ctx)
    assert again.keys_to_store == [key(3)] and tiers(m, again.store_spec) == ["disk"]
    # a load names each key's chunk, and so its tier
    m.complete_store(again.keys_to_store, ctx)
    spec = m.prepare_load([key(0), key(2)], ctx)
    assert tiers(m, spec) == ["ddr", "disk"]
    m.complete_load([key(0), key(2)], ctx)
    assert m.counters.loaded_slots == {"ddr": 1, "disk": 1}
    assert m.counters.loaded_bytes == {"ddr": 1024, "disk": 1024}


def test_manager_evicts_a_finished_prefix_tail_first(tmp_path):
    """vLLM's LRU contract: when a request finishes, its prefix is touched tail first, so the
    tail is evicted before the head (a lookup stops at the first miss: an evicted head would
    leave the rest of the prefix as dead weight); a freed DDR chunk takes the next store."""
    m, ctx = manager(tmp_path), ReqContext("r")
    keys = [key(i) for i in range(6)]
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 128)
    store(m, keys, ctx)  # DDR: 0, 1; disk: 2..5: all full
    m.on_request_finished(ctx)
    assert m.used_slots() == {"ddr": 2, "disk": 4}
    out = m.prepare_store([key(6)], ReqContext("s"))
    assert out.evicted_keys == [key(5)]  # the tail
    assert m.counters.evicted_slots == 1
    assert m.lookup(key(5), ctx) is LookupResult.MISS
    assert m.lookup(key(0), ctx) is LookupResult.HIT
    m.complete_store(out.keys_to_store, ReqContext("s"))
    m.touch([key(4)], ctx)  # used again: key 3 is next in line
    out = m.prepare_store([key(7)], ReqContext("s"))
    assert out.evicted_keys == [key(3)]


def test_manager_places_freed_chunks_fastest_tier_first(tmp_path):
    m, ctx = manager(tmp_path), ReqContext("r")
    out = m.prepare_store([key(i) for i in range(4)], ctx)  # DDR 0, 1; disk 2, 3
    m.complete_store(out.keys_to_store[:1], ctx, success=False)  # key 0's DDR chunk is free
    m.complete_store(out.keys_to_store[1:], ctx)
    out = m.prepare_store([key(8), key(9)], ctx)
    assert tiers(m, out.store_spec) == ["ddr", "disk"]


def test_manager_refuses_a_store_all_or_nothing_when_every_chunk_is_busy(tmp_path):
    m, ctx = manager(tmp_path), ReqContext("r")
    keys = [key(i) for i in range(6)]
    store(m, keys[:5], ctx)
    m.prepare_store(keys[5:], ctx)  # a store in flight is not evictable either
    m.prepare_load(keys[:4], ctx)
    assert m.prepare_store([key(6), key(7)], ctx) is None  # one chunk is free: vLLM retries
    assert m.counters.no_room == 1 and m.counters.evicted_slots == 0
    assert all(m.lookup(k, ctx) is LookupResult.HIT for k in keys[:5])
    m.complete_load(keys[:4], ctx)
    assert len(m.prepare_store([key(6), key(7)], ctx).evicted_keys) == 2


def test_manager_emits_kv_events(tmp_path):
    config = SwapConfig(tiers=(TierSpec("ddr", capacity_pages=2),), policy="swap")
    m = vman.TieredBlockManager(config, [2], blocks_per_chunk=1, tokens_per_chunk=128,
                                chunk_bytes=1024, enable_events=True)
    ctx = ReqContext("r")
    store(m, [key(0), key(1)], ctx)
    store(m, [key(2)], ctx)
    events = list(m.take_events())
    assert [(e.removed, len(e.keys)) for e in events] == [(False, 2), (True, 1), (False, 1)]
    assert not list(m.take_events())


def test_manager_drops_failed_transfers(tmp_path):
    m, ctx = manager(tmp_path), ReqContext("r")
    out = m.prepare_store([key(0), key(1)], ctx)
    m.mark_failed([key(0)])  # the workers reported the store of key 0 failed
    m.complete_store(out.keys_to_store, ctx)
    assert m.lookup(key(0), ctx) is LookupResult.MISS
    assert m.lookup(key(1), ctx) is LookupResult.HIT
    assert m.counters.store_faults == 1 and m.counters.stored_slots == {"ddr": 1}
    assert m.used_slots() == {"ddr": 1, "disk": 0}
    # complete_store(success=False) drops as well
    out = m.prepare_store([key(2)], ctx)
    m.complete_store(out.keys_to_store, ctx, success=False)
    assert m.lookup(key(2), ctx) is LookupResult.MISS and m.counters.store_faults == 2
    # a failed load: a miss at once, dropped once its last reader completes
    m.prepare_load([key(1)], ctx)
    m.prepare_load([key(1)], ctx)
    m.mark_failed([key(1)])
    assert m.lookup(key(1), ctx) is LookupResult.MISS
    m.complete_load([key(1)], ctx)
    assert m.counters.load_faults == 1 and m.used_slots()["ddr"] == 1
    m.complete_load([key(1)], ctx)
    assert m.counters.load_faults == 2 and m.used_slots() == {"ddr": 0, "disk": 0}
    assert m.counters.loaded_slots == {}
    assert m.lookup(key(1), ctx) is LookupResult.MISS
    # the freed slots take new chunks: DDR first again
    out = m.prepare_store([key(3), key(4)], ctx)
    assert tiers(m, out.store_spec) == ["ddr", "ddr"]


def test_policy_recompute_stores_nothing_in_the_manager(tmp_path):
    m, ctx = manager(tmp_path, "recompute"), ReqContext("r")
    out = m.prepare_store([key(0)], ctx)
    assert out.keys_to_store == [] and out.evicted_keys == []
    m.complete_store(out.keys_to_store, ctx)
    assert m.lookup(key(0), ctx) is LookupResult.MISS
    assert m.used_slots() == {"ddr": 0, "disk": 0}


def _slow_disk_fast_prefill(m: vman.TieredBlockManager) -> None:
    """Disk loads of a chunk take 2.5 ms; a prefill costs 10 us a token plus 10 ns a query-key
    pair (batches of 64..512 tokens after 0..1024 cached ones)."""
    for _ in range(3):
        m.costs.observe_transfer("disk", "load", m.chunk_bytes, 2.5e-3)
    for q in (64, 128, 256, 512):
        for past in (0, 256, 1024):
            m.costs.observe_batch(q, q + past, attention_work(q, past),
                                  1e-5 * q + 1e-8 * attention_work(q, past))


def _looked_up(m: vman.TieredBlockManager, req: str, keys) -> list:
    """What vLLM's prefix lookup does before the connector prices the hit."""
    ctx = ReqContext(req)
    m.begin_lookup(req)
    return [m.lookup(k, ctx) for k in keys]


def test_auto_declines_a_hit_slower_to_load_than_to_recompute(tmp_path):
    m, ctx = manager(tmp_path, "auto"), ReqContext("r")
    store(m, [key(i) for i in range(3)], ctx)  # 0, 1 in DDR; 2 on disk
    # lookups report every stored chunk; the connector prices the whole hit
    assert _looked_up(m, "a", [key(2)]) == [LookupResult.HIT]
    assert m.worth_loading("a", 128, 0)  # nothing measured yet: the tiers are tried
    _slow_disk_fast_prefill(m)
    # one block from disk: 1.4 ms to prefill again against 2.5 ms to load
    assert m.costs.marginal_s(128, 0) < m.costs.transfer_s("disk", "load", 1024)
    _looked_up(m, "b", [key(2)])
    assert not m.worth_loading("b", 128, 0)
    assert m.counters.declined_slots == 1
    # after 15 cached blocks, attention over them makes recomputing the block slower (3.8 ms)
    _looked_up(m, "c", [key(2)])
    assert m.worth_loading("c", 128, 15 * 128)
    # a hit with a DDR chunk whose cost is unmeasured: tried
    _looked_up(m, "d", [key(0), key(2)])
    assert m.worth_loading("d", 256, 0)
    # one declined hit in EXPLORE_EVERY is loaded anyway: the load fits stay measured
    taken = []
    for i in range(2 * vman.EXPLORE_EVERY):
        _looked_up(m, f"e{i}", [key(2)])
        taken.append(m.worth_loading(f"e{i}", 128, 0))
    assert taken.count(True) == 2 and m.counters.declined_slots == 1 + 2 * vman.EXPLORE_EVERY - 2
    # "swap" loads whatever the costs
    s = manager(tmp_path / "swap", "swap")
    store(s, [key(i) for i in range(3)], ctx)
    _slow_disk_fast_prefill(s)
    _looked_up(s, "q", [key(2)])
    assert s.worth_loading("q", 128, 0) and s.counters.declined_slots == 0


def test_reset_cache_forgets_chunks_in_flight(tmp_path):
    """vLLM's reset_cache ignores the late completions of jobs in flight: nothing may wait
    for them (a HIT_PENDING would defer the prefix's requests forever)."""
    m, ctx = manager(tmp_path), ReqContext("r")
    store(m, [key(0)], ctx)
    m.prepare_load([key(0)], ctx)                      # a load in flight
    assert m.prepare_store([key(1)], ctx) is not None  # a store in flight
    m.reset_cache()
    assert _looked_up(m, "x", [key(0), key(1)]) == [LookupResult.MISS] * 2
    assert sum(m.used_slots().values()) == 0
    assert m.prepare_store([key(i) for i in range(6)], ctx).keys_to_store == \
        [key(i) for i in range(6)]  # every slot free again (2 DDR + 4 disk)


def test_manager_reports_metric_deltas(tmp_path):
    m, ctx = manager(tmp_path), ReqContext("r")
    defs = vconn.TierattnOffloadingSpec.build_metric_definitions({})
    store(m, [key(i) for i in range(3)], ctx)
    m.prepare_load([key(2)], ctx)
    m.complete_load([key(2)], ctx)
    data = m.get_stats().data["data"]
    assert set(data) <= set(defs)
    assert data["vllm:tierattn_stored_slots"] == {("ddr",): 2, ("disk",): 1}
    assert data["vllm:tierattn_stored_bytes"] == {("ddr",): 2048, ("disk",): 1024}
    assert data["vllm:tierattn_loaded_slots"] == {("disk",): 1}
    assert data["vllm:tierattn_used_slots"] == {("ddr",): 2, ("disk",): 1}
    # counters report what changed since the last report; gauges every time
    store(m, [key(3)], ctx)
    data = m.get_stats().data["data"]
    assert data["vllm:tierattn_stored_slots"] == {("disk",): 1}
    assert "vllm:tierattn_loaded_slots" not in data
    assert data["vllm:tierattn_used_slots"] == {("ddr",): 2, ("disk",): 2}
    assert json.dumps(m.summary())


# --- TieredBlockWorker ------------------------------------------------------------------------

T, WIDTH, LAYERS, BLOCKS = 4, 8, 2, 8  # tokens per block, K/V row width, layers, engine blocks
PAGE_BYTES = 2 * T * WIDTH * 4  # fp32


def kv_caches() -> CanonicalKVCaches:
    """An engine's KV cache as vLLM hands it to a worker: per layer ``(blocks, page bytes)``
    int8, here random fp32 values."""
    gen = torch.Generator().manual_seed(0)
    tensors = [CanonicalKVCacheTensor(torch.randn(BLOCKS, PAGE_BYTES // 4, generator=gen)
                                      .view(torch.int8), PAGE_BYTES) for _ in range(LAYERS)]
    refs = [[CanonicalKVCacheRef(i, PAGE_BYTES) for i in range(LAYERS)]]
    return CanonicalKVCaches(tensors, refs)


def worker(tmp_path, kv, *, bpc: int = 1) -> vwork.TieredBlockWorker:
    config = SwapConfig(tiers=(TierSpec("ddr", capacity_pages=2),
                               TierSpec("disk", path=str(tmp_path))), policy="swap")
    return vwork.TieredBlockWorker(kv, config, [2, 4], tokens_per_block=T, blocks_per_chunk=bpc,
                                dtype=torch.float32, fingerprint="test")


def blocks(kv, ids) -> list[torch.Tensor]:
    return [t.tensor[ids].clone() for t in kv.tensors]


def test_worker_stores_and_loads_blocks_bitwise(tmp_path):
    kv = kv_caches()
    w = worker(tmp_path, kv)
    want = blocks(kv, [1, 2, 3])
    # blocks 1, 2 -> DDR slots 1, 0; block 3 -> disk slot 2
    assert w.submit_store(1, GPULoadStoreSpec([1, 2, 3], [3], [0]),
                          CPULoadStoreSpec([1, 0, 4]))
    done = w.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in done] == \
        [(1, True, 3 * LAYERS * PAGE_BYTES)]
    assert not w.failed_jobs
    assert sorted((k, d) for k, d, *_ in w.transfers) == [("ddr", "store"), ("disk", "store")]
    assert len(disk_files(tmp_path)) == 1 and disk_pages(tmp_path) == LAYERS  # one segment
    for layer in range(LAYERS):  # the slots the manager chose hold the blocks
        ddr = w.tiers[1].pool(layer).reshape(2, -1)
        assert torch.equal(ddr[1].view(torch.int8), want[layer][0])
        assert torch.equal(ddr[0].view(torch.int8), want[layer][1])
    for t in kv.tensors:
        t.tensor[4:7] = 0
    assert w.submit_load(2, CPULoadStoreSpec([1, 0, 4]),
                         GPULoadStoreSpec([6, 4, 5], [3], [0]))
    assert [r.job_id for r in w.get_finished()] == [2]
    got = blocks(kv, [6, 4, 5])
    for layer in range(LAYERS):
        assert torch.equal(got[layer], want[layer]), layer
    w.shutdown()
    assert not disk_files(tmp_path)


@pytest.mark.parametrize("fault", ["corrupted", "deleted"])
def test_worker_reports_a_failed_disk_load(tmp_path, fault):
    kv = kv_caches()
    w = worker(tmp_path, kv)
    w.submit_store(1, GPULoadStoreSpec([3], [1], [2]), CPULoadStoreSpec([2]))
    w.get_finished()
    n = corrupt_files(tmp_path) if fault == "corrupted" else delete_files(tmp_path)
    assert n == LAYERS  # a page per layer
    assert w.submit_load(2, CPULoadStoreSpec([2]), GPULoadStoreSpec([5], [1], [2]))
    result, = w.get_finished()
    assert result.job_id == 2 and result.transfer_size is None
    assert w.failed_jobs == {2} and w.failed_loads == {2}


def test_worker_reports_a_failed_store_and_leaves_no_file(tmp_path, monkeypatch):
    kv = kv_caches()
    w = worker(tmp_path, kv)
    disk, real = w.tiers[2], w.tiers[2].write

    def write(layer, *args, **kwargs):  # the last layer's page does not fit on the disk
        if layer == LAYERS - 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(disk, "write", write)
    assert w.submit_store(1, GPULoadStoreSpec([1, 2], [2], [0]),
                          CPULoadStoreSpec([0, 2]))
    result, = w.get_finished()
    assert result.job_id == 1 and result.transfer_size is None
    assert w.failed_jobs == {1}
    # no slot of the chunk reads as a page, the first layer's included
    assert bool((disk.segment().starts < 0).all())


def test_worker_loads_from_inside_a_chunk(tmp_path):
    """Chunks of two blocks; a load starting at a request's block 1 reads the chunk's second
    slot (vLLM's block_indices)."""
    kv = kv_caches()
    w = worker(tmp_path, kv, bpc=2)
    want = blocks(kv, [2, 3])
    w.submit_store(1, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([0]))
    w.submit_store(2, GPULoadStoreSpec([3, 4], [2], [2]), CPULoadStoreSpec([1]))
    assert [r.job_id for r in w.get_finished()] == [1, 2]
    assert w.submit_load(3, CPULoadStoreSpec([0, 1]),
                         GPULoadStoreSpec([6, 7], [2], [1]))
    assert [r.job_id for r in w.get_finished()] == [3] and not w.failed_jobs
    got = blocks(kv, [6, 7])
    for layer in range(LAYERS):
        assert torch.equal(got[layer], want[layer]), layer
