"""ART in a decode loop: each decode step's time per implementation, one panel per length, and the split count
ART took at each step.

Reads the JSON written by ``art-analysis bench --suite decode-loop`` (``kernels.bench_decode_loop``).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from .figure_io import figure_from_json_main

STYLES = {
    "art_dense": dict(color="black", marker="^", label="dense"),
    "art": dict(color="tab:orange", marker="s", label="ART, default split rule"),
    "art_previous_step": dict(color="tab:green", marker="D", label="ART, told the previous step's {walks}"),
    "art_calibrated": dict(color="tab:gray", marker="x", linestyle=":", label="ART, told this step's {walks}"),
    "art_on_demand": dict(color="tab:purple", marker="o", label="ART, on-demand followers"),
}


def decode_loop_figure(payload: dict):
    """One panel per loop (``payload["loops"]``: ``batch`` (else the payload's), ``seqlen``, ``rows`` of ``step``,
    ``impl``, ``ms`` and, for ART, ``num_splits``): milliseconds per decode step, one line per implementation timed
    (``STYLES``), each
    ART point labelled with its split count where it differs from the step's calibrated one, or "on demand" where
    the hint's plan took on-demand followers (``on_demand``).  The hinted rows were
    told each pair's walk where they record ``pair_walks`` (else, in runs before V44, the longest walk)."""
    loops = payload["loops"]
    told = "walks" if any("pair_walks" in r for loop in loops for r in loop["rows"]) else "longest walk"
    fig, axes = plt.subplots(1, len(loops), figsize=(5.5 * len(loops), 4.2), squeeze=False)
    for ax, loop in zip(axes[0], loops):
        rows = loop["rows"]
        calibrated = {r["step"]: r.get("num_splits") for r in rows if r["impl"] == "art_calibrated"}
        for impl, style in STYLES.items():
            mine = sorted((r for r in rows if r["impl"] == impl and "ms" in r), key=lambda r: r["step"])
            if not mine:   # runs before V48 time no on-demand followers
                continue
            ax.plot([r["step"] for r in mine], [r["ms"] for r in mine], **{**style, "label": style["label"].format(
                walks=told)})
            if impl in ("art", "art_previous_step"):
                for r in mine:
                    if r.get("on_demand") or r.get("num_splits") != calibrated.get(r["step"]):
                        ax.annotate("on demand" if r.get("on_demand") else
                                    f"{r['num_splits']} split{'s' if r['num_splits'] != 1 else ''}",
                                    (r["step"], r["ms"]), fontsize=7, color=style["color"],
                                    textcoords="offset points", xytext=(4, 4))
        summary = loop.get("summary", {})
        title = f"B = {loop.get('batch', payload.get('batch', '?'))}, {loop['seqlen'] // 1024}k tokens"
        if "previous_step_over_dense" in summary:
            title += (f"\nloop over dense: {summary['previous_step_over_dense']:.2f}x with the hint, "
                      f"{summary['default_over_dense']:.2f}x without")
        if "on_demand_over_dense" in summary:
            title += f", {summary['on_demand_over_dense']:.2f}x on demand"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("decode step")
        ax.set_ylabel("ms per call (CUDA-graph median)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{payload.get('device', 'GPU')}: ART in a decode loop on {payload.get('capture', 'a captured layer')}"
                 f" ({payload.get('date', '')[:10]})", fontsize=9, y=1.03)
    return fig


def main(argv: list[str] | None = None) -> int:
    return figure_from_json_main(argv, __doc__.splitlines()[0], decode_loop_figure, Path("figures/decode_loop.png"),
                                 "JSON of art-analysis bench --suite decode-loop", "art-decode-loop")


if __name__ == "__main__":
    raise SystemExit(main())
