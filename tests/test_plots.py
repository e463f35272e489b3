"""The eval plots (tierattn.eval.plots): the files each function writes, from synthetic cells and
from committed results, and the reading rules the plots keep -- legends outside the axes,
direct labels that overlap nothing, points that share a value drawn apart, KL 0 on the floor."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tierattn.eval import plots

RESULTS = Path(__file__).resolve().parent.parent / "eval" / "results"
REASONING = RESULTS / "reasoning-reasoner-n200-ps8-seed2026-b0.25_0.5_0.75" / "results.json"
FIDELITY = RESULTS / "fidelity-smollm2-s8-ps16-seed0-b0.25_0.5" / "results.json"
#: the default reasoning job's methods (``--full`` runs all twelve)
DEFAULT_METHODS = {"full", "offload", "topk", "evict-snapkv", "evict-h2o", "oracle"}
PNG = b"\x89PNG\r\n\x1a\n"


def _acc(method: str, hbm: float, accuracy: float, kib: float = 0.0, **kw) -> dict:
    return {"section": "main", "method": method, "hbm": hbm, "evict": 0.0, "feasible": True,
            "accuracy": accuracy, "ci_low": max(accuracy - 0.05, 0.0),
            "ci_high": min(accuracy + 0.05, 1.0), "h2d_bytes_per_token": kib * 1024, **kw}


def reasoning_cells(grid: bool = True) -> list[dict]:
    """Main cells over two budgets (top-k variants sharing their bytes, as measured), a grid."""
    cells = [_acc("full", 1.0, 0.99)]
    for hbm in (0.25, 0.5):
        cells += [_acc("offload", hbm, 0.99, kib=600 * (1 - hbm)),
                  _acc("topk", hbm, 0.97 + hbm / 20, kib=147),
                  _acc("topk-max", hbm, 0.96 + hbm / 20, kib=147),
                  _acc("topk-quest", hbm, 0.5 + hbm, kib=147),
                  _acc("evict-h2o", hbm, 0.1 + hbm), _acc("evict-snapkv", hbm, 0.3 + hbm),
                  _acc("oracle", hbm, 0.9 + hbm / 10)]
    # an infeasible cell has no measurements: it must be skipped, not plotted
    cells.append({"section": "main", "method": "evict-rkv", "hbm": 0.25, "feasible": False,
                  "reason": "budget below the sink and window"})
    if grid:
        cells += [{"section": "grid", "method": "h2o+offload", "hbm": h, "evict": e,
                   "feasible": True, "accuracy": 0.99 - e} for h in (0.2, 0.5)
                  for e in (0.0, 0.25, 0.5)]
    return cells


def fidelity_cells() -> list[dict]:
    """Fidelity rows: the full reference, exact offload (KL 0 and float noise below 0), an
    infeasible cell without measurements, rows with and without top-1 intervals."""
    rows = [{"method": "full", "hbm": 1.0, "feasible": True, "kl_mean": 0.0,
             "top1_agreement": 1.0, "top1_ci_low": None, "top1_ci_high": None}]
    for hbm, kl in ((0.25, 0.0), (0.5, -1e-9)):
        rows.append({"method": "offload", "hbm": hbm, "feasible": True, "kl_mean": kl,
                     "top1_agreement": 1.0, "top1_ci_low": 0.97, "top1_ci_high": 1.0})
    for hbm in (0.25, 0.5):
        rows.append({"method": "topk", "hbm": hbm, "feasible": True, "kl_mean": 0.02 / hbm,
                     "top1_agreement": 0.9, "top1_ci_low": None, "top1_ci_high": None})
        rows.append({"method": "evict-h2o", "hbm": hbm, "feasible": True, "kl_mean": 1.0,
                     "top1_agreement": 0.5, "top1_ci_low": 0.4, "top1_ci_high": 0.6})
    rows.append({"method": "evict-streaming", "hbm": 0.1, "feasible": False, "reason": "x"})
    return rows


@pytest.fixture
def figures(monkeypatch) -> list:
    """The figures the plot functions save, kept open (and drawn) for inspection."""
    kept = []

    def keep(plt, fig, path):
        fig.canvas.draw()
        kept.append(fig)
        fig.savefig(path, dpi=plots._DPI)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    yield kept
    plots._pyplot().close("all")


def assert_pngs(paths: list[Path], names: list[str]) -> None:
    assert [p.name for p in paths] == names
    for p in paths:
        assert p.is_file() and p.read_bytes()[:8] == PNG


def assert_readable(fig) -> None:
    """No legend overlaps an axes; no two texts inside an axes overlap."""
    renderer = fig.canvas.get_renderer()
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert legends
    frames = [ax.get_window_extent(renderer) for ax in fig.axes]
    for legend, frame in itertools.product(legends, frames):
        assert not legend.get_window_extent(renderer).overlaps(frame)
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts if t.get_text()]
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b)


def test_reasoning_plots_files(tmp_path, figures):
    paths = plots.reasoning_plots(reasoning_cells(), tmp_path)
    assert_pngs(paths, ["accuracy_vs_hbm.png", "hbm_x_evict_heatmap.png",
                        "bytes_vs_accuracy.png"])
    assert len(figures) == 3
    for fig in (figures[0], figures[2]):
        assert_readable(fig)
    # no grid rows: no heatmap, the other two as before
    (tmp_path / "no-grid").mkdir()
    paths = plots.reasoning_plots(reasoning_cells(grid=False), tmp_path / "no-grid")
    assert_pngs(paths, ["accuracy_vs_hbm.png", "bytes_vs_accuracy.png"])


def test_bytes_panels(tmp_path, figures):
    """Eviction and the oracle left (x = HBM ratio), the byte movers right (x = KiB): the
    points that share bytes (the top-k variants, every budget) are spread, none on another."""
    plots.reasoning_plots(reasoning_cells(), tmp_path)
    left, right = figures[2].axes

    def markers(ax):  # the per-budget markers (not the error bars' caps)
        return [(x, y) for ln in ax.lines if ln.get_marker() in plots._MARKERS
                for x, y in zip(ln.get_xdata(), ln.get_ydata())]

    assert len(markers(left)) == 3 * 2  # evict-h2o, evict-snapkv, oracle at two budgets
    assert all(0.1 < x < 0.65 for x, _ in markers(left))
    shared = [x for x, _ in markers(right) if abs(x - 147) < 60]
    assert len(shared) == 3 * 2 and len(set(shared)) == 6  # top-k family: all apart
    assert len(markers(right)) == 4 * 2
    # offload and top-k carry their names beside their curves
    assert {"offload", "topk"} <= {t.get_text() for t in right.texts}


def test_fidelity_plots(tmp_path, figures):
    """Infeasible rows skipped, KL 0 and below drawn on the floor, intervals where present."""
    assert "fidelity_plots" in plots.__all__
    paths = plots.fidelity_plots(fidelity_cells(), tmp_path)
    assert_pngs(paths, ["fidelity_vs_hbm.png"])
    (fig,) = figures
    assert_readable(fig)
    kl_ax, top_ax = fig.axes
    assert kl_ax.get_yscale() == "log"
    ys = [y for ln in kl_ax.lines for y in ln.get_ydata()]
    assert min(ys) == plots.KL_FLOOR
    # offload, topk, evict-h2o at two budgets each (full and the infeasible row not drawn)
    xs = {round(x, 6) for ln in kl_ax.lines for x in ln.get_xdata()}
    assert len(xs) == 6 and not any(abs(x - 0.1) < 1e-3 or x > 0.9 for x in xs)


def test_fidelity_one_budget(tmp_path):
    rows = [r for r in fidelity_cells() if r["hbm"] in (0.25, 1.0)]
    assert_pngs(plots.fidelity_plots(rows, tmp_path), ["fidelity_vs_hbm.png"])


@pytest.mark.skipif(not REASONING.exists(), reason="committed reasoning results missing")
@pytest.mark.parametrize("methods", [None, DEFAULT_METHODS], ids=["all", "default"])
def test_reasoning_plots_committed(tmp_path, figures, methods):
    cells = json.loads(REASONING.read_text())["cells"]
    if methods is not None:
        cells = [c for c in cells if c["section"] != "main" or c["method"] in methods]
    paths = plots.reasoning_plots(cells, tmp_path)
    assert_pngs(paths, ["accuracy_vs_hbm.png", "hbm_x_evict_heatmap.png",
                        "bytes_vs_accuracy.png"])
    for fig in (figures[0], figures[2]):
        assert_readable(fig)


@pytest.mark.skipif(not FIDELITY.exists(), reason="committed fidelity results missing")
def test_fidelity_plots_committed(tmp_path, figures):
    cells = json.loads(FIDELITY.read_text())["cells"]
    # and merged with the one-budget runs at 4096 tokens, as a caller may pass them
    for f in sorted(RESULTS.glob("fidelity-smollm2-ctx4096-s2-ps16-seed0-b0.*/results.json")):
        cells += json.loads(f.read_text())["cells"]
    assert_pngs(plots.fidelity_plots(cells, tmp_path), ["fidelity_vs_hbm.png"])
    assert_readable(figures[0])
