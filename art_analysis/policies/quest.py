"""Quest: query-aware page selection from per-page key min/max bounds (Tang et al., 2024).

https://arxiv.org/abs/2406.10774
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int_count
from .base import BudgetPolicy, SelectionInputs, validate_inputs
from .budget import keep_top_blocks
from .scores import check_group_reduce, grouped_queries, reduce_group


def page_key_bounds(inputs: SelectionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of the valid keys of every page (block): two ``[B, Hkv, nb, D]`` float64.

    Pages without a valid token get zeros (they are never selected).
    """
    # Min and max are exact in the cache's own dtype: widen only the [B, Hkv, nb, D] results.
    keys = inputs.to_blocks(inputs.k)
    invalid = ~inputs.valid_block_tokens[:, None, :, :, None]
    key_min = keys.masked_fill(invalid, float("inf")).amin(3).to(torch.float64)
    key_max = keys.masked_fill(invalid, float("-inf")).amax(3).to(torch.float64)
    empty = ~inputs.valid_blocks[:, None, :, None]
    return key_min.masked_fill(empty, 0.0), key_max.masked_fill(empty, 0.0)


def page_score_bound(queries: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound on ``q . k`` over the keys of a page.

    ``bound = sum_i max(q_i * max_i, q_i * min_i) >= max_{k in page} q . k`` because each term
    is at least ``q_i * k_i`` for any ``k_i`` in ``[min_i, max_i]``.

    Args:
        queries: ``[..., M, D]``.
        key_min, key_max: ``[..., P, D]`` per-page element-wise key bounds.

    Returns:
        ``[..., M, P]``.
    """
    q = queries[..., :, None, :]
    return torch.maximum(q * key_max[..., None, :, :], q * key_min[..., None, :, :]).sum(-1)


def block_score_bounds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int,
                       cache_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Quest's bound on ``q . k`` over every block, per query head: ``[B, Hq, nb]`` float64.

    ``q [B, Hq, D]``, ``k, v [B, Hkv, S, D]`` (``v`` is only checked).  Blocks without a valid
    token get 0.  Multiply by the softmax scale for a bound on the logits.
    """
    inputs = validate_inputs(k, v, queries=q[:, :, None], layer=None, num_layers=None, block_size=block_size,
                             cache_seqlens=cache_seqlens)
    key_min, key_max = page_key_bounds(inputs)
    bound = page_score_bound(grouped_queries(inputs), key_min[:, :, None], key_max[:, :, None])
    return bound.squeeze(3).flatten(1, 2)                                   # [B, Hkv, G, 1, nb] -> [B, Hq, nb]



def group_block_bounds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int,
                       cache_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`block_score_bounds` reduced to the KV head (max over its query heads): ``[B, Hkv, nb]``.

    The ``block_scores`` of the ``"importance"`` order: the block that could score highest for
    any head of the group is walked first (one decode program serves the whole group).
    """
    bounds = block_score_bounds(q, k, v, block_size=block_size, cache_seqlens=cache_seqlens)
    return bounds.view(bounds.shape[0], k.shape[1], -1, bounds.shape[-1]).amax(2)

@dataclass(frozen=True)
class QuestPolicy(BudgetPolicy):
    """Keep the current page and the pages with the highest score bound.

    Pages are blocks.  The bound of :func:`page_score_bound` is computed for every query head
    and query and reduced over both (``group_reduce="max"`` by default: a page is kept if it
    could matter to any head of the group, since one decode program serves them all).  Of the
    ``N_b`` kept blocks (see :mod:`~art_analysis.policies.budget`) one is the newest block (the
    current page); the rest are the top pages.  Layers ``layer < dense_layers`` stay dense, as
    in Quest (this applies only when ``layer`` is given).

    Attributes:
        budget: tokens (int) or fraction (float in ``(0, 1]``), current page included.
        group_reduce: ``"max"`` or ``"mean"`` over the group's query heads and the queries.
        dense_layers: leading layers left dense (Quest: 2).
    """

    group_reduce: str = "max"
    dense_layers: int = 2
    name = "quest"
    needs_queries = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_group_reduce(self.group_reduce)
        object.__setattr__(self, "dense_layers", check_int_count(self.dense_layers, "dense_layers", 0))

    def keep_blocks(self, inputs: SelectionInputs) -> torch.Tensor:
        if inputs.layer is not None and inputs.layer < self.dense_layers:
            return inputs.every_valid_block()
        keep = self.kept_block_counts(inputs)
        key_min, key_max = page_key_bounds(inputs)
        queries = grouped_queries(inputs)                                   # [B, Hkv, G, Nq, D]
        bound = page_score_bound(queries, key_min[:, :, None], key_max[:, :, None])  # [B, Hkv, G, Nq, nb]
        scores = reduce_group(bound.flatten(2, 3), self.group_reduce)
        return keep_top_blocks(scores, keep, inputs.valid_blocks, inputs.newest_blocks(1), "current page")
