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
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from kernels.results_io import write_json_atomic, write_text_atomic

from ..analysis.bounds import truncation_report
from ..analysis.composition import COMPOSITION_COLUMNS, COMPOSITION_FORMATS, compose_with_art
from ..analysis.convergence import mean_error_at
from ..analysis.end_to_end import GENERATION_COLUMNS, GENERATION_FORMATS
from ..analysis.misalignment import misaligned_fraction, token_scores
from ..analysis.sensitivity import pick_default, threshold_grid
from ..blockwise import blockwise_attention
from ..plots.convergence import plot_error_vs_loaded
from ..plots.misalignment import plot_score_vs_contribution
from ..plots.sensitivity import plot_threshold_tradeoff
from ..rules_summary import SUMMARY_COLUMNS, SUMMARY_FORMATS, standard_rules, summarize
from ..synthetic import PRESETS, synthetic_cache
from ..table import format_table
from . import build_parser
from .flexprefill import COLUMNS as FLEXPREFILL_COLUMNS, FORMATS as FLEXPREFILL_FORMATS
from ..termination import ARTConfig, stop

ORDERS = ("sequential", "recency", "sink_recency")
TAUS = (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5)
PHIS = (1e-3, 1e-4, 1e-5, 1e-6)
PATIENCES = (2, 4, 8, 16)
# The error bound under which the sensitivity study picks a setting (99th percentile over heads).
ERROR_BOUND = 0.02
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
PASSKEY_NEW_TOKENS = 10


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
    generation: list[dict] = []
    flexprefill_json = args.out / "flexprefill.json"
    flexprefill_args = ["flexprefill", "--out", str(args.out), "--json", str(flexprefill_json)]
    if args.synthetic_only:
        flexprefill_args += ["--seqlen", str(context)]
    else:
        from ..models import load_model

        loaded = load_model(args.model)
        capture, folder = _model_capture(loaded, args, context)
        sources["smollm2"] = capture.policy_inputs(-1)
        flexprefill_args += ["--capture", str(folder)]
        generation = _passkey_generation(loaded, args.block_size, context)
    seqlen = 2048 if args.quick else 8192
    for preset in PRESETS:
        cache = synthetic_cache(1, 32, 8, seqlen, 128, preset=preset, seed=0)
        sources[f"synthetic-{preset}"] = [(cache.q, cache.k, cache.v, torch.tensor([seqlen]),
                                           cache.q[:, :, None], 0, 1)]

    traces = {name: [blockwise_attention(q, k, v, block_size=args.block_size, cache_seqlens=lens)
                     for q, k, v, lens, *_ in tqdm(inputs, desc=f"simulate {name}", leave=False)]
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
                   for q, k, v, lens, *_ in sources[main_source]]
        convergence[order] = (fractions, mean_error_at(ordered, fractions))

    q, k, v, lens, *_ = sources[main_source][len(sources[main_source]) // 2]
    score, contribution = token_scores(q[0], k[0], v[0], int(lens[0]))
    misaligned = misaligned_fraction(score, contribution)

    chosen_rule = replace(ARTConfig(), tau=chosen["tau"], phi=chosen["phi"], patience=chosen["patience"])
    bounds = _bounds_summary(traces[main_source], sources[main_source], chosen_rule)
    composition = compose_with_art(sources[main_source], art=chosen_rule, block_size=args.block_size)

    out = args.out
    figures = dict(
        convergence=plot_error_vs_loaded(convergence, out / "convergence.png",
                                         title=f"Convergence by traversal order ({main_source})"),
        sensitivity=plot_threshold_tradeoff(grid, out / "sensitivity.png", chosen=chosen,
                                            title=f"ART threshold sensitivity ({main_source})"),
        misalignment=plot_score_vs_contribution(score[0], contribution[0], out / "misalignment.png",
                                                title=f"Score vs contribution ({main_source}, middle layer)"),
    )
    print("\nFlexPrefill block selection against gamma")
    flexprefill = build_parser().parse_args(flexprefill_args)
    flexprefill.func(flexprefill)
    results = dict(date=datetime.date.today().isoformat(), host=platform.node(), torch=torch.__version__,
                   context=context, block_size=args.block_size, main_source=main_source,
                   error_bound=ERROR_BOUND, chosen=chosen,
                   defaults=dict(tau=defaults.tau, phi=defaults.phi, patience=defaults.patience),
                   summaries=summaries, sensitivity=grid,
                   convergence={o: e.tolist() for o, (_, e) in convergence.items()},
                   misaligned_fraction=misaligned.tolist(), bounds=bounds, composition=composition,
                   flexprefill=json.loads(flexprefill_json.read_text()), generation=generation,
                   figures={k: str(p) for k, p in figures.items()})
    write_json_atomic(out / "reproduce.json", results)
    write_text_atomic(out / "REPORT.md", _report(results, fractions))
    for name, rows in summaries.items():
        print(f"\n{name}")
        print(format_table(rows, SUMMARY_COLUMNS, SUMMARY_FORMATS))
    print(f"\npolicies followed by {chosen_rule.name} on {main_source}")
    print(format_table(composition, COMPOSITION_COLUMNS, COMPOSITION_FORMATS))
    if generation:
        print(f"\npasskey retrieval ({context} tokens) with each rule inside decoding")
        print(format_table(generation, GENERATION_COLUMNS, GENERATION_FORMATS))
    print(f"\nsensitivity on {main_source}: smallest loaded fraction with p99 error <= {ERROR_BOUND}: "
          f"tau={chosen['tau']:g} phi={chosen['phi']:g} patience={chosen['patience']} "
          f"(loaded {chosen['loaded_fraction']:.3f}); ARTConfig() uses tau={defaults.tau:g} "
          f"phi={defaults.phi:g} patience={defaults.patience}")
    print(f"wrote {out / 'REPORT.md'}, {out / 'reproduce.json'} and the figures in {out}")
    return 0


def _model_capture(loaded, args: argparse.Namespace, context: int):
    """Capture the model (or reuse an earlier capture with the same settings): KV caches, decode
    queries, and the prefill queries of the first, middle and last layers (for FlexPrefill)."""
    from ..capture import KVCapture, capture_kv, model_dims
    from ..corpus import long_text

    folder = args.captures / f"reproduce-{Path(str(args.model)).stem}-stdlib-c{context}-d{args.decode_steps}-prefill"
    if folder.exists():
        return KVCapture.load(folder), folder
    layers = model_dims(loaded.model)["num_layers"]
    # About 3-4 characters a token for source code; ask for comfortably more text.
    text = long_text("stdlib", seed=0, length=8 * context)
    capture = capture_kv(loaded, text=text, context_tokens=context, decode_steps=args.decode_steps,
                         prefill_layers=sorted({0, layers // 2, layers - 1}), source=dict(corpus="stdlib", seed=0))
    capture.save(folder)
    return capture, folder


def _passkey_generation(loaded, block_size: int, context: int) -> list[dict]:
    """Passkey retrieval with each rule inside the model's decode attention (five needle depths), walking
    sink-then-newest and by Quest's key bound."""
    from ..analysis.end_to_end import compare_generation
    from ..corpus import passkey_prompt
    from .evaluate import evaluation_rules

    prompts = [passkey_prompt(context, depth=depth, seed=i, tokenizer=loaded.tokenizer)
               for i, depth in enumerate(PASSKEY_DEPTHS)]
    rows = []
    for order in ("sink_recency", "importance"):
        rows += compare_generation(loaded.model, loaded.tokenizer, prompts, evaluation_rules(ARTConfig()),
                                   max_new_tokens=PASSKEY_NEW_TOKENS, block_size=block_size, order=order)
    return rows


def _bounds_summary(traces: list, inputs: list, rule: ARTConfig) -> dict:
    """Mean truncation error, its exact bound and its certified bound at the stops of ``rule``."""
    reports = [truncation_report(trace, q, k, v, stop(trace, rule).stop_step, lens)
               for trace, (q, k, v, lens, *_) in zip(traces, inputs)]
    pooled = {name: torch.cat([getattr(r, name).flatten() for r in reports])
              for name in ("error", "identity_residual", "rho", "bound_mean", "rho_certified", "bound_certified")}
    truncated = pooled["rho"] > 0
    summary = {f"{name}_mean": float(values.mean()) for name, values in pooled.items()}
    summary.update(rule=rule.name, truncated_heads=int(truncated.sum()), heads=int(truncated.numel()),
                   identity_residual_max=float(pooled["identity_residual"].max()),
                   certified_le_0_05=float((pooled["bound_certified"][truncated] <= 0.05).double().mean())
                   if truncated.any() else float("nan"))
    return summary


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
        "## Truncation error and its bounds",
        "",
        f"At the stops of `{results['bounds']['rule']}` ({results['bounds']['truncated_heads']} of "
        f"{results['bounds']['heads']} heads truncated), averaged over all heads: absolute error "
        f"||O_full - O^(t)|| {results['bounds']['error_mean']:.3e}, "
        f"mean exact bound rho_R(||Obar_R|| + ||O^(t)||) {results['bounds']['bound_mean_mean']:.3e}, mean certified "
        f"bound from per-block key min/max {results['bounds']['bound_certified_mean']:.3e}; the certified bound "
        f"is at most 0.05 for {results['bounds']['certified_le_0_05']:.1%} of the truncated heads. The identity "
        f"O_full - O^(t) = rho_R (Obar_R - O^(t)) holds to {results['bounds']['identity_residual_max']:.1e}.",
        "",
        "## KV-selection policies followed by ART",
        "",
        "```",
        format_table(results["composition"], COMPOSITION_COLUMNS, COMPOSITION_FORMATS),
        "```",
        "",
        *_generation_section(results),
        "## FlexPrefill: kept tiles and error against gamma",
        "",
        "Block selection by attention mass alone (the key-centric peer), on the recorded prefill layers "
        "(`flexprefill_*.png`; the latency figure is drawn from the newest GPU benchmark JSON):",
        "",
        "```",
        format_table(results["flexprefill"], FLEXPREFILL_COLUMNS, FLEXPREFILL_FORMATS),
        "```",
        "",
    ]
    return "\n".join(lines)


def _generation_section(results: dict) -> list[str]:
    if not results["generation"]:
        return []
    return [
        "## End to end: passkey retrieval with the rule inside decoding",
        "",
        f"The simulator's truncated output replaces the model's attention at every decode step of every "
        f"layer (the prefill stays dense). Passkey prompts of {results['context']} tokens, needle depths "
        f"{list(PASSKEY_DEPTHS)}, {PASSKEY_NEW_TOKENS} greedy tokens; accuracy counts prompts whose passkey "
        "appears in the output, agreement compares tokens with dense decoding. `sink_recency` walks the sink "
        "block, then newest first; `importance` walks blocks by Quest's per-block key bound on the score "
        "(max over the group's heads), highest first:",
        "",
        "```",
        format_table(results["generation"], GENERATION_COLUMNS, GENERATION_FORMATS),
        "```",
        "",
    ]
