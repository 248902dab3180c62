"""Retrieval with a stopping rule inside decoding: answers kept, tokens agreeing, KL against dense.

Drawn from :func:`art_analysis.analysis.retention.compare_generation` tables (it needs a model:
``art-analysis evaluate`` or ``art-analysis reproduce`` run it).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .figure_io import save_figure


def plot_retention(table: pd.DataFrame, path: str | Path,
                   title: str = "Retrieval with the rule inside decoding") -> Path:
    """One panel per task and walk order: accuracy and token agreement (bars), the loaded fraction
    (black dots) and the share of heads whose walk read the needle's block (red crosses) per rule,
    the mean teacher-forced KL against dense in the tick labels."""
    panels = list(table.groupby(["task", "order"], sort=False))
    columns = min(2, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.2 * rows), squeeze=False)
    for ax, ((task, order), group) in zip(axes.flat, panels):
        x = np.arange(len(group))
        ax.bar(x - 0.2, group["accuracy"], 0.4, label="answer found", color="tab:blue")
        ax.bar(x + 0.2, group["token_agreement"], 0.4, label="tokens equal to dense", color="tab:green")
        ax.scatter(x, group["loaded_fraction"], color="black", zorder=3, label="loaded fraction")
        ax.scatter(x, group["needle_read"], color="tab:red", marker="x", zorder=3, label="needle block read")
        labels = [f"{rule.split(':')[0]}\nKL {kl:.1e}" for rule, kl in zip(group["rule"], group["kl_mean"])]
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{task}, {order} walk ({int(group['prompts'].iloc[0])} prompts)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)
