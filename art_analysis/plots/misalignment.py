"""Per-token attention score against output contribution (the paper's Figure 1)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import torch

from .figure_io import save_figure


def plot_score_vs_contribution(score: torch.Tensor, contribution: torch.Tensor, path: str | Path,
                               top: float = 0.2, title: str = "Attention score vs output contribution") -> Path:
    """Scatter for one head: ``score, contribution: [S]``.  Orange: top-``top`` by contribution but
    outside the top-``top`` by score."""
    count = max(1, int(round(top * score.numel())))
    high_contribution = torch.zeros_like(score, dtype=torch.bool)
    high_contribution[contribution.topk(count).indices] = True
    high_score = torch.zeros_like(score, dtype=torch.bool)
    high_score[score.topk(count).indices] = True
    missed = high_contribution & ~high_score
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(score[~missed].numpy(), contribution[~missed].numpy(), s=4, alpha=0.4, label="tokens")
    ax.scatter(score[missed].numpy(), contribution[missed].numpy(), s=6, color="tab:orange",
               label=f"top {top:.0%} by contribution, not by score")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("attention score (max over the group's heads)")
    ax.set_ylabel("||a_j v_j||")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def main() -> None:
    from ..analysis.misalignment import token_scores
    from ..synthetic import synthetic_cache

    cache = synthetic_cache(1, 8, 2, 4096, 64, preset="realistic", value_outliers=64)
    score, contribution = token_scores(cache.q[0], cache.k[0], cache.v[0], 4096)
    print(plot_score_vs_contribution(score[0], contribution[0], "figures/misalignment_synthetic.png"))


if __name__ == "__main__":
    main()
