"""`art-analysis flexprefill`: FlexPrefill's patterns, kept tiles and error against gamma; figures.

On a capture with recorded prefill queries (``art-analysis capture --prefill-layers ...``) every
recorded layer is analysed; otherwise a synthetic prefill with sink, local, heavy-hitter and
topic-block heads.  The latency figure is drawn from a GPU benchmark JSON
(``kernels.bench_flexprefill``), the newest in ``benchmarks/results`` unless ``--bench-json``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from kernels.results_io import latest_result, write_json_atomic

from ..flexprefill import QUERY_AWARE, gamma_sweep
from ..table import format_table
from .figures import read_benchmark_result
from .head_counts import parse_head_counts
from .output_paths import check_output_file, check_output_folder
from .synthetic_options import add_synthetic_options, refuse_beside_capture, synthetic_values

# the synthetic prefill's options and their defaults (``None`` on the parser, so that one given beside --capture shows)
SYNTHETIC_DEFAULTS = {"heads": "8/4", "seqlen": 4096, "head_dim": 64, "seed": 0}
SYNTHETIC_HELP = {"heads": "query/KV heads", "seqlen": "tokens", "head_dim": "head dim", "seed": "random seed"}
SYNTHETIC_KINDS = {"seqlen": dict(type=int), "head_dim": dict(type=int), "seed": dict(type=int)}
COLUMNS = ("input", "gamma", "kept_fraction", "rel_error", "query_aware_heads")
FORMATS = {"gamma": ".3f", "kept_fraction": ".3f", "rel_error": ".4f", "query_aware_heads": ".2f"}


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def register(subparsers) -> None:
    parser = subparsers.add_parser("flexprefill", help="FlexPrefill block selection: patterns, kept tiles, error",
                                   description=__doc__)
    source = parser.add_argument_group("input (a capture with prefill queries, or a synthetic prefill)")
    source.add_argument("--capture", type=Path, help="a capture folder holding prefill queries")
    source.add_argument("--layers", type=_int_list, default=None, help="capture layers (default: all recorded)")
    add_synthetic_options(source, SYNTHETIC_DEFAULTS, SYNTHETIC_HELP, SYNTHETIC_KINDS, "prefill")
    method = parser.add_argument_group("FlexPrefill")
    method.add_argument("--gammas", type=_float_list, default=[0.8, 0.85, 0.9, 0.95, 0.99])
    method.add_argument("--tau", type=float, default=0.1)
    method.add_argument("--block-size", type=int, default=64)
    method.add_argument("--min-budget", type=int, default=256, help="tokens")
    method.add_argument("--max-budget", type=int, default=None, help="tokens")
    method.add_argument("--budget-divisor", type=int, default=None,
                        help="tokens per block in the budget conversion (upstream: 128); default block size")
    method.add_argument("--union-vs-for-query-aware", action="store_true",
                        help="upstream quirk: union query-aware sets with the vertical-slash set")
    method.add_argument("--no-js-eps", action="store_true", help="upstream quirk: no epsilon in the JS logs")
    parser.add_argument("--bench-json", type=Path, default=None, help="GPU benchmark JSON for the latency figure")
    parser.add_argument("--out", type=Path, default=Path("figures"), help="folder for the figures")
    parser.add_argument("--json", type=Path, help="also write the table rows as JSON here")
    parser.add_argument("--export-prefill", type=Path, default=None,
                        help="also write the inputs' q, k, v as bf16 safetensors (keys q<L>, k<L>, v<L>) for "
                             "`python -m kernels.bench_flexprefill --capture FILE --capture-layer L`")
    parser.set_defaults(func=run)


def _export(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file({name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}, str(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _inputs(args):
    """Yield ``(label, layer, q [B,Hq,N,D], k, v [B,Hkv,N,D], sm_scale)``: a capture's layers at the model's softmax
    scale, or a synthetic prefill at ``D ** -0.5`` (``None``)."""
    if args.capture is not None:
        from ..capture import KVCapture

        refuse_beside_capture(args, SYNTHETIC_DEFAULTS, "prefill", "analyses the captured prefill queries")
        capture = KVCapture.load(args.capture)
        recorded = capture.prefill_layers
        if not recorded:
            raise ValueError(f"{args.capture} holds no prefill queries; capture with --prefill-layers")
        layers = recorded if args.layers is None else args.layers
        missing = sorted(set(layers) - set(recorded))
        if missing:
            raise ValueError(f"layers {missing} have no prefill queries; recorded: {list(recorded)}")
        for layer in layers:
            q = capture.prefill_queries(layer).float()
            _, k, v = capture.layer(layer)
            n = q.shape[2]
            yield f"layer {layer}", layer, q, k[:, :, :n].float(), v[:, :, :n].float(), capture.sm_scale
        return
    from kernels.bench_flexprefill import structured_prefill

    if args.layers is not None:
        raise ValueError("--layers chooses among a capture's prefill layers; pass --capture DIR")
    synthetic = synthetic_values(args, SYNTHETIC_DEFAULTS)
    q_heads, kv_heads = parse_head_counts(synthetic["heads"])
    q, k, v = structured_prefill(1, q_heads, kv_heads, synthetic["seqlen"], synthetic["head_dim"],
                                 seed=synthetic["seed"], dtype=torch.float32, device="cpu")
    yield "synthetic", 0, q, k, v, None


def run(args: argparse.Namespace) -> int:
    from ..plots.flexprefill import (plot_error_vs_gamma, plot_kept_vs_gamma,
                                     plot_latency_vs_gamma, plot_patterns)

    check_output_folder(args.out, "--out")
    check_output_file(args.json, "--json")
    check_output_file(args.export_prefill, "--export-prefill")
    bench = args.bench_json or latest_result("flexprefill")
    bench_rows = None if bench is None else read_benchmark_result(bench, "flexprefill")["rows"]
    quirks = {"budget_divisor": args.budget_divisor, "union_vs_for_query_aware": args.union_vs_for_query_aware}
    if args.no_js_eps:
        quirks["js_eps"] = None
    rows, labels, js, aware, kept_curves, error_curves, exported = [], [], [], [], {}, {}, {}
    for label, layer, q, k, v, sm_scale in _inputs(args):
        if args.export_prefill:
            exported.update({f"q{layer}": q, f"k{layer}": k, f"v{layer}": v})
        sweep = gamma_sweep(q, k, v, args.gammas, tau=args.tau, block_size=args.block_size,
                            min_budget=args.min_budget, max_budget=args.max_budget, sm_scale=sm_scale, **quirks)
        query_aware = sweep.pattern == QUERY_AWARE
        labels.append(label)
        js.append(sweep.js_distance.mean(dim=0))
        aware.append(query_aware.float().mean(dim=0) >= 0.5)
        kept_curves[label] = (sweep.gammas, sweep.kept_fraction.mean(dim=(1, 2)))
        error_curves[label] = (sweep.gammas, sweep.rel_error.mean(dim=(1, 2)))
        for g, gamma in enumerate(sweep.gammas.tolist()):
            rows.append({"input": label, "gamma": gamma, "kept_fraction": float(sweep.kept_fraction[g].mean()),
                         "rel_error": float(sweep.rel_error[g].mean()),
                         "query_aware_heads": float(query_aware.float().mean())})
    print(format_table(rows, COLUMNS, FORMATS))
    out = args.out
    print(plot_patterns(torch.stack(js), torch.stack(aware), labels, args.tau, out / "flexprefill_patterns.png"))
    print(plot_kept_vs_gamma(kept_curves, out / "flexprefill_kept_vs_gamma.png"))
    print(plot_error_vs_gamma(error_curves, out / "flexprefill_error_vs_gamma.png"))
    if bench_rows is not None:
        print(plot_latency_vs_gamma(bench_rows, out / "flexprefill_latency_vs_gamma.png"))
    if args.export_prefill:
        _export(args.export_prefill, exported)
        print(args.export_prefill)
    if args.json:
        write_json_atomic(args.json, rows)
    return 0
