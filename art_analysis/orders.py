"""KV-block traversal orders.

A traversal order lists, for every ``(b, kv_head)``, the ids of the KV blocks a decode
kernel visits, step by step.  Only *walkable* blocks appear: blocks that hold at least
one valid token (``j * block_size < cache_seqlens[b]``) and that the selection keeps.
Orders are returned as ``LongTensor [B, Hkv, T]``, padded with ``-1`` past each
``(b, kv_head)``'s own number of steps, where ``T`` is the largest number of steps.

Named orders (DESIGN §3):

* ``"sequential"``: oldest first (block 0, 1, 2, ...);
* ``"recency"``: newest first;
* ``"sink_recency"``: block 0 first (the attention sink), then newest first (the default);
* ``"importance"``: by a per-block score, highest first (``block_scores [B, Hkv, nb]``).

An explicit order is a ``LongTensor`` of block ids shaped ``[n]``, ``[B, n]`` or
``[B, Hkv, n]`` (``-1`` entries are padding).  For every ``(b, kv_head)`` its non-negative
entries must be exactly the walkable blocks, each once.
"""
from __future__ import annotations

import operator

import torch

ORDERS = ("sequential", "recency", "sink_recency", "importance")
KERNEL_ORDERS = ("sequential", "sink_recency")   # the orders the Triton decode kernel walks


def walkable_blocks(cache_seqlens: torch.Tensor, num_kv_heads: int, num_blocks: int, block_size: int,
                    selection: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks that hold a valid token and are kept by ``selection``: ``BoolTensor [B, Hkv, nb]``."""
    block_start = torch.arange(num_blocks, device=cache_seqlens.device) * block_size
    valid = block_start[None, :] < cache_seqlens[:, None].to(torch.long)
    valid = valid[:, None, :].expand(-1, num_kv_heads, -1)
    if selection is not None:
        valid = valid & selection
    return valid


def traversal_order(order: str | torch.Tensor, walkable: torch.Tensor,
                    block_scores: torch.Tensor | None = None) -> torch.Tensor:
    """Turn an order name or an explicit permutation into block ids ``[B, Hkv, T]`` (-1 padded).

    Args:
        order: one of :data:`ORDERS` or an explicit permutation (see the module docstring).
        walkable: ``BoolTensor [B, Hkv, nb]`` from :func:`walkable_blocks`.
        block_scores: ``[B, Hkv, nb]`` float scores, required by ``"importance"`` and refused by any other order.
    """
    batch, kv_heads, num_blocks = walkable.shape
    if block_scores is not None and not (isinstance(order, str) and order == "importance"):
        raise ValueError(f"block_scores order the walk only with order='importance'; got order {order!r}")
    if isinstance(order, torch.Tensor):
        return _explicit_order(order, walkable)
    if not isinstance(order, str) or order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS} or a LongTensor permutation, got {order!r}")
    ids = torch.arange(num_blocks, device=walkable.device, dtype=torch.float64)
    if order == "sequential":
        key = ids.expand(batch, kv_heads, -1).clone()
    elif order == "recency":
        key = (-ids).expand(batch, kv_heads, -1).clone()
    elif order == "sink_recency":
        key = (-ids).expand(batch, kv_heads, -1).clone()
        key[..., 0] = -float(num_blocks) - 1.0
    else:
        if block_scores is None:
            raise ValueError("order='importance' needs block_scores [B, Hkv, num_blocks]")
        if not isinstance(block_scores, torch.Tensor) or not block_scores.is_floating_point():
            got = block_scores.dtype if isinstance(block_scores, torch.Tensor) else type(block_scores).__name__
            raise TypeError(f"block_scores must be a floating-point tensor [B, Hkv, num_blocks], got {got}")
        if tuple(block_scores.shape) != (batch, kv_heads, num_blocks):
            raise ValueError(f"block_scores must have shape {(batch, kv_heads, num_blocks)}, "
                             f"got {tuple(block_scores.shape)}")
        if not torch.isfinite(block_scores).all():
            raise ValueError("block_scores must be finite")
        key = -block_scores.to(device=walkable.device, dtype=torch.float64)
    key = key.masked_fill(~walkable, float("inf"))
    sorted_ids = torch.sort(key, dim=-1, stable=True).indices
    num_steps = walkable.sum(-1)
    steps = int(num_steps.max().item()) if walkable.numel() else 0
    sorted_ids = sorted_ids[..., :steps]
    pad = torch.arange(steps, device=walkable.device)[None, None, :] >= num_steps[..., None]
    return sorted_ids.masked_fill(pad, -1)


def _explicit_order(order: torch.Tensor, walkable: torch.Tensor) -> torch.Tensor:
    batch, kv_heads, num_blocks = walkable.shape
    if order.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"an explicit order must be an integer tensor of block ids, got {order.dtype}")
    order = order.to(device=walkable.device, dtype=torch.long)
    if order.dim() == 1:
        order = order[None, None, :].expand(batch, kv_heads, -1)
    elif order.dim() == 2:
        if order.shape[0] != batch:
            raise ValueError(f"an explicit order [B, n] needs B={batch}, got {tuple(order.shape)}")
        order = order[:, None, :].expand(-1, kv_heads, -1)
    elif order.dim() != 3 or order.shape[:2] != (batch, kv_heads):
        raise ValueError(f"an explicit order must be [n], [B, n] or [B, Hkv, n] with B={batch}, "
                         f"Hkv={kv_heads}; got {tuple(order.shape)}")
    if ((order < -1) | (order >= num_blocks)).any():
        raise ValueError(f"an explicit order holds block ids in [0, {num_blocks}) or -1 padding")
    present = order >= 0
    counts = torch.zeros(batch, kv_heads, num_blocks + 1, dtype=torch.long, device=walkable.device)
    counts.scatter_add_(-1, torch.where(present, order, num_blocks), torch.ones_like(order))
    if not torch.equal(counts[..., :num_blocks], walkable.long()):
        raise ValueError("the explicit order is not a permutation of the walkable blocks: every block "
                         "holding valid tokens (and kept by the selection) must appear exactly once")
    # Move padding to the end while keeping the given order of the real entries.
    key = torch.where(present, torch.arange(order.shape[-1], device=order.device).expand_as(order),
                      order.shape[-1])
    compact = torch.gather(order, -1, torch.sort(key, dim=-1, stable=True).indices)
    steps = int(present.sum(-1).max().item()) if present.numel() else 0
    return compact[..., :steps].contiguous()


def check_token_range(tokens) -> tuple[int, int]:
    """``tokens`` as a token range ``(start, end)``, ``0 <= start < end`` (e.g. a retrieval prompt's needle)."""
    try:
        start, end = (operator.index(t) for t in tokens)
    except (TypeError, ValueError):
        start, end = -1, -1
    if not 0 <= start < end:
        raise ValueError(f"needle must be a token range [start, end) with 0 <= start < end, got {tokens}")
    return start, end


def walks_reading(block_ids: torch.Tensor, steps: torch.Tensor, tokens: tuple[int, int],
                  block_size: int) -> torch.Tensor:
    """Whether each walk's first ``steps`` steps visit a block holding a token of ``tokens`` (``[start, end)``).

    Args:
        block_ids: ``LongTensor [..., T]``, the walks' traversal orders (:func:`traversal_order`, -1 padded).
        steps: ``[...]`` (integer), the steps each walk took.
        tokens: the token range; block_size: tokens per block.

    Returns:
        ``BoolTensor [...]``.
    """
    first, last = tokens[0] // block_size, (tokens[1] - 1) // block_size
    taken = torch.arange(block_ids.shape[-1], device=block_ids.device) < steps[..., None]
    return ((block_ids >= first) & (block_ids <= last) & taken).any(-1)
