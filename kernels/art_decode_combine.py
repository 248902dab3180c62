"""Log-sum-exp combine of the split-K partial results of ``art_decode_split_kernel``.

For one query head with split partials ``o_s [D]`` (normalised) and ``lse_s``::

    w_s = exp(lse_s - max_s lse_s);  out = sum_s w_s o_s / sum_s w_s;  lse = max + log(sum_s w_s)

Empty splits carry ``lse_s = -inf`` and weigh 0.  When the ``(b, kv_head)`` *converged* flag
(a bit of its arrival counter) is set, the leader split (split 0) stopped the walk and only its partial is kept: the
followers' blocks lie after the stop step in the traversal order.

:func:`combine_group` runs inside the split kernel, in the program of a ``(b, kv_head)``
that finishes last (``kernels.art_decode_kernel``): it merges the partials of all the query
heads of the group, which the other programs wrote before it acquired the arrival counter.
The partials are read with ``.cg`` loads (L2, never a stale L1 line).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def combine_group(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, b, kv_head, kept_splits,
                  num_kv_heads, num_splits, stride_ob, stride_oh,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                  CHUNK_S: tl.constexpr):
    """Merge splits ``[0, kept_splits)`` of the ``GROUP`` query heads of ``(b, kv_head)``.

    ``part_out [B, Hq, splits, D]``, ``part_lse [B, Hq, splits]`` (fp32) -> ``out [B, Hq, D]``
    (its dtype) and ``lse [B, Hq]``; ``BLOCK_G >= GROUP``, ``BLOCK_S >= num_splits``, both powers
    of two; the partials are read ``CHUNK_S`` splits at a time.
    """
    group = tl.arange(0, BLOCK_G)
    group_valid = group < GROUP
    heads = kv_head * GROUP + group
    rows = (b.to(tl.int64) * num_kv_heads * GROUP + heads) * num_splits          # [BLOCK_G]
    splits = tl.arange(0, BLOCK_S)
    keep = group_valid[:, None] & (splits[None, :] < kept_splits)
    lse = tl.load(part_lse_ptr + rows[:, None] + splits[None, :], mask=keep, other=float("-inf"),
                  cache_modifier=".cg")
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(group_valid, lse_max, 0.0)
    denom = tl.sum(tl.where(keep, tl.exp(lse - lse_max[:, None]), 0.0), 1)

    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for first in tl.range(0, kept_splits, CHUNK_S):
        chunk = first + tl.arange(0, CHUNK_S)
        chunk_keep = group_valid[:, None] & (chunk[None, :] < kept_splits)                # [BLOCK_G, CHUNK_S]
        chunk_rows = rows[:, None] + chunk[None, :]
        chunk_lse = tl.load(part_lse_ptr + chunk_rows, mask=chunk_keep, other=float("-inf"), cache_modifier=".cg")
        weight = tl.where(chunk_keep, tl.exp(chunk_lse - lse_max[:, None]), 0.0)
        part = tl.load(part_out_ptr + chunk_rows[:, :, None] * HEAD_DIM + dims[None, None, :],
                       mask=chunk_keep[:, :, None], other=0.0, cache_modifier=".cg")
        acc += tl.sum(weight[:, :, None] * part, 1)
    denom_safe = tl.where(group_valid, denom, 1.0)
    out_rows = b.to(tl.int64) * stride_ob + heads.to(tl.int64) * stride_oh
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], (acc / denom_safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=group_valid[:, None])
    tl.store(lse_ptr + b.to(tl.int64) * num_kv_heads * GROUP + heads, lse_max + tl.log(denom_safe), mask=group_valid)
