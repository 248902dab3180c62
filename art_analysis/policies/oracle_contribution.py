"""Contribution oracle: the blocks that add the most to the attention output.

An upper reference, not a deployable policy: it needs the full attention of the very queries
it serves.  Block ``j``'s contribution ``||sum_{i in j} a_i v_i||`` is what the output loses
in magnitude when the block is dropped (before renormalisation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BudgetPolicy, SelectionInputs
from .budget import keep_top_blocks
from .scores import attention_weights, check_group_reduce, check_sm_scale, reduce_group


def block_contributions(inputs: SelectionInputs, sm_scale: float | None) -> torch.Tensor:
    """``||sum_{i in block} a_i v_i||`` per query head, query and block: ``[B, Hkv, G, Nq, nb]`` float64.

    ``a`` are the softmax weights of each query over all valid tokens; values past a sequence's length count as
    zeros (they may be NaN or Inf, which a zero weight would not cancel).
    """
    weights = inputs.to_blocks(attention_weights(inputs, sm_scale), dim=-1)          # [B, Hkv, G, Nq, nb, bs]
    valid = inputs.valid_tokens[:, None, :, None]
    values = inputs.to_blocks(torch.where(valid, inputs.v.to(torch.float64), 0.0))   # [B, Hkv, nb, bs, D]
    outputs = torch.einsum("bhgqpl,bhpld->bhgqpd", weights, values)
    return torch.linalg.vector_norm(outputs, dim=-1)


@dataclass(frozen=True)
class OracleContributionPolicy(BudgetPolicy):
    """Keep the ``N_b`` blocks with the largest contribution (see :mod:`~art_analysis.policies.budget`).

    The contribution of :func:`block_contributions` is reduced over the group's query heads and
    the queries by ``group_reduce`` (``"max"`` by default: a block is kept if it matters to any
    query head the decode program serves).

    Attributes:
        budget: tokens (int) or fraction (float in ``(0, 1]``).
        group_reduce: ``"max"`` or ``"mean"``.
        sm_scale: softmax scale, default ``D ** -0.5``.
    """

    group_reduce: str = "max"
    sm_scale: float | None = None
    name = "oracle_contribution"
    needs_queries = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_group_reduce(self.group_reduce)
        check_sm_scale(self.sm_scale)

    def keep_blocks(self, inputs: SelectionInputs) -> torch.Tensor:
        keep = self.kept_block_counts(inputs)
        scores = reduce_group(block_contributions(inputs, self.sm_scale).flatten(2, 3), self.group_reduce)
        return keep_top_blocks(scores, keep, inputs.valid_blocks)
