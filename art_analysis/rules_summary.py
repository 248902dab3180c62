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


def summarize(traces: Sequence[BlockTrace], rules: Sequence[Rule], oracle_eps: float | None = None) -> list[dict]:
    """Mean loaded fraction and relative error of every rule, pooled over all heads of all traces.

    Returns one dict per rule with ``rule, loaded_fraction, rel_error_mean, rel_error_p99,
    rel_error_max, cos_error_mean``; with ``oracle_eps`` also ``false_stop_rate``: the share of
    query heads the rule stops before ``Oracle(oracle_eps)`` would (the error after its stop is not
    yet settled within ``oracle_eps``).
    """
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
