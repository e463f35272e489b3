"""The evals: metrics against known values, result folders that are never overwritten, the
decoding loop (offload equals the full cache, the oracle keeps what it must, left padding), the
reasoning eval end to end on a small reasoner, and the JSONL path on a local checkpoint."""

from __future__ import annotations

import csv
import inspect
import json
import math
import random

import pytest
import torch

from tierattn.eval.evals.methods import (METHODS, RECALL, grid_config, key_tier_fraction,
                                   method_config, plan_cell, sketch_bits, sketch_rank)
from tierattn.eval.evals.metrics import (first_divergence, kl_summary, mcnemar, token_kl,
                                         trace_length, wilson)
from tierattn.eval.report import format_table, new_results_dir, write_csv
from tierattn.eval.evals.runner import decode
from tierattn.eval.evals.tasks import EOS, TaskConfig, Vocab, make_examples
from tierattn.eval.training.reasoner import build_model, save, to_gqa


def test_wilson_interval_matches_known_values():
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    lo, hi = wilson(190, 200)
    assert lo < 0.95 < hi


def test_mcnemar_exact_p_values():
    assert mcnemar([True] * 5, [False] * 5) == {"ref_only": 5, "other_only": 0, "p": 0.0625}
    assert mcnemar([True, False], [False, True])["p"] == 1.0
    assert mcnemar([True] * 3, [True] * 3)["p"] == 1.0
    with pytest.raises(ValueError, match="equal lengths"):
        mcnemar([True], [True, False])


def test_token_kl_trace_length_and_divergence():
    p = torch.log_softmax(torch.randn(2, 3, 7), -1)
    q = torch.log_softmax(torch.randn(2, 3, 7), -1)
    valid = torch.tensor([[True, True, False], [True, False, False]])
    assert token_kl(p, p, valid).abs().max() < 1e-12
    kl = token_kl(p, q, valid)
    assert kl.shape == (3,) and (kl > 0).all()
    assert kl_summary(kl)["max"] == pytest.approx(float(kl.max()))
    assert trace_length([5, 6, EOS, 7], EOS) == 3 and trace_length([5, 6], EOS) == 2
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 4, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_results_folders_are_never_overwritten(tmp_path):
    import re

    a, b, c = (new_results_dir(tmp_path, "run") for _ in range(3))
    # a second run is told apart by when it ran (UTC), a third within the same second by -2
    assert a.name == "run" and re.fullmatch(r"run-\d{8}-\d{6}", b.name)
    assert c.name in (f"{b.name}-2",) or re.fullmatch(r"run-\d{8}-\d{6}", c.name)
    assert len({a, b, c}) == 3 and all(p.is_dir() for p in (a, b, c))
    path = write_csv([{"x": 1}, {"x": 2, "y": 3}], tmp_path / "t.csv")
    assert list(csv.DictReader(path.open())) == [{"x": "1", "y": ""}, {"x": "2", "y": "3"}]
    table = format_table([{"m": "a", "v": 0.5}, {"m": "b", "v": None}],
                         [("method", "m", ""), ("value", "v", ".2f")])
    assert "0.50" in table and table.splitlines()[-1].split()[-1] == "-"


def test_every_results_file_records_where_it_came_from(tmp_path, monkeypatch):
    import json
    import subprocess
    from pathlib import Path

    import torch

    from tierattn.eval.report import save_json

    monkeypatch.setattr("sys.argv", ["tierattn", "eval", "reasoning", "--n", "4"])
    path = save_json({"cells": []}, tmp_path / "results.json", quiet=True)
    prov = json.loads(path.read_text())["provenance"]
    assert prov["command"] == "tierattn eval reasoning --n 4"
    assert prov["versions"]["torch"] == torch.__version__ and "triton" in prov["versions"]
    assert prov["machine"]["cpu_count"] >= 1 and prov["machine"]["cpu_model"] and prov["date"]
    # the checkout's commit (this test runs from one), and whether tracked files differ from it
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    assert prov["commit"] == head and isinstance(prov["dirty"], bool)
    # a file read back as a configuration records nothing; a given provenance is kept
    bare = save_json({"x": 1}, tmp_path / "calibration.json", quiet=True, record=False)
    assert json.loads(bare.read_text()) == {"x": 1}
    kept = save_json({"provenance": {"commit": "abc"}}, tmp_path / "kept.json", quiet=True)
    assert json.loads(kept.read_text()) == {"provenance": {"commit": "abc"}}


def test_method_configs_hold_equal_hbm_bytes():
    for m in METHODS:
        cfg = method_config(m, 0.5)
        if m == "full":
            assert cfg is None
        elif m.startswith("topk") or m == "adaptive":  # resident pages + key tier = the budget
            assert cfg.hot_budget + key_tier_fraction(cfg) == pytest.approx(0.5)
            assert cfg.recall_score == ("quest" if m == "topk-quest" else "sketch")
            assert cfg.sketch_reduce == ("max" if m == "topk-max" else "lse")
            assert cfg.budget_rounding == "down" and cfg.sink_pages == 0
        elif m == "oracle":
            assert cfg.evict_budget == 0 and len(cfg.tiers) == 1
        elif m.startswith("evict"):
            assert (cfg.hot_budget, cfg.evict_budget) == (0.5, 0.5) and len(cfg.tiers) == 1
            assert cfg.budget_rounding == "down" and key_tier_fraction(cfg) == 0
        else:  # offload and split: exact, no key tier
            assert cfg.hot_budget == 0.5 and cfg.evict_budget == 0
            assert cfg.attend == {"offload": "all", "split": "split"}[m]
            assert key_tier_fraction(cfg) == 0  # offload keeps no key range
    # the key sketch: 4-bit codes of 3/8 of the channels, 1.5 of the 32 bits of a key and
    # value channel; every channel at 4 bits: 4 of 32; Quest's range: 2 rows/page
    assert key_tier_fraction(method_config("topk", 0.5)) == pytest.approx(0.046875)
    assert key_tier_fraction(method_config("topk", 0.5, key_rank=1.0)) == pytest.approx(0.125)
    assert key_tier_fraction(method_config("topk-quest", 0.5, page_size=16)) == \
        pytest.approx(0.0625)
    assert method_config("topk", 0.5).prefetch == "none"
    # recall follows the budget: a share of the cold tokens
    assert method_config("topk", 0.5).recall_scope == "cold"
    # feasibility: must-hot pages inside the resident share of the shortest prompt
    assert plan_cell("evict-h2o", 0.25, prompt_tokens=290).feasible  # 2 of 9 pages
    assert plan_cell("topk", 0.25, prompt_tokens=290).feasible  # 7 pages of 20.3%
    # 10%: the 4.7% tier leaves 5.3% of 290 tokens, one 8-token page
    cell = plan_cell("topk", 0.1, prompt_tokens=290)
    assert cell.feasible and (cell.config.key_bits, cell.config.key_rank) == (4, 0.375)
    assert sketch_bits(cell.config) == 4 and sketch_rank(cell.config) == 0.375
    assert cell.key_tier == pytest.approx(0.046875)
    assert cell.config.hot_budget == pytest.approx(0.053125)
    # 7%: 2.3% of 290 holds no 8-token page; the 1/4-rank tier (3.1%) leaves 3.9%, one page
    cell = plan_cell("topk-max", 0.07, prompt_tokens=290)
    assert cell.feasible and cell.config.key_rank == 0.25
    cell = plan_cell("topk", 0.03, prompt_tokens=290)  # neither tier fits: both reasons
    assert not cell.feasible and cell.reason.count("key tier") == 2
    assert "0.375 of the channels" in cell.reason and "0.25 of the channels" in cell.reason
    cell = plan_cell("topk", 0.1, prompt_tokens=100, page_size=16)  # no whole page
    assert not cell.feasible and "must-hot" in cell.reason
    assert plan_cell("topk-quest", 0.1, prompt_tokens=290).reason.startswith("topk-quest")
    assert sketch_bits(method_config("topk-quest", 0.5)) is None
    assert sketch_bits(None) is None and sketch_bits(method_config("offload", 0.5)) is None
    assert sketch_rank(method_config("topk-quest", 0.5)) is None
    assert method_config("evict-random", 0.5).evict_policy == "random"
    g = grid_config(0.2, 0.5)
    assert (g.hot_budget, g.evict_budget, g.evict_policy) == (0.2, 0.5, "h2o")
    with pytest.raises(ValueError, match="method='nope'"):
        method_config("nope", 0.5)
    with pytest.raises(ValueError, match="hbm"):
        method_config("offload", 1.5)
    # the recall knob reaches topk and topk-quest only, and is checked
    assert method_config("topk", 0.25, recall=0.3).recall_budget == 0.3
    assert method_config("topk-quest", 0.25).recall_budget == RECALL
    with pytest.raises(ValueError, match="recall=0"):
        plan_cell("topk", 0.25, prompt_tokens=290, recall=0)


@pytest.fixture(scope="module")
def reasoner(tmp_path_factory):
    """An untrained GQA reasoner saved the way the shipped one is (random weights suffice for
    exactness and bookkeeping; accuracy needs the trained one)."""
    vocab = Vocab()
    model = to_gqa(build_model(vocab, seed=3), 4).eval()
    folder = tmp_path_factory.mktemp("reasoner")
    save(model, vocab, folder, {}, 0, final=True)
    return model, vocab, folder


def test_offload_decoding_equals_the_full_cache(reasoner):
    model, vocab, _ = reasoner
    ex = make_examples(TaskConfig(hops=(2, 4), chains=24, distractor_hops=4, vocab=vocab), 6, 1)
    prompts = [e.prompt for e in ex]
    full = decode(model, prompts, None, steps=6, eos_id=None)
    for hbm in (0.25, 0.5):
        off = decode(model, prompts, method_config("offload", hbm, max_context=352,
                                                   backend="torch"), steps=6)
        assert torch.equal(off.tokens, full.tokens)
        assert token_kl(full.logprobs, off.logprobs, torch.ones(6, 6, dtype=torch.bool)).max() \
            < 1e-6
        assert off.stats["total"]["h2d_decode_bytes"] > 0  # pages really came back from DDR
        assert off.stats["total"]["resident_fraction"]["hbm"] < hbm + 0.2


def test_left_padded_batch_equals_decoding_alone(reasoner):
    model, vocab, _ = reasoner
    ex = make_examples(TaskConfig(hops=2, chains=6, filler=(0, 3), vocab=vocab), 3, 2)
    prompts = [e.prompt for e in ex]
    assert len({len(p) for p in prompts}) > 1
    # offload (exact) isolates the loop's padding and position ids; eviction legitimately
    # differs, since padding shifts the page grid under the real tokens
    cfg = method_config("offload", 0.25, max_context=128, backend="torch")
    batch = decode(model, prompts, cfg, steps=4)
    for i, p in enumerate(prompts):
        alone = decode(model, [p], cfg, steps=4)
        assert torch.equal(batch.tokens[i], alone.tokens[0])
        assert (batch.logprobs[i] - alone.logprobs[0]).abs().max() < 1e-4


def test_oracle_keeps_the_needed_edges_and_drops_the_rest(reasoner):
    model, vocab, _ = reasoner
    from tierattn.models.hf.cache import TieredCache
    from tierattn.models.hf.patch import patch

    ex = make_examples(TaskConfig(hops=4, chains=24, vocab=vocab), 2, 5)
    cfg = method_config("oracle", 0.25, max_context=352)  # auto: the Triton interpreter here
    prompts = [e.prompt for e in ex]
    keep = [e.needed_edges for e in ex]
    with patch(model, cfg):
        from tierattn.eval.evals.runner import oracle_evict

        cache = TieredCache(model.config, cfg)
        ids = torch.tensor(prompts)
        arg = "cache" if "cache" in inspect.signature(model.forward).parameters \
            else "past_key_values"  # renamed during transformers 5.x
        model(input_ids=ids, use_cache=True, **{arg: cache})
        oracle_evict(cache, [0, 0], [len(p) for p in prompts], keep, 0.25, seed=0)
    ps = cfg.page_size
    for b, e in enumerate(ex):
        for layer in range(model.config.num_hidden_layers):
            pos, _ = cache.runtime.gather(layer, b)
            kept = {p // ps for p in pos.tolist()}
            pages = math.ceil(len(e.prompt) / ps)
            budget = int(0.25 * len(e.prompt)) // ps  # capped: whole pages within 25%
            assert len(kept) <= max(budget, 2) and len(kept) < pages
            # the sink and last pages, then the needed edges' pages in order while room lasts
            needed = list(dict.fromkeys(pg for s, t in e.needed_edges
                                        for pg in range(s // ps, (t - 1) // ps + 1)))
            room = budget - len({0, pages - 1})
            assert {0, pages - 1} <= kept
            assert set(needed[:max(0, room)]) <= kept


def test_reasoning_eval_end_to_end(reasoner, tmp_path):
    from tierattn.eval.cli import main

    _, _, folder = reasoner
    argv = ["eval", "reasoning", "--full", "--model", str(folder), "--n", "4", "--budgets",
            "0.5", "--out-root", str(tmp_path), "--backend", "torch"]
    assert main(argv) == 0
    (out,) = tmp_path.iterdir()
    result = json.loads((out / "results.json").read_text())
    cells = result["cells"]
    methods = {c["method"] for c in cells if c["section"] == "main"}
    assert methods == set(METHODS)
    assert {c["section"] for c in cells} == {"main", "grid", "one_hop", "filler"}
    assert len([c for c in cells if c["section"] == "grid"]) == 9
    for c in cells:
        if not c.get("feasible", True):
            assert c["reason"]
            continue
        assert 0 <= c["ci_low"] <= c["accuracy"] <= c["ci_high"] <= 1
        if c["method"] in ("full", "offload", "split") or \
                (c["section"] == "grid" and c["evict"] == 0):
            assert c["greedy_match"] == 1.0 and c["kl_max"] < 1e-5, c  # exact
            assert c["evicted_fraction"] == 0
        if c["method"] == "split" and c["section"] == "main":  # no page crossed the link
            off = next(o for o in cells if o["method"] == "offload" and o["section"] == "main")
            assert c["h2d_bytes_per_token"] < 0.1 * off["h2d_bytes_per_token"], (c, off)
        if c["method"].startswith("evict") or c["method"] == "oracle":
            assert c["evicted_fraction"] > 0.2 and c["h2d_bytes_per_token"] == 0
        # the sketch's width is recorded; at 50% HBM the 4-bit tier fits
        assert c["key_bits"] == (4 if c["method"] in ("topk", "topk-max", "adaptive")
                                 else None), c
    with (out / "cells.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(cells)
    for name in ("accuracy_vs_hbm.png", "hbm_x_evict_heatmap.png", "bytes_vs_accuracy.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert main(argv) == 0  # a second run gets its own folder
    assert len(list(tmp_path.iterdir())) == 2


def test_reasoning_default_run(reasoner, tmp_path, capsys):
    """The default run is the main section alone with the default methods, and prints and
    saves the verdict."""
    from tierattn.eval.cli import main
    from tierattn.eval.evals.reasoning import DEFAULT_METHODS

    _, _, folder = reasoner
    assert main(["eval", "reasoning", "--model", str(folder), "--n", "3", "--budgets", "0.5",
                 "--out-root", str(tmp_path), "--backend", "torch"]) == 0
    (out,) = tmp_path.iterdir()
    result = json.loads((out / "results.json").read_text())
    assert result["spec"]["n"] == 3 and result["spec"]["sections"] == ["main"]
    assert {c["section"] for c in result["cells"]} == {"main"}
    assert [c["method"] for c in result["cells"]] == list(DEFAULT_METHODS)
    assert all(c["kl_mean"] is None and c["top1_agreement"] is None for c in result["cells"])
    v = result["verdict"]
    assert set(v["budgets"]["0.5"]) == set(DEFAULT_METHODS[1:]) | {"best_eviction"}
    assert v["claims"]["offload_keeps_full"]  # offload is exact
    printed = capsys.readouterr().out
    assert printed.startswith("verdict:") and "offload keeps the full cache" in printed
    from tierattn.eval.evals.reasoning import verdict_table
    assert verdict_table(result).startswith("verdict:")  # from the saved JSON (string keys)


def _cell(method, hbm, acc, n=400, h2d=0.0, p=1.0):
    from tierattn.eval.evals.metrics import wilson

    lo, hi = wilson(round(acc * n), n)
    return {"section": "main", "method": method, "hbm": hbm, "feasible": True, "accuracy": acc,
            "ci_low": lo, "ci_high": hi, "mcnemar_p": p, "h2d_bytes_per_token": h2d}


def test_verdict_claims():
    """The verdict's claims follow the cells: each flips when its condition does."""
    from tierattn.eval.evals.reasoning import ReasoningSpec, verdict, verdict_table

    def cells(topk_acc, off_p=1.0, snap_acc=0.4, topk_h2d=250.0):
        return [_cell("full", 1.0, 0.99)] + [
            c for b in (0.25, 0.5) for c in (
                _cell("offload", b, 0.99, h2d=1000.0, p=off_p),
                _cell("topk", b, topk_acc, h2d=topk_h2d),
                _cell("evict-snapkv", b, snap_acc), _cell("evict-h2o", b, 0.1),
                _cell("oracle", b, 0.9))]

    good = verdict(cells(0.97))
    assert good["claims"] == {"offload_keeps_full": True, "topk_within_tolerance": True,
                              "topk_bytes": True, "offload_beats_eviction": True,
                              "topk_beats_eviction": True}
    assert verdict(cells(0.97, topk_h2d=300.0))["claims"]["topk_bytes"]  # 30%: the limit
    assert not verdict(cells(0.97, topk_h2d=301.0))["claims"]["topk_bytes"]
    assert good["budgets"][0.25]["best_eviction"] == "evict-snapkv"
    assert good["budgets"][0.25]["topk"]["bytes_vs_offload"] == 0.25
    assert not verdict(cells(0.95))["claims"]["topk_within_tolerance"]  # 4 points below
    assert not verdict(cells(0.97, off_p=0.01))["claims"]["offload_keeps_full"]
    close = verdict(cells(0.97, snap_acc=0.97))["claims"]
    assert not close["topk_beats_eviction"] and close["offload_beats_eviction"] is False
    table = verdict_table({"cells": cells(0.97)})
    assert "25% B" in table and "full cache (no budget)" in table
    assert verdict([c for c in cells(0.97) if c["method"] != "full"])["claims"] == {}
    # the default run: +-5 points at any accuracy; the full study keeps every section
    from tierattn.eval.evals.metrics import wilson
    lo, hi = wilson(ReasoningSpec().n // 2, ReasoningSpec().n)
    assert (hi - lo) / 2 <= 0.05
    assert ReasoningSpec.full_study().sections == ("main", "grid", "one_hop", "filler")
    with pytest.raises(ValueError, match="sections"):
        ReasoningSpec(sections=("nope",))
    # the long task: its own tasks (1K+ tokens), no filler control
    assert ReasoningSpec.full_study(task="long").sections == ("main", "grid", "one_hop")
    with pytest.raises(ValueError, match="filler"):
        ReasoningSpec(task="long", sections=("main", "filler"))
    with pytest.raises(ValueError, match="task"):
        ReasoningSpec(task="medium")
    from tierattn.eval.evals.reasoning import tasks
    from tierattn.eval.evals.tasks import LONG_VOCAB
    long = tasks(LONG_VOCAB, "long")
    assert set(long) == {"main", "one_hop"} and long["one_hop"].hop_range == (1, 1)
    assert min(len(e.prompt) for e in make_examples(long["main"], 50, seed=0)) >= 1016


def test_fidelity_merged_cells(tmp_path):
    """Cells of a grid's folders, one per (method, HBM): a later folder's row wins."""
    from tierattn.eval.evals.fidelity import merged_cells

    def folder(name, cells):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"cells": cells}))
        return tmp_path / name

    a = folder("b0.25", [{"method": "full", "hbm": 1.0, "kl_mean": 0.0},
                         {"method": "topk", "hbm": 0.25, "kl_mean": 0.009}])
    b = folder("b0.25-2", [{"method": "full", "hbm": 1.0, "kl_mean": 0.0},
                           {"method": "topk", "hbm": 0.25, "kl_mean": 0.004}])
    c = folder("b0.1", [{"method": "topk", "hbm": 0.1, "kl_mean": 0.02}])
    rows = {(r["method"], r["hbm"]): r for r in merged_cells([a, b, c])}
    assert set(rows) == {("full", 1.0), ("topk", 0.25), ("topk", 0.1)}
    assert rows[("topk", 0.25)]["kl_mean"] == 0.004 and rows[("topk", 0.25)]["source"] == "b0.25-2"
    assert merged_cells([b, a])[1]["kl_mean"] == 0.009  # the order given decides


def test_fidelity_reference_key_follows_the_weights():
    """A model not loaded from a GGUF file is keyed by its weights' bytes: the same weights
    give the same key, one changed weight (bf16 included) another."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tierattn.eval.evals.fidelity import _reference_key

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1)).to(torch.bfloat16)
    key = _reference_key(model, {"p": [[1, 2, 3]]}, {"steps": 4})
    assert key == _reference_key(model, {"p": [[1, 2, 3]]}, {"steps": 4})
    assert key != _reference_key(model, {"p": [[1, 2, 4]]}, {"steps": 4})
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    assert key != _reference_key(model, {"p": [[1, 2, 3]]}, {"steps": 4})


def test_answer_extraction_and_jsonl_errors(tmp_path):
    from tierattn.eval.evals.qa import extract_answer, load_jsonl

    assert extract_answer("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert extract_answer("The answer is $18.00.") == "18"
    assert extract_answer("no digits") is None
    assert extract_answer("#### blue") == "blue"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 3"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        load_jsonl(bad)
    bad.write_text('{"q": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: each line needs"):
        load_jsonl(bad)


def test_jsonl_questions_on_a_local_checkpoint(tmp_path):
    """A tiny Llama checkpoint with a word-level tokenizer, both saved to disk as a user's
    would be; offload must reproduce the full cache's generations exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tierattn.eval.evals.qa import run_qa

    words = ["<unk>", "<pad>", "<s>", "</s>", "Question:", "Answer:", "what", "is", "plus",
             "?", "####"] + [str(i) for i in range(20)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")
    ckpt = tmp_path / "tiny-llama"
    fast.save_pretrained(ckpt)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, eos_token_id=3, pad_token_id=1,
                                 bos_token_id=2)).save_pretrained(ckpt)
    rng = random.Random(0)
    data = tmp_path / "qa.jsonl"
    lines = []
    for _ in range(3):
        a, b = rng.randrange(9), rng.randrange(9)
        q = " ".join(["what is", str(a), "plus", str(b), "?"] + ["what"] * rng.randrange(40))
        lines.append(json.dumps({"question": q, "answer": f"#### {a + b}"}))
    data.write_text("\n".join(lines) + "\n")
    result = run_qa(ckpt, data, budgets=(0.5,), methods=("offload", "evict-h2o"),
                    max_new_tokens=8, page_size=4, backend="torch", out_root=tmp_path / "res")
    rows = {c["method"]: c for c in result["cells"]}
    assert set(rows) == {"full", "offload", "evict-h2o"} and rows["full"]["n"] == 3
    assert rows["offload"]["greedy_match"] == 1.0 and rows["offload"]["kl_max"] < 1e-5
    assert rows["evict-h2o"]["evicted_fraction"] > 0
    assert (tmp_path / "res").iterdir().__next__().joinpath("cells.csv").exists()
    with pytest.raises(ValueError, match="oracle"):
        run_qa(ckpt, data, methods=("oracle",), out_root=None)
