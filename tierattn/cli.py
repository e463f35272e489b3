"""The ``tierattn`` command line. Only subcommands that work are listed.

    tierattn demo [--context N] [--out FILE]   kernel demo: evict vs offload at a 25% HBM budget
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

    info = sub.add_parser("info", help="versions, device and backend")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
