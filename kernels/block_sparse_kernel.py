"""Triton kernel: causal block-sparse prefill attention over per-row key-block lists.

One program computes ``BLOCK_M`` query rows of one query head.  Its query block's key-block
list (``COLS``, ascending, ``COUNTS`` entries) is walked with a FlashAttention-2 online
softmax in base 2.  Because the list is ascending and causal, only its last entry can be the
diagonal block: every earlier block is walked without any mask, and the diagonal block alone
gets the causal and length mask.  The readable reference is
``art_analysis.flexprefill.sparse_attention``.

Addressing: batch, head and tile bases are int64 (widened before multiplying by strides); inside a
``[BLOCK_N, D]`` tile the element offsets are int32 and loop-invariant, so the loop does one
64-bit multiply per tile rather than one per element.  Plain pointer arithmetic, no block
pointers, so the same code runs in the CPU interpreter.  :func:`column_table_kernel` builds
the per-row key-block lists from a block mask on the device.
"""
import triton
import triton.language as tl


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_base, v_base, key_start, k_offs, v_offs, offs_m, seqlen, qk_scale,
                 stride_kn, stride_vn, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over keys ``[key_start, key_start + BLOCK_N)``; returns (acc, m, l).

    ``key_start`` is int64; ``k_offs``, ``v_offs`` ``[BLOCK_N, D]`` are the loop-invariant int32
    element offsets inside a tile."""
    k_ptrs = k_base + key_start * stride_kn + k_offs
    v_ptrs = v_base + key_start * stride_vn + v_offs
    if MASKED:
        offs_n = key_start + tl.arange(0, BLOCK_N)
        in_range = offs_n[:, None] < seqlen
        k = tl.load(k_ptrs, mask=in_range, other=0.0)
        v = tl.load(v_ptrs, mask=in_range, other=0.0)
        qk = tl.dot(q, tl.trans(k))
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < seqlen)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_ref = m_new
    p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def block_sparse_attention_kernel(
        Q, K, V, O, LSE, COLS, COUNTS,
        qk_scale, seqlen, num_q_heads, group, num_q_programs,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_on, stride_od,
        stride_lb, stride_lh, stride_ln,
        stride_cb, stride_ch, stride_cq, stride_cc,
        stride_nb, stride_nh, stride_nq,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        RETURN_LSE: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """One program per ``(query tile, b * Hq)``; the last query rows (the longest lists) start first.

    Grid ``(ceil(N / BLOCK_M), B * Hq)``, or with ``HEADS_FIRST`` ``(B * Hq, ceil(N / BLOCK_M))`` so
    that the query heads of one KV head (and all heads) run the same query tile side by side.
    Q, O: ``[B, Hq, N, D]``; K, V: ``[B, Hkv, N, D]``; LSE: ``[B, Hq, N]`` float32 (natural log);
    COLS: ``[B, Hq, nb, >= max count]`` int32 ascending key blocks; COUNTS: ``[B, Hq, nb]`` int32.
    ``qk_scale`` = softmax scale * log2(e).  BLOCK_M and BLOCK_N divide BLOCK_SIZE.
    """
    SUB_TILES: tl.constexpr = BLOCK_SIZE // BLOCK_N
    if HEADS_FIRST:
        pid_m = num_q_programs - 1 - tl.program_id(1)
        pid_bh = tl.program_id(0)
    else:
        pid_m = num_q_programs - 1 - tl.program_id(0)
        pid_bh = tl.program_id(1)
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = (pid_bh % num_q_heads).to(tl.int64)
    kv_h = h // group
    q_block = (pid_m * BLOCK_M) // BLOCK_SIZE

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seqlen
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    cols = COLS + b * stride_cb + h * stride_ch + q_block * stride_cq
    count = tl.load(COUNTS + b * stride_nb + h * stride_nh + q_block * stride_nq)
    last = tl.load(cols + (count - 1) * stride_cc, mask=count > 0, other=-1)
    has_diagonal = last == q_block
    unmasked_steps = (count - has_diagonal.to(tl.int32)) * SUB_TILES

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for step in range(0, unmasked_steps):
        col = tl.load(cols + (step // SUB_TILES) * stride_cc).to(tl.int64)
        key_start = col * BLOCK_SIZE + (step % SUB_TILES) * BLOCK_N
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, key_start, k_offs, v_offs, offs_m, seqlen,
                                     qk_scale, stride_kn, stride_vn, BLOCK_N, False)
    if has_diagonal:
        diagonal_steps = ((pid_m + 1) * BLOCK_M - 1 - q_block * BLOCK_SIZE) // BLOCK_N + 1
        for sub in range(0, diagonal_steps):
            key_start = q_block.to(tl.int64) * BLOCK_SIZE + sub * BLOCK_N
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, key_start, k_offs, v_offs, offs_m, seqlen,
                                         qk_scale, stride_kn, stride_vn, BLOCK_N, True)

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        lse = tl.where(nonempty, (m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(LSE + b * stride_lb + h * stride_lh + offs_m * stride_ln, lse, mask=row_ok)


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
