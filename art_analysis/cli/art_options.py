"""Command-line options that build an :class:`~art_analysis.termination.ARTConfig`.

Only the options given on the command line override the preset (``ARTConfig()``, or
``ARTConfig.paper()`` with ``--paper``).
"""
from __future__ import annotations

import argparse

from ..termination import GROUPS, PROBE_DIM_NAMES, PROBE_SOURCES, SCALES, ARTConfig

OPTIONS = {"tau": float, "phi": float, "patience": int, "min_steps": int}
CHOICES = {"probe_source": PROBE_SOURCES, "probe_dims": PROBE_DIM_NAMES, "scale": SCALES, "group": GROUPS}


def add_art_options(parser: argparse.ArgumentParser) -> None:
    defaults = ARTConfig()
    group = parser.add_argument_group("ART (each option overrides the preset: ARTConfig(), or the paper's)")
    group.add_argument("--paper", action="store_true", help="start from ARTConfig.paper() instead of ARTConfig()")
    for name, kind in OPTIONS.items():
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None,
                           help=f"default {getattr(defaults, name)}")
    for name, choices in CHOICES.items():
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, choices=choices, default=None,
                           help=f"default {getattr(defaults, name)}")


def art_config_from_args(args: argparse.Namespace) -> ARTConfig:
    given = {name: getattr(args, name) for name in (*OPTIONS, *CHOICES) if getattr(args, name) is not None}
    return ARTConfig.paper(**given) if args.paper else ARTConfig(**given)
