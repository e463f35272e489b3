"""``tierattn bench remote``: a returning conversation served by another vLLM instance through
the remote store, against prefilling it again and against the first instance's own DDR hit;
and the remote store's bandwidth against Mooncake's own client on the same bytes. One run.

Runs inside vLLM's environment with Mooncake Store installed (docs/serving.md). It starts a
Mooncake Store on 127.0.0.1 (a master and a ``mooncake_client`` lending the pool its memory,
:class:`LocalMooncake`), then three engines on SmolLM2-135M (the offline GGUF), each in its own
process:

* ``store``: serves turn 1 of every conversation (histories of ``histories`` tokens), so its
  blocks go to its DDR tier and to the store; pushes them out of vLLM's own cache with filler
  prompts; then serves each conversation's returning turn (history + answer + follow-up):
  the same instance's DDR hit;
* ``remote``: a fresh instance with empty tiers serves the returning turns: the history is
  loaded from the store;
* ``prefill``: a fresh instance without tierattn serves them: the history is prefilled again.

Every returning turn's time to first token is measured (one request at a time), and the
tokens of the three instances compared. ``cross_instance_ttft_speedup`` is the re-prefill TTFT
over the remote-load TTFT (p50 over the turns of 1K+-token histories).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tierattn.config import RemoteConfig
from tierattn.storage.remote import BATCH_KEYS

__all__ = ["LocalMooncake", "RemoteBenchSpec", "free_port", "mooncake_importable",
           "remote_summary", "run_remote_bench"]

BIN = Path(sys.executable).parent
MASTER, POOL = BIN / "mooncake_master", BIN / "mooncake_client"
#: the environment every Mooncake process and client of a one-machine run gets: loopback only
LOOPBACK = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def mooncake_importable() -> bool:
    """Mooncake's client imports (its binaries need Debian's libibverbs1) and its master and
    pool client are installed next to this interpreter."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError:
        return False
    return MASTER.exists() and POOL.exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{proc.args[0]} did not listen on 127.0.0.1:{port}")


class LocalMooncake:
    """A Mooncake Store on this machine, every socket on 127.0.0.1 and every port free: a
    ``mooncake_master`` with its HTTP metadata server and, with ``pool_mib``, a
    ``mooncake_client`` lending the pool that much memory (so values outlive the clients that
    wrote them). :meth:`stop` ends both by their PIDs.

    Args:
        log: the master's log file (the pool's goes beside it, ``.pool.log``).
        pool_mib: memory the pool client lends (0: none; clients must then lend their own).
    """

    def __init__(self, log: Path, pool_mib: int = 0) -> None:
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.proc = subprocess.Popen(
            [str(MASTER), "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics}", "--default_kv_lease_ttl=200"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=LOOPBACK)
        self.pool = None
        try:
            _wait_listening(self.rpc, self.proc)
            _wait_listening(self.http, self.proc)
            if pool_mib:
                port = free_port()
                self.pool = subprocess.Popen(
                    [str(POOL), f"--global_segment_size={pool_mib}MB", "--host=127.0.0.1",
                     f"--port={port}", "--protocol=tcp",
                     f"--master_server_address=127.0.0.1:{self.rpc}",
                     f"--metadata_server=http://127.0.0.1:{self.http}/metadata"],
                    stdout=log.with_suffix(".pool.log").open("w"), stderr=subprocess.STDOUT,
                    env=LOOPBACK)
                _wait_listening(port, self.pool)
        except BaseException:
            self.stop()
            raise

    def config(self, **kw) -> RemoteConfig:
        """A :class:`RemoteConfig` of this store (small segment and buffer, 1 s deadline,
        unless ``kw`` says otherwise)."""
        kw = {"segment_gib": 0.0625, "buffer_mib": 32, "deadline_s": 1.0, "retry_s": 2.0, **kw}
        return RemoteConfig(master=f"127.0.0.1:{self.rpc}",
                            metadata=f"http://127.0.0.1:{self.http}/metadata", **kw)

    def key_count(self) -> int:
        """Objects the store holds now (the master's ``master_key_count`` metric)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("master_key_count "):
                    return int(float(line.split()[1]))
        raise RuntimeError("the master reports no master_key_count metric")

    def stop(self) -> None:
        for proc in (self.pool, self.proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    def __enter__(self) -> LocalMooncake:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(frozen=True)
class RemoteBenchSpec:
    """What :func:`run_remote_bench` measures (the defaults are the committed run).

    Attributes:
        histories: history lengths in tokens; ``conversations`` of each.
        answer_tokens, followup_tokens: turn 1's answer; the returning turn's new prompt
            tokens (it generates ``answer_tokens`` again).
        block_size: vLLM's block (and stored chunk) size in tokens.
        pool_mib: memory the store's pool lends.
        bandwidth_mib: bytes moved by each bandwidth measurement (in blocks of the model's
            size), best of ``bandwidth_repeats``.
        seed: where the windows of offline text start.
    """

    histories: tuple[int, ...] = (1024, 2048)
    conversations: int = 4
    answer_tokens: int = 16
    followup_tokens: int = 32
    block_size: int = 128
    pool_mib: int = 2048
    bandwidth_mib: int = 128
    bandwidth_repeats: int = 4
    seed: int = 0

    @classmethod
    def smoke(cls) -> RemoteBenchSpec:
        return cls(histories=(512,), conversations=2, answer_tokens=4, followup_tokens=16,
                   pool_mib=512, bandwidth_mib=16, bandwidth_repeats=1)

    def max_len(self) -> int:
        """The longest request: a returning turn, whole blocks."""
        need = max(self.histories) + 2 * self.answer_tokens + self.followup_tokens
        return -(-need // self.block_size) * self.block_size

    def kv_tokens(self) -> int:
        """vLLM's KV cache: one returning turn and two blocks (histories are pushed out of
        it)."""
        return self.max_len() + 2 * self.block_size


def _workload(spec: RemoteBenchSpec, ids: list[int]) -> dict:
    pos = [spec.seed * 97 % 64]

    def window(n: int) -> list[int]:
        if pos[0] + n > len(ids):
            pos[0] = 0
        out = ids[pos[0]:pos[0] + n]
        pos[0] += n
        return out

    convs = [(h, window(h), window(spec.followup_tokens)) for h in spec.histories
             for _ in range(spec.conversations)]
    fillers = [window(max(spec.histories)) for _ in range(3)]
    return {"conversations": convs, "fillers": fillers}


def _one_engine(role: str, spec: RemoteBenchSpec, model: Path, work: dict, remote: dict | None,
                answers: list | None) -> dict:
    """One instance (in its own process): ``store``, ``remote`` or ``prefill``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tierattn.config import SwapConfig
    from tierattn.eval.bench.vllm import _kv_bytes_per_token
    from tierattn.models.vllm import vllm_kv_transfer_config

    config = None
    if role != "prefill":
        swap = SwapConfig(tiers=("ddr",), policy="swap", remote=RemoteConfig(**remote))
        config = vllm_kv_transfer_config(swap, prompt_only=False, block_size=spec.block_size)
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=spec.max_len(), block_size=spec.block_size, seed=spec.seed,
              kv_cache_memory_bytes=spec.kv_tokens() * _kv_bytes_per_token(model),
              disable_log_stats=False, kv_transfer_config=config)

    def run(prompts: list[list[int]], n: int):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)

    out: dict = {"role": role}
    try:
        _serve(llm, run, role, spec, work, answers, out)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


def _serve(llm, run, role: str, spec: RemoteBenchSpec, work: dict, answers: list | None,
           out: dict) -> None:
    from tierattn.eval.bench.vllm import _metrics

    convs = work["conversations"]
    if role == "store":
        first = run([c[1] for c in convs], spec.answer_tokens)
        answers = [list(r.outputs[0].token_ids) for r in first]
        run(work["fillers"], 1)  # the histories leave vLLM's own cache: its tiers hold them
    out["answers"] = answers
    before = _metrics(llm)
    turns = []
    for (h, history, follow), answer in zip(convs, answers):
        r = run([history + answer + follow], spec.answer_tokens)[0]
        turns.append({"history": h, "ttft_s": r.metrics.first_token_latency,
                      "cached_tokens": r.num_cached_tokens,
                      "tokens": list(r.outputs[0].token_ids)})
    out["turns"] = turns
    after = _metrics(llm)
    out["metrics"] = {k: v - before.get(k, 0) for k, v in after.items()
                      if "tierattn" in k and v - before.get(k, 0)}


def _bandwidth(store: LocalMooncake, spec: RemoteBenchSpec, block_bytes: int) -> dict:
    """The store's put and get of ``bandwidth_mib`` in blocks of ``block_bytes``, through
    :class:`~tierattn.storage.remote.RemoteStore` (framed, checksummed) and through Mooncake's
    own client (``put_batch``/``get_batch`` of the raw bytes), in the same run, best of
    ``bandwidth_repeats`` (the two alternate going first)."""
    from tierattn.storage.remote import RemoteStore

    n = max(1, (spec.bandwidth_mib << 20) // block_bytes)
    payloads = [os.urandom(block_bytes) for _ in range(n)]
    nbytes = n * block_bytes
    cfg = store.config(segment_gib=0.0, buffer_mib=2 * spec.bandwidth_mib + 64, deadline_s=60.0)
    out: dict = {"blocks": n, "block_bytes": block_bytes, "bytes": nbytes}
    with RemoteStore(cfg) as ours:
        raw = ours._client  # Mooncake's own client, the same connection
        best: dict[str, float] = {}
        for rep in range(spec.bandwidth_repeats):
            keys = [f"tierattn/bench/{rep}/{i}" for i in range(n)]
            raw_keys = [f"raw/bench/{rep}/{i}" for i in range(n)]
            order = [("raw_put", raw.put_batch, (raw_keys, payloads)),
                     ("tier_put", ours.put, (keys, payloads)),
                     ("raw_get", raw.get_batch, (raw_keys,)), ("tier_get", ours.get, (keys,))]
            if rep % 2:  # who goes first alternates: neither gains from a warmer pool
                order = [order[1], order[0], order[3], order[2]]
            for name, fn, args in order:
                t0 = time.perf_counter()
                got = fn(*args)
                seconds = time.perf_counter() - t0
                ok = (got == 0) if name == "raw_put" else all(got) if name == "tier_put" else \
                    all(len(g) == block_bytes for g in got) if name == "raw_get" else \
                    all(g is not None and len(g) == block_bytes for g in got)
                if not ok:
                    raise RuntimeError(f"{name} failed in the bandwidth run ({ours.stats()})")
                best[name] = min(best.get(name, float("inf")), seconds)
    for name, seconds in best.items():
        out[name + "_GBps"] = nbytes / seconds / 1e9
    out["put_ratio"] = out["tier_put_GBps"] / out["raw_put_GBps"]
    out["get_ratio"] = out["tier_get_GBps"] / out["raw_get_GBps"]
    return out


def tier_bandwidth(store: LocalMooncake, *, page_shape: tuple[int, ...], dtype: str,
                   pages: int, repeats: int) -> dict:
    """The remote tier of a cache (:class:`~tierattn.storage.tiers.RemoteTier`): one layer's
    write of ``pages`` pages in one batch (what a demotion puts) and their read into a host
    buffer (what staging gets, checked), against Mooncake's own ``put_batch``/``get_batch`` of
    the same pages' bytes, in the same run, best of ``repeats`` (the two alternate going
    first)."""
    import torch

    from tierattn.storage.tiers import RemoteTier

    dtype = getattr(torch, dtype)
    page_bytes = math.prod(page_shape) * dtype.itemsize
    cfg = store.config(segment_gib=0.0, buffer_mib=2 * (pages * page_bytes >> 20) + 64,
                       deadline_s=60.0)
    data = torch.randn(pages, *page_shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    raw_payloads = [data[i].reshape(-1).view(torch.uint8).numpy() for i in range(pages)]
    slots, starts = list(range(pages)), [page_shape[1] * i for i in range(pages)]
    out = torch.empty_like(data)
    tier = RemoteTier(1, pages, tuple(page_shape), dtype, cfg, "bench")
    best: dict[str, float] = {}
    try:
        raw = tier.store._client  # Mooncake's own client, the same connection
        for rep in range(repeats):
            keys = [f"raw/tier-bench/{rep}/{i}" for i in range(pages)]
            order = [("raw_put", lambda keys=keys: raw.put_batch(keys, raw_payloads) == 0),
                     ("tier_write", lambda: tier.write(0, slots, data, starts) or True),
                     ("raw_get", lambda keys=keys: all(len(g) == page_bytes
                                                       for g in raw.get_batch(keys))),
                     ("tier_read", lambda: tier.read_into(0, slots, starts, out, slots) or True)]
            if rep % 2:
                order = [order[1], order[0], order[3], order[2]]
            for name, fn in order:
                t0 = time.perf_counter()
                if not fn():
                    raise RuntimeError(f"{name} failed in the tier bandwidth run")
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            if not torch.equal(out, data):
                raise RuntimeError("the remote tier read back other bytes than it wrote")
            raw.batch_remove(keys, True)
            tier.release(0, slots)
    finally:
        tier.close()
    nbytes = pages * page_bytes
    res = {"pages": pages, "page_bytes": page_bytes, "bytes": nbytes,
           **{name + "_GBps": nbytes / sec / 1e9 for name, sec in best.items()}}
    res["write_ratio"] = res["tier_write_GBps"] / res["raw_put_GBps"]
    res["read_ratio"] = res["tier_read_GBps"] / res["raw_get_GBps"]
    return res


def _kv_heads_dim(folder: Path) -> tuple[int, int]:
    """``(KV heads, head dim)`` of the model in ``folder``, from its config."""
    c = json.loads((folder / "config.json").read_text())
    return (c.get("num_key_value_heads") or c["num_attention_heads"],
            c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _summarise(spec: RemoteBenchSpec, runs: dict, bandwidth: dict, tier: dict,
               vllm_version: str) -> dict:
    ref = [t["tokens"] for t in runs["prefill"]["turns"]]
    differing = sum(a != b for role in ("store", "remote")
                    for a, b in zip((t["tokens"] for t in runs[role]["turns"]), ref))
    cells = []
    for h in spec.histories:
        ttft = {role: [t["ttft_s"] for t in runs[role]["turns"] if t["history"] == h]
                for role in runs}
        cells.append({"history": h, "ttft_prefill_p50_s": _p50(ttft["prefill"]),
                      "ttft_remote_p50_s": _p50(ttft["remote"]),
                      "ttft_ddr_p50_s": _p50(ttft["store"]),
                      "remote_speedup": _p50(ttft["prefill"]) / _p50(ttft["remote"]),
                      "ddr_speedup": _p50(ttft["prefill"]) / _p50(ttft["store"])})
    long = [h for h in spec.histories if h >= 1024] or list(spec.histories)
    pre = [t["ttft_s"] for t in runs["prefill"]["turns"] if t["history"] in long]
    rem = [t["ttft_s"] for t in runs["remote"]["turns"] if t["history"] in long]
    speedup = _p50(pre) / _p50(rem)
    loaded = runs["remote"]["metrics"].get("vllm:tierattn_loaded_slots[remote]", 0)
    targets = [
        {"target": "cross-instance returning-turn TTFT >= 2x lower than re-prefill "
                   f"(p50, histories {','.join(map(str, long))})",
         "value": f"{speedup:.2f}x", "met": speedup >= 2.0},
        {"target": "the remote tier's write >= 0.7x Mooncake's own put of the same bytes",
         "value": f"{bandwidth['put_ratio']:.2f}x", "met": bandwidth["put_ratio"] >= 0.7},
        {"target": "the remote tier's read >= 0.7x Mooncake's own get of the same bytes",
         "value": f"{bandwidth['get_ratio']:.2f}x", "met": bandwidth["get_ratio"] >= 0.7},
        {"target": "a cache's remote tier writes pages >= 0.7x as fast as Mooncake's own put "
                   "of their bytes", "value": f"{tier['write_ratio']:.2f}x",
         "met": tier["write_ratio"] >= 0.7},
        {"target": "a cache's remote tier reads pages >= 0.7x as fast as Mooncake's own get",
         "value": f"{tier['read_ratio']:.2f}x", "met": tier["read_ratio"] >= 0.7},
        {"target": "0 differing tokens (the store's and the remote instance's returning turns "
                   "against re-prefill)", "value": str(differing), "met": differing == 0},
        {"target": "the remote instance loaded the histories from the store",
         "value": f"{int(loaded)} blocks", "met": loaded > 0},
    ]
    return {"spec": dataclasses.asdict(spec), "vllm": vllm_version, "cells": cells,
            "cross_instance_ttft_speedup": speedup, "differing_tokens": differing,
            "bandwidth": bandwidth, "page_tier": tier, "targets": targets,
            "runs": {role: {"metrics": r["metrics"],
                            "turns": [{k: v for k, v in t.items() if k != "tokens"}
                                      for t in r["turns"]]} for role, r in runs.items()}}


def run_remote_bench(spec: RemoteBenchSpec = RemoteBenchSpec(), *,
                     out_root: str | Path = "results", model_dir: str | Path | None = None
                     ) -> dict:
    """The three instances and the bandwidth cell; returns (and writes) the results."""
    from tqdm import tqdm

    import vllm

    from tierattn.eval.bench.vllm import (_kv_bytes_per_token, _texts_ids, export_smollm2,
                                          run_in_process)
    from tierattn.eval.report import new_results_dir, save_json, write_csv

    cache = Path(model_dir or Path(tempfile.gettempdir()) / "tierattn-smollm2-f32")
    model = export_smollm2(cache)
    work = _workload(spec, _texts_ids(model))
    out = new_results_dir(out_root, "remote-smollm2-h" + "_".join(map(str, spec.histories)) +
                          f"-c{spec.conversations}")
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="tierattn-remote-") as tmp, \
            LocalMooncake(Path(tmp) / "master.log", pool_mib=spec.pool_mib) as store:
        remote = dataclasses.asdict(store.config(segment_gib=0.0, buffer_mib=256))
        (Path(tmp) / "work.json").write_text(json.dumps(work))
        answers = None
        for role in tqdm(("store", "remote", "prefill"), desc="remote bench", unit="instance"):
            (Path(tmp) / "answers.json").write_text(json.dumps(answers))
            runs[role] = run_in_process("tierattn.eval.bench.remote", role, [
                "--spec", json.dumps(dataclasses.asdict(spec)), "--model", str(model),
                "--work", str(Path(tmp) / "work.json"), "--remote", json.dumps(remote),
                "--answers", str(Path(tmp) / "answers.json")], Path(tmp) / f"{role}.json")
            answers = runs[role]["answers"]
        block_bytes = _kv_bytes_per_token(model) * spec.block_size
        bandwidth = _bandwidth(store, spec, block_bytes)
        # a TieredKVCache's pages of this model: 16 tokens, one layer's K and V
        page = (2, 16, *_kv_heads_dim(model))
        tier = tier_bandwidth(store, page_shape=page, dtype="float32",
                              pages=min(BATCH_KEYS, max(1, (spec.bandwidth_mib << 20) //
                                                        (4 * math.prod(page)))),
                              repeats=spec.bandwidth_repeats)
    result = _summarise(spec, runs, bandwidth, tier, vllm.__version__)
    result["out"] = str(out)
    result["model"] = str(model)
    save_json(result, out / "results.json", quiet=True)
    write_csv(result["cells"], out / "cells.csv")
    return result


def remote_summary(result: dict) -> str:
    """The printed report: TTFT per history and instance, the bandwidth cell, the targets."""
    from tierattn.eval.report import format_table, target_lines

    lines = ["Returning turn's time to first token, p50 (s): re-prefill on a fresh instance, "
             "remote load on a fresh instance, DDR hit on the instance that served turn 1:",
             format_table(result["cells"], [
                 ("history", "history", "d"), ("prefill", "ttft_prefill_p50_s", ".3f"),
                 ("remote", "ttft_remote_p50_s", ".3f"), ("ddr", "ttft_ddr_p50_s", ".3f"),
                 ("remote x", "remote_speedup", ".2f"), ("ddr x", "ddr_speedup", ".2f")])]
    bw = result["bandwidth"]
    lines += ["", f"Store bandwidth ({bw['blocks']} blocks of {bw['block_bytes'] >> 10} KiB, "
              f"best of {result['spec']['bandwidth_repeats']}): put {bw['tier_put_GBps']:.2f} "
              f"GB/s vs Mooncake's own {bw['raw_put_GBps']:.2f} ({bw['put_ratio']:.2f}x); get "
              f"{bw['tier_get_GBps']:.2f} vs {bw['raw_get_GBps']:.2f} ({bw['get_ratio']:.2f}x)"]
    pt = result["page_tier"]
    lines += [f"A cache's remote tier ({pt['pages']} pages of {pt['page_bytes'] >> 10} KiB, one "
              f"batch): write {pt['tier_write_GBps']:.2f} GB/s vs Mooncake's own put "
              f"{pt['raw_put_GBps']:.2f} ({pt['write_ratio']:.2f}x); read "
              f"{pt['tier_read_GBps']:.2f} vs get {pt['raw_get_GBps']:.2f} "
              f"({pt['read_ratio']:.2f}x)"]
    lines += target_lines(result["targets"])
    if result.get("out"):
        lines.append(f"\nresults: {result['out']}/results.json, cells.csv")
    return "\n".join(lines)


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--one", "--spec", "--model", "--work", "--remote", "--answers", "--dst"):
        p.add_argument(flag)
    a = p.parse_args()
    raw = json.loads(a.spec)
    spec = RemoteBenchSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    work = json.loads(Path(a.work).read_text())
    answers = json.loads(Path(a.answers).read_text())
    res = _one_engine(a.one, spec, Path(a.model), work, json.loads(a.remote), answers)
    Path(a.dst).write_text(json.dumps(res))


if __name__ == "__main__":
    _main()
