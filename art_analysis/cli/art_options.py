"""Command-line options that build an :class:`~art_analysis.termination.ARTConfig`."""
from __future__ import annotations

import argparse

from ..termination import GROUPS, PROBE_DIM_NAMES, PROBE_SOURCES, SCALES, ARTConfig


def add_art_options(parser: argparse.ArgumentParser) -> None:
    defaults = ARTConfig()
    group = parser.add_argument_group("ART (defaults: the project's ARTConfig())")
    group.add_argument("--paper", action="store_true", help="use ARTConfig.paper() instead of the defaults")
    group.add_argument("--tau", type=float, default=defaults.tau)
    group.add_argument("--phi", type=float, default=defaults.phi)
    group.add_argument("--patience", type=int, default=defaults.patience)
    group.add_argument("--min-steps", type=int, default=defaults.min_steps)
    group.add_argument("--probe-source", choices=PROBE_SOURCES, default=defaults.probe_source)
    group.add_argument("--probe-dims", choices=PROBE_DIM_NAMES, default=defaults.probe_dims)
    group.add_argument("--scale", choices=SCALES, default=defaults.scale)
    group.add_argument("--group", choices=GROUPS, default=defaults.group)


def art_config_from_args(args: argparse.Namespace) -> ARTConfig:
    if args.paper:
        return ARTConfig.paper(group=args.group)
    return ARTConfig(tau=args.tau, phi=args.phi, patience=args.patience, min_steps=args.min_steps,
                     probe_source=args.probe_source, probe_dims=args.probe_dims, scale=args.scale,
                     group=args.group)
