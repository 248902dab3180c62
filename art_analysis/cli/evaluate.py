"""`art-analysis evaluate`: retrieval accuracy and token agreement with stopping rules in the decode loop.

Builds passkey or needle-in-a-haystack prompts of ``--context`` tokens with the needle at each
``--depths`` position, generates ``--max-new-tokens`` greedily with every rule replacing the
model's decode attention (the simulator's truncated output), and compares with dense decoding.
With ``--backend kernel`` the ART rules decode through the Triton kernel instead (rows marked
``(kernel)``; ``--backend kernel_single_walk``: every call in one split, rows marked ``(kernel, single walks)``):
on a CUDA device, where the model is moved, or on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment; slow: a 2048-token prompt, 4 new tokens, took 2.7 minutes
on 2 CPU cores).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from kernels.results_io import write_json_atomic

from ..analysis.retention import BACKENDS, KERNEL_BACKENDS, check_backend, runs_on_kernel
from ..table import format_table
from ..termination import ARTConfig, MassCoverage
from .art_options import add_art_options, art_config_from_args
from .output_paths import check_output_file


def _depths(text: str) -> list[float]:
    try:
        depths = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated depths in [0, 1], got {text!r}") from None
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise argparse.ArgumentTypeError(f"depths must lie in [0, 1], got {text!r}")
    return depths


def register(subparsers) -> None:
    parser = subparsers.add_parser("evaluate", help="retrieval accuracy with stopping rules inside decoding",
                                   description=__doc__)
    parser.add_argument("--model", default="smollm2", help="embedded model name, HF folder or GGUF file")
    parser.add_argument("--task", choices=("passkey", "niah"), default="passkey")
    parser.add_argument("--context", type=int, default=2048, help="prompt length in tokens")
    parser.add_argument("--depths", type=_depths, default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--seed", type=int, default=0, help="first seed; prompt i uses seed + i")
    parser.add_argument("--max-new-tokens", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--order", choices=("sink_recency", "importance"), default="sink_recency",
                        help="walk order of every decode attention call (importance: Quest's key bound)")
    parser.add_argument("--backend", choices=BACKENDS, default="simulator",
                        help="kernel: the ART rules decode through the Triton kernel (kernels.art_decode) and its "
                             "production plan, which can read more than the simulator (see "
                             "art_analysis.analysis.retention); kernel_single_walk: through the kernel with every "
                             "call one split, which stops where the simulator's rule does")
    add_art_options(parser)
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    parser.set_defaults(func=run)


def evaluation_rules(art: ARTConfig) -> dict:
    """The rules compared by default: ART as configured, the paper's preset, and key-centric coverage."""
    return {"art": art, "art_paper": ARTConfig.paper(), "coverage_0.9": MassCoverage(0.9),
            "coverage_0.99": MassCoverage(0.99)}


def run(args: argparse.Namespace) -> int:
    from ..analysis.retention import GENERATION_COLUMNS, GENERATION_FORMATS, compare_generation
    from ..corpus import niah_prompt, passkey_prompt
    from ..models import check_model_positions, load_model

    if args.context < 64:
        raise ValueError(f"--context must be at least 64 tokens, got {args.context}")
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if args.max_new_tokens < 2:
        raise ValueError(f"--max-new-tokens must be >= 2 (the first token comes from the prefill), "
                         f"got {args.max_new_tokens}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    rules = evaluation_rules(art_config_from_args(args))
    check_output_file(args.json, "--json")
    on_kernel = args.backend in KERNEL_BACKENDS
    try:
        check_backend(args.backend, args.block_size, args.order)
    except ValueError as exc:
        raise ValueError(f"--backend {args.backend} walks 64-token blocks in the sink_recency order; got "
                         f"--block-size {args.block_size} --order {args.order}") from exc
    if on_kernel and not runs_on_kernel(rules["art"]):
        raise ValueError(f"--backend {args.backend} decodes ART rules the kernel implements (--group all); the "
                         f"configured rule would decode through the simulator: leave out --group "
                         f"{rules['art'].group} or use --backend simulator")
    if on_kernel and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"--backend {args.backend} runs the Triton kernel on a CUDA device, or on the CPU in "
                         "Triton's interpreter: set TRITON_INTERPRET=1 in the environment to run it here")
    check_model_positions(args.model, args.context + args.max_new_tokens - 1,
                          f"--context {args.context} with --max-new-tokens {args.max_new_tokens}")
    loaded = load_model(args.model)
    if on_kernel and torch.cuda.is_available():
        loaded.model.to("cuda")
    build = passkey_prompt if args.task == "passkey" else niah_prompt
    prompts = [build(args.context, depth=depth, seed=args.seed + i, tokenizer=loaded.tokenizer)
               for i, depth in enumerate(args.depths)]
    rows = compare_generation(loaded.model, loaded.tokenizer, prompts, rules, max_new_tokens=args.max_new_tokens,
                              block_size=args.block_size, order=args.order, backend=args.backend)
    print(format_table(rows, GENERATION_COLUMNS, GENERATION_FORMATS))
    if args.json:
        write_json_atomic(args.json, rows.to_dict("records"))
    return 0
