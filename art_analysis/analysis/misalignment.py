"""Attention score versus output contribution per token (the paper's Figure 1).

For decode query head ``h`` the weight of token ``j`` is ``a_{h,j}`` and its contribution is
``||a_{h,j} v_j||``.  As in the paper, the per-token *score* is the maximum weight over the
query heads of a KV head; the contribution is taken the same way (max over those heads).
"""
from __future__ import annotations

import torch


def token_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlen: int,
                 sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token attention score and contribution for one sequence.

    Args:
        q: ``[Hq, D]``; k, v: ``[Hkv, S, D]``; seqlen: valid tokens.

    Returns:
        ``(score, contribution)``, both ``[Hkv, seqlen]`` float64 (max over the group's query heads).
    """
    if q.dim() != 2 or k.dim() != 3 or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"expected q [Hq, D] and k, v [Hkv, S, D] with one D; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] % k.shape[0]:
        raise ValueError(f"Hq % Hkv must be 0, got Hq={q.shape[0]}, Hkv={k.shape[0]}")
    if not 1 <= seqlen <= k.shape[1]:
        raise ValueError(f"seqlen must lie in [1, S={k.shape[1]}], got {seqlen}")
    kv_heads = k.shape[0]
    group = q.shape[0] // kv_heads
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    k, v = k[:, :seqlen].double(), v[:, :seqlen].double()
    logits = torch.einsum("hgd,hsd->hgs", q.double().view(kv_heads, group, -1), k) * sm_scale
    weights = torch.softmax(logits, dim=-1)
    contribution = weights * torch.linalg.vector_norm(v, dim=-1)[:, None, :]
    return weights.amax(1), contribution.amax(1)


def misaligned_fraction(score: torch.Tensor, contribution: torch.Tensor, top: float = 0.2) -> torch.Tensor:
    """Share of the top-``top`` tokens by contribution that are *not* in the top-``top`` by score.

    Args: ``score, contribution: [H, S]``.  Returns ``[H]``.
    """
    if not 0 < top <= 1:
        raise ValueError(f"top must lie in (0, 1], got {top}")
    count = max(1, int(round(top * score.shape[-1])))
    by_contribution = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, contribution.topk(count, -1).indices, True)
    by_score = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, score.topk(count, -1).indices, True)
    return (by_contribution & ~by_score).sum(-1).double() / count
