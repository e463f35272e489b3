"""The serving benchmark's arithmetic without running an engine (CI runs its smoke): where the
cost model predicts swapping to pay, the per-cell comparisons, the targets and the plot."""

from __future__ import annotations

import pytest

from tierattn.serving.costmodel import CostModel
from tierattn.eval.cli import SERVING_POLICIES
from tierattn.eval.bench.serving import POLICIES, _cell, _targets, crossover, serving_plot, \
    serving_summary

KV = 1000  # bytes per token


def costs(latency: float, seconds_per_byte: float, per_token: float, per_pair: float = 0.0,
          kinds=("ddr",)) -> dict:
    m = CostModel(kinds)
    for kind in kinds:
        for d in ("store", "load"):
            m.links[(kind, d)].prior = (latency, seconds_per_byte)
    m.prefill.prior = (0.0, per_token, 0.0, per_pair)
    return m.as_dict()


def test_crossover_where_recompute_overtakes_the_swap_latency():
    # recompute 1 ms/token; swap 2 x (5 ms + 1e-7 s/B x 1000 B/token) = 10 ms + 0.2 ms/token
    c = crossover(costs(5e-3, 1e-7, 1e-3), "ddr", KV, None)
    assert c == {"status": "crossover", "tokens": 13}  # 12.5 tokens: swap cheaper from 13 on


def test_crossover_statuses():
    assert crossover(costs(0.0, 1e-9, 1e-3), "ddr", KV, None) == {"status": "swap cheaper"}
    assert crossover(costs(1.0, 1e-3, 1e-6), "ddr", KV, None, max_tokens=4096) == \
        {"status": "recompute cheaper"}
    assert crossover(costs(0.0, 1e-9, 1e-3), "disk", KV, None) == {"status": "unmeasured"}
    no_prefill = costs(0.0, 1e-9, 1e-3)
    no_prefill["prefill"] = None
    assert crossover(no_prefill, "ddr", KV, None) == {"status": "unmeasured"}


def test_quadratic_recompute_makes_a_slow_tier_pay_eventually():
    # swap costs 3 ms/token both ways, recompute 1 ms/token + 1e-6 s per query-key pair:
    # recompute overtakes when 1e-3 t + 5e-7 t (t + 1) > 3e-3 t, i.e. t > ~3999
    c = crossover(costs(0.0, 1.5e-6, 1e-3, 1e-6), "ddr", KV, None)
    assert c["status"] == "crossover" and 3990 <= c["tokens"] <= 4010


def run(policy, tok_s, prompt=512, pool=0.5, **kw):
    return {"policy": policy, "prompt_tokens": prompt, "pool": 1.0 if policy ==
            "unconstrained" else pool, "throughput_tok_s": tok_s, "failed_requests": 0,
            "differing_tokens": 0, **kw}


def test_cells_and_targets():
    runs = [run("unconstrained", 10.0), run("hf-recompute", 8.0), run("swap-ddr", 12.0),
            run("swap-ddr+disk", 9.0), run("auto-ddr", 11.7), run("auto-ddr+disk", 8.2)]
    cell = _cell(runs, 512, 0.5)
    assert cell["auto-ddr_vs_best"] == pytest.approx(11.7 / 12.0)
    assert cell["auto-ddr+disk_vs_best"] == pytest.approx(8.2 / 9.0)
    assert cell["swap-ddr_vs_hf"] == pytest.approx(1.5)
    t = _targets({"cells": [cell], "runs": runs})
    assert t["auto_vs_best_min"]["value"] == pytest.approx(8.2 / 9.0)
    assert not t["auto_vs_best_min"]["met"] and t["auto_vs_hf_min"]["met"]
    assert t["swap_vs_recompute_at_longest"] == {"prompt_tokens": 512, "value": 1.5,
                                                 "goal": 1.3, "met": True}
    runs[2]["differing_tokens"] = 3
    assert not _targets({"cells": [cell], "runs": runs})["differing_tokens"]["met"]


def test_the_plot_and_summary_are_written(tmp_path):
    runs = []
    for prompt in (128, 512):
        for policy, tok_s in zip(POLICIES, (10, 8, 12, 9, 11.5, 8.5)):
            runs.append(run(policy, tok_s * 128 / prompt, prompt, ttft_p50_s=1.0,
                            ttft_p99_s=2.0, itl_p50_s=0.1, itl_p99_s=0.5, recomputed_tokens=0,
                            swapped_out=1, stored_bytes={"ddr": 10**6}))
    result = {"spec": {"requests": 16}, "runs": runs,
              "cells": [_cell(runs, p, 0.5) for p in (128, 512)],
              "crossover": {"ddr": {"status": "swap cheaper"},
                            "disk": {"status": "crossover", "tokens": 300}}}
    result["targets"] = _targets(result)
    path = serving_plot(result, tmp_path / "plot.png")
    assert path.stat().st_size > 10_000
    text = serving_summary(result)
    assert "from 300 tokens on" in text and "swap cheaper at every length" in text


def test_the_cli_lists_the_benchmarks_policies():
    assert SERVING_POLICIES == POLICIES[1:]
