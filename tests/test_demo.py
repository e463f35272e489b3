"""The kernel demo (``tierattn demo``) on a small context: real numbers, checked."""

from __future__ import annotations

import json

import torch

from tierattn.eval.demo import format_report, main, run_demo


def test_demo_offload_is_exact_and_eviction_loses_the_needles(device):
    result = run_demo(context=512, page_size=16, device=device, seed=1)
    evict, exact, topk = result["rows"]
    assert result["needles_in_hot_set"] == []  # the prompt never looked at them
    assert exact["max_abs_err"] < 1e-4 and exact["mass_captured"] > 0.9999
    assert exact["needles_attended"] == 3 and evict["needles_attended"] == 0
    assert evict["mass_captured"] < 0.5 * result["needle_mass_in_dense_attention"] + 0.5
    assert evict["max_abs_err"] > 100 * exact["max_abs_err"]
    assert evict["mass_captured"] < topk["mass_captured"] < 1.0
    assert topk["bytes_h2d"] < exact["bytes_h2d"]
    assert "offload, exact" in format_report(result)


def test_demo_writes_json(tmp_path, device):
    path = tmp_path / "demo.json"
    main(out=str(path), context=256, device=device)
    data = json.loads(path.read_text())
    assert {r["method"].split(" ")[0] for r in data["rows"]} == {"evict", "offload,"}


def test_loop_runs_every_preset_small():
    from tierattn.eval.bench.loop import format_stats, run_loop

    for preset in ("offload", "topk", "evict-h2o"):
        res = run_loop(preset=preset, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                       prompt=64, steps=4, dtype=torch.float32, device="cpu", progress=False,
                       backend="torch")
        total = res["stats"]["total"]
        assert total["attend_calls"] == 2 * 5 and "resident fraction" in format_stats(res)
        if preset == "offload":
            assert total["copy_launches_per_layer_per_step"] >= 1.0
            assert total["prefetch_hit_rate"] == 1.0 and total["evicted_tokens"] == 0
        if preset == "evict-h2o":
            assert total["evicted_tokens"] > 0 and total["h2d_bytes_total"] == 0
