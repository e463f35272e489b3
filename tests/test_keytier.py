"""The key-tier probe (tierattn.eval.evals.keytier) on a real transformers model (tiny Llama
config): the oracle selection is the floor every selector is measured against, the sketch nears it
as its width grows, the key tiers are costed as the eval costs them, bad specs are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tierattn.eval.evals.keytier import SELECTORS, KeyTierSpec, probe_key_tiers, selector_tier
from tierattn.eval.evals.methods import method_config, key_tier_fraction


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    # peaked attention, so that rankings differ: scale the query and key projections up
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    g = torch.Generator().manual_seed(1)
    segs = [torch.randint(0, 96, (160,), generator=g).tolist() for _ in range(2)]
    return model, segs


def test_exact_selection_is_the_floor_and_the_sketch_converges(tiny):
    model, segs = tiny
    spec = KeyTierSpec(context=160, segments=2, continuation=32, every=4, page_size=8,
                       recall=0.2, backend="torch")
    attn = model.config._attn_implementation
    rows = {r["selector"]: r for r in probe_key_tiers(model, segs, spec, progress=False)}
    assert model.config._attn_implementation == attn  # the capture is undone
    assert tuple(rows) == SELECTORS
    full = {r["selector"]: r for r in probe_key_tiers(
        model, segs, KeyTierSpec(**{**spec.__dict__, "selectors": ("sketch-4-r1.0", "sketch-4")}),
        progress=False)}
    # every channel kept is the unprojected sketch, to the bit
    assert full["sketch-4-r1.0"]["missed_mass"] == full["sketch-4"]["missed_mass"]
    floor = rows["oracle"]["missed_mass"]
    # 2 layers x 2 segments x 8 positions, every one a real probe
    assert all(r["probes"] == 2 * 2 * 8 for r in rows.values())
    assert 0.0 < floor < 1.0
    for name, r in rows.items():  # the pages with the most attention are the best selection
        assert r["missed_mass"] >= floor - 1e-9, name
        assert r["vs_oracle"] == pytest.approx(r["missed_mass"] / floor)
    # finer codes rank closer to the true attention; 8 bits is all but the oracle
    missed = {name: r["missed_mass"] for name, r in rows.items()}
    assert missed["sketch-8"] <= missed["sketch-4"] + 1e-6 <= missed["sketch-2"] + 2e-6
    assert rows["sketch-8"]["vs_oracle"] < 1.01
    # the ranking matters here: at the same 12.5% key tier (8-token pages) Quest's loose bound
    # and the sketch's largest logit leave more behind than the sketch's attention mass
    assert missed["quest"] > 1.01 * missed["sketch-4"]
    assert missed["sketch-4-max"] > missed["sketch-4"]
    # the two-round mode: re-ranking Quest's shortlist by the exact keys recovers part of it,
    # for half as many bytes again
    assert missed["quest-2x"] < missed["quest"]
    assert rows["quest-2x"]["fetch"] == 1.5 and rows["quest"]["fetch"] == 1.0


def test_key_tiers_are_costed_as_the_eval_costs_them():
    for p in (8, 16):
        assert selector_tier("quest", p) == key_tier_fraction(method_config("topk-quest", 0.5,
                                                                            page_size=p))
        for bits in (2, 4):
            cfg = method_config("topk", 0.5, page_size=p, key_bits=bits, key_rank=1.0)
            assert selector_tier(f"sketch-{bits}", p) == key_tier_fraction(cfg) == bits / 32
        # the eval's default tier: 4-bit codes of 3/8 of the channels
        cfg = method_config("topk", 0.5, page_size=p)
        assert selector_tier("sketch-4-r0.375", p) == key_tier_fraction(cfg) == 0.375 * 4 / 32
        assert selector_tier("sketch-2-r0.75", p) == selector_tier("sketch-8-r0.1875", p)
    assert selector_tier("sketch-4-max", 16) == 0.125 and selector_tier("oracle", 16) is None
    assert selector_tier("quest-2x", 16) == selector_tier("quest", 16) == 1 / 16


@pytest.mark.parametrize("kw, match", [
    (dict(context=80, continuation=64, page_size=16), "no whole page"),
    (dict(recall=0.0), "recall"),
    (dict(recall=1.5), "recall"),
    (dict(selectors=("oracle", "sketch-3")), "choose from"),
    (dict(selectors=("sketch-4-r0",)), "choose from"),
    (dict(selectors=("sketch-4-r1.5",)), "choose from"),
    (dict(selectors=()), "choose from"),
    (dict(every=0), "every"),
    (dict(page_size=True), "page_size"),
])
def test_bad_specs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        KeyTierSpec(**kw)


def test_segments_must_match_the_context(tiny):
    model, segs = tiny
    spec = KeyTierSpec(context=128, continuation=32, page_size=8, backend="torch")
    with pytest.raises(ValueError, match="160 tokens; spec.context=128"):
        probe_key_tiers(model, segs, spec, progress=False)
