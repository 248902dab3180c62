"""ART threshold sensitivity: loaded fraction against error for a grid of settings."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib.pyplot as plt

from .figure_io import finish_log_axes, save_figure


def plot_threshold_tradeoff(rows: Sequence[dict], path: str | Path, chosen: dict | None = None,
                            title: str = "ART threshold sensitivity") -> Path:
    """Scatter of loaded fraction vs 99th-percentile error, one point per ``(tau, phi, patience)`` row.

    ``rows`` come from :func:`art_analysis.analysis.sensitivity.threshold_grid`.
    """
    fig, ax = plt.subplots(figsize=(6, 4))
    patiences = sorted({r["patience"] for r in rows})
    for patience in patiences:
        sub = [r for r in rows if r["patience"] == patience]
        ax.scatter([r["loaded_fraction"] for r in sub], [max(r["rel_error_p99"], 1e-8) for r in sub],
                   label=f"patience {patience}", s=18)
    if chosen is not None:
        ax.scatter([chosen["loaded_fraction"]], [max(chosen["rel_error_p99"], 1e-8)], marker="*", s=200,
                   color="black", label=f"chosen tau={chosen['tau']:g} phi={chosen['phi']:g} p={chosen['patience']}")
    finish_log_axes(ax, "mean fraction of the KV cache loaded", "99th percentile relative error", title)
    return save_figure(fig, path)


def main() -> None:
    from ..analysis.sensitivity import threshold_grid
    from ..blockwise import blockwise_attention
    from ..synthetic import synthetic_cache

    cache = synthetic_cache(1, 8, 2, 8192, 64, preset="realistic")
    trace = blockwise_attention(cache.q, cache.k, cache.v)
    rows = threshold_grid([trace], [1e-3, 1e-4, 1e-5], [1e-4, 1e-5, 1e-6], [2, 4, 8])
    print(plot_threshold_tradeoff(rows, "figures/sensitivity_synthetic.png"))


if __name__ == "__main__":
    main()
