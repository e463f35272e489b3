"""Reasoning-accuracy eval: eviction vs offload at equal HBM budget (DESIGN.md, level 1).

On the shipped tiny reasoner (or any reasoner trained by :mod:`.train_reasoner`) it runs

* **main**: methods at each HBM ratio of ``budgets`` on multi-hop pointer-chasing queries (2-4
  hops, 24 chains, ~290-token prompts; ``task="long"``: 64 chains with 1-2 filler tokens after
  each edge, 1016-1284-token prompts, on the long reasoner);
* **grid**: HBM ratio x eviction ratio (H2O drops ``evict`` of each sequence, ``hbm`` stays hot,
  the rest is offloaded), to test "accuracy depends on the eviction ratio, not the HBM ratio";
* **controls** at ``control_budget``: 1-hop queries (prefill-time eviction sees the query, so
  it should work there) and a filler variant (12 chains with 1-3 filler tokens after each edge).

The default run answers the question in minutes: the main section alone for the full cache,
offload, ``topk``, the two strongest eviction baselines and the oracle, on 400 items (every
accuracy's 95% interval within +-5 points), and a verdict (:func:`verdict`).
``ReasoningSpec.full_study()`` (``--full``) is the whole study: every method, the grid and the
controls on 200 items.

Each cell runs greedy decoding (accuracy, trace length, greedy match with the full cache, bytes
moved, residency) and teacher forcing on the gold answer (token KL and top-1 agreement against
the full cache on identical inputs). Every method is paired with the full cache on the same
items (McNemar). Results go to a new folder (never overwritten) as JSON, CSV and PNG plots.

    tierattn eval reasoning [--full] [--task long] [--n N] [--out-root results]
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tierattn.eval.evals.methods import (METHODS, PAGE_SIZE, RECALL, evict_ratio, grid_config,
                                   plan_cell, sketch_bits, sketch_rank)
from tierattn.eval.evals.metrics import (first_divergence, kl_summary, mcnemar, token_kl,
                                         trace_length, wilson)
from tierattn.eval.report import (format_table, new_results_dir, results_summary, save_json,
                                  write_csv)
from tierattn.eval.evals.runner import Decoded, decode
from tierattn.eval.evals.tasks import EOS, PAD, TaskConfig, Vocab, long_task, make_examples

__all__ = ["DEFAULT_METHODS", "Item", "ReasoningSpec", "SECTIONS", "TABLE_COLUMNS",
           "evaluate_items", "run_reasoning", "verdict"]

#: the default run's methods: the reference, tierattn's two modes, the two strongest eviction
#: baselines of the full study (SnapKV first at every budget, H2O second on average) and the
#: oracle (the most any eviction policy could keep)
DEFAULT_METHODS = ("full", "offload", "topk", "evict-snapkv", "evict-h2o", "oracle")
#: every section, in the order they run (the default runs "main" alone)
SECTIONS = ("main", "grid", "one_hop", "filler")
#: the task families: "short" (~290-token prompts, the shipped reasoner) and "long" (1016-1284-
#: token prompts of 64 chains and fillers, the long reasoner; no separate filler control)
TASKS = ("short", "long")


@dataclass(frozen=True)
class ReasoningSpec:
    """What :func:`run_reasoning` measures.

    The defaults are the quick run (the main section, :data:`DEFAULT_METHODS`, 400 items: a
    Wilson 95% interval is at most +-4.9 points at any accuracy); :meth:`full_study` is the
    whole study.

    Attributes:
        n: items per task (every cell of a task uses the same items; the first ``n`` of a seed
            are the same whatever ``n``, so a run shares its first items with a smaller one).
        budgets: HBM ratios of the main section.
        methods: methods of the main section and the controls (``full`` is always run).
        sections: which of :data:`SECTIONS` run.
        teacher_forcing: also decode each cell teacher-forced on the gold answer, for token KL
            and top-1 agreement with the full cache (the full study does; the default run
            judges greedy answers and bytes alone, in half the time).
        grid_hbm, grid_evict: the HBM ratio x eviction ratio grid (``hbm + evict <= 1``).
        control_budget: HBM ratio of the 1-hop and filler controls.
        page_size: tokens per page.
        recall: cold pages the ``topk`` methods recall per step, as a fraction of the
            cold tokens.
        seed: item seed (fresh: training and its held-out sets use other seeds).
        backend: kernel backend of the tiered cache.
        batch_size: items decoded together.
        task: ``"short"`` (24 chains) or ``"long"`` (1K-token prompts; its reasoner by
            default).
    """

    n: int = 400
    budgets: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75)
    methods: tuple[str, ...] = DEFAULT_METHODS
    sections: tuple[str, ...] = ("main",)
    teacher_forcing: bool = False
    grid_hbm: tuple[float, ...] = (0.2, 0.35, 0.5)
    grid_evict: tuple[float, ...] = (0.0, 0.25, 0.5)
    control_budget: float = 0.25
    page_size: int = PAGE_SIZE
    recall: float = RECALL
    seed: int = 2026
    backend: str = "auto"
    batch_size: int = 200
    task: str = "short"

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}.")
        if self.task == "long" and "filler" in self.sections:
            raise ValueError("the long task has no filler control (its prompts have fillers "
                             "already); drop 'filler' from sections.")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"methods: {bad} are not among {METHODS}.")
        for h in self.grid_hbm:
            for e in self.grid_evict:
                if h + e > 1.0 + 1e-9:
                    raise ValueError(f"grid: hbm {h} + evict {e} exceed the whole sequence; "
                                     "lower grid_hbm or grid_evict.")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}.")
        bad = [x for x in self.sections if x not in SECTIONS]
        if bad or not self.sections:
            raise ValueError(f"sections: {bad or 'none'} given; choose among {SECTIONS}.")

    @classmethod
    def full_study(cls, **kw) -> ReasoningSpec:
        """The whole study: every method of :data:`METHODS`, the HBM x eviction grid and the
        two controls, on 200 items per task (``kw`` overrides any field)."""
        sections = SECTIONS if kw.get("task", "short") == "short" else \
            tuple(x for x in SECTIONS if x != "filler")
        return cls(**{"n": 200, "methods": METHODS, "sections": sections,
                      "teacher_forcing": True, **kw})


def tasks(vocab: Vocab, task: str = "short") -> dict[str, TaskConfig]:
    """The eval's tasks: ``short``, 24 chains' worth of ~290-token prompts; ``long``
    (:func:`~tierattn.eval.evals.tasks.long_task`), 1016-1284-token prompts, no filler variant (its
    prompts have fillers already)."""
    if task == "long":
        return {"main": long_task(vocab, hops=(2, 4)), "one_hop": long_task(vocab, hops=1)}
    return {
        "main": TaskConfig(hops=(2, 4), chains=24, distractor_hops=4, vocab=vocab),
        "one_hop": TaskConfig(hops=1, chains=24, distractor_hops=4, vocab=vocab),
        "filler": TaskConfig(hops=(2, 4), chains=12, distractor_hops=4, filler=(1, 3),
                             vocab=vocab),
    }


@dataclass
class Item:
    """One question for :func:`evaluate_items`.

    Attributes:
        prompt: token ids.
        answer: the gold answer's token ids (forced under teacher forcing; may be empty when
            the full cache's own trace is forced instead).
        correct: ``correct(trace) -> bool`` judges a greedy trace (token ids).
        keep: prompt spans the oracle keeps (None: no oracle for this item).
        group: a label for per-group accuracy (the hop count here).
    """

    prompt: list[int]
    answer: list[int]
    correct: object
    keep: list[tuple[int, int]] | None = None
    group: int | str | None = None


def _pointer_items(examples) -> list[Item]:
    return [Item(e.prompt, e.target, (lambda t, target=e.target: t == target), e.needed_edges,
                 e.hops) for e in examples]


@dataclass
class _Reference:
    greedy: list[list[int]]
    correct: list[bool]
    forced: list[list[int]]
    tf: torch.Tensor | None  # [B, S, V] log-probs under teacher forcing (None: not run)
    lengths: list[int]


def _decode_batched(model, items: list[Item], config, *, steps: int, forced=None, eos_id: int,
                    pad_id: int, batch_size: int, keep_fraction: float = 1.0,
                    oracle: bool = False) -> tuple[list[list[int]], torch.Tensor, list]:
    """``(traces, logprobs [n, S, V], stats per batch)`` over ``items`` in batches (greedy, or
    teacher-forced on ``forced``)."""
    traces, logprobs, stats = [], [], []
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        d: Decoded = decode(
            model, [it.prompt for it in chunk], config, steps=steps, eos_id=eos_id,
            pad_id=pad_id, forced=forced[i:i + batch_size] if forced is not None else None,
            keep=[it.keep for it in chunk] if oracle else None, keep_fraction=keep_fraction)
        traces += [t[:trace_length(t, eos_id)] for t in d.tokens.tolist()]
        logprobs.append(d.logprobs)
        stats.append((d.stats, len(chunk), d.tokens.shape[1]))
    return traces, _cat_steps(logprobs), stats


def _cat_steps(logprobs: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """Concatenate ``[b, S_i, V]`` blocks along the batch, padding the steps to ``width``."""
    width = width or max(lp.shape[1] for lp in logprobs)
    cut = [x[:, :width] for x in logprobs]
    return torch.cat([torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[1])) for x in cut])


def _teacher_forced(model, items, config, ref: _Reference, greedy: list[list[int]],
                    greedy_lp: torch.Tensor, common: dict) -> torch.Tensor:
    """Log-probs under teacher forcing on ``ref.forced``. Where a greedy trace already equals
    the forced tokens, its steps saw the same inputs, so only the other items are decoded again
    (``[n, S, V]`` like ``ref.tf``); random eviction, whose draws follow the batch rows, decodes
    every item again."""
    width = ref.tf.shape[1]
    tf = _cat_steps([greedy_lp], width).clone()
    redo = [i for i, (g, f) in enumerate(zip(greedy, ref.forced)) if g[:len(f)] != f]
    if config.evict_budget and config.evict_policy == "random":
        redo = list(range(len(items)))  # its draws depend on the batch row: decode the same rows
    if redo:
        _, lp, _ = _decode_batched(model, [items[i] for i in redo], config,
                                   forced=[ref.forced[i] for i in redo], **common)
        tf[redo] = _cat_steps([lp], width)
    return tf


def _reference(model, items, *, steps, eos_id, pad_id, batch_size,
               teacher_forcing: bool = True) -> _Reference:
    greedy, _, _ = _decode_batched(model, items, None, steps=steps, eos_id=eos_id, pad_id=pad_id,
                                   batch_size=batch_size)
    # teacher forcing on the gold answer, or on the full cache's own trace when there is none
    forced = [it.answer if it.answer else g for it, g in zip(items, greedy)]
    tf = None
    if teacher_forcing:
        _, tf, _ = _decode_batched(model, items, None, steps=steps, forced=forced,
                                   eos_id=eos_id, pad_id=pad_id, batch_size=batch_size)
    return _Reference(greedy, [bool(it.correct(g)) for it, g in zip(items, greedy)], forced, tf,
                      [len(f) for f in forced])


def _traffic(stats: list, num_layers: int, prompt_tokens: int) -> dict:
    """H2D bytes per generated token (all, and without prefetched pages nobody used), D2H
    bytes per token, cold tokens attended per layer and step, resident HBM fraction of the
    live tokens, evicted fraction."""
    if not stats or not stats[0][0]:
        return {"h2d_bytes_per_token": 0.0, "h2d_used_bytes_per_token": 0.0,
                "d2h_bytes_per_token": 0.0, "cold_tokens_per_step": 0.0, "resident_hbm": 1.0,
                "evicted_fraction": 0.0}
    h2d = sum(s["total"]["h2d_decode_bytes"] for s, _, _ in stats)
    wasted = sum(s["total"]["wasted_prefetches"] * s["total"]["page_bytes"]
                 for s, _, _ in stats)
    d2h = sum(s["total"]["d2h_bytes_total"] for s, _, _ in stats)
    generated = sum(b * steps for _, b, steps in stats)
    items = sum(b for _, b, _ in stats)
    # the cold pages attended: fetched and used (a prefetched page nobody used is not), and
    # those attended on the host (split attention: their partial states are not pages)
    cold_tokens = sum(((t["h2d_decode_bytes"] - t.get("partial_decode_bytes", 0)
                        + t.get("host_attn_decode_bytes", 0)) / t["page_bytes"]
                       - t["wasted_prefetches"]) * t["page_size"]
                      for t in (s["total"] for s, _, _ in stats))
    # per layer, the share of decode steps that recalled and that split (attend="auto")
    ways = {}
    for key in ("recall_steps", "split_steps"):
        done = [sum(s["layers"][i][key] for s, _, _ in stats) for i in range(num_layers)]
        steps_run = [sum(s["layers"][i]["decode_steps"] for s, _, _ in stats)
                     for i in range(num_layers)]
        ways[key.replace("_steps", "_share_by_layer")] = [
            round(n / m, 4) if m else 0.0 for n, m in zip(done, steps_run)]
    hbm = sum(s["total"]["resident_fraction"].get("hbm", 0.0) * b for s, b, _ in stats) / items
    evicted = sum(s["total"]["evicted_tokens"] for s, _, _ in stats)
    return {"h2d_bytes_per_token": h2d / generated,
            "h2d_used_bytes_per_token": (h2d - wasted) / generated,
            "d2h_bytes_per_token": d2h / generated,
            "cold_tokens_per_step": cold_tokens / (generated * num_layers),
            "resident_hbm": hbm, "evicted_fraction": evicted / (num_layers * prompt_tokens),
            **ways}


def evaluate_items(model, items: list[Item], runs: list[dict], *, steps: int, eos_id: int,
                   pad_id: int, batch_size: int = 200, desc: str = "cells",
                   reference: _Reference | None = None,
                   teacher_forcing: bool = True) -> list[dict]:
    """Run each of ``runs`` (dicts with ``method``, ``config``, optional ``hbm``/``evict``/
    ``oracle``) on ``items`` and score it against the full cache; returns one row per run
    (token KL and top-1 agreement None without ``teacher_forcing``, or when ``reference`` was
    made without it)."""
    ref = reference or _reference(model, items, steps=steps, eos_id=eos_id, pad_id=pad_id,
                                  batch_size=batch_size, teacher_forcing=teacher_forcing)
    teacher_forcing = teacher_forcing and ref.tf is not None
    num_layers = model.config.num_hidden_layers
    prompt_tokens = sum(len(it.prompt) for it in items)
    rows = []
    for run in tqdm(runs, desc=desc, leave=False):
        if not run.get("feasible", True):
            rows.append({"method": run["method"], "hbm": run.get("hbm"),
                         "evict": run.get("evict"), "feasible": False,
                         "reason": run.get("reason", "")})
            continue
        start = time.perf_counter()
        oracle = run.get("oracle", False)
        common = {"steps": steps, "eos_id": eos_id, "pad_id": pad_id, "batch_size": batch_size,
                  "keep_fraction": run.get("hbm", 1.0), "oracle": oracle}
        tf = None
        if run["config"] is None:  # the full cache itself: its rows are the reference's
            greedy, tf, stats = ref.greedy, ref.tf, []
        else:
            greedy, greedy_lp, stats = _decode_batched(model, items, run["config"], **common)
            if teacher_forcing:
                tf = _teacher_forced(model, items, run["config"], ref, greedy, greedy_lp,
                                     common)
        ok = [bool(it.correct(g)) for it, g in zip(items, greedy)]
        k, n = sum(ok), len(ok)
        lo, hi = wilson(k, n)
        kl, top1 = torch.empty(0), None  # no teacher forcing: KL and top-1 are None
        if teacher_forcing:
            valid = torch.arange(tf.shape[1])[None, :] < torch.tensor(ref.lengths)[:, None]
            kl = token_kl(ref.tf[:, :tf.shape[1]], tf, valid)
            top1 = float((ref.tf[:, :tf.shape[1]].argmax(-1) == tf.argmax(-1))[valid]
                         .float().mean())
        div = [first_divergence(r, g) for r, g in zip(ref.greedy, greedy)]
        diverged = [d for d in div if d is not None]
        groups = sorted({it.group for it in items if it.group is not None}, key=str)
        test = mcnemar(ref.correct, ok)
        row = {
            "method": run["method"], "hbm": run.get("hbm"), "evict": run.get("evict"),
            "feasible": True, "hbm_held": run.get("held"), "key_tier": run.get("key_tier"),
            "key_bits": sketch_bits(run["config"]),
            "key_rank": sketch_rank(run["config"]),
            "n": n,
            "correct": k, "accuracy": k / n, "ci_low": lo, "ci_high": hi,
            "mcnemar_p": test["p"], "full_only": test["ref_only"],
            "method_only": test["other_only"],
            **{f"acc_{g}": sum(o for o, it in zip(ok, items) if it.group == g) /
               max(1, sum(it.group == g for it in items)) for g in groups},
            "trace_len_ratio": sum(map(len, greedy)) / max(1, sum(map(len, ref.greedy))),
            **{f"kl_{key}": v for key, v in kl_summary(kl).items()},
            "top1_agreement": top1,
            "greedy_match": sum(d is None for d in div) / n,
            "first_divergence_mean": sum(diverged) / len(diverged) if diverged else None,
            **_traffic(stats, num_layers, prompt_tokens),
            "seconds": time.perf_counter() - start,
        }
        rows.append(row)
    return rows


TABLE_COLUMNS = [("section", "section", ""), ("method", "method", ""), ("hbm", "hbm", ".2f"),
                 ("evict", "evict", ".2f"), ("acc", "accuracy", ".3f"),
                 ("95% lo", "ci_low", ".3f"), ("95% hi", "ci_high", ".3f"),
                 ("McNemar p", "mcnemar_p", ".2g"), ("KL mean", "kl_mean", ".2e"),
                 ("KL p99.9", "kl_p999", ".2e"), ("top1", "top1_agreement", ".3f"),
                 ("greedy=", "greedy_match", ".3f"), ("len x", "trace_len_ratio", ".2f"),
                 ("H2D B/tok", "h2d_bytes_per_token", ".0f"),
                 ("used B/tok", "h2d_used_bytes_per_token", ".0f"),
                 ("cold tok/step", "cold_tokens_per_step", ".1f"),
                 ("HBM held", "hbm_held", ".3f"), ("key tier", "key_tier", ".3f")]


def _plan(spec: ReasoningSpec, max_context: int,
          shortest: dict[str, int]) -> dict[str, list[dict]]:
    """The runs of every section, each method at equal HBM bytes (an infeasible cell is
    listed with its reason and not run); ``shortest``: the shortest prompt of each task."""
    def run(method, hbm, task):
        cell = plan_cell(method, hbm, prompt_tokens=shortest[task], page_size=spec.page_size,
                         max_context=max_context, backend=spec.backend, seed=spec.seed,
                         recall=spec.recall)
        return {"method": method, "hbm": 1.0 if method == "full" else hbm,
                "evict": evict_ratio(method, hbm), "config": cell.config,
                "oracle": method == "oracle", "feasible": cell.feasible, "reason": cell.reason,
                "held": 1.0 if method == "full" else min(hbm, cell.resident + cell.key_tier),
                "key_tier": cell.key_tier}

    others = [m for m in spec.methods if m != "full"]
    plan = {}
    if "main" in spec.sections:
        plan["main"] = [run("full", 1.0, "main")] + [run(m, h, "main") for m in others
                                                     for h in spec.budgets]
    if "grid" in spec.sections:
        plan["grid"] = [{"method": "h2o+offload", "hbm": h, "evict": e, "oracle": False,
                         "held": h, "key_tier": 0.0,
                         "config": grid_config(h, e, page_size=spec.page_size,
                                               max_context=max_context, backend=spec.backend)}
                        for e in spec.grid_evict for h in spec.grid_hbm]
    for task in ("one_hop", "filler"):
        if task in spec.sections:
            plan[task] = [run("full", 1.0, task)] + [run(m, spec.control_budget, task)
                                                     for m in others]
    return plan


def run_reasoning(spec: ReasoningSpec | None = None, *, model_dir: str | Path | None = None,
                  out_root: str | Path | None = "results", plots: bool = True) -> dict:
    """Run the whole eval on a trained reasoner and write the results folder.

    Returns:
        ``{"spec", "model", "cells": [...], "out": path or None, ...}``; every cell row has the
        fields of :func:`evaluate_items` plus ``section``.
    """
    from tierattn.eval.training.reasoner import SHIPPED, SHIPPED_LONG, load_reasoner

    spec = spec or ReasoningSpec()
    if model_dir is None:
        model_dir = SHIPPED_LONG if spec.task == "long" else SHIPPED
    model, vocab = load_reasoner(model_dir)
    started = time.time()
    # the tasks the sections use ("grid" runs on the main task's items); a task's seed does
    # not depend on which others run
    seeds = {name: spec.seed + i for i, name in enumerate(tasks(vocab, spec.task))}
    task_cfgs = {name: cfg for name, cfg in tasks(vocab, spec.task).items()
                 if name in spec.sections or (name == "main" and "grid" in spec.sections)}
    examples = {name: make_examples(cfg, spec.n, seed=seeds[name])
                for name, cfg in task_cfgs.items()}
    longest = max(len(e.prompt) for ex in examples.values() for e in ex)
    steps = max(cfg.hop_range[1] for cfg in task_cfgs.values()) + 4  # room to over-generate
    max_context = -(-(longest + steps + spec.page_size) // spec.page_size) * spec.page_size
    shortest = {name: min(len(e.prompt) for e in ex) for name, ex in examples.items()}
    plan = _plan(spec, max_context, shortest)
    cells = []
    sections = [(x, "main" if x == "grid" else x) for x in SECTIONS if x in spec.sections]
    refs: dict[str, _Reference] = {}
    for section, task in tqdm(sections, desc="reasoning eval"):
        items = _pointer_items(examples[task])
        if task not in refs:
            refs[task] = _reference(model, items, steps=steps, eos_id=EOS, pad_id=PAD,
                                    batch_size=spec.batch_size,
                                    teacher_forcing=spec.teacher_forcing)
        rows = evaluate_items(model, items, plan[section], steps=steps, eos_id=EOS, pad_id=PAD,
                              batch_size=spec.batch_size, desc=section, reference=refs[task],
                              teacher_forcing=spec.teacher_forcing)
        cells += [{"section": section, "task": task, **r} for r in rows]
    folder = Path(model_dir)
    result = {
        "spec": asdict(spec),
        "model": {"folder": str(folder), "name": folder.name,
                  "config": {k: model.config.to_dict()[k] for k in (
                      "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "hidden_size", "head_dim")}},
        "tasks": {name: {**asdict(cfg), "vocab": asdict(cfg.vocab),
                         "prompt_tokens_mean": sum(len(e.prompt) for e in examples[name]) /
                         len(examples[name])} for name, cfg in task_cfgs.items()},
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.machine(), "threads": torch.get_num_threads()},
        "minutes": (time.time() - started) / 60,
        "cells": cells,
    }
    result["verdict"] = verdict(cells)
    result["out"] = str(write_results(result, out_root, plots=plots)) if out_root else None
    return result


def results_name(spec: ReasoningSpec, model_name: str) -> str:
    """The results folder's name, from the config."""
    return (f"reasoning-{model_name}-{'long-' if spec.task == 'long' else ''}"
            f"n{spec.n}-ps{spec.page_size}-seed{spec.seed}-"
            f"{'' if spec.recall == RECALL else f'r{spec.recall:g}-'}"
            f"b{'_'.join(f'{b:g}' for b in spec.budgets)}")


def write_results(result: dict, out_root: str | Path, *, plots: bool = True) -> Path:
    """``results.json``, ``cells.csv`` and the PNG plots in a new folder under ``out_root``."""
    spec = ReasoningSpec(**{k: tuple(v) if isinstance(v, list) else v
                            for k, v in result["spec"].items()})
    out = new_results_dir(out_root, results_name(spec, result["model"]["name"]))
    result["out"] = str(out)
    if plots:
        from tierattn.eval.plots import reasoning_plots
        result["plots"] = [str(p) for p in reasoning_plots(result["cells"], out)]
    save_json(result, out / "results.json", quiet=True)
    write_csv(result["cells"], out / "cells.csv")
    return out


#: how far (accuracy points) ``topk`` may fall below the full cache and still "keep" it
TOPK_TOLERANCE = 0.03
#: most of offload's H2D bytes per token ``topk`` may move at any budget (the recall target)
TOPK_BYTES = 0.30


def verdict(cells: list[dict]) -> dict:
    """The answer the eval exists for, from the main section's cells: is offload's accuracy
    indistinguishable from the full cache's, does ``topk`` come within :data:`TOPK_TOLERANCE`
    of it on at most :data:`TOPK_BYTES` of offload's bytes, and how far does the best eviction
    baseline fall, at each budget.

    ``offload_keeps_full`` is "no McNemar test at p < 0.05 against the full cache": no evidence
    of a loss on these items, not a proof of none (offload is exact by construction; the
    greedy-match column shows it). A claim "at every budget" covers the budgets where its
    methods were feasible and ran.

    Returns:
        ``{"full": accuracy, "budgets": {hbm: {method: {"accuracy", "ci_low", "ci_high",
        "delta", "mcnemar_p", "h2d_bytes_per_token", "bytes_vs_offload"}, "best_eviction":
        method}}, "claims": {name: bool}, "lines": [str]}``; a claim is listed only when its
        methods ran.
    """
    main = [c for c in cells if c.get("section", "main") == "main" and c.get("feasible", True)]
    full = next((c for c in main if c["method"] == "full"), None)
    if full is None:
        return {"full": None, "budgets": {}, "claims": {}, "lines": []}
    budgets: dict[float, dict] = {}
    for c in main:
        if c["method"] == "full":
            continue
        budgets.setdefault(c["hbm"], {})[c["method"]] = {
            "accuracy": c["accuracy"], "ci_low": c["ci_low"], "ci_high": c["ci_high"],
            "delta": c["accuracy"] - full["accuracy"], "mcnemar_p": c["mcnemar_p"],
            "h2d_bytes_per_token": c["h2d_bytes_per_token"]}
    for row in budgets.values():
        off = row.get("offload", {}).get("h2d_bytes_per_token")
        for m in row.values():
            m["bytes_vs_offload"] = m["h2d_bytes_per_token"] / off if off else None
        evictions = [m for m in row if m.startswith("evict")]
        row["best_eviction"] = max(evictions, key=lambda m: row[m]["accuracy"], default=None)
    order = sorted(budgets)
    claims, lines = {}, []
    have = {m for row in budgets.values() for m in row if m != "best_eviction"}
    pct = lambda b: f"{b:.0%}"  # noqa: E731
    if "offload" in have:
        ok = all(budgets[b]["offload"]["mcnemar_p"] >= 0.05 for b in order
                 if "offload" in budgets[b])
        claims["offload_keeps_full"] = ok
        worst = min(budgets[b]["offload"]["delta"] for b in order if "offload" in budgets[b])
        lines.append(f"offload keeps the full cache's accuracy at every budget (McNemar "
                     f"p >= 0.05): {'yes' if ok else 'NO'} (largest drop "
                     f"{max(0.0, -worst) * 100:.1f} points)")
    if "topk" in have:
        rows = [budgets[b]["topk"] for b in order if "topk" in budgets[b]]
        ok = all(r["delta"] >= -TOPK_TOLERANCE for r in rows)
        claims["topk_within_tolerance"] = ok
        ratios = [r["bytes_vs_offload"] for r in rows if r["bytes_vs_offload"] is not None]
        bytes_note = f", on {min(ratios):.0%}-{max(ratios):.0%} of offload's bytes" \
            if ratios else ""
        lines.append(f"topk within {TOPK_TOLERANCE * 100:.0f} points of the full cache at "
                     f"every budget: {'yes' if ok else 'NO'} (largest drop "
                     f"{max(0.0, -min(r['delta'] for r in rows)) * 100:.1f} points{bytes_note})")
        if ratios:
            ok = max(ratios) <= TOPK_BYTES + 1e-9
            claims["topk_bytes"] = ok
            lines.append(f"topk moves at most {TOPK_BYTES:.0%} of offload's H2D bytes per token "
                         f"at every budget: {'yes' if ok else 'NO'} (at most {max(ratios):.1%})")
    best = [(b, budgets[b]["best_eviction"]) for b in order if budgets[b]["best_eviction"]]
    if best:
        lines.append("best eviction baseline: " + "; ".join(
            f"{m} at {pct(b)} HBM {budgets[b][m]['accuracy']:.3f} "
            f"({-budgets[b][m]['delta'] * 100:.1f} points below the full cache)"
            for b, m in best))
        for name, method in (("offload_beats_eviction", "offload"),
                             ("topk_beats_eviction", "topk")):
            if method in have:
                # separated intervals: the method's lower bound above eviction's upper bound
                claims[name] = all(budgets[b][method]["ci_low"] > budgets[b][m]["ci_high"]
                                   for b, m in best if method in budgets[b])
                lines.append(f"{method} above the best eviction at every budget (95% "
                             f"intervals apart): {'yes' if claims[name] else 'NO'}")
    if "oracle" in have:
        lines.append("oracle eviction (keeps the edges the answer needs): " + ", ".join(
            f"{budgets[b]['oracle']['accuracy']:.3f} at {pct(b)}" for b in order
            if "oracle" in budgets[b]))
    return {"full": full["accuracy"], "budgets": budgets, "claims": claims, "lines": lines}


def verdict_table(result: dict) -> str:
    """The verdict as text: accuracy [95% interval] per method and budget, ``topk``'s bytes as
    a share of offload's, then the claims."""
    v = verdict(result["cells"])  # recomputed: a saved verdict's budget keys are strings
    if v["full"] is None:
        return ""
    order = sorted(v["budgets"])
    methods = list(dict.fromkeys(m for b in order for m in v["budgets"][b]
                                 if m != "best_eviction"))
    full = next(c for c in result["cells"] if c.get("section", "main") == "main"
                and c["method"] == "full")
    ref = f"{full['accuracy']:.3f} [{full['ci_low']:.3f}, {full['ci_high']:.3f}]"
    rows = [{"method": "full cache (no budget)", **{f"{b:g}": ref for b in order}}]
    for m in methods:
        row = {"method": m}
        for b in order:
            x = v["budgets"][b].get(m)
            if x is None:
                continue
            share = x.get("bytes_vs_offload")
            note = f"  {share:.0%} B" if share is not None and m != "offload" and share else ""
            row[f"{b:g}"] = f"{x['accuracy']:.3f} [{x['ci_low']:.3f}, {x['ci_high']:.3f}]{note}"
        rows.append(row)
    table = format_table(rows, [("method", "method", "")] +
                         [(f"HBM {b:.0%}", f"{b:g}", "") for b in order])
    return "\n".join(["verdict: exact-chain accuracy [Wilson 95%] at equal HBM bytes "
                      "(B: H2D bytes per token as a share of offload's)", table, ""] +
                     [f"- {line}" for line in v["lines"]])


def summary(result: dict) -> str:
    """The verdict, then the table of every cell (``--full``: every section) and the paths of
    the files and plots."""
    return verdict_table(result) + "\n\n" + results_summary(result, TABLE_COLUMNS)
