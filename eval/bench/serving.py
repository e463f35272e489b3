"""``tierattn bench --serving``: transformers' continuous batching under memory pressure, its own
recompute against tierattn's swap tiers and cost model, on SmolLM2-135M (the offline GGUF).

Each cell is a prompt length and a KV pool size (a fraction of the KV every request holds at
its end). ``requests`` requests of that prompt length (distinct windows of offline text) ask
for 64-128 new tokens each (greedy, no EOS, so every run does the same work); all are
submitted at once and streamed. Per cell, the same requests run:

* ``unconstrained``: transformers' engine with room for every request (the tokens every other
  run must reproduce, and the throughput without memory pressure);
* ``hf-recompute``: transformers' default under the tight pool (a preempted request is
  soft-reset: its tokens are prefilled again);
* ``swap-ddr``, ``swap-ddr+disk``: ``tierattn.swap`` with ``policy="swap"``, into DDR (as large
  as the pool), or a DDR tier of ``ddr_share`` of the pool that spills to disk;
* ``auto-ddr``, ``auto-ddr+disk``: the same tiers with ``policy="auto"`` (the cost model).

Reported per run: throughput (generated tokens per second of wall time from submission to the
last token), time to first token and inter-token latency (p50, p99; per token, from the
engine's timestamps), recomputed tokens, bytes stored and loaded per tier, preemptions, failed
requests and tokens that differ from ``unconstrained``. Results: ``results.json``,
``cells.csv``, ``calibration.json`` (the last auto run's cost model: a ``SwapConfig``
calibration file) and ``throughput_vs_prompt.png`` with the cost model's predicted swap/recompute
crossover per tier.
"""

from __future__ import annotations

import contextlib
import math
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tierattn.eval.report import format_table, new_results_dir, save_json, write_csv

__all__ = ["POLICIES", "ServingSpec", "run_serving", "serving_summary"]

#: the runs of a cell, in order (``unconstrained`` first: the reference)
POLICIES = ("unconstrained", "hf-recompute", "swap-ddr", "swap-ddr+disk", "auto-ddr",
            "auto-ddr+disk")


@dataclass(frozen=True)
class ServingSpec:
    """What :func:`run_serving` measures (the defaults are the committed run).

    Attributes:
        prompt_lengths: prompt tokens of every request of a cell.
        pools: KV pool sizes, as a fraction of the KV all requests hold at their end.
        requests: requests per run, submitted at once.
        new_tokens: fewest and most new tokens a request asks for (drawn per request).
        policies: which of :data:`POLICIES` run (``unconstrained`` always does; ``auto-ddr``
            makes the same choice as ``swap-ddr`` wherever DDR is far cheaper than a prefill,
            so the default leaves it out).
        page_size: tokens per block of the engine's paged cache.
        max_batch_tokens: most query tokens per forward batch.
        ddr_share: DDR capacity of the ``+disk`` runs, as a fraction of the KV pool.
        safety_margin: share of the pool the scheduler keeps free before it admits a new
            request (transformers' FIFO default is 0.15; vLLM keeps a 1% watermark).
        seed: the prompts' windows and the new-token counts.
    """

    prompt_lengths: tuple[int, ...] = (128, 512, 1024, 2048)
    pools: tuple[float, ...] = (0.5,)
    requests: int = 16
    new_tokens: tuple[int, int] = (64, 128)
    policies: tuple[str, ...] = ("hf-recompute", "swap-ddr", "swap-ddr+disk", "auto-ddr+disk")
    page_size: int = 64
    max_batch_tokens: int = 1024
    ddr_share: float = 0.25
    safety_margin: float = 0.0
    seed: int = 0

    @classmethod
    def smoke(cls) -> ServingSpec:
        """A minute on two CPU cores: two short prompt lengths, eight requests."""
        return cls(prompt_lengths=(64, 160), requests=8, new_tokens=(8, 16), page_size=16,
                   max_batch_tokens=256)


def _prompts(tok, spec: ServingSpec, length: int) -> list[list[int]]:
    """``spec.requests`` distinct windows of ``length`` tokens of the offline texts."""
    from tierattn.eval.evals.fidelity import offline_texts

    ids: list[int] = []
    for text in offline_texts():
        ids += tok(text, add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(spec.seed + length)
    need = length * spec.requests
    if len(ids) < length + spec.requests:
        raise ValueError(f"the offline texts hold {len(ids)} tokens, too few for "
                         f"{spec.requests} prompts of {length}.")
    stride = max(1, (len(ids) - length) // spec.requests) if need > len(ids) else length
    starts = [(i * stride + int(torch.randint(0, 8, (1,), generator=g))) %
              (len(ids) - length) for i in range(spec.requests)]
    return [ids[s:s + length] for s in starts]


@contextlib.contextmanager
def _count_soft_resets():
    """Count the requests transformers' own manager prefills again (and their tokens) by
    watching ``RequestState.create_equivalent_initial_request`` (the soft reset)."""
    from transformers.generation.continuous_batching.requests import RequestState

    counts = {"requests": 0, "tokens": 0}
    real = RequestState.create_equivalent_initial_request

    def counted(self):
        counts["requests"] += 1
        counts["tokens"] += len(self.initial_tokens) + len(self.generated_tokens)
        return real(self)

    RequestState.create_equivalent_initial_request = counted
    try:
        yield counts
    finally:
        RequestState.create_equivalent_initial_request = real


def _swap_config(policy: str, spec: ServingSpec, num_blocks: int, block_bytes: int,
                 disk_dir: Path, device: torch.device):
    from tierattn.config import TierSpec
    from tierattn.serving.swapcore import SwapConfig

    mode, _, where = policy.partition("-")
    if where == "ddr":
        tiers = (TierSpec("ddr"),)
    else:
        ddr = max(1, int(spec.ddr_share * num_blocks))
        tiers = (TierSpec("ddr", capacity_gib=ddr * block_bytes / 2**30),
                 TierSpec("disk", path=str(disk_dir)))
    # On CPU tensors "auto" would run the page-copy kernel under the Triton interpreter when
    # TRITON_INTERPRET is set (as in CI): a test harness, 20-55x slower here than the torch
    # copy a CPU server runs (74 MB/s against 1.6 GB/s out, 4.1 GB/s back), which would skew
    # the swap costs measured here.
    backend = "auto" if device.type == "cuda" else "torch"
    return SwapConfig(tiers=tiers, policy=mode, backend=backend)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _run(model, prompts, new_tokens, spec: ServingSpec, num_blocks: int, handle=None) -> dict:
    """One run: every request submitted at once, streamed; timings from the engine's token
    timestamps."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(new_tokens))
    cb = ContinuousBatchingConfig(page_size=spec.page_size, num_blocks=num_blocks,
                                  max_batch_tokens=spec.max_batch_tokens,
                                  safety_margin=spec.safety_margin)
    manager = model.init_continuous_batching(generation_config=gen,
                                             continuous_batching_config=cb)
    tokens: dict[str, list[int]] = {}
    times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    with _count_soft_resets() as resets:
        manager.start()
        try:
            t0 = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n, streaming=True, record_timestamps=True)
                   for p, n in zip(prompts, new_tokens)]
            done: set[str] = set()
            while len(done) < len(ids):
                out = manager.get_result(timeout=600)
                if out is None:
                    raise RuntimeError("serving bench: the engine stopped answering for 10 min")
                rid, got = out.request_id, list(out.generated_tokens)
                seen = times.setdefault(rid, [])
                new = len(got) - len(seen)
                if new > 0:  # the engine's own stamps of the tokens this output adds
                    stamps = out.timestamps or []
                    seen += stamps[-new:] if len(stamps) >= new else [time.perf_counter()] * new
                tokens[rid] = got
                if out.error is not None:
                    errors[rid] = out.error
                if out.is_finished():
                    done.add(rid)
            t_end = max(max(v) for v in times.values() if v)
        finally:
            manager.stop(block=True)
            manager.destroy()
    ttft = [v[0] - t0 for v in times.values() if v]
    itl = [b - a for v in times.values() for a, b in zip(v, v[1:])]
    total = sum(len(v) for v in tokens.values())
    row = {"wall_s": t_end - t0, "generated_tokens": total,
           "throughput_tok_s": total / (t_end - t0),
           "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
           "itl_p50_s": _pct(itl, 0.5), "itl_p99_s": _pct(itl, 0.99),
           "failed_requests": len(errors), "tokens": [tokens[i] for i in ids]}
    if handle is None:
        row.update(recomputed_requests=resets["requests"], recomputed_tokens=resets["tokens"],
                   swapped_out=0, stored_bytes={}, loaded_bytes={})
    else:
        st = handle.stats()
        row.update(recomputed_requests=st["recomputed_requests"],
                   recomputed_tokens=st["recomputed_tokens"], swapped_out=st["swapped_out"],
                   stored_bytes={k: v["stored"] for k, v in st["bytes"].items()},
                   loaded_bytes={k: v["loaded"] for k, v in st["bytes"].items()},
                   faults=st["faults"], tiers_full=st["tiers_full"],
                   actions={a: sum(d["action"] == a for d in st["decisions"])
                            for a in ("swap", "recompute")},
                   cost_check=st["cost_check"], cost_model=st["cost_model"])
    return row


def _block_bytes(model, spec: ServingSpec) -> int:
    cfg = model.config.get_text_config()
    heads = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return cfg.num_hidden_layers * 2 * spec.page_size * heads * dim * itemsize


def crossover(cost_model: dict, kind: str, kv_bytes_per_token: int, chunk: int | None,
              max_tokens: int = 1 << 20) -> dict:
    """Where the cost model (``CostModel.as_dict()``) predicts a swap through ``kind`` to become
    cheaper than a recompute for good: ``{"status": "crossover", "tokens": T}`` (swap cheaper
    from ``T`` tokens on), ``"swap cheaper"`` or ``"recompute cheaper"`` (at every length up
    to ``max_tokens``), or ``"unmeasured"``."""
    from tierattn.serving.costmodel import CostModel

    costs = CostModel.from_dict(cost_model)

    def gap(t: float) -> float | None:  # recompute minus swap, seconds
        swap = costs.swap_s([(kind, int(kv_bytes_per_token * t))]) \
            if kind in costs.kinds else None
        recompute = costs.recompute_s(int(t), chunk)
        return None if swap is None or recompute is None else recompute - swap

    if gap(1) is None:
        return {"status": "unmeasured"}
    grid = sorted({max(1, int(2 ** (k / 4))) for k in range(4 * max_tokens.bit_length())})
    grid = [t for t in grid if t <= max_tokens]
    dearer = [t for t in grid if gap(t) <= 0]  # lengths where swapping costs as much or more
    if not dearer:
        return {"status": "swap cheaper"}
    if dearer[-1] == grid[-1]:
        return {"status": "recompute cheaper"}
    lo, hi = dearer[-1], grid[grid.index(dearer[-1]) + 1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if gap(mid) > 0 else (mid, hi)
    return {"status": "crossover", "tokens": hi}


def run_serving(spec: ServingSpec = ServingSpec(), *, out_root: str | Path | None = "results",
                progress: bool = True) -> dict:
    """Run every cell of ``spec``; write the result folder under ``out_root`` (None: no
    files). Returns ``{"spec", "cells", "runs", "targets", "out", "plots"}``."""
    import tierattn
    from tierattn.eval.evals.fidelity import load_smollm2

    model, tok = load_smollm2()
    model.config._attn_implementation = "sdpa"
    block_bytes = _block_bytes(model, spec)
    kv_per_token = block_bytes // spec.page_size
    g = torch.Generator().manual_seed(spec.seed)
    lo, hi = spec.new_tokens
    new_tokens = [int(x) for x in torch.randint(lo, hi + 1, (spec.requests,), generator=g)]
    runs, cells = [], []
    total = len(spec.prompt_lengths) * (1 + len(spec.pools) * len(spec.policies))
    bar = tqdm(total=total, desc="serving bench", unit="run", disable=not progress)
    with tempfile.TemporaryDirectory(prefix="tierattn-serving-") as tmp:
        for length in spec.prompt_lengths:
            prompts = _prompts(tok, spec, length)
            need = sum(math.ceil((length + n) / spec.page_size) for n in new_tokens)
            longest = math.ceil((length + max(new_tokens)) / spec.page_size)
            bar.set_postfix_str(f"{length} tokens, unconstrained")
            ref = _run(model, prompts, new_tokens, spec, need + spec.requests)
            ref.update(prompt_tokens=length, pool=1.0, policy="unconstrained",
                       num_blocks=need + spec.requests)
            runs.append(ref)
            bar.update()
            for pool in spec.pools:
                blocks = max(longest + 1, int(pool * need))
                for policy in spec.policies:
                    bar.set_postfix_str(f"{length} tokens, pool {pool}, {policy}")
                    if policy == "hf-recompute":
                        row = _run(model, prompts, new_tokens, spec, blocks)
                    else:
                        cfg = _swap_config(policy, spec, blocks, block_bytes,
                                           Path(tmp) / policy, model.device)
                        with tierattn.swap(model, cfg) as handle:
                            row = _run(model, prompts, new_tokens, spec, blocks, handle)
                    row.update(prompt_tokens=length, pool=pool, policy=policy,
                               num_blocks=blocks)
                    row["differing_tokens"] = sum(
                        sum(a != b for a, b in zip(x, y)) + abs(len(x) - len(y))
                        for x, y in zip(row["tokens"], ref["tokens"]))
                    runs.append(row)
                    bar.update()
                cells.append(_cell(runs, length, pool))
    bar.close()
    calibration = next((r["cost_model"] for r in reversed(runs) if "cost_model" in r), None)
    result = {"spec": asdict(spec), "model": "SmolLM2-135M-Instruct (GGUF, fp32, sdpa)",
              "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(),
                          "torch": torch.__version__},
              "date": time.strftime("%Y-%m-%d"), "block_bytes": block_bytes,
              "kv_bytes_per_token": kv_per_token, "new_tokens": new_tokens,
              "crossover": {k: crossover(calibration, k, kv_per_token, spec.max_batch_tokens)
                            for k in ("ddr", "disk")} if calibration else {},
              "cells": cells, "runs": [{k: v for k, v in r.items() if k != "tokens"}
                                       for r in runs]}
    result["targets"] = _targets(result)
    if out_root is not None:
        name = f"serving-smollm2-p{'_'.join(map(str, spec.prompt_lengths))}-r{spec.requests}"
        if spec.new_tokens != ServingSpec.new_tokens:
            name += f"-n{spec.new_tokens[0]}_{spec.new_tokens[1]}"
        out = new_results_dir(out_root, name)
        result["out"] = str(out)
        if calibration:
            save_json(calibration, out / "calibration.json", quiet=True)
        write_csv([{k: v for k, v in r.items() if not isinstance(v, (dict, list))}
                   for r in result["runs"]], out / "runs.csv")
        write_csv(cells, out / "cells.csv")
        result["plots"] = [str(serving_plot(result, out / "throughput_vs_prompt.png"))]
        save_json(result, out / "results.json", quiet=True)
    return result


def _cell(runs: list[dict], length: int, pool: float) -> dict:
    """One row per cell: each policy's throughput, and auto against the better of the
    others."""
    mine = {r["policy"]: r for r in runs if r["prompt_tokens"] == length and
            r["pool"] in (pool, 1.0)}
    cell = {"prompt_tokens": length, "pool": pool}
    for p, r in mine.items():
        cell[f"{p}_tok_s"] = r["throughput_tok_s"]
    hf = mine.get("hf-recompute")
    for where in ("ddr", "ddr+disk"):
        auto, sw = mine.get(f"auto-{where}"), mine.get(f"swap-{where}")
        if auto and sw and hf:
            best = max(sw["throughput_tok_s"], hf["throughput_tok_s"])
            cell[f"auto-{where}_vs_best"] = auto["throughput_tok_s"] / best
            cell[f"auto-{where}_vs_hf"] = auto["throughput_tok_s"] / hf["throughput_tok_s"]
        if sw and hf:
            cell[f"swap-{where}_vs_hf"] = sw["throughput_tok_s"] / hf["throughput_tok_s"]
    return cell


def _targets(result: dict) -> dict:
    """The issue's targets, as measured (a ratio and whether it is met)."""
    cells, runs = result["cells"], result["runs"]
    worst = {}
    for key, goal in (("vs_best", 0.95), ("vs_hf", 0.95)):
        vals = [c[k] for c in cells for k in c if k.startswith("auto-") and k.endswith(key)]
        worst[f"auto_{key}_min"] = {"value": min(vals) if vals else None, "goal": goal,
                                    "met": bool(vals) and min(vals) >= goal}
    longest = max(c["prompt_tokens"] for c in cells) if cells else None
    at = [c["swap-ddr_vs_hf"] for c in cells if c["prompt_tokens"] == longest and
          "swap-ddr_vs_hf" in c]
    worst["swap_vs_recompute_at_longest"] = {"prompt_tokens": longest,
                                             "value": min(at) if at else None, "goal": 1.3,
                                             "met": bool(at) and min(at) >= 1.3}
    failed = sum(r["failed_requests"] for r in runs)
    differ = sum(r.get("differing_tokens", 0) for r in runs)
    worst["failed_requests"] = {"value": failed, "goal": 0, "met": failed == 0}
    worst["differing_tokens"] = {"value": differ, "goal": 0, "met": differ == 0}
    return worst


def serving_plot(result: dict, path: Path) -> Path:
    """Throughput against prompt length per policy (one panel per pool size), the
    unconstrained run for reference and the predicted swap/recompute crossover per tier."""
    from tierattn.eval.plots import _pyplot

    plt = _pyplot()
    pools = sorted({r["pool"] for r in result["runs"] if r["policy"] != "unconstrained"})
    fig, axes = plt.subplots(1, len(pools), figsize=(6.4 * len(pools), 4.4), squeeze=False)
    styles = {"unconstrained": ("black", ":"), "hf-recompute": ("tab:red", "-"),
              "swap-ddr": ("tab:green", "-"), "swap-ddr+disk": ("tab:blue", "-"),
              "auto-ddr": ("tab:olive", "--"), "auto-ddr+disk": ("tab:purple", "--")}
    lengths = sorted({r["prompt_tokens"] for r in result["runs"]})
    for ax, pool in zip(axes[0], pools):
        for policy, (color, ls) in styles.items():
            rows = sorted((r for r in result["runs"] if r["policy"] == policy and
                           r["pool"] in ((1.0,) if policy == "unconstrained" else (pool,))),
                          key=lambda r: r["prompt_tokens"])
            if rows:
                ax.plot([r["prompt_tokens"] for r in rows],
                        [r["throughput_tok_s"] for r in rows], marker="o", color=color, ls=ls,
                        label=policy)
        notes = []
        for kind, c in (result.get("crossover") or {}).items():
            x = c.get("tokens")
            if x is not None and lengths[0] <= x <= lengths[-1]:
                ax.axvline(x, color="gray", lw=1, ls="-.")
                ax.annotate(f"predicted crossover ({kind}): {x} tokens", (x, 0.02),
                            xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                            color="gray", ha="right", va="bottom")
            elif c["status"] != "unmeasured":
                notes.append(f"{kind}: {c['status']}" + (f" from {x} tokens" if x else
                                                         " at every length"))
        if notes:
            ax.text(0.02, 0.02, "cost model: swap via " + "; ".join(notes),
                    transform=ax.transAxes, fontsize=7, color="gray")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(x) for x in lengths])
        ax.set(xlabel="prompt tokens per request", ylabel="generated tokens / s",
               title=f"KV pool = {pool:.0%} of what the requests need", ylim=(0, None))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(f"SmolLM2-135M, continuous batching, {result['spec']['requests']} requests "
                 "(CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def serving_summary(result: dict) -> str:
    """The table printed after a run, the targets and where the files are."""
    cols = [("prompt", "prompt_tokens", "d"), ("pool", "pool", ".2f"),
            ("policy", "policy", "s"), ("tok/s", "throughput_tok_s", ".1f"),
            ("TTFT p50 s", "ttft_p50_s", ".2f"), ("TTFT p99 s", "ttft_p99_s", ".2f"),
            ("ITL p50 ms", "itl_p50_ms", ".1f"), ("ITL p99 ms", "itl_p99_ms", ".1f"),
            ("recomputed tok", "recomputed_tokens", "d"), ("swapped", "swapped_out", "d"),
            ("stored MB", "stored_mb", ".1f"), ("failed", "failed_requests", "d"),
            ("differ", "differing_tokens", "d")]
    rows = [{**r, "itl_p50_ms": 1e3 * r["itl_p50_s"] if r["itl_p50_s"] else None,
             "itl_p99_ms": 1e3 * r["itl_p99_s"] if r["itl_p99_s"] else None,
             "stored_mb": sum(r["stored_bytes"].values()) / 1e6} for r in result["runs"]]
    lines = [format_table(rows, cols), "", "targets:"]
    for name, t in result["targets"].items():
        v = t["value"]
        lines.append(f"  {name}: {v if not isinstance(v, float) else round(v, 3)} "
                     f"(goal {t['goal']}) {'met' if t['met'] else 'NOT met'}")
    for kind, c in (result.get("crossover") or {}).items():
        lines.append(f"  cost model, swap via {kind}: " + (
            f"cheaper than recompute from {c['tokens']} tokens on" if c.get("tokens") else
            c["status"] + (" at every length" if c["status"] != "unmeasured" else "")))
    if result.get("out"):
        lines.append(f"\nresults: {result['out']}/results.json, cells.csv, runs.csv, "
                     "calibration.json")
    lines += [f"plot: {p}" for p in result.get("plots", [])]
    return "\n".join(lines)
