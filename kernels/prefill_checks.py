"""Boundary checks shared by the FlexPrefill reference and the Triton launchers.

Prefill tensors are ``[B, H, N, D]``: queries ``[B, Hq, N, D]``, keys and values
``[B, Hkv, N, D]`` with ``Hq % Hkv == 0`` (causal self-attention: one length ``N``).
"""
from __future__ import annotations

import os

import torch

from .int_checks import check_count, check_flags, is_finite_real

SUPPORTED_HEAD_DIMS = (64, 128)   # of the Triton prefill kernels (estimate and block-sparse attention)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)   # on a GPU; the CPU interpreter takes any float


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


def check_kernel_tensors(*named: tuple[str, torch.Tensor]) -> None:
    """The Triton prefill kernels' constraints on tensors that passed :func:`check_prefill_inputs`: a head dim of
    ``SUPPORTED_HEAD_DIMS``, one dtype, and CUDA tensors (or any device under ``TRITON_INTERPRET=1``)."""
    (first_name, first), *others = named
    if first.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}, got {first.shape[-1]}")
    if any(x.dtype != first.dtype for _, x in others):
        raise TypeError(f"{', '.join(name for name, _ in named)} must share one dtype, "
                        f"got {', '.join(str(x.dtype) for _, x in named)}")
    if first.device.type != "cuda" and not (first.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError(f"the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got "
                         f"{first_name} on {first.device}")


def check_selection_params(gamma: float, tau: float, block_size: int, min_budget: int, max_budget: int | None,
                           budget_divisor: int | None, js_eps: float | None, union_vs_for_query_aware: bool) -> None:
    """Raise ``ValueError`` on out-of-range FlexPrefill parameters (numbers given as bools or tensors included), and
    ``TypeError`` where the ``union_vs_for_query_aware`` flag is not a bool."""
    check_flags(union_vs_for_query_aware=union_vs_for_query_aware)
    if not (is_finite_real(gamma) and 0.0 < gamma <= 1.0):
        raise ValueError(f"gamma must lie in (0, 1] (a real number), got {gamma!r}")
    if not (is_finite_real(tau) and tau >= 0.0):
        raise ValueError(f"tau must be >= 0 (a finite real number), got {tau!r}")
    check_count(block_size, "block_size", 1)
    check_count(min_budget, "min_budget", 0, unit="tokens")
    if max_budget is not None:
        check_count(max_budget, "max_budget (or None)", max(min_budget, 1), unit="tokens")
    if budget_divisor is not None:
        check_count(budget_divisor, "budget_divisor (or None)", 1)
    if js_eps is not None and not (is_finite_real(js_eps) and js_eps > 0.0):
        raise ValueError(f"js_eps must be None or > 0 (a finite real number), got {js_eps!r}")


def check_block_mask(block_mask: torch.Tensor, q: torch.Tensor, block_size: int) -> None:
    """Raise unless ``block_mask`` is a bool ``[B, Hq, nb, nb]`` on q's device, ``nb = ceil(N / bs)``."""
    check_count(block_size, "block_size", 1)
    b, hq, n, _ = q.shape
    nb = -(-n // block_size)
    if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
        raise TypeError("block_mask must be a bool tensor [B, Hq, nb, nb]")
    if tuple(block_mask.shape) != (b, hq, nb, nb):
        raise ValueError(f"block_mask must have shape {(b, hq, nb, nb)} for N={n}, block_size={block_size}, "
                         f"got {tuple(block_mask.shape)}")
    if block_mask.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.device} but q is on {q.device}")
