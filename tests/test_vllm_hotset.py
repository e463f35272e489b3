"""tierattn's hot set inside vLLM (models/vllm/hotset.py, hotattn.py, hotconnector.py), on
vLLM's CPU platform.

Engine tests: tiny random llama (head_dim 32) and qwen3 (head_dim 64) models in fp32, 32-token
blocks, four prompts of 850..919 random tokens and 32 greedy tokens each: every prompt is
several times a tight device pool of :data:`TIGHT` blocks. Each engine runs once per module, in
this process (its scheduler is wrapped to record the largest running batch), and is compared
with vLLM alone: with ample blocks (the tokens) and on the same tight pool (the running batch
and preemptions).

Unit tests: the hot set's cold-page rule and admission, the top-k choice of pages, and
``vllm_engine_args``'s refusals.

CI runs this file in the venv with vLLM (``.venv-vllm``); without vLLM it is skipped.
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from tierattn.config import TierConfig, TierSpec  # noqa: E402
from tierattn.errors import TierConfigError  # noqa: E402
from tierattn.models.vllm import config as vcfg  # noqa: E402

pytestmark = pytest.mark.skipif(
    not any(vllm.__version__ == v or vllm.__version__.startswith(v + ".") for v in vcfg.SUPPORTED),
    reason=f"vLLM {vllm.__version__} is not a release the hot set supports {vcfg.SUPPORTED}")

BLOCK = 32
#: head dims 32 and 64, 2 layers, 4 query and 2 KV heads
FAMILIES = {"llama": 32, "qwen3": 64}
GEOMETRY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                tie_word_embeddings=False)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(GEOMETRY["vocab_size"]) for _ in range(850 + 23 * i)]
           for i in range(4)]
NEW_TOKENS = 32
#: the tight device pool: one prompt (27..29 blocks) fits, two do not
TIGHT, AMPLE = 40, 200
HOT = TierConfig.preset("offload", page_size=BLOCK, hot_budget=0.25, prefill_chunk_size=128)


def block_bytes(family: str) -> int:
    return 2 * 2 * 2 * BLOCK * FAMILIES[family] * 4  # layers x (K, V) x heads x tokens x D x fp32


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("hotset-models")
    out = {}
    for family, cfg, cls in (("llama", LlamaConfig, LlamaForCausalLM),
                             ("qwen3", Qwen3Config, Qwen3ForCausalLM)):
        torch.manual_seed(0)
        model = cls(cfg(**GEOMETRY, head_dim=FAMILIES[family])).to(torch.float32)
        model.save_pretrained(root / family)
        out[family] = str(root / family)
    return out


@dataclass
class Run:
    tokens: list[list[int]]
    most_running: int
    preemptions: int
    manager: dict


def run_llm(model: str, family: str, blocks: int, engine_args: dict | None = None, *,
            in_process: bool = True) -> Run | list[list[int]]:
    """Generate :data:`PROMPTS` greedily on a KV cache of ``blocks`` blocks; with
    ``in_process=False`` (vLLM's engine-core process) only the tokens."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=model, dtype="float32", max_model_len=1100, enforce_eager=True,
                  skip_tokenizer_init=True, disable_log_stats=False, seed=0, block_size=BLOCK,
                  kv_cache_memory_bytes=blocks * block_bytes(family))
    kwargs.update(engine_args or {})
    llm = LLM(**kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        if not in_process:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                                use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        most = [0]
        schedule = sched.schedule

        def counted(*a, **k):
            out = schedule(*a, **k)
            most[0] = max(most[0], len(sched.running))
            return out

        sched.schedule = counted
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                            use_tqdm=False)
        metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        (mgr,) = sched.kv_cache_manager.coordinator.single_type_managers
        return Run(tokens=[list(o.outputs[0].token_ids) for o in outs], most_running=most[0],
                   preemptions=int(metrics.get("vllm:num_preemptions", 0)),
                   manager={"type": type(mgr).__name__,
                            **{k: getattr(mgr, k) for k in ("stored_pages", "freed_blocks",
                                                            "no_room") if hasattr(mgr, k)}})
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


ENGINES = {
    # name: (family, blocks, engine args)
    "llama-vllm-ample": ("llama", AMPLE, None),
    "llama-vllm-tight": ("llama", TIGHT, None),
    "llama-exact": ("llama", TIGHT, vcfg.vllm_engine_args(HOT)),
    "qwen3-vllm-ample": ("qwen3", AMPLE, None),
    "qwen3-vllm-tight": ("qwen3", TIGHT, None),
    "qwen3-exact": ("qwen3", TIGHT, vcfg.vllm_engine_args(HOT)),
}


def _with_extra(args: dict, **extra) -> dict:
    args = json.loads(json.dumps(args))
    args["kv_transfer_config"]["kv_connector_extra_config"].update(extra)
    return args


ENGINES.update({
    # decode rows too staged (hot and cold pages copied into a buffer of vLLM blocks) and
    # attended by vLLM's own kernel: the path without a compiled host kernel, and the shape of
    # a device engine's recall
    "llama-exact-staged": ("llama", TIGHT, _with_extra(vcfg.vllm_engine_args(HOT),
                                                       stage_cold=True)),
    # top-k over every cold page is exact: the Quest ranking and the compaction, checked
    "llama-topk-all": ("llama", TIGHT, vcfg.vllm_engine_args(HOT.replace(
        attend="topk", recall_score="quest", recall_budget=1.0))),
    "qwen3-topk": ("qwen3", TIGHT, vcfg.vllm_engine_args(HOT.replace(
        attend="topk", recall_score="quest", recall_budget=0.2))),
    # the top-k pages staged for vLLM's kernel: the same pages as the host kernel reads
    "qwen3-topk-staged": ("qwen3", TIGHT, _with_extra(vcfg.vllm_engine_args(HOT.replace(
        attend="topk", recall_score="quest", recall_budget=0.2)), stage_cold=True)),
    # a host tier of 6 pages: most cold pages stay on the device, vLLM preempts (recompute)
    "llama-small-host": ("llama", TIGHT, vcfg.vllm_engine_args(
        HOT, tiers=(TierSpec("ddr", capacity_pages=6),))),
})


@pytest.fixture(scope="module")
def runs(models):
    done: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in done:
            family, blocks, args = ENGINES[name]
            done[name] = run_llm(models[family], family, blocks, args)
        return done[name]
    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_exact_hot_set_is_token_identical_to_vllm_on_a_pool_a_quarter_of_the_prompts(
        runs, family):
    ref, tight, hot = runs(f"{family}-vllm-ample"), runs(f"{family}-vllm-tight"), \
        runs(f"{family}-exact")
    assert hot.tokens == ref.tokens
    assert tight.tokens == ref.tokens
    # every prompt is 27..29 blocks; the hot set runs all four at once in 40 blocks
    assert tight.most_running == 1
    assert hot.most_running >= 3 * tight.most_running
    assert hot.preemptions <= tight.preemptions
    assert hot.manager["type"] == "HotSetManager" and hot.manager["freed_blocks"] > 0
    assert hot.manager["freed_blocks"] <= hot.manager["stored_pages"]  # freed only once copied
    assert ref.manager["type"] == "FullAttentionManager"


def test_cold_pages_recalled_into_a_device_buffer_are_token_identical(runs):
    assert runs("llama-exact-staged").tokens == runs("llama-vllm-ample").tokens


def test_topk_over_every_cold_page_is_exact(runs):
    assert runs("llama-topk-all").tokens == runs("llama-vllm-ample").tokens


def test_topk_recalls_a_fifth_and_runs_the_batch(runs):
    run = runs("qwen3-topk")
    assert run.most_running >= 3
    assert all(len(t) == NEW_TOKENS for t in run.tokens)


def test_topk_pages_staged_for_vllms_kernel_give_the_host_kernels_tokens(runs):
    assert runs("qwen3-topk-staged").tokens == runs("qwen3-topk").tokens


def test_a_full_host_tier_falls_back_to_vllm_recompute(runs):
    run, ref = runs("llama-small-host"), runs("llama-vllm-ample")
    assert run.manager["no_room"] > 0
    assert run.manager["stored_pages"] <= 6 + run.preemptions * 6
    assert run.preemptions > 0
    assert run.tokens == ref.tokens


#: an engine in vLLM's worker processes (``vllm serve``'s layout), or vLLM without plugins
SUBPROCESS_RUN = """
import json
from test_vllm_hotset import ENGINES, run_llm
if __name__ == "__main__":
    family, blocks, args = ENGINES[{name!r}]
    tokens = run_llm({model!r}, family, blocks, args, in_process=False)
    print("RESULT" + json.dumps(tokens))
"""


def _subprocess_tokens(models, name: str, env: dict, tmp_path: Path) -> list:
    family = ENGINES[name][0]
    script = tmp_path / "run.py"
    script.write_text(SUBPROCESS_RUN.format(name=name, model=models[family]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path,
                         env={**os.environ, **env, "PYTHONPATH": str(Path(__file__).parent)})
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


def test_the_hot_set_runs_in_vllm_worker_processes(runs, models, tmp_path):
    tokens = _subprocess_tokens(models, "llama-exact", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
                                tmp_path)
    assert tokens == runs("llama-vllm-ample").tokens


def test_installed_but_not_configured_vllm_is_unchanged(runs, models, tmp_path):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    # this process loaded tierattn's plugin: CPU_ATTN is tierattn's class, acting as vLLM's
    assert AttentionBackendEnum.CPU_ATTN.get_path().startswith("tierattn.")
    plain = _subprocess_tokens(models, "llama-vllm-ample", {"VLLM_PLUGINS": ""}, tmp_path)
    assert runs("llama-vllm-ample").tokens == plain


def test_on_cuda_the_plugin_registers_the_device_backend_as_custom(monkeypatch):
    """The CUDA path's registration (no CUDA vLLM here: the platform is made to say CUDA); the
    backend it names is vLLM's Triton attention with the hot set's spec and no CUDA graph
    around attention."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    from tierattn.models.vllm import hotattn, plugin

    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    try:
        plugin.register()
        assert AttentionBackendEnum.CUSTOM.get_class() is hotattn.TierAttentionDeviceBackend
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()
    backend = hotattn.TierAttentionDeviceBackend
    assert issubclass(backend, TritonAttentionBackend) and backend.get_name() == "CUSTOM"
    assert backend.get_builder_cls()._cudagraph_support.name == "NEVER"
    assert vcfg.vllm_engine_args(HOT)["attention_backend"] == "CUSTOM"


def test_prefix_caching_is_refused_by_name(models):
    args = vcfg.vllm_engine_args(HOT)
    args["enable_prefix_caching"] = True
    with pytest.raises(Exception, match="enable_prefix_caching"):
        run_llm(models["llama"], "llama", TIGHT, args)


# --- units ------------------------------------------------------------------------------------


def test_cold_pages_are_those_past_the_hot_budget():
    from tierattn.models.vllm.hotset import cold_end

    tier = TierConfig.preset("offload", page_size=32, hot_budget=0.25, sink_pages=1,
                             recent_pages=2)
    assert cold_end(tier, 31) == 1          # nothing full: only the sink range
    assert cold_end(tier, 4 * 32) == 2      # 4 full pages, budget 1: sink, 1 cold, 2 recent
    assert cold_end(tier, 1024) == 32 - 7   # 32 full pages, budget 8: sink + 7 recent
    assert cold_end(tier.replace(hot_budget=64), 1024) == 32 - 2  # a token budget: 2 pages
    assert cold_end(tier, 1024, tight=True) == 32 - 2  # a pool running low: the floor


def _manager(host_slots: int):
    from vllm.v1.core.block_pool import BlockPool

    from tierattn.models.vllm.hotset import HotSetManager, HotSetSpec

    spec = HotSetSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32,
                      tier=HOT, chunk_tokens=128)
    pool = BlockPool(num_gpu_blocks=64, enable_caching=False, hash_block_size=BLOCK)
    m = HotSetManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                      scheduler_block_size=BLOCK)
    m.set_host_slots(host_slots)
    return m, pool


def test_the_manager_frees_a_cold_block_only_once_it_has_a_copy():
    m, pool = _manager(host_slots=4)
    free = pool.get_num_free_blocks()
    m.allocate_new_blocks("r", 20 * BLOCK, 20 * BLOCK)  # a 640-token prompt, one step
    assert pool.get_num_free_blocks() == free - 20
    m.remove_skipped_blocks("r", 20 * BLOCK)  # no copies yet: nothing is freed
    assert pool.get_num_free_blocks() == free - 20
    # 20 full pages at 25%: sink 0, cold 1..15, recent 16..19; the host tier has 4 slots
    copies = m.reserve_copies("r", 20 * BLOCK)
    assert [slot for _, slot in copies] == [0, 1, 2, 3] and m.no_room == 1
    assert m.take_pending() == copies
    m.remove_skipped_blocks("r", 20 * BLOCK)
    assert pool.get_num_free_blocks() == free - 16  # the 4 copied pages, no other
    assert [p for p, _ in m.cold_pages("r")] == [1, 2, 3, 4]
    m.free("r")  # finished or preempted: every block and host slot back
    assert pool.get_num_free_blocks() == free and m.free_host_slots() == 4


def test_a_pool_running_low_shrinks_exact_hot_sets_to_their_floor():
    """Exact mode: with fewer free blocks than one per request plus a chunk's, the pages past
    the floor (sinks, recent_pages) turn cold; a copy's block is freed only once vLLM has
    processed the step that made it."""
    from tierattn.models.vllm.hotset import cold_end

    m, pool = _manager(host_slots=1000)
    m.allocate_new_blocks("a", 20 * BLOCK, 20 * BLOCK)
    assert not m.tight()  # 44 free
    roomy = m.reserve_copies("a", 20 * BLOCK)
    assert len(roomy) == cold_end(HOT, 20 * BLOCK) - HOT.sink_pages
    m.allocate_new_blocks("b", 41 * BLOCK, 41 * BLOCK)  # 2 free < 2 requests + 5 chunk pages
    free = pool.get_num_free_blocks()
    assert m.tight() and free == 2
    tight = m.reserve_copies("b", 41 * BLOCK)
    assert len(tight) == 41 - HOT.recent_pages - HOT.sink_pages
    m.remove_skipped_blocks("b", 40 * BLOCK)  # the copying step is not processed yet
    assert pool.get_num_free_blocks() == free
    m.remove_skipped_blocks("b", 41 * BLOCK)
    assert pool.get_num_free_blocks() == free + len(tight)
    topk = HOT.replace(attend="topk", recall_score="quest")
    m.tier = topk  # top-k keeps its budget: its hot pages are part of what it attends
    assert not m.tight()


def test_admission_counts_the_hot_set_at_its_peak():
    m, _ = _manager(host_slots=1000)
    # a 2,048-token prompt: 64 blocks; with the hot set, 16 recent + chunk of 4 + 1 in progress
    assert m.peak_blocks(2048) == 16 + 4 + 1
    assert m.peak_blocks(64) == 2  # a short prompt: its own length


def _worker(kv_heads: int, ranges: torch.Tensor):
    from tierattn.models.vllm.hotworker import HotSetWorker

    w = HotSetWorker.__new__(HotSetWorker)
    w.kv_heads, w.ranges = kv_heads, [ranges]
    return w


def test_topk_picks_the_page_a_query_points_at():
    from tierattn.models.vllm.hotworker import RowGroup

    torch.manual_seed(0)
    kv_heads, group, d, pages = 2, 2, 16, 12
    keys = torch.randn(pages, kv_heads, 32, d) * 0.1
    q = torch.randn(1, kv_heads * group, d)
    keys[7, 1, 5] = 4 * q[0, 2]  # page 7 holds the key head 1's queries point at
    ranges = torch.stack((keys.amin(2), keys.amax(2)), dim=1)  # [slots, 2, H, D]
    slots = torch.tensor([[3, 7, 1, 0, 11, -1]])  # host slots of the row's cold pages
    none = torch.zeros(0)
    step = RowGroup(decode=True, tokens=torch.tensor([0]),
                    qo_indptr=torch.tensor([0, 1], dtype=torch.int32), seq_lens=none,
                    table=None, stage_hot=none, stage_cold=none, block_table=none, staged=False,
                    hot_entries=none, hot_count=none, last_len=none, cold_slots=slots,
                    recall=torch.tensor([2]), max_recall=2, topk=True)
    chosen, count = _worker(kv_heads, ranges)._recalled(step, 0, q, d ** -0.5)
    assert count.tolist() == [2]
    assert 7 in chosen[0, :2].tolist()
    assert sorted(chosen[0].tolist()) == sorted(slots[0].tolist())  # a permutation


@pytest.mark.parametrize("kwargs, match", [
    (dict(config=TierConfig.preset("split")), "attend"),
    (dict(config=TierConfig.preset("topk")), "recall_score"),
    (dict(config=TierConfig.preset("offload", page_size=16)), "page_size"),
    (dict(config=TierConfig.preset("offload", page_size=32, sink_pages=0)), "sink_pages"),
    (dict(config=TierConfig.preset("evict-h2o", page_size=32)), "evict_budget"),
    (dict(config=HOT, tiers=(TierSpec("disk", path="/tmp/tierattn-hot"),)), "disk"),
    (dict(config=HOT, tiers=("ddr", "cxl")), "one host tier"),
    (dict(config=HOT, swap=vcfg.SwapConfig()), "swap"),
    (dict(config="offload"), "TierConfig"),
])
def test_vllm_engine_args_refuses_what_the_hot_set_does_not_do(kwargs, match):
    with pytest.raises(TierConfigError, match=match):
        vcfg.vllm_engine_args(**kwargs)


def test_vllm_engine_args_are_json():
    args = vcfg.vllm_engine_args(HOT)
    assert json.loads(json.dumps(args)) == args
    assert args["block_size"] == BLOCK and args["enable_prefix_caching"] is False
    extra = args["kv_transfer_config"]["kv_connector_extra_config"]
    assert vcfg.hot_set_config(extra) == HOT.replace(tiers=TierConfig().tiers)
