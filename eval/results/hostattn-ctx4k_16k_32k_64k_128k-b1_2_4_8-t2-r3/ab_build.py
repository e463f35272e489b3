"""A/B of host-kernel builds: each built from its own source folder, measured cell by cell in
turn on the same pool, table and flushed caches (``measure_cell`` of ``tierattn bench host``).

    python ab_build.py NAME=DIR[:EXTRA_CFLAGS],... CONTEXTS BATCHES GEOMETRIES [DTYPES [PAGE]]
    e.g. python ab_build.py old=/tmp/old,new=kernels/csrc 16384,65536 1,4 llama-8b bf16,fp32

A folder holds ``host_decode.c`` and ``host_decode_body.h``; an older build's, for example:
``mkdir /tmp/old && for f in host_decode.c host_decode_body.h; do git show
6b57e2e:kernels/csrc/$f > /tmp/old/$f; done``. Prints per cell and build:
host_decode GB/s / host_read GB/s = ratio.
"""

import ctypes
import subprocess
import sys

import torch

import tierattn.kernels.host as host
from tierattn.eval.bench.host import DTYPES, GEOMETRIES, _Flush, fill_pool, measure_cell


def build(name: str, spec: str) -> ctypes.CDLL:
    """The kernel compiled from ``spec`` = ``DIR[:EXTRA_CFLAGS]`` with the package's flags."""
    src, _, extra = spec.partition(":")
    out = f"/tmp/ab_build_{name}.so"
    subprocess.run(["gcc", *host._FLAGS, "-march=native", "-fopenmp", *extra.split(),
                    f"{src}/host_decode.c", "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out)
    for suffix in host._SUFFIX.values():
        fn = getattr(lib, f"host_decode_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int] * 5 + [ctypes.c_float] * 2 + \
            [ctypes.c_int] * 2 + [ctypes.c_void_p] * 5
    lib.host_read.restype = ctypes.c_uint32
    lib.host_read.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int64] + \
        [ctypes.c_int] * 2
    return lib


def main(argv: list[str]) -> None:
    libs = {name: build(name, spec)
            for name, spec in (a.split("=", 1) for a in argv[0].split(","))}
    contexts = [int(x) for x in argv[1].split(",")]
    batches = [int(x) for x in argv[2].split(",")]
    geometries = argv[3].split(",")
    dtypes = argv[4].split(",") if len(argv) > 4 else ["fp32", "bf16"]
    page = int(argv[5]) if len(argv) > 5 else 16  # tokens per page
    flush = _Flush(2)
    gen = torch.Generator().manual_seed(0)
    for geo in GEOMETRIES:
        if geo.name not in geometries:
            continue
        for dn in dtypes:
            pool = fill_pool(max(batches) * max(contexts) // page + 64, geo, DTYPES[dn], page,
                             gen)
            for c in contexts:
                for b in batches:
                    line = f"{geo.name:13s} {dn} {c // 1024:4d}k b{b} p{page}:"
                    for name, lib in libs.items():
                        host._lib = lib  # host_decode / host_read call this build
                        r = measure_cell(pool, geo, dn, c, b, reps=5, threads=2, flush=flush,
                                         gen=torch.Generator().manual_seed(c * 10 + b),
                                         sdpa=False)
                        line += (f"  {name} {r['decode_Bps'] / 1e9:5.1f}/"
                                 f"{r['read_Bps'] / 1e9:5.1f}={r['ratio']:.3f}")
                    print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
