"""The ``tierattn`` command line: the subcommands that work, each with its own ``--help``.

    tierattn demo                     kernel demo: evict vs offload at a 25% HBM budget
    tierattn loop                     multi-layer decode loop of the tiered runtime
    tierattn eval reasoning           eviction vs offload on the tiny reasoner (--task long)
    tierattn eval qa                  the same on any HF checkpoint and a JSONL of questions
    tierattn eval fidelity            SmolLM2-135M: KL, top-1, perplexity, passkeys
    tierattn eval keytier             SmolLM2: the attention each recall selector misses
    tierattn bench kv                 data moved per token vs whole-layer offload, modeled GPUs
    tierattn bench hostcost           the runtime's Python cost per layer and decode step
    tierattn bench host               split attention's host kernel vs a plain read
    tierattn bench disk               the disk tier vs the folder's raw bandwidth
    tierattn bench serving            continuous batching: recompute vs swap vs auto
    tierattn bench vllm               vLLM (its own environment): recompute vs the tiers
    tierattn bench vllm-hotset        vLLM: tierattn's hot set vs vLLM on one pool
    tierattn bench remote             vLLM: another instance loads a conversation from Mooncake
    tierattn bench gpu --out DIR      the prepared check of every GPU figure (needs CUDA)
    tierattn train --out DIR          train a tiny reasoner (--task long: the long one)
    tierattn models                   every causal-LM type of transformers, patched
    tierattn autotune --kernel K      tune a kernel on this GPU
    tierattn serve -- ARGS            `transformers serve ARGS` with tierattn.swap
    tierattn vllm-args                `vllm serve` flags that serve with the hot set
    tierattn info                     versions, machine, backend, the checkout's commit

Spellings of the previous release (``tierattn bench --disk``, ``tierattn eval reasoning --data``)
still work, with a deprecation message, until 0.2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tierattn.eval import commands
from tierattn.eval.commands import UsageError


#: the serving bench's runs (tierattn.eval.bench.serving.POLICIES but the reference, listed here so
#: --help imports no torch)
SERVING_POLICIES = ("hf-recompute", "swap-ddr", "swap-ddr+disk", "auto-ddr", "auto-ddr+disk")
#: the eval's methods (tierattn.eval.evals.methods.METHODS, listed here so --help imports no torch)
METHOD_NAMES = ("full", "offload", "split", "topk", "adaptive", "topk-max", "topk-quest",
                "evict-h2o", "evict-snapkv", "evict-snapkv-decode", "evict-rkv",
                "evict-streaming", "evict-random", "oracle")

#: ``tierattn bench`` subcommands
BENCHES = ("kv", "hostcost", "host", "disk", "serving", "vllm", "vllm-hotset", "remote", "gpu")
DTYPES = ("bf16", "fp16", "fp32")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2), without the usage."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse's hook
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


class _PassThrough(_Parser):
    """A subcommand that hands all its arguments, ``--help`` included, to a module's own
    ``main(argv, prog)`` (the GPU check, the reasoner's training): ``args.rest``."""

    def parse_known_args(self, args=None, namespace=None):
        namespace = namespace if namespace is not None else argparse.Namespace()
        namespace.rest = list(args or [])
        for key, value in self._defaults.items():
            setattr(namespace, key, value)
        return namespace, []


def _pass_through(subparsers, name: str, **kwargs) -> argparse.ArgumentParser:
    subparsers._parser_class = _PassThrough  # argparse builds every subparser from this class
    try:
        return subparsers.add_parser(name, add_help=False, **kwargs)
    finally:
        subparsers._parser_class = _Parser


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def _float_in(lo: float, hi: float, *, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not ((lo < v if lo_open else lo <= v) and v <= hi):
            side = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(f"must lie in {side}{lo}, {hi}], got {v}")
        return v
    parse.__name__ = "number"
    return parse


def _budget(text: str) -> int | float:
    """Tokens when the text is an integer (>= 0), a fraction in [0, 1] otherwise."""
    if any(c in text for c in ".eE"):
        return _float_in(0.0, 1.0)(text)
    return _int_at_least(0)(text)


def _list(item):
    def parse(text: str) -> tuple:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError("must be a comma-separated list, got nothing")
        return tuple(item(p.strip()) for p in parts)
    parse.__name__ = "list"
    return parse


_floats = _list(_float_in(0.0, 1.0, lo_open=True))  # HBM ratios / hot budgets: (0, 1]


def _span(text: str) -> tuple[int, int]:
    """``LO,HI``: two integers >= 1 with LO <= HI."""
    got = _list(_int_at_least(1))(text)
    if len(got) != 2 or got[0] > got[1]:
        raise argparse.ArgumentTypeError(f"must be LO,HI with 1 <= LO <= HI, got {text!r}")
    return got
_ints = _list(_int_at_least(1))


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        got = tuple(p.strip() for p in text.split(",") if p.strip())
        bad = [g for g in got if g not in allowed]
        if bad or not got:
            raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'nothing'} not among "
                                             f"{','.join(allowed)}")
        return got
    parse.__name__ = "list"
    return parse


def _device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, available on this machine."""
    import torch

    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and
                                                                          index):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA device; use cpu")
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text}: this machine has {torch.cuda.device_count()} CUDA devices")
    return text


def _out_file(text: str) -> str:
    """A file to write: its folder must exist (nothing is created silently)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name in it")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {path.parent} does not exist; create it "
                                         "first or write elsewhere")
    return text


def _existing(kind: str):
    def parse(text: str) -> str:
        path = Path(text)
        ok = path.is_dir() if kind == "folder" else path.is_file()
        if not ok:
            raise argparse.ArgumentTypeError(f"no {kind} {text}")
        return text
    parse.__name__ = kind
    return parse


def _command(name: str):
    """The subcommand's body in :mod:`tierattn.eval.commands` (which imports torch and the rest
    only when a command runs: ``--help`` stays fast)."""
    return getattr(commands, name)


def _run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the commands that write a results folder."""
    parser.add_argument("--threads", type=_int_at_least(1), default=None,
                        help="torch CPU threads")
    parser.add_argument("--out-root", default="results",
                        help="results go to a new folder under this one (default ./results)")


def _smoke(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--smoke", action="store_true", help=f"reduced sizes (CI's run): {what}")


def _add_eval(sub) -> None:
    ev = sub.add_parser("eval", help="accuracy and fidelity evals: eviction vs offload at equal "
                        "HBM budget", description="Accuracy and fidelity evals: eviction vs "
                        "offload at equal HBM bytes. `tierattn eval WHAT --help` for each.")
    esub = ev.add_subparsers(dest="what", required=True, parser_class=_Parser,
                             metavar="{reasoning,qa,fidelity,keytier}")

    def common(p, *, page_default: str, recall: str = "of the cold tokens") -> None:
        p.add_argument("--page-size", type=_int_at_least(1), default=None,
                       help=f"tokens per page (default {page_default})")
        p.add_argument("--recall", type=_float_in(0.0, 1.0, lo_open=True), default=None,
                       help=f"cold pages the topk methods recall per step, as a fraction {recall}"
                            ", in (0, 1] (default 0.25, tierattn.eval.evals.methods.RECALL)")
        p.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                       help="kernel backend (auto: Triton on CUDA, the torch reference on CPU)")
        _run_flags(p)

    def methods(p, budgets: str, chosen: str = "all of them") -> None:
        p.add_argument("--budgets", type=_floats, default=None,
                       help=f"comma-separated HBM ratios in (0, 1] (default {budgets})")
        p.add_argument("--methods", type=_choices(METHOD_NAMES), default=None,
                       help=f"comma-separated methods (full is always run; default: {chosen})")
        p.add_argument("--seed", type=int, default=None)

    r = esub.add_parser("reasoning", help="the tiny reasoner: eviction vs offload (default run "
                        "3-4 minutes; --full the whole study)")
    r.add_argument("--model", type=_existing("folder"), default=None,
                   help="a trained reasoner folder (default: the shipped one for --task)")
    r.add_argument("--n", type=_int_at_least(1), default=None,
                   help="items per task (default 400, --full 200)")
    r.add_argument("--full", action="store_true",
                   help="the whole study (every method, the HBM x eviction grid, the 1-hop and "
                        "filler controls; ~7.5 min on 2 cores) instead of the default run "
                        "(full, offload, topk, SnapKV, H2O, oracle; main task)")
    r.add_argument("--task", choices=("short", "long"), default="short",
                   help="short (24 chains, ~290-token prompts, the shipped reasoner) or long "
                        "(64 chains and fillers, 1016-1284-token prompts, the long reasoner)")
    r.add_argument("--teacher-forcing", action="store_true",
                   help="also teacher-force every cell on the gold answer for token KL and "
                        "top-1 agreement with the full cache (--full always does)")
    methods(r, "0.1,0.25,0.5,0.75", "full, offload, topk, evict-snapkv, evict-h2o, "
                             "oracle; --full: all of them")
    common(r, page_default="8: the 25%% budget needs small pages")
    r.set_defaults(func=_command("cmd_eval_reasoning"))

    q = esub.add_parser("qa", help="any local Hugging Face checkpoint on a JSONL of "
                        "question/answer pairs (GSM8K style)")
    q.add_argument("--model", type=_existing("folder"), required=True,
                   help="a Hugging Face checkpoint folder")
    q.add_argument("--data", type=_existing("file"), required=True,
                   help="JSONL of question/answer pairs")
    q.add_argument("--n", type=_int_at_least(1), default=None, help="items (default: all)")
    q.add_argument("--max-new-tokens", type=_int_at_least(1), default=256,
                   help="generation length (default 256)")
    methods(q, "0.25,0.5")
    common(q, page_default="16")
    q.set_defaults(func=_command("cmd_eval_qa"))

    f = esub.add_parser("fidelity", help="SmolLM2-135M (the offline GGUF): KL, top-1, "
                        "perplexity and passkeys against the full cache")
    f.add_argument("--contexts", type=_list(_int_at_least(256)), default=None,
                   help="context lengths in tokens (e.g. 2048,4096): text segments and passkey "
                        "prompts of that length (default: 448-token segments)")
    f.add_argument("--segments", type=_int_at_least(1), default=None,
                   help="text segments (default 8)")
    methods(f, "0.25,0.5")
    common(f, page_default="16")
    f.set_defaults(func=_command("cmd_eval_fidelity"))

    k = esub.add_parser("keytier", help="SmolLM2: the attention mass each recall selector "
                        "misses, per key-tier byte")
    k.add_argument("--contexts", type=_list(_int_at_least(256)), default=None,
                   help="segment lengths in tokens (default 2048)")
    k.add_argument("--segments", type=_int_at_least(1), default=None,
                   help="text segments (default 2)")
    common(k, page_default="16", recall="of the candidate pages")
    k.set_defaults(func=_command("cmd_eval_keytier"))


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks, each measured side by side in one run",
                           description="Benchmarks, each measured side by side in one run. "
                           "`tierattn bench WHAT --help` for each.")
    bsub = bench.add_subparsers(dest="what", required=True, parser_class=_Parser,
                                metavar="{" + ",".join(BENCHES) + "}")
    hardware = dict(action="append", type=_existing("file"), default=None, metavar="FILE",
                    help="an extra hardware profile JSON to model with (e.g. the "
                         "hardware-measured.json of a GPU check); repeatable")

    kv = bsub.add_parser("kv", help="exact data-movement counts per token (Llama-8B-shaped KV) "
                         "vs whole-layer and per-page offloading, modeled H100/H200 times, host "
                         "cost vs sdpa")
    _smoke(kv, "1K/4K contexts, 4 steps")
    kv.add_argument("--contexts", type=_ints, default=None,
                    help="comma-separated context lengths (default 4096,32768,131072)")
    kv.add_argument("--budgets", type=_floats, default=None,
                    help="comma-separated hot budgets (default 1.0,0.5,0.25,0.1)")
    kv.add_argument("--modes", type=_choices(("offload", "topk", "topk-sync")), default=None,
                    help="offload,topk,topk-sync (default all three)")
    kv.add_argument("--layers", type=_int_at_least(1), default=None,
                    help="layers simulated (default 2)")
    kv.add_argument("--steps", type=_int_at_least(1), default=None, help="decode steps counted")
    kv.add_argument("--batch", type=_int_at_least(1), default=None)
    kv.add_argument("--recall", type=_float_in(0.0, 1.0, lo_open=True), default=None,
                    help="topk recall budget (0.1)")
    kv.add_argument("--query-rho", type=_float_in(0.0, 1.0), default=None,
                    help="correlation of consecutive decode queries (default 0.9)")
    kv.add_argument("--seed", type=int, default=None)
    kv.add_argument("--hardware", **hardware)
    kv.add_argument("--no-host-cost", action="store_true",
                    help="skip the tiny reasoner's decode-step timing against sdpa")
    kv.add_argument("--device", type=_device, default=None)
    _run_flags(kv)
    kv.set_defaults(func=_command("cmd_bench_kv"))

    hc = bsub.add_parser("hostcost", help="the runtime's own work per layer and decode step "
                         "with kernels stubbed (dense, offload 50%%, topk at 4K/32K, batch 1/8)")
    _smoke(hc, "4K, batch 1")
    hc.add_argument("--contexts", type=_ints, default=None, help="context lengths")
    hc.add_argument("--batch", type=_int_at_least(1), default=None)
    hc.add_argument("--steps", type=_int_at_least(1), default=None, help="decode steps timed")
    _run_flags(hc)
    hc.set_defaults(func=_command("cmd_bench_hostcost"))

    host = bsub.add_parser("host", help="the host attention kernel (split attention's CPU side) "
                           "vs a plain read of the same pages and torch's sdpa, then the GPU "
                           "decode step modeled: offload vs topk vs split")
    _smoke(host, "4K/16K, batch 1/2, one repeat")
    host.add_argument("--contexts", type=_ints, default=None,
                      help="context lengths (default 4K-128K)")
    host.add_argument("--budgets", type=_floats, default=None,
                      help="the modeled hot budgets, below 1 (default 0.1,0.25)")
    host.add_argument("--hardware", **hardware)
    host.add_argument("--seed", type=int, default=None)
    _run_flags(host)
    host.set_defaults(func=_command("cmd_bench_host"))

    disk = bsub.add_parser("disk", help="the disk tier vs the raw sequential bandwidth of the "
                           "same folder: write, cold read, mixed spill/recall, and a 32K-context "
                           "spill and recall through the runtime")
    _smoke(disk, "256 and 1K pages, 2K context")
    disk.add_argument("--folder", type=_existing("folder"), default=None,
                      help="the folder measured (default: the system's temp folder)")
    disk.add_argument("--pages", type=_ints, default=None,
                      help="page counts (default 1024,4096,16384,65536)")
    _run_flags(disk)
    disk.set_defaults(func=_command("cmd_bench_disk"))

    srv = bsub.add_parser("serving", help="continuous batching under memory pressure on "
                          "SmolLM2-135M: transformers' recompute vs tierattn.swap into DDR, "
                          "DDR+disk and the cost model's choice")
    _smoke(srv, "two short prompt lengths, 8 requests")
    srv.add_argument("--prompt-lengths", type=_ints, default=None,
                     help="prompt tokens per cell (default 128,512,1024,2048)")
    srv.add_argument("--pools", type=_floats, default=None,
                     help="KV pool sizes as fractions of what the requests need (default 0.5)")
    srv.add_argument("--requests", type=_int_at_least(1), default=None,
                     help="requests per run (default 16)")
    srv.add_argument("--new-tokens", type=_span, default=None, metavar="LO,HI",
                     help="fewest and most new tokens per request (default 64,128)")
    srv.add_argument("--policies", type=_choices(SERVING_POLICIES), default=None,
                     help="which runs besides the unconstrained reference "
                          f"(default {','.join(SERVING_POLICIES)})")
    srv.add_argument("--seed", type=int, default=None)
    _run_flags(srv)
    srv.set_defaults(func=_command("cmd_bench_serving"))

    for name, text, smoke in (
            ("vllm", "vLLM on SmolLM2-135M, inside vLLM's environment: its recompute vs "
             "tierattn's tiers on a preemption-heavy batch and on returning conversations",
             "6 requests, 512-token histories"),
            ("vllm-hotset", "tierattn's hot set inside vLLM on SmolLM2-135M (vLLM's "
             "environment): 16 requests of 2K-token prompts on a quarter of the pool they need, "
             "vLLM alone vs exact and top-k; passkeys at 4K", "4 requests of 512 tokens")):
        v = bsub.add_parser(name, help=text)
        _smoke(v, smoke)
        v.add_argument("--requests", type=_int_at_least(1), default=None,
                       help="requests per run")
        _run_flags(v)
        v.set_defaults(func=_command("cmd_bench_" + name.replace("-", "_")))

    rem = bsub.add_parser("remote", help="two vLLM instances on SmolLM2-135M sharing a Mooncake "
                          "Store started on 127.0.0.1 (vLLM's environment, the [remote] extra): "
                          "a returning conversation loaded on the other instance vs re-prefill "
                          "vs the first instance's DDR hit; the store's bandwidth vs Mooncake's "
                          "own client")
    _smoke(rem, "512-token histories, 2 conversations")
    _run_flags(rem)
    rem.set_defaults(func=_command("cmd_bench_remote"))

    gpu = _pass_through(bsub, "gpu", help="the prepared check of every GPU figure: "
                          "correctness gate, kernel timings, autotuning, the measured hardware "
                          "profile (needs CUDA; `tierattn bench gpu --help`)")
    gpu.set_defaults(func=_command("cmd_bench_gpu"))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tierattn", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="kernel demo: evict vs offload at one HBM budget")
    demo.add_argument("--context", type=_int_at_least(1), default=1024,
                      help="tokens of context, a multiple of --page-size, at least 16 pages "
                           "(default 1024)")
    demo.add_argument("--page-size", type=_int_at_least(1), default=16)
    demo.add_argument("--hot-fraction", type=_float_in(0.0, 1.0, lo_open=True), default=0.25,
                      help="fraction of pages resident in HBM, in (0, 1] (default 0.25)")
    demo.add_argument("--recall-fraction", type=_float_in(0.0, 1.0, lo_open=True), default=0.10,
                      help="fraction of pages top-k recall may bring back (default 0.10)")
    demo.add_argument("--dtype", choices=DTYPES, default="bf16")
    demo.add_argument("--device", type=_device, default=None,
                      help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", type=_out_file, default=None,
                      help="also write the results as JSON to this file")
    demo.add_argument("--no-interpret", dest="interpret", action="store_false",
                      help="on CPU, use the torch reference backend instead of the Triton "
                           "interpreter")
    demo.set_defaults(func=_command("cmd_demo"))

    loop = sub.add_parser("loop", help="multi-layer decode loop over random KV in any preset; "
                          "prints the runtime's telemetry")
    loop.add_argument("--preset", default="offload",
                      choices=("dense", "offload", "topk", "evict-h2o", "evict-streaming",
                               "evict-snapkv"))
    loop.add_argument("--layers", type=_int_at_least(1), default=32)
    loop.add_argument("--q-heads", type=_int_at_least(1), default=32,
                      help="query heads, a multiple of --kv-heads (default 32)")
    loop.add_argument("--kv-heads", type=_int_at_least(1), default=8)
    loop.add_argument("--head-dim", type=_int_at_least(1), default=128)
    loop.add_argument("--batch", type=_int_at_least(1), default=1)
    loop.add_argument("--prompt", type=_int_at_least(0), default=1024,
                      help="prompt tokens (default 1024)")
    loop.add_argument("--steps", type=_int_at_least(0), default=16,
                      help="decode steps (default 16)")
    loop.add_argument("--page-size", type=_int_at_least(1), default=16)
    loop.add_argument("--hot-budget", type=_budget, default=None,
                      help="tokens (an integer) or a fraction of the context (default: preset)")
    loop.add_argument("--evict-budget", type=_budget, default=None)
    loop.add_argument("--dtype", choices=DTYPES, default="bf16")
    loop.add_argument("--device", type=_device, default=None)
    loop.add_argument("--backend", choices=("auto", "triton", "torch"), default="torch",
                      help="kernel backend (default torch: the reference, fast on CPU)")
    loop.add_argument("--out", type=_out_file, default=None,
                      help="also write the telemetry as JSON to this file")
    loop.add_argument("--no-interpret", dest="interpret", action="store_false")
    loop.set_defaults(func=_command("cmd_loop"))

    _add_eval(sub)
    _add_bench(sub)

    train = _pass_through(sub, "train", help="train a tiny reasoner (the shipped "
                           "ones were trained so; `tierattn train --help`)")
    train.set_defaults(func=_command("cmd_train"))

    models = sub.add_parser("models", help="every causal-LM type of the installed transformers "
                            "as a tiny random model: exact offload vs the model's own attention "
                            "(identical / refused with its structural reason / failed)")
    models.add_argument("--types", type=_list(str), default=None,
                        help="comma-separated model types (default: every one)")
    models.add_argument("--out-root", default="results",
                        help="results go to models-transformers-VERSION under this folder")
    models.set_defaults(func=_command("cmd_models"))

    tune = sub.add_parser("autotune", help="sweep a kernel's config space on this GPU and save "
                          "the winners for it (needs CUDA)")
    tune.add_argument("--kernel", required=True, choices=("decode", "score", "prefill", "copy"))
    tune.add_argument("--out", type=_out_file, default=None,
                      help="JSON to write/merge (default: the package's file for this GPU)")
    tune.add_argument("--seconds", type=_float_in(0.0, 1e9, lo_open=True), default=None,
                      help="stop the sweep after this many seconds (keeps the best so far)")
    tune.set_defaults(func=_command("cmd_autotune"))

    serve = sub.add_parser(
        "serve", help="`transformers serve` with tierattn.swap: preempted continuous-batching "
        "requests kept in the tiers, or recomputed, as the measured cost model decides",
        description="Runs `transformers serve ARGS` (after --) with tierattn.swap on every "
        "model it loads; pass --continuous-batching among ARGS.")
    serve.add_argument("--swap-tiers", type=_choices(("ddr", "cxl", "disk")), default=("ddr",),
                       help="where preempted requests' KV goes, fastest first (default ddr)")
    serve.add_argument("--swap-disk", default=None, metavar="DIR",
                       help="the disk tier's folder (with --swap-tiers ...,disk)")
    serve.add_argument("--swap-capacity-gib", type=_list(_float_in(0.0, 1e9)), default=None,
                       help="GiB per tier, in --swap-tiers order (default: DDR/CXL as large as "
                            "the KV pool, disk 4x)")
    serve.add_argument("--swap-policy", choices=("auto", "swap", "recompute"), default="auto",
                       help="auto: the cost model decides (default); swap; recompute")
    serve.add_argument("--swap-calibration", type=_existing("file"), default=None,
                       help="a calibration JSON (tierattn bench serving writes one); default: "
                            "probe the tiers at start")
    serve.add_argument("--swap-remote-master", default=None, metavar="HOST:PORT",
                       help="a Mooncake Store's master: preempted requests the tiers have no "
                            "room for go there (with --swap-remote-metadata)")
    serve.add_argument("--swap-remote-metadata", default=None, metavar="URL",
                       help="the store's metadata server, http://HOST:PORT/metadata")
    serve.add_argument("--swap-remote-host", default="127.0.0.1", metavar="ADDR",
                       help="the address the store's other clients reach this one at "
                            "(default 127.0.0.1: one machine)")
    serve.add_argument("serve_args", nargs=argparse.REMAINDER,
                       help="-- then the arguments of `transformers serve`")
    serve.set_defaults(func=_command("cmd_serve"))

    from tierattn.eval.vllm_args import add_vllm_args
    add_vllm_args(sub, _float_in, _int_at_least)

    info = sub.add_parser("info", help="versions, machine, backend and the checkout's commit")
    info.set_defaults(func=_command("cmd_info"))
    return parser


#: ``tierattn bench --FLAG`` of the previous release -> the subcommand that replaced it
OLD_BENCH_FLAGS = {"--host": "hostcost", "--host-attn": "host", "--disk": "disk",
                   "--serving": "serving", "--vllm": "vllm", "--vllm-hotset": "vllm-hotset"}


def _deprecated(argv: list[str]) -> list[str]:
    """The previous release's spellings rewritten to the subcommands, with a message on stderr
    (they go in 0.2): ``bench [--disk|--serving|...]`` and ``eval reasoning --data``."""
    if argv[:1] == ["bench"] and not (set(argv[1:2]) & {*BENCHES, "-h", "--help"}):
        modes = [a for a in argv[1:] if a in OLD_BENCH_FLAGS]
        if len(modes) > 1:
            raise UsageError(f"{modes[0]} and {modes[1]} are separate benchmarks; run them one "
                             f"at a time (tierattn bench {OLD_BENCH_FLAGS[modes[0]]})")
        what = OLD_BENCH_FLAGS[modes[0]] if modes else "kv"
        new = ["bench", what, *(a for a in argv[1:] if a not in modes)]
        old = " ".join(["tierattn", "bench", *modes])
    elif argv[:2] == ["eval", "reasoning"] and "--data" in argv:
        new, old, what = ["eval", "qa", *argv[2:]], "tierattn eval reasoning --data", "qa"
    else:
        return argv
    print(f"tierattn: `{old}` is deprecated and goes in 0.2; use `tierattn "
          f"{new[0]} {what}`", file=sys.stderr)
    return new


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error is one line on stderr and exit status 2."""
    from tierattn.errors import TierAttnError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(_deprecated(argv))
        return args.func(args)
    except (UsageError, TierAttnError) as e:
        command = " ".join(a for a in argv[:2] if not a.startswith("-"))
        print(f"tierattn {command}: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
