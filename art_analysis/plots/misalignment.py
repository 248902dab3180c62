"""Attention score against output contribution (the paper's Figure 1), and its rates per layer and head.

Run as a module (``python -m art_analysis.plots.misalignment``) for a synthetic cache with
value-norm outliers.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from .figure_io import demo_main, save_figure


def plot_score_vs_contribution(tokens: pd.DataFrame, path: str | Path, kv_head: int = 0, b: int = 0,
                               title: str | None = None) -> Path:
    """Scatter of one KV head's tokens; orange: in the top share by contribution but not by score.

    ``tokens`` from :func:`art_analysis.analysis.misalignment.misaligned_tokens`."""
    head = tokens[(tokens["kv_head"] == kv_head) & (tokens["b"] == b)]
    if head.empty:
        raise ValueError(f"no tokens for b={b}, kv_head={kv_head}")
    missed = head["misaligned"].to_numpy()
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(head["score"][~missed], head["contribution"][~missed], s=4, alpha=0.4, label="tokens")
    ax.scatter(head["score"][missed], head["contribution"][missed], s=7, color="tab:orange",
               label=f"top by contribution, low score ({missed.sum()} tokens)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("attention score (max over the group's heads)")
    ax.set_ylabel("||a_j v_j|| (max over the group's heads)")
    layer = int(head["layer"].iloc[0])
    ax.set_title(title or f"Score vs contribution, layer {layer}, KV head {kv_head}")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_misalignment_rates(rates: pd.DataFrame, path: str | Path,
                            title: str = "Misalignment of attention score and contribution") -> Path:
    """Left: misaligned rate per layer and KV head (heatmap).  Right: recall@k of the contribution
    ranking by the score ranking, mean over heads per layer.  ``rates`` from
    :func:`art_analysis.analysis.misalignment.misalignment_rates`."""
    pivot = rates.groupby(["layer", "kv_head"])["misaligned_rate"].mean().unstack("kv_head")
    recall = [c for c in rates.columns if c.startswith("recall@")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    image = left.imshow(pivot.to_numpy().T, aspect="auto", cmap="magma", vmin=0,
                        extent=(pivot.index.min() - 0.5, pivot.index.max() + 0.5, pivot.columns.max() + 0.5,
                                pivot.columns.min() - 0.5))
    fig.colorbar(image, ax=left, label="share of top contributors ranked low by score")
    left.set_xlabel("layer")
    left.set_ylabel("KV head")
    left.set_title("misaligned rate")
    per_layer = rates.groupby("layer")[recall].mean()
    for column in recall:
        right.plot(per_layer.index, per_layer[column], marker="o", markersize=3, label=column)
    right.set_ylim(0, 1.02)
    right.set_xlabel("layer")
    right.set_ylabel("recall of the top contributors")
    right.set_title("top-k by score vs top-k by contribution")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return demo_main(argv, __doc__.splitlines()[0], _draw_demo)


def _draw_demo(out: Path) -> None:
    from ..analysis.misalignment import misaligned_tokens, misalignment_rates
    from ..synthetic import synthetic_cache

    cache = synthetic_cache(1, 8, 2, 4096, 64, preset="realistic", value_outliers=64)
    print(plot_score_vs_contribution(misaligned_tokens(cache), out / "misalignment.png"))
    print(plot_misalignment_rates(misalignment_rates(cache), out / "misalignment_rates.png"))


if __name__ == "__main__":
    raise SystemExit(main())
