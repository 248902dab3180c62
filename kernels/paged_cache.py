"""A contiguous KV cache scattered into a shuffled page pool: the paged layout of ``art_decode``.

``to_paged(k, v, page_size)`` turns ``k, v [B, Hkv, S, D]`` into ``k_pages, v_pages [num_pages, page_size,
Hkv, D]`` and ``block_table [B, ceil(S / page_size)]`` (int32), sequence ``b``'s page ``i`` at pool row
``block_table[b, i]``.  The pages are handed out in a random order, as an allocator that has served many
sequences would, and the pool holds ``spare_pages`` pages no sequence owns; spare pages and the slots past
``S`` in each sequence's last page hold random values, which a kernel must never let reach its output.
"""
from __future__ import annotations

import math

import torch

from .int_checks import check_count


def kv_strides(cache: torch.Tensor, paged: bool) -> tuple[int, int, int]:
    """The strides the decode kernels address a K or V cache by: ``(leading index, KV head, token)``, the leading index
    being the sequence of a contiguous ``[B, Hkv, S, D]`` cache or the page of a paged ``[num_pages, page_size, Hkv,
    D]`` pool, whose token stride is the slot's."""
    if paged:
        return cache.stride(0), cache.stride(2), cache.stride(1)
    return cache.stride(0), cache.stride(1), cache.stride(2)


def to_paged(k: torch.Tensor, v: torch.Tensor, page_size: int, *, seed: int = 0,
             spare_pages: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter ``k, v [B, Hkv, S, D]`` into shuffled pages of ``page_size`` tokens (see the module docstring).

    Returns ``k_pages, v_pages [B * ceil(S / page_size) + spare_pages, page_size, Hkv, D]`` (dtype and device
    of ``k``) and ``block_table [B, ceil(S / page_size)]`` int32 on the same device; ``seed`` fixes the page
    order and the random values."""
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError(f"k and v must be tensors, got {type(k).__name__} and {type(v).__name__}")
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [B, Hkv, S, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if v.dtype != k.dtype or v.device != k.device:
        raise ValueError("k and v must share dtype and device, "
                         f"got {k.dtype} on {k.device} and {v.dtype} on {v.device}")
    check_count(page_size, "page_size", 1)
    check_count(spare_pages, "spare_pages", 0)
    batch, kv_heads, seqlen, dim = k.shape
    per_seq = math.ceil(seqlen / page_size)
    num_pages = batch * per_seq + spare_pages
    generator = torch.Generator(device=k.device).manual_seed(seed)
    table = torch.randperm(num_pages, generator=generator, device=k.device)[:batch * per_seq].view(batch, per_seq)
    pos = torch.arange(seqlen, device=k.device)
    # token t of sequence b sits in slot t % page_size of page table[b, t // page_size]; every other slot (spare
    # pages, the last page past S) keeps the pool's random values, like a pool that was never cleared
    slots = (table[:, pos // page_size] * page_size + pos % page_size).flatten()
    pools = []
    for x in (k, v):
        pool = torch.empty(num_pages, page_size, kv_heads, dim, dtype=x.dtype, device=x.device)
        pool.normal_(generator=generator)
        pool.view(-1, kv_heads, dim)[slots] = x.permute(0, 2, 1, 3).reshape(-1, kv_heads, dim)
        pools.append(pool)
    return pools[0], pools[1], table.to(torch.int32)
