"""Threshold sensitivity of ART: loaded fraction and error over a grid of (tau, phi, patience)."""
from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Sequence

from ..blockwise import BlockTrace
from ..rules_summary import summarize
from ..termination import ARTConfig


def threshold_grid(traces: Sequence[BlockTrace], taus: Sequence[float], phis: Sequence[float],
                   patiences: Sequence[int], base: ARTConfig | None = None) -> list[dict]:
    """Evaluate ``base`` with every ``(tau, phi, patience)`` over ``traces``.

    Returns one row per setting: ``tau, phi, patience`` plus the columns of
    :func:`art_analysis.rules_summary.summarize`.
    """
    base = base or ARTConfig()
    grid = list(product(taus, phis, patiences))
    rules = [replace(base, tau=t, phi=f, patience=p) for t, f, p in grid]
    rows = summarize(traces, rules)
    return [dict(tau=t, phi=f, patience=p, **row) for (t, f, p), row in zip(grid, rows)]


def pick_default(rows: Sequence[dict], max_p99_error: float) -> dict:
    """The setting with the smallest loaded fraction whose 99th-percentile error is within bound."""
    feasible = [r for r in rows if r["rel_error_p99"] <= max_p99_error]
    if not feasible:
        raise ValueError(f"no setting keeps the 99th-percentile relative error under {max_p99_error}")
    return min(feasible, key=lambda r: (r["loaded_fraction"], r["rel_error_p99"]))
