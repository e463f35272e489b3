"""The documentation's references stay true: README.md, BENCHMARKS.md, docs/*.md and the READMEs
of kernels/ and eval/results/.

Guards, each in its own test:

* the README is a front page (at most 250 lines; the ``tierattn.patch(`` snippet early);
* every relative markdown link points to an existing file, and every ``#anchor`` into a
  markdown file names one of its headings (GitHub's slug rules);
* every repository path cited (``tierattn/runtime/cache.py``, ``eval/results/<run>/``,
  ``.ci/run``, globs such as ``eval/hardware/*.json``) exists;
* every dotted ``tierattn.*`` name cited resolves -- statically, from the source files' ASTs, so
  that names in modules that import vLLM are checked without vLLM installed;
* every ``tierattn ...`` command line in a fenced code block parses with the CLI's own parser;
* no page but BENCHMARKS.md carries issue numbers or commit hashes (provenance belongs in the
  results files).

Each test lists every offender in its failure message.
"""

from __future__ import annotations

import ast
import functools
import glob
import itertools
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted([README, ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md"),
               ROOT / "kernels" / "README.md", ROOT / "eval" / "results" / "README.md"])
#: the pages that must not name issues or commits (BENCHMARKS.md may keep provenance lines)
PROSE = [p for p in DOCS if p != ROOT / "BENCHMARKS.md"]
#: import prefix -> source folder (pyproject's setuptools ``package-dir``)
PACKAGE_DIRS = {"tierattn.kernels": "kernels", "tierattn.models": "models",
                "tierattn.eval": "eval", "tierattn": "tierattn"}
#: top-level folders whose paths the docs cite; other paths (``results/``, the CLI's default
#: output folder in the working directory, or ``/nvme/kv``) are the user's, not checked
REPO_FOLDERS = ("tierattn", "kernels", "models", "eval", "tests", "docs", ".ci")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _ids(paths: list[Path]) -> list[str]:
    return [_rel(p) for p in paths]


@functools.cache
def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


FENCE = re.compile(r"^(```|~~~)([^\n]*)\n(.*?)^\1[ \t]*$", re.M | re.S)
#: the fences whose lines are shell commands (other blocks hold code or a program's output,
#: where only ``$ ``-prefixed lines are commands)
SHELL = {"bash", "sh", "shell", "console"}


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return [(m.group(2).strip().lower(), m.group(3)) for m in FENCE.finditer(text)]


def _without_fences(text: str) -> str:
    return FENCE.sub("", text)


def test_readme_is_a_front_page():
    lines = _text(README).splitlines()
    assert len(lines) <= 250, (
        f"README.md has {len(lines)} lines; at most 250 (move detail to docs/)")
    starts = [m.start() for m in FENCE.finditer(_text(README)) if "tierattn.patch(" in m.group(3)]
    assert starts, "README.md has no code block with tierattn.patch("
    first_line = _text(README)[:starts[0]].count("\n") + 1
    assert first_line <= 80, f"the tierattn.patch( snippet starts on line {first_line}; at most 80"


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but ``-``/``_`` dropped, spaces
    to hyphens (inline code and link markup reduced to their text first)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    """Every heading's anchor, with GitHub's ``-1``, ``-2`` suffixes for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for line in _without_fences(_text(path)).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def _links(text: str) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_without_fences(text))]


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_relative_links_and_anchors_exist(doc):
    bad = []
    for target in _links(_text(doc)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: -- not ours
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {_rel(dest)}")
    assert not bad, f"{_rel(doc)}: broken links:\n  " + "\n  ".join(bad)


_FOLDERS = "|".join(re.escape(f) for f in REPO_FOLDERS)
#: a path starting with one of the repository's folders; braces and ``*`` for patterns
REPO_PATH = re.compile(rf"(?<![\w./~$-])(?:{_FOLDERS})/[\w.*{{}},/-]*")
#: a bare root file: an upper-case markdown name (README.md, DESIGN.md) or pyproject.toml
ROOT_FILE = re.compile(r"(?<![\w./-])(?:[A-Z][A-Z_]*\.md|pyproject\.toml)\b")


def _expand_braces(pattern: str) -> list[str]:
    """``ctx{2048,4096}-ps{16,8}`` -> the four names (shell brace expansion, unnested)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(choice) for choice in itertools.product(*options)]


def _cited_paths(text: str) -> set[str]:
    """Paths in inline code, in fenced blocks and in links (prose mentions count too)."""
    found = set()
    for m in REPO_PATH.finditer(text):
        token = m.group(0).rstrip(".,")
        if "{" in token and "}" not in token.split("{")[-1]:  # a brace cut by the regex
            continue
        found.add(token)
    found |= {m.group(0) for m in ROOT_FILE.finditer(text)}
    return found


def _path_exists(token: str) -> bool:
    for name in _expand_braces(token):
        if any(c in name for c in "*?["):
            if not glob.glob(str(ROOT / name)):
                return False
        elif not (ROOT / name).exists():
            return False
    return True


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_cited_repository_paths_exist(doc):
    missing = sorted(t for t in _cited_paths(_text(doc)) if not _path_exists(t))
    assert not missing, f"{_rel(doc)} cites paths that do not exist:\n  " + "\n  ".join(missing)


DOTTED = re.compile(r"(?<![\w./-])tierattn(?:\.[A-Za-z_]\w*)+")
#: ``from tierattn.x import a, b`` or ``import (a, b)`` in a snippet (or inside ``python -c``)
FROM_IMPORT = re.compile(
    r"(?<![\w.])from[ \t]+(tierattn[\w.]*)[ \t]+import[ \t]+(?:\(([^)]*)\)|([\w \t,*]*))")


def _module_file(module: str) -> Path | None:
    """The source file of ``tierattn.a.b`` by pyproject's folder mapping, or None."""
    for prefix, folder in PACKAGE_DIRS.items():
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix):].lstrip(".").split(".") if module != prefix else []
            base = ROOT.joinpath(folder, *rest)
            for candidate in (base.with_suffix(".py") if rest else None, base / "__init__.py"):
                if candidate is not None and candidate.is_file():
                    return candidate
            return None
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _lazy_and_all(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """A package's ``_LAZY = {name: module}`` (PEP 562 loading) and ``__all__`` names."""
    lazy, names = {}, set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
            if target == "_LAZY" and isinstance(value, ast.Dict):
                lazy = {ast.literal_eval(k): ast.literal_eval(v)
                        for k, v in zip(value.keys, value.values)}
            elif target == "__all__" and isinstance(value, (ast.List, ast.Tuple)):
                names = {ast.literal_eval(e) for e in value.elts}
    return lazy, names


def _assigned(target: ast.AST) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_assigned(e) for e in target.elts))
    return set()


def _body_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body defines: defs, classes, (annotated) assignments, imports."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                out.update(dict.fromkeys(_assigned(t), node))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            out.update(dict.fromkeys(_assigned(node.target), node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):  # `try: import x / except: ...` and guards
            blocks = [node.body, node.orelse] + [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                out.update(_body_names(block))
    return out


def _import_source(node: ast.ImportFrom, module_file: Path) -> str | None:
    """The absolute module an ``ImportFrom`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module
    package = _module_name(module_file).split(".")
    if module_file.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    for prefix, folder in PACKAGE_DIRS.items():
        if rel.parts[0] == folder:
            parts = [prefix, *rel.with_suffix("").parts[1:]]
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(parts)
    raise ValueError(path)


def _resolve_in(module: str, attrs: list[str]) -> str | None:
    """None when ``module.attrs...`` is defined, else why not."""
    path = _module_file(module)
    if path is None:
        return f"no module {module}"
    if not attrs:
        return None
    tree = _tree(path)
    name, rest = attrs[0], attrs[1:]
    lazy, exported = _lazy_and_all(tree)
    if name in lazy:
        return _resolve_in(lazy[name], [name, *rest])
    defined = _body_names(tree.body)
    if name not in defined:
        if name in exported:  # listed in __all__ but defined out of the AST's sight
            return None if not rest else f"{name} of {module} is exported but not found"
        if _module_file(f"{module}.{name}"):  # a submodule
            return _resolve_in(f"{module}.{name}", rest)
        return f"{module} defines no {name}"
    node = defined[name]
    if not rest:
        return None
    if isinstance(node, ast.ImportFrom):
        source = _import_source(node, path)
        if source and source.startswith("tierattn"):
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            return _resolve_in(source, [original, *rest])
        return None  # an attribute of a third-party object: not ours to check
    if isinstance(node, ast.ClassDef):
        members = _body_names(node.body)
        if rest[0] in members:
            return None  # deeper attributes (a method's attributes) are not checked
        return f"class {module}.{name} defines no {rest[0]}"
    return None  # an attribute of a plain object (a dict's key, an instance's field)


def _resolve(dotted: str) -> str | None:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):  # the longest prefix that is a module
        module = ".".join(parts[:n])
        if _module_file(module):
            return _resolve_in(module, parts[n:])
    return f"no module for {dotted}"


def _cited_names(text: str) -> set[str]:
    names = {m.group(0) for m in DOTTED.finditer(text)}
    for m in FROM_IMPORT.finditer(text):
        for item in (m.group(2) or m.group(3)).replace("\n", " ").split(","):
            item = item.strip().split(" as ")[0].strip()
            if item and item != "*":
                names.add(f"{m.group(1)}.{item}")
    return names


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_cited_tierattn_names_resolve(doc):
    bad = sorted(f"{n}: {why}" for n in _cited_names(_text(doc)) if (why := _resolve(n)))
    assert not bad, f"{_rel(doc)} cites names that do not exist:\n  " + "\n  ".join(bad)


COMMAND = re.compile(r"^(?:\$\s+)?(?:\S*/)?tierattn\s+(.*)$")


def _command_lines(text: str) -> list[str]:
    """``tierattn ...`` invocations in fenced blocks (continuations joined, one per ``&&``)."""
    out = []
    for language, block in _fenced_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            if language not in SHELL and not line.startswith("$ "):
                continue
            for segment in re.split(r"&&|;", line):
                segment = segment.strip()
                if COMMAND.match(segment):
                    out.append(segment)
    return out


def _argv(line: str) -> list[str] | None:
    """The arguments after ``tierattn``, cut at a pipe or redirection; None to skip the line."""
    if "..." in line or "<" in line or "[" in line:
        return None  # a usage pattern, not a command
    words = shlex.split(COMMAND.match(line).group(1), comments=True)
    cut = next((i for i, w in enumerate(words) if w in ("|", ">", ">>", "2>", "&>")), len(words))
    return words[:cut]


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_command_lines_parse(doc, monkeypatch):
    from tierattn.eval.cli import build_parser

    monkeypatch.chdir(ROOT)  # paths in the commands (which the parser checks) are the repo's
    bad = []
    for line in _command_lines(_text(doc)):
        argv = _argv(line)
        if argv is None:
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            bad.append(f"{line!r} (exit {exc.code})")
    assert not bad, f"{_rel(doc)}: command lines the CLI does not parse:\n  " + "\n  ".join(bad)


ISSUE = re.compile(r"\bissues? \d+\b|(?<![\w(#/])#\d+\b", re.I)
HASH = re.compile(r"(?<![\w./#-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/-])")
URL = re.compile(r"https?://\S+")


def _clean(text: str) -> str:
    """The text without URLs and link targets (anchors and paths may hold such tokens)."""
    text = URL.sub("", text)
    return re.sub(r"\]\([^)]*\)", "]()", text)


@pytest.mark.parametrize("doc", PROSE, ids=_ids(PROSE))
def test_no_issue_numbers_or_commit_hashes(doc):
    bad = []
    for i, line in enumerate(_clean(_text(doc)).splitlines(), 1):
        bad += [f"line {i}: issue reference {m.group(0)!r}" for m in ISSUE.finditer(line)]
        bad += [f"line {i}: commit hash {m.group(0)!r}" for m in HASH.finditer(line)]
    assert not bad, f"{_rel(doc)}: provenance belongs in the results files:\n  " + "\n  ".join(bad)
