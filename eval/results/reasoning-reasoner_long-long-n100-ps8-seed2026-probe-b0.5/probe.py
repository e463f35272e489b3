"""Why is topk worst at 50% HBM on the long task? (a diagnostic probe, not a study)

100 items of the long task's main section (seed 2026, the study's first 100), 50% HBM, the
shipped long reasoner, greedy only:
  topk            as shipped (25% of the cold tokens recalled per step)
  topk-r0.45      45% of the cold tokens: about the 10% cell's recalled tokens per step
  topk-quest-hot  the hot set re-ranked every step by the current query's Quest bound
                  (``score="quest"``); its key range is 12.5% more HBM that this probe does
                  NOT count: over budget, a diagnostic only

    python eval/results/reasoning-reasoner_long-long-n100-ps8-seed2026-probe-b0.5/probe.py 100

(run from outside the repository root, or the top-level ``kernels/`` folder shadows the
package's). Writes ``rows.json`` beside itself.
"""
import dataclasses
import json
import sys
from pathlib import Path

from tierattn.eval import reasoning as R
from tierattn.eval.methods import plan_cell
from tierattn.eval.tasks import EOS, PAD, make_examples
from tierattn.eval.train_reasoner import SHIPPED_LONG, load_reasoner

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
model, vocab = load_reasoner(SHIPPED_LONG)
cfg = R.tasks(vocab, "long")["main"]
examples = make_examples(cfg, n, seed=2026)
items = R._pointer_items(examples)
steps = cfg.hop_range[1] + 4
max_context = -(-(max(len(e.prompt) for e in examples) + steps + 8) // 8) * 8
shortest = min(len(e.prompt) for e in examples)
runs = [{"method": "full", "config": None}]
for name, recall, score in (("topk", 0.25, None), ("topk-r0.45", 0.45, None),
                            ("topk-quest-hot", 0.25, "quest")):
    config = plan_cell("topk", 0.5, prompt_tokens=shortest, max_context=max_context,
                       recall=recall).config
    if score:
        config = dataclasses.replace(config, score=score)
    runs.append({"method": name, "config": config, "hbm": 0.5})
rows = R.evaluate_items(model, items, runs, steps=steps, eos_id=EOS, pad_id=PAD,
                        teacher_forcing=False)
(Path(__file__).parent / "rows.json").write_text(json.dumps(rows, indent=1, default=str))
for r in rows:
    print(r["method"], r["accuracy"], r.get("h2d_bytes_per_token"),
          r.get("cold_tokens_per_step"))
