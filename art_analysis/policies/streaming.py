"""StreamingLLM: attention-sink blocks plus the most recent blocks (Xiao et al., 2023).

https://arxiv.org/abs/2309.17453
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int_count
from .base import BudgetPolicy, SelectionInputs
from .budget import keep_top_blocks, tokens_to_blocks


@dataclass(frozen=True)
class StreamingPolicy(BudgetPolicy):
    """Keep the sink blocks and fill the rest of the budget with the newest blocks.

    No scores and no queries.  Of the ``N_b = ceil(T_b / block_size)`` kept blocks (see
    :mod:`~art_analysis.policies.budget`), the first ``ceil(sink_tokens / block_size)`` are the
    oldest blocks (the attention sink) and the others are the newest blocks (the sliding window).

    Attributes:
        budget: tokens (int) or fraction of each sequence (float in ``(0, 1]``).
        sink_tokens: leading tokens always kept (StreamingLLM keeps 4).
    """

    sink_tokens: int = 4
    name = "streaming"

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "sink_tokens", check_int_count(self.sink_tokens, "sink_tokens", 0))

    def keep_blocks(self, inputs: SelectionInputs) -> torch.Tensor:
        keep = self.kept_block_counts(inputs)
        sink = inputs.first_blocks(tokens_to_blocks(self.sink_tokens, inputs.block_size))
        newest_first = torch.arange(inputs.num_blocks, device=inputs.k.device, dtype=torch.float64)
        scores = newest_first.expand(*inputs.k.shape[:2], -1)
        return keep_top_blocks(scores, keep, inputs.valid_blocks, sink, "sink blocks")
