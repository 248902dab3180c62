"""Relative error of the partial output against the fraction of the KV cache loaded."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import matplotlib.pyplot as plt
import torch

from .figure_io import finish_log_axes, save_figure


def plot_error_vs_loaded(curves: Mapping[str, tuple[torch.Tensor, torch.Tensor]], path: str | Path,
                         title: str = "Convergence of the partial output") -> Path:
    """One line per label: ``curves[label] = (fractions [F], mean relative error [F])``."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (fractions, error) in curves.items():
        ax.plot(fractions.numpy(), error.clamp(min=1e-8).numpy(), label=label)
    finish_log_axes(ax, "fraction of the KV cache loaded", "mean relative L2 error of O^(t)", title)
    return save_figure(fig, path)


def main() -> None:
    from ..analysis.convergence import mean_error_at
    from ..blockwise import blockwise_attention
    from ..synthetic import synthetic_cache

    cache = synthetic_cache(1, 8, 2, 8192, 64, preset="realistic")
    fractions = torch.linspace(0, 1, 101)
    curves = {order: (fractions, mean_error_at([blockwise_attention(cache.q, cache.k, cache.v, order=order)],
                                               fractions))
              for order in ("sequential", "recency", "sink_recency")}
    print(plot_error_vs_loaded(curves, "figures/convergence_synthetic.png"))


if __name__ == "__main__":
    main()
