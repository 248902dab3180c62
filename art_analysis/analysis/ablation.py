"""ART's ablations: what each test and the patience buy, and what the cheap probes cost.

Each variant changes one field of a base :class:`~art_analysis.termination.ARTConfig`
(DESIGN §5): no scale test, no direction test, no patience (``patience=1``), the ``mma``
probe (the ``D/4`` dims one thread holds) instead of the full vector, and the accumulator
probe instead of the normalised output.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import pandas as pd

from ..blockwise import BlockTrace
from ..rules_summary import SUMMARY_FORMATS, summarize
from ..termination import ARTConfig
from .sensitivity import DEFAULT_ORACLE_EPS


def ablation_variants(base: ARTConfig | None = None) -> dict[str, ARTConfig]:
    """Variant name -> rule: ``full`` (``base``), ``no_scale``, ``no_direction``, ``no_patience``,
    ``mma_probe``, ``accumulator_probe``."""
    base = base or ARTConfig()
    if not isinstance(base, ARTConfig):
        raise TypeError(f"base must be an ARTConfig (the rule the variants change), got {type(base).__name__}")
    return {
        "full": base,
        "no_scale": replace(base, use_scale=False, use_direction=True),
        "no_direction": replace(base, use_direction=False, use_scale=True),
        "no_patience": replace(base, patience=1),
        "mma_probe": replace(base, probe_dims="mma"),
        "accumulator_probe": replace(base, probe_source="accumulator"),
    }


def ablation_table(traces: Sequence[BlockTrace], base: ARTConfig | None = None,
                   oracle_eps: float = DEFAULT_ORACLE_EPS) -> pd.DataFrame:
    """One row per variant of :func:`ablation_variants`: ``variant`` plus the summary columns of
    :func:`~art_analysis.rules_summary.summarize` (with ``false_stop_rate`` against ``Oracle(oracle_eps)``)
    and ``loaded_vs_full`` (its loaded fraction over the full rule's)."""
    variants = ablation_variants(base)
    rows = summarize(traces, list(variants.values()), oracle_eps=oracle_eps)
    table = pd.DataFrame([dict(variant=name, **row) for name, row in zip(variants, rows)])
    table["loaded_vs_full"] = table["loaded_fraction"] / table["loaded_fraction"].iloc[0]
    return table


ABLATION_COLUMNS = ("variant", "loaded_fraction", "loaded_vs_full", "rel_error_mean", "rel_error_p99",
                    "false_stop_rate")
ABLATION_FORMATS = {**SUMMARY_FORMATS, "loaded_vs_full": ".3f", "false_stop_rate": ".3f"}
