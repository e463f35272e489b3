"""Test setup: interpreter mode, NaN-poisoned allocations, and the kernel figures table.

Kernel tests run on CUDA when a GPU is present and under the Triton interpreter otherwise.
``TRITON_INTERPRET`` must be set before triton is imported, so it is set here, at the top.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tierattn.kernels import testing  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per worker: two workers with two spinning OpenMP threads each on a
    # 2-core machine make small tensor ops a hundred times slower
    torch.set_num_threads(1)

#: the engines' own test suites, vendored or fetched, run by their drivers (tests/upstream/*.py)
#: against tierattn, not by tierattn's test run
collect_ignore = ["upstream"]

DEVICE = torch.device("cuda" if torch.cuda.is_available() and
                      os.environ.get("TRITON_INTERPRET") != "1" else "cpu")


def pytest_configure(config: pytest.Config) -> None:
    # one folder per run, made by the xdist controller (or a plain run); workers inherit the path
    if not hasattr(config, "workerinput"):
        os.environ["TIERATTN_FIGURES_DIR"] = tempfile.mkdtemp(prefix="tierattn-figures-")
        # cached eval references (tierattn.eval.evals.fidelity) stay inside the run, not in ~/.cache
        os.environ["TIERATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="tierattn-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop("TIERATTN_FIGURES_DIR", ""), ignore_errors=True)
        shutil.rmtree(os.environ.pop("TIERATTN_CACHE_DIR", ""), ignore_errors=True)


def _figures_dir() -> Path:
    return Path(os.environ["TIERATTN_FIGURES_DIR"])


@pytest.fixture
def device() -> torch.device:
    """The device kernel tests run on: CUDA when present, else CPU under the interpreter."""
    return DEVICE


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``torch.empty`` returns NaN-filled (float) or sentinel-filled (int) memory, so
    anything a kernel forgets to write fails loudly (flash-linear-attention's practice)."""
    monkeypatch.setattr(torch, "empty", testing.nan_like_empty)


class Figures:
    """Appends one JSON line per recorded event to this worker's file."""

    def __init__(self, worker: str) -> None:
        self._path = _figures_dir() / f"{worker}.jsonl"

    def _write(self, **event) -> None:
        with self._path.open("a") as f:
            f.write(json.dumps(event) + "\n")

    def case(self, kernel: str, check: testing.RuleCheck | None = None, *,
             random: bool = False) -> None:
        """A numeric case of ``kernel`` ran; ``check`` carries its error ratio (None: exact)."""
        self._write(kind="case", kernel=kernel, ratio=check.ratio if check else 0.0,
                    random=random)

    def masking(self, kernel: str, exact: bool) -> None:
        self._write(kind="masking", kernel=kernel, exact=exact)

    def bad_input(self, kernel: str) -> None:
        self._write(kind="bad_input", kernel=kernel)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to a named figure outside the kernel table (e.g. files rejected)."""
        self._write(kind="count", kernel="", name=name, n=n)


@pytest.fixture(scope="session")
def figures(request: pytest.FixtureRequest) -> Figures:
    worker = getattr(request.config, "workerinput", {}).get("workerid", "main")
    return Figures(worker)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """Seed derived from the test id (and ``TIERATTN_TEST_SEED``); seeds torch too."""
    s = testing.seed_from(request.node.nodeid, int(os.environ.get("TIERATTN_TEST_SEED", "0")))
    torch.manual_seed(s)
    return s


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if hasattr(config, "workerinput"):
        return
    events = []
    for path in sorted(_figures_dir().glob("*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line]
    if not events:
        return
    cases: dict[str, int] = defaultdict(int)
    randoms: dict[str, int] = defaultdict(int)
    worst: dict[str, float] = defaultdict(float)
    masks: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    bad: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    for e in events:
        k = e["kernel"]
        if e["kind"] == "count":
            counts[e["name"]] += e["n"]
            continue
        if e["kind"] == "case":
            cases[k] += 1
            randoms[k] += e["random"]
            worst[k] = max(worst[k], e["ratio"])
        elif e["kind"] == "masking":
            masks[k][0] += e["exact"]
            masks[k][1] += 1
        else:
            bad[k] += 1
    kernels = sorted(set(cases) | set(masks) | set(bad))
    if not kernels and not counts:
        return
    tr = terminalreporter
    tr.section("tierattn figures")
    tr.write_line(f"device: {DEVICE} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})")
    if kernels:
        tr.write_line(f"{'kernel':<10} {'cases':>6} {'random':>7} {'worst err ratio':>16} "
                      f"{'masking exact':>14} {'bad inputs':>11}")
        for k in kernels:
            m = masks.get(k, [0, 0])
            tr.write_line(f"{k:<10} {cases[k]:>6} {randoms[k]:>7} {worst[k]:>16.4f} "
                          f"{f'{m[0]}/{m[1]}':>14} {bad[k]:>11}")
        tot_m = [sum(m[0] for m in masks.values()), sum(m[1] for m in masks.values())]
        tr.write_line(f"{'total':<10} {sum(cases.values()):>6} {sum(randoms.values()):>7} "
                      f"{max(worst.values(), default=0.0):>16.4f} "
                      f"{f'{tot_m[0]}/{tot_m[1]}':>14} {sum(bad.values()):>11}")
        tr.write_line("(worst err ratio = max|out-ref| / (2*max|torch_lowp-ref| + floor); "
                      "<= 1 passes)")
    for name, n in sorted(counts.items()):
        tr.write_line(f"{name}: {n}")
