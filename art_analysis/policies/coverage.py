"""Coverage: the smallest block set holding ``gamma`` of the softmax mass (FlexPrefill's rule, Lai et al., 2025).

https://arxiv.org/abs/2502.20766
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_fraction
from .base import SelectionInputs, SelectionPolicy
from .scores import attention_weights, check_sm_scale


def minimal_covering_blocks(mass: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per row, the fewest blocks whose mass reaches ``gamma``: ``BoolTensor`` shaped like ``mass [..., nb]``.

    Blocks are taken by decreasing mass (ties: the older block first) until the taken mass is
    ``>= gamma`` (with a ``1e-12`` tolerance); at least one block is always taken.
    """
    order = torch.sort(mass, dim=-1, descending=True, stable=True).indices
    ranked = torch.gather(mass, -1, order)
    before = torch.cumsum(ranked, dim=-1) - ranked
    take = before < gamma - 1e-12
    take[..., 0] = True
    return torch.zeros_like(take).scatter(-1, order, take)


@dataclass(frozen=True)
class CoveragePolicy(SelectionPolicy):
    """Keep the smallest set of blocks holding ``gamma`` of each query head's attention mass.

    A query head's block mass is its softmax weight summed over each block's tokens and averaged
    over the ``Nq`` queries.  Each query head gets its own minimal set
    (:func:`minimal_covering_blocks`); a KV head keeps the **union** over its group, so every
    query head of the group reaches ``gamma``.  The number of kept blocks follows from
    ``gamma``: there is no budget.

    Attributes:
        gamma: mass to cover, in ``(0, 1]`` (FlexPrefill uses 0.9-0.95).
        sm_scale: softmax scale, default ``D ** -0.5``.
    """

    gamma: float
    sm_scale: float | None = None
    name = "coverage"
    needs_queries = True

    def __post_init__(self) -> None:
        check_fraction(self.gamma, "gamma")
        check_sm_scale(self.sm_scale)

    def keep_blocks(self, inputs: SelectionInputs) -> torch.Tensor:
        mass = inputs.block_sum(attention_weights(inputs, self.sm_scale).mean(3))    # [B, Hkv, G, nb]
        per_head = minimal_covering_blocks(mass, float(self.gamma))
        return per_head.any(2) & inputs.valid_blocks[:, None, :]
