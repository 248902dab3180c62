"""Token budgets, how they map to blocks, and top-k block selection.

A budget is either a number of tokens (``int >= 1``) or a fraction of each sequence
(``float`` in ``(0, 1]``).  Per sequence ``b`` of ``L_b`` valid tokens:

* budget tokens ``T_b = budget`` for an int (an int above ``L_b`` is an error), or
  ``T_b = max(1, floor(fraction * L_b))`` for a fraction (kvpress's rounding);
* kept blocks ``N_b = ceil(T_b / block_size)``, **exactly**, for every ``kv_head`` of the
  sequence.  Blocks are the unit the decode walk loads, so a budget is met at block
  granularity; with ``block_size=1`` exactly ``T_b`` tokens are kept.

Windows and sinks given in tokens are also kept at block granularity: ``w`` tokens are the
newest (or oldest) ``ceil(w / block_size)`` blocks, and they count toward ``N_b``.
"""
from __future__ import annotations

import math
import numbers
from typing import Union

import torch

Budget = Union[int, float]


def check_budget(budget: Budget, name: str = "budget") -> Budget:
    """``budget`` as an ``int >= 1`` (tokens) or a ``float`` in ``(0, 1]`` (fraction), from an ``int`` or a
    ``float`` or a NumPy scalar of either kind (not a ``bool``); else ``TypeError`` / ``ValueError``."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise TypeError(f"{name} must be an int (tokens) or a float in (0, 1] (fraction), got {budget!r}")
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise ValueError(f"{name} must be >= 1 token, got {budget}")
        return int(budget)
    if not (math.isfinite(budget) and 0.0 < budget <= 1.0):
        raise ValueError(f"{name} as a fraction must lie in (0, 1], got {budget!r}; "
                         "pass an int for a budget in tokens")
    return float(budget)


def budget_tokens(budget: Budget, seqlens: torch.Tensor) -> torch.Tensor:
    """Budget in tokens per sequence: ``LongTensor [B]`` (see the module docstring)."""
    if isinstance(budget, int):
        too_long = seqlens < budget
        if too_long.any():
            b = int(too_long.nonzero()[0, 0])
            raise ValueError(f"budget of {budget} tokens exceeds the length of sequence {b} "
                             f"({int(seqlens[b])} tokens); lower it or give a fraction in (0, 1]")
        return torch.full_like(seqlens, budget)
    tokens = torch.floor(seqlens.to(torch.float64) * budget + 1e-9).long()
    return tokens.clamp(min=1)


def tokens_to_blocks(tokens: torch.Tensor | int, block_size: int) -> torch.Tensor | int:
    """``ceil(tokens / block_size)`` for an int or a ``LongTensor``."""
    if isinstance(tokens, int):
        return -(-tokens // block_size)
    return torch.div(tokens + block_size - 1, block_size, rounding_mode="floor")


def keep_top_blocks(scores: torch.Tensor, keep: torch.Tensor, valid_blocks: torch.Tensor,
                    forced: torch.Tensor | None = None, forced_name: str = "forced") -> torch.Tensor:
    """Keep, per ``(b, kv_head)``, the forced blocks and then the highest-scoring ones, ``keep[b]`` in all.

    Args:
        scores: ``[B, Hkv, nb]`` finite block scores (higher is kept first; ties go to the
            older block).
        keep: ``LongTensor [B]`` blocks to keep, at most the valid blocks of each sequence.
        valid_blocks: ``BoolTensor [B, nb]`` blocks holding a valid token.
        forced: ``BoolTensor [B, nb]`` or ``[B, Hkv, nb]`` blocks always kept (they count
            toward ``keep``); more forced blocks than ``keep`` is an error.
        forced_name: what the forced blocks are, for the error message.

    Returns:
        ``BoolTensor [B, Hkv, nb]`` with exactly ``keep[b]`` blocks set per ``(b, kv_head)``.
    """
    key = scores.to(torch.float64)
    if forced is not None:
        forced = forced.expand_as(key) if forced.dim() == 3 else forced[:, None, :].expand_as(key)
        forced = forced & valid_blocks[:, None, :]
        count = forced.sum(-1).amax(-1)
        if (count > keep).any():
            b = int((count > keep).nonzero()[0, 0])
            raise ValueError(f"the budget of sequence {b} ({int(keep[b])} blocks) cannot hold the "
                             f"{forced_name} ({int(count[b])} blocks); raise the budget or shrink the {forced_name}")
        key = key.masked_fill(forced, float("inf"))
    key = key.masked_fill(~valid_blocks[:, None, :], float("-inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return rank < keep[:, None, None]
