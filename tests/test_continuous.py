"""tierattn.swap inside transformers' continuous batching: tiny random models of four families
(llama; qwen3; mistral, every layer sliding; gemma3_text, sliding and full layers, so two block
sizes), ten concurrent requests of mixed lengths in a KV cache of 16 blocks of 4 tokens. Every
run is compared token for token with the same engine given ample blocks (greedy)."""

from __future__ import annotations

import errno
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
import transformers
from helpers import corrupt_writes, fail_disk_reads, fail_disk_writes
from mooncake_helpers import Master, mooncake_importable

from tierattn.config import TierSpec
from tierattn.errors import TierConfigError, UnsupportedEngineError, UnsupportedModelError
from tierattn.models.hf.continuous import SUPPORTED, check_transformers, swap, swap_every_model
from tierattn.serving.swapcore import SwapConfig

_VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2])
engine = pytest.mark.skipif(_VERSION not in SUPPORTED,
                            reason=f"transformers {transformers.__version__} is not a release "
                                   "tierattn.swap supports")

ENOSPC = OSError(errno.ENOSPC, "No space left on device")
FAMILIES = {
    "llama": {},
    "qwen3": {},
    "mistral": {"sliding_window": 16},
    "gemma3_text": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
}
LENGTHS = (5, 9, 13, 20, 7, 17, 30, 11, 3, 25)
NEW_TOKENS = 20
TIGHT, AMPLE = 16, 512  # blocks of 4 tokens: the longest request (50 tokens) fits alone


def tiny_model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64,
                               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                               **FAMILIES[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model


PROMPTS = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(i)).tolist()
           for i, n in enumerate(LENGTHS)]


def generate(model, blocks: int) -> dict[str, list[int]]:
    """Greedy continuous batching of PROMPTS in ``blocks`` blocks; asserts no request failed."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    out = model.generate_batch(
        PROMPTS, generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                                                    eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=blocks,
                                                            max_batch_tokens=64),
        progress_bar=False)
    failed = {k: o.error for k, o in out.items() if o.error is not None}
    assert not failed, f"failed requests: {failed}"
    assert len(out) == len(PROMPTS)
    return {k: list(o.generated_tokens) for k, o in out.items()}


@pytest.fixture(scope="module")
def models():
    return {}


@pytest.fixture(scope="module")
def references():
    return {}


def subject(models, references, family: str = "llama"):
    """The family's model and its tokens with ample blocks (built once per module)."""
    if family not in models:
        models[family] = tiny_model(family)
        references[family] = generate(models[family], AMPLE)
    return models[family], references[family]


def disk(tmp_path, **kw) -> TierSpec:
    return TierSpec("disk", path=str(tmp_path / "kv"), **kw)


@engine
@pytest.mark.parametrize("policy", ["swap", "recompute", "auto"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tokens_identical_under_every_policy(models, references, family, policy):
    model, want = subject(models, references, family)
    with swap(model, SwapConfig(policy=policy)) as handle:
        got = generate(model, TIGHT)
        st = handle.stats()
    assert got == want
    assert st["handle"] == "swap" and set(st["bytes"]) == {"ddr"}  # the handles' one schema
    preempted = st["swapped_out"] + st["recomputed_requests"]
    assert preempted > 0, "the KV cache was not tight: nothing was preempted"
    assert len(st["decisions"]) == preempted
    if policy == "swap":
        assert st["swapped_out"] > 0 and st["swapped_in"] == st["swapped_out"]
        assert st["bytes"]["ddr"]["stored"] == st["bytes"]["ddr"]["loaded"] > 0
        # default tiers (sized from the host): every victim swapped, and the DDR tier holds
        # memory only for what was stored
        assert st["tiers_full"] == 0 and st["recomputed_requests"] == 0
        assert 0 < st["peak_reserved_bytes"]["ddr"] <= 2 * st["bytes"]["ddr"]["stored"]
    if policy == "recompute":
        assert st["swapped_out"] == 0 and st["bytes"]["ddr"]["stored"] == 0
        assert st["recomputed_tokens"] > 0
    assert st["held_bytes"]["ddr"] == 0  # every swapped request came back
    assert st["faults"] == {"store": 0, "load": 0}


@engine
def test_auto_prices_every_decision(models, references):
    model, want = subject(models, references)
    with swap(model, SwapConfig(policy="auto")) as handle:
        assert generate(model, TIGHT) == want
        st = handle.stats()
    assert st["cost_model"]["calibrated_from"] == "probes at start"
    assert st["cost_model"]["links"]["ddr"]["store"]["observations"] > 0
    for d in st["decisions"]:  # prefill batches ran before the first preemption
        assert d["predicted_swap_s"] is not None and d["predicted_recompute_s"] is not None
        cheaper = "swap" if d["predicted_swap_s"] < d["predicted_recompute_s"] else "recompute"
        assert d["action"] == cheaper
        if d["action"] == "swap":
            assert d["measured_s"] > 0
    measured = st["cost_check"]["swap"]["decisions"] + st["cost_check"]["recompute"]["decisions"]
    assert measured > 0


@engine
def test_a_full_ddr_tier_spills_to_disk(models, references, tmp_path):
    model, want = subject(models, references)
    with swap(model, SwapConfig(tiers=(TierSpec("ddr", capacity_pages=4), disk(tmp_path)),
                                policy="swap")) as handle:
        assert generate(model, TIGHT) == want
        st = handle.stats()
    assert st["bytes"]["disk"]["stored"] > 0 and st["bytes"]["ddr"]["stored"] > 0
    assert st["bytes"]["disk"]["stored"] == st["bytes"]["disk"]["loaded"]
    assert not any((tmp_path / "kv").iterdir())


needs_mooncake = pytest.mark.skipif(not mooncake_importable(), reason="needs the [remote] "
                                    "extra and libibverbs1; .ci/run installs both")


@pytest.fixture
def store(tmp_path):
    """A Mooncake Store on 127.0.0.1: a master and a 64 MiB pool."""
    master = Master(tmp_path / "master.log", pool_mib=64)
    yield master
    master.stop()


@engine
@needs_mooncake
def test_a_full_ddr_tier_spills_to_the_remote_store(models, references, store):
    model, want = subject(models, references)
    config = SwapConfig(tiers=(TierSpec("ddr", capacity_pages=4),), policy="swap",
                        remote=store.config(segment_gib=0.0))
    with swap(model, config) as handle:
        assert generate(model, TIGHT) == want
        st = handle.stats()
    assert st["bytes"]["remote"]["stored"] == st["bytes"]["remote"]["loaded"] > 0
    assert st["bytes"]["ddr"]["stored"] > 0 and st["held_bytes"]["remote"] == 0
    assert st["remote"]["put"] > 0 and st["remote"]["get"] > 0 and st["remote"]["up"]
    assert st["faults"] == {"store": 0, "load": 0}
    assert store.key_count() == 0  # nothing of the engine is left in the store


@engine
@needs_mooncake
def test_a_master_killed_during_a_load_recomputes_and_no_request_fails(models, references,
                                                                       store, monkeypatch):
    from tierattn.storage.tiers import RemoteTier

    model, want = subject(models, references)
    read = RemoteTier.read_into

    def killed_then_read(self, *a, **kw):  # the master dies as the first load starts
        store.stop()
        return read(self, *a, **kw)
    monkeypatch.setattr(RemoteTier, "read_into", killed_then_read)
    config = SwapConfig(tiers=(TierSpec("ddr", capacity_pages=2),), policy="swap",
                        remote=store.config(segment_gib=0.0, deadline_s=1.0, retry_s=60.0))
    t0 = time.monotonic()
    with swap(model, config) as handle:
        assert generate(model, TIGHT) == want
        st = handle.stats()
    assert st["faults"]["load"] >= 1 and st["recomputed_requests"] >= st["faults"]["load"]
    assert st["remote"]["down"] == 1 and not st["remote"]["up"]  # one deadline, then skipped
    assert time.monotonic() - t0 < 60  # no request waited on the dead store past a deadline
    assert any(d["reason"] == "tiers full" or d["reason"].startswith("store fault")
               for d in st["decisions"])  # later victims were not stored into it


@engine
def test_every_tier_full_recomputes_and_no_request_fails(models, references, tmp_path):
    model, want = subject(models, references)
    tight = (TierSpec("ddr", capacity_pages=2), disk(tmp_path, capacity_pages=2))
    with swap(model, SwapConfig(tiers=tight, policy="swap")) as handle:
        assert generate(model, TIGHT) == want
        st = handle.stats()
    assert st["tiers_full"] > 0 and st["recomputed_requests"] >= st["tiers_full"]
    assert any(d["reason"] == "tiers full" for d in st["decisions"])


@engine
def test_a_disk_fault_on_swap_out_recomputes_that_request(models, references, tmp_path,
                                                          monkeypatch, figures):
    model, want = subject(models, references)
    with swap(model, SwapConfig(tiers=(disk(tmp_path),), policy="swap")) as handle:
        calls = fail_disk_writes(monkeypatch, ENOSPC, after=6)  # a few stores succeed first
        assert generate(model, TIGHT) == want
        st = handle.stats()
    assert calls["failed"] > 0 and st["faults"]["store"] > 0 and st["swapped_out"] > 0
    assert all(d["action"] == "recompute" for d in st["decisions"]
               if d["reason"].startswith("store fault"))
    assert not any((tmp_path / "kv").iterdir())
    figures.count("swap faults injected (store)", st["faults"]["store"])
    figures.count("swap faults recomputed, tokens identical", st["faults"]["store"])


@engine
@pytest.mark.parametrize("fault", ["EIO", "corrupted"])
def test_a_disk_fault_on_swap_in_recomputes_that_request(models, references, tmp_path,
                                                         monkeypatch, figures, fault):
    model, want = subject(models, references)
    if fault == "EIO":  # every third batch of page reads fails
        fail_disk_reads(monkeypatch, OSError(errno.EIO, "Input/output error"), every=3)
    else:  # every third batch of pages written is corrupted on disk after its checksum
        corrupt_writes(monkeypatch, every=3)
    with swap(model, SwapConfig(tiers=(disk(tmp_path),), policy="swap")) as handle:
        assert generate(model, TIGHT) == want
        st = handle.stats()
    assert st["faults"]["load"] > 0 and st["swapped_in"] > 0
    assert st["recomputed_requests"] >= st["faults"]["load"]
    assert not any((tmp_path / "kv").iterdir())
    figures.count("swap faults injected (load)", st["faults"]["load"])
    figures.count("swap faults recomputed, tokens identical", st["faults"]["load"])


@engine
def test_a_manager_from_init_continuous_batching_is_tiered(models, references):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, want = subject(models, references)
    with swap(model, SwapConfig(policy="swap")) as handle:
        manager = model.init_continuous_batching(
            generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                                               eos_token_id=-1),
            continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=TIGHT,
                                                                max_batch_tokens=64))
        manager.start()
        try:
            ids = manager.add_requests(PROMPTS, max_new_tokens=NEW_TOKENS)
            got = {}
            while len(got) < len(ids):
                out = manager.get_result(timeout=30)
                assert out is not None, "the manager stopped answering"
                if out.is_finished():
                    assert out.error is None
                    got[out.request_id] = list(out.generated_tokens)
        finally:
            manager.stop(block=True)
        st = handle.stats()
    assert [got[i] for i in ids] == [want[i] for i in sorted(want, key=lambda k: int(k[4:]))]
    assert st["swapped_out"] > 0


@engine
def test_undo_gives_the_model_back(models, references):
    model, want = subject(models, references)
    with swap(model, SwapConfig(policy="swap")) as handle:
        assert swap(model, SwapConfig(policy="swap")) is handle  # idempotent
        with pytest.raises(ValueError, match="another config"):
            swap(model, SwapConfig(policy="recompute"))
    assert "init_continuous_batching" not in vars(model)
    assert not hasattr(model, "_tierattn_swap")
    before = handle.stats()["swapped_out"]
    assert generate(model, TIGHT) == want  # transformers' own manager: it recomputes
    assert handle.stats()["swapped_out"] == before


@engine
def test_swap_every_model_covers_models_it_was_not_given(models, references):
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    model, want = subject(models, references)
    original = ContinuousMixin.init_continuous_batching
    with swap_every_model(SwapConfig(policy="swap")) as handles:  # as `tierattn serve` does
        assert generate(model, TIGHT) == want
    assert len(handles) == 1 and handles[0].stats()["swapped_out"] > 0
    assert ContinuousMixin.init_continuous_batching is original
    assert not hasattr(model, "_tierattn_swap")


@engine
def test_swap_every_model_keeps_no_model_alive():
    """A server that unloads a model frees it while the block is still open."""
    import gc
    import weakref

    with swap_every_model(SwapConfig(policy="swap")) as handles:
        model = tiny_model("llama")
        alive = weakref.ref(model)
        generate(model, TIGHT)
        assert len(handles) == 1 and handles[0].model is model
        del model
        gc.collect()
        assert alive() is None and handles[0].model is None
        # the engine is gone too: its KV cache is not held by the swap store
        assert handles[0].swapper.store is None
    assert handles[0].stats()["swapped_out"] > 0


def test_misuse_is_refused_clearly(models):
    with pytest.raises(TierConfigError, match="SwapConfig"):
        swap(torch.nn.Linear(2, 2), config={"policy": "swap"})
    if _VERSION in SUPPORTED:
        with pytest.raises(UnsupportedModelError, match="continuous batching"):
            swap(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("version", ["5.0.0", "5.20.2", "5.26.0", "6.0.0", "dev"])
def test_an_unchecked_transformers_release_is_refused(version, monkeypatch):
    with pytest.raises(UnsupportedEngineError, match=r"5\.21\.x"):
        check_transformers(version)
    monkeypatch.setattr(transformers, "__version__", version)
    with pytest.raises(UnsupportedEngineError, match=version):
        swap(torch.nn.Linear(2, 2))


def _tiny_checkpoint(folder) -> None:
    """A tiny random Llama and a word-level tokenizer saved as a local checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(124)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<pad>").save_pretrained(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=3)).save_pretrained(folder)


@engine
def test_tierattn_serve_swaps_inside_transformers_serve(tmp_path):
    from transformers.utils import is_serve_available

    if not is_serve_available():
        pytest.skip("transformers[serving] is not installed")
    ckpt = tmp_path / "ckpt"
    _tiny_checkpoint(ckpt)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "tierattn.eval.cli", "serve", "--swap-policy", "swap", "--",
             str(ckpt), "--continuous-batching", "--cb-num-blocks", "10", "--cb-block-size", "4",
             "--cb-max-batch-tokens", "64", "--port", str(port), "--device", "cpu", "--dtype",
             "float32", "--attn-implementation", "sdpa"], stdout=out, stderr=subprocess.STDOUT,
            cwd=tmp_path)  # not the repository root: its kernels/ folder shadows a package
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://localhost:{port}/health", timeout=1)
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, log.read_text()[-2000:]
                time.sleep(0.5)
        answers: dict[int, dict] = {}

        def ask(i: int) -> None:
            body = json.dumps({"model": str(ckpt), "max_tokens": 16, "temperature": 0,
                               "prompt": " ".join(f"w{j}" for j in range(3 * i, 3 * i + 20))})
            req = urllib.request.Request(f"http://localhost:{port}/v1/completions",
                                         body.encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                answers[i] = json.loads(r.read())

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.terminate()
        server.wait(timeout=60)
    text = log.read_text()
    assert len(answers) == 6 and all("choices" in a for a in answers.values()), text[-2000:]
    assert "tierattn.swap:" in text and ": swap (policy;" in text, text[-2000:]

