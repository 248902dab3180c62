"""Block-wise online-softmax decode attention that records every partial output.

This is the readable reference of the ART decode kernel (``kernels.art_decode``): it walks
a KV cache block by block in a traversal order and records the state a FlashAttention-2
style decode kernel holds after each block.

Shapes: ``q [B, Hq, D]``, ``k, v [B, Hkv, S, D]`` (query head ``h`` reads KV head
``h // (Hq // Hkv)``), ``cache_seqlens [B]``, ``selection [B, Hkv, nb]`` with
``nb = ceil(S / block_size)``.  Step ``t`` is the position in the order; ``T`` is the
largest number of steps over all ``(b, kv_head)``.  Steps past a ``(b, kv_head)``'s own
walk are padding: ``block_ids`` is ``-1`` there and the running state is carried forward.

Two modes:

* ``"exact"`` (float64): per-block log-sum-exps ``L_j`` and block mean values
  ``Obar_j = sum_{i in j} exp(s_i - L_j) v_i`` are computed for all blocks at once (in
  chunks of the sequence to bound memory), then ``O^(t) = sum_{u<=t} exp(L_u) Obar_u /
  sum_{u<=t} exp(L_u)``, with both sums as log-cumulative-sum-exps (the positive and
  negative parts of ``Obar`` separately), so a prefix holding a vanishing share of the mass
  (a newest-first walk that reaches a dominant sink last) keeps its exact output.  No Python
  loop over blocks.
* ``"kernel"`` (float32): the online recurrence exactly as a FlashAttention-2 decode
  kernel runs it, one step at a time::

      m = -inf, l = 0, acc = 0
      s = (q @ k_blk^T) * sm_scale                # fp32, invalid tokens -inf
      m_new = max(m, max(s));  alpha = exp(m - m_new);  p = exp(s - m_new)
      l = alpha * l + sum(p)
      acc = alpha * acc + p.to(v.dtype) @ v_blk   # p rounded to the value dtype
      O = acc / l
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kernels.softmax_scale import softmax_scale

from .checks import (check_block_size, check_cache_seqlens, check_finite, check_finite_cache, check_float_tensor,
                     check_kv_cache)
from .orders import traversal_order, walkable_blocks

MODES = ("exact", "kernel")
# Tokens of K/V converted to float64 at a time in exact mode (bounds peak memory).
EXACT_CHUNK_TOKENS = 8192


@dataclass
class BlockTrace:
    """Everything the simulator records, per step of the walk.

    Attributes:
        partial_out: ``[B, Hq, T, D]`` normalised partial output ``O^(t)``.
        accumulator: ``[B, Hq, T, D]`` un-normalised accumulator ``acc^(t) = l^(t) O^(t)``.
        running_max: ``[B, Hq, T]`` running max ``m^(t)`` of the scaled logits.
        running_sum: ``[B, Hq, T]`` running sum ``l^(t)``, relative to ``m^(t)``.
        block_mass: ``[B, Hq, T]`` the step's block share of the softmax mass of the walk.
        block_contribution: ``[B, Hq, T]`` ``||sum_{j in block} a_j v_j||`` with ``a`` the
            softmax weights over the whole walk.
        block_ids: ``[B, Hkv, T]`` block visited at each step, ``-1`` on padding.
        block_tokens: ``[B, Hkv, T]`` valid tokens in that block (0 on padding).
        num_steps: ``[B]`` steps of the longest walk among the kv heads of each sequence.
        final_out: ``[B, Hq, D]`` attention over every walked block.
        block_size, sm_scale, mode: the settings that produced the trace.
    """

    partial_out: torch.Tensor
    accumulator: torch.Tensor
    running_max: torch.Tensor
    running_sum: torch.Tensor
    block_mass: torch.Tensor
    block_contribution: torch.Tensor
    block_ids: torch.Tensor
    block_tokens: torch.Tensor
    num_steps: torch.Tensor
    final_out: torch.Tensor
    block_size: int
    sm_scale: float
    mode: str

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.partial_out.shape[1] // self.block_ids.shape[1]

    @property
    def loaded_fraction(self) -> torch.Tensor:
        """``[B, Hq, T]`` float64: share of the walk's tokens visited once step ``t`` is done (padded
        steps repeat 1)."""
        tokens = torch.cumsum(self.block_tokens, dim=-1).repeat_interleave(self.group_size, dim=1).to(torch.float64)
        return tokens / tokens[..., -1:]

    @property
    def steps_per_head(self) -> torch.Tensor:
        """``[B, Hq]`` number of real (non-padding) steps of each query head's walk."""
        steps = (self.block_ids >= 0).sum(-1)
        return steps.repeat_interleave(self.group_size, dim=1)


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int = 64,
                        order: str | torch.Tensor = "sink_recency", cache_seqlens: torch.Tensor | None = None,
                        selection: torch.Tensor | None = None, sm_scale: float | None = None,
                        mode: str = "exact", block_scores: torch.Tensor | None = None) -> BlockTrace:
    """Walk the KV cache block by block and record every partial output.

    Args:
        q: ``[B, Hq, D]`` decode queries.
        k, v: ``[B, Hkv, S, D]`` contiguous KV cache.
        block_size: tokens per KV block (the last block of a sequence may be partial; a block past ``S`` is
            the one block of the whole cache).
        order: traversal order name or explicit permutation (see :mod:`art_analysis.orders`).
        cache_seqlens: ``[B]`` valid tokens per sequence, ``1 <= len <= S`` (default ``S``).
        selection: ``BoolTensor [B, Hkv, ceil(S / block_size)]``, the blocks a KV-selection
            policy keeps; every ``(b, kv_head)`` must keep at least one block with valid tokens.
        sm_scale: softmax scale, default ``D ** -0.5``.
        mode: ``"exact"`` (float64) or ``"kernel"`` (float32 online recurrence).
        block_scores: ``[B, Hkv, nb]`` scores for ``order="importance"`` (only; another order refuses them).

    Returns:
        A :class:`BlockTrace`.
    """
    seqlens, sm_scale = _validate(q, k, v, block_size, cache_seqlens, selection, sm_scale, mode)
    batch, kv_heads, seqlen, _ = k.shape
    num_blocks = math.ceil(seqlen / block_size)
    walkable = walkable_blocks(seqlens, kv_heads, num_blocks, block_size, selection)
    if not walkable.any(-1).all():
        raise ValueError("every (b, kv_head) must keep at least one block holding valid tokens; "
                         "the selection drops all of them for some (b, kv_head)")
    block_ids = traversal_order(order, walkable, block_scores)
    block_start = block_ids.clamp(min=0) * block_size
    block_tokens = torch.where(block_ids >= 0,
                               (seqlens[:, None, None].long() - block_start).clamp(max=block_size), 0)
    run = _exact if mode == "exact" else _kernel
    # A block past the cache is its one block: walked as S tokens, not padded to block_size (which may be huge).
    state = run(q, k, v, block_ids, seqlens, min(block_size, seqlen), sm_scale)
    return BlockTrace(**state, block_ids=block_ids, block_tokens=block_tokens,
                      num_steps=(block_ids >= 0).sum(-1).amax(-1), block_size=block_size,
                      sm_scale=sm_scale, mode=mode)


class BlockwiseAttention(nn.Module):
    """``nn.Module`` form of :func:`blockwise_attention` for use inside models.

    ``forward(q [B, Hq, D], k [B, Hkv, S, D], v, cache_seqlens=None, selection=None, block_scores=None)``
    returns the :class:`BlockTrace`; its ``final_out`` is the attention output.
    """

    def __init__(self, block_size: int = 64, order: str | torch.Tensor = "sink_recency",
                 sm_scale: float | None = None, mode: str = "exact"):
        super().__init__()
        self.block_size, self.order, self.sm_scale, self.mode = block_size, order, sm_scale, mode

    def forward(self, q, k, v, cache_seqlens=None, selection=None, block_scores=None) -> BlockTrace:
        return blockwise_attention(q, k, v, block_size=self.block_size, order=self.order,
                                   cache_seqlens=cache_seqlens, selection=selection,
                                   sm_scale=self.sm_scale, mode=self.mode, block_scores=block_scores)


def check_decode_call(q, k, v, cache_seqlens=None, sm_scale=None) -> tuple[torch.Tensor, float]:
    """One decode attention call's inputs, as :func:`blockwise_attention` and the studies take them: ``q [B, Hq, D]``
    and ``k, v [B, Hkv, S, D]`` floating, non-empty, on one device, ``Hq`` a multiple of ``Hkv``, finite (the cache
    among its valid tokens), ``cache_seqlens [B]`` in ``[1, S]`` (default ``S``) and a positive ``sm_scale``
    (default ``D ** -0.5``); returns ``(cache_seqlens, sm_scale)`` filled in, else ``ValueError`` / ``TypeError``."""
    check_float_tensor(q, "q", "[B, Hq, D]")
    check_kv_cache(k, v)
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    if q.device != k.device:
        raise ValueError(f"q and k, v must be on one device, got {q.device} and {k.device}")
    batch, q_heads, dim = q.shape
    if min(batch, q_heads, dim) < 1:
        raise ValueError(f"q must have non-empty dims [B, Hq, D], got {tuple(q.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"q has batch {batch} but k has batch {k.shape[0]}")
    if k.shape[-1] != dim:
        raise ValueError(f"head dim mismatch: q has D={dim}, k and v have D={k.shape[-1]}")
    kv_heads, seqlen = k.shape[1], k.shape[2]
    if q_heads % kv_heads != 0:
        raise ValueError(f"Hq % Hkv must be 0 (query head h reads KV head h // (Hq // Hkv)); "
                         f"got Hq={q_heads}, Hkv={kv_heads}")
    seqlens = check_cache_seqlens(cache_seqlens, batch, seqlen, k.device)
    check_finite_cache(k, v, seqlens)
    check_finite(q=q)
    return seqlens, softmax_scale(sm_scale, dim)


def _validate(q, k, v, block_size, cache_seqlens, selection, sm_scale, mode):
    seqlens, sm_scale = check_decode_call(q, k, v, cache_seqlens, sm_scale)
    check_block_size(block_size)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if selection is not None:
        batch, kv_heads, seqlen, _ = k.shape
        num_blocks = math.ceil(seqlen / block_size)
        if not isinstance(selection, torch.Tensor) or selection.dtype != torch.bool:
            raise TypeError("selection must be a BoolTensor [B, Hkv, num_blocks]")
        if tuple(selection.shape) != (batch, kv_heads, num_blocks):
            raise ValueError(f"selection must have shape {(batch, kv_heads, num_blocks)}, "
                             f"got {tuple(selection.shape)}")
        if selection.device != k.device:
            raise ValueError(f"selection must be on k's device {k.device}, got {selection.device}")
    return seqlens, sm_scale


def _to_query_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, G, ...]`` -> ``[B, Hkv * G, ...]`` (query head ``h = kv_head * G + g``)."""
    return x.flatten(1, 2)


def _exact(q, k, v, block_ids, seqlens, block_size, sm_scale):
    batch, kv_heads, seqlen, dim = k.shape
    group = q.shape[1] // kv_heads
    num_blocks = math.ceil(seqlen / block_size)
    qg = q.to(torch.float64).view(batch, kv_heads, group, dim) * sm_scale
    block_lse = q.new_empty((batch, kv_heads, group, num_blocks), dtype=torch.float64)
    block_max = torch.empty_like(block_lse)
    block_mean = q.new_empty((batch, kv_heads, group, num_blocks, dim), dtype=torch.float64)
    chunk_blocks = max(1, EXACT_CHUNK_TOKENS // block_size)
    positions = torch.arange(seqlen, device=k.device)
    for first in range(0, num_blocks, chunk_blocks):
        last = min(first + chunk_blocks, num_blocks)
        start, stop = first * block_size, min(last * block_size, seqlen)
        width = (last - first) * block_size
        valid = positions[start:start + width][None, :] < seqlens[:, None]              # [B, width]
        if stop - start < width:                                                        # a partial last block
            valid = nn.functional.pad(valid, (0, width - (stop - start)), value=False)
        scores = q.new_full((batch, kv_heads, group, width), float("-inf"), dtype=torch.float64)
        scores[..., :stop - start] = torch.einsum("bhgd,bhld->bhgl", qg, k[:, :, start:stop].to(torch.float64))
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        # Tokens past cache_seqlens are never read: zero them so garbage there cannot leak in.
        values = v.new_zeros((batch, kv_heads, width, dim), dtype=torch.float64)
        values[:, :, :stop - start] = v[:, :, start:stop]
        values.masked_fill_(~valid[:, None, :, None], 0.0)
        scores = scores.view(batch, kv_heads, group, last - first, block_size)
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse[..., None]).nan_to_num(nan=0.0)
        values = values.view(batch, kv_heads, last - first, block_size, dim)
        block_lse[..., first:last] = lse
        block_max[..., first:last] = scores.amax(-1)
        block_mean[..., first:last, :] = torch.einsum("bhgnl,bhnld->bhgnd", weights, values)

    real = (block_ids >= 0)[:, :, None, :]
    index = block_ids.clamp(min=0)[:, :, None, :].expand(-1, -1, group, -1)
    lse_t = torch.gather(block_lse, -1, index).masked_fill(~real, float("-inf"))
    max_t = torch.gather(block_max, -1, index).masked_fill(~real, float("-inf"))
    mean_t = torch.gather(block_mean, 3, index[..., None].expand(-1, -1, -1, -1, dim))
    total = torch.logsumexp(lse_t, dim=-1, keepdim=True)
    share = torch.exp(lse_t - total)
    # O^(t) = sum_{u<=t} e^{L_u} Obar_u / sum_{u<=t} e^{L_u}, every sum in the log domain.
    prefix = torch.logcumsumexp(lse_t, dim=-1)[..., None]
    positive = torch.logcumsumexp(lse_t[..., None] + torch.log(mean_t.clamp(min=0)), dim=3)
    negative = torch.logcumsumexp(lse_t[..., None] + torch.log((-mean_t).clamp(min=0)), dim=3)
    partial = torch.exp(positive - prefix) - torch.exp(negative - prefix)
    running_max = torch.cummax(max_t, dim=-1).values
    running_sum = torch.exp(torch.logcumsumexp(lse_t, dim=-1) - running_max)
    contribution = share * torch.linalg.vector_norm(mean_t, dim=-1)
    return dict(
        partial_out=_to_query_heads(partial),
        accumulator=_to_query_heads(partial * running_sum[..., None]),
        running_max=_to_query_heads(running_max),
        running_sum=_to_query_heads(running_sum),
        block_mass=_to_query_heads(share),
        block_contribution=_to_query_heads(contribution),
        final_out=_to_query_heads(partial[..., -1, :]),
    )


def _kernel(q, k, v, block_ids, seqlens, block_size, sm_scale):
    batch, kv_heads, seqlen, dim = k.shape
    group = q.shape[1] // kv_heads
    steps = block_ids.shape[-1]
    num_blocks = math.ceil(seqlen / block_size)
    pad = num_blocks * block_size - seqlen
    if pad:
        k = nn.functional.pad(k, (0, 0, 0, pad))
        v = nn.functional.pad(v, (0, 0, 0, pad))
    k_blocks = k.reshape(batch, kv_heads, num_blocks, block_size * dim)
    v_blocks = v.reshape(batch, kv_heads, num_blocks, block_size * dim)
    qg = q.to(torch.float32).view(batch, kv_heads, group, dim)
    offsets = torch.arange(block_size, device=k.device)
    value_dtype = v.dtype if v.dtype in (torch.float16, torch.bfloat16) else torch.float32

    m = torch.full((batch, kv_heads, group), float("-inf"), device=k.device)
    l = torch.zeros((batch, kv_heads, group), device=k.device)
    acc = torch.zeros((batch, kv_heads, group, dim), device=k.device)
    out_t, acc_t, m_t, l_t, mass_t, contrib_t = ([] for _ in range(6))
    for t in range(steps):
        ids = block_ids[..., t]
        real = ids >= 0
        index = ids.clamp(min=0)[..., None, None].expand(-1, -1, 1, block_size * dim)
        kb = torch.gather(k_blocks, 2, index).view(batch, kv_heads, block_size, dim).to(torch.float32)
        vb = torch.gather(v_blocks, 2, index).view(batch, kv_heads, block_size, dim).to(torch.float32)
        scores = torch.einsum("bhgd,bhld->bhgl", qg, kb) * sm_scale
        valid = (ids.clamp(min=0)[..., None] * block_size + offsets) < seqlens[:, None, None]
        scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
        vb = vb.masked_fill(~valid[..., None], 0.0)
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[..., None])
        block_sum = p.sum(-1)
        block_out = torch.einsum("bhgl,bhld->bhgd", p.to(value_dtype).to(torch.float32), vb)
        keep = real[..., None]
        m = torch.where(keep, m_new, m)
        l = torch.where(keep, alpha * l + block_sum, l)
        acc = torch.where(keep[..., None], alpha[..., None] * acc + block_out, acc)
        out_t.append(acc / l[..., None])
        acc_t.append(acc)
        m_t.append(m)
        l_t.append(l)
        mass_t.append(torch.where(keep, block_sum, 0.0))
        contrib_t.append(torch.where(keep, torch.linalg.vector_norm(block_out, dim=-1), 0.0))
    running_max = torch.stack(m_t, -1)
    # Rescale each step's block mass and output from its own reference max m^(t) to the final one.
    to_final = torch.exp(running_max - running_max[..., -1:]) / l[..., None]
    partial = torch.stack(out_t, 3)
    return dict(
        partial_out=_to_query_heads(partial),
        accumulator=_to_query_heads(torch.stack(acc_t, 3)),
        running_max=_to_query_heads(running_max),
        running_sum=_to_query_heads(torch.stack(l_t, -1)),
        block_mass=_to_query_heads(torch.stack(mass_t, -1) * to_final),
        block_contribution=_to_query_heads(torch.stack(contrib_t, -1) * to_final),
        final_out=_to_query_heads(partial[..., -1, :]),
    )
