"""The ``tierattn`` command line. Only subcommands that work are listed.

    tierattn demo [--context N] [--out FILE]   kernel demo: evict vs offload at a 25% HBM budget
    tierattn loop [--preset P] [--out FILE]    multi-layer decode loop of the tiered runtime
    tierattn eval reasoning [--n N] [--out-root DIR]   eviction vs offload on the tiny reasoner
    tierattn eval reasoning --model DIR --data F.jsonl  the same on any HF checkpoint + JSONL
    tierattn eval fidelity [--out-root DIR]    SmolLM2-135M: KL, top-1, perplexity, passkey
    tierattn bench [--smoke] [--out-root DIR]  data movement per token vs whole-layer offload
    tierattn autotune --kernel decode|score|prefill|copy   tune a kernel on this GPU
    tierattn info                              versions, device, backend, interpreter mode
"""

from __future__ import annotations

import argparse
import json
import os
import sys


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
    from tierattn.eval.loop import main as loop_main

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


def _budget(text: str) -> int | float:
    """Tokens when the text is an integer, a fraction otherwise."""
    return float(text) if any(c in text for c in ".e") else int(text)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _cmd_eval(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "fidelity":
        from tierattn.eval.fidelity import FidelitySpec, run_fidelity, summary

        spec = FidelitySpec(budgets=args.budgets or (0.25, 0.5), segments=args.segments,
                            page_size=args.page_size, seed=args.seed or 0, backend=args.backend)
        print(summary(run_fidelity(spec, out_root=args.out_root)))
        return 0
    if args.data:
        from tierattn.eval.qa import run_qa, summary

        if not args.model:
            raise SystemExit("tierattn eval reasoning: --data needs --model (a local Hugging "
                             "Face checkpoint folder).")
        print(summary(run_qa(args.model, args.data, budgets=args.budgets or (0.25, 0.5),
                             n=args.n, max_new_tokens=args.max_new_tokens,
                             page_size=args.page_size, backend=args.backend, seed=args.seed or 0,
                             out_root=args.out_root)))
        return 0
    from tierattn.eval.reasoning import ReasoningSpec, run_reasoning, summary

    spec = ReasoningSpec(n=args.n or 200, budgets=args.budgets or (0.25, 0.5, 0.75),
                         page_size=args.page_size, backend=args.backend,
                         **({"seed": args.seed} if args.seed is not None else {}))
    print(summary(run_reasoning(spec, model_dir=args.model, out_root=args.out_root)))
    return 0


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from tierattn.eval.bench import BenchSpec, run_bench, summary

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.host:
        from tierattn.eval.bench import host_summary, run_host_bench

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierattn", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="kernel demo: evict vs offload at one HBM budget")
    demo.add_argument("--context", type=int, default=1024, help="tokens of context (default 1024)")
    demo.add_argument("--page-size", type=int, default=16)
    demo.add_argument("--hot-fraction", type=float, default=0.25,
                      help="fraction of pages resident in HBM (default 0.25)")
    demo.add_argument("--recall-fraction", type=float, default=0.10,
                      help="fraction of pages top-k recall may bring back (default 0.10)")
    demo.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default=None, help="also write the results as JSON to this file")
    demo.add_argument("--no-interpret", dest="interpret", action="store_false",
                      help="on CPU, use the torch reference backend instead of the Triton "
                           "interpreter")
    demo.set_defaults(func=_cmd_demo)

    loop = sub.add_parser("loop", help="multi-layer decode loop over random KV in any preset; "
                          "prints the runtime's telemetry")
    loop.add_argument("--preset", default="offload",
                      choices=("dense", "offload", "topk", "evict-h2o", "evict-streaming",
                               "evict-snapkv"))
    loop.add_argument("--layers", type=int, default=32)
    loop.add_argument("--q-heads", type=int, default=32)
    loop.add_argument("--kv-heads", type=int, default=8)
    loop.add_argument("--head-dim", type=int, default=128)
    loop.add_argument("--batch", type=int, default=1)
    loop.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    loop.add_argument("--steps", type=int, default=16, help="decoded tokens (default 16)")
    loop.add_argument("--page-size", type=int, default=16)
    loop.add_argument("--hot-budget", type=_budget, default=None,
                      help="tokens (int) or fraction (float) kept in HBM; default: the preset's")
    loop.add_argument("--evict-budget", type=_budget, default=None)
    loop.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    loop.add_argument("--device", default=None)
    loop.add_argument("--backend", choices=("auto", "triton", "torch"), default="torch",
                      help="kernel backend (default torch: the interpreter is slow on long loops)")
    loop.add_argument("--out", default=None, help="also write config + stats as JSON")
    loop.add_argument("--no-interpret", dest="interpret", action="store_false")
    loop.set_defaults(func=_cmd_loop)

    ev = sub.add_parser("eval", help="accuracy and fidelity evals: eviction vs offload at equal "
                        "HBM budget")
    ev.add_argument("what", choices=("reasoning", "fidelity"),
                    help="reasoning: the tiny reasoner (or --model/--data); fidelity: SmolLM2")
    ev.add_argument("--model", default=None,
                    help="reasoning: a trained reasoner folder (default: the shipped one), or "
                         "a Hugging Face checkpoint folder with --data")
    ev.add_argument("--data", default=None, help="JSONL of question/answer pairs (GSM8K style)")
    ev.add_argument("--n", type=int, default=None,
                    help="items per task (reasoning default 200; --data default: all)")
    ev.add_argument("--budgets", type=_floats, default=None,
                    help="comma-separated HBM ratios (reasoning default 0.25,0.5,0.75)")
    ev.add_argument("--segments", type=int, default=8, help="fidelity: text segments")
    ev.add_argument("--max-new-tokens", type=int, default=256, help="--data: generation length")
    ev.add_argument("--page-size", type=int, default=16)
    ev.add_argument("--seed", type=int, default=None)
    ev.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                    help="kernel backend (auto: Triton on CUDA, the torch reference on CPU)")
    ev.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ev.add_argument("--out-root", default="results",
                    help="results go to a new folder under this one (default ./results)")
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
    bench.add_argument("--contexts", type=_ints, default=None,
                       help="comma-separated context lengths (default 4096,32768,131072)")
    bench.add_argument("--budgets", type=_floats, default=None,
                       help="comma-separated hot budgets (default 1.0,0.5,0.25,0.1)")
    bench.add_argument("--modes", type=lambda t: tuple(t.split(",")), default=None,
                       help="offload,topk,topk-sync (default all three)")
    bench.add_argument("--layers", type=int, default=None, help="layers simulated (default 2)")
    bench.add_argument("--steps", type=int, default=None, help="decode steps counted")
    bench.add_argument("--batch", type=int, default=None)
    bench.add_argument("--recall", type=float, default=None, help="topk recall budget (0.1)")
    bench.add_argument("--query-rho", type=float, default=None,
                       help="correlation of consecutive decode queries (default 0.9)")
    bench.add_argument("--seed", type=int, default=None)
    bench.add_argument("--hardware", action="append", default=None, metavar="FILE",
                       help="an extra hardware profile JSON to model with (e.g. the "
                            "hardware-measured.json of a GPU check); repeatable")
    bench.add_argument("--no-host-cost", action="store_true",
                       help="skip the tiny reasoner's decode-step timing against sdpa")
    bench.add_argument("--device", default=None)
    bench.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    bench.add_argument("--out-root", default="results",
                       help="results go to a new folder under this one (default ./results)")
    bench.set_defaults(func=_cmd_bench)

    tune = sub.add_parser("autotune", help="sweep a kernel's config space on this GPU and save "
                          "the winners for it (needs CUDA)")
    tune.add_argument("--kernel", required=True, choices=("decode", "score", "prefill", "copy"))
    tune.add_argument("--out", default=None,
                      help="JSON to write/merge (default: the package's file for this GPU)")
    tune.add_argument("--seconds", type=float, default=None,
                      help="stop the sweep after this many seconds (keeps the best so far)")
    tune.set_defaults(func=_cmd_autotune)

    info = sub.add_parser("info", help="versions, device and backend")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
