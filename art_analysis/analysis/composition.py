"""ART on top of KV-selection policies: what each policy keeps, and what ART still saves.

A policy keeps some blocks; ART then walks only those (DESIGN §6).  For every policy the
analysis reports, pooled over every query head of every input:

* ``kept_fraction``: valid tokens the policy keeps;
* ``art_loaded_of_kept``: fraction of the kept tokens ART loads before it stops;
* ``loaded_fraction``: their product, the share of the full cache actually read;
* ``policy_error``: relative error of the policy's output against dense attention;
* ``art_added_error``: relative error ART adds against the policy's output;
* ``total_error``: relative error of ART-on-policy against dense attention.
"""
from __future__ import annotations

from typing import Sequence

import pandas as pd
import torch
from tqdm import tqdm

from ..policies import SelectionPolicy, parse_spec
from ..policies.compose import WALK_ORDERS, simulate_policy
from ..termination import ARTConfig, art_or_default, stop
from .inputs import decode_inputs

DEFAULT_POLICIES = ("dense", "streaming:budget=0.2", "snapkv:budget=0.2", "pyramidkv:budget=0.2",
                    "h2o:budget=0.2", "quest:budget=0.2", "streaming:budget=0.8", "snapkv:budget=0.8")


def compose_with_art(source, policy_specs: Sequence[str | SelectionPolicy] = DEFAULT_POLICIES,
                     art: ARTConfig | None = None, block_size: int = 64, order: str = "sink_recency",
                     step: int = -1) -> pd.DataFrame:
    """One row per policy (columns: :data:`COMPOSITION_COLUMNS`).

    Args:
        source: a capture, a synthetic cache or decode inputs (:func:`~.inputs.decode_inputs`); the
            inputs' recent ``queries`` feed query-aware policies, and their ``sm_scale`` (a capture's: the
            model's) is the scale of every walk and of the policies' scores (unless a policy sets its own).
        policy_specs: a list of policies: strings for :func:`art_analysis.policies.parse_spec` (the row's
            ``policy``) or :class:`~art_analysis.policies.SelectionPolicy` objects (the row's ``policy`` is
            their ``spec``).
        art: the stopping rule (default ``ARTConfig()``).
        order: the walk over the kept blocks, one of :data:`~art_analysis.policies.compose.WALK_ORDERS`.
    """
    if isinstance(policy_specs, str):
        raise TypeError(f"policy_specs must be a list of policy specs, e.g. [{policy_specs!r}], not one string")
    if not policy_specs:
        raise ValueError("compose_with_art needs at least one policy spec")
    if order not in WALK_ORDERS:
        raise ValueError(f"order must be one of {WALK_ORDERS} (the walks over a policy's kept blocks), got {order!r}")
    art = art_or_default(art)
    policies = [(spec.spec, spec) if isinstance(spec, SelectionPolicy) else (spec, parse_spec(spec))
                for spec in policy_specs]
    pooled = [{key: [] for key in ("kept", "art", "loaded", "policy", "added", "total")} for _ in policies]
    for call in tqdm(decode_inputs(source, step), desc="policies x ART", leave=False):
        dense = call.trace(order=order, block_size=block_size).final_out
        dense_norm = torch.linalg.vector_norm(dense, dim=-1)
        valid_tokens = call.cache_seqlens.double()[:, None]
        for (_, policy), row in zip(policies, pooled):
            walk = simulate_policy(policy, call.q, call.k, call.v, queries=call.queries, layer=call.layer,
                                   num_layers=call.num_layers, block_size=block_size, order=order,
                                   cache_seqlens=call.cache_seqlens, sm_scale=call.sm_scale)
            trace = walk.trace
            result = stop(trace, art)
            kept = trace.block_tokens.sum(-1).double().repeat_interleave(trace.group_size, dim=1) / valid_tokens
            row["kept"].append(kept.flatten())
            row["art"].append(result.loaded_fraction.flatten())
            row["loaded"].append((kept * result.loaded_fraction).flatten())
            row["policy"].append((torch.linalg.vector_norm(trace.final_out - dense, dim=-1) / dense_norm).flatten())
            row["added"].append(result.rel_error.flatten())
            row["total"].append((torch.linalg.vector_norm(result.output - dense, dim=-1) / dense_norm).flatten())
    rows = []
    for (spec, _), row in zip(policies, pooled):
        values = {key: torch.cat(parts).double() for key, parts in row.items()}
        rows.append(dict(policy=spec, kept_fraction=float(values["kept"].mean()),
                         art_loaded_of_kept=float(values["art"].mean()),
                         loaded_fraction=float(values["loaded"].mean()),
                         policy_error=float(values["policy"].mean()),
                         art_added_error=float(values["added"].mean()),
                         total_error=float(values["total"].mean()),
                         total_error_p99=float(torch.quantile(values["total"], 0.99))))
    return pd.DataFrame(rows)


COMPOSITION_COLUMNS = ("policy", "kept_fraction", "art_loaded_of_kept", "loaded_fraction", "policy_error",
                       "art_added_error", "total_error", "total_error_p99")
COMPOSITION_FORMATS = {"kept_fraction": ".3f", "art_loaded_of_kept": ".3f", "loaded_fraction": ".3f",
                       "policy_error": ".2e", "art_added_error": ".2e", "total_error": ".2e",
                       "total_error_p99": ".2e"}
