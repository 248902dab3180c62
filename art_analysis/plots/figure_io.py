"""Saving figures atomically."""
from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (format from the suffix), and a ``.pdf`` beside a ``.png``, each through
    a temporary file; then close the figure.  Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    targets = [path] + ([path.with_suffix(".pdf")] if path.suffix == ".png" else [])
    for target in targets:
        tmp = target.with_name(f".{target.stem}.tmp{target.suffix}")
        fig.savefig(tmp, dpi=150, bbox_inches="tight")
        os.replace(tmp, target)
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
