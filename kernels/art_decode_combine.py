"""Log-sum-exp combine of the split-K partial results of ``art_decode_split_kernel``.

For one query head with split partials ``o_s [D]`` (normalised) and ``lse_s``::

    w_s = exp(lse_s - max_s lse_s);  out = sum_s w_s o_s / sum_s w_s;  lse = max + log(sum_s w_s)

Empty splits carry ``lse_s = -inf`` and weigh 0.  When the ``(b, kv_head)`` *converged* flag
is set, the leader split (split 0) stopped the walk and only its partial is kept: the
followers' blocks lie after the stop step in the traversal order.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def art_decode_combine_kernel(part_out_ptr, part_lse_ptr, flag_ptr, out_ptr, lse_ptr,
                              num_q_heads, num_splits, stride_ob, stride_oh,
                              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                              CHUNK_S: tl.constexpr, USE_FLAG: tl.constexpr):
    """Grid ``(B * Hq,)``: ``part_out [B, Hq, splits, D]``, ``part_lse [B, Hq, splits]`` -> ``out``, ``lse``."""
    row = tl.program_id(0).to(tl.int64)
    b = row // num_q_heads
    head = row % num_q_heads
    kept_splits = num_splits
    if USE_FLAG:
        converged = tl.load(flag_ptr + b * (num_q_heads // GROUP) + head // GROUP)
        kept_splits = tl.where(converged == 0, num_splits, 1)
    splits = tl.arange(0, BLOCK_S)
    keep = splits < kept_splits
    lse = tl.load(part_lse_ptr + row * num_splits + splits, mask=keep, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    denom = tl.sum(tl.where(keep, tl.exp(lse - lse_max), 0.0), 0)

    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for first in tl.range(0, num_splits, CHUNK_S):
        chunk = first + tl.arange(0, CHUNK_S)
        chunk_keep = chunk < kept_splits
        chunk_lse = tl.load(part_lse_ptr + row * num_splits + chunk, mask=chunk_keep, other=float("-inf"))
        weight = tl.where(chunk_keep, tl.exp(chunk_lse - lse_max), 0.0)
        part = tl.load(part_out_ptr + (row * num_splits + chunk)[:, None] * HEAD_DIM + dims[None, :],
                       mask=chunk_keep[:, None], other=0.0)
        acc += tl.sum(weight[:, None] * part, 0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + dims, (acc / denom).to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + row, lse_max + tl.log(denom))
