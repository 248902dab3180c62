"""Saving figures atomically, and the command lines of the runnable figure modules: a figure drawn from one result
JSON, and a module's demo figures of a synthetic cache."""
from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import matplotlib

from kernels.results_io import new_file_mode

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (format from the suffix, e.g. ``.png`` or ``.pdf``), and a ``.pdf`` beside a
    ``.png``; then close the figure.  Returns ``path``.  Every file is written to a temporary file in its folder
    first and renamed only once all of them are written, so a failure leaves the earlier figures whole and no
    temporary file behind."""
    path = Path(path)
    formats = fig.canvas.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        plt.close(fig)
        raise ValueError(f"a figure path must end in one of {', '.join('.' + f for f in sorted(formats))}, got "
                         f"{str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    targets = [path] + ([path.with_suffix(".pdf")] if path.suffix == ".png" else [])
    written = []
    try:
        for target in targets:
            fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=target.suffix, dir=target.parent)
            os.close(fd)
            written.append(tmp)
            fig.savefig(tmp, dpi=150, bbox_inches="tight", format=target.suffix[1:].lower())
            os.chmod(tmp, new_file_mode())
        for tmp, target in zip(written, targets):
            os.replace(tmp, target)
    except BaseException:
        for tmp in written:
            Path(tmp).unlink(missing_ok=True)
        raise
    finally:
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
                          result_help: str, kind: str) -> int:
    """``python -m art_analysis.plots.X RESULT [--out PNG]``: draw ``figure(RESULT)`` and save it
    (:func:`save_figure`); prints the path, returns 0.  RESULT is read as a stored result of ``kind``
    (``art_analysis.cli.figures.read_benchmark_result``): a file that is not one is named, as the command line's
    error, before anything is drawn."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("result", type=Path, help=result_help)
    parser.add_argument("--out", type=Path, default=default_out, help=f"figure path (default: {default_out})")
    args = parser.parse_args(argv)
    print(save_figure(figure(read_figure_input(parser, args.result, kind)), args.out))
    return 0


def read_figure_input(parser: argparse.ArgumentParser, path: Path, kind: str) -> dict:
    """The stored result of ``kind`` at ``path`` for a figure module's command line; a file that is not one (missing,
    not JSON, another suite's, lacking what the figure reads) ends the command with ``parser``'s error."""
    from ..cli.figures import read_benchmark_result

    try:
        return read_benchmark_result(path, kind)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))


def demo_main(argv: list[str] | None, description: str, draw: Callable[[Path], None],
              default_out: Path = Path("figures/synthetic")) -> int:
    """``python -m art_analysis.plots.X [--out FOLDER]``: ``draw(FOLDER)`` draws the module's figures of a synthetic
    cache into ``FOLDER`` (the studies' own figures, of a capture, come from ``art-analysis figures`` and
    ``reproduce``); returns 0."""
    parser = argparse.ArgumentParser(description=f"{description} Draws the figures of a synthetic cache.")
    parser.add_argument("--out", type=Path, default=default_out,
                        help=f"folder for the figures (default: {default_out})")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} is not a folder")
    draw(args.out)
    return 0
