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

from ..blockwise import blockwise_attention
from ..policies import parse_spec
from ..policies.compose import simulate_policy
from ..termination import ARTConfig, stop
from .inputs import decode_inputs

DEFAULT_POLICIES = ("dense", "streaming:budget=0.2", "snapkv:budget=0.2", "pyramidkv:budget=0.2",
                    "h2o:budget=0.2", "quest:budget=0.2", "streaming:budget=0.8", "snapkv:budget=0.8")


def compose_with_art(source, policy_specs: Sequence[str] = DEFAULT_POLICIES, art: ARTConfig | None = None,
                     block_size: int = 64, order: str = "sink_recency", step: int = -1) -> pd.DataFrame:
    """One row per policy spec (columns: :data:`COMPOSITION_COLUMNS`).

    Args:
        source: a capture, a synthetic cache or decode inputs (:func:`~.inputs.decode_inputs`); the
            inputs' recent ``queries`` feed query-aware policies.
        policy_specs: strings for :func:`art_analysis.policies.parse_spec`.
        art: the stopping rule (default ``ARTConfig()``).
    """
    if not policy_specs:
        raise ValueError("compose_with_art needs at least one policy spec")
    art = art or ARTConfig()
    policies = [(spec, parse_spec(spec)) for spec in policy_specs]
    pooled = {spec: {key: [] for key in ("kept", "art", "loaded", "policy", "added", "total")}
              for spec, _ in policies}
    for q, k, v, seqlens, queries, layer, num_layers in tqdm(decode_inputs(source, step), desc="policies x ART",
                                                            leave=False):
        dense = blockwise_attention(q, k, v, block_size=block_size, order=order, cache_seqlens=seqlens).final_out
        dense_norm = torch.linalg.vector_norm(dense, dim=-1)
        valid_tokens = seqlens.double()[:, None]
        for spec, policy in policies:
            walk = simulate_policy(policy, q, k, v, queries=queries, layer=layer, num_layers=num_layers,
                                   block_size=block_size, order=order, cache_seqlens=seqlens)
            trace = walk.trace
            result = stop(trace, art)
            kept = trace.block_tokens.sum(-1).double().repeat_interleave(trace.group_size, dim=1) / valid_tokens
            row = pooled[spec]
            row["kept"].append(kept.flatten())
            row["art"].append(result.loaded_fraction.flatten())
            row["loaded"].append((kept * result.loaded_fraction).flatten())
            row["policy"].append((torch.linalg.vector_norm(trace.final_out - dense, dim=-1) / dense_norm).flatten())
            row["added"].append(result.rel_error.flatten())
            row["total"].append((torch.linalg.vector_norm(result.output - dense, dim=-1) / dense_norm).flatten())
    rows = []
    for spec, _ in policies:
        values = {key: torch.cat(parts).double() for key, parts in pooled[spec].items()}
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
