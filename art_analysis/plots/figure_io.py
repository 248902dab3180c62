"""Saving figures atomically."""
from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (format from the suffix) through a temporary file, then close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=150, bbox_inches="tight")
    os.replace(tmp, path)
    plt.close(fig)
    return path


def finish_log_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Log-scale y axis, labels, title, a light grid and a small legend."""
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
