"""PyramidKV: SnapKV scores with budgets falling linearly from the first layer to the last (Cai et al., 2024).

https://arxiv.org/abs/2406.02069 (layer budgets as in KVCache-Factory's ``pyramidkv_utils.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.int_checks import is_finite_real

from .base import SelectionInputs
from .budget import budget_tokens, tokens_to_blocks
from .snapkv import SnapKVPolicy


def pyramid_layer_tokens(tokens: torch.Tensor, seqlens: torch.Tensor, *, window: int, layer: int,
                         num_layers: int, beta: float) -> torch.Tensor:
    """Token budget of ``layer`` per sequence: ``LongTensor [B]``.

    With the uniform budget ``T`` and window ``w``, the non-window part ``A = T - w`` is
    spread over the layers linearly from ``hi = 2A - A / beta`` at layer 0 to ``lo = A / beta``
    at the last layer (their mean is ``A``, so the model-wide budget is unchanged).  When
    ``hi`` exceeds what a sequence holds outside the window (``L - w``), ``hi = L - w`` and
    ``lo = 2A - hi``, keeping the mean.  Layer ``l`` keeps
    ``max(1, w + floor(hi - (hi - lo) * l / (num_layers - 1)))`` tokens (``T`` for one layer).
    """
    if num_layers == 1:
        return tokens.clone()
    short = tokens < window
    if short.any():
        b = int(short.nonzero()[0, 0])
        raise ValueError(f"the budget of sequence {b} ({int(tokens[b])} tokens) is smaller than the "
                         f"window ({window} tokens)")
    spread = (tokens - window).to(torch.float64)
    lo = spread / beta
    hi = 2 * spread - lo
    room = (seqlens - window).to(torch.float64)
    capped = hi > room
    hi = torch.where(capped, room, hi)
    lo = torch.where(capped, 2 * spread - room, lo)
    per_layer = hi - (hi - lo) * layer / (num_layers - 1)
    return (window + torch.floor(per_layer + 1e-9).long()).clamp(min=1)


@dataclass(frozen=True)
class PyramidKVPolicy(SnapKVPolicy):
    """SnapKV selection with a per-layer budget from :func:`pyramid_layer_tokens`.

    Needs ``layer`` and ``num_layers``.  Layer ``l`` keeps exactly
    ``ceil(pyramid_layer_tokens(...) / block_size)`` blocks per ``(b, kv_head)``: the newest
    ``ceil(window / block_size)`` and the top blocks by SnapKV's scores.

    Attributes:
        budget: average budget per layer, tokens (int) or fraction (float in ``(0, 1]``).
        beta: ratio of the mean to the last layer's non-window budget (PyramidKV uses 20).
        window, kernel_size, pooling, group_reduce, sm_scale: as in :class:`SnapKVPolicy`.
    """

    beta: float = 20.0
    name = "pyramidkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (is_finite_real(self.beta) and self.beta >= 1):
            raise ValueError(f"beta must be a finite number >= 1, got {self.beta!r}")
        object.__setattr__(self, "beta", float(self.beta))

    def keep_blocks(self, inputs: SelectionInputs) -> torch.Tensor:
        if inputs.layer is None or inputs.num_layers is None:
            raise ValueError("policy 'pyramidkv' sets a budget per layer: pass layer and num_layers")
        tokens = pyramid_layer_tokens(budget_tokens(self.budget, inputs.seqlens), inputs.seqlens,
                                      window=self.window, layer=inputs.layer, num_layers=inputs.num_layers,
                                      beta=float(self.beta))
        return self.keep_top(inputs, tokens_to_blocks(tokens, inputs.block_size))
