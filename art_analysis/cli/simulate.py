"""`art-analysis simulate`: run the simulator and the stopping rules on one cache, print a table."""
from __future__ import annotations

import argparse
from pathlib import Path

from kernels.results_io import write_json_atomic

from ..analysis.inputs import DecodeInput, decode_inputs
from ..blockwise import MODES
from ..orders import ORDERS
from ..rules_summary import SUMMARY_COLUMNS, SUMMARY_FORMATS, standard_rules, summarize
from ..synthetic import PRESETS, synthetic_cache
from ..table import format_table
from .art_options import add_art_options, art_config_from_args
from .head_counts import parse_head_counts
from .output_paths import check_output_file
from .synthetic_options import add_synthetic_options, refuse_beside_capture, synthetic_values


# the synthetic cache's options and their defaults (``None`` on the parser, so that one given beside --capture shows)
SYNTHETIC_DEFAULTS = {"synthetic": "realistic", "batch": 1, "heads": "32/8", "seqlen": 8192, "head_dim": 128,
                      "seed": 0}
SYNTHETIC_HELP = {"synthetic": "preset", "batch": "sequences", "heads": "query/KV heads", "seqlen": "tokens",
                  "head_dim": "head dim", "seed": "random seed"}
SYNTHETIC_KINDS = {"synthetic": dict(choices=sorted(PRESETS)), "batch": dict(type=int), "seqlen": dict(type=int),
                   "head_dim": dict(type=int), "seed": dict(type=int)}


def register(subparsers) -> None:
    parser = subparsers.add_parser("simulate", help="simulate block-wise decode attention and the stopping rules",
                                   description=__doc__)
    source = parser.add_argument_group("input (a captured cache, or a synthetic one)")
    source.add_argument("--capture", type=Path, help="a capture folder written by `art-analysis capture`")
    source.add_argument("--layer", type=int, default=None, help="layer of the capture (default: all layers)")
    source.add_argument("--step", type=int, default=None,
                        help="decode step of the capture; negative counts from the end (default: the last)")
    add_synthetic_options(source, SYNTHETIC_DEFAULTS, SYNTHETIC_HELP, SYNTHETIC_KINDS, "cache")
    walk = parser.add_argument_group("walk")
    walk.add_argument("--block-size", type=int, default=64)
    walk.add_argument("--order", choices=ORDERS[:3], default="sink_recency")
    walk.add_argument("--mode", choices=MODES, default="exact")
    walk.add_argument("--policy", default=None,
                      help="a KV-selection policy applied before ART, e.g. 'snapkv:budget=0.2'")
    add_art_options(parser)
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_output_file(args.json, "--json")
    art = art_config_from_args(args)
    inputs = _inputs(args)
    traces = []
    policy = None
    if args.policy:
        from ..policies import parse_spec

        policy = parse_spec(args.policy)
    for call in inputs:
        if policy is None:
            traces.append(call.trace(order=args.order, block_size=args.block_size, mode=args.mode))
        else:
            from ..policies.compose import simulate_policy

            # The walk the paged kernel makes over the kept blocks (see policies.compose).
            traces.append(simulate_policy(policy, call.q, call.k, call.v, queries=call.queries, layer=call.layer,
                                          num_layers=call.num_layers, block_size=args.block_size, order=args.order,
                                          cache_seqlens=call.cache_seqlens, sm_scale=call.sm_scale,
                                          mode=args.mode).trace)
    rows = summarize(traces, standard_rules(art))
    if policy is not None:
        print(f"after {args.policy}: loaded_fraction and the errors are of the walk over the blocks the policy "
              f"kept, against attention over those blocks")
    print(format_table(rows, SUMMARY_COLUMNS, SUMMARY_FORMATS))
    if args.json:
        write_json_atomic(args.json, rows)
    return 0


def _inputs(args) -> list[DecodeInput]:
    """The decode calls to simulate: every layer (or ``--layer``) of the capture at ``--step``, at the model's
    softmax scale, or the synthetic cache as one layer (layer-wise budgets reduce to the uniform one).  An option of
    the other source is refused rather than ignored."""
    if args.capture is not None:
        from ..capture import KVCapture

        refuse_beside_capture(args, SYNTHETIC_DEFAULTS, "cache", "simulates the captured one")
        capture = KVCapture.load(args.capture)
        if args.layer is not None:
            capture = capture.select(layers=[args.layer])
        return decode_inputs(capture, -1 if args.step is None else args.step)
    given = [option for option, value in (("--layer", args.layer), ("--step", args.step)) if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} {'chooses' if len(given) == 1 else 'choose'} within a capture; pass "
                         f"--capture DIR")
    synthetic = synthetic_values(args, SYNTHETIC_DEFAULTS)
    q_heads, kv_heads = parse_head_counts(synthetic["heads"])
    return decode_inputs(synthetic_cache(synthetic["batch"], q_heads, kv_heads, synthetic["seqlen"],
                                         synthetic["head_dim"], preset=synthetic["synthetic"], seed=synthetic["seed"]))
