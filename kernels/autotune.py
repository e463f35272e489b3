"""Kernel autotuning: declared config spaces, bucketed keys, checked sweeps, per-GPU JSON tables.

Each tunable kernel declares its launch parameters as data (:data:`SPACES`). A sweep
(:func:`autotune`, CUDA only) builds representative problems, computes each problem's reference
once, runs every config of the space, rejects the ones that fail to compile or break the error
rule of :mod:`.testing`, times the rest with ``triton.testing.do_bench`` (median) next to the
default config, and writes the winner per bucketed key to ``kernels/tuned/<gpu-slug>.json``
(e.g. ``nvidia-h200.json``). At run time the launchers ask :func:`resolve_config` for their tile
parameters: explicit arguments win, then the tuned entry of the call's key (CUDA only), then the
defaults, which are exactly the launch parameters of an untuned build. Each launcher's
``_key_sizes`` derives the key's sizes from host-known shapes (no sync), and the sweep keys its
problems with the same function, so a tuned entry is found by exactly the launches it was
tuned for.

Keys (:func:`bucket_key`) name the problem class, with coarse power-of-two buckets for sizes that
vary from call to call (``ctx<=4096`` holds 513..4096 tokens; ``>`` the last edge beyond it):

=========  =============================================================================
decode     ``d=128,g=4,ps=16,dtype=bf16,ctx<=32768,rows<=64`` (ctx: mean pages per page-table
           row times the page size, edges 512/4096/32768/262144; rows: B*H_kv, edges 8/64/512)
score      ``d=128,g=4,dtype=bf16,entries<=512,rows<=64`` (entries: mean pages per sequence,
           edges 64/512/4096; rows: B*H_kv)
prefill    ``d=128,g=4,ps=16,dtype=bf16,qlen<=1024`` (mean chunk length per sequence, edges
           16/64/256/1024/4096)
copy       ``bytes=65536,path=h2d,pages<=512`` (page bytes rounded up to a power of two; path
           h2d/d2h/d2d/h2h from the pools' devices; pages per call, edges 64/512/4096)
=========  =============================================================================

``TIERATTN_AUTOTUNE`` selects the lookup: ``lookup`` (default) reads the packaged table of the
current GPU and falls back to defaults per missing entry; ``off`` never reads a table; a path to
a ``.json`` file uses that table on any GPU. Anything else raises :class:`TierConfigError`.

Table format (:func:`load_tuned` validates it; unknown kernels, parameters or fields are errors)::

    {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0",
     "created": "2025-06-01T12:00:00+00:00",
     "entries": {"decode": {"<key>": {"config": {"block_n": 32, "num_warps": 4, ...},
                                      "us": 41.2, "default_us": 55.0, "checked": true,
                                      "tried": 36, "rejected": 2, "cut": false,
                                      "shape": "B8 ctx32768 ..."}}}}
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from tierattn.errors import KernelInputError, KernelUnsupportedError, TierConfigError

from ._common import next_pow2, triton_interpreting

__all__ = [
    "DEFAULT_SHAPES", "ENV_VAR", "KERNELS", "Problem", "SPACES", "TUNED_DIR", "autotune",
    "autotune_mode", "bucket_key", "check_config", "clear_cache", "config_space", "format_summary",
    "gpu_slug", "load_tuned", "make_problem", "merge_config", "merge_tuned", "resolve_config",
    "save_tuned", "tune_problem", "tuned_config", "tuned_path",
]

KERNELS = ("decode", "score", "prefill", "copy")
ENV_VAR = "TIERATTN_AUTOTUNE"
#: the packaged tables, one JSON file per GPU name (package data of ``tierattn.kernels``).
TUNED_DIR = Path(__file__).resolve().parent / "tuned"
#: a winner must beat the default by this fraction, or the default is kept (timing noise).
MIN_GAIN = 0.02

#: declared launch parameters of each kernel and the values a sweep tries.
SPACES: dict[str, dict[str, tuple[int, ...]]] = {
    "decode": {"block_n": (16, 32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3)},
    "score": {"block_e": (4, 8, 16, 32, 64, 128), "num_warps": (1, 2, 4, 8)},
    "prefill": {"block_m": (16, 32, 64, 128), "block_n": (16, 32, 64), "num_warps": (4, 8),
                "num_stages": (1, 2, 3)},
    "copy": {"block_bytes": (2048, 4096, 8192, 16384, 32768, 65536),
             "programs_per_sm": (1, 2, 4, 8)},
}
#: parameters that must be powers of two (tile shapes, warps); block_bytes also >= 128.
_POW2 = {"block_n", "block_m", "block_e", "block_bytes", "num_warps"}

_CTX = (512, 4096, 32768, 262144)
_ROWS = (8, 64, 512)
#: key fields per kernel: (label, size name, bucket edges or None for the exact value).
_KEYS: dict[str, tuple[tuple[str, str, tuple[int, ...] | None], ...]] = {
    "decode": (("d", "d", None), ("g", "group", None), ("ps", "page_size", None),
               ("dtype", "dtype", None), ("ctx", "ctx", _CTX), ("rows", "rows", _ROWS)),
    "score": (("d", "d", None), ("g", "group", None), ("dtype", "dtype", None),
              ("entries", "entries", (64, 512, 4096)), ("rows", "rows", _ROWS)),
    "prefill": (("d", "d", None), ("g", "group", None), ("ps", "page_size", None),
                ("dtype", "dtype", None), ("qlen", "q_len", (16, 64, 256, 1024, 4096))),
    "copy": (("bytes", "page_bytes", None), ("path", "path", None),
             ("pages", "pages", (64, 512, 4096))),
}
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}
_ENTRY_FIELDS = {"config": dict, "us": (int, float), "default_us": (int, float), "checked": bool,
                 "tried": int, "rejected": int, "cut": bool, "shape": str}
_REQUIRED_FIELDS = ("config", "us", "default_us", "checked")
_TOP_FIELDS = {"gpu": str, "torch": str, "triton": str, "created": str, "entries": dict}


def _check_kernel(kernel: object) -> str:
    if kernel not in KERNELS:
        raise KernelInputError(f"kernel={kernel!r} is not one of {KERNELS}.")
    return kernel  # type: ignore[return-value]


def _check_sizes(kernel: str, sizes: dict, *, complete: bool) -> None:
    known = {size for _, size, _ in _KEYS[kernel]}
    unknown, missing = set(sizes) - known, known - set(sizes)
    if unknown or (complete and missing):
        raise KernelInputError(
            f"sizes of {kernel!r} are {sorted(known)}; got unknown {sorted(unknown)} and "
            f"missing {sorted(missing) if complete else []}.")


def _prune_reason(kernel: str, cfg: dict, sz: dict) -> str | None:
    """Why ``cfg`` cannot (or need not) run on a problem of sizes ``sz``; None if it can.

    A rule whose size is not in ``sz`` is skipped.
    """
    d_pad = max(16, next_pow2(sz["d"])) if "d" in sz else None
    p_pad = max(16, next_pow2(sz["page_size"])) if "page_size" in sz else None
    if kernel in ("decode", "prefill") and p_pad and cfg["block_n"] < p_pad:
        return f"block_n < padded page size {p_pad} (the launcher raises it to {p_pad})"
    if kernel == "decode" and d_pad and cfg["block_n"] * d_pad > 128 * 128:
        return "fp32 K/V tiles of more than 128*128 elements spill registers"
    if kernel == "prefill" and d_pad and d_pad > 128 and cfg["block_m"] * cfg["block_n"] > 64 * 64:
        return "BLOCK_M*BLOCK_N > 64*64 with D > 128 overflows shared memory and registers"
    if kernel == "score" and d_pad and "group" in sz and \
            cfg["block_e"] * next_pow2(sz["group"]) * d_pad > 32768:
        return "the [G, BLOCK_E, D] product tile exceeds 32768 fp32 elements (registers)"
    if kernel == "copy" and "page_bytes" in sz and \
            cfg["block_bytes"] > max(2048, next_pow2(sz["page_bytes"])):
        return "block_bytes larger than a page moves the same block as a page-sized one"
    return None


def config_space(kernel: str, **sizes: Any) -> list[dict[str, int]]:
    """Every config of ``kernel``'s declared space, pruned for a problem of ``sizes``.

    Args:
        kernel: one of :data:`KERNELS`.
        **sizes: optional problem sizes (the names :func:`bucket_key` takes); configs that
            cannot compile or duplicate another for these sizes are left out.

    Returns:
        A list of ``{param: value}`` dicts in a fixed order.
    """
    _check_sizes(_check_kernel(kernel), sizes, complete=False)
    names = list(SPACES[kernel])
    out = [dict(zip(names, vals)) for vals in itertools.product(*SPACES[kernel].values())]
    return [c for c in out if _prune_reason(kernel, c, sizes) is None]


def _bucket(label: str, n: float, edges: tuple[int, ...]) -> str:
    for edge in edges:
        if n <= edge:
            return f"{label}<={edge}"
    return f"{label}>{edges[-1]}"


def bucket_key(kernel: str, **sizes: Any) -> str:
    """Stable key of the problem class a launch belongs to (see the module docstring).

    Args:
        kernel: one of :data:`KERNELS`.
        **sizes: decode ``d, group, page_size, dtype, ctx, rows``; score ``d, group, dtype,
            entries, rows``; prefill ``d, group, page_size, dtype, q_len``; copy ``page_bytes,
            path, pages``. ``dtype`` is a torch dtype or ``"fp16" | "bf16" | "fp32"``.
    """
    _check_sizes(_check_kernel(kernel), sizes, complete=True)
    parts = []
    for label, size, edges in _KEYS[kernel]:
        v = sizes[size]
        if size == "dtype":
            v = _DTYPE_NAMES.get(v, v)
        elif size == "page_bytes":
            v = next_pow2(v)
        parts.append(f"{label}={v}" if edges is None else _bucket(label, v, edges))
    return ",".join(parts)


def _config_problem(kernel: str, cfg: object) -> str | None:
    """What is wrong with a config dict of ``kernel`` (None: nothing)."""
    if not isinstance(cfg, dict):
        return f"must be an object of launch parameters, got {type(cfg).__name__}"
    for name, v in cfg.items():
        if name not in SPACES[kernel]:
            return f"unknown parameter {name!r} for {kernel} (known: {sorted(SPACES[kernel])})"
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"{name}={v!r} must be a positive int"
        if name in _POW2 and v & (v - 1):
            return f"{name}={v} must be a power of two"
        if name == "block_bytes" and v < 128:
            return f"block_bytes={v} must be at least 128"
    return None


def check_config(kernel: str, config: dict | None) -> dict[str, int]:
    """Validate a launcher's ``config=`` argument; returns a copy (``{}`` for None)."""
    if config is None:
        return {}
    problem = _config_problem(kernel, config)
    if problem:
        raise KernelInputError(
            f"config={config!r}: {problem}; see tierattn.kernels.autotune.SPACES[{kernel!r}].")
    return dict(config)


def gpu_slug(name: str) -> str:
    """File-name form of a GPU name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def tuned_path(gpu_name: str) -> Path:
    """The packaged table of a GPU: ``kernels/tuned/<gpu-slug>.json``."""
    return TUNED_DIR / f"{gpu_slug(gpu_name)}.json"


@functools.cache
def _mode(raw: str) -> tuple[str, Path | None]:
    value = raw.strip()
    if value.lower() in ("", "lookup"):
        return "lookup", None
    if value.lower() == "off":
        return "off", None
    if value.endswith(".json") or "/" in value or os.sep in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise TierConfigError(
                f"{ENV_VAR}={raw!r} names no file; point it at a tuned-config JSON written by "
                "`tierattn autotune`, or set it to 'lookup' or 'off'.")
        return "path", path
    raise TierConfigError(
        f"{ENV_VAR}={raw!r} is not a lookup mode; use 'lookup' (default: the packaged table of "
        "this GPU), 'off' (defaults only) or the path of a tuned-config .json file.")


def autotune_mode() -> tuple[str, Path | None]:
    """``("lookup" | "off" | "path", path or None)`` from :data:`ENV_VAR` (raises if invalid)."""
    return _mode(os.environ.get(ENV_VAR, ""))


@functools.cache
def _table(path: str) -> dict | None:
    # read once per file and process; None when a GPU has no packaged table
    return load_tuned(path) if Path(path).is_file() else None


@functools.cache
def _packaged_table(gpu_name: str) -> dict | None:
    return _table(str(tuned_path(gpu_name)))


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def clear_cache() -> None:
    """Forget loaded tables and the parsed environment (after writing a table, in tests)."""
    for fn in (_table, _packaged_table, _mode, _launch_lookup):
        fn.cache_clear()


def tuned_config(kernel: str, key: str, device: torch.device | str | None = None, *,
                 gpu_name: str | None = None) -> dict[str, int] | None:
    """The tuned launch parameters of ``kernel`` for ``key``, or None (use the defaults).

    Args:
        kernel: one of :data:`KERNELS`.
        key: from :func:`bucket_key`.
        device: the launch's device; anything but a compiled CUDA launch returns None at once.
        gpu_name: look up this GPU's table instead of ``device``'s (tests, offline tools).

    Raises:
        TierConfigError: :data:`ENV_VAR` is invalid, or the table it selects is malformed.
    """
    _check_kernel(kernel)
    if gpu_name is None:
        if device is None or torch.device(device).type != "cuda" or triton_interpreting():
            return None
    mode, path = autotune_mode()
    if mode == "off":
        return None
    if path is not None:
        table = _table(str(path))
    else:
        if gpu_name is None:
            dev = torch.device(device)
            gpu_name = _gpu_name(dev.index if dev.index is not None else
                                 torch.cuda.current_device())
        table = _packaged_table(gpu_name)
    entry = table["entries"].get(kernel, {}).get(key) if table is not None else None
    return dict(entry["config"]) if entry is not None else None


def merge_config(defaults: dict, tuned: dict | None, explicit: dict) -> dict:
    """Launch parameters of one call: ``defaults`` overridden by ``explicit`` when the caller
    gave any (None values count as not given), else by ``tuned``.

    A tuned config is a checked whole, so it is never mixed with a caller's values: any explicit
    tile argument turns the table off for that call.
    """
    given = {k: v for k, v in explicit.items() if v is not None}
    return {**defaults, **given} if given else {**defaults, **(tuned or {})}


@functools.lru_cache(maxsize=4096)
def _launch_lookup(kernel: str, sizes: tuple, index: int, mode: str, interpret: str
                   ) -> dict | None:
    # one launch class's whole lookup; the environment is part of the cache key
    return tuned_config(kernel, bucket_key(kernel, **dict(sizes)), torch.device("cuda", index))


def resolve_config(kernel: str, device: torch.device, defaults: dict, explicit: dict,
                   sizes: dict) -> dict:
    """:func:`merge_config` with the table entry of ``sizes``' key (:func:`bucket_key`).

    The table is consulted only for CUDA launches without explicit tile arguments; a launch
    class seen before costs one cached lookup of its sizes (a few microseconds in all).
    """
    tuned = None
    if device.type == "cuda" and not any(v is not None for v in explicit.values()):
        index = device.index if device.index is not None else torch.cuda.current_device()
        tuned = _launch_lookup(kernel, tuple(sizes.items()), index,
                               os.environ.get(ENV_VAR, ""), os.environ.get("TRITON_INTERPRET", ""))
    return merge_config(defaults, tuned, explicit)


def _validate(data: object, where: str) -> dict:
    def bad(what: str) -> TierConfigError:
        return TierConfigError(
            f"tuned-config file {where}: {what}; fix or delete it (rerun `tierattn autotune`), "
            f"or set {ENV_VAR}=off.")

    if not isinstance(data, dict):
        raise bad(f"top level must be an object, got {type(data).__name__}")
    for name, value in data.items():
        if name not in _TOP_FIELDS:
            raise bad(f"unknown field {name!r} (known: {sorted(_TOP_FIELDS)})")
        if not isinstance(value, _TOP_FIELDS[name]):
            raise bad(f"field {name!r} must be a {_TOP_FIELDS[name].__name__}")
    for name in ("gpu", "entries"):
        if name not in data:
            raise bad(f"missing field {name!r}")
    for kernel, table in data["entries"].items():
        if kernel not in KERNELS:
            raise bad(f"unknown kernel {kernel!r} in entries (known: {list(KERNELS)})")
        if not isinstance(table, dict):
            raise bad(f"entries.{kernel} must be an object of key -> entry")
        for key, entry in table.items():
            at = f"entries.{kernel}[{key!r}]"
            if not isinstance(entry, dict):
                raise bad(f"{at} must be an object")
            for name, value in entry.items():
                want = _ENTRY_FIELDS.get(name)
                if want is None:
                    raise bad(f"{at} has unknown field {name!r} (known: {sorted(_ENTRY_FIELDS)})")
                if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                    raise bad(f"{at}.{name} has the wrong type ({type(value).__name__})")
            missing = [n for n in _REQUIRED_FIELDS if n not in entry]
            if missing:
                raise bad(f"{at} lacks {missing}")
            if entry["checked"] is not True:
                raise bad(f"{at} was not checked against the reference (checked must be true)")
            problem = _config_problem(kernel, entry["config"])
            if problem:
                raise bad(f"{at}.config: {problem}")
    return data


def load_tuned(path: str | os.PathLike) -> dict:
    """Read and validate a tuned-config JSON file.

    Raises:
        TierConfigError: the file is not JSON or does not follow the format (naming the file
            and the field at fault).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TierConfigError(
            f"tuned-config file {path}: cannot be read as JSON ({e}); fix or delete it, or set "
            f"{ENV_VAR}=off.") from e
    return _validate(data, str(path))


def merge_tuned(old: dict | None, new: dict) -> dict:
    """``new``'s metadata and entries over ``old``'s (entry by entry: a new key replaces an old
    one, other old keys stay). Both tables must be for the same GPU."""
    if old is None:
        return json.loads(json.dumps(new))
    if old.get("gpu") != new.get("gpu"):
        raise TierConfigError(
            f"cannot merge tuned configs of {new.get('gpu')!r} into a table of "
            f"{old.get('gpu')!r}; write them to that GPU's own file (out_path).")
    merged = json.loads(json.dumps(old))  # deep copy of plain JSON data
    merged.update({k: v for k, v in new.items() if k != "entries"})
    for kernel, table in new["entries"].items():
        merged["entries"].setdefault(kernel, {}).update(json.loads(json.dumps(table)))
    return merged


def save_tuned(path: str | os.PathLike, data: dict, *, merge: bool = True) -> dict:
    """Validate ``data``, merge it into the file at ``path`` when one exists (``merge=True``),
    and write the result atomically. Returns what was written."""
    path = Path(path)
    _validate(data, f"{path} (data to save)")
    if merge and path.is_file():
        data = merge_tuned(load_tuned(path), data)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    clear_cache()
    return data


#: Llama-3-8B-like layer: 32 query heads, 8 KV heads, D=128, bf16, 16-token (64 KiB) pages.
_LLAMA = {"hq": 32, "hkv": 8, "d": 128, "page_size": 16, "dtype": "bf16"}
DEFAULT_SHAPES: dict[str, list[dict]] = {
    "decode": [{**_LLAMA, "batch": b, "ctx": c} for c in (4096, 32768) for b in (1, 8)],
    "score": [{**_LLAMA, "batch": b, "ctx": c} for c in (4096, 32768) for b in (1, 8)],
    "prefill": [{**_LLAMA, "batch": 1, "q_len": n, "ctx": 4096} for n in (512, 2048)],
    "copy": [{**_LLAMA, "pages": n, "path": p} for n in (256, 2048) for p in ("h2d", "d2h")],
}


@dataclass
class Problem:
    """One sweep problem: inputs and references built once, a config runs against them.

    ``run(config, check)`` launches the kernel with ``config`` (``check=True``: every output
    the check compares, e.g. the page mass besides ``out``/``lse``; the sweep times that same
    variant, so what is timed is what was checked);
    ``check(result)`` returns why the result breaks the rule, or None; ``reset`` restores the
    state an in-place kernel overwrote, before each checked run.
    """

    kernel: str
    shape: str
    sizes: dict
    default: dict
    run: Callable[[dict, bool], Any]
    check: Callable[[Any], str | None]
    reset: Callable[[], None] | None = None


def _rule(dtype: torch.dtype, **triples: tuple) -> str | None:
    from .testing import check_rule
    for name, (out, ref, lowp) in triples.items():
        c = check_rule(out, ref, lowp, dtype)
        if not c.ok:
            return f"{name}: {c}"
    return None


def _randn(shape, dtype, device, gen, scale=1.0) -> torch.Tensor:
    # generated on the target device: CPU generation of a GiB pool would dominate a sweep
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def _table_of(batch, pages, kv_len, page_size, num_slots, device, gen):
    """``batch`` rows of ``pages`` entries on randomly ordered slots; last pages partly full."""
    from .page_table import PageTable
    slots = torch.randperm(num_slots, generator=gen, device=device)[:batch * pages]
    indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * pages
    last = torch.full((batch,), kv_len - (pages - 1) * page_size, dtype=torch.int32,
                      device=device)
    return PageTable.from_csr(indptr, slots.to(torch.int32), last)


def _decode_problem(s: dict, device: torch.device, gen: torch.Generator) -> Problem:
    from . import decode
    dt, hi = _DTYPES[s["dtype"]], torch.float32
    b, hq, hkv, d, ps = s["batch"], s["hq"], s["hkv"], s["d"], s["page_size"]
    kv_len = max(1, s["ctx"] - 3)  # a partly filled last page
    pages = -(-kv_len // ps)
    pool = _randn((b * pages + 3, 2, ps, hkv, d), dt, device, gen)
    q = _randn((b, hq, d), dt, device, gen)
    pt = _table_of(b, pages, kv_len, ps, pool.shape[0], device, gen)
    ref, lowp = (decode.sparse_decode_reference(q, pool, pt, return_page_mass=True,
                                                compute_dtype=c) for c in (hi, dt))

    return Problem(
        "decode", f"B{b} ctx{kv_len} Hq{hq}/Hkv{hkv} D{d} P{ps} {s['dtype']}",
        decode._key_sizes(q, pool, pt), decode._default_config(d),
        lambda cfg, chk: decode.sparse_decode(q, pool, pt, validate=False, config=cfg,
                                              return_page_mass=chk),
        _attention_check(dt, ref, lowp))


def _attention_check(dt: torch.dtype, ref, lowp):
    """The check of an attention result (``out``, ``lse``, ``page_mass``) against the fp32/fp64
    reference ``ref`` and the low-precision torch run ``lowp`` (the error rule)."""
    def check(res) -> str | None:
        return _rule(dt, out=(res.out, ref.out, lowp.out), lse=(res.lse, ref.lse, lowp.lse),
                     page_mass=(res.page_mass, ref.page_mass, lowp.page_mass))
    return check


def _score_problem(s: dict, device: torch.device, gen: torch.Generator) -> Problem:
    from . import score
    dt = _DTYPES[s["dtype"]]
    b, hq, hkv, d, ps = s["batch"], s["hq"], s["hkv"], s["d"], s["page_size"]
    pages = max(1, s["ctx"] // ps)
    kmin = _randn((b * pages + 3, hkv, d), dt, device, gen)
    kmax = (kmin.float() + _randn(kmin.shape, torch.float32, device, gen).abs()).to(dt)
    q = _randn((b, hq, d), dt, device, gen, scale=d ** -0.5)
    pt = _table_of(b, pages, pages * ps, ps, kmin.shape[0], device, gen)
    ref, lowp = (score.quest_score_reference(q, kmin, kmax, pt, compute_dtype=c)
                 for c in (torch.float32, dt))
    return Problem(
        "score", f"B{b} pages{pages} Hq{hq}/Hkv{hkv} D{d} {s['dtype']}",
        score._key_sizes(q, kmin, pt), score._default_config(hq // hkv, d),
        lambda cfg, chk: score.quest_score(q, kmin, kmax, pt, validate=False, config=cfg),
        lambda out: _rule(dt, scores=(out, ref, lowp)))


def _prefill_problem(s: dict, device: torch.device, gen: torch.Generator) -> Problem:
    from . import prefill
    dt = _DTYPES[s["dtype"]]
    b, hq, hkv, d, ps = s["batch"], s["hq"], s["hkv"], s["d"], s["page_size"]
    kv_len, q_len = s["ctx"], min(s["q_len"], s["ctx"])
    pages = -(-kv_len // ps)
    pool = _randn((b * pages + 3, 2, ps, hkv, d), dt, device, gen)
    q = _randn((b * q_len, hq, d), dt, device, gen)
    qo = torch.arange(b + 1, dtype=torch.int32, device=device) * q_len
    pt = _table_of(b, pages, kv_len, ps, pool.shape[0], device, gen)
    ref, lowp = (prefill.paged_prefill_reference(q, pool, pt, qo, return_page_mass=True,
                                                 compute_dtype=c) for c in (torch.float32, dt))

    return Problem(
        "prefill", f"B{b} q{q_len} ctx{kv_len} Hq{hq}/Hkv{hkv} D{d} P{ps} {s['dtype']}",
        prefill._key_sizes(q, pool, qo), prefill._default_config(d),
        lambda cfg, chk: prefill.paged_prefill(q, pool, pt, qo, validate=False, config=cfg,
                                               return_page_mass=chk),
        _attention_check(dt, ref, lowp))


def _copy_problem(s: dict, device: torch.device, gen: torch.Generator) -> Problem:
    from . import page_copy
    dt = _DTYPES[s["dtype"]]
    n, page = s["pages"], (2, s["page_size"], s["hkv"], s["d"])

    def pool(num_slots: int, host: bool) -> torch.Tensor:
        t = _randn((num_slots, *page), dt, device, gen)
        # the host side of an h2d/d2h copy is pinned memory read over UVA (CUDA only)
        return t.cpu().pin_memory() if host and device.type == "cuda" else t

    path = s.get("path", "d2d")
    src, dst = pool(n + 7, path[0] == "h"), pool(n + 5, path[-1] == "h")
    src_slots = torch.randperm(src.shape[0], generator=gen, device=device)[:n].int()
    dst_slots = torch.randperm(dst.shape[0], generator=gen, device=device)[:n].int()
    poison = torch.full_like(dst, float("nan"))
    ref = poison.clone()
    dst.copy_(poison)
    page_copy.copy_pages_reference(src, src_slots, ref, dst_slots)
    bits = {2: torch.int16, 4: torch.int32}[dst.element_size()]

    def run(cfg: dict, chk: bool) -> None:
        page_copy.copy_pages(src, src_slots, dst, dst_slots, validate=False, config=cfg)
        if chk and device.type == "cuda":
            torch.cuda.synchronize(device)  # a pinned dst is read by the host right after

    def check(_) -> str | None:
        return None if torch.equal(dst.view(bits), ref.view(bits)) else \
            "dst differs bitwise from copy_pages_reference"

    # copy_pages writes dst in place: every checked run starts from the poisoned dst, so a config
    # that skips a page cannot pass on bytes an earlier config wrote. Timed repeats need no
    # restore: copying the same pages to the same disjoint slots is idempotent.
    sizes = page_copy._key_sizes(src, dst, src_slots)
    return Problem("copy", f"{n} pages of {sizes['page_bytes']} B {sizes['path']}", sizes,
                   page_copy._default_config(), run, check, reset=lambda: dst.copy_(poison))


_BUILDERS = {"decode": _decode_problem, "score": _score_problem, "prefill": _prefill_problem,
             "copy": _copy_problem}


def make_problem(kernel: str, shape: dict | None = None, device: torch.device | str = "cuda",
                 seed: int = 0) -> Problem:
    """Build one sweep problem of ``kernel``: random inputs (never zeros) and references.

    ``shape`` overrides fields of the kernel's first default shape (``batch``, ``ctx``,
    ``q_len``, ``pages``, ``path``, ``hq``, ``hkv``, ``d``, ``page_size``, ``dtype``).
    """
    base = DEFAULT_SHAPES[_check_kernel(kernel)][0]
    unknown = set(shape or {}) - set(base)
    if unknown:
        raise KernelInputError(f"shape fields {sorted(unknown)} are unknown for {kernel!r}; "
                               f"known: {sorted(base)}.")
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return _BUILDERS[kernel]({**base, **(shape or {})}, device, gen)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def tune_problem(prob: Problem, bench: Callable[[Callable[[], Any]], float], *,
                 deadline: float | None = None, progress: bool = False) -> dict:
    """Check and time every config of ``prob``'s space; the default first (the baseline).

    ``bench(fn)`` returns milliseconds. A config is timed only after its checked run passed;
    past ``deadline`` (``time.monotonic()``) the sweep stops with the best so far (``cut``).

    Returns:
        ``{"key", "shape", "winner", "us", "default_us", "speedup", "checked", "rejected",
        "rejects", "cut", "tried"}``; ``winner`` is None when the default itself failed
        (nothing is published for a red baseline).
    """
    from tqdm.auto import tqdm

    configs = [prob.default] + [c for c in config_space(prob.kernel, **prob.sizes)
                                if c != prob.default]
    timed: list[tuple[float, dict]] = []
    rejects: list[dict] = []
    cut = False
    for i, cfg in enumerate(tqdm(configs, desc=f"{prob.kernel} {prob.shape}", leave=False,
                                 disable=not progress)):
        if deadline is not None and timed and time.monotonic() > deadline:
            cut = True
            break
        try:
            if prob.reset is not None:
                prob.reset()
            reason = prob.check(prob.run(cfg, True))
            if reason is None:
                timed.append((1000.0 * bench(lambda cfg=cfg: prob.run(cfg, True)), cfg))
        except Exception as e:  # a config that does not compile or launch is rejected
            reason = _short(e)
        if reason is not None:
            rejects.append({"config": cfg, "reason": reason})
        if i == 0 and not timed:
            break  # the default is red: publish nothing for this problem
    summary = {"key": bucket_key(prob.kernel, **prob.sizes), "shape": prob.shape,
               "winner": None, "us": None, "default_us": None, "speedup": None,
               "checked": len(timed), "rejected": len(rejects), "rejects": rejects,
               "cut": cut, "tried": len(timed) + len(rejects)}
    if not timed or timed[0][1] is not prob.default:
        return summary
    default_us = timed[0][0]
    us, best = min(timed, key=lambda t: t[0])
    if us > default_us * (1 - MIN_GAIN):
        us, best = default_us, prob.default
    summary.update(winner=dict(best), us=us, default_us=default_us, speedup=default_us / us)
    return summary


def autotune(kernel: str, *, shapes: list[dict] | None = None,
             device: torch.device | str | None = None, out_path: str | os.PathLike | None = None,
             warmup_ms: float = 25, rep_ms: float = 100, progress: bool = True,
             time_budget_s: float | None = None) -> dict:
    """Sweep ``kernel``'s config space on representative shapes and write the winners.

    Args:
        kernel: one of :data:`KERNELS`.
        shapes: problems to tune (dicts of fields overriding the first default shape; see
            :func:`make_problem`); default :data:`DEFAULT_SHAPES` (Llama-8B-like).
        device: a CUDA device (default: the current one).
        out_path: JSON table to merge the winners into (default: the packaged table of this
            GPU, :func:`tuned_path`).
        warmup_ms, rep_ms: ``triton.testing.do_bench`` budgets per config.
        progress: show a tqdm bar per problem.
        time_budget_s: stop after about this long, keeping the best config so far of the
            problem under way (its entry records ``cut``); later problems are skipped.

    Returns:
        ``{"kernel", "gpu", "path", "cut", "keys": {key: summary}}`` with each key's winner, its
        time and the default's (us), the speedup and the numbers checked and rejected.

    Raises:
        KernelUnsupportedError: no CUDA device (or the Triton interpreter is on): nothing to
            time.
    """
    _check_kernel(kernel)
    if not torch.cuda.is_available() or triton_interpreting():
        why = "TRITON_INTERPRET=1 is set" if triton_interpreting() else \
            "torch.cuda.is_available() is False"
        raise KernelUnsupportedError(
            f"autotune times compiled kernels on a CUDA GPU, and {why}; run it on the GPU the "
            "table is for (with TRITON_INTERPRET unset). Untuned launches use the defaults.")
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        raise KernelInputError(f"device={device} is not a CUDA device; pass 'cuda' or 'cuda:N'.")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from triton.testing import do_bench

    def bench(fn: Callable[[], Any]) -> float:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    gpu = _gpu_name(device.index)
    deadline = time.monotonic() + time_budget_s if time_budget_s is not None else None
    with torch.cuda.device(device):
        return _sweep(kernel, shapes if shapes is not None else DEFAULT_SHAPES[kernel], device,
                      bench, gpu, Path(out_path) if out_path is not None else tuned_path(gpu),
                      deadline=deadline, progress=progress)


def _sweep(kernel: str, shapes: list[dict], device: torch.device,
           bench: Callable[[Callable[[], Any]], float], gpu: str, path: Path, *,
           deadline: float | None, progress: bool) -> dict:
    """:func:`autotune` after its device checks (tests run it on CPU with a fake ``bench``)."""
    import triton

    keys: dict[str, dict] = {}
    entries: dict[str, dict] = {}
    cut = False
    for shape in shapes:
        if deadline is not None and time.monotonic() > deadline:
            cut = True
            break
        prob = make_problem(kernel, shape, device)
        res = tune_problem(prob, bench, deadline=deadline, progress=progress)
        del prob  # free the problem's pools before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cut |= res["cut"]
        key = res["key"]
        # two shapes of one bucket: keep the larger gain (both winners passed the check)
        if key in keys and (res["speedup"] or 0) <= (keys[key]["speedup"] or 0):
            continue
        keys[key] = res
        if res["winner"] is not None:
            entries[key] = {"config": res["winner"], "us": round(res["us"], 3),
                            "default_us": round(res["default_us"], 3), "checked": True,
                            "tried": res["tried"], "rejected": res["rejected"], "cut": res["cut"],
                            "shape": res["shape"]}
    if entries:
        save_tuned(path, {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                          "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          "entries": {kernel: entries}})
    return {"kernel": kernel, "gpu": gpu, "path": str(path) if entries else None, "cut": cut,
            "keys": keys}


def format_summary(result: dict) -> str:
    """A plain-text table of :func:`autotune`'s result, one line per key."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = [f"autotune {result['kernel']} on {result['gpu']}: "
             + (f"winners merged into {result['path']}" if result["path"] else "nothing written"),
             f"{'key':<52} {'winner':<44} {'us':>9} {'default':>9} {'gain':>6} {'ok':>4} "
             f"{'rej':>4}"]
    for key, r in result["keys"].items():
        win = ",".join(f"{k}={v}" for k, v in r["winner"].items()) if r["winner"] else "-"
        lines.append(f"{key:<52} {win:<44} {fmt(r['us'], '9.2f')} "
                     f"{fmt(r['default_us'], '9.2f')} {fmt(r['speedup'], '5.2f')}x "
                     f"{r['checked']:>4} {r['rejected']:>4}" + ("  (cut)" if r["cut"] else ""))
        if r["winner"] is None and r["rejects"]:
            lines.append(f"  default rejected: {r['rejects'][0]['reason']}")
    if result["cut"]:
        lines.append("the time budget ran out: cut keys hold the best config checked so far, "
                     "later shapes were not tuned")
    return "\n".join(lines)
