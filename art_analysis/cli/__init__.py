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
        print(f"art-analysis {args.command}: error: {error_message(exc)}", file=sys.stderr)
        return 2
    except OverflowError as exc:
        print(f"art-analysis {args.command}: error: a number is too large ({exc}); choose smaller sizes",
              file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        if not out_of_memory(exc):
            raise
        print(f"art-analysis {args.command}: error: out of memory ({exc}); choose smaller sizes", file=sys.stderr)
        return 2


def error_message(exc: BaseException) -> str:
    """``exc``'s message without the C++ stack that PyTorch's own errors carry after it."""
    return str(exc).split("\nException raised from ")[0]


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed: a ``MemoryError``, or PyTorch's ``RuntimeError`` of a CPU allocation
    (``DefaultCPUAllocator: can't allocate memory``) or its ``OutOfMemoryError`` of a device's."""
    return isinstance(exc, MemoryError) or "can't allocate memory" in str(exc) or "out of memory" in str(exc)


if __name__ == "__main__":
    sys.exit(main())
