"""``tierattn vllm-args``: the ``vllm serve`` flags (or ``vllm.LLM`` keyword arguments) that
serve a model with tierattn's hot set -- :func:`tierattn.vllm_engine_args` on the command line.
Imports no vLLM: a launcher may print the flags for a server on another machine."""

from __future__ import annotations

import argparse
import json


def _cmd_vllm_args(args: argparse.Namespace) -> int:
    import shlex

    from tierattn.config import TierConfig, TierSpec
    from tierattn.models.vllm import vllm_engine_args

    knobs = {"page_size": args.page_size, "prefill_chunk_size": args.prefill_chunk}
    if args.preset == "topk":
        knobs["recall_score"] = "quest"
    if args.hot_budget is not None:
        knobs["hot_budget"] = args.hot_budget
    if args.recall_budget is not None:
        knobs["recall_budget"] = args.recall_budget
    engine = vllm_engine_args(TierConfig.preset(args.preset, **knobs),
                              tiers=(TierSpec(args.tier, capacity_gib=args.capacity_gib),))
    if args.json:
        print(json.dumps(engine, indent=2))
        return 0
    flags = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif value is True:
            flags.append(flag)
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    print(" ".join(shlex.quote(f) for f in flags))
    return 0


def add_vllm_args(sub, _float_in, _int_at_least) -> None:
    """Register the ``vllm-args`` subcommand on the CLI's subparsers (with the CLI's checked
    argument types: a number in a range, an int at least a bound)."""
    vargs = sub.add_parser(
        "vllm-args", help="the `vllm serve` flags that serve a model with tierattn's hot set",
        description="Prints tierattn.vllm_engine_args(TierConfig.preset(PRESET, ...)) as `vllm "
        "serve` flags (--json: as the keyword arguments of vllm.LLM).")
    vargs.add_argument("--preset", choices=("offload", "topk"), default="offload",
                       help="offload: every cold page attended (exact, default); topk: the "
                            "Quest-ranked recall_budget of them")
    vargs.add_argument("--hot-budget", type=_float_in(0.0, 1.0), default=None,
                       help="share of each request kept on the device (default: the preset's)")
    vargs.add_argument("--recall-budget", type=_float_in(0.0, 1.0), default=None,
                       help="topk: share of the cold pages recalled per step")
    vargs.add_argument("--page-size", type=_int_at_least(32), default=32,
                       help="tokens per page = vLLM block (a multiple of 32 on CPU)")
    vargs.add_argument("--prefill-chunk", type=_int_at_least(1), default=512,
                       help="most prompt tokens a request adds per step")
    vargs.add_argument("--tier", choices=("ddr", "cxl"), default="ddr",
                       help="the host tier of cold pages")
    vargs.add_argument("--capacity-gib", type=_float_in(0.0, 1e9), default=None,
                       help="the host tier's capacity (default: up to half the host's memory)")
    vargs.add_argument("--json", action="store_true", help="print vllm.LLM keyword arguments")
    vargs.set_defaults(func=_cmd_vllm_args)
