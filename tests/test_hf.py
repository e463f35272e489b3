"""Hugging Face integration: exact-mode generation equals the reference attention on the families
whose attention differs in a way the route must carry (sliding windows, softcap, sinks, MoE,
GQA), patch/unpatch/idempotence, the explicit-cache routes, the silent-fallback guard, typed
errors for bad arguments, and structural refusals naming the layer. Every other causal-LM type
of transformers is tried in ``test_any_model.py``."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import tierattn  # noqa: E402
from tierattn.errors import KernelInputError, TierConfigError, UnsupportedModelError  # noqa: E402
from tierattn.models import TieredCache  # noqa: E402
from tierattn.models.hf.cache import CACHE_KWARG  # noqa: E402

#: families whose attention kwargs differ (windows, softcap, sinks, scaling, MoE): the deep test
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma2",
            "gemma3_text", "olmo2", "cohere2", "gpt_oss")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
EXTRA = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
         "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
         "gemma3_text": dict(sliding_window=8, query_pre_attn_scalar=16,
                             layer_types=["sliding_attention", "full_attention"]),
         "cohere2": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
         "mistral": dict(sliding_window=8),
         "gemma2": dict(query_pre_attn_scalar=16, attn_logit_softcapping=5.0)}
#: families whose reference implementation is eager (they have no SDPA path)
EAGER = {"gemma2", "gpt_oss"}


def tiny(model_type: str, **overrides):
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **EXTRA.get(model_type, {}),
                                              **overrides})
    torch.manual_seed(0)
    attn = "eager" if model_type in EAGER else "sdpa"
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn).eval()


def exact_config(**kw) -> tierattn.TierConfig:
    # an 8-token hot budget on 4-token pages: a page leaves HBM every 4 generated tokens
    return tierattn.TierConfig(**{**dict(page_size=4, hot_budget=8, max_context=128,
                                         backend="torch"), **kw})


def generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, **kw)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_exact_mode_generation_equals_reference(model_type, batch, figures):
    """Batch 3 is left-padded by 0, 5 and 11 tokens: padding pages and the page where the
    padding ends are masked, and the prompts cross page boundaries at different offsets."""
    model = tiny(model_type)
    ids = torch.randint(3, 128, (batch, 29), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    for b, pad in enumerate([0, 5, 11][:batch]):
        ids[b, :pad], mask[b, :pad] = 0, 0
    ref = generate(model, ids, attention_mask=mask)
    with tierattn.patch(model, exact_config()) as handle:
        assert handle.stats() == {"handle": "patch", "bytes": {}, "total": {}, "layers": []}
        out = generate(model, ids, attention_mask=mask)
        every = handle.stats()
        stats = every["total"]
    # the handles' one schema: bytes per tier below the device, stored and loaded
    assert every["handle"] == "patch" and every["bytes"] == {
        t: {"stored": stats["d2h_bytes"].get(t, 0), "loaded": stats["h2d_bytes"].get(t, 0)}
        for t in set(stats["d2h_bytes"]) | set(stats["h2d_bytes"])}
    diff = max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits))
    same = torch.equal(out.sequences, ref.sequences)
    print(f"{model_type} batch {batch}: greedy identical {same}, max |logit diff| {diff:.2e}, "
          f"demoted pages {stats['demoted_pages']}")
    assert torch.equal(out.sequences, ref.sequences)
    assert diff < 1e-4  # fp32 end to end: kernel rounding only
    text = model.config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or
                ["sliding_attention" if getattr(text, "sliding_window", None) else
                 "full_attention"])
    if "full_attention" in kinds:  # full layers offload: pages leave HBM every few tokens
        assert stats["demoted_pages"] > 0 and stats["h2d_bytes_total"] > 0
    if "sliding_attention" in kinds and text.sliding_window < 29:  # windows bind: pages leave
        assert stats["window_dropped_tokens"] > 0
    assert stats["evicted_tokens"] == 0
    figures.count(f"HF architectures token-identical in exact mode (batch {batch}"
                  f"{', left-padded' if batch > 1 else ''})")


def test_triton_backend_under_interpreter_end_to_end():
    model = tiny("llama")
    ids = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(5))
    ref = generate(model, ids)
    with tierattn.patch(model, exact_config(backend="triton")):
        out = generate(model, ids)
    assert torch.equal(out.sequences, ref.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits)) < 1e-4


def test_patch_is_reversible_idempotent_and_a_context_manager():
    model = tiny("llama")
    before = (model.config._attn_implementation, "generate" in vars(model))
    cfg = exact_config()
    handle = tierattn.patch(model, cfg)
    assert tierattn.patch(model, cfg) is handle  # twice: the same handle
    assert model.config._attn_implementation == "tierattn"
    with pytest.raises(tierattn.TierConfigError, match="already patched"):
        tierattn.patch(model, exact_config(hot_budget=12))
    handle.undo()
    handle.undo()  # a second undo is harmless
    assert (model.config._attn_implementation, "generate" in vars(model)) == before
    handle = tierattn.patch(model, cfg)
    handle.unpatch()  # the former name, an alias
    assert (model.config._attn_implementation, "generate" in vars(model)) == before
    with tierattn.patch(model, cfg):
        assert model.config._attn_implementation == "tierattn"
    assert model.config._attn_implementation == before[0]


@pytest.mark.parametrize("kwarg", ["cache", "past_key_values"])
def test_explicit_tiered_cache(kwarg):
    model = tiny("qwen2")
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(2))
    ref = generate(model, ids)
    cache = TieredCache(model.config, exact_config())
    with tierattn.patch(model, exact_config()) as handle:
        out = generate(model, ids, **{kwarg: cache})
        assert handle.cache is cache
    assert torch.equal(out.sequences, ref.sequences)
    assert cache.stats()["total"]["attend_calls"] > 0


@pytest.mark.parametrize("preset", ["exact", "evict-h2o"])
def test_a_deep_copied_cache_forks_the_sequences(preset):
    """``copy.deepcopy`` of a used cache is a fork: its layers answer to the copy (the
    original may go), and greedy steps from the copy equal those from the original."""
    model = tiny("llama")
    ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(3))
    config = exact_config() if preset == "exact" else exact_config(evict_budget=12)
    with torch.no_grad(), tierattn.patch(model, config):
        cache = TieredCache(model.config, config)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        fork = copy.deepcopy(cache)
        assert all(layer.owner is fork for layer in fork.layers)

        def steps(c, first):
            out, nxt = [], first.argmax(-1)
            for _ in range(6):
                out.append(nxt)
                nxt = model(input_ids=nxt[:, None], past_key_values=c,
                            use_cache=True).logits[:, -1].argmax(-1)
            return torch.stack(out, 1)

        original = steps(cache, logits)
        del cache
        assert torch.equal(steps(fork, logits), original)


@pytest.mark.parametrize("preset", ["topk", "evict-h2o", "evict-streaming", "evict-snapkv"])
def test_approximate_presets_run_and_report(preset):
    model = tiny("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    cfg = tierattn.TierConfig.preset(preset, page_size=4, max_context=128, backend="torch")
    with tierattn.patch(model, cfg) as handle:
        out = generate(model, ids)
        total = handle.stats()["total"]
    assert out.sequences.shape == (1, 40 + 24)
    if preset == "topk":
        assert total["evicted_tokens"] == 0 and total["h2d_bytes_total"] > 0
    else:
        assert total["evicted_tokens"] > 0 and total["h2d_bytes_total"] == 0


def test_guard_catches_a_silent_fallback(monkeypatch):
    """If the registration were broken and the model ran another attention, generate() fails
    instead of returning output the tiered path never produced."""
    from transformers import AttentionInterface

    model = tiny("llama")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    with tierattn.patch(model, exact_config()):
        monkeypatch.setitem(AttentionInterface._global_mapping, "tierattn",
                            AttentionInterface._global_mapping["sdpa"])
        # the first-call guard: layer 0 stored K/V, layer 1 is about to, no attention ran
        with pytest.raises(UnsupportedModelError, match="did not run through tierattn"):
            generate(model, ids)


def test_a_decode_mask_that_is_not_the_prompts_left_padding_is_refused():
    # decode steps check the mask on the device, without a sync; the mismatch raises at the end
    import inspect

    model = tiny("llama")
    cfg = exact_config()
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
    ids = torch.randint(3, 128, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with tierattn.patch(model, cfg):
        cache = TieredCache(model.config, cfg)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
              **{arg: cache})
        good = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        model(input_ids=ids[:, -1:], attention_mask=good, position_ids=pos[:, -1:] + 1,
              use_cache=True, **{arg: cache})
        cache.verify()  # the prompt's left padding followed by ones: fine
        bad = torch.cat([good, torch.ones(2, 1, dtype=mask.dtype)], 1)
        bad[0, 3] = 0
        model(input_ids=ids[:, -1:], attention_mask=bad, position_ids=pos[:, -1:] + 2,
              use_cache=True, **{arg: cache})
        with pytest.raises(tierattn.UnsupportedDecodingError, match="left padding"):
            cache.verify()


def test_plain_forward_without_the_cache_is_refused():
    model = tiny("llama")
    with tierattn.patch(model, exact_config()), \
            pytest.raises(tierattn.TierStateError, match="TieredCache"):
        model(torch.randint(3, 128, (1, 5)), use_cache=False)


def test_unsupported_requests_are_refused_clearly():
    model = tiny("llama")
    padded = torch.randint(3, 128, (2, 9))
    mask = torch.ones_like(padded)
    mask[0, -3:] = 0  # right padding
    with tierattn.patch(model, exact_config()):
        with pytest.raises(tierattn.UnsupportedDecodingError, match="left padding"):
            generate(model, padded, attention_mask=mask)
        with pytest.raises(tierattn.UnsupportedDecodingError, match="beam"):
            generate(model, padded[:1], num_beams=2)



@pytest.mark.parametrize("edit,match", [
    (dict(layer_types=["full_attention", "linear_attention"]),
     r"layer 1 is 'linear_attention': a linear-attention/recurrent layer"),
    (dict(layer_types=["chunked_attention", "full_attention"]), r"layer 0 is 'chunked_attention'"),
    (dict(layer_types=["full_attention", "mamba"]), r"layer 1 is 'mamba'"),
    (dict(layer_types=["full_attention", "something_new"]),
     r"layer 1 is 'something_new': neither full nor sliding"),
    (dict(num_kv_shared_layers=1), r"layers 1..1 reuse the K/V of earlier layers"),
    (dict(add_cross_attention=True), r"cross-attend"),
    (dict(v_head_dim=8), r"K and V have different head dims \(16 and 8\)"),
])
def test_structural_refusals_name_the_layer_and_the_reason(edit, match):
    model = tiny("llama")
    for k, v in edit.items():
        setattr(model.config, k, v)
    with pytest.raises(UnsupportedModelError, match=match):
        tierattn.patch(model, exact_config())
    assert model.config._attn_implementation == "sdpa"  # refused: nothing changed


def test_a_model_outside_any_list_is_served_and_a_bidirectional_one_refused():
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64)).eval()
    ids = torch.randint(3, 64, (1, 13), generator=torch.Generator().manual_seed(1))
    ref = generate(gpt2, ids)
    with tierattn.patch(gpt2, exact_config()):
        assert torch.equal(generate(gpt2, ids).sequences, ref.sequences)
    bert = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "bert", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
        intermediate_size=32, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="layer 0 attends without a causal mask"):
        tierattn.patch(bert, exact_config())


def test_patch_and_cache_arguments_are_checked_at_the_call():
    model = tiny("llama")
    with pytest.raises(TierConfigError, match="config must be a TierConfig"):
        tierattn.patch(model, {"hot_budget": 0.5})
    with pytest.raises(TierConfigError, match="cuda_graphs must be"):
        tierattn.patch(model, exact_config(), cuda_graphs="yes")
    with pytest.raises(TierConfigError, match="config must be a TierConfig"):
        TieredCache(model.config, {"hot_budget": 0.5})
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    three = TieredCache(tiny("llama", num_hidden_layers=3).config, exact_config())
    with tierattn.patch(model, exact_config()):
        with pytest.raises(KernelInputError, match="made for 3 layers; the model has 2"):
            generate(model, ids, past_key_values=three)
        other = TieredCache(tiny("qwen2").config, exact_config())
        with pytest.raises(KernelInputError, match="another model"):
            generate(model, ids, past_key_values=other)
        cache = TieredCache(model.config, exact_config())
        generate(model, ids, past_key_values=cache)
        with pytest.raises(KernelInputError, match="holds 2 sequences; generate got 3"):
            generate(model, torch.cat([ids, ids[:1]]), past_key_values=cache)


def test_a_dropped_cache_frees_its_pools_without_the_cyclic_collector():
    """The layers hold their cache weakly: a cycle kept a dropped cache's pools (GBs at 4K x 20
    prompts) allocated until the collector ran, and a fidelity run's next cell was refused
    memory. A layer that outlives its cache says so."""
    import gc
    import weakref
    model = tiny("llama")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    gc.disable()
    try:
        with tierattn.patch(model, exact_config()):  # its handle keeps the last cache (stats)
            cache = TieredCache(model.config, exact_config())
            generate(model, ids, past_key_values=cache)
        runtime, layer = weakref.ref(cache.runtimes[0]), cache.layers[0]
        del cache
        freed = runtime() is None  # before enabling: the collector may run then
    finally:
        gc.enable()
    assert freed
    with pytest.raises(ReferenceError, match="outlived its TieredCache"):
        layer.get_seq_length()


def test_cache_kwarg_name_is_not_a_special_path_name():
    # names containing flash, sdpa or flex_attention trigger special paths in transformers
    assert not any(word in CACHE_KWARG or word in "tierattn"
                   for word in ("flash", "sdpa", "flex_attention"))


def test_sampling_matches_reference_with_the_same_seed():
    model = tiny("qwen3")
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=True, top_k=20, temperature=0.9,
              pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(11)
        ref = model.generate(ids, **kw)
        with tierattn.patch(model, exact_config()):
            torch.manual_seed(11)
            out = model.generate(ids, **kw)
    assert torch.equal(out, ref)


def test_chunked_prefill_through_generate():
    """generate(prefill_chunk_size=N) feeds the prompt in chunks: each chunk attends the
    earlier chunks' pages, some of them already demoted."""
    model = tiny("llama")
    ids = torch.randint(3, 128, (1, 45), generator=torch.Generator().manual_seed(7))
    ref = generate(model, ids)
    with tierattn.patch(model, exact_config()) as handle:
        out = generate(model, ids, prefill_chunk_size=8)
        assert handle.stats()["total"]["demoted_pages"] > 0
    assert torch.equal(out.sequences, ref.sequences)
    # a prompt longer than the pools' chunk headroom without chunking is a clear error
    with tierattn.patch(model, exact_config(prefill_chunk_size=16)), \
            pytest.raises(Exception, match="prefill_chunk_size"):
        generate(model, ids)


def test_assisted_decoding_is_refused():
    model, assistant = tiny("llama"), tiny("llama")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    with tierattn.patch(model, exact_config()), pytest.raises(tierattn.UnsupportedDecodingError):
        generate(model, ids, assistant_model=assistant)
