"""Summaries of stopping rules over one or more traces (one row per rule)."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from .blockwise import BlockTrace
from .termination import ARTConfig, FixedBudget, MassCoverage, Oracle, Rule, sweep


def standard_rules(art: ARTConfig | None = None) -> list[Rule]:
    """ART (project defaults and paper preset), its ablations, and the baselines."""
    art = art or ARTConfig()
    return [
        art,
        replace(art, use_scale=False),
        replace(art, use_direction=False),
        replace(art, patience=1),
        ARTConfig.paper(),
        Oracle(0.01),
        MassCoverage(0.9),
        MassCoverage(0.99),
        FixedBudget(8),
    ]


def check_traces(traces) -> list[BlockTrace]:
    """``traces`` as a list: a non-empty sequence of :class:`~art_analysis.blockwise.BlockTrace` (e.g. one per
    layer), or one trace; else ``TypeError`` / ``ValueError`` saying what was given."""
    if isinstance(traces, BlockTrace):
        return [traces]
    if isinstance(traces, (str, bytes)) or not isinstance(traces, Sequence):
        raise TypeError(f"traces must be a BlockTrace or a sequence of them, got {type(traces).__name__}")
    if not traces:
        raise ValueError("traces must hold at least one BlockTrace")
    bad = [type(t).__name__ for t in traces if not isinstance(t, BlockTrace)]
    if bad:
        raise TypeError(f"traces must hold BlockTraces (blockwise_attention's), got {', '.join(sorted(set(bad)))}")
    return list(traces)


def summarize(traces: Sequence[BlockTrace], rules: Sequence[Rule], oracle_eps: float | None = None) -> list[dict]:
    """Mean loaded fraction and relative error of every rule, pooled over all heads of all traces (a sequence of
    :class:`~art_analysis.blockwise.BlockTrace`, or one).

    Returns one dict per rule with ``rule, loaded_fraction, rel_error_mean, rel_error_p99,
    rel_error_max, cos_error_mean``; with ``oracle_eps`` also ``false_stop_rate``: the share of
    query heads the rule stops before ``Oracle(oracle_eps)`` would (the error after its stop is not
    yet settled within ``oracle_eps``).
    """
    traces = check_traces(traces)
    rules = list(rules)
    checked = rules + ([Oracle(oracle_eps)] if oracle_eps is not None else [])
    results = [sweep(trace, checked) for trace in traces]
    rows = []
    for i, rule in enumerate(rules):
        loaded = torch.cat([r.loaded_fraction[i].flatten() for r in results]).double()
        error = torch.cat([r.rel_error[i].flatten() for r in results]).double()
        cos = torch.cat([r.cos_error[i].flatten() for r in results]).double()
        row = dict(rule=rule.name, loaded_fraction=float(loaded.mean()),
                   rel_error_mean=float(error.mean()), rel_error_p99=float(torch.quantile(error, 0.99)),
                   rel_error_max=float(error.max()), cos_error_mean=float(cos.mean()))
        if oracle_eps is not None:
            early = torch.cat([(r.stop_step[i] < r.stop_step[-1]).flatten() for r in results])
            row["false_stop_rate"] = float(early.double().mean())
        rows.append(row)
    return rows


SUMMARY_COLUMNS = ("rule", "loaded_fraction", "rel_error_mean", "rel_error_p99", "rel_error_max")
SUMMARY_FORMATS = {"loaded_fraction": ".3f", "rel_error_mean": ".2e", "rel_error_p99": ".2e",
                   "rel_error_max": ".2e", "false_stop_rate": ".3f"}
# The columns of a summary made with ``oracle_eps``.
RULE_COLUMNS = SUMMARY_COLUMNS + ("false_stop_rate",)
