"""FlexPrefill figures: pattern per layer and head, kept fraction, error and latency against gamma.

``python -m art_analysis.plots.flexprefill [--out FOLDER]`` draws all four on a synthetic prefill and the
newest ``benchmarks/results/*-flexprefill.json`` (if any) into ``figures/synthetic`` (``art-analysis flexprefill``
draws them of a capture).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch

from .figure_io import demo_main, save_figure


def plot_patterns(js_distance: torch.Tensor, query_aware: torch.Tensor, row_labels: Sequence[str], tau: float,
                  path: str | Path) -> Path:
    """Heatmap of the JS distance per row (layer) and head; query-aware heads marked ``Q``.

    Args:
        js_distance: ``[L, H]``.  query_aware: ``[L, H]`` bool.  row_labels: ``L`` names.
    """
    js = js_distance.float().numpy()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * js.shape[1] + 2), max(2.0, 0.45 * js.shape[0] + 1.2)))
    image = ax.imshow(js, aspect="auto", cmap="viridis_r", vmin=0.0, vmax=float(np.sqrt(np.log(2.0))))
    for (row, col), aware in np.ndenumerate(query_aware.numpy()):
        if aware:
            ax.text(col, row, "Q", ha="center", va="center", color="white", fontsize=7, fontweight="bold")
    ax.set_yticks(range(len(row_labels)), labels=list(row_labels))
    ax.set_xlabel("query head")
    aware_share = float(query_aware.float().mean())
    ax.set_title(f"FlexPrefill patterns (Q: query-aware, D_JS < {tau:g}; {aware_share:.0%} of heads)", fontsize=9)
    fig.colorbar(image, ax=ax, label="D_JS")
    return save_figure(fig, path)


def _plot_curves(curves: Mapping[str, tuple[torch.Tensor, torch.Tensor]], path: str | Path, ylabel: str,
                 title: str, log: bool) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (x, y) in curves.items():
        ax.plot(x.numpy(), y.numpy(), marker="o", label=label)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("gamma (attention mass to cover)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_kept_vs_gamma(curves: Mapping[str, tuple[torch.Tensor, torch.Tensor]], path: str | Path) -> Path:
    """One line per label: ``curves[label] = (gammas [G], mean kept fraction of causal tiles [G])``."""
    return _plot_curves(curves, path, "kept fraction of causal tiles", "FlexPrefill: computed tiles against gamma",
                        log=False)


def plot_error_vs_gamma(curves: Mapping[str, tuple[torch.Tensor, torch.Tensor]], path: str | Path) -> Path:
    """One line per label: ``curves[label] = (gammas [G], mean relative error vs dense [G])``;
    errors are floored at 1e-8 for the log axis (gamma = 1 can be exact)."""
    floored = {label: (x, y.clamp(min=1e-8)) for label, (x, y) in curves.items()}
    return _plot_curves(floored, path, "relative L2 error vs dense causal attention",
                        "FlexPrefill: output error against gamma", log=True)


def plot_latency_vs_gamma(rows: Sequence[dict], path: str | Path) -> Path:
    """Benchmark rows (``kernels.bench_flexprefill``): full-call latency per gamma, one line per
    (data, length), with dense SDPA of the same input dashed."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    cases = sorted({(r["data"], r["seqlen"]) for r in rows if r["method"] == "flexprefill"})
    colors = plt.cm.tab10(np.linspace(0, 1, 10))
    for i, (data, seqlen) in enumerate(cases):
        calls = sorted((r for r in rows if r["method"] == "flexprefill" and r["data"] == data
                        and r["seqlen"] == seqlen), key=lambda r: r["gamma"])
        color = colors[i % 10]
        label = f"{data} N={seqlen // 1024}k"
        ax.plot([r["gamma"] for r in calls], [r["ms"] for r in calls], marker="o", color=color, label=label)
        dense = [r["ms"] for r in rows if r["method"] == "sdpa" and r["data"] == data and r["seqlen"] == seqlen]
        if dense:
            ax.axhline(dense[0], color=color, linestyle="--", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("gamma")
    ax.set_ylabel("latency, median ms (dashed: dense SDPA)")
    ax.set_title("FlexPrefill full call (estimation + sparse kernel) against gamma")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return demo_main(argv, __doc__.splitlines()[0], _draw_demo)


def _draw_demo(out: Path) -> None:
    from kernels.bench_flexprefill import structured_prefill
    from kernels.results_io import latest_result

    from ..flexprefill import QUERY_AWARE, gamma_sweep

    q, k, v = structured_prefill(1, 8, 4, 4096, 64, seed=0, dtype=torch.float32, device="cpu")
    sweep = gamma_sweep(q, k, v, [0.8, 0.85, 0.9, 0.95, 0.99], tau=0.1, block_size=64, min_budget=256)
    print(plot_patterns(sweep.js_distance, sweep.pattern == QUERY_AWARE, ["synthetic"], 0.1,
                        out / "flexprefill_patterns.png"))
    label = "synthetic N=4k"
    print(plot_kept_vs_gamma({label: (sweep.gammas, sweep.kept_fraction.mean(dim=(1, 2)))},
                             out / "flexprefill_kept_vs_gamma.png"))
    print(plot_error_vs_gamma({label: (sweep.gammas, sweep.rel_error.mean(dim=(1, 2)))},
                              out / "flexprefill_error_vs_gamma.png"))
    bench = latest_result("flexprefill")
    if bench is not None:
        from ..cli.figures import read_benchmark_result

        print(plot_latency_vs_gamma(read_benchmark_result(bench, "flexprefill")["rows"],
                                    out / "flexprefill_latency_vs_gamma.png"))


if __name__ == "__main__":
    raise SystemExit(main())
