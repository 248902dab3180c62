"""Triton kernel: causal block-sparse prefill attention over per-row key-block lists.

One program computes ``BLOCK_M`` query rows of one query head.  Its query block's key-block
list (``COLS``, ascending, ``COUNTS`` entries) is walked with a FlashAttention-2 online
softmax in base 2.  Because the list is ascending and causal, only its last entry can be the
diagonal block: every earlier block is walked without any mask, and the diagonal block alone
gets the causal and length mask.  The readable reference is
``art_analysis.flexprefill.sparse_attention``.

Addressing is int64 (batch, head and token offsets are widened before multiplying by strides);
plain pointer arithmetic, no block pointers, so the same code runs in the CPU interpreter.
"""
import triton
import triton.language as tl


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_base, v_base, key_start, offs_m, seqlen, qk_scale,
                 stride_kn, stride_kd, stride_vn, stride_vd,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over keys ``[key_start, key_start + BLOCK_N)``; returns (acc, m, l)."""
    offs_n = key_start + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    if MASKED:
        in_range = offs_n[:, None] < seqlen
        k = tl.load(k_ptrs, mask=in_range, other=0.0)
        v = tl.load(v_ptrs, mask=in_range, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    qk = tl.dot(q, tl.trans(k))
    if MASKED:
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < seqlen)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_ref = m_new
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def block_sparse_attention_kernel(
        Q, K, V, O, LSE, COLS, COUNTS,
        qk_scale, seqlen, num_q_heads, group,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_on, stride_od,
        stride_lb, stride_lh, stride_ln,
        stride_cb, stride_ch, stride_cq, stride_cc,
        stride_nb, stride_nh, stride_nq,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        RETURN_LSE: tl.constexpr):
    """Grid ``(ceil(N / BLOCK_M), B * Hq)``; the last query rows (the longest lists) start first.

    Q, O: ``[B, Hq, N, D]``; K, V: ``[B, Hkv, N, D]``; LSE: ``[B, Hq, N]`` float32 (natural log);
    COLS: ``[B, Hq, nb, >= max count]`` int32 ascending key blocks; COUNTS: ``[B, Hq, nb]`` int32.
    ``qk_scale`` = softmax scale * log2(e).  BLOCK_M and BLOCK_N divide BLOCK_SIZE.
    """
    SUB_TILES: tl.constexpr = BLOCK_SIZE // BLOCK_N
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
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
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, key_start, offs_m, seqlen, qk_scale,
                                     stride_kn, stride_kd, stride_vn, stride_vd, HEAD_DIM, BLOCK_N, False)
    if has_diagonal:
        diagonal_steps = ((pid_m + 1) * BLOCK_M - 1 - q_block * BLOCK_SIZE) // BLOCK_N + 1
        for sub in range(0, diagonal_steps):
            key_start = q_block.to(tl.int64) * BLOCK_SIZE + sub * BLOCK_N
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_base, v_base, key_start, offs_m, seqlen, qk_scale,
                                         stride_kn, stride_kd, stride_vn, stride_vd, HEAD_DIM, BLOCK_N, True)

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        lse = tl.where(nonempty, (m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(LSE + b * stride_lb + h * stride_lh + offs_m * stride_ln, lse, mask=row_ok)
