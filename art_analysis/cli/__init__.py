"""The `art-analysis` command.

Each sub-command lives in its own module of this package and exposes
`register(subparsers) -> None`, which adds its parser and sets `func` (a callable taking
the parsed `argparse.Namespace` and returning an exit code).
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("simulate", "figures", "reproduce", "capture", "bench", "bench-compare", "flexprefill", "evaluate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="art-analysis",
        description="Attention Run-time Termination: simulate, analyse, capture, benchmark, reproduce.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name.replace('-', '_')}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError, ImportError) as exc:
        print(f"art-analysis {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
