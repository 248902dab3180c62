"""How fast the partial output converges along the walk (the paper's Figure 4)."""
from __future__ import annotations

from typing import Sequence

import torch

from ..blockwise import BlockTrace


def error_curve(trace: BlockTrace) -> tuple[torch.Tensor, torch.Tensor]:
    """Loaded fraction and relative error of ``O^(t)`` after every step.

    Returns ``(loaded_fraction, rel_error)``, both ``[B, Hq, T]``; padded steps repeat the
    final values (fraction 1, error 0).
    """
    tokens = torch.cumsum(trace.block_tokens, dim=-1).repeat_interleave(trace.group_size, dim=1)
    loaded = tokens.double() / tokens[..., -1:].double()
    final = trace.final_out[:, :, None, :]
    error = torch.linalg.vector_norm(trace.partial_out - final, dim=-1)
    error = error / torch.clamp(torch.linalg.vector_norm(final, dim=-1), min=1e-30)
    return loaded, error.double()


def mean_error_at(traces: Sequence[BlockTrace], fractions: torch.Tensor) -> torch.Tensor:
    """Mean (over every head of every trace) relative error once ``fractions`` of the walk is loaded.

    For each head, the error at fraction ``f`` is that of the last step whose loaded fraction
    is ``<= f`` (error 1 before the first block).  Returns ``[len(fractions)]`` float64.
    """
    if not traces:
        raise ValueError("mean_error_at needs at least one trace")
    fractions = torch.as_tensor(fractions, dtype=torch.float64, device=traces[0].partial_out.device)
    totals = torch.zeros_like(fractions)
    count = 0
    for trace in traces:
        loaded, error = error_curve(trace)
        loaded, error = loaded.flatten(0, 1), error.flatten(0, 1)                # [N, T]
        position = torch.searchsorted(loaded.contiguous(), fractions.expand(loaded.shape[0], -1).contiguous(),
                                      right=True) - 1
        padded = torch.cat([error, torch.ones(error.shape[0], 1, dtype=error.dtype, device=error.device)], dim=-1)
        at = torch.gather(padded, 1, torch.where(position >= 0, position, error.shape[1]))
        totals += at.sum(0)
        count += at.shape[0]
    return totals / max(count, 1)
