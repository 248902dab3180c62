"""ART threshold sensitivity: tau x phi heatmaps, patience curves, Pareto frontiers, false stops.

Every function takes the DataFrames of :mod:`art_analysis.analysis.sensitivity`.  Run as a
module (``python -m art_analysis.plots.sensitivity``) for a synthetic cache.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .figure_io import demo_main, finish_log_axes, save_figure

ERROR_FLOOR = 1e-8
FAMILY_STYLES = {"Oracle": dict(color="black", marker="s"), "MassCoverage": dict(color="tab:orange", marker="o"),
                 "FixedBudget": dict(color="tab:purple", marker="v")}


def _chosen_label(chosen: dict) -> str:
    return f"chosen tau={chosen['tau']:g} phi={chosen['phi']:g} p={chosen['patience']}"


def plot_threshold_heatmaps(grid: pd.DataFrame, path: str | Path, patience: int | None = None,
                            title: str = "ART over tau x phi") -> Path:
    """Loaded fraction and 99th-percentile error over ``tau x phi`` at one patience (default: the
    largest in the grid), each cell annotated."""
    patience = int(grid["patience"].max()) if patience is None else patience
    at = grid[grid["patience"] == patience]
    if at.empty:
        raise ValueError(f"the grid has no rows with patience={patience}")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, column, label, log in ((axes[0], "loaded_fraction", "mean loaded fraction", False),
                                   (axes[1], "rel_error_p99", "p99 relative error", True)):
        table = at.pivot_table(index="tau", columns="phi", values=column).sort_index(ascending=False)
        table = table[sorted(table.columns, reverse=True)]
        values = np.log10(table.clip(lower=ERROR_FLOOR).to_numpy()) if log else table.to_numpy()
        image = ax.imshow(values, cmap="viridis", aspect="auto")
        fig.colorbar(image, ax=ax, label=f"log10 {label}" if log else label)
        ax.set_xticks(range(len(table.columns)), [f"{c:g}" for c in table.columns])
        ax.set_yticks(range(len(table.index)), [f"{t:g}" for t in table.index])
        ax.set_xlabel("phi (direction threshold)")
        ax.set_ylabel("tau (scale threshold)")
        ax.set_title(label)
        middle = (np.nanmin(values) + np.nanmax(values)) / 2
        for i in range(table.shape[0]):
            for j in range(table.shape[1]):
                ax.text(j, i, f"{table.iloc[i, j]:.2g}", ha="center", va="center", fontsize=7,
                        color="white" if values[i, j] < middle else "black")
    fig.suptitle(f"{title} (patience {patience})")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_patience_curves(grid: pd.DataFrame, path: str | Path, title: str = "ART against patience") -> Path:
    """Loaded fraction and p99 error against patience, one line per ``(tau, phi)``."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    pairs = grid.groupby(["tau", "phi"], sort=True)
    colors = plt.cm.viridis(np.linspace(0, 1, max(1, pairs.ngroups)))
    for color, ((tau, phi), group) in zip(colors, pairs):
        group = group.sort_values("patience")
        label = f"tau={tau:g} phi={phi:g}"
        left.plot(group["patience"], group["loaded_fraction"], marker="o", markersize=3, color=color, label=label)
        right.plot(group["patience"], group["rel_error_p99"].clip(lower=ERROR_FLOOR), marker="o", markersize=3,
                   color=color)
    left.set_xscale("log", base=2)
    left.set_xlabel("patience (stable blocks in a row)")
    left.set_ylabel("mean loaded fraction")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=5, ncol=2)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("patience (stable blocks in a row)")
    right.set_ylabel("p99 relative error")
    right.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_pareto(grid: pd.DataFrame, baselines: pd.DataFrame, path: str | Path, chosen: dict | None = None,
                title: str = "Loaded fraction against error") -> Path:
    """Every ART setting (grey), ART's Pareto front (green) and each baseline family's points and front.

    ``grid`` from :func:`~art_analysis.analysis.sensitivity.threshold_grid`, ``baselines`` from
    :func:`~art_analysis.analysis.sensitivity.baseline_sweep`."""
    from ..analysis.sensitivity import pareto_front

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter(grid["loaded_fraction"], grid["rel_error_p99"].clip(lower=ERROR_FLOOR), s=10, color="0.7",
               label="ART settings")
    front = pareto_front(grid.assign(family="ART"))
    ax.plot(front["loaded_fraction"], front["rel_error_p99"].clip(lower=ERROR_FLOOR), color="tab:green",
            marker="D", markersize=4, label="ART Pareto front")
    for family, group in baselines.groupby("family", sort=False):
        style = FAMILY_STYLES.get(family, {})
        ordered = group.sort_values("loaded_fraction")
        ax.plot(ordered["loaded_fraction"], ordered["rel_error_p99"].clip(lower=ERROR_FLOOR), linestyle="--",
                markersize=4, label=family, **style)
    if chosen is not None:
        ax.scatter([chosen["loaded_fraction"]], [max(chosen["rel_error_p99"], ERROR_FLOOR)], marker="*", s=200,
                   color="black", zorder=5, label=_chosen_label(chosen))
    finish_log_axes(ax, "mean fraction of the KV cache loaded", "99th-percentile relative error", title)
    return save_figure(fig, path)


def plot_false_stops(grid: pd.DataFrame, path: str | Path, chosen: dict | None = None,
                     title: str = "ART stops that come before the oracle's") -> Path:
    """False-stop rate (share of heads stopped before ``Oracle(eps)``) against loaded fraction, one
    colour per patience."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for patience, group in grid.groupby("patience"):
        ax.scatter(group["loaded_fraction"], group["false_stop_rate"], s=14, label=f"patience {patience}")
    if chosen is not None and "false_stop_rate" in chosen:
        ax.scatter([chosen["loaded_fraction"]], [chosen["false_stop_rate"]], marker="*", s=200, color="black",
                   label=_chosen_label(chosen))
    ax.set_xlabel("mean fraction of the KV cache loaded")
    ax.set_ylabel("false-stop rate")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return demo_main(argv, __doc__.splitlines()[0], _draw_demo)


def _draw_demo(out: Path) -> None:
    from ..analysis.inputs import traces
    from ..analysis.sensitivity import baseline_sweep, pick_default, threshold_grid
    from ..synthetic import synthetic_cache

    walks = traces(synthetic_cache(1, 8, 2, 8192, 64, preset="realistic"))
    grid = threshold_grid(walks, [1e-2, 1e-3, 1e-4], [1e-4, 1e-5, 1e-6], [2, 4, 8, 16])
    chosen = pick_default(grid, 0.05)
    print(plot_threshold_heatmaps(grid, out / "sensitivity_heatmaps.png"))
    print(plot_patience_curves(grid, out / "sensitivity_patience.png"))
    print(plot_pareto(grid, baseline_sweep(walks), out / "pareto.png", chosen=chosen))
    print(plot_false_stops(grid, out / "false_stops.png", chosen=chosen))


if __name__ == "__main__":
    raise SystemExit(main())
