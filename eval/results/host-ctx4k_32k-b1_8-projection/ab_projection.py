"""Host cost of topk's projected key sketch, side by side (issue 28).

Runs `tierattn.eval.hostcost.host_row` (kernels stubbed, 4K context, batch 1, Llama-8B-shaped KV,
64 decode steps x 2 layers) for `topk` as shipped (4-bit codes of 3/8 of the channels, 25% of the
cold pages) and with every channel (`key_rank=1.0`), alternating, `REPEATS` times, in one
process; prints the medians. On a GPU the projection is one batched matmul launch per layer and
step; on this CPU the bench also times that matmul's arithmetic (bf16, [1, 32, 128] x
[8, 128, 48]).

    python eval/results/host-ctx4k_32k-b1_8-projection/ab_projection.py
"""

import statistics

import tierattn.eval.hostcost as hc

REPEATS = 3
hc.HOST_VARIANTS["topk, every channel"] = ("topk", {"key_rank": 1.0})
rows: dict[str, list[dict]] = {}
for _ in range(REPEATS):
    for variant in ("topk", "topk, every channel"):
        rows.setdefault(variant, []).append(hc.host_row(variant, 4096, 1, steps=64))
print(f"{'variant':<22} {'host us/L/step (median of runs: mean)':>38} {'median':>8} "
      f"{'torch ops':>9} {'launches':>8}")
for variant, rs in rows.items():
    print(f"{variant:<22} {statistics.median(r['host_us_per_layer_step'] for r in rs):>38.1f} "
          f"{statistics.median(r['host_us_median'] for r in rs):>8.1f} "
          f"{rs[0]['torch_ops_per_layer_step']:>9.1f} {rs[0]['launches_per_layer_step']:>8.2f}")
