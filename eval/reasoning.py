"""Reasoning-accuracy eval: eviction vs offload at equal HBM budget (DESIGN.md, level 1).

On the shipped tiny reasoner (or any reasoner trained by :mod:`.train_reasoner`) it runs

* **main**: every method of :data:`~tierattn.eval.methods.METHODS` at each HBM ratio of
  ``budgets`` on multi-hop pointer-chasing queries (2-4 hops, 24 chains, ~290-token prompts);
* **grid**: HBM ratio x eviction ratio (H2O drops ``evict`` of each sequence, ``hbm`` stays hot,
  the rest is offloaded), to test "accuracy depends on the eviction ratio, not the HBM ratio";
* **controls** at ``control_budget``: 1-hop queries (prefill-time eviction sees the query, so
  it should work there) and a filler variant (12 chains with 1-3 filler tokens after each edge).

Each cell runs greedy decoding (accuracy, trace length, greedy match with the full cache, bytes
moved, residency) and teacher forcing on the gold answer (token KL and top-1 agreement against
the full cache on identical inputs). Every method is paired with the full cache on the same
items (McNemar). Results go to a new folder (never overwritten) as JSON, CSV and PNG plots.

    tierattn eval reasoning [--n 200] [--out-root results]
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tierattn.eval.methods import (METHODS, PAGE_SIZE, RECALL, evict_ratio, grid_config,
                                   plan_cell, sketch_bits)
from tierattn.eval.metrics import (first_divergence, kl_summary, mcnemar, token_kl, trace_length,
                                   wilson)
from tierattn.eval.report import new_results_dir, results_summary, save_json, write_csv
from tierattn.eval.runner import Decoded, decode
from tierattn.eval.tasks import EOS, PAD, TaskConfig, Vocab, make_examples

__all__ = ["Item", "ReasoningSpec", "TABLE_COLUMNS", "evaluate_items", "run_reasoning"]


@dataclass(frozen=True)
class ReasoningSpec:
    """What :func:`run_reasoning` measures.

    Attributes:
        n: items per task (every cell of a task uses the same items).
        budgets: HBM ratios of the main section.
        methods: methods of the main section and the controls (``full`` is always run).
        grid_hbm, grid_evict: the HBM ratio x eviction ratio grid (``hbm + evict <= 1``).
        control_budget: HBM ratio of the 1-hop and filler controls.
        page_size: tokens per page.
        recall: cold pages the ``topk`` methods recall per step, as a fraction of the
            sequence.
        seed: item seed (fresh: training and its held-out sets use other seeds).
        backend: kernel backend of the tiered cache.
        batch_size: items decoded together.
    """

    n: int = 200
    budgets: tuple[float, ...] = (0.25, 0.5, 0.75)
    methods: tuple[str, ...] = METHODS
    grid_hbm: tuple[float, ...] = (0.2, 0.35, 0.5)
    grid_evict: tuple[float, ...] = (0.0, 0.25, 0.5)
    control_budget: float = 0.25
    page_size: int = PAGE_SIZE
    recall: float = RECALL
    seed: int = 2026
    backend: str = "auto"
    batch_size: int = 200

    def __post_init__(self) -> None:
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


def tasks(vocab: Vocab) -> dict[str, TaskConfig]:
    """The eval's tasks; all have 24 chains' worth of ~290-token prompts."""
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
    tf: torch.Tensor  # [B, S, V] log-probs under teacher forcing
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


def _reference(model, items, *, steps, eos_id, pad_id, batch_size) -> _Reference:
    greedy, _, _ = _decode_batched(model, items, None, steps=steps, eos_id=eos_id, pad_id=pad_id,
                                   batch_size=batch_size)
    # teacher forcing on the gold answer, or on the full cache's own trace when there is none
    forced = [it.answer if it.answer else g for it, g in zip(items, greedy)]
    _, tf, _ = _decode_batched(model, items, None, steps=steps, forced=forced, eos_id=eos_id,
                               pad_id=pad_id, batch_size=batch_size)
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
    # the cold pages attended: fetched and used (a prefetched page nobody used is not)
    cold_tokens = sum((s["total"]["h2d_decode_bytes"] / s["total"]["page_bytes"]
                       - s["total"]["wasted_prefetches"]) * s["total"]["page_size"]
                      for s, _, _ in stats)
    hbm = sum(s["total"]["resident_fraction"].get("hbm", 0.0) * b for s, b, _ in stats) / items
    evicted = sum(s["total"]["evicted_tokens"] for s, _, _ in stats)
    return {"h2d_bytes_per_token": h2d / generated,
            "h2d_used_bytes_per_token": (h2d - wasted) / generated,
            "d2h_bytes_per_token": d2h / generated,
            "cold_tokens_per_step": cold_tokens / (generated * num_layers),
            "resident_hbm": hbm, "evicted_fraction": evicted / (num_layers * prompt_tokens)}


def evaluate_items(model, items: list[Item], runs: list[dict], *, steps: int, eos_id: int,
                   pad_id: int, batch_size: int = 200, desc: str = "cells",
                   reference: _Reference | None = None) -> list[dict]:
    """Run each of ``runs`` (dicts with ``method``, ``config``, optional ``hbm``/``evict``/
    ``oracle``) on ``items`` and score it against the full cache; returns one row per run."""
    ref = reference or _reference(model, items, steps=steps, eos_id=eos_id, pad_id=pad_id,
                                  batch_size=batch_size)
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
        if run["config"] is None:  # the full cache itself: its rows are the reference's
            greedy, tf, stats = ref.greedy, ref.tf, []
        else:
            greedy, greedy_lp, stats = _decode_batched(model, items, run["config"], **common)
            tf = _teacher_forced(model, items, run["config"], ref, greedy, greedy_lp, common)
        ok = [bool(it.correct(g)) for it, g in zip(items, greedy)]
        k, n = sum(ok), len(ok)
        lo, hi = wilson(k, n)
        valid = torch.arange(tf.shape[1])[None, :] < torch.tensor(ref.lengths)[:, None]
        kl = token_kl(ref.tf[:, :tf.shape[1]], tf, valid)
        top1 = (ref.tf[:, :tf.shape[1]].argmax(-1) == tf.argmax(-1))[valid].float().mean()
        div = [first_divergence(r, g) for r, g in zip(ref.greedy, greedy)]
        diverged = [d for d in div if d is not None]
        groups = sorted({it.group for it in items if it.group is not None}, key=str)
        test = mcnemar(ref.correct, ok)
        row = {
            "method": run["method"], "hbm": run.get("hbm"), "evict": run.get("evict"),
            "feasible": True, "hbm_held": run.get("held"), "key_tier": run.get("key_tier"),
            "key_bits": sketch_bits(run["config"]),
            "n": n,
            "correct": k, "accuracy": k / n, "ci_low": lo, "ci_high": hi,
            "mcnemar_p": test["p"], "full_only": test["ref_only"],
            "method_only": test["other_only"],
            **{f"acc_{g}": sum(o for o, it in zip(ok, items) if it.group == g) /
               max(1, sum(it.group == g for it in items)) for g in groups},
            "trace_len_ratio": sum(map(len, greedy)) / max(1, sum(map(len, ref.greedy))),
            **{f"kl_{key}": v for key, v in kl_summary(kl).items()},
            "top1_agreement": float(top1),
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
    main = [run("full", 1.0, "main")] + [run(m, h, "main") for m in others
                                         for h in spec.budgets]
    grid = [{"method": "h2o+offload", "hbm": h, "evict": e, "oracle": False, "held": h,
             "key_tier": 0.0,
             "config": grid_config(h, e, page_size=spec.page_size, max_context=max_context,
                                   backend=spec.backend)}
            for e in spec.grid_evict for h in spec.grid_hbm]
    control = {task: [run("full", 1.0, task)] + [run(m, spec.control_budget, task)
                                                 for m in others]
               for task in ("one_hop", "filler")}
    return {"main": main, "grid": grid, **control}


def run_reasoning(spec: ReasoningSpec | None = None, *, model_dir: str | Path | None = None,
                  out_root: str | Path | None = "results", plots: bool = True) -> dict:
    """Run the whole eval on a trained reasoner and write the results folder.

    Returns:
        ``{"spec", "model", "cells": [...], "out": path or None, ...}``; every cell row has the
        fields of :func:`evaluate_items` plus ``section``.
    """
    from tierattn.eval.train_reasoner import SHIPPED, load_reasoner

    spec = spec or ReasoningSpec()
    model, vocab = load_reasoner(model_dir)
    started = time.time()
    task_cfgs = tasks(vocab)
    examples = {name: make_examples(cfg, spec.n, seed=spec.seed + i)
                for i, (name, cfg) in enumerate(task_cfgs.items())}
    longest = max(len(e.prompt) for ex in examples.values() for e in ex)
    steps = max(cfg.hop_range[1] for cfg in task_cfgs.values()) + 4  # room to over-generate
    max_context = -(-(longest + steps + spec.page_size) // spec.page_size) * spec.page_size
    shortest = {name: min(len(e.prompt) for e in ex) for name, ex in examples.items()}
    plan = _plan(spec, max_context, shortest)
    cells = []
    sections = [("main", "main"), ("grid", "main"), ("one_hop", "one_hop"),
                ("filler", "filler")]
    refs: dict[str, _Reference] = {}
    for section, task in tqdm(sections, desc="reasoning eval"):
        items = _pointer_items(examples[task])
        if task not in refs:
            refs[task] = _reference(model, items, steps=steps, eos_id=EOS, pad_id=PAD,
                                    batch_size=spec.batch_size)
        rows = evaluate_items(model, items, plan[section], steps=steps, eos_id=EOS, pad_id=PAD,
                              batch_size=spec.batch_size, desc=section, reference=refs[task])
        cells += [{"section": section, "task": task, **r} for r in rows]
    folder = Path(model_dir) if model_dir is not None else SHIPPED
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
    result["out"] = str(write_results(result, out_root, plots=plots)) if out_root else None
    return result


def results_name(spec: ReasoningSpec, model_name: str) -> str:
    """The results folder's name, from the config."""
    return (f"reasoning-{model_name}-n{spec.n}-ps{spec.page_size}-seed{spec.seed}-"
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


def summary(result: dict) -> str:
    """The printed table and the paths of the files and plots."""
    return results_summary(result, TABLE_COLUMNS)
