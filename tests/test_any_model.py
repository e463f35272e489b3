"""Any model: every causal-LM type of the installed transformers, as a tiny random model, is
either served token-identically to its own attention (exact offload, batch 1 and batch 3
left-padded, pages leaving HBM) or refused with a structural reason -- never by name, never
with other tokens or an error from inside the model. Its table is the one docs/huggingface.md
links."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tierattn.eval.evals.anymodel import STATUSES, summary_markdown, survey  # noqa: E402


def test_every_causal_lm_type_is_identical_or_refused_by_its_structure(figures):
    rows = survey(progress=False)
    print(summary_markdown(rows))
    broken = [r for r in rows if r.status in ("differs", "failed")]
    assert not broken, "\n".join(f"{r.model_type}: {r.status}: {r.reason}" for r in broken)
    identical = [r.model_type for r in rows if r.status == "identical"]
    assert len(identical) >= 30, identical
    for r in rows:
        assert r.status in STATUSES
        if r.status == "refused":  # a structural reason: a layer, a module property, a shape
            assert r.reason and r.model_type not in r.reason, (r.model_type, r.reason)
    for status in ("identical", "refused", "skipped"):
        figures.count(f"causal-LM types {status}", sum(r.status == status for r in rows))
