"""topk with its cold pages on disk vs topk over DDR on the shipped reasoner's default task at
25% HBM (the eval's own topk cell, equal HBM bytes): misses read at their layer (the default)
and deferred a step. Run: python topk_disk_accuracy.py [N] (N items, default 200)."""
import sys
import tempfile
import time

from tierattn.config import TierSpec
from tierattn.eval.reasoning import (ReasoningSpec, tasks, make_examples, _pointer_items,
                                     _plan, _reference, evaluate_items, EOS, PAD)
from tierattn.eval.train_reasoner import load_reasoner

n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
spec = ReasoningSpec(n=n, budgets=(0.25,), methods=("full", "topk"), sections=("main",))
model, vocab = load_reasoner(None)
cfg = tasks(vocab)["main"]
ex = make_examples(cfg, n, seed=spec.seed)
longest = max(len(e.prompt) for e in ex)
steps = cfg.hop_range[1] + 4
mc = -(-(longest + steps + spec.page_size) // spec.page_size) * spec.page_size
plan = _plan(spec, mc, {"main": min(len(e.prompt) for e in ex)})["main"]
top = [r for r in plan if r["method"] == "topk"][0]
with tempfile.TemporaryDirectory() as d:
    on_disk = top["config"].replace(tiers=(TierSpec("hbm"), TierSpec("disk", path=d)))
    disk = dict(top, method="topk-disk (misses read)", config=on_disk)
    defer = dict(top, method="topk-disk (misses deferred)",
                 config=on_disk.replace(disk_misses="defer"))
    items = _pointer_items(ex)
    ref = _reference(model, items, steps=steps, eos_id=EOS, pad_id=PAD, batch_size=spec.batch_size,
                     teacher_forcing=True)
    t = time.time()
    rows = evaluate_items(model, items, [top, disk, defer], steps=steps, eos_id=EOS, pad_id=PAD,
                          batch_size=spec.batch_size, reference=ref)
for r in rows:
    print({k: r.get(k) for k in ("method", "hbm", "accuracy", "top1_agreement")})
print("seconds", round(time.time() - t))
