"""Boundary checks shared by the FlexPrefill reference and the Triton launchers.

Prefill tensors are ``[B, H, N, D]``: queries ``[B, Hq, N, D]``, keys and values
``[B, Hkv, N, D]`` with ``Hq % Hkv == 0`` (causal self-attention: one length ``N``).
"""
from __future__ import annotations

import torch


def check_prefill_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``q [B,Hq,N,D]``, ``k (,v) [B,Hkv,N,D]`` fit together."""
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be [B, H, N, D], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[3]} and {k.shape[3]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must have the same length N (causal self-attention prefill), "
                         f"got {q.shape[2]} and {k.shape[2]}")
    if q.shape[2] < 1:
        raise ValueError("the sequence must hold at least one token")
    for name, x in named:
        if min(x.shape) < 1:
            raise ValueError(f"{name} must have non-empty dims [B, H, N, D], got {tuple(x.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads must be a multiple of KV heads, got {q.shape[1]} and {k.shape[1]}")


def check_selection_params(gamma: float, tau: float, block_size: int, min_budget: int,
                           max_budget: int | None, budget_divisor: int | None, js_eps: float | None) -> None:
    """Raise ``ValueError`` on out-of-range FlexPrefill parameters."""
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must lie in (0, 1], got {gamma}")
    if not tau >= 0.0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(min_budget, int) or min_budget < 0:
        raise ValueError(f"min_budget must be an int >= 0 (tokens), got {min_budget!r}")
    if max_budget is not None and (not isinstance(max_budget, int) or max_budget < max(min_budget, 1)):
        raise ValueError(f"max_budget must be None or an int >= max(min_budget, 1) (tokens), got {max_budget!r}")
    if budget_divisor is not None and (not isinstance(budget_divisor, int) or budget_divisor < 1):
        raise ValueError(f"budget_divisor must be None or a positive int, got {budget_divisor!r}")
    if js_eps is not None and not js_eps > 0.0:
        raise ValueError(f"js_eps must be None or > 0, got {js_eps}")


def check_block_mask(block_mask: torch.Tensor, q: torch.Tensor, block_size: int) -> None:
    """Raise unless ``block_mask`` is a bool ``[B, Hq, nb, nb]`` on q's device, ``nb = ceil(N / bs)``."""
    b, hq, n, _ = q.shape
    nb = -(-n // block_size)
    if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
        raise TypeError("block_mask must be a bool tensor [B, Hq, nb, nb]")
    if tuple(block_mask.shape) != (b, hq, nb, nb):
        raise ValueError(f"block_mask must have shape {(b, hq, nb, nb)} for N={n}, block_size={block_size}, "
                         f"got {tuple(block_mask.shape)}")
    if block_mask.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.device} but q is on {q.device}")
