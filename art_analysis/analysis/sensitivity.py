"""Threshold sensitivity of ART and its trade-off against the baseline stopping rules.

* :func:`threshold_grid`: loaded fraction, error and false-stop rate over a ``(tau, phi, patience)``
  grid (the heatmaps and the patience curves);
* :func:`baseline_sweep`: the same columns for ``Oracle(eps)``, ``MassCoverage(gamma)`` and
  ``FixedBudget(steps)`` over their parameter;
* :func:`pareto_front`: the settings of each family that no other setting of the family beats on
  both loaded fraction and error;
* :func:`pick_default`: the rule that chose ``ARTConfig()``; :func:`choose_setting` the same, with
  the most accurate setting (flagged) when none meets the bound.

All take traces (``analysis.inputs.traces(source)``) so that one walk serves every rule.
"""
from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Sequence

import pandas as pd

from kernels.int_checks import is_finite_real

from ..blockwise import BlockTrace
from ..checks import as_list, check_rows
from ..rules_summary import summarize
from ..termination import ARTConfig, FixedBudget, MassCoverage, Oracle

DEFAULT_ORACLE_EPS = 0.01
# The grid of the sensitivity study, a smaller one for quick runs, and the 99th-percentile error
# bound under which the study picks the project's defaults (``figures/REPORT.md``).
TAUS = (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5)
PHIS = (1e-3, 1e-4, 1e-5, 1e-6)
PATIENCES = (2, 4, 8, 16)
QUICK_GRID = ((1e-2, 1e-3, 1e-4), (1e-4, 1e-6), (4, 16))
ERROR_BOUND = 0.02


def threshold_grid(traces: Sequence[BlockTrace], taus: Sequence[float], phis: Sequence[float],
                   patiences: Sequence[int], base: ARTConfig | None = None,
                   oracle_eps: float = DEFAULT_ORACLE_EPS) -> pd.DataFrame:
    """Evaluate ``base`` with every ``(tau, phi, patience)`` over ``traces``.

    Returns one row per setting: ``tau, phi, patience`` plus the columns of
    :func:`art_analysis.rules_summary.summarize` (``false_stop_rate`` against ``Oracle(oracle_eps)``).
    """
    base = base or ARTConfig()
    if not isinstance(base, ARTConfig):
        raise TypeError(f"base must be an ARTConfig (the rule whose thresholds the grid sets), got "
                        f"{type(base).__name__}")
    grid = list(product(as_list(taus, "taus", "[1e-3, 1e-2]"), as_list(phis, "phis", "[1e-6, 1e-4]"),
                        as_list(patiences, "patiences", "[4, 16]")))
    if not grid:
        raise ValueError("taus, phis and patiences must each hold at least one value")
    rules = [replace(base, tau=t, phi=f, patience=p) for t, f, p in grid]
    rows = summarize(traces, rules, oracle_eps=oracle_eps)
    return pd.DataFrame([dict(tau=t, phi=f, patience=p, **row) for (t, f, p), row in zip(grid, rows)])


def baseline_sweep(traces: Sequence[BlockTrace], *, eps: Sequence[float] = (0.1, 0.03, 0.01, 0.003, 0.001),
                   gammas: Sequence[float] = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999),
                   steps: Sequence[int] = (2, 4, 8, 16, 32, 64),
                   oracle_eps: float = DEFAULT_ORACLE_EPS) -> pd.DataFrame:
    """``Oracle``, ``MassCoverage`` and ``FixedBudget`` over their parameter.

    Returns one row per rule: ``family, parameter`` plus the summary columns.
    """
    rules = ([("Oracle", e, Oracle(e)) for e in as_list(eps, "eps", "[0.01, 0.001]")]
             + [("MassCoverage", g, MassCoverage(g)) for g in as_list(gammas, "gammas", "[0.9, 0.99]")]
             + [("FixedBudget", s, FixedBudget(s)) for s in as_list(steps, "steps", "[8, 16]")])
    rows = summarize(traces, [rule for *_, rule in rules], oracle_eps=oracle_eps)
    return pd.DataFrame([dict(family=family, parameter=value, **row) for (family, value, _), row in zip(rules, rows)])


def pareto_front(rows: pd.DataFrame, *, cost: str = "loaded_fraction", error: str = "rel_error_p99",
                 by: str | None = "family") -> pd.DataFrame:
    """The rows no other row (of the same ``by`` group) beats on both ``cost`` and ``error``,
    sorted by ``cost``."""
    check_rows(rows, (), "threshold_grid or baseline_sweep")
    missing = [column for column in (cost, error, by) if column is not None and column not in rows.columns]
    if missing:
        raise ValueError(f"rows lack the column(s) {missing}: pass by=None for rows of one family (e.g. "
                         "threshold_grid's), or name columns the rows hold")
    groups = [rows] if by is None else [group for _, group in rows.groupby(by, sort=False)]
    kept = []
    for group in groups:
        ordered = group.sort_values([cost, error])
        best = float("inf")
        for index, row in ordered.iterrows():
            if row[error] < best:
                kept.append(index)
                best = row[error]
    return rows.loc[kept].sort_values([by, cost] if by else [cost])


def pick_default(rows: pd.DataFrame, max_p99_error: float) -> dict:
    """The setting with the smallest loaded fraction whose 99th-percentile error is within bound."""
    feasible = rows[rows["rel_error_p99"] <= max_p99_error]
    if feasible.empty:
        raise ValueError(f"no setting keeps the 99th-percentile relative error under {max_p99_error}")
    return _plain(feasible.sort_values(["loaded_fraction", "rel_error_p99"]).iloc[0])


def _plain(row: pd.Series) -> dict:
    """A DataFrame row as a dict of plain Python values (JSON-ready)."""
    return {key: (value.item() if hasattr(value, "item") else value) for key, value in row.items()}


def choose_setting(rows: pd.DataFrame, max_p99_error: float = ERROR_BOUND) -> dict:
    """:func:`pick_default` plus ``within_bound=True``; when no setting meets the bound, the setting
    with the smallest 99th-percentile error, with ``within_bound=False``."""
    check_rows(rows, ("rel_error_p99", "loaded_fraction"), "threshold_grid")
    if not is_finite_real(max_p99_error):
        raise ValueError(f"max_p99_error must be a finite number, got {max_p99_error!r}")
    if rows.empty:
        raise ValueError("no threshold setting to choose from: the grid's table is empty")
    try:
        return dict(pick_default(rows, max_p99_error), within_bound=True)
    except ValueError:
        return dict(_plain(rows.sort_values(["rel_error_p99", "loaded_fraction"]).iloc[0]), within_bound=False)
