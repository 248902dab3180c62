"""The truncation error at a rule's stops against its exact and certified bounds (DESIGN §5).

Run as a module (``python -m art_analysis.plots.bounds``) for a synthetic cache.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .figure_io import demo_main, save_figure

BOUND_LABELS = {"bound_mean": "rho_R (||Obar_R|| + ||O^(t)||)", "bound_max_value": "rho_R (max ||v|| + ||O^(t)||)",
                "bound_certified": "certified (key min/max)"}


def plot_bounds(table: pd.DataFrame, path: str | Path, title: str = "Truncation error against its bounds") -> Path:
    """Log-log scatter of every truncated head's error against each bound, with the line
    ``error = bound`` (a bound holds where its points lie on or below it).  ``table`` from
    :func:`art_analysis.analysis.bounds.bound_table`."""
    truncated = table[table["rho"] > 0]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    if truncated.empty:
        ax.text(0.5, 0.5, "no head was truncated", ha="center", va="center", transform=ax.transAxes)
    else:
        for bound, label in BOUND_LABELS.items():
            held = truncated[f"{bound}_holds"].mean()
            ax.scatter(truncated[bound].clip(lower=1e-12), truncated["error"].clip(lower=1e-12), s=6, alpha=0.5,
                       label=f"{label}: holds for {held:.1%}")
        low = max(1e-12, float(truncated["error"].clip(lower=1e-12).min()))
        high = float(truncated[list(BOUND_LABELS)].max().max())
        line = np.logspace(np.log10(low), np.log10(max(high, low * 10)), 50)
        ax.plot(line, line, color="black", linewidth=1, label="error = bound")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    ax.set_xlabel("bound")
    ax.set_ylabel("||O_full - O^(t)||")
    ax.set_title(f"{title} ({len(truncated)} truncated heads)")
    ax.grid(True, alpha=0.3)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return demo_main(argv, __doc__.splitlines()[0], _draw_demo)


def _draw_demo(out: Path) -> None:
    from ..analysis.bounds import bound_table
    from ..synthetic import synthetic_cache
    from ..termination import ARTConfig

    cache = synthetic_cache(1, 8, 2, 8192, 64, preset="realistic")
    print(plot_bounds(bound_table(cache, {"art": ARTConfig()}), out / "bounds.png"))


if __name__ == "__main__":
    raise SystemExit(main())
