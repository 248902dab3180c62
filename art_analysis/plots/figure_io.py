"""Saving figures atomically, and the command line of a figure drawn from one result JSON."""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
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


def figure_from_json_main(argv: list[str] | None, description: str, figure: Callable, default_out: Path,
                          result_help: str) -> int:
    """``python -m art_analysis.plots.X RESULT [--out PNG]``: draw ``figure(json of RESULT)`` and save it
    (:func:`save_figure`); prints the path, returns 0."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("result", type=Path, help=result_help)
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args(argv)
    print(save_figure(figure(json.loads(args.result.read_text())), args.out))
    return 0
