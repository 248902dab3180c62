"""A command's options that describe a synthetic input, beside ``--capture``.

They default to ``None`` on the parser, so that one given beside a capture is refused instead of ignored, and the
documented default fills in only where the synthetic input is built."""
from __future__ import annotations

import argparse


def add_synthetic_options(group, defaults: dict, helps: dict, kinds: dict, what: str) -> None:
    """Add ``--<name>`` for each of ``defaults`` (``name -> default``) to ``group``; ``helps[name]`` says what the
    option sets of the synthetic ``what`` and ``kinds[name]`` holds its ``add_argument`` keywords (``type``,
    ``choices``)."""
    for name, default in defaults.items():
        group.add_argument(f"--{name.replace('_', '-')}", default=None, **kinds.get(name, {}),
                           help=f"{helps[name]} of the synthetic {what} (default: {default})")


def refuse_beside_capture(args: argparse.Namespace, defaults: dict, what: str, instead: str) -> None:
    """Raise ``ValueError`` naming the options of ``defaults`` given in ``args`` (they describe the synthetic
    ``what``, and ``--capture`` ``instead``)."""
    given = [f"--{name.replace('_', '-')}" for name in defaults if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} {'describes' if len(given) == 1 else 'describe'} a synthetic {what}; "
                         f"--capture {instead}")


def synthetic_values(args: argparse.Namespace, defaults: dict) -> dict:
    """``name -> value`` for each of ``defaults``: the value given in ``args``, else the default."""
    return {name: default if getattr(args, name) is None else getattr(args, name) for name, default in defaults.items()}
