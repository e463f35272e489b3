"""Writing results users keep: JSON files next to the printed tables."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["save_json"]


def save_json(result: dict, out: str | Path | None) -> Path | None:
    """Write ``result`` as indented JSON to ``out`` (folders created); None writes nothing."""
    if not out:
        return None
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
