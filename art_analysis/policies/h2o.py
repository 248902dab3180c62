"""H2O: heavy hitters by accumulated attention plus a recent window (Zhang et al., 2023).

https://arxiv.org/abs/2306.14048
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.int_checks import is_finite_real

from .base import BudgetPolicy, SelectionInputs
from .budget import keep_top_blocks
from .scores import attention_weights, check_group_reduce, check_sm_scale, reduce_group


def accumulated_attention(inputs: SelectionInputs, *, group_reduce: str, sm_scale: float | None) -> torch.Tensor:
    """H2O's block scores ``[B, Hkv, nb]`` float64.

    Per query head, every token accumulates the softmax weight it receives from each of the
    ``Nq`` queries (summed: all queries see every valid token, so kvpress's normalisation by
    the number of queries that can attend a key is a constant); the sums are reduced over the
    group's query heads (``group_reduce``) and summed over each block's tokens.
    """
    accumulated = attention_weights(inputs, sm_scale).sum(3)
    return inputs.block_sum(reduce_group(accumulated, group_reduce))


@dataclass(frozen=True)
class H2OPolicy(BudgetPolicy):
    """Keep a recent window and the heavy-hitter blocks.

    Of the ``N_b`` kept blocks (see :mod:`~art_analysis.policies.budget`), the newest
    ``ceil(recent_fraction * N_b)`` are the recent window (H2O splits its budget evenly) and the
    rest are the top blocks by :func:`accumulated_attention`.  This is the one-shot form of
    H2O's greedy eviction: the scores are accumulated over all given queries, then the heavy
    hitters are chosen at once.

    Attributes:
        budget: tokens (int) or fraction (float in ``(0, 1]``), window included.
        recent_fraction: share of the kept blocks given to the recent window, in ``[0, 1]``.
        group_reduce: ``"mean"`` or ``"max"`` over the query heads of a KV head.
        sm_scale: softmax scale, default ``D ** -0.5``.
    """

    recent_fraction: float = 0.5
    group_reduce: str = "mean"
    sm_scale: float | None = None
    name = "h2o"
    needs_queries = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (is_finite_real(self.recent_fraction) and 0 <= self.recent_fraction <= 1):
            raise ValueError(f"recent_fraction must lie in [0, 1] (a real number), got {self.recent_fraction!r}")
        object.__setattr__(self, "recent_fraction", float(self.recent_fraction))
        check_group_reduce(self.group_reduce)
        check_sm_scale(self.sm_scale)

    def keep_blocks(self, inputs: SelectionInputs) -> torch.Tensor:
        keep = self.kept_block_counts(inputs)
        recent = torch.ceil(keep.to(torch.float64) * self.recent_fraction - 1e-9).long()
        scores = accumulated_attention(inputs, group_reduce=self.group_reduce, sm_scale=self.sm_scale)
        return keep_top_blocks(scores, keep, inputs.valid_blocks, inputs.newest_blocks(recent), "recent window")
