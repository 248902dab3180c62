"""Decode kernel speed on the GPU: KV throughput per implementation, and ART's time against its loaded fraction.

Reads the JSON written by :func:`kernels.bench.run` (``benchmarks/results/<date>-art-decode.json``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt

from kernels.results_io import latest_result

from .figure_io import read_figure_input, save_figure

IMPL_STYLES = {
    "cudnn_sdpa": dict(color="tab:blue", marker="o", label="cuDNN SDPA"),
    "flash_sdpa": dict(color="tab:orange", marker="s", label="flash SDPA"),
    "flex_attention": dict(color="tab:purple", marker="v", label="FlexAttention"),
    "art_dense": dict(color="black", marker="^", label="ART kernel, dense (block 128)"),
    "art_dense_bs64": dict(color="tab:gray", marker="^", linestyle=":", label="ART kernel, dense (block 64)"),
    "art_never": dict(color="tab:gray", marker="x", linestyle="--", label="ART, never stops (tau=phi=0, block 64)"),
    "art": dict(color="tab:green", marker="D", label="ART, terminating"),
}


PAGED_STYLES = {"art_dense": dict(color="black", label="dense"), "art": dict(color="tab:green", label="ART")}
PAGE_HATCHES = ("//", "", "..", "xx")
# how the run emptied the L2 before each timed call (kernels.l2_flush); results without the key used do_bench's memset
FLUSH_WORDS = {"read": "a read", "memset": "do_bench's memset"}


def paged_panel(ax, paged: list[dict]) -> None:
    """Each paged row's time over the same call's on the contiguous cache (``kernels.bench.bench_paged``'s
    ``over_contiguous``), one bar per call and page size, grouped by shape; a row without a time is left out."""
    timed = [r for r in paged if r.get("page_size") and "over_contiguous" in r]
    shapes = sorted({(r["batch"], r["seqlen"]) for r in timed}, key=lambda shape: (shape[1], shape[0]))
    series = sorted({(r["impl"], r["page_size"]) for r in timed}, key=lambda key: (key[0] != "art_dense", key[1]))
    sizes = sorted({size for _, size in series})
    width = 0.8 / max(len(series), 1)
    for i, (impl, size) in enumerate(series):
        by_shape = {(r["batch"], r["seqlen"]): r["over_contiguous"] for r in timed
                    if r["impl"] == impl and r["page_size"] == size}
        positions = [j + (i - (len(series) - 1) / 2) * width for j, shape in enumerate(shapes) if shape in by_shape]
        style = PAGED_STYLES.get(impl, dict(color="tab:gray", label=impl))
        ax.bar(positions, [by_shape[shape] for shape in shapes if shape in by_shape], width, color=style["color"],
               hatch=PAGE_HATCHES[sizes.index(size) % len(PAGE_HATCHES)], edgecolor="white", alpha=0.8,
               label=f"{style['label']}, pages of {size}")
    ax.axhline(1.0, color="red", linewidth=0.8, linestyle=":")
    ax.set_ylim(0, 1.4 * max((r["over_contiguous"] for r in timed), default=1.0))   # room for the legend
    ax.set_xticks(range(len(shapes)), [f"{batch} x {seqlen // 1024}k" for batch, seqlen in shapes])
    ax.set_ylabel("time / contiguous layout's time")
    ax.set_title("paged layout (shuffled pages)")
    ax.legend(fontsize=6, ncol=2, loc="upper left")


DENSE_BATCH_STYLES = {"art_dense": dict(linestyle="-", marker="^", label="default plan"),
                      "art_dense_bs64_one_wave": dict(linestyle="--", marker="x", label="64-token blocks, one wave")}


def dense_batches_panel(ax, rows: list[dict]) -> None:
    """The dense calls at batch sizes off the main grid (``kernels.bench.bench_dense_batches``): each call's throughput
    over the best peer's (``speedup_vs_best_peer``) against the batch, one colour per length and one line style per
    plan, with the dense target (``kernels.bench.DENSE_TARGET``); a row without a time is left out."""
    from kernels.bench import DENSE_TARGET

    timed = [r for r in rows if r["impl"] in DENSE_BATCH_STYLES and "speedup_vs_best_peer" in r]
    for color, seqlen in zip(("tab:blue", "tab:red", "tab:green"), sorted({r["seqlen"] for r in timed})):
        for impl, style in DENSE_BATCH_STYLES.items():
            sub = sorted((r for r in timed if r["seqlen"] == seqlen and r["impl"] == impl), key=lambda r: r["batch"])
            if sub:
                ax.plot([r["batch"] for r in sub], [r["speedup_vs_best_peer"] for r in sub], color=color,
                        markersize=4, **{**style, "label": f"{seqlen // 1024}k, {style['label']}"})
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.axhline(DENSE_TARGET, color="red", linewidth=0.8, linestyle=":", label=f"target {DENSE_TARGET}x")
    ax.set_xlabel("batch")
    ax.set_ylabel("throughput over the best peer's")
    ax.set_title("dense, batches between the grid's")
    ax.legend(fontsize=6, loc="lower right")


def plot_kernel_speed(results: dict, path: str | Path) -> Path:
    """Write :func:`kernel_speed_figure` of ``results`` to ``path`` (and a PDF beside a PNG); returns ``path``."""
    return save_figure(kernel_speed_figure(results), path)


def kernel_speed_figure(results: dict):
    """One throughput panel per sequence length (synthetic 32/8 heads, D=128; log scale, the ART
    rows as the whole cache's bytes over their time), where the results have them a panel of the dense calls at
    batch sizes off the grid (:func:`dense_batches_panel`) and one of the paged rows' time over the contiguous
    layout's (:func:`paged_panel`), and a panel of ART time / dense time
    against the loaded fraction, with the target ``1.15 x fraction`` and, where the results have
    them, the rows' latency floors (``kernels.bench``: the longest leader walk at the time per block
    of a lone walk), walk models and the dense kernel's time over the same walks (``walks_dense_ms``)."""
    rows = [r for r in results["rows"] if "ms" in r]
    synthetic = [r for r in rows if r["data"] == "synthetic"]
    lengths = sorted({r["seqlen"] for r in synthetic})
    extra = [(draw, part) for draw, part in ((dense_batches_panel, results.get("dense_batches")),
                                             (paged_panel, results.get("paged"))) if part]
    panels = len(lengths) + len(extra) + 1
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), squeeze=False)
    axes = axes[0]
    for ax, (draw, part) in zip(axes[len(lengths):], extra):
        draw(ax, part)
    ceiling = results["copy_ceiling_tb_per_s"]
    for ax, seqlen in zip(axes, lengths):
        for impl, style in IMPL_STYLES.items():
            sub = sorted((r for r in synthetic if r["seqlen"] == seqlen and r["impl"] == impl),
                         key=lambda r: r["batch"])
            if sub:
                ax.plot([r["batch"] for r in sub], [r["tb_per_s"] for r in sub], **style)
        ax.axhline(ceiling, color="red", linewidth=0.8, linestyle=":", label=f"copy ceiling {ceiling:.2f} TB/s")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_title(f"S = {seqlen // 1024}k")
    axes[0].set_ylabel("KV TB/s (whole-cache bytes / time)")   # one label: the panels share its meaning
    handles = {}
    for ax in axes[:len(lengths)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8, bbox_to_anchor=(0.4, -0.12))
    ax = axes[-1]
    dense = {(r["data"], r["batch"], r["seqlen"]): r["ms"] for r in rows if r["impl"] == "art_dense"}
    for data, name, marker, color in (("synthetic", "synthetic", "D", "tab:green"),
                                      ("smollm2_layer15_tiled", "SmolLM2 layer", "o", "tab:olive")):
        sub = [r for r in rows if r["impl"] == "art" and r["data"] == data and (data, r["batch"], r["seqlen"]) in dense]
        if sub:
            ax.scatter([r["loaded_fraction"] for r in sub],
                       [r["ms"] / dense[(data, r["batch"], r["seqlen"])] for r in sub], marker=marker, color=color,
                       label=name)
        for key, mark, what in (("latency_floor_ms", dict(marker="_", s=80), "longest walk x lone step"),
                                ("model_ms", dict(marker="x", s=20), "walks at the lone pace, shared bandwidth"),
                                ("walks_dense_ms", dict(marker="+", s=40), "dense kernel over the same walks")):
            marked = [r for r in sub if key in r]
            if marked:
                ax.scatter([r["loaded_fraction"] for r in marked],
                           [r[key] / dense[(data, r["batch"], r["seqlen"])] for r in marked], color=color,
                           label=f"{name}: {what}", **mark)
    ax.plot([0, 1], [0, 1.15], color="red", linewidth=0.8, linestyle=":", label="target 1.15 x fraction")
    ax.set_xlabel("loaded fraction of the KV blocks")
    ax.set_ylabel("ART time / dense time")
    ax.set_title("ART: time against traffic")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))   # beside the panel: its points reach the top
    fig.subplots_adjust(wspace=0.3)   # room for the last panel's own y label
    fig.suptitle(f"{results['device']}: decode attention, Hq/Hkv = 32/8, D = 128, bf16 "
                 f"(CUDA-graph do_bench medians, L2 emptied by {FLUSH_WORDS[results.get('l2_flush', 'memset')]}, "
                 f"{results['date'][:10]}; ART rows count the whole cache)")
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="?", help="benchmark JSON (default: the newest *-art-decode.json)")
    parser.add_argument("--out", type=Path, default=Path("figures/kernel_speed.png"))
    args = parser.parse_args(argv)
    path = args.results or latest_result("art-decode")
    if path is None:
        parser.error("no *-art-decode.json in benchmarks/results: pass the benchmark JSON")
    print(plot_kernel_speed(read_figure_input(parser, path, "art-decode"), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
