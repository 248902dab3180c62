"""`art-analysis reproduce`: capture the embedded model, run every study, regenerate figures/ and REPORT.md.

The pipeline, with progress bars: capture two texts (Python standard-library sources and the
prose of its documentation) with the default model, the first with the prefill queries of its
first, middle and last layers; run every study of ``art-analysis figures`` on the first text;
check the defaults it picks on the second; decode passkey and needle-in-a-haystack prompts with
the stopping rules inside the model (retention); sweep FlexPrefill's gamma on the recorded
prefill layers; draw the kernel-speed, decode-loop and FlexPrefill latency figures from the newest GPU results
in ``benchmarks/results``, and the walk-persistence figure from the analysis stored there; write ``REPORT.md``,
``reproduce.json`` and every figure (PNG + PDF) into ``--out``, each atomically.  Captures are cached under
``--captures`` (see :mod:`art_analysis.capture_store`) and reused when their settings match.  ``--quick`` uses
1024-token contexts, a smaller grid and fewer prompts.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from kernels.results_io import flat_summary, latest_result, read_result, write_json_atomic, write_text_atomic

from ..analysis.inputs import traces
from ..analysis.sensitivity import DEFAULT_ORACLE_EPS, ERROR_BOUND
from ..capture_store import corpus_capture
from ..plots.retention import plot_retention
from ..rules_summary import standard_rules, summarize
from ..synthetic import PRESETS, synthetic_cache
from ..termination import ARTConfig
from . import build_parser
from .figures import draw_benchmark_figures, draw_figures, print_studies, read_benchmark_results, run_studies
from .output_paths import check_output_folder
from .report import render_report

TEXTS = ("stdlib", "docs")
RETENTION_DEPTHS = (0.1, 0.35, 0.65, 0.9)
QUICK_RETENTION_DEPTHS = (0.25, 0.75)
RETENTION_NEW_TOKENS = 10
RETENTION_ORDERS = ("sink_recency", "importance")


def register(subparsers) -> None:
    parser = subparsers.add_parser("reproduce", help="run every study and regenerate figures/ and REPORT.md",
                                   description=__doc__)
    parser.add_argument("--model", default="smollm2", help="embedded model name, HF folder or GGUF file")
    parser.add_argument("--context", type=int, default=None, help="context tokens (default 4096, quick 1024)")
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="short contexts, a small grid, fewer prompts")
    parser.add_argument("--synthetic-only", action="store_true", help="skip the real model (synthetic caches only)")
    parser.add_argument("--captures", type=Path, default=None,
                        help="folder of cached captures (default $ART_CAPTURES or captures/)")
    parser.add_argument("--benchmarks", type=Path, default=Path("benchmarks/results"),
                        help="GPU benchmark JSON folder for the kernel figures")
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    context = args.context if args.context is not None else (1024 if args.quick else 4096)
    if context < 256:
        raise ValueError(f"--context must be at least 256 tokens, got {context}")
    for option, value in (("--block-size", args.block_size), ("--decode-steps", args.decode_steps)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    out = check_output_folder(args.out, "--out")
    if args.captures is not None:
        check_output_folder(args.captures, "--captures")
    benchmark_results = read_benchmark_results(args.benchmarks)
    flexprefill_json = out / "flexprefill.json"
    flexprefill_args = ["flexprefill", "--out", str(out), "--json", str(flexprefill_json)]
    retention = pd.DataFrame()
    if args.synthetic_only:
        seqlen = 2048 if args.quick else 8192
        sources = {f"synthetic-realistic-seed{seed}": synthetic_cache(1, 8, 2, seqlen, 64, preset="realistic",
                                                                      seed=seed) for seed in (0, 1)}
        flexprefill_args += ["--seqlen", str(context)]
    else:
        from ..models import check_model_positions, load_model

        check_model_positions(args.model, context + RETENTION_NEW_TOKENS - 1,
                              f"--context {context} with the retrieval's {RETENTION_NEW_TOKENS} new tokens")
        loaded = load_model(args.model)
        sources, folders = {}, {}
        layers = loaded.config.num_hidden_layers
        for i, text in enumerate(tqdm(TEXTS, desc="captures")):
            # The first text also records the prefill queries of the first, middle and last layers.
            prefill = sorted({0, layers // 2, layers - 1}) if i == 0 else ()
            capture, folder = corpus_capture(loaded, text=text, context=context, decode_steps=args.decode_steps,
                                             prefill_layers=prefill, root=args.captures)
            sources[f"{Path(str(args.model)).stem}-{text}"], folders[text] = capture, folder
        flexprefill_args += ["--capture", str(folders[TEXTS[0]])]
        retention = _retention(loaded, args.block_size, context, args.quick)
    (main_name, main_source), (second_name, second_source) = sources.items()

    studies = run_studies(main_source, main_name, block_size=args.block_size, quick=args.quick)
    figures = draw_figures(studies, out)
    chosen = studies.chosen
    chosen_rule = replace(ARTConfig(), tau=chosen["tau"], phi=chosen["phi"], patience=chosen["patience"])
    rules = [chosen_rule] + ([ARTConfig()] if chosen_rule.name != ARTConfig().name else [])
    second = summarize(traces(second_source, block_size=args.block_size), rules, oracle_eps=DEFAULT_ORACLE_EPS)

    synthetic_seqlen = 2048 if args.quick else 8192
    synthetic = {}
    for preset in tqdm(PRESETS, desc="synthetic caches", leave=False):
        cache = synthetic_cache(1, 32, 8, synthetic_seqlen, 128, preset=preset, seed=0)
        synthetic[f"synthetic-{preset} (32/8 heads, {synthetic_seqlen} tokens)"] = summarize(
            traces(cache, block_size=args.block_size), standard_rules(), oracle_eps=DEFAULT_ORACLE_EPS)

    print("\nFlexPrefill block selection against gamma")
    flexprefill = build_parser().parse_args(flexprefill_args)
    flexprefill.func(flexprefill)
    figures.update(draw_benchmark_figures(benchmark_results, out))
    if not retention.empty:
        figures["retention"] = plot_retention(retention, out / "retention.png",
                                              title=f"Retrieval with the rule inside decoding ({context} tokens)")
    results = dict(
        date=datetime.date.today().isoformat(), host=platform.node(), torch=torch.__version__, context=context,
        block_size=args.block_size, quick=args.quick, main_source=main_name, second_source=second_name,
        error_bound=ERROR_BOUND, oracle_eps=DEFAULT_ORACLE_EPS,
        defaults=dict(tau=ARTConfig().tau, phi=ARTConfig().phi, patience=ARTConfig().patience),
        studies=studies.tables(), second_check=second, synthetic=synthetic,
        retention=retention.to_dict("records"), flexprefill=json.loads(flexprefill_json.read_text()),
        benchmarks=_benchmark_summaries(args.benchmarks), figures={k: str(p) for k, p in figures.items()})
    write_json_atomic(out / "reproduce.json", results)
    write_text_atomic(out / "REPORT.md", render_report(results))
    print_studies(studies)
    if not retention.empty:
        from ..analysis.retention import GENERATION_COLUMNS, GENERATION_FORMATS
        from ..table import format_table

        print(f"\nretrieval ({context} tokens) with each rule inside decoding")
        print(format_table(retention, GENERATION_COLUMNS, GENERATION_FORMATS))
    for row in second:
        print(f"check on {second_name}: {row['rule']}: loaded {row['loaded_fraction']:.3f}, "
              f"p99 error {row['rel_error_p99']:.2e} ({'within' if row['rel_error_p99'] <= ERROR_BOUND else 'OVER'} "
              f"the bound {ERROR_BOUND})")
    print(f"wrote {out / 'REPORT.md'}, {out / 'reproduce.json'} and {len(figures)} figures (PNG + PDF) in {out}")
    return 0


def _retention(loaded, block_size: int, context: int, quick: bool) -> pd.DataFrame:
    """Passkey and needle-in-a-haystack retrieval with each rule inside the model's decode attention,
    walking sink-then-newest and by Quest's key bound."""
    from ..analysis.retention import compare_generation
    from ..corpus import PROMPT_BUILDERS
    from .evaluate import evaluation_rules

    depths = QUICK_RETENTION_DEPTHS if quick else RETENTION_DEPTHS
    prompts = [PROMPT_BUILDERS[task](context, depth=depth, seed=i, tokenizer=loaded.tokenizer)
               for task in ("passkey", "niah") for i, depth in enumerate(depths)]
    return pd.concat([compare_generation(loaded.model, loaded.tokenizer, prompts, evaluation_rules(ARTConfig()),
                                         max_new_tokens=RETENTION_NEW_TOKENS, block_size=block_size, order=order)
                      for order in RETENTION_ORDERS], ignore_index=True)


def _benchmark_summaries(folder: Path) -> dict:
    """The ``summary`` of the newest decode, decode-loop and FlexPrefill GPU results in ``folder``, with their file
    names and the code they were measured with (``source``, ``kernels.results_io.source_revision``; ``None`` in
    results written before it was recorded).  The decode loop's summary holds one entry per loop
    (``"<batch>x<seqlen>"``); its numbers are taken as ``"<batch>x<seqlen> <key>"`` (the per-implementation totals left
    out), so that the report lists them."""
    summaries = {}
    for kind in ("art-decode", "art-decode-loop", "flexprefill"):
        found = latest_result(kind, folder)
        if found is not None:
            payload = read_result(found, what=f"stored {kind} result")
            summaries[kind] = dict(file=found.name, device=payload.get("device"), date=payload.get("date"),
                                   source=payload.get("source"), summary=flat_summary(payload) or None)
    return summaries
