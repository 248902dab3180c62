"""A policy followed by ART: in the simulator and through the paged decode kernel.

A policy keeps blocks per ``(b, kv_head)``, while a paged kernel reads one block table per
*sequence*, shared by all its KV heads.  So the paged form treats every ``(b, kv_head)`` as a
sequence of its own with one KV head (:func:`paged_selection`): its kept blocks, in
increasing block id, become its block table, and the query heads of that KV head become its
``G = Hq // Hkv`` query heads.  Nothing is lost: the kernel serves one ``(b, kv_head)`` per
program anyway.  Keeping block ids increasing puts the only partial block (a sequence's last)
at the end of the table, where the kernel's length mask expects it.

:func:`paged_art_decode` runs ``kernels.art_decode`` on that layout.  The kernel walks the
table in its traversal order; :func:`walk_order` gives the original
block ids it visits, step by step, which is the explicit order :func:`simulate_policy` hands
the simulator, so the two walk the same blocks in the same order:

* ``"sequential"``: kept blocks oldest first;
* ``"recency"``: kept blocks newest first;
* ``"sink_recency"``: the first kept block (block 0, the attention sink, whenever the policy
  keeps it), then the other kept blocks newest first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.int_checks import check_choice

from ..blockwise import BlockTrace, blockwise_attention
from ..checks import check_block_size, check_cache_seqlens
from ..orders import walkable_blocks
from .base import SelectionPolicy

WALK_ORDERS = ("sequential", "recency", "sink_recency")


@dataclass
class PolicyTrace:
    """A policy's selection and the simulator's walk over it.

    Attributes:
        selection: ``BoolTensor [B, Hkv, nb]`` blocks the policy keeps.
        order: ``LongTensor [B, Hkv, T]`` block ids in walk order (-1 padded).
        trace: the :class:`~art_analysis.blockwise.BlockTrace` of that walk.
    """

    selection: torch.Tensor
    order: torch.Tensor
    trace: BlockTrace


@dataclass
class PagedSelection:
    """A selection laid out for the paged kernel, one sequence per ``(b, kv_head)``.

    Attributes:
        q: ``[B * Hkv, G, D]`` queries (row ``b * Hkv + h`` holds query heads ``h*G .. h*G+G-1``).
        k_cache, v_cache: ``[B * Hkv * nb, block_size, 1, D]`` pages; page ``(b * Hkv + h) * nb + j``
            holds block ``j`` of ``(b, h)``, zero-padded past ``S``.
        block_table: ``int32 [B * Hkv, max_kept]`` pages of the kept blocks by increasing block id
            (padding entries point at page 0 and lie past the sequence's length).
        cache_seqlens: ``int32 [B * Hkv]`` valid tokens in the kept blocks.
        batch, kv_heads: ``B`` and ``Hkv`` of the original cache.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    batch: int
    kv_heads: int

    def unflatten_heads(self, out: torch.Tensor) -> torch.Tensor:
        """Kernel output ``[B * Hkv, G, ...]`` -> ``[B, Hq, ...]``."""
        return out.reshape(self.batch, -1, *out.shape[2:])

    def unflatten_steps(self, steps: torch.Tensor) -> torch.Tensor:
        """Kernel stats ``[B * Hkv, 1, splits]`` (one KV head per sequence) -> ``[B, Hkv, splits]``."""
        return steps.reshape(self.batch, self.kv_heads, steps.shape[-1])


@dataclass
class KernelRun:
    """What the paged kernel returns for a selection.

    Attributes:
        out: ``[B, Hq, D]`` attention output (``q``'s dtype).
        steps: ``int32 [B, Hkv, splits]`` KV blocks loaded per program; with one split,
            ``steps - 1`` is the simulator's ``stop_step`` of the group.
    """

    out: torch.Tensor
    steps: torch.Tensor


def walk_order(selection: torch.Tensor, order: str, *, block_size: int,
               cache_seqlens: torch.Tensor | None = None, seqlen: int | None = None) -> torch.Tensor:
    """Original block ids the paged kernel visits over the kept blocks: ``LongTensor [B, Hkv, T]``, -1 padded.

    Args:
        selection: ``BoolTensor [B, Hkv, nb]``.
        order: one of :data:`WALK_ORDERS` (see the module docstring).
        block_size: tokens per block.
        cache_seqlens: ``[B]`` valid tokens (default ``seqlen``); blocks past them are dropped.
        seqlen: ``S``, the cache length (default ``nb * block_size``).
    """
    if not isinstance(selection, torch.Tensor) or selection.dtype != torch.bool or selection.dim() != 3:
        raise TypeError("selection must be a BoolTensor [B, Hkv, num_blocks]")
    if order not in WALK_ORDERS:
        raise ValueError(f"order must be one of {WALK_ORDERS} for a paged walk, got {order!r}")
    batch, kv_heads, num_blocks = selection.shape
    block_size = check_block_size(block_size)
    if seqlen is not None and not (isinstance(seqlen, int) and not isinstance(seqlen, bool)
                                   and (num_blocks - 1) * block_size < seqlen <= num_blocks * block_size):
        raise ValueError(f"seqlen must be an int in ({(num_blocks - 1) * block_size}, {num_blocks * block_size}]: "
                         f"the {num_blocks} blocks of {block_size} tokens the selection covers, got {seqlen!r}")
    seqlens = check_cache_seqlens(cache_seqlens, batch, num_blocks * block_size if seqlen is None else seqlen,
                                  selection.device)
    kept = walkable_blocks(seqlens, kv_heads, num_blocks, block_size, selection)
    # Rank of each kept block in increasing id (its row in the block table).
    position = torch.cumsum(kept.long(), dim=-1) - 1
    count = kept.sum(-1, keepdim=True)
    if order == "sequential":
        step = position
    elif order == "recency":
        step = count - 1 - position
    else:
        step = torch.where(position == 0, 0, count - position)
    steps = int(count.max()) if count.numel() else 0
    walk = torch.full((batch, kv_heads, steps + 1), -1, dtype=torch.long, device=selection.device)
    target = torch.where(kept, step, steps)
    ids = torch.arange(num_blocks, device=selection.device)
    walk.scatter_(-1, target, torch.where(kept, ids, -1).expand_as(target))
    return walk[..., :steps]


def simulate_policy(policy: SelectionPolicy, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    queries: torch.Tensor | None = None, layer: int | None = None, num_layers: int | None = None,
                    block_size: int = 64, order: str = "sink_recency", cache_seqlens: torch.Tensor | None = None,
                    sm_scale: float | None = None, mode: str = "exact") -> PolicyTrace:
    """Select with ``policy``, then walk the kept blocks in the paged kernel's ``order``.

    Args:
        policy: any :class:`~art_analysis.policies.base.SelectionPolicy`.
        q: ``[B, Hq, D]`` decode queries.
        k, v: ``[B, Hkv, S, D]``.
        queries: ``[B, Hq, Nq, D]`` for query-aware policies; default: the decode query itself,
            ``q[:, :, None]`` (Quest's setting; for SnapKV and H2O pass an observation window).
        layer, num_layers, block_size, cache_seqlens: passed to ``policy.select`` and the walk.
        order: one of :data:`WALK_ORDERS`.
        sm_scale, mode: passed to :func:`~art_analysis.blockwise.blockwise_attention`; ``sm_scale`` (the
            model's softmax scale, default ``D ** -0.5``) also scores a policy whose own ``sm_scale`` is ``None``
            (:meth:`~art_analysis.policies.base.SelectionPolicy.with_sm_scale`).

    Apply a stopping rule with ``art_analysis.termination.stop(result.trace, rule)``.
    """
    if not isinstance(policy, SelectionPolicy):
        raise TypeError(f"policy must be a SelectionPolicy (policies.make(name, ...) or policies.parse_spec(spec) "
                        f"builds one), got {type(policy).__name__}")
    if not (isinstance(q, torch.Tensor) and q.dim() == 3):
        described = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be [B, Hq, D] decode queries, got {described}")
    if queries is None and policy.needs_queries:
        queries = q[:, :, None]
    policy = policy.with_sm_scale(sm_scale)
    selection = policy.select(k, v, queries=queries, layer=layer, num_layers=num_layers, block_size=block_size,
                              cache_seqlens=cache_seqlens)
    walk = walk_order(selection, order, block_size=block_size, cache_seqlens=cache_seqlens, seqlen=k.shape[2])
    trace = blockwise_attention(q, k, v, block_size=block_size, order=walk, cache_seqlens=cache_seqlens,
                                selection=selection, sm_scale=sm_scale, mode=mode)
    return PolicyTrace(selection=selection, order=walk, trace=trace)


def paged_selection(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: torch.Tensor, *,
                    block_size: int, cache_seqlens: torch.Tensor | None = None) -> PagedSelection:
    """Lay out a selection for the paged kernel (see the module docstring and :class:`PagedSelection`).

    Args:
        q: ``[B, Hq, D]``; k, v: ``[B, Hkv, S, D]``; selection: ``BoolTensor [B, Hkv, ceil(S / block_size)]``.
        block_size: tokens per block, which is also the page size: one of the kernel's
            ``kernels.art_decode.BLOCK_SIZES``.
        cache_seqlens: ``[B]`` valid tokens (default ``S``).
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v, selection)):
        raise TypeError("q, k, v and selection must be torch tensors")
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"expected q [B, Hq, D] and k, v [B, Hkv, S, D] with Hq % Hkv == 0, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, kv_heads, seqlen, dim = k.shape
    from kernels.art_decode import BLOCK_SIZES

    check_choice(block_size, "block_size (the kernel's page and block size)", BLOCK_SIZES)
    num_blocks = -(-seqlen // block_size)
    if selection.dtype != torch.bool or tuple(selection.shape) != (batch, kv_heads, num_blocks):
        raise ValueError(f"selection must be a BoolTensor of shape {(batch, kv_heads, num_blocks)}")
    seqlens = check_cache_seqlens(cache_seqlens, batch, seqlen, k.device)
    walk = walk_order(selection, "sequential", block_size=block_size, cache_seqlens=seqlens, seqlen=seqlen)
    if walk.shape[-1] == 0 or (walk[..., 0] < 0).any():
        raise ValueError("every (b, kv_head) must keep at least one block holding valid tokens")
    pad = num_blocks * block_size - seqlen
    pages = [torch.nn.functional.pad(t, (0, 0, 0, pad)).reshape(batch * kv_heads * num_blocks, block_size, 1, dim)
             for t in (k, v)]
    first_page = (torch.arange(batch * kv_heads, device=k.device) * num_blocks).view(batch, kv_heads, 1)
    table = torch.where(walk >= 0, first_page + walk, 0)
    tokens = torch.where(walk >= 0, (seqlens[:, None, None] - walk * block_size).clamp(max=block_size), 0)
    return PagedSelection(q=q.reshape(batch * kv_heads, -1, dim), k_cache=pages[0], v_cache=pages[1],
                          block_table=table.reshape(batch * kv_heads, -1).to(torch.int32).contiguous(),
                          cache_seqlens=tokens.sum(-1).reshape(-1).to(torch.int32), batch=batch, kv_heads=kv_heads)


def paged_art_decode(paged: PagedSelection, *, art=None, order: str = "sink_recency", sm_scale: float | None = None,
                     num_splits: int | None = None) -> KernelRun:
    """Run ``kernels.art_decode`` over a :class:`PagedSelection` (block size = page size).

    Args:
        paged: from :func:`paged_selection`.
        art: ``kernels.art_params.ARTParams`` (``ARTConfig.kernel_params()``) or ``None`` (dense).
        order: ``"sequential"`` or ``"sink_recency"`` over each table (see :func:`walk_order`).
        sm_scale, num_splits: passed to the kernel.
    """
    from kernels.art_decode import art_decode

    if not isinstance(paged, PagedSelection):
        raise TypeError(f"paged must be a PagedSelection (see paged_selection), got {type(paged).__name__}")
    out, steps = art_decode(paged.q, paged.k_cache, paged.v_cache, cache_seqlens=paged.cache_seqlens,
                            block_table=paged.block_table, sm_scale=sm_scale, art=art, order=order,
                            block_size=paged.k_cache.shape[1], num_splits=num_splits, return_stats=True)
    return KernelRun(out=paged.unflatten_heads(out), steps=paged.unflatten_steps(steps))
