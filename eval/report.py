"""Writing results users keep: JSON and CSV files, never-overwritten result folders, tables."""

from __future__ import annotations

import csv
import json
from pathlib import Path

__all__ = ["format_table", "new_results_dir", "results_summary", "save_json", "write_csv"]


def save_json(result: dict, out: str | Path | None, *, quiet: bool = False) -> Path | None:
    """Write ``result`` as indented JSON to ``out`` (folders created); None writes nothing."""
    if not out:
        return None
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    if not quiet:
        print(f"wrote {path}")
    return path


def new_results_dir(root: str | Path, name: str) -> Path:
    """Create ``root/name`` -- or ``root/name-2``, ``-3``... if it exists: results are never
    overwritten."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path, k = root / name, 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            k += 1
            path = root / f"{name}-{k}"


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
