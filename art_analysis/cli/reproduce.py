"""`art-analysis reproduce`: capture the embedded model, run every analysis, regenerate the figures.

Writes into ``--out`` (default ``figures/``): ``REPORT.md``, ``reproduce.json`` and the PNG
figures, each atomically.  Captures are cached under ``captures/`` and reused when their
settings match.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch
from tqdm import tqdm

from ..analysis.convergence import mean_error_at
from ..analysis.misalignment import misaligned_fraction, token_scores
from ..analysis.sensitivity import pick_default, threshold_grid
from ..blockwise import blockwise_attention
from ..plots.convergence import plot_error_vs_loaded
from ..plots.misalignment import plot_score_vs_contribution
from ..plots.sensitivity import plot_threshold_tradeoff
from ..rules_summary import SUMMARY_COLUMNS, SUMMARY_FORMATS, standard_rules, summarize
from ..synthetic import PRESETS, synthetic_cache
from ..table import format_table
from ..termination import ARTConfig

ORDERS = ("sequential", "recency", "sink_recency")
TAUS = (1e-3, 3e-4, 1e-4, 3e-5, 1e-5)
PHIS = (1e-4, 1e-5, 1e-6)
PATIENCES = (2, 4, 8)
# The error bound under which the sensitivity study picks a setting (99th percentile over heads).
ERROR_BOUND = 0.02


def register(subparsers) -> None:
    parser = subparsers.add_parser("reproduce", help="run every analysis and regenerate figures/ and REPORT.md",
                                   description=__doc__)
    parser.add_argument("--model", default="smollm2", help="embedded model name, HF folder or GGUF file")
    parser.add_argument("--context", type=int, default=None, help="context tokens (default 4096, quick 1024)")
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="short contexts and small synthetic caches")
    parser.add_argument("--synthetic-only", action="store_true", help="skip the real model")
    parser.add_argument("--captures", type=Path, default=Path("captures"))
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    context = args.context or (1024 if args.quick else 4096)
    sources: dict[str, list] = {}
    if not args.synthetic_only:
        sources["smollm2"] = _model_inputs(args, context)
    seqlen = 2048 if args.quick else 8192
    for preset in PRESETS:
        cache = synthetic_cache(1, 32, 8, seqlen, 128, preset=preset, seed=0)
        sources[f"synthetic-{preset}"] = [(cache.q, cache.k, cache.v, torch.tensor([seqlen]))]

    traces = {name: [blockwise_attention(q, k, v, block_size=args.block_size, cache_seqlens=lens)
                     for q, k, v, lens in tqdm(inputs, desc=f"simulate {name}", leave=False)]
              for name, inputs in sources.items()}
    main_source = next(iter(traces))

    grid = threshold_grid(traces[main_source], TAUS, PHIS, PATIENCES)
    chosen = pick_default(grid, ERROR_BOUND)
    defaults = ARTConfig()
    rules = standard_rules()
    summaries = {name: summarize(ts, rules) for name, ts in traces.items()}

    fractions = torch.linspace(0, 1, 101, dtype=torch.float64)
    convergence = {}
    for order in ORDERS:
        ordered = [blockwise_attention(q, k, v, block_size=args.block_size, cache_seqlens=lens, order=order)
                   for q, k, v, lens in sources[main_source]]
        convergence[order] = (fractions, mean_error_at(ordered, fractions))

    q, k, v, lens = sources[main_source][len(sources[main_source]) // 2]
    score, contribution = token_scores(q[0], k[0], v[0], int(lens[0]))
    misaligned = misaligned_fraction(score, contribution)

    out = args.out
    figures = dict(
        convergence=plot_error_vs_loaded(convergence, out / "convergence.png",
                                         title=f"Convergence by traversal order ({main_source})"),
        sensitivity=plot_threshold_tradeoff(grid, out / "sensitivity.png", chosen=chosen,
                                            title=f"ART threshold sensitivity ({main_source})"),
        misalignment=plot_score_vs_contribution(score[0], contribution[0], out / "misalignment.png",
                                                title=f"Score vs contribution ({main_source}, middle layer)"),
    )
    results = dict(date=datetime.date.today().isoformat(), host=platform.node(), torch=torch.__version__,
                   context=context, block_size=args.block_size, main_source=main_source,
                   error_bound=ERROR_BOUND, chosen=chosen,
                   defaults=dict(tau=defaults.tau, phi=defaults.phi, patience=defaults.patience),
                   summaries=summaries, sensitivity=grid,
                   convergence={o: e.tolist() for o, (_, e) in convergence.items()},
                   misaligned_fraction=misaligned.tolist(), figures={k: str(p) for k, p in figures.items()})
    _write_atomic(out / "reproduce.json", json.dumps(results, indent=2) + "\n")
    _write_atomic(out / "REPORT.md", _report(results, fractions))
    for name, rows in summaries.items():
        print(f"\n{name}")
        print(format_table(rows, SUMMARY_COLUMNS, SUMMARY_FORMATS))
    print(f"\nsensitivity on {main_source}: smallest loaded fraction with p99 error <= {ERROR_BOUND}: "
          f"tau={chosen['tau']:g} phi={chosen['phi']:g} patience={chosen['patience']} "
          f"(loaded {chosen['loaded_fraction']:.3f}); ARTConfig() uses tau={defaults.tau:g} "
          f"phi={defaults.phi:g} patience={defaults.patience}")
    print(f"wrote {out / 'REPORT.md'}, {out / 'reproduce.json'} and {len(figures)} figures")
    return 0


def _model_inputs(args: argparse.Namespace, context: int) -> list:
    """Capture (or reuse) the model's KV cache; one input per layer at the last decode step."""
    from ..capture import KVCapture, capture_kv
    from ..decode_inputs import decode_step_inputs

    folder = args.captures / f"reproduce-{Path(str(args.model)).stem}-{context}-{args.decode_steps}"
    if folder.exists():
        capture = KVCapture.load(folder)
    else:
        capture = capture_kv(model=args.model, source="stdlib", context_tokens=context,
                             decode_steps=args.decode_steps)
        capture.save(folder)
    inputs = []
    for layer in range(capture.num_layers):
        q, k, v, lens, _ = decode_step_inputs(capture, layer, -1)
        inputs.append((q, k, v, lens))
    return inputs


def _report(results: dict, fractions: torch.Tensor) -> str:
    chosen, defaults = results["chosen"], results["defaults"]
    lines = [
        "# ART reproduction report",
        "",
        f"Generated by `art-analysis reproduce` on {results['date']} (torch {results['torch']}). "
        f"Main source: `{results['main_source']}`, context {results['context']} tokens, "
        f"block size {results['block_size']}. Every number below is computed by that run.",
        "",
        "## Stopping rules",
        "",
        "Loaded fraction of the KV cache and relative L2 error of the truncated output against the "
        "full walk, pooled over every query head (and every layer for the model).",
        "",
    ]
    for name, rows in results["summaries"].items():
        lines += [f"### {name}", "", "```", format_table(rows, SUMMARY_COLUMNS, SUMMARY_FORMATS), "```", ""]
    lines += [
        "## Threshold sensitivity and the project defaults",
        "",
        f"Grid: tau in {list(TAUS)}, phi in {list(PHIS)}, patience in {list(PATIENCES)} "
        f"(output probe, relative scale, group rule `all`). The setting with the smallest loaded "
        f"fraction whose 99th-percentile error stays under {results['error_bound']} is "
        f"tau={chosen['tau']:g}, phi={chosen['phi']:g}, patience={chosen['patience']} "
        f"(loaded {chosen['loaded_fraction']:.3f}, p99 error {chosen['rel_error_p99']:.2e}). "
        f"`ARTConfig()` uses tau={defaults['tau']:g}, phi={defaults['phi']:g}, "
        f"patience={defaults['patience']}. See `sensitivity.png`.",
        "",
        "## Convergence by traversal order",
        "",
        "Mean relative error of `O^(t)` once a fraction of the cache is loaded (`convergence.png`):",
        "",
        "| loaded | " + " | ".join(results["convergence"]) + " |",
        "|---|" + "---|" * len(results["convergence"]),
    ]
    for f in (0.05, 0.1, 0.25, 0.5):
        i = int(round(f * (len(fractions) - 1)))
        lines.append(f"| {f:.2f} | " + " | ".join(f"{e[i]:.3e}" for e in results["convergence"].values()) + " |")
    share = results["misaligned_fraction"]
    lines += [
        "",
        "## Attention score vs contribution",
        "",
        "Share of the top-20% tokens by contribution `||a_j v_j||` that are not in the top 20% by "
        f"attention score, per KV head of the middle input: {', '.join(f'{s:.2f}' for s in share)} "
        "(`misalignment.png`).",
        "",
    ]
    return "\n".join(lines)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
