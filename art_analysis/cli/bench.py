"""`art-analysis bench`: GPU speed benchmarks (decode: the ART kernel vs dense peers; decode-loop: ART over a captured
layer's decode steps, each told the previous step's walks, and with on-demand followers; told-wave: calls told
their walks with and without the wave, and the region of the wave rule's constants that picks the faster;
FlexPrefill)."""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
from pathlib import Path

from .art_options import add_art_options, art_config_from_args
from .output_paths import check_output_file, check_output_folder

SUITES = ("decode", "decode-loop", "told-wave", "flexprefill", "all")


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="GPU speed benchmarks (decode kernel, FlexPrefill)",
                                   description=__doc__)
    parser.add_argument("--suite", choices=SUITES, default="decode",
                        help="decode (default), decode-loop (needs --capture), told-wave, flexprefill, or all "
                             "(decode-loop only with --capture)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON results")
    parser.add_argument("--figure", type=Path, default=Path("figures/kernel_speed.png"),
                        help="decode speed figure")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--resume", action="store_true",
                        help="decode: continue the newest result in --out where it is an incomplete run of the same "
                             "settings (device, software, code, thresholds, capture), timing only the shapes it lacks")
    parser.add_argument("--capture", type=Path, default=None,
                        help="decode: a captured layer to benchmark tiled to length: a layer_NNN.safetensors file "
                             "(k, v, decode_q) of a capture folder, e.g. of `art-analysis capture --dtype float16`")
    add_art_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("art-analysis bench: error: the benchmarks time Triton kernels on a CUDA GPU and none is "
              "available here; run it on a GPU machine (e.g. bash scripts/gpu_decode.sh)", file=sys.stderr)
        return 2
    check_output_folder(args.out, "--out")
    check_output_file(args.figure, "--figure")
    if args.capture is not None:
        from kernels.bench import decode_query_shape

        decode_query_shape(args.capture)
    if args.suite == "decode-loop" and args.capture is None:
        raise ValueError("--suite decode-loop replays a captured layer's decode steps: pass --capture "
                         "(a capture folder's layer_NNN.safetensors)")
    config = art_config_from_args(args)
    summaries = {}
    if args.suite in ("decode", "all"):
        from kernels.bench import run as run_decode

        from ..plots.kernel_speed import plot_kernel_speed
        from ..synthetic import synthetic_cache
        from ..termination import replay_kernel_walks

        payload = run_decode(args.out, args.quick, art=config.kernel_params(), make_cache=synthetic_cache,
                             capture=args.capture, replay=functools.partial(replay_kernel_walks, rule=config),
                             resume=args.resume)
        plot_kernel_speed(payload, args.figure)
        summaries["decode"] = payload["summary"]
    if args.suite == "decode-loop" or (args.suite == "all" and args.capture is not None):
        from kernels.bench_decode_loop import run as run_decode_loop

        summaries["decode-loop"] = run_decode_loop(args.out, args.capture, art=config.kernel_params(),
                                                   quick=args.quick)["summary"]
    if args.suite in ("told-wave", "all"):
        from kernels.bench_told_wave import run as run_told_wave

        from ..synthetic import synthetic_cache

        summaries["told-wave"] = run_told_wave(args.out, art=config.kernel_params(), make_cache=synthetic_cache,
                                               capture=args.capture, quick=args.quick)["summary"]
    if args.suite in ("flexprefill", "all"):
        if importlib.util.find_spec("kernels.bench_flexprefill") is None:
            raise ImportError("the flexprefill suite needs kernels/bench_flexprefill.py")
        from kernels.bench_flexprefill import run as run_flexprefill

        summaries["flexprefill"] = run_flexprefill(args.out, args.quick)["summary"]
    _print_summaries(summaries)
    return 0


def _print_summaries(summaries: dict) -> None:
    """Each suite's summary: the decode loop's and the told wave's as JSON, then the decode and FlexPrefill targets
    as short tables, last (the JSON results hold every number)."""
    from ..table import format_table

    for suite in ("decode-loop", "told-wave"):
        if suite in summaries:
            print(f"{suite}: {json.dumps(summaries[suite], indent=1)}")
    for suite, module in (("decode", "kernels.bench"), ("flexprefill", "kernels.bench_flexprefill")):
        if suite in summaries:
            target_rows = importlib.import_module(module).target_rows
            rows = [{**row, "met": {True: "yes", False: "no", None: "-"}[row["met"]]}
                    for row in target_rows(summaries[suite])]
            print(f"{suite} targets:")
            print(format_table(rows, ("target", "measured", "met")))
