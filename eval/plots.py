"""PNG plots of the evals (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["reasoning_plots"]

#: one colour per method, stable across plots
COLORS = {"full": "black", "offload": "tab:green", "topk": "tab:olive",
          "topk-max": "yellowgreen", "topk-quest": "tab:cyan", "evict-h2o": "tab:red",
          "evict-snapkv": "tab:orange", "evict-streaming": "tab:purple",
          "evict-random": "tab:gray", "oracle": "tab:blue", "h2o+offload": "tab:brown",
          "evict-snapkv-decode": "tab:pink", "evict-rkv": "darkred"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def reasoning_plots(cells: list[dict], out: str | Path) -> list[Path]:
    """Accuracy vs HBM ratio per method, the HBM x eviction heatmap, bytes moved vs accuracy.

    Args:
        cells: rows of :func:`tierattn.eval.reasoning.run_reasoning` (``section`` ``main`` and
            ``grid`` are plotted).
        out: folder for the PNG files.

    Returns:
        The written paths.
    """
    plt = _pyplot()
    out = Path(out)
    paths = []
    main = [c for c in cells if c["section"] == "main" and c.get("feasible", True)]
    full = next((c for c in main if c["method"] == "full"), None)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if full is not None:
        ax.axhspan(full["ci_low"], full["ci_high"], color="black", alpha=0.08)
        ax.axhline(full["accuracy"], color="black", lw=1, label="full cache")
    for method in dict.fromkeys(c["method"] for c in main if c["method"] != "full"):
        rows = sorted((c for c in main if c["method"] == method), key=lambda c: c["hbm"])
        x = [c["hbm"] for c in rows]
        y = [c["accuracy"] for c in rows]
        err = [[c["accuracy"] - c["ci_low"] for c in rows], [c["ci_high"] - c["accuracy"]
                                                               for c in rows]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=method,
                    color=COLORS.get(method))
    ax.set(xlabel="HBM budget (fraction of the KV bytes held in HBM, key tier included)",
           ylabel="exact-chain accuracy (Wilson 95%)", ylim=(-0.02, 1.02),
           title="Multi-hop pointer chasing at equal HBM budget")
    paths.append(_save(plt, fig, ax, out / "accuracy_vs_hbm.png"))

    grid = [c for c in cells if c["section"] == "grid"]
    if grid:
        hbms = sorted({c["hbm"] for c in grid})
        evicts = sorted({c["evict"] for c in grid})
        acc = [[next((c["accuracy"] for c in grid if c["hbm"] == h and c["evict"] == e),
                     float("nan")) for h in hbms] for e in evicts]
        fig, ax = plt.subplots(figsize=(5.2, 4.2))
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
        paths.append(_save(plt, fig, None, out / "hbm_x_evict_heatmap.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in dict.fromkeys(c["method"] for c in main):
        # one line per method through its budgets: the frontier it offers (eviction moves no
        # bytes, so it sits at x = 1)
        rows = sorted((c for c in main if c["method"] == method), key=lambda c: c["hbm"])
        ax.plot([max(c["h2d_bytes_per_token"], 1.0) for c in rows],
                [c["accuracy"] for c in rows], marker="o", ms=4, lw=1, label=method,
                color=COLORS.get(method))
        for c in rows:
            if method != "full":
                ax.annotate(f"{c['hbm']:g}", (max(c["h2d_bytes_per_token"], 1.0),
                                              c["accuracy"]), fontsize=6)
    ax.set_xscale("log")
    ax.set(xlabel="H2D bytes per generated token (1 = none; labels: HBM ratio)",
           ylabel="exact-chain accuracy", ylim=(-0.02, 1.02),
           title="Bytes moved vs accuracy")
    paths.append(_save(plt, fig, ax, out / "bytes_vs_accuracy.png"))
    return paths


def _save(plt, fig, legend_ax, path: Path) -> Path:
    if legend_ax is not None:
        legend_ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
