"""Triton kernel: causal block-sparse prefill attention over per-row key-block lists.

One program computes ``BLOCK_M`` query rows of one query head.  Its query block's key-block
list (``COLS``, ascending, ``COUNTS`` entries) is walked with a FlashAttention-2 online
softmax in base 2.  Because the list is ascending and causal, only its last entry can be the
diagonal block: every earlier block is walked without any mask, and the diagonal block alone
gets the causal mask.  The readable reference is ``art_analysis.flexprefill.sparse_attention``.

Q, K, V are read and O is written through ``[B, H, N, D]`` tensor descriptors made on the host
and passed by value (bulk copies on Hopper; a descriptor built inside the kernel costs every
program a tensor-map write and its fences, which short key lists do not repay): rows past ``N``
load as zeros and are not stored, so ragged lengths need no masks, and the software pipeliner
overlaps the copies with the two matrix products.  Descriptor coordinates are int32.
:func:`column_table_kernel` builds the per-row key-block lists from a block mask on the device.
"""
import triton
import triton.language as tl


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_desc, v_desc, b, kv_h, key_start, offs_m, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over keys ``[key_start, key_start + BLOCK_N)``; returns (acc, m, l).

    ``MASKED``: the diagonal block, where key ``j`` is visible to row ``i`` iff ``j <= i`` (keys
    past ``N`` read as zeros and only rows past ``N``, never stored, can see them)."""
    k = k_desc.load([b, kv_h, key_start, 0]).reshape(BLOCK_N, HEAD_DIM)
    qk = tl.dot(q, tl.trans(k))
    if MASKED:
        offs_n = key_start + tl.arange(0, BLOCK_N)
        qk = tl.where(offs_n[None, :] <= offs_m[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([b, kv_h, key_start, 0]).reshape(BLOCK_N, HEAD_DIM)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def block_sparse_attention_kernel(
        q_desc, k_desc, v_desc, o_desc, LSE, COLS, COUNTS,
        qk_scale, seqlen, num_q_heads, group, num_q_programs,
        stride_lb, stride_lh, stride_ln,
        stride_cb, stride_ch, stride_cq, stride_cc,
        stride_nb, stride_nh, stride_nq,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        RETURN_LSE: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """One program per ``(query tile, b * Hq)``; the last query rows (the longest lists) start first.

    Grid ``(ceil(N / BLOCK_M), B * Hq)``, or with ``HEADS_FIRST`` ``(B * Hq, ceil(N / BLOCK_M))`` so
    that the query heads of one KV head (and all heads) run the same query tile side by side.
    q_desc, o_desc: descriptors of ``[B, Hq, N, D]`` tensors, k_desc, v_desc of ``[B, Hkv, N, D]``, with
    blocks ``[1, 1, BLOCK_M or BLOCK_N, D]``; LSE: ``[B, Hq, N]`` float32 (natural log);
    COLS: ``[B, Hq, nb, >= max count]`` int32 ascending key blocks; COUNTS: ``[B, Hq, nb]`` int32.
    ``qk_scale`` = softmax scale * log2(e).
    BLOCK_M and BLOCK_N divide BLOCK_SIZE.
    """
    SUB_TILES: tl.constexpr = BLOCK_SIZE // BLOCK_N
    if HEADS_FIRST:
        pid_m = num_q_programs - 1 - tl.program_id(1)
        pid_bh = tl.program_id(0)
    else:
        pid_m = num_q_programs - 1 - tl.program_id(0)
        pid_bh = tl.program_id(1)
    b = pid_bh // num_q_heads
    h = pid_bh % num_q_heads
    kv_h = h // group
    q_block = (pid_m * BLOCK_M) // BLOCK_SIZE
    first_row = pid_m * BLOCK_M
    offs_m = first_row + tl.arange(0, BLOCK_M)
    q = q_desc.load([b, h, first_row, 0]).reshape(BLOCK_M, HEAD_DIM)

    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    cols = COLS + b64 * stride_cb + h64 * stride_ch + q_block * stride_cq
    count = tl.load(COUNTS + b64 * stride_nb + h64 * stride_nh + q_block * stride_nq)
    last = tl.load(cols + (count - 1) * stride_cc, mask=count > 0, other=-1)
    has_diagonal = last == q_block
    unmasked_steps = (count - has_diagonal.to(tl.int32)) * SUB_TILES

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for step in range(0, unmasked_steps):
        col = tl.load(cols + (step // SUB_TILES) * stride_cc)
        key_start = col * BLOCK_SIZE + (step % SUB_TILES) * BLOCK_N
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_desc, v_desc, b, kv_h, key_start, offs_m, qk_scale,
                                     HEAD_DIM, BLOCK_N, False)
    if has_diagonal:
        diagonal_steps = (first_row + BLOCK_M - 1 - q_block * BLOCK_SIZE) // BLOCK_N + 1
        for sub in range(0, diagonal_steps):
            key_start = q_block * BLOCK_SIZE + sub * BLOCK_N
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_desc, v_desc, b, kv_h, key_start, offs_m, qk_scale,
                                         HEAD_DIM, BLOCK_N, True)

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_desc.store([b, h, first_row, 0], out.to(q.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    if RETURN_LSE:
        lse = tl.where(nonempty, (m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(LSE + b64 * stride_lb + h64 * stride_lh + offs_m.to(tl.int64) * stride_ln, lse, mask=offs_m < seqlen)


@triton.jit
def column_table_kernel(MASK, COLS, COUNTS, num_blocks, num_heads,
                        stride_mb, stride_mh, stride_mq, stride_mk,
                        stride_cb, stride_ch, stride_cq, stride_cc,
                        stride_nb, stride_nh, stride_nq,
                        CHUNK: tl.constexpr):
    """Per query block, its kept key blocks ``<=`` the diagonal in ascending order.

    MASK ``[B, H, nb, nb]`` (uint8 view of bool); COLS ``[B, H, nb, nb]`` int32 (entries past the
    count are left unwritten); COUNTS ``[B, H, nb]`` int32.  Grid ``(nb, B * H)``."""
    row = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    mask_row = MASK + b * stride_mb + h * stride_mh + row.to(tl.int64) * stride_mq
    cols_row = COLS + b * stride_cb + h * stride_ch + row.to(tl.int64) * stride_cq
    count = 0
    for start in range(0, row + 1, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        kept = (tl.load(mask_row + offs * stride_mk, mask=offs <= row, other=0) != 0).to(tl.int32)
        slot = count + tl.cumsum(kept, 0) - 1
        tl.store(cols_row + slot * stride_cc, offs.to(tl.int32), mask=kept != 0)
        count += tl.sum(kept, 0)
    tl.store(COUNTS + b * stride_nb + h * stride_nh + row * stride_nq, count)
