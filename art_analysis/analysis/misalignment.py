"""Attention score versus output contribution per token (the paper's Figure 1).

For decode query head ``h`` the weight of token ``j`` is ``a_{h,j}`` and its contribution is
``||a_{h,j} v_j||``.  As in the paper, the per-token *score* is the maximum weight over the
query heads of a KV head; the contribution is taken the same way (max over those heads).

A token is *misaligned* when it is in the top ``top`` share of tokens by contribution but
the attention-score ranking places it outside its own top ``top`` share: a key-centric policy
keeping that share by score would drop it.  ``recall@k`` is the share of the top-``k`` tokens by
contribution that the top-``k`` by score contains (1 for perfectly aligned rankings).
"""
from __future__ import annotations

from typing import Sequence

import pandas as pd
import torch

from kernels.softmax_scale import softmax_scale

from ..checks import as_list, check_fraction, check_int
from .inputs import decode_inputs


def token_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlen: int,
                 sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token attention score and contribution for one sequence.

    Args:
        q: ``[Hq, D]``; k, v: ``[Hkv, S, D]``; seqlen: valid tokens.
        sm_scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``(score, contribution)``, both ``[Hkv, seqlen]`` float64 (max over the group's query heads).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    seqlen = check_int(seqlen, "seqlen", 1)
    if q.dim() != 2 or k.dim() != 3 or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"expected q [Hq, D] and k, v [Hkv, S, D] with one D; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] % k.shape[0]:
        raise ValueError(f"Hq % Hkv must be 0, got Hq={q.shape[0]}, Hkv={k.shape[0]}")
    if not 1 <= seqlen <= k.shape[1]:
        raise ValueError(f"seqlen must lie in [1, S={k.shape[1]}], got {seqlen}")
    kv_heads = k.shape[0]
    group = q.shape[0] // kv_heads
    sm_scale = softmax_scale(sm_scale, q.shape[-1])
    k, v = k[:, :seqlen].double(), v[:, :seqlen].double()
    logits = torch.einsum("hgd,hsd->hgs", q.double().view(kv_heads, group, -1), k) * sm_scale
    weights = torch.softmax(logits, dim=-1)
    contribution = weights * torch.linalg.vector_norm(v, dim=-1)[:, None, :]
    return weights.amax(1), contribution.amax(1)


def _top_mask(values: torch.Tensor, share: float) -> torch.Tensor:
    """``BoolTensor`` like ``values [H, S]`` marking each row's top ``round(share * S)`` (at least 1)."""
    count = max(1, int(round(share * values.shape[-1])))
    return torch.zeros_like(values, dtype=torch.bool).scatter_(-1, values.topk(count, -1).indices, True)


def misaligned_fraction(score: torch.Tensor, contribution: torch.Tensor, top: float = 0.2) -> torch.Tensor:
    """Share of the top-``top`` tokens by contribution that are *not* in the top-``top`` by score.

    Args: ``score, contribution: [H, S]``.  Returns ``[H]``.
    """
    top = check_fraction(top, "top")
    by_contribution = _top_mask(contribution, top)
    return (by_contribution & ~_top_mask(score, top)).sum(-1).double() / by_contribution.sum(-1)


def misalignment_rates(source, *, top: float = 0.2, ks: Sequence[float] = (0.01, 0.05, 0.1, 0.2),
                       step: int = -1) -> pd.DataFrame:
    """Per-layer, per-head misalignment.

    Returns:
        One row per ``(layer, b, kv_head)``: ``tokens``, ``misaligned_rate`` (share of the top-``top``
        tokens by contribution that the score ranking places outside its top ``top``), and
        ``recall@k`` for every ``k`` in ``ks`` (share of the top-``k`` tokens by contribution found in
        the top-``k`` by score).
    """
    top = check_fraction(top, "top")
    ks = [check_fraction(k, "every k") for k in as_list(ks, "ks", "[0.05, 0.1]")]
    rows = []
    for call in decode_inputs(source, step):
        for b in range(call.q.shape[0]):
            seqlen = int(call.cache_seqlens[b])
            score, contribution = token_scores(call.q[b], call.k[b], call.v[b], seqlen, call.sm_scale)
            rate = misaligned_fraction(score, contribution, top)
            recall = {f"recall@{k:g}": (_top_mask(contribution, k) & _top_mask(score, k)).sum(-1).double()
                      / _top_mask(contribution, k).sum(-1) for k in ks}
            for head in range(score.shape[0]):
                rows.append(dict(layer=call.layer, b=b, kv_head=head, tokens=seqlen,
                                 misaligned_rate=float(rate[head]),
                                 **{name: float(values[head]) for name, values in recall.items()}))
    return pd.DataFrame(rows)


def misaligned_tokens(source, *, layer: int | None = None, top: float = 0.2, step: int = -1) -> pd.DataFrame:
    """Every token of one layer with its score, contribution and misalignment flag (Figure 1's scatter).

    Args:
        layer: the model layer (default: the middle captured layer).

    Returns:
        One row per ``(b, kv_head, token)``: ``layer, score, contribution, score_rank`` (0 = highest
        score, as a share of the tokens), ``top_contribution`` and ``misaligned`` (bools).
    """
    top = check_fraction(top, "top")
    calls = decode_inputs(source, step)
    layers = [call.layer for call in calls]
    if layer is None:
        layer = layers[len(layers) // 2]
    if layer not in layers:
        raise ValueError(f"layer {layer} is not in the source; it holds layers {layers}")
    call = calls[layers.index(layer)]
    frames = []
    for b in range(call.q.shape[0]):
        seqlen = int(call.cache_seqlens[b])
        score, contribution = token_scores(call.q[b], call.k[b], call.v[b], seqlen, call.sm_scale)
        by_contribution = _top_mask(contribution, top)
        misaligned = by_contribution & ~_top_mask(score, top)
        rank = torch.empty_like(score).scatter_(-1, score.argsort(-1, descending=True),
                                                torch.arange(seqlen, dtype=score.dtype).expand_as(score)) / seqlen
        heads, tokens = score.shape
        frames.append(pd.DataFrame(dict(
            layer=layer, b=b, kv_head=torch.arange(heads).repeat_interleave(tokens).numpy(),
            token=torch.arange(tokens).repeat(heads).numpy(), score=score.flatten().numpy(),
            contribution=contribution.flatten().numpy(), score_rank=rank.flatten().numpy(),
            top_contribution=by_contribution.flatten().numpy(), misaligned=misaligned.flatten().numpy())))
    return pd.concat(frames, ignore_index=True)
