"""`art-analysis capture`: record a real model's KV cache and queries to a folder.

Example::

    art-analysis capture --model smollm2 --context 8192 --decode-steps 8 --source stdlib \\
        --out captures/stdlib-8k --prefill-layers 0,15,29
    # eight distinct texts (seeds 1..8), one batch row each
    art-analysis capture --context 8192 --source stdlib --seed 1 --batch 8 --out captures/stdlib-b8-8k
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..corpus import LONG_TEXT_SOURCES, PROMPT_BUILDERS
from .output_paths import check_output_folder

SOURCES = LONG_TEXT_SOURCES + tuple(PROMPT_BUILDERS)
STORE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _layer_list(value: str) -> list[int]:
    try:
        layers = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices like 0,15,29, got {value!r}")
    if not layers:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices like 0,15,29, got {value!r} (leave "
                                         f"the option out to record no prefill queries)")
    if any(layer < 0 for layer in layers):
        raise argparse.ArgumentTypeError(f"layer indices must be >= 0, got {value!r}")
    return layers


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "capture",
        help="capture post-RoPE K, V and queries from a real model",
        description="Prefill a context from an offline corpus, decode greedily, and save per-layer post-RoPE "
                    "K, V [B,Hkv,S,D], decode queries [B,Hq,steps,D] and optional prefill queries as safetensors.",
    )
    parser.add_argument("--model", default="smollm2",
                        help="model name (smollm2) or a local HF model folder or .gguf file (default: smollm2)")
    parser.add_argument("--context", type=int, default=8192, help="prefill length in tokens (default: 8192)")
    parser.add_argument("--decode-steps", type=int, default=8, help="greedy decode steps to record (default: 8)")
    parser.add_argument("--source", choices=SOURCES, default="stdlib",
                        help="text: long offline text (stdlib, docs) or a retrieval prompt (passkey, niah)")
    parser.add_argument("--seed", type=int, default=0, help="selects the text / the hidden answer (default: 0)")
    parser.add_argument("--batch", type=int, default=1,
                        help="batch rows, each its own text or prompt: seeds SEED .. SEED+BATCH-1 (default: 1)")
    parser.add_argument("--depth", type=float, default=0.5,
                        help="passkey/niah: where the needle sits in the haystack, 0..1 (default: 0.5)")
    parser.add_argument("--prefill-layers", type=_layer_list, default=[],
                        help="comma-separated layers whose full prefill queries are also recorded, e.g. 0,15,29")
    parser.add_argument("--dtype", choices=sorted(STORE_DTYPES), default="float32",
                        help="dtype the tensors are stored in (the model runs in float32; default: float32)")
    parser.add_argument("--out", required=True, type=Path, help="output folder, e.g. captures/NAME")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing capture folder")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..capture import capture_kv, check_capture_destination
    from ..corpus import long_text
    from ..models import check_model_positions, load_model

    check_capture_destination(args.out, args.overwrite)
    check_output_folder(args.out.resolve().parent, f"--out {str(args.out)!r}: its parent")
    if args.decode_steps < 1:
        raise ValueError(f"--decode-steps must be >= 1, got {args.decode_steps}")
    if args.context < 1:
        raise ValueError(f"--context must be >= 1, got {args.context}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if not 0 <= args.depth <= 1:
        raise ValueError(f"--depth must lie in [0, 1], got {args.depth}")
    check_model_positions(args.model, args.context, f"--context {args.context}")
    loaded = load_model(args.model)
    seeds = list(range(args.seed, args.seed + args.batch))
    source = {"name": args.source, "seed": args.seed} if args.batch == 1 else {"name": args.source, "seeds": seeds}
    if args.source in PROMPT_BUILDERS:
        prompts = [PROMPT_BUILDERS[args.source](args.context, depth=args.depth, seed=seed, tokenizer=loaded.tokenizer)
                   for seed in seeds]
        inputs = {"prompt": prompts[0] if args.batch == 1 else prompts}
    else:
        texts = [long_text(args.source, seed=seed, length=args.context, tokenizer=loaded.tokenizer) for seed in seeds]
        inputs = {"text": texts[0] if args.batch == 1 else texts}
    start = time.perf_counter()
    capture = capture_kv(loaded, context_tokens=args.context, decode_steps=args.decode_steps,
                         prefill_layers=args.prefill_layers, source=source, progress=not args.no_progress, **inputs)
    elapsed = time.perf_counter() - start
    out = capture.to(dtype=STORE_DTYPES[args.dtype]).save(args.out, overwrite=args.overwrite)
    print(f"{capture} captured in {elapsed:.1f} s -> {out}")
    if args.source in PROMPT_BUILDERS:
        for row, prompt in enumerate(prompts):
            generated = loaded.tokenizer.decode(capture.generated_ids[row])
            print(f"answer {prompt.answer!r} at depth {prompt.achieved_depth:.3f}; model continued with {generated!r}")
    return 0
