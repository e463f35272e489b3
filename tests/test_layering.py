"""The package's import layering: one-way imports between its modules, lazy (function-level)
imports included, and no cycle anywhere.

    errors -> config -> kernels -> tiers/transfer (segment, kvfile, telemetry, costmodel) ->
    pagemap/validate -> mover/staging/swaptiers -> prefetch/hostattn/swapcore ->
    importance/policy/planner -> attention/graphs ->
    snapshot -> cache -> models -> eval

A module may import modules of its own layer or below; an import of a higher layer, at load
time or inside a function, fails this test, and so does a cycle inside a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: folder -> package (pyproject's package-dir)
PACKAGES = {"tierattn": "tierattn", "kernels": "tierattn.kernels", "models": "tierattn.models",
            "eval": "tierattn.eval"}
LAYERS = [
    # the package root imports only the errors at load; it exposes the rest lazily (PEP 562)
    ["tierattn.errors", "tierattn"],
    ["tierattn.config"],
    ["tierattn.kernels"],
    ["tierattn.costmodel", "tierattn.kvfile", "tierattn.segment", "tierattn.telemetry",
     "tierattn.tiers", "tierattn.transfer"],
    ["tierattn.pagemap", "tierattn.validate"],
    ["tierattn.mover", "tierattn.staging", "tierattn.swaptiers"],
    ["tierattn.prefetch", "tierattn.hostattn", "tierattn.swapcore"],
    ["tierattn.importance", "tierattn.policy", "tierattn.planner"],
    ["tierattn.attention", "tierattn.graphs"],
    ["tierattn.snapshot"],
    ["tierattn.cache"],
    ["tierattn.models"],
    ["tierattn.eval"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    best = None
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if module == prefix or (prefix != "tierattn" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    if best is None:
        raise AssertionError(f"{module} belongs to no layer; add it to LAYERS in this test")
    return best[0]


def _imports(module: str) -> set[str]:
    """Every tierattn module ``module`` imports, anywhere in the file."""
    path = MODULES[module]
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` may import a submodule
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module and name.startswith("tierattn"):
                found.add(name)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    mine = _layer(module)
    up = sorted(m for m in GRAPH[module] if _layer(m) > mine)
    assert not up, f"{module} (layer {mine}) imports higher layers: {up}"


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_test_sees_the_runtime_split():
    # the graph is real: the facade imports its parts, kernels never import the sweep
    assert {"tierattn.pagemap", "tierattn.mover", "tierattn.prefetch", "tierattn.importance",
            "tierattn.policy", "tierattn.snapshot"} <= GRAPH["tierattn.cache"]
    for name in ("decode", "score", "prefill", "page_copy"):
        assert "tierattn.kernels.tuning" in GRAPH[f"tierattn.kernels.{name}"]
        assert "tierattn.kernels.autotune" not in GRAPH[f"tierattn.kernels.{name}"]
    assert not any(m.startswith("tierattn.eval") for m in GRAPH["tierattn.models.patch"])
