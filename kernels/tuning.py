"""Launch-time kernel configs: declared config spaces, bucketed keys and the per-GPU tuned tables.

Each tunable kernel declares its launch parameters as data (:data:`SPACES`). At run time the
launchers ask :func:`resolve_config` for their tile parameters: explicit arguments win, then the
tuned entry of the call's key (CUDA only), then the defaults, which are exactly the launch
parameters of an untuned build. Each launcher's ``_key_sizes`` derives the key's sizes from
host-known shapes (no sync); the sweep (:mod:`.autotune`, which writes the tables) keys its
problems with the same function, so a tuned entry is found by exactly the launches it was tuned
for. This module imports no kernel, so every kernel may import it; the sweep imports the kernels.

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
from pathlib import Path
from typing import Any

import torch

from tierattn.errors import KernelInputError, TierConfigError

from ._common import next_pow2, triton_interpreting

__all__ = [
    "ENV_VAR", "KERNELS", "SPACES", "TUNED_DIR", "autotune_mode", "bucket_key", "check_config",
    "clear_cache", "config_space", "gpu_slug", "load_tuned", "merge_config", "resolve_config",
    "tuned_config", "tuned_path",
]

KERNELS = ("decode", "score", "prefill", "copy")


ENV_VAR = "TIERATTN_AUTOTUNE"


#: the packaged tables, one JSON file per GPU name (package data of ``tierattn.kernels``).
TUNED_DIR = Path(__file__).resolve().parent / "tuned"


#: declared launch parameters of each kernel and the values a sweep tries.
SPACES: dict[str, dict[str, tuple[int, ...]]] = {
    "decode": {"block_n": (16, 32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3)},
    "score": {"block_e": (4, 8, 16, 32, 64, 128), "num_warps": (1, 2, 4, 8)},
    "prefill": {"block_m": (16, 32, 64, 128), "block_n": (16, 32, 64), "num_warps": (4, 8),
                "num_stages": (1, 2, 3)},
    "copy": {"block_bytes": (2048, 4096, 8192, 16384, 32768, 65536),
             "programs_per_sm": (1, 2, 4, 8)},
    # declared for config= checks; not swept yet (not in KERNELS, no tuned table)
    "sketch": {"block_e": (4, 8, 16, 32, 64), "block_p": (4, 8, 16, 32), "num_warps": (1, 2, 4, 8)},
}


#: parameters that must be powers of two (tile shapes, warps); block_bytes also >= 128.
_POW2 = {"block_n", "block_m", "block_e", "block_p", "block_bytes", "num_warps"}


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
            f"config={config!r}: {problem}; see tierattn.kernels.tuning.SPACES[{kernel!r}].")
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
