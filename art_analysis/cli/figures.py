"""`art-analysis figures`: every study of one capture, its figures and its tables.

Runs convergence (per order, per layer; the recent-window curve), misalignment, threshold
sensitivity (heatmaps, patience, Pareto frontiers against the baselines, false stops), the
ablations, the truncation bounds and the KV-selection policies on ``--capture`` (or a synthetic
cache), writes ``<out>/<figure>.png`` and ``.pdf`` for each and ``<out>/studies.json`` with every
table, and prints the key tables.  Kernel and FlexPrefill latency figures are drawn from the
newest GPU benchmark JSON in ``--benchmarks`` when there is one.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from kernels.results_io import latest_result, read_result, write_json_atomic

from ..analysis.ablation import ABLATION_COLUMNS, ABLATION_FORMATS, ablation_table
from ..analysis.bounds import BOUND_COLUMNS, BOUND_FORMATS, bound_rules, bound_summary, bound_table
from ..analysis.composition import COMPOSITION_COLUMNS, COMPOSITION_FORMATS, compose_with_art
from ..analysis.convergence import convergence_curves, recent_window_curves
from ..analysis.inputs import decode_inputs
from ..analysis.misalignment import misaligned_tokens, misalignment_rates
from ..analysis.sensitivity import (DEFAULT_ORACLE_EPS, ERROR_BOUND, PATIENCES, PHIS, QUICK_GRID, TAUS,
                                    baseline_sweep, choose_setting, threshold_grid)
from ..plots.ablation import plot_ablation
from ..plots.bounds import plot_bounds
from ..plots.composition import plot_composition
from ..plots.convergence import plot_convergence, plot_recent_window
from ..plots.misalignment import plot_misalignment_rates, plot_score_vs_contribution
from ..plots.sensitivity import plot_false_stops, plot_pareto, plot_patience_curves, plot_threshold_heatmaps
from ..rules_summary import RULE_COLUMNS, SUMMARY_FORMATS, standard_rules, summarize
from ..synthetic import PRESETS, synthetic_cache
from ..table import format_table
from ..termination import ARTConfig
from .output_paths import check_output_folder


@dataclass
class CaptureStudies:
    """Every study of one source (DataFrames as returned by :mod:`art_analysis.analysis`)."""

    source: str
    art: str
    convergence: pd.DataFrame
    recent_window: pd.DataFrame
    misalignment_rates: pd.DataFrame
    misaligned_tokens: pd.DataFrame
    rules: pd.DataFrame
    grid: pd.DataFrame
    chosen: dict
    baselines: pd.DataFrame
    ablation: pd.DataFrame
    bounds: pd.DataFrame
    bounds_summary: pd.DataFrame
    composition: pd.DataFrame

    def tables(self) -> dict:
        """JSON-ready tables (per-token and per-head rows left out)."""
        skip = {"misaligned_tokens", "bounds"}
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in skip:
                out[f.name] = value.to_dict("records") if isinstance(value, pd.DataFrame) else value
        return out


def run_studies(source, name: str, *, art: ARTConfig | None = None, block_size: int = 64, step: int = -1,
                quick: bool = False, error_bound: float = ERROR_BOUND) -> CaptureStudies:
    """Run every capture study on ``source`` (a capture, a synthetic cache or decode inputs).

    ``art`` (default ``ARTConfig()``) is the rule of the ablation, bounds and policy studies;
    the sensitivity grid (smaller with ``quick``) also picks the setting with the smallest loaded
    fraction whose 99th-percentile error stays within ``error_bound`` (``chosen``).
    """
    art = art or ARTConfig()
    calls = decode_inputs(source, step)
    taus, phis, patiences = QUICK_GRID if quick else (TAUS, PHIS, PATIENCES)
    progress = tqdm(total=8, desc=f"studies ({name})", leave=False)

    def done(result):
        progress.update()
        return result

    walks = done([call.trace(block_size=block_size) for call in calls])
    convergence = done(convergence_curves(calls, block_size=block_size))
    recent = done(recent_window_curves(calls))
    rates = misalignment_rates(calls)
    tokens = done(misaligned_tokens(calls))
    rules = pd.DataFrame(summarize(walks, standard_rules(art), oracle_eps=DEFAULT_ORACLE_EPS))
    grid = threshold_grid(walks, taus, phis, patiences, base=art)
    chosen = choose_setting(grid, error_bound)
    baselines = done(baseline_sweep(walks))
    ablation = done(ablation_table(walks, art))
    bounds = done(bound_table(calls, bound_rules(art), block_size=block_size))
    composition = done(compose_with_art(calls, art=art, block_size=block_size))
    progress.close()
    return CaptureStudies(source=name, art=art.name, convergence=convergence, recent_window=recent,
                          misalignment_rates=rates, misaligned_tokens=tokens, rules=rules, grid=grid, chosen=chosen,
                          baselines=baselines, ablation=ablation, bounds=bounds, bounds_summary=bound_summary(bounds),
                          composition=composition)


def draw_figures(studies: CaptureStudies, out: Path) -> dict[str, Path]:
    """Every figure of ``studies`` into ``out`` (PNG + PDF); returns name -> PNG path."""
    name = studies.source
    return dict(
        convergence=plot_convergence(studies.convergence, out / "convergence.png",
                                     title=f"Convergence by traversal order ({name})"),
        recent_window=plot_recent_window(studies.recent_window, out / "recent_window.png",
                                         title=f"Recent-window retention curve ({name})"),
        misalignment=plot_score_vs_contribution(studies.misaligned_tokens, out / "misalignment.png"),
        misalignment_rates=plot_misalignment_rates(studies.misalignment_rates, out / "misalignment_rates.png",
                                                   title=f"Score vs contribution misalignment ({name})"),
        sensitivity_heatmaps=plot_threshold_heatmaps(studies.grid, out / "sensitivity_heatmaps.png",
                                                     title=f"ART over tau x phi ({name})"),
        sensitivity_patience=plot_patience_curves(studies.grid, out / "sensitivity_patience.png",
                                                  title=f"ART against patience ({name})"),
        pareto=plot_pareto(studies.grid, studies.baselines, out / "pareto.png", chosen=studies.chosen,
                           title=f"Loaded fraction against error ({name})"),
        false_stops=plot_false_stops(studies.grid, out / "false_stops.png", chosen=studies.chosen,
                                     title=f"Stops before Oracle(eps={DEFAULT_ORACLE_EPS:g}) ({name})"),
        ablation=plot_ablation(studies.ablation, out / "ablation.png", title=f"ART ablations ({name})"),
        bounds=plot_bounds(studies.bounds, out / "bounds.png", title=f"Truncation error against its bounds ({name})"),
        composition=plot_composition(studies.composition, out / "composition.png",
                                     title=f"KV-selection policies followed by ART ({name})"),
    )


# the stored results the benchmark figures are drawn from, and the entries each figure reads
BENCHMARK_FIGURE_INPUTS = {"art-decode": ("rows",), "art-decode-loop": ("loops",),
                           "art-decode-walk-persistence": ("walks", "summary"), "flexprefill": ("rows",)}


def read_benchmark_results(benchmarks: Path) -> dict[str, dict]:
    """The newest stored result of each kind of ``BENCHMARK_FIGURE_INPUTS`` in ``benchmarks`` (GPU results, and the
    analysis of a captured decode loop written by ``python -m art_analysis.analysis.walk_persistence``), each checked
    to be a JSON object with the entries its figure reads; kinds the folder holds no result of are left out.  Read
    before a long run, so that a damaged file is named before anything is written."""
    results = {}
    for kind, required in BENCHMARK_FIGURE_INPUTS.items():
        path = latest_result(kind, benchmarks)
        if path is not None:
            results[kind] = read_result(path, required, what=f"stored {kind} result")
    return results


def draw_benchmark_figures(results: dict[str, dict], out: Path) -> dict[str, Path]:
    """The kernel-speed, decode-loop, walk-persistence and FlexPrefill-latency figures of ``results``
    (:func:`read_benchmark_results`), each where its result is there."""
    from ..plots.decode_loop import decode_loop_figure
    from ..plots.figure_io import save_figure
    from ..plots.flexprefill import plot_latency_vs_gamma
    from ..plots.kernel_speed import plot_kernel_speed
    from ..plots.walk_persistence import walk_persistence_figure

    figures = {}
    if "art-decode" in results:
        figures["kernel_speed"] = plot_kernel_speed(results["art-decode"], out / "kernel_speed.png")
    if "art-decode-loop" in results:
        figures["decode_loop"] = save_figure(decode_loop_figure(results["art-decode-loop"]), out / "decode_loop.png")
    if "art-decode-walk-persistence" in results:
        figures["walk_persistence"] = save_figure(walk_persistence_figure(results["art-decode-walk-persistence"]),
                                                  out / "walk_persistence.png")
    if "flexprefill" in results:
        figures["flexprefill_latency"] = plot_latency_vs_gamma(results["flexprefill"]["rows"],
                                                               out / "flexprefill_latency_vs_gamma.png")
    return figures


def print_studies(studies: CaptureStudies) -> None:
    """The key tables of ``studies`` on standard output."""
    chosen = studies.chosen
    print(f"\nstopping rules on {studies.source}")
    print(format_table(studies.rules, RULE_COLUMNS, SUMMARY_FORMATS))
    print(f"\nablations of {studies.art}")
    print(format_table(studies.ablation, ABLATION_COLUMNS, ABLATION_FORMATS))
    print("\ntruncation bounds at each rule's stops (share of heads where each bound holds)")
    print(format_table(studies.bounds_summary, BOUND_COLUMNS, BOUND_FORMATS))
    print(f"\npolicies followed by {studies.art}")
    print(format_table(studies.composition, COMPOSITION_COLUMNS, COMPOSITION_FORMATS))
    print(f"\n{'smallest loaded fraction' if chosen['within_bound'] else 'NO setting meets; lowest error'} "
          f"with p99 error <= {ERROR_BOUND}: tau={chosen['tau']:g} phi={chosen['phi']:g} "
          f"patience={chosen['patience']} (loaded {chosen['loaded_fraction']:.3f}, "
          f"p99 {chosen['rel_error_p99']:.2e})")


def register(subparsers) -> None:
    parser = subparsers.add_parser("figures", help="run every study on a capture and draw its figures",
                                   description=__doc__)
    parser.add_argument("--capture", type=Path, help="a capture folder written by `art-analysis capture`")
    parser.add_argument("--synthetic", choices=sorted(PRESETS), help="use a synthetic cache instead")
    parser.add_argument("--step", type=int, default=-1, help="decode step of the capture (default: the last)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a smaller threshold grid")
    parser.add_argument("--benchmarks", type=Path, default=Path("benchmarks/results"),
                        help="GPU benchmark JSON folder for the kernel figures")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default figures/<capture or synthetic name>)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.capture is None) == (args.synthetic is None):
        raise ValueError("give exactly one of --capture DIR and --synthetic PRESET")
    if args.out is not None:
        check_output_folder(args.out, "--out")
    benchmark_results = read_benchmark_results(args.benchmarks)
    if args.capture is not None:
        from ..capture import KVCapture

        source, name = KVCapture.load(args.capture), args.capture.name
    else:
        source, name = synthetic_cache(1, 8, 2, 2048 if args.quick else 8192, 64, preset=args.synthetic,
                                       seed=0), f"synthetic-{args.synthetic}"
    out = args.out or Path("figures") / name
    studies = run_studies(source, name, block_size=args.block_size, step=args.step, quick=args.quick)
    figures = draw_figures(studies, out)
    figures.update(draw_benchmark_figures(benchmark_results, out))
    write_json_atomic(out / "studies.json", dict(studies.tables(), figures={k: str(p) for k, p in figures.items()}))
    print_studies(studies)
    print(f"\nwrote {len(figures)} figures (PNG + PDF) and studies.json to {out}")
    return 0
