"""Convergence of the partial output (the paper's Figure 4): error against the fraction loaded.

Run as a module (``python -m art_analysis.plots.convergence``) to draw both figures for a
synthetic cache.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib.pyplot as plt
import pandas as pd

from .figure_io import demo_main, finish_log_axes, save_figure

ERROR_FLOOR = 1e-8


def spread_layers(layers: Sequence[int], count: int = 6) -> list[int]:
    """Up to ``count`` layers spread evenly over ``layers`` (first and last included)."""
    layers = sorted(set(layers))
    if len(layers) <= count:
        return layers
    step = (len(layers) - 1) / (count - 1)
    return sorted({layers[round(i * step)] for i in range(count)})


def plot_convergence(curves: pd.DataFrame, path: str | Path, layers: Sequence[int] | None = None,
                     title: str = "Convergence of the partial output by traversal order") -> Path:
    """One panel per layer: median relative error of ``O^(t)`` (line) and its interquartile range
    (band) over heads, per order.  ``curves`` from
    :func:`art_analysis.analysis.convergence.convergence_curves`."""
    layers = list(layers) if layers is not None else spread_layers(curves["layer"].unique())
    columns = min(3, len(layers))
    rows = -(-len(layers) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False, sharey=True)
    for ax, layer in zip(axes.flat, layers):
        for order, group in curves[curves["layer"] == layer].groupby("order", sort=False):
            x = group["loaded_fraction"].to_numpy()
            line, = ax.plot(x, group["error_median"].clip(lower=ERROR_FLOOR), label=order)
            ax.fill_between(x, group["error_q25"].clip(lower=ERROR_FLOOR), group["error_q75"].clip(lower=ERROR_FLOOR),
                            color=line.get_color(), alpha=0.2, linewidth=0)
        finish_log_axes(ax, "fraction of the KV cache loaded", "relative L2 error of O^(t)", f"layer {layer}")
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    fig.suptitle(f"{title} (median and IQR over heads)")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_recent_window(window: pd.DataFrame, path: str | Path, layers: Sequence[int] | None = None,
                       title: str = "Error of a recent-window output against its size") -> Path:
    """Median relative error (over heads) of attention over the newest tokens only (solid) and with
    the sink tokens kept (dashed), one colour per layer.  ``window`` from
    :func:`art_analysis.analysis.convergence.recent_window_curves`."""
    layers = list(layers) if layers is not None else spread_layers(window["layer"].unique())
    colors = plt.cm.viridis([i / max(1, len(layers) - 1) for i in range(len(layers))])
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for color, layer in zip(colors, layers):
        for style, (label, group) in zip(styles, window[window["layer"] == layer].groupby("window", sort=False)):
            ax.plot(group["loaded_fraction"], group["error_median"].clip(lower=ERROR_FLOOR), linestyle=style,
                    color=color, label=f"layer {layer}, {label}")
    finish_log_axes(ax, "fraction of the tokens attended", "median relative L2 error", title)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return demo_main(argv, __doc__.splitlines()[0], _draw_demo)


def _draw_demo(out: Path) -> None:
    from ..analysis.convergence import convergence_curves, recent_window_curves
    from ..synthetic import synthetic_cache

    cache = synthetic_cache(1, 8, 2, 8192, 64, preset="realistic")
    print(plot_convergence(convergence_curves(cache), out / "convergence.png"))
    print(plot_recent_window(recent_window_curves(cache), out / "recent_window.png"))


if __name__ == "__main__":
    raise SystemExit(main())
