"""SnapKV: observation-window attention, pooled, top blocks plus the window (Li et al., 2024).

https://arxiv.org/abs/2404.14469
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..checks import check_int_count
from .base import BudgetPolicy, SelectionInputs
from .budget import keep_top_blocks, tokens_to_blocks
from .scores import attention_weights, check_group_reduce, check_sm_scale, reduce_group

POOLINGS = ("avgpool", "maxpool")


def check_pooling(pooling: str, kernel_size: int) -> None:
    """Raise unless ``pooling`` is known and ``kernel_size`` is a positive odd int."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 \
            or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd int (pooling keeps the length), got {kernel_size!r}")


def snapkv_block_scores(inputs: SelectionInputs, *, kernel_size: int, pooling: str, group_reduce: str,
                        sm_scale: float | None) -> torch.Tensor:
    """SnapKV's block scores ``[B, Hkv, nb]`` float64.

    Per query head: the softmax weights of the observation queries, averaged over the ``Nq``
    queries (``[B, Hkv, G, S]``), pooled along the tokens (``kernel_size``, stride 1, zero
    padding; invalid tokens are 0 before and after pooling), reduced over the group's query
    heads (``group_reduce``: kvpress averages), and summed over each block's tokens.
    """
    weights = attention_weights(inputs, sm_scale).mean(3)
    flat = weights.flatten(0, 2)[:, None, :]
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    pooled = pool(flat, kernel_size, stride=1, padding=kernel_size // 2).view_as(weights)
    return inputs.block_sum(reduce_group(pooled, group_reduce))


@dataclass(frozen=True)
class SnapKVPolicy(BudgetPolicy):
    """Keep the observation window and the blocks the window's queries attend to most.

    ``queries`` are the observation window (SnapKV: the prompt's last ``window`` queries; at
    decode, recent decode queries).  Of the ``N_b`` kept blocks (see
    :mod:`~art_analysis.policies.budget`), the newest ``ceil(window / block_size)`` hold the
    window and the rest are the top blocks by :func:`snapkv_block_scores`.

    Attributes:
        budget: tokens (int) or fraction (float in ``(0, 1]``), window included.
        window: observation-window tokens, always kept (SnapKV default 32).
        kernel_size: pooling width, odd (SnapKV default 5).
        pooling: ``"avgpool"`` or ``"maxpool"``.
        group_reduce: ``"mean"`` (kvpress) or ``"max"`` over the query heads of a KV head.
        sm_scale: softmax scale, default ``D ** -0.5``.
    """

    window: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"
    group_reduce: str = "mean"
    sm_scale: float | None = None
    name = "snapkv"
    needs_queries = True

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "window", check_int_count(self.window, "window", 0))
        check_pooling(self.pooling, self.kernel_size)
        check_group_reduce(self.group_reduce)
        check_sm_scale(self.sm_scale)

    def keep_blocks(self, inputs: SelectionInputs) -> torch.Tensor:
        keep = self.kept_block_counts(inputs)
        return self.keep_top(inputs, keep)

    def keep_top(self, inputs: SelectionInputs, keep: torch.Tensor) -> torch.Tensor:
        """Keep ``keep[b]`` (``LongTensor [B]``) blocks: the window and the top-scoring blocks."""
        scores = snapkv_block_scores(inputs, kernel_size=self.kernel_size, pooling=self.pooling,
                                     group_reduce=self.group_reduce, sm_scale=self.sm_scale)
        window = inputs.newest_blocks(tokens_to_blocks(self.window, inputs.block_size))
        return keep_top_blocks(scores, keep, inputs.valid_blocks, window, "observation window")
