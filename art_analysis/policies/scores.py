"""Query-side scoring shared by the query-aware policies.

Queries ``[B, Hq, Nq, D]`` are taken to come at or after the newest cached token, so each
attends to every valid token of its sequence (no causal mask inside the cache).  Scores are
computed in float64.  A per-query-head score ``[B, Hkv, G, ...]`` (``G = Hq // Hkv``, query
head ``h = kv_head * G + g``) becomes a per-KV-head score by :func:`reduce_group`.
"""
from __future__ import annotations

import torch

from .base import SelectionInputs

GROUP_REDUCTIONS = ("mean", "max")


def check_group_reduce(value: str) -> None:
    """Raise unless ``value`` is one of :data:`GROUP_REDUCTIONS`."""
    if value not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduce must be one of {GROUP_REDUCTIONS}, got {value!r}")


def check_sm_scale(value: float | None) -> None:
    """Raise unless ``value`` is ``None`` (``D ** -0.5``) or a positive finite number."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value < float("inf")):
        raise ValueError(f"sm_scale must be a positive finite number or None, got {value!r}")


def reduce_group(x: torch.Tensor, how: str) -> torch.Tensor:
    """``[B, Hkv, G, ...]`` -> ``[B, Hkv, ...]`` by the mean or the max over the group's query heads."""
    return x.mean(2) if how == "mean" else x.amax(2)


def grouped_queries(inputs: SelectionInputs) -> torch.Tensor:
    """Queries as ``[B, Hkv, G, Nq, D]`` float64."""
    batch, kv_heads = inputs.k.shape[:2]
    queries = inputs.queries.to(torch.float64)
    return queries.view(batch, kv_heads, inputs.group_size, *queries.shape[2:])


def attention_weights(inputs: SelectionInputs, sm_scale: float | None) -> torch.Tensor:
    """Softmax weights of every query over the valid tokens: ``[B, Hkv, G, Nq, S]`` float64.

    ``a[b, h, g, n, i] = softmax_i(sm_scale * q[b, h*G+g, n] . k[b, h, i])`` over ``i < L_b``;
    invalid tokens get weight 0.
    """
    scale = inputs.k.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    logits = torch.einsum("bhgnd,bhsd->bhgns", grouped_queries(inputs), inputs.k.to(torch.float64)) * scale
    valid = inputs.valid_tokens[:, None, None, None, :]
    return torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
