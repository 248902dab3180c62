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
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import pandas as pd
from tqdm import tqdm

from kernels.int_checks import is_finite_real
from kernels.results_io import RESULTS_DIR, latest_result, read_result, write_json_atomic

from ..analysis.ablation import ABLATION_COLUMNS, ABLATION_FORMATS, ablation_table
from ..analysis.bounds import BOUND_COLUMNS, BOUND_FORMATS, bound_rules, bound_summary, bound_table
from ..analysis.composition import COMPOSITION_COLUMNS, COMPOSITION_FORMATS, DEFAULT_POLICIES, compose_with_art
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
from ..policies import parse_spec
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


def policy_study_min_tokens() -> int:
    """The fewest cached tokens the study of ``DEFAULT_POLICIES`` runs on: a policy keeping an observation window
    within a fractional budget (SnapKV, PyramidKV) needs ``floor(budget * tokens) >= window``."""
    return max((math.ceil(policy.window / policy.budget - 1e-9) for policy in map(parse_spec, DEFAULT_POLICIES)
                if hasattr(policy, "window") and isinstance(policy.budget, float)), default=1)


def run_studies(source, name: str, *, art: ARTConfig | None = None, block_size: int = 64, step: int = -1,
                quick: bool = False, error_bound: float = ERROR_BOUND) -> CaptureStudies:
    """Run every capture study on ``source`` (a capture, a synthetic cache or decode inputs).

    ``art`` (default ``ARTConfig()``) is the rule of the ablation, bounds and policy studies;
    the sensitivity grid (smaller with ``quick``) also picks the setting with the smallest loaded
    fraction whose 99th-percentile error stays within ``error_bound`` (``chosen``).  Inputs shorter than the policy
    study needs (:func:`policy_study_min_tokens`) are refused before any study runs.
    """
    art = art or ARTConfig()
    calls = decode_inputs(source, step)
    shortest, needed = min(int(call.cache_seqlens.min()) for call in calls), policy_study_min_tokens()
    if shortest < needed:
        raise ValueError(f"{name} holds {shortest} cached tokens at decode step {step}; the study of the built-in "
                         f"KV-selection policies needs at least {needed} (SnapKV and PyramidKV keep their "
                         "observation window within a budget of a fraction of the tokens)")
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


@dataclass(frozen=True)
class Reads:
    """What a figure reads of a JSON object, or of each object of a JSON list that passes ``only`` (default: every
    one): the entries ``keys``, those of them it draws as numbers (``numbers``: each must be a finite number), and for
    each ``(entry, reads)`` of ``inner`` what it reads of that entry's value where the entry is there."""

    keys: tuple[str, ...] = ()
    inner: tuple[tuple[str, Reads], ...] = ()
    only: Callable[[dict], bool] | None = None
    numbers: tuple[str, ...] = ()


def _timed(row: dict) -> bool:
    return "ms" in row


def _lacking(value, reads: Reads, where: str) -> str | None:
    """Where ``value`` (an object, or a list of objects; found at ``where``) lacks what ``reads`` names, and what it
    lacks; ``None`` where it lacks nothing."""
    for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
        at = where if i is None else f"{where}[{i}]"
        if not isinstance(item, dict):
            return f"{at} is not an object"
        if reads.only is not None and not reads.only(item):
            continue
        missing = [key for key in reads.keys if key not in item]
        if missing:
            return f"{at} lacks {', '.join(missing)}"
        for key in reads.numbers:
            if not is_finite_real(item[key]):
                return f"{at + '.' if at else ''}{key} must be a finite number, got {item[key]!r}"
        for key, inner in reads.inner:
            if key in item and (gap := _lacking(item[key], inner, f"{at}.{key}" if at else key)):
                return gap
    return None


# the stored results the benchmark figures are drawn from: the suite each is written as (None: one without a suite)
# and what its figure reads (art_analysis.plots: kernel_speed, decode_loop, walk_persistence, flexprefill)
BENCHMARK_FIGURE_INPUTS = {
    "art-decode": ("decode", Reads(("rows", "copy_ceiling_tb_per_s", "device", "date"),
                                   numbers=("copy_ceiling_tb_per_s",), inner=(
        ("rows", Reads(("impl", "data", "batch", "seqlen", "tb_per_s"), only=_timed,
                       numbers=("batch", "seqlen", "tb_per_s"))),
        ("rows", Reads(("loaded_fraction",), only=lambda row: _timed(row) and row.get("impl") == "art",
                       numbers=("loaded_fraction",))),
        ("dense_batches", Reads(("impl",))),
        ("dense_batches", Reads(("batch", "seqlen"), only=lambda row: "speedup_vs_best_peer" in row)),
        ("paged", Reads(("impl", "batch", "seqlen"),
                        only=lambda row: bool(row.get("page_size")) and "over_contiguous" in row)),
    ))),
    "art-decode-loop": ("decode-loop", Reads(("loops",), inner=(
        ("loops", Reads(("seqlen", "rows"), inner=(("rows", Reads(("impl", "step"))),))),))),
    "art-decode-walk-persistence": (None, Reads(("walks", "summary"), inner=(
        ("summary", Reads(("rank_correlation", "split_choice_agreement"))),))),
    "flexprefill": ("flexprefill", Reads(("rows",), inner=(
        ("rows", Reads(("method",))),
        ("rows", Reads(("data", "seqlen", "ms"), only=lambda row: row.get("method") in ("flexprefill", "sdpa"),
                       numbers=("seqlen", "ms"))),
        ("rows", Reads(("gamma",), only=lambda row: row.get("method") == "flexprefill", numbers=("gamma",))),
    ))),
}


def read_benchmark_result(path: Path, kind: str) -> dict:
    """The stored result of ``kind`` (a kind of ``BENCHMARK_FIGURE_INPUTS``) at ``path``, checked to be a JSON object
    of its suite holding every entry its figure reads; ``ValueError`` naming the file and what is wrong otherwise.  A
    run marked ``"complete": false`` is returned with a note: its figure shows only what it measured."""
    suite, reads = BENCHMARK_FIGURE_INPUTS[kind]
    what = f"stored {kind} result"
    payload = read_result(path, reads.keys + (() if suite is None else ("suite",)), what=what)
    if suite is not None and payload["suite"] != suite:
        raise ValueError(f"{what} {path} is a result of the suite {payload['suite']!r}, not {suite!r}")
    gap = _lacking(payload, reads, "")
    if gap is not None:
        raise ValueError(f"{what} {path}: {gap}")
    if payload.get("complete") is False:
        print(f"note: {path} is an incomplete run (\"complete\": false); its figure shows only what it measured")
    return payload


def read_benchmark_results(benchmarks: Path) -> dict[str, dict]:
    """The newest stored result of each kind of ``BENCHMARK_FIGURE_INPUTS`` in ``benchmarks`` (GPU results, and the
    analysis of a captured decode loop written by ``python -m art_analysis.analysis.walk_persistence``), each read by
    :func:`read_benchmark_result`; kinds the folder holds no result of are left out.  ``benchmarks`` must be a folder,
    but the default ``benchmarks/results`` may be missing (a run outside a checkout).  Read before a long run, so
    that a damaged file is named before anything is written."""
    if not benchmarks.is_dir() and (benchmarks.exists() or benchmarks != RESULTS_DIR):
        raise ValueError(f"--benchmarks {str(benchmarks)!r} is not a folder")
    results = {}
    for kind in BENCHMARK_FIGURE_INPUTS:
        path = latest_result(kind, benchmarks)
        if path is not None:
            results[kind] = read_benchmark_result(path, kind)
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
    parser.add_argument("--step", type=int, default=None, help="decode step of the capture (default: the last)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a smaller threshold grid")
    parser.add_argument("--benchmarks", type=Path, default=RESULTS_DIR,
                        help="GPU benchmark JSON folder for the kernel figures")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default figures/<capture or synthetic name>)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.capture is None) == (args.synthetic is None):
        raise ValueError("give exactly one of --capture DIR and --synthetic PRESET")
    if args.capture is None and args.step is not None:
        raise ValueError("--step chooses a decode step of a capture; pass --capture DIR")
    out = None if args.out is None else check_output_folder(args.out, "--out")
    benchmark_results = read_benchmark_results(args.benchmarks)
    if args.capture is not None:
        from ..capture import KVCapture

        # the capture folder's own name, also where it is given as "." or ends in ".."
        source, name = KVCapture.load(args.capture), args.capture.resolve().name
    else:
        source, name = synthetic_cache(1, 8, 2, 2048 if args.quick else 8192, 64, preset=args.synthetic,
                                       seed=0), f"synthetic-{args.synthetic}"
    if out is None:   # the default folder, named by the source, checked before the studies that it would lose
        out = check_output_folder(Path("figures") / name, "--out")
    studies = run_studies(source, name, block_size=args.block_size, step=-1 if args.step is None else args.step,
                          quick=args.quick)
    figures = draw_figures(studies, out)
    figures.update(draw_benchmark_figures(benchmark_results, out))
    write_json_atomic(out / "studies.json", dict(studies.tables(), figures={k: str(p) for k, p in figures.items()}))
    print_studies(studies)
    print(f"\nwrote {len(figures)} figures (PNG + PDF) and studies.json to {out}")
    return 0
