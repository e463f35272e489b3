"""Host cost of topk's recall before and after the fused selection (issue 28, item 4), side by
side: `tierattn.eval.hostcost.host_row` (kernels stubbed, Llama-8B-shaped KV, 64 decode steps x
2 layers, 4K context, batch 1) for dense, offload 50% and topk, in alternating processes -- one
running the code before the change (an install of commit 47bac65), one this checkout -- so that
machine noise hits both alike. Prints the medians over `REPEATS` rounds of each process's mean
and median per layer and step, its torch ops and launches.

    git worktree add /tmp/before 47bac65
    pip install --no-deps --no-build-isolation --target /tmp/before_site /tmp/before
    python eval/results/host-select/ab_select.py /tmp/before_site
"""

import json
import os
import statistics
import subprocess
import sys

REPEATS = 3
VARIANTS = ("dense", "offload", "topk")
CHILD = """
import json, sys
import tierattn.eval.hostcost as hc
rows = [hc.host_row(v, 4096, 1, steps=64) for v in sys.argv[1:]]
print(json.dumps([{k: r[k] for k in ("variant", "host_us_per_layer_step", "host_us_median",
                                     "torch_ops_per_layer_step", "launches_per_layer_step",
                                     "device_reads_per_layer_step")} for r in rows]))
"""


def run(site: str | None) -> list[dict]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if site:
        env["PYTHONPATH"] = site
    out = subprocess.run([sys.executable, "-c", CHILD, *VARIANTS], env=env, cwd="/",
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    before_site = sys.argv[1]
    rows: dict[tuple[str, str], list[dict]] = {}
    for _ in range(REPEATS):
        for label, site in (("before", before_site), ("after", None)):
            for r in run(site):
                rows.setdefault((label, r["variant"]), []).append(r)
    print(f"{'code':<7} {'variant':<8} {'mean us/L/step':>15} {'median':>8} {'torch ops':>9} "
          f"{'launches':>8} {'device reads':>12}")
    for (label, variant), rs in rows.items():
        med = lambda k, rs=rs: statistics.median(r[k] for r in rs)  # noqa: E731
        print(f"{label:<7} {variant:<8} {med('host_us_per_layer_step'):>15.1f} "
              f"{med('host_us_median'):>8.1f} {med('torch_ops_per_layer_step'):>9.1f} "
              f"{med('launches_per_layer_step'):>8.2f} {med('device_reads_per_layer_step'):>12.0f}")


if __name__ == "__main__":
    main()
