"""The package's import layering: one-way imports between its modules, lazy (function-level)
imports included, and no cycle anywhere.

    errors -> config -> kernels -> storage (tiers, transfer, segment, kvfile), telemetry,
    the cost model -> pagemap/validate -> mover/staging/swaptiers -> prefetch/hostattn/swapcore ->
    importance/policy/planner -> attention/graphs -> snapshot -> cache -> models -> eval

A module may import modules of its own layer or below; an import of a higher layer, at load
time or inside a function, fails this test, and so does a cycle inside a layer. Across the
groups: storage imports neither the runtime nor serving; serving never imports the runtime.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: folder -> package (pyproject's package-dir)
PACKAGES = {"tierattn": "tierattn", "kernels": "tierattn.kernels", "models": "tierattn.models",
            "eval": "tierattn.eval"}
#: the tree's groups, and the groups each may import (besides the shared modules below them)
GROUPS = {"tierattn.storage": set(), "tierattn.serving": {"tierattn.storage"},
          "tierattn.runtime": {"tierattn.storage", "tierattn.serving"}}
LAYERS = [
    # the package root imports only the errors at load; it exposes the rest lazily (PEP 562)
    ["tierattn.errors", "tierattn"],
    ["tierattn.config"],
    ["tierattn.kernels"],
    ["tierattn.serving.costmodel", "tierattn.storage.kvfile", "tierattn.storage.segment",
     "tierattn.telemetry", "tierattn.storage.tiers", "tierattn.storage.transfer",
     "tierattn.storage", "tierattn.serving", "tierattn.runtime"],
    ["tierattn.storage.pagemap", "tierattn.runtime.validate"],
    ["tierattn.storage.mover", "tierattn.storage.staging", "tierattn.serving.swaptiers"],
    ["tierattn.runtime.prefetch", "tierattn.runtime.hostattn", "tierattn.serving.swapcore"],
    ["tierattn.runtime.importance", "tierattn.runtime.policy", "tierattn.runtime.planner"],
    ["tierattn.runtime.attention", "tierattn.runtime.graphs"],
    ["tierattn.runtime.snapshot"],
    ["tierattn.runtime.cache"],
    ["tierattn.models"],
    ["tierattn.eval"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts or "results" in path.relative_to(ROOT).parts:
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((pkg, *parts))] = path
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
    assert {"tierattn.storage.pagemap", "tierattn.storage.mover", "tierattn.runtime.prefetch",
            "tierattn.runtime.importance", "tierattn.runtime.policy",
            "tierattn.runtime.snapshot"} <= GRAPH["tierattn.runtime.cache"]
    for name in ("decode", "score", "prefill", "page_copy"):
        assert "tierattn.kernels.tuning" in GRAPH[f"tierattn.kernels.{name}"]
        assert "tierattn.kernels.autotune" not in GRAPH[f"tierattn.kernels.{name}"]
    assert not any(m.startswith("tierattn.eval") for m in GRAPH["tierattn.models.hf.patch"])


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_groups_import_only_what_they_build_on(group):
    others = set(GROUPS) - GROUPS[group] - {group}
    bad = sorted(f"{m} -> {n}" for m in GRAPH if m.startswith(group + ".")
                 for n in GRAPH[m] if any(n == o or n.startswith(o + ".") for o in others))
    assert not bad, f"{group} imports groups it must not: {bad}"


def test_every_folder_is_a_package_the_wheel_ships():
    # a folder of modules left out of pyproject's package list installs without its code
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert found == listed
