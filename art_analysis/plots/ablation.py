"""ART's ablations side by side: loaded fraction, error and false stops per variant.

Run as a module (``python -m art_analysis.plots.ablation``) for a synthetic cache.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from .figure_io import demo_main, save_figure


def plot_ablation(table: pd.DataFrame, path: str | Path, title: str = "ART ablations") -> Path:
    """Three bar panels (mean loaded fraction, p99 relative error, false-stop rate), one bar per
    variant of :func:`art_analysis.analysis.ablation.ablation_table`."""
    panels = [("loaded_fraction", "mean loaded fraction", False), ("rel_error_p99", "p99 relative error", True),
              ("false_stop_rate", "false-stop rate", False)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8))
    positions = range(len(table))
    for ax, (column, label, log) in zip(axes, panels):
        ax.bar(positions, table[column].clip(lower=1e-8) if log else table[column],
               color=["tab:green"] + ["tab:gray"] * (len(table) - 1))
        ax.set_xticks(positions, table["variant"], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{title}: {table['rule'].iloc[0]}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return demo_main(argv, __doc__.splitlines()[0], _draw_demo)


def _draw_demo(out: Path) -> None:
    from ..analysis.ablation import ablation_table
    from ..analysis.inputs import traces
    from ..synthetic import synthetic_cache

    walks = traces(synthetic_cache(1, 8, 2, 8192, 64, preset="realistic"))
    print(plot_ablation(ablation_table(walks), out / "ablation.png"))


if __name__ == "__main__":
    raise SystemExit(main())
