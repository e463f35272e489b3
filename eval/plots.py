"""PNG plots of the evals (matplotlib, headless).

Conventions shared by the plots: one colour per method (:data:`COLORS`), eviction methods drawn
dashed (they lose tokens; the others keep every token in some tier), legends outside the axes so
they never cover data, and methods that share an x value drawn side by side ("dodged") so their
points and error bars stay apart.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["fidelity_plots", "reasoning_plots"]

#: one colour per method, stable across plots
COLORS = {"full": "black", "offload": "tab:green", "topk": "tab:olive",
          "topk-max": "goldenrod", "topk-quest": "tab:cyan", "evict-h2o": "tab:red",
          "evict-snapkv": "tab:orange", "evict-streaming": "tab:purple",
          "evict-random": "tab:gray", "oracle": "tab:blue", "h2o+offload": "tab:brown",
          "evict-snapkv-decode": "tab:pink", "evict-rkv": "darkred"}

#: legend order: the reference, the exact and recall methods, the oracle, then eviction
_ORDER = ["full", "offload", "topk", "topk-max", "topk-quest", "oracle", "evict-snapkv",
          "evict-snapkv-decode", "evict-h2o", "evict-rkv", "evict-streaming", "evict-random"]

#: one marker per HBM ratio in the bytes plot (where x is not the HBM ratio)
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]

#: token KL below this is drawn on it: exact methods give 0 or float noise (~1e-9, either sign)
KL_FLOOR = 1e-6

_DPI = 130


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _methods(rows: list[dict]) -> list[str]:
    """The methods in ``rows``, in legend order (unknown ones last, as they come)."""
    seen = list(dict.fromkeys(r["method"] for r in rows))
    return sorted(seen, key=lambda m: (_ORDER.index(m) if m in _ORDER else len(_ORDER),
                                       seen.index(m)))


def _style(method: str) -> dict:
    """Colour and line style of ``method`` (eviction dashed)."""
    return {"color": COLORS.get(method), "ls": "--" if method.startswith("evict") else "-"}


def _dodge(methods: list[str], xs: list[float], share: float = 0.6) -> dict[str, float]:
    """An x offset per method so that ``methods`` at the same ``xs`` sit side by side.

    The group spans ``share`` of the smallest gap between the ``xs`` (of 0.25 with one x).
    """
    xs = sorted(set(xs))
    gap = min((b - a for a, b in zip(xs, xs[1:])), default=0.25)
    step = share * gap / max(len(methods), 1)
    return {m: (i - (len(methods) - 1) / 2) * step for i, m in enumerate(methods)}


def _hbm_axis(ax, budgets: list[float], dodge: dict[str, float]) -> None:
    """Ticks at the budgets and room for the dodged points on either side."""
    budgets = sorted(set(budgets))
    pad = max((abs(v) for v in dodge.values()), default=0.0) + 0.04
    ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax.set_xlim(budgets[0] - pad, budgets[-1] + pad)


def _errorbar(ax, x, rows: list[dict], key: str, lo: str, hi: str, **kw):
    """``ax.errorbar`` of ``rows[key]`` with the ``lo``/``hi`` interval where rows have one."""
    y = [r[key] for r in rows]
    err = None
    if any(r.get(lo) is not None and r.get(hi) is not None for r in rows):
        # rows without an interval (older runs, merged with newer ones) get none; max(0, .):
        # a Wilson bound can sit a float ulp on the wrong side of the estimate
        err = [[max(0.0, r[key] - r[lo]) if r.get(lo) is not None else 0.0 for r in rows],
               [max(0.0, r[hi] - r[key]) if r.get(hi) is not None else 0.0 for r in rows]]
    return ax.errorbar(x, y, yerr=err, capsize=2, elinewidth=0.8, lw=1.2, **kw)


def _full_band(ax, full: dict | None):
    """The full cache's accuracy and 95% interval as a horizontal band (its legend handle)."""
    if full is None:
        return None
    # a (band, line) tuple: the legend draws the two overlaid, as on the axes
    return (ax.axhspan(full["ci_low"], full["ci_high"], color="black", alpha=0.1, lw=0),
            ax.axhline(full["accuracy"], color="black", lw=1))


def _save(plt, fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` and close it."""
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def reasoning_plots(cells: list[dict], out: str | Path) -> list[Path]:
    """Accuracy vs HBM ratio per method, the HBM x eviction heatmap, bytes moved vs accuracy.

    Args:
        cells: rows of :func:`tierattn.eval.evals.reasoning.run_reasoning` (``section`` ``main`` and
            ``grid`` are plotted; infeasible rows are skipped).
        out: folder for the PNG files.

    Returns:
        The written paths: ``accuracy_vs_hbm.png``, ``hbm_x_evict_heatmap.png`` (only with
        ``grid`` rows) and ``bytes_vs_accuracy.png``.
    """
    plt = _pyplot()
    out = Path(out)
    main = [c for c in cells if c["section"] == "main" and c.get("feasible") is not False]
    full = next((c for c in main if c["method"] == "full"), None)
    rest = [c for c in main if c["method"] != "full"]
    paths = [_accuracy_vs_hbm(plt, rest, full, out / "accuracy_vs_hbm.png")]
    grid = [c for c in cells if c["section"] == "grid" and c.get("feasible") is not False]
    if grid:
        paths.append(_heatmap(plt, grid, out / "hbm_x_evict_heatmap.png"))
    paths.append(_bytes_vs_accuracy(plt, rest, full, out / "bytes_vs_accuracy.png"))
    return paths


def _accuracy_vs_hbm(plt, rows: list[dict], full: dict | None, path: Path) -> Path:
    """Accuracy with Wilson intervals against the HBM budget, one dodged line per method."""
    fig, ax = plt.subplots(figsize=(7.8, 4.4), layout="constrained")
    handles, labels = [], []
    band = _full_band(ax, full)
    if band is not None:
        handles.append(band)
        labels.append("full cache (HBM 1, 95% CI)")
    methods = _methods(rows)
    dodge = _dodge(methods, [c["hbm"] for c in rows])
    for method in methods:
        mrows = sorted((c for c in rows if c["method"] == method), key=lambda c: c["hbm"])
        handles.append(_errorbar(ax, [c["hbm"] + dodge[method] for c in mrows], mrows,
                                 "accuracy", "ci_low", "ci_high", marker="o", ms=4,
                                 **_style(method)))
        labels.append(method)
    if rows:
        _hbm_axis(ax, [c["hbm"] for c in rows], dodge)
    ax.set(xlabel="HBM budget (fraction of the KV bytes held in HBM, key tier included)",
           ylabel="exact-chain accuracy (Wilson 95%)", ylim=(-0.02, 1.02),
           title="Multi-hop pointer chasing at equal HBM budget")
    ax.grid(alpha=0.3)
    fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    return _save(plt, fig, path)


def _heatmap(plt, grid: list[dict], path: Path) -> Path:
    """H2O+offload accuracy over the HBM ratio x eviction ratio grid."""
    hbms = sorted({c["hbm"] for c in grid})
    evicts = sorted({c["evict"] for c in grid})
    acc = [[next((c["accuracy"] for c in grid if c["hbm"] == h and c["evict"] == e),
                 float("nan")) for h in hbms] for e in evicts]
    fig, ax = plt.subplots(figsize=(5.2, 4.2), layout="constrained")
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis", origin="lower")
    for i in range(len(evicts)):
        for j in range(len(hbms)):
            ax.text(j, i, f"{acc[i][j]:.2f}", ha="center", va="center",
                    color="white" if acc[i][j] < 0.6 else "black")
    ax.set_xticks(range(len(hbms)), [f"{h:g}" for h in hbms])
    ax.set_yticks(range(len(evicts)), [f"{e:g}" for e in evicts])
    ax.set(xlabel="HBM ratio (rest offloaded)", ylabel="eviction ratio (H2O, dropped)",
           title="Accuracy: HBM ratio x eviction ratio")
    fig.colorbar(im, ax=ax, label="exact-chain accuracy")
    return _save(plt, fig, path)


def _bytes_vs_accuracy(plt, rows: list[dict], full: dict | None, path: Path) -> Path:
    """The frontier: accuracy against H2D bytes per generated token.

    Two panels share the accuracy axis. Left, the methods that move no bytes (eviction and the
    eviction oracle) over the HBM budgets: on a bytes axis they would all stack at x = 0. Right,
    the methods that move bytes (offload, top-k) against KiB moved per token, one line through
    each method's budgets. The marker shape is the HBM ratio in both panels, so a budget can be
    followed across them; the legend sits below the panels.
    """
    from matplotlib.lines import Line2D

    zero = [c for c in rows if not c.get("h2d_bytes_per_token")]
    moved = [c for c in rows if c.get("h2d_bytes_per_token")]
    budgets = sorted({c["hbm"] for c in rows})
    marker = {b: _MARKERS[i % len(_MARKERS)] for i, b in enumerate(budgets)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 4.6), sharey=True,
                                      gridspec_kw={"width_ratios": [1, 1.5]},
                                      layout="constrained")
    bands = [_full_band(ax, full) for ax in (left, right)]
    lines = {}  # method -> legend handle
    placed = {left: {}, right: {}}  # ax -> method -> [(x, accuracy, ci_low, ci_high)]

    def draw(ax, method: str, mrows: list[dict], x: list[float]) -> None:
        # the line and the error bars in the method's style, then one marker per budget
        style = _style(method)
        lines[method] = _errorbar(ax, x, mrows, "accuracy", "ci_low", "ci_high", **style)
        placed[ax][method] = [(xi, c["accuracy"], c.get("ci_low", c["accuracy"]),
                               c.get("ci_high", c["accuracy"])) for xi, c in zip(x, mrows)]
        for xi, c in zip(x, mrows):
            ax.plot(xi, c["accuracy"], marker=marker[c["hbm"]], ms=6, color=style["color"],
                    mec="white", mew=0.6, ls="none", zorder=3)

    methods = _methods(zero)
    dodge = _dodge(methods, [c["hbm"] for c in zero])
    for method in methods:
        mrows = sorted((c for c in zero if c["method"] == method), key=lambda c: c["hbm"])
        draw(left, method, mrows, [c["hbm"] + dodge[method] for c in mrows])
    if zero:
        _hbm_axis(left, [c["hbm"] for c in zero], dodge)
    left.set(xlabel="HBM ratio (methods side by side)", ylabel="exact-chain accuracy (Wilson 95%)",
             ylim=(-0.02, 1.02), title="0 bytes moved: eviction, oracle")

    kib = {id(c): c["h2d_bytes_per_token"] / 1024 for c in moved}
    # top-k fetches the same pages per token at every budget, and so do its variants: many
    # points share one x. Spread them side by side (2% of the axis apart, method by method,
    # budgets in order) around a dotted line at the true x.
    span = max(kib.values(), default=1.0)
    step = 0.02 * span
    shift, guides = {}, []
    for x in set(kib.values()):
        at = [c for c in moved if kib[id(c)] == x]
        if len(at) == 1:
            continue
        pos, prev, order = [], None, _methods(at)
        for c in sorted(at, key=lambda c: (order.index(c["method"]), c["hbm"])):
            # half a step more between methods than between a method's budgets
            pos.append(0.0 if prev is None else pos[-1] + step * (1.5 if c["method"] != prev
                                                                  else 1.0))
            shift[id(c)], prev = pos[-1], c["method"]
        for c in at:
            shift[id(c)] -= pos[-1] / 2
        right.axvline(x, color="gray", lw=0.8, ls=":", zorder=0)
        guides.append(x)
    for method in _methods(moved):
        mrows = sorted((c for c in moved if c["method"] == method), key=lambda c: c["hbm"])
        draw(right, method, mrows, [kib[id(c)] + shift.get(id(c), 0.0) for c in mrows])
    right.set_xlim(0, 1.1 * span)
    right.set(xlabel="H2D KiB per generated token (points at one value: side by side, dotted)",
              title="Bytes moved: offload (exact), top-k recall")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=9)

    # one legend below the panels: the methods column by column, then the HBM markers in
    # columns of their own (blank entries pad the methods' last column)
    entries = ([(bands[0], "full cache (HBM 1, 95% CI)")] if full is not None else []) + \
        [(lines[m], m) for m in _methods(rows)]
    nrow = max(-(-len(entries) // 5), min(len(budgets), 4), 1)
    blank = Line2D([], [], ls="none")
    entries += [(blank, "")] * (-len(entries) % nrow)
    entries += [(Line2D([], [], marker=marker[b], color="dimgray", ls="none", ms=6),
                 f"HBM {b:g}") for b in budgets]
    fig.suptitle("Accuracy against bytes moved per token, at equal HBM budget")
    if entries:
        fig.legend(*zip(*entries), loc="outside lower center", ncol=-(-len(entries) // nrow),
                   fontsize=8)
    # the right panel's few curves also get their names beside them (the left one is too busy)
    _label_curves(fig, right, placed[right], guides)
    return _save(plt, fig, path)


def _label_curves(fig, ax, curves: dict[str, list[tuple]], vlines: list[float] = ()) -> None:
    """Write each method's name beside its points where it overlaps nothing.

    ``curves`` maps a method to its points ``(x, y, y_low, y_high)``; ``vlines`` are the x of
    vertical guide lines, kept clear too. Candidate spots around
    the curve's lowest point, then its highest, are tried in turn; a label goes to the first
    spot inside the axes that overlaps no point, error bar or earlier label, and is left out
    (the legend still names the curve) when there is none.
    """
    from matplotlib.transforms import Bbox

    fig.canvas.draw()  # runs the layout: display coordinates are final from here
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    to_px = ax.transData.transform
    taken = []
    for pts in curves.values():
        for x, _, lo, hi in pts:
            (x0, y0), (x1, y1) = to_px((x, lo)), to_px((x, hi))
            taken.append(Bbox([[x0 - 6, y0 - 6], [x1 + 6, y1 + 6]]))
    for x in vlines:  # guide lines: a label across one reads badly
        taken.append(Bbox([[to_px((x, 0))[0] - 1, frame.y0], [to_px((x, 0))[0] + 1, frame.y1]]))
    spots = [((0, -14), "center", "top"), ((4, -14), "left", "top"),
             ((-4, -14), "right", "top"), ((10, 0), "left", "center"),
             ((-10, 0), "right", "center")]
    for method, pts in curves.items():
        low, high = min(pts, key=lambda p: p[1]), max(pts, key=lambda p: p[1])
        tries = [(low, *s) for s in spots] + [(high, (0, 14), "center", "bottom")]
        for (x, y, *_), offset, ha, va in tries:
            text = ax.annotate(method, (x, y), xytext=offset, textcoords="offset points",
                               ha=ha, va=va, fontsize=8, color=COLORS.get(method))
            box = text.get_window_extent(renderer)
            if (frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
                    and not any(box.overlaps(b) for b in taken)):
                taken.append(box)
                break
            text.remove()


def fidelity_plots(cells: list[dict], out: str | Path) -> list[Path]:
    """Token KL and top-1 agreement with the full cache against the HBM ratio, per method.

    Args:
        cells: rows of :func:`tierattn.eval.evals.fidelity.run_fidelity`, possibly merged from
        several
            runs (one budget or many). Infeasible rows and the ``full`` reference row (KL 0,
            top-1 1 by definition) are not drawn as points; top-1 = 1 is drawn as a line.
        out: folder for the PNG file.

    Returns:
        The written path: ``fidelity_vs_hbm.png``.
    """
    plt = _pyplot()
    out = Path(out)
    rows = [c for c in cells if c.get("feasible") is not False and c["method"] != "full"
            and c.get("kl_mean") is not None]
    fig, (kl_ax, top_ax) = plt.subplots(1, 2, figsize=(9.6, 4.4), layout="constrained")
    # the reference dotted, so that an exact method's line at 1 stays visible on it
    handles = [top_ax.axhline(1.0, color="black", lw=1, ls=":")]
    labels = ["full cache (reference)"]
    methods = _methods(rows)
    dodge = _dodge(methods, [c["hbm"] for c in rows])
    for method in methods:
        mrows = sorted((c for c in rows if c["method"] == method), key=lambda c: c["hbm"])
        x = [c["hbm"] + dodge[method] for c in mrows]
        style = _style(method)
        kl = [max(c["kl_mean"], KL_FLOOR) for c in mrows]
        kl_ax.plot(x, kl, marker="o", ms=5, **style)
        # the clipped points (exact to float noise) hollow, on the floor
        clipped = [(xi, k) for xi, k, c in zip(x, kl, mrows) if c["kl_mean"] < KL_FLOOR]
        if clipped:
            kl_ax.plot(*zip(*clipped), marker="o", ms=5, ls="none", mfc="white",
                       color=style["color"], zorder=3)
        handles.append(_errorbar(top_ax, x, mrows, "top1_agreement", "top1_ci_low",
                                 "top1_ci_high", marker="o", ms=5, **style))
        labels.append(method)
    kl_ax.set_yscale("log")
    kl_ax.set(xlabel="HBM budget", title="Token KL (lower is better)",
              ylabel=f"mean token KL vs full cache (log)\nhollow: < {KL_FLOOR:g} (exact), "
                     "drawn at it")
    top_ax.set(xlabel="HBM budget", ylabel="top-1 agreement with the full cache",
               title="Top-1 agreement (higher is better)")
    for ax in (kl_ax, top_ax):
        if rows:
            _hbm_axis(ax, [c["hbm"] for c in rows], dodge)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=9)
    fig.suptitle("Fidelity to the full cache at equal HBM budget")
    nrow = -(-len(labels) // 6)  # rows of at most 6, as even as they go
    fig.legend(handles, labels, loc="outside lower center", ncol=-(-len(labels) // nrow),
               fontsize=8)
    return [_save(plt, fig, out / "fidelity_vs_hbm.png")]
