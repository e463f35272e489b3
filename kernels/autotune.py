"""Kernel autotuning sweeps: checked, timed runs of each config of a kernel's declared space.

A sweep (:func:`autotune`, CUDA only) builds representative problems, computes each problem's
reference once, runs every config of the space (:data:`.tuning.SPACES`), rejects the ones that
fail to compile or break the error rule of :mod:`.testing`, times the rest with
``triton.testing.do_bench`` (median) next to the default config, and merges the winner per
bucketed key (:func:`.tuning.bucket_key`) into ``kernels/tuned/<gpu-slug>.json`` (e.g.
``nvidia-h200.json``), which the launchers read at run time through :mod:`.tuning`. Kernels
never import this module; it imports them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from tierattn.errors import KernelInputError, KernelUnsupportedError, TierConfigError

from ._common import triton_interpreting
from .tuning import (
    _DTYPES,
    _check_kernel,
    _gpu_name,
    _validate,
    bucket_key,
    clear_cache,
    config_space,
    load_tuned,
    tuned_path,
)

__all__ = [
    "DEFAULT_SHAPES", "MIN_GAIN", "Problem", "autotune", "format_summary", "make_problem",
    "merge_tuned", "save_tuned", "tune_problem",
]


#: a winner must beat the default by this fraction, or the default is kept (timing noise).
MIN_GAIN = 0.02


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
