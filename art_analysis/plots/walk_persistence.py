"""Whether ART's walks keep their lengths across decode steps: each walk against itself one step earlier, and
each layer's longest walk over the steps with the split rule's thresholds.

Reads the JSON written by ``python -m art_analysis.analysis.walk_persistence CAPTURE --out FILE``.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import torch

from ..analysis.walk_persistence import layer_longest
from .figure_io import figure_from_json_main


def walk_persistence_figure(result: dict):
    """Two panels from a walk-persistence result (``walks [L, T, B, Hkv]`` and its ``summary``): every walk at
    step ``t`` against the same walk at ``t - 1``, and each layer's longest walk at each step, one line per layer,
    with the summary's split-rule thresholds as dashed lines."""
    walks = torch.tensor(result["walks"])
    summary = result["summary"]
    fig, (pairs_ax, longest_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    before, after = walks[:, :-1].flatten(), walks[:, 1:].flatten()
    pairs_ax.scatter(before, after, s=8, alpha=0.35, color="tab:green")
    top = int(walks.max()) + 2
    pairs_ax.plot([0, top], [0, top], color="gray", linewidth=0.8, linestyle=":")
    rank = summary["rank_correlation"]
    pairs_ax.set_title(f"each walk, one step apart (rank correlation "
                       f"{'undefined' if rank is None else f'{rank:.2f}'})")
    pairs_ax.set_xlabel("blocks loaded at step t - 1")
    pairs_ax.set_ylabel("blocks loaded at step t")
    longest = layer_longest(walks)
    steps = range(walks.shape[1])
    for walk in longest:
        longest_ax.plot(steps, walk, color="tab:blue", alpha=0.35, linewidth=1)
    for threshold, agreement in summary["split_choice_agreement"].items():
        longest_ax.axhline(int(threshold), color="red", linestyle="--", linewidth=0.8,
                           label=f"{threshold} blocks: same side as the step before in {agreement:.1%}")
    longest_ax.set_title(f"each layer's longest walk ({walks.shape[0]} layers)")
    longest_ax.set_xlabel("decode step")
    longest_ax.set_ylabel("blocks loaded")
    if summary["split_choice_agreement"]:
        longest_ax.legend(fontsize=7)
    for ax in (pairs_ax, longest_ax):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{result.get('model', 'capture')}: ART walks across decode steps "
                 f"({result.get('context_tokens', '?')} tokens, {result.get('dtype', 'as stored')}; the simulator's "
                 f"kernel-mode walks, 64-token blocks)", fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> int:
    return figure_from_json_main(argv, __doc__.splitlines()[0], walk_persistence_figure,
                                 Path("figures/walk_persistence.png"),
                                 "JSON of art_analysis.analysis.walk_persistence --out", "art-decode-walk-persistence")


if __name__ == "__main__":
    raise SystemExit(main())
