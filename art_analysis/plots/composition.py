"""KV-selection policies with and without ART: traffic and error per policy.

Run as a module (``python -m art_analysis.plots.composition``) for a synthetic cache.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .figure_io import demo_main, save_figure


def plot_composition(table: pd.DataFrame, path: str | Path,
                     title: str = "KV-selection policies followed by ART") -> Path:
    """Left: fraction of the cache kept by the policy and read with ART on top.  Right: mean relative
    error of the policy alone and of the policy followed by ART.  ``table`` from
    :func:`art_analysis.analysis.composition.compose_with_art`."""
    x = np.arange(len(table))
    width = 0.4
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    left.bar(x - width / 2, table["kept_fraction"], width, label="policy alone", color="tab:gray")
    left.bar(x + width / 2, table["loaded_fraction"], width, label="policy + ART", color="tab:green")
    left.set_ylabel("fraction of the KV cache read")
    right.bar(x - width / 2, table["policy_error"].clip(lower=1e-8), width, label="policy alone", color="tab:gray")
    right.bar(x + width / 2, table["total_error"].clip(lower=1e-8), width, label="policy + ART", color="tab:green")
    right.set_yscale("log")
    right.set_ylabel("mean relative error against dense")
    for ax in (left, right):
        ax.set_xticks(x, table["policy"], rotation=35, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return demo_main(argv, __doc__.splitlines()[0], _draw_demo)


def _draw_demo(out: Path) -> None:
    from ..analysis.composition import compose_with_art
    from ..synthetic import synthetic_cache

    cache = synthetic_cache(1, 8, 2, 4096, 64, preset="realistic")
    print(plot_composition(compose_with_art(cache), out / "composition.png"))


if __name__ == "__main__":
    raise SystemExit(main())
